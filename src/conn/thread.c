/* SPDX-License-Identifier: Apache-2.0 */
/* The I/O thread: completions, events, timers, sleep; the owner's
 * commands through bex__conn_owner_ops.drain_cmds (moved from sock/io.c). */
#include <assert.h>

#include "conn/conn.h"
#include "transport/rdma/srq.h"

#define WC_BATCH 64
/* Completions one CQ (and the shared receive queue) may give a poll turn,
 * in batches of WC_BATCH, before the turn's progress calls: a CQ is polled
 * until it gives less than a batch or this many, and once the turn has
 * taken more than one from it, until a poll gives nothing (those that
 * landed while it dispatched the others). With several messages in
 * flight per QP over many QPs, one batch a turn split a QP's answers
 * across turns and its next sends across doorbells (at 1024 QPs with 4
 * each, 0.54-0.71 doorbells a request against 0.27 at 1 QP:
 * docs/benchmarks.md, Figure 11's counts). A turn of one completion (a
 * ping-pong's) polls no more than before. The bound keeps a turn's first
 * completion from waiting for more than this many dispatches. */
#define WC_TURN_MAX 1024
/* The coarse clock lags the precise one by a jiffy at most (HZ 100 at
 * worst): a timer further than this ahead needs no precise look. */
#define COARSE_LAG_US 10000
/* Within that lag of the nearest deadline the coarse clock cannot say
 * whether it is due: the turns then read the precise clock on every
 * NEAR_EVERY-th of them (a deadline runs at most that many turns late; a
 * sleep reads it anyway). Before (issue 25 item 2, busy mode), every turn
 * did while a deadline was near: in one busy VM run a spinning server
 * read it 3.7 times a round trip beyond its empty turns' share, some 100
 * instructions. */
#define NEAR_EVERY 16

/* A polling thread's turns look at its timers (run_timers: the coarse
 * clock, some 26 instructions) when they found nothing to do (no
 * completion that made work, no command), and when the loop's count of
 * turns is a multiple of WORK_TIMERS on one that found some: of any
 * WORK_TIMERS turns in a row one looks, so a timer runs at most that many
 * turns late. Before (issue 25 item 2, busy mode), on every turn: a busy
 * ping-pong's one turn with work a round trip paid the clock read that the
 * idle turns around it make anyway. The count is the turns' statistic,
 * which the turn has just added to (a count of the turns with work of its
 * own, its store and its test were 5 instructions a busy round trip's
 * turn, now a load and a test). */
#define WORK_TIMERS 16

/* Completion events acknowledged together (on_channel). */
#define CQ_ACK_BATCH 64

BEX__IO_TLS bex_ctx *bex__io_ctx;
BEX__IO_TLS struct bex__io *bex__io_self;

static inline bool poll_cqs(struct bex__io *io, struct ibv_wc *wc);

/* handle_events's polls ahead of a connection's event: out of line, so
 * that the common call (the completion channel's event, or a TCP
 * connection's data on a thread without CQs) saves no registers for them
 * (issue 25: some 17 instructions an event). */
__attribute__((noinline)) static void cq_first_polls(struct bex__io *io, struct ibv_wc *wc)
{
    for (int k = 0; k < 4 && poll_cqs(io, wc); k++)
        ;
}

static void handle_events(struct bex__io *io, struct epoll_event *ev, int n, struct ibv_wc *wc)
{
    /* A connection's TCP event (its peer closed it) may come with the
     * completions that explain it still in a CQ (the peer's NIC refused our
     * write, then the peer closed): take those first, so that the
     * connection fails for that cause and not for the reset. */
    if (io->n_cq || io->sh.srq) {
        for (int i = 0; i < n; i++) {
            if (((struct ep_tag *)ev[i].data.ptr)->cq_first) {
                cq_first_polls(io, wc);
                break;
            }
        }
    }
    for (int i = 0; i < n; i++) {
        struct ep_tag *t = ev[i].data.ptr;
        t->cb(t, ev[i].events);
    }
}

/* The completion channel's watcher: the CQs are polled on every turn
 * anyway; an event only needs acknowledging, and its CQ arming again
 * (every CQ is, before the next poll). One event a call: with one CQ
 * there is no other, and another CQ's keeps the descriptor readable, so a
 * read never returns EAGAIN. */
