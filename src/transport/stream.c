/* SPDX-License-Identifier: Apache-2.0 */
/* The stream core both transports specialise. See stream.h. */
#include <assert.h>
#include <errno.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "loop/loop.h"
#include "transport/stream.h"

void bex__stream_set_init(struct bex__stream_set *s)
{
    bex__list_init(&s->all);
    bex__list_init(&s->ring);
    s->ring_n = 0;
}

void bex__stream_attach(struct bex__stream_set *s, struct bex__stream *st, uint32_t id, bool client)
{
    memset(st, 0, sizeof(*st));
    bex__list_init(&st->all_node);
    bex__list_init(&st->ring_node);
    st->id = id;
    st->state = client ? BEX__S_OPENING : BEX__S_OPEN;
    bex__list_push_head(&s->all, &st->all_node);
    if (client)
        bex__stream_ring_add(s, st);
}

void bex__stream_ring_add(struct bex__stream_set *s, struct bex__stream *st)
{
    if (bex__stream_in_ring(st))
        return;
    bex__list_push_tail(&s->ring, &st->ring_node);
    s->ring_n++;
}

void bex__stream_ring_remove(struct bex__stream_set *s, struct bex__stream *st)
{
    if (!bex__stream_in_ring(st))
        return;
    bex__list_remove(&st->ring_node);
    s->ring_n--;
}

struct bex__stream *bex__stream_ring_turn(struct bex__stream_set *s)
{
    struct bex__stream *st = bex__stream_ring_first(s);
    if (st)
        bex__list_rotate(&s->ring);
    return st;
}

void bex__stream_unlink(struct bex__stream_set *s, struct bex__stream *st)
{
    bex__stream_ring_remove(s, st);
    bex__list_remove(&st->all_node);
}

struct bex__stream *bex__stream_find(const struct bex__stream_set *s, uint32_t id)
{
    const struct bex__list *n;
    bex__list_foreach(n, &s->all)
    {
        struct bex__stream *st = bex__list_entry(n, struct bex__stream, all_node);
        if (st->id == id)
            return st;
    }
    return NULL;
}

void bex__stream_enqueue(struct bex__stream *st, struct bex__msg *m)
{
    m->next = NULL;
    if (st->q_tail)
        st->q_tail->next = m;
    else
        st->q_head = m;
    st->q_tail = m;
    st->q_len++;
}

struct bex__msg *bex__stream_take_queue(struct bex__stream *st)
{
    struct bex__msg *m = st->q_head;
    st->q_head = st->q_tail = NULL;
    st->q_len = 0;
    return m;
}

bool bex__ack_hold_due(struct bex__xport *x, uint64_t *held, uint32_t delay_us)
{
    uint64_t now = bex__now_us();
    if (!*held) {
        *held = now ? now : 1;
        x->due_us = *held + delay_us;
        return false;
    }
    return now >= x->due_us;
}

int bex__stream_violation(struct bex__log *log, const char *name, const char *transport,
                          uint32_t *said, const char *what)
{
    bex__log_once(log, said, BEX__SAID_VIOLATION, BEX_LOG_WARN,
                  "%s: over %s: protocol violation by the peer: %s (the connection fails)", name,
                  transport, what);
    return -EPROTO;
}

/* The next state for ev: -1 illegal there, -2 nothing to do. */
static int next_state(unsigned s, enum bex__stream_event ev)
{
    switch (ev) {
    case BEX__SE_OPEN_SENT:
        return s == BEX__S_OPENING ? BEX__S_OPEN : s == BEX__S_OPENING_CLOSE ? BEX__S_CLOSING : -1;
    case BEX__SE_CLOSE:
        return s == BEX__S_OPENING ? BEX__S_OPENING_CLOSE : s == BEX__S_OPEN ? BEX__S_CLOSING : -2;
    case BEX__SE_CLOSE_SENT:
        return s == BEX__S_CLOSING       ? BEX__S_CLOSE_SENT
               : s == BEX__S_PEER_CLOSED ? BEX__S_CLOSE_SENT_PEER
                                         : -1;
    case BEX__SE_CLOSE_DONE:
        return s == BEX__S_CLOSE_SENT        ? BEX__S_CLOSE_DONE
               : s == BEX__S_CLOSE_SENT_PEER ? BEX__S_CLOSED_BOTH
                                             : -1;
    case BEX__SE_PEER_CLOSE:
        switch (s) {
        case BEX__S_OPEN:
        case BEX__S_CLOSING:
            return BEX__S_PEER_CLOSED;
        case BEX__S_CLOSE_SENT:
            return BEX__S_CLOSE_SENT_PEER;
        case BEX__S_CLOSE_DONE:
            return BEX__S_CLOSED_BOTH;
        default:
            return -1;
        }
    case BEX__SE_END:
        return s == BEX__S_CLOSED_BOTH ? BEX__S_ENDED : -1;
    case BEX__SE_FAIL:
        return BEX__S_FAILED;
    }
    return -1;
}

int bex__stream_move(struct bex__stream *st, enum bex__stream_event ev)
{
    if (st->state == BEX__S_FAILED)
        return 0; /* whatever was still under way when it failed */
    int next = next_state(st->state, ev);
    if (next == -2)
        return 0;
    if (next < 0) {
        /* the peer's CLOSE is the one move a peer drives */
        assert(ev == BEX__SE_PEER_CLOSE);
        return -EPROTO;
    }
    st->state = (uint8_t)next;
    return 1;
}

const char *bex__stream_state_name(unsigned state)
{
    static const char *const names[] = {
        [BEX__S_OPENING] = "opening",
        [BEX__S_OPENING_CLOSE] = "opening, closed",
        [BEX__S_OPEN] = "open",
        [BEX__S_CLOSING] = "closing",
        [BEX__S_PEER_CLOSED] = "closed by the peer",
        [BEX__S_CLOSE_SENT] = "close sent",
        [BEX__S_CLOSE_SENT_PEER] = "close sent, closed by the peer",
        [BEX__S_CLOSE_DONE] = "close done",
        [BEX__S_CLOSED_BOTH] = "closed both ways",
        [BEX__S_ENDED] = "ended",
        [BEX__S_FAILED] = "failed",
    };
    return state < ARRAY_SIZE(names) ? names[state] : "?";
}
