/* SPDX-License-Identifier: Apache-2.0 */
/* bex service directory: where a service's replicas are, and which are
 * healthy (paper §7.2).
 *
 * A service (a name, e.g. "ps") is a set of shards numbered from 0; each
 * shard has replicas, each an address with a locality label: '/'-separated
 * components from the widest failure domain down, e.g. "dc1/pod2" (data
 * center, mini-pod). The directory's contents come from a static cluster
 * file (JSON, bex_dir_load_file; docs/configuration.md has the format) or
 * from etcd v3 (bex_dir_watch_etcd: servers register under a lease with
 * bex_dir_register_etcd and vanish when they die; the directory watches the
 * key prefix and its view follows; docs/protocol.md has the key layout).
 *
 * Replica choice (bex_dir_pick): the nearest healthy replica by locality
 * (same pod before same data center before any other), the least
 * outstanding calls among equally near ones, ties taken in turn.
 *
 * Quarantine: a node (an address) with more than conn_fail_max connection
 * failures or more than req_fail_max request failures within
 * fail_window_ms is excluded for quarantine_ms; then one call probes it
 * (the next pick of a shard it is in takes it), and its answer lifts the
 * quarantine or starts another period. A node is never quarantined when
 * that would leave a shard it serves with no replica outside quarantine;
 * and when that last replica fails (a connection failure, or failures
 * past a threshold), the shard's quarantined replicas are probed at once
 * rather than after their period.
 * Each transition is logged once and counted (bex_dir_node_stats_get).
 *
 * A directory is shared: channels over it (bex_rpc_channel_config.dir) and
 * the application pick from it and report outcomes to it, so health seen by
 * one channel steers the others. It must outlive every channel over it.
 *
 * Threads: every function may be called from any thread. */
#ifndef BEX_DIR_H
#define BEX_DIR_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/addr.h"
#include "bex/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#pragma GCC visibility push(default)

typedef struct bex_dir bex_dir;

/* Longest locality label, service name (bytes, NUL excluded). */
#define BEX_DIR_LOCALITY_MAX 63
#define BEX_DIR_NAME_MAX     63

/* Directory configuration; zero in any field means its default. */
/* clang-format off */
#define BEX_DIR_CONFIG_INIT {.size = sizeof(bex_dir_config)}
/* clang-format on */
typedef struct bex_dir_config {
    size_t size;               /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    uint32_t conn_fail_max;    /* M: more connection failures than this within
                                  the window quarantine a node (30) */
    uint32_t req_fail_max;     /* N: the same for request failures (50) */
    uint32_t fail_window_ms;   /* the window (300000: 5 minutes) */
    uint32_t quarantine_ms;    /* how long a quarantined node is left out
                                  before a probe (60000) */
    uint32_t probe_timeout_ms; /* a probe not reported by then (its call
                                  cancelled, its channel gone) lets another
                                  call probe (10000) */
    uint32_t max_nodes;        /* distinct addresses remembered, health
                                  included (65536); more is -ENOSPC */
    bex_log_fn log_fn;         /* the log hook (NULL: stderr) */
    void *log_arg;
    int log_level; /* BEX_LOG_* (0: BEX_LOG_WARN) */
} bex_dir_config;

/* An empty directory (cfg may be NULL). Returns 0, -EINVAL, -ENOMEM. */
int bex_dir_create(const bex_dir_config *cfg, bex_dir **out);

/* Stop the etcd watch if any, free everything. Channels over d must be
 * destroyed first. */
void bex_dir_destroy(bex_dir *d);

/* Replace the directory's contents with a cluster file's (JSON; the format
 * is in docs/configuration.md, "Cluster file"). Node health is kept for
 * addresses that stay. On error the contents are unchanged and err (errlen
 * bytes, may be NULL) says what and where: -EINVAL (malformed), -ENOENT /
 * -EACCES / -EISDIR (the file), -ENOMEM, -ENOSPC (max_nodes), -EBUSY (d follows
 * etcd). */
int bex_dir_load_file(bex_dir *d, const char *path, char *err, size_t errlen);
/* The same from text in memory. */
int bex_dir_load_json(bex_dir *d, const char *json, char *err, size_t errlen);

/* Follow etcd (url e.g. "http://127.0.0.1:2379", its v3 JSON gateway)
 * under key prefix (NULL: "/bex/"): read what is registered now, then watch
 * for changes from a thread of d's; the contents follow within the watch's
 * latency. Once per directory. A broken watch is logged and re-established
 * (read again, watched again) every second until it holds. Returns 0 once
 * the first read succeeded, or -ECONNREFUSED / -ETIMEDOUT / -EPROTO (etcd's
 * answer), -EBUSY (already), -ENOMEM; err says more. */
int bex_dir_watch_etcd(bex_dir *d, const char *url, const char *prefix, char *err, size_t errlen);

/* Bumped on every change of the contents (tests wait on it). */
uint64_t bex_dir_generation(bex_dir *d);

/* One replica. */
typedef struct bex_dir_replica {
    bex_addr addr;
    char locality[BEX_DIR_LOCALITY_MAX + 1];
    uint32_t transport; /* BEX_TRANSPORT_* (0: the client context's) */
} bex_dir_replica;

/* The replicas of (service, shard) now, up to cap into out. Returns how
 * many there are (may exceed cap), 0 when the service or shard is unknown. */
size_t bex_dir_replicas(bex_dir *d, const char *service, uint32_t shard, bex_dir_replica *out,
                        size_t cap);

/* Choose a replica of (service, shard) for a call from a client at
 * locality (NULL: none; every replica is then equally far), not avoid (may
 * be NULL) when another is usable. Counts the call as outstanding on the
 * node until bex_dir_report (with done set). Returns 0, or -ENOENT (no
 * replica). */
