/* SPDX-License-Identifier: Apache-2.0 */
/* Primary-backup replication (issue 29, item 1; include/bex/ps.h,
 * "Replicas"): one shard, three replicas in this process, each behind its
 * own RPC server and context; replica 0 the primary, listed first.
 * Over TCP natively and RDMA in the VM.
 *
 * adagrad: four Pushers at once on the same Adagrad rows through clients
 *   with BEX_PS_PUSH_PRIMARY; afterwards every replica's rows are equal bit
 *   for bit, and each applied every Push once. (adagrad_fanout, not run by
 *   CTest: the same with today's client fan-out, where the replicas apply
 *   in different orders and the check fails.)
 * retry: a Push sent to the primary twice (the second a new RPC call, so
 *   the RPC layer's dedup cannot catch it: as a client's retry after its
 *   answer was lost) is applied once on every replica: the primary forwards
 *   it again with its id and each backup's id record leaves it out. A
 *   client's Push to a backup is refused -EPERM, a forward of a session the
 *   backup did not follow from its start -ESTALE.
 * order: a backup alone, fed forwards by the test: one ahead of its turn
 *   is held and applied after the one before it (Adagrad rows equal bit
 *   for bit to a reference shard fed in lsn order, which differs from the
 *   arrival order's); a resend of a held one replaces it (the older
 *   answered -EAGAIN); one a window or more ahead is refused -EAGAIN; lsn 1
 *   of a new session answers the held ones -ESTALE; malformed forwards are
 *   refused -EINVAL and change nothing.
 * bench (not run by CTest): Push latency and throughput, client fan-out
 *   against primary-backup, the same load (docs/benchmarks.md).
 * backup_down: a backup's server gone, the Push waiting for it fails
 *   -EHOSTDOWN within the forward deadline and so does every later one:
 *   none is acknowledged without every backup.
 * retry_seq: bex_ps_push_seq twice with one seq: applied once everywhere.
 * backup_behind: a backup that missed a forward but kept its rows (the
 *   chaos test's finding: it never rejoined) is found behind by the
 *   primary's probe, gets the forward again from the primary's log and
 *   rejoins; the replicas end equal. backup_behind_log: the same with a
 *   log too small to hold a Push: the backup stays down, Pushes refused
 *   -EHOSTDOWN, nothing resent; restarted with a catch-up (a full copy)
 *   it rejoins and the replicas end equal. behind_hostile: a backup's
 *   server replaced by a fake whose probe answers claim hostile
 *   positions (past the primary's lsn, UINT64_MAX, 0, a short body): the
 *   primary resends only what its log covers, never rejoins it, and
 *   goes on refusing Pushes -EHOSTDOWN.
 * primary_stale: a restarted primary whose catch-up timed out (its peer
 *   hangs) refuses Pushes and Fetches (-EAGAIN) rather than serve its old
 *   rows as primary (seen once in the VM); a second catch-up, from a
 *   backup, brings it level and it serves.
 * restart_suffix: a backup restarted from its snapshot, 4 forwards
 *   behind, catches up by the primary's log suffix, no row copied;
 *   restart_suffix_log: the log too small, a full copy;
 *   restart_suffix_empty: its snapshot at the primary's lsn (an empty
 *   suffix, seen in the chaos test): it takes the primary's session and
 *   rejoins (it refused every later forward, and stayed down); suffix_hostile:
 *   hostile positions asked of the primary are refused, nothing changes.
 * join_v6: a backup on ::1 joins a running primary on ::1. */
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ps_test.h"
#include "ps/shard_internal.h"

#define NREP    PB_NREP
#define NKEY    12
#define NPUSHER 4
#define NPUSH   150

static const bex_ps_table_config *const TA = &TABLES[1]; /* Adagrad */
static const bex_ps_table_config *const TS = &TABLES[0]; /* SGD */
static uint64_t log_bytes;      /* the primary's forward_log_bytes (0: default) */
static uint32_t bk_connect_ms;  /* the primary's backup_connect_timeout_ms */
static struct relay *bk2_relay; /* in front of backup 2 (NULL: none) */
static uint32_t bk2_delay_ms;   /* its hold of each connection */

/* A TCP relay in front of backup 2 that holds each connection delay_ms
 * before it opens its own to the backup: a backup whose connection takes
 * longer than a forward's deadline to come up (RDMA setup at load 30). */
struct relay {
    int lfd;
    bex_addr at, to;
    uint32_t delay_ms;
    _Atomic bool stop;
    pthread_t th;
};

/* Copy between a and b until either side closes or the relay stops. */
static void relay_pipe(struct relay *rl, int a, int b)
{
    char buf[16384];
    while (!atomic_load(&rl->stop)) {
        struct pollfd pf[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
        if (poll(pf, 2, 50) < 0)
            return;
        for (int i = 0; i < 2; i++) {
            if (!pf[i].revents)
                continue;
            ssize_t n = read(pf[i].fd, buf, sizeof buf);
            if (n <= 0 || write(pf[1 - i].fd, buf, (size_t)n) != n)
                return;
        }
    }
}

static void *relay_main(void *arg)
{
    struct relay *rl = arg;
    while (!atomic_load(&rl->stop)) {
        struct pollfd pf = {rl->lfd, POLLIN, 0};
        if (poll(&pf, 1, 50) <= 0)
            continue;
        int a = accept(rl->lfd, NULL, NULL);
        if (a < 0)
            continue;
        pair_sleep_ms(rl->delay_ms);
        int b = socket(AF_INET, SOCK_STREAM, 0);
        if (b >= 0 && connect(b, (const struct sockaddr *)&rl->to.in4, sizeof rl->to.in4) == 0)
            relay_pipe(rl, a, b);
        if (b >= 0)
            close(b);
        close(a);
    }
    return NULL;
}

static void relay_start(struct relay *rl, const bex_addr *to, uint32_t delay_ms)
{
    *rl = (struct relay){.to = *to, .delay_ms = delay_ms};
    struct sockaddr_in sa = to->in4;
    sa.sin_port = 0; /* the kernel's pick: no race for a port */
    socklen_t sl = sizeof sa;
    rl->lfd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(rl->lfd >= 0 && bind(rl->lfd, (struct sockaddr *)&sa, sizeof sa) == 0);
    CHECK(listen(rl->lfd, 8) == 0 && getsockname(rl->lfd, (struct sockaddr *)&sa, &sl) == 0);
    char ip[INET_ADDRSTRLEN], text[64];
    inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip);
    snprintf(text, sizeof text, "%s:%u", ip, ntohs(sa.sin_port));
    CHECK_OK(bex_addr_parse(text, 0, &rl->at));
    CHECK(pthread_create(&rl->th, NULL, relay_main, rl) == 0);
}

static void relay_stop(struct relay *rl)
{
    atomic_store(&rl->stop, true);
    CHECK(pthread_join(rl->th, NULL) == 0);
    close(rl->lfd);
}

/* Three replicas: with roles (replica 0 the primary of the other two, a
 * forward deadline of fwd_ms, down backups probed every retry_ms) or,
 * fanout, all BEX_PS_ROLE_ANY. */
static int pb_start_ex(struct pb *p, bool fanout, uint32_t fwd_ms, uint32_t retry_ms)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    *p = (struct pb){.sctx = pb_ctx_at(a0)};
    p->cctx = client_ctx();
    bex_ps_shard_config pc = {.shard = 0, .n_shards = 1, .tables = TABLES, .n_tables = 2};
    for (int r = 1; r < NREP; r++) {
        pc.role = fanout ? BEX_PS_ROLE_ANY : BEX_PS_ROLE_BACKUP;
        pb_replica_start(p, r, a0, &pc);
    }
    bex_rpc_endpoint bk[NREP - 1];
    for (int r = 1; r < NREP; r++)
        bk[r - 1] = (bex_rpc_endpoint){.addr = p->addr[r]};
    if (bk2_relay) {
        relay_start(bk2_relay, &p->addr[2], bk2_delay_ms);
        bk[1].addr = bk2_relay->at;
    }
    if (!fanout) {
        pc.role = BEX_PS_ROLE_PRIMARY;
        pc.backups = bk;
        pc.n_backups = NREP - 1;
        pc.forward_timeout_ms = fwd_ms;
        pc.backup_retry_ms = retry_ms;
        pc.forward_log_bytes = log_bytes;
        pc.backup_connect_timeout_ms = bk_connect_ms;
    }
    pb_replica_start(p, 0, a0, &pc);
    p->dir = pb_dir(p);
    return 0;
}

