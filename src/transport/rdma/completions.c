/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA engine: completions, of sends (delivery reports and the
 * acknowledgement queue) and of receives (control messages, data), split
 * from engine.c along its banner. See engine.h. */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/engine_internal.h"

/* ---------------- completions ---------------- */

int bex__engine_queue_ctl(struct bex__engine *e, const struct bex__hdr *h)
{
    /* Bounded by what a peer that keeps the limits can cause (one answer per
     * rendezvous slot, one refusal per receive); past that the peer sends
     * requests without letting us answer them. */
    if (e->ctl_n >= e->ctl_cap)
        return bex__engine_violation(e, "%u control messages wait for credits it does not return",
                                     e->ctl_n);
    e->ctlq[(e->ctl_head + e->ctl_n) % e->ctl_cap] = *h;
    e->ctl_n++;
    bex__engine_alone_sync(e);
    if (h->type == BEX__MSG_RNDV_RESP && h->status)
        e->ctl_errs++;
    else if (h->type == BEX__MSG_CLOSE)
        e->ctl_refusals++;
    return 0;
}

int bex__engine_refuse_stream(struct bex__engine *e, uint32_t id)
{
    /* A peer sends at most rq OPENs before it needs our credits back, and
     * answers go out as our credits allow: more waiting refusals than that
     * means it keeps opening without returning credits. */
    if (e->ctl_refusals >= e->rq)
        return bex__engine_violation(
            e, "it opens streams past the limit faster than it lets us refuse them");
    struct bex__hdr h = {.type = BEX__MSG_CLOSE, .stream = id};
    return bex__engine_queue_ctl(e, &h);
}

static void delivered(struct bex__engine *e, struct bex__msg *m)
{
    struct bex__stats *st = e->stats; /* one load: a counter's store may alias e */
    BEX__STAT_ADD(st, msgs_sent, 1);
    BEX__STAT_ADD(st, bytes_sent, m->len);
    bex__engine_msg_done(e, m, 0);
}

/* Has the peer returned the credit of consuming work request seq? */
static bool acked(const struct bex__engine *e, uint32_t seq)
{
    return (int32_t)(e->cons_acked - seq) >= 0;
}

/* The NIC is done with m: reported once the peer's engine has it too. */
static void ack_wait(struct bex__engine *e, struct bex__msg *m)
{
    if (!e->ack_head && acked(e, m->ack_seq)) {
        delivered(e, m);
        return;
    }
    m->next = NULL;
    if (e->ack_tail)
        e->ack_tail->next = m;
    else
        e->ack_head = m;
    e->ack_tail = m;
}

/* Messages whose requests are posted and not yet retired, which the
 * peer's credits acknowledge: its engine has them, so its NIC had all their
 * bytes, and an inline request's bytes were copied at posting (nothing of
 * the caller's is read again, even by a retransmission). Reported in
 * order, after the acknowledgement queue (older); the slot stays taken
 * until a signaled completion retires it. True when a report's upcall
 * ended the engine (the state is tested after each report only: nothing
 * else here changes it). */
__attribute__((always_inline)) static inline bool acks_posted(struct bex__engine *e)
{
    /* dscan >= head: the retirement moves it on (send_completed) */
    assert((int32_t)(e->dscan - e->head) >= 0);
    /* requests are posted only while the engine is up, and its failure
     * retires them all (head == post then) */
    assert(e->state == E_UP);
    while (e->dscan != e->post) {
        struct sslot *s = sslot_at(e, e->dscan);
        struct bex__msg *m = s->done;
        if (s->closed)
            return false;
        if (!m) {
            e->dscan++;
            continue;
        }
        /* (a small message's request is inline: its flag first, one
         * test where the bytes' came first) */
        bool copied = (s->wr.send_flags & IBV_SEND_INLINE) || !s->bytes;
        if (m->status || !copied || !acked(e, m->ack_seq))
            return false;
        s->done = NULL;
        e->dscan++;
        delivered(e, m);
        if (e->state != E_UP)
            return true;
    }
    return false;
}

/* The peer returned n credits: report what they acknowledge. True when a
 * report's upcall ended the engine. */
__attribute__((always_inline)) static inline bool acks_in(struct bex__engine *e, uint32_t n)
{
    e->cons_acked += n;
    /* the queue holds messages only while the engine is up (its failure
     * hands them back) */
    while (e->ack_head && acked(e, e->ack_head->ack_seq)) {
        struct bex__msg *m = e->ack_head;
        e->ack_head = m->next;
        if (!e->ack_head)
            e->ack_tail = NULL;
        m->next = NULL;
        delivered(e, m);
        if (e->state != E_UP)
            return true;
    }
    if (!e->ack_head && e->head != e->post)
        return acks_posted(e);
    return false;
}

/* Slot s's message and CLOSE, once its request is retired. */
static void slot_retired(struct bex__engine *e, struct sslot *s)
{
    if (s->done) {
        struct bex__msg *m = s->done;
        s->done = NULL;
        /* status set: abandoned with fragments in flight, now done */
        if (m->status)
            bex__engine_msg_done(e, m, m->status);
        else
            ack_wait(e, m);
    }
    if (s->closed) {
        struct bex__stream *st = s->closed;
        s->closed = NULL;
        bex__stream_move(st, BEX__SE_CLOSE_DONE);
        if (st->state == BEX__S_CLOSED_BOTH)
            bex__engine_finish_stream(e, st);
    }
}

/* send_retire with quiet chains allowed: the slots up to counter cnt
 * (masked), or every posted one when cnt names none of them, retired in
 * a loop over the slots alone; head and inflight are stored once, and
 * before each report (its upcall may fail the engine, which retires
 * everything and moves head to the tail: the loop stops there). */
static inline void quiet_retire(struct bex__engine *e, uint32_t cnt)
{
    uint32_t c = e->head, end = e->post;
    uint32_t n = (cnt - c) & WR_CNT_MASK; /* cnt's slot is the n-th from head */
    if (n < end - c)
        end = c + n + 1;
    uint32_t bytes = 0;
    struct sslot *ss = e->ss; /* (sslot_at's, read once) */
    uint32_t mask = e->sq - 1;
    while (c != end) {
        struct sslot *s = &ss[c++ & mask];
        assert(s == sslot_at(e, c - 1));
        assert(!e->dest && !s->post_us && !s->free_mw);
        bytes += s->bytes;
        if ((uintptr_t)s->done | (uintptr_t)s->closed) {
            e->head = c;
            e->inflight -= bytes;
            bytes = 0;
            slot_retired(e, s);
            if (e->head != c) /* the engine failed: everything is retired */
                c = end = e->head;
        }
    }
    e->head = c;
    e->inflight -= bytes;
}

/* Completions come in posting order: everything up to cnt is done. With
 * quiet chains allowed (quiet_max) there is no send window, destination's
 * bound, adaptive sample or window to deallocate (engine.c,
 * bex__engine_set_dest): a retired slot gives back its bytes and reports
 * its message or CLOSE, the one test of the two (most often the
 * acknowledgement scan, acks_posted, reported the message already). */
static inline void send_retire(struct bex__engine *e, uint32_t cnt)
{
    if (e->quiet_max) {
        quiet_retire(e, cnt);
        return;
    }
    while (e->head != e->post) {
        uint32_t c = e->head;
        struct sslot *s = sslot_at(e, c);
        e->head++;
        e->inflight -= s->bytes;
        bex__engine_window_give(e, s->bytes);
        if (s->post_us) /* an adaptive window's sample (no call otherwise) */
            bex__engine_wnd_completed(e, s);
        if (s->free_mw) {
            ibv_dealloc_mw(s->free_mw); /* its invalidation is done */
            s->free_mw = NULL;
        }
        slot_retired(e, s);
        if ((c & WR_CNT_MASK) == cnt)
            break;
    }
}

static void send_completed(struct bex__engine *e, uint32_t cnt)
{
    send_retire(e, cnt);
    /* the acknowledgement scan starts at the oldest unretired slot at the
     * earliest (acks_posted): moved on here, once a completion, not there
     * once a message */
    if ((int32_t)(e->dscan - e->head) < 0)
        e->dscan = e->head;
}

