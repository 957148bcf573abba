/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: primary-backup replication (docs/architecture.md,
 * "Replication"; wire: docs/protocol.md, "Forward").
 *
 * Primary: a client's Push is applied under the shard's lock, which gives
 * it its place in the order (lsn), then forwarded whole (its id included)
 * to every backup, each on a channel of that backup alone; the client's
 * answer waits for every backup's. A forward that fails (its channel's
 * retries and deadline spent) marks its backup down: from then on the
 * primary refuses Pushes (-EHOSTDOWN) rather than acknowledge one a
 * backup may lack (with a static cluster file nothing removes a backup).
 *
 * Backup: forwards are applied in lsn order; one ahead of its turn is held
 * (bounded) and answered when applied; one already applied (a resend) is
 * answered at once. A new primary session starts at lsn 1. */
#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "bex/ps.h"
#include "common/log.h"
#include "common/util.h"
#include "ps/ps_internal.h"
#include "ps/repl_batch.h"
#include "ps/shard_internal.h"
#include "rpc/internal.h"

#define FWD_TIMEOUT_MS 5000u
#define BK_CONNECT_MS  10000u
#define FWD_WINDOW     1024u
#define FWD_WINDOW_MAX 65536u
#define FWD_HOLD_MAX   (64ull << 20)
#define FWD_ATTEMPTS   16u

int bex__ps_repl_init(bex_ps_shard *s, const bex_ps_shard_config *cfg)
{
    struct repl *rp = &s->rp;
    if (cfg->role > BEX_PS_ROLE_BACKUP || (cfg->n_backups && cfg->role != BEX_PS_ROLE_PRIMARY) ||
        cfg->n_backups >= BEX_PS_REPLICAS_MAX || (cfg->n_backups && !cfg->backups) ||
        cfg->forward_window > FWD_WINDOW_MAX)
        return -EINVAL;
    /* the first state (no move): the configured role's */
    rp->state = cfg->role == BEX_PS_ROLE_PRIMARY  ? RP_PRIMARY
                : cfg->role == BEX_PS_ROLE_BACKUP ? RP_BACKUP
                                                  : RP_ANY;
    rp->role = cfg->role;
    rp->fwd_timeout_ms = cfg->forward_timeout_ms ? cfg->forward_timeout_ms : FWD_TIMEOUT_MS;
    rp->bk_connect_ms =
        cfg->backup_connect_timeout_ms ? cfg->backup_connect_timeout_ms : BK_CONNECT_MS;
    rp->win_n = cfg->forward_window ? cfg->forward_window : FWD_WINDOW;
    rp->hold_max = cfg->forward_hold_max ? cfg->forward_hold_max : FWD_HOLD_MAX;
    rp->retry_ns = (uint64_t)(cfg->backup_retry_ms ? cfg->backup_retry_ms : 1000) * 1000000ull;
    /* a primary's room for every backup: one may join later (join.c),
     * while forwards to the others complete */
    if (cfg->role == BEX_PS_ROLE_PRIMARY && !(rp->bk = calloc(BEX_PS_BACKUPS_MAX, sizeof *rp->bk)))
        return -ENOMEM;
    rp->n_bk = cfg->n_backups;
    for (size_t i = 0; i < rp->n_bk; i++) {
        rp->bk[i].addr = cfg->backups[i].addr;
        rp->bk[i].transport = cfg->backups[i].transport;
    }
    /* a session no earlier life of this primary used */
    while (!rp->session)
        if (getrandom(&rp->session, sizeof rp->session, 0) != sizeof rp->session)
            return -EIO;
    int rc = bex__ps_batch_init(rp, cfg);
    return rc ? rc : bex__ps_rlog_init(&rp->log, cfg);
}

/* The channel to backup b: retries within the forward's deadline, never
 * throttled (a forward lost is a backup marked down or removed). Its
 * connection may take the setup deadline: a forward's own deadline bounds
 * how long a Push waits for it (bex__ps_fwd_timeout). */
static int bk_channel(struct repl *rp, bex_ctx *ctx, struct backup *b)
{
    bex_rpc_endpoint ep = {.addr = b->addr, .transport = b->transport};
    bex_rpc_channel_config cc = {.endpoints = &ep,
                                 .n_endpoints = 1,
                                 .name = "ps-forward",
                                 .request_timeout_ms = rp->fwd_timeout_ms,
                                 .connect_timeout_ms = rp->bk_connect_ms,
                                 .probe_timeout_ms = rp->fwd_timeout_ms,
                                 .max_attempts = FWD_ATTEMPTS,
                                 .retry_budget_burst = 1000000,
                                 .retry_budget_permille = 1000};
    return bex_rpc_channel_create(ctx, &cc, &b->ch);
}

