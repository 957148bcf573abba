/* SPDX-License-Identifier: Apache-2.0 */
/* The I/O thread's commands: what sock asks of it (bex__sock_drain_cmds,
 * bex__conn_owner_ops.drain_cmds); the loop itself is conn/thread.c. */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "sock/internal.h"
#include "transport/rdma/srq.h"

static void do_connect(struct bex__io *io, struct bex_sock *s)
{
    struct conn *c = NULL;
    struct bex__list *n;
    bex__list_foreach(n, &io->conns)
    {
        struct conn *p = bex__conn_of(n);
        if (p->client && !bex__conn_dead(p) && (!p->x || !p->x->ops->is_dead(p->x)) &&
            p->mode == s->mode && bex_addr_equal(&p->key, &s->peer)) {
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
    bex__sock_move(s, SK_EV_ATTACH);
    bex__conn_ready(c);
    atomic_store(&s->eng_id, c->eng_id);
    if (c->x->ops->is_up(c->x)) {
        atomic_store(&s->max_msg, bex__sock_peer_limit(c->x->ops->peer_max_msg(c->x)));
        bex__sock_set_state(s, S_OPEN);
        if (s->ops.on_connect && !bex__sock_app_closed(s))
            s->ops.on_connect(s, 0, s->user);
    }
}

static void do_send(struct sock_msg *w)
{
    struct bex_sock *s = w->s;
    if (s->waiting && !bex__sock_dead(s)) { /* goes to the transport once chosen */
        w->m.next = NULL;
        if (s->wq_tail)
            s->wq_tail->m.next = &w->m;
        else
            s->wq_head = w;
        s->wq_tail = w;
        s->pending++;
        return;
    }
    if (!bex__sock_attached(s) || bex__sock_dead(s)) {
        /* accepted by bex_sock_send, but the socket died meanwhile */
        void *buf = w->m.buf, *user = w->m.user;
        size_t len = w->m.len;
        bex__sock_msg_put(w);
        bex__sock_report_done(s, buf, len, user, -ECANCELED);
        bex__sock_maybe_finish(s);
        return;
    }
    bex__sock_to_transport(s, w);
}

static void do_close(struct bex_sock *s)
{
    if (bex__sock_app_closed(s))
        return;
    bex__sock_move(s, SK_EV_CLOSE);
    if (s->waiting) {
        if (s->wq_head)
            return;         /* its sends go first: closed once attached */
        s->waiting = false; /* nothing to say to the peer: the stream never opened */
    }
    /* Connecting or up alike, the queue is sent, then CLOSE; the engine
     * lets go by on_stream_closed (or on_fail). A stream the peer closed
     * is closing already. */
    if (bex__sock_attached(s) && !bex__sock_dead(s)) {
        s->conn->x->ops->close_stream(s->conn->x, &s->st);
        bex__conn_ready(s->conn);
    }
    if (!bex__sock_attached(s) && !bex__sock_dead(s))
        bex__sock_move(s, SK_EV_DIE);
    bex__sock_maybe_finish(s);
}

void bex__io_listen(struct bex__io *io, struct bex_listener *l)
{
    bex__list_push_head(&io->listeners, &l->link);
    bex__loop_watch(&io->loop, l->fd, EPOLLIN, &l->tag);
}

/* Forget a closing listener on this thread: its connections here keep
 * going without it while they have sockets (an OPEN on them is refused
 * from now on), and close once they have none: a peer's new sockets then
 * make a new connection, to whatever listens at that address next. */
static void forget_listener(struct bex__io *io, struct bex_listener *l)
{
    struct bex__list *n;
    bex__list_foreach(n, &io->conns)
    {
        struct conn *cn = bex__conn_of(n);
        if (cn->l == l)
            cn->l = NULL;
    }
    bex__io_reap_due(io); /* those without sockets close (bex__conn_reap) */
}

static void do_unlisten(struct bex__io *io, struct bex_listener *l)
{
    bex__list_remove(&l->link);
    bex__loop_unwatch(&io->loop, l->fd);
    bex__listener_pause_stop(l);
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

bool bex__sock_drain_cmds(struct bex__io *io)
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
            bex__io_move(io, IO_STOPPING);
            break;
        case CMD_BIND:
            bex__exposed_bind(io, bex__container_of(c, struct bind_cmd, cmd));
            break;
        }
    }
    io->draining = false;
    return true;
}
