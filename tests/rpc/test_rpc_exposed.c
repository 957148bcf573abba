/* RPC answers into a buffer the caller exposed (bex_rpc_call_into): the
 * body lands in the caller's destination (over RDMA by the server's WRITE
 * into it, over TCP copied), a body larger than the destination is refused
 * with nothing written, a call cancelled or past its deadline completes
 * only once its destination is retired (no exposure of it left) and no
 * late answer lands in it afterwards, a retry to another replica exposes
 * afresh, and (rxe) a hostile server writing with another call's token is
 * refused. Over RDMA (rxe) and TCP (tcp). */
#include "rpc/rpc_test.h"
#include "sock/internal.h"

struct dres {
    _Atomic long calls;
    int status;
    void *body;
    size_t len;
    long armed_at_done; /* exposures of the destination still armed when done ran */
    bex_ctx *ctx;
    void *dst;
    struct waiter w;
};

/* Exposures of the destination dst (its header room) still armed. */
static long armed_of(bex_ctx *ctx, void *dst)
{
    long n = 0;
    for (uint32_t i = 0; i < EXPOSED_MAX; i++) {
        struct exp_slot *x = &ctx->exposed[i];
        if (X_KIND(atomic_load(&x->state)) == X_ARMED && x->buf == bex__rpc_hdr_of(dst))
            n++;
    }
    return n;
}

static void d_done(int status, void *body, size_t len, void *user)
{
    struct dres *d = user;
    d->status = status;
    d->body = body;
    d->len = len;
    d->armed_at_done = armed_of(d->ctx, d->dst);
    waiter_add(&d->w, &d->calls, 1);
}

static void dres_init(struct dres *d, bex_ctx *ctx, void *dst)
{
    memset(d, 0, sizeof *d);
    d->ctx = ctx;
    d->dst = dst;
    pthread_mutex_init(&d->w.mu, NULL);
    pthread_cond_init(&d->w.cv, NULL);
}

static void *pattern_body(bex_ctx *ctx, size_t len, uint32_t seed)
{
    void *b = bex_rpc_alloc(ctx, len);
    CHECK(b);
    fill_pattern(b, len, seed);
    return b;
}

static bool all_bytes(const void *p, size_t n, uint8_t v)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != v)
            return false;
    return true;
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
    bex_rpc_endpoint eps[1];
    bex_rpc_channel_config cc = chan_cfg(eps, &sp, 1);
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
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
        CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO, n ? pattern_body(ctx, n, (uint32_t)i + 7) : NULL,
                                   n, dst, CAP, NULL, d_done, &d, NULL));
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
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_rpc_free(dst);
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
}

/* A 64 KiB answer for a 16 KiB destination: -EMSGSIZE, nothing written
 * into the destination nor past it; the channel goes on. */
static int t_too_large(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_endpoint eps[1];
    bex_rpc_channel_config cc = chan_cfg(eps, &sp, 1);
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    enum { CAP = 16 << 10, BIG = 64 << 10 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    size_t usable = bex_mem_usable_size(bex__rpc_hdr_of(dst)) - BEX_RPC_HDR_LEN;
    CHECK(usable >= CAP);
    memset(bex__rpc_hdr_of(dst), 0xA5, usable + BEX_RPC_HDR_LEN);
    struct dres d;
    dres_init(&d, ctx, dst);
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO, pattern_body(ctx, BIG, 3), BIG, dst, CAP, NULL,
                               d_done, &d, NULL));
    CHECK(wait_count(&d.w, &d.calls, 1, 20000) == 0);
    CHECK_EQ(d.status, -EMSGSIZE);
    CHECK(d.body == dst);
    CHECK_EQ(d.len, 0);
    CHECK_EQ(d.armed_at_done, 0);
    /* over RDMA the refusal may be written into the header room; the
     * body and everything past it stay as they were */
    CHECK(all_bytes(dst, usable, 0xA5));
    /* exactly the capacity fits */
    dres_init(&d, ctx, dst);
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO, pattern_body(ctx, CAP, 4), CAP, dst, CAP, NULL,
                               d_done, &d, NULL));
    CHECK(wait_count(&d.w, &d.calls, 1, 20000) == 0);
    CHECK_OK(d.status);
    CHECK_EQ(d.len, CAP);
    CHECK(check_pattern(dst, CAP, 4) == 0);
    CHECK(all_bytes(dst + CAP, usable - CAP, 0xA5));
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_rpc_free(dst);
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
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
    bex_rpc_endpoint eps[1];
    bex_rpc_channel_config cc = chan_cfg(eps, &sp, 1);
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    enum { CAP = 1 << 20, LEN = 256 << 10 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    /* warm the connection so the deadline below is about the answer */
    struct dres d;
    dres_init(&d, ctx, dst);
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO, NULL, 0, dst, CAP, NULL, d_done, &d, NULL));
    CHECK(wait_count(&d.w, &d.calls, 1, 20000) == 0);
    CHECK_OK(d.status);
    uint32_t delay = 400 * time_scale();
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
    dres_init(&d, ctx, dst);
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO, pattern_body(ctx, 5000, 11), 5000, dst, CAP, NULL,
                               d_done, &d, NULL));
    CHECK(wait_count(&d.w, &d.calls, 1, 20000) == 0);
    CHECK_OK(d.status);
    CHECK(check_pattern(dst, 5000, 11) == 0);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_rpc_free(dst);
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
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
    bex_rpc_endpoint eps[2];
    bex_rpc_channel_config cc = chan_cfg(eps, sp, 2);
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    enum { CAP = 64 << 10 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    memset(dst, 0x77, CAP);
    struct dres d;
    dres_init(&d, ctx, dst);
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_WRITE, NULL, 0, dst, CAP, NULL, d_done, &d, NULL));
    CHECK(wait_count(&d.w, &d.calls, 1, 20000) == 0);
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
    CHECK(es[0].attempts == 1 && es[0].failures == 1 && es[1].attempts == 1 &&
          es[1].answers == 1);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_rpc_free(dst);
    CHECK_OK(bex_ctx_destroy(ctx));
    int rc = stop_server(&sp[0], false);
    rc |= stop_server(&sp[1], false);
    return rc ? 1 : 0;
}

BEX_TEST_MAIN({"into", t_into}, {"too_large", t_too_large}, {"cancel", t_cancel},
              {"deadline", t_deadline}, {"retry", t_retry})
