/* SPDX-License-Identifier: Apache-2.0 */
/* The I/O thread: commands, completions, events, timers, sleep. */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "sock/internal.h"
#include "transport/rdma/srq.h"

#define TICK_MS 10
/* A thread with no connection (and no listener backing off) has no timer
 * to run; it still wakes now and then to collect its heaps. */
#define IDLE_WAKE_MS 1000
#define WC_BATCH     64

_Thread_local bex_ctx *bex__io_ctx;
_Thread_local struct bex__io *bex__io_self;

static void do_connect(struct bex__io *io, struct bex_sock *s)
{
    struct conn *c = NULL;
    for (struct conn *p = io->conns; p; p = p->next) {
        if (p->client && !p->dead && (!p->x || !p->x->ops->is_dead(p->x)) && p->mode == s->mode &&
            p->key.sin_addr.s_addr == s->peer.sin_addr.s_addr &&
            p->key.sin_port == s->peer.sin_port) {
            c = p;
            break;
        }
    }
    if (!c) {
        int err = bex__conn_start_client(io, &s->peer, s->mode, &c);
        if (err) {
            bex__sock_fail(s, err, true);
            return;
        }
    }
    uint32_t id = c->next_stream++;
    int err = bex__conn_stream_add(c, id, &s->st);
    if (err) {
        bex__sock_fail(s, err, true);
        return;
    }
    s->conn = c;
    s->id = id;
    if (!c->x) { /* the setup has not chosen the transport yet */
        s->waiting = true;
        return;
    }
    c->x->ops->attach(c->x, &s->st, s->id, true);
    s->attached = true;
    bex__conn_ready(c);
    atomic_store(&s->eng_id, c->eng_id);
    if (c->x->ops->is_up(c->x)) {
        atomic_store(&s->max_msg, c->x->ops->peer_max_msg(c->x));
        bex__sock_set_state(s, S_OPEN);
        if (s->ops.on_connect && !s->app_closed)
            s->ops.on_connect(s, 0, s->user);
    }
}

/* Hand w to its attached socket's transport; the connection has work. */
static void to_transport(struct bex_sock *s, struct sock_msg *w)
{
    s->pending++;
    s->conn->x->ops->send(s->conn->x, &s->st, &w->m);
    bex__conn_ready(s->conn);
}

static void do_send(struct sock_msg *w)
{
    struct bex_sock *s = w->s;
    if (s->waiting && !s->dead) { /* goes to the transport once chosen */
        w->m.next = NULL;
        if (s->wq_tail)
            s->wq_tail->m.next = &w->m;
        else
            s->wq_head = w;
        s->wq_tail = w;
        s->pending++;
        return;
    }
    if (!s->attached || s->dead) {
        /* accepted by bex_sock_send, but the socket died meanwhile */
        void *buf = w->m.buf, *user = w->m.user;
        size_t len = w->m.len;
        bex__sock_msg_put(w);
        bex__sock_report_done(s, buf, len, user, -ECANCELED);
        bex__sock_maybe_finish(s);
        return;
    }
    to_transport(s, w);
}

/* A send on the socket's own I/O thread (from a callback) goes straight
 * to its transport instead of through the command queue, when nothing can
 * be ahead of it: no command waits in the queue or is being run (an
 * earlier send, close or bind of this thread, or one another thread issued
 * before it), the socket's stream is attached, and the transport takes the
 * message without handing it back at once (so that no on_send_done runs
 * inside bex_sock_send). False: queue it as any other thread would. */
bool bex__io_send_now(struct sock_msg *w)
{
    struct bex_sock *s = w->s;
    struct bex__io *io = s->io;
    if (io->draining || atomic_load_explicit(&io->loop.cmds, memory_order_relaxed) || s->waiting ||
        !s->attached || s->dead)
        return false;
    struct bex__xport *x = s->conn->x;
    if (!x->ops->takes || !x->ops->takes(x, &s->st, &w->m))
        return false;
    to_transport(s, w);
    BEX__STAT_ADD(io, direct_sends, 1);
    return true;
}

static void do_close(struct bex_sock *s)
{
    if (s->app_closed)
        return;
    s->app_closed = true;
    if (s->waiting) {
        if (s->wq_head)
            return;         /* its sends go first: closed once attached */
        s->waiting = false; /* nothing to say to the peer: the stream never opened */
    }
    /* Connecting or up alike, the queue is sent, then CLOSE; the engine
     * lets go by on_stream_closed (or on_fail). A stream the peer closed
     * is closing already. */
    if (s->attached && !s->dead) {
        s->conn->x->ops->close_stream(s->conn->x, &s->st);
        bex__conn_ready(s->conn);
    }
    if (!s->attached)
        s->dead = true;
    bex__sock_maybe_finish(s);
}

