/* SPDX-License-Identifier: Apache-2.0 */
/* The good client role: a well-behaved bex client on BEX_TEST_ADDR1 that
 * echoes messages of 16 B .. 1 MiB through the server on two sockets and
 * checks every echo: the length it sent, the header, the checksum and every
 * byte, in order, each within a deadline ("on time").
 * Lines: "ready" (connected), "result ok msgs=N bytes=B maxlat_ms=L" or
 * "result fail <why>", "paused". Commands: 'g' go (with wait_go; also
 * resumes), 's' stop after min_msgs, 'p' pause (send nothing more; say
 * "paused" once nothing is in flight), 'q' close and exit. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adv.h"
#include "bex/sock.h"

#define NSOCK  2
#define WINDOW 4 /* messages in flight per socket */
#define FIFO   (WINDOW + 1)

struct sent {
    uint32_t seq;
    size_t len;
    uint64_t t;
};

struct gsock {
    bex_sock *s;
    bool closed; /* on_close came: s is gone (under G.mu) */
    struct sent fifo[FIFO];
    int head, n;
};

struct good {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct gsock gs[NSOCK];
    int connected, conn_err, closed, errors, first_err;
    uint64_t msgs, bytes, maxlat, send_err;
    char fail[256];
};

static struct good G = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void set_fail(const char *why)
{
    if (!G.fail[0])
        snprintf(G.fail, sizeof G.fail, "%s", why);
}

static void g_connect(bex_sock *s, int status, void *user)
{
    (void)s, (void)user;
    pthread_mutex_lock(&G.mu);
    if (status) {
        G.conn_err++;
        char why[128];
        snprintf(why, sizeof why, "connect failed: %s", bex_strerror(status));
        set_fail(why);
    } else {
        G.connected++;
    }
    pthread_cond_broadcast(&G.cv);
    pthread_mutex_unlock(&G.mu);
}

static void g_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct gsock *gs = user;
    (void)s;
    char why[200];
    int bad = adv_msg_check(buf, len, why, sizeof why);
    struct adv_msg_hdr h = {0};
    if (len >= sizeof h)
        memcpy(&h, buf, sizeof h);
    bex_mem_free(buf);
    uint64_t now = adv_now_ms();
    pthread_mutex_lock(&G.mu);
    if (gs->n == 0) {
        set_fail("an echo nobody asked for");
    } else {
        struct sent *e = &gs->fifo[gs->head];
        if (bad) {
            set_fail(why);
        } else if (h.seq != e->seq || len != e->len) {
            snprintf(why, sizeof why,
                     "echo out of order or resized: got seq %u len %zu, sent %u len %zu", h.seq,
                     len, e->seq, e->len);
            set_fail(why);
        } else {
            G.msgs++;
            G.bytes += len;
            if (now - e->t > G.maxlat)
                G.maxlat = now - e->t;
        }
        gs->head = (gs->head + 1) % FIFO;
        gs->n--;
    }
    pthread_cond_broadcast(&G.cv);
    pthread_mutex_unlock(&G.mu);
}

static void g_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu, (void)user;
    bex_mem_free(buf);
    if (status) {
        pthread_mutex_lock(&G.mu);
        G.send_err++;
        char why[128];
        snprintf(why, sizeof why, "a send failed: %s", bex_strerror(status));
        set_fail(why);
        pthread_cond_broadcast(&G.cv);
        pthread_mutex_unlock(&G.mu);
    }
}

static void g_error(bex_sock *s, int err, void *user)
{
    (void)user;
    pthread_mutex_lock(&G.mu);
    G.errors++;
    char why[128];
    snprintf(why, sizeof why, "socket error: %s", bex_strerror(err));
    set_fail(why);
    pthread_cond_broadcast(&G.cv);
    pthread_mutex_unlock(&G.mu);
    bex_sock_close(s);
}

static void g_close(bex_sock *s, void *user)
{
    struct gsock *gs = user;
    (void)s;
    pthread_mutex_lock(&G.mu);
    gs->closed = true;
    G.closed++;
    pthread_cond_broadcast(&G.cv);
    pthread_mutex_unlock(&G.mu);
}

static const bex_sock_ops g_ops = {.on_connect = g_connect,
                                   .on_recv = g_recv,
                                   .on_send_done = g_done,
                                   .on_error = g_error,
                                   .on_close = g_close};