static int handle_ctl(struct bex__engine *e, const struct bex__hdr *h)
{
    switch (h->type) {
    case BEX__MSG_RNDV_REQ:
        return bex__engine_rndv_request(e, h);
    case BEX__MSG_RNDV_RESP: {
        uint32_t i = h->id & 0xffff;
        if (i >= e->max_rndv || !e->rout[i].used || e->rout[i].gen != (h->id >> 16))
            return bex__engine_violation(
                e, "an answer (status %d) to rendezvous request %u of generation %u, which %s",
                h->status, i, h->id >> 16,
                i >= e->max_rndv ? "names no slot"
                : !e->rout[i].used
                    ? "is not asked (answered twice: the peer saw our request twice?)"
                    : "is of another generation");
        struct bex__msg *m = e->rout[i].m;
        e->rout[i].m = NULL;
        e->rout[i].used = false;
        e->rout_used--;
        if (!m) {
            /* its message was handed back meanwhile: a granted destination
             * goes back unwritten, a refusal frees the slot at once */
            if (h->status)
                e->peer_rndv_used--;
            else
                bex__engine_queue_release(e, h->addr, h->rkey, h->stream);
            return 0;
        }
        m->rndv_id = 0;
        if (h->status) {
            /* the peer refused it; never let a peer's number pass for one
             * of the codes that say what happened here */
            m->status = h->status >= -4095 && h->status != ST_UNSENT && h->status != ST_INDOUBT
                            ? h->status
                            : -EREMOTEIO;
            m->peer_slot = false;
            e->peer_rndv_used--;
        } else {
            m->raddr = h->addr;
            m->rkey = h->rkey;
            m->imm = h->stream;
        }
        m->state = BEX__M_READY;
        if (m->st)
            bex__stream_ring_add(&e->streams, m->st);
        return 0;
    }
    case BEX__MSG_OPEN:
        e->ops->on_open(&e->x, h->stream);
        return 0;
    case BEX__MSG_CLOSE:
        /* a CLOSE its stream's state does not take sets stream_fault */
        e->stream_fault = 0;
        e->ops->on_peer_close(&e->x, h->stream);
        return e->stream_fault;
    case BEX__MSG_CREDIT:
        return 0;
    }
    return bex__engine_violation(e, "a control message of type %u", h->type);
}

/* A fresh receive buffer, the slow way: the bin is taken on the first
 * one (on the engine's I/O thread, the one that completes its receives),
 * and bex_mem_alloc refills it when empty. */
__attribute__((noinline)) static void *rbuf_new_slow(struct bex__engine *e)
{
    if (e->rbin == &bex__mem_bin_none) {
        struct bex__mem_bin *b = bex__mem_thread_bin(e->sh->recv_pool, e->rbuf_len);
        if (b)
            e->rbin = b;
    }
    return bex_mem_alloc(e->sh->recv_pool, e->rbuf_len);
}

/* A fresh receive buffer (rbuf_len bytes from the receive pool): from the
 * I/O thread's bin of its class, inline. */
__attribute__((always_inline)) static inline void *rbuf_new(struct bex__engine *e)
{
    void *b = bex__mem_bin_take(e->rbin);
    return __builtin_expect(b != NULL, 1) ? b : rbuf_new_slow(e);
}

/* Give consumed slot idx (r) a fresh buffer and queue it for reposting, or,
 * when the context may not receive more (or memory is short), leave it
 * starved: its credit stays with us until bex__engine_refill_starved() succeeds.
 * gone, the buffer that went up to the application, is still counted as
 * posted: a fresh one takes its place in that count (one buffer of the
 * size out, one in), or, starved, the count drops by it. */
