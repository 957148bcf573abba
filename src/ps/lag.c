/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: replica lag and the operations metrics (issue 29 item 5;
 * docs/architecture.md, "Replication", "Operations").
 *
 * A primary knows, per backup, the highest lsn it acknowledged (a forward
 * is acknowledged once applied, so every lsn below it is applied too: the
 * backup applies in order) and, for the last LAG_RING lsns, when each was
 * numbered: a backup's lag is the Pushes numbered past its acknowledged
 * lsn, and the age of the oldest of them. A backup knows when it applied
 * its last forward. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "bex/ps.h"
#include "common/prom.h"
#include "ps/shard_internal.h"
#include "rpc/internal.h"

#define LAG_RING 4096u

struct lag {
    _Atomic uint64_t acked[BEX_PS_BACKUPS_MAX]; /* highest lsn acknowledged, per backup */
    uint64_t session;                           /* the primary's session acked counts in */
    uint64_t at[LAG_RING];                      /* lsn % LAG_RING -> numbered at (ns) */
    uint64_t applied_ns;                        /* backup: its last forward applied */
};

int bex__ps_lag_init(bex_ps_shard *s)
{
    s->lag = calloc(1, sizeof *s->lag);
    return s->lag ? 0 : -ENOMEM;
}

void bex__ps_lag_fini(bex_ps_shard *s)
{
    free(s->lag);
    s->lag = NULL;
}

void bex__ps_lag_numbered_locked(bex_ps_shard *s, uint64_t lsn)
{
    struct lag *l = s->lag;
    if (l->session != s->rp.session) {
        /* a new session numbers from 1: what was acked counts no more */
        l->session = s->rp.session;
        for (uint32_t b = 0; b < BEX_PS_BACKUPS_MAX; b++)
            atomic_store_explicit(&l->acked[b], 0, memory_order_relaxed);
    }
    l->at[lsn % LAG_RING] = bex__rpc_now_ns();
}

/* Forwards complete out of order (one per call): the highest counts. */
void bex__ps_lag_acked(bex_ps_shard *s, uint32_t b, uint64_t lsn)
{
    if (b >= BEX_PS_BACKUPS_MAX)
        return;
    _Atomic uint64_t *a = &s->lag->acked[b];
    uint64_t cur = atomic_load_explicit(a, memory_order_relaxed);
    while (cur < lsn && !atomic_compare_exchange_weak_explicit(a, &cur, lsn, memory_order_relaxed,
                                                               memory_order_relaxed))
        ;
}

void bex__ps_lag_applied_locked(bex_ps_shard *s)
{
    s->lag->applied_ns = bex__rpc_now_ns();
}

void bex__ps_lag_stats_locked(const bex_ps_shard *s, bex_ps_shard_stats *out)
{
    const struct lag *l = s->lag;
    uint64_t now = bex__rpc_now_ns(), lsn = s->rp.lsn;
    out->n_backups = 0;
    out->fwd_age_ns = s->rp.role == BEX_PS_ROLE_BACKUP && l->applied_ns ? now - l->applied_ns : 0;
    if (s->rp.role != BEX_PS_ROLE_PRIMARY)
        return;
    for (size_t b = 0; b < s->rp.n_bk && b < BEX_PS_BACKUPS_MAX; b++) {
        uint64_t ack = atomic_load_explicit(&l->acked[b], memory_order_relaxed);
        uint64_t behind = lsn > ack ? lsn - ack : 0;
        /* the oldest not acknowledged, or the oldest still known */
        uint64_t first = behind <= LAG_RING ? ack + 1 : lsn - LAG_RING + 1;
        uint64_t at = behind ? l->at[first % LAG_RING] : now;
        out->lag_pushes[b] = behind;
        out->lag_ns[b] = now > at ? now - at : 0;
        out->n_backups = (uint32_t)b + 1;
    }
}

static double secs(uint64_t ns)
{
    return (double)ns / 1e9;
}

