/* The TCP transport (see tcp.h). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "transport/tcp/tcp_internal.h"

_Atomic(const struct bex__tcp_wrap *) bex__tcp_wrap_test;

/* The TCP transport itself, when a test wrapped it (bex__tcp_wrap_test). */
static struct bex__xport *unwrap(struct bex__xport *x)
{
    while (x && x->ops->inner)
        x = x->ops->inner(x);
    return x;
}

bool bex__xport_is_tcp(const struct bex__xport *x)
{
    x = unwrap((struct bex__xport *)x);
    return x && x->ops == &bex__tcp_transport;
}

bool bex__tcp_link_lost(const struct bex__xport *x)
{
    return bex__xport_is_tcp(x) && tcp_of(unwrap((struct bex__xport *)x))->link_lost;
}

static void want(struct bex__tcp *t)
{
    /* Paused, neither: the peer's EOF waits behind the bytes not read, and
     * EPOLLRDHUP, level-triggered, would wake the loop on every turn. */
    uint32_t ev = 0;
    if (!t->rx_paused)
        ev |= EPOLLIN | EPOLLRDHUP;
    if (t->out_n || t->ctl_n)
        ev |= EPOLLOUT;
    if (ev != t->events && !t->dead) {
        if (bex__loop_modify(t->loop, t->fd, ev, t->tag) == 0)
            t->events = ev;
    }
}

/* ---------------- received memory (recv_bytes_max) ---------------- */

/* As over RDMA (bex__recv_room): with nothing held, one message of any
 * size may come. */
static bool recv_room(struct bex__tcp *t, uint64_t want_bytes)
{
    return bex__recv_room(t->sh, want_bytes);
}

static _Atomic int32_t *holders(struct bex__tcp *t)
{
    return &(t->sh->recv_acct ? t->sh->recv_acct : &t->sh->recv_own)->holders;
}

/* What this connection may hold of partly received messages: with no other
 * connection of the context holding any, the whole budget; else its share,
 * which leaves room for one more holder, so that a few peers that start
 * large messages and stall cannot take the budget from every other (they
 * fail by the rate check, too_slow). */
static uint64_t recv_share(struct bex__tcp *t)
{
    int32_t n = atomic_load_explicit(holders(t), memory_order_relaxed) - (t->holding ? 1 : 0);
    return bex__recv_share(t->sh->recv_max, n, t->cfg.share_min);
}

/* part_bytes changed: keep the context's count of holders, and start the
 * rate window when the connection begins to hold. */
static void hold_note(struct bex__tcp *t)
{
    bool h = !t->dead && t->part_bytes > 0;
    if (h == t->holding)
        return;
    t->holding = h;
    atomic_fetch_add_explicit(holders(t), h ? 1 : -1, memory_order_relaxed);
    if (h) {
        t->rate_ms = bex__now_ms();
        t->rate_rx = t->part_rx;
    }
}

static void part_unhold(struct bex__tcp *t, const struct part *p)
{
    if (!p->direct) {
        t->part_bytes -= p->len;
        hold_note(t);
    }
}

/* ---------------- failure ---------------- */

static void done(struct bex__tcp *t, struct bex__msg *m, int status)
{
    t->up->on_send_done(&t->x, m, status);
}

static void part_free(struct bex__tcp *t, struct part *p)
{
    part_unhold(t, p);
    if (!p->direct && p->buf)
        bex_mem_free(p->buf); /* the estimate learns of it at its next exact count */
    free(p);
}