static inline void take_cq_event(struct bex__io *io)
{
    struct ibv_cq *cq;
    void *cq_ctx;
    if (ibv_get_cq_event(io->ch, &cq, &cq_ctx) == 0) {
        BEX__STAT_ADD(&io->stats, cq_events, 1);
        if (cq != io->ev_cq) {
            bex__io_ack_cq_events(io);
            io->ev_cq = cq;
        }
        if (++io->ev_unacked >= CQ_ACK_BATCH)
            bex__io_ack_cq_events(io);
        io->cq_armed = false;
    }
}

static void on_channel(struct ep_tag *t, uint32_t events)
{
    (void)events;
    take_cq_event(bex__container_of(t, struct bex__io, ch_tag));
}

void bex__io_ack_cq_events(struct bex__io *io)
{
    if (io->ev_unacked)
        ibv_ack_cq_events(io->ev_cq, io->ev_unacked);
    io->ev_unacked = 0;
}

/* SRQ mode: the device's async events, each to its QP's queue. */
static void on_async(struct ep_tag *t, uint32_t events)
{
    (void)events;
    struct bex__io *io = bex__container_of(t, struct bex__io, async_tag);
    struct ibv_async_event ae;
    while (bex__rdma_async_next(io->env->dev, &ae) > 0) {
        bex__srq_async(&ae);
        ibv_ack_async_event(&ae);
    }
}

void bex__io_tags_init(struct bex__io *io)
{
    io->ch_tag.cb = on_channel;
    io->async_tag.cb = on_async;
}

/* A receive completion of c in this poll turn: counted, and c once per
 * turn (bex_sock_stats.poll_recvs / poll_recv_conns: how many of a QP's
 * receives a turn takes together, so how many of its answers can leave in
 * one chain). */
__attribute__((always_inline)) static inline void count_recv_ok(struct bex__io *io, struct conn *c)
{
    BEX__STAT_ADD(&io->stats, poll_recvs, 1);
    if (c->recv_turn != io->poll_no) {
        c->recv_turn = io->poll_no;
        BEX__STAT_ADD(&io->stats, poll_recv_conns, 1);
    }
}

/* count_recv_ok when wc is a receive's success. */
__attribute__((always_inline)) static inline void count_recv(struct bex__io *io, struct conn *c,
                                                             const struct ibv_wc *wc)
{
    if (wc->status == IBV_WC_SUCCESS && (wc->opcode & IBV_WC_RECV))
        count_recv_ok(io, c);
}

/* Hand each completion to its engine, found by the id in its wr_id:
 * whether one made its connection ready (a receive, or a send after which
 * its engine has work). A send's completion that leaves nothing to do is
 * no work for the loop: the turn after it need not run (issue 25: an event
 * loop's round trip took three turns, the last two for the completion of
 * the answer's send, which rxe completes within the post, and an empty
 * poll; the sleep polls once more after arming anyway). */
__attribute__((always_inline)) static inline bool dispatch(struct bex__io *io,
                                                           const struct ibv_wc *wc, int n)
{
    bool any = false;
    for (int i = 0; i < n; i++) {
        if (bex__wr_engine(wc[i].wr_id) == 0 && io->sh.srq) {
            /* a receive of the shared queue: its QP says whose */
            struct conn *c = bex__engine_srq_complete(io->sh.srq, &wc[i]);
            if (c) {
                count_recv(io, c, &wc[i]);
                bex__conn_ready(c);
                any = true;
            }
            continue;
        }
        struct conn *c = bex__conn_by_engine(io, bex__wr_engine(wc[i].wr_id));
        if (!c || !c->eng) /* a stale completion of a destroyed engine */
            continue;
        count_recv(io, c, &wc[i]);
        if (bex__engine_complete(c->eng, &wc[i])) {
            bex__conn_ready(c);
            any = true;
        }
    }
    return any;
}

/* ibv_poll_cq failed: completions may be lost, and with them the hand-back
 * of messages; no engine of this CQ (q: its index; UINT32_MAX: the shared
 * receive queue's, which every engine of the thread uses) can be trusted
 * to finish. */
