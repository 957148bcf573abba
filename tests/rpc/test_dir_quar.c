/* Quarantine when the other replica of the shard dies (issue 9 item 6,
 * "never all replicas of a shard at once"), end to end over TCP natively
 * (tcp). Replica A (in the client's pod) is quarantined for request
 * failures (calls it answers too late), with a period far longer than the
 * case; then replica B, the shard's last one outside quarantine, is killed
 * with -9:
 * - other_dies: A still answers; every call after the kill succeeds
 *   within its deadline, through A, which is probed at once (not after its
 *   period) and whose quarantine is lifted by the probe's answer;
 * - both_die: A was killed before B; A's early probe fails and A is
 *   quarantined again, B stays outside quarantine, and every call fails
 *   with a connection error within its deadline, none hangs. */
#include <sys/wait.h>

#include "bex/dir.h"
#include "rpc/rpc_test.h"

static _Atomic int n_early, n_early_failed, n_lifted;

static void qlog(int level, const char *msg, void *arg)
{
    (void)arg;
    if (strstr(msg, "probed before its quarantine ends"))
        atomic_fetch_add(&n_early, 1);
    if (strstr(msg, "failed its early probe"))
        atomic_fetch_add(&n_early_failed, 1);
    if (strstr(msg, "quarantine lifted"))
        atomic_fetch_add(&n_lifted, 1);
    fprintf(stderr, "dir log (level %d): %s\n", level, msg);
}

/* A quarantine far longer than any case: only the fix may end it early. */
#define QUARANTINE_MS 600000u

/* ps/0 on sp[0] (A, the client's pod) and sp[1] (B, another pod); more than
 * 2 failures of a kind quarantine a node. */
static bex_dir *mkdir2(const struct srv_proc *sp)
{
    bex_dir_config c = {.conn_fail_max = 2,
                        .req_fail_max = 2,
                        .fail_window_ms = QUARANTINE_MS,
                        .quarantine_ms = QUARANTINE_MS,
                        .log_fn = qlog,
                        .log_level = BEX_LOG_INFO};
    bex_dir *d;
    CHECK_OK(bex_dir_create(&c, &d));
    dir_load_ps(d, sp, 2, 1, NULL);
    return d;
}

static bex_dir_node_stats nstats(bex_dir *d, const struct srv_proc *sp)
{
    bex_dir_node_stats s;
    CHECK_OK(bex_dir_node_stats_get(d, &sp->addr, &s));
    return s;
}

/* Kill a server with -9 and reap it, so that it is gone before the next
 * call. */
static void kill9(struct srv_proc *sp)
{
    CHECK(kill(sp->pid, SIGKILL) == 0);
    int status = 0;
    CHECK(waitpid(sp->pid, &status, 0) == sp->pid);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    close(sp->to_child);
}

/* The call deadline of the cases after the kill (scaled). */
static unsigned deadline_ms(void)
{
    return 1000 * time_scale();
}

/* A channel over d with A quarantined for request failures (calls it
 * answered after their deadline) and B, the shard's other replica, taking
 * the calls. */
static bex_rpc_channel *setup(bex_ctx *ctx, bex_dir *d, const struct srv_proc *sp)
{
    bex_rpc_channel_config cc = {
        .dir = d,
        .service = "ps",
        .shard = 0,
        .locality = "dc1/pod1",
        .name = "quar",
        .request_timeout_ms = deadline_ms(),
        .connect_timeout_ms = 1000 * time_scale(),
        .retry_budget_burst = 100,
    };
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    /* A is nearest: these go there, are answered 1 s late, and each
     * times out (a request failure); the third passes the threshold */
    const bex_rpc_call_opts slow = {.timeout_ms = 100 * time_scale(),
                                    .flags = BEX_RPC_CALL_NO_RETRY};
    for (int i = 0; i < 3; i++) {
        uint32_t *b = bex_rpc_alloc(ctx, sizeof *b);
        CHECK(b);
        *b = 1000 * time_scale();
        CHECK_EQ(bex_rpc_call_sync(ch, SVC, M_LATE, b, sizeof *b, &slow, NULL, NULL), -ETIMEDOUT);
    }
    bex_dir_node_stats a = nstats(d, &sp[0]);
    CHECK_EQ(a.state, BEX_DIR_QUARANTINED);
    CHECK(a.req_failures >= 3 && a.quarantines == 1);
    /* B takes the calls now, over a connection that is up when it dies */
    for (int i = 0; i < 5; i++)
        CHECK_OK(bex_rpc_call_sync(ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL));
    CHECK_EQ(nstats(d, &sp[1]).ok, 5);
    CHECK_EQ(nstats(d, &sp[0]).state, BEX_DIR_QUARANTINED);
    return ch;
}

/* One echo call of 64 bytes (seed i) with the case's deadline: its status
 * (-EPROTO for a wrong body), its time in *took_ms. */
static int echo(bex_ctx *ctx, bex_rpc_channel *ch, uint32_t i, uint64_t *took_ms)
{
    uint8_t *b = bex_rpc_alloc(ctx, 64);
    CHECK(b);
    fill_pattern(b, 64, i);
    const bex_rpc_call_opts o = {.timeout_ms = deadline_ms()};
    void *resp = NULL;
    size_t len = 0;
    uint64_t t0 = pair_now_ms();
    int rc = bex_rpc_call_sync(ch, SVC, M_ECHO, b, 64, &o, &resp, &len);
    *took_ms = pair_now_ms() - t0;
    if (!rc && (len != 64 || check_pattern(resp, len, i)))
        rc = -EPROTO;
    bex_rpc_free(resp);
    return rc;
}

static void print_stats(const char *what, bex_dir *d, const struct srv_proc *sp,
                        bex_rpc_channel *ch)
{
    bex_dir_node_stats a = nstats(d, &sp[0]), b = nstats(d, &sp[1]);
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    fprintf(stderr,
            "%s: A state %d picks %llu ok %llu conn_fail %llu req_fail %llu quarantines %llu "
            "probes %llu probe_fail %llu lifts %llu; B state %d picks %llu conn_fail %llu "
            "refused %llu; channel retries %llu failovers %llu ladder moves %llu\n",
            what, a.state, (unsigned long long)a.picks, (unsigned long long)a.ok,
            (unsigned long long)a.conn_failures, (unsigned long long)a.req_failures,
            (unsigned long long)a.quarantines, (unsigned long long)a.probes,
            (unsigned long long)a.probe_failures, (unsigned long long)a.lifts, b.state,
            (unsigned long long)b.picks, (unsigned long long)b.conn_failures,
            (unsigned long long)b.quarantine_refused, (unsigned long long)st.retries,
            (unsigned long long)st.failovers, (unsigned long long)st.ladder_moves);
}

/* B dies while A is quarantined and well: calls go on through A at once. */
static int t_other_dies(void)
{
    (void)chan_cfg; /* rpc_test.h's fixed-list helper: directory mode here */
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    bex_dir *d = mkdir2(sp);
    bex_rpc_channel *ch = setup(ctx, d, sp);
    kill9(&sp[1]);
    const unsigned slack = 50 * time_scale();
    int failed = 0;
    uint64_t worst = 0;
    for (uint32_t i = 0; i < 20; i++) {
        uint64_t took;
        int rc = echo(ctx, ch, i, &took);
        if (rc || took > deadline_ms() + slack) {
            fprintf(stderr, "call %u: %s after %llu ms\n", i, bex_strerror(rc),
                    (unsigned long long)took);
            failed++;
        }
        if (took > worst)
            worst = took;
    }
    print_stats("other_dies", d, sp, ch);
    fprintf(stderr, "other_dies: %d of 20 calls failed or late, slowest %llu ms\n", failed,
            (unsigned long long)worst);
    CHECK_EQ(failed, 0);
    /* A was probed at once, answered, and is out of quarantine: lifted
     * once, by the early probe (logged once) */
    bex_dir_node_stats a = nstats(d, &sp[0]);
    CHECK_EQ(a.state, BEX_DIR_HEALTHY);
    CHECK_EQ(a.quarantines, 1);
    CHECK_EQ(a.probes, 1);
    CHECK_EQ(a.early_probes, 1);
    CHECK_EQ(a.probe_failures, 0);
    CHECK_EQ(a.lifts, 1);
    CHECK(a.ok >= 20);
    /* the calls were A's server's: its own count (20 echoes, this call and
     * the 3 slow ones at least) */
    struct tstats t = server_stats(ch);
    CHECK(t.st.requests >= 24);
    CHECK_EQ(atomic_load(&n_early), 1);
    CHECK_EQ(atomic_load(&n_lifted), 1);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_EQ(nstats(d, &sp[0]).outstanding, 0);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    return stop_server(&sp[0], false) ? 1 : 0;
}

struct rec {
    _Atomic long calls, ok, late, twice;
    struct waiter w;
};

struct one {
    struct rec *r;
    uint64_t t0_ms;
    int status;
    _Atomic int done;
};

static void one_done(int status, void *body, size_t len, void *user)
{
    (void)len;
    struct one *o = user;
    struct rec *r = o->r;
    if (atomic_fetch_add(&o->done, 1))
        atomic_fetch_add(&r->twice, 1);
    o->status = status;
    if (pair_now_ms() > o->t0_ms + deadline_ms() + 50 * time_scale())
        atomic_fetch_add(&r->late, 1);
    if (!status)
        atomic_fetch_add(&r->ok, 1);
    bex_rpc_free(body);
    waiter_add(&r->w, &r->calls, 1);
}

/* What a call to two dead replicas may fail with: their connections'
 * errors, not a deadline run out nor anything else. */
static bool conn_error(int rc)
{
    return rc == -ECONNREFUSED || rc == -ECONNRESET || rc == -EPIPE;
}

/* B dies after A, A quarantined: A is probed early and fails its probe;
 * calls fail with a connection error within their deadline. */
static int t_both_die(void)
{
    RPC_NEED_ADDRS();
    struct srv_proc sp[2];
    spawn_server(&sp[0], false);
    spawn_server(&sp[1], false);
    bex_ctx *ctx = client_ctx();
    bex_dir *d = mkdir2(sp);
    bex_rpc_channel *ch = setup(ctx, d, sp);
    kill9(&sp[0]);
    /* A died a while ago: past the channel's hold-down of it (100 ms), so
     * that nothing but quarantine keeps calls off it */
    pair_sleep_ms(300 * time_scale());
    kill9(&sp[1]);
    const unsigned slack = 50 * time_scale();
    int bad = 0;
    for (uint32_t i = 0; i < 10; i++) {
        uint64_t took;
        int rc = echo(ctx, ch, i, &took);
        fprintf(stderr, "call %u: %s after %llu ms\n", i, bex_strerror(rc),
                (unsigned long long)took);
        if (!conn_error(rc) || took > deadline_ms() + slack)
            bad++;
    }
    /* and many at once */
    enum { N = 32 };
    static struct rec r = {.w = WAITER_INIT};
    static struct one o[N];
    for (int i = 0; i < N; i++) {
        o[i] = (struct one){.r = &r, .t0_ms = pair_now_ms()};
        CHECK_OK(bex_rpc_call(ch, SVC, M_ECHO, NULL, 0, NULL, one_done, &o[i], NULL));
    }
    CHECK(wait_count(&r.w, &r.calls, N, 10000) == 0);
    for (int i = 0; i < N; i++)
        if (!conn_error(o[i].status)) {
            fprintf(stderr, "concurrent call %d: %s\n", i, bex_strerror(o[i].status));
            bad++;
        }
    print_stats("both_die", d, sp, ch);
    CHECK_EQ(bad, 0);
    CHECK_EQ(atomic_load(&r.ok), 0);
    CHECK_EQ(atomic_load(&r.late), 0);
    CHECK_EQ(atomic_load(&r.twice), 0);
    /* A was probed before its period ended, failed, and was quarantined
     * again (and may be ready for another probe by B's last failure: not
     * healthy either way); B, the last replica outside quarantine, stays
     * out of it */
    bex_dir_node_stats a = nstats(d, &sp[0]), b = nstats(d, &sp[1]);
    CHECK(a.probes >= 1 && a.probe_failures >= 1);
    CHECK(a.early_probes >= a.probes);
    CHECK_EQ(a.quarantines, 1 + a.probe_failures);
    CHECK_EQ(a.lifts, 0);
    CHECK(a.state == BEX_DIR_QUARANTINED || a.state == BEX_DIR_PROBING);
    CHECK_EQ(b.state, BEX_DIR_HEALTHY);
    CHECK(b.quarantine_refused >= 1);
    /* logged once each, however often it happened */
    CHECK_EQ(atomic_load(&n_early), 1);
    CHECK_EQ(atomic_load(&n_early_failed), 1);
    CHECK_EQ(atomic_load(&n_lifted), 0);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_EQ(nstats(d, &sp[0]).outstanding, 0);
    CHECK_EQ(nstats(d, &sp[1]).outstanding, 0);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

BEX_TEST_MAIN({"other_dies", t_other_dies}, {"both_die", t_both_die})
