/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA engine: the send side (the scheduler, work requests and their
 * posting, credits and the send window) and bex__engine_progress, split
 * from engine.c along its banner. See engine.h. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/engine_internal.h"

/* ---------------- send side ---------------- */

/* A free slot's marks (its message, CLOSE and window to deallocate) are
 * NULL: calloc'd so, set only after the slot is taken, and cleared by
 * whoever consumes them (the retirement, slot_retired and send_retire;
 * the failure's walk of the slots; the acknowledgement scan; a stream's
 * detach; release_windows), so that taking a slot stores none of them. */
static inline bool slot_marks_clear(const struct sslot *s)
{
    return !s->done && !s->closed && !s->free_mw;
}

/* The next send slot, its work request cleared but for the unions of
 * remote addresses and window binds, which a SEND does not read (see
 * slot_take); its sg_list points at its sge from the start (engine_areas),
 * and bex__engine_post_pending links the chain (wr.next). */
static inline struct sslot *slot_take_send(struct bex__engine *e)
{
    struct sslot *s = sslot_at(e, e->tail);
    assert(s->wr.sg_list == s->sge);
    assert(slot_marks_clear(s));
    s->wr.wr_id = wrid(e, e->tail & WR_CNT_MASK);
    s->wr.num_sge = 0;
    s->wr.opcode = IBV_WR_SEND;
    s->wr.send_flags = 0;
    s->wr.imm_data = 0;
    s->bytes = 0;
    e->tail++;
    return s;
}

/* The next send slot, its work request all cleared. */
struct sslot *bex__engine_slot_take(struct bex__engine *e)
{
    struct sslot *s = slot_take_send(e);
    e->chain_loud = true; /* no SEND: wr_quiet refuses it */
    memset(&s->wr.wr, 0, sizeof(s->wr.wr));
    memset(&s->wr.qp_type, 0, sizeof(s->wr.qp_type));
    memset(&s->wr.bind_mw, 0, sizeof(s->wr.bind_mw));
    return s;
}

static void account_bytes(struct bex__engine *e, struct sslot *s, uint32_t bytes)
{
    s->bytes = bytes;
    e->inflight += bytes;
    if (e->inflight > atomic_load_explicit(&e->stats->max_inflight_bytes, memory_order_relaxed))
        atomic_store_explicit(&e->stats->max_inflight_bytes, e->inflight, memory_order_relaxed);
}

/* A work request that takes one of the peer's receives: the peer hears
 * from us (its keepalive is put off, bex__engine_tick) once it is posted,
 * which this progress call does. */
static void spend_credit(struct bex__engine *e)
{
    e->peer_credits--;
    e->cons_sent++;
    e->peer_hears = true;
}

/* Prepare a SEND of header h (and payload). Caller checked slot + credit. */
static struct sslot *prep_send(struct bex__engine *e, struct bex__hdr *h, void *payload,
                               uint32_t len, uint32_t lkey)
{
    struct sslot *s = slot_take_send(e);
    h->credits = (uint16_t)(e->to_return > 0xffff ? 0xffff : e->to_return);
    e->to_return -= h->credits;
    bex__hdr_encode(h, s->hdr);
    s->sge[0] = (struct ibv_sge){(uintptr_t)s->hdr, BEX__HDR_LEN, e->hdr_lkey};
    s->wr.num_sge = 1;
    if (len) {
        s->sge[1] = (struct ibv_sge){(uintptr_t)payload, len, lkey};
        s->wr.num_sge = 2;
    }
    s->wr.opcode = IBV_WR_SEND;
    spend_credit(e);
    account_bytes(e, s, len);
    BEX__STAT_ADD(e->stats, sends_posted, 1);
    return s;
}

/* A gathered message's buffers (nseg, m's) as s's SGEs from sge[first]
 * on, one per buffer (goes_eager checked they fit the QP). Inline: a call
 * would make the frame of a gathered lone message (send_gathered_way)
 * save registers. */
__attribute__((always_inline)) static inline void
gather_segs(struct sslot *s, int first, const struct bex__msg *m, unsigned nseg)
{
    for (unsigned i = 0; i < nseg; i++)
        s->sge[first + i] =
            (struct ibv_sge){(uintptr_t)m->seg[i].buf, m->seg[i].len, m->seg[i].lkey};
    s->wr.num_sge = first + (int)nseg;
}

/* m's bytes as s's SGEs from sge[first] on: one for a plain message (no
 * call), one per buffer for a gathered one. nseg is m's, passed so that a
 * caller that knows it is 0 (the plain lone message) compiles no loop. */
__attribute__((always_inline)) static inline void gather(struct sslot *s, int first,
                                                         const struct bex__msg *m, unsigned nseg)
{
    if (nseg) {
        gather_segs(s, first, m, nseg);
        return;
    }
    s->sge[first] = (struct ibv_sge){(uintptr_t)m->buf, (uint32_t)m->len, m->lkey};
    s->wr.num_sge = first + 1;
}

/* Prepare the header-free SEND_WITH_IMM of DATA m (the immediate carries
 * stream and credits). Caller checked slot + credit, and sets s->done
 * (eager_prep). The slot's fields are set once each (slot_take_send's,
 * unrolled: no store cleared first and set again). */
