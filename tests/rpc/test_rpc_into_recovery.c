/* SPDX-License-Identifier: Apache-2.0 */
/* Calls with a destination (bex_rpc_call_into) under the channel's
 * recovery machinery, as ordinary calls have it (issue 9 items 4 to 6):
 *
 * attempt_timeout (tcp, rxe): an attempt the server withholds its answer
 * to is abandoned after attempt_timeout_ms, its exposure retired, and the
 * retry (a fresh exposure) is answered into the destination, well within
 * the call's deadline.
 * attempt_limits (tcp): attempts that all go unanswered: max_attempts of
 * them, then the call's deadline (not before); with a budget of one retry,
 * two attempts and one throttled retry.
 * ladder_steps (tcp): an endpoint listed RDMA on a context without a
 * device: calls with a destination alone take the ladder's steps 1, 2, 3
 * and succeed over TCP.
 * kill (tcp, rxe): two replicas, 32 calls with destinations outstanding,
 * one replica killed with -9: every call succeeds within its deadline
 * with the default retry budget (the ladder moves the calls that were out
 * on the dead replica).
 * directory (tcp): a channel over a directory reports the outcomes of
 * calls with destinations: answers as ok, the dead replica's connection
 * failures until it is quarantined.
 *
 * Every call completes exactly once (d_done counts) with its destination
 * retired (no exposure of it armed), and the request bodies come back to
 * the pool. */
#include "bex/dir.h"
#include "rpc/into_test.h"

static size_t pool_in_use(bex_ctx *ctx)
{
    bex_mem_pool *p = bex_ctx_pool(ctx);
    bex_mem_stats st;
    bex_mem_pool_collect(p);
    bex_mem_pool_stats(p, &st);
    return st.in_use_bytes;
}

/* The pool has what it had before (at most `before` in use) within 2 s:
 * every request body given to the channel was freed. */
static void check_pool_back(bex_ctx *ctx, size_t before)
{
    uint64_t end = pair_now_ms() + 2000 * time_scale();
    while (pool_in_use(ctx) > before && pair_now_ms() < end)
        pair_sleep_ms(5);
    CHECK(pool_in_use(ctx) <= before);
}

/* d completed once, and stays so for a while (no second completion). */
static void check_once(struct dres *d)
{
    pair_sleep_ms(100 * time_scale());
    CHECK_EQ(atomic_load(&d->calls), 1);
}

/* One replica that holds the first M_HOLD1 request and echoes the later
 * ones; attempt_timeout_ms A: the first attempt is abandoned after A, the
 * second answers into the destination, the call completing after A and
 * well before its deadline; 2 attempts, 1 retry, the endpoint's failure
 * counted; the held request was not answered into the destination. */
static int t_attempt_timeout(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_endpoint eps[1];
    const unsigned A = 300 * time_scale(), deadline = 5000 * time_scale();
    bex_rpc_channel_config cc = chan_cfg(eps, &sp, 1);
    cc.request_timeout_ms = LONG_MS * time_scale();
    cc.attempt_timeout_ms = A;
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    enum { CAP = 64 << 10, LEN = 20000 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    /* the connection up first (an echo), so that A times the answer (in
     * a loaded VM the setup took longer than A: the warm-up may have been
     * retried, so what follows counts from after it) */
    struct dres d;
    dres_init(&d, ctx, dst);
    bex_rpc_call_opts warm = {.timeout_ms = 20000 * time_scale()};
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO, NULL, 0, dst, CAP, &warm, d_done, &d, NULL));
    CHECK(wait_count(&d.w, &d.calls, 1, 30000) == 0);
    CHECK_OK(d.status);
    struct tstats ts0 = server_stats(ch);
    bex_rpc_channel_stats st0;
    bex_rpc_channel_stats_get(ch, &st0);
    bex_rpc_endpoint_stats es0[1];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es0, 1), 1);
    size_t pool0 = pool_in_use(ctx);
    memset(bex__rpc_hdr_of(dst), 0x5C, CAP + BEX_RPC_HDR_LEN);
    dres_init(&d, ctx, dst);
    bex_rpc_call_opts o = {.timeout_ms = deadline};
    uint64_t t0 = pair_now_ms();
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_HOLD1, pattern_body(ctx, LEN, 41), LEN, dst, CAP, &o,
                               d_done, &d, NULL));
    CHECK(wait_count(&d.w, &d.calls, 1, 30000) == 0);
    uint64_t took = pair_now_ms() - t0;
    fprintf(stderr, "attempt_timeout: status %d after %llu ms (attempt timeout %u ms)\n", d.status,
            (unsigned long long)took, A);
    CHECK_OK(d.status);
    CHECK(d.body == dst);
    CHECK_EQ(d.len, LEN);
    CHECK(check_pattern(dst, LEN, 41) == 0);
    CHECK(all_bytes(dst + LEN, CAP - LEN, 0x5C));
    CHECK_EQ(d.armed_at_done, 0);
    CHECK(took >= A);
    CHECK(took < deadline / 2);
    check_once(&d);
    CHECK_EQ(armed_of(ctx, dst), 0);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.attempts - st0.attempts, 2);
    CHECK_EQ(st.retries - st0.retries, 1);
    CHECK_EQ(st.ok - st0.ok, 1);
    CHECK_EQ(st.failed, 0);
    bex_rpc_endpoint_stats es[1];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 1), 1);
    CHECK_EQ(es[0].attempts - es0[0].attempts, 2);
    CHECK_EQ(es[0].failures - es0[0].failures, 1);
    CHECK_EQ(es[0].answers - es0[0].answers, 1);
    check_pool_back(ctx, pool0);
    /* the server dispatched both attempts (the first is still held) */
    struct tstats t = server_stats(ch);
    CHECK_EQ(t.st.requests - ts0.st.requests, 3); /* 2 attempts, this M_STATS */
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_rpc_free(dst);
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
}

/* Attempts that are never answered (M_NEVER): with the default budget,
 * max_attempts (3) of them, A apart, then -ETIMEDOUT at the deadline, not
 * before (the last attempt stays out); with a budget of one retry, two
 * attempts and a throttled retry. The server dispatched exactly those. */
static int limits_case(bex_ctx *ctx, struct srv_proc *sp, uint32_t burst, uint64_t want_attempts)
{
    bex_rpc_endpoint eps[1];
    bex_rpc_channel_config cc = chan_cfg(eps, sp, 1);
    const unsigned A = 200 * time_scale(), deadline = 1500 * time_scale();
    cc.attempt_timeout_ms = A;
    cc.retry_budget_burst = burst;
    cc.retry_budget_permille = 1;
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    struct tstats t0 = server_stats(ch); /* also the connection up */
    bex_rpc_channel_stats st0;
    bex_rpc_channel_stats_get(ch, &st0);
    enum { CAP = 4096 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    memset(dst, 0x2B, CAP);
    size_t pool0 = pool_in_use(ctx);
    struct dres d;
    dres_init(&d, ctx, dst);
    bex_rpc_call_opts o = {.timeout_ms = deadline};
    uint64_t start = pair_now_ms();
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_NEVER, pattern_body(ctx, 100, 3), 100, dst, CAP, &o,
                               d_done, &d, NULL));
    CHECK(wait_count(&d.w, &d.calls, 1, 30000) == 0);
    uint64_t took = pair_now_ms() - start;
    fprintf(stderr, "attempt_limits (burst %u): status %d after %llu ms\n", burst, d.status,
            (unsigned long long)took);
    CHECK_EQ(d.status, -ETIMEDOUT);
    CHECK(d.body == dst);
    CHECK_EQ(d.armed_at_done, 0);
    CHECK(all_bytes(dst, CAP, 0x2B));
    CHECK(took >= deadline);
    CHECK(took <= deadline + 300 * time_scale());
    check_once(&d);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.attempts - st0.attempts, want_attempts);
    CHECK_EQ(st.retries - st0.retries, want_attempts - 1);
    CHECK_EQ(st.retry_throttled - st0.retry_throttled, burst == 1 ? 1 : 0);
    CHECK_EQ(st.fail_timeout, 1);
    struct tstats t1 = server_stats(ch);
    CHECK_EQ(t1.st.requests - t0.st.requests, want_attempts + 1); /* + the M_STATS call */
    check_pool_back(ctx, pool0);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_rpc_free(dst);
    return 0;
}

static int t_attempt_limits(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    CHECK_OK(limits_case(ctx, &sp, 10, 3));
    CHECK_OK(limits_case(ctx, &sp, 1, 2));
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
}

/* One endpoint listed RDMA, on a context without a device (every RDMA
 * connection refused at once, -ENODEV), max_attempts 2 and a budget of
 * one retry, calls with destinations only: steps 1, 2 and 3 (TCP), the
 * call answered over TCP into its destination; the ladder's moves spend
 * neither attempts nor the budget. Later calls stay on TCP. */
static int t_ladder_steps(void)
{
    RPC_NEED_ADDRS();
    RPC_NEED_NO_DEVICE();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    CHECK(bex_ctx_pd(ctx) == NULL);
    bex_rpc_endpoint eps[1];
    bex_rpc_channel_config cc = ladder_cfg(eps, &sp);
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    enum { CAP = 4096 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    for (int i = 0; i < 5; i++) {
        struct dres d;
        dres_init(&d, ctx, dst);
        CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO, pattern_body(ctx, 64, (uint32_t)i), 64, dst,
                                   CAP, NULL, d_done, &d, NULL));
        CHECK(wait_count(&d.w, &d.calls, 1, 30000) == 0);
        if (d.status)
            fprintf(stderr, "ladder_steps: call %d: %s\n", i, bex_strerror(d.status));
        CHECK_OK(d.status);
        CHECK_EQ(d.len, 64);
        CHECK(check_pattern(dst, 64, (uint32_t)i) == 0);
        CHECK_EQ(d.armed_at_done, 0);
        check_once(&d);
    }
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    check_ladder_climbed(&st);
    CHECK_EQ(st.retries, 2);
    CHECK_EQ(st.retry_throttled, 0);
    CHECK_EQ(st.attempts, 5); /* the RDMA ones never left */
    CHECK_EQ(st.ok, 5);
    bex_rpc_endpoint_stats es[1];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 1), 1);
    CHECK_EQ(es[0].ladder, BEX_RPC_LADDER_TCP);
    CHECK_EQ(es[0].tcp_answers, 5);
    CHECK_EQ(es[0].answers, 5);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_rpc_free(dst);
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
}

/* ---- two replicas under load, one killed ---- */

static uint32_t k_delay_ms; /* M_LATE's hold of each call (the body's first word) */

static void k_done(int status, void *body, size_t len, void *user)
{
    struct tcall *o = user;
    bool ok = status == 0 && body == o->dst && len == 64 && memcmp(body, &k_delay_ms, 4) == 0 &&
              check_pattern((uint8_t *)body + 4, 60, o->seed) == 0;
    tcall_done(o, status, ok);
}

/* Two replicas, 32 calls with destinations outstanding (each held 20 ms,
 * scaled, by the server: about 16 out on each replica), the first replica
 * killed with -9 after 500 ms (scaled): every call succeeds, once, within
 * its deadline (+ slack), with the channel's default budget and attempts;
 * the killed endpoint left step OK, the other did not. Each destination is
 * reused only after its call completed. */
static int t_kill(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    const unsigned deadline = 2000 * time_scale();
    bex_rpc_channel *ch = chan_open(ctx, sp, 2, 2000);
    enum { OUT = 32, CAP = 256, MAXN = 100000 };
    static uint8_t *dsts[OUT];
    for (int i = 0; i < OUT; i++)
        CHECK(dsts[i] = bex_rpc_alloc_dest(ctx, CAP));
    bex_rpc_call_opts warm = {.timeout_ms = 20000 * time_scale()};
    for (int i = 0; i < 2; i++) { /* both connections up first (round robin) */
        struct dres d;
        dres_init(&d, ctx, dsts[0]);
        CHECK_OK(
            bex_rpc_call_into(ch, SVC, M_ECHO, NULL, 0, dsts[0], CAP, &warm, d_done, &d, NULL));
        CHECK(wait_count(&d.w, &d.calls, 1, 30000) == 0);
        CHECK_OK(d.status);
    }
    static struct tally r = {.w = WAITER_INIT};
    static struct tcall o[MAXN];
    k_delay_ms = 20 * time_scale();
    const unsigned slack = 200 * time_scale(); /* the retirement of an exposure */
    long n = 0, before_kill = 0;
    uint64_t start = pair_now_ms(), kill_at = start + 500 * time_scale(),
             end = kill_at + 1000 * time_scale(); /* the ladder moves at the failure: 1 s
                                                   * (scaled) of calls after the kill */
    bool killed = false;
    int hold = -1; /* the killed server's port, held (srv_kill_hold) */
    while (pair_now_ms() < end && n < MAXN) {
        /* call n reuses the destination of call n - OUT: wait for it */
        uint64_t until = pair_now_ms() + 30000ull * time_scale();
        while (n >= OUT && !atomic_load(&o[n - OUT].done)) {
            CHECK(pair_now_ms() < until);
            (void)wait_count(&r.w, &r.calls, atomic_load(&r.calls) + 1, 5);
        }
        if (!killed && pair_now_ms() >= kill_at) {
            CHECK((hold = srv_kill_hold(&sp[0])) >= 0);
            killed = true;
            before_kill = n;
        }
        uint8_t *dst = dsts[n % OUT];
        o[n] = (struct tcall){.r = &r,
                              .dst = dst,
                              .seed = (uint32_t)n,
                              .t0_ms = pair_now_ms(),
                              .limit_ms = deadline + slack};
        uint8_t *b = bex_rpc_alloc(ctx, 64);
        CHECK(b);
        memcpy(b, &k_delay_ms, 4);
        fill_pattern(b + 4, 60, (uint32_t)n);
        CHECK_OK(bex_rpc_call_into(ch, SVC, M_LATE, b, 64, dst, CAP, NULL, k_done, &o[n], NULL));
        n++;
    }
    CHECK(killed);
    CHECK(wait_count(&r.w, &r.calls, n, 30000) == 0);
    tcall_show_failed(o, n, "kill");
    bex_rpc_endpoint_stats es[2];
    kill_check(ch, &r, n, before_kill, OUT, es);
    CHECK_EQ(atomic_load(&r.twice), 0);
    CHECK(es[0].conn_failures >= 1);
    for (int i = 0; i < OUT; i++)
        CHECK_EQ(armed_of(ctx, dsts[i]), 0);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    for (int i = 0; i < OUT; i++)
        bex_rpc_free(dsts[i]);
    CHECK_OK(bex_ctx_destroy(ctx));
    close(hold);
    int rc = stop_server(&sp[0], true);
    rc |= stop_server(&sp[1], false);
    return rc ? 1 : 0;
}

/* ---- directory mode ---- */

static bex_dir_node_stats nstats(bex_dir *d, const struct srv_proc *sp)
{
    bex_dir_node_stats s;
    CHECK_OK(bex_dir_node_stats_get(d, &sp->addr, &s));
    return s;
}

static void into_echo(bex_rpc_channel *ch, bex_ctx *ctx, uint8_t *dst, size_t cap, uint32_t seed)
{
    struct dres d;
    dres_init(&d, ctx, dst);
    CHECK_OK(bex_rpc_call_into(ch, SVC, M_ECHO, pattern_body(ctx, 64, seed), 64, dst, cap, NULL,
                               d_done, &d, NULL));
    CHECK(wait_count(&d.w, &d.calls, 1, 30000) == 0);
    if (d.status)
        fprintf(stderr, "directory: call %u: %s\n", seed, bex_strerror(d.status));
    CHECK_OK(d.status);
    CHECK(check_pattern(dst, 64, seed) == 0);
    CHECK_EQ(d.armed_at_done, 0);
}

/* ps/0 on two replicas, sps[0] in the client's pod: calls with
 * destinations go to it and are reported ok (picks = ok, none
 * outstanding); once it is killed each call's connection to it fails and
 * is reported, the call succeeding via the other replica, until the
 * (M + 1)th failure quarantines it; then it is no longer picked. */
static int t_directory(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    const uint32_t M = 3;
    bex_dir_config dc = {
        .conn_fail_max = M, .req_fail_max = 1000, .fail_window_ms = 60000, .quarantine_ms = 60000};
    bex_dir *d;
    CHECK_OK(bex_dir_create(&dc, &d));
    dir_load_ps(d, sp, 2, 1, NULL);
    bex_rpc_channel_config cc = {.dir = d,
                                 .service = "ps",
                                 .locality = "dc1/pod1",
                                 .name = "dir",
                                 .request_timeout_ms = LONG_MS * time_scale(),
                                 .connect_timeout_ms = 15000 * time_scale(),
                                 .holddown_ms = 1,
                                 .retry_budget_burst = 100};
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    enum { CAP = 4096 };
    uint8_t *dst = bex_rpc_alloc_dest(ctx, CAP);
    CHECK(dst);
    for (uint32_t i = 0; i < 10; i++)
        into_echo(ch, ctx, dst, CAP, i);
    bex_dir_node_stats s0 = nstats(d, &sp[0]);
    CHECK_EQ(s0.picks, 10);
    CHECK_EQ(s0.ok, 10);
    CHECK_EQ(s0.outstanding, 0);
    CHECK_EQ(s0.conn_failures, 0);
    CHECK(kill(sp[0].pid, SIGKILL) == 0);
    /* bounded by time, not calls: within its 1 ms hold-down after each
     * failure the dead replica is not picked, and calls take microseconds */
    uint32_t calls = 0;
    uint64_t until = pair_now_ms() + 10000ull * time_scale();
    while (nstats(d, &sp[0]).state != BEX_DIR_QUARANTINED) {
        CHECK(pair_now_ms() < until);
        into_echo(ch, ctx, dst, CAP, 100 + calls++);
    }
    s0 = nstats(d, &sp[0]);
    bex_dir_node_stats s1 = nstats(d, &sp[1]);
    fprintf(stderr,
            "directory: quarantined after %u calls; node0 picks %llu ok %llu conn_fail %llu "
            "req_fail %llu; node1 picks %llu ok %llu\n",
            calls, (unsigned long long)s0.picks, (unsigned long long)s0.ok,
            (unsigned long long)s0.conn_failures, (unsigned long long)s0.req_failures,
            (unsigned long long)s1.picks, (unsigned long long)s1.ok);
    CHECK_EQ(s0.conn_failures, M + 1);
    CHECK_EQ(s0.quarantines, 1);
    CHECK_EQ(s0.ok, 10);
    CHECK_EQ(s0.outstanding, 0);
    CHECK_EQ(s1.ok, calls);
    CHECK_EQ(s1.outstanding, 0);
    /* quarantined: no longer picked */
    uint64_t picks = s0.picks;
    for (uint32_t i = 0; i < 5; i++)
        into_echo(ch, ctx, dst, CAP, 200 + i);
    CHECK_EQ(nstats(d, &sp[0]).picks, picks);
    CHECK_EQ(nstats(d, &sp[1]).ok, calls + 5);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_dir_destroy(d);
    bex_rpc_free(dst);
    CHECK_OK(bex_ctx_destroy(ctx));
    int rc = stop_server(&sp[0], true);
    rc |= stop_server(&sp[1], false);
    return rc ? 1 : 0;
}

BEX_TEST_MAIN({"attempt_timeout", t_attempt_timeout}, {"attempt_limits", t_attempt_limits},
              {"ladder_steps", t_ladder_steps}, {"kill", t_kill}, {"directory", t_directory})
