/* SPDX-License-Identifier: Apache-2.0 */
/* The service directory: services, shards and replicas from a cluster file
 * or etcd, replica choice by locality and load, and quarantine.
 *
 * One mutex guards a directory. Channels call in with their own lock held
 * (lock order: channel, then directory); the directory never calls out
 * except to its logger. Nodes (addresses) are kept for the directory's
 * life, whether or not a shard lists them now, so that a channel may hold
 * a node's handle and a node's health survives a re-registration. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "common/cfg.h"
#include "bex/sock.h"
#include "common/log.h"
#include "common/util.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"
#include "rpc/dir_impl.h"

__attribute__((format(printf, 3, 4))) void bex__dir_set_err(char *err, size_t errlen,
                                                            const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ---- API ---- */

int bex_dir_create(const bex_dir_config *cfg, bex_dir **out)
{
    static const bex_dir_config none;
    bex_dir_config c;
    BEX__CFG_TAKE(cfg, c);
    if (!out)
        return -EINVAL;
    if (!cfg)
        cfg = &none;
    if (cfg->conn_fail_max > 100000 || cfg->req_fail_max > 100000)
        return -EINVAL;
    bex_dir *d = calloc(1, sizeof(*d));
    if (!d)
        return -ENOMEM;
    d->conn_max = cfg->conn_fail_max ? cfg->conn_fail_max : 30;
    d->req_max = cfg->req_fail_max ? cfg->req_fail_max : 50;
    d->window_ns = (cfg->fail_window_ms ? cfg->fail_window_ms : 300000) * 1000000ull;
    d->quarantine_ns = (cfg->quarantine_ms ? cfg->quarantine_ms : 60000) * 1000000ull;
    d->probe_ns = (cfg->probe_timeout_ms ? cfg->probe_timeout_ms : 10000) * 1000000ull;
    d->max_nodes = cfg->max_nodes ? cfg->max_nodes : 65536;
    while (!d->rng)
        if (getrandom(&d->rng, sizeof d->rng, 0) != sizeof d->rng)
            d->rng = bex__rpc_now_ns() ^ (uint64_t)(uintptr_t)d;
    pthread_mutex_init(&d->mu, NULL);
    bex__log_init(&d->log, cfg->log_fn, cfg->log_arg, cfg->log_level);
    *out = d;
    return 0;
}

