/* SPDX-License-Identifier: Apache-2.0 */
/* RPC over bex sockets, two or three processes: echo at several sizes,
 * many calls outstanding, deadlines and cancellation (exactly once, late
 * answers dropped), failover to a second server when the first is killed
 * with -9, the retry budget under a failing service, a retried write
 * applied once, a peer sending garbage, answers from another thread, the
 * counters and their Prometheus dump. Over RDMA (rxe) and TCP (tcp). */
#include "rpc/rpc_test.h"
#include "rpc/still_clock.h"

#include <dirent.h>

/* ---- completion bookkeeping shared by the cases ---- */

static void one_done(int status, void *body, size_t len, void *user)
{
    struct tcall *o = user;
    bool ok = status == 0 && len == o->len && (len == 0 || check_pattern(body, len, o->seed) == 0);
    bex_rpc_free(body);
    tcall_done(o, status, ok);
}

/* The time (ns) thread tid of this process has spent runnable but waiting
 * for a CPU (the kernel's schedstat run_delay), UINT64_MAX if the kernel
 * does not say. */
static uint64_t run_delay_ns(pid_t tid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%d/schedstat", (int)tid);
    FILE *f = fopen(path, "r");
    if (!f)
        return UINT64_MAX;
    unsigned long long run, wait;
    int n = fscanf(f, "%llu %llu", &run, &wait);
    fclose(f);
    return n == 2 ? (uint64_t)wait : UINT64_MAX;
}

/* run_delay_ns of every thread of this process now, for t_deadline to
 * tell how long the thread that completes a call waited since */
struct waits {
    size_t n;
    pid_t tid[64];
    uint64_t ns[64];
};

static void waits_snap(struct waits *w)
{
    w->n = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return;
    for (struct dirent *e; (e = readdir(d)) && w->n < 64;) {
        if (e->d_name[0] == '.')
            continue;
        pid_t tid = (pid_t)atoi(e->d_name);
        uint64_t ns = run_delay_ns(tid);
        if (ns != UINT64_MAX) {
            w->tid[w->n] = tid;
            w->ns[w->n++] = ns;
        }
    }
    closedir(d);
}

/* How long (ms, rounded up) thread tid waited for a CPU between the
 * snapshot w and the moment it recorded now_ns; 0 if either is unknown
 * (then the bound is the plain one). */
static uint64_t waited_ms(const struct waits *w, pid_t tid, uint64_t now_ns)
{
    for (size_t i = 0; i < w->n; i++)
        if (w->tid[i] == tid && now_ns != UINT64_MAX && now_ns >= w->ns[i])
            return (now_ns - w->ns[i] + 999999) / 1000000;
    return 0;
}

/* A call whose completion records when, on which thread, and that
 * thread's run-queue wait so far (t_deadline's bound). */
struct timed_call {
    struct tcall c; /* limit_ms 0: the case judges the time itself */
    uint64_t at_ms;
    pid_t tid;
    uint64_t wait_ns;
};

static void timed_done(int status, void *body, size_t len, void *user)
{
    struct timed_call *o = user;
    o->at_ms = pair_now_ms();
    o->tid = gettid();
    o->wait_ns = run_delay_ns(o->tid);
    one_done(status, body, len, &o->c);
}

/* ---- cases ---- */

/* Echo at 64 B, 4 KiB and 1 MiB (rendezvous), synchronously and with 64
 * calls outstanding; the bodies come back intact and zero-copy. */
static int t_echo(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    /* about bodies, not deadlines: 64 calls of up to 64 KiB out at once took
     * over a second each in a loaded VM (docs/benchmarks.md) */
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, 20000);
    static const size_t sizes[] = {64, 4096, 1u << 20, 0};
    for (size_t i = 0; i < 4; i++) {
        void *resp = NULL;
        size_t rlen = 1;
        void *b = sizes[i] ? pattern_body(ctx, sizes[i], (uint32_t)i) : NULL;
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, b, sizes[i], NULL, &resp, &rlen));
        CHECK_EQ(rlen, sizes[i]);
        if (sizes[i])
            CHECK(check_pattern(resp, rlen, (uint32_t)i) == 0);
        else
            CHECK(resp == NULL);
        bex_rpc_free(resp);
    }
    /* many outstanding, mixed sizes */
    enum { N = 512, OUT = 64 };
    static struct tally r = {.w = WAITER_INIT};
    static struct tcall o[N];
    for (int i = 0; i < N; i++) {
        CHECK(wait_count(&r.w, &r.calls, i - OUT + 1, 20000) == 0);
        size_t len = sizes[i % 3] == (1u << 20) ? 65536 : sizes[i % 3];
        o[i] = (struct tcall){.r = &r, .seed = 100 + (uint32_t)i, .len = len};
        CHECK_OK(bex_rpc_call(ch, SVC, M_ECHO, pattern_body(ctx, len, o[i].seed), len, NULL,
                              one_done, &o[i], NULL));
    }
    CHECK(wait_count(&r.w, &r.calls, N, 20000) == 0);
    tcall_show_failed(o, N, "echo");
    CHECK_EQ(atomic_load(&r.ok), N);
    CHECK_EQ(atomic_load(&r.twice), 0);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.calls, N + 4);
    CHECK_EQ(st.ok, N + 4);
    CHECK_EQ(st.failed, 0);
    CHECK_EQ(st.attempts, N + 4);
    CHECK(st.lat_p50_us > 0 && st.lat_p50_us <= st.lat_p99_us && st.lat_p99_us <= st.lat_p999_us);
    /* an unregistered method: -ENOSYS from the server, not retried */
    CHECK_EQ(bex_rpc_call_sync(ch, SVC, 99, NULL, 0, NULL, NULL, NULL), -ENOSYS);
    return rpc_finish(ch, ctx, &sp, 1);
}

/* A handler that never answers: the call completes with -ETIMEDOUT at its
 * deadline (within a small slack), exactly once. bex_rpc_cancel completes
 * a call once with -ECANCELED; an answer arriving after a call's deadline
 * is dropped and counted.
 *
 * The slack bounds the library's own delay, not the host's: the channel's
 * timer thread sleeps until the deadline and completes the call as soon as
 * it runs, but on a loaded host the kernel may leave it runnable without a
 * CPU for longer than the slack (seen: 28 ms on a 2-core host with the CPUs
 * busy, the wake-up itself late by all of it). So the bound adds the time
 * the completing thread spent waiting for a CPU since the call started (the
 * kernel's schedstat run_delay); a timer armed wrong, sleeping past the
 * deadline or a completion queued behind other work still shows as late,
 * as none of that is run-queue wait (docs/testing.md). */
static int t_deadline(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, 0);
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL)); /* connected */
    static struct tally r = {.w = WAITER_INIT};
    const unsigned tmo = 100 * time_scale(), slack = 30 * time_scale();
    static struct tcall o[3];
    static struct timed_call o0;
    static struct waits ws;
    waits_snap(&ws);
    uint64_t t0 = pair_now_ms();
    o0 = (struct timed_call){.c = {.r = &r, .t0_ms = t0}};
    bex_rpc_call_opts opts = {.timeout_ms = tmo};
    CHECK_OK(bex_rpc_call(ch, SVC, M_NEVER, NULL, 0, &opts, timed_done, &o0, NULL));
    CHECK(wait_count(&r.w, &r.calls, 1, 5000) == 0);
    uint64_t took = pair_now_ms() - t0;
    CHECK_EQ(o0.c.status, -ETIMEDOUT);
    CHECK(took >= tmo);
    uint64_t waited = waited_ms(&ws, o0.tid, o0.wait_ns);
    if (o0.at_ms > t0 + tmo + slack)
        fprintf(stderr,
                "deadline: completed %llu ms after the call (deadline %u, slack %u), "
                "its thread waited %llu ms for a CPU\n",
                (unsigned long long)(o0.at_ms - t0), tmo, slack, (unsigned long long)waited);
    CHECK(o0.at_ms <= t0 + tmo + slack + waited);
    /* explicit cancel */
    uint64_t id;
    o[1] = (struct tcall){.r = &r};
    CHECK_OK(bex_rpc_call(ch, SVC, M_NEVER, NULL, 0, NULL, one_done, &o[1], &id));
    CHECK_OK(bex_rpc_cancel(ch, id));
    CHECK(wait_count(&r.w, &r.calls, 2, 5000) == 0);
    CHECK_EQ(o[1].status, -ECANCELED);
    CHECK_EQ(bex_rpc_cancel(ch, id), -ENOENT);
    /* a late answer: the server echoes after 3 x the deadline */
    o[2] = (struct tcall){.r = &r};
    uint32_t *b = bex_rpc_alloc(ctx, 4);
    *b = 3 * tmo;
    CHECK_OK(bex_rpc_call(ch, SVC, M_LATE, b, 4, &opts, one_done, &o[2], NULL));
    CHECK(wait_count(&r.w, &r.calls, 3, 5000) == 0);
    CHECK_EQ(o[2].status, -ETIMEDOUT);
    bex_rpc_channel_stats st;
    for (int i = 0; i < 200; i++) {
        bex_rpc_channel_stats_get(ch, &st);
        if (st.late_responses)
            break;
        pair_sleep_ms(10 * time_scale());
    }
    CHECK_EQ(st.late_responses, 1);
    pair_sleep_ms(tmo); /* nothing completes twice, even later */
    CHECK_EQ(atomic_load(&r.calls), 3);
    CHECK_EQ(atomic_load(&r.twice), 0);
    CHECK_EQ(st.fail_timeout, 2);
    CHECK_EQ(st.fail_cancel, 1);
    CHECK_EQ(st.retries, 0); /* timeouts of the whole call are not retried */
    return rpc_finish(ch, ctx, &sp, 1);
}

