/* SPDX-License-Identifier: Apache-2.0 */
/* bex-info's path check: a connection to a peer running `bex-info
 * --listen`, round trips of RTT_LEN bytes (echoed), then a burst of
 * BURST_MSG-byte messages (each acknowledged with ACK_LEN bytes). */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "info.h"

#define RTT_LEN   64
#define RTT_N     20
#define BURST_MSG (1u << 20)
#define ACK_LEN   8
#define WAIT_MS   10000

struct peer {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int connected; /* 1 up, < 0 its error */
    int failed;    /* on_error's */
    int transport;
    uint64_t answers;
};

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void p_connect(bex_sock *s, int err, void *user)
{
    struct peer *p = user;
    pthread_mutex_lock(&p->mu);
    p->connected = err ? err : 1;
    p->transport = err ? 0 : bex_sock_transport(s);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void p_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s, (void)len;
    struct peer *p = user;
    bex_mem_free(buf);
    pthread_mutex_lock(&p->mu);
    p->answers++;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void p_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu, (void)status, (void)user;
    bex_mem_free(buf);
}

static void p_error(bex_sock *s, int err, void *user)
{
    (void)s;
    struct peer *p = user;
    pthread_mutex_lock(&p->mu);
    p->failed = err;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static const bex_sock_ops peer_ops = {
    .on_connect = p_connect, .on_recv = p_recv, .on_send_done = p_done, .on_error = p_error};

/* Until *field reaches want (answers) or is set (connected), an error, or
 * WAIT_MS: 0, the error, or -ETIMEDOUT. */
static int wait_for(struct peer *p, const uint64_t *answers, uint64_t want)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += WAIT_MS / 1000;
    int rc = 0;
    pthread_mutex_lock(&p->mu);
    while (!rc && !p->failed && (answers ? *answers < want : p->connected == 0))
        rc = -pthread_cond_timedwait(&p->cv, &p->mu, &dl);
    if (p->failed)
        rc = p->failed;
    else if (!answers && p->connected < 0)
        rc = p->connected;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

static int send_bytes(bex_ctx *ctx, bex_sock *s, size_t len)
{
    void *b = bex_sock_alloc(ctx, len);
    if (!b)
        return -ENOMEM;
    memset(b, 0x5a, len);
    int rc = bex_sock_send(s, b, len, NULL);
    if (rc)
        bex_mem_free(b);
    return rc;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int round_trips(bex_ctx *ctx, bex_sock *s, struct peer *p, struct check_result *r)
{
    double t[RTT_N];
    for (uint32_t i = 0; i < RTT_N; i++) {
        uint64_t t0 = now_ns();
        int rc = send_bytes(ctx, s, RTT_LEN);
        if (rc || (rc = wait_for(p, &p->answers, i + 1)))
            return rc;
        t[i] = (double)(now_ns() - t0) / 1e3;
        r->rtts = i + 1;
    }
    qsort(t, RTT_N, sizeof t[0], cmp_double);
    r->rtt_us[0] = t[0];
    r->rtt_us[1] = t[RTT_N / 2];
    return 0;
}

static int burst(bex_ctx *ctx, bex_sock *s, struct peer *p, uint64_t bytes, struct check_result *r)
{
    uint64_t n = (bytes + BURST_MSG - 1) / BURST_MSG, base = p->answers;
    uint64_t t0 = now_ns();
    for (uint64_t i = 0; i < n; i++) {
        int rc = send_bytes(ctx, s, BURST_MSG);
        if (rc)
            return rc;
    }
    int rc = wait_for(p, &p->answers, base + n);
    if (rc)
        return rc;
    double sec = (double)(now_ns() - t0) / 1e9;
    r->burst_bytes = n * BURST_MSG;
    r->burst_mib_s = (double)r->burst_bytes / 1048576.0 / sec;
    return 0;
}

void info_check(bex_ctx *ctx, const bex_addr *peer, uint32_t transport, uint64_t burst_bytes,
                struct check_result *r)
{
    static struct peer p = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    *r = (struct check_result){.step = "connect"};
    bex_connect_opts o = {.flags = BEX_CONNECT_TRANSPORT, .transport = transport};
    bex_sock *s;
    r->err = bex_sock_connect_opts(ctx, peer, &peer_ops, &p, &o, &s);
    if (r->err) {
        snprintf(r->text, sizeof r->text, "%s", bex_strerror(r->err));
        return;
    }
    r->err = wait_for(&p, NULL, 0);
    r->transport = p.transport;
    if (!r->err) {
        r->step = "round trip";
        r->err = round_trips(ctx, s, &p, r);
    }
    if (!r->err && burst_bytes) {
        r->step = "burst";
        r->err = burst(ctx, s, &p, burst_bytes, r);
    }
    if (r->err && bex_sock_last_error(s, r->text, sizeof r->text) == 0)
        snprintf(r->text, sizeof r->text, "%s", bex_strerror(r->err));
    if (!r->err)
        r->step = NULL;
    bex_sock_close(s);
}

/* ---- the other side: --listen ---- */

static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    bex_ctx *ctx = user;
    if (len > RTT_LEN) { /* a burst's: acknowledged, not echoed */
        bex_mem_free(buf);
        buf = bex_sock_alloc(ctx, ACK_LEN);
        if (!buf)
            return;
        memset(buf, 0, ACK_LEN);
        len = ACK_LEN;
    }
    if (bex_sock_send(s, buf, len, NULL))
        bex_mem_free(buf);
}

static void srv_error(bex_sock *s, int err, void *user)
{
    (void)err, (void)user;
    bex_sock_close(s);
}

static void srv_accept(bex_listener *l, bex_sock *s, void *user)
{
    static const bex_sock_ops ops = {
        .on_recv = srv_recv, .on_send_done = p_done, .on_error = srv_error};
    (void)l;
    bex_sock_set_user(s, &ops, user);
}

int info_serve(bex_ctx *ctx, const bex_addr *addr)
{
    sigset_t sigs; /* blocked by main before the context's threads */
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    bex_listener_ops lops = {.on_accept = srv_accept};
    bex_listener *l;
    int rc = bex_listen(ctx, addr, &lops, ctx, &l);
    if (rc) {
        fprintf(stderr, "bex-info: --listen: %s\n", bex_strerror(rc));
        return 1;
    }
    bex_addr at;
    bex_listener_addr(l, &at);
    char ip[BEX_ADDR_STRLEN];
    bex_addr_format(&at, false, ip, sizeof ip);
    printf("bex-info: listening on %s:%u\n", ip, bex_addr_port(&at));
    fflush(stdout);
    int sig;
    sigwait(&sigs, &sig);
    bex_listener_close(l);
    return 0;
}
