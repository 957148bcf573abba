/* SPDX-License-Identifier: Apache-2.0 */
/* The counters Figure 11's per-message counts rest on, over RDMA (rxe;
 * one process, two contexts: a server on ADDR0, a client on ADDR1).
 *
 * - keepalive_count: an idle connection's keepalive WRITEs are counted
 *   (bex_sock_stats.keepalive_writes), each a doorbell of its own and in
 *   no SEND or WRITE count, so that a benchmark can tell them from its
 *   messages' posts. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sock/echo.h"

#define MSG_LEN 256

static struct in_addr addr0, addr1;

struct hold_srv {
    struct local_srv base; /* first: what the shared callbacks take */
    _Atomic long held;
    _Atomic bool release;
};

/* The first message holds the thread until released; every one is echoed
 * (bex frees the buffer once sent: no on_send_done here). */
static void hold_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct hold_srv *h = user;
    if (atomic_load(&h->held) == 0) {
        waiter_add(&h->base.w, &h->held, 1);
        unsigned limit = 60000 * time_scale();
        for (unsigned t = 0; !atomic_load(&h->release) && t < limit; t++)
            pair_sleep_ms(1);
        CHECK(atomic_load(&h->release));
    }
    if (bex_sock_send(s, buf, len, NULL) != 0)
        bex_mem_free(buf);
}

struct cli {
    struct local_cli base;
    _Atomic long recvd, done, bad;
};

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct cli *c = user;
    if (len != MSG_LEN)
        atomic_fetch_add(&c->bad, 1);
    bex_mem_free(buf);
    waiter_add(c->base.w, &c->recvd, 1);
}

static void cli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu;
    struct cli *c = user;
    if (status != 0)
        atomic_fetch_add(&c->bad, 1);
    bex_mem_free(buf);
    waiter_add(c->base.w, &c->done, 1);
}

/* Counters read apart while the I/O thread may be posting: two snapshots
 * 1 ms apart until they agree. */
static void still_stats(bex_ctx *ctx, bex_sock_stats *out)
{
    bex_sock_stats again;
    for (int i = 0; i < 2000; i++) {
        bex_ctx_stats(ctx, out);
        pair_sleep_ms(1);
        bex_ctx_stats(ctx, &again);
        if (memcmp(out, &again, sizeof again) == 0)
            return;
    }
    fprintf(stderr, "the counters never held still for 1 ms\n");
    exit(1);
}

#define KA_WANT 3
static int keepalive_count(void)
{
    PAIR_NEED(pair_addrs(&addr0, &addr1));
    if (pair_tcp())
        return bex_test_skip("keepalive WRITEs are RDMA's");
    bex_ctx_config cfg = {.io_threads = 1, .keepalive_ms = 100};
    struct hold_srv h = {.base.w = WAITER_INIT, .release = true};
    bex_ctx *sctx = local_ctx(&cfg, addr0), *cctx = local_ctx(&cfg, addr1);
    bex_addr a;
    bex_listener *l = local_listen(sctx, addr0, &h.base, hold_recv, &a);
    struct cli c = {.base.w = &h.base.w};
    bex_sock_ops ops = {.on_connect = local_cli_connect,
                        .on_recv = cli_recv,
                        .on_send_done = cli_done,
                        .on_close = local_cli_closed};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(cctx, &a, &ops, &c, &s));
    CHECK_OK(wait_count(&h.base.w, &c.base.connected, 1, 10000));
    local_send(cctx, s, MSG_LEN);
    CHECK_OK(wait_count(&h.base.w, &c.recvd, 1, 10000));
    CHECK_OK(wait_count(&h.base.w, &c.done, 1, 10000));
    bex_sock_stats s0, s1;
    still_stats(cctx, &s0);
    /* idle now: what the client posts from here is keepalives (and
     * nothing else: its one message was answered and acknowledged) */
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    do {
        pair_sleep_ms(10);
        still_stats(cctx, &s1);
    } while (s1.keepalive_writes < s0.keepalive_writes + KA_WANT && pair_now_ms() < end);
    uint64_t ka = s1.keepalive_writes - s0.keepalive_writes;
    fprintf(stderr, "idle: %llu keepalive writes, %llu WRITEs, %llu SENDs, %llu doorbells\n",
            (unsigned long long)ka, (unsigned long long)(s1.writes_posted - s0.writes_posted),
            (unsigned long long)(s1.sends_posted - s0.sends_posted),
            (unsigned long long)(s1.post_send_calls - s0.post_send_calls));
    CHECK(ka >= KA_WANT);
    CHECK_EQ(s1.writes_posted - s0.writes_posted, 0); /* (data WRITEs only) */
    CHECK_EQ(s1.sends_posted - s0.sends_posted, 0);
    CHECK_EQ(s1.post_send_calls - s0.post_send_calls, ka);
    CHECK_EQ(atomic_load(&c.bad), 0);
    bex_sock_close(s);
    CHECK_OK(wait_count(&h.base.w, &c.base.closed, 1, 10000));
    CHECK_OK(wait_count(&h.base.w, &h.base.closed, 1, 10000));
    CHECK_OK(bex_listener_close(l));
    CHECK_OK(bex_ctx_destroy(cctx));
    CHECK_OK(bex_ctx_destroy(sctx));
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(keepalive_count))
