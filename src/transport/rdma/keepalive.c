/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA engine: keepalive, stall detection and failure (split from
 * engine.c along its banner). See engine.h. */
#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/engine_internal.h"

/* The peer broke the protocol: say how, once (the engine fails after). */
__attribute__((format(printf, 2, 3))) int bex__engine_violation(struct bex__engine *e,
                                                                const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return bex__stream_violation(e->sh->log, e->name, "RDMA", &e->said, msg);
}

/* ---------------- keepalive and failure ---------------- */

/* A live peer that stops answering: keepalive goes on, but our rendezvous
 * requests or the credits our sends wait for never come. Fail the engine
 * with -ETIMEDOUT rather than hold those sends forever. */
static bool stalled(struct bex__engine *e, uint64_t now)
{
    if (e->cfg.rndv_timeout_ms && e->rout_used) {
        for (uint32_t i = 0; i < e->max_rndv; i++) {
            if (e->rout[i].used && now - e->rout[i].sent_ms > e->cfg.rndv_timeout_ms) {
                bex__log(e->sh->log, BEX_LOG_ERROR,
                         "%s: a rendezvous request got no answer in %u ms", e->name,
                         e->cfg.rndv_timeout_ms);
                bex__engine_fail(e, -ETIMEDOUT);
                return true;
            }
        }
    }
    if (!bex__engine_have_credit(e, false) && (e->streams.ring_n || e->ctl_n)) {
        if (!e->credit_wait) {
            e->credit_wait = now;
        } else if (e->cfg.credit_timeout_ms && now - e->credit_wait > e->cfg.credit_timeout_ms) {
            bex__log(e->sh->log, BEX_LOG_ERROR,
                     "%s: sends waited %u ms for credits the peer never returned", e->name,
                     e->cfg.credit_timeout_ms);
            bex__engine_fail(e, -ETIMEDOUT);
            return true;
        }
    } else {
        e->credit_wait = 0;
    }
    /* the peer takes our messages but never returns their credits (timed
     * by the tick, not stamped per message: no clock read on the data path) */
    if (!e->ack_head || !e->ack_wait_ms || e->ack_mark != e->cons_acked) {
        e->ack_wait_ms = e->ack_head ? now : 0;
        e->ack_mark = e->cons_acked;
    } else if (e->cfg.credit_timeout_ms && now - e->ack_wait_ms > e->cfg.credit_timeout_ms) {
        bex__log(e->sh->log, BEX_LOG_ERROR,
                 "%s: sent messages waited %u ms for the credits that acknowledge them", e->name,
                 e->cfg.credit_timeout_ms);
        bex__engine_fail(e, -ETIMEDOUT);
        return true;
    }
    return false;
}

/* A work request posted and never completed: a peer whose hello granted
 * credits for receives it never posts has our SEND NAKed for want of a
 * receive (RNR), and at qp_rnr_retry 7 the NIC retries it forever while
 * the peer's keepalive goes on. Timed by the tick, as the acknowledgements
 * are: the same credit_timeout_ms, since the peer withholds what a credit
 * promised. */
static bool post_stalled(struct bex__engine *e, uint64_t now)
{
    /* timed while a signaled request is pending: unsignaled ones alone are
     * retired by one the tick posts (retire_quiet), which is timed then */
    bool pending = (int32_t)(e->sig_end - e->head) > 0;
    if (!pending || !e->post_wait_ms || e->post_mark != e->head) {
        e->post_wait_ms = pending ? now : 0;
        e->post_mark = e->head;
        return false;
    }
    if (!e->cfg.credit_timeout_ms || now - e->post_wait_ms <= e->cfg.credit_timeout_ms)
        return false;
    char what[96];
    bex__engine_describe_send(e, e->head & WR_CNT_MASK, what, sizeof what);
    bex__log(e->sh->log, BEX_LOG_ERROR,
             "%s: a %s has not completed in %u ms: the peer takes none (no receive posted for the "
             "credits it granted?)",
             e->name, what, e->cfg.credit_timeout_ms);
    bex__engine_fail(e, -ETIMEDOUT);
    return true;
}

/* Requests posted unsignaled and nothing signaled pending to retire them
 * (bex__engine_post_pending): the next chain goes signaled; if none has
 * come by the next tick, a keepalive write (always signaled) retires them,
 * so that their slots and bytes come back on an engine gone quiet. */
static void retire_quiet(struct bex__engine *e)
{
    if (e->state != E_UP || e->head == e->post || (int32_t)(e->sig_end - e->head) > 0)
        return;
    if (!e->sig_force) {
        e->sig_force = true;
        return;
    }
    e->ka_due = true;
    bex__engine_alone_sync(e);
    if (!bex__engine_wops_hold(e)) {
        bex__engine_prep_keepalive(e);
        bex__engine_post_pending(e);
    }
}

