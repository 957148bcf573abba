/* SPDX-License-Identifier: Apache-2.0 */
/* What a peer can write with the keys it holds (issue 7 part 1), on rxe,
 * two processes (see pair.h).
 *
 * The server hands every connection a ticket: an exposed buffer's
 * descriptor (real address, key and token) plus, for the attack, the
 * addresses of things a peer must never reach: the landing chunk's header,
 * a canary buffer of the general pool (and that pool's key, which is never
 * handed out) and a received SEND buffer the application still holds. A
 * good client keeps one socket busy with echoes the whole time; one abusive
 * connection after another forges a bex_remote_buf from its ticket and
 * writes with bex_sock_send_direct. Each forged write must be refused (the
 * abuser's send fails with -EACCES, its engine fails on both sides), and at
 * the end the server checks that no byte of the header, the canary or the
 * SEND buffer changed, and that the good socket never noticed. A genuine
 * direct write through a ticket is the positive control: the key works. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "mem/internal.h"
#include "pair.h"

#define EXP_LEN     8192 /* exposed buffer */
#define CANARY_LEN  4096
#define KEPT_LEN    1000 /* a SEND the server's application holds on to */
#define HDR_SNAP    4096 /* bytes of the landing chunk header compared */
#define DIRECT_SEED 91
#define ATTACK_SEED 4242
#define CANARY_SEED 17
#define KEPT_SEED   23
#define ECHO_SMALL  3000   /* by SEND */
#define ECHO_LARGE  200000 /* by rendezvous: a landing destination (and window) */
#define MAX_KEPT    8
#define VERDICT_LEN 128

struct ticket {
    bex_remote_buf rb;
    uint64_t hdr;     /* the landing chunk header of rb's buffer */
    uint64_t canary;  /* a general-pool buffer */
    uint32_t gen_key; /* the general pool's key (lkey), never handed out */
    uint32_t pad;
    uint64_t kept; /* a received SEND buffer the application holds, or 0 */
};

/* ---------------- server ---------------- */

struct srv {
    bex_ctx *ctx;
    uint8_t *canary;
    uint8_t *kept;
    uint8_t *hdr_at; /* landing chunk header, and its bytes when first seen */
    uint8_t hdr_snap[HDR_SNAP];
    _Atomic long accepted, errors, direct_ok, direct_bad, check_req;
    bex_sock *check_sock;
    uint8_t *delivered[MAX_KEPT]; /* exposed buffers delivered, held to the end */
    _Atomic long ndelivered;
};

/* What the server expects, per case. */
struct expect {
    long attacks; /* abusive sockets that must fail */
    long direct;  /* genuine direct writes that must arrive */
    uint32_t mode;
};

struct ssock {
    struct srv *srv;
    void *exposed;
};

static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct ssock *ss = user;
    struct srv *v = ss->srv;
    if (buf == ss->exposed) {
        ss->exposed = NULL;
        if (len == EXP_LEN && check_pattern(buf, len, DIRECT_SEED) == 0)
            atomic_fetch_add(&v->direct_ok, 1);
        else
            atomic_fetch_add(&v->direct_bad, 1);
        /* held: a late write through its (revoked) key must not change it */
        long n = atomic_load(&v->ndelivered);
        if (n < MAX_KEPT) {
            v->delivered[n] = buf;
            atomic_store(&v->ndelivered, n + 1);
        } else {
            bex_mem_free(buf);
        }
        char *ack = bex_sock_alloc(v->ctx, 4);
        CHECK(ack);
        memcpy(ack, "ACK!", 4);
        if (bex_sock_send(s, ack, 4, NULL))
            bex_mem_free(ack);
        return;
    }
    const uint8_t *b = buf;
    if (len == KEPT_LEN && b[0] == 'K' && !v->kept) {
        v->kept = buf; /* held until the end: a peer must not reach it */
        return;
    }
    if (len >= 1 && b[0] == 'C') {
        v->check_sock = s;
        atomic_store(&v->check_req, 1);
        bex_mem_free(buf);
        return;
    }
    if (len >= 1 && b[0] == 'E' && bex_sock_send(s, buf, len, NULL) == 0)
        return;
    bex_mem_free(buf);
}

static void srv_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    struct ssock *ss = user;
    (void)s, (void)len, (void)mu, (void)status;
    if (buf == ss->exposed)
        ss->exposed = NULL; /* handed back (-ECANCELED): never written */
    bex_mem_free(buf);
}

static void srv_error(bex_sock *s, int err, void *user)
{
    struct ssock *ss = user;
    (void)err;
    atomic_fetch_add(&ss->srv->errors, 1);
    bex_sock_close(s);
}

static void srv_close(bex_sock *s, void *user)
{
    (void)s;
    free(user);
}

static const bex_sock_ops srv_ops = {
    .on_recv = srv_recv, .on_send_done = srv_done, .on_error = srv_error, .on_close = srv_close};

static void srv_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    struct srv *v = user;
    struct ssock *ss = calloc(1, sizeof(*ss));
    CHECK(ss);
    ss->srv = v;
    bex_sock_set_user(s, &srv_ops, ss);
    ss->exposed = bex_sock_alloc_exposable(v->ctx, EXP_LEN);
    CHECK(ss->exposed);
    memset(ss->exposed, 0, EXP_LEN);
    struct ticket *t = bex_sock_alloc(v->ctx, sizeof(*t));
    CHECK(t);
    memset(t, 0, sizeof(*t));
    CHECK_OK(bex_sock_expose(s, ss->exposed, EXP_LEN, NULL, &t->rb));
    uint8_t *hdr = (uint8_t *)bex__mem_chunk_of(ss->exposed);
    if (!v->hdr_at) {
        v->hdr_at = hdr;
        memcpy(v->hdr_snap, hdr, HDR_SNAP);
    }
    t->hdr = (uintptr_t)hdr;
    t->canary = (uintptr_t)v->canary;
    t->gen_key = bex_mem_mr(v->canary)->lkey;
    t->kept = (uintptr_t)v->kept;
    atomic_fetch_add(&v->accepted, 1);
    CHECK_OK(bex_sock_send(s, t, sizeof(*t), NULL));
}

/* After the client's 'C': wait for the abusers' sockets to have failed,
 * then check every byte a peer must not have reached; reply the verdict. */
static int srv_verdict(struct srv *v, long attacks, long direct, char *out)
{
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (atomic_load(&v->errors) < attacks && pair_now_ms() < end)
        pair_sleep_ms(10);
    uint8_t attack[64];
    fill_pattern(attack, sizeof attack, ATTACK_SEED);
    if (atomic_load(&v->errors) != attacks)
        return snprintf(out, VERDICT_LEN, "BAD %ld of %ld abusive sockets failed",
                        atomic_load(&v->errors), attacks);
    if (check_pattern(v->canary, CANARY_LEN, CANARY_SEED))
        return snprintf(out, VERDICT_LEN, "BAD general-pool canary changed");
    if (!v->kept || check_pattern(v->kept + 1, KEPT_LEN - 1, KEPT_SEED))
        return snprintf(out, VERDICT_LEN, "BAD received SEND buffer changed");
    if (!v->hdr_at || memcmp(v->hdr_at, v->hdr_snap, HDR_SNAP) != 0 ||
        memcmp(v->hdr_at, attack, sizeof attack) == 0)
        return snprintf(out, VERDICT_LEN, "BAD landing chunk header changed");
    for (long i = 0; i < atomic_load(&v->ndelivered); i++)
        if (check_pattern(v->delivered[i], EXP_LEN, DIRECT_SEED))
            return snprintf(out, VERDICT_LEN, "BAD a delivered buffer changed afterwards");
    if (atomic_load(&v->direct_ok) != direct || atomic_load(&v->direct_bad) != 0)
        return snprintf(out, VERDICT_LEN, "BAD genuine direct writes: %ld ok, %ld bad",
                        atomic_load(&v->direct_ok), atomic_load(&v->direct_bad));
    return snprintf(out, VERDICT_LEN, "GOOD");
}

static int remote_server(struct pair *p, void *arg)
{
    const struct expect *x = arg;
    CHECK_EQ(bex_ctx_remote_access(p->ctx), x->mode);
    struct srv *v = calloc(1, sizeof(*v));
    CHECK(v);
    v->ctx = p->ctx;
    v->canary = bex_sock_alloc(p->ctx, CANARY_LEN);
    CHECK(v->canary);
    fill_pattern(v->canary, CANARY_LEN, CANARY_SEED);
    bex_listener_ops lops = {.on_accept = srv_accept};
    pair_listen(p, &lops, v);
    uint64_t end = pair_now_ms() + 150000ull * time_scale();
    while (!atomic_load(&v->check_req) && pair_now_ms() < end)
        pair_sleep_ms(10);
    CHECK(atomic_load(&v->check_req));
    char *verdict = bex_sock_alloc(p->ctx, VERDICT_LEN);
    CHECK(verdict);
    memset(verdict, 0, VERDICT_LEN);
    srv_verdict(v, x->attacks, x->direct, verdict);
    fprintf(stderr, "server verdict: %s\n", verdict);
    int bad = strncmp(verdict, "GOOD", 4) != 0;
    CHECK_OK(bex_sock_send(v->check_sock, verdict, VERDICT_LEN, NULL));
    pair_wait_parent(p);
    bex_listener_close(p->l);
    bex_mem_free(v->canary);
    bex_mem_free(v->kept);
    for (long i = 0; i < atomic_load(&v->ndelivered); i++)
        bex_mem_free(v->delivered[i]);
    return bad;
}

/* ---------------- client ---------------- */

struct ccli {
    struct waiter w;
    _Atomic long connected, recvd, done, errors, closed, echoes, bad_echoes, acks;
    _Atomic int send_status;
    int conn_status, err;
    bool have_ticket;
    struct ticket t;
    char verdict[VERDICT_LEN];
    bool have_verdict;
};

static void ccli_connect(bex_sock *s, int status, void *user)
{
    struct ccli *c = user;
    (void)s;
    c->conn_status = status;
    atomic_fetch_add(&c->connected, 1);
    waiter_signal(&c->w);
}

static void ccli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct ccli *c = user;
    (void)s;
    const uint8_t *b = buf;
    if (!c->have_ticket && len == sizeof(struct ticket)) {
        memcpy(&c->t, buf, sizeof c->t);
        c->have_ticket = true;
    } else if (len == VERDICT_LEN) {
        memcpy(c->verdict, buf, VERDICT_LEN);
        c->verdict[VERDICT_LEN - 1] = 0;
        c->have_verdict = true;
    } else if (len == 4 && memcmp(b, "ACK!", 4) == 0) {
        atomic_fetch_add(&c->acks, 1);
    } else if ((len == ECHO_SMALL || len == ECHO_LARGE) && b[0] == 'E') {
        uint32_t seq;
        memcpy(&seq, b + 4, 4);
        if (check_pattern(b + 8, len - 8, seq))
            atomic_fetch_add(&c->bad_echoes, 1);
        atomic_fetch_add(&c->echoes, 1);
    }
    bex_mem_free(buf);
    atomic_fetch_add(&c->recvd, 1);
    waiter_signal(&c->w);
}

static void ccli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    struct ccli *c = user;
    (void)s, (void)len, (void)mu;
    if (status)
        atomic_store(&c->send_status, status);
    bex_mem_free(buf);
    atomic_fetch_add(&c->done, 1);
    waiter_signal(&c->w);
}

static void ccli_error(bex_sock *s, int err, void *user)
{
    struct ccli *c = user;
    c->err = err;
    atomic_fetch_add(&c->errors, 1);
    waiter_signal(&c->w);
    bex_sock_close(s);
}

static void ccli_close(bex_sock *s, void *user)
{
    struct ccli *c = user;
    (void)s;
    waiter_add(&c->w, &c->closed, 1);
}

static const bex_sock_ops ccli_ops = {.on_connect = ccli_connect,
                                      .on_recv = ccli_recv,
                                      .on_send_done = ccli_done,
                                      .on_error = ccli_error,
                                      .on_close = ccli_close};

static struct ccli *ccli_new(void)
{
    struct ccli *c = calloc(1, sizeof(*c));
    CHECK(c);
    pthread_mutex_init(&c->w.mu, NULL);
    pthread_cond_init(&c->w.cv, NULL);
    return c;
}

