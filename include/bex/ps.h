/* SPDX-License-Identifier: Apache-2.0 */
/* bex parameter server (issue 10; paper §2.1, §8): sharded embedding tables
 * served over bex RPC.
 *
 * A table is a map from uint64 keys to rows of dim float32 values; a key
 * belongs to shard bex_ps_key_shard(key, n_shards). A row is created on its
 * first touch (Fetch or Push) with bex_ps_init_value, a hash of (table,
 * key, column), so every replica of a shard creates the same row. Push
 * applies gradients with the table's optimizer (SGD or Adagrad).
 *
 * Server side: a shard (bex_ps_shard) holds one shard of every table;
 * bex_ps_shard_register puts its Fetch and Push on an RPC server (Push as
 * BEX_RPC_METHOD_WRITE: a retried Push is applied once, within the
 * server's dedup window). bex_ps_shard_snapshot writes it to a file;
 * bex_ps_shard_create loads that file when it exists. Wire and snapshot
 * formats: docs/protocol.md ("Parameter server").
 *
 * Client side: a bex_ps_client fetches and pushes over a directory (one RPC
 * channel per shard); a request's keys are split by shard and the
 * sub-requests go out in parallel; the request completes once, when every
 * sub-request has answered or failed (each within the request's deadline).
 *
 * Replicas: the directory may list several replicas of a shard (at
 * different locality labels). Two ways to keep them equal:
 * - client fan-out (BEX_PS_PUSH_ALL, the default, shards with
 *   BEX_PS_ROLE_ANY): described below. Concurrent Pushers reach the
 *   replicas in different orders, so Adagrad replicas diverge.
 * - primary-backup (BEX_PS_PUSH_PRIMARY, shards with BEX_PS_ROLE_PRIMARY
 *   and BEX_PS_ROLE_BACKUP): a Push goes to the shard's primary alone (the
 *   first replica the directory lists); the primary orders the Pushes
 *   (under its lock), applies each, forwards it with its id to every
 *   backup (BEX_PS_M_FORWARD, numbered), and answers the client only once
 *   every backup applied it; backups apply the forwards in the primary's
 *   order and refuse client Pushes (-EPERM). Replicas are equal bit for bit
 *   whatever the optimizer. A backup that fails a forward is marked down
 *   and the primary refuses Pushes (-EHOSTDOWN) until it rejoins (it holds
 *   every Push again: probed): with a static cluster file there is no
 *   failover and no acknowledgement without every backup
 *   (docs/architecture.md, "Replication").
 * With client fan-out: A Fetch goes to one of them, the nearest
 * healthy one the directory picks, and fails over to another when it fails
 * or does not answer. A Push goes to every replica the directory lists for
 * each of its shards, each on a channel of that replica alone: a retry
 * after a lost answer goes to the same server with the same sequence, and
 * its dedup window applies the Push once. A Push succeeds when every
 * replica acknowledged; bex_ps_push_report says which did not. Each Push
 * also carries an id (the client's random id and 128-bit random token,
 * and a sequence) that every replica records, in its snapshot too: a
 * replica applies an id once, refuses one more than 1024 behind the
 * client's highest (-ESTALE), and a peer that does not hold the token
 * cannot touch the client's record (docs/security.md, "Dedup keys and Push ids").
 *
 * Threads: every function may be called from any thread. */
#ifndef BEX_PS_H
#define BEX_PS_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/common.h"
#include "bex/dir.h"
#include "bex/rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

#pragma GCC visibility push(default)

/* RPC service and methods of a PS server. BEX_PS_M_COPY and
 * BEX_PS_M_FORWARD are reserved: a restarted replica's catch-up copy of its
 * peer (docs/protocol.md, "Catch-up") and a primary's forward of a Push to
 * its backups ("Forward"), not for applications. */
#define BEX_PS_SERVICE 0x5053u /* "PS" */
enum { BEX_PS_M_FETCH = 1, BEX_PS_M_PUSH = 2, BEX_PS_M_COPY = 3, BEX_PS_M_FORWARD = 4 };

