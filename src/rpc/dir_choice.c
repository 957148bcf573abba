/* SPDX-License-Identifier: Apache-2.0 */
/* The service directory: the choice of a replica by locality, load and
 * health (bex__dir_pick). */
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

#include "bex/sock.h"
#include "common/log.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"
#include "rpc/dir_impl.h"

/* ---- choice ---- */

static uint64_t rnd(bex_dir *d)
{
    /* xorshift64* */
    uint64_t x = d->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    d->rng = x;
    return x * 0x2545F4914F6CDD1Dull;
}

enum { TIER_PROBE, TIER_HEALTHY, TIER_AVOIDED, TIER_LAST, TIER_NONE };

int bex__dir_pick_node(bex_dir *d, const char *service, uint32_t shard, const char *locality,
                       bex__dir_avoid_fn avoid, void *arg, uint64_t now, struct bex__dir_node **out)
{
    struct pending pl = {0};
    pthread_mutex_lock(&d->mu);
    struct shard *sh = service ? bex__dir_shard_find(d, service, shard) : NULL;
    if (!sh || sh->n == 0) {
        pthread_mutex_unlock(&d->mu);
        return -ENOENT;
    }
    /* best: lowest tier, then nearest, then least outstanding, then one
     * of the equals at random (reservoir sampling: each with 1/k) */
    struct bex__dir_node *best = NULL;
    int best_tier = TIER_NONE;
    unsigned best_close = 0;
    uint64_t ties = 0;
    for (size_t i = 0; i < sh->n; i++) {
        struct bex__dir_node *n = sh->reps[i];
        bex__dir_node_tick(n, now);
        bool av = avoid && avoid(arg, n);
        int tier;
        if (n->state == BEX_DIR_PROBING && !n->probe_out)
            tier = av ? TIER_LAST : TIER_PROBE; /* the probe goes first */
        else if (n->state == BEX_DIR_HEALTHY)
            tier = av ? TIER_AVOIDED : TIER_HEALTHY;
        else
            tier = TIER_LAST; /* quarantined, or its probe out: only when nothing else */
        unsigned close = bex__dir_closeness(locality, n->r.locality);
        bool better = !best || tier < best_tier;
        if (!better && tier == best_tier) {
            if (tier == TIER_LAST)
                better = n->until < best->until;
            else if (close != best_close)
                better = close > best_close;
            else if (n->st.outstanding != best->st.outstanding)
                better = n->st.outstanding < best->st.outstanding;
            else
                better = rnd(d) % ++ties == 0;
        }
        if (better && (!best || tier != best_tier || close != best_close ||
                       n->st.outstanding != best->st.outstanding))
            ties = 1; /* a new best: the equals count restarts */
        if (better) {
            best = n;
            best_tier = tier;
            best_close = close;
        }
    }
    if (best->state == BEX_DIR_PROBING && !best->probe_out) {
        best->probe_out = true;
        best->until = now + d->probe_ns;
        best->st.probes++;
        if (!best->early) /* an early one was logged when released */
            bex__dir_defer(&pl, BEX_LOG_INFO, "dir: probing quarantined node %s", best->name);
    }
    best->st.picks++;
    best->st.outstanding++;
    *out = best;
    pthread_mutex_unlock(&d->mu);
    bex__dir_flush(d, &pl);
    return 0;
}

void bex__dir_node_info(bex_dir *d, const struct bex__dir_node *n, bex_dir_replica *out)
{
    pthread_mutex_lock(&d->mu); /* a load may update the replica's data */
    *out = n->r;
    pthread_mutex_unlock(&d->mu);
}

bool bex__dir_in_shard(bex_dir *d, const char *service, uint32_t shard,
                       const struct bex__dir_node *n)
{
    pthread_mutex_lock(&d->mu);
    struct shard *sh = bex__dir_shard_find(d, service, shard);
    bool in = sh && bex__dir_shard_has(sh, n);
    pthread_mutex_unlock(&d->mu);
    return in;
}

struct bex__dir_node *bex__dir_node_find(bex_dir *d, const bex_addr *addr)
{
    pthread_mutex_lock(&d->mu);
    struct bex__dir_node *n = bex__dir_node_lookup(d, addr);
    pthread_mutex_unlock(&d->mu);
    return n;
}

struct bex__log *bex__dir_log(bex_dir *d)
{
    return &d->log;
}
