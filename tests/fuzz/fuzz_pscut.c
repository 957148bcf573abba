/* SPDX-License-Identifier: Apache-2.0 */
/* Fuzz target: a PS shard's Cut method (BEX_PS_M_CUT, docs/protocol.md,
 * "Consistent cuts"), the body a peer sent. The shard (one of one, role
 * any, no cut_dir) must refuse or ignore every body without holding a
 * Push, writing a file or counting a cut.
 *
 * Checks: -EINVAL exactly when the body is not a Cut header of its op's
 * length (bex__ps_cut_get); else PREPARE -ENOTSUP (no cut_dir), COMMIT
 * and JOINED -EOPNOTSUPP (no handler to answer later), ABORT 0, JOIN
 * -EPERM (not a primary); no snapshot or failure counted. */
#include <arpa/inet.h>
#include <errno.h>
#include <string.h>

#include "bex/ps.h"
#include "bex/sock.h"
#include "fuzz.h"
#include "ps/ps_internal.h"

static const bex_ps_table_config tables[] = {{.id = 1, .dim = 4, .optimizer = BEX_PS_SGD}};

static void quiet(int level, const char *msg, void *arg)
{
    (void)level;
    (void)msg;
    (void)arg;
}

static bex_ctx *ctx_once(void)
{
    static bex_ctx *ctx;
    if (!ctx) {
        bex_ctx_config c = {.transport = BEX_TRANSPORT_TCP, .log_fn = quiet};
        c.local_addr = bex_addr_loopback4(0);
        FZ_CHECK(bex_ctx_create(&c, &ctx) == 0);
    }
    return ctx;
}

static int want(const uint8_t *data, size_t size)
{
    struct bex__ps_cut_hdr h;
    if (bex__ps_cut_get(data, size, &h) ||
        size != (h.op == BEX__PS_CUT_JOIN ? BEX__PS_JOIN_LEN : BEX__PS_CUT_HDR_LEN))
        return -EINVAL;
    switch (h.op) {
    case BEX__PS_CUT_PREPARE:
        return -ENOTSUP;
    case BEX__PS_CUT_ABORT:
        return 0;
    case BEX__PS_CUT_JOIN:
        return -EPERM;
    default:
        return -EOPNOTSUPP;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    bex_ctx *ctx = ctx_once();
    bex_ps_shard_config pc = {
        .shard = 0, .n_shards = 1, .tables = tables, .n_tables = 1, .log_fn = quiet};
    bex_ps_shard *s;
    FZ_CHECK(bex_ps_shard_create(&pc, &s) == 0);
    void *resp = NULL;
    size_t rlen = 0;
    int rc = bex_ps_shard_serve(s, ctx, BEX_PS_M_CUT, data, size, &resp, &rlen);
    FZ_CHECK(rc == want(data, size));
    FZ_CHECK(rc ? resp == NULL : rlen == BEX__PS_CUT_HDR_LEN);
    bex_rpc_free(resp);
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(s, &st);
    FZ_CHECK(st.snaps == 0 && st.snap_failures == 0);
    bex_ps_shard_destroy(s);
    return 0;
}
