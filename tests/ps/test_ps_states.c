/* SPDX-License-Identifier: Apache-2.0 */
/* The PS state machines (docs/architecture.md, "Lifecycles"), one
 * process, no peer: a move asked for in a state that refuses it is
 * refused with a clear error and a WARN naming the state.
 *
 * shard_catchup: bex_ps_shard_catchup on a shard that awaits none
 *   (created without BEX_PS_SHARD_CATCHUP) and a second time after its
 *   catch-up ended: -EINVAL, and the log says the shard is SERVING; the
 *   first, awaited one (no peers: the shard serves its own rows) runs. */
#include <stdio.h>
#include <string.h>

#include "bex/ps.h"
#include "harness.h"

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
    bex_ctx_config c = {.transport = BEX_TRANSPORT_TCP};
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

BEX_TEST_MAIN({"shard_catchup", t_shard_catchup})