int bex__ps_repl_register(bex_ps_shard *s, bex_ctx *ctx)
{
    struct repl *rp = &s->rp;
    rp->ctx = ctx;
    if ((rp->role == BEX_PS_ROLE_BACKUP || rp->fenced) && !rp->win &&
        !(rp->win = calloc(rp->win_n, sizeof *rp->win)))
        return -ENOMEM;
    for (size_t i = 0; i < rp->n_bk; i++) {
        int rc = rp->bk[i].ch ? 0 : bk_channel(rp, ctx, &rp->bk[i]);
        if (rc)
            return rc;
    }
    return 0;
}

uint32_t bex__ps_fwd_timeout(const struct repl *rp, const struct backup *b)
{
    /* a backup never reached is still connecting (an RDMA connection can
     * take seconds on a loaded host): its setup is not the forward's delay */
    return b->reached ? rp->fwd_timeout_ms : rp->fwd_timeout_ms + rp->bk_connect_ms;
}

void bex__ps_fwdh_free(struct fwdh *f)
{
    while (f) {
        struct fwdh *nx = f->more;
        free(f->keys);
        free(f->g);
        free(f);
        f = nx;
    }
}

/* Answer the forwards on list (each its status), after the lock. */
static void answer_all(struct fwdh *list)
{
    while (list) {
        struct fwdh *nx = list->next;
        bex_rpc_reply(list->req, list->status, NULL, 0);
        bex__ps_fwdh_free(list);
        list = nx;
    }
}

void bex__ps_repl_fini(bex_ps_shard *s)
{
    struct repl *rp = &s->rp;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < rp->n_bk; i++)
        bex__ps_batch_close_locked(&rp->bk[i]);
    pthread_mutex_unlock(&s->mu);
    /* outstanding forwards complete (-ECANCELED): their Pushes answered,
     * and so are the ones still queued */
    for (size_t i = 0; i < rp->n_bk; i++) {
        if (rp->bk[i].ch)
            bex_rpc_channel_destroy(rp->bk[i].ch);
        bex__ps_batch_drain(&rp->bk[i], -ECANCELED);
    }
    free(rp->bk);
    bex__ps_rlog_clear(&rp->log);
    free(rp->log.e);
    struct fwdh *list = NULL;
    for (uint32_t i = 0; rp->win && i < rp->win_n; i++)
        if (rp->win[i]) {
            rp->win[i]->status = -ECANCELED;
            rp->win[i]->next = list;
            list = rp->win[i];
        }
    answer_all(list);
    free(rp->win);
}

/* The position a copy of s carries (under s->mu): a primary's session and
 * last lsn, a backup's session and last lsn applied, else zeros. */
void bex__ps_repl_position(const bex_ps_shard *s, uint64_t *session, uint64_t *lsn)
{
    const struct repl *rp = &s->rp;
    *session = *lsn = 0;
    if (rp->role == BEX_PS_ROLE_PRIMARY) {
        *session = rp->session;
        *lsn = rp->lsn;
    } else if (rp->role == BEX_PS_ROLE_BACKUP && rp->in_session) {
        *session = rp->in_session;
        *lsn = rp->next - 1;
    }
}

/* A backup that caught up takes its copy's position (under s->mu): it
 * holds every forward of that session up to its lsn, so its primary's
 * probe finds it in step. */
void bex__ps_repl_take_cut(bex_ps_shard *s)
{
    struct repl *rp = &s->rp;
    if (rp->role != BEX_PS_ROLE_BACKUP || !rp->cut_session)
        return;
    rp->in_session = rp->cut_session;
    rp->next = rp->cut_lsn + 1;
}

/* ---- primary ---- */

static void fop_put(struct fop *op)
{
    if (atomic_fetch_sub(&op->left, 1) != 1)
        return;
    int st = atomic_load(&op->status);
    bex_ps_shard *s = op->s;
    struct bex__ps_hdr a = {.table = op->h.table, .n = op->h.n, .dim = op->h.dim};
    if (!st && s->rp.fenced) {
        pthread_mutex_lock(&s->mu);
        if (!bex__ps_lease_held(&s->rp))
            st = -ESTALE; /* the lease may have expired: another may lead now */
        a.epoch = s->rp.epoch;
        pthread_mutex_unlock(&s->mu);
        if (op->h.flags & BEX__PS_F_EPOCH)
            a.flags = BEX__PS_F_EPOCH; /* the term, for the client's next Pushes */
    }
    size_t alen = BEX__PS_HDR_LEN + (a.flags ? BEX__PS_EPOCH_LEN : 0);
    uint8_t *out = st ? NULL : bex_rpc_alloc(op->s->rp.ctx, alen);
    if (!st && !out)
        st = -ENOMEM;
    if (out)
        bex__ps_hdr_put(out, &a);
    bex_rpc_reply(op->req, st, out, out ? alen : 0);
    pthread_mutex_lock(&s->mu);
    s->rp.inflight--;
    pthread_mutex_unlock(&s->mu);
    free(op->body);
    free(op);
}