static void cq_failed(struct bex__io *io, uint32_t q, int n)
{
    bool any = false;
    struct bex__list *it;
    bex__list_foreach(it, &io->conns)
    {
        struct conn *c = bex__conn_of(it);
        if (c->eng && !bex__conn_dead(c) && (c->cq_idx == q || q == UINT32_MAX)) {
            any = true;
            bex__conn_fail(c, -EIO);
        }
    }
    if (any) /* once per failure, not per poll */
        bex__log(io->env->log, BEX_LOG_ERROR, "ibv_poll_cq: %d; every engine failed", n);
}

/* c's progress call (c off the ready list): whether its transport may
 * have more at once (c is ready again then). */
__attribute__((always_inline)) static inline bool run_one(struct bex__io *io, struct conn *c)
{
    if (!c->x || bex__conn_dead(c))
        return false;
    BEX__STAT_ADD(io, visits, 1);
    bool did = c->x->ops->progress(c->x);
    if (did)
        bex__conn_ready(c);
    /* a callback in progress may have marked it again: it stays */
    bex__conn_due_sync(c);
    return did;
}

/* run_ready's list of several: taken whole, so that the connections
 * marked again during it wait for the next turn. */
__attribute__((noinline)) static bool run_ready_all(struct bex__io *io)
{
    struct bex__list list, *n;
    bex__list_init(&list);
    bex__list_take_all(&io->ready, &list);
    bool did = false;
    while ((n = bex__list_first(&list))) {
        bex__list_remove(n);
        did |= run_one(io, bex__list_entry(n, struct conn, ready_link));
    }
    return did;
}

/* Progress for the connections that have work, and only those: one whose
 * transport says it may have more at once stays on the list for the next
 * turn, the others leave it until a command, completion, event or timer
 * brings them back (bex__conn_ready). One connection on the list (a
 * ping-pong's every turn) is taken off it alone, the list not moved
 * (issue 25 item 2); what it marks again is on the list for the next turn,
 * as in run_ready_all. */
static inline bool run_ready(struct bex__io *io)
{
    struct bex__list *n = io->ready.next;
    if (n == &io->ready)
        return false;
    if (__builtin_expect(n->next != &io->ready, 0))
        return run_ready_all(io);
    bex__list_remove(n);
    return run_one(io, bex__list_entry(n, struct conn, ready_link));
}

/* poll_cq's part after a poll gave n > 0 completions in wc: dispatched,
 * and the CQ polled on until it gives less than a batch or WC_TURN_MAX
 * (see there): whether a completion made work; *full set when it may hold
 * more. */
static inline bool poll_cq_more(struct bex__io *io, uint32_t q, struct ibv_wc *wc, int n,
                                bool *full)
{
    bool any = false;
    int got = 0;
    for (;;) {
        any |= dispatch(io, wc, n);
        got += n;
        if (!((n == WC_BATCH || got > 1) && got < WC_TURN_MAX))
            break;
        n = bex__rdma_poll_cq(io->cqs[q].cq, WC_BATCH, wc);
        bex__stat_poll(&io->stats, n);
        if (n <= 0) { /* (an empty poll calls nothing more) */
            if (n < 0)
                cq_failed(io, q, n);
            return any;
        }
    }
    if (n == WC_BATCH || got >= WC_TURN_MAX)
        *full = true;
    return any;
}

/* One CQ of the thread (index q), polled until it gives less than a
 * batch or WC_TURN_MAX (see there): whether a completion made work; *full
 * set when it may hold more. The shared receive queue's part apart
 * (poll_srq): a ping-pong's poll is one CQ's, and its fixed cost was some
 * 70 instructions (issue 25). */
static inline bool poll_cq(struct bex__io *io, uint32_t q, struct ibv_wc *wc, bool *full)
{
    int n = bex__rdma_poll_cq(io->cqs[q].cq, WC_BATCH, wc);
    bex__stat_poll(&io->stats, n);
    if (n <= 0) { /* (an empty poll calls nothing more) */
        if (n < 0)
            cq_failed(io, q, n);
        return false;
    }
    return poll_cq_more(io, q, wc, n, full);
}

/* SRQ mode: every receive completion of the thread, one at a time: an
 * engine that fails on one takes its QP's others out of what was polled
 * (bex__srq_release), and a completion handed out is never one of a QP
 * destroyed since. Whether one made work; *full as poll_cq's. */
