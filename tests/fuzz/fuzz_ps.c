/* SPDX-License-Identifier: Apache-2.0 */
/* Fuzz target: a parameter-server shard's request handling
 * (bex_ps_shard_serve: the strict decoder of Fetch/Push bodies, then the
 * tables and optimizers). The first byte picks the method (even: Fetch,
 * odd: Push), the rest is the request body a peer sent. Each input gets a
 * fresh shard (one shard of one: every key is its own) with two tables,
 * 1: dim 4, SGD; 2: dim 3, Adagrad; at most 64 rows each.
 *
 * Checks: the result is 0, -EINVAL, -E2BIG or -ENOSPC; 0 exactly when the
 * body is well formed for a known table of that dim (bex__ps_decode and the
 * table check) and its new keys fit; an answer carries the request's
 * table, count and dim and the length they imply; a refused request
 * changes nothing (no row, no count but the refusal's); a Fetch of the
 * same keys again returns the same rows (Fetch changes nothing once a row
 * exists). */
#include <arpa/inet.h>
#include <errno.h>
#include <stdbool.h>
#include <string.h>

#include "bex/ps.h"
#include "bex/sock.h"
#include "fuzz.h"
#include "ps/ps_internal.h"

static const bex_ps_table_config tables[] = {
    {.id = 1, .dim = 4, .optimizer = BEX_PS_SGD, .max_rows = 64},
    {.id = 2, .dim = 3, .optimizer = BEX_PS_ADAGRAD, .max_rows = 64},
};

static void quiet(int level, const char *msg, void *arg)
{
    (void)level;
    (void)msg;
    (void)arg;
}

/* A context for bex_rpc_alloc, made once (TCP on loopback: no device, no
 * socket until something listens or connects). */
static bex_ctx *ctx_once(void)
{
    static bex_ctx *ctx;
    if (!ctx) {
        bex_ctx_config c = {.transport = BEX_TRANSPORT_TCP, .log_fn = quiet};
        bex_addr_parse("127.0.0.1", 0, &c.local_addr);
        FZ_CHECK(bex_ctx_create(&c, &ctx) == 0);
    }
    return ctx;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    bex_ctx *ctx = ctx_once();
    uint32_t method = (data[0] & 1) ? BEX_PS_M_PUSH : BEX_PS_M_FETCH;
    size_t len = size - 1;
    void *body = bex_rpc_alloc(ctx, len);
    FZ_CHECK(body);
    memcpy(body, data + 1, len);
    bex_ps_shard_config pc = {
        .shard = 0, .n_shards = 1, .tables = tables, .n_tables = 2, .log_fn = quiet};
    bex_ps_shard *s;
    FZ_CHECK(bex_ps_shard_create(&pc, &s) == 0);
    struct bex__ps_hdr h;
    int dec = bex__ps_decode(method, body, len, &h);
    FZ_CHECK(dec == 0 || dec == -EINVAL || dec == -E2BIG);
    bool table_ok = dec == 0 && ((h.table == 1 && h.dim == 4) || (h.table == 2 && h.dim == 3));
    void *resp = NULL;
    size_t rlen = 0;
    int rc = bex_ps_shard_serve(s, ctx, method, body, len, &resp, &rlen);
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(s, &st);
    FZ_CHECK(rc == 0 || rc == -EINVAL || rc == -E2BIG || rc == -ENOSPC);
    if (dec)
        FZ_CHECK(rc == dec);
    else if (!table_ok)
        FZ_CHECK(rc == -EINVAL);
    if (rc) {
        FZ_CHECK(resp == NULL && st.rows == 0 && st.fetches == 0 && st.pushes == 0);
        FZ_CHECK(st.malformed == (rc == -ENOSPC ? 0u : 1u));
    } else {
        FZ_CHECK(table_ok);
        FZ_CHECK(bex__ps_check_resp(method, resp, rlen, h.table, h.n, h.dim) == 0);
        FZ_CHECK(st.rows <= h.n && st.malformed == 0);
        FZ_CHECK(method == BEX_PS_M_FETCH ? st.fetches == 1 : st.pushes == 1);
        if (method == BEX_PS_M_FETCH) {
            /* the same keys again: the same rows, no row made */
            void *again = bex_rpc_alloc(ctx, len), *r2 = NULL;
            size_t l2 = 0;
            FZ_CHECK(again);
            memcpy(again, data + 1, len);
            FZ_CHECK(bex_ps_shard_serve(s, ctx, method, again, len, &r2, &l2) == 0);
            FZ_CHECK(l2 == rlen && memcmp(r2, resp, rlen) == 0);
            bex_ps_shard_stats st2;
            bex_ps_shard_stats_get(s, &st2);
            FZ_CHECK(st2.rows == st.rows);
            bex_rpc_free(again);
            bex_rpc_free(r2);
        }
    }
    bex_rpc_free(resp);
    bex_rpc_free(body);
    bex_ps_shard_destroy(s);
    return 0;
}