/* Calls outstanding when the channel is destroyed complete once with
 * -ECANCELED; their buffers come back (the context's pool is empty). */
static int t_destroy(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, 0);
    /* the connection first: over RDMA its engine keeps a header area of
     * the pool as long as it lives */
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    bex_mem_stats ms;
    bex_mem_pool_collect(bex_ctx_pool(ctx));
    bex_mem_pool_stats(bex_ctx_pool(ctx), &ms);
    size_t base = ms.in_use_bytes;
    static struct tally r = {.w = WAITER_INIT};
    static struct tcall o[16];
    for (int i = 0; i < 16; i++) {
        o[i] = (struct tcall){.r = &r};
        size_t len = i % 2 ? 100000 : 64; /* some by rendezvous */
        CHECK_OK(bex_rpc_call(ch, SVC, M_NEVER, pattern_body(ctx, len, 1), len, NULL, one_done,
                              &o[i], NULL));
    }
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_EQ(atomic_load(&r.calls), 16);
    for (int i = 0; i < 16; i++)
        CHECK_EQ(o[i].status, -ECANCELED);
    bex_mem_pool_collect(bex_ctx_pool(ctx)); /* frees from the I/O thread count */
    bex_mem_pool_stats(bex_ctx_pool(ctx), &ms);
    /* base may still count the first call's 64-byte message (freed by the
     * I/O thread around the completion): less than any of the 16 calls'
     * buffers, so a leak of one of them still shows */
    if (ms.in_use_bytes > base)
        fprintf(stderr, "pool: %zu bytes in use, %zu before the calls\n", ms.in_use_bytes, base);
    CHECK(ms.in_use_bytes <= base);
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
}

/* Steady load on a channel over two servers; the first is killed with -9
 * mid-run. Every call completes within its deadline (plus a little for
 * the completion to run), and none is lost: calls out on the dead server
 * are retried on the other (attempt timeout or connection failure). */
static int t_failover(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_endpoint ep[2];
    bex_rpc_channel_config cc = chan_cfg(ep, sp, 2);
    const unsigned deadline = 1000 * time_scale();
    cc.request_timeout_ms = deadline;
    cc.attempt_timeout_ms = deadline / 4;
    /* the budget must cover what a dead endpoint fails at once: the calls
     * out on it and those sent to it until its failure is seen (at tens of
     * thousands of calls a second over loopback, more than the default
     * burst of 10) */
    cc.retry_budget_burst = 100;
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    /* both connections up first (round robin: one call each), so that the
     * deadlines measure failover, not the first setup */
    bex_rpc_call_opts warm = {.timeout_ms = 20000 * time_scale()};
    for (int i = 0; i < 2; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, &warm, NULL, NULL));
    enum { OUT = 8 };
    static struct tally r = {.w = WAITER_INIT};
    static struct tcall o[100000];
    const unsigned slack = 20 * time_scale();
    long n = 0;
    uint64_t start = pair_now_ms(), kill_at = start + 300 * time_scale(),
             end = start + 2000 * time_scale();
    bool killed = false;
    int hold = -1; /* the killed server's port, held (srv_kill_hold) */
    long before_kill = 0;
    while (pair_now_ms() < end && n < 100000) {
        CHECK(wait_count(&r.w, &r.calls, n - OUT + 1, 20000) == 0);
        if (!killed && pair_now_ms() >= kill_at) {
            CHECK((hold = srv_kill_hold(&sp[0])) >= 0);
            killed = true;
            before_kill = n;
        }
        o[n] = (struct tcall){.r = &r,
                              .seed = (uint32_t)n,
                              .len = 64,
                              .t0_ms = pair_now_ms(),
                              .limit_ms = deadline + slack};
        CHECK_OK(bex_rpc_call(ch, SVC, M_ECHO, pattern_body(ctx, 64, (uint32_t)n), 64, NULL,
                              one_done, &o[n], NULL));
        n++;
    }
    CHECK(killed);
    CHECK(wait_count(&r.w, &r.calls, n, 20000) == 0);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    fprintf(stderr,
            "failover: %ld calls (%ld before the kill), ok %ld, failed %ld, late %ld, "
            "retries %llu, throttled %llu, conn failures %llu\n",
            n, before_kill, atomic_load(&r.ok), atomic_load(&r.bad), atomic_load(&r.late),
            (unsigned long long)st.retries, (unsigned long long)st.retry_throttled,
            (unsigned long long)st.conn_failures);
    tcall_show_failed(o, n, "failover");
    CHECK(before_kill > OUT && n > before_kill + OUT);
    CHECK_EQ(atomic_load(&r.twice), 0);
    CHECK_EQ(atomic_load(&r.late), 0);
    CHECK_EQ(atomic_load(&r.ok), n);
    CHECK(st.retries >= 1);
    CHECK(st.conn_failures >= 1);
    /* per endpoint: the killed one's connection failed, the other answered;
     * every attempt is counted at one of them */
    bex_rpc_endpoint_stats es[2];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 2);
    CHECK(es[0].conn_failures >= 1 && es[1].conn_failures == 0);
    CHECK(es[0].failures >= 1);
    CHECK(es[1].answers > es[0].answers);
    CHECK_EQ(es[0].attempts + es[1].attempts, st.attempts);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_ctx_destroy(ctx));
    close(hold);
    int rc = stop_server(&sp[0], true);
    rc |= stop_server(&sp[1], false);
    return rc ? 1 : 0;
}

/* The RPC layer's clock in t_connect_timeout (tests/rpc/still_clock.h):
 * Tc and the hold-down are judged on the clock they are kept by (on the
 * wall clock, a call "within Tc + 1 s" failed at load 30-38); hooked after
 * the servers are forked. */

/* An echo of no body out on ch, its completion counted in *n, its status in
 * *status. */
struct ct_call {
    _Atomic long *n;
    _Atomic int status;
    struct waiter *w;
};

static void ct_done(int status, void *body, size_t len, void *user)
{
    (void)len;
    struct ct_call *c = user;
    bex_rpc_free(body);
    atomic_store(&c->status, status);
    waiter_add(c->w, c->n, 1);
}

/* Tc: the first endpoint accepts TCP connections (its kernel does, into
 * the backlog of a socket nobody accepts from) but never answers the
 * setup. Calls go to it first, its connection is failed at Tc and they
 * are retried on the second endpoint: each completes, successfully, once
 * the RPC clock reaches Tc (not a millisecond before), and well before the
 * context's own setup deadline. */
static int t_connect_timeout(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[1], false);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0);
    bex_addr ba = {.in4 = {.sin_family = AF_INET, .sin_addr = sp[1].addr.in4.sin_addr}};
    CHECK(bind(fd, (struct sockaddr *)&ba, sizeof ba) == 0);
    CHECK(listen(fd, 16) == 0);
    socklen_t bl = sizeof ba;
    CHECK(getsockname(fd, (struct sockaddr *)&ba, &bl) == 0);
    sp[0] = (struct srv_proc){.addr = ba};
    atomic_store(&still_ns, 0);
    bex__rpc_clock_hook(still_clock);
    bex_ctx *ctx = client_ctx();
    bex_rpc_endpoint ep[2];
    bex_rpc_channel_config cc = chan_cfg(ep, sp, 2);
    const unsigned tc = 500;
    cc.connect_timeout_ms = tc;
    /* on the RPC clock, which stands still while the calls below go to the
     * second endpoint: they stay off the first */
    const unsigned hold = 1500;
    cc.holddown_ms = hold;
    /* the connection to the second endpoint first, by another channel that
     * keeps it (sockets to one address share a connection: the channel
     * under test then opens its socket on it at once) */
    bex_rpc_endpoint e1[1];
    bex_rpc_channel_config kc = chan_cfg(e1, &sp[1], 1);
    bex_rpc_channel *keep, *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &kc, &keep));
    bex_rpc_call_opts warm = {.timeout_ms = 20000 * time_scale()};
    CHECK_OK(bex_rpc_call_sync(keep, SVC, M_ECHO, NULL, 0, &warm, NULL, NULL));
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    /* the clock stops, a second ahead of the real one (past every time read
     * from it: it stays monotonic) */
    still_freeze();
    struct waiter w = WAITER_INIT;
    _Atomic long n = 0;
    struct ct_call c[3] = {{.n = &n, .w = &w}, {.n = &n, .w = &w}, {.n = &n, .w = &w}};
    /* round robin sends the first call to the first endpoint: at Tc it
     * goes to the second */
    CHECK_OK(bex_rpc_call(ch, SVC, M_ECHO, NULL, 0, NULL, ct_done, &c[0], NULL));
    still_advance_ms(tc - 1);
    pair_sleep_ms(tc + 200); /* past Tc on the wall clock, short of it on the RPC one */
    CHECK_EQ(atomic_load(&n), 0);
    still_advance_ms(1);
    CHECK(wait_count(&w, &n, 1, 20000) == 0);
    CHECK_OK(atomic_load(&c[0].status));
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.conn_failures, 1); /* the first endpoint timed out once */
    CHECK_EQ(st.retries, 1);
    /* held down now: calls go to the second endpoint directly, no retry */
    for (int i = 0; i < 4; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.retries, 1);
    CHECK_EQ(st.attempts, 6);
    /* after the hold-down, one call of two probes the first endpoint again:
     * it completes at Tc via the second */
    still_advance_ms(hold + 50);
    CHECK_OK(bex_rpc_call(ch, SVC, M_ECHO, NULL, 0, NULL, ct_done, &c[1], NULL));
    CHECK_OK(bex_rpc_call(ch, SVC, M_ECHO, NULL, 0, NULL, ct_done, &c[2], NULL));
    CHECK(wait_count(&w, &n, 2, 20000) == 0); /* the one to the second endpoint */
    still_advance_ms(tc - 1);
    pair_sleep_ms(tc + 200);
    CHECK_EQ(atomic_load(&n), 2);
    still_advance_ms(1);
    CHECK(wait_count(&w, &n, 3, 20000) == 0);
    CHECK_OK(atomic_load(&c[1].status));
    CHECK_OK(atomic_load(&c[2].status));
    bex_rpc_channel_stats_get(ch, &st);
    fprintf(stderr, "connect_timeout: conn failures %llu, retries %llu, attempts %llu\n",
            (unsigned long long)st.conn_failures, (unsigned long long)st.retries,
            (unsigned long long)st.attempts);
    CHECK_EQ(st.conn_failures, 2);
    CHECK_EQ(st.retries, 2);
    CHECK_EQ(st.failed, 0);
    /* the probe's socket waits, its request queued, for a setup the first
     * endpoint never answers: closing that listener resets the connection
     * in its backlog, and the channel's destroy need not wait out the
     * context's setup deadline (RPC_SETUP_MS, 10 s: most of this case's
     * time before) */
    close(fd);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_rpc_channel_destroy(keep));
    CHECK_OK(bex_ctx_destroy(ctx));
    bex__rpc_clock_hook(NULL); /* (its objects are gone) */
    return stop_server(&sp[1], false) ? 1 : 0;
}

/* The endpoint list replaced at run time (what a directory will do): calls
 * go to the new list only; a call out on a removed endpoint is retried on
 * the new one and succeeds; an endpoint in both lists keeps its
 * connection. */
static int64_t requests_of(bex_rpc_channel *stats_ch)
{
    return (int64_t)server_stats(stats_ch).st.requests;
}

static int t_endpoints(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_endpoint ep[2], e0[1], e1[1];
    bex_rpc_channel_config cc = chan_cfg(ep, sp, 2);
    bex_rpc_channel *ch, *st0, *st1;
    bex_rpc_channel_config c0 = chan_cfg(e0, &sp[0], 1), c1 = chan_cfg(e1, &sp[1], 1);
    CHECK_OK(bex_rpc_channel_create(ctx, &c0, &st0)); /* the servers' counters */
    CHECK_OK(bex_rpc_channel_create(ctx, &c1, &st1));
    cc.n_endpoints = 1; /* the first server only */
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    CHECK_EQ(bex_rpc_channel_set_endpoints(ch, ep, 0), -EINVAL);
    for (int i = 0; i < 10; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    /* a request counts itself: 10 echoes + this one */
    CHECK_EQ(requests_of(st0), 11);
    CHECK_EQ(requests_of(st1), 1);
    /* a call out on the first server (answered after 1 s) when the list
     * becomes the second server alone */
    static struct tally r = {.w = WAITER_INIT};
    static struct tcall o = {.r = &r}; /* (its body is no pattern: status only) */
    uint32_t *b = bex_rpc_alloc(ctx, 4);
    *b = 1000 * time_scale(); /* the server's delay */
    CHECK_OK(bex_rpc_call(ch, SVC, M_LATE, b, 4, NULL, one_done, &o, NULL));
    int64_t n0;
    while ((n0 = requests_of(st0)) < 13) /* 10 + 2 stats + the late call */
        pair_sleep_ms(5);
    CHECK_OK(bex_rpc_channel_set_endpoints(ch, &ep[1], 1));
    CHECK(wait_count(&r.w, &r.calls, 1, 20000) == 0);
    CHECK_EQ(o.status, 0); /* answered by the second server, after its own delay */
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.retries, 1);
    for (int i = 0; i < 10; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    CHECK_EQ(requests_of(st0), n0 + 1); /* nothing more but this stats call */
    CHECK_EQ(requests_of(st1), 13);     /* 1 stats + the retried call + 10 + this */
    /* both servers now: the second keeps its connection (no new failure) */
    uint64_t cf = st.conn_failures;
    CHECK_OK(bex_rpc_channel_set_endpoints(ch, ep, 2));
    for (int i = 0; i < 10; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.conn_failures, cf);
    CHECK_EQ(requests_of(st0), n0 + 1 + 5 + 1); /* round robin: 5 each */
    CHECK_EQ(requests_of(st1), 13 + 5 + 1);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_rpc_channel_destroy(st0));
    CHECK_OK(bex_rpc_channel_destroy(st1));
    CHECK_OK(bex_ctx_destroy(ctx));
    int rc = stop_server(&sp[0], false);
    rc |= stop_server(&sp[1], false);
    return rc ? 1 : 0;
}

/* A service that fails every call with a retryable -EAGAIN: the budget
 * keeps the attempts near the calls (N calls, up to 5 attempts each, at
 * most burst + 10 % of N retries), where without it there would be 5 N.
 * The server counts what reached it. */
static int t_budget(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_endpoint ep[1];
    bex_rpc_channel_config cc = chan_cfg(ep, &sp, 1);
    cc.max_attempts = 5; /* budget: defaults (burst 10, 100 per mille) */
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    enum { N = 200 };
    for (int i = 0; i < N; i++)
        CHECK_EQ(bex_rpc_call_sync(ch, SVC, M_EAGAIN, NULL, 0, NULL, NULL, NULL), -EAGAIN);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    bex_rpc_endpoint ep2[1];
    bex_rpc_channel_config cc2 = chan_cfg(ep2, &sp, 1);
    bex_rpc_channel *ch2;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc2, &ch2));
    struct tstats ts_ = server_stats(ch2);
    fprintf(stderr,
            "budget: %d calls, %lld attempts reached the server, %llu retries, %llu throttled\n", N,
            (long long)ts_.eagain, (unsigned long long)st.retries,
            (unsigned long long)st.retry_throttled);
    CHECK_EQ(ts_.eagain, (long long)st.attempts);
    CHECK(ts_.eagain > N);                /* retries did happen */
    CHECK(ts_.eagain <= N + 10 + N / 10); /* and the budget held them */
    CHECK(st.retry_throttled > 0);
    CHECK_EQ(st.fail_remote, N);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_rpc_channel_destroy(ch2));
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
}

/* A state-changing call whose answer is lost (the server closes the
 * connection after applying it): the retry, on a new connection, gets the
 * first result from the dedup window; the write was applied once. A
 * second write is applied as usual. */
static int t_write_once(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, true);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, 0);
    void *resp;
    size_t len;
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_WRITE, NULL, 0, NULL, &resp, &len));
    CHECK_EQ(len, 8);
    CHECK_EQ(*(int64_t *)resp, 1); /* the first application's result */
    bex_rpc_free(resp);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.retries, 1);
    CHECK(st.conn_failures >= 1);
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_WRITE, NULL, 0, NULL, &resp, &len));
    CHECK_EQ(*(int64_t *)resp, 2);
    bex_rpc_free(resp);
    /* the first answer lost and slow: the retry arrives while the write
     * is still being answered; it is not applied again, and gets the
     * first answer when it comes (before the fix it was dropped and the
     * call ran into its deadline) */
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_SLOWW, NULL, 0, NULL, &resp, &len));
    CHECK_EQ(len, 8);
    CHECK_EQ(*(int64_t *)resp, 3);
    bex_rpc_free(resp);
    struct tstats t = server_stats(ch);
    CHECK_EQ(t.applied, 3);
    CHECK_EQ(t.st.dup_pending, 1);
    CHECK_EQ(t.st.dup_replayed, 2);
    return rpc_finish(ch, ctx, &sp, 1);
}

/* The dedup window's rules, with requests made by hand on a raw socket
 * (client id 77, sequences chosen): a window of 4 sequences. Then a WRITE
 * first refused -EAGAIN (not applied) is applied on the channel's retry,
 * not answered -EAGAIN again from the window. */
static struct {
    struct waiter w;
    _Atomic long n, closed;
    struct bex__rpc_hdr h[16];
    int64_t val[16];
} rw = {.w = WAITER_INIT};

static void raw_on_close(bex_sock *s, void *user)
{
    (void)s;
    (void)user;
    waiter_add(&rw.w, &rw.closed, 1);
}

static void raw_on_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    (void)user;
    long i = atomic_load(&rw.n);
    const char *why;
    CHECK(i < 16);
    CHECK_OK(bex__rpc_hdr_decode(buf, len, &rw.h[i], &why));
    rw.val[i] = len == BEX_RPC_HDR_LEN + 8 ? *(int64_t *)((uint8_t *)buf + BEX_RPC_HDR_LEN) : -1;
    bex_mem_free(buf);
    waiter_add(&rw.w, &rw.n, 1);
}

/* Send a M_WRITE with seq; returns the answer's status, *val its value. */
static int raw_write(bex_ctx *ctx, bex_sock *s, uint64_t seq, int64_t *val)
{
    static uint64_t call_id;
    long i = atomic_load(&rw.n);
    uint8_t *m = bex_sock_alloc(ctx, BEX_RPC_HDR_LEN);
    CHECK(m);
    struct bex__rpc_hdr h = {.kind = BEX__RPC_REQUEST,
                             .service = SVC,
                             .method = M_WRITE,
                             .call_id = ++call_id,
                             .client_id = 77,
                             .seq = seq};
    bex__rpc_hdr_encode(&h, m);
    CHECK_OK(bex_sock_send(s, m, BEX_RPC_HDR_LEN, NULL));
    CHECK(wait_count(&rw.w, &rw.n, i + 1, 5000) == 0);
    CHECK(rw.h[i].call_id == call_id && rw.h[i].seq == seq && rw.h[i].client_id == 77);
    *val = rw.val[i];
    return rw.h[i].status;
}

static int t_window(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    srv_window = 4;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_sock_ops ops = {.on_recv = raw_on_recv, .on_close = raw_on_close};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(ctx, &sp.addr, &ops, NULL, &s));
    int64_t v;
    CHECK_EQ(raw_write(ctx, s, 1, &v), 0);
    CHECK_EQ(v, 1); /* applied */
    CHECK_EQ(raw_write(ctx, s, 1, &v), 0);
    CHECK_EQ(v, 1); /* the first answer again, not applied */
    CHECK_EQ(raw_write(ctx, s, 10, &v), 0);
    CHECK_EQ(v, 2);                              /* applied; the window is now (6, 10] */
    CHECK_EQ(raw_write(ctx, s, 1, &v), -ESTALE); /* fell out: refused, not applied */
    CHECK_EQ(raw_write(ctx, s, 8, &v), 0);
    CHECK_EQ(v, 3);                              /* new, inside the window: applied */
    CHECK_EQ(raw_write(ctx, s, 6, &v), -ESTALE); /* never seen, but below it */
    CHECK_EQ(raw_write(ctx, s, 10, &v), 0);
    CHECK_EQ(v, 2);
    bex_sock_close(s);
    CHECK(wait_count(&rw.w, &rw.closed, 1, 5000) == 0);
    /* -EAGAIN from a WRITE leaves no trace: the retry is applied */
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, 0);
    void *resp;
    size_t len;
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_FLAKY, NULL, 0, NULL, &resp, &len));
    CHECK_EQ(len, 8);
    CHECK_EQ(*(int64_t *)resp, 4);
    bex_rpc_free(resp);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.retries, 1);
    struct tstats t = server_stats(ch);
    CHECK_EQ(t.applied, 4);
    CHECK_EQ(t.st.dup_replayed, 2);
    CHECK_EQ(t.st.stale, 2);
    return rpc_finish(ch, ctx, &sp, 1);
}

/* A raw socket sends the server messages that are not RPC requests: the
 * server closes that socket (the peer sees on_error) and logs it once;
 * a channel calling meanwhile goes on. */
static struct waiter gw = WAITER_INIT;
static _Atomic long g_err, g_closed;
static void g_on_error(bex_sock *s, int err, void *user)
{
    (void)err;
    (void)user;
    (void)s;
    /* not closed here: the test thread may still be sending on s (a socket
     * is gone once on_close has run); it closes s after its sends */
    waiter_add(&gw, &g_err, 1);
}
static void g_on_close(bex_sock *s, void *user)
{
    (void)s;
    (void)user;
    waiter_add(&gw, &g_closed, 1);
}

static int t_garbage(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, 0);
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, pattern_body(ctx, 64, 1), 64, NULL, NULL, NULL));
    bex_sock_ops ops = {.on_error = g_on_error, .on_close = g_on_close};
    bex_sock *raw;
    CHECK_OK(bex_sock_connect(ctx, &sp.addr, &ops, NULL, &raw));
    /* a valid header with a body length that lies, then plain noise */
    uint8_t *m1 = bex_sock_alloc(ctx, 128);
    struct bex__rpc_hdr h = {.kind = BEX__RPC_REQUEST,
                             .service = SVC,
                             .method = M_ECHO,
                             .call_id = 1,
                             .client_id = 1,
                             .seq = 1,
                             .body_len = 1000};
    bex__rpc_hdr_encode(&h, m1);
    CHECK_OK(bex_sock_send(raw, m1, 128, NULL));
    for (int i = 0; i < 5; i++) {
        uint8_t *m = bex_sock_alloc(ctx, 200);
        fill_pattern(m, 200, (uint32_t)i);
        /* the server may have closed the socket already: then the send is
         * refused and the buffer stays ours */
        int rc = bex_sock_send(raw, m, 200, NULL);
        CHECK(rc == 0 || rc == -EPIPE);
        if (rc)
            bex_mem_free(m);
    }
    CHECK(wait_count(&gw, &g_err, 1, 5000) == 0);
    CHECK_EQ(g_closed, 0);
    bex_sock_close(raw);
    CHECK(wait_count(&gw, &g_closed, 1, 5000) == 0);
    for (int i = 0; i < 50; i++) {
        void *resp;
        size_t len;
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, pattern_body(ctx, 4096, (uint32_t)i), 4096,
                                   NULL, &resp, &len));
        CHECK(len == 4096 && check_pattern(resp, len, (uint32_t)i) == 0);
        bex_rpc_free(resp);
    }
    struct tstats t = server_stats(ch);
    CHECK_EQ(t.st.bad_header, 1);
    CHECK_EQ(t.malformed_logs, 1);
    return rpc_finish(ch, ctx, &sp, 1);
}

/* Handlers answering from another thread, many calls outstanding from
 * several client threads at once (TSan covers the hand-offs). */
struct thr_arg {
    bex_ctx *ctx;
    bex_rpc_channel *ch;
    int idx;
};

static void *thr_main(void *arg)
{
    struct thr_arg *a = arg;
    enum { N = 300, OUT = 16 };
    struct tally *r = calloc(1, sizeof(*r));
    struct tcall *o = calloc(N, sizeof(*o));
    CHECK(r && o);
    pthread_mutex_init(&r->w.mu, NULL);
    pthread_cond_init(&r->w.cv, NULL);
    for (int i = 0; i < N; i++) {
        CHECK(wait_count(&r->w, &r->calls, i - OUT + 1, 20000) == 0);
        uint32_t seed = (uint32_t)(a->idx * 10000 + i);
        size_t len = i % 7 == 0 ? 20000 : 256;
        o[i] = (struct tcall){.r = r, .seed = seed, .len = len};
        CHECK_OK(bex_rpc_call(a->ch, SVC, M_THREAD, pattern_body(a->ctx, len, seed), len, NULL,
                              one_done, &o[i], NULL));
    }
    CHECK(wait_count(&r->w, &r->calls, N, 30000) == 0);
    tcall_show_failed(o, N, a->idx == 0 ? "thread 0" : a->idx == 1 ? "thread 1" : "thread 2");
    CHECK_EQ(atomic_load(&r->ok), N);
    CHECK_EQ(atomic_load(&r->twice), 0);
    free(o);
    free(r);
    return NULL;
}

static int t_threads(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    /* about threads, not deadlines */
    bex_rpc_channel *ch = chan_open(ctx, &sp, 1, 20000);
    pthread_t t[3];
    struct thr_arg a[3];
    for (int i = 0; i < 3; i++) {
        a[i] = (struct thr_arg){ctx, ch, i};
        CHECK(pthread_create(&t[i], NULL, thr_main, &a[i]) == 0);
    }
    for (int i = 0; i < 3; i++)
        CHECK(pthread_join(t[i], NULL) == 0);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.ok, 900);
    return rpc_finish(ch, ctx, &sp, 1);
}

/* The Prometheus dump says what the counters say. */
static int t_prometheus(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = client_ctx();
    bex_rpc_endpoint ep[1];
    bex_rpc_channel_config cc = chan_cfg(ep, &sp, 1);
    cc.name = "pr\"om";
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    for (int i = 0; i < 10; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    CHECK_EQ(bex_rpc_call_sync(ch, SVC, 99, NULL, 0, NULL, NULL, NULL), -ENOSYS);
    char small[16];
    int need = bex_rpc_channel_prometheus(ch, small, sizeof small);
    CHECK(need > (int)sizeof small && strlen(small) == sizeof small - 1);
    char *buf = malloc((size_t)need + 1);
    CHECK(buf);
    CHECK_EQ(bex_rpc_channel_prometheus(ch, buf, (size_t)need + 1), need);
    CHECK(strstr(buf, "# TYPE bex_rpc_calls_total counter\n"));
    CHECK(strstr(buf, "bex_rpc_calls_total{channel=\"pr\\\"om\"} 11\n"));
    CHECK(strstr(buf, "bex_rpc_ok_total{channel=\"pr\\\"om\"} 10\n"));
    CHECK(strstr(buf, "bex_rpc_failures_total{channel=\"pr\\\"om\",kind=\"remote\"} 1\n"));
    CHECK(strstr(buf, "bex_rpc_latency_seconds_count{channel=\"pr\\\"om\"} 11\n"));
    CHECK(strstr(buf, "bex_rpc_latency_seconds{channel=\"pr\\\"om\",quantile=\"0.99\"} "));
    /* the endpoint's counters: 11 attempts, 11 answers, nothing failed */
    bex_rpc_endpoint_stats es[2];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 1);
    CHECK(es[0].attempts == 11 && es[0].answers == 11 && es[0].failures == 0 &&
          es[0].conn_failures == 0);
    CHECK(strcmp(es[0].locality, "dc1/pod1") == 0);
    char want[256], ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &sp.addr.in4.sin_addr, ip, sizeof ip);
    snprintf(want, sizeof want,
             "bex_rpc_endpoint_attempts_total{channel=\"pr\\\"om\",endpoint=\"%s:%u\","
             "locality=\"dc1/pod1\"} 11\n",
             ip, ntohs(sp.addr.in4.sin_port));
    CHECK(strstr(buf, want));
    free(buf);
    return rpc_finish(ch, ctx, &sp, 1);
}

BEX_TEST_MAIN({"echo", t_echo}, {"deadline", t_deadline}, {"destroy", t_destroy},
              {"failover", t_failover}, {"connect_timeout", t_connect_timeout},
              {"endpoints", t_endpoints}, {"budget", t_budget}, {"write_once", t_write_once},
              {"window", t_window}, {"garbage", t_garbage}, {"threads", t_threads},
              {"prometheus", t_prometheus})
