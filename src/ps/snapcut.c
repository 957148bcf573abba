/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: its side of a consistent cut of the whole model
 * (BEX_PS_M_CUT; docs/architecture.md, "Snapshots").
 *
 * PREPARE(id): from now on a Push reaching the registered handler is
 * held (queued with its request, never failed); the Pushes already past
 * the handler's door are waited for (a count, checked against the
 * holding flag Dekker-style: a Push either sees the flag and queues, or
 * PREPARE sees it counted and waits); then, under the shard's lock, the
 * shard's rows changed since its last cut (or all) and the ids of the
 * Pushes applied are copied into a buffer, and a thread takes over.
 * COMMIT(id) wakes it: it releases the Pushes held (serves them in their
 * order; Pushes arriving meanwhile queue behind them), writes the file and
 * answers COMMIT. No COMMIT within cut_pause_ms, too many bytes held, or
 * ABORT: the thread releases the Pushes and the cut is void (the next one
 * is full: its changed rows were not written). */
#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bex/ps.h"
#include "common/fault.h"
#include "common/log.h"
#include "common/util.h"
#include "ps/ps_internal.h"
#include "ps/shard_internal.h"
#include "rpc/internal.h"

#define CUT_PAUSE_MS     50u
#define CUT_PAUSE_MS_MAX 60000u
#define CUT_HOLD_MAX     (64ull << 20)
#define CUT_FULL_EVERY   8u
#define CUT_MIN_IV_MS    100u
#define JOIN_PAUSE_MS    10000u
#define JOIN_PAUSE_MAX   600000u

/* A cut's life (docs/architecture.md, "Lifecycles"), under s->mu;
 * changed only by cut_move. IDLE; PREPARING (PREPARE or JOIN claimed it:
 * the last cut's thread joined, the door drained, the copy made); HELD
 * (the Pushes held, the thread waits for COMMIT); COMMITTED (COMMIT or
 * JOINED taken); ABORTED (ABORT, too many bytes held, no memory for a
 * held Push: the cut is void, and PREPARE never moves on from it);
 * RELEASING (the thread releases the Pushes and writes the file, or voids
 * the cut); CLOSING (the shard is going: what is under way ends, nothing
 * starts) and CLOSED, the end. */
enum cut_state {
    CUT_IDLE,
    CUT_PREPARING,
    CUT_HELD,
    CUT_COMMITTED,
    CUT_ABORTED,
    CUT_RELEASING,
    CUT_CLOSING,
    CUT_CLOSED,
};

/* A Push held for a cut. */
struct cutq {
    struct cutq *next;
    struct reg *r;
    bex_rpc_req *req;
    void *body;
    size_t len;
};

struct cut {
    char *dir; /* NULL: cuts refused */
    uint64_t pause_ns, hold_max, min_iv_ns;
    uint32_t full_every;
    pthread_cond_t cv; /* CLOCK_MONOTONIC: the door drained, COMMIT, ABORT */
    _Atomic uint32_t inflight;
    _Atomic bool holding;
    /* under s->mu */
    enum cut_state state; /* cut_move */
    uint64_t id, last_id, prep_ns, prep_unix, last_prep_ns, deadline, join_ns;
    bool join;            /* this hold is a backup's join, not a cut */
    bex_rpc_endpoint jep; /* join: the new backup */
    uint32_t since_full;  /* incremental cuts since the last full */
    bool need_full, full;
    struct cutq *q, **qtail;
    uint64_t q_bytes, q_n, rows;
    char *buf;
    size_t len;
    bex_rpc_req *commit_req; /* not NULL: COMMIT (JOINED) taken for this id */
    bex_ctx *ctx;
    pthread_t th;
    bool th_live;
    /* the last snapshot or cut written (bex_ps_shard_stats) */
    uint64_t snap_id, snap_unix, snap_write_ns, snap_pause_ns, snaps, failures, snap_rows;
};

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t unix_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

const char *bex__ps_cut_state_name(unsigned st)
{
    static const char *const names[] = {
        [CUT_IDLE] = "IDLE",           [CUT_PREPARING] = "PREPARING", [CUT_HELD] = "HELD",
        [CUT_COMMITTED] = "COMMITTED", [CUT_ABORTED] = "ABORTED",     [CUT_RELEASING] = "RELEASING",
        [CUT_CLOSING] = "CLOSING",     [CUT_CLOSED] = "CLOSED"};
    return st < ARRAY_SIZE(names) ? names[st] : "?";
}