/* A granted destination must be written within rate_window_ms +
 * len / min_rate of its grant, or of the last destination written if that
 * is later: a peer granted destinations that it never writes holds the
 * context's receive budget (the keepalive goes on). Counting from the last
 * delivery lets an honest sender that writes its grants one after another,
 * paced by its send window, through. Grants and deliveries are stamped
 * here, on the tick after they happen (one clock: the tick's). Whether
 * one is late. */
static bool grants_stalled(struct bex__engine *e, uint64_t now)
{
    /* receives not reposted for want of room: the peer may lack the credit
     * its WRITE_WITH_IMM takes, and that time is ours, not its */
    if (e->rin_done != e->rin_done_seen || e->n_starved) {
        e->rin_done_seen = e->rin_done;
        e->rin_done_ms = now;
    }
    if (!e->cfg.min_rate || !e->rin_bytes)
        return false;
    for (uint32_t i = 0; i < e->max_rndv; i++) {
        struct rndv_in *in = &e->rin[i];
        if (!in->used || !in->granted)
            continue;
        if (in->granted_gen != (in->gen | 0x8000)) {
            in->granted_gen = in->gen | 0x8000;
            in->granted_ms = now;
        }
        uint64_t from = in->granted_ms > e->rin_done_ms ? in->granted_ms : e->rin_done_ms;
        uint64_t allow = e->cfg.rate_window_ms + (uint64_t)in->len * 1000 / e->cfg.min_rate;
        if (now > from && now - from > allow) {
            bex__log(e->sh->log, BEX_LOG_ERROR,
                     "%s: a granted rendezvous destination of %u bytes not written in %llu ms "
                     "(recv_min_rate %u bytes/s, recv_rate_ms %u)",
                     e->name, in->len, (unsigned long long)(now - from), e->cfg.min_rate,
                     e->cfg.rate_window_ms);
            return true;
        }
    }
    return false;
}

/* Has the engine anything a progress call could move, anything in flight,
 * or messages waiting for the peer's acknowledgement (their wait is timed
 * by the tick)? An engine with none of it is idle: its tick leaves it
 * alone. (Receives consumed and not yet reposted are not such work: they
 * go back in batches of k from the completion path, and a few may wait
 * there on an idle engine for good.) */
bool bex__engine_busy(const struct bex__engine *e)
{
    return bex__engine_work(e) || e->ack_head;
}

/* The same less the acknowledgement queue: what a send completion asks a
 * progress call for (the acknowledgement comes with a receive, which asks
 * for its own; test_iothreads.echo_visits counts the calls). */
bool bex__engine_work(const struct bex__engine *e)
{
    return e->streams.ring_n || e->ctl_n || e->rel_n || e->wq_n || e->wop_busy || e->ka_due ||
           (e->acks_owed && e->to_return) || e->head != e->tail || e->post != e->tail ||
           e->n_starved || e->to_return >= e->k || e->rout_used || e->rin_used || e->wait_n;
}

bool bex__engine_tick_soon(const struct bex__engine *e)
{
    return e->state == E_UP && (e->n_starved || e->wait_n || e->rin_used || e->rout_used ||
                                e->streams.ring_n || e->ctl_n || e->rel_n || e->wq_n);
}

bool bex__engine_tick(struct bex__engine *e, uint64_t now)
{
    bex__engine_hold_sync(e);
    if (e->state != E_UP)
        return false;
    uint64_t seen = __atomic_load_n(e->ka_local, __ATOMIC_ACQUIRE);
    if (seen != e->ka_seen || e->peer_heard) {
        /* the sequence advanced, or the peer's messages arrived: alive */
        e->ka_seen = seen;
        e->ka_last_ms = now;
        e->peer_heard = false;
    } else if (now - e->ka_last_ms > e->cfg.keepalive_timeout_ms) {
        bex__log(e->sh->log, BEX_LOG_ERROR, "%s: keepalive timeout (%u ms)", e->name,
                 e->cfg.keepalive_timeout_ms);
        BEX__STAT_ADD(e->stats, keepalive_fails, 1);
        bex__engine_fail(e, -ETIMEDOUT);
        return true;
    }
    if (stalled(e, now) || post_stalled(e, now))
        return true;
    if (grants_stalled(e, now)) {
        bex__engine_fail(e, -ETIMEDOUT);
        return true;
    }
    /* received memory the application freed lets starved receives and
     * deferred rendezvous answers go on */
    if (e->n_starved) {
        bex__engine_refill_starved(e);
        if (e->n_unposted >= e->k || (e->n_starved == 0 && e->n_unposted))
            bex__engine_repost_recvs(e);
        if (e->state != E_UP)
            return true;
    }
    int rc = bex__engine_rndv_resume(e);
    if (rc) {
        bex__engine_fail(e, rc);
        return true;
    }
    /* A peer that hears from us counts it as our keepalive (peer_heard),
     * so while we post messages the write is put off: at 1024 connections
     * with one message each in flight the writes were 0.4 extra doorbells
     * and signaled completions per message (docs/benchmarks.md). Quiet for
     * keepalive_ms (to within a tick), we write again. An idle engine
     * ticks once per keepalive_ms (conn/timers.c), each tick a little
     * early or late: an eighth of the period early is on time. */
    if (e->peer_hears) {
        e->peer_hears = false;
        e->ka_next_ms = now + e->cfg.keepalive_ms;
    }
    if (now + e->cfg.keepalive_ms / 8 >= e->ka_next_ms) {
        e->ka_next_ms = now + e->cfg.keepalive_ms;
        e->ka_due = true;
        bex__engine_alone_sync(e);
        if (!bex__engine_wops_hold(e)) {
            bex__engine_prep_keepalive(e);
            bex__engine_post_pending(e);
        }
    }
    retire_quiet(e);
    return e->state != E_UP || bex__engine_busy(e);
}