/* ---- a backup's state (under s->mu) ---- */

const char *bex__ps_backup_state_name(unsigned st)
{
    static const char *const names[] = {
        [BK_UP] = "UP", [BK_DOWN] = "DOWN", [BK_PROBING] = "PROBING", [BK_OUT] = "OUT"};
    return st < ARRAY_SIZE(names) ? names[st] : "?";
}

/* Static mode: UP -> DOWN -> PROBING -> UP or DOWN; etcd mode (where no
 * backup is marked down): UP -> OUT -> UP. */
static bool backup_move_ok(enum bex__ps_backup_state from, enum bex__ps_backup_state to)
{
    switch (from) {
    case BK_UP:
        return to == BK_DOWN || to == BK_OUT;
    case BK_DOWN:
        return to == BK_PROBING;
    case BK_PROBING:
        return to == BK_UP || to == BK_DOWN;
    case BK_OUT:
        return to == BK_UP;
    }
    return false;
}

void bex__ps_backup_move(bex_ps_shard *s, uint32_t i, enum bex__ps_backup_state to)
{
    struct backup *b = &s->rp.bk[i];
    enum bex__ps_backup_state from = b->state;
    bool ok = backup_move_ok(from, to);
    assert(ok);
    (void)ok;
    b->state = to;
    if (s->log.level >= BEX_LOG_DEBUG)
        bex__log(&s->log, BEX_LOG_DEBUG, "ps shard %u: backup %u %s -> %s", s->shard, i,
                 bex__ps_backup_state_name(from), bex__ps_backup_state_name(to));
}

const char *bex__ps_repl_state_name(unsigned st)
{
    static const char *const names[] = {[RP_ANY] = "ANY",
                                        [RP_PRIMARY] = "PRIMARY",
                                        [RP_PAUSED] = "PAUSED",
                                        [RP_BACKUP] = "BACKUP",
                                        [RP_UNSYNCED] = "UNSYNCED"};
    return st < ARRAY_SIZE(names) ? names[st] : "?";
}

/* etcd mode's moves (static mode has none): a term's primary pauses and
 * resumes, a backup leads, any follows a term (UNSYNCED until it copied). */
static bool repl_move_ok(enum bex__ps_repl_state from, enum bex__ps_repl_state to)
{
    switch (from) {
    case RP_ANY:
        return false;
    case RP_PRIMARY:
        return to == RP_PAUSED || to == RP_UNSYNCED;
    case RP_PAUSED:
        return to == RP_PRIMARY || to == RP_UNSYNCED;
    case RP_BACKUP:
        return to == RP_PRIMARY || to == RP_UNSYNCED;
    case RP_UNSYNCED:
        return to == RP_PRIMARY || to == RP_BACKUP;
    }
    return false;
}

void bex__ps_repl_move(bex_ps_shard *s, enum bex__ps_repl_state to)
{
    struct repl *rp = &s->rp;
    enum bex__ps_repl_state from = rp->state;
    bool ok = repl_move_ok(from, to);
    assert(ok);
    (void)ok;
    rp->state = to;
    atomic_store(&rp->role, to == RP_PRIMARY || to == RP_PAUSED ? BEX_PS_ROLE_PRIMARY
                            : to == RP_ANY                      ? BEX_PS_ROLE_ANY
                                                                : BEX_PS_ROLE_BACKUP);
    if (s->log.level >= BEX_LOG_DEBUG)
        bex__log(&s->log, BEX_LOG_DEBUG, "ps shard %u: replication %s -> %s", s->shard,
                 bex__ps_repl_state_name(from), bex__ps_repl_state_name(to));
}

/* etcd mode: a forward to backup fc->b failed. Not waited for when the
 * backup is out of the set already (or the forward is of an earlier
 * term: its Push is refused then); else it waits for the agent's removal
 * of the backup (true: fc is answered by bex__ps_repl_removed). */
static bool fenced_failed(bex_ps_shard *s, struct fcall *fc, int status)
{
    struct repl *rp = &s->rp;
    bool wait = false, stale;
    pthread_mutex_lock(&s->mu);
    s->st.fwd_failed++;
    stale = fc->epoch != rp->epoch || rp->role != BEX_PS_ROLE_PRIMARY;
    if (!stale && rp->bk[fc->b].state != BK_OUT) {
        fc->rm_nx = rp->rm;
        rp->rm = fc;
        wait = true;
    }
    pthread_mutex_unlock(&s->mu);
    if (stale) {
        int zero = 0;
        atomic_compare_exchange_strong(&fc->op->status, &zero, -ESTALE);
    }
    if (wait) {
        bex__log(&s->log, BEX_LOG_WARN,
                 "ps shard %u: backup %u did not apply a forward (%s): removing it from the "
                 "replica set",
                 s->shard, fc->b, bex_strerror(status));
        if (rp->kick)
            rp->kick(rp->kick_arg);
    }
    return wait;
}