/* The moves of docs/architecture.md's table. */
static bool cut_move_ok(enum cut_state from, enum cut_state to)
{
    if (to == CUT_CLOSING) /* the shard going, from a cut under way */
        return from != CUT_IDLE && from != CUT_CLOSING && from != CUT_CLOSED;
    switch (from) {
    case CUT_IDLE:
        return to == CUT_PREPARING || to == CUT_CLOSED;
    case CUT_PREPARING:
        return to == CUT_HELD || to == CUT_ABORTED || to == CUT_IDLE;
    case CUT_HELD:
        return to == CUT_COMMITTED || to == CUT_ABORTED || to == CUT_RELEASING;
    case CUT_COMMITTED:
        return to == CUT_ABORTED || to == CUT_RELEASING;
    case CUT_ABORTED:
        return to == CUT_RELEASING || to == CUT_IDLE;
    case CUT_RELEASING:
        return to == CUT_IDLE;
    case CUT_CLOSING:
        return to == CUT_CLOSED;
    case CUT_CLOSED:
        return false;
    }
    return false;
}

/* The one place c->state changes (under s->mu): asserts the move is one
 * of the table's, logs it by name (DEBUG), wakes the waiters on c->cv. */
static void cut_move(bex_ps_shard *s, enum cut_state to)
{
    struct cut *c = s->cut;
    enum cut_state from = c->state;
    bool ok = cut_move_ok(from, to);
    assert(ok);
    (void)ok;
    c->state = to;
    pthread_cond_broadcast(&c->cv);
    if (s->log.level >= BEX_LOG_DEBUG)
        bex__log(&s->log, BEX_LOG_DEBUG, "ps shard %u: cut %" PRIu64 " %s -> %s", s->shard, c->id,
                 bex__ps_cut_state_name(from), bex__ps_cut_state_name(to));
}

/* The cut under way is void (under s->mu): ABORTED, unless it is past
 * that (its thread decided already, or the shard is going). */
static void cut_void_locked(bex_ps_shard *s)
{
    enum cut_state st = s->cut->state;
    if (st == CUT_PREPARING || st == CUT_HELD || st == CUT_COMMITTED)
        cut_move(s, CUT_ABORTED);
}

/* A cut's end (under s->mu): IDLE, or CLOSED when the shard is going. */
static void cut_end_locked(bex_ps_shard *s)
{
    cut_move(s, s->cut->state == CUT_CLOSING ? CUT_CLOSED : CUT_IDLE);
}

/* Wait on c->cv until at (monotonic ns), at most. */
static void wait_until(bex_ps_shard *s, uint64_t at)
{
    struct timespec ts = {(time_t)(at / 1000000000ull), (long)(at % 1000000000ull)};
    pthread_cond_timedwait(&s->cut->cv, &s->mu, &ts);
}

int bex__ps_cut_init(bex_ps_shard *s, const bex_ps_shard_config *cfg)
{
    if (cfg->cut_pause_ms > CUT_PAUSE_MS_MAX || cfg->join_pause_ms > JOIN_PAUSE_MAX ||
        (cfg->restore_cut && !cfg->cut_dir))
        return -EINVAL;
    struct cut *c = calloc(1, sizeof *c);
    if (!c || (cfg->cut_dir && !(c->dir = strdup(cfg->cut_dir)))) {
        free(c);
        return -ENOMEM;
    }
    c->pause_ns = (uint64_t)(cfg->cut_pause_ms ? cfg->cut_pause_ms : CUT_PAUSE_MS) * 1000000ull;
    c->hold_max = cfg->cut_hold_max ? cfg->cut_hold_max : CUT_HOLD_MAX;
    c->full_every = cfg->cut_full_every ? cfg->cut_full_every : CUT_FULL_EVERY;
    c->min_iv_ns = (uint64_t)(cfg->cut_min_interval_ms ? cfg->cut_min_interval_ms : CUT_MIN_IV_MS) *
                   1000000ull;
    c->join_ns = (uint64_t)(cfg->join_pause_ms ? cfg->join_pause_ms : JOIN_PAUSE_MS) * 1000000ull;
    c->qtail = &c->q;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    s->cut = c;
    if (!cfg->restore_cut)
        return 0;
    uint32_t chain = 0;
    int rc = bex__ps_cut_restore(s, c->dir, cfg->restore_cut, &chain);
    if (rc == 0) {
        /* the shard is that cut: the next may be incremental to it */
        c->last_id = cfg->restore_cut;
        c->since_full = chain - 1;
    }
    return rc;
}

