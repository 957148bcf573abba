/* SPDX-License-Identifier: Apache-2.0 */
/* bex_ctx_prometheus (issue 27 item 6): the transport's counters and the
 * pools' memory in Prometheus text, over RDMA (label rxe) and TCP
 * (BEX_TEST_TRANSPORT=tcp, label tcp). The server is a child process
 * (pair.h) that echoes; the client renders its own context's text.
 *  - names: every family is there with its HELP and TYPE lines, before
 *    any connection; a short buffer gets the length needed, NUL-ended.
 *  - load: the stated load, LOAD_N echoes of LOAD_LEN bytes, moves
 *    messages and bytes sent and received by at least that much; engines
 *    is 1 while the socket is up; with a buffer of 1 MiB held the main
 *    pool's in-use bytes are at least 1 MiB (the echoes' buffers, freed
 *    on the I/O thread, count until collected: no exact difference), and
 *    its registered bytes at least its in-use bytes.
 *  - keepalive: the server frozen (SIGSTOP) moves keepalive failures to 1.
 *  - fallback: a client context of transport auto: without a device its
 *    connection is a fallback to TCP (counted); with one (rxe), none is.
 *  - stalls: the stated load against a server granting 8 credits (rq_depth
 *    8) from a client whose send window holds one message (4096 bytes):
 *    over RDMA the credit and window stalls move (each send past the
 *    eighth waits for a credit, each past the first for the window); over
 *    TCP they stay 0 (the kernel's flow control: bex counts neither). RNR
 *    and retry errors are not made to move: credits keep RNR from
 *    happening, and a retry error needs a lost path (the adversary suite's
 *    cut wire), so their families are only checked to exist (names). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "echo.h"

#define LOAD_N   400
#define LOAD_LEN 4096
#define TEXT_CAP 16384

static const char *const families[] = {
    "bex_transport_engines",
    "bex_transport_tcp_connections",
    "bex_transport_messages_sent_total",
    "bex_transport_messages_received_total",
    "bex_transport_sent_bytes_total",
    "bex_transport_received_bytes_total",
    "bex_transport_credit_stalls_total",
    "bex_transport_window_stalls_total",
    "bex_transport_recv_paused_total",
    "bex_transport_rnr_errors_total",
    "bex_transport_retry_errors_total",
    "bex_transport_keepalive_failures_total",
    "bex_transport_tcp_fallbacks_total",
    "bex_pool_registered_bytes",
    "bex_pool_in_use_bytes",
};

/* The sample's value of metric (with its labels, as `name{...}`) in the
 * context's text; fails the case when it is not there. */
static long long metric(bex_ctx *ctx, const char *sample)
{
    static char text[TEXT_CAP];
    int n = bex_ctx_prometheus(ctx, text, sizeof text);
    if (n < 0 || (size_t)n >= sizeof text) {
        fprintf(stderr, "bex_ctx_prometheus: %d\n", n);
        return -1;
    }
    char key[128];
    snprintf(key, sizeof key, "\n%s ", sample);
    const char *at = strstr(text, key);
    if (!at) {
        fprintf(stderr, "no sample \"%s\" in:\n%s", sample, text);
        return -1;
    }
    return strtoll(at + strlen(key), NULL, 10);
}

struct cli {
    struct waiter w;
    _Atomic long connected, recvd, errors, closed;
    int conn_status;
};

static void cli_connected(bex_sock *s, int status, void *user)
{
    (void)s;
    struct cli *c = user;
    c->conn_status = status;
    waiter_add(&c->w, &c->connected, 1);
}

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s, (void)len;
    bex_mem_free(buf);
    waiter_add(&((struct cli *)user)->w, &((struct cli *)user)->recvd, 1);
}

static void cli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu, (void)status, (void)user;
    bex_mem_free(buf);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    (void)s, (void)err;
    waiter_add(&((struct cli *)user)->w, &((struct cli *)user)->errors, 1);
}

static void cli_closed(bex_sock *s, void *user)
{
    (void)s;
    waiter_add(&((struct cli *)user)->w, &((struct cli *)user)->closed, 1);
}

static const bex_sock_ops cli_ops = {.on_connect = cli_connected,
                                     .on_recv = cli_recv,
                                     .on_send_done = cli_done,
                                     .on_error = cli_error,
                                     .on_close = cli_closed};

