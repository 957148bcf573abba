/* SPDX-License-Identifier: Apache-2.0 */
/* RPC test scaffolding: RPC servers in child processes (forked before the
 * client's context exists), each on BEX_TEST_ADDR0 with its own port,
 * serving the test methods below; the client runs in the parent on
 * BEX_TEST_ADDR1. Over TCP natively (BEX_TEST_TRANSPORT=tcp, loopback) or
 * over RDMA in the VM, as tests/sock/pair.h decides.
 *
 * A server child leaves through exit() after a full teardown (held
 * requests answered, server and context destroyed), so a leak or a hang
 * there fails the case; stop_server() checks its exit status. */
#ifndef BEX_TEST_RPC_H
#define BEX_TEST_RPC_H

#include "bex/dir.h"
#include "bex/rpc.h"
#include "rpc/internal.h"
#include "sock/child.h"

enum {
    SVC = 7,
    M_ECHO = 1,
    M_NEVER = 2,  /* held; answered -ECANCELED at teardown */
    M_WRITE = 3,  /* WRITE: applied count + 1, answered with the count */
    M_EAGAIN = 4, /* always -EAGAIN (a failing service), counted */
    M_THREAD = 5, /* echo, answered from a worker thread */
    M_STATS = 6,  /* the server's counters (struct tstats) */
    M_LATE = 7,   /* echo from the worker after a delay (u32 ms in the body) */
    M_FLAKY = 8,  /* WRITE: the first request ever is refused -EAGAIN (not
                     applied), later ones as M_WRITE */
    M_SLOWW = 9,  /* WRITE: applied at once (counted with M_WRITE), its
                     connection closed, answered 300 ms (scaled) later from
                     the worker */
    M_HOLD1 = 10, /* the first request of it held (answered -ECANCELED at
                     teardown), later ones echoed */
};

/* Keepalive timeout of both sides' contexts (scaled): the RPC cases are not
 * about keepalive, and on a loaded host the VM stalled long enough for the
 * 2 s default to fail a connection mid-case (test_rpc.threads). Failures
 * the cases want (a killed server) show as a reset connection at once. */
#define RPC_KEEPALIVE_MS 10000
/* The contexts' setup deadline (scaled; bex's default is 3 s): a loaded VM
 * took over 3 s to set up an RDMA connection (the server closed it, the
 * client saw it refused: test_rpc.deadline). */
#define RPC_SETUP_MS 10000

/* The dedup window of the next spawn_server (0: the default). */
static uint32_t srv_window;
/* The QP's ACK timeout exponent and retry count of the next spawn_server's
 * context (0: the defaults), for cases that time RDMA failure detection. */
static uint8_t srv_qp_timeout, srv_qp_retry_cnt;

/* A case returns at once with the skip (or failure) pair_addrs decides. */
#define RPC_NEED_ADDRS()                                                                           \
    do {                                                                                           \
        struct in_addr a0_, a1_;                                                                   \
        int rc_ = pair_addrs(&a0_, &a1_);                                                          \
        if (rc_)                                                                                   \
            return rc_;                                                                            \
    } while (0)

struct tstats {
    int64_t applied, eagain, malformed_logs;
    bex_rpc_server_stats st;
};

struct work {
    bex_rpc_req *req;
    void *body;
    size_t len;
    uint64_t due_ms;
    struct work *next;
};

static struct {
    bex_ctx *ctx;
    bex_rpc_server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct work *q;    /* for the worker */
    struct work *held; /* M_NEVER */
    bool stop;
    _Atomic int64_t applied, eagain, malformed_logs;
    bool drop_first_write; /* lose the first WRITE's answer (close its connection) */
} ts = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void ts_log(int level, const char *msg, void *arg)
{
    (void)arg;
    if (strstr(msg, "malformed"))
        atomic_fetch_add(&ts.malformed_logs, 1);
    fprintf(stderr, "bex (server %d, level %d): %s\n", (int)getpid(), level, msg);
}

static void h_echo(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    bex_rpc_reply(req, 0, body, len); /* zero-copy: the request goes back */
}

static void queue_work(bex_rpc_req *req, void *body, size_t len, uint64_t due, bool held)
{
    struct work *w = calloc(1, sizeof(*w));
    CHECK(w);
    *w = (struct work){.req = req, .body = body, .len = len, .due_ms = due};
    pthread_mutex_lock(&ts.mu);
    struct work **list = held ? &ts.held : &ts.q;
    w->next = *list;
    *list = w;
    pthread_cond_broadcast(&ts.cv);
    pthread_mutex_unlock(&ts.mu);
}

static void h_never(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    queue_work(req, body, len, 0, true);
}

static void h_thread(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    queue_work(req, body, len, 0, false);
}

static void h_late(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    uint32_t ms = 0;
    if (len >= 4)
        memcpy(&ms, body, 4);
    queue_work(req, body, len, pair_now_ms() + ms, false);
}

static void h_write(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    (void)len;
    bex_rpc_free(body);
    int64_t n = atomic_fetch_add(&ts.applied, 1) + 1;
    int64_t *out = bex_rpc_alloc(ts.ctx, sizeof n);
    CHECK(out);
    *out = n;
    if (ts.drop_first_write && n == 1)
        bex__rpc_req_close_conn(req); /* the answer below is lost */
    bex_rpc_reply(req, 0, out, sizeof n);
}

static void h_flaky(bex_rpc_req *req, void *body, size_t len, void *user)
{
    static _Atomic int seen;
    if (atomic_fetch_add(&seen, 1) == 0) {
        bex_rpc_free(body);
        bex_rpc_reply(req, -EAGAIN, NULL, 0);
        return;
    }
    h_write(req, body, len, user);
}

static void h_hold1(bex_rpc_req *req, void *body, size_t len, void *user)
{
    static _Atomic int seen;
    if (atomic_fetch_add(&seen, 1) == 0)
        queue_work(req, body, len, 0, true);
    else
        h_echo(req, body, len, user);
}

static void h_slow_write(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    (void)len;
    bex_rpc_free(body);
    int64_t n = atomic_fetch_add(&ts.applied, 1) + 1;
    int64_t *out = bex_rpc_alloc(ts.ctx, sizeof n);
    CHECK(out);
    *out = n;
    bex__rpc_req_close_conn(req); /* the client retries on a new connection */
    queue_work(req, out, sizeof n, pair_now_ms() + 300 * time_scale(), false);
}

static void h_eagain(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    (void)len;
    bex_rpc_free(body);
    atomic_fetch_add(&ts.eagain, 1);
    bex_rpc_reply(req, -EAGAIN, NULL, 0);
}

static void h_stats(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    (void)len;
    bex_rpc_free(body);
    struct tstats *t = bex_rpc_alloc(ts.ctx, sizeof *t);
    CHECK(t);
    t->applied = atomic_load(&ts.applied);
    t->eagain = atomic_load(&ts.eagain);
    t->malformed_logs = atomic_load(&ts.malformed_logs);
    bex_rpc_server_stats_get(ts.srv, &t->st);
    bex_rpc_reply(req, 0, t, sizeof *t);
}

/* Answers queued work when it is due, from its own thread. */
static void *worker_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&ts.mu);
    for (;;) {
        uint64_t now = pair_now_ms();
        struct work **pp = &ts.q, *w = NULL;
        for (; *pp; pp = &(*pp)->next)
            if ((*pp)->due_ms <= now || ts.stop) {
                w = *pp;
                *pp = w->next;
                break;
            }
        if (w) {
            pthread_mutex_unlock(&ts.mu);
            bex_rpc_reply(w->req, 0, w->body, w->len);
            free(w);
            pthread_mutex_lock(&ts.mu);
            continue;
        }
        if (ts.stop)
            break;
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 2 * 1000000L;
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&ts.cv, &ts.mu, &t);
    }
    pthread_mutex_unlock(&ts.mu);
    return NULL;
}

/* arg: non-NULL to lose the first WRITE's answer */
static void srv_child(int wfd, int rfd, void *arg)
{
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    ts.drop_first_write = arg != NULL;
    bex_ctx_config base = {.keepalive_timeout_ms = RPC_KEEPALIVE_MS,
                           .connect_timeout_ms = RPC_SETUP_MS};
    bex_ctx_config c = scaled(&base, a0);
    c.log_fn = ts_log;
    c.qp_timeout = srv_qp_timeout;
    c.qp_retry_cnt = srv_qp_retry_cnt;
    CHECK_OK(bex_ctx_create(&c, &ts.ctx));
    bex_rpc_server_config scfg = {.dedup_window = srv_window};
    CHECK_OK(bex_rpc_server_create(ts.ctx, &scfg, &ts.srv));
    CHECK_OK(bex_rpc_server_register(ts.srv, SVC, M_FLAKY, BEX_RPC_METHOD_WRITE, h_flaky, NULL));
    CHECK_OK(
        bex_rpc_server_register(ts.srv, SVC, M_SLOWW, BEX_RPC_METHOD_WRITE, h_slow_write, NULL));
    CHECK_OK(bex_rpc_server_register(ts.srv, SVC, M_ECHO, 0, h_echo, NULL));
    CHECK_OK(bex_rpc_server_register(ts.srv, SVC, M_NEVER, 0, h_never, NULL));
    CHECK_OK(bex_rpc_server_register(ts.srv, SVC, M_WRITE, BEX_RPC_METHOD_WRITE, h_write, NULL));
    CHECK_OK(bex_rpc_server_register(ts.srv, SVC, M_EAGAIN, 0, h_eagain, NULL));
    CHECK_OK(bex_rpc_server_register(ts.srv, SVC, M_THREAD, 0, h_thread, NULL));
    CHECK_OK(bex_rpc_server_register(ts.srv, SVC, M_STATS, 0, h_stats, NULL));
    CHECK_OK(bex_rpc_server_register(ts.srv, SVC, M_LATE, 0, h_late, NULL));
    CHECK_OK(bex_rpc_server_register(ts.srv, SVC, M_HOLD1, 0, h_hold1, NULL));
    CHECK(bex_rpc_server_register(ts.srv, SVC, M_ECHO, 0, h_echo, NULL) == -EEXIST);
    pthread_t worker;
    CHECK(pthread_create(&worker, NULL, worker_main, NULL) == 0);
    bex_addr la = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    CHECK_OK(bex_rpc_server_listen(ts.srv, &la));
    bex_addr got;
    bex_rpc_server_addr(ts.srv, &got);
    CHECK(got.in4.sin_port != 0);
    CHECK(write(wfd, &got.in4.sin_port, sizeof got.in4.sin_port) == sizeof got.in4.sin_port);
    char q;
    ssize_t r = read(rfd, &q, 1); /* until the parent says so, or is gone */
    (void)r;
    /* answer everything held, then tear down for real */
    pthread_mutex_lock(&ts.mu);
    ts.stop = true;
    struct work *held = ts.held;
    ts.held = NULL;
    pthread_cond_broadcast(&ts.cv);
    pthread_mutex_unlock(&ts.mu);
    CHECK(pthread_join(worker, NULL) == 0);
    while (held) {
        struct work *n = held->next;
        bex_rpc_reply(held->req, -ECANCELED, held->body, held->len);
        free(held);
        held = n;
    }
    CHECK_OK(bex_rpc_server_destroy(ts.srv));
    int err = bex_ctx_destroy(ts.ctx);
    if (err) {
        fprintf(stderr, "server: bex_ctx_destroy: %s\n", bex_strerror(err));
        exit(1);
    }
    exit(0);
}

/* Fork a server; call before the client's context exists. */
static void spawn_server(struct srv_proc *sp, bool drop_first_write)
{
    srv_spawn(sp, srv_child, drop_first_write ? &ts : NULL);
}

/* Tell a server to go and check it left cleanly (or reap a killed one:
 * expect_kill). Returns 0 or -1. */
static int stop_server(struct srv_proc *sp, bool expect_kill)
{
    return srv_stop(sp, expect_kill);
}

/* The client's context, on ADDR1. */
static bex_ctx *client_ctx(void)
{
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ctx_config base = {.keepalive_timeout_ms = RPC_KEEPALIVE_MS,
                           .connect_timeout_ms = RPC_SETUP_MS};
    bex_ctx_config c = scaled(&base, a1);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

/* A channel config over n servers with test-friendly timeouts: Tc (15 s)
 * and Tr (2 s) scaled (the defaults of 10 and 40 ms are for a real cluster, not for a
 * sanitizer build in an emulated VM, where an RDMA connection's setup took
 * over a second on a loaded host). */
static bex_rpc_channel_config chan_cfg(bex_rpc_endpoint *eps, struct srv_proc *sps, size_t n)
{
    for (size_t i = 0; i < n; i++)
        eps[i] = (bex_rpc_endpoint){.addr = sps[i].addr, .locality = i ? "dc1/pod2" : "dc1/pod1"};
    return (bex_rpc_channel_config){
        .endpoints = eps,
        .n_endpoints = n,
        .name = "test",
        .request_timeout_ms = 2000 * time_scale(),
        .connect_timeout_ms = 15000 * time_scale(), /* above the contexts' setup deadline */
    };
}

/* The completions of a case's calls, each call with a record of its own. */
struct tally {
    _Atomic long calls;   /* completions */
    _Atomic long twice;   /* a call completed a second time */
    _Atomic long ok, bad; /* status 0 with the right body / anything else */
    _Atomic long late;    /* completed after its deadline + slack */
    struct waiter w;
};

/* One completion on t of the call whose record holds *done: twice when it
 * is not the call's first, late and ok (else bad) as the case judged it;
 * counted last, when the case may go on. */
static inline void tally_done(struct tally *t, _Atomic int *done, bool late, bool ok)
{
    if (atomic_fetch_add(done, 1))
        atomic_fetch_add(&t->twice, 1);
    if (late)
        atomic_fetch_add(&t->late, 1);
    atomic_fetch_add(ok ? &t->ok : &t->bad, 1);
    waiter_add(&t->w, &t->calls, 1);
}

/* A call of such a case: what its completion is judged by. */
struct tcall {
    struct tally *r;
    uint8_t *dst;             /* its destination (bex_rpc_call_into), or NULL */
    uint32_t seed;            /* of its body's pattern */
    size_t len;               /* of the answer expected */
    uint64_t t0_ms, limit_ms; /* must complete by t0 + limit (limit 0: no bound) */
    int status;
    _Atomic int done;
};

/* Call o completed with status, its answer ok as the case judged it. */
static inline void tcall_done(struct tcall *o, int status, bool ok)
{
    o->status = status;
    tally_done(o->r, &o->done, o->limit_ms && pair_now_ms() > o->t0_ms + o->limit_ms, ok);
}

/* Say how the first few failed calls of o[0..n) failed. */
static inline void tcall_show_failed(const struct tcall *o, long n, const char *what)
{
    for (long i = 0, shown = 0; i < n && shown < 5; i++)
        if (o[i].status) {
            fprintf(stderr, "%s: call %ld: %s\n", what, i, bex_strerror(o[i].status));
            shown++;
        }
}

/* The end of a kill case: two replicas, the first killed with -9 after
 * before_kill of the n calls on ch (at most out at once) went, their
 * completions on t. Its line, then: calls before and after the kill,
 * every one answered well and in time, the ladder moved, the killed
 * replica's endpoint (es[0]) off step OK and the other's (es[1]) at OK. */
static inline void kill_check(bex_rpc_channel *ch, const struct tally *t, long n, long before_kill,
                              long out, bex_rpc_endpoint_stats es[2])
{
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(ch, &st);
    fprintf(stderr,
            "kill: %ld calls (%ld before the kill), ok %ld, failed %ld, late %ld, twice %ld, "
            "retries %llu, ladder moves %llu, throttled %llu, steps %llu/%llu/%llu\n",
            n, before_kill, atomic_load(&t->ok), atomic_load(&t->bad), atomic_load(&t->late),
            atomic_load(&t->twice), (unsigned long long)st.retries,
            (unsigned long long)st.ladder_moves, (unsigned long long)st.retry_throttled,
            (unsigned long long)st.ladder_reconnects, (unsigned long long)st.ladder_replicas,
            (unsigned long long)st.ladder_tcp);
    CHECK(before_kill > out && n > before_kill + out);
    CHECK_EQ(atomic_load(&t->ok), n);
    CHECK_EQ(atomic_load(&t->late), 0);
    CHECK(st.ladder_reconnects >= 1);
    CHECK(st.ladder_moves >= 1);
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, es, 2), 2);
    CHECK(es[0].ladder != BEX_RPC_LADDER_OK);
    CHECK_EQ(es[1].ladder, BEX_RPC_LADDER_OK);
}

/* The recovery ladder's cases on the native TCP tier: a context without a
 * device refuses every RDMA connection at once. */
#define RPC_NEED_NO_DEVICE()                                                                       \
    do {                                                                                           \
        if (!pair_tcp())                                                                           \
            return bex_test_skip("a case for the native TCP tier (RDMA refused by a context "      \
                                 "without a device)");                                             \
    } while (0)

/* chan_cfg over sp alone, listed RDMA, with max_attempts 2 and a budget of
 * one retry: the ladder's moves (steps 1, 2, 3) must spend neither. */
static inline bex_rpc_channel_config ladder_cfg(bex_rpc_endpoint *ep, struct srv_proc *sp)
{
    bex_rpc_channel_config cc = chan_cfg(ep, sp, 1);
    ep[0].transport = BEX_TRANSPORT_RDMA;
    cc.max_attempts = 2;
    cc.retry_budget_burst = 1;
    cc.retry_budget_permille = 1;
    return cc;
}

/* A lone endpoint's ladder went up once: step 1 (a reconnect), step 2 (no
 * other replica), step 3 (TCP), two moves. */
static inline void check_ladder_climbed(const bex_rpc_channel_stats *st)
{
    CHECK_EQ(st->ladder_reconnects, 1);
    CHECK_EQ(st->ladder_replicas, 1);
    CHECK_EQ(st->ladder_tcp, 1);
    CHECK_EQ(st->ladder_moves, 2);
}

/* Load service "ps" into d: one shard, its replicas sps[0..n), sps[i] in
 * locality dc1/pod<pod + i> (a client's is dc1/pod1), each listed with
 * transport unless that is NULL. */
static inline void dir_load_ps(bex_dir *d, const struct srv_proc *sps, size_t n, int pod,
                               const char *transport)
{
    char j[1024], err[256] = "";
    int o = snprintf(j, sizeof j, "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":[");
    for (size_t i = 0; i < n; i++) {
        char ip[INET_ADDRSTRLEN], tr[64] = "";
        inet_ntop(AF_INET, &sps[i].addr.in4.sin_addr, ip, sizeof ip);
        if (transport)
            snprintf(tr, sizeof tr, ",\"transport\":\"%s\"", transport);
        o += snprintf(j + o, sizeof j - (size_t)o,
                      "%s{\"addr\":\"%s:%u\",\"locality\":\"dc1/pod%d\"%s}", i ? "," : "", ip,
                      ntohs(sps[i].addr.in4.sin_port), pod + (int)i, tr);
        CHECK(o > 0 && (size_t)o < sizeof j);
    }
    o += snprintf(j + o, sizeof j - (size_t)o, "]}]}}}");
    CHECK((size_t)o < sizeof j);
    int rc = bex_dir_load_json(d, j, err, sizeof err);
    if (rc)
        fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
}

/* A body of len bytes (fill_pattern's, seed) to send. */
static inline void *pattern_body(bex_ctx *ctx, size_t len, uint32_t seed)
{
    void *b = bex_rpc_alloc(ctx, len);
    CHECK(b);
    fill_pattern(b, len, seed);
    return b;
}

/* A channel over sp[0..n) with chan_cfg's settings; request_ms (unscaled;
 * 0: chan_cfg's) the calls' deadline. */
static inline bex_rpc_channel *chan_open(bex_ctx *ctx, struct srv_proc *sp, size_t n,
                                         unsigned request_ms)
{
    bex_rpc_endpoint eps[4];
    CHECK(n <= 4);
    bex_rpc_channel_config cc = chan_cfg(eps, sp, n);
    if (request_ms)
        cc.request_timeout_ms = request_ms * time_scale();
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    return ch;
}

/* The end of a case: the channel and the client's context gone, then the
 * servers sp[0..n) told to go (each must leave cleanly); what the case
 * returns. */
static inline int rpc_finish(bex_rpc_channel *ch, bex_ctx *ctx, struct srv_proc *sp, size_t n)
{
    CHECK_OK(bex_rpc_channel_destroy(ch));
    CHECK_OK(bex_ctx_destroy(ctx));
    int rc = 0;
    for (size_t i = 0; i < n; i++)
        rc |= stop_server(&sp[i], false);
    return rc ? 1 : 0;
}

static struct tstats server_stats(bex_rpc_channel *ch)
{
    void *resp = NULL;
    size_t len = 0;
    CHECK_OK(bex_rpc_call_sync(ch, SVC, M_STATS, NULL, 0, NULL, &resp, &len));
    CHECK_EQ(len, sizeof(struct tstats));
    struct tstats t;
    memcpy(&t, resp, sizeof t);
    bex_rpc_free(resp);
    return t;
}

#endif
