/* SPDX-License-Identifier: Apache-2.0 */
/* fakenet: see fakenet.h. */
#include "rpc/fakenet.h"

#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include "rpc/internal.h"
#include "sock/internal.h"
#include "transport/stream.h"
#include "transport/tcp/tcp.h"
#include "engine_test.h"

#define MAX_RULES 16
#define BIG_MSG   (1u << 20)

struct fn_x {
    struct bex__xport x; /* first: what the sock layer holds */
    struct bex__xport *in;
    const struct bex__transport_upcalls *up; /* the sock layer's */
    struct bex__engine_shared *sh;
    struct bex__loop *loop;
    struct ep_tag *tag;
    int fd;
    uint16_t lport, pport;
    bool no_read, dead;
    _Atomic bool fail_pending;
    /* messages handed to send and not handed back (I/O thread only) */
    struct bex__msg **out;
    uint32_t n_out, cap_out;
    /* TX FN_FAIL_BEFORE: held here until the connection fails */
    struct bex__msg **held;
    uint32_t n_held, cap_held;
    /* TX FN_IN_DOUBT: the message, whether the transport handed it back
     * (held here) and whether its answer came (dropped) */
    struct bex__msg *doubt;
    bool doubt_back, doubt_answered;
    struct fn_x *next; /* every live wrapper (lock) */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct fn_rule rules[MAX_RULES];
static int rule_hits[MAX_RULES];
static int n_rules;
static struct fn_x *all;
static _Atomic uint64_t violations, sent, returned;
static _Atomic int live;
static _Atomic bool partial, framed;

static void violation(const char *what, const struct fn_x *w)
{
    fprintf(stderr, "fakenet: contract violation on :%u -> :%u: %s\n", w->lport, w->pport, what);
    atomic_fetch_add(&violations, 1);
}

static bool push(struct bex__msg ***a, uint32_t *n, uint32_t *cap, struct bex__msg *m)
{
    if (*n == *cap) {
        uint32_t c = *cap ? *cap * 2 : 64;
        struct bex__msg **p = realloc(*a, c * sizeof(*p));
        if (!p)
            return false;
        *a = p;
        *cap = c;
    }
    (*a)[(*n)++] = m;
    return true;
}

static bool take(struct bex__msg **a, uint32_t *n, struct bex__msg *m)
{
    for (uint32_t i = 0; i < *n; i++) {
        if (a[i] == m) {
            a[i] = a[--*n];
            return true;
        }
    }
    return false;
}

/* The RPC kind of a message (0: not a well-formed RPC message). */
static int rpc_kind(const void *buf, size_t len)
{
    struct bex__rpc_hdr h;
    const char *why;
    if (!buf || bex__rpc_hdr_decode(buf, len, &h, &why))
        return 0;
    if (h.kind == BEX__RPC_REQUEST && h.service == BEX_RPC_SERVICE_PING)
        return FN_PING;
    return h.kind;
}

static bool conn_matches(const struct fn_rule *r, const struct fn_x *w)
{
    if (r->sh && r->sh != (const void *)w->sh)
        return false;
    return r->side == FN_CLIENT ? w->pport == r->port : w->lport == r->port;
}

/* The action of the first live rule for this message, spending one use. */
static int match(struct fn_x *w, int dir, int kind)
{
    int action = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_rules && !action; i++) {
        struct fn_rule *r = &rules[i];
        if (r->count == 0 || r->action == FN_NO_READ || r->action == FN_SMALL_BUF ||
            r->dir != dir || !conn_matches(r, w) || (r->kind && r->kind != kind) || !kind)
            continue;
        if (r->count > 0)
            r->count--;
        rule_hits[i]++;
        action = r->action;
    }
    pthread_mutex_unlock(&lock);
    return action;
}

static bool no_read_rule(struct fn_x *w)
{
    bool yes = false;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_rules; i++) {
        if (rules[i].action == FN_NO_READ && rules[i].count != 0 && conn_matches(&rules[i], w)) {
            if (!w->no_read)
                rule_hits[i]++;
            yes = true;
        }
    }
    pthread_mutex_unlock(&lock);
    return yes;
}

static struct fn_x *of(struct bex__xport *x)
{
    return (struct fn_x *)x;
}

/* Take EPOLLIN away (level-triggered: nothing more is read, but the peer's
 * close still wakes the connection). The TCP transport caches what it
 * asked for and only changes it when that changes, so this holds until it
 * wants to write with the socket full; the tick puts it back. */
static void stop_reading(struct fn_x *w)
{
    w->no_read = true;
    bex__loop_modify(w->loop, w->fd, EPOLLRDHUP, w->tag);
}