static bex_sock *cli_connect(bex_ctx *ctx, const bex_addr *to, struct cli *c)
{
    bex_sock *s;
    if (bex_sock_connect(ctx, to, &cli_ops, c, &s) || wait_count(&c->w, &c->connected, 1, 10000) ||
        c->conn_status != 0)
        return NULL;
    return s;
}

static int cli_close(bex_sock *s, struct cli *c)
{
    bex_sock_close(s);
    return wait_count(&c->w, &c->closed, 1, 10000);
}

static int names_client(struct pair *p, void *arg)
{
    (void)arg;
    char text[TEXT_CAP];
    int n = bex_ctx_prometheus(p->ctx, text, sizeof text);
    CHECK(n > 0 && (size_t)n < sizeof text);
    CHECK_EQ(strlen(text), (size_t)n);
    for (size_t i = 0; i < sizeof families / sizeof families[0]; i++) {
        char help[128], type[128];
        snprintf(help, sizeof help, "# HELP %s ", families[i]);
        snprintf(type, sizeof type, "# TYPE %s ", families[i]);
        if (!strstr(text, help) || !strstr(text, type))
            fprintf(stderr, "family %s missing\n", families[i]);
        CHECK(strstr(text, help) && strstr(text, type));
    }
    CHECK_EQ(metric(p->ctx, "bex_transport_engines"), 0);
    CHECK(metric(p->ctx, "bex_pool_in_use_bytes{pool=\"landing\"}") >= 0);
    char small[32];
    memset(small, 'x', sizeof small);
    CHECK_EQ(bex_ctx_prometheus(p->ctx, small, sizeof small), n);
    CHECK_EQ(small[sizeof small - 1], 0);
    CHECK_EQ(bex_ctx_prometheus(p->ctx, NULL, 0), n);
    CHECK_EQ(bex_ctx_prometheus(NULL, text, sizeof text), -EINVAL);
    return 0;
}

static int load_client(struct pair *p, void *arg)
{
    (void)arg;
    bex_ctx *ctx = p->ctx;
    long long sent0 = metric(ctx, "bex_transport_messages_sent_total");
    long long bytes0 = metric(ctx, "bex_transport_sent_bytes_total");
    CHECK(sent0 >= 0 && bytes0 >= 0);
    struct cli c = {.w = WAITER_INIT};
    bex_sock *s = cli_connect(ctx, &p->srv, &c);
    CHECK(s);
    CHECK_EQ(metric(ctx, "bex_transport_engines"), 1);
    CHECK_EQ(metric(ctx, "bex_transport_tcp_connections"), pair_tcp() ? 1 : 0);
    for (int i = 0; i < LOAD_N; i++)
        local_send(ctx, s, LOAD_LEN);
    CHECK_OK(wait_count(&c.w, &c.recvd, LOAD_N, 30000));
    CHECK(metric(ctx, "bex_transport_messages_sent_total") >= sent0 + LOAD_N);
    CHECK(metric(ctx, "bex_transport_messages_received_total") >= LOAD_N);
    CHECK(metric(ctx, "bex_transport_sent_bytes_total") >= bytes0 + (long long)LOAD_N * LOAD_LEN);
    CHECK(metric(ctx, "bex_transport_received_bytes_total") >= (long long)LOAD_N * LOAD_LEN);
    void *big = bex_sock_alloc(ctx, 1 << 20);
    CHECK(big);
    long long used1 = metric(ctx, "bex_pool_in_use_bytes{pool=\"main\"}");
    fprintf(stderr, "main pool in use: %lld bytes\n", used1);
    CHECK(used1 >= (1 << 20));
    CHECK(metric(ctx, "bex_pool_registered_bytes{pool=\"main\"}") >= used1);
    bex_mem_free(big);
    CHECK_EQ(metric(ctx, "bex_transport_keepalive_failures_total"), 0);
    CHECK_OK(cli_close(s, &c));
    return 0;
}

