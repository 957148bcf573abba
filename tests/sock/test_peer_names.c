/* SPDX-License-Identifier: Apache-2.0 */
/* Log lines about a peer name it (docs/architecture.md, "Log lines about a
 * peer"), over either transport (BEX_TEST_TRANSPORT=tcp: label tcp; else
 * RDMA: label rxe). The client watches its own log while the server (a
 * child process, pair.h) is killed or frozen:
 *  - lost: kill -9 with a socket open: one line "peer a.b.c.d:port
 *    (engine N): connection lost with 1 socket open (...)";
 *  - frozen: SIGSTOP: the keepalive timeout's line starts with the same
 *    "peer a.b.c.d:port (engine N): ".
 * In both, every WARN or ERROR line the client logs names the server so.
 * Over TCP both failed before the TCP transport named its peer (its lines
 * said "tcp connection: ...", and a lost connection was not logged). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "echo.h"

/* ---------------- the client's log ---------------- */

#define LOG_MAX 64

static struct {
    pthread_mutex_t mu;
    int n;
    int level[LOG_MAX];
    char line[LOG_MAX][256];
} lg = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void log_keep(int level, const char *msg, void *arg)
{
    fprintf(stderr, "[%s] bex: %s\n", (const char *)arg, msg);
    pthread_mutex_lock(&lg.mu);
    if (lg.n < LOG_MAX) {
        lg.level[lg.n] = level;
        snprintf(lg.line[lg.n], sizeof lg.line[0], "%s", msg);
        lg.n++;
    }
    pthread_mutex_unlock(&lg.mu);
}

/* Waits up to ms (scaled) for a WARN/ERROR line containing what; then
 * checks that every WARN/ERROR line starts with "peer <srv> (engine ".
 * Returns how many lines contained what. */
static int log_check(const bex_addr *srv, const char *what, unsigned ms)
{
    char prefix[64];
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &srv->in4.sin_addr, ip, sizeof ip);
    snprintf(prefix, sizeof prefix, "peer %s:%u (engine ", ip, ntohs(srv->in4.sin_port));
    uint64_t end = pair_now_ms() + (uint64_t)ms * time_scale();
    int found = 0;
    for (;;) {
        found = 0;
        pthread_mutex_lock(&lg.mu);
        for (int i = 0; i < lg.n; i++)
            found += lg.level[i] <= BEX_LOG_WARN && strstr(lg.line[i], what) != NULL;
        pthread_mutex_unlock(&lg.mu);
        if (found || pair_now_ms() >= end)
            break;
        pair_sleep_ms(10);
    }
    pthread_mutex_lock(&lg.mu);
    int bad = 0;
    for (int i = 0; i < lg.n; i++) {
        if (lg.level[i] <= BEX_LOG_WARN && strncmp(lg.line[i], prefix, strlen(prefix)) != 0) {
            fprintf(stderr, "not named \"%s...\": %s\n", prefix, lg.line[i]);
            bad++;
        }
    }
    pthread_mutex_unlock(&lg.mu);
    CHECK_EQ(bad, 0);
    return found;
}

/* ---------------- the client ---------------- */

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
    atomic_fetch_add(&c->connected, 1);
    waiter_signal(&c->w);
}

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s, (void)len;
    struct cli *c = user;
    bex_mem_free(buf);
    atomic_fetch_add(&c->recvd, 1);
    waiter_signal(&c->w);
}

static void cli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu, (void)status, (void)user;
    bex_mem_free(buf);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    (void)s, (void)err;
    struct cli *c = user;
    atomic_fetch_add(&c->errors, 1);
    waiter_signal(&c->w);
}

static void cli_closed(bex_sock *s, void *user)
{
    (void)s;
    struct cli *c = user;
    waiter_add(&c->w, &c->closed, 1);
}

static const bex_sock_ops cli_ops = {.on_connect = cli_connected,
                                     .on_recv = cli_recv,
                                     .on_send_done = cli_done,
                                     .on_error = cli_error,
                                     .on_close = cli_closed};

/* One socket up and one echo back, then the server gets sig; the client's
 * log must name the server in the line containing what. */
static int victim_client(struct pair *p, int sig, const char *what)
{
    struct cli c = {.w = WAITER_INIT};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &cli_ops, &c, &s));
    CHECK_OK(wait_count(&c.w, &c.connected, 1, 10000));
    CHECK_EQ(c.conn_status, 0);
    void *m = bex_sock_alloc(p->ctx, 64);
    CHECK(m);
    memset(m, 7, 64);
    CHECK_OK(bex_sock_send(s, m, 64, NULL));
    CHECK_OK(wait_count(&c.w, &c.recvd, 1, 10000));
    kill(p->child, sig);
    /* keepalive timeout 1500 ms (scaled): the error comes within it */
    CHECK_OK(wait_count(&c.w, &c.errors, 1, 10000));
    int found = log_check(&p->srv, what, 2000);
    fprintf(stderr, "%d line(s) with \"%s\"\n", found, what);
    CHECK_EQ(found, 1);
    bex_sock_close(s);
    CHECK_OK(wait_count(&c.w, &c.closed, 1, 10000));
    kill(p->child, SIGKILL);
    waitpid(p->child, NULL, 0);
    p->child = 0;
    return 0;
}

static int lost_client(struct pair *p, void *arg)
{
    (void)arg;
    return victim_client(p, SIGKILL, "connection lost with 1 socket open");
}

static int frozen_client(struct pair *p, void *arg)
{
    (void)arg;
    return victim_client(p, SIGSTOP, "keepalive timeout");
}

static int lost(void)
{
    bex_ctx_config scfg = {.keepalive_ms = 100, .keepalive_timeout_ms = 1500};
    bex_ctx_config ccfg = scfg;
    ccfg.log_fn = log_keep;
    ccfg.log_arg = (void *)"client";
    return pair_run(&scfg, echo_srv_main, NULL, &ccfg, lost_client, NULL, 60);
}

static int frozen(void)
{
    bex_ctx_config scfg = {.keepalive_ms = 100, .keepalive_timeout_ms = 1500};
    bex_ctx_config ccfg = scfg;
    ccfg.log_fn = log_keep;
    ccfg.log_arg = (void *)"client";
    return pair_run(&scfg, echo_srv_main, NULL, &ccfg, frozen_client, NULL, 60);
}

BEX_TEST_MAIN(BEX_CASE(lost), BEX_CASE(frozen))