__attribute__((always_inline)) static inline void
slot_refill(struct bex__engine *e, uint32_t idx, struct bex__rslot *r, const void *gone)
{
    /* known since a buffer was posted: the engine's own slots' first
     * (bex__engine_slot_set_buf), or a shared queue's receive's
     * (bex__engine_srq_complete), so read without a test */
    int64_t u = e->rbuf_usable;
    assert(u && bex__engine_rbuf_usable(e, gone) == u);
    struct bex__engine_shared *sh = e->sh;
    /* the counters' pointer once: the estimate's and the count's (the
     * bin's stores, through void pointers, would have it read again); set
     * since the engine's creation (engine_init), so no test of it */
    struct bex__recv_acct *a = sh->recv_acct;
    assert(a == bex__recv_acct_of(sh));
    void *fresh = NULL;
    /* room for rbuf_len more with gone already out of the count */
    uint64_t want = e->rbuf_len + (uint64_t)u;
    if (e->n_starved == 0 &&
        (!sh->recv_max || bex__recv_room_at(sh, a, want) || bex__recv_room_exact(sh, want)))
        fresh = rbuf_new(e);
    if (!fresh) {
        bex__recv_posted(e->sh, -u);
        bex__engine_hold_starved(e, idx);
        BEX__STAT_ADD(e->stats, recv_paused, 1);
        return;
    }
    /* the same size class as gone's (bex__engine_rbuf_usable asserts it) */
    assert(bex_mem_usable_size(fresh) == (size_t)u);
    bex__recv_allocated_at(a, u);
    bex__engine_slot_put(e, r, fresh, gone);
    bex__engine_hold_unposted(e, idx);
}

void bex__engine_refill_starved(struct bex__engine *e)
{
    uint32_t done = 0;
    while (done < e->n_starved && bex__engine_recv_room(e, e->rbuf_len)) {
        void *fresh = bex__engine_recv_alloc(e, e->sh->recv_pool, e->rbuf_len);
        if (!fresh)
            break;
        uint32_t idx = e->starved[done++];
        bex__engine_slot_set_buf(e, bex__engine_rslot_at(e, idx), fresh);
        e->unposted[e->n_unposted++] = idx;
    }
    e->n_starved -= done;
    memmove(e->starved, e->starved + done, e->n_starved * sizeof(*e->starved));
}

/* A receive completion no valid peer causes: what it was, for the log. */
static int bad_recv(struct bex__engine *e, const struct ibv_wc *wc, uint32_t idx, const char *what)
{
    return bex__engine_violation(
        e, "%s (receive %u: opcode %d, %u bytes, immediate 0x%08x, flags 0x%x)", what, idx,
        (int)wc->opcode, wc->byte_len, ntohl(wc->imm_data), (unsigned)wc->wc_flags);
}

/* A WRITE_WITH_IMM's rendezvous slot (imm: slot i, generation gen) that
 * the peer may not complete: why, or NULL when it may. */
static const char *rin_unwritable(const struct bex__engine *e, uint32_t i, uint32_t gen)
{
    if (i >= e->max_rndv)
        return "a write-with-immediate naming no rendezvous slot";
    const struct rndv_in *in = &e->rin[i];
    if (!in->used)
        return "a write-with-immediate naming a free rendezvous slot (written already?)";
    if (in->gen != gen)
        return "a write-with-immediate naming another generation of a rendezvous slot";
    /* a deferred request (no buffer yet) was never answered, and a slot
     * the peer has not been told about cannot be done */
    if (!in->buf)
        return "a write-with-immediate naming a rendezvous request not yet answered";
    if (!in->granted)
        return "a write-with-immediate naming a destination whose answer is not yet sent";
    return NULL;
}

/* A SEND's header that does not decode: its first bytes, for the log. */
static int bad_header(struct bex__engine *e, const struct ibv_wc *wc, uint32_t idx,
                      const uint8_t *b)
{
    return bex__engine_violation(
        e,
        "a SEND whose header does not decode (receive %u, %u bytes: %02x %02x %02x%02x "
        "%02x%02x%02x%02x %02x%02x%02x%02x %02x%02x%02x%02x ...)",
        idx, wc->byte_len, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
        b[12], b[13], b[14], b[15]);
}

