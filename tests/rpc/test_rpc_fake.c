/* SPDX-License-Identifier: Apache-2.0 */
/* RPC unit tests over fakenet (tests/rpc/fakenet.h): servers and clients
 * in one process, each on its own context over loopback TCP, every
 * connection wrapped by the fault-injecting transport, so that a failure
 * lands at a chosen point of a call (a request arriving at the primary, a
 * response on its way back, a large body part-way through) rather than
 * when a killed process or a timer happens to strike. Every case also
 * checks the transport contract fakenet keeps: each message handed to a
 * transport comes back exactly once. */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bex/dir.h"
#include "bex/rpc.h"
#include "harness.h"
#include "rpc/fakenet.h"
#include "rpc/internal.h"

enum { SVC = 7, M_ECHO = 1, M_NEVER = 2, M_WRITE = 3, M_WRITE_HOLD = 4, M_BUSY = 5 };

static unsigned scale(void)
{
    return bex_test_time_scale();
}

/* The RPC layer's clock in the cases that step it (bex__rpc_clock_hook):
 * it starts at the real time and moves only by fake_advance, so that a
 * deadline is reached when the case says, whatever the host's load. */
static _Atomic uint64_t fake_ns;

static uint64_t fake_clock(void)
{
    return atomic_load(&fake_ns);
}

static void fake_start(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    atomic_store(&fake_ns, (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec);
    bex__rpc_clock_hook(fake_clock);
}

static void fake_advance(unsigned ms)
{
    atomic_fetch_add(&fake_ns, ms * 1000000ull);
}

static bex_ctx *ctx_new(void)
{
    bex_ctx_config c = {
        .transport = BEX_TRANSPORT_TCP, .keepalive_timeout_ms = 60000, .connect_timeout_ms = 10000};
    bex_addr_parse("127.0.0.1", 0, &c.local_addr);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

/* ---- servers ---- */

struct server {
    bex_ctx *ctx;
    bex_rpc_server *srv;
    char tag;            /* echoed in front of every answer */
    _Atomic int echoes;  /* M_ECHO handled */
    _Atomic int applied; /* M_WRITE applied */
    _Atomic int big;     /* requests of 1 MiB or more handled */
    pthread_mutex_t mu;
    bex_rpc_req *held[64]; /* M_NEVER */
    int n_held;
    bex_addr addr;
};

static void h_echo(bex_rpc_req *req, void *body, size_t len, void *user)
{
    struct server *s = user;
    atomic_fetch_add(&s->echoes, 1);
    if (len >= (1u << 20))
        atomic_fetch_add(&s->big, 1);
    bex_rpc_free(body);
    char *r = bex_rpc_alloc(s->ctx, 1);
    CHECK(r != NULL);
    r[0] = s->tag;
    bex_rpc_reply(req, 0, r, 1);
}

static void h_never(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)len;
    struct server *s = user;
    bex_rpc_free(body);
    pthread_mutex_lock(&s->mu);
    CHECK(s->n_held < 64);
    s->held[s->n_held++] = req;
    pthread_mutex_unlock(&s->mu);
}

/* Always busy: a remote, retryable failure (-EAGAIN). */
static void h_busy(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)len;
    (void)user;
    bex_rpc_free(body);
    bex_rpc_reply(req, -EAGAIN, NULL, 0);
}

static void h_write(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)len;
    struct server *s = user;
    bex_rpc_free(body);
    uint32_t n = (uint32_t)atomic_fetch_add(&s->applied, 1) + 1;
    uint32_t *r = bex_rpc_alloc(s->ctx, sizeof n);
    CHECK(r != NULL);
    *r = n;
    bex_rpc_reply(req, 0, r, sizeof n);
}

static void server_start_cfg(struct server *s, char tag, const bex_rpc_server_config *cfg)
{
    memset(s, 0, sizeof(*s));
    s->tag = tag;
    pthread_mutex_init(&s->mu, NULL);
    s->ctx = ctx_new();
    CHECK_OK(bex_rpc_server_create(s->ctx, cfg, &s->srv));
    /* a WRITE whose handler holds the request (answered at server_stop) */
    CHECK_OK(bex_rpc_server_register(s->srv, SVC, M_WRITE_HOLD, BEX_RPC_METHOD_WRITE, h_never, s));
    CHECK_OK(bex_rpc_server_register(s->srv, SVC, M_ECHO, 0, h_echo, s));
    CHECK_OK(bex_rpc_server_register(s->srv, SVC, M_NEVER, 0, h_never, s));
    CHECK_OK(bex_rpc_server_register(s->srv, SVC, M_WRITE, BEX_RPC_METHOD_WRITE, h_write, s));
    CHECK_OK(bex_rpc_server_register(s->srv, SVC, M_BUSY, 0, h_busy, s));
    bex_addr a = {.in4 = {.sin_family = AF_INET}};
    inet_pton(AF_INET, "127.0.0.1", &a.in4.sin_addr);
    CHECK_OK(bex_rpc_server_listen(s->srv, &a));
    bex_rpc_server_addr(s->srv, &s->addr);
    CHECK(s->addr.in4.sin_port != 0);
}