__attribute__((noinline)) static bool poll_srq(struct bex__io *io, struct ibv_wc *wc, bool *full)
{
    bool any = false;
    int n = 0, rc = 0;
    while (n < WC_TURN_MAX && (rc = bex__srq_next(io->sh.srq, &wc[0])) > 0) {
        any |= dispatch(io, wc, 1);
        n++;
    }
    /* the reposts of every engine served: one post */
    bex__srq_flush(io->sh.srq);
    if (rc < 0)
        cq_failed(io, UINT32_MAX, rc);
    if (n == WC_TURN_MAX)
        *full = true;
    return any;
}

/* poll_cqs's every CQ and the shared receive queue's (poll_no counted by
 * the caller). */
__attribute__((noinline)) static bool poll_cqs_all(struct bex__io *io, struct ibv_wc *wc)
{
    bool any = false, full = false;
    for (uint32_t q = 0; q < io->n_cq; q++)
        any |= poll_cq(io, q, wc, &full);
    if (io->sh.srq)
        any |= poll_srq(io, wc, &full);
    io->cq_quiet = io->cq_armed && !full;
    return any || full; /* (a full CQ may hold more) */
}

/* dispatch_one's send completion (out of line: it keeps c across the
 * engine's call, which the receive's path does not). */
__attribute__((noinline)) static bool dispatch_sent(struct conn *c, const struct ibv_wc *wc)
{
    if (!bex__engine_complete(c->eng, wc))
        return false;
    bex__conn_ready(c);
    return true;
}

/* One completion of a thread without a shared receive queue, the only
 * one its poll gave, to its engine: dispatch's body for n == 1 (issue 25: the general loop of
 * poll_cq_more, with its batch and turn bounds, saved six registers and
 * spilled five values, some 100 instructions for a ping-pong's one
 * completion). After a receive or a failure the engine always wants its
 * progress call (bex__engine_complete's contract): the connection is
 * marked first and the engine's call is the last, so that this frame
 * keeps nothing across it, and the upcall's answer (a send from the
 * callback, which marks the connection too) finds it marked (issue 25
 * item 2: some 15 instructions a receive). A send's completion makes work
 * only when the engine says so. */
__attribute__((always_inline)) static inline bool dispatch_one(struct bex__io *io,
                                                               const struct ibv_wc *wc)
{
    struct conn *c = bex__conn_by_engine(io, bex__wr_engine(wc->wr_id));
    if (!c || !c->eng) /* a stale completion of a destroyed engine */
        return false;
    if (__builtin_expect(wc->status == IBV_WC_SUCCESS, 1)) {
        if (__builtin_expect(!(wc->opcode & IBV_WC_RECV), 0))
            return dispatch_sent(c, wc);
        /* count_recv_ok's counts: the poll's one completion is its
         * connection's first receive of the turn, so c->recv_turn, which
         * only a later completion of this poll would look at, is neither
         * tested nor set (a later poll's number differs from any it holds;
         * issue 25 item 2: 5 instructions a receive) */
        BEX__STAT_ADD(&io->stats, poll_recvs, 1);
        BEX__STAT_ADD(&io->stats, poll_recv_conns, 1);
        bex__conn_ready(c);
        return bex__engine_complete_recv(c->eng, wc); /* (true; tested here) */
    }
    bex__conn_ready(c);
    return bex__engine_complete(c->eng, wc); /* (true) */
}

/* poll_one_rest for n other than 1 (several completions, or a failed
 * poll). */
__attribute__((noinline)) static bool poll_rest_more(struct bex__io *io, struct ibv_wc *wc, int n)
{
    bool any = false, full = false;
    if (n < 0)
        cq_failed(io, 0, n);
    else
        any = poll_cq_more(io, 0, wc, n, &full);
    io->cq_quiet = io->cq_armed && !full;
    return any || full;
}

/* poll_cqs's one CQ after its first poll gave n (not 0). One
 * completion (a ping-pong's) is all the CQ had: poll_cq_more would
 * dispatch it and poll no more (got 1, less than a batch), so neither
 * does this. Every way out is a tail call, so that its frame saves no
 * register (issue 25 item 2). */