void bex__tcp_fail(struct bex__xport *x, int err)
{
    struct bex__tcp *t = tcp_of(x);
    if (t->dead)
        return;
    t->dead = true;
    t->x.due_us = 0;
    /* the fd is the connection's: it closes it on on_fail; from here on
     * nothing is written or read, so every buffer is ours to hand back */
    for (uint32_t i = 0; i < t->out_n; i++) {
        struct out_frame *f = &t->out[(t->out_head + i) % OUT_MAX];
        if (f->m && f->last)
            done(t, f->m, -ECANCELED); /* never written whole */
    }
    t->out_n = 0;
    while (t->ack_head) { /* written whole, the peer may or may not hold it */
        struct bex__msg *m = t->ack_head;
        t->ack_head = m->next;
        done(t, m, -EIO);
    }
    t->ack_tail = NULL;
    t->ack_n = 0;
    for (struct bex__stream *st = t->all; st; st = st->all_next) {
        while (st->q_head) {
            struct bex__msg *m = st->q_head;
            st->q_head = m->next;
            done(t, m, -ECANCELED);
        }
        st->q_tail = NULL;
        st->q_len = 0;
        st->failed = true;
        st->in_ring = false;
    }
    t->all = NULL; /* unlinked: the sock layer lets go of them in on_fail */
    t->ring = t->ring_tail = NULL;
    for (int i = 0; i < PART_HASH; i++) {
        while (t->parts[i]) {
            struct part *p = t->parts[i];
            t->parts[i] = p->next;
            part_free(t, p);
        }
    }
    t->parts_n = 0;
    t->cur = NULL;
    t->up->on_fail(&t->x, err);
}

/* The peer broke the protocol: one log line, then the connection goes. */
static void violation(struct bex__tcp *t, const char *what)
{
    if (!t->violation_logged)
        bex__log(t->sh->log, BEX_LOG_WARN, "%s: over TCP: protocol violation by the peer: %s",
                 t->cfg.name, what);
    t->violation_logged = true;
    bex__tcp_fail(&t->x, -EPROTO);
}

/* ---------------- streams ---------------- */

static void ring_add(struct bex__tcp *t, struct bex__stream *st)
{
    if (st->in_ring || st->failed)
        return;
    st->in_ring = true;
    st->rr_next = NULL;
    if (t->ring_tail)
        t->ring_tail->rr_next = st;
    else
        t->ring = st;
    t->ring_tail = st;
}

static struct bex__stream *stream_find(struct bex__tcp *t, uint32_t id)
{
    for (struct bex__stream *st = t->all; st; st = st->all_next)
        if (st->id == id)
            return st;
    return NULL;
}

static void stream_unlink(struct bex__tcp *t, struct bex__stream *st)
{
    if (st->all_prev)
        st->all_prev->all_next = st->all_next;
    else
        t->all = st->all_next;
    if (st->all_next)
        st->all_next->all_prev = st->all_prev;
    st->all_prev = st->all_next = NULL;
}

/* Both CLOSEs are through: the stream ends (it is not in the ring: nothing
 * is left to send). */
static void stream_maybe_end(struct bex__tcp *t, struct bex__stream *st)
{
    if (!st->close_done || !st->peer_closed || st->failed)
        return;
    st->failed = true; /* ended: never scheduled again */
    if (st->in_ring) {
        struct bex__stream **p = &t->ring, *prev = NULL;
        while (*p && *p != st) {
            prev = *p;
            p = &(*p)->rr_next;
        }
        if (*p) {
            *p = st->rr_next;
            if (t->ring_tail == st)
                t->ring_tail = prev;
        }
        st->in_ring = false;
    }
    stream_unlink(t, st);
    t->up->on_stream_closed(&t->x, st);
}

static void tcp_attach(struct bex__xport *x, struct bex__stream *st, uint32_t id, bool client)
{
    struct bex__tcp *t = tcp_of(x);
    memset(st, 0, sizeof(*st));
    st->id = id;
    st->need_open = client;
    st->all_next = t->all;
    if (t->all)
        t->all->all_prev = st;
    t->all = st;
    if (client)
        ring_add(t, st);
}

static bool tcp_takes(struct bex__xport *x, const struct bex__stream *st, const struct bex__msg *m)
{
    const struct bex__tcp *t = tcp_of(x);
    return !t->dead && !st->failed && !st->close_req &&
           (m->direct || m->len <= t->cfg.peer_max_msg);
}

