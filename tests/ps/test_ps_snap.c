/* SPDX-License-Identifier: Apache-2.0 */
/* Consistent cuts of the whole model and the operations metrics (issue
 * 29 items 3 and 5; docs/architecture.md, "Snapshots"): shards in this
 * process, each behind its own RPC server and context, natively over TCP.
 *
 * cut: two shards, three trainers Pushing integer gradients (each to its
 *   own keys on both shards, each waiting for every acknowledgement) while
 *   cuts are taken; each cut restored into fresh shards holds, of each
 *   trainer, exactly a prefix of its Pushes (counted from the rows:
 *   both shards agree within the one Push in flight, at least the Pushes
 *   acknowledged before the cut began, at most those sent before it
 *   ended); the last cut, incremental, taken once they stopped, restored
 *   shard by shard, equals the live shards bit for bit (Adagrad's
 *   accumulators included); the Pushes' pause is reported and bounded.
 * skew: the two phases by hand, PREPARE reaching one shard 150 ms before
 *   the other: still a prefix of each trainer's Pushes (without the hold,
 *   the later shard's part ran many Pushes ahead: it fails so).
 * incremental: an incremental cut holds only the rows changed since the
 *   cut before; every cut_full_every-th is full.
 * pause: PREPARE without COMMIT: a Push sent meanwhile waits and succeeds
 *   once the pause (cut_pause_ms) ends, not before; COMMIT then is
 *   answered -ETIMEDOUT and no file is written; a PREPARE too soon is
 *   refused -EBUSY; the next cut is full.
 * hold_max: past cut_hold_max bytes held the cut gives way at once (the
 *   Push served, COMMIT -ETIMEDOUT).
 * bad_files: truncated, corrupt, other shard's, missing base: a clear
 *   error (logged), no shard.
 * lag: a primary's backup gone: its lag in Pushes and seconds shows in
 *   bex_ps_shard_stats and /metrics' text; a backup's forward age; the
 *   snapshot age, duration and failovers families.
 * join: a third replica joins a running primary while two trainers Push;
 *   afterwards all three are equal bit for bit (Adagrad too). */
#include <pthread.h>
#include <stdatomic.h>
#include <sys/stat.h>

#include "ps_test.h"
#include "ps/shard_internal.h"

static const bex_ps_table_config ST[] = {
    {.id = 1, .dim = 4, .optimizer = BEX_PS_SGD, .lr = 1.0f, .init_scale = 0.5f},
    {.id = 2, .dim = 2, .optimizer = BEX_PS_ADAGRAD, .lr = 0.5f, .init_scale = 0.5f},
};
#define NS    2 /* shards */
#define NT    3 /* trainers */
#define NKEYS 6 /* keys per trainer, both shards */

struct node {
    bex_ctx *ctx;
    bex_ps_shard *s;
    bex_rpc_server *srv;
    bex_addr addr;
};

struct cluster {
    struct node n[NS];
    uint32_t ns;
    bex_ctx *cctx;
    bex_dir *dir;
    char tmp[64];
};

static bex_ps_shard_config shard_cfg(const struct cluster *c, uint32_t shard)
{
    return (bex_ps_shard_config){.shard = shard,
                                 .n_shards = c->ns,
                                 .tables = ST,
                                 .n_tables = 2,
                                 .cut_dir = c->tmp,
                                 .cut_pause_ms = 2000 * time_scale(),
                                 .cut_min_interval_ms = 1,
                                 .cut_full_every = 4};
}

static void node_start(struct node *n, const bex_ps_shard_config *pc)
{
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config sc = scaled(&base, a0);
    CHECK_OK(bex_ctx_create(&sc, &n->ctx));
    CHECK_OK(bex_ps_shard_create(pc, &n->s));
    CHECK_OK(bex_rpc_server_create(n->ctx, NULL, &n->srv));
    CHECK_OK(bex_ps_shard_register(n->s, n->srv, n->ctx));
    if (!bex_addr_port(&n->addr))
        n->addr = (bex_addr){.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    CHECK_OK(bex_rpc_server_listen(n->srv, &n->addr));
    bex_rpc_server_addr(n->srv, &n->addr);
}

static void node_stop(struct node *n)
{
    if (n->srv)
        CHECK_OK(bex_rpc_server_destroy(n->srv));
    bex_ps_shard_destroy(n->s);
    if (n->ctx)
        CHECK_OK(bex_ctx_destroy(n->ctx));
    n->srv = NULL;
    n->s = NULL;
    n->ctx = NULL;
}

static bex_dir *dir_of(const struct cluster *c)
{
    bex_addr a[NS];
    for (uint32_t k = 0; k < c->ns; k++)
        a[k] = c->n[k].addr;
    return dir_of_shards(a, (int)c->ns, false);
}

static int cluster_start(struct cluster *c, uint32_t ns, uint32_t full_every)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    *c = (struct cluster){.ns = ns};
    snprintf(c->tmp, sizeof c->tmp, "/tmp/bex-snap-XXXXXX");
    CHECK(mkdtemp(c->tmp));
    for (uint32_t k = 0; k < ns; k++) {
        bex_ps_shard_config pc = shard_cfg(c, k);
        pc.cut_full_every = full_every;
        node_start(&c->n[k], &pc);
    }
    c->cctx = client_ctx();
    c->dir = dir_of(c);
    return 0;
}

static void cluster_stop(struct cluster *c)
{
    for (uint32_t k = 0; k < c->ns; k++)
        node_stop(&c->n[k]);
    bex_dir_destroy(c->dir);
    CHECK_OK(bex_ctx_destroy(c->cctx));
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", c->tmp);
    CHECK(system(cmd) == 0);
}

static bex_ps_client *client(const struct cluster *c)
{
    bex_ps_client_config cc = {.dir = c->dir,
                               .service = "ps",
                               .timeout_ms = 20000 * time_scale(),
                               .connect_timeout_ms = 15000 * time_scale()};
    bex_ps_client *pc;
    CHECK_OK(bex_ps_client_create(c->cctx, &cc, &pc));
    return pc;
}

/* Each cut starts 2 ms after the last: a replica refuses (-EBUSY) a
 * PREPARE sooner than cut_min_interval_ms (1 here) after its last one,
 * and on a quiet host a cut of a few rows ends in under a millisecond. */
static int cut(struct cluster *c, uint32_t flags, bex_ps_snapshot_result *r)
{
    pair_sleep_ms(2);
    bex_ps_snapshot_config sc = {
        .dir = c->dir, .service = "ps", .flags = flags, .timeout_ms = 20000 * time_scale()};
    return bex_ps_snapshot_all(c->cctx, &sc, r);
}

/* ---- cut ---- */

struct trainer {
    bex_ps_client *pc;
    int id;
    _Atomic uint64_t acked, sent;
    _Atomic bool *stop;
};

static uint64_t tkey(int t, int j)
{
    return 1000u * (uint64_t)(t + 1) + (uint64_t)j;
}

static void *trainer_main(void *arg)
{
    struct trainer *u = arg;
    uint64_t keys[NKEYS];
    float g1[NKEYS * 4], g2[NKEYS * 2];
    for (int j = 0; j < NKEYS; j++)
        keys[j] = tkey(u->id, j);
    for (int j = 0; j < NKEYS * 4; j++)
        g1[j] = -1.0f; /* +1 a Push: SGD with lr 1 */
    for (int j = 0; j < NKEYS * 2; j++)
        g2[j] = 1.0f;
    while (!atomic_load(u->stop)) {
        atomic_fetch_add(&u->sent, 1);
        /* one Push per table: the SGD one counts */
        CHECK_OK(bex_ps_push_sync(u->pc, ST[0].id, ST[0].dim, keys, NKEYS, g1));
        atomic_fetch_add(&u->acked, 1);
        CHECK_OK(bex_ps_push_sync(u->pc, ST[1].id, ST[1].dim, keys, NKEYS, g2));
    }
    return NULL;
}

/* The Pushes of count n on key's SGD row (column 0): its initial value
 * plus one n times, as the shard adds them. -1: no such count. */
static int64_t count_of(uint64_t key, float v, uint64_t max)
{
    float f = bex_ps_init_value(ST[0].id, key, 0, ST[0].init_scale);
    for (uint64_t n = 0; n <= max; n++, f -= ST[0].lr * -1.0f)
        if (memcmp(&f, &v, 4) == 0)
            return (int64_t)n;
    return -1;
}

/* Column 0 of key's SGD row at shard s (0 when it has none). */
static float row0(bex_ps_shard *s, uint64_t key, bool *has)
{
    struct table *t = bex__ps_find_table(s, ST[0].id);
    uint32_t r = bex__ps_row_find(t, key);
    *has = r != UINT32_MAX;
    return *has ? t->vals[(size_t)r * t->width] : 0;
}

/* Restore cut id into fresh shards (not serving) and check each
 * trainer's counts: one per shard, equal on all its keys there, within
 * one Push of each other, from lo[t] to hi[t]. */
static void check_prefix(struct cluster *c, uint64_t id, const uint64_t *lo, const uint64_t *hi)
{
    bex_ps_shard *rs[NS];
    for (uint32_t k = 0; k < c->ns; k++) {
        bex_ps_shard_config pc = shard_cfg(c, k);
        pc.restore_cut = id;
        CHECK_OK(bex_ps_shard_create(&pc, &rs[k]));
    }
    for (int t = 0; t < NT; t++) {
        int64_t per[NS] = {-1, -1};
        for (int j = 0; j < NKEYS; j++) {
            uint64_t key = tkey(t, j);
            uint32_t k = bex_ps_key_shard(key, c->ns);
            bool has;
            float v = row0(rs[k], key, &has);
            int64_t n = has ? count_of(key, v, hi[t] + 1) : 0;
            CHECK(n >= 0);
            if (per[k] < 0)
                per[k] = n;
            CHECK_EQ(per[k], n); /* a Push is whole on one shard */
        }
        CHECK(per[0] >= 0 && per[1] >= 0); /* keys on both shards */
        int64_t mn = per[0] < per[1] ? per[0] : per[1], mx = per[0] ^ per[1] ^ mn;
        printf("cut %llu trainer %d: %lld and %lld Pushes (acked before %llu, sent by the end "
               "%llu)\n",
               (unsigned long long)id, t, (long long)per[0], (long long)per[1],
               (unsigned long long)lo[t], (unsigned long long)hi[t]);
        CHECK(mx - mn <= 1);         /* a prefix: only the Push in flight straddles */
        CHECK(mn >= (int64_t)lo[t]); /* every Push acknowledged before the cut */
        CHECK(mx <= (int64_t)hi[t]); /* none sent after it */
    }
    for (uint32_t k = 0; k < c->ns; k++)
        bex_ps_shard_destroy(rs[k]);
}

/* Every row of a (both tables, every float) equal bit for bit in b. */
static void same_rows(bex_ps_shard *a, bex_ps_shard *b)
{
    for (size_t i = 0; i < a->n_tables; i++) {
        const struct table *ta = &a->tables[i];
        const struct table *tb = bex__ps_find_table(b, ta->cfg.id);
        CHECK_EQ(ta->n_rows, tb->n_rows);
        for (uint32_t r = 0; r < ta->n_rows; r++) {
            uint32_t q = bex__ps_row_find(tb, ta->keys[r]);
            CHECK(q != UINT32_MAX);
            CHECK(memcmp(ta->vals + (size_t)r * ta->width, tb->vals + (size_t)q * tb->width,
                         4 * (size_t)ta->width) == 0);
        }
    }
}

static void cut_while_training(struct cluster *c, struct trainer *u, uint64_t *id, bool want_full)
{
    uint64_t lo[NT], hi[NT];
    for (int t = 0; t < NT; t++)
        lo[t] = atomic_load(&u[t].acked);
    bex_ps_snapshot_result r;
    CHECK_OK(cut(c, 0, &r));
    for (int t = 0; t < NT; t++)
        hi[t] = atomic_load(&u[t].sent);
    printf("cut %llu: %u shards, %u full, %llu rows, %llu Pushes held, pause %.1f ms\n",
           (unsigned long long)r.cut_id, r.shards, r.full, (unsigned long long)r.rows,
           (unsigned long long)r.held, (double)r.pause_ns_max / 1e6);
    CHECK_EQ(r.shards, c->ns);
    CHECK_EQ(r.full, want_full ? c->ns : 0);
    /* bounded: the shard's cut_pause_ms at most (a cut past it aborts) */
    CHECK(r.pause_ns_max < 2000ull * time_scale() * 1000000ull);
    *id = r.cut_id;
    check_prefix(c, r.cut_id, lo, hi);
}

/* NT trainers on c, Pushing until *stop, each with 20 Pushes
 * acknowledged when this returns. */
static void trainers_start(struct cluster *c, struct trainer *u, pthread_t *th, _Atomic bool *stop)
{
    for (int t = 0; t < NT; t++) {
        u[t] = (struct trainer){.pc = client(c), .id = t, .stop = stop};
        CHECK(pthread_create(&th[t], NULL, trainer_main, &u[t]) == 0);
    }
    while (atomic_load(&u[NT - 1].acked) < 20)
        pair_sleep_ms(5);
}

/* The trainers stopped, their clients gone. */
static void trainers_stop(struct trainer *u, pthread_t *th, _Atomic bool *stop)
{
    atomic_store(stop, true);
    for (int t = 0; t < NT; t++) {
        CHECK(pthread_join(th[t], NULL) == 0);
        bex_ps_client_destroy(u[t].pc);
    }
}

static int t_cut(void)
{
    struct cluster c;
    int rc = cluster_start(&c, NS, 4);
    if (rc)
        return rc;
    _Atomic bool stop = false;
    struct trainer u[NT];
    pthread_t th[NT];
    trainers_start(&c, u, th, &stop);
    uint64_t id1, id2;
    cut_while_training(&c, u, &id1, true); /* the first: full */
    pair_sleep_ms(50);
    cut_while_training(&c, u, &id2, false); /* incremental to it */
    CHECK(id2 > id1);
    trainers_stop(u, th, &stop);
    bex_ps_snapshot_result r;
    CHECK_OK(cut(&c, 0, &r));
    CHECK_EQ(r.full, 0);
    /* restore each shard alone: equal to the live one, Adagrad's
     * accumulators included */
    for (uint32_t k = 0; k < NS; k++) {
        bex_ps_shard_config pc = shard_cfg(&c, k);
        pc.restore_cut = r.cut_id;
        bex_ps_shard *rs;
        CHECK_OK(bex_ps_shard_create(&pc, &rs));
        same_rows(c.n[k].s, rs);
        bex_ps_shard_stats st;
        bex_ps_shard_stats_get(c.n[k].s, &st);
        CHECK_EQ(st.snaps, 3);
        CHECK_EQ(st.snap_id, r.cut_id);
        CHECK(st.snap_unix_ns > 0);
        bex_ps_shard_destroy(rs);
    }
    cluster_stop(&c);
    return 0;
}

/* ---- incremental ---- */

static void push_keys(bex_ps_client *pc, const uint64_t *keys, size_t n)
{
    float g[64 * 4];
    for (size_t i = 0; i < n * 4; i++)
        g[i] = -1.0f;
    CHECK_OK(bex_ps_push_sync(pc, ST[0].id, ST[0].dim, keys, n, g));
}

static int t_incremental(void)
{
    struct cluster c;
    int rc = cluster_start(&c, 1, 3);
    if (rc)
        return rc;
    bex_ps_client *pc = client(&c);
    uint64_t keys[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, more[3] = {2, 5, 77};
    push_keys(pc, keys, 10);
    bex_ps_snapshot_result r1, r2, r3, r4;
    CHECK_OK(cut(&c, 0, &r1));
    CHECK(r1.full == 1 && r1.rows == 10);
    push_keys(pc, more, 3);
    CHECK_OK(cut(&c, 0, &r2));
    CHECK(r2.full == 0 && r2.rows == 3); /* the changed rows alone */
    CHECK_OK(cut(&c, 0, &r3));
    CHECK(r3.full == 0 && r3.rows == 0); /* nothing changed */
    CHECK_OK(cut(&c, 0, &r4));
    CHECK(r4.full == 1 && r4.rows == 11); /* every third: full */
    CHECK_OK(cut(&c, BEX_PS_SNAPSHOT_FULL, &r1));
    CHECK(r1.full == 1 && r1.rows == 11);
    /* restore of r3 (full r1, then r2 and r3) equals the shard now */
    bex_ps_shard_config sc = shard_cfg(&c, 0);
    sc.restore_cut = r3.cut_id;
    bex_ps_shard *rs;
    CHECK_OK(bex_ps_shard_create(&sc, &rs));
    same_rows(c.n[0].s, rs);
    bex_ps_shard_destroy(rs);
    bex_ps_client_destroy(pc);
    cluster_stop(&c);
    return 0;
}

/* ---- pause ---- */

static bex_rpc_channel *chan(const struct cluster *c, uint32_t k)
{
    bex_rpc_endpoint ep = {.addr = c->n[k].addr};
    bex_rpc_channel_config cc = {.endpoints = &ep,
                                 .n_endpoints = 1,
                                 .name = "raw",
                                 .request_timeout_ms = 20000 * time_scale(),
                                 .connect_timeout_ms = 15000 * time_scale(),
                                 .max_attempts = 1};
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(c->cctx, &cc, &ch));
    return ch;
}

static int cut_call(bex_ctx *ctx, bex_rpc_channel *ch, uint8_t op, uint64_t id)
{
    uint8_t *b = bex_rpc_alloc(ctx, BEX__PS_CUT_HDR_LEN);
    CHECK(b);
    bex__ps_cut_put(b, &(struct bex__ps_cut_hdr){.op = op, .id = id});
    void *resp = NULL;
    int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, BEX_PS_M_CUT, b, BEX__PS_CUT_HDR_LEN, NULL,
                               &resp, NULL);
    bex_rpc_free(resp);
    return rc;
}

struct pushed {
    bex_ps_client *pc;
    _Atomic uint64_t done_ms;
};

static void *push_one(void *arg)
{
    struct pushed *p = arg;
    uint64_t key = 4;
    push_keys(p->pc, &key, 1);
    atomic_store(&p->done_ms, pair_now_ms());
    return NULL;
}

static int t_pause(void)
{
    struct cluster c;
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    c = (struct cluster){.ns = 1};
    snprintf(c.tmp, sizeof c.tmp, "/tmp/bex-snap-XXXXXX");
    CHECK(mkdtemp(c.tmp));
    bex_ps_shard_config pc = shard_cfg(&c, 0);
    uint32_t pause_ms = 300;
    pc.cut_pause_ms = pause_ms;
    pc.cut_min_interval_ms = 60000; /* the second PREPARE: too soon */
    node_start(&c.n[0], &pc);
    c.cctx = client_ctx();
    c.dir = dir_of(&c);
    struct pushed p = {.pc = client(&c)};
    uint64_t key = 4;
    push_keys(p.pc, &key, 1); /* connected */
    bex_rpc_channel *ch = chan(&c, 0);
    uint64_t t0 = pair_now_ms();
    CHECK_OK(cut_call(c.cctx, ch, BEX__PS_CUT_PREPARE, 42));
    pthread_t th;
    CHECK(pthread_create(&th, NULL, push_one, &p) == 0);
    pair_sleep_ms(pause_ms / 3);
    CHECK_EQ(atomic_load(&p.done_ms), 0); /* held */
    CHECK(pthread_join(th, NULL) == 0);   /* then served: never failed */
    uint64_t waited = atomic_load(&p.done_ms) - t0;
    printf("a Push during the pause waited %llu ms (pause %u ms)\n", (unsigned long long)waited,
           pause_ms);
    CHECK(waited >= pause_ms * 9 / 10);
    CHECK_EQ(cut_call(c.cctx, ch, BEX__PS_CUT_COMMIT, 42), -ETIMEDOUT);
    CHECK_EQ(cut_call(c.cctx, ch, BEX__PS_CUT_PREPARE, 43), -EBUSY);
    char path[256];
    CHECK_OK(bex__ps_cut_path(path, sizeof path, c.tmp, 0, 42));
    struct stat st;
    CHECK(stat(path, &st) != 0); /* no file for a void cut */
    bex_ps_shard_stats ss;
    bex_ps_shard_stats_get(c.n[0].s, &ss);
    CHECK_EQ(ss.snap_failures, 1);
    CHECK_EQ(ss.pushes, 2);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_ps_client_destroy(p.pc);
    cluster_stop(&c);
    return 0;
}

/* Past cut_hold_max bytes held the cut gives way at once: the Push held
 * is served well before the pause's end, COMMIT is refused. */
static int t_hold_max(void)
{
    struct cluster c;
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    c = (struct cluster){.ns = 1};
    snprintf(c.tmp, sizeof c.tmp, "/tmp/bex-snap-XXXXXX");
    CHECK(mkdtemp(c.tmp));
    bex_ps_shard_config pc = shard_cfg(&c, 0);
    pc.cut_pause_ms = 20000; /* not what ends it */
    pc.cut_hold_max = 16;    /* one Push is more */
    node_start(&c.n[0], &pc);
    c.cctx = client_ctx();
    c.dir = dir_of(&c);
    struct pushed p = {.pc = client(&c)};
    uint64_t key = 4;
    push_keys(p.pc, &key, 1);
    bex_rpc_channel *ch = chan(&c, 0);
    uint64_t t0 = pair_now_ms();
    CHECK_OK(cut_call(c.cctx, ch, BEX__PS_CUT_PREPARE, 42));
    pthread_t th;
    CHECK(pthread_create(&th, NULL, push_one, &p) == 0);
    CHECK(pthread_join(th, NULL) == 0);
    CHECK(atomic_load(&p.done_ms) - t0 < 10000);
    CHECK_EQ(cut_call(c.cctx, ch, BEX__PS_CUT_COMMIT, 42), -ETIMEDOUT);
    bex_ps_shard_stats ss;
    bex_ps_shard_stats_get(c.n[0].s, &ss);
    CHECK(ss.snap_failures == 1 && ss.pushes == 2 && ss.snaps == 0);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_ps_client_destroy(p.pc);
    cluster_stop(&c);
    return 0;
}

/* ---- bad_files ---- */

static char logged[4096];

static void log_keep(int level, const char *msg, void *arg)
{
    (void)arg;
    (void)level;
    size_t n = strlen(logged);
    snprintf(logged + n, sizeof logged - n, "%s\n", msg);
}

static int restore_err(struct cluster *c, uint32_t shard, uint64_t id, const char *want)
{
    bex_ps_shard_config pc = shard_cfg(c, shard);
    pc.restore_cut = id;
    pc.log_fn = log_keep;
    logged[0] = 0;
    bex_ps_shard *s = NULL;
    int rc = bex_ps_shard_create(&pc, &s);
    CHECK(rc != 0 && !s);
    if (!strstr(logged, want)) {
        fprintf(stderr, "log lacks \"%s\":\n%s", want, logged);
        CHECK(0);
    }
    return rc;
}

static void file_of(const struct cluster *c, uint32_t shard, uint64_t id, char *path)
{
    CHECK_OK(bex__ps_cut_path(path, 256, c->tmp, shard, id));
}

static int t_bad_files(void)
{
    struct cluster c;
    int rc = cluster_start(&c, NS, 8);
    if (rc)
        return rc;
    bex_ps_client *pc = client(&c);
    uint64_t keys[4] = {1, 2, 3, 4};
    push_keys(pc, keys, 4);
    bex_ps_snapshot_result r1, r2;
    CHECK_OK(cut(&c, 0, &r1));
    push_keys(pc, keys, 2);
    CHECK_OK(cut(&c, 0, &r2));
    char p0[256], p1[256], cmd[600];
    /* the base of an incremental cut missing */
    file_of(&c, 1, r1.cut_id, p1);
    CHECK(unlink(p1) == 0);
    CHECK_EQ(restore_err(&c, 1, r2.cut_id, "whose file is missing"), -ENOENT);
    /* truncated */
    file_of(&c, 0, r1.cut_id, p0);
    struct stat fst;
    CHECK(stat(p0, &fst) == 0);
    CHECK(truncate(p0, fst.st_size - 7) == 0);
    CHECK_EQ(restore_err(&c, 0, r1.cut_id, "checksum mismatch"), -EINVAL);
    CHECK(truncate(p0, 10) == 0);
    CHECK_EQ(restore_err(&c, 0, r1.cut_id, "truncated"), -EINVAL);
    /* an incremental cut whose base is bad */
    CHECK_EQ(restore_err(&c, 0, r2.cut_id, "truncated"), -EINVAL);
    /* a byte changed */
    file_of(&c, 1, r2.cut_id, p1);
    snprintf(cmd, sizeof cmd, "printf 'Z' | dd of=%s bs=1 seek=60 conv=notrunc 2>/dev/null", p1);
    CHECK(system(cmd) == 0);
    CHECK_EQ(restore_err(&c, 1, r2.cut_id, "checksum mismatch"), -EINVAL);
    /* another shard's file under this shard's name */
    bex_ps_snapshot_result r3;
    CHECK_OK(cut(&c, BEX_PS_SNAPSHOT_FULL, &r3));
    file_of(&c, 1, r3.cut_id, p1);
    file_of(&c, 0, r3.cut_id, p0);
    snprintf(cmd, sizeof cmd, "cp %s %s", p1, p0);
    CHECK(system(cmd) == 0);
    CHECK_EQ(restore_err(&c, 0, r3.cut_id, "not cut"), -EINVAL);
    /* a cut never taken */
    CHECK_EQ(restore_err(&c, 0, 12345, "shard0-cut12345"), -ENOENT);
    bex_ps_client_destroy(pc);
    cluster_stop(&c);
    return 0;
}

/* ---- skew ---- */

/* The cut's two phases by hand, PREPARE reaching shard 0 well before
 * shard 1 (as a slow network would have it): the trainers, held at shard
 * 0, cannot move on at shard 1 meanwhile, so the cut still holds a prefix
 * of each one's Pushes. Without the hold, shard 1's part would be many
 * Pushes ahead of shard 0's. */
static int t_skew(void)
{
    struct cluster c;
    int rc = cluster_start(&c, NS, 4);
    if (rc)
        return rc;
    _Atomic bool stop = false;
    struct trainer u[NT];
    pthread_t th[NT];
    trainers_start(&c, u, th, &stop);
    bex_rpc_channel *ch[NS] = {chan(&c, 0), chan(&c, 1)};
    uint64_t lo[NT], hi[NT], id = 777;
    for (int t = 0; t < NT; t++)
        lo[t] = atomic_load(&u[t].acked);
    CHECK_OK(cut_call(c.cctx, ch[0], BEX__PS_CUT_PREPARE, id));
    pair_sleep_ms(150);
    CHECK_OK(cut_call(c.cctx, ch[1], BEX__PS_CUT_PREPARE, id));
    CHECK_OK(cut_call(c.cctx, ch[0], BEX__PS_CUT_COMMIT, id));
    CHECK_OK(cut_call(c.cctx, ch[1], BEX__PS_CUT_COMMIT, id));
    for (int t = 0; t < NT; t++)
        hi[t] = atomic_load(&u[t].sent);
    check_prefix(&c, id, lo, hi);
    trainers_stop(u, th, &stop);
    for (int k = 0; k < NS; k++)
        CHECK_OK(bex_rpc_channel_destroy(ch[k]));
    cluster_stop(&c);
    return 0;
}

/* ---- lag ---- */

static _Atomic int async_rc = 1;

static void push_done(int status, void *user)
{
    (void)user;
    atomic_store(&async_rc, status);
}

static void prom_has(bex_ps_shard *s, const char *want)
{
    static char buf[1 << 16];
    int n = bex_ps_shard_prometheus(&s, 1, buf, sizeof buf);
    CHECK(n > 0 && (size_t)n < sizeof buf);
    if (!strstr(buf, want)) {
        fprintf(stderr, "/metrics lacks \"%s\"\n", want);
        CHECK(0);
    }
}

static int t_lag(void)
{
    struct cluster c;
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    c = (struct cluster){.ns = 1};
    snprintf(c.tmp, sizeof c.tmp, "/tmp/bex-snap-XXXXXX");
    CHECK(mkdtemp(c.tmp));
    /* n[1]: the backup (not in the directory), n[0] its primary */
    struct node bk = {0};
    bex_ps_shard_config pc = shard_cfg(&c, 0);
    pc.role = BEX_PS_ROLE_BACKUP;
    node_start(&bk, &pc);
    bex_rpc_endpoint ep = {.addr = bk.addr};
    pc.role = BEX_PS_ROLE_PRIMARY;
    pc.backups = &ep;
    pc.n_backups = 1;
    pc.forward_timeout_ms = 1500 * time_scale();
    node_start(&c.n[0], &pc);
    c.cctx = client_ctx();
    c.dir = dir_of(&c);
    bex_ps_client_config cc = {.dir = c.dir,
                               .timeout_ms = 20000 * time_scale(),
                               .connect_timeout_ms = 15000 * time_scale(),
                               .push_mode = BEX_PS_PUSH_PRIMARY};
    bex_ps_client *pcl;
    CHECK_OK(bex_ps_client_create(c.cctx, &cc, &pcl));
    uint64_t keys[2] = {5, 6};
    for (int i = 0; i < 3; i++)
        push_keys(pcl, keys, 2);
    bex_ps_shard_stats st, sb;
    bex_ps_shard_stats_get(c.n[0].s, &st);
    bex_ps_shard_stats_get(bk.s, &sb);
    CHECK(st.n_backups == 1 && st.lag_pushes[0] == 0 && st.lag_ns[0] == 0);
    CHECK(sb.role == BEX_PS_ROLE_BACKUP && sb.fwd_age_ns > 0 && sb.lsn == 3);
    prom_has(c.n[0].s, "bex_ps_replica_lag_pushes{shard=\"0\",backup=\"0\"} 0\n");
    prom_has(c.n[0].s, "bex_ps_failovers_total{shard=\"0\"} 0\n");
    prom_has(bk.s, "bex_ps_forward_age_seconds{shard=\"0\"} ");
    /* the backup gone: a Push waits for it, the lag grows */
    node_stop(&bk);
    float g[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
    CHECK_OK(bex_ps_push(pcl, ST[0].id, ST[0].dim, keys, 2, g, push_done, NULL));
    pair_sleep_ms(300);
    bex_ps_shard_stats_get(c.n[0].s, &st);
    printf("backup gone: lag %llu Pushes, %.3f s\n", (unsigned long long)st.lag_pushes[0],
           (double)st.lag_ns[0] / 1e9);
    CHECK(st.lag_pushes[0] == 1 && st.lag_ns[0] >= 250000000ull);
    prom_has(c.n[0].s, "bex_ps_replica_lag_pushes{shard=\"0\",backup=\"0\"} 1\n");
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (atomic_load(&async_rc) == 1 && pair_now_ms() < end)
        pair_sleep_ms(10);
    CHECK_EQ(atomic_load(&async_rc), -EHOSTDOWN);
    /* a snapshot: its age and duration */
    char path[128];
    snprintf(path, sizeof path, "%s/plain.snap", c.tmp);
    CHECK_OK(bex_ps_shard_snapshot(c.n[0].s, path));
    bex_ps_shard_stats_get(c.n[0].s, &st);
    CHECK(st.snaps == 1 && st.snap_unix_ns > 0 && st.snap_id == 0);
    prom_has(c.n[0].s, "bex_ps_snapshot_age_seconds{shard=\"0\"} ");
    prom_has(c.n[0].s, "bex_ps_snapshot_duration_seconds{shard=\"0\"} ");
    bex_ps_client_destroy(pcl);
    cluster_stop(&c);
    return 0;
}

/* ---- join ---- */

struct jtrainer {
    bex_ps_client *pc;
    int id;
    _Atomic bool *stop;
    _Atomic uint64_t acked;
};

static void *jtrainer_main(void *arg)
{
    struct jtrainer *u = arg;
    for (uint64_t i = 0; !atomic_load(u->stop); i++) {
        uint64_t keys[3] = {7 + i % 5, 20 + (uint64_t)u->id, 30 + i % 3};
        float g1[3 * 4], g2[3 * 2];
        for (int j = 0; j < 12; j++)
            g1[j] = (float)((int)(i % 7) - 3);
        for (int j = 0; j < 6; j++)
            g2[j] = 0.25f * (float)(j + 1 + u->id) - 0.6f;
        CHECK_OK(bex_ps_push_sync(u->pc, ST[0].id, ST[0].dim, keys, 3, g1));
        CHECK_OK(bex_ps_push_sync(u->pc, ST[1].id, ST[1].dim, keys, 3, g2));
        atomic_fetch_add(&u->acked, 1);
    }
    return NULL;
}

static int t_join(void)
{
    struct cluster c;
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    c = (struct cluster){.ns = 1};
    snprintf(c.tmp, sizeof c.tmp, "/tmp/bex-snap-XXXXXX");
    CHECK(mkdtemp(c.tmp));
    struct node bk[2] = {{0}};
    bex_ps_shard_config pc = shard_cfg(&c, 0);
    pc.role = BEX_PS_ROLE_BACKUP;
    node_start(&bk[0], &pc);
    bex_rpc_endpoint ep = {.addr = bk[0].addr};
    pc.role = BEX_PS_ROLE_PRIMARY;
    pc.backups = &ep;
    pc.n_backups = 1;
    node_start(&c.n[0], &pc);
    c.cctx = client_ctx();
    c.dir = dir_of(&c);
    _Atomic bool stop = false;
    struct jtrainer u[2];
    pthread_t th[2];
    for (int t = 0; t < 2; t++) {
        bex_ps_client_config cc = {.dir = c.dir,
                                   .timeout_ms = 20000 * time_scale(),
                                   .connect_timeout_ms = 15000 * time_scale(),
                                   .push_mode = BEX_PS_PUSH_PRIMARY};
        u[t] = (struct jtrainer){.id = t, .stop = &stop};
        CHECK_OK(bex_ps_client_create(c.cctx, &cc, &u[t].pc));
        CHECK(pthread_create(&th[t], NULL, jtrainer_main, &u[t]) == 0);
    }
    while (atomic_load(&u[1].acked) < 30)
        pair_sleep_ms(5);
    /* a third replica, empty, joins while the Pushes go on */
    pc = shard_cfg(&c, 0);
    pc.role = BEX_PS_ROLE_BACKUP;
    pc.flags = BEX_PS_SHARD_CATCHUP;
    node_start(&bk[1], &pc);
    bex_ps_join_config jc = {.primary = {.addr = c.n[0].addr},
                             .self = {.addr = bk[1].addr},
                             .timeout_ms = 10000 * time_scale()};
    uint64_t at = atomic_load(&u[0].acked) + atomic_load(&u[1].acked);
    CHECK_OK(bex_ps_shard_join(bk[1].s, bk[1].ctx, &jc));
    uint64_t until = atomic_load(&u[0].acked) + atomic_load(&u[1].acked) + 40;
    while (atomic_load(&u[0].acked) + atomic_load(&u[1].acked) < until)
        pair_sleep_ms(5);
    atomic_store(&stop, true);
    for (int t = 0; t < 2; t++) {
        CHECK(pthread_join(th[t], NULL) == 0);
        bex_ps_client_destroy(u[t].pc);
    }
    bex_ps_shard_stats sp, s1, s2;
    bex_ps_shard_stats_get(c.n[0].s, &sp);
    bex_ps_shard_stats_get(bk[0].s, &s1);
    bex_ps_shard_stats_get(bk[1].s, &s2);
    printf("joined after %llu Pushes; lsn %llu, %llu, %llu; the new one applied %llu forwards\n",
           (unsigned long long)at, (unsigned long long)sp.lsn, (unsigned long long)s1.lsn,
           (unsigned long long)s2.lsn, (unsigned long long)s2.fwd_applied);
    CHECK(sp.n_backups == 2 && sp.backups_down == 0);
    CHECK(sp.lsn == s1.lsn && sp.lsn == s2.lsn);
    CHECK(s2.fwd_applied > 0 && s2.catchup_rows > 0);
    same_rows(c.n[0].s, bk[0].s); /* bit for bit, Adagrad too */
    same_rows(c.n[0].s, bk[1].s);
    /* a cut of a primary-backup shard (its primary), restored */
    bex_ps_snapshot_result r;
    CHECK_OK(cut(&c, 0, &r));
    bex_ps_shard_config rc_cfg = shard_cfg(&c, 0);
    rc_cfg.restore_cut = r.cut_id;
    bex_ps_shard *rs;
    CHECK_OK(bex_ps_shard_create(&rc_cfg, &rs));
    same_rows(c.n[0].s, rs);
    bex_ps_shard_destroy(rs);
    /* the same backup twice: refused */
    node_stop(&bk[1]);
    node_start(&bk[1], &pc);
    CHECK_EQ(bex_ps_shard_join(bk[1].s, bk[1].ctx, &jc), -EEXIST);
    node_stop(&bk[1]);
    node_stop(&bk[0]);
    cluster_stop(&c);
    return 0;
}

BEX_TEST_MAIN({"cut", t_cut}, {"incremental", t_incremental}, {"pause", t_pause},
              {"bad_files", t_bad_files}, {"lag", t_lag}, {"join", t_join}, {"skew", t_skew},
              {"hold_max", t_hold_max})
