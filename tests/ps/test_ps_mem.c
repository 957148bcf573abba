/* SPDX-License-Identifier: Apache-2.0 */
/* The PS client's calls on caller memory (bex_ps_fetch_into,
 * bex_ps_push_from; issue 24 item 1, issue 28 item 3): rows fetched into an
 * array of bex_ps_rows_alloc land at their keys' positions, a Push sent
 * from one is applied as bex_ps_push's, keys on several shards take the
 * copying way with the same result; bad input (memory bex did not
 * register, an array too small, another context's array, one in use, the
 * context's cap) is refused with nothing sent; a server answering with a
 * wrong row count fails the call and nothing is written past the rows
 * asked. Over TCP natively (tcp) and RDMA in the VM (rxe). */
#include "ps_test.h"

static bex_dir *dir_of(const struct srv_proc *sps, int n)
{
    bex_addr a[NSH];
    for (int i = 0; i < n; i++)
        a[i] = sps[i].addr;
    return dir_of_shards(a, n, true);
}

/* The keys of key_of(0..NK) on shard s, their indexes in idx. */
static int keys_on(uint32_t s, uint64_t *keys, int *idx)
{
    int n = 0;
    for (int i = 0; i < NK; i++)
        if (bex_ps_key_shard(key_of(i), NSH) == s) {
            idx[n] = i;
            keys[n++] = key_of(i);
        }
    return n;
}

/* The answer's PS header lies right in front of rows: the server wrote the
 * answer there whole (bex_rpc_call_into), nothing decoded into it. */
static void answer_in_place(const float *rows, const bex_ps_table_config *t, uint32_t n)
{
    const uint8_t *h = (const uint8_t *)rows - BEX__PS_HDR_LEN;
    CHECK_EQ(h[0], BEX__PS_VERSION);
    CHECK_EQ(bex__ps_get32(h + 4), t->id);
    CHECK_EQ(bex__ps_get32(h + 8), n);
    CHECK_EQ(bex__ps_get32(h + 12), t->dim);
}

/* The Push went from the array: its request's PS header (with the Push's
 * id) in the room in front of its keys. */
static void push_in_place(const float *grads, const bex_ps_table_config *t, uint32_t n)
{
    const uint8_t *h = (const uint8_t *)grads - 8 * (size_t)n - BEX__PS_ID_LEN - BEX__PS_HDR_LEN;
    CHECK_EQ(h[0], BEX__PS_VERSION);
    CHECK_EQ(h[2], BEX__PS_F_ID);
    CHECK_EQ(bex__ps_get32(h + 8), n);
    CHECK_EQ(bex__ps_get32(h + 12), t->dim);
}

/* Fetch into an array and Push from one, on one shard (without a copy) and
 * across both (the copying way): the rows are the reference's. */
static int t_into(void)
{
    struct ps_rig g;
    int rc = rig_up(&g, NSH, MODE_NORMAL);
    if (rc)
        return rc;
    bex_ctx *ctx = g.ctx;
    bex_ps_client *pc = g.pc;
    const bex_ps_table_config *t = &TABLES[0];
    uint64_t all_keys[NK], k0[NK];
    int all[NK], idx[NK];
    keys_init(all_keys, all);
    struct ref r;
    ref_init(&r, t, all_keys);
    int n = keys_on(0, k0, idx);
    float *rows = bex_ps_rows_alloc(ctx, (uint32_t)n, t->dim);
    CHECK(rows);
    memset((uint8_t *)rows - BEX__PS_HDR_LEN, 0, BEX__PS_HDR_LEN);
    CHECK_OK(bex_ps_fetch_into_sync(pc, t->id, t->dim, k0, (size_t)n, rows));
    ref_check(&r, idx, n, rows);
    if (bex_ctx_pd(ctx)) /* RDMA: written there (TCP-only: the rows copied once) */
        answer_in_place(rows, t, (uint32_t)n);
    /* a Push from the array, its keys in the array's slots */
    uint64_t *slots = bex_ps_rows_keys(rows);
    CHECK(slots);
    memcpy(slots, k0, sizeof(uint64_t) * (size_t)n);
    grads_of(rows, n, t->dim, 3);
    ref_push(&r, idx, n, rows);
    bex_ps_replica_result res[2];
    size_t n_res = 0;
    CHECK_OK(bex_ps_push_from_sync(pc, t->id, t->dim, slots, (size_t)n, rows, res, 2, &n_res));
    CHECK_EQ(n_res, 1);
    CHECK_EQ(res[0].status, 0);
    CHECK_EQ(res[0].shard, 0);
    CHECK_EQ(bex_ps_rows_busy(rows), 0);
    push_in_place(rows, t, (uint32_t)n);
    CHECK_OK(bex_ps_fetch_into_sync(pc, t->id, t->dim, k0, (size_t)n, rows));
    ref_check(&r, idx, n, rows);
    transport_check(ctx);
    CHECK_OK(bex_ps_rows_free(rows));
    return rig_down(&g, rc);
}

/* keys_of(0..NK) grouped by shard (shard 0's, then shard 1's), their
 * indexes in idx; the count on shard 0 in *n0. */
static void keys_grouped(uint64_t *keys, int *idx, int *n0)
{
    *n0 = keys_on(0, keys, idx);
    keys_on(1, keys + *n0, idx + *n0);
}

/* Keys on both shards, grouped by shard: each shard's part of a Fetch
 * lands in its slice of the array and each shard's part of a Push goes
 * from its slice, the first in place, the second gathered (bex_ps_rows_zero
 * counts them: no part copied), the rows are the reference's; keys not
 * grouped are refused -EINVAL, nothing sent (issue 28 items 1 and 3). */
static int t_multi(void)
{
    struct ps_rig g;
    int rc = rig_up(&g, NSH, MODE_NORMAL);
    if (rc)
        return rc;
    bex_ctx *ctx = g.ctx;
    bex_ps_client *pc = g.pc;
    const bex_ps_table_config *t = &TABLES[0];
    uint64_t all_keys[NK], keys[NK];
    int all[NK], idx[NK], n0;
    keys_init(all_keys, all);
    struct ref r;
    ref_init(&r, t, all_keys);
    keys_grouped(keys, idx, &n0);
    CHECK(n0 > 0 && n0 < NK);
    float *big = bex_ps_rows_alloc(ctx, NK, t->dim);
    CHECK(big);
    CHECK_EQ(bex_ps_rows_zero(big), 0);
    CHECK_OK(bex_ps_fetch_into_sync(pc, t->id, t->dim, keys, NK, big));
    ref_check(&r, idx, NK, big);
    CHECK_EQ(bex_ps_rows_zero(big), 2); /* one part per shard, no copying call */
    grads_of(big, NK, t->dim, 5);
    ref_push(&r, idx, NK, big);
    bex_ps_replica_result res[4];
    size_t n_res = 0;
    CHECK_OK(bex_ps_push_from_sync(pc, t->id, t->dim, keys, NK, big, res, 4, &n_res));
    CHECK_EQ(n_res, 2);
    CHECK_EQ(res[0].shard, 0);
    CHECK_EQ(res[1].shard, 1);
    CHECK_EQ(res[0].status | res[1].status, 0);
    CHECK_EQ(bex_ps_rows_zero(big), 4); /* both parts from the array */
    push_in_place(big, t, (uint32_t)n0);
    CHECK_OK(bex_ps_fetch_into_sync(pc, t->id, t->dim, keys, NK, big));
    ref_check(&r, idx, NK, big);
    /* not grouped: refused, the array untouched and free */
    CHECK_EQ(bex_ps_fetch_into_sync(pc, t->id, t->dim, all_keys, NK, big), -EINVAL);
    CHECK_EQ(bex_ps_push_from_sync(pc, t->id, t->dim, all_keys, NK, big, NULL, 0, NULL), -EINVAL);
    CHECK_EQ(bex_ps_rows_busy(big), 0);
    CHECK_EQ(bex_ps_rows_zero(big), 6);
    transport_check(ctx);
    CHECK_OK(bex_ps_rows_free(big));
    return rig_down(&g, rc);
}

/* ---- 1, 2 and 4 shards: no Push part copied ---- */

/* A child's server: listening at a0 (any port), the port written to wfd,
 * then serving until the parent writes to (or closes) rfd. */
static void listen_until_told(bex_rpc_server *srv, struct in_addr a0, int wfd, int rfd)
{
    bex_addr la = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}}, got;
    CHECK_OK(bex_rpc_server_listen(srv, &la));
    bex_rpc_server_addr(srv, &got);
    CHECK(write(wfd, &got.in4.sin_port, sizeof got.in4.sin_port) == sizeof got.in4.sin_port);
    char q;
    ssize_t r = read(rfd, &q, 1);
    (void)r;
}

/* A shard server of n_shards (arg: shard, n_shards). */
static void shard_child(int wfd, int rfd, void *arg)
{
    const uint32_t *sn = arg;
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config c = scaled(&base, a0);
    bex_ctx *ctx;
    bex_rpc_server *srv;
    bex_ps_shard *ps;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    CHECK_OK(bex_rpc_server_create(ctx, NULL, &srv));
    bex_ps_shard_config pc = {.shard = sn[0], .n_shards = sn[1], .tables = TABLES, .n_tables = 2};
    CHECK_OK(bex_ps_shard_create(&pc, &ps));
    CHECK_OK(bex_ps_shard_register(ps, srv, ctx));
    listen_until_told(srv, a0, wfd, rfd);
    CHECK_OK(bex_rpc_server_destroy(srv));
    bex_ps_shard_destroy(ps);
    CHECK_OK(bex_ctx_destroy(ctx));
    exit(0);
}

#define SHARDS_MAX 4

/* keys_of(0..NK) grouped by shard of ns, their indexes in idx. */
static void keys_by_shard(uint32_t ns, uint64_t *keys, int *idx)
{
    int n = 0;
    for (uint32_t s = 0; s < ns; s++)
        for (int i = 0; i < NK; i++)
            if (bex_ps_key_shard(key_of(i), ns) == s) {
                idx[n] = i;
                keys[n++] = key_of(i);
            }
    CHECK_EQ(n, NK);
}

/* One Push from an array over ns shards: ns parts, each sent from the
 * array (bex_ps_rows_zero goes up by ns: none copied), each shard's result
 * 0, and a Fetch reads the reference's rows. */
static void push_spread(uint32_t ns)
{
    struct srv_proc sp[SHARDS_MAX];
    uint32_t sn[SHARDS_MAX][2];
    bex_addr a[SHARDS_MAX];
    for (uint32_t s = 0; s < ns; s++) {
        sn[s][0] = s;
        sn[s][1] = ns;
        srv_spawn(&sp[s], shard_child, sn[s]);
        a[s] = sp[s].addr;
    }
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_shards(a, (int)ns, true);
    bex_ps_client *pc = client_of(ctx, d);
    const bex_ps_table_config *t = &TABLES[0];
    uint64_t all_keys[NK], keys[NK];
    int idx[NK];
    for (int i = 0; i < NK; i++)
        all_keys[i] = key_of(i);
    struct ref r;
    ref_init(&r, t, all_keys);
    keys_by_shard(ns, keys, idx);
    float *g = bex_ps_rows_alloc(ctx, NK, t->dim);
    CHECK(g);
    grads_of(g, NK, t->dim, 11);
    ref_push(&r, idx, NK, g);
    bex_ps_replica_result res[SHARDS_MAX];
    size_t n_res = 0;
    CHECK_OK(bex_ps_push_from_sync(pc, t->id, t->dim, keys, NK, g, res, SHARDS_MAX, &n_res));
    fprintf(stderr, "%u shards: %llu of %zu parts sent from the array\n", ns,
            (unsigned long long)bex_ps_rows_zero(g), n_res);
    CHECK_EQ(n_res, ns);
    CHECK_EQ(bex_ps_rows_zero(g), ns);
    for (uint32_t s = 0; s < ns; s++) {
        CHECK_EQ(res[s].shard, s);
        CHECK_EQ(res[s].status, 0);
    }
    CHECK_EQ(bex_ps_rows_busy(g), 0);
    CHECK_OK(bex_ps_fetch_into_sync(pc, t->id, t->dim, keys, NK, g));
    ref_check(&r, idx, NK, g);
    CHECK_OK(bex_ps_rows_free(g));
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    for (uint32_t s = 0; s < ns; s++)
        CHECK_OK(stop(&sp[s]));
}

static int t_shards(void)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    push_spread(1);
    push_spread(2);
    push_spread(4);
    return 0;
}

/* ---- parts past the eager bound ---- */

#define NBIG 700 /* keys: about 350 rows of dim 8 (11 KiB) a shard, past eager_max (8 KiB) */

/* A Push from an array over 2 shards whose parts are each past the
 * transport's eager bound: the first sent in place, the second gathered
 * (its headers and keys in a buffer of their own, its rows from the
 * array), by rendezvous over RDMA (the WRITEs cut at the buffers' ends) and
 * in fragments over TCP; both parts from the array (bex_ps_rows_zero),
 * and a Fetch reads every row as init - lr * grad. */
static int t_large(void)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    struct srv_proc sp[2];
    uint32_t sn[2][2] = {{0, 2}, {1, 2}};
    bex_addr a[2];
    for (int s = 0; s < 2; s++) {
        srv_spawn(&sp[s], shard_child, sn[s]);
        a[s] = sp[s].addr;
    }
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_shards(a, 2, true);
    bex_ps_client *pc = client_of(ctx, d);
    const bex_ps_table_config *t = &TABLES[0];
    static uint64_t keys[NBIG];
    uint32_t n = 0, n0 = 0;
    for (uint32_t s = 0; s < 2; s++) {
        n0 = s == 1 ? n : n0; /* shard 0's count */
        for (int i = 0; i < NBIG; i++)
            if (bex_ps_key_shard(key_of(i), 2) == s)
                keys[n++] = key_of(i);
    }
    CHECK_EQ(n, NBIG);
    CHECK(n0 * t->dim * 4 > 8192 && (n - n0) * t->dim * 4 > 8192);
    float *g = bex_ps_rows_alloc(ctx, NBIG, t->dim);
    CHECK(g);
    for (uint32_t i = 0; i < NBIG * t->dim; i++)
        g[i] = (float)(i % 97) / 97.0f - 0.5f;
    bex_ps_replica_result res[2];
    size_t n_res = 0;
    CHECK_OK(bex_ps_push_from_sync(pc, t->id, t->dim, keys, NBIG, g, res, 2, &n_res));
    CHECK_EQ(n_res, 2);
    CHECK_EQ(res[0].status | res[1].status, 0);
    CHECK_EQ(bex_ps_rows_zero(g), 2); /* both parts from the array, none copied */
    float *rows = bex_ps_rows_alloc(ctx, NBIG, t->dim);
    CHECK(rows);
    CHECK_OK(bex_ps_fetch_into_sync(pc, t->id, t->dim, keys, NBIG, rows));
    for (uint32_t i = 0; i < NBIG; i++)
        for (uint32_t c = 0; c < t->dim; c++) {
            float want =
                bex_ps_init_value(t->id, keys[i], c, t->init_scale) - t->lr * g[i * t->dim + c];
            if (!(fabsf(rows[i * t->dim + c] - want) <= 1e-5f)) {
                fprintf(stderr, "row %u col %u: %.9g, want %.9g\n", i, c,
                        (double)rows[i * t->dim + c], (double)want);
                CHECK(0);
            }
        }
    transport_check(ctx);
    CHECK_OK(bex_ps_rows_free(rows));
    CHECK_OK(bex_ps_rows_free(g));
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    for (int s = 0; s < 2; s++)
        rc |= stop(&sp[s]);
    return rc ? 1 : 0;
}

static void never(int status, void *user)
{
    (void)status;
    (void)user;
    CHECK(0);
}

/* Bad input: refused, nothing sent (done never runs). */
static int t_bad(void)
{
    struct ps_rig g;
    int rc = rig_up(&g, 1, MODE_NORMAL);
    if (rc)
        return rc;
    bex_ctx *ctx = g.ctx;
    bex_ps_client *pc = g.pc;
    uint64_t keys[NK];
    int idx[NK];
    CHECK(keys_on(0, keys, idx) >= 4); /* the server is shard 0 of NSH */
    float plain[4 * 8];
    /* memory bex did not register */
    CHECK_EQ(bex_ps_fetch_into(pc, 1, 8, keys, 4, plain, never, NULL), -EINVAL);
    CHECK_EQ(bex_ps_push_from(pc, 1, 8, keys, 4, plain, NULL, 0, NULL, never, NULL), -EINVAL);
    CHECK_EQ(bex_ps_rows_free(plain), -EINVAL);
    CHECK(!bex_ps_rows_keys(plain));
    /* an array too small: 3 rows for 4 keys, or 4 rows of dim 4 for dim 8 */
    float *small = bex_ps_rows_alloc(ctx, 3, 8), *narrow = bex_ps_rows_alloc(ctx, 4, 4);
    CHECK(small && narrow);
    CHECK_EQ(bex_ps_fetch_into(pc, 1, 8, keys, 4, small, never, NULL), -ENOBUFS);
    CHECK_EQ(bex_ps_push_from(pc, 1, 8, keys, 4, small, NULL, 0, NULL, never, NULL), -ENOBUFS);
    CHECK_EQ(bex_ps_fetch_into(pc, 1, 8, keys, 4, narrow, never, NULL), -ENOBUFS);
    /* fewer keys than rows: fine (a Fetch lands in the first rows) */
    CHECK_OK(bex_ps_fetch_into_sync(pc, 1, 8, keys, 2, small));
    /* another context's array */
    bex_ctx *other = client_ctx();
    float *theirs = bex_ps_rows_alloc(other, 4, 8);
    CHECK(theirs);
    CHECK_EQ(bex_ps_fetch_into(pc, 1, 8, keys, 4, theirs, never, NULL), -EINVAL);
    CHECK_OK(bex_ps_rows_free(theirs));
    CHECK_OK(bex_ctx_destroy(other));
    /* bad arguments */
    CHECK(!bex_ps_rows_alloc(ctx, 0, 8) && errno == EINVAL);
    CHECK(!bex_ps_rows_alloc(ctx, 4, BEX_PS_DIM_MAX + 1) && errno == EINVAL);
    CHECK_EQ(bex_ps_fetch_into(pc, 1, 0, keys, 4, small, never, NULL), -EINVAL);
    CHECK_EQ(bex_ps_fetch_into(pc, 1, 8, NULL, 2, small, never, NULL), -EINVAL);
    CHECK_OK(bex_ps_rows_free(small));
    CHECK_OK(bex_ps_rows_free(narrow));
    return rig_down(&g, rc);
}

/* The context's cap on caller memory: past it -ENOBUFS; freed memory
 * counts no more. */
