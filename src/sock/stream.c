/* SPDX-License-Identifier: Apache-2.0 */
/* Socket lifecycle on the I/O thread, and the transports' upcalls. */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>

#include "sock/internal.h"

const char *bex__sock_state_name(int st)
{
    static const char *const names[] = {
        [S_CONNECTING] = "CONNECTING", [S_OPEN] = "OPEN", [S_FAILED] = "FAILED"};
    return (unsigned)st < ARRAY_SIZE(names) ? names[st] : "?";
}

void bex__sock_set_state(struct bex_sock *s, enum bex__sock_state to)
{
    int from = atomic_load_explicit(&s->state, memory_order_relaxed);
    assert((from == S_CONNECTING && (to == S_OPEN || to == S_FAILED)) ||
           (from == S_OPEN && to == S_FAILED));
    if (s->ctx->log.level >= BEX_LOG_DEBUG)
        bex__log(&s->ctx->log, BEX_LOG_DEBUG, "socket %u (engine %u): %s -> %s", s->id,
                 atomic_load(&s->eng_id), bex__sock_state_name(from), bex__sock_state_name(to));
    atomic_store(&s->state, (int)to);
}

const char *bex__sock_life_name(enum bex__sock_life life)
{
    static const char *const names[] = {
        [SK_IDLE] = "IDLE",   [SK_ATTACHED] = "ATTACHED",        [SK_DEAD] = "DEAD",
        [SK_DYING] = "DYING", [SK_IDLE_CLOSED] = "IDLE_CLOSED",  [SK_CLOSING] = "CLOSING",
        [SK_DONE] = "DONE",   [SK_DYING_CLOSED] = "DYING_CLOSED"};
    return (unsigned)life < ARRAY_SIZE(names) ? names[life] : "?";
}

/* The state ev leads to from s's (its one bit set or cleared); *legal:
 * whether s's state allows ev. */
static unsigned life_after(unsigned from, enum bex__sock_event ev, bool *legal)
{
    switch (ev) {
    case SK_EV_ATTACH: /* a live stream on no transport */
        *legal = !(from & (SK_BIT_ATTACHED | SK_BIT_DEAD));
        return from | SK_BIT_ATTACHED;
    case SK_EV_LET_GO:
        *legal = from & SK_BIT_ATTACHED;
        return from & ~SK_BIT_ATTACHED;
    case SK_EV_DIE:
        *legal = !(from & SK_BIT_DEAD);
        return from | SK_BIT_DEAD;
    case SK_EV_CLOSE:
        *legal = !(from & SK_BIT_CLOSED);
        return from | SK_BIT_CLOSED;
    }
    *legal = false;
    return from;
}

static const char *const event_names[] = {[SK_EV_ATTACH] = "attach",
                                          [SK_EV_LET_GO] = "let go",
                                          [SK_EV_DIE] = "die",
                                          [SK_EV_CLOSE] = "close"};

static void life_set(struct bex_sock *s, enum bex__sock_event ev, unsigned to)
{
    if (s->ctx->log.level >= BEX_LOG_DEBUG)
        bex__log(&s->ctx->log, BEX_LOG_DEBUG, "socket %u (engine %u): %s: %s -> %s", s->id,
                 atomic_load(&s->eng_id), event_names[ev], bex__sock_life_name(s->life),
                 bex__sock_life_name((enum bex__sock_life)to));
    s->life = (enum bex__sock_life)to;
}

bool bex__sock_try_move(struct bex_sock *s, enum bex__sock_event ev)
{
    bool legal;
    unsigned to = life_after(s->life, ev, &legal);
    if (legal)
        life_set(s, ev, to);
    return legal;
}

/* Without asserts (NDEBUG) an illegal move still sets or clears its bit,
 * as the booleans it replaced did. */
void bex__sock_move(struct bex_sock *s, enum bex__sock_event ev)
{
    bool legal;
    unsigned to = life_after(s->life, ev, &legal);
    assert(legal && "an illegal socket move of our own");
    life_set(s, ev, to);
}

/* Hand a buffer back to the application; without an on_send_done nobody
 * would ever free it, so bex does. */
void bex__sock_report_done(struct bex_sock *s, void *buf, size_t len, void *msg_user, int status)
{
    if (s->ops.on_send_done)
        s->ops.on_send_done(s, buf, len, msg_user, status, s->user);
    else
        bex_mem_free(buf);
}

/* Free the socket once the application closed it, the engine let go of it
 * and every message was reported; exposed buffers not delivered come back
 * before on_close. */
void bex__sock_maybe_finish(struct bex_sock *s)
{
    if (!bex__sock_app_closed(s) || bex__sock_attached(s) || s->pending || s->close_reported)
        return;
    s->close_reported = true;
    if (!bex__sock_dead(s))
        bex__sock_move(s, SK_EV_DIE);
    bex__exposed_cancel(s);
    if (s->conn)
        bex__conn_stream_del(s->conn, s->id);
    s->conn = NULL;
    if (s->ops.on_close)
        s->ops.on_close(s, s->user);
    free(s);
}

/* The socket can carry no more traffic: tell the application once (unless
 * it closed the socket already). The engine has let go of the stream (on_fail)
 * or is closing it (the peer's CLOSE); either way the peer writes nothing
 * more into its exposed buffers, which come back now. */
void bex__sock_fail(struct bex_sock *s, int err, bool connecting)
{
    /* the reason first: a sender that finds the socket failed
     * (-EPIPE) can read why (bex_sock_last_error) */
    if (!atomic_load_explicit(&s->last_err, memory_order_relaxed)) {
        atomic_store(&s->last_connecting, connecting);
        atomic_store(&s->last_err, err);
    }
    if (!bex__sock_dead(s)) {
        bex__sock_move(s, SK_EV_DIE);
        bex__sock_set_state(s, S_FAILED);
        bex__exposed_cancel(s);
    }
    if (!s->error_told && !bex__sock_app_closed(s)) {
        s->error_told = true;
        if (connecting) {
            if (s->ops.on_connect)
                s->ops.on_connect(s, err, s->user);
        } else if (s->ops.on_error) {
            s->ops.on_error(s, err, s->user);
        }
    }
    bex__sock_maybe_finish(s);
}

/* The next socket of c's stream table (it = BEX__HMAP_ITER_INIT first),
 * or NULL. The body may remove the socket it was given, and nothing else. */
static struct bex_sock *next_sock(struct conn *c, struct bex__hmap_iter *it)
{
    return bex__sock_of(bex__hmap_next(&c->streams, it, NULL));
}

static void conn_up(struct conn *c, struct bex__xport *x)
{
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    for (struct bex_sock *s; (s = next_sock(c, &it));) {
        atomic_store(&s->max_msg, bex__sock_peer_limit(x->ops->peer_max_msg(x)));
        if (atomic_load(&s->state) != S_CONNECTING)
            continue; /* open already, or failed */
        bex__sock_set_state(s, S_OPEN);
        if (!bex__sock_app_closed(s) && s->ops.on_connect)
            s->ops.on_connect(s, 0, s->user);
    }
}

/* The connection is finished: every socket on it learns the error; the
 * engine already handed their messages back. */
static void conn_down(struct conn *c, int err, bool connecting)
{
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    for (struct bex_sock *s; (s = next_sock(c, &it));) {
        if (s->waiting)
            bex__sock_drop_waiting(s);
        if (bex__sock_attached(s))
            bex__sock_move(s, SK_EV_LET_GO); /* the engine let go */
        bex__sock_fail(s, err, connecting && atomic_load(&s->state) == S_CONNECTING);
    }
}

static uint32_t conn_open_streams(struct conn *c)
{
    uint32_t open = 0;
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    for (struct bex_sock *s; (s = next_sock(c, &it));)
        open += !bex__sock_dead(s);
    return open;
}

/* Whether s takes received messages: live, not closed, with an on_recv. */
static inline bool sock_takes_recv(const struct bex_sock *s)
{
    return !(s->life & (SK_BIT_DEAD | SK_BIT_CLOSED)) && s->ops.on_recv;
}

/* on_msg's other cases: another stream than the one found last, or a
 * socket that takes no more messages. */
static __attribute__((noinline)) void on_msg_slow(struct conn *c, uint32_t stream, void *buf,
                                                  size_t len)
{
    struct bex_sock *s = bex__sock_of(bex__conn_stream_find(c, stream));
    if (!s || !sock_takes_recv(s)) {
        bex_mem_free(buf); /* the socket is gone: nobody to give it to */
        return;
    }
    s->ops.on_recv(s, buf, len, s->user);
}

/* The stream bex__conn_stream_find found last first, as it does, but here:
 * then on_msg saves no registers and both its calls are tail calls (it was
 * 29 instructions a message, issue 25 item 2). */