void bex__ps_fwd_done(int status, struct fcall *fc)
{
    struct fop *op = fc->op;
    bex_ps_shard *s = op->s;
    if (status && s->rp.fenced) {
        if (fenced_failed(s, fc, status))
            return; /* answered once the backup is out of the set */
    } else if (status) {
        struct backup *b = &s->rp.bk[fc->b];
        pthread_mutex_lock(&s->mu);
        bool was = b->state != BK_UP;
        if (!was) {
            bex__ps_backup_move(s, fc->b, BK_DOWN);
            b->probe_ns = bex__rpc_now_ns() + s->rp.retry_ns;
            s->rp.n_down++;
        }
        s->st.fwd_failed++;
        pthread_mutex_unlock(&s->mu);
        if (!was)
            bex__log(&s->log, BEX_LOG_ERROR,
                     "ps shard %u: backup %u did not apply a forward (%s): marked down, Pushes "
                     "refused from now on (no failover with a static cluster file)",
                     s->shard, fc->b, bex_strerror(status));
        int zero = 0;
        atomic_compare_exchange_strong(&op->status, &zero, -EHOSTDOWN);
    } else {
        bex__ps_lag_acked(s, fc->b, op->lsn);
    }
    fop_put(op);
}

size_t bex__ps_repl_removals(bex_ps_shard *s, uint32_t *out, size_t cap)
{
    size_t n = 0;
    pthread_mutex_lock(&s->mu);
    for (struct fcall *f = s->rp.rm; f && n < cap; f = f->rm_nx) {
        bool seen = false;
        for (size_t i = 0; i < n; i++)
            seen |= out[i] == f->b;
        if (!seen)
            out[n++] = f->b;
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

void bex__ps_repl_removed(bex_ps_shard *s, uint32_t b, int status)
{
    struct fcall *mine = NULL, **pp = &s->rp.rm;
    pthread_mutex_lock(&s->mu);
    if (status == 0 && b < s->rp.n_bk && s->rp.bk[b].state != BK_OUT)
        bex__ps_backup_move(s, b, BK_OUT);
    while (*pp) {
        struct fcall *f = *pp;
        if (f->b == b) {
            *pp = f->rm_nx;
            f->rm_nx = mine;
            mine = f;
        } else {
            pp = &f->rm_nx;
        }
    }
    pthread_mutex_unlock(&s->mu);
    while (mine) {
        struct fcall *nx = mine->rm_nx;
        int zero = 0;
        if (status)
            atomic_compare_exchange_strong(&mine->op->status, &zero, -EHOSTDOWN);
        fop_put(mine->op);
        mine = nx;
    }
}

/* A probe of a down backup answered (status 0: it holds every Push the
 * primary applied; it rejoins). */
struct probe {
    bex_ps_shard *s;
    uint32_t b;
};

static void probe_done(int status, void *body, size_t len, void *user)
{
    struct probe *pr = user;
    bex_ps_shard *s = pr->s;
    struct backup *b = &s->rp.bk[pr->b];
    /* behind in this session: its answer says where (docs/protocol.md) */
    bool behind = status == -ESTALE && len == BEX__PS_POS_LEN && !s->rp.fenced;
    uint64_t pos = behind ? bex__ps_get64(body) : 0;
    bex_rpc_free(body);
    if (behind && bex__ps_rlog_resend(s, pr->b, pos) == 0) {
        free(pr); /* still probing: the resend ends it */
        return;
    }
    if (behind)
        bex__log(&s->log, BEX_LOG_WARN,
                 "ps shard %u: backup %u is behind (at lsn %llu) by more than the forward log "
                 "holds: it stays down until restarted with a catch-up",
                 s->shard, pr->b, (unsigned long long)pos);
    pthread_mutex_lock(&s->mu);
    bool back = status == 0 && b->state == BK_PROBING;
    if (b->state == BK_PROBING)
        bex__ps_backup_move(s, pr->b, back ? BK_UP : BK_DOWN);
    if (back) {
        s->rp.n_down--;
        s->st.rejoins++;
    }
    pthread_mutex_unlock(&s->mu);
    if (back)
        bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: backup %u holds every Push: it rejoins",
                 s->shard, pr->b);
    free(pr);
}

/* Probe backup b (down) at the primary's lsn: an empty Push of the first
 * table, flagged not to be applied. */
static void probe_send(bex_ps_shard *s, uint32_t b, uint64_t lsn)
{
    struct repl *rp = &s->rp;
    struct probe *pr = malloc(sizeof *pr);
    size_t len = BEX__PS_FWD_HDR_LEN + BEX__PS_HDR_LEN;
    uint8_t *body = pr ? bex_rpc_alloc(rp->ctx, len) : NULL;
    int rc = body ? 0 : -ENOMEM;
    if (body) {
        *pr = (struct probe){s, b};
        bex__ps_fwd_put(body, &(struct bex__ps_fwd_hdr){
                                  .session = rp->session, .lsn = lsn, .flags = BEX__PS_FWD_PROBE});
        const bex_ps_table_config *t = &s->tables[0].cfg;
        bex__ps_hdr_put(body + BEX__PS_FWD_HDR_LEN,
                        &(struct bex__ps_hdr){.table = t->id, .n = 0, .dim = t->dim});
        bex_rpc_call_opts o = {.timeout_ms = rp->fwd_timeout_ms};
        rc = bex_rpc_call(rp->bk[b].ch, BEX_PS_SERVICE, BEX_PS_M_FORWARD, body, len, &o, probe_done,
                          pr, NULL);
        if (rc) {
            bex_rpc_free(body);
            probe_done(rc, NULL, 0, pr);
        }
        return;
    }
    free(pr);
    pthread_mutex_lock(&s->mu);
    if (rp->bk[b].state == BK_PROBING)
        bex__ps_backup_move(s, b, BK_DOWN);
    pthread_mutex_unlock(&s->mu);
}

/* The down backups due a probe (under s->mu): marked probing, their
 * indexes into due (returns how many). */
static uint32_t probes_due_locked(bex_ps_shard *s, uint32_t *due)
{
    struct repl *rp = &s->rp;
    uint64_t now = bex__rpc_now_ns();
    uint32_t n = 0;
    for (uint32_t i = 0; i < rp->n_bk; i++) {
        struct backup *b = &rp->bk[i];
        if (b->state == BK_DOWN && now >= b->probe_ns && rp->lsn) {
            bex__ps_backup_move(s, i, BK_PROBING);
            b->probe_ns = now + rp->retry_ns;
            due[n++] = i;
        }
    }
    return n;
}

/* Apply a client's Push (decoded: h; its body, len bytes) and number it,
 * under the lock, and log it. 0 and *lsn, or the error that refuses it. */
static int primary_apply(bex_ps_shard *s, const struct bex__ps_hdr *h, struct table *t,
                         const uint64_t *keys, const float *g, const bex_rpc_req *req,
                         struct fop *op)
{
    struct pushid id = {.k = {h->id_client, {h->id_tok[0], h->id_tok[1]}},
                        .seq = h->id_seq,
                        .served = true,
                        .req = req};
    int rc = 0;
    uint32_t due[BEX_PS_REPLICAS_MAX], n_due = 0;
    uint64_t at = 0;
    pthread_mutex_lock(&s->mu);
    if (bex__ps_shard_catching(s))
        rc = -EAGAIN; /* its rows are not the shard's yet: the client retries */
    else if (s->rp.fenced)
        rc = s->rp.state == RP_PAUSED ? -EAGAIN
                                      : bex__ps_fenced_admit(s, h); /* backups leave the set */
    if (rc) {
        /* refused */
    } else if (s->rp.n_down) {
        /* nothing is applied while a backup is down: the lsn stays */
        s->st.backup_down_refused++;
        rc = -EHOSTDOWN;
        n_due = probes_due_locked(s, due);
        at = s->rp.lsn;
    } else {
        /* a retry of a Push applied here already is forwarded again: the
         * backups' id records apply it once, and it is acknowledged only
         * when every backup has it */
        rc = bex__ps_push_apply_locked(s, t, h->n, keys, g, (h->flags & BEX__PS_F_ID) ? &id : NULL,
                                       NULL);
        if (rc == 0) {
            op->lsn = ++s->rp.lsn;
            if (s->rp.n_bk)
                bex__ps_rlog_add_locked(&s->rp.log, op->lsn, op->body, op->len);
            s->rp.inflight++;
            s->st.fwd_sent += s->rp.n_bk;
            bex__ps_lag_numbered_locked(s, op->lsn);
            bex__ps_batch_queue_locked(s, op); /* in lsn order */
        }
    }
    pthread_mutex_unlock(&s->mu);
    for (uint32_t i = 0; i < n_due; i++)
        probe_send(s, due[i], at);
    return rc;
}

int bex__ps_primary_push(bex_ps_shard *s, const struct bex__ps_hdr *h, const void *body, size_t len,
                         bex_rpc_req *req)
{
    struct table *t;
    uint64_t *keys;
    float *g;
    int rc = bex__ps_push_read(s, h, (const uint8_t *)body + bex__ps_keys_off(h), &t, &keys, &g);
    if (rc)
        return rc;
    /* room for every backup: one may join before it is numbered */
    struct fop *op = calloc(1, sizeof *op + BEX_PS_BACKUPS_MAX * sizeof(struct fcall));
    uint8_t *copy = op ? malloc(len ? len : 1) : NULL;
    if (!copy)
        rc = -ENOMEM;
    if (!rc) {
        memcpy(copy, body, len);
        *op = (struct fop){.s = s, .req = req, .h = *h, .body = copy, .len = len};
        rc = primary_apply(s, h, t, keys, g, req, op);
    }
    free(keys);
    free(g);
    if (rc) {
        free(copy);
        free(op);
        return rc;
    }
    bex__ps_batch_pump(s);
    fop_put(op); /* the sending guard: the answer may go here */
    return BEX__PS_LATER;
}

/* ---- backup ---- */

/* Apply a forward in its turn (under the lock), or a batch's forwards
 * from the next one on (those before it applied already): the first
 * error, else 0. */
static int fwd_apply_locked(bex_ps_shard *s, struct fwdh *f)
{
    int first = 0;
    for (; f; f = f->more) {
        if (f->lsn < s->rp.next)
            continue;
        int rc = bex__ps_push_apply_locked(s, f->t, f->n, f->keys, f->g, f->has_id ? &f->id : NULL,
                                           NULL);
        s->rp.next++;
        s->st.fwd_applied++;
        bex__ps_lag_applied_locked(s);
        if (rc)
            bex__log(&s->log, BEX_LOG_ERROR,
                     "ps shard %u: forward %llu not applied (%s): this backup now differs from "
                     "its primary",
                     s->shard, (unsigned long long)f->lsn, bex_strerror(rc));
        first = first ? first : rc;
    }
    return first;
}

/* After a batch applied several: the held ones it covered (a resend
 * grouped otherwise) applied too, from the next lsn on, onto *done. */
static void settle_locked(bex_ps_shard *s, struct fwdh **done)
{
    struct repl *rp = &s->rp;
    for (uint32_t i = 0; i < rp->win_n && rp->hold_bytes; i++) {
        struct fwdh *h = rp->win[i];
        if (!h || h->lsn >= rp->next)
            continue;
        rp->win[i] = NULL;
        rp->hold_bytes -= h->bytes;
        h->status = fwd_apply_locked(s, h);
        h->next = *done;
        *done = h;
    }
}

/* Apply the held forwards whose turn came, onto *done. */
static void drain_locked(bex_ps_shard *s, struct fwdh **done)
{
    struct repl *rp = &s->rp;
    struct fwdh *h;
    while ((h = rp->win[rp->next % rp->win_n]) && h->lsn == rp->next) {
        rp->win[rp->next % rp->win_n] = NULL;
        rp->hold_bytes -= h->bytes;
        h->status = fwd_apply_locked(s, h);
        h->next = *done;
        *done = h;
    }
}

/* Every held forward onto *done with status (a new session, -ESTALE). */
static void drop_held_locked(struct repl *rp, struct fwdh **done, int status)
{
    for (uint32_t i = 0; i < rp->win_n; i++)
        if (rp->win[i]) {
            rp->win[i]->status = status;
            rp->win[i]->next = *done;
            *done = rp->win[i];
            rp->win[i] = NULL;
        }
    rp->hold_bytes = 0;
}

/* Take forward f of session (under the lock): applied now (its status),
 * held (BEX__PS_LATER: f kept), or refused. Answers due onto *done. */
static int fwd_take_locked(bex_ps_shard *s, uint64_t session, struct fwdh *f, struct fwdh **done)
{
    struct repl *rp = &s->rp;
    if (bex__ps_shard_catching(s))
        return -EAGAIN;
    if (session != rp->in_session) {
        if (f->lsn != 1) {
            /* not the start of that primary's stream: what came before it
             * is not here */
            bex__log(&s->log, BEX_LOG_ERROR,
                     "ps shard %u: forward %llu of a primary session this backup did not follow "
                     "from its start: refused",
                     s->shard, (unsigned long long)f->lsn);
            return -ESTALE;
        }
        drop_held_locked(rp, done, -ESTALE);
        rp->in_session = session;
        rp->next = 1;
    }
    if (f->lsn + (f->cnt - 1) < rp->next)
        return 0; /* applied already: a resend */
    if (f->lsn <= rp->next) {
        int rc = fwd_apply_locked(s, f);
        if (f->cnt > 1)
            settle_locked(s, done);
        drain_locked(s, done);
        return rc;
    }
    struct fwdh **slot = &rp->win[f->lsn % rp->win_n];
    size_t old = *slot ? (*slot)->bytes : 0;
    if (f->lsn - rp->next >= rp->win_n || rp->hold_bytes - old + f->bytes > rp->hold_max)
        return -EAGAIN; /* too far ahead: the primary's channel retries */
    if (*slot) {
        /* a resend of the one held: the newer attempt is answered */
        rp->hold_bytes -= old;
        (*slot)->status = -EAGAIN;
        (*slot)->next = *done;
        *done = *slot;
    }
    *slot = f;
    rp->hold_bytes += f->bytes;
    s->st.fwd_held++;
    return BEX__PS_LATER;
}

int bex__ps_fwd_decode(bex_ps_shard *s, const uint8_t *push, size_t len, uint64_t lsn,
                       struct fwdh **out)
{
    struct bex__ps_hdr h;
    int rc = bex__ps_decode(BEX_PS_M_PUSH, push, len, &h);
    struct fwdh *f = rc ? NULL : calloc(1, sizeof *f);
    if (!rc && !f)
        rc = -ENOMEM;
    if (!rc)
        rc = bex__ps_push_read(s, &h, push + bex__ps_keys_off(&h), &f->t, &f->keys, &f->g);
    if (rc) {
        free(f);
        return rc;
    }
    f->lsn = lsn;
    f->cnt = 1;
    f->n = h.n;
    f->has_id = h.flags & BEX__PS_F_ID;
    /* the primary admitted the client: no new-client rate here */
    f->id = (struct pushid){.k = {h.id_client, {h.id_tok[0], h.id_tok[1]}}, .seq = h.id_seq};
    f->bytes = sizeof *f + (size_t)h.n * 8 + (size_t)h.n * h.dim * 4;
    *out = f;
    return 0;
}

/* A probe answered -ESTALE with the last lsn this backup applied. */
static int probe_behind(bex_ps_shard *s, bex_rpc_req *req, uint64_t pos)
{
    uint8_t *out = bex_rpc_alloc(s->rp.ctx, BEX__PS_POS_LEN);
    if (!out)
        return -ESTALE; /* answered without it: the primary probes again */
    bex__ps_put64(out, pos);
    bex_rpc_reply(req, -ESTALE, out, BEX__PS_POS_LEN);
    return BEX__PS_LATER;
}

int bex__ps_backup_forward(bex_ps_shard *s, const void *body, size_t len, bex_rpc_req *req)
{
    if (s->rp.role != BEX_PS_ROLE_BACKUP)
        return -EPERM;
    struct bex__ps_fwd_hdr fh;
    struct fwdh *f = NULL;
    int rc = bex__ps_fwd_get(body, len, &fh);
    const uint8_t *push = (const uint8_t *)body + BEX__PS_FWD_HDR_LEN;
    size_t plen = len - BEX__PS_FWD_HDR_LEN;
    if (rc == 0 && (fh.flags & BEX__PS_FWD_BATCH))
        rc = bex__ps_batch_decode(s, fh.lsn, push, plen, &f);
    else if (rc == 0)
        rc = bex__ps_fwd_decode(s, push, plen, fh.lsn, &f);
    if (rc)
        return rc;
    f->req = req;
    struct fwdh *done = NULL;
    pthread_mutex_lock(&s->mu);
    bool probe = fh.flags & BEX__PS_FWD_PROBE;
    if (s->rp.fenced && (rc = bex__ps_fenced_forward(s, fh.session)))
        ; /* a stale epoch, or one this backup has not copied from yet */
    else if (probe)
        /* in step: it follows that session and applied that lsn */
        rc = !bex__ps_shard_catching(s) && fh.session == s->rp.in_session && fh.lsn < s->rp.next
                 ? 0
                 : -ESTALE;
    else
        rc = fwd_take_locked(s, fh.session, f, &done);
    if (rc == -ESTALE && probe && s->rp.fenced && s->rp.state == RP_BACKUP &&
        fh.session == s->rp.epoch) {
        /* out of step with its primary (left out of the set): copy again */
        bex__ps_repl_move(s, RP_UNSYNCED);
        if (s->rp.kick)
            s->rp.kick(s->rp.kick_arg);
    }
    if (rc && rc != BEX__PS_LATER)
        s->st.fwd_refused++;
    /* static mode, behind in the session it follows: say where it is */
    uint64_t pos = s->rp.next - 1;
    bool say = rc == -ESTALE && probe && !s->rp.fenced && !bex__ps_shard_catching(s) &&
               fh.session == s->rp.in_session && fh.lsn >= s->rp.next;
    pthread_mutex_unlock(&s->mu);
    answer_all(done);
    if (rc != BEX__PS_LATER)
        bex__ps_fwdh_free(f);
    return say ? probe_behind(s, req, pos) : rc;
}

/* ---- etcd mode: a change of term (failover.c) ---- */

int bex__ps_repl_lead(bex_ps_shard *s, uint64_t epoch, struct bex__elect *el,
                      const bex_rpc_endpoint *backups, const bool *out, size_t n)
{
    struct repl *rp = &s->rp;
    if (n >= BEX_PS_REPLICAS_MAX)
        return -EINVAL;
    /* room for every backup: a replica may join during the term (join.c) */
    struct backup *bk = calloc(BEX_PS_BACKUPS_MAX, sizeof *bk);
    if (!bk)
        return -ENOMEM;
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        bk[i].addr = backups[i].addr;
        bk[i].transport = backups[i].transport;
        bk[i].state = out[i] ? BK_OUT : BK_UP; /* out: probed, and rejoins when in step */
        rc = bk_channel(rp, rp->ctx, &bk[i]);
    }
    struct backup *old = bk;
    size_t n_old = n;
    if (!rc) {
        pthread_mutex_lock(&s->mu);
        old = rp->bk;
        n_old = rp->n_bk;
        for (size_t i = 0; i < n_old; i++)
            bex__ps_batch_close_locked(&old[i]);
        rp->bk = bk;
        rp->n_bk = n;
        rp->n_down = 0;
        rp->epoch = rp->session = epoch;
        rp->lsn = 0;
        bex__ps_rlog_clear(&rp->log);
        rp->el = el;
        if (rp->state != RP_PRIMARY && rp->state != RP_PAUSED)
            bex__ps_repl_move(s, RP_PRIMARY);
        pthread_mutex_unlock(&s->mu);
    }
    /* an earlier term's forwards complete -ECANCELED: their Pushes are
     * refused (fenced_failed: not of this term) */
    for (size_t i = 0; i < n_old; i++) {
        if (old[i].ch)
            bex_rpc_channel_destroy(old[i].ch);
        bex__ps_batch_drain(&old[i], -ECANCELED);
    }
    free(old);
    return rc;
}

