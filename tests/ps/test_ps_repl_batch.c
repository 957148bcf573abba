/* SPDX-License-Identifier: Apache-2.0 */
/* A primary's forwards in batches (issue 29, item 1: "batched,
 * pipelined"; docs/protocol.md, "Forward"): one shard, three replicas in
 * this process, each behind its own RPC server and context; replica 0 the
 * primary. Over TCP natively and RDMA in the VM.
 *
 * batched: the primary may have one batch out to a backup; backup 2 is a
 *   fake that holds the first forward it gets. The Pushes sent meanwhile
 *   wait in the primary's queue for it and go, once the first is answered,
 *   in one batch: the fake sees two batches (1 Push, then the other 7,
 *   lsns consecutive), the primary counts fewer batches than forwards,
 *   every Push is acknowledged and the real backup applied each in order.
 * adagrad: four Pushers at once on the same Adagrad rows, batches of at
 *   most 3 Pushes, one out per backup: every replica's rows equal bit for
 *   bit, each Push applied once.
 * hostile: a backup fed batches by the test (as a buggy or hostile
 *   primary): a valid one applied; a count above or below its entries, an
 *   entry's length past the batch, an lsn gap, a bad Push in the middle,
 *   count 0 or 2^32 - 1, a batch flagged a probe: refused -EINVAL whole,
 *   nothing of them applied (counted fwd_batches_bad); a batch of a session
 *   the backup did not follow from its start: -ESTALE; a batch ahead of its
 *   turn held and applied after the one before it; a resend overlapping
 *   what was applied applies only the rest. The backup's Adagrad row ends
 *   bit for bit equal to a shard fed the Pushes in lsn order. */
#include <pthread.h>

#include "ps_test.h"

#define NREP    PB_NREP
#define NKEY    12
#define NPUSHER 4
#define NPUSH   150
#define NHELD   8

static const bex_ps_table_config *const TA = &TABLES[1]; /* Adagrad */

/* Three replicas, replica 0 the primary of the other two with batches of
 * at most batch_max Pushes, depth out per backup; fake (not NULL): replica
 * 2 is an RPC server with fake as its FORWARD handler. */
static int pb_start(struct pb *p, uint32_t batch_max, uint32_t depth, bex_rpc_handler fake)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    *p = (struct pb){.sctx = pb_ctx_at(a0), .cctx = client_ctx()};
    bex_ps_shard_config pc = {.shard = 0, .n_shards = 1, .tables = TABLES, .n_tables = 2};
    pc.role = BEX_PS_ROLE_BACKUP;
    pb_replica_start(p, 1, a0, &pc);
    if (fake) {
        p->bctx[2] = pb_ctx_at(a0);
        CHECK_OK(bex_rpc_server_create(p->bctx[2], NULL, &p->srv[2]));
        CHECK_OK(bex_rpc_server_register(p->srv[2], BEX_PS_SERVICE, BEX_PS_M_FORWARD,
                                         bex__ps_method_flags(BEX_PS_M_FORWARD), fake, NULL));
        pb_listen(p, 2, a0);
    } else {
        pb_replica_start(p, 2, a0, &pc);
    }
    bex_rpc_endpoint bk[NREP - 1];
    for (int r = 1; r < NREP; r++)
        bk[r - 1] = (bex_rpc_endpoint){.addr = p->addr[r]};
    pc.role = BEX_PS_ROLE_PRIMARY;
    pc.backups = bk;
    pc.n_backups = NREP - 1;
    pc.forward_batch_max = batch_max;
    pc.forward_batches_inflight = depth;
    pb_replica_start(p, 0, a0, &pc);
    p->dir = pb_dir(p);
    return 0;
}

static bex_rpc_channel *chan_to(const struct pb *p, int r)
{
    return raw_chan_at(p->cctx, p->addr[r]);
}

static void async_done(int status, void *body, size_t len, void *user)
{
    (void)len;
    bex_rpc_free(body);
    atomic_store((_Atomic int *)user, status);
}

static void call_async(bex_rpc_channel *ch, bex_ctx *ctx, uint32_t method, const uint8_t *body,
                       size_t len, _Atomic int *st)
{
    atomic_store(st, 1);
    void *b = bex_rpc_alloc(ctx, len);
    CHECK(b);
    memcpy(b, body, len);
    CHECK_OK(bex_rpc_call(ch, BEX_PS_SERVICE, method, b, len, NULL, async_done, st, NULL));
}

static int call_raw(bex_rpc_channel *ch, bex_ctx *ctx, const void *body, size_t len)
{
    void *b = bex_rpc_alloc(ctx, len);
    CHECK(b);
    memcpy(b, body, len);
    void *resp = NULL;
    int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, BEX_PS_M_FORWARD, b, len, NULL, &resp, NULL);
    bex_rpc_free(resp);
    return rc;
}

static int wait_status(_Atomic int *st)
{
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (atomic_load(st) == 1 && pair_now_ms() < end)
        pair_sleep_ms(2);
    return atomic_load(st);
}

/* A client's Push of key 7 of TA, grads from salt (b: room for 64 bytes). */
static size_t push_of(uint8_t *b, int salt)
{
    bex__ps_hdr_put(b, &(struct bex__ps_hdr){.table = TA->id, .n = 1, .dim = TA->dim});
    bex__ps_put64(b + BEX__PS_HDR_LEN, 7);
    for (uint32_t d = 0; d < TA->dim; d++)
        bex__ps_putf(b + BEX__PS_HDR_LEN + 8 + 4 * d, 0.3f * (float)(salt * 3 + (int)d) - 1.1f);
    return BEX__PS_HDR_LEN + 8 + 4 * TA->dim;
}

/* ---- batched ---- */

/* The fake backup: the first forward held (answered by the test), the
 * others answered 0; each batch's count and first lsn kept, and whether
 * its entries' lsns were consecutive. */
static struct {
    pthread_mutex_t mu;
    bex_rpc_req *held;
    int calls;
    uint32_t count[NHELD + 1];
    uint64_t first[NHELD + 1];
    bool gap;
} fk = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void fake_fwd(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    struct bex__ps_fwd_hdr fh = {0};
    const uint8_t *p = body;
    bool batch = bex__ps_fwd_get(body, len, &fh) == 0 && (fh.flags & BEX__PS_FWD_BATCH);
    uint32_t n = batch ? bex__ps_get32(p + BEX__PS_FWD_HDR_LEN) : 1;
    size_t off = BEX__PS_FWD_HDR_LEN + BEX__PS_FWD_BATCH_HDR;
    bool gap = false;
    for (uint32_t i = 0; batch && i < n && off + BEX__PS_FWD_ENT_HDR <= len; i++) {
        gap |= bex__ps_get64(p + off) != fh.lsn + i;
        off += BEX__PS_FWD_ENT_HDR + bex__ps_get32(p + off + 8);
    }
    bex_rpc_free(body);
    pthread_mutex_lock(&fk.mu);
    int k = fk.calls++;
    if (k <= NHELD) {
        fk.count[k] = n;
        fk.first[k] = fh.lsn;
    }
    fk.gap |= gap;
    bool hold = k == 0;
    if (hold)
        fk.held = req;
    pthread_mutex_unlock(&fk.mu);
    if (!hold)
        bex_rpc_reply(req, 0, NULL, 0);
}

static int fake_calls(void)
{
    pthread_mutex_lock(&fk.mu);
    int n = fk.calls;
    pthread_mutex_unlock(&fk.mu);
    return n;
}

static int t_batched(void)
{
    struct pb p;
    int rc = pb_start(&p, 0, 1, fake_fwd);
    if (rc)
        return rc;
    bex_rpc_channel *ch = chan_to(&p, 0);
    uint8_t b[64];
    _Atomic int st[NHELD];
    size_t len = push_of(b, 0);
    call_async(ch, p.cctx, BEX_PS_M_PUSH, b, len, &st[0]);
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (fake_calls() < 1 && pair_now_ms() < end)
        pair_sleep_ms(2);
    CHECK_EQ(fake_calls(), 1);
    for (int i = 1; i < NHELD; i++) {
        len = push_of(b, i);
        call_async(ch, p.cctx, BEX_PS_M_PUSH, b, len, &st[i]);
    }
    /* every Push numbered and queued for both backups */
    while (pb_stats(p.s[0]).fwd_sent < 2 * NHELD && pair_now_ms() < end)
        pair_sleep_ms(2);
    CHECK_EQ(pb_stats(p.s[0]).fwd_sent, 2 * NHELD);
    CHECK_EQ(fake_calls(), 1); /* the rest wait for the one out */
    pthread_mutex_lock(&fk.mu);
    bex_rpc_req *held = fk.held;
    pthread_mutex_unlock(&fk.mu);
    bex_rpc_reply(held, 0, NULL, 0);
    for (int i = 0; i < NHELD; i++)
        CHECK_EQ(wait_status(&st[i]), 0);
    CHECK_EQ(fake_calls(), 2);
    CHECK(fk.count[0] == 1 && fk.first[0] == 1);
    CHECK(fk.count[1] == NHELD - 1 && fk.first[1] == 2);
    CHECK(!fk.gap);
    bex_ps_shard_stats ps = pb_stats(p.s[0]);
    CHECK(ps.fwd_batches < ps.fwd_sent);
    CHECK(ps.fwd_batches >= 3); /* 2 to the fake, 1 at least to backup 1 */
    bex_ps_shard_stats bs = pb_stats(p.s[1]);
    CHECK(bs.lsn == NHELD && bs.pushes == NHELD && bs.fwd_applied == NHELD);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    pb_stop(&p);
    return 0;
}

/* ---- adagrad ---- */

/* Replica r's rows of keys[0..n) of TA, as it serves them. */
static void rows_of(bex_ps_shard *s, bex_ctx *ctx, const uint64_t *keys, uint32_t n, float *rows)
{
    uint8_t body[BEX__PS_HDR_LEN + 8 * NKEY];
    CHECK(n <= NKEY);
    bex__ps_hdr_put(body, &(struct bex__ps_hdr){.table = TA->id, .n = n, .dim = TA->dim});
    for (uint32_t i = 0; i < n; i++)
        bex__ps_put64(body + BEX__PS_HDR_LEN + 8 * i, keys[i]);
    void *resp = NULL;
    size_t len = 0;
    CHECK_OK(bex_ps_shard_serve(s, ctx, BEX_PS_M_FETCH, body, BEX__PS_HDR_LEN + 8 * (size_t)n,
                                &resp, &len));
    CHECK_EQ(len, BEX__PS_HDR_LEN + 4 * (size_t)n * TA->dim);
    for (size_t i = 0; i < (size_t)n * TA->dim; i++)
        rows[i] = bex__ps_getf((const uint8_t *)resp + BEX__PS_HDR_LEN + 4 * i);
    bex_rpc_free(resp);
}

static int t_adagrad(void)
{
    struct pb p;
    int rc = pb_start(&p, 3, 1, NULL);
    if (rc)
        return rc;
    struct ps_pusher u[NPUSHER];
    pthread_t th[NPUSHER];
    bex_ps_client_config cc = {.dir = p.dir,
                               .service = "ps",
                               .timeout_ms = 20000 * time_scale(),
                               .connect_timeout_ms = 15000 * time_scale(),
                               .push_mode = BEX_PS_PUSH_PRIMARY};
    for (int i = 0; i < NPUSHER; i++) {
        u[i] = (struct ps_pusher){.id = i, .t = TA, .npush = NPUSH, .nkey = NKEY};
        CHECK_OK(bex_ps_client_create(p.cctx, &cc, &u[i].c));
        CHECK(pthread_create(&th[i], NULL, ps_pusher_main, &u[i]) == 0);
    }
    for (int i = 0; i < NPUSHER; i++) {
        CHECK(pthread_join(th[i], NULL) == 0);
        bex_ps_client_destroy(u[i].c);
    }
    uint64_t keys[NKEY];
    for (int i = 0; i < NKEY; i++)
        keys[i] = 1000 + (uint64_t)i;
    float rows[NREP][NKEY * 5];
    for (int r = 0; r < NREP; r++) {
        rows_of(p.s[r], p.sctx, keys, NKEY, rows[r]);
        bex_ps_shard_stats st = pb_stats(p.s[r]);
        CHECK(st.pushes == NPUSHER * NPUSH && st.lsn == NPUSHER * NPUSH); /* each once */
    }
    for (int r = 1; r < NREP; r++)
        CHECK(memcmp(rows[0], rows[r], sizeof rows[0]) == 0);
    bex_ps_shard_stats ps = pb_stats(p.s[0]);
    CHECK(ps.fwd_sent == 2ull * NPUSHER * NPUSH && ps.fwd_batches <= ps.fwd_sent);
    CHECK(ps.backups_down == 0);
    fprintf(stderr, "forwards %llu in %llu batches\n", (unsigned long long)ps.fwd_sent,
            (unsigned long long)ps.fwd_batches);
    transport_check(p.cctx);
    transport_check(p.sctx);
    pb_stop(&p);
    return 0;
}

/* ---- hostile ---- */

#define SESSION 0xabcull

/* A batch of session: n Pushes of key 7 (salt = lsn), lsns[i] (NULL:
 * first + i) into b (room for 16 entries). */
static size_t batch_of(uint8_t *b, uint64_t session, uint64_t first, uint32_t n,
                       const uint64_t *lsns)
{
    bex__ps_fwd_put(
        b, &(struct bex__ps_fwd_hdr){.session = session, .lsn = first, .flags = BEX__PS_FWD_BATCH});
    bex__ps_put32(b + BEX__PS_FWD_HDR_LEN, n);
    bex__ps_put32(b + BEX__PS_FWD_HDR_LEN + 4, 0);
    size_t off = BEX__PS_FWD_HDR_LEN + BEX__PS_FWD_BATCH_HDR;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t lsn = lsns ? lsns[i] : first + i;
        size_t el = push_of(b + off + BEX__PS_FWD_ENT_HDR, (int)lsn);
        bex__ps_put64(b + off, lsn);
        bex__ps_put32(b + off + 8, (uint32_t)el);
        bex__ps_put32(b + off + 12, 0);
        off += BEX__PS_FWD_ENT_HDR + el;
    }
    return off;
}

/* The offset of entry i of a batch of Pushes of key 7. */
static size_t ent_off(uint32_t i)
{
    uint8_t tmp[64];
    return BEX__PS_FWD_HDR_LEN + BEX__PS_FWD_BATCH_HDR +
           i * (BEX__PS_FWD_ENT_HDR + push_of(tmp, 0));
}

/* Batches that lie, each refused whole; returns how many. */
static int hostile_refused(bex_rpc_channel *ch, bex_ctx *ctx)
{
    uint8_t b[2048];
    size_t len = batch_of(b, SESSION, 4, 3, NULL);
    bex__ps_put32(b + BEX__PS_FWD_HDR_LEN, 5); /* count above its entries */
    CHECK_EQ(call_raw(ch, ctx, b, len), -EINVAL);
    bex__ps_put32(b + BEX__PS_FWD_HDR_LEN, 2); /* below: bytes after */
    CHECK_EQ(call_raw(ch, ctx, b, len), -EINVAL);
    bex__ps_put32(b + BEX__PS_FWD_HDR_LEN, 0);
    CHECK_EQ(call_raw(ch, ctx, b, len), -EINVAL);
    bex__ps_put32(b + BEX__PS_FWD_HDR_LEN, UINT32_MAX);
    CHECK_EQ(call_raw(ch, ctx, b, len), -EINVAL);
    len = batch_of(b, SESSION, 4, 3, NULL);
    bex__ps_put32(b + ent_off(1) + 8, UINT32_MAX - 8); /* a length past the batch */
    CHECK_EQ(call_raw(ch, ctx, b, len), -EINVAL);
    len = batch_of(b, SESSION, 4, 3, NULL);
    bex__ps_put32(b + ent_off(2) + 8, bex__ps_get32(b + ent_off(2) + 8) - 4); /* a Push cut */
    CHECK_EQ(call_raw(ch, ctx, b, len), -EINVAL);
    len = batch_of(b, SESSION, 4, 2, (const uint64_t[]){4, 6}); /* an lsn gap */
    CHECK_EQ(call_raw(ch, ctx, b, len), -EINVAL);
    len = batch_of(b, SESSION, 4, 3, NULL);
    bex__ps_putf(b + ent_off(1) + BEX__PS_FWD_ENT_HDR + BEX__PS_HDR_LEN + 8, NAN); /* the middle */
    CHECK_EQ(call_raw(ch, ctx, b, len), -EINVAL);
    len = batch_of(b, SESSION, 4, 3, NULL);
    b[1] |= BEX__PS_FWD_PROBE; /* a probe cannot be a batch */
    CHECK_EQ(call_raw(ch, ctx, b, len), -EINVAL);
    return 8; /* counted fwd_batches_bad (the probe flag is refused before) */
}

/* Key 7's row of a fresh shard fed the Pushes of lsns 1..n in order. */
static void reference(bex_ctx *ctx, uint32_t n, float *row)
{
    bex_ps_shard_config pc = {.shard = 0, .n_shards = 1, .tables = TABLES, .n_tables = 2};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    for (uint32_t i = 1; i <= n; i++) {
        uint8_t b[64];
        size_t len = push_of(b, (int)i);
        void *resp = NULL;
        size_t rlen = 0;
        CHECK_OK(bex_ps_shard_serve(s, ctx, BEX_PS_M_PUSH, b, len, &resp, &rlen));
        bex_rpc_free(resp);
    }
    uint64_t key = 7;
    rows_of(s, ctx, &key, 1, row);
    bex_ps_shard_destroy(s);
}

static int t_hostile(void)
{
    struct pb p;
    int rc = pb_start(&p, 0, 0, NULL);
    if (rc)
        return rc;
    bex_rpc_channel *ch = chan_to(&p, 2); /* a backup no primary feeds */
    bex_ps_shard *s = p.s[2];
    uint8_t b[2048];
    size_t len = batch_of(b, SESSION, 1, 3, NULL);
    CHECK_OK(call_raw(ch, p.cctx, b, len));
    int bad = hostile_refused(ch, p.cctx);
    bex_ps_shard_stats st = pb_stats(s);
    CHECK(st.pushes == 3 && st.lsn == 3 && st.fwd_batches_bad == (uint64_t)bad);
    len = batch_of(b, SESSION + 1, 5, 2, NULL); /* a session not followed from its start */
    CHECK_EQ(call_raw(ch, p.cctx, b, len), -ESTALE);
    /* ahead of its turn: held, then applied after 4..5 */
    _Atomic int st6;
    len = batch_of(b, SESSION, 6, 2, NULL);
    call_async(ch, p.cctx, BEX_PS_M_FORWARD, b, len, &st6);
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (pb_stats(s).fwd_held < 1 && pair_now_ms() < end)
        pair_sleep_ms(2);
    CHECK_EQ(pb_stats(s).fwd_held, 1);
    len = batch_of(b, SESSION, 4, 2, NULL);
    CHECK_OK(call_raw(ch, p.cctx, b, len));
    CHECK_EQ(wait_status(&st6), 0);
    CHECK(pb_stats(s).pushes == 7 && pb_stats(s).lsn == 7);
    len = batch_of(b, SESSION, 6, 3, NULL); /* 6, 7 applied already: 8 alone */
    CHECK_OK(call_raw(ch, p.cctx, b, len));
    CHECK(pb_stats(s).pushes == 8 && pb_stats(s).lsn == 8);
    float row[5], want[5];
    uint64_t key = 7;
    rows_of(s, p.sctx, &key, 1, row);
    reference(p.sctx, 8, want);
    CHECK(memcmp(row, want, sizeof row) == 0);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    pb_stop(&p);
    return 0;
}

BEX_TEST_MAIN({"batched", t_batched}, {"adagrad", t_adagrad}, {"hostile", t_hostile})
