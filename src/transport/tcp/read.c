/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport: the read side (headers, payloads into received
 * buffers, partly received messages, acknowledgements in), split from
 * tcp.c along its banner. See tcp.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "common/sys.h"
#include "mem/lookup.h"
#include "transport/tcp/tcp_internal.h"

/* ---------------- read side ---------------- */

static struct part *part_of(struct bex__tcp *t, uint32_t stream)
{
    /* (t->one is never busy at a header: its frame is its message) */
    return t->parts_n ? bex__hmap_get(&t->parts, stream) : NULL;
}

/* The peer acknowledged n of our messages. */
static int acked(struct bex__tcp *t, uint32_t n)
{
    if (n > t->ack_n)
        return -EPROTO;
    if (n)
        t->ack_wait_ms = t->rx_ms;
    while (n--) {
        struct bex__msg *m = t->ack_head;
        t->ack_head = m->next;
        if (!t->ack_head)
            t->ack_tail = NULL;
        t->ack_n--;
        bex__tcp_done(t, m, 0);
        if (t->state == T_DEAD)
            return 0;
    }
    return 0;
}

/* Is a DIRECT message into the exposed buffer of token being received? */
static bool direct_held(struct bex__tcp *t, uint32_t token)
{
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    struct part *p;
    while ((p = bex__hmap_next(&t->parts, &it, NULL)))
        if (p->direct && p->token == token)
            return true;
    return false;
}

/* Is p's exposed buffer still exposed (armed, same arming)? Between two
 * reads of its payload the application may have taken it back (closed its
 * socket, say): not one more byte goes into it then. */
static bool direct_live(struct bex__tcp *t, const struct part *p)
{
    uint32_t len;
    return t->up->direct_buf(&t->x, p->token, &len) == p->buf && len == p->len;
}

/* A message of the peer's arrived whole. */
static void part_complete(struct bex__tcp *t, struct part *p)
{
    if (p != &t->one)
        bex__hmap_del(&t->parts, p->stream);
    t->parts_n--;
    if (p->held) /* (the test here, not a call a message: issue 25 item 2) */
        bex__tcp_part_unhold(t, p);
    t->acks_owed++;
    if (t->ack_now)
        t->msg_in_us = bex__now_us();
    t->msgs_in++;
    BEX__STAT_ADD(t->sh->stats, msgs_recv, 1);
    if (p->direct) {
        uint32_t token = p->token;
        bex__tcp_part_release(t, p);
        if (t->up->on_direct(&t->x, token))
            bex__tcp_violation(t, "a DIRECT message names no exposed buffer");
        return;
    }
    uint32_t stream = p->stream, len = p->len;
    void *buf = p->buf;
    bex__tcp_part_release(t, p); /* (inline) */
    BEX__STAT_ADD(t->sh->stats, bytes_recv, len);
    t->up->on_msg(&t->x, stream, buf, len);
}

/* Backpressure: stop reading until there is room for the message whose
 * header was read (the tick looks again). own: the connection's share
 * stops it, not the context's budget. */
static bool pause_for_room(struct bex__tcp *t, bool own)
{
    t->need_buf = true;
    t->pause_own = own;
    if (!t->rx_paused) {
        BEX__STAT_ADD(t->sh->stats, recv_paused, 1);
        t->paused_ms = bex__now_ms();
    }
    t->rx_paused = true;
    bex__tcp_want(t);
    return false;
}

/* The peer's CLOSE of a stream: a message of it the peer cut off goes. */
static bool on_close_frame(struct bex__tcp *t, const struct bex__hdr *h)
{
    struct part *p = part_of(t, h->stream);
    if (p) { /* a message the peer cut off */
        bex__hmap_del(&t->parts, h->stream);
        t->parts_n--;
        bex__tcp_part_free(t, p);
    }
    struct bex__stream *st = bex__stream_find(&t->streams, h->stream);
    if (st && bex__stream_move(st, BEX__SE_PEER_CLOSE) < 0) {
        char what[96];
        snprintf(what, sizeof what, "a CLOSE of stream %u, which is %s", st->id,
                 bex__stream_state_name(st->state));
        bex__tcp_violation(t, what);
        return false;
    }
    t->up->on_peer_close(&t->x, h->stream);
    if (t->state != T_DEAD && st && bex__stream_find(&t->streams, h->stream) == st)
        bex__tcp_stream_maybe_end(t, st);
    return t->state != T_DEAD;
}

/* Where a DATA message starting with h goes: a received buffer, when the
 * budget has room. false: on_header returns *ret. */
