/* SPDX-License-Identifier: Apache-2.0 */
/* The parameter server end to end (include/bex/ps.h): two shard servers in
 * child processes, a client over a directory in the parent. After Pushes,
 * Fetch returns the rows a reference computed here gives (SGD and
 * Adagrad), across both shards; a Push whose answer is lost is retried and
 * applied once; malformed bodies get an error and the server goes on; a
 * shard stopped with a snapshot and restarted serves the same rows; a
 * corrupt or foreign snapshot is refused. Over TCP natively (tcp) and RDMA
 * in the VM (rxe). */
#include "ps_test.h"
#include "rpc/still_clock.h"

/* A directory with shard i on sps[i]. */
static bex_dir *dir_of(const struct srv_proc *sps)
{
    bex_addr a[NSH];
    for (int i = 0; i < NSH; i++)
        a[i] = sps[i].addr;
    return dir_of_shards(a, NSH, true);
}

/* The client, its directory and context gone, then both servers told to
 * go; rc with a server that did not leave cleanly added. */
static int client_down(bex_ps_client *pc, bex_dir *d, bex_ctx *ctx, struct srv_proc *sp, int rc)
{
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    for (int s = 0; s < NSH; s++)
        rc |= stop(&sp[s]);
    return rc;
}

/* ---- cases ---- */

static struct {
    _Atomic long calls, bad;
    struct waiter w;
} many = {.w = WAITER_INIT};

static void many_done(int status, void *user)
{
    (void)user;
    if (status)
        atomic_fetch_add(&many.bad, 1);
    waiter_add(&many.w, &many.calls, 1);
}

/* Rows start at the initialiser's values; after Pushes (one with a key
 * twice, applied in order) Fetch returns the reference's rows on both
 * shards, for SGD and Adagrad, in one request and in many at once. */
static int t_train(void)
{
    struct ps_rig g;
    int rc = rig_up(&g, NSH, MODE_NORMAL);
    if (rc)
        return rc;
    bex_ctx *ctx = g.ctx;
    bex_ps_client *pc = g.pc;
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static struct ref refs[2];
    for (int t = 0; t < 2; t++) {
        struct ref r = refs[t];
        ref_init(&r, &TABLES[t], keys);
        fetch_check(pc, &r, keys, all, NK);
        /* the first half, then everything with key 3 twice */
        push_ref(pc, &r, keys, all, NK / 2, 1);
        int twice[NK + 1];
        memcpy(twice, all, sizeof all);
        twice[NK] = 3;
        push_ref(pc, &r, keys, twice, NK + 1, 2);
        push_ref(pc, &r, keys, all, NK, 3);
        fetch_check(pc, &r, keys, all, NK);
        /* a shuffled subset (rows come back in the request's order) */
        int sub[NK / 3];
        for (int i = 0; i < NK / 3; i++)
            sub[i] = (i * 17 + 5) % NK;
        fetch_check(pc, &r, keys, sub, NK / 3);
        refs[t] = r;
    }
    /* many requests out at once: each completes once, with its rows */
    enum { OUT = 32 };
    static float rows[OUT][DMAX];
    for (int i = 0; i < OUT; i++)
        CHECK_OK(bex_ps_fetch(pc, 1, 8, &keys[i % NK], 1, rows[i], many_done, NULL));
    CHECK(wait_count(&many.w, &many.calls, OUT, 20000) == 0);
    CHECK_EQ(atomic_load(&many.bad), 0);
    pair_sleep_ms(50);
    CHECK_EQ(atomic_load(&many.calls), OUT); /* not twice */
    for (int i = 0; i < OUT; i++) {
        int idx = i % NK;
        ref_check(&refs[0], &idx, 1, rows[i]);
    }
    /* both shards served Fetches and Pushes */
    for (int s = 0; s < NSH; s++) {
        bex_rpc_channel *ch = raw_chan(ctx, &g.sp[s]);
        struct srv_stats st = stats_of(ch);
        CHECK(st.ps.fetches > 0 && st.ps.pushes == 6 && st.ps.malformed == 0);
        CHECK_OK(bex_rpc_channel_destroy(ch));
    }
    transport_check(ctx);
    return rig_down(&g, rc);
}

/* shard 0 loses the answer to the first Push it applies (its connection
 * closed): the client retries on a new connection and the dedup window
 * answers the retry with the first answer; the rows show one application. */
static int t_write_once(void)
{
    int rc = 0;
    struct in_addr a0, a1;
    if ((rc = pair_addrs(&a0, &a1)))
        return rc;
    struct srv_proc sp[NSH];
    spawn(&sp[0], 0, NULL, MODE_DROP);
    spawn(&sp[1], 1, NULL, MODE_NORMAL);
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of(sp);
    bex_ps_client *pc = client_of(ctx, d);
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    for (int t = 0; t < 2; t++) {
        struct ref r;
        ref_init(&r, &TABLES[t], keys);
        push_ref(pc, &r, keys, all, NK, 10 + t);
        fetch_check(pc, &r, keys, all, NK);
    }
    bex_rpc_channel *ch = raw_chan(ctx, &sp[0]);
    struct srv_stats st = stats_of(ch);
    CHECK_EQ(st.ps.pushes, 2);                            /* applied once each */
    CHECK(st.rpc.dup_replayed + st.rpc.dup_pending >= 1); /* and the retry came */
    CHECK_OK(bex_rpc_channel_destroy(ch));
    return client_down(pc, d, ctx, sp, rc) ? 1 : 0;
}

struct timed {
    _Atomic long calls;
    int status;
    struct waiter w;
};

static void timed_done(int status, void *user)
{
    struct timed *t = user;
    t->status = status;
    waiter_add(&t->w, &t->calls, 1);
}

/* The RPC layer's clock in t_deadline (tests/rpc/still_clock.h): "at its
 * deadline, not before, not after" is judged on the clock the deadline is
 * kept by (on the wall clock, a completion 108 ms after the deadline
 * failed a 100 ms slack at load 20). */

/* Shard 1 never answers Fetches: a Fetch over both shards completes once,
 * with -ETIMEDOUT, at its deadline (not with the RPC clock short of it,
 * and with the clock at the deadline and no further), although shard 0
 * answered at once; a Fetch of shard 0's keys alone succeeds; Push to
 * shard 1 (answered) still works. A dead shard (killed with -9) fails a
 * request across shards by the deadline too. */
static int t_deadline(void)
{
    int rc = 0;
    struct in_addr a0, a1;
    if ((rc = pair_addrs(&a0, &a1)))
        return rc;
    struct srv_proc sp[NSH];
    spawn(&sp[0], 0, NULL, MODE_NORMAL);
    spawn(&sp[1], 1, NULL, MODE_HOLD);
    atomic_store(&still_ns, 0);
    bex__rpc_clock_hook(still_clock); /* (the servers forked before) */
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of(sp);
    const unsigned tmo = 300 * time_scale();
    const uint64_t tmo_ns = tmo * 1000000ull;
    bex_ps_client *pc = client_tmo(ctx, d, tmo);
    uint64_t keys[NK], k0[NK];
    int all[NK], n0 = 0;
    keys_init(keys, all);
    for (int i = 0; i < NK; i++)
        if (bex_ps_key_shard(keys[i], NSH) == 0)
            k0[n0++] = keys[i];
    static float rows[NK * DMAX];
    /* the connections first (setup is not what is timed): in the VM an
     * RDMA connection takes longer than the deadline to set up, so a
     * request may time out while its connection goes on being made */
    float g[DMAX] = {0};
    uint64_t k1 = keys[0];
    for (int i = 0; bex_ps_key_shard(k1, NSH) != 1; i++)
        k1 = keys[i];
    uint64_t warm_end = pair_now_ms() + 20000ull * time_scale();
    while ((rc = bex_ps_fetch_sync(pc, 1, 8, k0, (size_t)n0, rows)) == -ETIMEDOUT &&
           pair_now_ms() < warm_end)
        ;
    CHECK_OK(rc);
    while ((rc = bex_ps_push_sync(pc, 1, 8, &k1, 1, g)) == -ETIMEDOUT && pair_now_ms() < warm_end)
        ;
    CHECK_OK(rc);
    uint64_t f0 = still_freeze();
    static struct timed t = {.w = WAITER_INIT};
    CHECK_OK(bex_ps_fetch(pc, 1, 8, keys, NK, rows, timed_done, &t));
    /* a millisecond short of the deadline: still out (however long the
     * wait, the clock stays there) */
    atomic_store(&still_ns, f0 + tmo_ns - 1000000);
    pair_sleep_ms(tmo);
    CHECK_EQ(atomic_load(&t.calls), 0);
    atomic_store(&still_ns, f0 + tmo_ns); /* at the deadline */
    CHECK(wait_count(&t.w, &t.calls, 1, 10000) == 0);
    CHECK_EQ(t.status, -ETIMEDOUT);
    atomic_store(&still_ns, f0 + 2 * tmo_ns);
    pair_sleep_ms(tmo);
    CHECK_EQ(atomic_load(&t.calls), 1); /* once */
    CHECK_OK(bex_ps_fetch_sync(pc, 1, 8, k0, (size_t)n0, rows));
    /* shard 1 dead: a request across shards fails by its deadline (it has
     * failed once the clock is there) */
    kill(sp[1].pid, SIGKILL);
    int st;
    waitpid(sp[1].pid, &st, 0);
    close(sp[1].to_child);
    static struct timed t2 = {.w = WAITER_INIT};
    uint64_t f1 = atomic_load(&still_ns);
    CHECK_OK(bex_ps_fetch(pc, 1, 8, keys, NK, rows, timed_done, &t2));
    atomic_store(&still_ns, f1 + tmo_ns);
    CHECK(wait_count(&t2.w, &t2.calls, 1, 10000) == 0);
    CHECK(t2.status != 0);
    CHECK_OK(bex_ps_fetch_sync(pc, 1, 8, k0, (size_t)n0, rows));
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    bex__rpc_clock_hook(NULL); /* (its objects are gone) */
    return stop(&sp[0]) ? 1 : 0;
}

/* A body of method with header (version, flags, table, n, dim) and then
 * extra bytes of filler; len_adj added to the length the header implies. */
static void *bad_body(bex_ctx *ctx, uint32_t method, uint8_t version, uint8_t flags, uint32_t table,
                      uint32_t n, uint32_t dim, long len_adj, size_t *len)
{
    size_t l = (size_t)((long)bex__ps_req_len(method, n, dim) + len_adj);
    uint8_t *b = bex_rpc_alloc(ctx, l);
    CHECK(b);
    memset(b, 0, l);
    if (l >= BEX__PS_HDR_LEN) {
        bex__ps_hdr_put(b, &(struct bex__ps_hdr){.table = table, .n = n, .dim = dim});
        b[0] = version;
        b[1] = flags;
    }
    *len = l;
    return b;
}

/* Malformed bodies each get -EINVAL or -E2BIG (never a crash, never
 * applied, also a Push refused for one NaN); random bytes too; then the
 * server still serves, and leaves cleanly. */
static int t_malformed(void)
{
    int rc = 0;
    struct in_addr a0, a1;
    if ((rc = pair_addrs(&a0, &a1)))
        return rc;
    struct srv_proc sp[NSH];
    for (int s = 0; s < NSH; s++)
        spawn(&sp[s], (uint32_t)s, NULL, MODE_NORMAL);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = raw_chan(ctx, &sp[0]);
    const uint32_t F = BEX_PS_M_FETCH, P = BEX_PS_M_PUSH;
    struct {
        uint32_t m;
        uint8_t ver, flags;
        uint32_t table, n, dim;
        long adj;
        int want;
    } cases[] = {
        {F, 1, 0, 1, 0, 8, -16, -EINVAL},                      /* empty */
        {F, 1, 0, 1, 0, 8, -8, -EINVAL},                       /* short header */
        {F, 2, 0, 1, 2, 8, 0, -EINVAL},                        /* version */
        {F, 1, 1, 1, 2, 8, 0, -EINVAL},                        /* flags */
        {F, 1, 0, 1, 2, 8, -8, -EINVAL},                       /* a key missing */
        {F, 1, 0, 1, 2, 8, 1, -EINVAL},                        /* a byte extra */
        {F, 1, 0, 1, 2, 0, 0, -EINVAL},                        /* dim 0 */
        {F, 1, 0, 9, 2, 8, 0, -EINVAL},                        /* no such table */
        {F, 1, 0, 1, 2, 7, 0, -EINVAL},                        /* the table's dim is 8 */
        {F, 1, 0, 1, BEX_PS_KEYS_MAX + 1, 8, 0, -E2BIG},       /* too many keys */
        {F, 1, 0, 1, 2, BEX_PS_DIM_MAX + 1, 0, -E2BIG},        /* too wide */
        {F, 1, 0, 1, BEX_PS_KEYS_MAX, 4096, 0, -E2BIG},        /* the answer too big */
        {P, 1, 0, 1, 2, 8, -4, -EINVAL},                       /* a gradient short */
        {P, 1, 0, 1, 2, 8, -(long)(4 * 16), -EINVAL},          /* the gradients missing */
        {P, 1, 0, 2, 2, 8, 0, -EINVAL},                        /* table 2's dim is 5 */
        {P, 1, 0, 1, 100000, 8, -(long)(100000 * 40), -E2BIG}, /* n past the bound */
    };
    long sent = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len;
        void *b = bad_body(ctx, cases[i].m, cases[i].ver, cases[i].flags, cases[i].table,
                           cases[i].n, cases[i].dim, cases[i].adj, &len);
        int got = bex_rpc_call_sync(ch, BEX_PS_SERVICE, cases[i].m, len ? b : NULL, len, NULL, NULL,
                                    NULL);
        if (!len)
            bex_rpc_free(b);
        if (got != cases[i].want) {
            fprintf(stderr, "case %zu: %d (%s), want %d\n", i, got, bex_strerror(got),
                    cases[i].want);
            CHECK(0);
        }
        sent++;
    }
    /* a Push with one NaN among good gradients: refused whole */
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    uint64_t mine[2];
    for (int i = 0, k = 0; k < 2; i++) /* two keys of shard 0 */
        if (bex_ps_key_shard(keys[i], NSH) == 0)
            mine[k++] = keys[i];
    {
        size_t len;
        uint8_t *b = bad_body(ctx, P, 1, 0, 1, 2, 8, 0, &len);
        bex__ps_put64(b + 16, mine[0]);
        bex__ps_put64(b + 24, mine[1]);
        for (int i = 0; i < 16; i++)
            bex__ps_putf(b + 32 + 4 * i, i == 13 ? NAN : 0.5f);
        CHECK_EQ(bex_rpc_call_sync(ch, BEX_PS_SERVICE, P, b, len, NULL, NULL, NULL), -EINVAL);
        sent++;
    }
    /* a key of shard 1 among shard 0's: refused whole */
    {
        size_t len;
        uint8_t *b = bad_body(ctx, F, 1, 0, 1, 2, 8, 0, &len);
        int i0 = 0, i1 = 0;
        while (bex_ps_key_shard(keys[i0], NSH) != 0)
            i0++;
        while (bex_ps_key_shard(keys[i1], NSH) != 1)
            i1++;
        bex__ps_put64(b + 16, keys[i0]);
        bex__ps_put64(b + 24, keys[i1]);
        CHECK_EQ(bex_rpc_call_sync(ch, BEX_PS_SERVICE, F, b, len, NULL, NULL, NULL), -EINVAL);
        sent++;
    }
    /* random bytes, random lengths */
    uint32_t seed = 12345;
    for (int i = 0; i < 300; i++) {
        seed = seed * 1103515245u + 12345u;
        size_t len = 1 + (seed >> 16) % 200;
        uint8_t *b = bex_rpc_alloc(ctx, len);
        CHECK(b);
        for (size_t k = 0; k < len; k++) {
            seed = seed * 1103515245u + 12345u;
            b[k] = (uint8_t)(seed >> 24);
        }
        if (i % 2 && len > 4)
            b[0] = 1, b[1] = b[2] = b[3] = 0; /* past the version check */
        int got = bex_rpc_call_sync(ch, BEX_PS_SERVICE, i % 3 ? F : P, b, len, NULL, NULL, NULL);
        CHECK(got == -EINVAL || got == -E2BIG);
        sent++;
    }
    struct srv_stats st = stats_of(ch);
    CHECK_EQ(st.ps.malformed, sent);
    CHECK_EQ(st.ps.pushes, 0);
    CHECK_EQ(st.ps.rows, 0); /* nothing created either */
    CHECK_OK(bex_rpc_channel_destroy(ch));
    /* and it serves: the rows, NaN Push included, are the initial ones */
    bex_dir *d = dir_of(sp);
    bex_ps_client *pc = client_of(ctx, d);
    struct ref r;
    ref_init(&r, &TABLES[0], keys);
    fetch_check(pc, &r, keys, all, NK);
    return client_down(pc, d, ctx, sp, rc) ? 1 : 0;
}