/* Fail the connection now (its thread): held messages come back first, as
 * never sent, then the TCP transport hands back its own and reports. */
static void doubt_hand_back(struct fn_x *w)
{
    struct bex__msg *m = w->doubt;
    w->doubt = NULL;
    if (!take(w->out, &w->n_out, m))
        violation("in-doubt message not outstanding", w);
    atomic_fetch_add(&returned, 1);
    w->up->on_send_done(&w->x, m, -EIO);
}

static void fail_now(struct fn_x *w, int err)
{
    atomic_store(&w->fail_pending, false);
    if (w->doubt && w->doubt_back)
        doubt_hand_back(w);
    while (w->n_held) {
        struct bex__msg *m = w->held[--w->n_held];
        if (!take(w->out, &w->n_out, m))
            violation("held message not outstanding", w);
        atomic_fetch_add(&returned, 1);
        w->up->on_send_done(&w->x, m, -ECANCELED);
    }
    w->in->ops->fail(w->in, err);
}

static void watch_partial(struct fn_x *w)
{
    for (uint32_t i = 0; i < w->n_out; i++) {
        struct bex__msg *m = w->out[i];
        if (m->len >= BIG_MSG && m->off > 0 && m->off < m->len)
            atomic_store(&partial, true);
        if (m->len >= BIG_MSG && m->off == m->len)
            atomic_store(&framed, true);
    }
}

/* ---------------- upcalls from the TCP transport ---------------- */

static void up_on_up(struct bex__xport *in)
{
    struct fn_x *w = in->user;
    if (no_read_rule(w))
        stop_reading(w);
    w->up->on_up(&w->x);
}

static void up_on_msg(struct bex__xport *in, uint32_t stream, void *buf, size_t len)
{
    struct fn_x *w = in->user;
    if (w->doubt && !w->doubt_answered) {
        /* the answer to the in-doubt message: lost with the connection */
        bex_mem_free(buf);
        w->doubt_answered = true;
        if (w->doubt_back)
            fail_now(w, -ECONNRESET);
        return;
    }
    switch (match(w, FN_RX, rpc_kind(buf, len))) {
    case FN_DROP:
        bex_mem_free(buf);
        return;
    case FN_FAIL_BEFORE:
        bex_mem_free(buf);
        fail_now(w, -ECONNRESET);
        return;
    case FN_FAIL_AFTER:
        w->up->on_msg(&w->x, stream, buf, len);
        if (!w->in->ops->is_dead(w->in))
            fail_now(w, -ECONNRESET);
        return;
    default:
        w->up->on_msg(&w->x, stream, buf, len);
    }
}

static void up_on_open(struct bex__xport *in, uint32_t stream)
{
    struct fn_x *w = in->user;
    w->up->on_open(&w->x, stream);
}

static void up_on_peer_close(struct bex__xport *in, uint32_t stream)
{
    struct fn_x *w = in->user;
    w->up->on_peer_close(&w->x, stream);
}

static void up_on_send_done(struct bex__xport *in, struct bex__msg *m, int status)
{
    struct fn_x *w = in->user;
    if (m == w->doubt && status == 0) {
        /* held until its answer comes (then -EIO) */
        w->doubt_back = true;
        if (w->doubt_answered)
            atomic_store(&w->fail_pending, true);
        return;
    }
    if (m == w->doubt)
        w->doubt = NULL; /* not sent after all: as it is */
    if (!take(w->out, &w->n_out, m))
        violation("message handed back twice, or never handed to send", w);
    atomic_fetch_add(&returned, 1);
    w->up->on_send_done(&w->x, m, status);
}

static void up_on_stream_closed(struct bex__xport *in, struct bex__stream *st)
{
    struct fn_x *w = in->user;
    w->up->on_stream_closed(&w->x, st);
}

static int up_on_direct(struct bex__xport *in, uint32_t imm)
{
    struct fn_x *w = in->user;
    return w->up->on_direct(&w->x, imm);
}

static void *up_direct_buf(struct bex__xport *in, uint32_t token, uint32_t *len)
{
    struct fn_x *w = in->user;
    return w->up->direct_buf(&w->x, token, len);
}

static void up_on_fail(struct bex__xport *in, int err)
{
    struct fn_x *w = in->user;
    w->dead = true;
    if (w->doubt && w->doubt_back)
        doubt_hand_back(w); /* failed before its answer came: in doubt all the same */
    if (w->n_held)
        violation("held messages at on_fail", w);
    if (w->n_out)
        violation("on_fail with messages not handed back", w);
    w->up->on_fail(&w->x, err);
}

