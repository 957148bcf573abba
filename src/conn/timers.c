/* SPDX-License-Identifier: Apache-2.0 */
/* The timers of an I/O thread's connections and listeners, on the thread's
 * heap (common/timer.h; io->timers, in bex__now_us() time). The loop sleeps
 * until the nearest one; nothing walks every connection on a clock.
 *
 * - A connection's tick (keepalive, stall and rate checks, work held back
 *   that no event announces). An idle connection's comes once per
 *   keepalive_ms (at most a second), on a grid every connection of the
 *   process shares (multiples of that period of the monotonic clock): a
 *   thread's idle connections all tick, and write their keepalives, in one
 *   wake-up per keepalive period, and their peers' keepalives arrive about
 *   then too. A connection whose transport holds something back
 *   (BEX__TICK_SOON) ticks every io->tick_ms, on that period's grid. Every
 *   TICK_SWEEP-th tick of a connection also gives it a progress call,
 *   whatever its transport said. The connections of one period are a
 *   round (io->rounds): a list and one timer, at the earliest of their
 *   deadlines, which ticks those due. So a tick costs the heap nothing: at
 *   1024 connections one timer per connection spent ~1050 of the ~1230
 *   instructions of an idle TCP connection's tick in the heap's removal and
 *   insertion (docs/benchmarks.md).
 * - A connection's setup deadline (connect_timeout_ms) and its transport's
 *   due_us (TCP's acknowledgement delay; RDMA's held acknowledgements):
 *   one timer each.
 * - A listener's accept backoff; the thread's housekeeping (collecting the
 *   heaps other threads freed into; SRQ mode: QPs draining). */
#include <errno.h>

#include "conn/conn.h"
#include "transport/rdma/srq.h"

/* A connection with work held back ticks every TICK_MS (event mode:
 * keepalive_ms / 2, at least TICK_MS). */
#define TICK_MS 10
/* A thread with no connection still wakes now and then (its heaps). */
#define IDLE_WAKE_MS 1000
/* Every TICK_SWEEP-th tick of a connection gives it a progress call. */
#define TICK_SWEEP 10

/* The first multiple of period after now. */
static uint64_t next_round(uint64_t now_us, uint64_t period_us)
{
    return (now_us / period_us + 1) * period_us;
}

/* An idle connection's tick period: keepalive_ms, at most a second (the
 * stall and rate checks of its tick keep that precision whatever
 * keepalive_ms is). */
static uint64_t keepalive_us(const struct bex__io *io)
{
    uint32_t ms = io->env->cfg->keepalive_ms;
    return (uint64_t)(ms < IDLE_WAKE_MS ? ms : IDLE_WAKE_MS) * 1000;
}

/* c ticks at due, in round r (a list and one timer, at the earliest due). */
static void round_join(struct bex__tick_round *r, struct conn *c, uint64_t due)
{
    c->tick_due = due;
    bex__list_push_tail(&r->conns, &c->tick_link);
    if (!r->tm.active || due < r->tm.due)
        bex__timer_start(&r->io->timers, &r->tm, due);
}

static void tick(struct bex__io *io, struct conn *c)
{
    if (bex__conn_dead(c))
        return; /* finished: nothing to tick */
    unsigned want = 0;
    if (c->x) {
        bool sweep = c->rounds++ % TICK_SWEEP == 0;
        want = c->x->ops->tick(c->x, io->now_us / 1000);
        BEX__STAT_ADD(io, tick_calls, 1);
        if ((want & BEX__TICK_PROGRESS) || sweep)
            bex__conn_ready(c);
        bex__conn_due_sync(c); /* a keepalive written may hold acknowledgements */
        if (bex__conn_dead(c))
            return;
    }
    struct bex__tick_round *r = &io->rounds[want & BEX__TICK_SOON ? 1 : 0];
    round_join(r, c, next_round(io->now_us, r->period_us));
}

/* A round's timer: its connections that are due tick, in the order they
 * joined; the others (joined after the round's deadline had passed, its
 * timer not yet run) wait for theirs. A tick may end any connection
 * (bex__conn_timers_stop takes it off the list it is on, this one too). */
static void on_round(struct bex__timer *t)
{
    struct bex__tick_round *r = bex__container_of(t, struct bex__tick_round, tm);
    struct bex__io *io = r->io;
    struct bex__list due;
    bex__list_init(&due);
    bex__list_take_all(&r->conns, &due);
    while (!bex__list_empty(&due)) {
        struct conn *c = bex__list_entry(due.next, struct conn, tick_link);
        bex__list_remove(&c->tick_link);
        if (c->tick_due > io->now_us)
            round_join(r, c, c->tick_due);
        else
            tick(io, c);
    }
}

static void on_setup_deadline(struct bex__timer *t)
{
    struct conn *c = bex__container_of(t, struct conn, setup_tm);
    if (bex__conn_dead(c) || c->phase == P_UP)
        return;
    if (!c->client) /* a peer that never finishes its setup is refused, by
                     * name; closed without a notice, as before */
        bex__conn_log_refusal(c, -ETIMEDOUT, "setup not finished in time");
    bex__conn_fail(c, -ETIMEDOUT); /* a client's on_connect says so */
}