__attribute__((always_inline)) static inline bool
part_buf(struct bex__tcp *t, const struct bex__hdr *h, struct part *p, bool *ret)
{
    if (h->id > t->cfg.max_msg) {
        bex__tcp_violation(t, "a message above max_msg");
        return false;
    }
    /* the share is never below share_min: within it no call (its holders'
     * count and division, some 20 instructions a message, issue 25 item 2) */
    uint64_t held = t->part_bytes + h->id;
    if (held > t->cfg.share_min && held > bex__tcp_recv_share(t)) {
        *ret = pause_for_room(t, true);
        return false;
    }
    /* the context's budget, as over RDMA: with nothing held, one message of
     * any size may come */
    if (!bex__recv_room(t->sh, h->id)) { /* until the application frees some */
        *ret = pause_for_room(t, false);
        return false;
    }
    p->len = h->id;
    size_t usable;
    p->buf = bex__mem_alloc_usable(t->sh->recv_pool, p->len ? p->len : 1, &usable);
    if (!p->buf) {
        bex__tcp_fail(&t->x, -ENOMEM);
        return false;
    }
    bex__recv_allocated(t->sh, (int64_t)usable);
    return true;
}

/* Where the entry of a message drafted in d goes: t->one when the frame
 * carries the whole message (the common case, no allocation), else a
 * partly received message of the map. NULL: out of memory. */
static struct part *part_place(struct bex__tcp *t, const struct bex__hdr *h, const struct part *d)
{
    if (h->len == d->len && !t->one_busy) {
        t->one = *d;
        t->one_busy = true;
        return &t->one;
    }
    struct part *p = malloc(sizeof(*p));
    if (!p)
        return NULL;
    *p = *d;
    if (bex__hmap_put(&t->parts, p->stream, p)) {
        free(p);
        return NULL;
    }
    return p;
}

/* p, a DATA message's new entry, is held partly received: its bytes
 * counted against the budget and its hold noted. */
static inline void part_hold(struct bex__tcp *t, struct part *p)
{
    p->held = true;
    t->part_bytes += p->len;
    bex__tcp_hold_note(t);
}

/* A DATA or DIRECT frame that starts a message: its entry, or NULL, and
 * on_header returns *ret (false: the connection failed). */
static struct part *part_start(struct bex__tcp *t, const struct bex__hdr *h, bool direct, bool *ret)
{
    *ret = false;
    if (h->addr != 0) {
        bex__tcp_violation(t, "a fragment of a message that never started");
        return NULL;
    }
    /* one at most per stream, so a peer within its streams stays within
     * this; more is a peer naming streams it never opened */
    if (t->cfg.parts_max && t->parts_n >= t->cfg.parts_max) {
        bex__tcp_violation(t, "more messages partly sent at once than it has streams");
        return NULL;
    }
    if (direct && direct_held(t, h->id)) {
        bex__tcp_violation(t, "a second DIRECT message into an exposed buffer still being written");
        return NULL;
    }
    if (!direct && h->len == h->id && !t->one_busy) {
        /* the common case, a DATA frame carrying its whole message: its
         * entry made in t->one itself (not drafted and copied there, some
         * 10 instructions a message, issue 25 item 5) */
        struct part *p = &t->one;
        *p = (struct part){.stream = h->stream};
        if (!part_buf(t, h, p, ret))
            return NULL;
        t->one_busy = true;
        t->parts_n++;
        if (h->len > t->stage_end - t->stage_off) /* as below */
            part_hold(t, p);
        return p;
    }
    struct part d = {.stream = h->stream, .direct = direct};
    if (direct) {
        d.token = h->id;
        d.buf = t->up->direct_buf(&t->x, h->id, &d.len);
        if (!d.buf) {
            bex__tcp_violation(t, "a DIRECT message names no exposed buffer");
            return NULL;
        }
    } else if (!part_buf(t, h, &d, ret)) {
        return NULL;
    }
    struct part *p = part_place(t, h, &d);
    if (!p) {
        if (!direct)
            bex_mem_free(d.buf); /* the estimate learns of it at its next exact count */
        bex__tcp_fail(&t->x, -ENOMEM);
        return NULL;
    }
    t->parts_n++;
    /* A message whose frame carries it whole, staged whole behind its
     * header, is delivered before the next header is read: it is never
     * held partly received, and its hold is not noted (two atomic updates
     * of the context's holders a message; issue 25 item 5). */
    if (!direct && (h->len != p->len || h->len > t->stage_end - t->stage_off))
        part_hold(t, p);
    return p;
}