__attribute__((always_inline)) static inline struct sslot *
prep_data(struct bex__engine *e, struct bex__stream *st, struct bex__msg *m, unsigned nseg)
{
    struct sslot *s = sslot_at(e, e->tail);
    assert(s->wr.sg_list == s->sge);
    assert(slot_marks_clear(s));
    s->wr.wr_id = wrid(e, e->tail & WR_CNT_MASK);
    e->tail++;
    uint32_t credits = e->to_return > BEX__IMM_CREDITS_MAX ? BEX__IMM_CREDITS_MAX : e->to_return;
    e->to_return -= credits;
    uint32_t len = (uint32_t)m->len;
    s->wr.imm_data = htonl(bex__imm_encode(st->id, credits));
    s->wr.opcode = IBV_WR_SEND_WITH_IMM;
    if (len) {
        gather(s, 0, m, nseg);
        /* copied into the work request at posting: the NIC reads no memory */
        if (len <= e->max_inline) {
            s->wr.send_flags = IBV_SEND_INLINE;
        } else {
            s->wr.send_flags = 0;
            e->chain_loud = true; /* the NIC reads m after posting */
        }
    } else {
        s->wr.num_sge = 0;
        s->wr.send_flags = 0;
    }
    spend_credit(e);
    account_bytes(e, s, len);
    BEX__STAT_ADD(e->stats, sends_posted, 1);
    return s;
}

/* Does m go by SEND? Up to the peer's eager_max header-free; on a stream
 * the immediate cannot name, with the header in front, so it must fit the
 * peer's receive buffer with it (zero bytes always do). */
static inline bool goes_eager(const struct bex__engine *e, const struct bex__stream *st,
                              const struct bex__msg *m)
{
    if (m->direct || m->len > e->peer_eager)
        return false;
    /* a gathered message whose buffers (and header) the QP cannot carry in
     * one request takes the rendezvous way: one buffer a WRITE */
    if (m->nseg && m->nseg + (st->id <= BEX__IMM_STREAM_MAX ? 0u : 1u) > e->max_sge)
        return false;
    return st->id <= BEX__IMM_STREAM_MAX || m->len + BEX__HDR_LEN <= e->peer_eager || m->len == 0;
}

static void pop_head(struct bex__stream *st)
{
    struct bex__msg *m = st->q_head;
    st->q_head = m->next;
    if (!st->q_head)
        st->q_tail = NULL;
    st->q_len--;
    m->next = NULL;
}

/* Ask for destinations of large messages ahead of the head. */
static bool try_rndv_req(struct bex__engine *e, struct bex__stream *st, bool *blocked)
{
    uint32_t ahead = 0;
    for (struct bex__msg *m = st->q_head; m && ahead < e->cfg.rndv_ahead; m = m->next, ahead++) {
        if (m->direct || goes_eager(e, st, m) || m->rndv_asked || m->status)
            continue;
        if (m->len > e->peer_max_msg) {
            m->status = -EMSGSIZE; /* the peer said it takes none so large */
            continue;
        }
        if (e->peer_rndv_used >= e->peer_max_rndv || e->rout_used >= e->max_rndv ||
            !bex__engine_free_slots(e)) {
            *blocked = true;
            return false;
        }
        if (!bex__engine_have_credit(e, false)) {
            BEX__STAT_ADD(e->stats, credit_stalls, 1);
            *blocked = true;
            return false;
        }
        uint32_t i = 0;
        while (e->rout[i].used)
            i++;
        e->rout[i].m = m;
        e->rout[i].used = true;
        e->rout[i].sent_ms = bex__now_ms();
        e->rout[i].gen = (uint16_t)((e->rout[i].gen + 1) & 0x7fff);
        e->rout_used++;
        e->peer_rndv_used++;
        m->peer_slot = true;
        m->rndv_id = i + 1;
        m->rndv_asked = true;
        m->state = BEX__M_RNDV_SENT;
        struct bex__hdr h = {.type = BEX__MSG_RNDV_REQ,
                             .stream = st->id,
                             .len = (uint32_t)m->len,
                             .id = ((uint32_t)e->rout[i].gen << 16) | i};
        prep_send(e, &h, NULL, 0, 0);
        return true;
    }
    return false;
}

/* st's head m (or, queued: false, m alone, never queued) goes by SEND
 * (goes_eager), with a slot and a credit there and its bytes taken by the
 * window: its work request prepared. Inlined in the scheduler's turn
 * (the lone send prepares its own: lone_send). */
__attribute__((always_inline)) static inline void
eager_prep(struct bex__engine *e, struct bex__stream *st, struct bex__msg *m, bool queued)
{
    struct sslot *s;
    if (st->id <= BEX__IMM_STREAM_MAX) {
        s = prep_data(e, st, m, m->nseg);
    } else {
        struct bex__hdr h = {.type = BEX__MSG_DATA, .stream = st->id, .len = (uint32_t)m->len};
        s = prep_send(e, &h, NULL, 0, 0);
        if (m->len) {
            gather(s, 1, m, m->nseg);
            e->chain_loud = true; /* the NIC reads m after posting */
        }
        account_bytes(e, s, (uint32_t)m->len);
    }
    if (queued)
        pop_head(st);
    m->state = BEX__M_POSTED;
    m->ack_seq = e->cons_sent;
    s->done = m;
}

/* One turn of a stream: at most one fragment or one small message (or one
 * control message of its own). Returns true if it prepared a request. */
/* A turn of st whose head m goes by SEND (eager). */
static bool turn_eager(struct bex__engine *e, struct bex__stream *st, struct bex__msg *m,
                       bool *blocked)
{
    if (!bex__engine_have_credit(e, false)) {
        BEX__STAT_ADD(e->stats, credit_stalls, 1);
        *blocked = true;
        return false;
    }
    if (!bex__engine_window_take(e, (uint32_t)m->len)) {
        *blocked = true;
        return false;
    }
    eager_prep(e, st, m, true);
    return true;
}

