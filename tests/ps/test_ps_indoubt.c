/* SPDX-License-Identifier: Apache-2.0 */
/* A Push whose send comes back in doubt (-EIO: the request reached the
 * shard, its answer is lost with the connection), at bex_ps_push (issue
 * 23, item 1's layer above): over fakenet (tests/rpc/fakenet.h), natively
 * on loopback TCP, one process.
 *
 * retried: the channel retries with the same ids; the Push is applied
 *   once (the RPC dedup window answers the retry) and succeeds.
 * restored: the shard is restored from its snapshot between the first
 *   attempt and the retry, behind a server with no RPC dedup window (as a
 *   restarted one has none): the Push id in the snapshot answers the
 *   retry; applied once.
 * in_doubt: the retry cannot reach the shard (its connection fails before
 *   sending, every time): the Push completes -EIO (in doubt), not a
 *   connection error that reads as "not applied"; it was applied once.
 * fetch_*: a Fetch whose replica dies comes back with the rows from the
 *   shard's other replica (bex_ps_fetch); into_*: the same by
 *   bex_ps_fetch_into, its rows into an array of bex_ps_rows_alloc. */
#include <arpa/inet.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

#include "bex/dir.h"
#include "bex/ps.h"
#include "harness.h"
#include "ps/ps_internal.h"
#include "rpc/fakenet.h"
#include "rpc/internal.h"

static const bex_ps_table_config TI = {.id = 1, .dim = 2, .optimizer = BEX_PS_SGD, .lr = 1.0f};

static bex_ctx *ctx_new(void)
{
    bex_ctx_config c = {
        .transport = BEX_TRANSPORT_TCP, .keepalive_timeout_ms = 60000, .connect_timeout_ms = 10000};
    bex_addr_parse("127.0.0.1", 0, &c.local_addr);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

/* The shard's side: the shard the handler serves now (restored: swapped
 * for its snapshot's after the first Push). */
struct side {
    bex_ctx *ctx;
    bex_rpc_server *srv;
    bex_ps_shard *cur, *old;
    char path[64];
    uint16_t port;
};

static bex_ps_shard *shard_new(const char *snap)
{
    bex_ps_shard_config pc = {
        .shard = 0, .n_shards = 1, .tables = &TI, .n_tables = 1, .snapshot_path = snap};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    return s;
}

/* Push registered without the RPC dedup window (a restarted server has
 * none): after the first, the shard is snapshotted and restored from the
 * file, and the restored one serves from then on. */
static void h_push(bex_rpc_req *req, void *body, size_t len, void *user)
{
    struct side *sd = user;
    void *resp = NULL;
    size_t rlen = 0;
    int rc = bex_ps_shard_serve(sd->cur, sd->ctx, BEX_PS_M_PUSH, body, len, &resp, &rlen);
    bex_rpc_free(body);
    if (!sd->old) {
        CHECK_OK(bex_ps_shard_snapshot(sd->cur, sd->path));
        sd->old = sd->cur;
        sd->cur = shard_new(sd->path);
    }
    bex_rpc_reply(req, rc, resp, rlen);
}

static void side_start(struct side *sd, bool restore)
{
    memset(sd, 0, sizeof *sd);
    sd->ctx = ctx_new();
    snprintf(sd->path, sizeof sd->path, "/tmp/bex-ps-indoubt-%d", (int)getpid());
    unlink(sd->path);
    sd->cur = shard_new(NULL);
    CHECK_OK(bex_rpc_server_create(sd->ctx, NULL, &sd->srv));
    if (restore)
        CHECK_OK(bex_rpc_server_register(sd->srv, BEX_PS_SERVICE, BEX_PS_M_PUSH, 0, h_push, sd));
    else
        CHECK_OK(bex_ps_shard_register(sd->cur, sd->srv, sd->ctx));
    bex_addr a = {.in4 = {.sin_family = AF_INET}};
    inet_pton(AF_INET, "127.0.0.1", &a.in4.sin_addr);
    CHECK_OK(bex_rpc_server_listen(sd->srv, &a));
    bex_rpc_server_addr(sd->srv, &a);
    sd->port = ntohs(a.in4.sin_port);
}

static void side_stop(struct side *sd)
{
    CHECK_OK(bex_rpc_server_destroy(sd->srv));
    bex_ps_shard_destroy(sd->cur);
    bex_ps_shard_destroy(sd->old);
    CHECK_OK(bex_ctx_destroy(sd->ctx));
    unlink(sd->path);
}

static bex_ps_shard_stats stats(bex_ps_shard *s)
{
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(s, &st);
    return st;
}

/* A client over d (the test's deadlines) at locality (NULL: none). */
static bex_ps_client *client_new(bex_ctx *cx, bex_dir *d, const char *locality,
                                 uint32_t max_attempts)
{
    bex_ps_client_config cc = {.dir = d,
                               .service = "ps",
                               .locality = locality,
                               .timeout_ms = 5000 * bex_test_time_scale(),
                               .connect_timeout_ms = 2000 * bex_test_time_scale(),
                               .max_attempts = max_attempts};
    bex_ps_client *pc;
    CHECK_OK(bex_ps_client_create(cx, &cc, &pc));
    return pc;
}

/* One Push of key 7 (gradient 1) by a client of max_attempts; its status,
 * its report's in *rep. */
static int push_once(bex_ctx *cx, uint16_t port, uint32_t max_attempts, int *rep)
{
    char j[256], err[256];
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":["
             "{\"replicas\":[{\"addr\":\"127.0.0.1:%u\",\"transport\":\"tcp\"}]}]}}}",
             port);
    bex_dir *d;
    CHECK_OK(bex_dir_create(NULL, &d));
    CHECK_OK(bex_dir_load_json(d, j, err, sizeof err));
    bex_ps_client *pc = client_new(cx, d, NULL, max_attempts);
    uint64_t key = 7;
    float g[2] = {1.0f, 1.0f};
    bex_ps_replica_result res[1];
    size_t n_res = 0;
    int rc = bex_ps_push_report_sync(pc, TI.id, TI.dim, &key, 1, g, res, 1, &n_res);
    CHECK_EQ(n_res, 1);
    *rep = res[0].status;
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    return rc;
}