int bex_dir_pick(bex_dir *d, const char *service, uint32_t shard, const char *locality,
                 const bex_addr *avoid, bex_dir_replica *out);

/* Outcomes of calls, for quarantine. */
enum {
    BEX_DIR_OK = 0,        /* the node answered */
    BEX_DIR_CONN_FAIL = 1, /* its connection failed or timed out */
    BEX_DIR_REQ_FAIL = 2,  /* a request to it failed (timed out, refused) */
    BEX_DIR_DONE = 3,      /* neither (e.g. cancelled): only ends the call */
};
/* Report an outcome for addr. done: the call bex_dir_pick counted as
 * outstanding is over. Unknown addresses are ignored. */
void bex_dir_report(bex_dir *d, const bex_addr *addr, int outcome, int done);

enum { BEX_DIR_HEALTHY = 0, BEX_DIR_QUARANTINED = 1, BEX_DIR_PROBING = 2 };

typedef struct bex_dir_node_stats {
    int state;                   /* BEX_DIR_HEALTHY, _QUARANTINED, _PROBING */
    uint64_t picks;              /* times chosen */
    uint32_t outstanding;        /* calls picked and not reported done */
    uint64_t ok;                 /* BEX_DIR_OK reports */
    uint64_t conn_failures;      /* BEX_DIR_CONN_FAIL reports */
    uint64_t req_failures;       /* BEX_DIR_REQ_FAIL reports */
    uint64_t quarantines;        /* times quarantined (probe failures included) */
    uint64_t quarantine_refused; /* times it would have been, but it was the
                                    last replica of a shard outside quarantine */
    uint64_t probes;             /* probe calls given out */
    uint64_t probe_failures;     /* probes that failed (quarantined again) */
    uint64_t lifts;              /* quarantines lifted by a good probe */
    uint64_t early_probes;       /* quarantines cut short for a probe, or a
                                    probe given out beside one still out: the
                                    last replica of a shard outside quarantine
                                    failed */
} bex_dir_node_stats;

/* The counters of the node at addr. Returns 0, or -ENOENT (never seen). */
int bex_dir_node_stats_get(bex_dir *d, const bex_addr *addr, bex_dir_node_stats *out);

/* Every node's counters in Prometheus text exposition format (metric
 * names bex_dir_node_*, label node="a.b.c.d:port" or "[v6]:port"; state and outstanding
 * as gauges), NUL-terminated, into buf (cap bytes). Returns the length it
 * needed (without the NUL), like snprintf: output is cut when that is
 * >= cap. */
int bex_dir_prometheus(bex_dir *d, char *buf, size_t cap);

/* ---- server side: registration in etcd ---- */

typedef struct bex_dir_registration bex_dir_registration;

/* Register self as a replica of (service, shard) in etcd at url under
 * prefix (NULL: "/bex/"), with a lease of ttl_s seconds (0: 10) kept alive
 * by a thread every third of it: the key vanishes within ttl_s of this
 * process dying or of bex_dir_deregister. Returns 0, -EINVAL, -ENOMEM,
 * -ECONNREFUSED / -ETIMEDOUT / -EPROTO (etcd); err says more. */
int bex_dir_register_etcd(const char *url, const char *prefix, const char *service, uint32_t shard,
                          const bex_dir_replica *self, uint32_t ttl_s, char *err, size_t errlen,
                          bex_dir_registration **out);

/* Stop the keepalive and revoke the lease (the key goes at once). NULL is
 * ignored. Returns 0, or etcd's error from the revoke (the lease then
 * expires by itself). */
int bex_dir_deregister(bex_dir_registration *r);

/* Stop the keepalive only, as a crash would (the key goes when the lease
 * expires); frees r. For tests. */
void bex_dir_registration_abandon(bex_dir_registration *r);

/* ---- etcd's connection: TLS and authentication ---- */

/* How every etcd request of the process connects (watches, registrations,
 * leases): an https:// URL is checked against ca_file and presents
 * cert_file/key_file when etcd asks for a client certificate
 * (--client-cert-auth); with etcd's authentication on, requests carry a
 * token, taken from user/password (POST /v3/auth/authenticate, again when
 * etcd answers that the token is invalid or expired) or given as token.
 * Paths are read by libcurl at each request. NULL fields: none. */
/* clang-format off */
#define BEX_ETCD_CONFIG_INIT {.size = sizeof(bex_etcd_config)}
/* clang-format on */
typedef struct bex_etcd_config {
    size_t size;           /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    const char *ca_file;   /* PEM CA bundle for etcd's server certificate (NULL: the system's) */
    const char *cert_file; /* PEM client certificate (NULL: none) */
    const char *key_file;  /* its private key (PEM; required with cert_file) */
    const char *user;      /* etcd user name (NULL: no authentication) */
    const char *password;  /* its password (required with user) */
    const char *token;     /* a token to send as it is (instead of user/password) */
} bex_etcd_config;

/* Set the process's etcd connection settings (copied; cfg NULL: none).
 * Requests already under way keep what they had. Until this is called the
 * environment gives them, read at the first etcd request: BEX_ETCD_CACERT,
 * BEX_ETCD_CERT, BEX_ETCD_KEY, BEX_ETCD_USER ("name:password"),
 * BEX_ETCD_TOKEN. Returns 0, -EINVAL (a bad size, a certificate without
 * its key or the reverse, a user without a password, both user and
 * token), -ENOMEM. Any thread. */
int bex_etcd_configure(const bex_etcd_config *cfg);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif
