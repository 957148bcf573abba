/* The I/O thread: commands, completions, events, timers, sleep. */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "sock/internal.h"

#define TICK_MS  10
#define WC_BATCH 64

_Thread_local bex_ctx *bex__io_ctx;

static void do_connect(bex_ctx *ctx, struct bex_sock *s)
{
    struct conn *c = NULL;
    for (struct conn *p = ctx->conns; p; p = p->next) {
        if (p->client && !p->dead && (!p->x || !p->x->ops->is_dead(p->x)) && p->mode == s->mode &&
            p->key.sin_addr.s_addr == s->peer.sin_addr.s_addr &&
            p->key.sin_port == s->peer.sin_port) {
            c = p;
            break;
        }
    }
    if (!c) {
        int err = bex__conn_start_client(ctx, &s->peer, s->mode, &c);
        if (err) {
            bex__sock_fail(s, err, true);
            return;
        }
    }
    s->conn = c;
    s->id = c->next_stream++;
    bex__conn_map_add(c, s);
    if (!c->x) { /* the setup has not chosen the transport yet */
        s->waiting = true;
        return;
    }
    c->x->ops->attach(c->x, &s->st, s->id, true);
    s->attached = true;
    atomic_store(&s->eng_id, c->eng_id);
    if (c->x->ops->is_up(c->x)) {
        atomic_store(&s->max_msg, c->x->ops->peer_max_msg(c->x));
        atomic_store(&s->state, S_OPEN);
        if (s->ops.on_connect && !s->app_closed)
            s->ops.on_connect(s, 0, s->user);
    }
}

static void do_send(bex_ctx *ctx, struct sock_msg *w)
{
    (void)ctx;
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
        bex__sock_report_done(s, w->m.buf, w->m.len, w->m.user, -ECANCELED);
        free(w);
        bex__sock_maybe_finish(s);
        return;
    }
    s->pending++;
    s->conn->x->ops->send(s->conn->x, &s->st, &w->m);
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
    if (s->attached && !s->dead)
        s->conn->x->ops->close_stream(s->conn->x, &s->st);
    if (!s->attached)
        s->dead = true;
    bex__sock_maybe_finish(s);
}

void bex__io_listen(bex_ctx *ctx, struct bex_listener *l)
{
    l->next = ctx->listeners;
    ctx->listeners = l;
    bex__loop_watch(&ctx->loop, l->fd, EPOLLIN, &l->tag);
}