/* A WRITE_WITH_IMM landed (receive idx, its buffer unused): a rendezvous
 * destination written, or an exposed buffer. */
static int write_imm_completed(struct bex__engine *e, const struct ibv_wc *wc, uint32_t idx)
{
    bex__engine_hold_unposted(e, idx); /* its buffer was not used */
    e->acks_owed = true;
    uint32_t imm = ntohl(wc->imm_data);
    uint32_t i = imm & 0xffff, gen = (imm >> 16) & 0x7fff;
    if (imm & BEX__IMM_DIRECT) {
        BEX__STAT_ADD(e->stats, msgs_recv, 1);
        int rc = e->ops->on_direct(&e->x, imm);
        return rc == -EPROTO
                   ? bad_recv(e, wc, idx, "a write-with-immediate naming no exposed buffer")
                   : rc;
    } else {
        const char *why = rin_unwritable(e, i, gen);
        if (why)
            return bad_recv(e, wc, idx, why);
        struct rndv_in *in = &e->rin[i];
        in->used = false;
        e->rin_used--;
        e->rin_bytes -= in->len;
        e->rin_done++;
        bex__engine_rin_unbind(e, in); /* the key is dead before the buffer goes up */
        BEX__STAT_ADD(e->stats, msgs_recv, 1);
        BEX__STAT_ADD(e->stats, bytes_recv, in->len);
        e->ops->on_msg(&e->x, in->stream, in->buf, in->len);
        if (e->state == E_UP)
            return bex__engine_rndv_resume(e); /* the peer's budget has room again */
    }
    return 0;
}

/* Receive slot idx of a completion, or NULL when it is no receive of ours
 * the peer may have completed (*why: what it was); the queue is looked up
 * once (bex__engine_rslot_at's test). */
static inline struct bex__rslot *recv_slot(struct bex__engine *e, uint32_t idx, const char **why)
{
    if (!e->rs) {
        /* SRQ mode (the engine has no slots of its own): the queue checked
         * it (a slot of its own, posted), and the credits
         * (bex__engine_srq_complete) */
        *why = "a completion naming no receive of ours";
        return idx == e->srq_cur ? &e->sh->srq->slots[idx] : NULL;
    }
    /* not a receive of ours, or one not posted */
    *why = idx >= e->rslots ? "a completion naming no receive of ours"
                            : "a completion of a receive not posted";
    if (idx >= e->rslots || !e->rs[idx].buf)
        return NULL;
    /* more receives are posted than the peer is granted (rq_spare): one it
     * had no credit for is a violation, not an RNR */
    *why = "a message beyond the credits granted";
    if (e->n_unposted - e->n_credited + e->n_starved + e->to_return >= e->rq)
        return NULL;
    return &e->rs[idx];
}

/* The credits a peer's message returns (of a message of type, on stream):
 * 0, 1 when the acknowledgements they report ended the engine (nothing
 * more to do), or a violation's code. */
__attribute__((always_inline)) static inline int credits_in(struct bex__engine *e,
                                                            const struct ibv_wc *wc,
                                                            uint32_t credits, uint8_t type,
                                                            uint32_t stream)
{
    e->peer_credits += credits;
    if (e->peer_credits > e->peer_rq) /* more credits back than the peer ever granted */
        return bex__engine_violation(e,
                                     "%u credits back (type %u, stream %u, %u bytes, QP %u), %u "
                                     "held: above the %u it granted (a message delivered "
                                     "twice either way?)",
                                     credits, type, stream, wc->byte_len, e->qp ? e->qp->qp_num : 0,
                                     e->peer_credits - credits, e->peer_rq);
    if (credits) {
        e->credit_wait = 0;
        if (acks_in(e, credits))
            return 1;
    }
    return 0;
}

/* A DATA of len bytes on stream, its payload in r's buffer from off on (len
 * checked): the buffer goes up as it is (zero-copy), a fresh one replaces
 * it. */