static int pb_start(struct pb *p, bool fanout, uint32_t fwd_ms)
{
    return pb_start_ex(p, fanout, fwd_ms, 0);
}

static bex_ps_client *pb_client(const struct pb *p, uint32_t mode)
{
    bex_ps_client_config cc = {.dir = p->dir,
                               .service = "ps",
                               .timeout_ms = 20000 * time_scale(),
                               .connect_timeout_ms = 15000 * time_scale(),
                               .push_mode = mode};
    bex_ps_client *c;
    CHECK_OK(bex_ps_client_create(p->cctx, &cc, &c));
    return c;
}

/* Replica r's rows of keys[0..n) of table t, as it serves them. */
static void rows_of(struct pb *p, int r, const bex_ps_table_config *t, const uint64_t *keys,
                    uint32_t n, float *rows)
{
    uint8_t body[BEX__PS_HDR_LEN + 8 * NKEY];
    CHECK(n <= NKEY);
    bex__ps_hdr_put(body, &(struct bex__ps_hdr){.table = t->id, .n = n, .dim = t->dim});
    for (uint32_t i = 0; i < n; i++)
        bex__ps_put64(body + BEX__PS_HDR_LEN + 8 * i, keys[i]);
    void *resp = NULL;
    size_t len = 0;
    CHECK_OK(bex_ps_shard_serve(p->s[r], p->sctx, BEX_PS_M_FETCH, body,
                                BEX__PS_HDR_LEN + 8 * (size_t)n, &resp, &len));
    CHECK_EQ(len, BEX__PS_HDR_LEN + 4 * (size_t)n * t->dim);
    for (size_t i = 0; i < (size_t)n * t->dim; i++)
        rows[i] = bex__ps_getf((const uint8_t *)resp + BEX__PS_HDR_LEN + 4 * i);
    bex_rpc_free(resp);
}

/* ---- adagrad ---- */

static int adagrad_run(bool fanout)
{
    struct pb p;
    int rc = pb_start(&p, fanout, 0);
    if (rc)
        return rc;
    struct ps_pusher u[NPUSHER];
    pthread_t th[NPUSHER];
    for (int i = 0; i < NPUSHER; i++) {
        u[i] = (struct ps_pusher){pb_client(&p, fanout ? BEX_PS_PUSH_ALL : BEX_PS_PUSH_PRIMARY), i,
                                  TA, NPUSH, NKEY};
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
        rows_of(&p, r, TA, keys, NKEY, rows[r]);
        CHECK_EQ(pb_stats(p.s[r]).pushes, NPUSHER * NPUSH); /* each once */
    }
    for (int r = 1; r < NREP; r++)
        CHECK(memcmp(rows[0], rows[r], sizeof rows[0]) == 0);
    if (!fanout) {
        CHECK_EQ(pb_stats(p.s[0]).lsn, NPUSHER * NPUSH);
        CHECK_EQ(pb_stats(p.s[1]).lsn, NPUSHER * NPUSH);
        CHECK_EQ(pb_stats(p.s[0]).backups_down, 0);
    }
    /* the clients' and the forwards' connections over the transport
     * under test */
    transport_check(p.cctx);
    transport_check(p.sctx);
    pb_stop(&p);
    return 0;
}

static int t_adagrad(void)
{
    return adagrad_run(false);
}

static int t_adagrad_fanout(void)
{
    return adagrad_run(true);
}

/* ---- retry ---- */

/* A Push body of one key of TS, grads all 1, with id (77, seq). */
static size_t push_body(uint8_t *b, uint64_t key, uint64_t seq)
{
    struct bex__ps_hdr h = {.table = TS->id,
                            .n = 1,
                            .dim = TS->dim,
                            .flags = BEX__PS_F_ID,
                            .id_client = 77,
                            .id_seq = seq,
                            .id_tok = {0x1111, 0x2222}};
    bex__ps_hdr_put(b, &h);
    uint8_t *q = b + bex__ps_keys_off(&h);
    bex__ps_put64(q, key);
    for (uint32_t d = 0; d < TS->dim; d++)
        bex__ps_putf(q + 8 + 4 * d, 1.0f);
    return bex__ps_keys_off(&h) + 8 + 4 * TS->dim;
}

static bex_rpc_channel *chan_to(const struct pb *p, int r)
{
    return raw_chan_at(p->cctx, p->addr[r]);
}

static bex_ctx *raw_ctx;

static int call_raw(bex_rpc_channel *ch, uint32_t method, const void *body, size_t len)
{
    void *b = bex_rpc_alloc(raw_ctx, len);
    CHECK(b);
    memcpy(b, body, len);
    void *resp = NULL;
    int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, method, b, len, NULL, &resp, NULL);
    bex_rpc_free(resp);
    return rc;
}

static int t_retry(void)
{
    struct pb p;
    int rc = pb_start(&p, false, 0);
    if (rc)
        return rc;
    uint8_t b[256];
    uint64_t key = 4242;
    size_t len = push_body(b, key, 1);
    bex_rpc_channel *ch0 = chan_to(&p, 0), *ch1 = chan_to(&p, 1);
    raw_ctx = p.cctx;
    CHECK_OK(call_raw(ch0, BEX_PS_M_PUSH, b, len));
    CHECK_OK(call_raw(ch0, BEX_PS_M_PUSH, b, len)); /* the retry: acknowledged, not applied */
    for (int r = 0; r < NREP; r++) {
        float row[8];
        rows_of(&p, r, TS, &key, 1, row);
        for (uint32_t d = 0; d < TS->dim; d++) {
            float want = bex_ps_init_value(TS->id, key, d, TS->init_scale);
            want -= TS->lr * 1.0f;
            CHECK(memcmp(&row[d], &want, 4) == 0);
        }
        bex_ps_shard_stats st = pb_stats(p.s[r]);
        CHECK_EQ(st.pushes, 1);
        CHECK_EQ(st.dup_ids, 1);
        if (r)
            CHECK_EQ(st.fwd_applied, 2);
    }
    /* a client's Push to a backup; a forward out of nowhere */
    CHECK_EQ(call_raw(ch1, BEX_PS_M_PUSH, b, len), -EPERM);
    CHECK_EQ(pb_stats(p.s[1]).not_primary, 1);
    uint8_t f[BEX__PS_FWD_HDR_LEN + 256];
    bex__ps_fwd_put(f, &(struct bex__ps_fwd_hdr){.session = 5, .lsn = 9});
    memcpy(f + BEX__PS_FWD_HDR_LEN, b, len);
    CHECK_EQ(call_raw(ch1, BEX_PS_M_FORWARD, f, BEX__PS_FWD_HDR_LEN + len), -ESTALE);
    CHECK_EQ(call_raw(ch1, BEX_PS_M_FORWARD, f, 10), -EINVAL);
    CHECK_EQ(call_raw(ch0, BEX_PS_M_FORWARD, f, BEX__PS_FWD_HDR_LEN + len), -EPERM);
    CHECK_EQ(pb_stats(p.s[1]).pushes, 1);
    /* the primary's Push needs the handler */
    void *resp = NULL;
    size_t rlen = 0;
    CHECK_EQ(bex_ps_shard_serve(p.s[0], p.sctx, BEX_PS_M_PUSH, b, len, &resp, &rlen), -EOPNOTSUPP);
    CHECK_OK(bex_rpc_channel_destroy(ch0));
    CHECK_OK(bex_rpc_channel_destroy(ch1));
    pb_stop(&p);
    return 0;
}