/* goes_eager header-free (prep_data: the immediate names st), and within
 * the peer's max_msg: one bound (eager_lim). A stream the immediate cannot
 * name takes the ring's way (its header's SEND is prep_send's, a call).
 * A gathered message's buffers are checked against the QP's SGEs by its
 * own way (send_gathered_way). */
static inline bool lone_eager(const struct bex__engine *e, const struct bex__stream *st,
                              const struct bex__msg *m)
{
    return !m->direct && m->len <= e->eager_lim && st->id <= BEX__IMM_STREAM_MAX;
}

/* m's queue fields, for the queue's way or its hand-back */
static inline void msg_queue_init(struct bex__msg *m)
{
    m->next = NULL;
    m->off = 0;
    m->rndv_id = 0;
    m->rndv_asked = false;
    m->peer_slot = false;
}

/* Whether a message for st with nothing queued may be prepared at once,
 * never queued (posted by the next bex__engine_progress, which was due
 * anyway), as far as the engine and st tell: nothing the scheduler would
 * put first or count waits. Another stream waiting in the ring, what
 * progress sends first (window operations, a keepalive, control messages,
 * releases), a stream owing its OPEN or CLOSE, a send window or a
 * destination's bound (quiet_max 0: their stalls are counted by the
 * scheduler's turn): the ring's way (the ring's count or'ed with the
 * engine's not_alone, which says whether it is up and quiet_max set
 * too: one test where eight fields were loaded and tested). So is every
 * message after a repost that failed in a direct send (repost_err): the
 * engine fails at the next progress call, and nothing more may be
 * prepared for a tick's post to send before it. */
__attribute__((always_inline)) static inline bool lone_open(const struct bex__engine *e,
                                                            const struct bex__stream *st)
{
    assert(e->not_alone == bex__engine_alone_word(e)); /* (a setter without its sync) */
    return st->state == BEX__S_OPEN && !(e->streams.ring_n | e->not_alone);
}

/* ... and as far as m tells, with a slot and a credit for it (no slot or
 * the last credits: the ring's way). Nothing here hands a message back or
 * fails the engine. */
__attribute__((always_inline)) static inline bool
lone_fits(const struct bex__engine *e, const struct bex__stream *st, const struct bex__msg *m)
{
    return bex__engine_free_slots(e) && bex__engine_have_credit(e, false) && lone_eager(e, st, m);
}

/* An answer sent from the upcall of the peer's message carries that
 * message's credit, as progress would have it (return_owed, before its
 * turn): from the slack when it covers it, taken here (what progress does
 * first anyway, whichever way the message goes). True: what the slack does
 * not cover stays owed (bex__engine_credit_owed), and the lone message's
 * way posts the receives again first (send_repost_way). */
__attribute__((always_inline)) static inline bool lone_credit(struct bex__engine *e)
{
    return bex__engine_credit_owed(e) && !bex__engine_credit_from_slack(e);
}

/* m prepared alone (lone_open and lone_fits hold), nseg its buffers: turn_eager's
 * checks hold, the credit is checked, and with quiet_max set no send
 * window or destination's bound counts bytes (bex__engine_window_take
 * takes any); eager_prep's header-free case, without its call of
 * prep_send, so that its frame is a leaf's. NULL. */
__attribute__((always_inline)) static inline struct bex__msg *
lone_send(struct bex__engine *e, struct bex__stream *st, struct bex__msg *m, unsigned nseg)
{
    m->st = st;
    m->status = 0;
    struct sslot *s = prep_data(e, st, m, nseg);
    m->state = BEX__M_POSTED;
    m->ack_seq = e->cons_sent;
    s->done = m;
    return NULL;
}

/* m, for st which takes it (bex__engine_takes), queued and st in the ring */
static inline void send_queued(struct bex__engine *e, struct bex__stream *st, struct bex__msg *m)
{
    msg_queue_init(m);
    m->state = m->direct ? BEX__M_READY : BEX__M_QUEUED;
    bex__stream_enqueue(st, m);
    bex__stream_ring_add(&e->streams, st);
}

/* bex__engine_send_now's way when m is not sent alone: queued on st (the
 * queue's link and the fields of the rendezvous and fragments set for
 * it), or handed back untouched when st takes nothing (stream failed or
 * closing, engine dead or absent). Out of line, a tail call: the lone
 * message's frame keeps nothing across a call. */
static __attribute__((noinline)) struct bex__msg *send_queue_way(struct bex__stream *st,
                                                                 struct bex__msg *m)
{
    if (!bex__engine_takes(st))
        return m;
    m->st = st;
    m->status = 0;
    send_queued(st->eng, st, m);
    return NULL;
}

static int repost_now(struct bex__engine *e);

/* bex__engine_send_now's way when the lone message's credit needs the
 * receives posted again (lone_credit: owed): posted here, then m prepared as
 * alone. A failed post fails nothing here (m and the rest would be
 * handed back inside the caller's send, against send_now's contract,
 * transport.h): its error is kept (repost_err, with the part of the
 * chain the NIC took counted as posted: repost_now), m goes the queue's
 * way, and the progress call the send marked the connection for fails
 * the engine, which hands m back never sent; until then every later
 * message goes the queue's way too (lone_open). Out of line, a tail call:
 * the lone message's frame stays a leaf's. */