static void on_due(struct bex__timer *t)
{
    struct conn *c = bex__container_of(t, struct conn, due_tm);
    if (!bex__conn_dead(c))
        bex__conn_ready(c);
}

void bex__conn_timers_start(struct conn *c)
{
    struct bex__io *io = c->io;
    bex__timer_init(&c->setup_tm, on_setup_deadline);
    bex__timer_init(&c->due_tm, on_due);
    bex__list_init(&c->tick_link);
    uint64_t now = bex__now_us();
    /* (the tick compared the coarse clock with a deadline in ms: a ms late) */
    bex__timer_start(&io->timers, &c->setup_tm,
                     now + (uint64_t)io->env->cfg->connect_timeout_ms * 1000 + 1000);
    round_join(&io->rounds[0], c, next_round(now, keepalive_us(io)));
}

void bex__conn_timers_stop(struct conn *c)
{
    struct bex__timers *ts = &c->io->timers;
    bex__timer_stop(ts, &c->setup_tm);
    bex__list_remove(&c->tick_link); /* (a round's timer with none left fires once, idle) */
    bex__timer_stop(ts, &c->due_tm);
}

void bex__conn_due_set(struct conn *c, uint64_t due)
{
    if (!due) {
        if (c->due_tm.active)
            bex__timer_stop(&c->io->timers, &c->due_tm);
    } else if (!c->due_tm.active || c->due_tm.due != due)
        bex__timer_start(&c->io->timers, &c->due_tm, due);
}

static void on_listener_pause(struct bex__timer *t)
{
    bex__listener_resume(bex__container_of(t, struct bex_listener, pause_tm));
}

void bex__listener_pause_timer(struct bex_listener *l, uint32_t ms)
{
    bex__timer_init(&l->pause_tm, on_listener_pause);
    bex__timer_start(&l->io->timers, &l->pause_tm, bex__now_us() + (uint64_t)ms * 1000);
}

void bex__listener_pause_stop(struct bex_listener *l)
{
    if (l->paused)
        bex__timer_stop(&l->io->timers, &l->pause_tm);
}

/* Frees of buffers this thread allocated wait in its heaps until it
 * collects them: another thread's exact count of received memory
 * (recv_bytes_max) sees them then. With connections, on the keepalive
 * grid (the same wake-up as their ticks); else once a second. */
static void on_house(struct bex__timer *t)
{
    struct bex__io *io = bex__container_of(t, struct bex__io, house);
    bool several = io->env->n_io > 1;
    if (several) {
        bex_mem_pool_collect(io->sh.recv_pool);
        bex_mem_pool_collect(io->sh.landing);
    }
    uint64_t period =
        several && !bex__list_empty(&io->conns) ? keepalive_us(io) : (uint64_t)IDLE_WAKE_MS * 1000;
    bex__timer_start(&io->timers, t, next_round(io->now_us, period));
}

/* A QP that drained gives back the CQ room its engine held (srq.h). */
static void cq_room_back(void *arg, uint32_t cq_idx, uint32_t cqe)
{
    struct bex__io *io = arg;
    io->cqs[cq_idx].used -= cqe;
}

static void on_srq(struct bex__timer *t)
{
    struct bex__io *io = bex__container_of(t, struct bex__io, srq_tm);
    if (!io->sh.srq || !io->sh.srq->n_dying)
        return;
    bex__srq_reap(io->sh.srq, io->now_us / 1000, false, cq_room_back, io);
    if (io->sh.srq->n_dying)
        bex__timer_start(&io->timers, t, io->now_us + (uint64_t)io->tick_ms * 1000);
}

void bex__io_srq_timer(struct bex__io *io)
{
    if (io->sh.srq && io->sh.srq->n_dying && !io->srq_tm.active)
        bex__timer_start(&io->timers, &io->srq_tm, bex__now_us() + (uint64_t)io->tick_ms * 1000);
}

void bex__io_timers_init(struct bex__io *io)
{
    const bex_ctx_config *cfg = io->env->cfg;
    bex__timers_init(&io->timers);
    io->tick_ms = TICK_MS;
    if (cfg->poll_mode == BEX_POLL_EVENT && cfg->keepalive_ms / 2 > TICK_MS)
        io->tick_ms = cfg->keepalive_ms / 2;
    bex__timer_init(&io->house, on_house);
    bex__timer_init(&io->srq_tm, on_srq);
    for (int i = 0; i < 2; i++) {
        struct bex__tick_round *r = &io->rounds[i];
        bex__timer_init(&r->tm, on_round);
        bex__list_init(&r->conns);
        r->io = io;
        r->period_us = i ? (uint64_t)io->tick_ms * 1000 : keepalive_us(io);
    }
    io->now_us = bex__now_us();
    bex__timer_start(&io->timers, &io->house, next_round(io->now_us, keepalive_us(io)));
}

void bex__io_timers_run(struct bex__io *io, uint64_t now_us)
{
    io->now_us = now_us;
    bex__timers_run(&io->timers, now_us);
}
