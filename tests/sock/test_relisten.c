/* SPDX-License-Identifier: Apache-2.0 */
/* A listener closed and opened again on the same address, its context
 * kept: sockets that connect to that address afterwards reach the new
 * listener (within a few attempts: ones racing the change may fail).
 * same_ctx: the connecting socket on the listener's own context;
 * two_ctx: on another context; ctx_restart: the listener's context
 * destroyed and created again (the comparison that always worked). One
 * process, TCP natively (label tcp) or RDMA in the VM (rxe). */
#include "echo.h"

/* How long a client keeps trying to reach the new listener (scaled). */
#define REACH_MS 5000

struct cli {
    struct local_cli base;
    _Atomic long echoed, failed;
};

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s, (void)len;
    struct cli *c = user;
    bex_mem_free(buf);
    waiter_add(c->base.w, &c->echoed, 1);
}

static void cli_connect(bex_sock *s, int err, void *user)
{
    (void)s;
    struct cli *c = user;
    if (err)
        waiter_add(c->base.w, &c->failed, 1);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    (void)s, (void)err;
    struct cli *c = user;
    waiter_add(c->base.w, &c->failed, 1);
}

static void srv_echo(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)user;
    if (bex_sock_send(s, buf, len, NULL) != 0)
        bex_mem_free(buf);
}

/* One attempt: a socket from cctx to at sends 64 bytes; true when they
 * come back, false when the socket fails (or nothing within 2 s). */
static bool try_echo(bex_ctx *cctx, const bex_addr *at, struct waiter *w)
{
    struct cli c = {.base.w = w};
    bex_sock_ops ops = {.on_connect = cli_connect,
                        .on_recv = cli_recv,
                        .on_error = cli_error,
                        .on_close = local_cli_closed};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(cctx, at, &ops, &c, &s));
    void *b = bex_sock_alloc(cctx, 64);
    CHECK(b);
    memset(b, 7, 64);
    if (bex_sock_send(s, b, 64, NULL)) { /* the socket failed already */
        bex_mem_free(b);
        atomic_store(&c.failed, 1);
    }
    uint64_t end = pair_now_ms() + 2000 * time_scale();
    while (!atomic_load(&c.echoed) && !atomic_load(&c.failed) && pair_now_ms() < end)
        pair_sleep_ms(5);
    bool ok = atomic_load(&c.echoed) > 0;
    bex_sock_close(s);
    CHECK_EQ(wait_count(w, &c.base.closed, 1, 5000), 0);
    return ok;
}

/* Attempts until one is echoed (true) or REACH_MS passed (false). */
static bool reach(bex_ctx *cctx, const bex_addr *at, struct waiter *w, int *tries)
{
    uint64_t end = pair_now_ms() + REACH_MS * time_scale();
    for (*tries = 1;; ++*tries) {
        if (try_echo(cctx, at, w))
            return true;
        if (pair_now_ms() > end)
            return false;
        pair_sleep_ms(50);
    }
}

/* The accepted sockets of v are closed: each closed itself once its
 * client's close came (echo_srv_error). */
static void srv_wait_closed(struct local_srv *v)
{
    CHECK_EQ(wait_count(&v->w, &v->closed, atomic_load(&v->accepted), 5000), 0);
}

enum mode { SAME_CTX, TWO_CTX, CTX_RESTART };

static int relisten(enum mode m)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    bex_ctx *sctx = local_ctx(NULL, a0);
    bex_ctx *cctx = m == SAME_CTX ? sctx : local_ctx(NULL, a1);
    struct local_srv v1 = {.w = WAITER_INIT}, v2 = {.w = WAITER_INIT};
    bex_addr at;
    bex_listener *l = local_listen(sctx, a0, &v1, srv_echo, &at);
    int tries;
    CHECK(reach(cctx, &at, &v1.w, &tries));
    CHECK_EQ(tries, 1);
    CHECK_OK(bex_listener_close(l));
    srv_wait_closed(&v1);
    if (m == CTX_RESTART) {
        bex_ctx_destroy(sctx);
        sctx = local_ctx(NULL, a0);
    }
    /* the same address, port included */
    v2.on_recv = srv_echo;
    bex_listener_ops lops = {.on_accept = local_srv_accept};
    CHECK_OK(bex_listen(sctx, &at, &lops, &v2, &l));
    bool ok = reach(cctx, &at, &v1.w, &tries);
    fprintf(stderr, "new listener: %s after %d attempt(s), %ld accepted (old one: %ld)\n",
            ok ? "reached" : "NOT reached", tries, atomic_load(&v2.accepted),
            atomic_load(&v1.accepted));
    CHECK(ok);
    CHECK(atomic_load(&v2.accepted) >= 1);
    CHECK_OK(bex_listener_close(l));
    srv_wait_closed(&v2);
    if (cctx != sctx)
        bex_ctx_destroy(cctx);
    bex_ctx_destroy(sctx);
    return 0;
}

static int same_ctx(void)
{
    return relisten(SAME_CTX);
}

static int two_ctx(void)
{
    return relisten(TWO_CTX);
}

static int ctx_restart(void)
{
    return relisten(CTX_RESTART);
}

BEX_TEST_MAIN(BEX_CASE(same_ctx), BEX_CASE(two_ctx), BEX_CASE(ctx_restart))
