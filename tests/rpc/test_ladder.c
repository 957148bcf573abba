/* SPDX-License-Identifier: Apache-2.0 */
/* The RPC client's recovery ladder (issue 9 item 5; docs/architecture.md,
 * "Recovery ladder"): reconnect, then other replicas, then TCP, RDMA tried
 * again later; every step logged once and counted.
 *
 * steps, two_replicas, directory (tcp): endpoints listed as RDMA on a
 * context without a device: every RDMA connection is refused at once
 * (-ENODEV), so the ladder's state machine runs natively; the step order
 * (from the log), the counters and the Prometheus dump are checked
 * exactly.
 * kill (tcp and rxe): two replicas under steady load (64 calls
 * outstanding), one killed with -9: no call lost (each succeeds within its
 * deadline), with the default retry budget.
 * rdma_unusable (rxe): RoCE packets dropped on the VM's wire (a tc filter:
 * the QPs fail, TCP still passes): calls move to TCP within 1 s and go on
 * succeeding; once RoCE passes again the endpoints go back to RDMA. */
#include <sys/wait.h>

#include "bex/dir.h"
#include "rpc/rpc_test.h"

/* ---- the client's log, kept for the step order ---- */

static struct {
    pthread_mutex_t mu;
    char *lines[512];
    int n;
} lg = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Kept, and printed when the case ends (log_dump, also at exit after a
 * failed CHECK): not at once, as the hook runs under the channel's lock
 * and a write to the VM's console could block for 200 ms under load,
 * holding the ladder up (seen). */
static void log_keep(int level, const char *msg, void *arg)
{
    (void)arg;
    char *line = NULL;
    if (asprintf(&line, "bex (client, level %d, %llu ms): %s", level,
                 (unsigned long long)(pair_now_ms() % 100000), msg) < 0)
        line = NULL;
    pthread_mutex_lock(&lg.mu);
    if (lg.n < 512)
        lg.lines[lg.n++] = line;
    else
        free(line);
    pthread_mutex_unlock(&lg.mu);
}

static pid_t log_owner;

static void log_dump(void)
{
    if (getpid() != log_owner)
        return;
    pthread_mutex_lock(&lg.mu);
    for (int i = 0; i < lg.n; i++)
        fprintf(stderr, "%s\n", lg.lines[i] ? lg.lines[i] : "(line lost)");
    lg.n = 0;
    pthread_mutex_unlock(&lg.mu);
}

/* Index of the first kept line from `from` on holding all of a and b
 * (b may be NULL), or -1. */
static int log_mark(void)
{
    pthread_mutex_lock(&lg.mu);
    int n = lg.n;
    pthread_mutex_unlock(&lg.mu);
    return n;
}

static int log_find(int from, const char *a, const char *b)
{
    pthread_mutex_lock(&lg.mu);
    int r = -1;
    for (int i = from; i < lg.n && r < 0; i++)
        if (lg.lines[i] && strstr(lg.lines[i], a) && (!b || strstr(lg.lines[i], b)))
            r = i;
    pthread_mutex_unlock(&lg.mu);
    return r;
}

/* How many kept lines from `from` on hold both a and b. */
static int log_count_from(int from, const char *a, const char *b)
{
    int n = 0;
    for (int i = log_find(from, a, b); i >= 0; i = log_find(i + 1, a, b))
        n++;
    return n;
}

static int log_count(const char *a, const char *b)
{
    return log_count_from(0, a, b);
}

static void ep_name(const bex_addr *a, char *out, size_t cap)
{
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &a->in4.sin_addr, ip, sizeof ip);
    snprintf(out, cap, "endpoint %s:%u:", ip, ntohs(a->in4.sin_port));
}

/* From log line `from` on, the ladder of endpoint a went through steps 1,
 * 2 and (tcp) 3 in that order, each logged once. */