void bex__io_listen(struct bex__io *io, struct bex_listener *l)
{
    l->next = io->listeners;
    io->listeners = l;
    bex__loop_watch(&io->loop, l->fd, EPOLLIN, &l->tag);
}

/* Forget a closing listener on this thread: its connections here keep
 * going without it while they have sockets (an OPEN on them is refused
 * from now on), and close once they have none: a peer's new sockets then
 * make a new connection, to whatever listens at that address next. */
static void forget_listener(struct bex__io *io, struct bex_listener *l)
{
    for (struct conn *cn = io->conns; cn; cn = cn->next)
        if (cn->l == l)
            cn->l = NULL;
    io->reap = true; /* those without sockets close (bex__conn_reap) */
}

static void do_unlisten(struct bex__io *io, struct bex_listener *l)
{
    for (struct bex_listener **p = &io->listeners; *p; p = &(*p)->next)
        if (*p == l) {
            *p = l->next;
            break;
        }
    bex__loop_unwatch(&io->loop, l->fd);
    forget_listener(io, l);
    /* The other threads next: connections this one handed them are queued
     * there ahead of this word (a queue keeps one pusher's order), and no
     * more come now that the listener is out of epoll. */
    bex_ctx *ctx = io->ctx;
    for (uint32_t i = 0; i < ctx->n_io; i++) {
        if (&ctx->io[i] == io)
            continue;
        l->fwd[i].l = l;
        bex__io_push(&ctx->io[i], &l->fwd[i].cmd, CMD_UNLISTEN_FWD);
    }
    sem_post(&l->done);
}

static bool drain_cmds(struct bex__io *io)
{
    struct bex__cmd *fifo = bex__loop_take(&io->loop);
    if (!fifo)
        return false;
    io->draining = true; /* sends from callbacks meanwhile queue behind these */
    while (fifo) {
        struct bex__cmd *c = fifo;
        fifo = c->next;
        switch (c->type) {
        case CMD_SEND:
            do_send(bex__container_of(c, struct sock_msg, cmd));
            break;
        case CMD_CONNECT:
            do_connect(io, bex__container_of(c, struct bex_sock, connect_cmd));
            break;
        case CMD_CLOSE:
            do_close(bex__container_of(c, struct bex_sock, close_cmd));
            break;
        case CMD_LISTEN: {
            struct bex_listener *l = bex__container_of(c, struct bex_listener, cmd);
            bex__io_listen(io, l);
            sem_post(&l->done);
            break;
        }
        case CMD_SET_USER: {
            struct set_user_cmd *u = bex__container_of(c, struct set_user_cmd, cmd);
            if (u->has_ops)
                u->s->ops = u->ops;
            u->s->user = u->user;
            free(u);
            break;
        }
        case CMD_UNLISTEN:
            do_unlisten(io, bex__container_of(c, struct bex_listener, cmd));
            break;
        case CMD_UNLISTEN_FWD: {
            struct listener_fwd *f = bex__container_of(c, struct listener_fwd, cmd);
            struct bex_listener *l = f->l;
            forget_listener(io, l);
            sem_post(&l->done); /* the last use of l here */
            break;
        }
        case CMD_ADOPT: {
            struct adopt_cmd *a = bex__container_of(c, struct adopt_cmd, cmd);
            bex__conn_adopt(io, a->l, a->fd, &a->peer);
            free(a);
            break;
        }
        case CMD_STOP:
            io->stopping = true;
            break;
        case CMD_BIND:
            bex__exposed_bind(io, bex__container_of(c, struct bind_cmd, cmd));
            break;
        }
    }
    io->draining = false;
    return true;
}

static bool poll_cqs(struct bex__io *io, struct ibv_wc *wc);

static void handle_events(struct bex__io *io, struct epoll_event *ev, int n, struct ibv_wc *wc)
{
    /* A connection's TCP event (its peer closed it) may come with the
     * completions that explain it still in a CQ (the peer's NIC refused our
     * write, then the peer closed): take those first, so that the
     * connection fails for that cause and not for the reset. */
    for (int i = 0; i < n; i++) {
        if (((struct ep_tag *)ev[i].data.ptr)->cq_first) {
            for (int k = 0; k < 4 && poll_cqs(io, wc); k++)
                ;
            break;
        }
    }
    for (int i = 0; i < n; i++) {
        struct ep_tag *t = ev[i].data.ptr;
        t->cb(t, ev[i].events);
    }
}

/* The completion channel's watcher: the CQs are polled on every turn
 * anyway; the events only need acknowledging. */
