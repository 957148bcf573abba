/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: tables of rows in memory, the Fetch/Push wire format's
 * strict decoder, the optimizers, and snapshots (docs/protocol.md,
 * "Parameter server").
 *
 * A table is an open-addressing hash of key -> row index over a growing row
 * array (weights, then Adagrad's accumulators, per row). One mutex per
 * shard: handlers run on I/O threads and a snapshot may run on another. */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "common/cfg.h"
#include "ps/cfg.h"
#include "bex/ps.h"
#include "common/log.h"
#include "common/util.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"
#include "ps/shard_internal.h"

/* ---- shard ---- */

void bex__ps_held_free(struct held *h)
{
    while (h) {
        struct held *n = h->next;
        free(h->keys);
        free(h->g);
        free(h);
        h = n;
    }
}

void bex__ps_tables_free(struct table *ts, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(ts[i].keys);
        free(ts[i].vals);
        free(ts[i].dirty);
        bex__ihash_free(&ts[i].idx);
    }
    free(ts);
}

/* ---- the shard's state (under s->mu) ---- */

const char *bex__ps_shard_state_name(unsigned st)
{
    static const char *const names[] = {[SH_SERVING] = "SERVING",
                                        [SH_WAIT] = "WAIT",
                                        [SH_CATCHUP] = "CATCHUP",
                                        [SH_RESYNC_WAIT] = "RESYNC_WAIT",
                                        [SH_RESYNC] = "RESYNC"};
    return st < ARRAY_SIZE(names) ? names[st] : "?";
}

/* The moves of docs/architecture.md's table: a catch-up starts from a
 * WAIT state and ends SERVING (or back in WAIT: a primary's that failed);
 * a resync starts from SERVING and, over, leaves what it waited for. */
static bool shard_move_ok(enum bex__ps_shard_state from, enum bex__ps_shard_state to)
{
    switch (from) {
    case SH_SERVING:
        return to == SH_RESYNC_WAIT;
    case SH_WAIT:
        return to == SH_CATCHUP;
    case SH_CATCHUP:
        return to == SH_SERVING || to == SH_WAIT;
    case SH_RESYNC_WAIT:
        return to == SH_RESYNC || to == SH_WAIT;
    case SH_RESYNC:
        return to == SH_SERVING || to == SH_RESYNC_WAIT || to == SH_CATCHUP;
    }
    return false;
}

void bex__ps_shard_move(bex_ps_shard *s, enum bex__ps_shard_state to)
{
    enum bex__ps_shard_state from = s->state;
    bool ok = shard_move_ok(from, to);
    assert(ok);
    (void)ok;
    s->state = to;
    if (s->log.level >= BEX_LOG_DEBUG)
        bex__log(&s->log, BEX_LOG_DEBUG, "ps shard %u: %s -> %s", s->shard,
                 bex__ps_shard_state_name(from), bex__ps_shard_state_name(to));
}

int bex__ps_shard_catchup_start(bex_ps_shard *s)
{
    pthread_mutex_lock(&s->mu);
    enum bex__ps_shard_state st = s->state;
    bool go = st == SH_WAIT || st == SH_RESYNC_WAIT;
    if (go)
        bex__ps_shard_move(s, st == SH_WAIT ? SH_CATCHUP : SH_RESYNC);
    pthread_mutex_unlock(&s->mu);
    if (go)
        return 0;
    /* the application's call (or a second one meanwhile: it would install
     * a copy over Pushes applied after the first) */
    bex__log(&s->log, BEX_LOG_WARN,
             "ps shard %u: catch-up refused (-EINVAL): the shard is %s, not waiting for one",
             s->shard, bex__ps_shard_state_name(st));
    return -EINVAL;
}

void bex__ps_shard_catchup_end_locked(bex_ps_shard *s, bool again)
{
    bool resync = s->state == SH_RESYNC;
    bex__ps_shard_move(s, !again ? SH_SERVING : resync ? SH_RESYNC_WAIT : SH_WAIT);
}