#define WAIT(c, field, want, ms)                                                                   \
    do {                                                                                           \
        if (wait_count(&(c)->w, &(c)->field, (want), (ms))) {                                      \
            fprintf(stderr, "%s:%d: waited for " #field " >= %ld, have %ld\n", __FILE__, __LINE__, \
                    (long)(want), atomic_load(&(c)->field));                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static bex_sock *ccli_open(bex_ctx *ctx, const bex_addr *srv, struct ccli *c)
{
    bex_sock *s;
    CHECK_OK(bex_sock_connect(ctx, srv, &ccli_ops, c, &s));
    WAIT(c, connected, 1, 20000);
    CHECK_EQ(c->conn_status, 0);
    WAIT(c, recvd, 1, 20000);
    CHECK(c->have_ticket);
    return s;
}

/* One echo round trip on the good socket: the server's other engines go on. */
static void echo_once(bex_ctx *ctx, bex_sock *s, struct ccli *c, uint32_t seq)
{
    static const size_t lens[] = {ECHO_SMALL, ECHO_LARGE};
    for (int i = 0; i < 2; i++) {
        uint8_t *b = bex_sock_alloc(ctx, lens[i]);
        CHECK(b);
        b[0] = 'E';
        memcpy(b + 4, &seq, 4);
        fill_pattern(b + 8, lens[i] - 8, seq);
        long want = atomic_load(&c->echoes) + 1;
        CHECK_OK(bex_sock_send(s, b, lens[i], NULL));
        WAIT(c, echoes, want, 20000);
        CHECK_EQ(atomic_load(&c->bad_echoes), 0);
    }
}

/* A genuine direct write through the socket's ticket, acknowledged by the
 * server once delivered (so its window has been revoked by then). */
static void direct_once(bex_ctx *ctx, bex_sock *s, struct ccli *c, const bex_remote_buf *rb)
{
    uint8_t *d = bex_sock_alloc(ctx, EXP_LEN);
    CHECK(d);
    fill_pattern(d, EXP_LEN, DIRECT_SEED);
    long done = atomic_load(&c->done), acks = atomic_load(&c->acks);
    CHECK_OK(bex_sock_send_direct(s, d, EXP_LEN, rb, NULL));
    WAIT(c, done, done + 1, 20000);
    CHECK_EQ(atomic_load(&c->send_status), 0);
    WAIT(c, acks, acks + 1, 20000);
}

enum target {
    T_GEN_KEY,
    T_UNKNOWN_KEY,
    T_HEADER,
    T_CANARY,
    T_KEPT,
    T_OUT_OF_RANGE,
    T_STALE, /* window mode: the key of a finished transfer, same connection */
    T_CROSS, /* window mode: another connection's live key */
};
static const char *const target_name[] = {
    "general pool key on the canary", "a key never handed out",
    "landing chunk header",           "general-pool canary",
    "received SEND buffer",           "past the landing chunk",
    "a finished transfer's key",      "another connection's key"};

/* A fresh connection (its own context, so its own engine) forges a
 * descriptor from its ticket and writes through it: refused. */
static void attack(struct pair *p, struct in_addr me, enum target tg)
{
    bex_ctx_config cfg = scaled(NULL, me);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&cfg, &ctx));
    struct ccli *c = ccli_new();
    bex_sock *s = ccli_open(ctx, &p->srv, c);
    bex_remote_buf rb = c->t.rb;
    struct ccli *vc = NULL; /* T_CROSS: the victim connection */
    bex_ctx *vctx = NULL;
    bex_sock *vs = NULL;
    switch (tg) {
    case T_STALE:
        direct_once(ctx, s, c, &rb); /* delivered: its window is revoked */
        break;
    case T_CROSS:
        CHECK_OK(bex_ctx_create(&cfg, &vctx));
        vc = ccli_new();
        vs = ccli_open(vctx, &p->srv, vc);
        rb = vc->t.rb; /* live, but bound on the victim's QP */
        break;
    case T_GEN_KEY:
        rb.rkey = c->t.gen_key;
        rb.addr = c->t.canary;
        break;
    case T_UNKNOWN_KEY:
        rb.rkey += 0x100; /* the next key index: nobody was given it */
        break;
    case T_HEADER:
        rb.addr = c->t.hdr;
        break;
    case T_CANARY:
        rb.addr = c->t.canary;
        break;
    case T_KEPT:
        CHECK(c->t.kept);
        rb.addr = c->t.kept;
        break;
    case T_OUT_OF_RANGE:
        rb.addr += 64u << 20;
        break;
    }
    uint8_t *b = bex_sock_alloc(ctx, rb.len);
    CHECK(b);
    fill_pattern(b, rb.len, ATTACK_SEED);
    long done = atomic_load(&c->done);
    CHECK_OK(bex_sock_send_direct(s, b, rb.len, &rb, NULL));
    WAIT(c, errors, 1, 20000); /* the abusive engine fails */
    WAIT(c, done, done + 1, 20000);
    int st = atomic_load(&c->send_status);
    fprintf(stderr, "attack through %s: send status %d (%s), socket error %d (%s)\n",
            target_name[tg], st, bex_strerror(st), c->err, bex_strerror(c->err));
    /* the engine failed on the peer NIC's refusal (remote access error);
     * the send itself comes back as every posted one of a failed engine */
    CHECK_EQ(c->err, -EACCES);
    CHECK(st == -EIO || st == -EACCES);
    WAIT(c, closed, 1, 20000);
    bex_ctx_destroy(ctx);
    free(c);
    if (vc) {
        /* the victim's window was never touched: its genuine write works */
        direct_once(vctx, vs, vc, &vc->t.rb);
        CHECK_EQ(atomic_load(&vc->errors), 0);
        bex_sock_close(vs);
        WAIT(vc, closed, 1, 20000);
        bex_ctx_destroy(vctx);
        free(vc);
    }
}