static void server_start(struct server *s, char tag)
{
    server_start_cfg(s, tag, NULL);
}

static uint16_t port(const struct server *s)
{
    return ntohs(s->addr.in4.sin_port);
}

static void server_stop(struct server *s)
{
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->n_held; i++)
        bex_rpc_reply(s->held[i], -ECANCELED, NULL, 0);
    s->n_held = 0;
    pthread_mutex_unlock(&s->mu);
    CHECK_OK(bex_rpc_server_destroy(s->srv));
    CHECK_OK(bex_ctx_destroy(s->ctx));
    pthread_mutex_destroy(&s->mu);
}

static bex_rpc_server_stats server_stats(struct server *s)
{
    bex_rpc_server_stats st;
    bex_rpc_server_stats_get(s->srv, &st);
    return st;
}

/* ---- calls ---- */

struct result {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done; /* completions: must end at 1 */
    int status;
    char tag;
    uint32_t word;
    uint64_t t_done;
    uint64_t rpc_done; /* the RPC layer's clock then (ns) */
};

static void on_done(int status, void *body, size_t len, void *user)
{
    struct result *r = user;
    pthread_mutex_lock(&r->mu);
    r->done++;
    r->status = status;
    r->t_done = bex_test_now_ms();
    r->rpc_done = bex__rpc_now_ns();
    if (body && len >= 1)
        r->tag = ((char *)body)[0];
    if (body && len >= 4)
        memcpy(&r->word, body, 4);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    bex_rpc_free(body);
}

static void result_init(struct result *r)
{
    memset(r, 0, sizeof(*r));
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

/* Wait (at most ms, scaled) for the completion; fails the case on a hang. */
static void result_wait(struct result *r, unsigned ms)
{
    uint64_t end = bex_test_now_ms() + (uint64_t)ms * scale();
    pthread_mutex_lock(&r->mu);
    while (!r->done && bex_test_now_ms() < end) {
        pthread_mutex_unlock(&r->mu);
        bex_test_sleep_ms(1);
        pthread_mutex_lock(&r->mu);
    }
    int done = r->done;
    pthread_mutex_unlock(&r->mu);
    if (!done)
        fprintf(stderr, "call did not complete within %u ms\n", ms * scale());
    CHECK(done == 1);
}

static void call(bex_rpc_channel *ch, bex_ctx *ctx, uint32_t method, size_t len, uint32_t timeout,
                 struct result *r)
{
    result_init(r);
    void *b = NULL;
    if (len) {
        b = bex_rpc_alloc(ctx, len);
        CHECK(b != NULL);
        memset(b, 0x5a, len < 4096 ? len : 4096);
    }
    bex_rpc_call_opts o = {.timeout_ms = timeout};
    CHECK_OK(bex_rpc_call(ch, SVC, method, b, len, &o, on_done, r, NULL));
}

static bex_rpc_channel *chan(bex_ctx *ctx, struct server **srvs, int n, bex_rpc_channel_config c)
{
    bex_rpc_endpoint eps[4];
    for (int i = 0; i < n; i++)
        eps[i] = (bex_rpc_endpoint){.addr = srvs[i]->addr};
    c.endpoints = eps;
    c.n_endpoints = (size_t)n;
    if (!c.connect_timeout_ms)
        c.connect_timeout_ms = 2000 * scale();
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &c, &ch));
    return ch;
}

static bex_rpc_channel_stats chan_stats(bex_rpc_channel *ch)
{
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    return st;
}

/* Every message any transport was given came back once, and every wrapped
 * transport is gone (after the contexts were destroyed). */
static void check_contract(void)
{
    CHECK_EQ(fn_violations(), 0);
    CHECK_EQ(fn_live(), 0);
    CHECK_EQ(fn_sent(), fn_returned());
    CHECK(fn_sent() > 0);
}

/* The end of a case: the channel, the client's context, d (may be NULL)
 * and the servers (b may be NULL) gone; fakenet removed and its contract
 * checked. What the case returns. */
static int finish(bex_rpc_channel *ch, bex_ctx *cx, bex_dir *d, struct server *a, struct server *b)
{
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_ctx_destroy(cx));
    if (d)
        bex_dir_destroy(d);
    server_stop(a);
    if (b)
        server_stop(b);
    fn_uninstall();
    check_contract();
    return 0;
}

/* Every request and every ping the client sends to s fails its connection
 * before it leaves (a dead replica); the requests' rule, the pings' in
 * *pings. */
static int fail_to(struct server *s, int *pings)
{
    int rule = fn_add(&(struct fn_rule){.side = FN_CLIENT,
                                        .port = port(s),
                                        .dir = FN_TX,
                                        .kind = BEX__RPC_REQUEST,
                                        .action = FN_FAIL_BEFORE,
                                        .count = -1});
    *pings = fn_add(&(struct fn_rule){.side = FN_CLIENT,
                                      .port = port(s),
                                      .dir = FN_TX,
                                      .kind = FN_PING,
                                      .action = FN_FAIL_BEFORE,
                                      .count = -1});
    return rule;
}

