/* SPDX-License-Identifier: Apache-2.0 */
/* The ids of the Pushes a shard applied (issue 23, items 3 and 4), in one
 * process through bex_ps_shard_serve:
 *
 * stale: a Push more than the window (1024 ids) behind its client's highest
 *   is refused -ESTALE and counted, not applied again.
 * stale_snapshot: the same on a shard restarted from its snapshot.
 * spoof: a peer that knows a victim's client id but not its token sends a
 *   huge sequence and an empty Push with the victim's next sequence: the
 *   victim's Pushes are still applied, each once.
 * flood: fresh client ids past the shard's rate are refused -EAGAIN
 *   (retriable) and never evict an honest client with a retriable Push; a
 *   full table refuses new clients the same way until the retry horizon
 *   of its idlest client has passed.
 * foreign: shard 0 of 2 refuses -EINVAL a Fetch or Push with a key of shard
 *   1's, alone or beside its own keys, new or beside rows it holds, and
 *   makes no row for it; its own keys are served (a Fetch checks only the
 *   keys without a row, issue 25 item 5). */
#include "ps_test.h"

static const bex_ps_table_config TD = {.id = 1, .dim = 2, .optimizer = BEX_PS_SGD, .lr = 1.0f};

/* a clock the test moves (bex__rpc_clock_hook) */
static uint64_t now_ns = 1000000000ull;
static uint64_t test_clock(void)
{
    return now_ns;
}

/* a client: its id and its token */
struct who {
    uint64_t client, tok[2];
};
static const struct who VICTIM = {0x1234, {0x9b1f3c0d5e7a2468ull, 0x13579bdf2468ace0ull}};

/* A Push of key k (gradient 1) with id (w, seq). */
static int push(bex_ps_shard *s, bex_ctx *ctx, const struct who *w, uint64_t seq, uint32_t n)
{
    struct bex__ps_hdr h = {.table = TD.id,
                            .n = n,
                            .dim = TD.dim,
                            .flags = BEX__PS_F_ID,
                            .id_client = w->client,
                            .id_seq = seq,
                            .id_tok = {w->tok[0], w->tok[1]}};
    size_t len = bex__ps_req_len(BEX_PS_M_PUSH, n, TD.dim) + BEX__PS_ID_LEN;
    uint8_t *b = malloc(len);
    CHECK(b);
    bex__ps_hdr_put(b, &h);
    uint8_t *p = b + bex__ps_keys_off(&h);
    if (n) {
        bex__ps_put64(p, 7);
        bex__ps_putf(p + 8, 1.0f);
        bex__ps_putf(p + 12, 1.0f);
    }
    void *resp = NULL;
    size_t rlen = 0;
    int rc = bex_ps_shard_serve(s, ctx, BEX_PS_M_PUSH, b, len, &resp, &rlen);
    free(b);
    bex_rpc_free(resp);
    return rc;
}

static uint64_t pushes(bex_ps_shard *s)
{
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(s, &st);
    return st.pushes;
}

static bex_ps_shard_stats stats(bex_ps_shard *s)
{
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(s, &st);
    return st;
}

static bex_ps_shard *shard_new(const char *snap)
{
    bex_ps_shard_config pc = {
        .shard = 0, .n_shards = 1, .tables = &TD, .n_tables = 1, .snapshot_path = snap};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    return s;
}

static int t_stale(void)
{
    bex_ctx *ctx = client_ctx();
    bex_ps_shard *s = shard_new(NULL);
    CHECK_OK(push(s, ctx, &VICTIM, 900, 1));
    CHECK_OK(push(s, ctx, &VICTIM, 2000, 1));
    CHECK_EQ(pushes(s), 2);
    /* 1100 behind: applied or not, the shard cannot tell */
    CHECK_EQ(push(s, ctx, &VICTIM, 900, 1), -ESTALE);
    CHECK_EQ(push(s, ctx, &VICTIM, 975, 1), -ESTALE); /* never applied: cannot tell either */
    CHECK_EQ(pushes(s), 2);
    CHECK_EQ(stats(s).stale_ids, 2);
    CHECK_OK(push(s, ctx, &VICTIM, 2000, 1)); /* a retry within the window */
    CHECK_OK(push(s, ctx, &VICTIM, 977, 1));  /* 1023 behind: in the window, applied */
    CHECK_EQ(pushes(s), 3);
    CHECK_EQ(stats(s).dup_ids, 1);
    bex_ps_shard_destroy(s);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

static int t_stale_snapshot(void)
{
    bex_ctx *ctx = client_ctx();
    char tmpl[] = "/tmp/bex-ps-dedup-XXXXXX";
    CHECK(mkdtemp(tmpl));
    char path[128];
    snprintf(path, sizeof path, "%s/snap", tmpl);
    bex_ps_shard *s = shard_new(path);
    CHECK_OK(push(s, ctx, &VICTIM, 900, 1));
    CHECK_OK(push(s, ctx, &VICTIM, 2000, 1));
    CHECK_OK(bex_ps_shard_snapshot(s, path));
    bex_ps_shard_destroy(s);
    s = shard_new(path);
    CHECK_EQ(push(s, ctx, &VICTIM, 900, 1), -ESTALE);
    CHECK_OK(push(s, ctx, &VICTIM, 2000, 1));
    CHECK_EQ(pushes(s), 0);
    bex_ps_shard_stats st = stats(s);
    CHECK(st.stale_ids == 1 && st.dup_ids == 1);
    bex_ps_shard_destroy(s);
    unlink(path);
    rmdir(tmpl);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

static int t_spoof(void)
{
    bex_ctx *ctx = client_ctx();
    bex_ps_shard *s = shard_new(NULL);
    /* the victim's id, not its token (a token of zero too) */
    struct who thief = {VICTIM.client, {1, 2}}, zero = {VICTIM.client, {0, 0}};
    CHECK_OK(push(s, ctx, &VICTIM, 1, 1));
    /* the victim's next sequence, empty, before the victim; a huge one */
    CHECK_OK(push(s, ctx, &thief, 2, 0));
    CHECK_OK(push(s, ctx, &zero, 2, 0));
    CHECK_OK(push(s, ctx, &thief, UINT64_MAX - 1, 0));
    CHECK_OK(push(s, ctx, &zero, 1ull << 62, 1));
    uint64_t before = pushes(s);
    CHECK_OK(push(s, ctx, &VICTIM, 2, 1)); /* not pre-empted */
    CHECK_OK(push(s, ctx, &VICTIM, 3, 1)); /* not locked out */
    CHECK_EQ(pushes(s), before + 2);
    CHECK_OK(push(s, ctx, &VICTIM, 3, 1)); /* its own retry: once */
    CHECK_EQ(pushes(s), before + 2);
    bex_ps_shard_destroy(s);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

/* A shard of cap clients, horizon_ms retry horizon, rate new ids a second. */
static bex_ps_shard *shard_lim(uint32_t cap, uint32_t horizon_ms, uint32_t rate)
{
    bex_ps_shard_config pc = {.shard = 0,
                              .n_shards = 1,
                              .tables = &TD,
                              .n_tables = 1,
                              .dedup_clients = cap,
                              .retry_horizon_ms = horizon_ms,
                              .new_clients_per_sec = rate};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    return s;
}

static int t_flood(void)
{
    bex_ctx *ctx = client_ctx();
    bex__rpc_clock_hook(test_clock);
    /* the default bounds: 5000 fresh ids at once never evict the victim */
    bex_ps_shard *s = shard_new(NULL);
    CHECK_OK(push(s, ctx, &VICTIM, 1, 1));
    int refused = 0;
    for (uint64_t i = 0; i < 5000; i++) {
        struct who w = {0x10000 + i, {i, ~i}};
        int rc = push(s, ctx, &w, 1, 0);
        CHECK(rc == 0 || rc == -EAGAIN);
        refused += rc == -EAGAIN;
    }
    CHECK(refused > 0);
    CHECK_EQ(stats(s).clients_refused, (uint64_t)refused);
    uint64_t before = pushes(s);
    CHECK_OK(push(s, ctx, &VICTIM, 1, 1)); /* its retry: not applied again */
    CHECK_EQ(pushes(s), before);
    bex_ps_shard_destroy(s);
    /* 4 clients at most, a horizon of 10 s: a full table refuses a fifth
     * with -EAGAIN until the idlest has been unseen for 10 s */
    s = shard_lim(4, 10000, 1000000);
    CHECK_OK(push(s, ctx, &VICTIM, 1, 1));
    for (uint64_t i = 0; i < 3; i++)
        CHECK_OK(push(s, ctx, &(struct who){0x20000 + i, {i, i}}, 1, 0));
    struct who late = {0x30000, {7, 7}};
    CHECK_EQ(push(s, ctx, &late, 1, 1), -EAGAIN);
    now_ns += 9000000000ull;
    CHECK_EQ(push(s, ctx, &late, 1, 1), -EAGAIN);
    before = pushes(s);
    CHECK_OK(push(s, ctx, &VICTIM, 1, 1)); /* still known: once */
    CHECK_EQ(pushes(s), before);
    now_ns += 2000000000ull;
    /* the others are 11 s idle now, the victim 2 s: one of them goes */
    CHECK_OK(push(s, ctx, &late, 1, 1));
    CHECK_OK(push(s, ctx, &VICTIM, 1, 1));
    for (uint64_t i = 1; i < 3; i++) /* the idlest (0) went, not these */
        CHECK_OK(push(s, ctx, &(struct who){0x20000 + i, {i, i}}, 1, 0));
    CHECK_EQ(pushes(s), before + 1);
    bex_ps_shard_destroy(s);
    /* 64 clients, 1000 made one per 20 ms (horizon 1 s): each past the
     * 64th forgets the idlest; the last 64 are all still known */
    s = shard_lim(64, 1000, 1000000);
    for (uint64_t i = 0; i < 1000; i++, now_ns += 20000000ull)
        CHECK_OK(push(s, ctx, &(struct who){0x50000 + i, {i * 31, i}}, 5, 0));
    before = pushes(s);
    for (uint64_t i = 1000 - 64; i < 1000; i++)
        CHECK_OK(push(s, ctx, &(struct who){0x50000 + i, {i * 31, i}}, 5, 0));
    CHECK_EQ(pushes(s), before);
    CHECK_EQ(stats(s).dup_ids, 64);
    bex_ps_shard_destroy(s);
    /* 10 new ids a second: the 11th is refused, a second later it is not */
    s = shard_lim(0, 0, 10);
    for (uint64_t i = 0; i < 10; i++)
        CHECK_OK(push(s, ctx, &(struct who){0x40000 + i, {i, 1}}, 1, 0));
    CHECK_EQ(push(s, ctx, &late, 1, 0), -EAGAIN);
    now_ns += 1000000000ull;
    CHECK_OK(push(s, ctx, &late, 1, 0));
    bex_ps_shard_destroy(s);
    bex__rpc_clock_hook(NULL);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

/* A Push body (from bex_rpc_alloc of ctx) with id (w, 1) and no key. */
static void *push_rpc_body(bex_ctx *ctx, const struct who *w, size_t *len)
{
    struct bex__ps_hdr h = {.table = TD.id,
                            .dim = TD.dim,
                            .flags = BEX__PS_F_ID,
                            .id_client = w->client,
                            .id_seq = 1,
                            .id_tok = {w->tok[0], w->tok[1]}};
    *len = bex__ps_req_len(BEX_PS_M_PUSH, 0, TD.dim) + BEX__PS_ID_LEN;
    uint8_t *b = bex_rpc_alloc(ctx, *len);
    CHECK(b);
    bex__ps_hdr_put(b, &h);
    return b;
}

/* Pushes of 10 new clients on one channel (one RPC connection) of ctx to
 * addr, 100 a client id from base: how many were refused -EAGAIN (the
 * others: 0). */
static int new_clients_on(bex_ctx *ctx, const bex_addr *addr, uint64_t base)
{
    bex_rpc_endpoint ep = {.addr = *addr};
    bex_rpc_channel_config cc = {.endpoints = &ep,
                                 .n_endpoints = 1,
                                 .request_timeout_ms = 5000 * time_scale(),
                                 .connect_timeout_ms = 5000 * time_scale(),
                                 .max_attempts = 1};
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    int refused = 0;
    for (uint64_t i = 0; i < 10; i++) {
        size_t len;
        void *b = push_rpc_body(ctx, &(struct who){base + i, {i, 9}}, &len);
        int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, BEX_PS_M_PUSH, b, len, NULL, NULL, NULL);
        CHECK(rc == 0 || rc == -EAGAIN);
        refused += rc == -EAGAIN;
    }
    CHECK_OK(bex_rpc_channel_destroy(ch));
    return refused;
}

/* new_clients_per_conn 8: a connection bringing 10 new client ids gets the
 * last 2 refused -EAGAIN (counted); another connection brings its own 8. */
static int t_per_conn(void)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config sc = scaled(&base, a0);
    bex_ctx *sctx, *cctx = client_ctx();
    CHECK_OK(bex_ctx_create(&sc, &sctx));
    bex_ps_shard_config pc = {
        .shard = 0, .n_shards = 1, .tables = &TD, .n_tables = 1, .new_clients_per_conn = 8};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    bex_rpc_server *srv;
    CHECK_OK(bex_rpc_server_create(sctx, NULL, &srv));
    CHECK_OK(bex_ps_shard_register(s, srv, sctx));
    bex_addr la = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    CHECK_OK(bex_rpc_server_listen(srv, &la));
    bex_rpc_server_addr(srv, &la);
    CHECK_EQ(new_clients_on(cctx, &la, 0x70000), 2);
    CHECK_EQ(stats(s).clients_refused, 2);
    CHECK_EQ(new_clients_on(cctx, &la, 0x80000), 2);
    CHECK_EQ(stats(s).pushes, 16);
    CHECK_OK(bex_rpc_server_destroy(srv));
    bex_ps_shard_destroy(s);
    CHECK_OK(bex_ctx_destroy(cctx));
    CHECK_OK(bex_ctx_destroy(sctx));
    return 0;
}

/* A Fetch of keys[0..n) of TD: its status, the answer freed. */
static int fetch(bex_ps_shard *s, bex_ctx *ctx, const uint64_t *keys, uint32_t n)
{
    uint8_t body[BEX__PS_HDR_LEN + 8 * 4];
    CHECK(n <= 4);
    bex__ps_hdr_put(body, &(struct bex__ps_hdr){.table = TD.id, .n = n, .dim = TD.dim});
    for (uint32_t i = 0; i < n; i++)
        bex__ps_put64(body + BEX__PS_HDR_LEN + 8 * i, keys[i]);
    void *resp = NULL;
    size_t len = 0;
    int rc = bex_ps_shard_serve(s, ctx, BEX_PS_M_FETCH, body, BEX__PS_HDR_LEN + 8 * (size_t)n,
                                &resp, &len);
    if (rc == 0)
        CHECK_EQ(len, BEX__PS_HDR_LEN + 4 * (size_t)n * TD.dim);
    bex_rpc_free(resp);
    return rc;
}

static int t_foreign(void)
{
    bex_ctx *ctx = client_ctx();
    bex_ps_shard_config pc = {.shard = 0, .n_shards = 2, .tables = &TD, .n_tables = 1};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    uint64_t own[2], other = 0;
    int n_own = 0;
    for (uint64_t k = 1; n_own < 2 || !other; k++) {
        if (bex_ps_key_shard(k, 2) == 0 && n_own < 2)
            own[n_own++] = k;
        else if (bex_ps_key_shard(k, 2) == 1 && !other)
            other = k;
    }
    CHECK_EQ(fetch(s, ctx, &other, 1), -EINVAL); /* alone, new */
    CHECK_EQ(stats(s).rows, 0);
    CHECK_OK(fetch(s, ctx, own, 1)); /* a row made */
    CHECK_EQ(stats(s).rows, 1);
    /* beside a row it holds, beside a new key of its own: refused whole */
    CHECK_EQ(fetch(s, ctx, (uint64_t[]){own[0], other}, 2), -EINVAL);
    CHECK_EQ(fetch(s, ctx, (uint64_t[]){own[1], other, own[0]}, 3), -EINVAL);
    CHECK_EQ(stats(s).rows, 1);
    CHECK_OK(fetch(s, ctx, (uint64_t[]){own[0], own[1], own[0]}, 3));
    CHECK_EQ(stats(s).rows, 2);
    /* a Push of shard 1's key (push() sends key 7) */
    CHECK_EQ(bex_ps_key_shard(7, 2), 1);
    CHECK_EQ(push(s, ctx, &VICTIM, 1, 1), -EINVAL);
    CHECK_EQ(stats(s).rows, 2);
    CHECK_EQ(stats(s).malformed, 4);
    bex_ps_shard_destroy(s);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

BEX_TEST_MAIN({"stale", t_stale}, {"stale_snapshot", t_stale_snapshot}, {"spoof", t_spoof},
              {"flood", t_flood}, {"per_conn", t_per_conn}, {"foreign", t_foreign})