/* A case: the server's mode and the attacks, in order. */
struct mode_case {
    uint32_t mode;
    const enum target *targets;
    long n;
};

static int remote_client(struct pair *p, void *arg)
{
    const struct mode_case *mc = arg;
    struct in_addr a0, a1;
    CHECK_OK(pair_addrs(&a0, &a1));
    struct ccli *g = ccli_new();
    bex_sock *gs = ccli_open(p->ctx, &p->srv, g);
    /* a SEND the server keeps: its address goes into later tickets */
    uint8_t *k = bex_sock_alloc(p->ctx, KEPT_LEN);
    CHECK(k);
    k[0] = 'K';
    fill_pattern(k + 1, KEPT_LEN - 1, KEPT_SEED);
    CHECK_OK(bex_sock_send(gs, k, KEPT_LEN, NULL));
    WAIT(g, done, 1, 20000);
    /* the positive control: a genuine direct write through the ticket */
    direct_once(p->ctx, gs, g, &g->t.rb);
    echo_once(p->ctx, gs, g, 1);
    for (long i = 0; i < mc->n; i++) {
        attack(p, a1, mc->targets[i]);
        echo_once(p->ctx, gs, g, 100 + (uint32_t)i);
    }
    CHECK_EQ(atomic_load(&g->send_status), 0);
    CHECK_EQ(atomic_load(&g->errors), 0);
    /* the verdict */
    uint8_t *q = bex_sock_alloc(p->ctx, 1);
    CHECK(q);
    q[0] = 'C';
    long before = atomic_load(&g->recvd);
    CHECK_OK(bex_sock_send(gs, q, 1, NULL));
    WAIT(g, recvd, before + 1, 60000);
    CHECK(g->have_verdict);
    fprintf(stderr, "client: server says %s\n", g->verdict);
    CHECK(strcmp(g->verdict, "GOOD") == 0);
    CHECK_EQ(atomic_load(&g->errors), 0);
    bex_sock_close(gs);
    WAIT(g, closed, 1, 20000);
    free(g);
    return 0;
}

static void log_line(int level, const char *msg, void *arg)
{
    fprintf(stderr, "%s log %d: %s\n", (const char *)arg, level, msg);
}

static int run_case(const struct mode_case *mc)
{
    struct expect x = {.attacks = mc->n, .direct = 1, .mode = mc->mode};
    for (long i = 0; i < mc->n; i++)
        if (mc->targets[i] == T_STALE || mc->targets[i] == T_CROSS)
            x.direct++; /* a genuine write on the abuser's or the victim's connection */
    for (long i = 0; i < mc->n; i++)
        if (mc->targets[i] == T_CROSS)
            x.attacks++; /* the victim's server socket ends too, when it leaves */
    bex_ctx_config scfg = {
        .remote_access = mc->mode, .log_fn = log_line, .log_arg = (void *)"server"};
    bex_ctx_config ccfg = {
        .remote_access = mc->mode, .log_fn = log_line, .log_arg = (void *)"client"};
    return pair_run(&scfg, remote_server, &x, &ccfg, remote_client, (void *)mc, 120);
}

/* Both modes: forged keys and addresses. In window mode the header, the
 * canary and the SEND buffer are out of the window's MR as they are out of
 * the landing key's, and rxe (which ignores window ranges) still checks
 * the MR's: the landing layout is what keeps them safe there. */
static const enum target forged[] = {T_GEN_KEY, T_UNKNOWN_KEY, T_HEADER,
                                     T_CANARY,  T_KEPT,        T_OUT_OF_RANGE};

static int landing_forged(void)
{
    struct mode_case mc = {BEX_REMOTE_ACCESS_LANDING, forged, sizeof forged / sizeof forged[0]};
    return run_case(&mc);
}

static int window_forged(void)
{
    struct mode_case mc = {BEX_REMOTE_ACCESS_WINDOW, forged, sizeof forged / sizeof forged[0]};
    return run_case(&mc);
}

/* Window mode only: keys are per transfer and per connection. */
static const enum target scoped[] = {T_STALE, T_CROSS, T_STALE};

static int window_scoped(void)
{
    struct mode_case mc = {BEX_REMOTE_ACCESS_WINDOW, scoped, sizeof scoped / sizeof scoped[0]};
    return run_case(&mc);
}

BEX_TEST_MAIN(BEX_CASE(landing_forged), BEX_CASE(window_forged), BEX_CASE(window_scoped))