/* An echo of 8 bytes, answered (within 3 s) by the server tagged tag. */
static void echo_from(bex_rpc_channel *ch, bex_ctx *cx, char tag)
{
    struct result r;
    call(ch, cx, M_ECHO, 8, 0, &r);
    result_wait(&r, 3000);
    CHECK_EQ(r.status, 0);
    CHECK_EQ(r.tag, tag);
}

/* ---- cases ---- */

/* Whether r has completed. */
static bool result_done(struct result *r)
{
    pthread_mutex_lock(&r->mu);
    bool d = r->done != 0;
    pthread_mutex_unlock(&r->mu);
    return d;
}

/* A handler that never answers, and a request the network loses: the call
 * completes with -ETIMEDOUT at its deadline, not before and not later.
 * The first part steps the RPC layer's clock (bex__rpc_clock_hook): the
 * deadline is exact, whatever the load; the second reads the real one,
 * for the channel's timer waking at a deadline on its own. */
static int deadline(void)
{
    fn_install();
    fake_start();
    struct server s;
    server_start(&s, 'A');
    bex_ctx *cx = ctx_new();
    struct server *sv[] = {&s};
    bex_rpc_channel *ch = chan(cx, sv, 1, (bex_rpc_channel_config){.request_timeout_ms = 5000});
    /* the connection is up first, so that the deadline measures only the call */
    struct result r;
    call(ch, cx, M_ECHO, 8, 2000 * scale(), &r);
    result_wait(&r, 3000);
    CHECK_EQ(r.status, 0);
    static const unsigned tmo[] = {40, 120, 300};
    for (int i = 0; i < 3; i++) {
        /* the handler holds it; the clock stands 1 ms short of the
         * deadline (the timer thread looks at it every millisecond: 20 ms
         * give it turns to misfire), then reaches it */
        uint64_t t0 = bex__rpc_now_ns();
        call(ch, cx, M_NEVER, 8, tmo[i], &r);
        /* held first: the clock does not wait for the request to arrive,
         * and on a loaded host (-j2 under TSan) it had not within the
         * 20 ms below, so the count after the loop was 2 */
        uint64_t end = bex_test_now_ms() + 2000ull * scale();
        pthread_mutex_lock(&s.mu);
        while (s.n_held < i + 1 && bex_test_now_ms() < end) {
            pthread_mutex_unlock(&s.mu);
            bex_test_sleep_ms(1);
            pthread_mutex_lock(&s.mu);
        }
        CHECK_EQ(s.n_held, i + 1);
        pthread_mutex_unlock(&s.mu);
        fake_advance(tmo[i] - 1);
        bex_test_sleep_ms(20);
        CHECK(!result_done(&r));
        fake_advance(1);
        result_wait(&r, 2000);
        CHECK_EQ(r.status, -ETIMEDOUT);
        CHECK_EQ(r.rpc_done - t0, tmo[i] * 1000000ull); /* at the deadline exactly */
    }
    pthread_mutex_lock(&s.mu);
    CHECK_EQ(s.n_held, 3); /* each did reach the handler */
    pthread_mutex_unlock(&s.mu);
    /* the real clock from here on, on a channel made after it is back */
    bex_rpc_channel_stats st = chan_stats(ch);
    CHECK_EQ(st.fail_timeout, 3);
    CHECK_EQ(st.ok, 1);
    CHECK_OK(bex_rpc_channel_destroy(ch));
    bex__rpc_clock_hook(NULL);
    ch = chan(cx, sv, 1, (bex_rpc_channel_config){.request_timeout_ms = 5000});
    call(ch, cx, M_ECHO, 8, 2000 * scale(), &r);
    result_wait(&r, 3000);
    CHECK_EQ(r.status, 0);
    /* late by scheduling at most (a loaded 2-core host at nice 19 showed
     * 45 ms), well below the channel timer's 1 s idle wake-up: a deadline
     * left to that, or to a later attempt, fails this */
    const unsigned slack = 150 * scale();
    /* the request is lost on its way: the handler never sees it */
    fn_clear();
    int drop = fn_add(&(struct fn_rule){.side = FN_SERVER,
                                        .port = port(&s),
                                        .dir = FN_RX,
                                        .kind = BEX__RPC_REQUEST,
                                        .action = FN_DROP,
                                        .count = -1});
    int echoes = atomic_load(&s.echoes);
    for (int i = 0; i < 3; i++) {
        uint64_t t0 = bex_test_now_ms();
        call(ch, cx, M_ECHO, 8, tmo[i], &r);
        result_wait(&r, 2000);
        CHECK_EQ(r.status, -ETIMEDOUT);
        CHECK(r.t_done - t0 >= tmo[i] && r.t_done - t0 <= tmo[i] + slack);
    }
    CHECK_EQ(fn_hits(drop), 3);
    CHECK_EQ(atomic_load(&s.echoes), echoes);
    st = chan_stats(ch);
    CHECK_EQ(st.fail_timeout, 3);
    CHECK_EQ(st.ok, 1);
    CHECK_EQ(st.retries, 0); /* attempt_timeout_ms 0: a timeout is not retried */
    return finish(ch, cx, NULL, &s, NULL);
}

/* The primary fails mid-call: the request reached its handler, which
 * answered, and the connection failed before the answer left. The call
 * moves to the other replica and succeeds there, well within its deadline. */
static int failover(void)
{
    fn_install();
    struct server a, b;
    server_start(&a, 'A');
    server_start(&b, 'B');
    int rule = fn_add(&(struct fn_rule){.side = FN_SERVER,
                                        .port = port(&a),
                                        .dir = FN_RX,
                                        .kind = BEX__RPC_REQUEST,
                                        .action = FN_FAIL_AFTER,
                                        .count = 1});
    bex_ctx *cx = ctx_new();
    struct server *sv[] = {&a, &b};
    bex_rpc_channel *ch = chan(cx, sv, 2, (bex_rpc_channel_config){.request_timeout_ms = 2000});
    struct result r;
    uint64_t t0 = bex_test_now_ms();
    call(ch, cx, M_ECHO, 64, 0, &r); /* round robin starts at the first endpoint: a */
    result_wait(&r, 3000);
    CHECK_EQ(r.status, 0);
    CHECK_EQ(r.tag, 'B');
    CHECK(r.t_done - t0 < 2000);
    CHECK_EQ(fn_hits(rule), 1);
    CHECK_EQ(atomic_load(&a.echoes), 1); /* the primary had it: mid-call */
    CHECK_EQ(atomic_load(&b.echoes), 1);
    bex_rpc_channel_stats st = chan_stats(ch);
    CHECK_EQ(st.retries, 1);
    CHECK_EQ(st.failovers, 1);
    CHECK_EQ(st.ok, 1);
    CHECK_EQ(st.failed, 0);
    CHECK(st.conn_failures >= 1);
    /* and calls go on, every one answered (by either) */
    for (int i = 0; i < 20; i++) {
        call(ch, cx, M_ECHO, 64, 0, &r);
        result_wait(&r, 3000);
        CHECK_EQ(r.status, 0);
        CHECK(r.tag == 'A' || r.tag == 'B');
    }
    return finish(ch, cx, NULL, &a, &b);
}

/* Quarantine through a directory: replica a (the client's pod, so picked
 * first) fails every request's connection; it is quarantined at the
 * (M + 1)th connection failure, not before, then left alone; after the
 * period one call probes it: while it still fails, the probe fails and it
 * is quarantined again; once it works, the probe lifts the quarantine. */
static int quarantine(void)
{
    fn_install();
    struct server a, b;
    server_start(&a, 'A');
    server_start(&b, 'B');
    const uint32_t M = 3, Q = 400 * scale();
    bex_dir_config dc = {.conn_fail_max = M,
                         .req_fail_max = 1000,
                         .fail_window_ms = 60000,
                         .quarantine_ms = Q,
                         .probe_timeout_ms = 5000};
    bex_dir *d;
    CHECK_OK(bex_dir_create(&dc, &d));
    char j[512], err[256];
    snprintf(j, sizeof j,
             "{\"services\":{\"svc\":{\"shards\":[{\"replicas\":["
             "{\"addr\":\"127.0.0.1:%u\",\"locality\":\"dc1/pod1\"},"
             "{\"addr\":\"127.0.0.1:%u\",\"locality\":\"dc1/pod2\"}]}]}}}",
             port(&a), port(&b));
    CHECK_OK(bex_dir_load_json(d, j, err, sizeof err));
    int pings;
    int rule = fail_to(&a, &pings);
    bex_ctx *cx = ctx_new();
    bex_rpc_channel_config cc = {.dir = d,
                                 .service = "svc",
                                 .locality = "dc1/pod1",
                                 .request_timeout_ms = 2000,
                                 .connect_timeout_ms = 2000 * scale(),
                                 .holddown_ms = 1,
                                 .retry_budget_burst = 1000};
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(cx, &cc, &ch));
    bex_dir_node_stats ns;
    struct result r;
    int calls = 0;
    for (;;) {
        echo_from(ch, cx, 'B'); /* the retry on b answers */
        calls++;
        CHECK_OK(bex_dir_node_stats_get(d, &a.addr, &ns));
        if (ns.state == BEX_DIR_QUARANTINED)
            break;
        CHECK(ns.conn_failures <= M); /* not before the threshold is passed */
        CHECK(calls < 50);
    }
    CHECK_EQ(ns.conn_failures, M + 1);
    CHECK_EQ(ns.quarantines, 1);
    /* quarantined: a is not tried (well within the period) */
    int hits = fn_hits(rule);
    uint64_t picks = ns.picks;
    int b_before = atomic_load(&b.echoes);
    for (int i = 0; i < 10; i++)
        echo_from(ch, cx, 'B');
    CHECK_OK(bex_dir_node_stats_get(d, &a.addr, &ns));
    CHECK_EQ(ns.state, BEX_DIR_QUARANTINED);
    CHECK_EQ(ns.picks, picks);
    CHECK_EQ(fn_hits(rule), hits);
    CHECK_EQ(atomic_load(&b.echoes), b_before + 10);
    /* the period passes; a still fails: its probe fails, quarantined again */
    bex_test_sleep_ms(Q + 50);
    call(ch, cx, M_ECHO, 8, 0, &r);
    result_wait(&r, 3000);
    CHECK_EQ(r.status, 0);
    CHECK_OK(bex_dir_node_stats_get(d, &a.addr, &ns));
    CHECK_EQ(ns.probes, 1);
    CHECK_EQ(ns.probe_failures, 1);
    CHECK_EQ(ns.state, BEX_DIR_QUARANTINED);
    CHECK_EQ(fn_hits(rule), hits + 1);
    /* a recovers; after the next period the probe lifts the quarantine */
    fn_clear();
    int a_before = atomic_load(&a.echoes);
    bex_test_sleep_ms(Q + 50);
    echo_from(ch, cx, 'A'); /* the probe went to a */
    CHECK_OK(bex_dir_node_stats_get(d, &a.addr, &ns));
    CHECK_EQ(ns.probes, 2);
    CHECK_EQ(ns.lifts, 1);
    CHECK_EQ(ns.state, BEX_DIR_HEALTHY);
    CHECK_EQ(atomic_load(&a.echoes), a_before + 1);
    /* and a, nearest, takes the calls again */
    for (int i = 0; i < 5; i++)
        echo_from(ch, cx, 'A');
    return finish(ch, cx, d, &a, &b);
}

/* A dead service: every request's connection fails before it leaves.
 * Retries stay within the budget (burst + permille of the calls), every
 * attempt that was allowed did go to the transport, and none more. */
static int budget(void)
{
    fn_install();
    struct server s;
    server_start(&s, 'A');
    int pings;
    int rule = fail_to(&s, &pings);
    bex_ctx *cx = ctx_new();
    struct server *sv[] = {&s};
    const unsigned burst = 10, permille = 100, calls = 100;
    bex_rpc_channel *ch = chan(cx, sv, 1,
                               (bex_rpc_channel_config){.request_timeout_ms = 2000,
                                                        .max_attempts = 3,
                                                        .retry_budget_burst = burst,
                                                        .retry_budget_permille = permille,
                                                        .holddown_ms = 1});
    struct result r;
    for (unsigned i = 0; i < calls; i++) {
        call(ch, cx, M_ECHO, 8, 0, &r);
        result_wait(&r, 3000);
        CHECK(r.status < 0 && r.status != -ETIMEDOUT); /* failed, fast */
    }
    bex_rpc_channel_stats st = chan_stats(ch);
    fprintf(stderr, "calls %llu attempts %llu retries %llu throttled %llu\n",
            (unsigned long long)st.calls, (unsigned long long)st.attempts,
            (unsigned long long)st.retries, (unsigned long long)st.retry_throttled);
    CHECK_EQ(st.calls, calls);
    CHECK_EQ(st.failed, calls);
    /* each call earns permille/1000 of a retry, capped at the burst; the
     * recovery ladder's moves off a failed connection are counted in
     * retries but not against the budget (include/bex/rpc.h) */
    uint64_t budgeted = st.retries - st.ladder_moves;
    CHECK(budgeted <= burst + calls * permille / 1000);
    CHECK(budgeted >= burst); /* the burst was there to spend */
    CHECK(st.retry_throttled >= calls / 2);
    CHECK_EQ(st.attempts, st.calls + st.retries);
    CHECK_EQ((uint64_t)fn_hits(rule), st.attempts); /* every attempt reached the wire */
    fprintf(stderr, "ladder moves %llu, pings %d\n", (unsigned long long)st.ladder_moves,
            fn_hits(pings));
    CHECK_EQ(atomic_load(&s.echoes), 0);
    return finish(ch, cx, NULL, &s, NULL);
}

/* Probabilistic retry (paper section 7.2): with retry_permille p below
 * 1000 a retryable failure is retried with chance p/1000. Every call's
 * first attempt is answered -EAGAIN; with two attempts and a budget that
 * never throttles, the retries are a binomial count: n calls, chance p.
 * The bound is 5 standard deviations either side (a false failure about
 * once in 1.7 million runs); p = 0 or 1000 would land far outside it. */
static int retry_coin(void)
{
    fn_install();
    struct server s;
    server_start(&s, 'A');
    bex_ctx *cx = ctx_new();
    struct server *sv[] = {&s};
    const unsigned calls = 600, permille = 250;
    bex_rpc_channel *ch = chan(cx, sv, 1,
                               (bex_rpc_channel_config){.request_timeout_ms = 5000,
                                                        .max_attempts = 2,
                                                        .retry_permille = permille,
                                                        .retry_budget_burst = 1000,
                                                        .retry_budget_permille = 1000});
    struct result r;
    for (unsigned i = 0; i < calls; i++) {
        call(ch, cx, M_BUSY, 8, 0, &r);
        result_wait(&r, 3000);
        CHECK_EQ(r.status, -EAGAIN); /* the server's answer, retried or not */
    }
    bex_rpc_channel_stats st = chan_stats(ch);
    double mean = calls * permille / 1000.0;
    double sd = sqrt(calls * (permille / 1000.0) * (1 - permille / 1000.0));
    fprintf(stderr, "calls %llu retries %llu (expected %.0f +- %.0f), throttled %llu\n",
            (unsigned long long)st.calls, (unsigned long long)st.retries, mean, 5 * sd,
            (unsigned long long)st.retry_throttled);
    CHECK_EQ(st.calls, calls);
    CHECK_EQ(st.retry_throttled, 0);
    CHECK_EQ(st.ladder_moves, 0);
    CHECK((double)st.retries >= mean - 5 * sd);
    CHECK((double)st.retries <= mean + 5 * sd);
    CHECK_EQ(st.attempts, st.calls + st.retries);
    CHECK_EQ(server_stats(&s).requests, st.attempts); /* each attempt reached the server */
    return finish(ch, cx, NULL, &s, NULL);
}

/* A retried write is applied once: its first answer is lost (dropped, or
 * with the connection), the attempt times out and is retried; the server's
 * dedup window answers the retry with the first result. */
static int write_once_with(int action)
{
    fn_install();
    struct server s;
    server_start(&s, 'A');
    int rule = fn_add(&(struct fn_rule){.side = FN_CLIENT,
                                        .port = port(&s),
                                        .dir = FN_RX,
                                        .kind = BEX__RPC_RESPONSE,
                                        .action = action,
                                        .count = 1});
    bex_ctx *cx = ctx_new();
    struct server *sv[] = {&s};
    bex_rpc_channel *ch =
        chan(cx, sv, 1,
             (bex_rpc_channel_config){
                 .request_timeout_ms = 3000, .attempt_timeout_ms = 100, .holddown_ms = 1});
    struct result r;
    call(ch, cx, M_WRITE, 8, 0, &r);
    result_wait(&r, 4000);
    CHECK_EQ(r.status, 0);
    CHECK_EQ(r.word, 1); /* the first (and only) application's result */
    CHECK_EQ(fn_hits(rule), 1);
    CHECK_EQ(atomic_load(&s.applied), 1);
    bex_rpc_server_stats ss = server_stats(&s);
    CHECK_EQ(ss.requests, 1);
    bex_rpc_channel_stats st = chan_stats(ch);
    CHECK(st.retries >= 1);
    /* every retry that reached the server was answered from the dedup
     * window; usually one, more when a loaded host lets a retry outlive
     * its 100 ms attempt too (seen once at load 19) */
    CHECK(ss.dup_replayed + ss.dup_pending >= 1);
    CHECK(ss.dup_replayed + ss.dup_pending <= st.retries);
    /* a new write is a new sequence: applied */
    call(ch, cx, M_WRITE, 8, 0, &r);
    result_wait(&r, 4000);
    CHECK_EQ(r.status, 0);
    CHECK_EQ(r.word, 2);
    CHECK_EQ(atomic_load(&s.applied), 2);
    return finish(ch, cx, NULL, &s, NULL);
}

static int write_once(void)
{
    return write_once_with(FN_DROP);
}

static int write_once_reset(void)
{
    return write_once_with(FN_FAIL_BEFORE);
}

/* A peer sending garbage (its requests' RPC headers garbled) is
 * disconnected at each one, while a well-behaved client of the same server,
 * on another context, makes calls all along without a single failure. */
struct good_run {
    bex_ctx *ctx;
    bex_rpc_channel *ch;
    _Atomic bool stop;
    int ok, bad;
};

static void *good_main(void *arg)
{
    struct good_run *g = arg;
    while (!atomic_load(&g->stop) || g->ok < 50) {
        struct result r;
        call(g->ch, g->ctx, M_ECHO, 64, 0, &r);
        result_wait(&r, 3000);
        if (r.status == 0)
            g->ok++;
        else
            g->bad++;
    }
    return NULL;
}

static int garbage(void)
{
    fn_install();
    struct server s;
    server_start(&s, 'A');
    bex_ctx *bad = ctx_new(), *good = ctx_new();
    int rule = fn_add(&(struct fn_rule){.side = FN_CLIENT,
                                        .port = port(&s),
                                        .sh = fn_sh(bad),
                                        .dir = FN_TX,
                                        .kind = BEX__RPC_REQUEST,
                                        .action = FN_GARBLE,
                                        .count = -1});
    struct server *sv[] = {&s};
    struct good_run g = {.ctx = good};
    g.ch = chan(good, sv, 1, (bex_rpc_channel_config){.request_timeout_ms = 2000});
    bex_rpc_channel *bch = chan(
        bad, sv, 1,
        (bex_rpc_channel_config){.request_timeout_ms = 2000, .max_attempts = 1, .holddown_ms = 1});
    pthread_t th;
    CHECK_OK(pthread_create(&th, NULL, good_main, &g));
    const int rounds = 5;
    for (int i = 0; i < rounds; i++) {
        struct result r;
        uint64_t t0 = bex_test_now_ms();
        call(bch, bad, M_ECHO, 64, 0, &r);
        result_wait(&r, 3000);
        /* disconnected: a connection error, not an answer nor the deadline */
        CHECK(r.status < 0 && r.status != -ETIMEDOUT);
        CHECK(r.t_done - t0 < 1000 * scale());
    }
    atomic_store(&g.stop, true);
    CHECK_OK(pthread_join(th, NULL));
    /* every garbled request closed its connection (the recovery ladder's
     * pings are not garbled) */
    bex_rpc_server_stats ss = server_stats(&s);
    CHECK_EQ(fn_hits(rule), rounds);
    CHECK_EQ(ss.bad_header, rounds);
    CHECK_EQ(g.bad, 0);
    CHECK(g.ok >= 50);
    CHECK_EQ(atomic_load(&s.echoes), g.ok); /* no garbled request reached a handler */
    bex_rpc_channel_stats st = chan_stats(g.ch);
    CHECK_EQ(st.failed, 0);
    CHECK_EQ(st.conn_failures, 0);
    CHECK_EQ(st.retries, 0);
    CHECK_OK(bex_rpc_channel_destroy(g.ch));
    CHECK_OK(bex_ctx_destroy(good));
    return finish(bch, bad, NULL, &s, NULL);
}

/* A transport failure in the middle of a large request body: the server
 * never reads, so the body stalls part-way (what the socket buffers took);
 * the client's connection then fails. big_fail: 48 MiB, part of it still
 * queued (not framed) in the TCP transport; big_fail_framed: 3 MiB with
 * small socket buffers, framed whole and written in part. The body comes back once (the
 * transport contract, fakenet), the call completes once with the
 * connection's error, the client's pool has every byte back, and so has
 * the server's receive pool (the part it had read is freed). */
static size_t in_use(bex_mem_pool *p)
{
    bex_mem_stats st;
    bex_mem_pool_collect(p);
    bex_mem_pool_stats(p, &st);
    return st.in_use_bytes;
}

static int big_fail_with(bool framed)
{
    fn_install();
    struct server s;
    server_start(&s, 'A');
    int noread = fn_add(
        &(struct fn_rule){.side = FN_SERVER, .port = port(&s), .action = FN_NO_READ, .count = -1});
    int small[2] = {-1, -1};
    if (framed) {
        /* small socket buffers on both ends: a 3 MiB body (48 frames, one
         * batch of the TCP transport) is framed whole at once, and most of
         * it cannot be written */
        small[0] = fn_add(&(struct fn_rule){
            .side = FN_SERVER, .port = port(&s), .action = FN_SMALL_BUF, .count = -1});
        small[1] = fn_add(&(struct fn_rule){
            .side = FN_CLIENT, .port = port(&s), .action = FN_SMALL_BUF, .count = -1});
    }
    bex_ctx *cx = ctx_new();
    struct server *sv[] = {&s};
    bex_rpc_channel *ch =
        chan(cx, sv, 1, (bex_rpc_channel_config){.request_timeout_ms = 20000, .max_attempts = 1});
    bex_mem_pool *cpool = bex_ctx_pool(cx), *spool = bex_ctx_recv_pool(s.ctx);
    size_t c0 = in_use(cpool);
    const size_t len = framed ? 3u << 20 : 48u << 20;
    struct result r;
    call(ch, cx, M_ECHO, len, 0, &r);
    CHECK(in_use(cpool) >= c0 + len);
    uint64_t end = bex_test_now_ms() + 5000 * scale();
    bool (*seen)(void) = framed ? fn_framed_seen : fn_partial_seen;
    while (!seen() && bex_test_now_ms() < end)
        bex_test_sleep_ms(5);
    CHECK(seen());          /* framed in part (written in part), or framed whole */
    bex_test_sleep_ms(100); /* the writes stall on the full socket */
    if (framed) {
        CHECK_EQ(fn_hits(small[0]), 1);
        CHECK_EQ(fn_hits(small[1]), 1);
    }
    pthread_mutex_lock(&r.mu);
    CHECK_EQ(r.done, 0);
    pthread_mutex_unlock(&r.mu);
    CHECK_EQ(fn_hits(noread), 1);
    uint64_t sent0 = fn_sent(), ret0 = fn_returned();
    CHECK(sent0 > ret0); /* the body is out with the transport */
    uint64_t t0 = bex_test_now_ms();
    CHECK_EQ(fn_fail_conns(FN_CLIENT, port(&s)), 1);
    result_wait(&r, 2000);
    CHECK(r.status < 0 && r.status != -ETIMEDOUT);
    CHECK(r.t_done - t0 < 1000 * scale());
    CHECK_EQ(fn_violations(), 0);
    /* the client's buffers: all back */
    end = bex_test_now_ms() + 2000 * scale();
    while (in_use(cpool) > c0 && bex_test_now_ms() < end)
        bex_test_sleep_ms(5);
    CHECK(in_use(cpool) <= c0);
    /* the server saw the close, read what was buffered into a partial body,
     * and freed it: nothing reached the handler */
    end = bex_test_now_ms() + 2000 * scale();
    while (in_use(spool) > 0 && bex_test_now_ms() < end)
        bex_test_sleep_ms(5);
    CHECK_EQ(in_use(spool), 0);
    CHECK_EQ(atomic_load(&s.big), 0);
    CHECK_EQ(server_stats(&s).requests, 0);
    bex_rpc_channel_stats st = chan_stats(ch);
    CHECK_EQ(st.fail_conn, 1);
    return finish(ch, cx, NULL, &s, NULL);
}

static int big_fail(void)
{
    return big_fail_with(false);
}

static int big_fail_framed(void)
{
    return big_fail_with(true);
}

/* A write on ch, waited for: its status; *word its answer. */
static int write_wait(bex_rpc_channel *ch, bex_ctx *cx, uint32_t *word)
{
    struct result r;
    call(ch, cx, M_WRITE, 8, 0, &r);
    result_wait(&r, 5000);
    if (word)
        *word = r.word;
    return r.status;
}

/* Issue 23 item 4, RPC: a peer that knows a client's id (not its token)
 * neither pre-empts its next write nor locks it out with a sequence far
 * ahead: its records are its own. */
static int dedup_spoof(void)
{
    fn_install();
    struct server s;
    server_start(&s, 'A');
    bex_ctx *cx = ctx_new();
    struct server *sv[] = {&s};
    bex_rpc_channel_config cc = {.request_timeout_ms = 3000, .client_id = 0x5eed};
    bex_rpc_channel *victim = chan(cx, sv, 1, cc), *thief = chan(cx, sv, 1, cc);
    uint32_t w;
    CHECK_OK(write_wait(victim, cx, &w));
    CHECK_EQ(w, 1);
    /* the thief's sequence 1 is its own: applied, not the victim's answer */
    CHECK_OK(write_wait(thief, cx, &w));
    CHECK_EQ(w, 2);
    /* the thief runs 300 sequences ahead (past the window of 256) */
    for (int i = 0; i < 300; i++)
        CHECK_OK(write_wait(thief, cx, NULL));
    CHECK_OK(write_wait(victim, cx, &w)); /* sequence 2: applied, not -ESTALE */
    CHECK_EQ(w, 303);
    CHECK_EQ(server_stats(&s).stale, 0);
    CHECK_OK(bex_rpc_channel_destroy(thief));
    return finish(victim, cx, NULL, &s, NULL);
}

/* Issue 23 item 4, RPC: a table of 4 clients; a client whose write is
 * pending (its handler holds it) is not forgotten when fresh client ids
 * come: they are refused -EAGAIN (retriable) once the table is full of
 * clients within the retry horizon, and the pending client's retry after
 * a reconnection is not applied again. */
static int dedup_pending(void)
{
    fn_install();
    struct server s;
    server_start_cfg(&s, 'A', &(bex_rpc_server_config){.dedup_clients = 4});
    bex_ctx *cx = ctx_new();
    struct server *sv[] = {&s};
    bex_rpc_channel *held = chan(cx, sv, 1, (bex_rpc_channel_config){.request_timeout_ms = 20000});
    struct result r;
    call(held, cx, M_WRITE_HOLD, 8, 0, &r);
    for (uint64_t end = bex_test_now_ms() + 5000ull * scale(); bex_test_now_ms() < end;) {
        pthread_mutex_lock(&s.mu);
        int n = s.n_held;
        pthread_mutex_unlock(&s.mu);
        if (n)
            break;
        bex_test_sleep_ms(1);
    }
    int refused = 0;
    for (int i = 0; i < 8; i++) {
        bex_rpc_channel *f = chan(
            cx, sv, 1, (bex_rpc_channel_config){.request_timeout_ms = 3000, .max_attempts = 1});
        int rc = write_wait(f, cx, NULL);
        CHECK(rc == 0 || rc == -EAGAIN);
        refused += rc == -EAGAIN;
        CHECK_OK(bex_rpc_channel_destroy(f));
    }
    CHECK_EQ(refused, 5); /* 3 took the free places */
    CHECK_EQ(server_stats(&s).clients_refused, 5);
    /* the held write's connection fails: its retry comes on a new one */
    CHECK(fn_fail_conns(FN_CLIENT, port(&s)) >= 1);
    for (uint64_t end = bex_test_now_ms() + 5000ull * scale();
         bex_test_now_ms() < end && !server_stats(&s).dup_pending;)
        bex_test_sleep_ms(1);
    CHECK_EQ(server_stats(&s).dup_pending, 1);
    pthread_mutex_lock(&s.mu);
    CHECK_EQ(s.n_held, 1); /* not applied again */
    pthread_mutex_unlock(&s.mu);
    CHECK(!result_done(&r));
    server_stop(&s); /* answers it -ECANCELED */
    result_wait(&r, 5000);
    CHECK_EQ(r.status, -ECANCELED);
    CHECK_OK(bex_rpc_channel_destroy(held));
    CHECK_OK(bex_ctx_destroy(cx));
    fn_uninstall();
    check_contract();
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(deadline), BEX_CASE(failover), BEX_CASE(quarantine), BEX_CASE(budget),
              BEX_CASE(retry_coin), BEX_CASE(write_once), BEX_CASE(write_once_reset),
              BEX_CASE(garbage), BEX_CASE(big_fail), BEX_CASE(big_fail_framed),
              BEX_CASE(dedup_spoof), BEX_CASE(dedup_pending))