static __attribute__((noinline)) struct bex__msg *send_repost_way(struct bex__stream *st,
                                                                  struct bex__msg *m)
{
    struct bex__engine *e = st->eng;
    assert(!e->repost_err); /* (lone_open refused it) */
    e->repost_err = repost_now(e);
    if (e->repost_err) {
        bex__engine_alone_sync(e);    /* (0 before: unchanged when still 0) */
        return send_queue_way(st, m); /* (a tail call) */
    }
    return lone_send(e, st, m, m->nseg);
}

/* bex__engine_send_now's lone way for a gathered message (bex_sock_sendv),
 * whose buffers the QP's SGEs must hold (else the ring's way, which
 * sends one by rendezvous): out of line, so that the plain message's
 * frame has no loop over buffers and keeps fewer registers. */
static __attribute__((noinline)) struct bex__msg *send_gathered_way(struct bex__stream *st,
                                                                    struct bex__msg *m)
{
    struct bex__engine *e = st->eng;
    if (m->nseg > e->max_sge)
        return send_queue_way(st, m); /* (a tail call) */
    if (bex__engine_credit_owed(e))
        return send_repost_way(st, m); /* (a tail call) */
    return lone_send(e, st, m, m->nseg);
}

/* One frame, no call on the lone message's way (issue 25 item 2): the
 * engine's and the stream's states are tested once, in lone_open; what
 * the lone message's request reads of m is set here or by the caller,
 * never the queue's link nor the fields of the rendezvous and fragments,
 * which send_queue_way sets for the queue's way. */
struct bex__msg *bex__engine_send_now(struct bex__stream *st, struct bex__msg *m,
                                      struct bex__xport *x)
{
    (void)x;
    struct bex__engine *e = st->eng;
    if (!e || st->q_head || !lone_open(e, st))
        return send_queue_way(st, m); /* (a tail call) */
    /* first, so that its values are dead before the request's are loaded
     * (the frame, a leaf's, saves no register); the repost it may need is
     * decided last, by the one flag it leaves (not tested again: 3 a send) */
    bool owed = lone_credit(e);
    if (!lone_fits(e, st, m))
        return send_queue_way(st, m); /* (a tail call) */
    if (m->nseg)
        return send_gathered_way(st, m); /* (a tail call) */
    if (__builtin_expect(owed, 0))
        return send_repost_way(st, m); /* (a tail call) */
    return lone_send(e, st, m, 0);
}

void bex__engine_send(struct bex__stream *st, struct bex__msg *m)
{
    if (!bex__engine_send_now(st, m, NULL))
        return;
    /* refused (stream failed or closing, engine dead or absent): reported */
    m->st = st;
    m->status = 0;
    msg_queue_init(m);
    m->state = BEX__M_QUEUED;
    if (st->eng)
        bex__engine_msg_done(st->eng, m, ST_UNSENT);
}

/* A turn of st whose head m has its destination: one fragment written. */
static bool turn_fragment(struct bex__engine *e, struct bex__stream *st, struct bex__msg *m,
                          bool *blocked)
{
    uint32_t most = e->frag, w = bex__engine_window(e);
    if (w && w < most) /* the adaptive window's fragments follow it */
        most = w;
    size_t run;
    uint32_t lkey;
    uint8_t *at = bex__msg_at(m, m->off, &run, &lkey); /* a fragment ends at its buffer's end */
    uint32_t frag = (uint32_t)(run < most ? run : most);
    bool last = m->off + frag == m->len;
    if (last && !bex__engine_have_credit(e, false)) {
        BEX__STAT_ADD(e->stats, credit_stalls, 1);
        *blocked = true;
        return false;
    }
    if (!bex__engine_window_take(e, frag)) {
        *blocked = true;
        return false;
    }
    struct sslot *s = bex__engine_slot_take(e);
    s->sge[0] = (struct ibv_sge){(uintptr_t)at, frag, lkey};
    s->wr.num_sge = 1;
    s->wr.wr.rdma.remote_addr = m->raddr + m->off;
    s->wr.wr.rdma.rkey = m->rkey;
    account_bytes(e, s, frag);
    BEX__STAT_ADD(e->stats, writes_posted, 1);
    m->off += frag;
    m->last_wr = e->tail - 1;
    if (!last) {
        s->wr.opcode = IBV_WR_RDMA_WRITE;
        return true;
    }
    s->wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    s->wr.imm_data = htonl(m->imm);
    spend_credit(e);
    if (m->peer_slot) {
        m->peer_slot = false;
        e->peer_rndv_used--;
    }
    pop_head(st);
    m->state = BEX__M_POSTED;
    m->ack_seq = e->cons_sent;
    s->done = m;
    return true;
}

static bool stream_turn(struct bex__engine *e, struct bex__stream *st, bool *blocked)
{
    *blocked = false;
    if (!bex__engine_free_slots(e)) {
        *blocked = true;
        return false;
    }
    if (bex__stream_owes_open(st)) {
        if (!bex__engine_have_credit(e, false)) {
            *blocked = true;
            return false;
        }
        struct bex__hdr h = {.type = BEX__MSG_OPEN, .stream = st->id};
        prep_send(e, &h, NULL, 0, 0);
        bex__stream_move(st, BEX__SE_OPEN_SENT);
        return true;
    }
    struct bex__msg *m = st->q_head;
    if (m && !m->direct && !m->status && m->len > e->peer_max_msg)
        m->status = -EMSGSIZE; /* the peer said it takes none so large */
    if (m && m->status) {
        /* failed before posting (rendezvous refused): hand back in order */
        pop_head(st);
        bex__engine_msg_done(e, m, m->status);
        return true;
    }
    if (m && goes_eager(e, st, m))
        return turn_eager(e, st, m, blocked);
    if (m && m->state == BEX__M_READY)
        return turn_fragment(e, st, m, blocked);
    /* head waits for its destination: meanwhile ask for later ones */
    if (try_rndv_req(e, st, blocked))
        return true;
    if (*blocked)
        return false;
    if (!m && bex__stream_owes_close(st)) {
        if (!bex__engine_have_credit(e, false)) {
            *blocked = true;
            return false;
        }
        struct bex__hdr h = {.type = BEX__MSG_CLOSE, .stream = st->id};
        struct sslot *s = prep_send(e, &h, NULL, 0, 0);
        s->closed = st;
        e->chain_loud = true; /* its completion moves the stream on */
        bex__stream_move(st, BEX__SE_CLOSE_SENT);
        return true;
    }
    return false;
}

