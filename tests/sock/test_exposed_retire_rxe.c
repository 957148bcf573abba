/* SPDX-License-Identifier: Apache-2.0 */
/* The retire path of exposed buffers in window mode (issue 7 part 1), on
 * rxe, two processes (see pair.h).
 *
 * An exposed buffer is reachable through a type-2 window bound on its
 * engine's QP. When the exposure ends the window is retired
 * (bex__engine_retire_window): a LOCAL_INV on that QP if it is bound and the
 * engine alive, then the window is deallocated; on a dead engine the window
 * went with the QP already; a window never bound is only deallocated (an
 * invalidation of an unbound window panics rxe's kernel). Each case ends
 * one exposure one way and then has the peer write through the old token
 * (bex_sock_send_direct with the same bex_remote_buf, on the same QP): the
 * peer's NIC reports a remote access error (the writer's socket fails with
 * -EACCES, its send comes back -EIO or -EACCES) and the buffer's bytes do
 * not change.
 *
 *   delivered     a genuine write is delivered (the window is retired
 *                 before the buffer goes up); a second write with the token
 *   released      the application closes the exposing socket; the buffer
 *                 comes back -ECANCELED; a write with its token through
 *                 another socket of the same engine (so the same QP), after
 *                 a genuine write through a second exposure still works
 *   dead_engine   the engine dies (the peer's NIC refused a forged key) with
 *                 a bound window: the buffer comes back -ECANCELED once, no
 *                 invalidation is posted (the window went with the QP), and
 *                 the server's other engine goes on
 *   never_bound   an exposure whose socket's peer closes before its bind
 *                 command ran: the window is deallocated unbound (checked:
 *                 the slot's bound flag when it was taken back)
 *
 * The server checks at the end that every exposed buffer either holds the
 * genuine write's bytes (delivered) or its initial fill (handed back), and
 * that each was reported exactly once. With the LOCAL_INV of
 * bex__engine_retire_window left out, delivered and released fail (the
 * stale write lands); see docs/testing.md. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "pair.h"

#define EXP_LEN     8192
#define FILL_SEED   5    /* an exposed buffer's bytes until a genuine write */
#define DIRECT_SEED 91   /* a genuine write */
#define STALE_SEED  4242 /* a write through a retired token */
#define MAX_XB      32
#define MAX_SOCKS   32

/* ---------------- the server ---------------- */

/* The server's answers and the client's commands: one tag byte, then a
 * struct reply. */
struct reply {
    uint8_t tag;         /* 'T' ticket, 'A' delivered, 'C' handed back */
    uint8_t never_bound; /* 'C': the window was never bound (see above) */
    uint16_t xb;         /* the exposure */
    bex_remote_buf rb;   /* 'T' */
};

struct xb {
    uint8_t *buf;
    bex_sock *s;
    uint32_t slot; /* its slot of the context's exposed table */
    _Atomic int reports;
    int status;
    bool delivered;
};

static struct srv {
    bex_ctx *ctx;
    struct xb xb[MAX_XB];
    _Atomic long nxb;
    bex_sock *socks[MAX_SOCKS]; /* in accept order */
    _Atomic long nsocks;
    bex_sock *notify; /* where handed-back exposures are told */
    _Atomic long errors, bad, never_bound;
} g_srv;

static void srv_bad(const char *why)
{
    fprintf(stderr, "server: %s\n", why);
    atomic_fetch_add(&g_srv.bad, 1);
}

static void srv_reply(bex_sock *s, const struct reply *r)
{
    struct reply *b = bex_sock_alloc(g_srv.ctx, sizeof(*b));
    CHECK(b);
    *b = *r;
    if (bex_sock_send(s, b, sizeof(*b), NULL))
        bex_mem_free(b);
}

static int xb_of(const void *buf)
{
    for (long i = 0; i < atomic_load(&g_srv.nxb); i++)
        if (g_srv.xb[i].buf == buf)
            return (int)i;
    return -1;
}

/* Expose a fresh buffer, filled with FILL_SEED, on s. */
static int srv_expose(bex_sock *s, bex_remote_buf *rb)
{
    long i = atomic_load(&g_srv.nxb);
    CHECK(i < MAX_XB);
    struct xb *x = &g_srv.xb[i];
    x->buf = bex_sock_alloc_exposable(g_srv.ctx, EXP_LEN);
    CHECK(x->buf);
    fill_pattern(x->buf, EXP_LEN, FILL_SEED);
    x->s = s;
    atomic_store(&g_srv.nxb, i + 1);
    CHECK_OK(bex_sock_expose(s, x->buf, EXP_LEN, NULL, rb));
    x->slot = rb->token & 0xffff;
    return (int)i;
}

static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)user;
    int i = xb_of(buf);
    if (i >= 0) { /* a genuine write delivered: held to the end */
        struct xb *x = &g_srv.xb[i];
        if (atomic_fetch_add(&x->reports, 1))
            srv_bad("an exposed buffer reported twice");
        x->delivered = true;
        if (len != EXP_LEN || check_pattern(buf, EXP_LEN, DIRECT_SEED))
            srv_bad("a delivered buffer does not hold the write");
        /* sent after the window's retirement, which goes out alone and
         * first (engine.c, wops_hold): the writer knows the key is dead */
        srv_reply(s, &(struct reply){.tag = 'A', .xb = (uint16_t)i});
        return;
    }
    const uint8_t *b = buf;
    uint8_t cmd = len ? b[0] : 0;
    uint8_t arg = len > 1 ? b[1] : 0;
    bex_mem_free(buf);
    struct reply r = {.tag = 'T'};
    switch (cmd) {
    case 'X': /* expose, answer the ticket */
        r.xb = (uint16_t)srv_expose(s, &r.rb);
        srv_reply(s, &r);
        break;
    case 'Y': /* expose, no answer: the client closes this socket now */
        srv_expose(s, &r.rb);
        break;
    case 'N': /* tell handed-back exposures here */
        g_srv.notify = s;
        break;
    case 'R': /* the application lets go of socket #arg (and its exposures) */
        CHECK(arg < atomic_load(&g_srv.nsocks));
        bex_sock_close(g_srv.socks[arg]);
        break;
    case 'S': /* hold the I/O thread: what the client sends next piles up */
        pair_sleep_ms(300 * time_scale());
        break;
    default:
        srv_bad("unknown command");
    }
}

static void srv_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)len, (void)mu, (void)user;
    int i = xb_of(buf);
    if (i < 0) {
        bex_mem_free(buf);
        return;
    }
    struct xb *x = &g_srv.xb[i];
    if (atomic_fetch_add(&x->reports, 1))
        srv_bad("an exposed buffer reported twice");
    x->status = status;
    if (status != -ECANCELED)
        srv_bad("an exposed buffer handed back with a status other than -ECANCELED");
    /* whether the I/O thread had bound its window when it took the slot
     * back (exposed.c: the flag stays until the slot is claimed again, and
     * only this thread's callbacks expose here) */
    uint8_t nb = !g_srv.ctx->exposed[x->slot].bound;
    if (nb)
        atomic_fetch_add(&g_srv.never_bound, 1);
    if (g_srv.notify && g_srv.notify != s)
        srv_reply(g_srv.notify, &(struct reply){.tag = 'C', .xb = (uint16_t)i, .never_bound = nb});
}

static void srv_error(bex_sock *s, int err, void *user)
{
    (void)err, (void)user;
    atomic_fetch_add(&g_srv.errors, 1);
    if (g_srv.notify == s)
        g_srv.notify = NULL;
    bex_sock_close(s);
}

static void srv_close(bex_sock *s, void *user)
{
    (void)user;
    if (g_srv.notify == s)
        g_srv.notify = NULL;
}

static const bex_sock_ops srv_ops = {
    .on_recv = srv_recv, .on_send_done = srv_done, .on_error = srv_error, .on_close = srv_close};

static void srv_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l, (void)user;
    long n = atomic_load(&g_srv.nsocks);
    CHECK(n < MAX_SOCKS);
    g_srv.socks[n] = s;
    atomic_store(&g_srv.nsocks, n + 1);
    bex_sock_set_user(s, &srv_ops, NULL);
}

/* What a case leaves on the server. */
struct expect {
    long delivered, handed_back, errors;
    bool never_bound; /* at least one exposure never bound */
};

static int retire_server(struct pair *p, void *arg)
{
    const struct expect *want = arg;
    g_srv.ctx = p->ctx;
    CHECK_EQ(bex_ctx_remote_access(p->ctx), BEX_REMOTE_ACCESS_WINDOW);
    bex_listener_ops lops = {.on_accept = srv_accept};
    pair_listen(p, &lops, NULL);
    pair_wait_done(p); /* the client is done */
    /* our side of an engine the peer's refusal ended fails on its own time
     * (a flushed receive, or the TCP close) */
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (atomic_load(&g_srv.errors) < want->errors && pair_now_ms() < end)
        pair_sleep_ms(10);
    long delivered = 0, back = 0;
    for (long i = 0; i < atomic_load(&g_srv.nxb); i++) {
        struct xb *x = &g_srv.xb[i];
        if (atomic_load(&x->reports) != 1) {
            fprintf(stderr, "server: exposure %ld reported %d times\n", i,
                    atomic_load(&x->reports));
            atomic_fetch_add(&g_srv.bad, 1);
        }
        if (x->delivered) {
            delivered++;
            if (check_pattern(x->buf, EXP_LEN, DIRECT_SEED))
                srv_bad("a delivered buffer changed after its window was retired");
        } else {
            back++;
            if (check_pattern(x->buf, EXP_LEN, FILL_SEED))
                srv_bad("a handed-back buffer changed after its window was retired");
        }
    }
    fprintf(stderr,
            "server: %ld exposures, %ld delivered (want %ld), %ld handed back (want %ld), "
            "%ld socket errors (want %ld), %ld never bound\n",
            atomic_load(&g_srv.nxb), delivered, want->delivered, back, want->handed_back,
            atomic_load(&g_srv.errors), want->errors, atomic_load(&g_srv.never_bound));
    int rc = atomic_load(&g_srv.bad) != 0;
    if (delivered != want->delivered || (want->handed_back >= 0 && back != want->handed_back))
        rc = 1;
    if (want->errors >= 0 && atomic_load(&g_srv.errors) != want->errors)
        rc = 1;
    if (want->never_bound && !atomic_load(&g_srv.never_bound))
        rc = 1;
    for (long i = 0; i < atomic_load(&g_srv.nxb); i++)
        bex_mem_free(g_srv.xb[i].buf);
    return rc;
}

/* ---------------- the client ---------------- */

struct cs {
    struct waiter w;
    _Atomic long connected, done, errors, closed, tickets, acks, backs;
    _Atomic int send_status;
    int conn_status, err;
    struct reply ticket, back; /* the last of each */
};

static void cs_connect(bex_sock *s, int status, void *user)
{
    struct cs *c = user;
    (void)s;
    c->conn_status = status;
    waiter_add(&c->w, &c->connected, 1);
}

static void cs_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct cs *c = user;
    (void)s;
    struct reply r;
    CHECK_EQ(len, sizeof(r));
    memcpy(&r, buf, sizeof r);
    bex_mem_free(buf);
    if (r.tag == 'T') {
        c->ticket = r;
        waiter_add(&c->w, &c->tickets, 1);
    } else if (r.tag == 'A') {
        waiter_add(&c->w, &c->acks, 1);
    } else {
        CHECK_EQ(r.tag, 'C');
        c->back = r;
        waiter_add(&c->w, &c->backs, 1);
    }
}

static void cs_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    struct cs *c = user;
    (void)s, (void)len, (void)mu;
    if (status)
        atomic_store(&c->send_status, status);
    bex_mem_free(buf);
    waiter_add(&c->w, &c->done, 1);
}

static void cs_error(bex_sock *s, int err, void *user)
{
    struct cs *c = user;
    c->err = err;
    waiter_add(&c->w, &c->errors, 1);
    bex_sock_close(s);
}

static void cs_close(bex_sock *s, void *user)
{
    struct cs *c = user;
    (void)s;
    waiter_add(&c->w, &c->closed, 1);
}

static const bex_sock_ops cs_ops = {.on_connect = cs_connect,
                                    .on_recv = cs_recv,
                                    .on_send_done = cs_done,
                                    .on_error = cs_error,
                                    .on_close = cs_close};

#define WAIT(c, field, want)                                                                       \
    do {                                                                                           \
        if (wait_count(&(c)->w, &(c)->field, (want), 20000)) {                                     \
            fprintf(stderr, "%s:%d: waited for " #field " >= %ld, have %ld\n", __FILE__, __LINE__, \
                    (long)(want), atomic_load(&(c)->field));                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static struct cs *cs_open(bex_ctx *ctx, const bex_addr *srv, bex_sock **s)
{
    struct cs *c = calloc(1, sizeof(*c));
    CHECK(c);
    pthread_mutex_init(&c->w.mu, NULL);
    pthread_cond_init(&c->w.cv, NULL);
    CHECK_OK(bex_sock_connect(ctx, srv, &cs_ops, c, s));
    WAIT(c, connected, 1);
    CHECK_EQ(c->conn_status, 0);
    return c;
}

static void cs_cmd(bex_ctx *ctx, bex_sock *s, uint8_t cmd, uint8_t arg)
{
    uint8_t *b = bex_sock_alloc(ctx, 2);
    CHECK(b);
    b[0] = cmd;
    b[1] = arg;
    CHECK_OK(bex_sock_send(s, b, 2, NULL));
}

/* Ask for an exposure on s: its ticket. */
static struct reply cs_expose(bex_ctx *ctx, bex_sock *s, struct cs *c)
{
    long n = atomic_load(&c->tickets);
    cs_cmd(ctx, s, 'X', 0);
    WAIT(c, tickets, n + 1);
    return c->ticket;
}

/* A genuine write through a ticket: sent (status 0) and delivered ('A',
 * sent by the server after the window's retirement). */
static void cs_write_ok(bex_ctx *ctx, bex_sock *s, struct cs *c, const bex_remote_buf *rb)
{
    uint8_t *d = bex_sock_alloc(ctx, EXP_LEN);
    CHECK(d);
    fill_pattern(d, EXP_LEN, DIRECT_SEED);
    long done = atomic_load(&c->done), acks = atomic_load(&c->acks);
    CHECK_OK(bex_sock_send_direct(s, d, EXP_LEN, rb, NULL));
    WAIT(c, done, done + 1);
    CHECK_EQ(atomic_load(&c->send_status), 0);
    WAIT(c, acks, acks + 1);
}

/* A write through a retired (or forged) token: the server's NIC refuses
 * it. The writer's engine fails on the remote access error (-EACCES) and
 * the send comes back as every posted send of a failed engine (-EIO), or
 * with the refusal itself. */
static void cs_write_refused(bex_ctx *ctx, bex_sock *s, struct cs *c, const bex_remote_buf *rb)
{
    uint8_t *d = bex_sock_alloc(ctx, EXP_LEN);
    CHECK(d);
    fill_pattern(d, EXP_LEN, STALE_SEED);
    long done = atomic_load(&c->done);
    CHECK_OK(bex_sock_send_direct(s, d, EXP_LEN, rb, NULL));
    WAIT(c, errors, 1);
    WAIT(c, done, done + 1);
    int st = atomic_load(&c->send_status);
    fprintf(stderr, "client: write through a retired token: send %d (%s), socket error %d (%s)\n",
            st, bex_strerror(st), c->err, bex_strerror(c->err));
    CHECK_EQ(c->err, -EACCES);
    CHECK(st == -EIO || st == -EACCES);
    WAIT(c, closed, 1);
}

static int delivered_client(struct pair *p, void *arg)
{
    (void)arg;
    bex_sock *s;
    struct cs *c = cs_open(p->ctx, &p->srv, &s);
    struct reply t = cs_expose(p->ctx, s, c);
    cs_write_ok(p->ctx, s, c, &t.rb);
    cs_write_refused(p->ctx, s, c, &t.rb); /* the token, replayed */
    free(c);
    return 0;
}

static int released_client(struct pair *p, void *arg)
{
    (void)arg;
    bex_sock *s1, *s2;
    struct cs *c1 = cs_open(p->ctx, &p->srv, &s1);
    struct cs *c2 = cs_open(p->ctx, &p->srv, &s2);
    CHECK_EQ(atomic_load(&s1->eng_id), atomic_load(&s2->eng_id)); /* one engine, one QP */
    struct reply t1 = cs_expose(p->ctx, s1, c1);
    struct reply t2 = cs_expose(p->ctx, s2, c2);
    cs_cmd(p->ctx, s2, 'N', 0);
    cs_cmd(p->ctx, s2, 'R', 0); /* the server closes socket #0, s1 */
    WAIT(c2, backs, 1);         /* s1's exposure came back: its window retired */
    CHECK_EQ(c2->back.xb, t1.xb);
    WAIT(c1, closed, 1); /* the server's close reached s1 (on_error, then our close) */
    CHECK_EQ(c1->err, -ECONNRESET);
    /* the QP goes on after the invalidation: a live window still works */
    cs_write_ok(p->ctx, s2, c2, &t2.rb);
    /* s1's token through s2: the same QP, where the window was bound */
    cs_write_refused(p->ctx, s2, c2, &t1.rb);
    free(c1);
    free(c2);
    return 0;
}

static int dead_engine_client(struct pair *p, void *arg)
{
    (void)arg;
    bex_sock *m;
    struct cs *cm = cs_open(p->ctx, &p->srv, &m);
    cs_cmd(p->ctx, m, 'N', 0);
    /* a second context: an engine of its own on both sides */
    struct in_addr a0, a1;
    CHECK_OK(pair_addrs(&a0, &a1));
    bex_ctx_config cfg = scaled(&(bex_ctx_config){.remote_access = BEX_REMOTE_ACCESS_WINDOW}, a1);
    bex_ctx *ctx2;
    CHECK_OK(bex_ctx_create(&cfg, &ctx2));
    bex_sock *d;
    struct cs *cd = cs_open(ctx2, &p->srv, &d);
    struct reply td = cs_expose(ctx2, d, cd); /* bound: its ticket was sent after the bind */
    /* a key never handed out kills the engine on both sides */
    bex_remote_buf forged = td.rb;
    forged.rkey += 0x100;
    cs_write_refused(ctx2, d, cd, &forged);
    WAIT(cm, backs, 1); /* the exposure came back after the engine died */
    CHECK_EQ(cm->back.xb, td.xb);
    CHECK_EQ(cm->back.never_bound, 0);
    bex_ctx_destroy(ctx2);
    free(cd);
    /* the server's other engine goes on, windows included */
    struct reply t = cs_expose(p->ctx, m, cm);
    cs_write_ok(p->ctx, m, cm, &t.rb);
    CHECK_EQ(atomic_load(&cm->errors), 0);
    bex_sock_close(m);
    WAIT(cm, closed, 1);
    free(cm);
    return 0;
}

static int never_bound_client(struct pair *p, void *arg)
{
    (void)arg;
    bex_sock *m;
    struct cs *cm = cs_open(p->ctx, &p->srv, &m);
    cs_cmd(p->ctx, m, 'N', 0);
    /* The server's I/O thread sleeps in the 'S' callback while 'Y' and the
     * CLOSE of s arrive; both come out of one poll, so the exposure is
     * cancelled (the peer closed its socket) before the bind command that
     * the expose queued is drained. Timing decides whether both made the
     * same poll: tried a few times, it must happen at least once. */
    for (int tries = 1;; tries++) {
        bex_sock *s;
        struct cs *c = cs_open(p->ctx, &p->srv, &s);
        long backs = atomic_load(&cm->backs);
        cs_cmd(p->ctx, m, 'S', 0);
        pair_sleep_ms(50); /* 'S' alone in its poll */
        cs_cmd(p->ctx, s, 'Y', 0);
        bex_sock_close(s);
        WAIT(cm, backs, backs + 1);
        WAIT(c, closed, 1);
        free(c);
        fprintf(stderr, "client: try %d: the exposure was %s\n", tries,
                cm->back.never_bound ? "never bound" : "bound first");
        if (cm->back.never_bound)
            break;
        CHECK(tries < 5);
    }
    /* the engine survived it: a window bound afterwards works */
    struct reply t = cs_expose(p->ctx, m, cm);
    cs_write_ok(p->ctx, m, cm, &t.rb);
    CHECK_EQ(atomic_load(&cm->errors), 0);
    bex_sock_close(m);
    WAIT(cm, closed, 1);
    free(cm);
    return 0;
}

static int run(pair_fn client, const struct expect *x)
{
    bex_ctx_config cfg = {.remote_access = BEX_REMOTE_ACCESS_WINDOW};
    return pair_run(&cfg, retire_server, (void *)x, &cfg, client, NULL, 120);
}

static int delivered(void)
{
    return run(delivered_client, &(struct expect){.delivered = 1, .handed_back = 0, .errors = 1});
}

static int released(void)
{
    /* s1 closed by the application (no on_error), s2 failed by the refusal */
    return run(released_client, &(struct expect){.delivered = 1, .handed_back = 1, .errors = 1});
}

static int dead_engine(void)
{
    /* the dying engine's socket, then m when the client closes it */
    return run(dead_engine_client, &(struct expect){.delivered = 1, .handed_back = 1, .errors = 2});
}

static int never_bound(void)
{
    /* each try's socket ends by the peer's close (on_error) */
    return run(
        never_bound_client,
        &(struct expect){.delivered = 1, .handed_back = -1, .errors = -1, .never_bound = true});
}

BEX_TEST_MAIN(BEX_CASE(delivered), BEX_CASE(released), BEX_CASE(dead_engine), BEX_CASE(never_bound))
