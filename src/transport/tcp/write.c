/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport: the write side (the scheduler, frames, the write
 * batch and progress), split from tcp.c along its banner. See tcp.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "common/sys.h"
#include "transport/tcp/tcp_internal.h"

/* ---------------- write side ---------------- */

/* The batch's next frame, for h (its credits set here). Inline: a message
 * sent pays no call for its frame (some 8 instructions, issue 25 item 5). */
__attribute__((always_inline)) static inline struct out_frame *frame_new(struct bex__tcp *t,
                                                                         struct bex__hdr *h)
{
    struct out_frame *f = &t->out[(t->out_head + t->out_n++) % OUT_MAX];
    memset(f, 0, sizeof(*f));
    /* acknowledge what arrived whole since the last header */
    uint32_t a = t->acks_owed > 0xffff ? 0xffff : t->acks_owed;
    h->credits = (uint16_t)a;
    t->acks_owed -= a;
    if (!t->acks_owed && t->ack_held) {
        t->ack_held = 0;
        t->x.due_us = 0;
    }
    bex__hdr_encode(h, f->hdr);
    return f;
}

static struct out_frame *frame_ctl(struct bex__tcp *t, uint8_t type, uint32_t stream)
{
    struct bex__hdr h = {.type = type, .stream = stream};
    return frame_new(t, &h);
}

/* One unit of the stream's work into the batch: its OPEN, one fragment of
 * its head message, or its CLOSE. Returns whether the stream has more. */
static bool stream_turn(struct bex__tcp *t, struct bex__stream *st)
{
    if (bex__stream_owes_open(st)) {
        frame_ctl(t, BEX__MSG_OPEN, st->id);
        bex__stream_move(st, BEX__SE_OPEN_SENT);
        return st->q_head || bex__stream_closing(st);
    }
    struct bex__msg *m = st->q_head;
    if (m) {
        /* a gathered message's fragments end at its buffers' ends: the
         * batch's sendmsg gathers them, nothing is copied */
        size_t run;
        uint32_t lkey;
        const uint8_t *p = bex__msg_at(m, m->off, &run, &lkey);
        uint32_t n = (uint32_t)(run < t->cfg.frag_size ? run : t->cfg.frag_size);
        /* id: the whole message's length (DATA) or the exposed buffer's
         * token (DIRECT); addr: where this fragment starts in it */
        struct bex__hdr h = {.type = m->direct ? BEX__MSG_DIRECT : BEX__MSG_DATA,
                             .stream = st->id,
                             .len = n,
                             .id = m->direct ? m->imm : (uint32_t)m->len,
                             .addr = m->off};
        if (t->ack_now && m->off == 0 && bex__now_us() - t->msg_in_us <= t->cfg.ack_delay_us)
            t->ack_now = false; /* answers follow the peer's messages again */
        struct out_frame *f = frame_new(t, &h);
        f->m = m;
        f->p = p;
        f->plen = n;
        m->off += n;
        if (m->off == m->len) {
            f->last = true;
            m->state = BEX__M_POSTED;
            st->q_head = m->next;
            if (!st->q_head)
                st->q_tail = NULL;
            st->q_len--;
            BEX__STAT_ADD(t->sh->stats, msgs_sent, 1);
            BEX__STAT_ADD(t->sh->stats, bytes_sent, m->len);
        }
        return st->q_head || bex__stream_closing(st);
    }
    if (bex__stream_owes_close(st)) {
        struct out_frame *f = frame_ctl(t, BEX__MSG_CLOSE, st->id);
        f->st = st;
        bex__stream_move(st, BEX__SE_CLOSE_SENT);
    }
    return false;
}

/* Whether owed acknowledgements must go now, alone. An echo's answer is
 * queued by on_recv and goes on the next loop turn; a thread's next message
 * comes some microseconds later: either carries them, so they are held for
 * a frame, up to ack_delay_us (the I/O thread calls progress again then:
 * x.due_us), or until ACK_MAX are owed. The bound keeps a peer that only
 * receives acknowledging in time: its sender's messages are reported done
 * (and their buffers handed back) by these acknowledgements alone. A hold
 * that ends without a frame says the traffic is one-way for now: from then
 * on acknowledgements go at once (a sender waiting for each would wait
 * ack_delay_us a message otherwise), until a message of ours follows one
 * of the peer's within ack_delay_us again (stream_turn), as TCP leaves its
 * delayed acknowledgements for quick ones. */
static bool ack_due(struct bex__tcp *t)
{
    if (t->acks_owed >= ACK_MAX || t->ack_now)
        return true;
    if (!bex__ack_hold_due(&t->x, &t->ack_held, t->cfg.ack_delay_us))
        return false;
    t->ack_now = true;
    t->msg_in_us = 0; /* nothing of the peer's answered since */
    return true;
}