#ifndef NDEBUG
/* May s go out unsignaled, retired by a later signaled completion? A SEND
 * that reads nothing of the caller's after posting (its payload inline, or
 * none, or only the slot's own header) and closes no stream: its message
 * is reported once the peer's credits acknowledge it (acks_in), which the
 * retirement does not wait for. What chain_loud sums as the requests are
 * prepared, checked against them (asserts only). */
static bool wr_quiet(const struct sslot *s)
{
    _Static_assert(IBV_WR_SEND_WITH_IMM == IBV_WR_SEND + 1, "the two SENDs are adjacent");
    return (uint32_t)(s->wr.opcode - IBV_WR_SEND) <= 1 && !s->closed &&
           (!s->done || !s->bytes || (s->wr.send_flags & IBV_SEND_INLINE));
}

/* chain_loud is set if a request of the chain needs it (it may be set
 * for none: a stream detached drops its CLOSE's slot's mark, say) */
static bool chain_loud_holds(const struct bex__engine *e)
{
    bool loud = false;
    for (uint32_t c = e->post; c != e->tail; c++)
        loud = loud || !wr_quiet(sslot_at(e, c));
    return e->chain_loud || !loud;
}
#endif

/* Whether a chain of quiet requests may go unsignaled: not once a quarter
 * of the queue would be unretired, not when the tick asked for a signal,
 * never with a send window or in window mode (quiet_max 0). */
static bool chain_quiet(const struct bex__engine *e)
{
    return e->tail - e->head < e->quiet_max && !e->sig_force;
}

/* ibv_post_send refused the chain from post to tail from bad on (rc): the
 * signaled counter recounted up to bad (what was counted: the chain's last
 * request signaled or not, post_chain's one), the chain lost, the engine
 * failed. Out of line (post_chain is inlined), and the chain found again
 * here, so that post_chain keeps no value across its call of the NIC. */
__attribute__((noinline, cold)) static void post_failed(struct bex__engine *e, int rc,
                                                        struct ibv_send_wr *bad)
{
    struct ibv_send_wr *first = &sslot_at(e, e->post)->wr;
    uint64_t signaled = (sslot_at(e, e->tail - 1)->wr.send_flags & IBV_SEND_SIGNALED) != 0;
    uint64_t now = 0;
    for (struct ibv_send_wr *w = first; w && w != bad; w = w->next)
        now += (w->send_flags & IBV_SEND_SIGNALED) != 0;
    BEX__STAT_ADD(e->stats, signaled, now - signaled); /* fewer: modulo 2^64 */
    bex__log(e->sh->log, BEX_LOG_ERROR, "%s: ibv_post_send: %s", e->name,
             bex_strerror(bex__rdma_err(rc)));
    /* nothing was posted from bad on: treat the chain as lost */
    e->post = e->tail;
    bex__engine_fail_now(e, bex__rdma_err(rc));
}

/* bex__engine_post_pending's work for a chain of at least one request,
 * inlined in the progress calls (once a message). windows: whether the
 * engine may be in window mode (false where the caller knows it is not:
 * post_prepared, no test of it). */
__attribute__((always_inline)) static inline void post_chain(struct bex__engine *e, bool windows)
{
    assert(e->post != e->tail);
    /* what is posted may carry the credits of receives still staged */
    if (e->sh->srq && !bex__srq_flushed(e->sh->srq, e->srq_wait))
        bex__srq_flush(e->sh->srq);
    /* one pass, each slot looked up once: its link and its bytes (a lone
     * request, no loop); whether the chain may go quiet was summed as its
     * requests were prepared (chain_loud: one of them reads the caller's
     * memory after posting, or is no SEND, or closes a stream), and the
     * peer's receives they take were noted then (spend_credit) */
    struct sslot *first = sslot_at(e, e->post), *s = first;
    uint32_t bytes = first->bytes;
    for (uint32_t c = e->post + 1; c != e->tail; c++) {
        struct sslot *next = sslot_at(e, c);
        s->wr.next = &next->wr;
        s = next;
        bytes += s->bytes;
    }
    s->wr.next = NULL;
    assert(chain_loud_holds(e));
    bool quiet = !e->chain_loud && chain_quiet(e);
    e->chain_loud = false;
    struct ibv_send_wr *wr = &first->wr;
    /* slot_take cleared the flags; prep_data may have set INLINE. Only
     * the chain's last request is ever signaled (recounted up to bad on
     * failure, so that the counter shows the signaling policy) */
    if (!quiet) {
        s->wr.send_flags |= IBV_SEND_SIGNALED;
        bex__engine_wnd_posted(e, s, bytes);
        e->sig_end = e->tail;
        e->sig_force = false;
        BEX__STAT_ADD(e->stats, signaled, 1);
        /* the chain's first found again (not kept across the window's
         * call: the frame saves one register fewer) */
        wr = &sslot_at(e, e->post)->wr;
    }
    struct ibv_send_wr *bad = NULL;
    /* counted before the call, as its work requests were when prepared:
     * rxe's ibv_post_send is a system call that may take milliseconds in a
     * starved guest, and counters read during it showed a keepalive WRITE
     * or a CREDIT message without its doorbell (test_poll_turn), or a
     * doorbell without its signaled request (test_sock_rxe.multiplex) */
    BEX__STAT_ADD(e->stats, post_send_calls, 1);
    /* (a quiet chain's first is kept: no call since it was found) */
    int rc = bex__rdma_post_send(e->qp, wr, &bad);
    if (rc) {
        post_failed(e, rc, bad);
        return;
    }
    /* rxe takes a window's current key from mw->rkey when the next bind is
     * posted: it is the new key from now on */
    if (windows && e->sh->windows)
        for (uint32_t c = e->post; c != e->tail; c++)
            if (e->ss[c % e->sq].wr.opcode == IBV_WR_BIND_MW)
                e->ss[c % e->sq].wr.bind_mw.mw->rkey = e->ss[c % e->sq].wr.bind_mw.rkey;
    e->post = e->tail;
}