int bex_ps_shard_create(const bex_ps_shard_config *cfg, bex_ps_shard **out)
{
    bex_ps_shard_config c;
    bex_ps_table_config tabs[BEX_PS_TABLES_MAX];
    BEX__CFG_TAKE(cfg, c);
    if (cfg && bex__ps_tables_take(&c, tabs))
        return -EINVAL;
    if (!cfg || !out || cfg->n_shards == 0 || cfg->shard >= cfg->n_shards || !cfg->tables ||
        (cfg->flags & ~(uint32_t)BEX_PS_SHARD_CATCHUP) || cfg->n_tables == 0 ||
        cfg->n_tables > BEX_PS_TABLES_MAX || cfg->dedup_clients > IDS_LOAD_MAX ||
        cfg->new_clients_per_sec > 1000000000u)
        return -EINVAL;
    for (size_t i = 0; i < cfg->n_tables; i++) {
        const bex_ps_table_config *t = &cfg->tables[i];
        if (t->dim == 0 || t->dim > BEX_PS_DIM_MAX ||
            (t->optimizer != BEX_PS_SGD && t->optimizer != BEX_PS_ADAGRAD) || !isfinite(t->lr) ||
            t->lr < 0 || !isfinite(t->init_scale) || t->init_scale < 0 ||
            !isfinite(t->adagrad_init) || t->adagrad_init < 0 || !isfinite(t->adagrad_eps) ||
            t->adagrad_eps < 0 || t->max_rows > BEX__PS_ROWS_MAX)
            return -EINVAL;
        for (size_t j = 0; j < i; j++)
            if (cfg->tables[j].id == t->id)
                return -EINVAL;
    }
    if (sodium_init() < 0)
        return -ENOMEM;
    bex_ps_shard *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    s->tables = calloc(cfg->n_tables, sizeof *s->tables);
    if (!s->tables) {
        free(s);
        return -ENOMEM;
    }
    s->n_tables = cfg->n_tables;
    s->shard = cfg->shard;
    s->n_shards = cfg->n_shards;
    for (size_t i = 0; i < cfg->n_tables; i++) {
        struct table *t = &s->tables[i];
        t->cfg = cfg->tables[i];
        bex__ps_table_defaults(&t->cfg);
        t->width = t->cfg.optimizer == BEX_PS_ADAGRAD ? 2 * t->cfg.dim : t->cfg.dim;
    }
    pthread_mutex_init(&s->mu, NULL);
    bex__log_init(&s->log, cfg->log_fn, cfg->log_arg, BEX_LOG_INFO);
    s->state = (cfg->flags & BEX_PS_SHARD_CATCHUP) ? SH_WAIT : SH_SERVING;
    s->held_tail = &s->held;
    s->held_max = cfg->catchup_log_max ? cfg->catchup_log_max : 256ull << 20;
    s->ids = (struct idset){.head = IDS_NIL, .tail = IDS_NIL};
    s->ids_max = cfg->dedup_clients ? cfg->dedup_clients : IDS_CLIENTS;
    s->horizon_ns = (cfg->retry_horizon_ms ? cfg->retry_horizon_ms : 300000) * 1000000ull;
    s->new_rate = cfg->new_clients_per_sec ? cfg->new_clients_per_sec : 1000;
    s->new_per_conn = cfg->new_clients_per_conn ? cfg->new_clients_per_conn : 64;
    int rrc = bex__ps_repl_init(s, cfg);
    if (!rrc)
        rrc = bex__ps_lag_init(s);
    if (!rrc)
        rrc = bex__ps_cut_init(s, cfg); /* restore_cut: loads the cut */
    if (rrc) {
        bex_ps_shard_destroy(s);
        return rrc;
    }
    if (cfg->snapshot_path && !cfg->restore_cut) {
        int rc = bex__ps_snapshot_load(s, cfg->snapshot_path);
        if (rc == -ENOENT) {
            bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: no snapshot at %s, starting empty",
                     s->shard, cfg->snapshot_path);
        } else if (rc) {
            bex__log(&s->log, BEX_LOG_ERROR, "ps shard %u: snapshot %s not loaded: %s", s->shard,
                     cfg->snapshot_path, bex_strerror(rc));
            bex_ps_shard_destroy(s);
            return rc;
        }
    }
    *out = s;
    return 0;
}