/* Bounds of the wire format (a body past them is refused, -E2BIG). */
#define BEX_PS_DIM_MAX    4096u       /* floats in a row */
#define BEX_PS_KEYS_MAX   65536u      /* keys in one Fetch or Push */
#define BEX_PS_BODY_MAX   (64u << 20) /* bytes of one body */
#define BEX_PS_TABLES_MAX 64u

enum { BEX_PS_SGD = 1, BEX_PS_ADAGRAD = 2 };

/* One table; zero in a float field means its default. */
/* clang-format off */
#define BEX_PS_TABLE_CONFIG_INIT {.size = sizeof(bex_ps_table_config)}
/* clang-format on */
typedef struct bex_ps_table_config {
    size_t size;        /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    uint32_t id;        /* any value, unique in the shard */
    uint32_t dim;       /* 1..BEX_PS_DIM_MAX */
    uint32_t optimizer; /* BEX_PS_SGD or BEX_PS_ADAGRAD */
    float lr;           /* learning rate (0.01) */
    float init_scale;   /* initial values uniform in [-s, s) (0.01) */
    float adagrad_init; /* Adagrad: accumulators start at this (0.1) */
    float adagrad_eps;  /* Adagrad: added to the root (1e-8) */
    uint32_t max_rows;  /* rows of this table in a shard (1 << 20,
                           at most 1 << 30); a request that would create more fails -ENOSPC */
} bex_ps_table_config;

/* The initial value of (table, key, column) for init_scale s: splitmix64
 * of the three, mapped to [-s, s) (docs/protocol.md has the formula). */
float bex_ps_init_value(uint32_t table, uint64_t key, uint32_t col, float s);

/* The shard of key among n_shards (>= 1): a hash of the key, so that
 * consecutive keys spread. */
uint32_t bex_ps_key_shard(uint64_t key, uint32_t n_shards);

/* ---- server ---- */

typedef struct bex_ps_shard bex_ps_shard;

/* clang-format off */
#define BEX_PS_SHARD_CONFIG_INIT {.size = sizeof(bex_ps_shard_config)}
/* clang-format on */
typedef struct bex_ps_shard_config {
    size_t size;              /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    uint32_t shard, n_shards; /* which shard this is (shard < n_shards) */
    const bex_ps_table_config *tables;
    size_t n_tables; /* 1..BEX_PS_TABLES_MAX */
    /* A snapshot to load when the file exists (NULL: none). Its shard,
     * shard count and tables must match; a corrupt file is an error, not
     * an empty start. */
    const char *snapshot_path;
    bex_log_fn log_fn; /* NULL: stderr */
    void *log_arg;
    uint32_t flags; /* BEX_PS_SHARD_* */
    /* BEX_PS_SHARD_CATCHUP: bytes of Pushes held until the catch-up ends
     * (256 MiB); a Push past it is answered -EAGAIN */
    uint64_t catchup_log_max;
    /* The ids of the Pushes applied (docs/security.md, "Dedup keys and Push ids"): clients
     * held (4096, at most 1 << 20); a client is forgotten only when the
     * table is full and it was last seen longer than retry_horizon_ms ago
     * (300000: longer than any client's retries); a new client past the
     * bounds below, or when the table is full of younger ones, is refused
     * -EAGAIN (retriable), never by evicting another. */
    uint32_t dedup_clients;
    uint32_t retry_horizon_ms;
    uint32_t new_clients_per_sec;  /* new client ids a second, this shard (1000) */
    uint32_t new_clients_per_conn; /* new client ids one RPC connection may bring (64) */
    /* Primary-backup replication (docs/architecture.md, "Replication"):
     * role BEX_PS_ROLE_* (0: ANY, client fan-out). A primary forwards each
     * Push to backups[0..n_backups) (at most BEX_PS_REPLICAS_MAX - 1;
     * copied) and answers once each applied it; a forward not applied
     * within forward_timeout_ms (5000, retries included) marks its backup
     * down. A backup holds forwards that arrive ahead of their turn, at
     * most forward_window of them (1024, at most 65536) and
     * forward_hold_max bytes (64 MiB); past either one is refused -EAGAIN
     * (the primary's channel retries it). A backup marked down is probed
     * at most every backup_retry_ms (1000) while Pushes come: it rejoins
     * when it holds every Push the primary applied (it never missed one,
     * or it caught up from a replica that has them). */
    uint32_t role;
    const bex_rpc_endpoint *backups;
    size_t n_backups;
    uint32_t forward_timeout_ms;
    uint32_t forward_window;
    uint64_t forward_hold_max;
    uint32_t backup_retry_ms;
} bex_ps_shard_config;