void bex__engine_post_pending(struct bex__engine *e)
{
    if (e->post != e->tail)
        post_chain(e, true);
}

/* The first n unposted receive slots are posted: those of them whose
 * credit went from the slack (the first n_credited) give the slack back,
 * the others' credits go to the peer; the rest stay unposted, in order. */
static inline void recvs_posted(struct bex__engine *e, uint32_t n)
{
    uint32_t credited = n < e->n_credited ? n : e->n_credited;
    e->slack += credited;
    e->to_return += n - credited;
    e->n_credited -= credited;
    e->n_unposted -= n;
    if (e->n_unposted)
        memmove(e->unposted, e->unposted + n, e->n_unposted * sizeof(*e->unposted));
}

/* Every unposted receive slot posted again, in one chain: 0, or the
 * post's error (logged). The engine's counts stay true either way: a
 * chain the NIC took up to bad is counted as posted up to there (those
 * receives cannot be posted twice), the rest stay unposted. */
static int repost_now(struct bex__engine *e)
{
    if (e->sh->srq) {
        /* onto the shared queue, posted with the other engines' at the
         * thread's next flush; the credits come back to this peer */
        e->srq_wait = bex__srq_post(e->sh->srq, e->unposted, e->n_unposted);
        recvs_posted(e, e->n_unposted);
        return 0;
    }
    /* linked from the first, each slot looked up once */
    assert(e->n_unposted);
    struct ibv_recv_wr *first = &e->rs[e->unposted[0]].wr, *w = first;
    for (uint32_t i = 1; i < e->n_unposted; i++) {
        struct ibv_recv_wr *next = &e->rs[e->unposted[i]].wr;
        w->next = next;
        w = next;
    }
    w->next = NULL;
    struct ibv_recv_wr *bad = NULL;
    int rc = bex__rdma_post_recv(e->qp, first, &bad);
    BEX__STAT_ADD(e->stats, post_recv_calls, 1);
    if (!rc) {
        recvs_posted(e, e->n_unposted);
        return 0;
    }
    uint32_t n = 0; /* those ahead of bad went; none when bad is not in the chain */
    while (n < e->n_unposted && &e->rs[e->unposted[n]].wr != bad)
        n++;
    recvs_posted(e, n < e->n_unposted ? n : 0);
    rc = bex__rdma_err(rc);
    bex__log(e->sh->log, BEX_LOG_ERROR, "%s: ibv_post_recv: %s", e->name, bex_strerror(rc));
    return rc;
}

/* Receives consumed and handled (unposted, with a fresh buffer) give their
 * credits back: at once while the spare receives posted beyond the
 * granted ones (slack) cover them, the slots kept for the next chain; else
 * every unposted slot is posted again, in one chain, and the slack is what
 * the credited ones had taken. The peer is never granted a receive that is
 * not posted: posted - credits it holds or will be sent = slack >= 0.
 * (Each consumed receive lowers both; a credit returned here raises the
 * second, a receive posted the first.) A repost that failed in a direct
 * send (repost_err) fails the engine here, before anything is posted. */
void bex__engine_repost_recvs(struct bex__engine *e)
{
    uint32_t fresh = e->n_unposted - e->n_credited; /* credits not yet returned */
    if (!e->repost_err && (fresh == 0 || bex__engine_credit_from_slack(e)))
        return;
    int rc = e->repost_err ? e->repost_err : repost_now(e);
    if (rc)
        bex__engine_fail_now(e, rc);
}

/* The keepalive sequence goes by RDMA WRITE: no receive, no credit, no
 * peer CPU. It takes the first free slot, ahead of any data, so a busy
 * engine cannot starve it. */
void bex__engine_prep_keepalive(struct bex__engine *e)
{
    if (!e->ka_due || !bex__engine_free_slots(e))
        return;
    e->ka_due = false;
    bex__engine_alone_sync(e);
    BEX__STAT_ADD(e->stats, keepalive_writes, 1);
    struct sslot *s = bex__engine_slot_take(e);
    uint64_t seq = ++e->ka_seq;
    memcpy(s->hdr, &seq, sizeof(seq));
    s->sge[0] = (struct ibv_sge){(uintptr_t)s->hdr, sizeof(seq), e->hdr_lkey};
    s->wr.num_sge = 1;
    s->wr.opcode = IBV_WR_RDMA_WRITE;
    s->wr.wr.rdma.remote_addr = e->peer_ka_addr;
    s->wr.wr.rdma.rkey = e->peer_ka_rkey;
}

