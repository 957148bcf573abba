/* SPDX-License-Identifier: Apache-2.0 */
/* The service directory's private header: its nodes, shards and services,
 * shared by the files of the directory (dir.c, dir_addr.c, dir_node.c,
 * dir_contents.c, dir_file.c, quarantine.c, dir_choice.c). */
#ifndef BEX_RPC_DIR_IMPL_H
#define BEX_RPC_DIR_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "bex/dir.h"
#include "common/log.h"
#include "rpc/dir_internal.h"

/* The timestamps (ns) of a node's last max + 1 failures of one kind: more
 * than max within the window is when the oldest of them is in it. */
struct fail_ring {
    uint64_t *t;
    uint32_t cap, n, head; /* cap = max + 1 */
};

struct bex__dir_node {
    bex_dir_replica r;
    char name[BEX_ADDR_STRLEN]; /* "a.b.c.d:port" or "[v6]:port", for the log */
    int state;
    uint64_t until;  /* QUARANTINED: till then; PROBING: the probe's expiry */
    bool probe_out;  /* PROBING: a probe call is out */
    bool early;      /* PROBING before its period ended (see release_early) */
    uint32_t logged; /* DIR_LOGGED_* lines logged once (reset by a lift) */
    struct fail_ring conn, req;
    bex_dir_node_stats st;
    struct bex__dir_node *next;
};

/* Lines logged once per node until a lift (bex__log_first): a refused
 * quarantine, an early probe, an early probe's failure. */
enum { DIR_LOGGED_REFUSED = 1, DIR_LOGGED_EARLY = 2, DIR_LOGGED_EARLY_FAIL = 4 };

struct shard {
    struct bex__dir_node **reps;
    size_t n;
};

struct service {
    char *name;
    struct shard *shards;
    uint32_t n_shards;
    struct service *next;
};

struct bex_dir {
    pthread_mutex_t mu;
    struct bex__log log;
    uint32_t conn_max, req_max, max_nodes;
    uint64_t window_ns, quarantine_ns, probe_ns;
    struct bex__dir_node *nodes;
    size_t n_nodes;
    struct service *services;
    uint64_t generation;
    uint64_t rng; /* ties among equal replicas: not security */
    void *watch;  /* the source (etcd's watch), stopped by watch_stop */
    void (*watch_stop)(void *watch);
    bool etcd;
};

/* Lines to log once d->mu is released: the log hook may call back into
 * the directory. A report logs a few at most (a refused quarantine and the
 * early probes it releases); defer says whether the line was kept, so that
 * a "logged once" flag is set only for a line that was. */
struct pending {
    int n;
    struct {
        int level;
        char text[256];
    } l[4];
};

struct bex__dir_node *bex__dir_node_lookup(bex_dir *d, const bex_addr *addr);
struct shard *bex__dir_shard_find(bex_dir *d, const char *service, uint32_t shard);
__attribute__((format(printf, 3, 4))) bool bex__dir_defer(struct pending *p, int level,
                                                          const char *fmt, ...);
void bex__dir_flush(bex_dir *d, const struct pending *p);
bool bex__dir_shard_has(const struct shard *sh, const struct bex__dir_node *n);
void bex__dir_node_tick(struct bex__dir_node *n, uint64_t now);

bool bex__dir_ring_add(struct fail_ring *r, uint64_t now, uint64_t window);

__attribute__((format(printf, 3, 4))) void bex__dir_set_err(char *err, size_t errlen,
                                                            const char *fmt, ...);
bool bex__dir_same_addr(const bex_addr *a, const bex_addr *b);

void bex__dir_services_free(struct service *s);
int bex__dir_node_get(bex_dir *d, const bex_dir_replica *r, struct bex__dir_node **out);

void bex__dir_node_free(struct bex__dir_node *n);

#endif
