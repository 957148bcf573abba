/* SPDX-License-Identifier: Apache-2.0 */
/* bex_ctx_prometheus (issue 27 item 6): the transport's counters and the
 * pools' memory in Prometheus text, over RDMA (label rxe) and TCP
 * (BEX_TEST_TRANSPORT=tcp, label tcp). The server is a child process
 * (pair.h) that echoes; the client renders its own context's text.
 *  - names: every family is there with its HELP and TYPE lines, before
 *    any connection; a short buffer gets the length needed, NUL-ended.
 *  - load: the stated load, LOAD_N echoes of LOAD_LEN bytes, moves
 *    messages and bytes sent and received by at least that much; engines
 *    is 1 while the socket is up; doorbells move, and over TCP frames
 *    (sends) by at least LOAD_N; with a buffer of 1 MiB held the main
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
 *    errors are only checked to exist (names): credits keep RNR from
 *    happening.
 *  - retry_errors (rxe only, label serial): the QPs' ACK timeout and
 *    retries stated (qp_timeout 14, about 67 ms; qp_retry_cnt 6: about
 *    0.5 s to fail); one echo through; then the server frozen (SIGSTOP:
 *    its kernel still acknowledges, its bex returns no credit), RETRY_N
 *    sends handed to the NIC, and the wire drops 100 % (netem loss on both
 *    veths): the next unacknowledged work request (a send or a keepalive)
 *    exhausts its retries. Retry errors move to 1 in bex_ctx_prometheus's
 *    text, the socket reports -ETIMEDOUT, every send comes back with an
 *    error (none reported delivered, none echoed), well before the
 *    keepalive timeout (20 s here). The wire is restored at exit however
 *    the case ends (atexit; a kill: the CTest fixture netem_cleanup). */
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
    "bex_transport_sends_total",
    "bex_transport_doorbells_total",
    "bex_transport_credit_messages_total",
    "bex_loop_waits_total",
    "bex_loop_sleeps_total",
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
    _Atomic long connected, recvd, errors, closed, done, done_err;
    _Atomic int err; /* the last on_error's */
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
    (void)s, (void)len, (void)mu;
    struct cli *c = user;
    bex_mem_free(buf);
    if (status)
        atomic_fetch_add(&c->done_err, 1);
    waiter_add(&c->w, &c->done, 1);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    (void)s;
    atomic_store(&((struct cli *)user)->err, err);
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
    /* the messages went out through doorbells; over TCP each in a frame */
    CHECK(metric(ctx, "bex_transport_doorbells_total") >= 1);
    if (pair_tcp())
        CHECK(metric(ctx, "bex_transport_sends_total") >= LOAD_N);
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

#define RETRY_N 4

/* netem loss of 100 % on both veths (op "add") or none ("del") */
static int wire_drop(const char *op)
{
    int rc = 0;
    for (int i = 0; i < 2; i++) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "tc qdisc %s dev veth%d root netem loss 100%% 2>&1", op, i);
        rc |= system(cmd);
    }
    return rc;
}

/* The drop must not outlive the case: removed at exit of this process
 * (a failed CHECK exits too), not of the forked server. */
static pid_t drop_owner;

static void wire_restore(void)
{
    if (drop_owner && getpid() == drop_owner) {
        drop_owner = 0;
        if (wire_drop("del"))
            fprintf(stderr, "could not remove the netem qdiscs\n");
    }
}

/* Waits (10 s at most) until pid is stopped (state T in /proc/pid/stat):
 * kill(SIGSTOP) returns before the target has stopped. */
static int wait_stopped(pid_t pid)
{
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    for (int i = 0; i < 1000; i++) {
        FILE *f = fopen(path, "r");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        if (f)
            fclose(f);
        buf[n] = 0;
        const char *st = strrchr(buf, ')');
        if (st && st[1] == ' ' && st[2] == 'T')
            return 0;
        pair_sleep_ms(10);
    }
    return -1;
}