static void on_msg(struct bex__xport *x, uint32_t stream, void *buf, size_t len)
{
    struct conn *c = x->user;
    struct bex__stream *st = c->last_st;
    if (__builtin_expect(st != NULL && c->last_id == stream, 1)) {
        struct bex_sock *s = bex__sock_of(st);
        if (__builtin_expect(sock_takes_recv(s), 1)) {
            s->ops.on_recv(s, buf, len, s->user);
            return;
        }
    }
    on_msg_slow(c, stream, buf, len);
}

static void on_open(struct bex__xport *x, uint32_t stream)
{
    struct conn *c = x->user;
    struct bex_sock *s = bex__sock_of(bex__conn_stream_find(c, stream));
    if (s || c->client) {
        char name[BEX__CONN_NAME_LEN];
        bex__log(&c->ctx->log, BEX_LOG_ERROR, "%s (engine %u): unexpected OPEN of stream %u",
                 bex__conn_name(c, name), c->eng_id, stream);
        bex__conn_fail(c, -EPROTO);
        return;
    }
    /* The peer's first frames may overtake its readiness notice, which
     * comes over TCP (test_early_data_rxe): they show that it chose RDMA,
     * so the engine is the transport from here on, and answers to them
     * go out through it (the notice, when it comes, starts the engine). */
    if (!c->x)
        c->x = x;
    if (bex__conn_nstreams(c) >= c->ctx->cfg.streams_max) {
        /* the peer's socket fails; nothing is allocated for it here */
        /* INFO: refusing a stream is flow control; should the peer go on
         * regardless, the engine fails with the one WARN/ERROR line that
         * names it */
        char name[BEX__CONN_NAME_LEN];
        bex__log_once(&c->ctx->log, &c->said, CONN_SAID_REFUSAL, BEX_LOG_INFO,
                      "%s (engine %u): opens more than %u streams on one connection; "
                      "refusing them (logged once per connection)",
                      bex__conn_name(c, name), c->eng_id, c->ctx->cfg.streams_max);
        if (x->ops->refuse_stream(x, stream))
            bex__conn_fail(c, -EPROTO);
        return;
    }
    s = calloc(1, sizeof(*s));
    if (!s) {
        bex__conn_fail(c, -ENOMEM);
        return;
    }
    s->ctx = c->ctx;
    s->io = c->io;
    s->conn = c;
    s->id = stream;
    s->peer = c->key; /* bex_sock_last_error names it */
    atomic_init(&s->state, S_OPEN);
    atomic_init(&s->closing, false);
    atomic_init(&s->user_pub, NULL);
    atomic_init(&s->max_msg, bex__sock_peer_limit(x->ops->peer_max_msg(x)));
    if (bex__conn_stream_add(c, stream, &s->st)) {
        free(s);
        bex__conn_fail(c, -ENOMEM);
        return;
    }
    x->ops->attach(x, &s->st, stream, false);
    bex__sock_move(s, SK_EV_ATTACH);
    atomic_init(&s->eng_id, c->eng_id);
    struct bex_listener *l = c->l;
    if (l && l->ops.on_accept)
        l->ops.on_accept(l, s, l->user);
    else
        bex_sock_close(s);
}

static void on_peer_close(struct bex__xport *x, uint32_t stream)
{
    struct conn *c = x->user;
    struct bex_sock *s = bex__sock_of(bex__conn_stream_find(c, stream));
    if (!s)
        return;
    /* the engine hands back what it held first (on_error says so); the
     * extra count keeps s alive should the stream finish meanwhile */
    s->pending++;
    if (bex__sock_attached(s))
        x->ops->peer_closed(x, &s->st);
    s->pending--;
    bex__sock_fail(s, -ECONNRESET, false);
}

/* on_send_done's every case: the descriptor back, the report, and the
 * socket freed if that was the last thing it waited for. */
static __attribute__((noinline)) void send_done_slow(struct sock_msg *w, int status)
{
    struct bex_sock *s = w->s;
    s->pending--;
    /* the descriptor goes back first: a caller's bex_send_req is the
     * caller's again in on_send_done, and a send from the callback reuses it */
    void *buf = w->m.buf, *user = w->m.user;
    size_t len = w->m.len;
    bex__sock_msg_put(w);
    bex__sock_report_done(s, buf, len, user, status);
    bex__sock_maybe_finish(s);
}