/* ---- order ---- */

/* A forward of session, lsn: one Push of key 7 of TA, grads from salt. */
static size_t fwd_body(uint8_t *b, uint64_t session, uint64_t lsn, int salt)
{
    bex__ps_fwd_put(b, &(struct bex__ps_fwd_hdr){.session = session, .lsn = lsn});
    uint8_t *p = b + BEX__PS_FWD_HDR_LEN;
    bex__ps_hdr_put(p, &(struct bex__ps_hdr){.table = TA->id, .n = 1, .dim = TA->dim});
    bex__ps_put64(p + BEX__PS_HDR_LEN, 7);
    for (uint32_t d = 0; d < TA->dim; d++)
        bex__ps_putf(p + BEX__PS_HDR_LEN + 8 + 4 * d, 0.3f * (float)(salt * 3 + (int)d) - 1.1f);
    return BEX__PS_FWD_HDR_LEN + BEX__PS_HDR_LEN + 8 + 4 * TA->dim;
}

static void async_done(int status, void *body, size_t len, void *user)
{
    (void)len;
    bex_rpc_free(body);
    atomic_store((_Atomic int *)user, status);
}

static void call_async(bex_rpc_channel *ch, const uint8_t *body, size_t len, _Atomic int *st)
{
    atomic_store(st, 1);
    void *b = bex_rpc_alloc(raw_ctx, len);
    CHECK(b);
    memcpy(b, body, len);
    CHECK_OK(
        bex_rpc_call(ch, BEX_PS_SERVICE, BEX_PS_M_FORWARD, b, len, NULL, async_done, st, NULL));
}

static int wait_status(_Atomic int *st)
{
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (atomic_load(st) == 1 && pair_now_ms() < end)
        pair_sleep_ms(2);
    return atomic_load(st);
}

static void wait_held(bex_ps_shard *s, uint64_t n)
{
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (pb_stats(s).fwd_held < n && pair_now_ms() < end)
        pair_sleep_ms(2);
    CHECK_EQ(pb_stats(s).fwd_held, n);
}

/* Key 7's row of a fresh shard fed the Pushes of forwards salts[0..3)
 * in that order. */
static void reference(bex_ctx *ctx, const int *salts, float *row)
{
    bex_ps_shard_config pc = {.shard = 0, .n_shards = 1, .tables = TABLES, .n_tables = 2};
    struct pb p = {.sctx = ctx};
    CHECK_OK(bex_ps_shard_create(&pc, &p.s[0]));
    for (int i = 0; i < 3; i++) {
        uint8_t b[256];
        size_t len = fwd_body(b, 1, 1, salts[i]);
        void *resp = NULL;
        size_t rlen = 0;
        CHECK_OK(bex_ps_shard_serve(p.s[0], ctx, BEX_PS_M_PUSH, b + BEX__PS_FWD_HDR_LEN,
                                    len - BEX__PS_FWD_HDR_LEN, &resp, &rlen));
        bex_rpc_free(resp);
    }
    uint64_t key = 7;
    rows_of(&p, 0, TA, &key, 1, row);
    bex_ps_shard_destroy(p.s[0]);
}

static void order_malformed(bex_rpc_channel *ch, bex_ps_shard *s)
{
    uint8_t b[256];
    size_t len = fwd_body(b, 0xabc, 4, 9);
    b[0] = 9; /* version */
    CHECK_EQ(call_raw(ch, BEX_PS_M_FORWARD, b, len), -EINVAL);
    len = fwd_body(b, 0, 4, 9); /* session 0 */
    CHECK_EQ(call_raw(ch, BEX_PS_M_FORWARD, b, len), -EINVAL);
    len = fwd_body(b, 0xabc, 4, 9);
    CHECK_EQ(call_raw(ch, BEX_PS_M_FORWARD, b, len - 1), -EINVAL); /* the Push cut */
    bex__ps_putf(b + len - 4, NAN);
    CHECK_EQ(call_raw(ch, BEX_PS_M_FORWARD, b, len), -EINVAL);
    CHECK_EQ(pb_stats(s).pushes, 4);
}

static int t_order(void)
{
    struct pb p;
    int rc = pb_start(&p, false, 0);
    if (rc)
        return rc;
    raw_ctx = p.cctx;
    bex_rpc_channel *ch = chan_to(&p, 2); /* a backup no primary feeds */
    uint8_t b[3][256];
    size_t len[3];
    for (int i = 0; i < 3; i++)
        len[i] = fwd_body(b[i], 0xabc, (uint64_t)i + 1, i);
    _Atomic int st3a, st3b;
    CHECK_OK(call_raw(ch, BEX_PS_M_FORWARD, b[0], len[0]));
    call_async(ch, b[2], len[2], &st3a);
    wait_held(p.s[2], 1);
    call_async(ch, b[2], len[2], &st3b); /* a resend of the held one */
    CHECK_EQ(wait_status(&st3a), -EAGAIN);
    CHECK_OK(call_raw(ch, BEX_PS_M_FORWARD, b[1], len[1]));
    CHECK_EQ(wait_status(&st3b), 0);
    CHECK_OK(call_raw(ch, BEX_PS_M_FORWARD, b[1], len[1])); /* applied already */
    bex_ps_shard_stats bs = pb_stats(p.s[2]);
    CHECK(bs.pushes == 3 && bs.fwd_applied == 3 && bs.lsn == 3);
    float row[5], want[5], wrong[5];
    uint64_t key = 7;
    rows_of(&p, 2, TA, &key, 1, row);
    reference(p.sctx, (const int[]){0, 1, 2}, want);
    reference(p.sctx, (const int[]){0, 2, 1}, wrong);
    CHECK(memcmp(row, want, sizeof row) == 0);
    CHECK(memcmp(want, wrong, sizeof want) != 0); /* the order shows */
    /* too far ahead; then a new session while one is held */
    uint8_t f[256];
    size_t fl = fwd_body(f, 0xabc, 4 + 1024, 5);
    CHECK_EQ(call_raw(ch, BEX_PS_M_FORWARD, f, fl), -EAGAIN);
    fl = fwd_body(f, 0xabc, 6, 5);
    _Atomic int st6;
    call_async(ch, f, fl, &st6);
    wait_held(p.s[2], 3);
    fl = fwd_body(f, 0xdef, 1, 6);
    CHECK_OK(call_raw(ch, BEX_PS_M_FORWARD, f, fl));
    CHECK_EQ(wait_status(&st6), -ESTALE);
    CHECK_EQ(pb_stats(p.s[2]).pushes, 4);
    fl = fwd_body(f, 0xabc, 7, 5); /* the old session: gone */
    CHECK_EQ(call_raw(ch, BEX_PS_M_FORWARD, f, fl), -ESTALE);
    order_malformed(ch, p.s[2]);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    pb_stop(&p);
    return 0;
}

/* ---- backup_down ---- */

static int t_backup_down(void)
{
    struct pb p;
    int rc = pb_start(&p, false, 1500 * time_scale());
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 99;
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    CHECK_OK(bex_rpc_server_destroy(p.srv[2]));
    p.srv[2] = NULL;
    CHECK_EQ(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g), -EHOSTDOWN);
    CHECK_EQ(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g), -EHOSTDOWN);
    bex_ps_shard_stats st = pb_stats(p.s[0]);
    CHECK_EQ(st.backups_down, 1);
    CHECK_EQ(st.backup_down_refused, 1);
    CHECK_EQ(st.role, BEX_PS_ROLE_PRIMARY);
    CHECK_EQ(pb_stats(p.s[1]).pushes, 2); /* the second Push reached backup 1 */
    bex_ps_client_destroy(c);
    pb_stop(&p);
    return 0;
}

/* ---- bench ---- */

#define BN_PUSHERS 4
#define BN_PUSHES  2000
#define BN_KEYS    16

struct bpusher {
    bex_ps_client *c;
    int id;
    uint64_t ns[BN_PUSHES];
};

static void *bench_main(void *arg)
{
    struct bpusher *u = arg;
    uint64_t keys[BN_KEYS];
    static const float g[BN_KEYS * 8] = {0.5f};
    for (int i = 0; i < BN_PUSHES; i++) {
        for (int k = 0; k < BN_KEYS; k++)
            keys[k] = (uint64_t)(u->id * 1000 + (i * 7 + k) % 200);
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        CHECK_OK(bex_ps_push_sync(u->c, TS->id, TS->dim, keys, BN_KEYS, g));
        clock_gettime(CLOCK_MONOTONIC, &b);
        u->ns[i] = (uint64_t)(b.tv_sec - a.tv_sec) * 1000000000ull + (uint64_t)b.tv_nsec -
                   (uint64_t)a.tv_nsec;
    }
    return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* One mode's run: P50, P99 (us) and Pushes a second, printed. */
static int bench_mode(bool fanout)
{
    struct pb p;
    int rc = pb_start(&p, fanout, 0);
    if (rc)
        return rc;
    static struct bpusher u[BN_PUSHERS];
    pthread_t th[BN_PUSHERS];
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < BN_PUSHERS; i++) {
        u[i].c = pb_client(&p, fanout ? BEX_PS_PUSH_ALL : BEX_PS_PUSH_PRIMARY);
        u[i].id = i;
        CHECK(pthread_create(&th[i], NULL, bench_main, &u[i]) == 0);
    }
    for (int i = 0; i < BN_PUSHERS; i++) {
        CHECK(pthread_join(th[i], NULL) == 0);
        bex_ps_client_destroy(u[i].c);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    static uint64_t all[BN_PUSHERS * BN_PUSHES];
    for (int i = 0; i < BN_PUSHERS; i++)
        memcpy(all + i * BN_PUSHES, u[i].ns, sizeof u[i].ns);
    size_t n = BN_PUSHERS * BN_PUSHES;
    qsort(all, n, sizeof all[0], cmp_u64);
    double secs = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
    printf("%-15s P50 %7.1f us  P99 %7.1f us  %8.0f Pushes/s\n",
           fanout ? "client fan-out" : "primary-backup", (double)all[n / 2] / 1e3,
           (double)all[n * 99 / 100] / 1e3, (double)n / secs);
    pb_stop(&p);
    return 0;
}

static int t_bench(void)
{
    for (int round = 0; round < 2; round++) {
        int rc = bench_mode(true);
        if (rc || (rc = bench_mode(false)))
            return rc;
    }
    return 0;
}

/* ---- backup_restart ---- */

/* Backup 2 comes back with none of its state, catching up from the
 * primary, at its address, on a new context (a new process). */
static void backup2_restart(struct pb *p)
{
    bex_ps_shard_config pc = {.shard = 0,
                              .n_shards = 1,
                              .tables = TABLES,
                              .n_tables = 2,
                              .role = BEX_PS_ROLE_BACKUP,
                              .flags = BEX_PS_SHARD_CATCHUP};
    pb_replica_start(p, 2, p->addr[2].in4.sin_addr, &pc);
    bex_rpc_endpoint peer = {.addr = p->addr[0]};
    bex_ps_catchup_config cc = {.peers = &peer, .n_peers = 1, .timeout_ms = 10000 * time_scale()};
    CHECK_OK(bex_ps_shard_catchup(p->s[2], p->bctx[2], &cc));
}

static int t_backup_restart(void)
{
    struct pb p;
    int rc = pb_start_ex(&p, false, 1500 * time_scale(), 50);
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 31;
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    /* killed: its server, its state and its context gone */
    CHECK_OK(bex_rpc_server_destroy(p.srv[2]));
    bex_ps_shard_destroy(p.s[2]);
    CHECK_OK(bex_ctx_destroy(p.bctx[2]));
    p.srv[2] = NULL;
    p.s[2] = NULL;
    p.bctx[2] = NULL;
    CHECK_EQ(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g), -EHOSTDOWN); /* applied, not acked */
    CHECK_EQ(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g), -EHOSTDOWN);
    backup2_restart(&p);
    /* Pushes refused until a probe finds it in step, then acknowledged */
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    while ((rc = bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g)) == -EHOSTDOWN &&
           pair_now_ms() < end)
        pair_sleep_ms(20);
    CHECK_OK(rc);
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    float row[NREP][8];
    for (int r = 0; r < NREP; r++) {
        rows_of(&p, r, TS, &key, 1, row[r]);
        CHECK_EQ(pb_stats(p.s[r]).lsn, 4);
    }
    CHECK(memcmp(row[0], row[1], sizeof row[0]) == 0);
    CHECK(memcmp(row[0], row[2], sizeof row[0]) == 0);
    bex_ps_shard_stats st = pb_stats(p.s[0]);
    CHECK(st.rejoins == 1 && st.backups_down == 0 && st.pushes == 4);
    bex_ps_client_destroy(c);
    pb_stop(&p);
    return 0;
}

/* ---- retry_seq ---- */

/* bex_ps_push_seq: a Push sent twice with the same seq through a client
 * (as a trainer retries one whose answer was lost) is applied once on
 * every replica; a new seq is a new Push. */
static int t_retry_seq(void)
{
    struct pb p;
    int rc = pb_start(&p, false, 0);
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 57;
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    uint64_t seq = bex_ps_push_next_seq(c);
    CHECK(seq > 0);
    CHECK_EQ(bex_ps_push_seq_sync(c, 0, TS->id, TS->dim, &key, 1, g, NULL, 0, NULL), -EINVAL);
    CHECK_OK(bex_ps_push_seq_sync(c, seq, TS->id, TS->dim, &key, 1, g, NULL, 0, NULL));
    CHECK_OK(bex_ps_push_seq_sync(c, seq, TS->id, TS->dim, &key, 1, g, NULL, 0, NULL));
    for (int r = 0; r < NREP; r++)
        CHECK_EQ(pb_stats(p.s[r]).pushes, 1);
    CHECK_EQ(pb_stats(p.s[0]).dup_ids, 1);
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g)); /* the next seq: applied */
    float row[NREP][8];
    for (int r = 0; r < NREP; r++) {
        CHECK_EQ(pb_stats(p.s[r]).pushes, 2);
        rows_of(&p, r, TS, &key, 1, row[r]);
        CHECK(memcmp(row[0], row[r], sizeof row[0]) == 0);
    }
    bex_ps_client_destroy(c);
    pb_stop(&p);
    return 0;
}

/* ---- slow_connect ---- */

/* The first Push while the primary's connection to backup 2 takes three
 * forward deadlines to come up: it waits for the connection (within
 * backup_connect_timeout_ms) and is applied everywhere; no backup is
 * marked down. It was -EHOSTDOWN, backup 2 down (the RDMA failures of
 * backup_behind, backup_restart and restart_suffix at load 29). */
static int t_slow_connect(void)
{
    uint32_t fwd = 200 * time_scale();
    struct pb p;
    struct relay rl;
    bk2_relay = &rl;
    bk2_delay_ms = 3 * fwd;
    bk_connect_ms = 30 * fwd;
    int rc = pb_start_ex(&p, false, fwd, 50);
    bk2_relay = NULL;
    bk_connect_ms = 0;
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 44;
    float g[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    /* one Push only: a later one would have the short forward deadline,
     * which a loaded host may miss (every forward here has the setup's) */
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    float row[NREP][8];
    for (int r = 0; r < NREP; r++) {
        rows_of(&p, r, TS, &key, 1, row[r]);
        CHECK(memcmp(row[0], row[r], sizeof row[0]) == 0);
        CHECK_EQ(pb_stats(p.s[r]).lsn, 1);
    }
    CHECK_EQ(pb_stats(p.s[0]).backups_down, 0);
    bex_ps_client_destroy(c);
    pb_stop(&p);
    relay_stop(&rl);
    return 0;
}

/* ---- backup_behind ---- */

/* Counter name of shard s in its /metrics text (-1: not there). */
static long long prom_ctr(bex_ps_shard *s, const char *name)
{
    static char buf[1 << 16];
    char pat[128];
    CHECK(bex_ps_shard_prometheus(&s, 1, buf, sizeof buf) > 0);
    snprintf(pat, sizeof pat, "\n%s{shard=\"0\"} ", name);
    const char *p = strstr(buf, pat);
    return p ? strtoll(p + strlen(pat), NULL, 10) : -1;
}

/* Backup 2 alive with its rows misses a forward (its server gone while
 * the Push was forwarded, as a backup stopped past the forward deadline
 * whose connection was reset) and comes back at its address: the
 * primary's probe finds it behind. Returns the Push's status once it is
 * not -EHOSTDOWN or after a few seconds. */
static int behind_run(struct pb *p, bex_ps_client *c, uint64_t key, uint32_t wait_ms)
{
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    CHECK_OK(bex_rpc_server_destroy(p->srv[2])); /* its rows stay */
    p->srv[2] = NULL;
    CHECK_EQ(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g), -EHOSTDOWN); /* missed there */
    CHECK_OK(bex_rpc_server_create(p->bctx[2], NULL, &p->srv[2]));
    CHECK_OK(bex_ps_shard_register(p->s[2], p->srv[2], p->bctx[2]));
    CHECK_OK(bex_rpc_server_listen(p->srv[2], &p->addr[2]));
    uint64_t end = pair_now_ms() + wait_ms;
    int rc;
    while ((rc = bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g)) == -EHOSTDOWN &&
           pair_now_ms() < end)
        pair_sleep_ms(20);
    return rc;
}

static int t_backup_behind(void)
{
    struct pb p;
    int rc = pb_start_ex(&p, false, 1500 * time_scale(), 50);
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 33;
    CHECK_OK(behind_run(&p, c, key, 10000 * time_scale())); /* was -EHOSTDOWN for ever */
    float row[NREP][8];
    for (int r = 0; r < NREP; r++) {
        rows_of(&p, r, TS, &key, 1, row[r]);
        CHECK(memcmp(row[0], row[r], sizeof row[0]) == 0);
        CHECK_EQ(pb_stats(p.s[r]).lsn, 3);
    }
    bex_ps_shard_stats st = pb_stats(p.s[0]);
    CHECK(st.rejoins == 1 && st.log_rejoins == 1 && st.backups_down == 0);
    CHECK_EQ(st.fwd_resent, 1); /* lsn 2 alone */
    CHECK_EQ(prom_ctr(p.s[0], "bex_ps_forwards_resent_total"), 1);
    CHECK_EQ(prom_ctr(p.s[0], "bex_ps_backup_log_rejoins_total"), 1);
    CHECK_EQ(pb_stats(p.s[2]).pushes, 3);
    bex_ps_client_destroy(c);
    pb_stop(&p);
    return 0;
}

static int t_backup_behind_log(void)
{
    struct pb p;
    log_bytes = 1; /* no Push fits: the log stays empty */
    int rc = pb_start_ex(&p, false, 1500 * time_scale(), 20);
    log_bytes = 0;
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 34;
    /* probed many times meanwhile (every 20 ms while Pushes come) */
    CHECK_EQ(behind_run(&p, c, key, 600), -EHOSTDOWN);
    bex_ps_shard_stats st = pb_stats(p.s[0]);
    CHECK(st.rejoins == 0 && st.log_rejoins == 0 && st.fwd_resent == 0 && st.backups_down == 1);
    CHECK_EQ(pb_stats(p.s[2]).lsn, 1);
    CHECK_EQ(pb_stats(p.s[1]).lsn, 2);
    /* further behind than the log: restarted, it copies and rejoins */
    CHECK_OK(bex_rpc_server_destroy(p.srv[2]));
    bex_ps_shard_destroy(p.s[2]);
    CHECK_OK(bex_ctx_destroy(p.bctx[2]));
    p.srv[2] = NULL;
    p.s[2] = NULL;
    p.bctx[2] = NULL;
    backup2_restart(&p);
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1}, row[NREP][8];
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    while ((rc = bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g)) == -EHOSTDOWN &&
           pair_now_ms() < end)
        pair_sleep_ms(20);
    CHECK_OK(rc);
    for (int r = 0; r < NREP; r++) {
        rows_of(&p, r, TS, &key, 1, row[r]);
        CHECK(memcmp(row[0], row[r], sizeof row[0]) == 0);
        CHECK_EQ(pb_stats(p.s[r]).lsn, 3);
    }
    st = pb_stats(p.s[0]);
    CHECK(st.rejoins == 1 && st.log_rejoins == 0 && st.fwd_resent == 0);
    bex_ps_client_destroy(c);
    pb_stop(&p);
    return 0;
}

/* ---- behind_hostile ---- */

/* A fake backup: a Forward fails (-EIO); probe k is answered -ESTALE
 * with the kth hostile position. */
static struct {
    bex_ctx *ctx;
    _Atomic int probes, forwards;
} hb;

static void hostile_fwd(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    struct bex__ps_fwd_hdr fh;
    int rc = bex__ps_fwd_get(body, len, &fh);
    bex_rpc_free(body);
    if (rc || !(fh.flags & BEX__PS_FWD_PROBE)) {
        atomic_fetch_add(&hb.forwards, 1);
        bex_rpc_reply(req, -EIO, NULL, 0);
        return;
    }
    /* past the primary's lsn, far past it, 0 (the log covers 1..), short */
    static const uint64_t pos[] = {1000, UINT64_MAX, UINT64_MAX - 1, 0, 5};
    int k = atomic_fetch_add(&hb.probes, 1) % 5;
    size_t n = k == 4 ? 3 : BEX__PS_POS_LEN;
    uint8_t *out = bex_rpc_alloc(hb.ctx, BEX__PS_POS_LEN);
    CHECK(out);
    bex__ps_put64(out, pos[k]);
    bex_rpc_reply(req, -ESTALE, out, n);
}

static int t_behind_hostile(void)
{
    struct pb p;
    int rc = pb_start_ex(&p, false, 1500 * time_scale(), 10);
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 36;
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    CHECK_OK(bex_rpc_server_destroy(p.srv[2]));
    hb.ctx = p.bctx[2];
    CHECK_OK(bex_rpc_server_create(p.bctx[2], NULL, &p.srv[2]));
    CHECK_OK(bex_rpc_server_register(p.srv[2], BEX_PS_SERVICE, BEX_PS_M_FORWARD,
                                     bex__ps_method_flags(BEX_PS_M_FORWARD), hostile_fwd, NULL));
    CHECK_OK(bex_rpc_server_listen(p.srv[2], &p.addr[2]));
    CHECK_EQ(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g), -EHOSTDOWN);
    /* every position answered a few times over */
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (atomic_load(&hb.probes) < 15 && pair_now_ms() < end) {
        CHECK_EQ(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g), -EHOSTDOWN);
        pair_sleep_ms(5);
    }
    CHECK(atomic_load(&hb.probes) >= 15);
    bex_ps_shard_stats st = pb_stats(p.s[0]);
    CHECK(st.rejoins == 0 && st.backups_down == 1 && st.lsn == 2);
    /* position 0 alone is covered: lsn 1 and 2 resent, refused */
    CHECK(st.fwd_resent >= 2 && st.fwd_resent % 2 == 0);
    CHECK((int)st.fwd_resent <= atomic_load(&hb.forwards));
    bex_ps_client_destroy(c);
    pb_stop(&p);
    return 0;
}

/* ---- primary_stale ---- */

/* A peer that never answers a COPY (its requests kept, answered at the end). */
static struct {
    bex_ctx *ctx;
    bex_rpc_server *srv;
    pthread_mutex_t mu; /* held and n_held: the I/O threads add, the test takes */
    bex_rpc_req *held[64];
    int n_held;
    bool stopping;
} hang = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void hang_copy(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)len;
    (void)user;
    bex_rpc_free(body);
    pthread_mutex_lock(&hang.mu);
    int rc = hang.stopping ? -ECANCELED : hang.n_held < 64 ? 0 : -EAGAIN;
    if (!rc)
        hang.held[hang.n_held++] = req;
    pthread_mutex_unlock(&hang.mu);
    if (rc)
        bex_rpc_reply(req, rc, NULL, 0);
}

static bex_rpc_endpoint hang_start(struct in_addr a0)
{
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config c = scaled(&base, a0);
    hang.stopping = false; /* before its server exists: no handler runs */
    CHECK_OK(bex_ctx_create(&c, &hang.ctx));
    CHECK_OK(bex_rpc_server_create(hang.ctx, NULL, &hang.srv));
    CHECK_OK(bex_rpc_server_register(hang.srv, BEX_PS_SERVICE, BEX_PS_M_COPY, 0, hang_copy, NULL));
    bex_addr la = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    CHECK_OK(bex_rpc_server_listen(hang.srv, &la));
    bex_rpc_server_addr(hang.srv, &la);
    return (bex_rpc_endpoint){.addr = la};
}

static void hang_stop(void)
{
    pthread_mutex_lock(&hang.mu);
    hang.stopping = true;
    int n = hang.n_held;
    hang.n_held = 0;
    pthread_mutex_unlock(&hang.mu);
    for (int i = 0; i < n; i++)
        bex_rpc_reply(hang.held[i], -ECANCELED, NULL, 0);
    CHECK_OK(bex_rpc_server_destroy(hang.srv));
    CHECK_OK(bex_ctx_destroy(hang.ctx));
}

/* The primary restarted (its state lost) at its address, catching up. */
static void primary_restart(struct pb *p)
{
    CHECK_OK(bex_rpc_server_destroy(p->srv[0]));
    bex_ps_shard_destroy(p->s[0]);
    bex_rpc_endpoint bk[NREP - 1];
    for (int r = 1; r < NREP; r++)
        bk[r - 1] = (bex_rpc_endpoint){.addr = p->addr[r]};
    bex_ps_shard_config pc = {.shard = 0,
                              .n_shards = 1,
                              .tables = TABLES,
                              .n_tables = 2,
                              .role = BEX_PS_ROLE_PRIMARY,
                              .backups = bk,
                              .n_backups = NREP - 1,
                              .forward_timeout_ms = 1500 * time_scale(),
                              .backup_retry_ms = 50,
                              .flags = BEX_PS_SHARD_CATCHUP};
    pb_replica_start(p, 0, p->addr[0].in4.sin_addr, &pc);
}

/* A Fetch of key at replica r, through bex_ps_shard_serve: its status. */
static int fetch_status(struct pb *p, int r, uint64_t key)
{
    uint8_t body[BEX__PS_HDR_LEN + 8];
    bex__ps_hdr_put(body, &(struct bex__ps_hdr){.table = TS->id, .n = 1, .dim = TS->dim});
    bex__ps_put64(body + BEX__PS_HDR_LEN, key);
    void *resp = NULL;
    size_t len = 0;
    int rc = bex_ps_shard_serve(p->s[r], p->sctx, BEX_PS_M_FETCH, body, sizeof body, &resp, &len);
    bex_rpc_free(resp);
    return rc;
}

static int t_primary_stale(void)
{
    struct pb p;
    int rc = pb_start_ex(&p, false, 1500 * time_scale(), 50);
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 35;
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1}, row[NREP][8];
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    bex_ps_client_destroy(c);
    primary_restart(&p);
    bex_rpc_endpoint peer = hang_start(p.addr[0].in4.sin_addr);
    bex_ps_catchup_config cc = {.peers = &peer, .n_peers = 1, .timeout_ms = 300};
    CHECK_EQ(bex_ps_shard_catchup(p.s[0], p.sctx, &cc), -ETIMEDOUT);
    /* its rows are empty: it must not serve them as the shard's */
    CHECK_EQ(fetch_status(&p, 0, key), -EAGAIN);
    bex_ps_client_config qc = {
        .dir = p.dir, .service = "ps", .timeout_ms = 300, .push_mode = BEX_PS_PUSH_PRIMARY};
    CHECK_OK(bex_ps_client_create(p.cctx, &qc, &c));
    CHECK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g) != 0); /* was acknowledged */
    bex_ps_client_destroy(c);
    for (int r = 1; r < NREP; r++)
        CHECK_EQ(pb_stats(p.s[r]).pushes, 2);
    /* caught up from backup 1 this time: it serves the shard's rows */
    bex_rpc_endpoint b1 = {.addr = p.addr[1]};
    cc = (bex_ps_catchup_config){.peers = &b1, .n_peers = 1, .timeout_ms = 10000 * time_scale()};
    CHECK_OK(bex_ps_shard_catchup(p.s[0], p.sctx, &cc));
    c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    for (int r = 0; r < NREP; r++)
        rows_of(&p, r, TS, &key, 1, row[r]);
    CHECK(memcmp(row[0], row[1], sizeof row[0]) == 0);
    CHECK(memcmp(row[0], row[2], sizeof row[0]) == 0);
    for (int r = 1; r < NREP; r++)
        CHECK_EQ(pb_stats(p.s[r]).pushes, 3);
    bex_ps_client_destroy(c);
    pb_stop(&p);
    hang_stop();
    return 0;
}

/* ---- restart_suffix, restart_suffix_log, suffix_hostile ---- */

/* Backup 2 killed and restarted from the snapshot at path (version 4:
 * its position in the primary's session), catching up from the primary. */
static void backup2_restart_snap(struct pb *p, const char *path)
{
    bex_ps_shard_config pc = {.shard = 0,
                              .n_shards = 1,
                              .tables = TABLES,
                              .n_tables = 2,
                              .role = BEX_PS_ROLE_BACKUP,
                              .flags = BEX_PS_SHARD_CATCHUP,
                              .snapshot_path = path};
    pb_replica_start(p, 2, p->addr[2].in4.sin_addr, &pc);
    bex_rpc_endpoint peer = {.addr = p->addr[0]};
    bex_ps_catchup_config cc = {.peers = &peer, .n_peers = 1, .timeout_ms = 10000 * time_scale()};
    CHECK_OK(bex_ps_shard_catchup(p->s[2], p->bctx[2], &cc));
}

static void backup2_kill(struct pb *p)
{
    CHECK_OK(bex_rpc_server_destroy(p->srv[2]));
    bex_ps_shard_destroy(p->s[2]);
    CHECK_OK(bex_ctx_destroy(p->bctx[2]));
    p->srv[2] = NULL;
    p->s[2] = NULL;
    p->bctx[2] = NULL;
}

/* Snapshot of backup 2 after the first Push, three more acknowledged,
 * backup 2 killed, one more (applied at the others, -EHOSTDOWN), backup 2
 * restarted from its snapshot; the Pushes go on once it is back. The
 * replicas end equal at lsn 6 (SGD and Adagrad rows). */
static void suffix_run(struct pb *p, const char *snap)
{
    bex_ps_client *c = pb_client(p, BEX_PS_PUSH_PRIMARY);
    uint64_t keys[2] = {41, 42};
    float g[16];
    for (int i = 0; i < 16; i++)
        g[i] = (float)(i % 5) - 2.0f;
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, keys, 2, g));
    CHECK_OK(bex_ps_shard_snapshot(p->s[2], snap));
    for (int i = 0; i < 3; i++)
        CHECK_OK(bex_ps_push_sync(c, TA->id, TA->dim, keys, 2, g));
    backup2_kill(p);
    CHECK_EQ(bex_ps_push_sync(c, TA->id, TA->dim, keys, 2, g), -EHOSTDOWN); /* lsn 5 */
    backup2_restart_snap(p, snap);
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    int rc;
    while ((rc = bex_ps_push_sync(c, TS->id, TS->dim, keys, 2, g)) == -EHOSTDOWN &&
           pair_now_ms() < end)
        pair_sleep_ms(20);
    CHECK_OK(rc);
    float row[NREP][2 * 8] = {{0}}, arow[NREP][2 * 8] = {{0}};
    for (int r = 0; r < NREP; r++) {
        rows_of(p, r, TS, keys, 2, row[r]);
        rows_of(p, r, TA, keys, 2, arow[r]);
        CHECK(memcmp(row[0], row[r], sizeof row[0]) == 0);
        CHECK(memcmp(arow[0], arow[r], sizeof arow[0]) == 0);
        CHECK_EQ(pb_stats(p->s[r]).lsn, 6);
    }
    bex_ps_client_destroy(c);
}

/* The replicas of the suffix cases (forward deadline 1.5 s, probes every
 * 20 ms) and a fresh directory dir (a mkdtemp template) for backup 2's
 * snapshot, whose path goes into snap. */
static int suffix_start(struct pb *p, char *dir, char *snap, size_t cap)
{
    int rc = pb_start_ex(p, false, 1500 * time_scale(), 20);
    if (rc)
        return rc;
    CHECK(mkdtemp(dir));
    snprintf(snap, cap, "%s/b2.snap", dir);
    return 0;
}

static int t_restart_suffix(void)
{
    struct pb p;
    char dir[] = "/tmp/bex-ps-suffix-XXXXXX", snap[64];
    int rc = suffix_start(&p, dir, snap, sizeof snap);
    if (rc)
        return rc;
    suffix_run(&p, snap);
    bex_ps_shard_stats st = pb_stats(p.s[2]);
    /* lsn 2..5 from the primary's log, no row copied */
    CHECK_EQ(st.catchup_suffix, 1);
    CHECK_EQ(st.suffix_applied, 4);
    CHECK_EQ(st.catchup_rows, 0);
    CHECK_EQ(st.catchup_failed, 0);
    CHECK(pb_stats(p.s[0]).suffixes_served >= 1);
    CHECK_EQ(pb_stats(p.s[0]).copies_served, 0);
    /* and in /metrics: the suffix path moved, the full copy's did not */
    CHECK_EQ(prom_ctr(p.s[2], "bex_ps_catchup_suffix_total"), 1);
    CHECK_EQ(prom_ctr(p.s[2], "bex_ps_catchup_suffix_pushes_total"), 4);
    CHECK_EQ(prom_ctr(p.s[2], "bex_ps_catchup_full_copies_total"), 0);
    CHECK(prom_ctr(p.s[0], "bex_ps_catchup_suffixes_served_total") >= 1);
    pb_stop(&p);
    CHECK(unlink(snap) == 0 && rmdir(dir) == 0);
    return 0;
}

static int t_restart_suffix_empty(void)
{
    struct pb p;
    char dir[] = "/tmp/bex-ps-suffix-XXXXXX", snap[64];
    int rc = suffix_start(&p, dir, snap, sizeof snap);
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 43;
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    CHECK_OK(bex_ps_shard_snapshot(p.s[2], snap)); /* at lsn 1, the primary's */
    backup2_kill(&p); /* no Push meanwhile: the primary stays at lsn 1 */
    backup2_restart_snap(&p, snap);
    CHECK_EQ(pb_stats(p.s[2]).catchup_suffix, 1);
    CHECK_EQ(pb_stats(p.s[2]).suffix_applied, 0);
    uint64_t end = pair_now_ms() + 5000ull * time_scale();
    while ((rc = bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g)) == -EHOSTDOWN &&
           pair_now_ms() < end)
        pair_sleep_ms(20);
    CHECK_OK(rc); /* it rejoined */
    for (int i = 0; i < 3; i++)
        CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    float row[NREP][8];
    for (int r = 0; r < NREP; r++) {
        rows_of(&p, r, TS, &key, 1, row[r]);
        CHECK(memcmp(row[0], row[r], sizeof row[0]) == 0);
        CHECK_EQ(pb_stats(p.s[r]).lsn, 5);
    }
    bex_ps_client_destroy(c);
    pb_stop(&p);
    CHECK(unlink(snap) == 0 && rmdir(dir) == 0);
    return 0;
}

static int t_restart_suffix_log(void)
{
    struct pb p;
    log_bytes = 1; /* no Push fits: the log cannot cover the snapshot */
    int rc = pb_start_ex(&p, false, 1500 * time_scale(), 20);
    log_bytes = 0;
    if (rc)
        return rc;
    char dir[] = "/tmp/bex-ps-suffix-XXXXXX", snap[64];
    CHECK(mkdtemp(dir));
    snprintf(snap, sizeof snap, "%s/b2.snap", dir);
    suffix_run(&p, snap);
    bex_ps_shard_stats st = pb_stats(p.s[2]);
    CHECK(st.catchup_suffix == 0 && st.suffix_applied == 0 && st.catchup_rows > 0);
    CHECK_EQ(pb_stats(p.s[0]).suffixes_served, 0);
    CHECK_EQ(pb_stats(p.s[0]).copies_served, 1);
    CHECK_EQ(st.catchup_full, 1);
    CHECK_EQ(prom_ctr(p.s[2], "bex_ps_catchup_full_copies_total"), 1);
    CHECK_EQ(prom_ctr(p.s[2], "bex_ps_catchup_suffix_total"), 0);
    CHECK_EQ(prom_ctr(p.s[0], "bex_ps_catchup_copies_served_total"), 1);
    pb_stop(&p);
    CHECK(unlink(snap) == 0 && rmdir(dir) == 0);
    return 0;
}

/* One COPY op SUFFIX call to replica r: its status; *last and the entries'
 * count on 0. */
static bex_rpc_channel *suffix_ch[NREP];

static int suffix_ask(struct pb *p, int r, uint64_t session, uint64_t pos, uint32_t max,
                      uint64_t *last, int *n)
{
    if (!suffix_ch[r]) {
        bex_rpc_endpoint ep = {.addr = p->addr[r]};
        bex_rpc_channel_config cc = {.endpoints = &ep,
                                     .n_endpoints = 1,
                                     .request_timeout_ms = 10000 * time_scale(),
                                     .connect_timeout_ms = 10000 * time_scale(),
                                     .max_attempts = 1};
        CHECK_OK(bex_rpc_channel_create(p->cctx, &cc, &suffix_ch[r]));
    }
    bex_rpc_channel *ch = suffix_ch[r];
    uint8_t *b = bex_rpc_alloc(p->cctx, BEX__PS_COPY_HDR_LEN);
    CHECK(b);
    bex__ps_copy_put(
        b, &(struct bex__ps_copy_hdr){
               .op = BEX__PS_COPY_SUFFIX, .max_len = max, .session = session, .offset = pos});
    bex_rpc_call_opts o = {.timeout_ms = 10000 * time_scale()};
    void *resp = NULL;
    size_t len = 0;
    int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, BEX_PS_M_COPY, b, BEX__PS_COPY_HDR_LEN, &o,
                               &resp, &len);
    struct bex__ps_copy_hdr a;
    if (rc == 0) {
        CHECK_OK(bex__ps_copy_get(resp, len, &a));
        *last = a.offset;
        *n = 0;
        for (size_t off = BEX__PS_COPY_HDR_LEN; off < len; (*n)++) {
            CHECK(len - off >= 12);
            CHECK_EQ(bex__ps_get64((uint8_t *)resp + off), pos + 1 + (uint64_t)*n);
            off += 12 + bex__ps_get32((uint8_t *)resp + off + 8);
        }
    }
    bex_rpc_free(resp);
    return rc;
}

/* Positions a restarted backup (or a hostile peer) may claim: the
 * primary answers the suffix its log holds, or refuses; it goes on
 * serving. */
static int t_suffix_hostile(void)
{
    struct pb p;
    int rc = pb_start(&p, false, 0);
    if (rc)
        return rc;
    bex_ps_client *c = pb_client(&p, BEX_PS_PUSH_PRIMARY);
    uint64_t key = 43, last = 0, session, lsn;
    float g[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    for (int i = 0; i < 3; i++)
        CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    pthread_mutex_lock(&p.s[0]->mu);
    bex__ps_repl_position(p.s[0], &session, &lsn);
    pthread_mutex_unlock(&p.s[0]->mu);
    CHECK_EQ(lsn, 3);
    int n = -1;
    CHECK_OK(suffix_ask(&p, 0, session, 0, 1u << 20, &last, &n));
    CHECK(last == 3 && n == 3); /* from the start: the log holds it */
    CHECK_OK(suffix_ask(&p, 0, session, 1, 1, &last, &n));
    CHECK(last == 3 && n == 1); /* max_len 1: one entry at least */
    CHECK_OK(suffix_ask(&p, 0, session, 3, 1u << 20, &last, &n));
    CHECK(last == 3 && n == 0);                                                     /* in step */
    CHECK_EQ(suffix_ask(&p, 0, session, 4, 1u << 20, &last, &n), -ERANGE);          /* future */
    CHECK_EQ(suffix_ask(&p, 0, session, UINT64_MAX, 1u << 20, &last, &n), -ERANGE); /* huge */
    CHECK_EQ(suffix_ask(&p, 0, session ^ 2, 1, 1u << 20, &last, &n), -ESTALE);
    CHECK_EQ(suffix_ask(&p, 0, 0, 0, 1u << 20, &last, &n), -ESTALE);
    CHECK_EQ(suffix_ask(&p, 0, session, 1, 0, &last, &n), -EINVAL);
    CHECK_EQ(suffix_ask(&p, 1, session, 1, 1u << 20, &last, &n), -ENOENT); /* a backup */
    CHECK_OK(bex_ps_push_sync(c, TS->id, TS->dim, &key, 1, g));
    CHECK_EQ(pb_stats(p.s[0]).suffixes_served, 3);
    for (int r = 0; r < NREP; r++)
        if (suffix_ch[r]) {
            bex_rpc_channel_destroy(suffix_ch[r]);
            suffix_ch[r] = NULL;
        }
    bex_ps_client_destroy(c);
    pb_stop(&p);
    return 0;
}

/* ---- join_v6 ---- */

/* A context on ::1 over TCP. */
static bex_ctx *v6_ctx(void)
{
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config c = scaled(&base, (struct in_addr){htonl(INADDR_LOOPBACK)});
    c.local_addr = bex_addr_loopback6(0);
    c.transport = BEX_TRANSPORT_TCP;
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

/* A primary and one backup on ::1, a Push; a second backup on ::1 joins
 * (the JOIN body carries its IPv6 address): the Pushes after it reach
 * it, and the three replicas end equal. */
static int t_join_v6(void)
{
    bex_ctx *ctx[NREP];
    bex_ps_shard *s[NREP];
    bex_rpc_server *srv[NREP];
    bex_rpc_endpoint ep[NREP];
    for (int r = NREP - 1; r >= 0; r--) {
        ctx[r] = v6_ctx();
        bex_ps_shard_config pc = {.shard = 0, .n_shards = 1, .tables = TABLES, .n_tables = 2};
        pc.role = r ? BEX_PS_ROLE_BACKUP : BEX_PS_ROLE_PRIMARY;
        pc.flags = r == 2 ? BEX_PS_SHARD_CATCHUP : 0;
        pc.backups = r ? NULL : &ep[1];
        pc.n_backups = r ? 0 : 1;
        pc.forward_timeout_ms = 3000 * time_scale();
        CHECK_OK(bex_ps_shard_create(&pc, &s[r]));
        CHECK_OK(bex_rpc_server_create(ctx[r], NULL, &srv[r]));
        CHECK_OK(bex_ps_shard_register(s[r], srv[r], ctx[r]));
        ep[r] = (bex_rpc_endpoint){.addr = bex_addr_loopback6(0), .transport = BEX_TRANSPORT_TCP};
        int rc = bex_rpc_server_listen(srv[r], &ep[r].addr);
        if (rc == -EADDRNOTAVAIL || rc == -EAFNOSUPPORT)
            return bex_test_skip("no IPv6 loopback");
        CHECK_OK(rc);
        bex_rpc_server_addr(srv[r], &ep[r].addr);
    }
    bex_ctx *cctx = v6_ctx();
    char j[512], a[3][BEX_ADDR_STRLEN], err[128];
    for (int r = 0; r < NREP; r++)
        bex_addr_format(&ep[r].addr, true, a[r], sizeof a[r]);
    snprintf(
        j, sizeof j,
        "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":[{\"addr\":\"%s\"},{\"addr\":\"%s\"},"
        "{\"addr\":\"%s\"}]}]}}}",
        a[0], a[1], a[2]);
    bex_dir *d;
    CHECK_OK(bex_dir_create(NULL, &d));
    CHECK_OK(bex_dir_load_json(d, j, err, sizeof err));
    bex_ps_client_config cc = {.dir = d,
                               .service = "ps",
                               .timeout_ms = 20000 * time_scale(),
                               .push_mode = BEX_PS_PUSH_PRIMARY};
    bex_ps_client *c;
    CHECK_OK(bex_ps_client_create(cctx, &cc, &c));
    uint64_t key = 61;
    float g[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    CHECK_OK(bex_ps_push_sync(c, TA->id, TA->dim, &key, 1, g));
    bex_ps_join_config jc = {.primary = ep[0], .self = ep[2], .timeout_ms = 10000 * time_scale()};
    CHECK_OK(bex_ps_shard_join(s[2], ctx[2], &jc));
    for (int i = 0; i < 3; i++)
        CHECK_OK(bex_ps_push_sync(c, TA->id, TA->dim, &key, 1, g));
    CHECK_EQ(pb_stats(s[0]).n_backups, 2);
    float row[NREP][8] = {{0}};
    for (int r = 0; r < NREP; r++) {
        uint8_t body[BEX__PS_HDR_LEN + 8];
        bex__ps_hdr_put(body, &(struct bex__ps_hdr){.table = TA->id, .n = 1, .dim = TA->dim});
        bex__ps_put64(body + BEX__PS_HDR_LEN, key);
        void *resp = NULL;
        size_t len = 0;
        CHECK_OK(bex_ps_shard_serve(s[r], ctx[r], BEX_PS_M_FETCH, body, sizeof body, &resp, &len));
        CHECK_EQ(len, BEX__PS_HDR_LEN + 4 * (size_t)TA->dim);
        for (uint32_t i = 0; i < TA->dim; i++)
            row[r][i] = bex__ps_getf((const uint8_t *)resp + BEX__PS_HDR_LEN + 4 * i);
        bex_rpc_free(resp);
        CHECK(memcmp(row[0], row[r], sizeof row[0]) == 0);
        CHECK_EQ(pb_stats(s[r]).lsn, 4);
    }
    bex_ps_client_destroy(c);
    bex_dir_destroy(d);
    for (int r = 0; r < NREP; r++)
        CHECK_OK(bex_rpc_server_destroy(srv[r]));
    for (int r = 0; r < NREP; r++) {
        bex_ps_shard_destroy(s[r]);
        CHECK_OK(bex_ctx_destroy(ctx[r]));
    }
    CHECK_OK(bex_ctx_destroy(cctx));
    return 0;
}

BEX_TEST_MAIN({"adagrad", t_adagrad}, {"adagrad_fanout", t_adagrad_fanout}, {"retry", t_retry},
              {"order", t_order}, {"backup_down", t_backup_down},
              {"backup_restart", t_backup_restart}, {"bench", t_bench}, {"retry_seq", t_retry_seq},
              {"slow_connect", t_slow_connect}, {"backup_behind", t_backup_behind},
              {"backup_behind_log", t_backup_behind_log}, {"primary_stale", t_primary_stale},
              {"behind_hostile", t_behind_hostile}, {"restart_suffix", t_restart_suffix},
              {"restart_suffix_log", t_restart_suffix_log},
              {"restart_suffix_empty", t_restart_suffix_empty},
              {"suffix_hostile", t_suffix_hostile}, {"join_v6", t_join_v6})