/* Both shards stopped with a snapshot and restarted (new processes, new
 * ports): Fetch returns the same rows, bit for bit, and Adagrad's
 * accumulators came back too (the next Push matches the reference). */
static int t_snapshot(void)
{
    int rc = 0;
    struct in_addr a0, a1;
    if ((rc = pair_addrs(&a0, &a1)))
        return rc;
    char tmpl[] = "/tmp/bex-ps-test-XXXXXX";
    CHECK(mkdtemp(tmpl));
    char snap[NSH][128];
    for (int s = 0; s < NSH; s++)
        snprintf(snap[s], sizeof snap[s], "%s/shard%d", tmpl, s);
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static struct ref r[2];
    static float before[2][NK * DMAX], after[2][NK * DMAX];
    for (int round = 0; round < 2; round++) {
        struct srv_proc sp[NSH];
        for (int s = 0; s < NSH; s++)
            spawn(&sp[s], (uint32_t)s, snap[s], MODE_NORMAL);
        bex_ctx *ctx = client_ctx();
        bex_dir *d = dir_of(sp);
        bex_ps_client *pc = client_of(ctx, d);
        for (int t = 0; t < 2; t++) {
            const bex_ps_table_config *tc = &TABLES[t];
            if (round == 0) {
                ref_init(&r[t], tc, keys);
                push_ref(pc, &r[t], keys, all, NK, 20 + t);
                push_ref(pc, &r[t], keys, all, NK / 2, 30 + t);
                CHECK_OK(bex_ps_fetch_sync(pc, tc->id, tc->dim, keys, NK, before[t]));
                ref_check(&r[t], all, NK, before[t]);
            } else {
                CHECK_OK(bex_ps_fetch_sync(pc, tc->id, tc->dim, keys, NK, after[t]));
                CHECK(memcmp(before[t], after[t], sizeof(float) * NK * tc->dim) == 0);
                push_ref(pc, &r[t], keys, all, NK, 40 + t);
                fetch_check(pc, &r[t], keys, all, NK);
            }
        }
        rc = client_down(pc, d, ctx, sp, rc);
        for (int s = 0; s < NSH; s++)
            CHECK(access(snap[s], R_OK) == 0);
    }
    for (int s = 0; s < NSH; s++)
        unlink(snap[s]);
    rmdir(tmpl);
    return rc ? 1 : 0;
}

static uint8_t *read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    CHECK(f);
    static uint8_t buf[1 << 16];
    *n = fread(buf, 1, sizeof buf, f);
    CHECK(*n > 0 && *n < sizeof buf);
    fclose(f);
    return buf;
}

/* In one process: a snapshot loads into a shard of the same config with
 * the same rows; a file with one byte flipped, cut short, of another shard
 * or of another table shape is refused with -EINVAL (not an empty start);
 * no file is an empty start. */
static int t_snapshot_bad(void)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    bex_ctx *ctx = client_ctx(); /* for bex_rpc_alloc */
    char tmpl[] = "/tmp/bex-ps-test-XXXXXX";
    CHECK(mkdtemp(tmpl));
    char path[128], bad[128];
    snprintf(path, sizeof path, "%s/good", tmpl);
    snprintf(bad, sizeof bad, "%s/bad", tmpl);
    bex_ps_shard_config pc = {.shard = 1, .n_shards = NSH, .tables = TABLES, .n_tables = 2};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    /* 3 rows in each table through Push bodies */
    for (int t = 0; t < 2; t++) {
        uint32_t dim = TABLES[t].dim;
        size_t len = bex__ps_req_len(BEX_PS_M_PUSH, 3, dim);
        uint8_t *b = bex_rpc_alloc(ctx, len);
        CHECK(b);
        bex__ps_hdr_put(b, &(struct bex__ps_hdr){.table = TABLES[t].id, .n = 3, .dim = dim});
        for (int k = 0, i = 0; k < 3; i++) /* keys of shard 1 */
            if (bex_ps_key_shard(key_of(i), NSH) == 1)
                bex__ps_put64(b + 16 + 8 * k++, key_of(i));
        for (uint32_t i = 0; i < 3 * dim; i++)
            bex__ps_putf(b + 16 + 24 + 4 * i, 0.25f * (float)i);
        void *resp;
        size_t rlen;
        CHECK_OK(bex_ps_shard_serve(s, ctx, BEX_PS_M_PUSH, b, len, &resp, &rlen));
        bex_rpc_free(b);
        bex_rpc_free(resp);
    }
    CHECK_OK(bex_ps_shard_snapshot(s, path));
    CHECK(access(path, R_OK) == 0);
    bex_ps_shard_destroy(s);
    /* loads: the same rows */
    pc.snapshot_path = path;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(s, &st);
    CHECK_EQ(st.rows, 6);
    bex_ps_shard_destroy(s);
    size_t n;
    uint8_t *f = read_file(path, &n);
    /* one flipped byte anywhere (header, rows, checksum) */
    size_t at[] = {0, 9, 30, n / 2, n - 40, n - 1};
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
        f[at[i]] ^= 0x10;
        write_file(bad, f, n);
        f[at[i]] ^= 0x10;
        pc.snapshot_path = bad;
        CHECK_EQ(bex_ps_shard_create(&pc, &s), -EINVAL);
    }
    write_file(bad, f, n - 7); /* cut short */
    CHECK_EQ(bex_ps_shard_create(&pc, &s), -EINVAL);
    write_file(bad, f, 10);
    CHECK_EQ(bex_ps_shard_create(&pc, &s), -EINVAL);
    /* another shard's; another table shape */
    pc.snapshot_path = path;
    pc.shard = 0;
    CHECK_EQ(bex_ps_shard_create(&pc, &s), -EINVAL);
    pc.shard = 1;
    bex_ps_table_config other[2] = {TABLES[0], TABLES[1]};
    other[1].dim = 6;
    pc.tables = other;
    CHECK_EQ(bex_ps_shard_create(&pc, &s), -EINVAL);
    other[1].dim = TABLES[1].dim;
    other[1].optimizer = BEX_PS_SGD;
    CHECK_EQ(bex_ps_shard_create(&pc, &s), -EINVAL);
    /* no file: an empty start */
    pc.tables = TABLES;
    pc.snapshot_path = bad;
    unlink(bad);
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    bex_ps_shard_stats_get(s, &st);
    CHECK_EQ(st.rows, 0);
    bex_ps_shard_destroy(s);
    unlink(path);
    rmdir(tmpl);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

/* A body for bex_ps_shard_serve: n keys from key_of(first), gradients g
 * (Push). */
static void *serve_body(bex_ctx *ctx, uint32_t method, uint32_t table, uint32_t dim, int first,
                        uint32_t n, float g, size_t *len)
{
    *len = bex__ps_req_len(method, n, dim);
    uint8_t *b = bex_rpc_alloc(ctx, *len);
    CHECK(b);
    bex__ps_hdr_put(b, &(struct bex__ps_hdr){.table = table, .n = n, .dim = dim});
    for (uint32_t k = 0; k < n; k++)
        bex__ps_put64(b + 16 + 8 * k, key_of(first + (int)k));
    if (method == BEX_PS_M_PUSH)
        for (uint32_t i = 0; i < n * dim; i++)
            bex__ps_putf(b + 16 + 8 * n + 4 * i, g);
    return b;
}

static int serve(bex_ps_shard *s, bex_ctx *ctx, uint32_t method, uint32_t table, uint32_t dim,
                 int first, uint32_t n)
{
    size_t len, rlen = 0;
    void *b = serve_body(ctx, method, table, dim, first, n, 1.0f, &len), *resp = NULL;
    int rc = bex_ps_shard_serve(s, ctx, method, b, len, &resp, &rlen);
    bex_rpc_free(b);
    if (rc == 0)
        CHECK_EQ(rlen, BEX__PS_HDR_LEN + (method == BEX_PS_M_FETCH ? 4 * (size_t)n * dim : 0));
    else
        CHECK(resp == NULL);
    bex_rpc_free(resp);
    return rc;
}

/* In one process: a table's max_rows holds (a request that would pass it
 * is -ENOSPC and creates nothing, rows already there are still served);
 * configurations out of range are -EINVAL; an unknown method -ENOSYS. */