/* The cut: with the server frozen (its kernel still acknowledges, its bex
 * returns no credit: the sends are handed to the NIC, not delivered), the
 * sends go out, then the wire drops everything: the next unacknowledged
 * work request (a send or a keepalive) exhausts its retries. */
static int retry_cut(struct pair *p, struct cli *c, bex_sock *s)
{
    CHECK_OK(kill(p->child, SIGSTOP));
    CHECK_OK(wait_stopped(p->child));
    for (int i = 0; i < RETRY_N; i++)
        local_send(p->ctx, s, LOAD_LEN);
    drop_owner = getpid();
    CHECK(atexit(wire_restore) == 0);
    CHECK_OK(wire_drop("add"));
    int rc = wait_count(&c->w, &c->errors, 1, 10000);
    if (!rc)
        rc = wait_count(&c->w, &c->done, 1 + RETRY_N, 10000);
    if (rc)
        fprintf(stderr, "after the cut: %ld errors, %ld sends done (%ld failed), %ld received\n",
                atomic_load(&c->errors), atomic_load(&c->done), atomic_load(&c->done_err),
                atomic_load(&c->recvd));
    return rc;
}

static int retry_client(struct pair *p, void *arg)
{
    (void)arg;
    bex_ctx *ctx = p->ctx;
    CHECK_EQ(metric(ctx, "bex_transport_retry_errors_total"), 0);
    struct cli c = {.w = WAITER_INIT};
    bex_sock *s = cli_connect(ctx, &p->srv, &c);
    CHECK(s);
    local_send(ctx, s, LOAD_LEN); /* the path works before the cut */
    CHECK_OK(wait_count(&c.w, &c.recvd, 1, 10000));
    CHECK_OK(wait_count(&c.w, &c.done, 1, 10000));
    CHECK_EQ(atomic_load(&c.done_err), 0);
    int rc = retry_cut(p, &c, s);
    long long retries = metric(ctx, "bex_transport_retry_errors_total");
    long long ka = metric(ctx, "bex_transport_keepalive_failures_total");
    fprintf(stderr,
            "wire cut: error %d, %ld of %d sends failed, retry errors %lld, keepalive "
            "failures %lld\n",
            atomic_load(&c.err), atomic_load(&c.done_err), RETRY_N, retries, ka);
    wire_restore();
    /* the frozen server is killed, not waited for (as in keepalive), even
     * when a check below fails: pair_run would wait for it */
    kill(p->child, SIGKILL);
    waitpid(p->child, NULL, 0);
    p->child = 0;
    CHECK_OK(rc);
    CHECK_EQ(atomic_load(&c.err), -ETIMEDOUT);
    CHECK_EQ(atomic_load(&c.done_err), RETRY_N);
    CHECK_EQ(atomic_load(&c.recvd), 1);
    CHECK_EQ(retries, 1);
    CHECK_EQ(ka, 0);
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

/* The QPs' ACK timeout and retries stated: bex's ACK timeout (about
 * 67 ms) and 6 retries, so that a send unacknowledged for 7 x 67 ms,
 * about 0.5 s, fails its QP. Not bex's 7: rxe retries forever at 7 (as
 * the verbs spec says of RNR retries only). Not shorter either: an ACK
 * timeout of 4 ms and 1 retry failed QPs before the cut on a loaded host.
 * The keepalive timeout far beyond (20 s), so that only the retries end
 * the connection. */
static const bex_ctx_config stated_retry = {
    .qp_timeout = 14, .qp_retry_cnt = 6, .keepalive_timeout_ms = 20000};

static int retry_errors(void)
{
    return pair_run(&stated_retry, echo_srv_main, NULL, &stated_retry, retry_client, NULL, 60);
}

static int fallback(void)
{
    return pair_run(NULL, echo_srv_main, NULL, NULL, fallback_client, NULL, 60);
}

BEX_TEST_MAIN(BEX_CASE(names), BEX_CASE(load), BEX_CASE(keepalive), BEX_CASE(fallback),
              BEX_CASE(stalls), BEX_CASE(retry_errors))