__attribute__((noinline)) static bool poll_one_rest(struct bex__io *io, struct ibv_wc *wc, int n)
{
    if (__builtin_expect(n != 1, 0))
        return poll_rest_more(io, wc, n);
    io->cq_quiet = io->cq_armed;
    return dispatch_one(io, wc);
}

/* Whether the thread has one CQ and no shared receive queue (the usual
 * with a device; a shared receive queue comes with a CQ, so n_cq is 0
 * only without a device): the kept way, one load. */
static inline bool one_cq(const struct bex__io *io)
{
    assert(io->cq_way == bex__io_cq_way_of(io)); /* (a change without its sync) */
    return io->cq_way == IO_CQ_ONE;
}

/* Poll every CQ of the thread (up to WC_TURN_MAX each): whether a
 * completion made work (dispatch) or a CQ may hold more. A thread of one
 * CQ and no shared receive queue (the usual) polls inline, and an empty
 * poll (one of a ping-pong's two: the sleep's after arming) returns at
 * once; a poll that found completions goes on out of line, whose frame
 * (the dispatch, the engine's completion) an empty one then does not pay
 * (issue 25: some 35 instructions of saved registers a poll). A thread of
 * TCP connections alone has no CQ: it is called some three times a
 * message, so that costs no call. One test for the usual thread, not one
 * for "no CQ" and another for "one" (issue 25 item 2). */
static inline bool poll_cqs(struct bex__io *io, struct ibv_wc *wc)
{
    if (__builtin_expect(!one_cq(io), 0)) {
        if (io->cq_way == IO_CQ_NONE) {
            io->cq_quiet = io->cq_armed;
            return false;
        }
        io->poll_no++;
        return poll_cqs_all(io, wc);
    }
    io->poll_no++;
    /* sh.cq is cqs[0].cq (but within an engine's creation): one load */
    assert(io->sh.cq == io->cqs[0].cq);
    int n = bex__rdma_poll_cq(io->sh.cq, WC_BATCH, wc);
    bex__stat_poll(&io->stats, n);
    if (n == 0) {
        io->cq_quiet = io->cq_armed;
        return false;
    }
    return poll_one_rest(io, wc, n);
}

/* Arm every CQ of the thread for an event at its next completion (a
 * system call each on rxe; mlx5 rings a doorbell): only when an event was
 * read since, or a CQ added or grown. The poll after it finds what came
 * before. Armed before the sleep, not before the turn's work: the
 * completions of the sends that work posts (rxe completes them within the
 * post) are then polled, not a wake-up each. */
__attribute__((noinline)) static void arm_cqs_all(struct bex__io *io)
{
    for (uint32_t q = 0; q < io->n_cq; q++)
        ibv_req_notify_cq(io->cqs[q].cq, 0);
    if (io->sh.srq)
        ibv_req_notify_cq(io->sh.srq->cq, 0);
    BEX__STAT_ADD(&io->stats, cq_arms, io->n_cq + (io->sh.srq != NULL));
    io->cq_armed = true;
    io->cq_quiet = false;
}

/* arm_cqs_all's one CQ and no shared receive queue (the usual, and a
 * ping-pong's once a round trip): inline, no loop, no frame (issue 25
 * item 2: arm_cqs's frame and loop were some 35 instructions a round
 * trip, its one call through the provider's table 6). */
static inline void arm_cqs(struct bex__io *io)
{
    if (__builtin_expect(!one_cq(io), 0)) {
        arm_cqs_all(io);
        return;
    }
    ibv_req_notify_cq(io->sh.cq, 0); /* (cqs[0].cq: poll_cqs) */
    BEX__STAT_ADD(&io->stats, cq_arms, 1);
    io->cq_armed = true;
    io->cq_quiet = false;
}

/* The timers due (conn/timers.c): the coarse clock first, the precise
 * one only when the nearest timer may be due. A coarse clock lagging by
 * more than COARSE_LAG_US (a VM's emulated ticks: 11.8 ms seen) skips a
 * due timer here: the loop's looks at the precise clock before a sleep
 * run it (io_sleep, and the spinning's every 16th idle poll). The coarse
 * value is the one a read this turn took if there was one (a TCP read's,
 * bex__now_ms_since_wait): one clock read a sub-request less at a server
 * (issue 25's fan-out); a timer due during the callbacks after that read
 * runs a turn later at most. */