static int keepalive_client(struct pair *p, void *arg)
{
    (void)arg;
    struct cli c = {.w = WAITER_INIT};
    bex_sock *s = cli_connect(p->ctx, &p->srv, &c);
    CHECK(s);
    CHECK_EQ(metric(p->ctx, "bex_transport_keepalive_failures_total"), 0);
    kill(p->child, SIGSTOP);
    CHECK_OK(wait_count(&c.w, &c.errors, 1, 10000));
    CHECK_EQ(metric(p->ctx, "bex_transport_keepalive_failures_total"), 1);
    CHECK_OK(cli_close(s, &c));
    kill(p->child, SIGKILL);
    waitpid(p->child, NULL, 0);
    p->child = 0;
    return 0;
}

/* A context of transport auto beside the pair's (which is tcp in the tcp
 * variant): whether its connection counts as a fallback. */
static int fallback_client(struct pair *p, void *arg)
{
    (void)arg;
    struct in_addr a0, a1;
    CHECK_OK(pair_addrs(&a0, &a1));
    bex_ctx_config cc = scaled(NULL, a1);
    cc.transport = BEX_TRANSPORT_AUTO;
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&cc, &ctx));
    struct cli c = {.w = WAITER_INIT};
    bex_sock *s = cli_connect(ctx, &p->srv, &c);
    CHECK(s);
    bool device = bex_ctx_pd(ctx) != NULL;
    fprintf(stderr, "client device: %s\n", device ? "yes" : "no");
    /* the server's context: tcp in the tcp variant, auto over rxe */
    bool tcp = !device || pair_tcp();
    CHECK_EQ(metric(ctx, "bex_transport_tcp_fallbacks_total"), tcp ? 1 : 0);
    CHECK_EQ(metric(ctx, "bex_transport_tcp_connections"), tcp ? 1 : 0);
    CHECK_OK(cli_close(s, &c));
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

static int stalls_client(struct pair *p, void *arg)
{
    (void)arg;
    bex_ctx *ctx = p->ctx;
    long long cs0 = metric(ctx, "bex_transport_credit_stalls_total");
    long long ws0 = metric(ctx, "bex_transport_window_stalls_total");
    CHECK(cs0 >= 0 && ws0 >= 0);
    struct cli c = {.w = WAITER_INIT};
    bex_sock *s = cli_connect(ctx, &p->srv, &c);
    CHECK(s);
    for (int i = 0; i < LOAD_N; i++)
        local_send(ctx, s, LOAD_LEN);
    CHECK_OK(wait_count(&c.w, &c.recvd, LOAD_N, 60000));
    long long cs = metric(ctx, "bex_transport_credit_stalls_total") - cs0;
    long long ws = metric(ctx, "bex_transport_window_stalls_total") - ws0;
    fprintf(stderr, "%d sends of %d bytes: %lld credit stalls, %lld window stalls\n", LOAD_N,
            LOAD_LEN, cs, ws);
    if (pair_tcp()) {
        CHECK_EQ(cs, 0);
        CHECK_EQ(ws, 0);
    } else {
        CHECK(cs > 0);
        CHECK(ws > 0);
    }
    CHECK_OK(cli_close(s, &c));
    return 0;
}

static const bex_ctx_config ka_cfg = {.keepalive_ms = 100, .keepalive_timeout_ms = 1500};

static int names(void)
{
    return pair_run(NULL, echo_srv_main, NULL, NULL, names_client, NULL, 60);
}

static int load(void)
{
    return pair_run(NULL, echo_srv_main, NULL, NULL, load_client, NULL, 120);
}

static int keepalive(void)
{
    return pair_run(&ka_cfg, echo_srv_main, NULL, &ka_cfg, keepalive_client, NULL, 60);
}

/* the server grants 8 credits; the client's window holds one message */
static const bex_ctx_config few_credits = {.rq_depth = 8};
static const bex_ctx_config one_in_flight = {.send_window = LOAD_LEN};

static int stalls(void)
{
    return pair_run(&few_credits, echo_srv_main, NULL, &one_in_flight, stalls_client, NULL, 120);
}

static int fallback(void)
{
    return pair_run(NULL, echo_srv_main, NULL, NULL, fallback_client, NULL, 60);
}

BEX_TEST_MAIN(BEX_CASE(names), BEX_CASE(load), BEX_CASE(keepalive), BEX_CASE(fallback),
              BEX_CASE(stalls))