__attribute__((always_inline)) static inline void data_in(struct bex__engine *e, uint32_t idx,
                                                          struct bex__rslot *r, uint32_t stream,
                                                          uint32_t len, uint32_t off)
{
    void *buf = r->buf;
    r->buf = NULL;
    if (off) /* a stream beyond the immediate's: the payload goes to the start */
        memmove(buf, (uint8_t *)buf + off, len);
    slot_refill(e, idx, r, buf);
    e->acks_owed = true;
    struct bex__stats *st = e->stats;
    BEX__STAT_ADD(st, msgs_recv, 1);
    BEX__STAT_ADD(st, bytes_recv, len);
    e->ops->on_msg(&e->x, stream, buf, len);
}

static inline int data_too_long(struct bex__engine *e, uint32_t len)
{
    return bex__engine_violation(e, "a DATA of %u bytes (eager_max %u, max_msg %u)", len,
                                 e->cfg.eager_max, e->cfg.max_msg);
}

/* A SEND with its header in front (no immediate): a control message, or a
 * DATA on a stream the immediate cannot name. Out of line: the small
 * messages of the streams the immediate names skip it. */
__attribute__((noinline)) static int header_in(struct bex__engine *e, const struct ibv_wc *wc,
                                               uint32_t idx, struct bex__rslot *r)
{
    struct bex__hdr h;
    /* rbuf_len >= BEX__HDR_LEN: a header-sized SEND always fits */
    if (bex__hdr_decode(r->buf, wc->byte_len, &h))
        return bad_header(e, wc, idx, r->buf);
    int rc = credits_in(e, wc, h.credits, h.type, h.stream);
    if (rc)
        return rc > 0 ? 0 : rc;
    if (h.type != BEX__MSG_DATA) {
        bex__engine_hold_unposted(e, idx); /* its buffer was not used */
        return handle_ctl(e, &h);
    }
    if (h.len > e->recv_max)
        return data_too_long(e, h.len);
    data_in(e, idx, r, h.stream, h.len, BEX__HDR_LEN);
    return 0;
}

/* A receive that is no SEND_WITH_IMM: a WRITE_WITH_IMM, a SEND with its
 * header in front, or what bex never sends. Out of line: the small
 * messages of the streams the immediate names skip it. */
__attribute__((noinline)) static int recv_other(struct bex__engine *e, const struct ibv_wc *wc,
                                                uint32_t idx, struct bex__rslot *r)
{
    if (wc->opcode == IBV_WC_RECV_RDMA_WITH_IMM)
        return write_imm_completed(e, wc, idx);
    /* bex never sends SEND_WITH_INV: a peer that does is revoking our
     * windows behind our back (rxe sets bit 0x4, the kernel's flag) */
    if (wc->opcode != IBV_WC_RECV || (wc->wc_flags & (IBV_WC_WITH_INV | 0x4)))
        return bad_recv(e, wc, idx, "a receive of an operation bex never sends");
    assert(!(wc->wc_flags & IBV_WC_WITH_IMM));
    return header_in(e, wc, idx, r);
}

static int recv_completed(struct bex__engine *e, const struct ibv_wc *wc, uint32_t idx)
{
    const char *why;
    struct bex__rslot *r = recv_slot(e, idx, &why);
    if (!r)
        return bad_recv(e, wc, idx, why);
    /* a SEND_WITH_IMM, with no invalidation: one test (recv_other's
     * checks, in their order, for anything else) */
    if (wc->opcode != IBV_WC_RECV ||
        (wc->wc_flags & (IBV_WC_WITH_INV | 0x4 | IBV_WC_WITH_IMM)) != IBV_WC_WITH_IMM)
        return recv_other(e, wc, idx, r);
    /* a DATA whose header is the immediate (bex__imm_decode's fields, read
     * one by one): its payload fills the buffer from the start */
    uint32_t imm = ntohl(wc->imm_data), len = wc->byte_len;
    if (!bex__imm_is_data(imm))
        return bad_recv(e, wc, idx, "a SEND_WITH_IMM of a reserved kind");
    uint32_t stream = bex__imm_stream(imm);
    int rc = credits_in(e, wc, bex__imm_credits(imm), BEX__MSG_DATA, stream);
    if (rc)
        return rc > 0 ? 0 : rc;
    if (len > e->recv_max)
        return data_too_long(e, len);
    data_in(e, idx, r, stream, len, 0);
    return 0;
}