void bex_ps_shard_destroy(bex_ps_shard *s)
{
    if (!s)
        return;
    bex__ps_cut_fini(s); /* its writer joined: it answers its COMMIT */
    bex__ps_repl_fini(s);
    bex__ps_lag_fini(s);
    bex__ps_held_free(s->held);
    bex__ps_ids_free(&s->ids);
    free(s->cp.buf);
    bex__ps_tables_free(s->tables, s->n_tables);
    pthread_mutex_destroy(&s->mu);
    bex__log_fini(&s->log);
    free(s);
}

/* The replication gauges into out (under s->mu). */
static void repl_stats_locked(const bex_ps_shard *s, bex_ps_shard_stats *out)
{
    out->role = s->rp.role;
    out->backups_down = s->rp.n_down;
    out->lsn = s->rp.role == BEX_PS_ROLE_PRIMARY ? s->rp.lsn : s->rp.next ? s->rp.next - 1 : 0;
    bex__ps_lag_stats_locked(s, out);
    bex__ps_cut_stats_locked(s, out);
}

void bex_ps_shard_stats_get(bex_ps_shard *s, bex_ps_shard_stats *out)
{
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    out->rows = 0;
    for (size_t i = 0; i < s->n_tables; i++)
        out->rows += s->tables[i].n_rows;
    repl_stats_locked(s, out);
    pthread_mutex_unlock(&s->mu);
}

/* Every shard's tables (copies), in order, for bex__prom_counters. */
struct table_iter {
    bex_ps_shard *const *shards;
    struct table **ts;
    size_t n, k, t;
};

static const void *table_next(void *arg, const void **cur, char *labels, size_t cap)
{
    struct table_iter *it = arg;
    if (!*cur)
        it->k = it->t = 0;
    while (it->k < it->n && it->t >= it->shards[it->k]->n_tables) {
        it->k++;
        it->t = 0;
    }
    if (it->k >= it->n)
        return NULL;
    const struct table *tb = &it->ts[it->k][it->t++];
    snprintf(labels, cap, "shard=\"%u\",table=\"%u\"", it->shards[it->k]->shard, tb->cfg.id);
    *cur = tb;
    return tb;
}

struct shard_labels {
    bex_ps_shard *const *shards;
    const bex_ps_shard_stats *sst;
};

static void shard_label(const void *obj, const void *arg, char *labels, size_t cap)
{
    const struct shard_labels *sl = arg;
    size_t k = (size_t)((const bex_ps_shard_stats *)obj - sl->sst);
    snprintf(labels, cap, "shard=\"%u\"", sl->shards[k]->shard);
}

static const struct bex__prom_ctr table_ctrs[] = {
    {"bex_ps_fetches_total", "Fetches served", offsetof(struct table, fetches)},
    {"bex_ps_pushes_total", "Pushes applied", offsetof(struct table, pushes)},
    {"bex_ps_rows_fetched_total", "Rows returned by Fetches", offsetof(struct table, rows_fetched)},
    {"bex_ps_rows_pushed_total", "Rows updated by Pushes", offsetof(struct table, rows_pushed)},
};