/* Window operations go out alone, on an idle send queue, and nothing
 * follows them until they complete: true while that holds the queue.
 *
 * rxe (kernel 6.1, and upstream as far as we read it) executes a local
 * operation (BIND_MW, LOCAL_INV) when the requester reaches it, but retires
 * it only once every work request before it is acknowledged. When a
 * retransmission starts in between (req_retry: the retransmit timer, a
 * NAK), the requester walks the queue again from the oldest unacknowledged
 * request and executes the done-but-unretired operation a second time. A
 * second bind of a type-2 window fails (the key it names is no longer the
 * window's, or the window is gone), and the QP either reports
 * IBV_WC_MW_BIND_ERR or, when the retransmit timer fires again first,
 * hangs for good in the RTS state with no completion at all (the requester
 * in error never runs the pending retry, and the completer waits for it):
 * the silent stall window mode showed under load. A second LOCAL_INV of a
 * window would be an invalidation of an unbound window, which panics the
 * kernel. With nothing unacknowledged before or after a window operation,
 * no retransmission can cover it, and it runs exactly once. The cost is a
 * drain of the send queue per batch of window operations. */
/* Whether owed credits must go alone now: an answer usually follows the
 * peer's message within microseconds and carries them, so they wait for
 * one up to ack_delay_us (the I/O thread calls progress again then:
 * x.due_us). */
static bool ack_due(struct bex__engine *e)
{
    assert(e->to_return); /* (progress tested it) */
    if (!e->acks_owed)
        return false;
    return bex__ack_hold_due(&e->x, &e->ack_held, e->cfg.ack_delay_us);
}

/* Every owed credit went (or waits for a buffer: starved): none is held,
 * and no return is due. */
static inline void acks_all_gone(struct bex__engine *e)
{
    e->acks_owed = e->n_starved != 0;
    e->ack_held = 0;
    e->x.due_us = 0;
}

/* Owed credits (acks_owed): when every one went (or waits for a buffer:
 * starved), nothing is held; else, held past ack_delay with no slot or
 * credit to send them, their return calls progress (x.due_us cleared).
 * Only while acks_owed: ack_held is set by ack_due then, and cleared here
 * when acks_owed is. */
static inline void acks_settle(struct bex__engine *e)
{
    if (!e->to_return && e->n_unposted == e->n_credited) {
        acks_all_gone(e);
        return;
    }
    if (e->ack_held && e->x.due_us && bex__now_us() >= e->x.due_us)
        e->x.due_us = 0;
}

bool bex__engine_wops_hold(struct bex__engine *e)
{
    if (!e->wq_n && !e->wop_busy)
        return false;
    if (e->head != e->post)
        return true; /* draining for them, or they are still in flight */
    e->wop_busy = false;
    bex__engine_alone_sync(e);
    if (!e->wq_n)
        return false;
    bex__engine_prep_wops(e);
    e->wop_busy = true;
    bex__engine_alone_sync(e);
    bex__engine_post_pending(e);
    return true;
}

/* Round-robin over streams with work, one unit each per turn. A stream
 * that can do nothing until an answer or a new message leaves the ring;
 * one held back by a shared budget (slots, credits, window) stays. */
static void schedule_streams(struct bex__engine *e)
{
    for (;;) {
        uint32_t n = e->streams.ring_n;
        bool any = false;
        for (uint32_t i = 0; i < n && e->streams.ring_n && bex__engine_free_slots(e); i++) {
            struct bex__stream *st = bex__stream_ring_turn(&e->streams);
            bool blocked;
            if (stream_turn(e, st, &blocked)) {
                any = true;
                /* its last unit went: out now rather than after one more
                 * (empty) turn next round */
                if (!st->q_head && !bex__stream_owes_open(st) && !bex__stream_owes_close(st))
                    bex__stream_ring_remove(&e->streams, st);
            } else if (!blocked) {
                bex__stream_ring_remove(&e->streams, st);
            }
        }
        if (!any || !bex__engine_free_slots(e) || e->state != E_UP)
            break;
    }
}

/* Control messages, destinations given back and the streams' turns, in
 * that order, as slots and credits allow (bex__engine_progress). False:
 * the engine failed first, with the error of a repost that failed in a
 * direct send (send_repost_way), now that no send is under way. */
__attribute__((noinline)) static bool progress_queues(struct bex__engine *e)
{
    if (__builtin_expect(e->repost_err != 0, 0)) {
        bex__engine_fail_now(e, e->repost_err);
        return false;
    }
    /* control messages first: they unblock the peer */
    while (e->ctl_n && bex__engine_free_slots(e) && bex__engine_have_credit(e, false)) {
        struct bex__hdr h = e->ctlq[e->ctl_head];
        e->ctl_head = (e->ctl_head + 1) % e->ctl_cap;
        e->ctl_n--;
        if (h.type == BEX__MSG_RNDV_RESP && h.status)
            e->ctl_errs--;
        else if (h.type == BEX__MSG_CLOSE)
            e->ctl_refusals--;
        prep_send(e, &h, NULL, 0, 0);
        if (h.type == BEX__MSG_RNDV_RESP && h.status == 0)
            e->rin[h.stream & 0xffff].granted = true;
    }
    bex__engine_alone_sync(e);
    /* destinations given back unwritten: each frees a peer slot */
    while (e->rel_n && bex__engine_free_slots(e) && bex__engine_have_credit(e, false)) {
        struct rndv_rel r = e->relq[e->rel_head];
        e->rel_head = (e->rel_head + 1) % e->max_rndv;
        e->rel_n--;
        struct sslot *s = bex__engine_slot_take(e);
        s->wr.num_sge = 0;
        s->wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        s->wr.imm_data = htonl(r.imm);
        s->wr.wr.rdma.remote_addr = r.addr;
        s->wr.wr.rdma.rkey = r.rkey;
        spend_credit(e);
        e->peer_rndv_used--;
        BEX__STAT_ADD(e->stats, writes_posted, 1);
    }
    bex__engine_alone_sync(e);
    schedule_streams(e);
    return true;
}