static bool drain_cmds(bex_ctx *ctx)
{
    struct bex__cmd *fifo = bex__loop_take(&ctx->loop);
    if (!fifo)
        return false;
    while (fifo) {
        struct bex__cmd *c = fifo;
        fifo = c->next;
        switch (c->type) {
        case CMD_SEND:
            do_send(ctx, bex__container_of(c, struct sock_msg, cmd));
            break;
        case CMD_CONNECT:
            do_connect(ctx, bex__container_of(c, struct bex_sock, connect_cmd));
            break;
        case CMD_CLOSE:
            do_close(bex__container_of(c, struct bex_sock, close_cmd));
            break;
        case CMD_LISTEN: {
            struct bex_listener *l = bex__container_of(c, struct bex_listener, cmd);
            bex__io_listen(ctx, l);
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
        case CMD_UNLISTEN: {
            struct bex_listener *l = bex__container_of(c, struct bex_listener, cmd);
            for (struct bex_listener **p = &ctx->listeners; *p; p = &(*p)->next)
                if (*p == l) {
                    *p = l->next;
                    break;
                }
            bex__loop_unwatch(&ctx->loop, l->fd);
            for (struct conn *cn = ctx->conns; cn; cn = cn->next)
                if (cn->l == l)
                    cn->l = NULL;
            sem_post(&l->done);
            break;
        }
        case CMD_STOP:
            ctx->stopping = true;
            break;
        case CMD_BIND:
            bex__exposed_bind(ctx, bex__container_of(c, struct bind_cmd, cmd));
            break;
        }
    }
    return true;
}

static void handle_events(bex_ctx *ctx, struct epoll_event *ev, int n)
{
    for (int i = 0; i < n; i++) {
        struct ep_tag *t = ev[i].data.ptr;
        switch (t->kind) {
        case EV_CHANNEL: {
            struct ibv_cq *cq;
            void *cq_ctx;
            while (ibv_get_cq_event(ctx->ch, &cq, &cq_ctx) == 0)
                ibv_ack_cq_events(cq, 1);
            break;
        }
        case EV_LISTENER:
            bex__listener_accept(ctx, bex__container_of(t, struct bex_listener, tag));
            break;
        case EV_CONN:
            bex__conn_step(bex__container_of(t, struct conn, tag), ev[i].events);
            break;
        }
    }
}

/* Hand each completion to its engine, found by the id in its wr_id. */
static void dispatch(bex_ctx *ctx, const struct ibv_wc *wc, int n)
{
    for (int i = 0; i < n; i++) {
        struct conn *c = bex__conn_by_engine(ctx, bex__wr_engine(wc[i].wr_id));
        if (c && c->eng) /* else a stale completion of a destroyed engine */
            bex__engine_complete(c->eng, &wc[i]);
    }
}

/* ibv_poll_cq failed: completions may be lost, and with them the hand-back
 * of messages; no engine of this CQ can be trusted to finish. */
static void cq_failed(bex_ctx *ctx, int n)
{
    bool any = false;
    for (struct conn *c = ctx->conns; c; c = c->next) {
        if (c->eng && !c->dead) {
            any = true;
            bex__conn_fail(c, -EIO);
        }
    }
    if (any) /* once per failure, not per poll */
        bex__log(&ctx->log, BEX_LOG_ERROR, "ibv_poll_cq: %d; every engine failed", n);
}

void *bex__io_main(void *arg)
{
    bex_ctx *ctx = arg;
    bex__io_ctx = ctx;
    struct ibv_wc wc[WC_BATCH];
    struct epoll_event ev[16];
    uint64_t next_tick = 0, idle_since = 0;
    uint32_t spins = 0, idle_polls = 0;
    bool spun_out = false;
    while (!ctx->stopping) {
        bool did = false;
        int n = ctx->sh.cq ? bex__rdma_poll_cq(ctx->sh.cq, WC_BATCH, wc) : 0;
        if (n < 0)
            cq_failed(ctx, n);
        dispatch(ctx, wc, n);
        did |= n > 0;
        did |= drain_cmds(ctx);
        for (struct conn *c = ctx->conns; c; c = c->next)
            if (c->x && !c->dead)
                did |= c->x->ops->progress(c->x);
        bex__conn_reap(ctx);
        uint64_t now = bex__now_ms();
        if (now >= next_tick) {
            bex__conn_tick(ctx, now);
            next_tick = now + TICK_MS;
        }
        if (did) {
            idle_since = 0;
            idle_polls = 0;
            spun_out = false;
            if (++spins % 64 == 0) {
                int m = bex__loop_wait(&ctx->loop, ev, 16, 0);
                handle_events(ctx, ev, m);
            }
            continue;
        }
        /* The precise clock may be a system call (see bex__now_ms): while
         * spinning, look at it on every 16th idle poll only. */
        if (idle_polls++ % 16 == 0) {
            uint64_t t = bex__now_us();
            if (!idle_since)
                idle_since = t;
            spun_out = t - idle_since >= ctx->cfg.poll_spin_us;
        }
        if (!spun_out) {
            if (++spins % 64 == 0) {
                int m = bex__loop_wait(&ctx->loop, ev, 16, 0);
                handle_events(ctx, ev, m);
            }
            continue;
        }
        /* Sleep: arm the CQ, then look once more so nothing slips between. */
        if (ctx->sh.cq)
            ibv_req_notify_cq(ctx->sh.cq, 0);
        bex__loop_sleep_begin(&ctx->loop);
        n = ctx->sh.cq ? bex__rdma_poll_cq(ctx->sh.cq, WC_BATCH, wc) : 0;
        if (n < 0)
            cq_failed(ctx, n);
        if (n > 0 || bex__loop_has_cmds(&ctx->loop)) {
            bex__loop_sleep_end(&ctx->loop);
            dispatch(ctx, wc, n);
            idle_since = 0;
            idle_polls = 0;
            spun_out = false;
            continue;
        }
        now = bex__now_ms();
        int timeout = next_tick > now ? (int)(next_tick - now) : 0;
        int m = bex__loop_wait(&ctx->loop, ev, 16, timeout);
        bex__loop_sleep_end(&ctx->loop);
        if (m > 0)
            handle_events(ctx, ev, m);
        idle_since = 0;
        idle_polls = 0;
        spun_out = false;
    }
    return NULL;
}