void bex__ps_cut_stop(bex_ps_shard *s)
{
    struct cut *c = s->cut;
    pthread_mutex_lock(&s->mu);
    if (c->state == CUT_IDLE)
        cut_move(s, CUT_CLOSED);
    else if (c->state != CUT_CLOSING && c->state != CUT_CLOSED)
        cut_move(s, CUT_CLOSING); /* a cut under way ends now */
    pthread_mutex_unlock(&s->mu);
}

void bex__ps_cut_fini(bex_ps_shard *s)
{
    struct cut *c = s->cut;
    if (!c)
        return;
    bex__ps_cut_stop(s);
    pthread_mutex_lock(&s->mu);
    while (c->state != CUT_CLOSED) /* the cut under way ends: CLOSING -> CLOSED */
        pthread_cond_wait(&c->cv, &s->mu);
    bool join = c->th_live;
    pthread_mutex_unlock(&s->mu);
    if (join)
        pthread_join(c->th, NULL);
    pthread_cond_destroy(&c->cv);
    free(c->dir);
    free(c);
    s->cut = NULL;
}

bool bex__ps_cut_hold(bex_ps_shard *s, struct reg *r, bex_rpc_req *req, void *body, size_t len)
{
    struct cut *c = s->cut;
    atomic_fetch_add(&c->inflight, 1);
    if (!atomic_load(&c->holding))
        return false; /* the common case: no cut */
    struct cutq *e = malloc(sizeof *e);
    pthread_mutex_lock(&s->mu);
    if (!atomic_load(&c->holding) || !e) {
        if (!e)
            cut_void_locked(s); /* served now, inside the cut: it is void */
        pthread_mutex_unlock(&s->mu);
        free(e);
        return false;
    }
    if (atomic_fetch_sub(&c->inflight, 1) == 1)
        pthread_cond_broadcast(&c->cv);
    *e = (struct cutq){NULL, r, req, body, len};
    *c->qtail = e;
    c->qtail = &e->next;
    c->q_n++;
    if ((c->q_bytes += len) > c->hold_max)
        cut_void_locked(s); /* Pushes are not failed: the cut gives way */
    pthread_mutex_unlock(&s->mu);
    return true;
}

void bex__ps_cut_done(bex_ps_shard *s)
{
    struct cut *c = s->cut;
    if (atomic_fetch_sub(&c->inflight, 1) == 1 && atomic_load(&c->holding)) {
        pthread_mutex_lock(&s->mu);
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&s->mu);
    }
}

/* Serve the Pushes held, in order, until none is (under s->mu, released
 * while serving); then no Push is held any more. */
static void release_locked(bex_ps_shard *s)
{
    struct cut *c = s->cut;
    for (;;) {
        struct cutq *q = c->q;
        c->q = NULL;
        c->qtail = &c->q;
        c->q_bytes = 0;
        if (!q) {
            atomic_store(&c->holding, false);
            return;
        }
        pthread_mutex_unlock(&s->mu);
        while (q) {
            struct cutq *nx = q->next;
            bex__ps_handle(q->r, q->req, q->body, q->len);
            free(q);
            q = nx;
        }
        pthread_mutex_lock(&s->mu);
    }
}

/* buf into the cut's file (through .tmp and a rename). */
static int write_file(bex_ps_shard *s, uint64_t id, const char *buf, size_t len)
{
    char path[4096], tmp[4100];
    int rc = bex__ps_cut_path(path, sizeof path, s->cut->dir, s->shard, id);
    if (rc)
        return rc;
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f)
        return -errno;
    if (fwrite(buf, 1, len, f) != len || fflush(f) || fsync(fileno(f)))
        rc = errno ? -errno : -EIO;
    if (fclose(f) && !rc)
        rc = -EIO;
    if (!rc && rename(tmp, path))
        rc = -errno;
    if (rc) {
        unlink(tmp);
        bex__log(&s->log, BEX_LOG_ERROR, "ps shard %u: cut %" PRIu64 " not written to %s: %s",
                 s->shard, id, path, bex_strerror(rc));
    }
    return rc;
}

/* COMMIT's answer: the cut's id, pause, Pushes held, rows and kind. */
struct outcome {
    uint64_t id, pause, held, rows;
    bool full;
};