/* A header is read (raw: its bytes; unused when need_buf, whose header is
 * decoded already): act on it, or set up where its payload goes. Returns
 * false when the read must stop (failed, or waiting for room). */
static bool on_header(struct bex__tcp *t, const uint8_t *raw)
{
    struct bex__hdr *h = &t->hdr;
    if (!t->need_buf) {
        if (bex__hdr_decode_frame(raw, h)) {
            bex__tcp_violation(t, "malformed frame header");
            return false;
        }
        if (acked(t, h->credits)) {
            bex__tcp_violation(t, "acknowledges messages never sent");
            return false;
        }
        if (t->state == T_DEAD)
            return false;
    }
    t->rhdr_len = 0;
    switch (h->type) {
    case BEX__MSG_CREDIT:
        return true;
    case BEX__MSG_OPEN:
        t->up->on_open(&t->x, h->stream);
        return t->state != T_DEAD;
    case BEX__MSG_CLOSE:
        return on_close_frame(t, h);
    default:
        break;
    }
    /* DATA or DIRECT: the payload follows */
    struct part *p = part_of(t, h->stream);
    bool direct = h->type == BEX__MSG_DIRECT;
    if (!p) {
        bool ret;
        if (!(p = part_start(t, h, direct, &ret)))
            return ret;
    } else if (p->direct != direct || (direct && p->token != h->id) ||
               (!direct && p->len != h->id) || p->off != h->addr) {
        bex__tcp_violation(t, "a fragment that does not continue its message");
        return false;
    }
    t->need_buf = false;
    if (t->rx_paused) {
        t->rx_paused = t->pause_own = false;
        bex__tcp_want(t);
    }
    if (h->len > p->len - p->off || (h->len == 0 && p->len != 0)) {
        bex__tcp_violation(t, "a fragment beyond its message");
        return false;
    }
    t->cur = p;
    t->cur_left = h->len;
    t->in_payload = true;
    if (h->len == 0) {
        t->in_payload = false;
        part_complete(t, p);
        t->cur = NULL;
        return t->state != T_DEAD;
    }
    return true;
}

/* n payload bytes of the current frame arrived (at its buffer's offset):
 * count them, and deliver its message when they were its last. Whether
 * reading goes on. */
static bool payload_in(struct bex__tcp *t, uint32_t n)
{
    struct part *p = t->cur;
    p->off += n;
    t->part_rx += n;
    t->cur_left -= n;
    if (t->cur_left)
        return true;
    t->in_payload = false;
    t->cur = NULL;
    if (p->off == p->len)
        part_complete(t, p);
    return t->state != T_DEAD;
}

/* A DIRECT message's buffer is no longer exposed: the connection fails
 * (false). */
static __attribute__((noinline)) bool direct_gone(struct bex__tcp *t)
{
    if (direct_live(t, t->cur))
        return true;
    /* as over RDMA, where its completion names no armed buffer */
    bex__tcp_violation(t, "a DIRECT message into a buffer no longer exposed");
    return false;
}

/* May the current frame's payload still go into its exposed buffer?
 * Inline: a DATA message's payload asks once (a call was some 10
 * instructions a message, issue 25 item 2). */
static inline bool direct_ok(struct bex__tcp *t)
{
    return !t->cur->direct || direct_gone(t);
}

/* Take what the last read staged: payload bytes of the current frame
 * (copied into its buffer) or the next header (decoded in place when it is
 * there whole). Whether reading goes on. */
static bool take_staged(struct bex__tcp *t)
{
    uint32_t avail = t->stage_end - t->stage_off;
    const uint8_t *s = t->stage + t->stage_off;
    if (t->in_payload) {
        if (!direct_ok(t))
            return false;
        uint32_t k = avail < t->cur_left ? avail : t->cur_left;
        memcpy(t->cur->buf + t->cur->off, s, k);
        t->stage_off += k;
        return payload_in(t, k);
    }
    if (!t->rhdr_len && avail >= BEX__HDR_LEN) {
        t->stage_off += BEX__HDR_LEN;
        if (!on_header(t, s))
            return false;
        /* its payload, when staged behind it, at once (not a turn of
         * bex__tcp_rx's loop more: issue 25 item 2) */
        if (!t->in_payload || t->stage_off == t->stage_end)
            return true;
        return take_staged(t);
    }
    uint32_t k = BEX__HDR_LEN - t->rhdr_len;
    k = avail < k ? avail : k;
    memcpy(t->rhdr + t->rhdr_len, s, k);
    t->rhdr_len += k;
    t->stage_off += k;
    return t->rhdr_len < BEX__HDR_LEN || on_header(t, t->rhdr);
}