/* Fill the batch: control frames first, then one unit per stream per turn. */
static void schedule(struct bex__tcp *t)
{
    while (t->ctl_n && t->out_n < OUT_MAX) {
        struct ctl c = t->ctlq[t->ctl_head];
        t->ctl_head = (t->ctl_head + 1) % t->ctl_cap;
        t->ctl_n--;
        struct out_frame *f = frame_ctl(t, c.type, c.stream);
        f->st = c.st;
    }
    struct bex__stream *st;
    while (t->out_n < OUT_MAX && (st = bex__stream_ring_first(&t->streams))) {
        bex__stream_ring_remove(&t->streams, st);
        if (bex__stream_gone(st))
            continue;
        if (stream_turn(t, st))
            bex__tcp_ring_add(t, st);
    }
    /* acknowledgements with nothing else to carry them */
    if (t->acks_owed && t->out_n < OUT_MAX && ack_due(t)) {
        frame_ctl(t, BEX__MSG_CREDIT, 0);
        BEX__STAT_ADD(t->sh->stats, credit_msgs, 1);
    }
}

/* A frame is written whole. The counters keep their RDMA names: a DIRECT
 * frame counts as a WRITE, every other frame as a SEND, a sendmsg call as
 * an ibv_post_send call. */
static void frame_written(struct bex__tcp *t, struct out_frame *f, uint64_t now_ms)
{
    if (!f->raw) {
        if (f->hdr[0] == BEX__MSG_DIRECT)
            BEX__STAT_ADD(t->sh->stats, writes_posted, 1);
        else
            BEX__STAT_ADD(t->sh->stats, sends_posted, 1);
    }
    if (f->m && f->last) {
        if (f->cut) {
            bex__tcp_done(t, f->m, -ECANCELED);
        } else {
            struct bex__msg *m = f->m;
            m->next = NULL;
            if (!t->ack_head)
                t->ack_wait_ms = now_ms;
            if (t->ack_tail)
                t->ack_tail->next = m;
            else
                t->ack_head = m;
            t->ack_tail = m;
            t->ack_n++;
        }
    }
    if (f->st) { /* our CLOSE went */
        bex__stream_move(f->st, BEX__SE_CLOSE_DONE);
        bex__tcp_stream_maybe_end(t, f->st);
    }
}

/* Write what the batch holds; 0, or a negative errno (the connection is
 * gone). */
int bex__tcp_flush(struct bex__tcp *t)
{
    while (t->out_n && t->state != T_DEAD) {
        struct iovec iov[IOV_BATCH];
        int n = 0;
        size_t skip = t->out_off;
        for (uint32_t i = 0; i < t->out_n && n + 2 <= IOV_BATCH; i++) {
            struct out_frame *f = &t->out[(t->out_head + i) % OUT_MAX];
            if (f->raw) {
                /* no header */
            } else if (skip < BEX__HDR_LEN) {
                iov[n++] = (struct iovec){f->hdr + skip, BEX__HDR_LEN - skip};
                skip = 0;
            } else {
                skip -= BEX__HDR_LEN;
            }
            if (f->plen > skip)
                iov[n++] = (struct iovec){(void *)(f->p + skip), f->plen - skip};
            skip = 0;
        }
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = bex__sys_sendmsg(t->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            if (errno == EINTR)
                continue;
            return -errno;
        }
        BEX__STAT_ADD(t->sh->stats, post_send_calls, 1);
        /* (the coarse clock: the read's, when a read just ran) */
        uint64_t now_ms = t->ev_ms ? t->ev_ms : bex__now_ms();
        t->last_tx = now_ms;
        size_t left = (size_t)w + t->out_off;
        t->out_off = 0;
        while (t->out_n) {
            struct out_frame *f = &t->out[t->out_head];
            size_t sz = (f->raw ? 0 : BEX__HDR_LEN) + f->plen;
            if (left < sz) {
                t->out_off = left;
                break;
            }
            left -= sz;
            t->out_head = (t->out_head + 1) % OUT_MAX;
            t->out_n--;
            frame_written(t, f, now_ms);
            if (t->state == T_DEAD)
                return 0;
        }
    }
    return 0;
}

bool bex__tcp_progress(struct bex__xport *x)
{
    struct bex__tcp *t = tcp_of(x);
    if (t->state != T_UP)
        return false;
    bool more = false;
    for (int round = 0; round < 4 && t->state != T_DEAD; round++) {
        schedule(t);
        int err = bex__tcp_flush(t);
        if (err) {
            t->link_lost = true;
            bex__tcp_fail(x, err);
            return true;
        }
        /* (acknowledgements held back wait for their deadline) */
        more = t->state != T_DEAD && !t->out_n &&
               (t->streams.ring_n || t->ctl_n || (t->acks_owed && !t->ack_held));
        if (t->out_n == OUT_MAX || !more)
            break;
    }
    if (t->state != T_DEAD)
        bex__tcp_want(t);
    return more;
}