/* A failing engine's streams: failed, and what they queued handed back
 * (never posted: -ECANCELED, or the error it had already). */
static void fail_streams(struct bex__engine *e)
{
    struct bex__stream *st;
    bex__stream_foreach(st, &e->streams, it)
    {
        bex__stream_move(st, BEX__SE_FAIL);
        struct bex__msg *m = bex__stream_take_queue(st);
        while (m) {
            struct bex__msg *next = m->next;
            m->next = NULL;
            m->rndv_id = 0;
            m->state = BEX__M_QUEUED;
            bex__engine_msg_done(e, m, m->status ? m->status : ST_UNSENT);
            m = next;
        }
    }
}

/* Failure is synchronous. The QP goes first: once ibv_destroy_qp returns
 * the NIC touches none of our buffers, so everything can be handed back at
 * once. (Moving the QP to error and waiting for flushed markers instead
 * costs a timeout on rxe, where a receive posted to a QP in error never
 * completes.) Completions of the QP still in the CQ are dropped. In SRQ
 * mode the shared queue takes the QP over instead (bex__srq_retire): in
 * the error state at once, destroyed once the shared receive it may have
 * taken for a half-received SEND is flushed back. */
void bex__engine_fail_now(struct bex__engine *e, int err)
{
    if (e->state == E_DEAD)
        return;
    bex__engine_move(e, E_DEAD);
    bex__engine_release_windows(e); /* before the QP: see release_windows */
    if (e->qp) {
        if (e->nodev) {
            bex__engine_nodev_to(e, IBV_QPS_RESET);
        } else if (e->srq_in) {
            bex__srq_retire(e->sh->srq, e->qp);
        } else {
            int rc = bex__rdma_qp_destroy(e->qp);
            if (rc) {
                /* cannot happen for a QP of ours (no multicast, and every
                 * window bound on it went just above); stop it at least */
                bex__log(e->sh->log, BEX_LOG_ERROR, "%s: ibv_destroy_qp: %s", e->name,
                         bex_strerror(rc));
                bex__rdma_qp_to_err(e->qp);
            }
        }
        e->qp = NULL;
    }
    bex__engine_srq_leave(e); /* no receive is consumed for it any more */
    e->x.due_us = 0;
    /* sent, not acknowledged: the peer's NIC took them, its engine may or
     * may not have them */
    while (e->ack_head) {
        struct bex__msg *m = e->ack_head;
        e->ack_head = m->next;
        m->next = NULL;
        bex__engine_msg_done(e, m, ST_INDOUBT);
    }
    e->ack_tail = NULL;
    /* posted messages next, in order, then prepared ones (bex__engine_send:
     * never posted); then queued ones */
    for (uint32_t c = e->head; c != e->tail; c++) {
        struct sslot *s = sslot_at(e, c);
        s->closed = NULL;
        if (s->done) {
            struct bex__msg *m = s->done;
            s->done = NULL;
            int st = (int32_t)(c - e->post) < 0 ? ST_INDOUBT : ST_UNSENT;
            bex__engine_msg_done(e, m, m->status ? m->status : st);
        }
    }
    e->head = e->post = e->sig_end = e->dscan = e->tail;
    e->chain_loud = false;
    bex__engine_window_give(e, e->inflight);
    e->inflight = 0;
    for (uint32_t i = 0; i < e->max_rndv; i++) {
        e->rout[i].m = NULL;
        e->rout[i].used = false;
    }
    e->rout_used = 0;
    e->rel_n = 0;
    e->ctl_n = e->ctl_errs = e->ctl_refusals = 0;
    bex__engine_alone_sync(e);
    fail_streams(e);
    for (uint32_t i = 0; i < e->max_rndv; i++) {
        if (e->rin[i].used) {
            e->rin[i].used = false;
            bex__engine_recv_free(e, e->rin[i].buf);
            e->rin[i].buf = NULL;
        }
    }
    e->rin_used = 0;
    e->rin_bytes = 0;
    e->wait_n = 0;
    struct bex__stream *st;
    while ((st = bex__stream_first(&e->streams))) {
        bex__stream_unlink(&e->streams, st);
        st->eng = NULL;
    }
    e->ops->on_fail(&e->x, err);
}

void bex__engine_fail(struct bex__engine *e, int err)
{
    bex__engine_fail_now(e, err);
}
