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
    char name[32]; /* "a.b.c.d:port", for the log */
    int state;
    uint64_t until;         /* QUARANTINED: till then; PROBING: the probe's expiry */
    bool probe_out;         /* PROBING: a probe call is out */
    bool refused_logged;    /* a refused quarantine was logged (reset by a lift) */
    bool early;             /* PROBING before its period ended (see release_early) */
    bool early_logged;      /* an early probe was logged (reset by a lift) */
    bool early_fail_logged; /* an early probe's failure was logged (reset by a lift) */
    struct fail_ring conn, req;
    bex_dir_node_stats st;
    struct bex__dir_node *next;
};

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
    struct bex__etcd_watch *watch;
    bool etcd;
};

#endif