/* What a failed completion says about the connection, for the log line: the
 * operator must tell a peer's abuse from a broken link. On the responder
 * side (a peer's WRITE with a key or range we never granted) the NIC only
 * moves our QP to the error state: all we see is our work flushed. */
static const char *wc_why(enum ibv_wc_status st)
{
    switch (st) {
    case IBV_WC_WR_FLUSH_ERR:
        return "our QP went to the error state; most likely the peer wrote with a key or to "
               "a range we did not grant (the NIC refused it), else the link failed";
    case IBV_WC_REM_ACCESS_ERR:
        return "the peer's NIC refused our write (key or range)";
    case IBV_WC_REM_INV_REQ_ERR:
        return "the peer's NIC refused our request as invalid";
    case IBV_WC_RETRY_EXC_ERR:
        return "the peer stopped acknowledging (transport retries exhausted)";
    case IBV_WC_RNR_RETRY_EXC_ERR:
        return "the peer had no receive posted (RNR retries exhausted)";
    case IBV_WC_REM_OP_ERR:
        return "the peer's NIC could not complete our request";
    default:
        return "the connection's QP failed";
    }
}

void bex__engine_set_name(struct bex__engine *e, const char *name)
{
    snprintf(e->name, sizeof e->name, "%s (engine %u)", name, e->id);
}

/* The send request a failed completion names (counter cnt), for the log:
 * which operation the peer's NIC refused tells a bad request of ours from
 * the link's trouble. */
void bex__engine_describe_send(struct bex__engine *e, uint32_t cnt, char *out, size_t n)
{
    uint32_t c = e->head;
    while (c != e->post && (c & WR_CNT_MASK) != cnt)
        c++;
    if (c == e->post) {
        snprintf(out, n, "send");
        return;
    }
    const struct ibv_send_wr *wr = &sslot_at(e, c)->wr;
    uint32_t len = 0;
    for (int i = 0; i < wr->num_sge; i++)
        len += wr->sg_list[i].length;
    const char *op = wr->opcode == IBV_WR_SEND                  ? "SEND"
                     : wr->opcode == IBV_WR_SEND_WITH_IMM       ? "SEND_WITH_IMM"
                     : wr->opcode == IBV_WR_RDMA_WRITE          ? "WRITE"
                     : wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM ? "WRITE_WITH_IMM"
                                                                : "local operation";
    snprintf(out, n, "send (%s of %u bytes, %u of %u in flight before it)", op, len, c - e->head,
             e->post - e->head);
}

/* A receive the peer had no right to send (rc: recv_completed's): logged, and
 * the engine failed. Out of line: no valid peer causes it. */
__attribute__((noinline, cold)) static void recv_violated(struct bex__engine *e, int rc)
{
    if (rc == -EPROTO) /* the peer's fault: a WARN (bex__stream_violation) */
        bex__stream_violation(e->sh->log, e->name, "RDMA", &e->said, "a message it sent");
    else
        bex__log_once(e->sh->log, &e->said, BEX__SAID_VIOLATION, BEX_LOG_ERROR, "%s: %s from peer",
                      e->name, strerror(-rc));
    bex__engine_fail(e, rc);
}

/* (noinline: bex__engine_complete's tail call, one copy of the receive's
 * path) */
__attribute__((noinline)) bool bex__engine_complete_recv(struct bex__engine *e,
                                                         const struct ibv_wc *wc)
{
    uint32_t low = (uint32_t)wc->wr_id;
    /* (a receive opcode is a receive request's, whose wr_id has WR_RECV;
     * the opcode itself is recv_completed's to check) */
    assert(wc->status == IBV_WC_SUCCESS && (low & WR_RECV));
    if (e->state == E_DEAD)
        return true; /* (as bex__engine_complete) */
    e->peer_heard = true;
    int rc = recv_completed(e, wc, low & WR_CNT_MASK);
    if (rc)
        recv_violated(e, rc);
    /* the upcalls may have failed the engine (a bad OPEN, say) */
    else if (e->state != E_DEAD && e->n_unposted >= e->k)
        bex__engine_repost_recvs(e);
    return true;
}