void bex__ps_repl_follow(bex_ps_shard *s, uint64_t epoch)
{
    struct repl *rp = &s->rp;
    struct fwdh *done = NULL;
    uint32_t b[BEX_PS_REPLICAS_MAX];
    pthread_mutex_lock(&s->mu);
    bool led = rp->state == RP_PRIMARY || rp->state == RP_PAUSED;
    rp->el = NULL;
    if (epoch > rp->epoch || led) {
        if (epoch > rp->epoch)
            rp->epoch = epoch;
        if (rp->state != RP_UNSYNCED)
            bex__ps_repl_move(s, RP_UNSYNCED);
        if (rp->win)
            drop_held_locked(rp, &done, -ESTALE);
    }
    pthread_mutex_unlock(&s->mu);
    answer_all(done);
    /* Pushes waiting for a removal are refused: this replica leads no more */
    size_t n = bex__ps_repl_removals(s, b, BEX_PS_REPLICAS_MAX);
    for (size_t i = 0; i < n; i++)
        bex__ps_repl_removed(s, b[i], -ESTALE);
}

int bex__ps_repl_pause(bex_ps_shard *s, uint32_t wait_ms)
{
    uint64_t end = bex__rpc_now_ns() + (uint64_t)wait_ms * 1000000ull;
    pthread_mutex_lock(&s->mu);
    if (s->rp.state == RP_PRIMARY)
        bex__ps_repl_move(s, RP_PAUSED);
    /* a Push waiting for a removal (the agent's, who pauses) ends the wait */
    while (s->rp.inflight && !s->rp.rm && bex__rpc_now_ns() < end) {
        pthread_mutex_unlock(&s->mu);
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&s->mu);
    }
    int rc = !s->rp.inflight ? 0 : s->rp.rm ? -EBUSY : -ETIMEDOUT;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void bex__ps_repl_resume(bex_ps_shard *s)
{
    pthread_mutex_lock(&s->mu);
    if (s->rp.state == RP_PAUSED)
        bex__ps_repl_move(s, RP_PRIMARY);
    pthread_mutex_unlock(&s->mu);
}