/* One read: the current frame's payload straight into its buffer, the rest
 * of a header, and up to RX_STAGE bytes more into the stage. Returns the
 * bytes read, 0 when there was nothing (or EINTR), -1 when the connection
 * failed; *drained: the read came short, so the socket had no more. */
static ssize_t read_some(struct bex__tcp *t, bool *drained)
{
    struct iovec iov[3];
    int n = 0;
    size_t want = 0;
    if (t->in_payload)
        iov[n++] = (struct iovec){t->cur->buf + t->cur->off, t->cur_left};
    if (t->rhdr_len)
        iov[n++] = (struct iovec){t->rhdr + t->rhdr_len, BEX__HDR_LEN - t->rhdr_len};
    iov[n++] = (struct iovec){t->stage, RX_STAGE};
    for (int i = 0; i < n; i++)
        want += iov[i].iov_len;
    ssize_t r = bex__sys_readv(t->fd, iov, n);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        *drained = true;
        return 0;
    }
    if (r < 0 && errno == EINTR)
        return 0;
    if (r <= 0) {
        t->link_lost = true;
        bex__tcp_fail(&t->x, r < 0 ? -errno : -ECONNRESET);
        return -1;
    }
    *drained = (size_t)r < want;
    t->last_rx = t->rx_ms;
    return r;
}

/* The bytes of one read, in the order read_some asked for them: payload,
 * the rest of a header, the stage (its bounds set first: a header that
 * pauses reading leaves them for later). Whether reading goes on. */
static bool took(struct bex__tcp *t, size_t got)
{
    uint32_t pay = 0, hdr = 0;
    if (t->in_payload)
        pay = got < t->cur_left ? (uint32_t)got : t->cur_left;
    size_t rest = got - pay;
    if (t->rhdr_len)
        hdr = rest < BEX__HDR_LEN - t->rhdr_len ? (uint32_t)rest : BEX__HDR_LEN - t->rhdr_len;
    t->stage_off = 0;
    t->stage_end = (uint32_t)(rest - hdr);
    if (pay && !payload_in(t, pay))
        return false;
    if (!hdr)
        return true;
    t->rhdr_len += hdr;
    return t->rhdr_len < BEX__HDR_LEN || on_header(t, t->rhdr);
}

/* Read what the socket has: one readv takes the current frame's payload
 * straight into its buffer and the next frames into the stage, from which
 * small payloads are copied; a short read says the socket is drained, so
 * no read is made to learn it (EAGAIN). At most RX_BUDGET bytes or RX_MSGS
 * messages are read a call (what is staged is taken whole, at most RX_STAGE
 * bytes more): the application's callbacks run in here, and the loop must
 * get to write (acknowledgements, keepalive) between batches, as it does
 * between CQ polls over RDMA; the descriptor stays readable for the next
 * call. */
#define RX_BUDGET (1u << 20)
#define RX_MSGS   16
void bex__tcp_rx(struct bex__tcp *t)
{
    size_t budget = RX_BUDGET;
    uint64_t msgs0 = t->msgs_in;
    bool drained = false;
    t->rx_ms = bex__now_ms();
    while (t->state != T_DEAD) {
        if (t->need_buf) {
            if (!on_header(t, NULL))
                return;
            continue;
        }
        if (t->stage_off < t->stage_end) {
            if (!take_staged(t))
                return;
            continue;
        }
        if (t->rx_paused || drained || !budget || t->msgs_in - msgs0 >= RX_MSGS)
            return;
        if (t->in_payload && !direct_ok(t))
            return;
        ssize_t r = read_some(t, &drained);
        if (r < 0)
            return;
        budget = (size_t)r < budget ? budget - (size_t)r : 0;
        if (r > 0 && !took(t, (size_t)r))
            return;
    }
}

bool bex__tcp_events(struct bex__xport *x, uint32_t events)
{
    if (x->ops != &bex__tcp_transport) /* (a test's wrapper) */
        x = bex__tcp_unwrap(x);
    struct bex__tcp *t = tcp_of(x);
    if (t->state == T_DEAD)
        return false;
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        bex__tcp_rx(t);
        t->ev_ms = t->rx_ms;
    }
    if (t->state != T_DEAD && events & EPOLLOUT) {
        int err = bex__tcp_flush(t);
        if (err) {
            t->link_lost = true;
            bex__tcp_fail(x, err);
        }
    }
    bool more = t->state != T_DEAD && bex__tcp_progress(x);
    t->ev_ms = 0;
    return more;
}