/* A CREDIT message: the credits nobody carried (out of line: rare). */
__attribute__((noinline)) static void prep_credit(struct bex__engine *e)
{
    struct bex__hdr h = {.type = BEX__MSG_CREDIT};
    prep_send(e, &h, NULL, 0, 0);
    BEX__STAT_ADD(e->stats, credit_msgs, 1);
}

/* bex__engine_progress's every case. */
static __attribute__((noinline)) bool progress_all(struct bex__engine *e)
{
    if (e->state != E_UP)
        return false;
    uint32_t before = e->post; /* what bex__engine_send prepared goes now too */
    /* window binds and revocations: ahead of the answers that name them,
     * and alone (see wops_hold) */
    if ((e->wq_n || e->wop_busy) && bex__engine_wops_hold(e))
        return e->tail != before;
    if (e->ka_due)
        bex__engine_prep_keepalive(e);
    /* the peer waits for these receives' credits to report its messages:
     * posted now, whatever we send next carries them */
    if (!bex__engine_return_owed(e))
        return e->tail != before;
    /* what waits in the queues: none when a lone stream's message was
     * prepared by bex__engine_send (no call then); a repost that failed in
     * a direct send is or'ed in (one instruction, not a test of its own) */
    if ((e->ctl_n | e->rel_n | e->streams.ring_n | (uint32_t)e->repost_err) && !progress_queues(e))
        return false;
    /* credits nobody carried: an explicit update once half the queue waits,
     * or once the peer has waited ack_delay for the ones it reports by
     * (none to return, the usual once an answer took them: one test) */
    if (e->to_return && (e->to_return >= e->k || ack_due(e)) && bex__engine_free_slots(e) &&
        bex__engine_have_credit(e, true))
        prep_credit(e);
    assert(e->acks_owed || !e->ack_held);
    if (e->acks_owed)
        acks_settle(e);
    if (e->post != e->tail)
        post_chain(e, true);
    /* (the checks ahead of the calls: a message's progress without window
     * mode or a keepalive due pays no call for them) */
    if (e->sh->windows && bex__engine_spare_fill(e))
        bex__engine_wops_hold(e); /* the queue is idle: the binds go out now */
    return e->tail != before;
}

/* The post of a lone message's chain (not in window mode), its one call
 * (the doorbell) in a frame of its own: false, the transport's progress
 * answer (bex__engine_progress_xport). */
static __attribute__((noinline)) bool post_prepared(struct bex__engine *e)
{
    post_chain(e, false);
    return false;
}

/* progress_all for the transport: false (bex__engine_progress_xport). */
static __attribute__((noinline)) bool progress_all_xport(struct bex__engine *e)
{
    (void)progress_all(e);
    return false;
}

enum progress_case { PC_GENERAL, PC_IDLE, PC_POST };

/* What a ping-pong's progress call finds (the answer prepared alone by
 * bex__engine_send_now, which carried every owed credit): none of the
 * cases progress_all tests first, each of them one bit of one word here
 * (no window operations, keepalive, control messages, releases, queued
 * streams, failed repost or credits to send; no credit owed; no window
 * mode, which not_alone's quiet_max covers). Then its work is
 * acks_settle's first case (done here) and the post of what is prepared
 * (PC_POST) if anything is (else PC_IDLE), with no frame but the post's
 * (the general one saves four registers). Any other state: PC_GENERAL,
 * progress_all's, which does the same in this case. */
__attribute__((always_inline)) static inline enum progress_case progress_lone(struct bex__engine *e)
{
    assert(e->not_alone == bex__engine_alone_word(e)); /* (a setter without its sync) */
    assert(!e->sh->windows || e->not_alone);           /* (window mode: quiet_max 0, in the word) */
    if (__builtin_expect(
            (e->not_alone | e->streams.ring_n | e->to_return) || bex__engine_credit_owed(e), 0))
        return PC_GENERAL;
    if (e->acks_owed)
        acks_all_gone(e); /* acks_settle's first case: not credit_owed, no to_return */
    return e->post == e->tail ? PC_IDLE : PC_POST;
}

bool bex__engine_progress(struct bex__engine *e)
{
    switch (progress_lone(e)) {
    case PC_GENERAL:
        return progress_all(e); /* (a tail call) */
    case PC_IDLE:
        return false;
    case PC_POST:
        break;
    }
    (void)post_prepared(e);
    return true; /* (progress_all's tail != before) */
}

/* The I/O thread's call (ops.c's progress, no wrapper: the ping-pong's
 * post is a tail call): bex__engine_progress, answering false whatever
 * it did, since the engine moves all it can in one call (what it leaves
 * waits for an event that asks for another call: ops.c). */
bool bex__engine_progress_xport(struct bex__xport *x)
{
    struct bex__engine *e = bex__engine_of(x);
    switch (progress_lone(e)) {
    case PC_GENERAL:
        return progress_all_xport(e); /* (a tail call) */
    case PC_IDLE:
        return false;
    case PC_POST:
        break;
    }
    return post_prepared(e); /* (a tail call: false) */
}
