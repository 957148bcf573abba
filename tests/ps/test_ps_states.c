/* SPDX-License-Identifier: Apache-2.0 */
/* The PS state machines (docs/architecture.md, "Lifecycles"), one
 * process, no peer: a move asked for in a state that refuses it is
 * refused with a clear error and a WARN naming the state.
 *
 * shard_catchup: bex_ps_shard_catchup on a shard that awaits none
 *   (created without BEX_PS_SHARD_CATCHUP) and a second time after its
 *   catch-up ended: -EINVAL, and the log says the shard is SERVING; the
 *   first, awaited one (no peers: the shard serves its own rows) runs.
 * forward_not_backup: a Forward (well-formed) sent over RPC to a replica
 *   that is no backup (BEX_PS_ROLE_ANY) is refused -EPERM, counted in
 *   not_primary and logged as such; nothing applied. */
#include <stdio.h>
#include <string.h>

#include "bex/ps.h"
#include "bex/rpc.h"
#include "harness.h"
#include "ps/ps_internal.h"

static const bex_ps_table_config TI = {.id = 1, .dim = 2, .optimizer = BEX_PS_SGD, .lr = 1.0f};

static char logged[4096];

static void log_keep(int level, const char *msg, void *arg)
{
    (void)arg;
    (void)level;
    size_t n = strlen(logged);
    snprintf(logged + n, sizeof logged - n, "%s\n", msg);
}

static int log_has(const char *want)
{
    if (strstr(logged, want))
        return 1;
    fprintf(stderr, "log lacks \"%s\":\n%s", want, logged);
    return 0;
}

static bex_ctx *ctx_new(void)
{
    /* generous deadlines: a loaded host must not fail the connection */
    bex_ctx_config c = {
        .transport = BEX_TRANSPORT_TCP, .keepalive_timeout_ms = 60000, .connect_timeout_ms = 20000};
    bex_addr_parse("127.0.0.1", 0, &c.local_addr);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

static bex_ps_shard *shard_new(uint32_t flags)
{
    bex_ps_shard_config pc = {.shard = 0,
                              .n_shards = 1,
                              .tables = &TI,
                              .n_tables = 1,
                              .flags = flags,
                              .log_fn = log_keep};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    return s;
}

static int t_shard_catchup(void)
{
    bex_ctx *ctx = ctx_new();
    bex_ps_catchup_config cc = BEX_PS_CATCHUP_CONFIG_INIT;
    bex_ps_shard *s = shard_new(0);
    logged[0] = 0;
    CHECK_EQ(bex_ps_shard_catchup(s, ctx, &cc), -EINVAL);
    CHECK(log_has("catch-up refused (-EINVAL): the shard is SERVING"));
    bex_ps_shard_destroy(s);

    s = shard_new(BEX_PS_SHARD_CATCHUP);
    logged[0] = 0;
    CHECK(bex_ps_shard_catchup(s, ctx, &cc) != -EINVAL); /* awaited: runs */
    CHECK(!strstr(logged, "catch-up refused"));
    logged[0] = 0;
    CHECK_EQ(bex_ps_shard_catchup(s, ctx, &cc), -EINVAL); /* a second one */
    CHECK(log_has("catch-up refused (-EINVAL): the shard is SERVING"));
    bex_ps_shard_destroy(s);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

/* A Forward of one SGD row (lsn 1 of session 7) to a replica of role
 * ANY, over loopback TCP. */
static int t_forward_not_backup(void)
{
    bex_ctx *ctx = ctx_new();
    bex_ps_shard *s = shard_new(0);
    bex_rpc_server *srv;
    CHECK_OK(bex_rpc_server_create(ctx, NULL, &srv));
    CHECK_OK(bex_ps_shard_register(s, srv, ctx));
    bex_addr a;
    CHECK_OK(bex_addr_parse("127.0.0.1", 0, &a));
    CHECK_OK(bex_rpc_server_listen(srv, &a));
    bex_rpc_server_addr(srv, &a);
    bex_rpc_endpoint ep = {.addr = a};
    bex_rpc_channel_config cc = {.endpoints = &ep,
                                 .n_endpoints = 1,
                                 .request_timeout_ms = 30000,
                                 .connect_timeout_ms = 20000,
                                 .max_attempts = 1};
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));

    size_t len = BEX__PS_FWD_HDR_LEN + BEX__PS_HDR_LEN + 8 + 4 * TI.dim;
    uint8_t *b = bex_rpc_alloc(ctx, len);
    CHECK(b);
    memset(b, 0, len);
    bex__ps_fwd_put(b, &(struct bex__ps_fwd_hdr){.session = 7, .lsn = 1});
    bex__ps_hdr_put(b + BEX__PS_FWD_HDR_LEN,
                    &(struct bex__ps_hdr){.table = TI.id, .n = 1, .dim = TI.dim});
    bex__ps_put64(b + BEX__PS_FWD_HDR_LEN + BEX__PS_HDR_LEN, 42);
    logged[0] = 0;
    void *resp = NULL;
    CHECK_EQ(bex_rpc_call_sync(ch, BEX_PS_SERVICE, BEX_PS_M_FORWARD, b, len, NULL, &resp, NULL),
             -EPERM);
    bex_rpc_free(resp);
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(s, &st);
    CHECK_EQ(st.not_primary, 1);
    CHECK_EQ(st.pushes, 0);
    CHECK(log_has("a Forward refused: this replica is not a backup"));

    bex_rpc_channel_destroy(ch);
    CHECK_OK(bex_rpc_server_destroy(srv));
    bex_ps_shard_destroy(s);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

BEX_TEST_MAIN({"shard_catchup", t_shard_catchup}, {"forward_not_backup", t_forward_not_backup})