void bex_dir_destroy(bex_dir *d)
{
    if (!d)
        return;
    if (d->watch)
        d->watch_stop(d->watch);
    bex__dir_services_free(d->services);
    while (d->nodes) {
        struct bex__dir_node *n = d->nodes->next;
        bex__dir_node_free(d->nodes);
        d->nodes = n;
    }
    bex__log_fini(&d->log);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

int bex__dir_source_claim(bex_dir *d)
{
    pthread_mutex_lock(&d->mu);
    bool busy = d->etcd;
    d->etcd = true;
    pthread_mutex_unlock(&d->mu);
    return busy ? -EBUSY : 0;
}

void bex__dir_source_set(bex_dir *d, void *src, void (*stop)(void *src))
{
    pthread_mutex_lock(&d->mu);
    if (!src)
        d->etcd = false;
    d->watch = src;
    d->watch_stop = stop;
    pthread_mutex_unlock(&d->mu);
}

uint64_t bex_dir_generation(bex_dir *d)
{
    pthread_mutex_lock(&d->mu);
    uint64_t g = d->generation;
    pthread_mutex_unlock(&d->mu);
    return g;
}

size_t bex_dir_replicas(bex_dir *d, const char *service, uint32_t shard, bex_dir_replica *out,
                        size_t cap)
{
    if (!d || !service)
        return 0;
    pthread_mutex_lock(&d->mu);
    struct shard *sh = bex__dir_shard_find(d, service, shard);
    size_t n = sh ? sh->n : 0;
    for (size_t i = 0; i < n && i < cap; i++)
        out[i] = sh->reps[i]->r;
    pthread_mutex_unlock(&d->mu);
    return n;
}

struct avoid_addr {
    const bex_addr *a;
};

static bool avoid_by_addr(void *arg, const struct bex__dir_node *n)
{
    const struct avoid_addr *aa = arg;
    return aa->a && bex__dir_same_addr(aa->a, &n->r.addr);
}

int bex_dir_pick(bex_dir *d, const char *service, uint32_t shard, const char *locality,
                 const bex_addr *avoid, bex_dir_replica *out)
{
    if (!d || !service || !out)
        return -EINVAL;
    struct avoid_addr aa = {avoid};
    struct bex__dir_node *n;
    int rc =
        bex__dir_pick_node(d, service, shard, locality, avoid_by_addr, &aa, bex__rpc_now_ns(), &n);
    if (!rc) {
        pthread_mutex_lock(&d->mu);
        *out = n->r;
        pthread_mutex_unlock(&d->mu);
    }
    return rc;
}

void bex_dir_report(bex_dir *d, const bex_addr *addr, int outcome, int done)
{
    if (!d || !addr)
        return;
    pthread_mutex_lock(&d->mu);
    struct bex__dir_node *n = bex__dir_node_lookup(d, addr);
    pthread_mutex_unlock(&d->mu);
    if (n) /* nodes are never freed before d */
        bex__dir_report_node(d, n, outcome, done != 0, bex__rpc_now_ns());
}

/* The directory's nodes' stats, for bex__prom_counters (the cursor is the
 * node). */
static const void *node_next(void *arg, const void **cur, char *labels, size_t cap)
{
    const bex_dir *d = arg;
    const struct bex__dir_node *n = *cur ? ((const struct bex__dir_node *)*cur)->next : d->nodes;
    if (!n)
        return NULL;
    *cur = n;
    snprintf(labels, cap, "node=\"%s\"", n->name);
    return &n->st;
}

static const struct bex__prom_ctr node_ctrs[] = {
    {"bex_dir_node_picks_total", "Times the node was chosen", offsetof(bex_dir_node_stats, picks)},
    {"bex_dir_node_ok_total", "Answers from the node", offsetof(bex_dir_node_stats, ok)},
    {"bex_dir_node_conn_failures_total", "Connection failures to the node",
     offsetof(bex_dir_node_stats, conn_failures)},
    {"bex_dir_node_req_failures_total", "Request failures to the node",
     offsetof(bex_dir_node_stats, req_failures)},
    {"bex_dir_node_quarantines_total", "Times the node was quarantined",
     offsetof(bex_dir_node_stats, quarantines)},
    {"bex_dir_node_quarantine_refused_total",
     "Quarantines refused: the node was a shard's last healthy replica",
     offsetof(bex_dir_node_stats, quarantine_refused)},
    {"bex_dir_node_probes_total", "Probe calls given to the node",
     offsetof(bex_dir_node_stats, probes)},
    {"bex_dir_node_probe_failures_total", "Probes that failed",
     offsetof(bex_dir_node_stats, probe_failures)},
    {"bex_dir_node_lifts_total", "Quarantines lifted by a good probe",
     offsetof(bex_dir_node_stats, lifts)},
    {"bex_dir_node_early_probes_total",
     "Quarantines cut short for a probe: a shard's last healthy replica failed",
     offsetof(bex_dir_node_stats, early_probes)},
};

int bex_dir_prometheus(bex_dir *d, char *buf, size_t cap)
{
    if (!d || (!buf && cap))
        return -EINVAL;
    if (cap)
        buf[0] = 0;
    struct bex__prom o = {buf, cap, 0};
    pthread_mutex_lock(&d->mu);
    bex__prom_counters(&o, node_ctrs, ARRAY_SIZE(node_ctrs), node_next, d);
    bex__prom_printf(&o, "# HELP bex_dir_node_state 0 healthy, 1 quarantined, 2 probing.\n"
                         "# TYPE bex_dir_node_state gauge\n");
    for (const struct bex__dir_node *n = d->nodes; n; n = n->next)
        bex__prom_printf(&o, "bex_dir_node_state{node=\"%s\"} %d\n", n->name, n->state);
    bex__prom_printf(&o, "# HELP bex_dir_node_outstanding Calls picked and not reported done.\n"
                         "# TYPE bex_dir_node_outstanding gauge\n");
    for (const struct bex__dir_node *n = d->nodes; n; n = n->next)
        bex__prom_printf(&o, "bex_dir_node_outstanding{node=\"%s\"} %u\n", n->name,
                         n->st.outstanding);
    pthread_mutex_unlock(&d->mu);
    return o.n > INT32_MAX ? INT32_MAX : (int)o.n;
}

int bex_dir_node_stats_get(bex_dir *d, const bex_addr *addr, bex_dir_node_stats *out)
{
    if (!d || !addr || !out)
        return -EINVAL;
    pthread_mutex_lock(&d->mu);
    struct bex__dir_node *n = bex__dir_node_lookup(d, addr);
    if (n) {
        /* no tick here: a state changes when a pick or report sees time pass */
        *out = n->st;
        out->state = n->state;
    }
    pthread_mutex_unlock(&d->mu);
    return n ? 0 : -ENOENT;
}