enum {
    BEX_PS_ROLE_ANY = 0,     /* takes client Pushes, forwards nothing (client fan-out) */
    BEX_PS_ROLE_PRIMARY = 1, /* takes client Pushes, forwards them to its backups */
    BEX_PS_ROLE_BACKUP = 2,  /* refuses client Pushes (-EPERM), applies forwards in order */
};

/* The shard starts catching up: Pushes are checked, answered and held in
 * a log (not applied), Fetches are answered -EAGAIN (retryable: the
 * client fails over to another replica), and COPY is refused, until
 * bex_ps_shard_catchup returns. */
#define BEX_PS_SHARD_CATCHUP (1u << 0)
/* (A backup that catches up takes its copy's replication position, and its
 * primary lets it rejoin: docs/architecture.md, "Replication".) */

/* Returns 0, -EINVAL (config; a snapshot not matching it or corrupt),
 * -ENOMEM, or the snapshot's read error (-EACCES, -EIO, ...). */
int bex_ps_shard_create(const bex_ps_shard_config *cfg, bex_ps_shard **out);
/* Free it; its server must be destroyed first. */
void bex_ps_shard_destroy(bex_ps_shard *s);

/* Register Fetch, Push (WRITE), Copy and Forward for BEX_PS_SERVICE on
 * srv, whose context is ctx (answers are allocated from it; a primary's
 * channels to its backups are made on it here). Before
 * bex_rpc_server_listen. */
int bex_ps_shard_register(bex_ps_shard *s, bex_rpc_server *srv, bex_ctx *ctx);

/* Serve one request body of method BEX_PS_M_*: what the registered
 * handlers do, for applications that wrap them. On 0, *resp / *resp_len
 * get the answer (from bex_rpc_alloc(ctx)). Errors: -EINVAL (malformed
 * body, unknown table, wrong dim, a key of another shard, a gradient not
 * finite), -E2BIG (past a
 * bound), -ENOSPC (table full), -ENOMEM, -ENOSYS (method); a Push with an
 * id: -ESTALE (more than 1024 ids behind its client's highest: applied or
 * not, the shard cannot tell; counted stale_ids), -EAGAIN (a new client
 * refused: the dedup table is full of live clients or new ones come too
 * fast; retriable, counted clients_refused). A failed Push changes
 * nothing. Through this function no connection is known: only the
 * per-second bound on new clients applies, not the per-connection one.
 * A backup refuses Push (-EPERM); a primary's Push and a Forward need the
 * registered handlers (answered once the backups applied it, or in turn):
 * through this function they are refused -EOPNOTSUPP. */
int bex_ps_shard_serve(bex_ps_shard *s, bex_ctx *ctx, uint32_t method, const void *body, size_t len,
                       void **resp, size_t *resp_len);

/* Write the shard to path (through path.tmp and a rename: a crash leaves
 * the old file). Returns 0 or a negative errno. */
int bex_ps_shard_snapshot(bex_ps_shard *s, const char *path);

/* ---- catch-up of a restarted replica (docs/architecture.md) ---- */

/* clang-format off */
#define BEX_PS_CATCHUP_CONFIG_INIT {.size = sizeof(bex_ps_catchup_config)}
/* clang-format on */
typedef struct bex_ps_catchup_config {
    size_t size; /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    const bex_rpc_endpoint *peers; /* replicas of this shard, tried in order, in rounds */
    size_t n_peers;
    uint32_t timeout_ms;  /* the whole catch-up's deadline, every peer (10000) */
    uint32_t chunk_bytes; /* bytes asked per COPY chunk (1 MiB, at most 16 MiB) */
    uint64_t max_bytes;   /* a copy longer than this is refused (1 GiB) */
} bex_ps_catchup_config;

