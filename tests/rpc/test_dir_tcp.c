/* SPDX-License-Identifier: Apache-2.0 */
/* Channels over a directory, end to end over TCP natively (tcp): calls go
 * to the nearest replica; when it is killed with -9 every call still
 * completes in time through the other replica, the dead one is
 * quarantined past its threshold and no longer tried, and after the
 * period a probe finds it still dead and quarantines it again. A shard
 * without replicas fails calls with -EHOSTUNREACH. */
#include <dirent.h>

#include "bex/dir.h"
#include "rpc/rpc_test.h"

static _Atomic int n_quarantined, n_probe_failed;

static void dir_log(int level, const char *msg, void *arg)
{
    (void)arg;
    if (strstr(msg, "quarantined for"))
        atomic_fetch_add(&n_quarantined, 1);
    if (strstr(msg, "failed its probe"))
        atomic_fetch_add(&n_probe_failed, 1);
    fprintf(stderr, "dir log (level %d): %s\n", level, msg);
}

/* ps/0 on sps[first..1]: sps[0] in the client's pod, sps[1] in another. */
static void load2(bex_dir *d, struct srv_proc *sps, int n)
{
    if (n == 2)
        dir_load_ps(d, sps, 2, 1, NULL);
    else
        dir_load_ps(d, &sps[1], 1, 2, NULL);
}

/* ps/0 on two servers: sps[0] in the client's pod, sps[1] in another. */
static bex_dir *dir_of(struct srv_proc *sps, uint32_t quarantine_ms)
{
    bex_dir_config c = {.conn_fail_max = 3,
                        .req_fail_max = 50,
                        .fail_window_ms = 60000,
                        .quarantine_ms = quarantine_ms,
                        .log_fn = dir_log,
                        .log_level = BEX_LOG_INFO};
    bex_dir *d;
    CHECK_OK(bex_dir_create(&c, &d));
    load2(d, sps, 2);
    return d;
}

static bex_rpc_channel_config dir_chan(bex_dir *d, unsigned deadline)
{
    return (bex_rpc_channel_config){
        .dir = d,
        .service = "ps",
        .shard = 0,
        .locality = "dc1/pod1",
        .name = "dir",
        .request_timeout_ms = deadline,
        .attempt_timeout_ms = deadline / 4,
        .connect_timeout_ms = 1000 * time_scale(),
        .retry_budget_burst = 100,
    };
}

static void one_done(int status, void *body, size_t len, void *user)
{
    struct tcall *o = user;
    bool ok = status == 0 && len == 64 && check_pattern(body, len, o->seed) == 0;
    bex_rpc_free(body);
    tcall_done(o, status, ok);
}

static bex_dir_node_stats nstats(bex_dir *d, const struct srv_proc *sp)
{
    bex_dir_node_stats s;
    CHECK_OK(bex_dir_node_stats_get(d, &sp->addr, &s));
    return s;
}

/* The nearest replica takes the calls; killed with -9, every call still
 * succeeds within its deadline via the other; the dead one is quarantined
 * (once, logged once), then no longer connected to; after the period its
 * probe fails and it is quarantined again. */
