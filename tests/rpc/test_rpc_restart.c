/* SPDX-License-Identifier: Apache-2.0 */
/* An RPC server destroyed and created again at the same address, its
 * context kept: a channel that called the first one reaches the second
 * within a few calls (ones racing the change may fail). same_ctx: the
 * channel on the server's own context (a primary's forward channel to a
 * replica of its process, tests/ps/test_ps_primary.c); two_ctx: on
 * another. One process, TCP natively (tcp) or RDMA in the VM (rxe). */
#include "bex/rpc.h"
#include "sock/echo.h"

enum { SVC = 7, M_ECHO = 1 };

/* How long the channel keeps calling the new server (scaled). */
#define REACH_MS 5000

static void h_echo(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    bex_rpc_reply(req, 0, body, len);
}

static bex_rpc_server *server_at(bex_ctx *ctx, bex_addr *at)
{
    bex_rpc_server *srv;
    CHECK_OK(bex_rpc_server_create(ctx, NULL, &srv));
    CHECK_OK(bex_rpc_server_register(srv, SVC, M_ECHO, 0, h_echo, NULL));
    CHECK_OK(bex_rpc_server_listen(srv, at));
    bex_rpc_server_addr(srv, at);
    return srv;
}

/* Calls until one is answered (its number) or REACH_MS passed (0). */
static int reach(bex_ctx *ctx, bex_rpc_channel *ch)
{
    uint64_t end = pair_now_ms() + REACH_MS * time_scale();
    for (int n = 1;; n++) {
        void *b = bex_rpc_alloc(ctx, 16), *resp = NULL;
        CHECK(b);
        memset(b, 5, 16);
        size_t rlen = 0;
        int rc = bex_rpc_call_sync(ch, SVC, M_ECHO, b, 16, NULL, &resp, &rlen);
        if (rc == 0) {
            CHECK_EQ(rlen, 16);
            bex_rpc_free(resp);
            return n;
        }
        if (resp)
            bex_rpc_free(resp);
        if (pair_now_ms() > end) {
            fprintf(stderr, "call %d: %d\n", n, rc);
            return 0;
        }
        pair_sleep_ms(50);
    }
}

static int restart(bool same)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx *sctx = local_ctx(&base, a0);
    bex_ctx *cctx = same ? sctx : local_ctx(&base, a1);
    bex_addr at = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    bex_rpc_server *srv = server_at(sctx, &at);
    bex_rpc_endpoint ep = {.addr = at};
    bex_rpc_channel_config cc = {.endpoints = &ep,
                                 .n_endpoints = 1,
                                 .request_timeout_ms = 2000 * time_scale(),
                                 .connect_timeout_ms = 2000 * time_scale()};
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(cctx, &cc, &ch));
    CHECK_EQ(reach(cctx, ch), 1);
    CHECK_OK(bex_rpc_server_destroy(srv));
    srv = server_at(sctx, &at); /* the same port */
    int n = reach(cctx, ch);
    fprintf(stderr, "new server: %s after %d call(s)\n", n ? "reached" : "NOT reached", n);
    CHECK(n > 0);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_rpc_server_destroy(srv));
    if (cctx != sctx)
        bex_ctx_destroy(cctx);
    bex_ctx_destroy(sctx);
    return 0;
}

static int same_ctx(void)
{
    return restart(true);
}

static int two_ctx(void)
{
    return restart(false);
}

BEX_TEST_MAIN(BEX_CASE(same_ctx), BEX_CASE(two_ctx))
