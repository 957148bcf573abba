/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport (see tcp.h). */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "transport/tcp/tcp_internal.h"

_Atomic(const struct bex__tcp_wrap *) bex__tcp_wrap_test;

/* The TCP transport itself, when a test wrapped it (bex__tcp_wrap_test). */
struct bex__xport *bex__tcp_unwrap(struct bex__xport *x)
{
    while (x && x->ops->inner)
        x = x->ops->inner(x);
    return x;
}

bool bex__xport_is_tcp_wrapped(const struct bex__xport *x)
{
    x = bex__tcp_unwrap((struct bex__xport *)x);
    return x && x->ops == &bex__tcp_transport;
}

bool bex__tcp_link_lost(const struct bex__xport *x)
{
    return bex__xport_is_tcp(x) && tcp_of(bex__tcp_unwrap((struct bex__xport *)x))->link_lost;
}

void bex__tcp_want_change(struct bex__tcp *t, uint32_t ev)
{
    if (t->state != T_DEAD && bex__loop_modify(t->loop, t->fd, ev, t->tag) == 0)
        t->events = ev;
}

/* ---------------- the rest of the ops ---------------- */

int bex__tcp_create(struct bex__engine_shared *sh, const struct bex__tcp_config *cfg,
                    const struct bex__transport_upcalls *up, void *user, int fd,
                    struct bex__loop *loop, struct ep_tag *tag, struct bex__xport **out)
{
    const struct bex__tcp_wrap *w = atomic_load(&bex__tcp_wrap_test);
    struct bex__xport *outer =
        w ? w->wrap(w->arg, sh, cfg, fd, loop, tag, up, user, &up, &user) : NULL;
    struct bex__tcp *t = calloc(1, sizeof(*t));
    if (outer)
        w->made(outer, t ? &t->x : NULL);
    if (!t)
        return -ENOMEM;
    t->x.ops = &bex__tcp_transport;
    t->x.user = user;
    t->up = up;
    t->sh = sh;
    t->cfg = *cfg;
    t->state = T_NEW;
    bex__stream_set_init(&t->streams);
    if (!t->cfg.ack_delay_us)
        t->cfg.ack_delay_us = BEX__TCP_ACK_DELAY_US;
    t->fd = fd;
    t->loop = loop;
    t->tag = tag;
    t->events = EPOLLIN | EPOLLRDHUP;
    t->last_rx = t->last_tx = bex__now_ms();
    *out = outer ? outer : &t->x;
    return 0;
}

int bex__tcp_prefix(struct bex__xport *x, const void *p, size_t n)
{
    struct bex__tcp *t = tcp_of(bex__tcp_unwrap(x));
    if (t->out_n || t->prefix || !(t->prefix = malloc(n)))
        return -ENOMEM;
    memcpy(t->prefix, p, n);
    struct out_frame *f = &t->out[(t->out_head + t->out_n++) % OUT_MAX];
    memset(f, 0, sizeof(*f));
    f->raw = true;
    f->p = t->prefix;
    f->plen = (uint32_t)n;
    return 0;
}

const char *bex__tcp_state_name(enum bex__tcp_state s)
{
    static const char *const names[] = {[T_NEW] = "NEW", [T_UP] = "UP", [T_DEAD] = "DEAD"};
    return (unsigned)s < ARRAY_SIZE(names) ? names[s] : "?";
}

void bex__tcp_move(struct bex__tcp *t, enum bex__tcp_state to)
{
    enum bex__tcp_state from = t->state;
    assert((from == T_NEW && to == T_UP) || (from != T_DEAD && to == T_DEAD));
    if (t->sh->log && t->sh->log->level >= BEX_LOG_DEBUG)
        bex__log(t->sh->log, BEX_LOG_DEBUG, "%s: over TCP: %s -> %s", t->cfg.name,
                 bex__tcp_state_name(from), bex__tcp_state_name(to));
    t->state = to;
}

void bex__tcp_start(struct bex__xport *x)
{
    struct bex__tcp *t = tcp_of(bex__tcp_unwrap(x));
    bex__tcp_move(t, T_UP);
    t->last_rx = t->last_tx = bex__now_ms();
    t->up->on_up(&t->x);
    if (t->state != T_DEAD)
        bex__tcp_want(t);
}

static void tcp_destroy(struct bex__xport *x)
{
    struct bex__tcp *t = tcp_of(x);
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    struct part *p;
    while ((p = bex__hmap_next(&t->parts, &it, NULL))) {
        bex__hmap_del(&t->parts, p->stream);
        bex__tcp_part_free(t, p);
    }
    if (t->one_busy)
        bex__tcp_part_free(t, &t->one);
    bex__hmap_free(&t->parts);
    free(t->ctlq);
    free(t->prefix);
    free(t);
}

static bool tcp_is_up(struct bex__xport *x)
{
    return tcp_of(x)->state == T_UP;
}

static bool tcp_is_dead(struct bex__xport *x)
{
    return tcp_of(x)->state == T_DEAD;
}

static uint32_t tcp_peer_max_msg(struct bex__xport *x)
{
    return tcp_of(x)->cfg.peer_max_msg;
}

const struct bex__transport_ops bex__tcp_transport = {
    .name = "tcp",
    .destroy = tcp_destroy,
    .is_up = tcp_is_up,
    .is_dead = tcp_is_dead,
    .peer_max_msg = tcp_peer_max_msg,
    .refuse_stream = bex__tcp_refuse_stream,
    .attach = bex__tcp_attach,
    .send = bex__tcp_send,
    .send_now = bex__tcp_send_now,
    .close_stream = bex__tcp_close_stream,
    .peer_closed = bex__tcp_peer_closed,
    .progress = bex__tcp_progress,
    .tick = bex__tcp_tick,
    .fail = bex__tcp_fail,
};