static void tcp_send(struct bex__xport *x, struct bex__stream *st, struct bex__msg *m)
{
    struct bex__tcp *t = tcp_of(x);
    m->next = NULL;
    m->st = st;
    m->off = 0;
    m->state = BEX__M_QUEUED;
    if (t->dead || st->failed || st->close_req) {
        done(t, m, -ECANCELED);
        return;
    }
    if (!m->direct && m->len > t->cfg.peer_max_msg) { /* queued before the peer was known */
        done(t, m, -EMSGSIZE);
        return;
    }
    if (st->q_tail)
        st->q_tail->next = m;
    else
        st->q_head = m;
    st->q_tail = m;
    st->q_len++;
    ring_add(t, st);
}

static void tcp_close_stream(struct bex__xport *x, struct bex__stream *st)
{
    struct bex__tcp *t = tcp_of(x);
    if (st->close_req || st->failed)
        return;
    st->close_req = true;
    ring_add(t, st);
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
static void tcp_peer_closed(struct bex__xport *x, struct bex__stream *st)
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
            done(t, m, -ECANCELED);
    }
    while (st->q_head) {
        m = st->q_head;
        st->q_head = m->next;
        done(t, m, -ECANCELED);
    }
    st->q_tail = NULL;
    st->q_len = 0;
    st->close_req = true;
    ring_add(t, st);
}

static int tcp_refuse_stream(struct bex__xport *x, uint32_t id)
{
    struct bex__tcp *t = tcp_of(x);
    /* bounded by what the peer sends: each refusal answers an OPEN frame */
    if (t->ctl_n >= 4096)
        return -EPROTO;
    return bex__tcp_ctl_push(t, BEX__MSG_CLOSE, id, NULL) ? 0 : -EPROTO;
}

/* ---------------- write side ---------------- */

static struct out_frame *frame_new(struct bex__tcp *t, struct bex__hdr *h)
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
    if (st->need_open && !st->open_sent) {
        frame_ctl(t, BEX__MSG_OPEN, st->id);
        st->open_sent = true;
        return st->q_head || st->close_req;
    }
    struct bex__msg *m = st->q_head;
    if (m) {
        uint32_t n = (uint32_t)(m->len - m->off);
        if (n > t->cfg.frag_size)
            n = t->cfg.frag_size;
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
        f->p = (const uint8_t *)m->buf + m->off;
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
        return st->q_head || st->close_req;
    }
    if (st->close_req && !st->close_sent) {
        struct out_frame *f = frame_ctl(t, BEX__MSG_CLOSE, st->id);
        f->st = st;
        st->close_sent = true;
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
    uint64_t now = bex__now_us();
    if (!t->ack_held) {
        t->ack_held = now ? now : 1;
        t->x.due_us = t->ack_held + t->cfg.ack_delay_us;
        return false;
    }
    if (now < t->x.due_us)
        return false;
    t->ack_now = true;
    t->msg_in_us = 0; /* nothing of the peer's answered since */
    return true;
}

/* Fill the batch: control frames first, then one unit per stream per turn. */
static bool schedule(struct bex__tcp *t)
{
    bool any = false;
    while (t->ctl_n && t->out_n < OUT_MAX) {
        struct ctl c = t->ctlq[t->ctl_head];
        t->ctl_head = (t->ctl_head + 1) % t->ctl_cap;
        t->ctl_n--;
        struct out_frame *f = frame_ctl(t, c.type, c.stream);
        f->st = c.st;
        any = true;
    }
    while (t->ring && t->out_n < OUT_MAX) {
        struct bex__stream *st = t->ring;
        t->ring = st->rr_next;
        if (!t->ring)
            t->ring_tail = NULL;
        st->in_ring = false;
        if (st->failed)
            continue;
        if (stream_turn(t, st))
            ring_add(t, st);
        any = true;
    }
    /* acknowledgements with nothing else to carry them */
    if (t->acks_owed && t->out_n < OUT_MAX && ack_due(t)) {
        frame_ctl(t, BEX__MSG_CREDIT, 0);
        BEX__STAT_ADD(t->sh->stats, credit_msgs, 1);
        any = true;
    }
    return any;
}

/* A frame is written whole. The counters keep their RDMA names: a DIRECT
 * frame counts as a WRITE, every other frame as a SEND, a sendmsg call as
 * an ibv_post_send call. */