static void answer_commit(bex_ps_shard *s, bex_rpc_req *req, int rc, const struct outcome *oc)
{
    uint8_t *out = rc ? NULL : bex_rpc_alloc(s->cut->ctx, BEX__PS_CUT_ANS_LEN);
    if (!rc && !out)
        rc = -ENOMEM;
    if (out) {
        bex__ps_cut_put(out, &(struct bex__ps_cut_hdr){.op = BEX__PS_CUT_COMMIT, .id = oc->id});
        bex__ps_put64(out + 16, oc->pause);
        bex__ps_put64(out + 24, oc->held);
        bex__ps_put64(out + 32, oc->rows);
        bex__ps_put32(out + 40, oc->full);
        bex__ps_put32(out + 44, 0);
    }
    bex_rpc_reply(req, rc, out, out ? BEX__PS_CUT_ANS_LEN : 0);
}

/* A join's end (under s->mu; the cut's thread): the new backup added
 * when it copied the shard and said JOINED, then the Pushes released,
 * then JOINED answered. */
static void *join_end(bex_ps_shard *s, bool ok)
{
    struct cut *c = s->cut;
    int rc = ok ? bex__ps_join_add_locked(s, &c->jep) : -ETIMEDOUT;
    if (rc)
        bex__log(&s->log, BEX_LOG_WARN,
                 "ps shard %u: a backup's join ended without it (%s): Pushes released", s->shard,
                 bex_strerror(rc));
    release_locked(s);
    bex_rpc_req *req = c->commit_req;
    cut_end_locked(s);
    pthread_mutex_unlock(&s->mu);
    if (req)
        bex_rpc_reply(req, rc, NULL, 0);
    return NULL;
}

/* A void cut (under s->mu; its state st when the thread woke): logged
 * and counted before its Pushes go, so that whoever sees them served sees
 * it too; the next cut is full. */
static void void_locked(bex_ps_shard *s, enum cut_state st)
{
    struct cut *c = s->cut;
    bex__log(&s->log, BEX_LOG_WARN,
             "ps shard %u: cut %" PRIu64 " aborted (%s): Pushes released, the next cut is full",
             s->shard, c->id,
             st == CUT_ABORTED   ? "aborted or too many bytes held"
             : st == CUT_CLOSING ? "the shard is going"
                                 : "no COMMIT in time");
    bex__ps_snap_written_locked(s, c->id, c->prep_unix, 0, 0, 0, -ETIMEDOUT);
    c->need_full = true;
}

/* Under s->mu, the Pushes released: the copy into the cut's file (the
 * lock released meanwhile). 0 or the write's error. */
static int write_locked(bex_ps_shard *s, const struct outcome *oc)
{
    struct cut *c = s->cut;
    char *buf = c->buf;
    size_t len = c->len;
    uint64_t unix0 = c->prep_unix;
    c->buf = NULL;
    pthread_mutex_unlock(&s->mu);
    uint64_t t0 = mono_ns();
    int rc = write_file(s, oc->id, buf, len);
    uint64_t wns = mono_ns() - t0;
    free(buf);
    pthread_mutex_lock(&s->mu);
    bex__ps_snap_written_locked(s, oc->id, unix0, wns, oc->pause, oc->rows, rc);
    if (rc == 0) {
        c->since_full = oc->full ? 0 : c->since_full + 1;
        c->last_id = oc->id;
        c->need_full = false;
    } else {
        c->need_full = true;
    }
    return rc;
}

/* The cut's thread: waits for COMMIT (or the pause's end), releases the
 * Pushes, writes the file, answers COMMIT. */
static void *cut_main(void *arg)
{
    bex_ps_shard *s = arg;
    struct cut *c = s->cut;
    pthread_mutex_lock(&s->mu);
    while (c->state == CUT_HELD && mono_ns() < c->deadline)
        wait_until(s, c->deadline);
    enum cut_state st = c->state;
    bool ok = st == CUT_COMMITTED;
    if (st != CUT_CLOSING)
        cut_move(s, CUT_RELEASING);
    if (c->join)
        return join_end(s, ok);
    if (!ok)
        void_locked(s, st);
    release_locked(s);
    struct outcome oc = {c->id, mono_ns() - c->prep_ns, c->q_n, c->rows, c->full};
    bex_rpc_req *req = c->commit_req;
    int rc = ok ? write_locked(s, &oc) : -ETIMEDOUT;
    if (!ok) {
        free(c->buf);
        c->buf = NULL;
    }
    cut_end_locked(s);
    pthread_mutex_unlock(&s->mu);
    if (req)
        answer_commit(s, req, rc, &oc);
    return NULL;
}