static void wait_cv(unsigned ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_nsec + ms * 1000000ull;
    ts.tv_sec += (time_t)(ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    pthread_cond_timedwait(&G.cv, &G.mu, &ts);
}

int adv_good_main(int rd, int wr, void *arg)
{
    const struct adv_good_opts *o = arg;
    struct in_addr a0, a1;
    if (adv_addrs(&a0, &a1))
        return 1;
    unsigned scale = adv_scale();
    /* "on time": no echo may take longer than this, attack or not */
    const uint64_t lat_max = 10000ull * scale;
    bex_ctx_config cfg = {.local_addr = bex_addr_ipv4(a1.s_addr, 0),
                          .keepalive_timeout_ms = ADV_KEEPALIVE_MS * adv_timer_scale(),
                          /* the server's setup deadline decides, not ours */
                          .connect_timeout_ms = 3 * adv_setup_ms(),
                          .qp_timeout = ADV_QP_TIMEOUT,
                          .secret = o->secret,
                          .secret_len = o->secret ? strlen(o->secret) : 0};
    bex_ctx *ctx;
    int err = bex_ctx_create(&cfg, &ctx);
    if (err) {
        adv_say(wr, "result fail bex_ctx_create: %s", bex_strerror(err));
        return 1;
    }
    bex_addr srv = {.in4 = {.sin_family = AF_INET, .sin_port = htons(o->port), .sin_addr = a0}};
    for (int i = 0; i < NSOCK; i++) {
        err = bex_sock_connect(ctx, &srv, &g_ops, &G.gs[i], &G.gs[i].s);
        if (err) {
            adv_say(wr, "result fail bex_sock_connect: %s", bex_strerror(err));
            return 1;
        }
    }
    int rc = 0;
    uint64_t end = adv_now_ms() + 20000ull * scale;
    pthread_mutex_lock(&G.mu);
    while (G.connected + G.conn_err < NSOCK && adv_now_ms() < end)
        wait_cv(50);
    bool up = G.connected == NSOCK;
    pthread_mutex_unlock(&G.mu);
    if (!up) {
        adv_say(wr, "result fail %s", G.fail[0] ? G.fail : "connect did not finish in time");
        rc = 1;
        goto out;
    }
    adv_say(wr, "ready");
    bool stop = !o->wait_go;
    if (o->wait_go) {
        char c;
        while ((c = adv_get_cmd(rd, -1)) != 'g' && c != 'q')
            ;
        if (c == 'q')
            goto out;
    }
    uint32_t seq = o->seq0, sent = 0;
    bool paused = false, told = false;
    /* run until min_msgs are echoed and (with wait_go) the parent said stop */
    pthread_mutex_lock(&G.mu);
    for (;;) {
        if (G.fail[0])
            break;
        uint64_t now = adv_now_ms();
        bool more = !paused && (!stop || sent < o->min_msgs);
        int inflight = 0;
        for (int i = 0; i < NSOCK; i++) {
            struct gsock *gs = &G.gs[i];
            inflight += gs->n;
            if (gs->n && now - gs->fifo[gs->head].t > lat_max) {
                char why[160];
                snprintf(why, sizeof why, "echo of seq %u (%zu B) not back after %llu ms",
                         gs->fifo[gs->head].seq, gs->fifo[gs->head].len,
                         (unsigned long long)lat_max);
                set_fail(why);
            }
            while (more && gs->n < WINDOW && !G.fail[0]) {
                size_t len = adv_msg_size(seq);
                void *b = bex_sock_alloc(ctx, len);
                if (!b) {
                    set_fail("bex_sock_alloc failed");
                    break;
                }
                adv_msg_fill(b, len, seq);
                struct sent *e = &gs->fifo[(gs->head + gs->n) % FIFO];
                *e = (struct sent){seq, len, adv_now_ms()};
                gs->n++;
                inflight++;
                /* the lock is not needed by the send; the I/O thread's
                 * callbacks take it, never the other way round */
                err = bex_sock_send(gs->s, b, len, NULL);
                if (err) {
                    bex_mem_free(b);
                    char why[128];
                    snprintf(why, sizeof why, "bex_sock_send: %s", bex_strerror(err));
                    set_fail(why);
                    break;
                }
                seq++;
                sent++;
                more = !paused && (!stop || sent < o->min_msgs);
            }
        }
        if (paused && inflight == 0 && !told) {
            adv_say(wr, "paused");
            told = true;
        }
        if (G.fail[0] || (!more && !paused && inflight == 0))
            break;
        if (!stop || paused) {
            pthread_mutex_unlock(&G.mu);
            char c = adv_get_cmd(rd, 0);
            pthread_mutex_lock(&G.mu);
            if (c == 's' || c == 'q')
                stop = true;
            if (c == 'p') /* nothing in flight while an attacker writes
                             where payloads in flight may be (attacks.c) */
                paused = true, told = false;
            if (c == 'g' || c == 'q')
                paused = false;
        }
        wait_cv(20);
    }
    if (G.fail[0]) {
        adv_say(wr, "result fail %s (after %llu good echoes)", G.fail, (unsigned long long)G.msgs);
        rc = 1;
    } else {
        adv_say(wr, "result ok msgs=%llu bytes=%llu maxlat_ms=%llu", (unsigned long long)G.msgs,
                (unsigned long long)G.bytes, (unsigned long long)G.maxlat);
    }
    pthread_mutex_unlock(&G.mu);
    /* stay connected until the parent has the server's report */
    while (adv_get_cmd(rd, -1) != 'q')
        ;
out:
    /* under G.mu: a socket whose on_close is running waits for the lock
     * and is not freed meanwhile; one already closed is not touched */
    pthread_mutex_lock(&G.mu);
    for (int i = 0; i < NSOCK; i++)
        if (!G.gs[i].closed)
            bex_sock_close(G.gs[i].s);
    pthread_mutex_unlock(&G.mu);
    end = adv_now_ms() + 10000ull * scale;
    pthread_mutex_lock(&G.mu);
    while (G.closed < NSOCK && adv_now_ms() < end)
        wait_cv(50);
    int closed = G.closed;
    pthread_mutex_unlock(&G.mu);
    if (closed < NSOCK) {
        fprintf(stderr, "good client: %d of %d sockets reported on_close\n", closed, NSOCK);
        return 1;
    }
    bex_ctx_destroy(ctx);
    return rc;
}