static void frame_written(struct bex__tcp *t, struct out_frame *f)
{
    if (!f->raw) {
        if (f->hdr[0] == BEX__MSG_DIRECT)
            BEX__STAT_ADD(t->sh->stats, writes_posted, 1);
        else
            BEX__STAT_ADD(t->sh->stats, sends_posted, 1);
    }
    if (f->m && f->last) {
        if (f->cut) {
            done(t, f->m, -ECANCELED);
        } else {
            struct bex__msg *m = f->m;
            m->next = NULL;
            if (!t->ack_head)
                t->ack_wait_ms = bex__now_ms();
            if (t->ack_tail)
                t->ack_tail->next = m;
            else
                t->ack_head = m;
            t->ack_tail = m;
            t->ack_n++;
        }
    }
    if (f->st) { /* our CLOSE went */
        f->st->close_done = true;
        stream_maybe_end(t, f->st);
    }
}

/* Write what the batch holds; 0, or a negative errno (the connection is
 * gone). */
static int flush(struct bex__tcp *t)
{
    while (t->out_n && !t->dead) {
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
        ssize_t w = sendmsg(t->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            if (errno == EINTR)
                continue;
            return -errno;
        }
        BEX__STAT_ADD(t->sh->stats, post_send_calls, 1);
        t->last_tx = bex__now_ms();
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
            frame_written(t, f);
            if (t->dead)
                return 0;
        }
    }
    return 0;
}

bool bex__tcp_progress(struct bex__xport *x)
{
    struct bex__tcp *t = tcp_of(x);
    if (t->dead || !t->is_up)
        return false;
    bool did = false;
    for (int round = 0; round < 4 && !t->dead; round++) {
        bool s = schedule(t);
        uint32_t before = t->out_n;
        int err = flush(t);
        if (err) {
            t->link_lost = true;
            bex__tcp_fail(x, err);
            return true;
        }
        did |= s || t->out_n != before;
        /* (acknowledgements held back wait for their deadline) */
        if (t->out_n == OUT_MAX || (!t->ring && !t->ctl_n && (!t->acks_owed || t->ack_held)))
            break;
    }
    if (!t->dead)
        want(t);
    return did;
}

/* ---------------- read side ---------------- */

static struct part **part_slot(struct bex__tcp *t, uint32_t stream)
{
    struct part **p = &t->parts[stream % PART_HASH];
    while (*p && (*p)->stream != stream)
        p = &(*p)->next;
    return p;
}

/* The peer acknowledged n of our messages. */
static int acked(struct bex__tcp *t, uint32_t n)
{
    if (n > t->ack_n)
        return -EPROTO;
    if (n)
        t->ack_wait_ms = bex__now_ms();
    while (n--) {
        struct bex__msg *m = t->ack_head;
        t->ack_head = m->next;
        if (!t->ack_head)
            t->ack_tail = NULL;
        t->ack_n--;
        done(t, m, 0);
        if (t->dead)
            return 0;
    }
    return 0;
}

/* Is a DIRECT message into the exposed buffer of token being received? */
static bool direct_held(struct bex__tcp *t, uint32_t token)
{
    for (int i = 0; i < PART_HASH; i++)
        for (struct part *p = t->parts[i]; p; p = p->next)
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
    *part_slot(t, p->stream) = p->next;
    t->parts_n--;
    part_unhold(t, p);
    t->acks_owed++;
    if (t->ack_now)
        t->msg_in_us = bex__now_us();
    t->msgs_in++;
    BEX__STAT_ADD(t->sh->stats, msgs_recv, 1);
    if (p->direct) {
        uint32_t token = p->token;
        free(p);
        if (t->up->on_direct(&t->x, token))
            violation(t, "a DIRECT message names no exposed buffer");
        return;
    }
    uint32_t stream = p->stream, len = p->len;
    void *buf = p->buf;
    free(p);
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
    want(t);
    return false;
}

/* A header is read: act on it, or set up where its payload goes. Returns
 * false when the read must stop (failed, or waiting for room). */