__attribute__((always_inline)) static inline void run_timers(struct bex__io *io)
{
    uint64_t next = bex__timers_next(&io->timers);
    io->turn_ms = bex__now_ms_since_wait(); /* (spin_look's too) */
    if (next == UINT64_MAX || io->turn_ms * 1000 + COARSE_LAG_US < next)
        return;
    if (io->near_turns++ % NEAR_EVERY)
        return;
    uint64_t now = bex__now_us();
    if (now >= next)
        bex__io_timers_run(io, now);
}

/* io_sleep's timers when it does not sleep (out of line: rare). */
__attribute__((noinline)) static void run_timers_late(struct bex__io *io)
{
    run_timers(io);
}

/* io_sleep's timeout for the nearest deadline next (UINT64_MAX: none,
 * -1), from the precise clock; the timers due run first (else the turns
 * with a timeout of 0 go on until the coarse clock lets run_timers see
 * them; the events are still looked at). A deadline that was the nearest
 * at the sleep before too (a busy thread's: the tick round's, for a
 * keepalive period) arms the loop's timer (one system call), and the
 * sleeps after, while it stays the nearest, read no clock (issue 25 item
 * 2: the clock read, its call and this arithmetic were some 40
 * instructions a round trip). An idle thread's deadlines each come once:
 * it arms nothing and sleeps on timeouts alone, as before. */
