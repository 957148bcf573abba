/* SPDX-License-Identifier: Apache-2.0 */
/* RPC answers into a buffer the caller exposed (bex_rpc_call_into): the
 * body lands in the caller's destination (over RDMA by the server's WRITE
 * into it, over TCP copied), a body larger than the destination is refused
 * with nothing written, a call cancelled or past its deadline completes
 * only once its destination is retired (no exposure of it left) and no
 * late answer lands in it afterwards, a retry to another replica exposes
 * afresh, and (rxe) a hostile server writing with another call's token is
 * refused. Over RDMA (rxe) and TCP (tcp). */
#include "rpc/into_test.h"

/* Call method with body (len bytes) into dst (cap bytes), d's bookkeeping
 * reset, and wait for its completion (20 s, scaled). */
static void into_wait(bex_rpc_channel *ch, bex_ctx *ctx, uint32_t method, void *body, size_t len,
                      uint8_t *dst, size_t cap, struct dres *d)
{
    dres_init(d, ctx, dst);
    CHECK_OK(bex_rpc_call_into(ch, SVC, method, body, len, dst, cap, NULL, d_done, d, NULL));
    CHECK(wait_count(&d->w, &d->calls, 1, 20000) == 0);
}

/* The end of a case: the channel, dst, the context and the servers sp[0..n)
 * (each must leave cleanly) gone; what the case returns. */
static int finish(bex_rpc_channel *ch, bex_ctx *ctx, uint8_t *dst, struct srv_proc *sp, size_t n)
{
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_rpc_free(dst);
    CHECK_OK(bex_ctx_destroy(ctx));
    int rc = 0;
    for (size_t i = 0; i < n; i++)
        rc |= stop_server(&sp[i], false);
    return rc ? 1 : 0;
}

/* Echo of 1 MiB, 64 KiB and 100 B into a 2 MiB destination: the body is
 * in the caller's buffer, intact, bytes past it untouched; the same
 * destination serves call after call. */
static int t_into(void)
{
    RPC_NEED_ADDRS();
    const char *tr = getenv("BEX_TEST_TRANSPORT");
    bool over_tcp = tr && strcmp(tr, "tcp") == 0;
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, LONG_MS);
    enum { CAP = 2 << 20 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    void *notdst = pattern_body(ctx, 8, 1);
    CHECK(bex_rpc_call_into(ch, SVC, M_ECHO, NULL, 0, notdst, 8, NULL, d_done, NULL, NULL) ==
          -EINVAL); /* not a destination */
    bex_rpc_free(notdst);
    static const size_t sizes[] = {1 << 20, 64 << 10, 100, 0};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        memset(bex__rpc_hdr_of(dst), 0xEE, CAP + BEX_RPC_HDR_LEN);
        struct dres d;
        dres_init(&d, ctx, dst);
        size_t n = sizes[i];
        CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO,
                                   n ? pattern_body(ctx, n, (uint32_t)i + 7) : NULL, n, dst, CAP,
                                   NULL, d_done, &d, NULL));
        CHECK(wait_count(&d.w, &d.calls, 1, 20000) == 0);
        CHECK_OK(d.status);
        CHECK(d.body == dst);
        CHECK_EQ(d.len, n);
        CHECK_EQ(d.armed_at_done, 0);
        if (n)
            CHECK(check_pattern(dst, n, (uint32_t)i + 7) == 0);
        CHECK(all_bytes(dst + n, CAP - n, 0xEE));
        /* over RDMA the server wrote the answer whole, header first, into
         * the exposed room; over TCP it was copied: the room is as it was */
        const uint8_t *room = bex__rpc_hdr_of(dst);
        if (over_tcp)
            CHECK(all_bytes(room, BEX_RPC_HDR_LEN, 0xEE));
        else
            CHECK(room[0] == 0xC1 && room[1] == 0xB5 && bex__rpc_hdr_body_len(room) == n);
    }
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.ok, 4);
    CHECK_EQ(st.bad_header, 0);
    CHECK_EQ(st.attempts, 4);
    /* each call had a socket of its own; none was refused */
    struct tstats t = server_stats(ch);
    CHECK_EQ(t.st.bad_header, 0);
    CHECK(t.st.conns >= 4);
    return finish(ch, ctx, dst, &sp, 1);
}

/* A 64 KiB answer for a 16 KiB destination: -EMSGSIZE, nothing written
 * into the destination nor past it; the channel goes on. */