static int t_kill(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    const uint32_t quarantine_ms = 1500 * time_scale();
    bex_dir *d = dir_of(sp, quarantine_ms);
    const unsigned deadline = 400 * time_scale();
    bex_rpc_channel_config cc = dir_chan(d, deadline);
    /* With the attempt timeout (deadline / 4): a loaded host may time out
     * an attempt on the live replica and retry it on the dead one, whose
     * refusals must not fail the call while that attempt is out (as they
     * did once in 7193 calls with -ECONNREFUSED: slow_live) */
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    /* the far replica's connection up first (the directory listing it
     * alone for one call), so that the deadlines measure failover, not a
     * first setup on a loaded host */
    load2(d, sp, 1);
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    load2(d, sp, 2);
    /* nearest first: all of these go to sp[0] */
    for (int i = 0; i < 20; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    CHECK_EQ(nstats(d, &sp[0]).picks, 20);
    CHECK_EQ(nstats(d, &sp[0]).ok, 20);
    CHECK_EQ(nstats(d, &sp[0]).outstanding, 0);
    CHECK_EQ(nstats(d, &sp[1]).picks, 1);
    enum { OUT = 8, MAX = 200000 };
    static struct tally r = {.w = WAITER_INIT};
    static struct tcall o[MAX];
    const unsigned slack = 20 * time_scale();
    long n = 0;
    uint64_t start = pair_now_ms(), kill_at = start + 200 * time_scale();
    bool killed = false;
    int hold = -1; /* the killed server's port, held (srv_kill_hold) */
    long before_kill = 0;
    uint64_t quarantined_at = 0, probe_failed_at = 0;
    bex_dir_node_stats at_q = {0};
    /* until the dead replica failed a probe (after its period), with a cap */
    uint64_t cap = start + (4000ull + 2 * quarantine_ms) * time_scale();
    while (pair_now_ms() < cap && n < MAX && !probe_failed_at) {
        CHECK(wait_count(&r.w, &r.calls, n - OUT + 1, 20000) == 0);
        if (!killed && pair_now_ms() >= kill_at) {
            CHECK((hold = srv_kill_hold(&sp[0])) >= 0);
            killed = true;
            before_kill = n;
        }
        if (killed && !quarantined_at && nstats(d, &sp[0]).state == BEX_DIR_QUARANTINED) {
            quarantined_at = pair_now_ms();
            at_q = nstats(d, &sp[0]);
        }
        if (quarantined_at && !probe_failed_at && nstats(d, &sp[0]).probe_failures >= 1)
            probe_failed_at = pair_now_ms();
        o[n] = (struct tcall){
            .r = &r, .seed = (uint32_t)n, .t0_ms = pair_now_ms(), .limit_ms = deadline + slack};
        void *b = bex_rpc_alloc(ctx, 64);
        CHECK(b);
        fill_pattern(b, 64, (uint32_t)n);
        CHECK_OK(bex_rpc_call(ch, SVC, M_ECHO, b, 64, NULL, one_done, &o[n], NULL));
        n++;
        /* at most about 8 calls a millisecond: MAX calls outlast the
         * cap, so the loop ends by the probe (on an idle host the calls
         * ran out before the quarantine period did) */
        if (n % 8 == 0)
            pair_sleep_ms(1);
    }
    CHECK(wait_count(&r.w, &r.calls, n, 20000) == 0);
    bex_dir_node_stats s0 = nstats(d, &sp[0]), s1 = nstats(d, &sp[1]);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    fprintf(stderr,
            "kill: %ld calls (%ld before the kill), ok %ld, bad %ld, late %ld; retries %llu "
            "(%llu to another replica), endpoints down %llu; "
            "node0 picks %llu conn_fail %llu req_fail %llu quarantines %llu probes %llu "
            "probe_fail %llu; node1 picks %llu; quarantined after %lld ms, probe failed "
            "%lld ms later\n",
            n, before_kill, atomic_load(&r.ok), atomic_load(&r.bad), atomic_load(&r.late),
            (unsigned long long)st.retries, (unsigned long long)st.failovers,
            (unsigned long long)st.endpoints_down, (unsigned long long)s0.picks,
            (unsigned long long)s0.conn_failures, (unsigned long long)s0.req_failures,
            (unsigned long long)s0.quarantines, (unsigned long long)s0.probes,
            (unsigned long long)s0.probe_failures, (unsigned long long)s1.picks,
            quarantined_at ? (long long)(quarantined_at - kill_at) : -1LL,
            probe_failed_at ? (long long)(probe_failed_at - quarantined_at) : -1LL);
    tcall_show_failed(o, n, "kill");
    CHECK(killed && before_kill > OUT);
    /* every call completed once, in time, with its own body */
    CHECK_EQ(atomic_load(&r.twice), 0);
    CHECK_EQ(atomic_load(&r.late), 0);
    CHECK_EQ(atomic_load(&r.ok), n);
    /* before the kill, the near replica took the calls */
    CHECK(s0.picks >= (uint64_t)before_kill);
    /* quarantined past M = 3 connection failures, logged once for it */
    CHECK(quarantined_at);
    CHECK(at_q.conn_failures > 3 && at_q.quarantines == 1);
    CHECK_EQ(atomic_load(&n_quarantined), 1);
    /* while quarantined, no call and no connection went there: between
     * the quarantine and the probe, its picks grew by the probe alone */
    CHECK(probe_failed_at);
    CHECK(probe_failed_at - quarantined_at + 200 * time_scale() >= quarantine_ms);
    CHECK(s0.probes >= 1 && s0.probe_failures >= 1 && s0.quarantines >= 2);
    CHECK_EQ(s0.picks - at_q.picks, s0.probes);
    CHECK(atomic_load(&n_probe_failed) >= 1);
    CHECK(s1.picks >= (uint64_t)(n - before_kill) / 2);
    /* the channel counted the move to the other replica, and the dead
     * endpoint's fall once (it never came back) */
    CHECK(st.failovers >= 1);
    CHECK_EQ(st.endpoints_down, 1);
    /* per-endpoint counters cover the replicas the directory gave */
    bex_rpc_endpoint_stats es[4];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 4), 2);
    for (int i = 0; i < 2; i++) {
        int k = es[i].addr.in4.sin_port == sp[0].addr.in4.sin_port ? 0 : 1;
        CHECK(es[i].addr.in4.sin_port == sp[k].addr.in4.sin_port);
        CHECK(!strcmp(es[i].locality, k ? "dc1/pod2" : "dc1/pod1"));
        CHECK(es[i].attempts >= 1);
        if (k == 0)
            CHECK(es[i].conn_failures >= 4);
    }
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_EQ(nstats(d, &sp[1]).outstanding, 0);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    close(hold);
    CHECK(stop_server(&sp[0], true) == 0);
    return stop_server(&sp[1], false) ? 1 : 0;
}

/* A shard with no replica: calls fail at once with -EHOSTUNREACH; a
 * directory reloaded with one makes them succeed; a bad directory config
 * of the channel is -EINVAL; a fixed-list channel still works. */
static int t_empty(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of(sp, 1000);
    bex_rpc_channel_config cc = dir_chan(d, 1000 * time_scale());
    bex_rpc_channel *ch;
    cc.shard = 1;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    CHECK_EQ(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL), -EHOSTUNREACH);
    char j[512], ip[INET_ADDRSTRLEN], err[256];
    inet_ntop(AF_INET, &sp[1].addr.in4.sin_addr, ip, sizeof ip);
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":[{\"addr\":\"%s:%u\"}]},"
             "{\"replicas\":[{\"addr\":\"%s:%u\"}]}]}}}",
             ip, ntohs(sp[1].addr.in4.sin_port), ip, ntohs(sp[1].addr.in4.sin_port));
    CHECK_OK(bex_dir_load_json(d, j, err, sizeof err));
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    CHECK_EQ(nstats(d, &sp[1]).ok, 1);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    /* directory mode takes no endpoint list, and needs a service */
    bex_rpc_endpoint ep = {.addr = sp[0].addr};
    cc.endpoints = &ep;
    cc.n_endpoints = 1;
    CHECK_EQ(bex_rpc_channel_create(ctx, &cc, &ch), -EINVAL);
    cc.endpoints = NULL;
    cc.n_endpoints = 0;
    cc.service = NULL;
    CHECK_EQ(bex_rpc_channel_create(ctx, &cc, &ch), -EINVAL);
    /* the fixed-list mode beside it */
    bex_rpc_endpoint eps[2];
    bex_rpc_channel_config fc = chan_cfg(eps, sp, 2);
    CHECK_OK(bex_rpc_channel_create(ctx, &fc, &ch));
    struct tstats t0 = server_stats(ch), t1 = server_stats(ch); /* round robin: one each */
    CHECK(t0.st.requests >= 1 && t1.st.requests >= 1);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    CHECK(stop_server(&sp[0], false) == 0);
    return stop_server(&sp[1], false) ? 1 : 0;
}

/* ps/0 listing sp alone */
static void load_one(bex_dir *d, const struct srv_proc *sp)
{
    char j[256], ip[INET_ADDRSTRLEN], err[256];
    inet_ntop(AF_INET, &sp->addr.in4.sin_addr, ip, sizeof ip);
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":[{\"addr\":\"%s:%u\"}]}]}}}", ip,
             ntohs(sp->addr.in4.sin_port));
    CHECK_OK(bex_dir_load_json(d, j, err, sizeof err));
}

static void late_done(int status, void *body, size_t len, void *user)
{
    (void)len;
    bex_rpc_free(body);
    struct tally *r = user;
    if (status == 0)
        atomic_fetch_add(&r->ok, 1);
    else
        atomic_fetch_add(&r->bad, 1);
    waiter_add(&r->w, &r->calls, 1);
}

/* A replica the directory stops listing loses the channel's connection
 * (within about a second: the timer thread looks), and a call out on it
 * is retried on the replica listed now, which answers it. */
static int t_prune(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of(sp, 1000);
    load_one(d, &sp[0]);
    bex_rpc_channel_config cc = dir_chan(d, 20000 * time_scale());
    cc.attempt_timeout_ms = 0; /* only the prune may move the call */
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL)); /* to sp[0] */
    /* a call sp[0] answers only after 5 s */
    static struct tally r = {.w = WAITER_INIT};
    uint32_t *b = bex_rpc_alloc(ctx, sizeof *b);
    CHECK(b);
    *b = 5000;
    CHECK_OK(bex_rpc_call(ch, SVC, M_LATE, b, sizeof *b, NULL, late_done, &r, NULL));
    pair_sleep_ms(100);
    load_one(d, &sp[1]); /* sp[0] leaves the shard */
    uint64_t t0 = pair_now_ms();
    CHECK(wait_count(&r.w, &r.calls, 1, 20000) == 0);
    uint64_t took = pair_now_ms() - t0;
    fprintf(stderr, "prune: the call completed %llu ms after sp[0] left\n",
            (unsigned long long)took);
    CHECK_EQ(atomic_load(&r.ok), 1);
    /* sp[1] got the call (its M_LATE and this M_STATS): the retry */
    struct tstats t = server_stats(ch);
    CHECK(t.st.requests >= 2);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK(st.retries >= 1 && st.failovers >= 1);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    CHECK(stop_server(&sp[0], false) == 0);
    return stop_server(&sp[1], false) ? 1 : 0;
}

/* The rig of slow_live and held_many: two servers (sp), the client's
 * context, a directory whose health rule does not act here (fail_max
 * failures of either kind a minute), a channel over it (deadline, attempt
 * timeout attempt or 0: dir_chan's, hold-down 1 ms) whose connection to
 * sp[warm] is up (the directory listing it alone for one call), then both
 * listed and the other killed -9, its port held. */
struct rig {
    bex_ctx *ctx;
    bex_dir *d;
    bex_rpc_channel *ch;
    int hold;
};

static void rig_up(struct rig *r, struct srv_proc *sp, uint32_t fail_max, unsigned deadline,
                   unsigned attempt, int warm)
{
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    r->ctx = client_ctx();
    bex_dir_config dc = {.conn_fail_max = fail_max,
                         .req_fail_max = fail_max,
                         .fail_window_ms = 60000,
                         .quarantine_ms = 60000,
                         .log_fn = dir_log,
                         .log_level = BEX_LOG_INFO};
    CHECK_OK(bex_dir_create(&dc, &r->d));
    bex_rpc_channel_config cc = dir_chan(r->d, deadline);
    if (attempt)
        cc.attempt_timeout_ms = attempt;
    cc.holddown_ms = 1;
    CHECK_OK(bex_rpc_channel_create(r->ctx, &cc, &r->ch));
    if (warm)
        load2(r->d, sp, 1);
    else
        dir_load_ps(r->d, &sp[0], 1, 1, NULL);
    CHECK_OK(bex_rpc_call_sync(r->ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    load2(r->d, sp, 2);
    r->hold = srv_kill_hold(&sp[!warm]);
    CHECK(r->hold >= 0);
}

/* r torn down: 0, or 1 when a server failed. */
static int rig_down(struct rig *r, struct srv_proc *sp, int warm)
{
    CHECK_OK(bex_rpc_channel_destroy(r->ch));
    bex_dir_destroy(r->d);
    CHECK_OK(bex_ctx_destroy(r->ctx));
    close(r->hold);
    CHECK(stop_server(&sp[!warm], true) == 0);
    return stop_server(&sp[warm], false) ? 1 : 0;
}

/* The live replica slow, the other dead: B (sp[0], in the client's pod,
 * so picked first) killed with -9, its port held (every connection to it
 * refused, nothing sent), A (sp[1]) answering the call 10 attempt
 * timeouts late, well within the deadline. The call must end with A's
 * answer: B's refusals may not spend its attempts while A's attempt is
 * out (before the fix: -ECONNREFUSED after about two attempt timeouts,
 * B's hold-down of 1 ms over at each retry), and A gets it once. */
static int t_slow_live(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    const unsigned attempt = 100 * time_scale(), late = 10 * attempt, deadline = 3 * late;
    /* B's refusals never quarantine it here: the channel's rule alone; A
     * alone first: its connection up */
    struct rig r;
    rig_up(&r, sp, 50, deadline, attempt, 1);
    bex_ctx *ctx = r.ctx;
    bex_dir *d = r.d;
    bex_rpc_channel *ch = r.ch;
    uint32_t *b = bex_rpc_alloc(ctx, sizeof *b);
    CHECK(b);
    *b = late;
    void *resp = NULL;
    size_t rlen = 0;
    uint64_t t0 = pair_now_ms();
    int rc = bex_rpc_call_sync(ch, SVC, M_LATE, b, sizeof *b, NULL, &resp, &rlen);
    uint64_t took = pair_now_ms() - t0;
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    bex_dir_node_stats s0 = nstats(d, &sp[0]);
    bex_rpc_endpoint_stats es[4];
    size_t nes = bex_rpc_channel_endpoint_stats(ch, es, 4);
    uint64_t a_attempts = 0;
    for (size_t i = 0; i < nes; i++)
        if (es[i].addr.in4.sin_port == sp[1].addr.in4.sin_port)
            a_attempts = es[i].attempts;
    fprintf(stderr,
            "slow_live: %s after %llu ms (answer due after %u, deadline %u); attempts %llu, "
            "retries %llu, ladder moves %llu; B's connection failures %llu; A's attempts %llu\n",
            bex_strerror(rc), (unsigned long long)took, late, deadline,
            (unsigned long long)st.attempts, (unsigned long long)st.retries,
            (unsigned long long)st.ladder_moves, (unsigned long long)s0.conn_failures,
            (unsigned long long)a_attempts);
    CHECK_OK(rc);
    CHECK(rlen == sizeof *b && *(uint32_t *)resp == late);
    bex_rpc_free(resp);
    CHECK(took >= late && took < deadline);
    /* B was tried (nearest) and refused; A had the warm-up and the call
     * once: a retry found nothing new to try and left A's attempt out */
    CHECK(s0.conn_failures >= 1);
    CHECK_EQ(s0.state, BEX_DIR_HEALTHY);
    CHECK_EQ(a_attempts, 2);
    return rig_down(&r, sp, 1);
}

static void status_done(int status, void *body, size_t len, void *user)
{
    (void)len;
    bex_rpc_free(body);
    tcall_done(user, status, status == 0);
}

/* N calls at once of method m on ch, each with its deadline (deadline ms,
 * completions judged late past deadline + slack); waits for all. */
static void calls_at_once(bex_ctx *ctx, bex_rpc_channel *ch, uint32_t m, struct tcall *o, int n,
                          struct tally *t, unsigned deadline, unsigned slack)
{
    for (int i = 0; i < n; i++) {
        o[i] = (struct tcall){.r = t, .t0_ms = pair_now_ms(), .limit_ms = deadline + slack};
        CHECK_OK(bex_rpc_call(ch, SVC, m, pattern_body(ctx, 64, (uint32_t)i), 64, NULL, status_done,
                              &o[i], NULL));
    }
    CHECK(wait_count(&t->w, &t->calls, n, 20000) == 0);
    CHECK_EQ(atomic_load(&t->twice), 0);
}

/* The threads of this process. */
static int threads_now(void)
{
    DIR *dp = opendir("/proc/self/task");
    CHECK(dp);
    int n = 0;
    for (struct dirent *e; (e = readdir(dp));)
        n += e->d_name[0] != '.';
    closedir(dp);
    return n;
}

/* Hostile endpoints against the held attempt, 64 calls at once: A
 * (sp[0]) accepts every call and never answers (M_NEVER), B (sp[1]) refuses
 * every connection at once (killed, its port held). With both listed,
 * every call's attempt at A times out, its retry is refused by B, and it
 * waits for A's attempt to its deadline: -ETIMEDOUT, in time, nothing
 * applied twice, no thread more, its attempts bounded (max_attempts,
 * 3, plus one refusal by B that costs none). With B alone, every call
 * fails -ECONNREFUSED before its deadline: B's refusals cost the calls
 * their attempts (no free retry loop): at most max_attempts + 1 tries
 * each. */
static int t_held_many(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    const unsigned deadline = 1000 * time_scale(), slack = 500 * time_scale();
    struct rig r;
    rig_up(&r, sp, 1000, deadline, 0, 0); /* A alone first: its connection up */
    bex_ctx *ctx = r.ctx;
    bex_dir *d = r.d;
    bex_rpc_channel *ch = r.ch;
    int threads = threads_now();
    enum { N = 64 };
    static struct tcall o[N];
    static struct tally t = {.w = WAITER_INIT}, t2 = {.w = WAITER_INIT};
    bex_rpc_channel_stats s0, s1, s2;
    bex_rpc_channel_stats_get(ch, &s0);
    calls_at_once(ctx, ch, M_NEVER, o, N, &t, deadline, slack);
    bex_rpc_channel_stats_get(ch, &s1);
    fprintf(stderr,
            "silent A, refusing B: %ld ok, %ld late; attempts %llu, retries %llu, throttled "
            "%llu, connection failures %llu\n",
            atomic_load(&t.ok), atomic_load(&t.late),
            (unsigned long long)(s1.attempts - s0.attempts),
            (unsigned long long)(s1.retries - s0.retries),
            (unsigned long long)(s1.retry_throttled - s0.retry_throttled),
            (unsigned long long)(s1.conn_failures - s0.conn_failures));
    tcall_show_failed(o, N, "silent A, refusing B");
    CHECK_EQ(atomic_load(&t.ok), 0);
    CHECK_EQ(atomic_load(&t.late), 0);
    for (int i = 0; i < N; i++)
        CHECK_EQ(o[i].status, -ETIMEDOUT);
    CHECK(s1.attempts - s0.attempts <= 3 * N);
    CHECK(s1.retries - s0.retries <= 4 * N);
    CHECK_EQ(threads_now(), threads);

    load2(d, sp, 1); /* B alone */
    calls_at_once(ctx, ch, M_ECHO, o, N, &t2, deadline, slack);
    bex_rpc_channel_stats_get(ch, &s2);
    fprintf(stderr,
            "refusing B alone: %ld ok, %ld late; attempts %llu, retries %llu, throttled %llu, "
            "connection failures %llu\n",
            atomic_load(&t2.ok), atomic_load(&t2.late),
            (unsigned long long)(s2.attempts - s1.attempts),
            (unsigned long long)(s2.retries - s1.retries),
            (unsigned long long)(s2.retry_throttled - s1.retry_throttled),
            (unsigned long long)(s2.conn_failures - s1.conn_failures));
    tcall_show_failed(o, N, "refusing B alone");
    CHECK_EQ(atomic_load(&t2.ok), 0);
    CHECK_EQ(atomic_load(&t2.late), 0);
    for (int i = 0; i < N; i++)
        CHECK(o[i].status == -ECONNREFUSED || o[i].status == -EHOSTUNREACH);
    CHECK(s2.retries - s1.retries <= 4 * N);
    CHECK_EQ(threads_now(), threads);
    return rig_down(&r, sp, 0);
}

/* The RPC layer's send hook (bex__rpc_send_hook), under the channel's
 * lock: armed, it waits until the socket layer has failed s (the refused
 * connection's failure callback then waits for the lock this thread
 * holds), so that the call's request is sent on a socket that failed
 * before the channel heard of it. */
static _Atomic bool refuse_armed, refused_under;

static void wait_refused(bex_sock *s)
{
    if (!atomic_exchange(&refuse_armed, false))
        return;
    uint64_t end = pair_now_ms() + 5000 * time_scale();
    while (atomic_load(&s->state) != S_FAILED && pair_now_ms() < end)
        pair_sleep_ms(1);
    CHECK_EQ(atomic_load(&s->state), S_FAILED);
    atomic_store(&refused_under, true);
}

/* A call (no retry) to the refusing replica alone whose request is sent
 * after its connection was refused but before the channel's callback
 * heard of it: the call fails with the socket's reason, -ECONNREFUSED
 * (before the fix: -EPIPE, "the socket is closed", which held_many saw
 * when its calls raced the refusals under TSan). */
static int t_refused_under_send(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    const unsigned deadline = 2000 * time_scale();
    struct rig r;
    rig_up(&r, sp, 1000, deadline, 0, 0); /* B (sp[1]) killed, its port held */
    load2(r.d, sp, 1);                    /* B alone */
    bex__rpc_send_hook(wait_refused);
    atomic_store(&refuse_armed, true);
    bex_rpc_call_opts o = {.flags = BEX_RPC_CALL_NO_RETRY};
    int rc = bex_rpc_call_sync(r.ch, SVC, M_ECHO, NULL, 0, &o, NULL, NULL);
    bex__rpc_send_hook(NULL);
    fprintf(stderr, "refused_under_send: %s\n", bex_strerror(rc));
    CHECK(atomic_load(&refused_under));
    CHECK_EQ(rc, -ECONNREFUSED);
    return rig_down(&r, sp, 0);
}

BEX_TEST_MAIN({"kill", t_kill}, {"empty", t_empty}, {"prune", t_prune}, {"slow_live", t_slow_live},
              {"held_many", t_held_many}, {"refused_under_send", t_refused_under_send})