static const struct bex__prom_ctr shard_ctrs[] = {
    {"bex_ps_catchup_rows_copied_total", "Rows copied from a peer replica by catch-up",
     offsetof(bex_ps_shard_stats, catchup_rows)},
    {"bex_ps_catchup_pushes_replayed_total", "Pushes held during catch-up and applied after it",
     offsetof(bex_ps_shard_stats, catchup_replayed)},
    {"bex_ps_catchup_pushes_skipped_total", "Pushes held during catch-up that the peer's copy had",
     offsetof(bex_ps_shard_stats, catchup_skipped)},
    {"bex_ps_catchup_failures_total",
     "Catch-ups that fell back to the snapshot (no peer gave a copy)",
     offsetof(bex_ps_shard_stats, catchup_failed)},
    {"bex_ps_catchup_copies_served_total", "Copies served to a restarted peer replica",
     offsetof(bex_ps_shard_stats, copies_served)},
    {"bex_ps_catchup_full_copies_total", "Catch-ups that installed a full copy of a peer's rows",
     offsetof(bex_ps_shard_stats, catchup_full)},
    {"bex_ps_catchup_suffix_total",
     "Catch-ups by the primary's log suffix (the forwards after the snapshot, no full copy)",
     offsetof(bex_ps_shard_stats, catchup_suffix)},
    {"bex_ps_catchup_suffix_pushes_total", "Forwards applied by log-suffix catch-ups",
     offsetof(bex_ps_shard_stats, suffix_applied)},
    {"bex_ps_catchup_suffixes_served_total", "Log suffixes a primary served to a restarted backup",
     offsetof(bex_ps_shard_stats, suffixes_served)},
    {"bex_ps_forwards_resent_total",
     "Forwards a primary sent again from its log to a backup found behind",
     offsetof(bex_ps_shard_stats, fwd_resent)},
    {"bex_ps_backup_log_rejoins_total", "Backups that rejoined by forwards sent again from the log",
     offsetof(bex_ps_shard_stats, log_rejoins)},
    {"bex_ps_dup_pushes_total", "Pushes whose id was applied already (not applied again)",
     offsetof(bex_ps_shard_stats, dup_ids)},
    {"bex_ps_stale_pushes_total",
     "Pushes refused for an id more than the window behind its client's highest",
     offsetof(bex_ps_shard_stats, stale_ids)},
    {"bex_ps_clients_refused_total",
     "New client ids refused (dedup table full of live clients, or past a rate)",
     offsetof(bex_ps_shard_stats, clients_refused)},
    {"bex_ps_forwards_sent_total", "Forwards a primary sent its backups (one per Push and backup)",
     offsetof(bex_ps_shard_stats, fwd_sent)},
    {"bex_ps_forwards_failed_total", "Forwards not applied by their backup (it was marked down)",
     offsetof(bex_ps_shard_stats, fwd_failed)},
    {"bex_ps_backup_down_refused_total", "Pushes a primary refused because a backup is down",
     offsetof(bex_ps_shard_stats, backup_down_refused)},
    {"bex_ps_forwards_applied_total", "Forwards a backup applied in their turn",
     offsetof(bex_ps_shard_stats, fwd_applied)},
    {"bex_ps_forwards_held_total", "Forwards a backup held until their turn",
     offsetof(bex_ps_shard_stats, fwd_held)},
    {"bex_ps_forwards_refused_total", "Forwards a backup refused or failed to apply",
     offsetof(bex_ps_shard_stats, fwd_refused)},
    {"bex_ps_backup_rejoins_total", "Backups back in the replica set after being marked down",
     offsetof(bex_ps_shard_stats, rejoins)},
    {"bex_ps_not_primary_total", "Client Pushes refused by a backup (or a Forward by a non-backup)",
     offsetof(bex_ps_shard_stats, not_primary)},
};

/* The replication gauges: role, lsn, backups down. */
static void repl_gauges(struct bex__prom *o, bex_ps_shard *const *shards,
                        const bex_ps_shard_stats *sst, size_t n)
{
    bex__prom_printf(o, "# HELP bex_ps_role Replication role: 0 any (client fan-out), 1 primary, "
                        "2 backup.\n# TYPE bex_ps_role gauge\n");
    for (size_t k = 0; k < n; k++)
        bex__prom_printf(o, "bex_ps_role{shard=\"%u\"} %u\n", shards[k]->shard, sst[k].role);
    bex__prom_printf(o, "# HELP bex_ps_repl_lsn Last forward numbered (primary) or applied "
                        "(backup).\n# TYPE bex_ps_repl_lsn gauge\n");
    for (size_t k = 0; k < n; k++)
        bex__prom_printf(o, "bex_ps_repl_lsn{shard=\"%u\"} %llu\n", shards[k]->shard,
                         (unsigned long long)sst[k].lsn);
    bex__prom_printf(o, "# HELP bex_ps_backups_down Backups a primary marked down.\n"
                        "# TYPE bex_ps_backups_down gauge\n");
    for (size_t k = 0; k < n; k++)
        bex__prom_printf(o, "bex_ps_backups_down{shard=\"%u\"} %u\n", shards[k]->shard,
                         sst[k].backups_down);
}