static int t_cap(void)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    bex_ctx_config base = {.user_mem_max = 1u << 20};
    bex_ctx_config c = scaled(&base, a1);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    float *a = bex_ps_rows_alloc(ctx, 1024, 128); /* 512 KiB + keys */
    CHECK(a);
    errno = 0;
    CHECK(!bex_ps_rows_alloc(ctx, 1024, 128));
    CHECK_EQ(errno, ENOBUFS);
    CHECK_OK(bex_ps_rows_free(a));
    float *b = bex_ps_rows_alloc(ctx, 1024, 128);
    CHECK(b);
    CHECK_OK(bex_ps_rows_free(b));
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

/* ---- a server answering Fetch with a wrong row count ---- */

static struct {
    bex_ctx *ctx;
    int delta; /* rows answered beyond those asked (negative: fewer) */
} rogue;

static void rogue_fetch(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    struct bex__ps_hdr h;
    CHECK_OK(bex__ps_decode(BEX_PS_M_FETCH, body, len, &h));
    bex_rpc_free(body);
    uint32_t n = (uint32_t)((int)h.n + rogue.delta);
    size_t out_len = BEX__PS_HDR_LEN + 4 * (size_t)n * h.dim;
    uint8_t *out = bex_rpc_alloc(rogue.ctx, out_len);
    CHECK(out);
    bex__ps_hdr_put(out, &(struct bex__ps_hdr){.table = h.table, .n = n, .dim = h.dim});
    for (size_t i = 0; i < (size_t)n * h.dim; i++)
        bex__ps_putf(out + BEX__PS_HDR_LEN + 4 * i, 7.0f);
    bex_rpc_reply(req, 0, out, out_len);
}

static void rogue_child(int wfd, int rfd, void *arg)
{
    rogue.delta = *(int *)arg;
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config c = scaled(&base, a0);
    bex_rpc_server *srv;
    CHECK_OK(bex_ctx_create(&c, &rogue.ctx));
    CHECK_OK(bex_rpc_server_create(rogue.ctx, NULL, &srv));
    CHECK_OK(bex_rpc_server_register(srv, BEX_PS_SERVICE, BEX_PS_M_FETCH, 0, rogue_fetch, NULL));
    listen_until_told(srv, a0, wfd, rfd);
    CHECK_OK(bex_rpc_server_destroy(srv));
    CHECK_OK(bex_ctx_destroy(rogue.ctx));
    exit(0);
}

/* More rows than asked, or fewer: the call fails, the array's rows past
 * those asked keep their values. */
static int t_wrong_rows(void)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    const int deltas[] = {1, 8, -1};
    for (size_t k = 0; k < sizeof deltas / sizeof deltas[0]; k++) {
        struct srv_proc sp;
        int delta = deltas[k];
        srv_spawn(&sp, rogue_child, &delta);
        bex_ctx *ctx = client_ctx();
        bex_dir *d = dir_of(&sp, 1);
        bex_ps_client *pc = client_of(ctx, d);
        float *rows = bex_ps_rows_alloc(ctx, 16, 8);
        CHECK(rows);
        for (int i = 0; i < 16 * 8; i++)
            rows[i] = -1.0f;
        uint64_t keys[4] = {11, 12, 13, 14};
        int st = bex_ps_fetch_into_sync(pc, 1, 8, keys, 4, rows);
        if (!(st == -EBADMSG || st == -EMSGSIZE)) {
            fprintf(stderr, "delta %d: status %d\n", delta, st);
            CHECK(0);
        }
        for (int i = 4 * 8; i < 16 * 8; i++)
            CHECK(rows[i] == -1.0f); /* nothing past the rows asked */
        CHECK_OK(bex_ps_rows_free(rows));
        bex_ps_client_destroy(pc);
        bex_dir_destroy(d);
        CHECK_OK(bex_ctx_destroy(ctx));
        rc |= stop(&sp);
    }
    return rc ? 1 : 0;
}

BEX_TEST_MAIN({"into", t_into}, {"multi", t_multi}, {"bad", t_bad}, {"cap", t_cap},
              {"wrong_rows", t_wrong_rows}, {"shards", t_shards}, {"large", t_large})