static bool on_header(struct bex__tcp *t)
{
    struct bex__hdr *h = &t->hdr;
    if (!t->need_buf) {
        if (bex__hdr_decode_frame(t->rhdr, h)) {
            violation(t, "malformed frame header");
            return false;
        }
        if (acked(t, h->credits)) {
            violation(t, "acknowledges messages never sent");
            return false;
        }
        if (t->dead)
            return false;
    }
    t->rhdr_len = 0;
    switch (h->type) {
    case BEX__MSG_CREDIT:
        return true;
    case BEX__MSG_OPEN:
        t->up->on_open(&t->x, h->stream);
        return !t->dead;
    case BEX__MSG_CLOSE: {
        struct part **pp = part_slot(t, h->stream);
        if (*pp) { /* a message the peer cut off */
            struct part *p = *pp;
            *pp = p->next;
            t->parts_n--;
            part_free(t, p);
        }
        struct bex__stream *st = stream_find(t, h->stream);
        if (st)
            st->peer_closed = true;
        t->up->on_peer_close(&t->x, h->stream);
        if (!t->dead && st && stream_find(t, h->stream) == st)
            stream_maybe_end(t, st);
        return !t->dead;
    }
    default:
        break;
    }
    /* DATA or DIRECT: the payload follows */
    struct part **pp = part_slot(t, h->stream);
    struct part *p = *pp;
    bool direct = h->type == BEX__MSG_DIRECT;
    if (!p) {
        if (h->addr != 0) {
            violation(t, "a fragment of a message that never started");
            return false;
        }
        /* one at most per stream, so a peer within its streams stays within
         * this; more is a peer naming streams it never opened */
        if (t->cfg.parts_max && t->parts_n >= t->cfg.parts_max) {
            violation(t, "more messages partly sent at once than it has streams");
            return false;
        }
        if (direct && direct_held(t, h->id)) {
            violation(t, "a second DIRECT message into an exposed buffer still being written");
            return false;
        }
        p = calloc(1, sizeof(*p));
        if (!p) {
            bex__tcp_fail(&t->x, -ENOMEM);
            return false;
        }
        p->stream = h->stream;
        p->direct = direct;
        if (direct) {
            p->token = h->id;
            p->buf = t->up->direct_buf(&t->x, h->id, &p->len);
            if (!p->buf) {
                free(p);
                violation(t, "a DIRECT message names no exposed buffer");
                return false;
            }
        } else {
            if (h->id > t->cfg.max_msg) {
                free(p);
                violation(t, "a message above max_msg");
                return false;
            }
            if (t->part_bytes + h->id > recv_share(t)) {
                free(p);
                return pause_for_room(t, true);
            }
            if (!recv_room(t, h->id)) { /* until the application frees some */
                free(p);
                return pause_for_room(t, false);
            }
            p->len = h->id;
            p->buf = bex_mem_alloc(t->sh->recv_pool, p->len ? p->len : 1);
            if (!p->buf) {
                free(p);
                bex__tcp_fail(&t->x, -ENOMEM);
                return false;
            }
            bex__recv_allocated(t->sh, (int64_t)bex_mem_usable_size(p->buf));
        }
        p->next = *pp;
        *pp = p;
        t->parts_n++;
        if (!direct) {
            t->part_bytes += p->len;
            hold_note(t);
        }
    } else if (p->direct != direct || (direct && p->token != h->id) ||
               (!direct && p->len != h->id) || p->off != h->addr) {
        violation(t, "a fragment that does not continue its message");
        return false;
    }
    t->need_buf = false;
    if (t->rx_paused) {
        t->rx_paused = t->pause_own = false;
        want(t);
    }
    if (h->len > p->len - p->off || (h->len == 0 && p->len != 0)) {
        violation(t, "a fragment beyond its message");
        return false;
    }
    t->cur = p;
    t->cur_left = h->len;
    t->in_payload = true;
    if (h->len == 0) {
        t->in_payload = false;
        part_complete(t, p);
        t->cur = NULL;
        return !t->dead;
    }
    return true;
}