/* Catch a shard created with BEX_PS_SHARD_CATCHUP (and serving: its RPC
 * server listens) up with a live peer replica, then let it serve. Pulls
 * the peer's rows and the ids of the Pushes it applied, as one consistent
 * cut, in chunks; takes them instead of its own rows; applies the held
 * Pushes the cut does not contain, each once; serves from then on. The
 * peers are tried in rounds until the deadline: one not reachable yet is
 * asked again, one whose copy is bad or behind, or that catches up itself,
 * is not. When no
 * peer gives a copy by the deadline (dead, itself catching up, hostile),
 * it logs why and falls back to its own rows (its snapshot) plus every
 * held Push, and returns the error (-ETIMEDOUT, -ECONNREFUSED, -EAGAIN,
 * -EBADMSG, -E2BIG, ...); the shard serves either way. Blocks: never from
 * a callback of ctx. -EINVAL when the shard is not catching up. */
int bex_ps_shard_catchup(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_catchup_config *cfg);

typedef struct bex_ps_shard_stats {
    uint64_t fetches, pushes, rows_fetched, rows_pushed;
    uint64_t malformed; /* bodies refused */
    uint64_t rows;      /* rows held, every table */
    /* catch-up: rows copied from the peer, held Pushes applied (replayed)
     * and left out (the peer's cut had them), catch-ups that fell back to
     * the snapshot; Pushes held; copies served to a restarted peer; Pushes
     * whose id was applied already (answered, not applied again) */
    uint64_t catchup_rows, catchup_replayed, catchup_skipped, catchup_failed;
    uint64_t held, copies_served, dup_ids;
    /* Pushes refused -ESTALE (an id more than 1024 behind its client's
     * highest); new clients refused -EAGAIN (dedup_clients, rates) */
    uint64_t stale_ids, clients_refused;
    /* primary-backup: forwards sent (one per Push and backup) and failed
     * (their backup marked down), Pushes refused because a backup is down;
     * at a backup: forwards applied, held out of turn, refused, and client
     * Pushes refused (-EPERM); lsn: the last forward numbered (primary) or
     * applied (backup) */
    uint64_t fwd_sent, fwd_failed, backup_down_refused;
    uint64_t fwd_applied, fwd_held, fwd_refused, not_primary;
    uint64_t rejoins; /* a primary's backups back after being marked down */
    uint64_t lsn;
    uint32_t role, backups_down;
} bex_ps_shard_stats;
void bex_ps_shard_stats_get(bex_ps_shard *s, bex_ps_shard_stats *out);

/* For shards[0..n), per table (labels shard and table): Fetches served,
 * Pushes applied, rows fetched and pushed, rows held, and a histogram of
 * the time a request took in the shard (bex_ps_serve_seconds, label
 * method "fetch" or "push"); per shard the bodies refused; in Prometheus
 * text exposition format (metric names bex_ps_*, each family once),
 * NUL-terminated, into buf (cap bytes). Returns the length it needed
 * (without the NUL), like snprintf: output is cut when that is >= cap;
 * -EINVAL, -ENOMEM. The RPC servers' side (requests, dedup, latency from
 * dispatch to answer): bex_rpc_server_prometheus. */
int bex_ps_shard_prometheus(bex_ps_shard *const *shards, size_t n, char *buf, size_t cap);

/* ---- client ---- */

typedef struct bex_ps_client bex_ps_client;

/* clang-format off */
#define BEX_PS_CLIENT_CONFIG_INIT {.size = sizeof(bex_ps_client_config)}
/* clang-format on */
typedef struct bex_ps_client_config {
    size_t size;                 /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    bex_dir *dir;                /* where the shards are; outlives the client */
    const char *service;         /* the directory's service name ("ps") */
    uint32_t n_shards;           /* 0: as many as the directory lists now */
    const char *locality;        /* this client's (NULL: none) */
    uint32_t timeout_ms;         /* a request's deadline (1000) */
    uint32_t attempt_timeout_ms; /* channel's (0: only failures retried) */
    uint32_t connect_timeout_ms; /* channel's (1000) */
    /* The channels' retry policy (bex_rpc_channel_config; 0: its
     * default): attempts per sub-request, the first included (3), and the
     * retry budget's burst (10) and per-call earning (100 per mille). A
     * client that must ride out a replica's death with many sub-requests
     * out on it needs a burst about as large as that number. */
    uint32_t max_attempts;
    uint32_t retry_budget_burst;
    uint32_t retry_budget_permille;
    /* BEX_PS_PUSH_ALL (0): a Push goes to every replica of its shards
     * (client fan-out); BEX_PS_PUSH_PRIMARY: to the primary alone, the
     * first replica the directory lists (primary-backup shards) */
    uint32_t push_mode;
} bex_ps_client_config;