int bex_ps_shard_prometheus(bex_ps_shard *const *shards, size_t n, char *buf, size_t cap)
{
    if ((n && !shards) || (!buf && cap))
        return -EINVAL;
    for (size_t k = 0; k < n; k++)
        if (!shards[k])
            return -EINVAL;
    if (cap)
        buf[0] = 0;
    /* copies under each shard's lock (a table's histograms are some KB),
     * printed outside them */
    struct table **ts = calloc(n ? n : 1, sizeof *ts);
    uint64_t *malformed = calloc(n ? n : 1, sizeof *malformed);
    bex_ps_shard_stats *sst = calloc(n ? n : 1, sizeof *sst);
    int rc = ts && malformed && sst ? 0 : -ENOMEM;
    for (size_t k = 0; k < n && !rc; k++) {
        bex_ps_shard *s = shards[k];
        if (!(ts[k] = malloc(s->n_tables * sizeof *ts[k]))) {
            rc = -ENOMEM;
            break;
        }
        pthread_mutex_lock(&s->mu);
        memcpy(ts[k], s->tables, s->n_tables * sizeof *ts[k]);
        malformed[k] = s->st.malformed;
        sst[k] = s->st;
        repl_stats_locked(s, &sst[k]);
        pthread_mutex_unlock(&s->mu);
    }
    struct bex__prom o = {buf, cap, 0};
    /* a metric family's samples together, every shard's */
    struct table_iter ti = {shards, ts, n, 0, 0};
    if (!rc)
        bex__prom_counters(&o, table_ctrs, ARRAY_SIZE(table_ctrs), table_next, &ti);
    if (!rc) {
        bex__prom_printf(&o, "# HELP bex_ps_rows Rows held.\n# TYPE bex_ps_rows gauge\n");
        for (size_t k = 0; k < n; k++)
            for (size_t t = 0; t < shards[k]->n_tables; t++)
                bex__prom_printf(&o, "bex_ps_rows{shard=\"%u\",table=\"%u\"} %u\n",
                                 shards[k]->shard, ts[k][t].cfg.id, ts[k][t].n_rows);
        bex__prom_printf(&o, "# HELP bex_ps_malformed_total Request bodies refused.\n"
                             "# TYPE bex_ps_malformed_total counter\n");
        for (size_t k = 0; k < n; k++)
            bex__prom_printf(&o, "bex_ps_malformed_total{shard=\"%u\"} %llu\n", shards[k]->shard,
                             (unsigned long long)malformed[k]);
        struct shard_labels sl = {shards, sst};
        struct bex__prom_array sa = {sst, n, sizeof *sst, shard_label, &sl};
        bex__prom_counters(&o, shard_ctrs, ARRAY_SIZE(shard_ctrs), bex__prom_array_next, &sa);
        repl_gauges(&o, shards, sst, n);
        bex__ps_ops_prom(&o, shards, sst, n);
        bex__prom_printf(&o, "# HELP bex_ps_serve_seconds Time a request took in the shard, "
                             "decoding to answer.\n# TYPE bex_ps_serve_seconds histogram\n");
        for (size_t k = 0; k < n; k++)
            for (size_t t = 0; t < shards[k]->n_tables; t++)
                for (int m = 0; m < 2; m++) {
                    char lb[96];
                    snprintf(lb, sizeof lb, "shard=\"%u\",table=\"%u\",method=\"%s\"",
                             shards[k]->shard, ts[k][t].cfg.id, m ? "push" : "fetch");
                    bex__prom_hist(&o, "bex_ps_serve_seconds", lb, &ts[k][t].lat[m]);
                }
    }
    for (size_t k = 0; ts && k < n; k++)
        free(ts[k]);
    free(ts);
    free(malformed);
    free(sst);
    if (rc) {
        if (cap)
            buf[0] = 0;
        return rc;
    }
    return o.n > INT32_MAX ? INT32_MAX : (int)o.n;
}