/* Read what the socket has: payloads straight into their buffers, the next
 * header in the same call. At most RX_BUDGET bytes or RX_MSGS messages a
 * call: the application's callbacks run in here, and the loop must get to
 * write (acknowledgements, keepalive) between batches, as it does between
 * CQ polls over RDMA; the descriptor stays readable for the next call. */
#define RX_BUDGET (1u << 20)
#define RX_MSGS   16
void bex__tcp_rx(struct bex__tcp *t)
{
    size_t budget = RX_BUDGET;
    uint64_t msgs0 = t->msgs_in;
    while (!t->dead) {
        if (!budget || t->msgs_in - msgs0 >= RX_MSGS)
            return;
        if (t->need_buf) {
            if (!on_header(t))
                return;
            continue;
        }
        if (t->rx_paused)
            return;
        struct iovec iov[2];
        int n = 0;
        if (t->in_payload) {
            struct part *p = t->cur;
            if (p->direct && !direct_live(t, p)) {
                /* as over RDMA, where its completion names no armed buffer */
                violation(t, "a DIRECT message into a buffer no longer exposed");
                return;
            }
            iov[n++] = (struct iovec){p->buf + p->off, t->cur_left};
        }
        iov[n++] = (struct iovec){t->rhdr + t->rhdr_len, BEX__HDR_LEN - t->rhdr_len};
        ssize_t r = readv(t->fd, iov, n);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            t->link_lost = true;
            bex__tcp_fail(&t->x, r < 0 ? -errno : -ECONNRESET);
            return;
        }
        t->last_rx = bex__now_ms();
        size_t got = (size_t)r;
        budget = got < budget ? budget - got : 0;
        if (t->in_payload) {
            struct part *p = t->cur;
            size_t k = got < t->cur_left ? got : t->cur_left;
            p->off += (uint32_t)k;
            t->part_rx += k;
            t->cur_left -= (uint32_t)k;
            got -= k;
            if (t->cur_left == 0) {
                t->in_payload = false;
                t->cur = NULL;
                if (p->off == p->len) {
                    part_complete(t, p);
                    if (t->dead)
                        return;
                }
            }
        }
        t->rhdr_len += (uint32_t)got;
        if (t->rhdr_len == BEX__HDR_LEN && !on_header(t))
            return;
    }
}

void bex__tcp_events(struct bex__xport *x, uint32_t events)
{
    x = unwrap(x);
    struct bex__tcp *t = tcp_of(x);
    if (t->dead)
        return;
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))
        bex__tcp_rx(t);
    if (!t->dead && events & EPOLLOUT) {
        int err = flush(t);
        if (err) {
            t->link_lost = true;
            bex__tcp_fail(x, err);
        }
    }
    if (!t->dead)
        bex__tcp_progress(x);
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
    struct bex__tcp *t = tcp_of(unwrap(x));
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

void bex__tcp_start(struct bex__xport *x)
{
    struct bex__tcp *t = tcp_of(unwrap(x));
    t->is_up = true;
    t->last_rx = t->last_tx = bex__now_ms();
    t->up->on_up(&t->x);
    if (!t->dead)
        want(t);
}

static void tcp_destroy(struct bex__xport *x)
{
    struct bex__tcp *t = tcp_of(x);
    for (int i = 0; i < PART_HASH; i++) {
        while (t->parts[i]) {
            struct part *p = t->parts[i];
            t->parts[i] = p->next;
            part_free(t, p);
        }
    }
    free(t->ctlq);
    free(t->prefix);
    free(t);
}

static bool tcp_is_up(struct bex__xport *x)
{
    return tcp_of(x)->is_up;
}

static bool tcp_is_dead(struct bex__xport *x)
{
    return tcp_of(x)->dead;
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
    .refuse_stream = tcp_refuse_stream,
    .attach = tcp_attach,
    .send = tcp_send,
    .takes = tcp_takes,
    .close_stream = tcp_close_stream,
    .peer_closed = tcp_peer_closed,
    .progress = bex__tcp_progress,
    .tick = bex__tcp_tick,
    .fail = bex__tcp_fail,
};