static int t_too_large(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, LONG_MS);
    enum { CAP = 16 << 10, BIG = 64 << 10 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    size_t usable = bex_mem_usable_size(bex__rpc_hdr_of(dst)) - BEX_RPC_HDR_LEN;
    CHECK(usable >= CAP);
    memset(bex__rpc_hdr_of(dst), 0xA5, usable + BEX_RPC_HDR_LEN);
    struct dres d;
    into_wait(ch, ctx, M_ECHO, pattern_body(ctx, BIG, 3), BIG, dst, CAP, &d);
    CHECK_EQ(d.status, -EMSGSIZE);
    CHECK(d.body == dst);
    CHECK_EQ(d.len, 0);
    CHECK_EQ(d.armed_at_done, 0);
    /* over RDMA the refusal may be written into the header room; the
     * body and everything past it stay as they were */
    CHECK(all_bytes(dst, usable, 0xA5));
    /* exactly the capacity fits */
    into_wait(ch, ctx, M_ECHO, pattern_body(ctx, CAP, 4), CAP, dst, CAP, &d);
    CHECK_OK(d.status);
    CHECK_EQ(d.len, CAP);
    CHECK(check_pattern(dst, CAP, 4) == 0);
    CHECK(all_bytes(dst + CAP, usable - CAP, 0xA5));
    return finish(ch, ctx, dst, &sp, 1);
}

/* A call cancelled (cancel) or past its deadline (deadline) while the
 * server holds the answer: done runs with the destination retired (no
 * exposure of it armed), and the late answer never lands in it. */
static int cancel_case(bool by_deadline)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, LONG_MS);
    enum { CAP = 1 << 20, LEN = 256 << 10 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    /* warm the connection so the deadline below is about the answer */
    struct dres d;
    into_wait(ch, ctx, M_ECHO, NULL, 0, dst, CAP, &d);
    CHECK_OK(d.status);
    uint32_t delay = 1500 * time_scale();
    uint8_t *b = pattern_body(ctx, LEN, 9);
    memcpy(b, &delay, 4); /* M_LATE: answered after this many ms */
    dres_init(&d, ctx, dst);
    bex_rpc_call_opts o = {.timeout_ms = by_deadline ? 100 * time_scale() : 0,
                           .flags = BEX_RPC_CALL_NO_RETRY};
    uint64_t id;
    uint64_t t0 = pair_now_ms();
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_LATE, b, LEN, dst, CAP, &o, d_done, &d, &id));
    if (!by_deadline) {
        pair_sleep_ms(100 * time_scale());
        CHECK_OK(bex_rpc_cancel(ch, id));
    }
    CHECK(wait_count(&d.w, &d.calls, 1, 20000) == 0);
    CHECK_EQ(d.status, by_deadline ? -ETIMEDOUT : -ECANCELED);
    CHECK(d.body == dst);
    CHECK_EQ(d.armed_at_done, 0);
    CHECK(pair_now_ms() - t0 < delay); /* before the answer was due */
    /* the caller owns dst again: a late answer must not land in it */
    memset(bex__rpc_hdr_of(dst), 0x3C, CAP + BEX_RPC_HDR_LEN);
    pair_sleep_ms(delay + 300 * time_scale());
    CHECK(all_bytes(bex__rpc_hdr_of(dst), CAP + BEX_RPC_HDR_LEN, 0x3C));
    CHECK_EQ(armed_of(ctx, dst), 0);
    /* and the channel goes on */
    into_wait(ch, ctx, M_ECHO, pattern_body(ctx, 5000, 11), 5000, dst, CAP, &d);
    CHECK_OK(d.status);
    CHECK(check_pattern(dst, 5000, 11) == 0);
    return finish(ch, ctx, dst, &sp, 1);
}

static int t_cancel(void)
{
    return cancel_case(false);
}

static int t_deadline(void)
{
    return cancel_case(true);
}

/* Two replicas; the first loses its answer to a WRITE (closes the
 * attempt's socket after applying it): the retry goes to the second
 * replica with a fresh exposure, its answer lands in the destination. */
static int t_retry(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], true);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, sp, 2, LONG_MS);
    enum { CAP = 64 << 10 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    memset(dst, 0x77, CAP);
    struct dres d;
    into_wait(ch, ctx, M_WRITE, NULL, 0, dst, CAP, &d);
    CHECK_OK(d.status);
    CHECK_EQ(d.len, sizeof(int64_t));
    int64_t n;
    memcpy(&n, dst, sizeof n);
    CHECK_EQ(n, 1); /* the second replica's first write */
    CHECK(all_bytes(dst + sizeof n, CAP - sizeof n, 0x77));
    CHECK_EQ(d.armed_at_done, 0);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.attempts, 2);
    CHECK_EQ(st.retries, 1);
    CHECK_EQ(st.failovers, 1);
    bex_rpc_endpoint_stats es[2];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 2);
    CHECK(es[0].attempts == 1 && es[0].failures == 1 && es[1].attempts == 1 && es[1].answers == 1);
    return finish(ch, ctx, dst, sp, 2);
}

/* An endpoint removed (bex_rpc_channel_set_endpoints) while a call with a
 * destination is out on it: its attempt ends and the call is tried on the
 * new list, whose answer lands in the destination. */
static int t_endpoints(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, sp, 1, LONG_MS);
    enum { CAP = 64 << 10, LEN = 20000 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    uint32_t delay = 500 * time_scale();
    uint8_t *b = pattern_body(ctx, LEN, 21);
    memcpy(b, &delay, 4); /* M_LATE: answered after this many ms */
    struct dres d;
    dres_init(&d, ctx, dst);
    bex_rpc_call_opts o = {.timeout_ms = 10000 * time_scale()};
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_LATE, b, LEN, dst, CAP, &o, d_done, &d, NULL));
    pair_sleep_ms(100 * time_scale());
    bex_rpc_endpoint second[1];
    (void)chan_cfg(second, &sp[1], 1);
    CHECK_OK(bex_rpc_channel_set_endpoints(ch, second, 1));
    CHECK(wait_count(&d.w, &d.calls, 1, 30000) == 0);
    CHECK_OK(d.status);
    CHECK_EQ(d.len, LEN);
    uint8_t *want = malloc(LEN);
    CHECK(want);
    fill_pattern(want, LEN, 21);
    memcpy(want, &delay, 4);
    CHECK(memcmp(dst, want, LEN) == 0);
    free(want);
    CHECK_EQ(d.armed_at_done, 0);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.attempts, 2);
    CHECK_EQ(st.retries, 1);
    bex_rpc_endpoint_stats es[1];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 1), 1);
    CHECK(es[0].addr.in4.sin_port == sp[1].addr.in4.sin_port && es[0].attempts == 1 &&
          es[0].answers == 1);
    return finish(ch, ctx, dst, sp, 2);
}

/* ---- a hostile server: raw sockets, answers one of two calls by writing
 * with the other call's token (both on one connection) ---- */

struct hsock {
    bex_sock *s;
    bool gone; /* on_close ran (under hs.mu) */
    bool has_dest, has_req;
    struct bex__rpc_dest d;
    struct bex__rpc_hdr h;
};

static struct {
    bex_ctx *ctx;
    pthread_mutex_t mu; /* n and gone, for the teardown */
    struct hsock socks[16];
    int n;
    bool sent;
} hs = {.mu = PTHREAD_MUTEX_INITIALIZER}; /* else the I/O thread's (one connection) */

static void hs_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct hsock *k = user;
    struct bex__rpc_hdr h;
    const char *why;
    if (!bex__rpc_hdr_decode(buf, len, &h, &why)) {
        if (h.kind == BEX__RPC_DEST &&
            !bex__rpc_dest_decode((uint8_t *)buf + BEX_RPC_HDR_LEN, &k->d))
            k->has_dest = k->d.token != 0;
        else if (h.kind == BEX__RPC_REQUEST) {
            k->h = h;
            k->has_req = true;
        }
    }
    bex_mem_free(buf);
    struct hsock *a = NULL, *b = NULL;
    for (int i = 0; i < hs.n; i++) {
        struct hsock *x = &hs.socks[i];
        if (x->has_dest && x->has_req) {
            if (!a)
                a = x;
            else if (!b)
                b = x;
        }
    }
    if (!a || !b || hs.sent)
        return;
    hs.sent = true;
    /* a's answer (its header, its call id) into b's destination */
    enum { BL = 16 };
    uint8_t *body = bex_rpc_alloc(hs.ctx, BL);
    CHECK(body);
    memset(body, 0x66, BL);
    struct bex__rpc_hdr r = a->h;
    r.kind = BEX__RPC_RESPONSE;
    r.flags = 0;
    r.status = 0;
    r.body_len = BL;
    r.timeout_ms = 0;
    bex__rpc_hdr_encode(&r, bex__rpc_hdr_of(body));
    bex_remote_buf rb = {
        .addr = b->d.addr, .rkey = b->d.rkey, .len = BEX_RPC_HDR_LEN + BL, .token = b->d.token};
    CHECK_OK(bex_sock_send_direct(a->s, bex__rpc_hdr_of(body), BEX_RPC_HDR_LEN + BL, &rb, NULL));
}