/* Under s->mu, holding: the Pushes past the door applied, then the copy.
 * 0 or the reason the cut cannot be (it is then void). */
static int take_locked(bex_ps_shard *s, uint32_t flags)
{
    struct cut *c = s->cut;
    uint64_t deadline = c->deadline;
    while (atomic_load(&c->inflight) && c->state == CUT_PREPARING && mono_ns() < deadline) {
        uint64_t at = mono_ns() + 1000000ull; /* a safety net: done() broadcasts */
        wait_until(s, at < deadline ? at : deadline);
    }
    if (c->state != CUT_PREPARING) /* the shard going; ABORT or a bound: void */
        return c->state == CUT_CLOSING ? -ECANCELED : -ETIMEDOUT;
    if (atomic_load(&c->inflight))
        return -ETIMEDOUT;
    if (c->join)
        return 0; /* the new backup copies the shard now (COPY) */
    c->full = c->need_full || !c->last_id || c->since_full + 1 >= c->full_every ||
              (flags & BEX__PS_CUT_F_FULL);
    int rc = bex__ps_cut_make(s, c->id, c->full ? 0 : c->last_id, &c->buf, &c->len, &c->rows);
    if (rc)
        c->need_full = true; /* marks cleared, rows not kept */
    return rc;
}

/* Whether a cut or join may start now (under s->mu): 0, 1 (this one is
 * under way already: a resend) or the refusal. */
static int may_start_locked(bex_ps_shard *s, const struct bex__ps_cut_hdr *h,
                            const bex_rpc_endpoint *jep)
{
    struct cut *c = s->cut;
    if (bex__ps_shard_catching(s))
        return -EAGAIN;
    if (c->state == CUT_CLOSING || c->state == CUT_CLOSED)
        return -ECANCELED; /* the shard is going */
    if (c->state != CUT_IDLE)
        return (c->state == CUT_HELD || c->state == CUT_COMMITTED) && c->id == h->id ? 1 : -EBUSY;
    if (c->last_prep_ns && mono_ns() - c->last_prep_ns < c->min_iv_ns)
        return -EBUSY;
    return jep ? bex__ps_join_check_locked(s, jep) : 0;
}

/* Under s->mu, PREPARING, the last cut's thread joined: hold the Pushes,
 * take the copy and start the cut's thread (HELD); else the Pushes are
 * released and the cut is over (IDLE; CLOSED when the shard is going). */
static int hold_locked(bex_ps_shard *s, bex_ctx *ctx, const struct bex__ps_cut_hdr *h,
                       const bex_rpc_endpoint *jep)
{
    struct cut *c = s->cut;
    if (c->state != CUT_PREPARING) { /* ABORT: void; the shard going: it stays so */
        int rc = c->state == CUT_CLOSING ? -ECANCELED : -ETIMEDOUT;
        cut_end_locked(s);
        return rc;
    }
    c->prep_ns = c->last_prep_ns = mono_ns();
    c->deadline = c->prep_ns + (jep ? c->join_ns : c->pause_ns);
    c->prep_unix = unix_ns();
    c->join = jep != NULL;
    if (jep)
        c->jep = *jep;
    c->q_n = c->rows = 0;
    c->ctx = ctx;
    atomic_store(&c->holding, true);
    int rc = take_locked(s, h->flags);
    if (!rc && (rc = -pthread_create(&c->th, NULL, cut_main, s)) == 0) {
        c->th_live = true;
        cut_move(s, CUT_HELD); /* the thread waits for the lock meanwhile */
        return 0;
    }
    free(c->buf);
    c->buf = NULL;
    c->need_full |= !jep;
    c->failures += !jep;
    release_locked(s);
    cut_end_locked(s);
    return rc;
}