/* The first Push request to port comes back in doubt; more: every later
 * one fails its connection before it leaves. */
static int doubt_rule(uint16_t port, bool more)
{
    int r = fn_add(&(struct fn_rule){.side = FN_CLIENT,
                                     .port = port,
                                     .dir = FN_TX,
                                     .kind = BEX__RPC_REQUEST,
                                     .action = FN_IN_DOUBT,
                                     .count = 1});
    if (more) {
        fn_add(&(struct fn_rule){.side = FN_CLIENT,
                                 .port = port,
                                 .dir = FN_TX,
                                 .kind = BEX__RPC_REQUEST,
                                 .action = FN_FAIL_BEFORE,
                                 .count = -1});
        fn_add(&(struct fn_rule){.side = FN_CLIENT,
                                 .port = port,
                                 .dir = FN_TX,
                                 .kind = FN_PING,
                                 .action = FN_FAIL_BEFORE,
                                 .count = -1});
    }
    return r;
}

static int finish(struct side *sd, bex_ctx *cx)
{
    CHECK_OK(bex_ctx_destroy(cx));
    side_stop(sd);
    fn_uninstall();
    CHECK_EQ(fn_violations(), 0);
    CHECK_EQ(fn_live(), 0);
    CHECK_EQ(fn_sent(), fn_returned());
    return 0;
}

static int t_retried(void)
{
    fn_install();
    struct side sd;
    side_start(&sd, false);
    bex_ctx *cx = ctx_new();
    int rule = doubt_rule(sd.port, false), rep;
    CHECK_OK(push_once(cx, sd.port, 3, &rep));
    CHECK_EQ(rep, 0);
    CHECK_EQ(fn_hits(rule), 1);
    CHECK_EQ(stats(sd.cur).pushes, 1);
    bex_rpc_server_stats rs;
    bex_rpc_server_stats_get(sd.srv, &rs);
    CHECK_EQ(rs.requests, 1);                      /* the retry never reached the shard */
    CHECK_EQ(rs.dup_replayed + rs.dup_pending, 1); /* it was answered from the window */
    return finish(&sd, cx);
}

static int t_restored(void)
{
    fn_install();
    struct side sd;
    side_start(&sd, true);
    bex_ctx *cx = ctx_new();
    int rule = doubt_rule(sd.port, false), rep;
    CHECK_OK(push_once(cx, sd.port, 3, &rep));
    CHECK_EQ(rep, 0);
    CHECK_EQ(fn_hits(rule), 1);
    CHECK(sd.old != NULL);
    CHECK_EQ(stats(sd.old).pushes, 1);
    bex_ps_shard_stats st = stats(sd.cur);
    CHECK(st.pushes == 0 && st.dup_ids == 1); /* the retry: its id was in the snapshot */
    return finish(&sd, cx);
}

static int t_in_doubt(void)
{
    fn_install();
    struct side sd;
    side_start(&sd, false);
    bex_ctx *cx = ctx_new();
    int rule = doubt_rule(sd.port, true), rep;
    CHECK_EQ(push_once(cx, sd.port, 2, &rep), -EIO);
    CHECK_EQ(rep, -EIO);
    CHECK_EQ(fn_hits(rule), 1);
    CHECK_EQ(stats(sd.cur).pushes, 1); /* it was applied: in doubt, not lost */
    return finish(&sd, cx);
}

/* ---- A Fetch in doubt: its replica dies with the request out ---- */

/* A client of both sides' shard (replica a at dc1/pod1, the client's
 * locality, so that a Fetch goes to a first; b at dc1/pod2). */
static bex_ps_client *fetch_client(bex_ctx *cx, bex_dir **d, uint16_t pa, uint16_t pb,
                                   uint32_t max_attempts, uint32_t b_quarantine_ms)
{
    char j[512], err[256];
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":["
             "{\"addr\":\"127.0.0.1:%u\",\"transport\":\"tcp\",\"locality\":\"dc1/pod1\"},"
             "{\"addr\":\"127.0.0.1:%u\",\"transport\":\"tcp\",\"locality\":\"dc1/pod2\"}]}]}}}",
             pa, pb);
    bex_dir_config dc = {
        .conn_fail_max = 1, .quarantine_ms = b_quarantine_ms, .probe_timeout_ms = 600000};
    CHECK_OK(bex_dir_create(&dc, d));
    CHECK_OK(bex_dir_load_json(*d, j, err, sizeof err));
    if (b_quarantine_ms) {
        /* b failed before (a replica killed and restarted a while ago):
         * quarantined in this client's directory */
        bex_addr ab;
        CHECK_OK(bex_addr_parse("127.0.0.1", pb, &ab));
        for (int i = 0; i < 2; i++)
            bex_dir_report(*d, &ab, BEX_DIR_CONN_FAIL, 0);
        bex_dir_node_stats ns;
        CHECK_OK(bex_dir_node_stats_get(*d, &ab, &ns));
        CHECK_EQ(ns.quarantines, 1);
    }
    return client_new(cx, *d, "dc1/pod1", max_attempts);
}

/* Both sides (a, b) and a Fetch client of them. */
struct frig {
    struct side a, b;
    bex_ctx *cx;
    bex_dir *d;
    bex_ps_client *pc;
};

static void frig_open(struct frig *f, uint32_t max_attempts, uint32_t b_quarantine_ms)
{
    fn_install();
    side_start(&f->a, false);
    side_start(&f->b, false);
    f->cx = ctx_new();
    f->pc = fetch_client(f->cx, &f->d, f->a.port, f->b.port, max_attempts, b_quarantine_ms);
}

static int frig_close(struct frig *f)
{
    bex_ps_client_destroy(f->pc);
    bex_dir_destroy(f->d);
    side_stop(&f->b);
    return finish(&f->a, f->cx);
}

#define NF 16

struct fwait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int left, st[NF];
};

struct fone {
    struct fwait *w;
    int i;
};

static void fetch_done(int status, void *user)
{
    struct fone *f = user;
    pthread_mutex_lock(&f->w->mu);
    f->w->st[f->i] = status;
    f->w->left--;
    pthread_cond_broadcast(&f->w->cv);
    pthread_mutex_unlock(&f->w->mu);
}

/* A Fetch of key into out (dim TI.dim): bex_ps_fetch, or into: bex_ps_fetch_into an array
 * of bex_ps_rows_alloc (*arr, freed by fetch_check). */
static void fetch_start(bex_ps_client *pc, bex_ctx *cx, const uint64_t *key, float *out, bool into,
                        float **arr, struct fone *f)
{
    *arr = NULL;
    if (!into) {
        CHECK_OK(bex_ps_fetch(pc, TI.id, TI.dim, key, 1, out, fetch_done, f));
        return;
    }
    *arr = bex_ps_rows_alloc(cx, 1, TI.dim);
    CHECK(*arr != NULL);
    CHECK_OK(bex_ps_fetch_into(pc, TI.id, TI.dim, key, 1, *arr, fetch_done, f));
}

/* The Fetch of key ended with status and the rows (out, or into its array,
 * which must have gone without a copy). */
static int fetch_check(int status, uint64_t key, const float *out, float *arr)
{
    if (status)
        fprintf(stderr, "fetch of %llu%s: %s\n", (unsigned long long)key, arr ? " into" : "",
                bex_strerror(status));
    CHECK_OK(status);
    const float *rows = arr ? arr : out;
    for (uint32_t c = 0; c < TI.dim; c++)
        CHECK_EQ(rows[c], bex_ps_init_value(TI.id, key, c, 0.01f));
    if (arr) {
        CHECK(bex_ps_rows_zero(arr) >= 1);
        CHECK_OK(bex_ps_rows_free(arr));
    }
    return 0;
}

static int fetch_left(struct fwait *w)
{
    pthread_mutex_lock(&w->mu);
    int left = w->left;
    pthread_mutex_unlock(&w->mu);
    return left;
}

static void fetch_wait(struct fwait *w)
{
    pthread_mutex_lock(&w->mu);
    while (w->left)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

/* nf Fetches out at once (into: bex_ps_fetch_into) while replica a dies
 * (its first request comes back in doubt, every later connection to it
 * fails before it sends): each must come back with the rows, from b. */
static int fetch_dies(int nf, uint32_t max_attempts, uint32_t b_quarantine_ms, bool into)
{
    struct frig fr;
    frig_open(&fr, max_attempts, b_quarantine_ms);
    struct side *b = &fr.b;
    bex_ps_client *pc = fr.pc;
    int rule = doubt_rule(fr.a.port, true);
    struct fwait w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .left = nf};
    struct fone f[NF];
    uint64_t keys[NF];
    float rows[NF][2], *arr[NF];
    for (int i = 0; i < nf; i++) {
        f[i] = (struct fone){&w, i};
        keys[i] = 100 + (uint64_t)i;
        fetch_start(pc, fr.cx, &keys[i], rows[i], into, &arr[i], &f[i]);
    }
    fetch_wait(&w);
    bex_ps_client_stats cs;
    bex_ps_client_stats_get(pc, &cs);
    fprintf(stderr,
            "fetches %d%s: calls %llu attempts %llu retries %llu failovers %llu conn_failures "
            "%llu\n",
            nf, into ? " into" : "", (unsigned long long)cs.calls, (unsigned long long)cs.attempts,
            (unsigned long long)cs.retries, (unsigned long long)cs.failovers,
            (unsigned long long)cs.conn_failures);
    for (int i = 0; i < nf; i++)
        CHECK_OK(fetch_check(w.st[i], keys[i], rows[i], arr[i]));
    CHECK_EQ(fn_hits(rule), 1);
    CHECK(stats(b->cur).fetches >= 1);
    return frig_close(&fr);
}

/* fetch_dies's cases: one Fetch, NF, NF with b quarantined (its probe
 * far off), each plain and into the caller's rows. */
#define DIES_CASE(name, nf, b_quarantine_ms, into)                                                 \
    static int name(void)                                                                          \
    {                                                                                              \
        return fetch_dies(nf, 0, b_quarantine_ms, into);                                           \
    }
DIES_CASE(t_fetch_one, 1, 0, false)
DIES_CASE(t_fetch_many, NF, 0, false)
DIES_CASE(t_fetch_quarantined, NF, 60000, false)
DIES_CASE(t_into_one, 1, 0, true)
DIES_CASE(t_into_many, NF, 0, true)
DIES_CASE(t_into_quarantined, NF, 60000, true)

static bex_dir_node_stats node_stats(bex_dir *d, uint16_t port)
{
    bex_addr x;
    bex_dir_node_stats ns = {0};
    CHECK_OK(bex_addr_parse("127.0.0.1", port, &x));
    CHECK_OK(bex_dir_node_stats_get(d, &x, &ns));
    return ns;
}

/* One Fetch (into: bex_ps_fetch_into) in doubt on a, which dies, while
 * b, its shard's live replica, is quarantined with its one probe out
 * (another call's: here the test's own pick). a's failures release another
 * probe of b (src/rpc/quarantine.c), which a retry of the channel takes;
 * should every attempt still go back to a and fail, the Fetch is a read:
 * once b's probe answers (the quarantine lifted), it must still come back
 * with the rows within its deadline, not -EIO. */
static int fetch_probe_out(bool into)
{
    struct frig fr;
    frig_open(&fr, 3, 1);
    struct side *a = &fr.a, *b = &fr.b;
    bex_ps_client *pc = fr.pc;
    bex_dir *d = fr.d;
    bex_addr aa, ab;
    CHECK_OK(bex_addr_parse("127.0.0.1", a->port, &aa));
    CHECK_OK(bex_addr_parse("127.0.0.1", b->port, &ab));
    /* b's quarantine (1 ms) over: the next pick of the shard probes it */
    bex_dir_replica r;
    do {
        CHECK_OK(bex_dir_pick(d, "ps", 0, "dc1/pod1", &aa, &r));
        if (!bex_addr_equal(&r.addr, &ab))
            bex_dir_report(d, &r.addr, BEX_DIR_DONE, 1);
    } while (!bex_addr_equal(&r.addr, &ab));
    CHECK_EQ(node_stats(d, b->port).probes, 1);
    int rule = doubt_rule(a->port, true);
    struct fwait w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .left = 1};
    struct fone f = {&w, 0};
    uint64_t key = 100;
    float rows[2], *arr;
    fetch_start(pc, fr.cx, &key, rows, into, &arr, &f);
    /* the Fetch done, or a's connection failures: the one in doubt, the
     * ladder's two steps (moves), then the channel's other two attempts */
    uint64_t end = bex_test_now_ms() + 20000ull * bex_test_time_scale();
    while (node_stats(d, a->port).conn_failures < 4 && fetch_left(&w) && bex_test_now_ms() < end)
        bex_test_sleep_ms(1);
    CHECK(node_stats(d, a->port).conn_failures >= 4 || !fetch_left(&w));
    bex_dir_report(d, &ab, BEX_DIR_OK, 1); /* b answered the test's probe */
    fetch_wait(&w);
    CHECK_OK(fetch_check(w.st[0], key, rows, arr));
    CHECK_EQ(fn_hits(rule), 1);
    CHECK_EQ(stats(b->cur).fetches, 1);
    return frig_close(&fr);
}

static int t_fetch_probe_out(void)
{
    return fetch_probe_out(false);
}

static int t_into_probe_out(void)
{
    return fetch_probe_out(true);
}

BEX_TEST_MAIN({"retried", t_retried}, {"restored", t_restored}, {"in_doubt", t_in_doubt},
              {"fetch_one", t_fetch_one}, {"fetch_many", t_fetch_many},
              {"fetch_quarantined", t_fetch_quarantined}, {"fetch_probe_out", t_fetch_probe_out},
              {"into_one", t_into_one}, {"into_many", t_into_many},
              {"into_quarantined", t_into_quarantined}, {"into_probe_out", t_into_probe_out})
