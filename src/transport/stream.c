/* The stream core both transports specialise. See stream.h. */
#include <errno.h>
#include <string.h>

#include "common/log.h"
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
    st->need_open = client;
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
                          bool *logged, const char *what)
{
    if (!*logged)
        bex__log(log, BEX_LOG_WARN,
                 "%s: over %s: protocol violation by the peer: %s (the connection fails)", name,
                 transport, what);
    *logged = true;
    return -EPROTO;
}