static int t_limits(void)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    bex_ctx *ctx = client_ctx();
    bex_ps_table_config t = {.id = 1, .dim = 4, .optimizer = BEX_PS_SGD, .max_rows = 4};
    bex_ps_shard_config pc = {.shard = 0, .n_shards = 1, .tables = &t, .n_tables = 1};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    bex_ps_shard_stats st;
    CHECK_EQ(serve(s, ctx, BEX_PS_M_PUSH, 1, 4, 0, 5), -ENOSPC);
    bex_ps_shard_stats_get(s, &st);
    CHECK(st.rows == 0 && st.pushes == 0);
    CHECK_OK(serve(s, ctx, BEX_PS_M_PUSH, 1, 4, 0, 3));
    CHECK_EQ(serve(s, ctx, BEX_PS_M_FETCH, 1, 4, 2, 3), -ENOSPC); /* 2 new of 3 */
    CHECK_OK(serve(s, ctx, BEX_PS_M_FETCH, 1, 4, 1, 3));          /* 1 new: the 4th */
    CHECK_OK(serve(s, ctx, BEX_PS_M_FETCH, 1, 4, 0, 4));
    CHECK_EQ(serve(s, ctx, BEX_PS_M_FETCH, 1, 4, 4, 1), -ENOSPC);
    bex_ps_shard_stats_get(s, &st);
    CHECK(st.rows == 4 && st.pushes == 1 && st.fetches == 2 && st.malformed == 0);
    size_t len;
    void *b = serve_body(ctx, BEX_PS_M_FETCH, 1, 4, 0, 1, 0, &len), *resp = NULL;
    CHECK_EQ(bex_ps_shard_serve(s, ctx, BEX_PS_M_CUT + 1, b, len, &resp, &len), -ENOSYS);
    bex_rpc_free(b);
    bex_ps_shard_destroy(s);
    /* configurations refused */
    bex_ps_table_config bad[] = {
        {.id = 1, .dim = 0, .optimizer = BEX_PS_SGD},
        {.id = 1, .dim = BEX_PS_DIM_MAX + 1, .optimizer = BEX_PS_SGD},
        {.id = 1, .dim = 4, .optimizer = 3},
        {.id = 1, .dim = 4, .optimizer = BEX_PS_SGD, .lr = -1},
        {.id = 1, .dim = 4, .optimizer = BEX_PS_SGD, .lr = NAN},
        {.id = 1, .dim = 4, .optimizer = BEX_PS_SGD, .max_rows = (1u << 30) + 1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pc.tables = &bad[i];
        CHECK_EQ(bex_ps_shard_create(&pc, &s), -EINVAL);
    }
    bex_ps_table_config twice[2] = {t, t};
    pc.tables = twice;
    pc.n_tables = 2;
    CHECK_EQ(bex_ps_shard_create(&pc, &s), -EINVAL);
    pc.tables = &t;
    pc.n_tables = 1;
    pc.shard = 1; /* of 1 */
    CHECK_EQ(bex_ps_shard_create(&pc, &s), -EINVAL);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

/* In one process: 100000 rows (the table grows and rehashes many times)
 * pushed in batches of 10000 keys with gradient 1 and SGD rate 1: every
 * row Fetched is its initial value - 1; the same after a snapshot and a
 * load into a new shard. */
static int t_many_rows(void)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    bex_ctx *ctx = client_ctx();
    enum { ROWS = 100000, BATCH = 10000 };
    bex_ps_table_config t = {.id = 7, .dim = 2, .optimizer = BEX_PS_SGD, .lr = 1.0f};
    bex_ps_shard_config pc = {.shard = 0, .n_shards = 1, .tables = &t, .n_tables = 1};
    char tmpl[] = "/tmp/bex-ps-test-XXXXXX";
    CHECK(mkdtemp(tmpl));
    char path[128];
    snprintf(path, sizeof path, "%s/snap", tmpl);
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    for (int first = 0; first < ROWS; first += BATCH)
        CHECK_OK(serve(s, ctx, BEX_PS_M_PUSH, 7, 2, first, BATCH));
    for (int round = 0; round < 2; round++) {
        bex_ps_shard_stats st;
        bex_ps_shard_stats_get(s, &st);
        CHECK_EQ(st.rows, ROWS);
        for (int first = 0; first < ROWS; first += BATCH) {
            size_t len, rlen;
            void *b = serve_body(ctx, BEX_PS_M_FETCH, 7, 2, first, BATCH, 0, &len), *resp;
            CHECK_OK(bex_ps_shard_serve(s, ctx, BEX_PS_M_FETCH, b, len, &resp, &rlen));
            bex_rpc_free(b);
            const uint8_t *p = (const uint8_t *)resp + BEX__PS_HDR_LEN;
            for (int k = 0; k < BATCH; k++)
                for (uint32_t c = 0; c < 2; c++, p += 4) {
                    float want = bex_ps_init_value(7, key_of(first + k), c, 0.01f) - 1.0f;
                    CHECK(bex__ps_getf(p) == want);
                }
            bex_rpc_free(resp);
        }
        bex_ps_shard_stats_get(s, &st);
        CHECK_EQ(st.rows, ROWS); /* Fetches created none */
        if (round == 0) {
            CHECK_OK(bex_ps_shard_snapshot(s, path));
            bex_ps_shard_destroy(s);
            pc.snapshot_path = path;
            CHECK_OK(bex_ps_shard_create(&pc, &s));
        }
    }
    bex_ps_shard_destroy(s);
    unlink(path);
    rmdir(tmpl);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

/* A free TCP port on 127.0.0.1 (racy, but only this test uses it). */
/* bex-ps serving both shards of the cluster file, snapshots in snapdir. */
static pid_t start_bex_ps(const char *cluster, const char *snapdir)
{
    const char *args[] = {"--cluster",      cluster, "--shard",     "all", "--table", "1:8:sgd:0.1",
                          "--snapshot-dir", snapdir, "--transport", "tcp", NULL};
    return bex_ps_start(args, NULL, 0);
}

/* The bex-ps program: two shards from a cluster file, Pushes and Fetches
 * through the client match the reference; SIGTERM stops it cleanly with
 * a snapshot per shard; started again it serves the same rows. (TCP
 * natively only: the cluster file names loopback addresses.) */
static int t_program(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program case runs over TCP only");
    char tmpl[] = "/tmp/bex-ps-test-XXXXXX";
    CHECK(mkdtemp(tmpl));
    char cluster[128], j[512];
    snprintf(cluster, sizeof cluster, "%s/cluster.json", tmpl);
    snprintf(j, sizeof j,
             "{\"version\":1,\"services\":{\"ps\":{\"shards\":["
             "{\"replicas\":[{\"addr\":\"127.0.0.1:%u\",\"transport\":\"tcp\"}]},"
             "{\"replicas\":[{\"addr\":\"127.0.0.1:%u\",\"transport\":\"tcp\"}]}]}}}\n",
             free_port(), free_port());
    write_file(cluster, j, strlen(j));
    const bex_ps_table_config tc = {.id = 1,
                                    .dim = 8,
                                    .optimizer = BEX_PS_SGD,
                                    .lr = 0.1f,
                                    .init_scale = 0.01f}; /* bex-ps's default scale */
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static struct ref r;
    ref_init(&r, &tc, keys);
    static float before[NK * DMAX], after[NK * DMAX];
    for (int round = 0; round < 2; round++) {
        pid_t pid = start_bex_ps(cluster, tmpl);
        bex_ctx *ctx = client_ctx();
        bex_dir *d;
        char err[256];
        CHECK_OK(bex_dir_create(NULL, &d));
        CHECK_OK(bex_dir_load_file(d, cluster, err, sizeof err));
        bex_ps_client *pc = client_of(ctx, d);
        if (round == 0) {
            push_ref(pc, &r, keys, all, NK, 50);
            CHECK_OK(bex_ps_fetch_sync(pc, 1, 8, keys, NK, before));
            ref_check(&r, all, NK, before);
            /* SIGUSR1: a snapshot per shard on demand, the server goes on */
            char p0[192];
            snprintf(p0, sizeof p0, "%s/ps-shard0-replica0.snap", tmpl);
            CHECK(access(p0, F_OK) != 0);
            CHECK(kill(pid, SIGUSR1) == 0);
            uint64_t end = pair_now_ms() + 10000ull * time_scale();
            while (access(p0, R_OK) != 0 && pair_now_ms() < end)
                pair_sleep_ms(5);
            CHECK(access(p0, R_OK) == 0);
            CHECK_OK(bex_ps_fetch_sync(pc, 1, 8, keys, NK, after));
            CHECK(memcmp(before, after, sizeof before) == 0);
        } else {
            CHECK_OK(bex_ps_fetch_sync(pc, 1, 8, keys, NK, after));
            CHECK(memcmp(before, after, sizeof before) == 0);
        }
        bex_ps_client_destroy(pc);
        bex_dir_destroy(d);
        CHECK_OK(bex_ctx_destroy(ctx));
        term_bex_ps(pid);
        for (int s = 0; s < NSH; s++) {
            char p[192];
            snprintf(p, sizeof p, "%s/ps-shard%d-replica0.snap", tmpl, s);
            CHECK(access(p, R_OK) == 0);
            if (round == 1)
                unlink(p);
        }
    }
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0); /* nothing else left behind (no .tmp) */
    return 0;
}

BEX_TEST_MAIN({"train", t_train}, {"write_once", t_write_once}, {"deadline", t_deadline},
              {"malformed", t_malformed}, {"snapshot", t_snapshot},
              {"snapshot_bad", t_snapshot_bad}, {"limits", t_limits}, {"many_rows", t_many_rows},
              {"program", t_program})