int bex__ps_repl_probe(bex_ps_shard *s, uint32_t b)
{
    struct repl *rp = &s->rp;
    size_t len = BEX__PS_FWD_HDR_LEN + BEX__PS_HDR_LEN;
    pthread_mutex_lock(&s->mu);
    struct bex__ps_fwd_hdr fh = {
        .session = rp->session, .lsn = rp->lsn, .flags = BEX__PS_FWD_PROBE};
    bex_rpc_channel *ch = b < rp->n_bk ? rp->bk[b].ch : NULL;
    pthread_mutex_unlock(&s->mu);
    uint8_t *body = ch ? bex_rpc_alloc(rp->ctx, len) : NULL;
    if (!body)
        return ch ? -ENOMEM : -EINVAL;
    bex__ps_fwd_put(body, &fh);
    const bex_ps_table_config *t = &s->tables[0].cfg;
    bex__ps_hdr_put(body + BEX__PS_FWD_HDR_LEN,
                    &(struct bex__ps_hdr){.table = t->id, .n = 0, .dim = t->dim});
    bex_rpc_call_opts o = {.timeout_ms = rp->fwd_timeout_ms};
    void *resp = NULL;
    int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, BEX_PS_M_FORWARD, body, len, &o, &resp, NULL);
    bex_rpc_free(resp);
    return rc;
}
