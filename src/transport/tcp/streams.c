/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport: streams (attach, the scheduler ring, queueing, close,
 * refusals), split from tcp.c along its banner. See tcp.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "transport/tcp/tcp_internal.h"

/* ---------------- streams ---------------- */

void bex__tcp_ring_add(struct bex__tcp *t, struct bex__stream *st)
{
    if (!bex__stream_gone(st))
        bex__stream_ring_add(&t->streams, st);
}

/* Both CLOSEs are through: the stream ends (it is not in the ring: nothing
 * is left to send). */
void bex__tcp_stream_maybe_end(struct bex__tcp *t, struct bex__stream *st)
{
    if (st->state != BEX__S_CLOSED_BOTH)
        return;
    bex__stream_move(st, BEX__SE_END); /* never scheduled again */
    bex__stream_unlink(&t->streams, st);
    t->up->on_stream_closed(&t->x, st);
}

void bex__tcp_attach(struct bex__xport *x, struct bex__stream *st, uint32_t id, bool client)
{
    bex__stream_attach(&tcp_of(x)->streams, st, id, client);
}

/* m as st's: its fields the send sets */
static inline void tcp_msg_init(struct bex__stream *st, struct bex__msg *m)
{
    m->next = NULL;
    m->st = st;
    m->off = 0;
    m->state = BEX__M_QUEUED;
}

/* Why t cannot send m on st now: -ECANCELED (dead, or the stream not
 * open), -EMSGSIZE (over the peer's limit: queued before the peer was
 * known), else 0. */
static inline int tcp_refusal(const struct bex__tcp *t, const struct bex__stream *st,
                              const struct bex__msg *m)
{
    if (t->state == T_DEAD || !bex__stream_open(st))
        return -ECANCELED;
    if (!m->direct && m->len > t->cfg.peer_max_msg)
        return -EMSGSIZE;
    return 0;
}

struct bex__msg *bex__tcp_send_now(struct bex__stream *st, struct bex__msg *m, struct bex__xport *x)
{
    struct bex__tcp *t = tcp_of(x);
    if (tcp_refusal(t, st, m))
        return m;
    tcp_msg_init(st, m);
    bex__stream_enqueue(st, m);
    bex__tcp_ring_add(t, st);
    return NULL;
}

void bex__tcp_send(struct bex__xport *x, struct bex__stream *st, struct bex__msg *m)
{
    struct bex__tcp *t = tcp_of(x);
    tcp_msg_init(st, m);
    int err = tcp_refusal(t, st, m);
    if (err) {
        bex__tcp_done(t, m, err);
        return;
    }
    bex__stream_enqueue(st, m);
    bex__tcp_ring_add(t, st);
}

void bex__tcp_close_stream(struct bex__xport *x, struct bex__stream *st)
{
    struct bex__tcp *t = tcp_of(x);
    if (bex__stream_move(st, BEX__SE_CLOSE) <= 0)
        return;
    bex__tcp_ring_add(t, st);
}

bool bex__tcp_ctl_push(struct bex__tcp *t, uint8_t type, uint32_t stream, struct bex__stream *st)
{
    if (t->ctl_n == t->ctl_cap) {
        uint32_t cap = t->ctl_cap ? t->ctl_cap * 2 : 16;
        struct ctl *q = malloc(cap * sizeof(*q));
        if (!q)
            return false;
        for (uint32_t i = 0; i < t->ctl_n; i++)
            q[i] = t->ctlq[(t->ctl_head + i) % t->ctl_cap];
        free(t->ctlq);
        t->ctlq = q;
        t->ctl_head = 0;
        t->ctl_cap = cap;
    }
    t->ctlq[(t->ctl_head + t->ctl_n++) % t->ctl_cap] = (struct ctl){type, stream, st};
    return true;
}

/* The peer closed the stream: what is queued comes back (-ECANCELED); a
 * message with frames in the batch is cut off after them (the peer drops
 * what it has of it); our CLOSE answers. */
void bex__tcp_peer_closed(struct bex__xport *x, struct bex__stream *st)
{
    struct bex__tcp *t = tcp_of(x);
    struct bex__msg *m = st->q_head;
    if (m && m->off > 0) {
        /* its earlier frames are written or in the batch */
        st->q_head = m->next;
        st->q_len--;
        bool in_batch = false;
        for (uint32_t i = t->out_n; i-- > 0;) {
            struct out_frame *f = &t->out[(t->out_head + i) % OUT_MAX];
            if (f->m == m) {
                f->last = f->cut = true;
                in_batch = true;
                break;
            }
        }
        if (!in_batch)
            bex__tcp_done(t, m, -ECANCELED);
    }
    while (st->q_head) {
        m = st->q_head;
        st->q_head = m->next;
        bex__tcp_done(t, m, -ECANCELED);
    }
    st->q_tail = NULL;
    st->q_len = 0;
    /* our CLOSE answers (the peer's is recorded as it arrived: on_header) */
    bex__stream_move(st, BEX__SE_CLOSE);
    bex__tcp_ring_add(t, st);
}

int bex__tcp_refuse_stream(struct bex__xport *x, uint32_t id)
{
    struct bex__tcp *t = tcp_of(x);
    /* bounded by what the peer sends: each refusal answers an OPEN frame */
    if (t->ctl_n >= 4096)
        return -EPROTO;
    return bex__tcp_ctl_push(t, BEX__MSG_CLOSE, id, NULL) ? 0 : -EPROTO;
}