static const struct bex__transport_upcalls fn_up = {BEX_TEST_UP_ON, .direct_buf = up_direct_buf};

/* ---------------- ops, forwarded ---------------- */

static void x_destroy(struct bex__xport *x)
{
    struct fn_x *w = of(x);
    if (w->n_out || w->n_held)
        violation("destroyed with messages not handed back", w);
    w->in->ops->destroy(w->in);
    pthread_mutex_lock(&lock);
    for (struct fn_x **p = &all; *p; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    atomic_fetch_sub(&live, 1);
    free(w->out);
    free(w->held);
    free(w);
}

static bool x_is_up(struct bex__xport *x)
{
    return of(x)->in->ops->is_up(of(x)->in);
}

static bool x_is_dead(struct bex__xport *x)
{
    return of(x)->in->ops->is_dead(of(x)->in);
}

static uint32_t x_peer_max_msg(struct bex__xport *x)
{
    return of(x)->in->ops->peer_max_msg(of(x)->in);
}

static int x_refuse_stream(struct bex__xport *x, uint32_t id)
{
    return of(x)->in->ops->refuse_stream(of(x)->in, id);
}

static void x_attach(struct bex__xport *x, struct bex__stream *st, uint32_t id, bool client)
{
    of(x)->in->ops->attach(of(x)->in, st, id, client);
}

static void x_send(struct bex__xport *x, struct bex__stream *st, struct bex__msg *m)
{
    struct fn_x *w = of(x);
    atomic_fetch_add(&sent, 1);
    for (uint32_t i = 0; i < w->n_out; i++)
        if (w->out[i] == m)
            violation("message handed to send twice", w);
    if (!push(&w->out, &w->n_out, &w->cap_out, m)) {
        violation("out of memory", w);
        return;
    }
    switch (match(w, FN_TX, rpc_kind(m->buf, m->len))) {
    case FN_FAIL_BEFORE:
        if (push(&w->held, &w->n_held, &w->cap_held, m)) {
            /* the stream is the transport's: it still knows nothing of m */
            m->st = st;
            atomic_store(&w->fail_pending, true);
            return;
        }
        violation("out of memory", w);
        break;
    case FN_IN_DOUBT:
        if (!w->doubt) {
            w->doubt = m;
            w->doubt_back = w->doubt_answered = false;
        }
        break;
    case FN_GARBLE:
        if (m->len >= 2)
            ((uint8_t *)m->buf)[0] ^= 0xff;
        break;
    default:
        break;
    }
    w->in->ops->send(w->in, st, m);
}

/* The inner transport (TCP) refuses what bex__tcp_send_now refuses, asked
 * through its ops before this wrapper records anything of m: a dead
 * transport, a stream not open, a message over the peer's limit. */
static struct bex__msg *x_send_now(struct bex__stream *st, struct bex__msg *m, struct bex__xport *x)
{
    struct fn_x *w = of(x);
    if (w->in->ops->is_dead(w->in) || !bex__stream_open(st) ||
        (!m->direct && m->len > w->in->ops->peer_max_msg(w->in)))
        return m;
    x_send(x, st, m);
    return NULL;
}

static void x_close_stream(struct bex__xport *x, struct bex__stream *st)
{
    of(x)->in->ops->close_stream(of(x)->in, st);
}

static void x_peer_closed(struct bex__xport *x, struct bex__stream *st)
{
    of(x)->in->ops->peer_closed(of(x)->in, st);
}

static bool x_progress(struct bex__xport *x)
{
    struct fn_x *w = of(x);
    if (atomic_load(&w->fail_pending) && !w->in->ops->is_dead(w->in)) {
        fail_now(w, -ECONNRESET);
        return true;
    }
    bool did = w->in->ops->progress(w->in);
    if (w->pport)
        watch_partial(w);
    return did;
}

static unsigned x_tick(struct bex__xport *x, uint64_t now_ms)
{
    struct fn_x *w = of(x);
    if (atomic_load(&w->fail_pending) && !w->in->ops->is_dead(w->in)) {
        fail_now(w, -ECONNRESET);
        return BEX__TICK_PROGRESS | BEX__TICK_SOON;
    }
    if (w->no_read && !w->in->ops->is_dead(w->in))
        stop_reading(w);
    w->in->ops->tick(w->in, now_ms);
    if (w->pport && !w->in->ops->is_dead(w->in))
        watch_partial(w);
    /* the wrapper's own doings need a look every tick period */
    return BEX__TICK_PROGRESS | BEX__TICK_SOON;
}

static void x_fail(struct bex__xport *x, int err)
{
    struct fn_x *w = of(x);
    if (w->in->ops->is_dead(w->in))
        return;
    fail_now(w, err);
}

static struct bex__xport *x_inner(struct bex__xport *x)
{
    return of(x)->in;
}

static const struct bex__transport_ops fn_ops = {
    .name = "fakenet",
    .destroy = x_destroy,
    .is_up = x_is_up,
    .is_dead = x_is_dead,
    .peer_max_msg = x_peer_max_msg,
    .refuse_stream = x_refuse_stream,
    .attach = x_attach,
    .send = x_send,
    .send_now = x_send_now,
    .close_stream = x_close_stream,
    .peer_closed = x_peer_closed,
    .progress = x_progress,
    .tick = x_tick,
    .fail = x_fail,
    .inner = x_inner,
};

/* ---------------- the hook ---------------- */

static uint16_t port_of(int fd, bool peer)
{
    struct sockaddr_in a;
    socklen_t l = sizeof a;
    int rc = peer ? getpeername(fd, (struct sockaddr *)&a, &l)
                  : getsockname(fd, (struct sockaddr *)&a, &l);
    return rc ? 0 : ntohs(a.sin_port);
}

static struct bex__xport *wrap(void *arg, struct bex__engine_shared *sh,
                               const struct bex__tcp_config *cfg, int fd, struct bex__loop *loop,
                               struct ep_tag *tag, const struct bex__transport_upcalls *up,
                               void *user, const struct bex__transport_upcalls **iup, void **iuser)
{
    (void)arg;
    (void)cfg;
    struct fn_x *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    w->x.ops = &fn_ops;
    w->x.user = user;
    w->up = up;
    w->sh = sh;
    w->loop = loop;
    w->tag = tag;
    w->fd = fd;
    w->lport = port_of(fd, false);
    w->pport = port_of(fd, true);
    *iup = &fn_up;
    *iuser = w;
    return &w->x;
}

static void made(struct bex__xport *outer, struct bex__xport *inner)
{
    struct fn_x *w = of(outer);
    if (!inner) {
        free(w);
        return;
    }
    w->in = inner;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_rules; i++) {
        if (rules[i].action == FN_SMALL_BUF && conn_matches(&rules[i], w)) {
            int sz = 32 << 10;
            setsockopt(w->fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
            setsockopt(w->fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
            rule_hits[i]++;
        }
    }
    w->next = all;
    all = w;
    pthread_mutex_unlock(&lock);
    atomic_fetch_add(&live, 1);
}

static const struct bex__tcp_wrap hook = {.wrap = wrap, .made = made};

void fn_install(void)
{
    atomic_store(&bex__tcp_wrap_test, &hook);
}

void fn_uninstall(void)
{
    atomic_store(&bex__tcp_wrap_test, NULL);
    fn_clear();
}

int fn_add(const struct fn_rule *r)
{
    pthread_mutex_lock(&lock);
    int i = n_rules < MAX_RULES ? n_rules++ : -1;
    if (i >= 0) {
        rules[i] = *r;
        rule_hits[i] = 0;
    }
    pthread_mutex_unlock(&lock);
    if (i < 0) {
        fprintf(stderr, "fakenet: too many rules\n");
        exit(1);
    }
    return i;
}

void fn_clear(void)
{
    pthread_mutex_lock(&lock);
    n_rules = 0;
    pthread_mutex_unlock(&lock);
}

int fn_hits(int i)
{
    pthread_mutex_lock(&lock);
    int h = rule_hits[i];
    pthread_mutex_unlock(&lock);
    return h;
}

int fn_fail_conns(int side, uint16_t port)
{
    int n = 0;
    struct fn_rule r = {.side = side, .port = port};
    pthread_mutex_lock(&lock);
    for (struct fn_x *w = all; w; w = w->next) {
        if (conn_matches(&r, w)) {
            atomic_store(&w->fail_pending, true);
            n++;
        }
    }
    pthread_mutex_unlock(&lock);
    return n;
}

const void *fn_sh(bex_ctx *ctx)
{
    return &ctx->io[0].sh;
}

uint64_t fn_violations(void)
{
    return atomic_load(&violations);
}

uint64_t fn_sent(void)
{
    return atomic_load(&sent);
}

uint64_t fn_returned(void)
{
    return atomic_load(&returned);
}

int fn_live(void)
{
    return atomic_load(&live);
}

bool fn_partial_seen(void)
{
    return atomic_load(&partial);
}

bool fn_framed_seen(void)
{
    return atomic_load(&framed);
}