/* Per backup of each primary: its lag in Pushes and in seconds. */
static void lag_prom(struct bex__prom *o, bex_ps_shard *const *shards,
                     const bex_ps_shard_stats *sst, size_t n)
{
    bex__prom_printf(o, "# HELP bex_ps_replica_lag_pushes Pushes a primary numbered that the "
                        "backup has not acknowledged.\n# TYPE bex_ps_replica_lag_pushes gauge\n");
    for (size_t k = 0; k < n; k++)
        for (uint32_t b = 0; b < sst[k].n_backups; b++)
            bex__prom_printf(o, "bex_ps_replica_lag_pushes{shard=\"%u\",backup=\"%u\"} %llu\n",
                             shards[k]->shard, b, (unsigned long long)sst[k].lag_pushes[b]);
    bex__prom_printf(o, "# HELP bex_ps_replica_lag_seconds Age of the oldest Push the backup has "
                        "not acknowledged (0: in step).\n"
                        "# TYPE bex_ps_replica_lag_seconds gauge\n");
    for (size_t k = 0; k < n; k++)
        for (uint32_t b = 0; b < sst[k].n_backups; b++)
            bex__prom_printf(o, "bex_ps_replica_lag_seconds{shard=\"%u\",backup=\"%u\"} %.6f\n",
                             shards[k]->shard, b, secs(sst[k].lag_ns[b]));
    bex__prom_printf(o, "# HELP bex_ps_forward_age_seconds At a backup: time since it applied its "
                        "last forward.\n# TYPE bex_ps_forward_age_seconds gauge\n");
    for (size_t k = 0; k < n; k++)
        if (sst[k].role == BEX_PS_ROLE_BACKUP)
            bex__prom_printf(o, "bex_ps_forward_age_seconds{shard=\"%u\"} %.6f\n", shards[k]->shard,
                             secs(sst[k].fwd_age_ns));
}

/* One gauge or counter family over the shards: value(k) per shard. */
static void family(struct bex__prom *o, bex_ps_shard *const *shards, const bex_ps_shard_stats *sst,
                   size_t n, const char *name, const char *type, const char *help,
                   double (*value)(const bex_ps_shard_stats *, uint64_t), uint64_t now)
{
    bex__prom_printf(o, "# HELP %s %s.\n# TYPE %s %s\n", name, help, name, type);
    for (size_t k = 0; k < n; k++)
        if (sst[k].snap_unix_ns || type[0] == 'c')
            bex__prom_printf(o, "%s{shard=\"%u\"} %.9g\n", name, shards[k]->shard,
                             value(&sst[k], now));
}

static double v_age(const bex_ps_shard_stats *st, uint64_t now)
{
    return now > st->snap_unix_ns ? secs(now - st->snap_unix_ns) : 0;
}
static double v_write(const bex_ps_shard_stats *st, uint64_t now)
{
    (void)now;
    return secs(st->snap_write_ns);
}
static double v_pause(const bex_ps_shard_stats *st, uint64_t now)
{
    (void)now;
    return secs(st->snap_pause_ns);
}
static double v_snaps(const bex_ps_shard_stats *st, uint64_t now)
{
    (void)now;
    return (double)st->snaps;
}
static double v_fails(const bex_ps_shard_stats *st, uint64_t now)
{
    (void)now;
    return (double)st->snap_failures;
}
static double v_failovers(const bex_ps_shard_stats *st, uint64_t now)
{
    (void)now;
    return (double)st->failovers;
}

void bex__ps_ops_prom(struct bex__prom *o, bex_ps_shard *const *shards,
                      const bex_ps_shard_stats *sst, size_t n)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    lag_prom(o, shards, sst, n);
    family(o, shards, sst, n, "bex_ps_failovers_total", "counter",
           "Times this replica became primary by a failover", v_failovers, now);
    family(o, shards, sst, n, "bex_ps_snapshots_total", "counter", "Snapshots and cuts written",
           v_snaps, now);
    family(o, shards, sst, n, "bex_ps_snapshot_failures_total", "counter",
           "Cuts aborted and snapshots or cuts not written", v_fails, now);
    family(o, shards, sst, n, "bex_ps_snapshot_age_seconds", "gauge",
           "Time since the last snapshot or cut written was taken", v_age, now);
    family(o, shards, sst, n, "bex_ps_snapshot_duration_seconds", "gauge",
           "Time the last snapshot or cut file took to write", v_write, now);
    family(o, shards, sst, n, "bex_ps_snapshot_pause_seconds", "gauge",
           "Time Pushes were held for the last cut", v_pause, now);
}