enum { BEX_PS_PUSH_ALL = 0, BEX_PS_PUSH_PRIMARY = 1 };

/* Returns 0, -EINVAL (no shard), -ENOMEM, -EIO (no randomness for the
 * client's Push token: getrandom failed). */
int bex_ps_client_create(bex_ctx *ctx, const bex_ps_client_config *cfg, bex_ps_client **out);
/* Outstanding requests complete with -ECANCELED first. Never from a
 * completion. */
void bex_ps_client_destroy(bex_ps_client *c);

/* The client's channels' counters summed (the Fetch channel of every shard
 * and the Push channel of every replica): sub-requests (RPC calls), how
 * they ended, and the retries behind them (bex_rpc_channel_stats has the
 * meaning of each). */
typedef struct bex_ps_client_stats {
    uint64_t calls, ok, failed;
    uint64_t attempts, retries, retry_throttled, failovers;
    uint64_t conn_failures;
} bex_ps_client_stats;
void bex_ps_client_stats_get(bex_ps_client *c, bex_ps_client_stats *out);

/* A request completed: 0, or the first error of its sub-requests. */
typedef void (*bex_ps_done_fn)(int status, void *user);

/* Fetch the rows of keys[0..n) of table (dim floats each) into
 * rows[i * dim ...]; keys are copied, rows must stay until done runs. On 0
 * done runs exactly once (maybe before this returns: n == 0, or every
 * sub-request failed at once); on error (-EINVAL, -E2BIG: a shard's part
 * past the wire's bounds, -ENOMEM) it does not. */
int bex_ps_fetch(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                 float *rows, bex_ps_done_fn done, void *user);
/* Push grads[i * dim ...] for keys[i]; keys and grads are copied. */
int bex_ps_push(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                const float *grads, bex_ps_done_fn done, void *user);
/* A Push's outcome at one replica of one shard. */
typedef struct bex_ps_replica_result {
    uint32_t shard;
    bex_addr addr; /* the replica (AF_UNSPEC when the shard had none) */
    int status;    /* 0: it applied the Push; else the error that ended its part
                      (its answer, -ETIMEDOUT, -ECONNREFUSED, ...; -EHOSTUNREACH:
                      the shard had no replica): not known to have applied it */
} bex_ps_replica_result;

/* Replicas of one shard a Push goes to, at most (more are left out). */
#define BEX_PS_REPLICAS_MAX 16u

/* bex_ps_push, reporting every replica's outcome (BEX_PS_PUSH_PRIMARY:
 * each shard's primary's, whose 0 means every backup applied it too): on
 * 0, *n_res (may be NULL) gets the number of (shard, replica) parts the
 * Push went out as,
 * shards in order, a shard's replicas in the directory's order, and the
 * first cap of them are written to res[] (shard and addr at once, status
 * before done runs). done's status is 0 when every part succeeded, else
 * the first error. res must stay until done runs. */
int bex_ps_push_report(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                       size_t n, const float *grads, bex_ps_replica_result *res, size_t cap,
                       size_t *n_res, bex_ps_done_fn done, void *user);

/* The same, waiting. Never from a completion of the client's context. */
int bex_ps_fetch_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                      size_t n, float *rows);
int bex_ps_push_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                     const float *grads);
int bex_ps_push_report_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                            size_t n, const float *grads, bex_ps_replica_result *res, size_t cap,
                            size_t *n_res);

/* The client's counters (bex_ps_client_stats) in Prometheus text exposition
 * format (metric names bex_ps_client_*_total, label client="name", NULL:
 * "ps"), NUL-terminated, into buf (cap bytes). Returns the length it needed
 * (without the NUL), like snprintf: output is cut when that is >= cap;
 * -EINVAL. Any thread. */
int bex_ps_client_prometheus(bex_ps_client *c, const char *name, char *buf, size_t cap);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif
