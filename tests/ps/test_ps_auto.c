/* SPDX-License-Identifier: Apache-2.0 */
/* A bex-ps replica listed "rdma" takes the clients whose recovery ladder
 * fell back to TCP (issue 10; docs/architecture.md, "Recovery ladder" step
 * 3), in the Soft-RoCE VM (rxe). bex-ps is started as bex-cluster starts it
 * in an RDMA phase: a cluster file listing the replica "rdma" and
 * `--transport rdma`.
 *
 * tcp_client: a client that connects over TCP (BEX_TRANSPORT_TCP for the
 * endpoint, as the ladder's step 3 does) is served, and one over RDMA
 * still gets RDMA.
 * restart: the demo's fault phase in small: an RDMA client's channel to
 * the replica; the replica killed with -9, the channel's endpoint climbs
 * to TCP while it is dead; the replica restarted: a Push and a Fetch are
 * answered over TCP at once (before any RDMA retry), and the ladder's
 * RDMA retry (rdma_retry_ms) then brings the endpoint back to RDMA against
 * the restarted replica. An RDMA-only replica refused those TCP
 * connections ("the peer has no RDMA device"), so the demo's restarted
 * replica missed the Pushes of the clients on TCP until their retry, 30 s
 * later. */
#include <signal.h>
#include <sys/wait.h>

#include "ps_test.h"

#define DIM 8

static const float LR = 0.1f, GRAD = 0.5f;

struct setup {
    char dir[64], cluster[128];
    bex_addr addr; /* the replica's */
    const char *args[16];
};

/* The cluster file bex-cluster writes for an RDMA phase (one shard, one
 * replica on ADDR0), and bex-ps's arguments as bex-cluster gives them. */
static void setup_make(struct setup *s)
{
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    snprintf(s->dir, sizeof s->dir, "/tmp/bex-ps-auto-XXXXXX");
    CHECK(mkdtemp(s->dir));
    snprintf(s->cluster, sizeof s->cluster, "%s/cluster.json", s->dir);
    uint16_t port = bex_test_port_at(a0);
    char ip[INET_ADDRSTRLEN], j[512];
    inet_ntop(AF_INET, &a0, ip, sizeof ip);
    int n = snprintf(j, sizeof j,
                     "{\"version\":1,\"services\":{\"ps\":{\"shards\":[{\"replicas\":["
                     "{\"addr\":\"%s:%u\",\"locality\":\"dc1/pod0\",\"transport\":\"rdma\"}"
                     "]}]}}}\n",
                     ip, port);
    CHECK(n > 0 && (size_t)n < sizeof j);
    write_file(s->cluster, j, (size_t)n);
    s->addr = (bex_addr){.in4 = {.sin_family = AF_INET, .sin_addr = a0, .sin_port = htons(port)}};
    const char *args[] = {"--cluster",
                          s->cluster,
                          "--shard",
                          "0",
                          "--replica",
                          "0",
                          "--table",
                          "1:8:sgd:0.1",
                          "--transport",
                          "rdma",
                          "--keepalive-timeout-ms",
                          "10000",
                          NULL};
    memcpy(s->args, args, sizeof args);
}

static void setup_end(struct setup *s)
{
    unlink(s->cluster);
    CHECK(rmdir(s->dir) == 0);
}

/* The clients' context, as bex-ranker's and bex-trainer's in an RDMA
 * phase: RDMA only. */
static bex_ctx *rdma_ctx(void)
{
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config c = scaled(&base, a1);
    c.transport = BEX_TRANSPORT_RDMA;
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

static bex_rpc_channel *chan(bex_ctx *ctx, const struct setup *s, uint32_t transport,
                             uint32_t rdma_retry_ms)
{
    bex_rpc_endpoint ep = {.addr = s->addr, .transport = transport};
    bex_rpc_channel_config cc = {.endpoints = &ep,
                                 .n_endpoints = 1,
                                 .name = "auto",
                                 .request_timeout_ms = 10000 * time_scale(),
                                 .connect_timeout_ms = 10000 * time_scale(),
                                 .probe_timeout_ms = 5000 * time_scale(),
                                 .retry_budget_burst = 1000,
                                 .rdma_retry_ms = rdma_retry_ms};
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    return ch;
}

static const uint64_t KEY = 424242;

/* A request of method for KEY's row alone (*len bytes): its header and
 * key written. */
static uint8_t *req_new(bex_ctx *ctx, uint32_t method, size_t *len)
{
    *len = bex__ps_req_len(method, 1, DIM);
    uint8_t *b = bex_rpc_alloc(ctx, *len);
    CHECK(b);
    bex__ps_hdr_put(b, &(struct bex__ps_hdr){.table = 1, .n = 1, .dim = DIM});
    bex__ps_put64(b + BEX__PS_HDR_LEN, KEY);
    return b;
}

/* Fetch KEY's row: 0 and row[], or the call's error. */
static int fetch(bex_ctx *ctx, bex_rpc_channel *ch, float *row, unsigned timeout_ms)
{
    size_t len;
    uint8_t *b = req_new(ctx, BEX_PS_M_FETCH, &len);
    bex_rpc_call_opts o = {.timeout_ms = timeout_ms};
    void *resp = NULL;
    size_t rl = 0;
    int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, BEX_PS_M_FETCH, b, len, &o, &resp, &rl);
    if (rc == 0) {
        CHECK_OK(bex__ps_check_resp(BEX_PS_M_FETCH, resp, rl, 1, 1, DIM));
        for (int c = 0; c < DIM; c++)
            row[c] = bex__ps_getf((const uint8_t *)resp + BEX__PS_HDR_LEN + 4 * c);
    }
    bex_rpc_free(resp);
    return rc;
}

/* Push GRAD to every column of KEY's row. */
static int push(bex_ctx *ctx, bex_rpc_channel *ch, unsigned timeout_ms)
{
    size_t len;
    uint8_t *b = req_new(ctx, BEX_PS_M_PUSH, &len);
    for (int c = 0; c < DIM; c++)
        bex__ps_putf(b + BEX__PS_HDR_LEN + 8 + 4 * c, GRAD);
    bex_rpc_call_opts o = {.timeout_ms = timeout_ms};
    void *resp = NULL;
    int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, BEX_PS_M_PUSH, b, len, &o, &resp, NULL);
    bex_rpc_free(resp);
    return rc;
}

/* KEY's row holds its initial value with `pushes` Pushes of GRAD applied. */
static void row_check(const float *row, int pushes)
{
    for (int c = 0; c < DIM; c++) {
        volatile float want = bex_ps_init_value(1, KEY, (uint32_t)c, 0.01f);
        for (int i = 0; i < pushes; i++)
            want = want - LR * GRAD;
        if (row[c] != want) {
            fprintf(stderr, "column %d: %.9g, want %.9g (%d Pushes)\n", c, (double)row[c],
                    (double)want, pushes);
            CHECK(0);
        }
    }
}

static bex_rpc_endpoint_stats ep_stats(bex_rpc_channel *ch)
{
    bex_rpc_endpoint_stats es;
    CHECK_EQ(bex_rpc_channel_endpoint_stats(ch, &es, 1), 1);
    return es;
}

/* A case's replica, started as bex-cluster starts it, and its clients'
 * context; replica_end undoes both. */
static bex_ctx *replica_start(struct setup *s, pid_t *pid)
{
    setup_make(s);
    *pid = bex_ps_start(s->args, NULL, 0);
    return rdma_ctx();
}

static void replica_end(struct setup *s, bex_ctx *ctx, pid_t pid)
{
    CHECK_OK(bex_ctx_destroy(ctx));
    term_bex_ps(pid);
    setup_end(s);
}

static void kill9(pid_t pid)
{
    CHECK(kill(pid, SIGKILL) == 0);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
}

/* A client connecting over TCP is served by a replica listed "rdma"; one
 * over RDMA still gets RDMA. */
static int t_tcp_client(void)
{
    if (pair_tcp())
        return bex_test_skip("a replica listed rdma needs an RDMA device: rxe only");
    struct setup s;
    pid_t pid;
    bex_ctx *ctx = replica_start(&s, &pid);
    float row[DIM];

    /* over TCP, as the ladder's step 3 connects */
    bex_rpc_channel *tcp = chan(ctx, &s, BEX_TRANSPORT_TCP, 0);
    CHECK_OK(push(ctx, tcp, 10000 * time_scale()));
    CHECK_OK(fetch(ctx, tcp, row, 10000 * time_scale()));
    row_check(row, 1);
    bex_sock_stats st;
    bex_ctx_stats(ctx, &st);
    CHECK_EQ(st.engines, 1);
    CHECK_EQ(st.tcp_conns, 1);

    /* over RDMA: the replica still prefers it */
    bex_rpc_channel *rd = chan(ctx, &s, 0, 0);
    CHECK_OK(fetch(ctx, rd, row, 10000 * time_scale()));
    row_check(row, 1);
    bex_ctx_stats(ctx, &st);
    CHECK_EQ(st.engines, 2);
    CHECK_EQ(st.tcp_conns, 1);
    bex_rpc_channel_stats cs;
    bex_rpc_channel_stats_get(rd, &cs);
    CHECK_EQ(cs.ladder_tcp, 0);
    CHECK_EQ(cs.ok, 1);

    CHECK_OK(bex_rpc_channel_destroy(tcp));
    CHECK_OK(bex_rpc_channel_destroy(rd));
    replica_end(&s, ctx, pid);
    return 0;
}

/* The demo's fault in small: killed, the replica's clients climb to TCP;
 * restarted, it answers them over TCP at once, and their RDMA retry later
 * brings them back to RDMA. Two channels on one RDMA-only context: `tcp`
 * with an RDMA retry far away (none can come during the case: its calls
 * after the restart are answered over TCP or not at all), `back` with a
 * short one (its retry brings it back to RDMA against the restarted
 * replica; sanitizer time scales do not stretch the case by the period). */
static int t_restart(void)
{
    if (pair_tcp())
        return bex_test_skip("a replica listed rdma needs an RDMA device: rxe only");
    struct setup s;
    pid_t pid;
    bex_ctx *ctx = replica_start(&s, &pid);
    const unsigned back_retry_ms = 2000;
    bex_rpc_channel *tcp = chan(ctx, &s, 0, 3600000), *back = chan(ctx, &s, 0, back_retry_ms);
    bex_rpc_channel *chs[2] = {tcp, back};
    float row[DIM];
    CHECK_OK(push(ctx, tcp, 10000 * time_scale()));
    CHECK_OK(fetch(ctx, back, row, 10000 * time_scale()));
    row_check(row, 1);
    for (int c = 0; c < 2; c++) {
        bex_rpc_endpoint_stats es = ep_stats(chs[c]);
        CHECK_EQ(es.ladder, BEX_RPC_LADDER_OK);
        CHECK_EQ(es.tcp_answers, 0);
    }

    /* killed: calls fail until both endpoints are at step 3 (TCP) */
    kill9(pid);
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    int failed = 0;
    for (int c = 0; c < 2; c++) {
        bex_rpc_endpoint_stats es;
        while ((es = ep_stats(chs[c])).ladder != BEX_RPC_LADDER_TCP && pair_now_ms() < end) {
            failed += fetch(ctx, chs[c], row, 2000 * time_scale()) != 0;
            pair_sleep_ms(50);
        }
        fprintf(stderr, "channel %d: endpoint at step %u (%d failed Fetches so far)\n", c,
                es.ladder, failed);
        CHECK_EQ(es.ladder, BEX_RPC_LADDER_TCP);
    }
    bex_rpc_channel_stats cs;
    bex_rpc_channel_stats_get(tcp, &cs);
    CHECK(cs.ladder_tcp >= 1);

    /* restarted (no snapshot: its rows start again from their initial
     * values): served over TCP at once */
    uint64_t t_restart = pair_now_ms();
    pid = bex_ps_start(s.args, NULL, 0);
    int rc = push(ctx, tcp, 10000 * time_scale());
    if (rc)
        fprintf(stderr, "Push to the restarted replica: %s\n", bex_strerror(rc));
    CHECK_OK(rc);
    CHECK_OK(fetch(ctx, tcp, row, 10000 * time_scale()));
    row_check(row, 1);
    bex_rpc_endpoint_stats es = ep_stats(tcp);
    bex_rpc_channel_stats_get(tcp, &cs);
    fprintf(stderr, "after the restart (%llu ms): step %u, %llu answers over TCP\n",
            (unsigned long long)(pair_now_ms() - t_restart), es.ladder,
            (unsigned long long)es.tcp_answers);
    CHECK_EQ(cs.rdma_retries, 0);
    CHECK_EQ(es.ladder, BEX_RPC_LADDER_TCP);
    CHECK_EQ(es.tcp_answers, 2);

    /* the ladder's RDMA retry works against the restarted replica */
    end = pair_now_ms() + 30000ull * time_scale();
    while ((es = ep_stats(back)).ladder != BEX_RPC_LADDER_OK && pair_now_ms() < end)
        pair_sleep_ms(100);
    bex_rpc_channel_stats_get(back, &cs);
    fprintf(stderr, "back: step %u, %llu RDMA retries, %llu restored\n", es.ladder,
            (unsigned long long)cs.rdma_retries, (unsigned long long)cs.rdma_restored);
    CHECK_EQ(es.ladder, BEX_RPC_LADDER_OK);
    CHECK(cs.rdma_restored >= 1);
    uint64_t tcp_answers = es.tcp_answers;
    CHECK_OK(push(ctx, back, 10000 * time_scale()));
    CHECK_OK(fetch(ctx, back, row, 10000 * time_scale()));
    row_check(row, 2);
    es = ep_stats(back);
    CHECK_EQ(es.tcp_answers, tcp_answers); /* over RDMA */
    CHECK_EQ(es.ladder, BEX_RPC_LADDER_OK);

    CHECK_OK(bex_rpc_channel_destroy(tcp));
    CHECK_OK(bex_rpc_channel_destroy(back));
    replica_end(&s, ctx, pid);
    return 0;
}

BEX_TEST_MAIN({"tcp_client", t_tcp_client}, {"restart", t_restart})