/* bex__engine_complete's every completion but a receive's success: out
 * of line, so that a receive's path through bex__engine_complete (the
 * shared receive queue's) saves no registers for it. */
__attribute__((noinline)) static bool complete_other(struct bex__engine *e, const struct ibv_wc *wc)
{
    uint32_t low = (uint32_t)wc->wr_id;
    if (e->state == E_DEAD)
        return true; /* queued before the QP went: everything was handed back */
    if (wc->status != IBV_WC_SUCCESS) {
        char what[96] = "receive";
        if (!(low & WR_RECV))
            bex__engine_describe_send(e, low & WR_CNT_MASK, what, sizeof what);
        bex__log(e->sh->log, BEX_LOG_ERROR,
                 "%s: work completion error on a %s: %s (vendor 0x%x): %s", e->name, what,
                 ibv_wc_status_str(wc->status), wc->vendor_err, wc_why(wc->status));
        if (wc->status == IBV_WC_RNR_RETRY_EXC_ERR)
            BEX__STAT_ADD(e->stats, rnr_errors, 1);
        else if (wc->status == IBV_WC_RETRY_EXC_ERR)
            BEX__STAT_ADD(e->stats, retry_errors, 1);
        bex__engine_fail(e, bex__rdma_wc_errno(wc->status));
        return true;
    }
    assert(!(low & WR_RECV));
    send_completed(e, low & WR_CNT_MASK);
    /* the window mode's spares are bound once the queue is idle */
    return !(e->state == E_UP && !bex__engine_work(e) && !(e->sh->windows && e->spare_want));
}

bool bex__engine_complete(struct bex__engine *e, const struct ibv_wc *wc)
{
    /* a receive's success first (bex__engine_complete_recv tests the
     * engine's state as complete_other does): both are tail calls */
    if (__builtin_expect(wc->status == IBV_WC_SUCCESS && ((uint32_t)wc->wr_id & WR_RECV), 1))
        return bex__engine_complete_recv(e, wc);
    return complete_other(e, wc);
}

void *bex__engine_srq_complete(struct bex__srq *q, const struct ibv_wc *wc)
{
    uint32_t idx = (uint32_t)wc->wr_id & WR_CNT_MASK;
    struct bex__engine *e = bex__srq_arrived(q, idx, wc->qp_num);
    if (!e)
        return NULL; /* a QP destroyed since: the slot went back to the pool */
    e->srq_cur = idx;
    if (__builtin_expect(!e->rbuf_usable, 0)) /* (slot_refill reads it untested) */
        (void)bex__engine_rbuf_usable(e, q->slots[idx].buf);
    /* The peer's credits: its share less what it consumed and we have not
     * returned, held (unposted, starved) or reposted but not yet told
     * (to_return). Without to_return, the reposts every k receives would
     * let a peer that never takes our credit updates (it holds its
     * receives) go on sending forever, each SEND on a receive that backs
     * another peer's credit (test_adversary.srq). */
    if (wc->status == IBV_WC_SUCCESS && e->n_unposted + e->n_starved + e->to_return >= e->rq) {
        /* a SEND with no credit of ours: it took a receive that backs
         * another peer's credit */
        int rc =
            bex__engine_violation(e, "a SEND beyond its %u credits (shared receive queue)", e->rq);
        bex__engine_fail(e, rc);
    } else {
        bex__engine_complete(e, wc);
        /* staged now, posted with the other engines' reposts at the end
         * of the thread's poll turn (bex__srq_flush) */
        if (e->state != E_DEAD && e->n_unposted)
            bex__engine_repost_recvs(e);
    }
    /* taken by neither the engine's lists nor its release (it failed on
     * this receive): back to the pool */
    if (e->srq_cur == idx)
        bex__srq_return(q, idx);
    e->srq_cur = NO_SLOT;
    return e->user;
}