__attribute__((noinline)) static int sleep_timeout(struct bex__io *io, uint64_t next)
{
    if (next == UINT64_MAX)
        return -1; /* (the housekeeping timer always runs) */
    uint64_t t = bex__now_us();
    if (next <= t)
        bex__io_timers_run(io, t);
    else if (next == io->sleep_due)
        bex__loop_timer(&io->loop, next);
    io->sleep_due = next;
    uint64_t ms = next > t ? (next - t + 999) / 1000 : 0;
    return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

/* Sleep until an event, a command, a completion or the nearest timer
 * (rounded up to epoll's milliseconds): the CQs armed (once per event
 * read), and polled once more since, so nothing slips between (the idle
 * turn's poll is that one when it ran armed and emptied them). The timers
 * due run here, from the precise clock; timers_late: the turn before ran
 * none (bex__io_main), and they run here even when the loop does not
 * sleep. In event mode a turn after a completion event (the CQs not
 * armed) is always followed by this look, so it reads no clock for the
 * timers (issue 25: a round trip read the coarse clock in the turn and
 * the precise one here); a timer's work then waits for the next turn. */
__attribute__((always_inline)) static inline void
io_sleep(struct bex__io *io, struct epoll_event *ev, struct ibv_wc *wc, bool timers_late)
{
    bool quiet = io->cq_quiet; /* (arming clears it: no load after the call) */
    if (!io->cq_armed) {
        arm_cqs(io);
        quiet = false;
    }
    bex__loop_sleep_begin(&io->loop);
    bool found = !quiet && poll_cqs(io, wc);
    if (found || bex__loop_has_cmds(&io->loop) || !bex__list_empty(&io->ready)) {
        bex__loop_sleep_end(&io->loop);
        if (timers_late)
            run_timers_late(io);
        return;
    }
    /* the loop's timer armed for the nearest deadline: no clock, no
     * timeout (tfd_due is never UINT64_MAX) */
    uint64_t next = bex__timers_next(&io->timers);
    int timeout = next == io->loop.tfd_due ? -1 : sleep_timeout(io, next);
    int m = bex__loop_wait_raw(&io->loop, ev, 16, timeout);
    /* the completion channel's event alone (an event loop's every wake-up
     * in a ping-pong): on_channel's work here, not through handle_events
     * and the watcher's call (issue 25: some 40 instructions a wake-up),
     * and not looked at for the loop's own wake-ups either */
    if (m == 1 && ev[0].data.ptr == &io->ch_tag) {
        bex__loop_sleep_end(&io->loop);
        take_cq_event(io);
        return;
    }
    m = bex__loop_wait_own(&io->loop, ev, m);
    bex__loop_sleep_end(&io->loop);
    if (m > 0)
        handle_events(io, ev, m, wc);
}

/* A spinning thread's look at its epoll set (epoll_wait(.., 0): a system
 * call). Its connections' messages over RDMA are completions, polled every
 * turn; what only the epoll set tells is a TCP connection's data, a
 * set-up's next message, a listener's new connection, a peer's close, the
 * device's async events. While a connection of the thread goes over TCP
 * or is in set-up, every 64th turn, as before; else once per tick of the
 * coarse clock the turn read (run_timers): at most HZ (100-1000) a second,
 * whatever the turns or messages, so that busy polling RDMA makes no
 * system call per message but its doorbells (issue 25: a look every 64
 * turns was 0.75-1.9 per message). A new connection at a listener, or a
 * peer's close, then waits for the next tick at most (1-10 ms; 12 ms seen
 * in a VM whose ticks lag); commands and timers do not wait for a look. */
__attribute__((noinline)) static void spin_look_now(struct bex__io *io, struct epoll_event *ev,
                                                    struct ibv_wc *wc)
{
    io->looked_ms = io->turn_ms;
    int m = bex__loop_wait(&io->loop, ev, 16, 0);
    handle_events(io, ev, m, wc);
}

/* spin_look's gate inline, the look out of line: a spinning thread's
 * every turn asks, and almost none looks (issue 25 item 2, busy mode: the
 * call and its frame on every turn). */
static inline void spin_look(struct bex__io *io, struct epoll_event *ev, struct ibv_wc *wc)
{
    if (io->n_watch) {
        if (++io->spins % 64)
            return;
    } else if (io->turn_ms == io->looked_ms) {
        return;
    }
    spin_look_now(io, ev, wc);
}

/* A spin-then-sleep thread's idle turn that reads the precise clock (every
 * 16th): the timers due run, and whether it has spun spin_us since
 * *idle_since (set at its first idle turn) and may sleep. */
static inline bool spin_done(struct bex__io *io, uint32_t spin_us, uint64_t *idle_since)
{
    uint64_t t = bex__now_us();
    if (bex__timers_next(&io->timers) <= t) /* (run_timers's gate lags) */
        bex__io_timers_run(io, t);
    if (!*idle_since)
        *idle_since = t;
    /* a transport's deadline is near (some hundred us at most): spin on to
     * it rather than sleep for epoll's whole millisecond */
    return t - *idle_since >= spin_us && bex__timers_next(&io->timers) > t + 1000;
}

const char *bex__io_state_name(int s)
{
    static const char *const names[] = {[IO_NEW] = "NEW",
                                        [IO_RUNNING] = "RUNNING",
                                        [IO_STOPPING] = "STOPPING",
                                        [IO_JOINED] = "JOINED"};
    return (unsigned)s < ARRAY_SIZE(names) ? names[s] : "?";
}

void bex__io_move(struct bex__io *io, enum bex__io_state to)
{
    int from = atomic_load_explicit(&io->state, memory_order_relaxed);
    assert((from == IO_NEW && to == IO_RUNNING) || (from == IO_RUNNING && to == IO_STOPPING) ||
           (from == IO_STOPPING && to == IO_JOINED));
    struct bex__log *lg = io->env ? io->env->log : NULL;
    if (lg && lg->level >= BEX_LOG_DEBUG)
        bex__log(lg, BEX_LOG_DEBUG, "I/O thread %u: %s -> %s", io->idx, bex__io_state_name(from),
                 bex__io_state_name(to));
    atomic_store_explicit(&io->state, (int)to, memory_order_release);
}

/* A turn's rare work: the dead connections reaped, and in SRQ mode the
 * draining QPs' timer looked at. One flag tested a turn where reap and the
 * shared queue were (issue 25 item 2), kept while either holds. */
__attribute__((noinline)) static void turn_chores(struct bex__io *io)
{
    if (io->reap)
        bex__conn_reap(io);
    if (io->sh.srq)
        bex__io_srq_timer(io);
    io->chores = io->reap || io->sh.srq; /* (reaping may set reap again) */
}

/* The loop of one poll mode (BEX_POLL_*), until the thread stops. Inline
 * once a mode (bex__io_main): a turn tested the mode three times, each a
 * load from the frame and a branch in one loop for all (issue 25 item 2),
 * and a busy turn with work kept the spin-then-sleep's idle count and
 * clock (two stores); in its own copy none of that. */
__attribute__((always_inline)) static inline void io_loop(struct bex__io *io,
                                                          const bex_ctx_config *cfg, uint32_t mode)
{
    const bool event = mode == BEX_POLL_EVENT, spin_sleep = mode == BEX_POLL_SPIN_SLEEP;
    struct ibv_wc wc[WC_BATCH];
    struct epoll_event ev[16];
    uint64_t idle_since = 0;
    uint32_t idle_polls = 0;
    bool spun_out = false;
    for (;;) {
        BEX__STAT_ADD(io, turns, 1);
        bool did = poll_cqs(io, wc);
        /* the calls a turn usually has nothing for are gated here, not
         * inside them: no call when there is nothing (issue 25: a round
         * trip's turn paid some 30 instructions for the three) */
        if (bex__loop_cmds_queued(&io->loop)) {
            did |= io->env->ops->drain_cmds(io);
            /* the one move to STOPPING is a command's (CMD_STOP), so the
             * state is looked at here, not on every turn (issue 25 item
             * 2); what the commands marked gets its progress call first,
             * as on any turn */
            if (__builtin_expect(bex__io_state(io) == IO_STOPPING, 0)) {
                run_ready(io);
                break;
            }
        }
        /* Event mode, CQs not armed: the sleep's look runs them (io_sleep).
         * Else on a turn that found nothing, and on every WORK_TIMERS-th
         * one that found work (see there). */
        if (event ? io->cq_armed
                  : (!did ||
                     atomic_load_explicit(&io->turns, memory_order_relaxed) % WORK_TIMERS == 0))
            run_timers(io);
        did |= run_ready(io);
        if (__builtin_expect(io->chores, 0))
            turn_chores(io);
        if (did) {
            if (spin_sleep) {
                idle_since = 0;
                idle_polls = 0;
            }
            spun_out = false;
            /* Event mode, a completion event read since the CQs were
             * armed: the sleep's look (arm, then poll) is the next turn's
             * poll. What this turn's work left (the completions of the
             * sends it posted, which rxe completes within the post; a
             * command; a connection ready again) is found there or brings
             * the loop back without sleeping. Before (issue 25), a second
             * turn polled for the answer's send completion, and the sleep
             * polled again after arming: three polls and two turns a round
             * trip, now two and one. Once armed, turns go on as before
             * (no sleep's look per turn while work keeps coming). */
            if (event && !io->cq_armed) {
                io_sleep(io, ev, wc, true);
                continue;
            }
            spin_look(io, ev, wc);
            continue;
        }
        BEX__STAT_ADD(&io->stats, empty_turns, 1);
        /* The precise clock may be a system call (see bex__now_ms): while
         * spinning, look at it on every 16th idle poll only. Busy polling
         * never sleeps; event mode sleeps at once. */
        if (event)
            spun_out = true;
        else if (spin_sleep && idle_polls++ % 16 == 0)
            spun_out = spin_done(io, cfg->poll_spin_us, &idle_since);
        if (!spun_out) {
            spin_look(io, ev, wc);
            continue;
        }
        io_sleep(io, ev, wc, event && !io->cq_armed);
        idle_since = 0;
        idle_polls = 0;
        spun_out = false;
    }
}

void *bex__io_main(void *arg)
{
    struct bex__io *io = arg;
    const bex_ctx_config *cfg = io->env->cfg;
    bex__io_ctx = io->ctx;
    bex__io_self = io;
    bex__io_timers_init(io);
    bex__io_cq_way_sync(io); /* (the device's CQ and queue are made before) */
    io->chores = io->reap || io->sh.srq;
    switch (cfg->poll_mode) {
    case BEX_POLL_EVENT:
        io_loop(io, cfg, BEX_POLL_EVENT);
        break;
    case BEX_POLL_SPIN_SLEEP:
        io_loop(io, cfg, BEX_POLL_SPIN_SLEEP);
        break;
    default: /* (BEX_POLL_BUSY) */
        io_loop(io, cfg, BEX_POLL_BUSY);
        break;
    }
    return NULL;
}