static void check_order_from(int from, const bex_addr *a, bool tcp)
{
    char name[64];
    ep_name(a, name, sizeof name);
    int s1 = log_find(from, name, "step 1, reconnecting");
    int s2 = log_find(from, name, "step 2, ");
    int s3 = log_find(from, name, "step 3, over TCP");
    fprintf(stderr, "%s steps logged at lines %d, %d, %d\n", name, s1, s2, s3);
    CHECK(s1 >= 0 && s2 > s1);
    CHECK_EQ(log_count_from(from, name, "step 1, reconnecting"), 1);
    CHECK_EQ(log_count_from(from, name, "step 2, "), 1);
    if (tcp) {
        CHECK(s3 > s2);
        CHECK_EQ(log_count_from(from, name, "step 3, over TCP"), 1);
    }
}

static void check_order(const bex_addr *a, bool tcp)
{
    check_order_from(0, a, tcp);
}

/* The client's context on ADDR1, its log kept (rpc_test.h's client_ctx
 * keeps none). */
static bex_ctx *ladder_ctx(uint8_t qp_timeout, uint8_t qp_retry_cnt)
{
    (void)client_ctx;
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ctx_config base = {.keepalive_timeout_ms = RPC_KEEPALIVE_MS,
                           .connect_timeout_ms = RPC_SETUP_MS};
    bex_ctx_config c = scaled(&base, a1);
    c.log_fn = log_keep;
    if (!log_owner) {
        log_owner = getpid();
        atexit(log_dump);
    }
    c.qp_timeout = qp_timeout;
    c.qp_retry_cnt = qp_retry_cnt;
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

static char *prom(bex_rpc_channel *ch)
{
    int need = bex_rpc_channel_prometheus(ch, NULL, 0);
    char *buf = malloc((size_t)need + 1);
    CHECK(buf);
    CHECK_EQ(bex_rpc_channel_prometheus(ch, buf, (size_t)need + 1), need);
    return buf;
}

/* ---- cases without RDMA: the state machine ---- */

/* One endpoint listed as RDMA, on a context that has no device (natively
 * over TCP): step 1 (reconnect: refused again), step 2 (no other replica),
 * step 3 (TCP: works); the call succeeds although max_attempts is 2 and
 * the budget holds one retry: the ladder's moves spend neither. Then RDMA
 * is probed every rdma_retry_ms, fails, and calls stay on TCP. */
static int t_steps(void)
{
    RPC_NEED_ADDRS();
    RPC_NEED_NO_DEVICE();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = ladder_ctx(0, 0);
    CHECK(bex_ctx_pd(ctx) == NULL);
    bex_rpc_endpoint ep[1];
    bex_rpc_channel_config cc = ladder_cfg(ep, &sp);
    const unsigned retry_ms = 300 * time_scale();
    cc.rdma_retry_ms = retry_ms;
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    void *resp = NULL;
    size_t len = 0;
    uint64_t t_call = pair_now_ms(); /* step 3, and its retry period, start after this */
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, pattern_body(ctx, 64, 5), 64, NULL, &resp, &len));
    CHECK(len == 64 && check_pattern(resp, len, 5) == 0);
    bex_rpc_free(resp);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    check_ladder_climbed(&st);
    CHECK_EQ(st.ladder_recovered, 0);
    CHECK_EQ(st.retries, 2);
    CHECK_EQ(st.retry_throttled, 0);
    CHECK_EQ(st.attempts, 1); /* the RDMA ones never left */
    CHECK_EQ(st.ok, 1);
    bex_rpc_endpoint_stats es[1];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 1), 1);
    CHECK_EQ(es[0].ladder, BEX_RPC_LADDER_TCP);
    CHECK_EQ(es[0].tcp_answers, 1);
    check_order(&sp.addr, true);
    CHECK(log_find(0, "step 2, no other replica on RDMA, TCP now", NULL) >= 0);
    /* RDMA is tried again after retry_ms, and again after that: refused,
     * calls go on over TCP */
    for (int i = 0; i < 20; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    while (pair_now_ms() < t_call + 4 * retry_ms) {
        bex_rpc_channel_stats_get(ch, &st);
        if (st.rdma_retries >= 2)
            break;
        pair_sleep_ms(5);
    }
    uint64_t took = pair_now_ms() - t_call;
    fprintf(stderr, "steps: 2 RDMA retries after %llu ms (period %u ms)\n",
            (unsigned long long)took, retry_ms);
    CHECK(st.rdma_retries >= 2);
    CHECK(took >= 2 * retry_ms && took < 3 * retry_ms); /* every period, not later */
    CHECK_EQ(st.rdma_restored, 0);
    for (int i = 0; i < 5; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.ok, 26);
    CHECK_EQ(st.failed, 0);
    CHECK_EQ(st.ladder_tcp, 1); /* logged and counted once */
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 1), 1);
    CHECK_EQ(es[0].ladder, BEX_RPC_LADDER_TCP);
    CHECK_EQ(es[0].tcp_answers, 26);
    check_order(&sp.addr, true);
    /* the dump says the same */
    char *buf = prom(ch);
    CHECK(strstr(buf, "bex_rpc_ladder_reconnects_total{channel=\"test\"} 1\n"));
    CHECK(strstr(buf, "bex_rpc_ladder_replicas_total{channel=\"test\"} 1\n"));
    CHECK(strstr(buf, "bex_rpc_ladder_tcp_total{channel=\"test\"} 1\n"));
    CHECK(strstr(buf, "bex_rpc_ladder_moves_total{channel=\"test\"} 2\n"));
    CHECK(strstr(buf, "bex_rpc_rdma_restored_total{channel=\"test\"} 0\n"));
    char want[256], ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &sp.addr.in4.sin_addr, ip, sizeof ip);
    snprintf(want, sizeof want,
             "bex_rpc_endpoint_ladder_step{channel=\"test\",endpoint=\"%s:%u\","
             "locality=\"dc1/pod1\"} 3\n",
             ip, ntohs(sp.addr.in4.sin_port));
    CHECK(strstr(buf, want));
    free(buf);
    return rpc_finish(ch, ctx, &sp, 1);
}

/* Two endpoints, both listed as RDMA on a context without a device: each
 * goes step 1, step 2 (calls to the other replica), step 3 (TCP) in that
 * order; no call fails, and both end up serving over TCP. */
static int t_two_replicas(void)
{
    RPC_NEED_ADDRS();
    RPC_NEED_NO_DEVICE();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = ladder_ctx(0, 0);
    bex_rpc_endpoint ep[2];
    bex_rpc_channel_config cc = chan_cfg(ep, sp, 2);
    ep[0].transport = ep[1].transport = BEX_TRANSPORT_RDMA;
    cc.holddown_ms = 50 * time_scale();
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    bex_rpc_endpoint_stats es[2];
    for (int i = 0; i < 200; i++) {
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
        CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 2);
        if (es[0].tcp_answers && es[1].tcp_answers)
            break;
        pair_sleep_ms(5);
    }
    CHECK(es[0].tcp_answers > 0 && es[1].tcp_answers > 0);
    CHECK_EQ(es[0].ladder, BEX_RPC_LADDER_TCP);
    CHECK_EQ(es[1].ladder, BEX_RPC_LADDER_TCP);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(st.ladder_reconnects, 2);
    CHECK_EQ(st.ladder_replicas, 2);
    CHECK_EQ(st.ladder_tcp, 2);
    CHECK_EQ(st.ladder_moves, 4); /* the first call: A, B, A, B refused, then TCP */
    CHECK_EQ(st.failed, 0);
    CHECK_EQ(st.retry_throttled, 0);
    CHECK(log_find(0, "step 2, no other replica on RDMA, TCP now", NULL) >= 0);
    check_order(&sp[0].addr, true);
    check_order(&sp[1].addr, true);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_ctx_destroy(ctx));
    int rc = stop_server(&sp[0], false);
    rc |= stop_server(&sp[1], false);
    return rc ? 1 : 0;
}

/* A channel over a directory (include/bex/dir.h) whose one replica of
 * ps/0 is listed "rdma", on a context without a device: the ladder runs
 * on the directory's endpoint as on a listed one (steps 1, 2, 3 in order,
 * calls succeed over TCP, RDMA probed again every rdma_retry_ms). */
static int t_directory(void)
{
    RPC_NEED_ADDRS();
    RPC_NEED_NO_DEVICE();
    struct srv_proc sp;
    spawn_server(&sp, false);
    bex_ctx *ctx = ladder_ctx(0, 0);
    bex_dir *d;
    CHECK_OK(bex_dir_create(NULL, &d));
    dir_load_ps(d, &sp, 1, 1, "rdma");
    const unsigned retry_ms = 200 * time_scale();
    bex_rpc_channel_config cc = {.dir = d,
                                 .service = "ps",
                                 .locality = "dc1/pod1",
                                 .name = "test",
                                 .request_timeout_ms = 2000 * time_scale(),
                                 .connect_timeout_ms = 15000 * time_scale(),
                                 .rdma_retry_ms = retry_ms};
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    uint64_t t_call = pair_now_ms();
    for (int i = 0; i < 10; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    check_ladder_climbed(&st);
    CHECK_EQ(st.ok, 10);
    bex_rpc_endpoint_stats es[1];
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 1), 1);
    CHECK_EQ(es[0].ladder, BEX_RPC_LADDER_TCP);
    CHECK_EQ(es[0].tcp_answers, 10);
    check_order(&sp.addr, true);
    while (pair_now_ms() < t_call + 4 * retry_ms) {
        bex_rpc_channel_stats_get(ch, &st);
        if (st.rdma_retries >= 1)
            break;
        pair_sleep_ms(5);
    }
    CHECK(st.rdma_retries >= 1);
    CHECK_EQ(st.rdma_restored, 0);
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp, false) ? 1 : 0;
}

/* ---- steady load ---- */

static uint32_t ld_delay_ms; /* M_LATE's: how long each call is held by the server */

/* A M_LATE body: the delay, then a pattern. */
static void *late_body(bex_ctx *ctx, uint32_t seed)
{
    uint8_t *b = bex_rpc_alloc(ctx, 64);
    CHECK(b);
    memcpy(b, &ld_delay_ms, 4);
    fill_pattern(b + 4, 60, seed);
    return b;
}
static void ld_done(int status, void *body, size_t len, void *user)
{
    struct tcall *o = user;
    bool ok = status == 0 && len == 64 && memcmp(body, &ld_delay_ms, 4) == 0 &&
              check_pattern((uint8_t *)body + 4, len - 4, o->seed) == 0;
    bex_rpc_free(body);
    tcall_done(o, status, ok);
}

/* Two replicas under steady load, 64 calls outstanding (each held 20 ms,
 * scaled, by the server, so that about 32 are out on each replica at any
 * time), one killed with -9 mid-run: every call succeeds within its
 * deadline, with the channel's default retry budget and attempts (the
 * calls out on the dead replica are moved by the ladder; before it, all
 * but the budget's burst of them failed). */
static int t_kill(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = ladder_ctx(0, 0);
    const unsigned deadline = 2000 * time_scale();
    bex_rpc_channel *ch = chan_open(ctx, sp, 2, 2000);
    bex_rpc_call_opts warm = {.timeout_ms = 20000 * time_scale()};
    for (int i = 0; i < 2; i++) /* both connections up first (round robin) */
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, &warm, NULL, NULL));
    enum { OUT = 64, MAXN = 200000 };
    static struct tally r = {.w = WAITER_INIT};
    static struct tcall o[MAXN];
    ld_delay_ms = 20 * time_scale();
    const unsigned slack = 20 * time_scale();
    long n = 0, before_kill = 0;
    uint64_t start = pair_now_ms(), kill_at = start + 500 * time_scale(),
             end = kill_at + 1000 * time_scale(); /* the ladder moves at the failure: 1 s
                                                   * (scaled) of calls after the kill */
    bool killed = false;
    int hold = -1; /* the killed server's port, held (srv_kill_hold) */
    while (pair_now_ms() < end && n < MAXN) {
        CHECK(wait_count(&r.w, &r.calls, n - OUT + 1, 20000) == 0);
        if (!killed && pair_now_ms() >= kill_at) {
            CHECK((hold = srv_kill_hold(&sp[0])) >= 0);
            killed = true;
            before_kill = n;
        }
        o[n] = (struct tcall){
            .r = &r, .seed = (uint32_t)n, .t0_ms = pair_now_ms(), .limit_ms = deadline + slack};
        CHECK_OK(bex_rpc_call(ch, SVC, M_LATE, late_body(ctx, (uint32_t)n), 64, NULL, ld_done,
                              &o[n], NULL));
        n++;
    }
    CHECK(killed);
    CHECK(wait_count(&r.w, &r.calls, n, 20000) == 0);
    tcall_show_failed(o, n, "kill");
    bex_rpc_endpoint_stats es[2];
    kill_check(ch, &r, n, before_kill, OUT, es);
    char name[64];
    ep_name(&sp[0].addr, name, sizeof name);
    CHECK_EQ(log_count(name, "step 1, reconnecting"), 1);
    /* the other replica was at OK: step 2 sent the calls there */
    CHECK(log_find(0, name, "step 2, calls go to other replicas") >= 0);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_ctx_destroy(ctx));
    close(hold);
    int rc = stop_server(&sp[0], true);
    rc |= stop_server(&sp[1], false);
    return rc ? 1 : 0;
}

/* ---- RDMA made unusable on the VM's wire ---- */

static pid_t drop_owner;
static FILE *tc_batch;

/* Ingress qdiscs on both ends of the veth wire, and a `tc -batch` reading
 * commands from us: started before the client's context exists (a fork
 * then copies no registered memory), and already running when the case
 * drops RoCE, so that the drop takes effect when asked, not after a tc
 * binary was loaded over the VM's 9p share (2 s under TCG). */
static void roce_prepare(void)
{
    if (system("modprobe -a sch_ingress cls_u32 act_gact >/dev/null 2>&1") != 0)
        fprintf(stderr, "modprobe sch_ingress cls_u32 act_gact failed (built in?)\n");
    CHECK(system("tc qdisc add dev veth0 ingress && tc qdisc add dev veth1 ingress") == 0);
    fflush(NULL);
    tc_batch = popen("exec tc -force -batch -", "w");
    CHECK(tc_batch);
}

/* Drop (on) or pass again (off) RoCE v2 (UDP 4791) at both veth ends'
 * ingress: the QPs' packets are lost, TCP passes. */
static void roce_drop(bool on)
{
    for (int i = 0; i < 2; i++)
        if (on)
            fprintf(tc_batch,
                    "filter add dev veth%d parent ffff: protocol ip prio 1 u32 match ip protocol "
                    "17 0xff match ip dport 4791 0xffff action drop\n",
                    i);
        else
            fprintf(tc_batch, "filter del dev veth%d parent ffff: prio 1\n", i);
    CHECK(fflush(tc_batch) == 0);
}

static void roce_cleanup(void)
{
    if (tc_batch) {
        pclose(tc_batch);
        tc_batch = NULL;
    }
    if (system("tc qdisc del dev veth0 ingress; tc qdisc del dev veth1 ingress") != 0)
        fprintf(stderr, "tc qdisc del failed\n");
}

static void roce_drop_atexit(void)
{
    if (getpid() == drop_owner)
        roce_cleanup();
}

/* Two replicas (both behind rxe0) under steady load; RoCE is dropped on the
 * wire: the QPs fail (ACK timeout 2^13 x 4.096 us, 3 retries: about 140 ms),
 * each endpoint reconnects (step 1, fails too), tries the other replica
 * (step 2, as broken) and falls back to TCP (step 3). Every call succeeds
 * within its deadline, and the first answer over TCP comes within 1 s of
 * the drop. With RoCE passing again, RDMA is probed (every 500 ms) and the
 * endpoints go back to it: calls are answered over RDMA again. */
static int t_rdma_unusable(void)
{
    RPC_NEED_ADDRS();
    if (pair_tcp())
        return bex_test_skip("an RDMA case (the VM's wire)");
    srv_qp_timeout = 13;
    srv_qp_retry_cnt = 3;
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    drop_owner = getpid();
    atexit(roce_drop_atexit);
    roce_prepare();
    bex_ctx *ctx = ladder_ctx(13, 3);
    CHECK(bex_ctx_pd(ctx) != NULL);
    bex_rpc_endpoint ep[2];
    bex_rpc_channel_config cc = chan_cfg(ep, sp, 2);
    const unsigned deadline = 3000 * time_scale();
    cc.request_timeout_ms = deadline; /* Tc: chan_cfg's (a loaded VM's RDMA setup took seconds) */
    /* a ping over rxe in the VM: about a millisecond, tens under load;
     * not scaled: the round trip is the kernel's (rxe), and a probe that
     * misses it only delays the return to RDMA by a period */
    cc.probe_timeout_ms = 100;
    const unsigned retry_ms = 500 * time_scale();
    cc.rdma_retry_ms = retry_ms;
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    bex_rpc_call_opts warm = {.timeout_ms = 20000 * time_scale()};
    for (int i = 0; i < 2; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, &warm, NULL, NULL));
    bex_sock_stats ss;
    bex_ctx_stats(ctx, &ss);
    CHECK_EQ(ss.tcp_conns, 0); /* both over RDMA */
    enum { OUT = 16, MAXN = 100000 };
    static struct tally r = {.w = WAITER_INIT};
    static struct tcall o[MAXN];
    const unsigned slack = 50 * time_scale();
    long n = 0;
    uint64_t start = pair_now_ms(), t_drop = 0, t_tcp = 0, t_pass = 0, t_back = 0;
    int mark = 0; /* the log from the drop on */
    bex_rpc_endpoint_stats es[2];
    bex_rpc_channel_stats st;
    for (;;) {
        uint64_t now = pair_now_ms();
        if (!t_drop && now >= start + 300 * time_scale()) {
            /* RDMA carries every call until now: a failure before the
             * drop (rxe under a loaded host) would make the rest moot */
            CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 2);
            CHECK(es[0].ladder == BEX_RPC_LADDER_OK && es[1].ladder == BEX_RPC_LADDER_OK);
            CHECK_EQ(es[0].tcp_answers + es[1].tcp_answers, 0);
            mark = log_mark();
            t_drop = pair_now_ms(); /* from the moment it is asked */
            roce_drop(true);
            fprintf(stderr, "rdma_unusable: RoCE dropped after %ld calls at %llu ms\n", n,
                    (unsigned long long)(t_drop % 100000));
        }
        if (t_drop && !t_tcp) {
            CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 2);
            if (es[0].tcp_answers + es[1].tcp_answers > 0) {
                t_tcp = now;
                fprintf(stderr, "rdma_unusable: first answer over TCP %llu ms after the drop\n",
                        (unsigned long long)(t_tcp - t_drop));
            } else if (now > t_drop + 10000 * time_scale()) {
                break; /* fails below */
            }
        }
        if (t_tcp && !t_pass && now >= t_tcp + 1000 * time_scale()) {
            roce_drop(false);
            t_pass = pair_now_ms();
        }
        if (t_pass && !t_back) {
            bex_rpc_channel_stats_get(ch, &st);
            CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 2);
            if (st.rdma_restored >= 2 && es[0].ladder == BEX_RPC_LADDER_OK &&
                es[1].ladder == BEX_RPC_LADDER_OK) {
                t_back = now;
                fprintf(stderr, "rdma_unusable: both back on RDMA %llu ms after RoCE passed\n",
                        (unsigned long long)(t_back - t_pass));
            } else if (now > t_pass + 20000 * time_scale()) {
                break;
            }
        }
        if (t_back && now >= t_back + 300 * time_scale())
            break;
        if (n >= MAXN)
            break;
        CHECK(wait_count(&r.w, &r.calls, n - OUT + 1, 20000) == 0);
        o[n] = (struct tcall){
            .r = &r, .seed = (uint32_t)n, .t0_ms = pair_now_ms(), .limit_ms = deadline + slack};
        CHECK_OK(bex_rpc_call(ch, SVC, M_ECHO, late_body(ctx, (uint32_t)n), 64, NULL, ld_done,
                              &o[n], NULL));
        n++;
    }
    CHECK(wait_count(&r.w, &r.calls, n, 30000) == 0);
    roce_cleanup();
    bex_rpc_channel_stats_get(ch, &st);
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 2);
    fprintf(stderr,
            "rdma_unusable: %ld calls, ok %ld, failed %ld, late %ld; steps %llu/%llu/%llu, "
            "recovered %llu, moves %llu, retries %llu (throttled %llu), RDMA retries %llu, "
            "restored %llu; TCP answers %llu + %llu\n",
            n, atomic_load(&r.ok), atomic_load(&r.bad), atomic_load(&r.late),
            (unsigned long long)st.ladder_reconnects, (unsigned long long)st.ladder_replicas,
            (unsigned long long)st.ladder_tcp, (unsigned long long)st.ladder_recovered,
            (unsigned long long)st.ladder_moves, (unsigned long long)st.retries,
            (unsigned long long)st.retry_throttled, (unsigned long long)st.rdma_retries,
            (unsigned long long)st.rdma_restored, (unsigned long long)es[0].tcp_answers,
            (unsigned long long)es[1].tcp_answers);
    tcall_show_failed(o, n, "rdma_unusable");
    CHECK(t_drop && t_tcp);
    CHECK(t_tcp - t_drop <= 1000 * time_scale()); /* calls on TCP within 1 s */
    CHECK(t_pass && t_back);                      /* and back on RDMA later */
    CHECK_EQ(atomic_load(&r.ok), n);              /* no call lost */
    CHECK_EQ(atomic_load(&r.late), 0);
    CHECK(st.ladder_tcp >= 1);
    CHECK(st.rdma_restored >= 2);
    /* at least one endpoint went the whole way, in order, each step once */
    bool whole = false;
    for (int i = 0; i < 2; i++) {
        char name[64];
        ep_name(&sp[i].addr, name, sizeof name);
        if (log_find(mark, name, "step 3, over TCP") >= 0) {
            check_order_from(mark, &sp[i].addr, true);
            whole = true;
        }
    }
    CHECK(whole);
    /* calls have left TCP: answers come, none over TCP */
    uint64_t tcp0 = es[0].tcp_answers + es[1].tcp_answers, ans0 = es[0].answers + es[1].answers;
    for (int i = 0; i < 10; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 2);
    CHECK_EQ(es[0].tcp_answers + es[1].tcp_answers, tcp0);
    CHECK_EQ(es[0].answers + es[1].answers, ans0 + 10);
    /* the probes' pings were answered by the servers themselves */
    CHECK(server_stats(ch).st.pings + server_stats(ch).st.pings >= 1);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_ctx_destroy(ctx));
    int rc = stop_server(&sp[0], false);
    rc |= stop_server(&sp[1], false);
    return rc ? 1 : 0;
}

BEX_TEST_MAIN({"steps", t_steps}, {"two_replicas", t_two_replicas}, {"directory", t_directory},
              {"kill", t_kill}, {"rdma_unusable", t_rdma_unusable})