/* The common case inline, in a frame that saves no registers: a socket
 * the application has not closed has nothing to finish after the report,
 * which cannot close it (SK_BIT_CLOSED is set by the close command,
 * bex__sock_drain_cmds, which the loop runs between upcalls, never inside
 * one), so on_send_done is a tail call; a descriptor of bex's goes back to
 * a cache with room (42 instructions a message with the call and
 * bex__sock_maybe_finish after it, issue 25 item 2). */
static void on_send_done(struct bex__xport *x, struct bex__msg *m, int status)
{
    (void)x;
    struct sock_msg *w = bex__container_of(m, struct sock_msg, m);
    struct bex_sock *s = w->s;
    struct bex__io *io = s->io;
    if (__builtin_expect(bex__sock_app_closed(s) || !s->ops.on_send_done || w->gathered ||
                             (!w->caller_owned && io->n_msg_free >= BEX__MSG_CACHE_MAX),
                         0)) {
        send_done_slow(w, status);
        return;
    }
    s->pending--;
    /* the descriptor back before the report's arguments are loaded (its
     * fields are not those the cache writes): the push then needs no
     * register the six arguments take, and the frame saves none (two
     * pushes and pops a message before, issue 25 item 2) */
    if (!w->caller_owned) { /* bex__sock_msg_put's case of a cache with room */
        w->free_next = io->msg_free;
        io->msg_free = w;
        io->n_msg_free++;
    }
    s->ops.on_send_done(s, m->buf, m->len, m->user, status, s->user);
}

static void on_stream_closed(struct bex__xport *x, struct bex__stream *st)
{
    struct bex_sock *s = bex__container_of(st, struct bex_sock, st);
    /* the end of a stream (the peer's answer to our CLOSE, or its own
     * CLOSE): the transport names only streams it holds */
    if (!bex__sock_try_move(s, SK_EV_LET_GO)) {
        struct conn *c = x->user;
        char name[32];
        if (!bex__conn_dead(c))
            bex__log(&c->ctx->log, BEX_LOG_WARN,
                     "%s (engine %u): stream %u ended twice (socket %s)", bex__conn_name(c, name),
                     c->eng_id, s->id, bex__sock_life_name(s->life));
        bex__conn_fail(c, -EPROTO);
        return;
    }
    if (!bex__sock_dead(s))
        bex__sock_move(s, SK_EV_DIE);
    bex__sock_maybe_finish(s);
}

/* c's transport is chosen: the sockets that waited for it attach, their
 * queued sends and closes go to it. */
static void conn_chosen(struct conn *c)
{
    struct bex__xport *x = c->x;
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    for (struct bex_sock *s; (s = next_sock(c, &it));) {
        if (!s->waiting)
            continue;
        s->waiting = false;
        x->ops->attach(x, &s->st, s->id, true);
        bex__sock_move(s, SK_EV_ATTACH);
        atomic_store(&s->eng_id, c->eng_id);
        while (s->wq_head) {
            struct sock_msg *w = s->wq_head;
            s->wq_head = w->m.next ? bex__container_of(w->m.next, struct sock_msg, m) : NULL;
            x->ops->send(x, &s->st, &w->m); /* counted in pending already */
        }
        s->wq_tail = NULL;
        if (bex__sock_app_closed(s))
            x->ops->close_stream(x, &s->st);
    }
}

void bex__sock_drop_waiting(struct bex_sock *s)
{
    s->waiting = false;
    s->pending++; /* s stays while its sends are reported */
    while (s->wq_head) {
        struct sock_msg *w = s->wq_head;
        s->wq_head = w->m.next ? bex__container_of(w->m.next, struct sock_msg, m) : NULL;
        s->pending--;
        void *buf = w->m.buf, *user = w->m.user;
        size_t len = w->m.len;
        bex__sock_msg_put(w);
        bex__sock_report_done(s, buf, len, user, -ECANCELED);
    }
    s->wq_tail = NULL;
    s->pending--;
}

/* on_up and on_fail are the connection's (conn_up and conn_down below,
 * through conn). */
static const struct bex__transport_upcalls sock_upcalls = {
    .on_msg = on_msg,
    .on_open = on_open,
    .on_peer_close = on_peer_close,
    .on_send_done = on_send_done,
    .on_stream_closed = on_stream_closed,
    .on_direct = bex__exposed_deliver,
    .direct_buf = bex__exposed_buf,
};

const struct bex__conn_owner_ops bex__sock_conn_ops = {
    .stream_upcalls = &sock_upcalls,
    .up = conn_up,
    .chosen = conn_chosen,
    .down = conn_down,
    .open_streams = conn_open_streams,
    .drain_cmds = bex__sock_drain_cmds,
};