static void on_channel(struct ep_tag *t, uint32_t events)
{
    (void)events;
    struct bex__io *io = bex__container_of(t, struct bex__io, ch_tag);
    struct ibv_cq *cq;
    void *cq_ctx;
    while (ibv_get_cq_event(io->ch, &cq, &cq_ctx) == 0)
        ibv_ack_cq_events(cq, 1);
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

/* Hand each completion to its engine, found by the id in its wr_id. */
static void dispatch(struct bex__io *io, const struct ibv_wc *wc, int n)
{
    for (int i = 0; i < n; i++) {
        if (bex__wr_engine(wc[i].wr_id) == 0 && io->sh.srq) {
            /* a receive of the shared queue: its QP says whose */
            struct conn *c = bex__engine_srq_complete(io->sh.srq, &wc[i]);
            if (c)
                bex__conn_ready(c);
            continue;
        }
        struct conn *c = bex__conn_by_engine(io, bex__wr_engine(wc[i].wr_id));
        /* else a stale completion of a destroyed engine */
        if (c && c->eng && bex__engine_complete(c->eng, &wc[i]))
            bex__conn_ready(c);
    }
}

/* ibv_poll_cq failed: completions may be lost, and with them the hand-back
 * of messages; no engine of this CQ (q: its index; UINT32_MAX: the shared
 * receive queue's, which every engine of the thread uses) can be trusted
 * to finish. */
static void cq_failed(struct bex__io *io, uint32_t q, int n)
{
    bool any = false;
    for (struct conn *c = io->conns; c; c = c->next) {
        if (c->eng && !c->dead && (c->cq_idx == q || q == UINT32_MAX)) {
            any = true;
            bex__conn_fail(c, -EIO);
        }
    }
    if (any) /* once per failure, not per poll */
        bex__log(&io->ctx->log, BEX_LOG_ERROR, "ibv_poll_cq: %d; every engine failed", n);
}

/* Progress for the connections that have work, and only those: one whose
 * transport says it may have more at once stays on the list for the next
 * turn, the others leave it until a command, completion, event or timer
 * brings them back (bex__conn_ready). */
static bool run_ready(struct bex__io *io)
{
    struct conn *list = io->ready;
    io->ready = NULL;
    bool did = false;
    while (list) {
        struct conn *c = list;
        list = c->ready_next;
        c->ready = false;
        if (!c->x || c->dead)
            continue;
        BEX__STAT_ADD(io, visits, 1);
        if (c->x->ops->progress(c->x)) {
            did = true;
            bex__conn_ready(c);
        }
        /* a callback in progress may have marked it again: it stays */
        uint64_t due = c->x ? c->x->due_us : 0;
        if (due && (!io->due_us || due < io->due_us))
            io->due_us = due;
    }
    return did;
}

/* The earliest deadline a transport set has passed: the connections whose
 * deadline passed get their progress call (a transport sets one only in
 * progress, so every deadline set is seen by run_ready). */
static void wake_due(struct bex__io *io, uint64_t now_us)
{
    uint64_t next = 0;
    for (struct conn *c = io->conns; c; c = c->next) {
        if (!c->x || c->dead || !c->x->due_us)
            continue;
        if (c->x->due_us <= now_us)
            bex__conn_ready(c);
        else if (!next || c->x->due_us < next)
            next = c->x->due_us;
    }
    io->due_us = next;
}

/* Poll every CQ of the thread once (a batch each): whether any had
 * completions. */
static bool poll_cqs(struct bex__io *io, struct ibv_wc *wc)
{
    bool any = false;
    for (uint32_t q = 0; q < io->n_cq; q++) {
        int n = bex__rdma_poll_cq(io->cqs[q].cq, WC_BATCH, wc);
        if (n < 0)
            cq_failed(io, q, n);
        dispatch(io, wc, n);
        any |= n > 0;
    }
    if (io->sh.srq) { /* SRQ mode: every receive completion of the thread */
        /* one at a time: an engine that fails on one takes its QP's
         * others out of what was polled (bex__srq_release), and a
         * completion handed out is never one of a QP destroyed since */
        int n = 0, rc = 0;
        while (n < WC_BATCH && (rc = bex__srq_next(io->sh.srq, &wc[0])) > 0) {
            dispatch(io, wc, 1);
            n++;
        }
        if (rc < 0)
            cq_failed(io, UINT32_MAX, rc);
        any |= n > 0;
    }
    return any;
}

/* A QP that drained gives back the CQ room its engine held (srq.h). */
static void cq_room_back(void *arg, uint32_t cq_idx, uint32_t cqe)
{
    struct bex__io *io = arg;
    io->cqs[cq_idx].used -= cqe;
}

/* Whether the timer tick has anything to do on this thread. */
static bool has_timers(struct bex__io *io)
{
    if (io->conns || (io->sh.srq && io->sh.srq->n_dying)) /* (QPs draining: bex__srq_reap) */
        return true;
    for (struct bex_listener *l = io->listeners; l; l = l->next)
        if (l->paused)
            return true;
    return false;
}

/* The timer tick: connections' deadlines and keepalives, QPs draining,
 * and (with several threads) the frees other threads made of this one's
 * buffers. */
static void io_tick(struct bex__io *io, uint64_t now)
{
    bex__conn_tick(io, now);
    if (io->sh.srq && io->sh.srq->n_dying)
        bex__srq_reap(io->sh.srq, now, false, cq_room_back, io);
    if (io->env->n_io > 1) {
        /* frees of buffers this thread allocated wait in its heaps
         * until it collects them: another thread's exact count of
         * received memory (recv_bytes_max) sees them then */
        bex_mem_pool_collect(io->sh.recv_pool);
        bex_mem_pool_collect(io->sh.landing);
    }
}

/* Sleep until an event, a command, a completion or the next timer (the
 * tick at next_tick, a transport's deadline): arm the CQs, then look once
 * more so nothing slips between. */
static void io_sleep(struct bex__io *io, struct epoll_event *ev, struct ibv_wc *wc,
                     uint64_t next_tick)
{
    for (uint32_t q = 0; q < io->n_cq; q++)
        ibv_req_notify_cq(io->cqs[q].cq, 0);
    if (io->sh.srq)
        ibv_req_notify_cq(io->sh.srq->cq, 0);
    bex__loop_sleep_begin(&io->loop);
    bool found = poll_cqs(io, wc);
    if (found || bex__loop_has_cmds(&io->loop) || io->ready) {
        bex__loop_sleep_end(&io->loop);
        return;
    }
    uint64_t now = bex__now_ms();
    int timeout = next_tick > now ? (int)(next_tick - now) : 0;
    if (!has_timers(io))
        timeout = IDLE_WAKE_MS;
    if (io->due_us) { /* event mode: sleep to a transport's deadline, rounded up */
        uint64_t t = bex__now_us();
        uint64_t due_ms = io->due_us > t ? (io->due_us - t + 999) / 1000 : 0;
        if (due_ms < (uint64_t)timeout)
            timeout = (int)due_ms;
    }
    int m = bex__loop_wait(&io->loop, ev, 16, timeout);
    bex__loop_sleep_end(&io->loop);
    if (m > 0)
        handle_events(io, ev, m, wc);
}

void *bex__io_main(void *arg)
{
    struct bex__io *io = arg;
    bex_ctx *ctx = io->ctx;
    bex__io_ctx = ctx;
    bex__io_self = io;
    struct ibv_wc wc[WC_BATCH];
    struct epoll_event ev[16];
    uint64_t next_tick = 0, idle_since = 0;
    /* Event mode wakes for timers only as often as keepalive needs:
     * every keepalive_ms / 2 (at least TICK_MS) instead of every TICK_MS. */
    uint32_t tick_ms = TICK_MS;
    if (ctx->cfg.poll_mode == BEX_POLL_EVENT && ctx->cfg.keepalive_ms / 2 > TICK_MS)
        tick_ms = ctx->cfg.keepalive_ms / 2;
    uint32_t spins = 0, idle_polls = 0;
    bool spun_out = false;
    while (!io->stopping) {
        BEX__STAT_ADD(io, turns, 1);
        bool did = poll_cqs(io, wc);
        did |= drain_cmds(io);
        if (io->due_us) {
            uint64_t t = bex__now_us();
            if (t >= io->due_us)
                wake_due(io, t);
        }
        did |= run_ready(io);
        bex__conn_reap(io);
        uint64_t now = bex__now_ms();
        if (now >= next_tick) {
            io_tick(io, now);
            next_tick = now + tick_ms;
        }
        if (did) {
            idle_since = 0;
            idle_polls = 0;
            spun_out = false;
            if (++spins % 64 == 0) {
                int m = bex__loop_wait(&io->loop, ev, 16, 0);
                handle_events(io, ev, m, wc);
            }
            continue;
        }
        /* The precise clock may be a system call (see bex__now_ms): while
         * spinning, look at it on every 16th idle poll only. Busy polling
         * never sleeps; event mode sleeps at once. */
        if (ctx->cfg.poll_mode == BEX_POLL_EVENT) {
            spun_out = true;
        } else if (ctx->cfg.poll_mode == BEX_POLL_SPIN_SLEEP && idle_polls++ % 16 == 0) {
            uint64_t t = bex__now_us();
            if (!idle_since)
                idle_since = t;
            /* a transport's deadline is near (some hundred us at most): spin
             * on to it rather than sleep for epoll's whole millisecond */
            spun_out = t - idle_since >= ctx->cfg.poll_spin_us && !io->due_us;
        }
        if (!spun_out) {
            if (++spins % 64 == 0) {
                int m = bex__loop_wait(&io->loop, ev, 16, 0);
                handle_events(io, ev, m, wc);
            }
            continue;
        }
        io_sleep(io, ev, wc, next_tick);
        idle_since = 0;
        idle_polls = 0;
        spun_out = false;
    }
    return NULL;
}