static void hs_error(bex_sock *s, int err, void *user)
{
    (void)err;
    (void)user;
    bex_sock_close(s);
}

static void hs_close(bex_sock *s, void *user)
{
    (void)s;
    struct hsock *k = user;
    pthread_mutex_lock(&hs.mu);
    k->gone = true;
    pthread_mutex_unlock(&hs.mu);
}

static const bex_sock_ops hs_ops = {.on_recv = hs_recv, .on_error = hs_error, .on_close = hs_close};

static void hs_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    (void)user;
    pthread_mutex_lock(&hs.mu);
    CHECK(hs.n < (int)(sizeof hs.socks / sizeof hs.socks[0]));
    struct hsock *k = &hs.socks[hs.n++];
    k->s = s;
    pthread_mutex_unlock(&hs.mu);
    CHECK_OK(bex_sock_set_user(s, &hs_ops, k));
}

static void hostile_child(int wfd, int rfd, void *arg)
{
    (void)arg;
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ctx_config base = {.keepalive_timeout_ms = RPC_KEEPALIVE_MS,
                           .connect_timeout_ms = RPC_SETUP_MS};
    bex_ctx_config c = scaled(&base, a0);
    CHECK_OK(bex_ctx_create(&c, &hs.ctx));
    static const bex_listener_ops lops = {.on_accept = hs_accept};
    bex_addr la = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    bex_listener *l;
    CHECK_OK(bex_listen(hs.ctx, &la, &lops, NULL, &l));
    bex_addr got;
    bex_listener_addr(l, &got);
    CHECK(write(wfd, &got.in4.sin_port, sizeof got.in4.sin_port) == sizeof got.in4.sin_port);
    char q;
    ssize_t r = read(rfd, &q, 1);
    (void)r;
    CHECK_OK(bex_listener_close(l));
    /* close what is left and wait for every on_close (a socket is freed
     * after its on_close, which waits for hs.mu) */
    for (int tries = 0;; tries++) {
        bool all = true;
        pthread_mutex_lock(&hs.mu);
        for (int i = 0; i < hs.n; i++)
            if (!hs.socks[i].gone) {
                all = false;
                bex_sock_close(hs.socks[i].s);
            }
        pthread_mutex_unlock(&hs.mu);
        if (all)
            break;
        CHECK(tries < 3000 * (int)time_scale());
        pair_sleep_ms(10);
    }
    CHECK_OK(bex_ctx_destroy(hs.ctx));
    exit(0);
}

/* Two calls with destinations on one connection to a hostile server that
 * answers the first of them by writing with the other's token: the call
 * whose destination was written refuses it (-EPROTO, bad_header), the
 * other is not answered (-ETIMEDOUT) and its destination is untouched;
 * neither completes with the hostile answer. RDMA only: over TCP no
 * token goes out. */
static int t_hostile(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    srv_spawn(&sp, hostile_child, NULL);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, LONG_MS);
    enum { CAP = 8 << 10 };
    uint8_t *dst[2];
    struct dres d[2];
    bex_rpc_call_opts o = {.timeout_ms = 5000 * time_scale(), .flags = BEX_RPC_CALL_NO_RETRY};
    for (int i = 0; i < 2; i++) {
        dst[i] = bex_rpc_alloc_dest(ctx, CAP);
        CHECK(dst[i]);
        memset(dst[i], 0x11, CAP);
        dres_init(&d[i], ctx, dst[i]);
        CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO, pattern_body(ctx, 32, (uint32_t)i), 32, dst[i],
                                   CAP, &o, d_done, &d[i], NULL));
    }
    for (int i = 0; i < 2; i++) {
        CHECK(wait_count(&d[i].w, &d[i].calls, 1, 20000) == 0);
        CHECK_EQ(d[i].armed_at_done, 0);
        CHECK(d[i].body == dst[i]);
    }
    int refused = d[0].status == -EPROTO ? 0 : 1;
    CHECK_EQ(d[refused].status, -EPROTO);
    CHECK_EQ(d[!refused].status, -ETIMEDOUT);
    CHECK(all_bytes(dst[!refused], CAP, 0x11));
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.ok, 0);
    CHECK_EQ(st.bad_header, 1);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_rpc_free(dst[0]);
    bex_rpc_free(dst[1]);
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
}

BEX_TEST_MAIN({"into", t_into}, {"too_large", t_too_large}, {"cancel", t_cancel},
              {"deadline", t_deadline}, {"retry", t_retry}, {"endpoints", t_endpoints},
              {"hostile", t_hostile})
