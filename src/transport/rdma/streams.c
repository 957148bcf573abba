/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA engine: streams (attach, the scheduler ring, queueing, close
 * and detach), split from engine.c along its banner. See engine.h. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/engine_internal.h"

/* ---------------- streams ---------------- */

void bex__engine_attach(struct bex__engine *e, struct bex__stream *st, uint32_t id, bool client)
{
    bex__stream_attach(&e->streams, st, id, client);
    st->eng = e;
}

void bex__engine_queue_release(struct bex__engine *e, uint64_t addr, uint32_t rkey, uint32_t imm)
{
    /* bounded: one entry per peer slot we hold, at most max_rndv */
    assert(e->rel_n < e->max_rndv);
    e->relq[(e->rel_head + e->rel_n) % e->max_rndv] = (struct rndv_rel){addr, rkey, imm};
    e->rel_n++;
    bex__engine_alone_sync(e);
}

/* Is counter c in flight, [head, tail)? */
static bool slot_live(const struct bex__engine *e, uint32_t c)
{
    return c - e->head < e->tail - e->head;
}

/* A message leaves its stream's queue unfinished (the peer closed the
 * stream). Whatever it holds of the peer is given back, and the message
 * itself only once the NIC is done with it: if fragments of it are still
 * in flight, the slot of its last one reports it. */
static void abandon(struct bex__engine *e, struct bex__msg *m)
{
    if (m->rndv_id) {
        /* the answer is on its way: the slot stays taken until it comes,
         * and then releases what the peer granted */
        e->rout[m->rndv_id - 1].m = NULL;
        m->rndv_id = 0;
        m->peer_slot = false;
    }
    if (m->peer_slot) {
        m->peer_slot = false;
        bex__engine_queue_release(e, m->raddr, m->rkey, m->imm);
    }
    int status = m->status ? m->status : ST_UNSENT;
    m->state = BEX__M_QUEUED;
    if (m->off && slot_live(e, m->last_wr)) {
        struct sslot *s = sslot_at(e, m->last_wr);
        assert(!s->done);
        m->status = status;
        m->state = BEX__M_POSTED;
        s->done = m;
        return;
    }
    bex__engine_msg_done(e, m, status);
}

/* Hand back every message still queued on a stream. */
static void flush_queue(struct bex__engine *e, struct bex__stream *st)
{
    struct bex__msg *m = bex__stream_take_queue(st);
    while (m) {
        struct bex__msg *next = m->next;
        m->next = NULL;
        abandon(e, m);
        m = next;
    }
}

void bex__engine_detach(struct bex__stream *st)
{
    struct bex__engine *e = st->eng;
    if (!e)
        return;
    flush_queue(e, st);
    /* posted messages keep a pointer to their stream for accounting */
    for (struct bex__msg *m = e->ack_head; m; m = m->next)
        if (m->st == st)
            m->st = NULL;
    for (uint32_t c = e->head; c != e->tail; c++) {
        struct sslot *s = sslot_at(e, c);
        if (s->done && s->done->st == st)
            s->done->st = NULL;
        if (s->closed == st)
            s->closed = NULL;
    }
    bex__stream_unlink(&e->streams, st);
    st->eng = NULL;
}

/* Both CLOSEs are through: nothing of the stream is in flight either way. */
void bex__engine_finish_stream(struct bex__engine *e, struct bex__stream *st)
{
    bex__stream_move(st, BEX__SE_END);
    bex__stream_unlink(&e->streams, st);
    st->eng = NULL;
    e->ops->on_stream_closed(&e->x, st);
}

bool bex__engine_takes(const struct bex__stream *st)
{
    const struct bex__engine *e = st->eng;
    return e && bex__stream_open(st) && e->state != E_DEAD;
}

void bex__engine_close_stream(struct bex__stream *st)
{
    if (!st->eng || bex__stream_move(st, BEX__SE_CLOSE) <= 0)
        return;
    bex__stream_ring_add(&st->eng->streams, st);
}

void bex__engine_peer_closed(struct bex__stream *st)
{
    struct bex__engine *e = st->eng;
    if (!e)
        return;
    int moved = bex__stream_move(st, BEX__SE_PEER_CLOSE);
    if (moved < 0) { /* handle_ctl fails the engine with it */
        e->stream_fault = bex__engine_violation(e, "a CLOSE of stream %u, which is %s", st->id,
                                                bex__stream_state_name(st->state));
        return;
    }
    if (!moved)
        return;
    /* The peer takes nothing more on this stream; our CLOSE answers its
     * own and tells it we write nothing more into its buffers. */
    flush_queue(e, st);
    if (st->state == BEX__S_CLOSED_BOTH)
        bex__engine_finish_stream(e, st);
    else
        bex__stream_ring_add(&e->streams, st);
}