/* PREPARE (jep NULL) or JOIN (jep: the new backup): hold the Pushes. */
static int prepare(bex_ps_shard *s, bex_ctx *ctx, const struct bex__ps_cut_hdr *h,
                   const bex_rpc_endpoint *jep)
{
    struct cut *c = s->cut;
    if (!c->dir && !jep)
        return -ENOTSUP;
    pthread_mutex_lock(&s->mu);
    int rc = may_start_locked(s, h, jep);
    bool join = !rc && c->th_live;
    if (!rc) {
        c->id = h->id;
        c->commit_req = NULL;
        c->th_live = false;
        cut_move(s, CUT_PREPARING); /* an ABORT or a stop may come in now */
    }
    pthread_mutex_unlock(&s->mu);
    if (rc)
        return rc == 1 ? 0 : rc; /* 1: this cut is prepared already (a resend) */
    /* tests: a stop lands here */
    (void)BEX__FAULT(BEX__FAULT_CUT_PREP);
    if (join)
        pthread_join(c->th, NULL); /* the last cut's, done */
    pthread_mutex_lock(&s->mu);
    rc = hold_locked(s, ctx, h, jep);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* COMMIT or ABORT of cut h->id. */
static int finish(bex_ps_shard *s, const struct bex__ps_cut_hdr *h, bex_rpc_req *req)
{
    struct cut *c = s->cut;
    if ((h->op == BEX__PS_CUT_COMMIT || h->op == BEX__PS_CUT_JOINED) && !req)
        return -EOPNOTSUPP; /* answered when done: needs the handler */
    pthread_mutex_lock(&s->mu);
    int rc = 0;
    if (h->op == BEX__PS_CUT_ABORT) {
        if (c->id == h->id) /* a cut under way (else nothing) */
            cut_void_locked(s);
    } else if (c->state != CUT_HELD || c->id != h->id || c->join != (h->op == BEX__PS_CUT_JOINED)) {
        /* its pause ran out (or it was aborted): the cut is void; or a
         * COMMIT again, or of another cut */
        rc = c->id == h->id && !c->commit_req ? -ETIMEDOUT : -ESTALE;
    } else {
        c->commit_req = req;
        cut_move(s, CUT_COMMITTED);
        rc = BEX__PS_LATER;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int bex__ps_cut_serve(bex_ps_shard *s, bex_ctx *ctx, const void *body, size_t len, bex_rpc_req *req,
                      void **resp, size_t *resp_len)
{
    struct bex__ps_cut_hdr h;
    bex_rpc_endpoint jep;
    if (bex__ps_cut_get(body, len, &h) ||
        (h.op == BEX__PS_CUT_JOIN ? len != BEX__PS_JOIN_LEN && len != BEX__PS_JOIN6_LEN
                                  : len != BEX__PS_CUT_HDR_LEN))
        return -EINVAL;
    bool fenced = false;
    int rc = 0;
    if (h.op == BEX__PS_CUT_JOIN) {
        bex__ps_join_endpoint((const uint8_t *)body + BEX__PS_CUT_HDR_LEN,
                              len - BEX__PS_CUT_HDR_LEN, &jep);
        rc = bex__ps_join_fenced(s, h.id, &jep, &fenced); /* etcd mode: no hold */
    }
    if (!fenced)
        rc = h.op == BEX__PS_CUT_PREPARE || h.op == BEX__PS_CUT_JOIN
                 ? prepare(s, ctx, &h, h.op == BEX__PS_CUT_JOIN ? &jep : NULL)
                 : finish(s, &h, req);
    if (rc)
        return rc;
    uint8_t *out = bex_rpc_alloc(ctx, BEX__PS_CUT_HDR_LEN);
    if (!out)
        return -ENOMEM;
    bex__ps_cut_put(out, &h);
    *resp = out;
    *resp_len = BEX__PS_CUT_HDR_LEN;
    return 0;
}

void bex__ps_cut_forget_locked(bex_ps_shard *s)
{
    if (s->cut)
        s->cut->need_full = true;
}

void bex__ps_snap_written_locked(bex_ps_shard *s, uint64_t id, uint64_t t0_unix, uint64_t write_ns,
                                 uint64_t pause_ns, uint64_t rows, int rc)
{
    struct cut *c = s->cut;
    if (rc) {
        c->failures++;
        return;
    }
    c->snaps++;
    c->snap_id = id;
    c->snap_unix = t0_unix;
    c->snap_write_ns = write_ns;
    c->snap_pause_ns = pause_ns;
    c->snap_rows = rows;
}

void bex__ps_cut_stats_locked(const bex_ps_shard *s, bex_ps_shard_stats *out)
{
    const struct cut *c = s->cut;
    out->snap_id = c->snap_id;
    out->snap_unix_ns = c->snap_unix;
    out->snap_write_ns = c->snap_write_ns;
    out->snap_pause_ns = c->snap_pause_ns;
    out->snaps = c->snaps;
    out->snap_failures = c->failures;
    out->snap_rows = c->snap_rows;
}
