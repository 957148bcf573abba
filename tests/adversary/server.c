/* SPDX-License-Identifier: Apache-2.0 */
/* The server role: a bex listener on BEX_TEST_ADDR0 that echoes every
 * message, with the instrumentation the suite asserts on:
 *   - RSS and the pool's in-use bytes, sampled every 20 ms (peaks kept);
 *   - the library's log, captured through bex_ctx_config.log_fn;
 *   - canaries: pool buffers of several sizes filled with a pattern, some
 *     allocated on the I/O thread (so they share chunks with the engines'
 *     headers and receive buffers), some on the main thread;
 *   - held buffers: received SEND buffers (eager messages) the server keeps
 *     instead of echoing (it echoes a copy), checked at every report;
 *   - every good message is verified when it arrives and again when its
 *     echo is done (a write into a buffer bex holds shows there).
 * Commands: 'r' report, 'q' close everything, destroy the context, exit.
 * Lines: "port N" once listening; the report: "key value" lines, then
 * "log <level> <text>" lines, then "end". */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adv.h"
#include "bex/sock.h"

#define MAX_LOG      4096
#define MAX_CANARY   32
#define HOLD_EAGER   24   /* received SEND buffers kept */
#define HOLD_LARGE   8    /* received rendezvous buffers kept: 4 good, 4 others */
#define EAGER_MAX    8192 /* the context's eager_max (the default) */
#define RSS_GUARD_KB (768L << 10)
#define MAX_SOCKS    4096

struct held {
    void *p;
    size_t n;
    uint32_t csum; /* of the content when it was taken */
};

struct srv {
    int wr;
    bex_ctx *ctx;
    bex_listener *l;
    bex_mem_pool *pool;
    pthread_mutex_t mu;
    char *log[MAX_LOG];
    int nlog, log_lost;
    /* sampler */
    pthread_t sampler;
    _Atomic int stop;
    _Atomic long rss_base, rss_peak;
    _Atomic size_t pool_base, pool_peak;
    int fds_base;
    /* canaries: [0, ncan_main) main thread; the I/O thread's follow once
     * io_can is set (release: filled before it is seen) */
    struct held can[MAX_CANARY];
    int ncan_main, ncan;
    _Atomic int io_can;
    _Atomic int ncan_io; /* ncan once the I/O thread's are in: what report() reads */
    struct held hold[HOLD_EAGER + HOLD_LARGE];
    int nhold_eager, nhold_large, nhold_large_good, nhold_large_other;
    /* sockets, for the final close */
    bex_sock *socks[MAX_SOCKS];
    int nsocks;
    _Atomic long accepted, closed, good_msgs, good_bad, echo_bad, other_msgs, other_bytes;
    char first_bad[256];
};

static struct srv S;

static void log_hook(int level, const char *msg, void *arg)
{
    (void)arg;
    char line[600];
    snprintf(line, sizeof line, "%d %s", level, msg);
    for (char *p = line; *p; p++)
        if (*p == '\n')
            *p = ' ';
    pthread_mutex_lock(&S.mu);
    if (S.nlog < MAX_LOG)
        S.log[S.nlog++] = strdup(line);
    else
        S.log_lost++;
    pthread_mutex_unlock(&S.mu);
    if (getenv("ADV_VERBOSE"))
        fprintf(stderr, "server log: %s\n", line);
}

static void note_bad(const char *why)
{
    pthread_mutex_lock(&S.mu);
    if (!S.first_bad[0])
        snprintf(S.first_bad, sizeof S.first_bad, "%s", why);
    pthread_mutex_unlock(&S.mu);
}

/* Every pool the context allocates from: general, received (eager
 * receives) and landing (rendezvous destinations, exposed buffers). */
static size_t pools_in_use(void)
{
    bex_mem_stats st, rs, ls;
    bex_mem_pool_stats(S.pool, &st);
    bex_mem_pool_stats(bex_ctx_recv_pool(S.ctx), &rs);
    bex_mem_pool_stats(bex_ctx_landing_pool(S.ctx), &ls);
    return st.in_use_bytes + rs.in_use_bytes + ls.in_use_bytes;
}

static void *sampler_main(void *arg)
{
    (void)arg;
    while (!atomic_load(&S.stop)) {
        long rss = adv_rss_kb();
        if (rss > atomic_load(&S.rss_peak))
            atomic_store(&S.rss_peak, rss);
        size_t in_use = pools_in_use();
        if (in_use > atomic_load(&S.pool_peak))
            atomic_store(&S.pool_peak, in_use);
        if (rss - atomic_load(&S.rss_base) > RSS_GUARD_KB) {
            /* stop before the VM runs out of memory and its OOM killer picks
             * a victim that is not us */
            adv_say(S.wr, "guard rss grew by %ld KiB (over %ld KiB): server stops itself",
                    rss - atomic_load(&S.rss_base), RSS_GUARD_KB);
            _exit(3);
        }
        adv_sleep_ms(20);
    }
    return NULL;
}

static void canary_add(size_t n, uint32_t seed)
{
    if (S.ncan >= MAX_CANARY)
        return;
    void *p = bex_mem_alloc(S.pool, n);
    CHECK(p);
    adv_pattern(p, n, seed);
    S.can[S.ncan++] = (struct held){p, n, 0};
}

/* ---- echo ---- */

static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)user;
    struct adv_msg_hdr h = {0};
    if (len >= sizeof h)
        memcpy(&h, buf, sizeof h);
    void *echo = buf;
    void *tag = NULL;
    if (h.magic == ADV_MAGIC) {
        char why[200];
        if (adv_msg_check(buf, len, why, sizeof why)) {
            atomic_fetch_add(&S.good_bad, 1);
            note_bad(why);
        } else {
            atomic_fetch_add(&S.good_msgs, 1);
            tag = (void *)1; /* verified: check again when the echo is done */
        }
    } else {
        atomic_fetch_add(&S.other_msgs, 1);
        atomic_fetch_add(&S.other_bytes, (long)len);
    }
    /* keep some received buffers, good clients' and attackers' alike, and
     * echo a copy: nothing may write into a buffer handed to us */
    bool keep = false;
    pthread_mutex_lock(&S.mu);
    if (len <= EAGER_MAX && S.nhold_eager < HOLD_EAGER) {
        S.hold[S.nhold_eager++] = (struct held){buf, len, adv_csum(buf, len, 1)};
        keep = true;
    } else if (len > EAGER_MAX && S.nhold_large < HOLD_LARGE) {
        /* the good clients' large messages would take every slot at once:
         * half are kept for the others' (an attacker's delivered buffer) */
        int *n = tag ? &S.nhold_large_good : &S.nhold_large_other;
        if (*n < HOLD_LARGE / 2) {
            (*n)++;
            S.hold[HOLD_EAGER + S.nhold_large++] = (struct held){buf, len, adv_csum(buf, len, 1)};
            keep = true;
        }
    }
    pthread_mutex_unlock(&S.mu);
    if (keep) {
        echo = bex_sock_alloc(S.ctx, len ? len : 1);
        CHECK(echo);
        memcpy(echo, buf, len);
    }
    if (bex_sock_send(s, echo, len, tag) != 0)
        bex_mem_free(echo);
}

static void srv_done(bex_sock *s, void *buf, size_t len, void *tag, int status, void *user)
{
    (void)s, (void)status, (void)user;
    char why[200];
    if (tag && adv_msg_check(buf, len, why, sizeof why)) {
        atomic_fetch_add(&S.echo_bad, 1);
        note_bad(why);
    }
    bex_mem_free(buf);
}

static void srv_error(bex_sock *s, int err, void *user)
{
    (void)err, (void)user;
    bex_sock_close(s);
}

static void srv_close(bex_sock *s, void *user)
{
    (void)user;
    pthread_mutex_lock(&S.mu);
    for (int i = 0; i < S.nsocks; i++) {
        if (S.socks[i] == s) {
            S.socks[i] = S.socks[--S.nsocks];
            break;
        }
    }
    pthread_mutex_unlock(&S.mu);
    atomic_fetch_add(&S.closed, 1);
}

static const bex_sock_ops srv_ops = {
    .on_recv = srv_recv, .on_send_done = srv_done, .on_error = srv_error, .on_close = srv_close};

static void srv_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    bex_sock_set_user(s, &srv_ops, user);
    atomic_fetch_add(&S.accepted, 1);
    pthread_mutex_lock(&S.mu);
    bool room = S.nsocks < MAX_SOCKS;
    if (room)
        S.socks[S.nsocks++] = s;
    pthread_mutex_unlock(&S.mu);
    if (!room)
        bex_sock_close(s);
    if (!atomic_load_explicit(&S.io_can, memory_order_relaxed)) {
        /* on the I/O thread: these share its heap's chunks with the
         * engines' header areas and receive buffers */
        static const size_t sz[] = {64, 3136, 3136, 8192, 8192, 65536, 1u << 20};
        for (size_t i = 0; i < sizeof sz / sizeof sz[0]; i++)
            canary_add(sz[i], 1000 + (uint32_t)i);
        atomic_store_explicit(&S.ncan_io, S.ncan, memory_order_relaxed);
        atomic_store_explicit(&S.io_can, 1, memory_order_release);
    }
}

/* ---- report ---- */

static void report(void)
{
    /* never S.ncan here: the I/O thread writes it, and a conditional read
     * of it may be done unconditionally by the compiler (TSan saw that
     * race when a report came before the first accept) */
    int ncan = S.ncan_main;
    if (atomic_load_explicit(&S.io_can, memory_order_acquire))
        ncan = atomic_load_explicit(&S.ncan_io, memory_order_relaxed);
    int can_bad = 0;
    for (int i = 0; i < ncan; i++) {
        long at = adv_pattern_diff(S.can[i].p, S.can[i].n, 1000 + (uint32_t)(i - S.ncan_main));
        if (i < S.ncan_main)
            at = adv_pattern_diff(S.can[i].p, S.can[i].n, 2000 + (uint32_t)i);
        if (at >= 0) {
            can_bad++;
            adv_say(S.wr, "note canary %d (%zu B at %p, %s thread) overwritten at byte %ld", i,
                    S.can[i].n, S.can[i].p, i < S.ncan_main ? "main" : "I/O", at);
        }
    }
    int held_bad = 0, large_bad = 0, nheld, nlarge;
    pthread_mutex_lock(&S.mu);
    nheld = S.nhold_eager;
    nlarge = S.nhold_large;
    for (int i = 0; i < HOLD_EAGER + HOLD_LARGE; i++) {
        if (!S.hold[i].p || adv_csum(S.hold[i].p, S.hold[i].n, 1) == S.hold[i].csum)
            continue;
        if (i < HOLD_EAGER) {
            held_bad++;
            adv_say(S.wr, "note held SEND buffer %d (%zu B) changed", i, S.hold[i].n);
        } else {
            large_bad++;
            adv_say(S.wr, "note held rendezvous buffer %d (%zu B) changed", i - HOLD_EAGER,
                    S.hold[i].n);
        }
    }
    pthread_mutex_unlock(&S.mu);
    bex_sock_stats ss;
    bex_ctx_stats(S.ctx, &ss);
    adv_say(S.wr, "rss_base_kb %ld", atomic_load(&S.rss_base));
    adv_say(S.wr, "rss_peak_kb %ld", atomic_load(&S.rss_peak));
    adv_say(S.wr, "rss_now_kb %ld", adv_rss_kb());
    adv_say(S.wr, "pool_base %zu", atomic_load(&S.pool_base));
    adv_say(S.wr, "pool_peak %zu", atomic_load(&S.pool_peak));
    adv_say(S.wr, "pool_now %zu", pools_in_use());
    adv_say(S.wr, "fds_base %d", S.fds_base);
    adv_say(S.wr, "fds_now %d", adv_fd_count());
    adv_say(S.wr, "backlog %d", adv_listen_backlog());
    adv_say(S.wr, "engines %llu", (unsigned long long)ss.engines);
    adv_say(S.wr, "mode %d", bex_ctx_remote_access(S.ctx));
    adv_say(S.wr, "srq_credits %llu", (unsigned long long)ss.srq_credits);
    adv_say(S.wr, "canaries %d", ncan);
    adv_say(S.wr, "canary_bad %d", can_bad);
    adv_say(S.wr, "held %d", nheld);
    adv_say(S.wr, "held_bad %d", held_bad);
    adv_say(S.wr, "held_large %d", nlarge);
    adv_say(S.wr, "held_large_bad %d", large_bad);
    adv_say(S.wr, "good_msgs %ld", atomic_load(&S.good_msgs));
    adv_say(S.wr, "good_bad %ld", atomic_load(&S.good_bad));
    adv_say(S.wr, "echo_bad %ld", atomic_load(&S.echo_bad));
    adv_say(S.wr, "other_msgs %ld", atomic_load(&S.other_msgs));
    adv_say(S.wr, "accepted %ld", atomic_load(&S.accepted));
    adv_say(S.wr, "closed %ld", atomic_load(&S.closed));
    pthread_mutex_lock(&S.mu);
    if (S.first_bad[0])
        adv_say(S.wr, "note first bad message: %s", S.first_bad);
    for (int i = 0; i < S.nlog; i++)
        adv_say(S.wr, "log %s", S.log[i]);
    adv_say(S.wr, "log_lost %d", S.log_lost);
    pthread_mutex_unlock(&S.mu);
    adv_say(S.wr, "end");
}

/* Close what is open, wait for every on_close, destroy: the teardown path
 * runs (and the sanitizers' leak check with it) after every attack. */
static int teardown(unsigned scale)
{
    pthread_mutex_lock(&S.mu);
    for (int i = 0; i < S.nsocks; i++)
        bex_sock_close(S.socks[i]);
    pthread_mutex_unlock(&S.mu);
    uint64_t end = adv_now_ms() + 10000ull * scale;
    int left;
    for (;;) {
        pthread_mutex_lock(&S.mu);
        left = S.nsocks;
        pthread_mutex_unlock(&S.mu);
        if (!left || adv_now_ms() >= end)
            break;
        adv_sleep_ms(20);
    }
    atomic_store(&S.stop, 1);
    pthread_join(S.sampler, NULL);
    if (left) {
        fprintf(stderr, "server: %d sockets never reported on_close\n", left);
        return 4;
    }
    bex_listener_close(S.l);
    for (int i = 0; i < S.ncan; i++)
        bex_mem_free(S.can[i].p);
    for (int i = 0; i < HOLD_EAGER + HOLD_LARGE; i++)
        bex_mem_free(S.hold[i].p);
    bex_ctx_destroy(S.ctx);
    for (int i = 0; i < S.nlog; i++)
        free(S.log[i]);
    return 0;
}

int adv_server_main(int rd, int wr, void *arg)
{
    const struct adv_server_opts *o = arg;
    struct in_addr a0, a1;
    if (adv_addrs(&a0, &a1))
        return 1;
    unsigned scale = adv_scale();
    adv_raise_nofile(8192);
    S.wr = wr;
    pthread_mutex_init(&S.mu, NULL);
    bex_ctx_config cfg = {
        .local_addr = bex_addr_ipv4(a0.s_addr, 0),
        .keepalive_timeout_ms = ADV_KEEPALIVE_MS * adv_timer_scale(),
        .connect_timeout_ms = adv_setup_ms(),
        .qp_timeout = ADV_QP_TIMEOUT,
        .log_fn = log_hook,
        .log_level = BEX_LOG_WARN,
        .log_window_ms = ADV_LOG_WINDOW_MS,
        .secret = o->secret,
        .secret_len = o->secret ? strlen(o->secret) : 0,
        .remote_access = o->remote_access,
        .srq_depth = o->srq_depth,
        /* limits small enough that the stated bounds hold (test_adversary.c) */
        .rndv_bytes_max = 32u << 20,
        .recv_bytes_max = 48u << 20,
        .streams_max = 64,
        /* setup_max: the default (64). 1000 idle connections refilled at
         * 200/s push out the one that kept us waiting longest, never a
         * client in the middle of its setup */
        /* no attack ends by our rendezvous timeout (the attackers answer
         * or vanish): long enough that a good client stalled by the loaded
         * VM is not failed by it. Credits: no_credits ends by this one */
        .rndv_timeout_ms = 20000 * adv_timer_scale(),
        .credit_timeout_ms = 3000 * adv_timer_scale(),
    };
    int err = bex_ctx_create(&cfg, &S.ctx);
    if (err) {
        adv_say(wr, "fail bex_ctx_create: %s", bex_strerror(err));
        return 2;
    }
    S.pool = bex_ctx_pool(S.ctx);
    static const size_t sz[] = {64, 8192, 1u << 20};
    for (size_t i = 0; i < sizeof sz / sizeof sz[0]; i++)
        canary_add(sz[i], 2000 + (uint32_t)i);
    S.ncan_main = S.ncan;
    bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    bex_listener_ops lops = {.on_accept = srv_accept};
    err = bex_listen(S.ctx, &a, &lops, &S, &S.l);
    if (err) {
        adv_say(wr, "fail bex_listen: %s", bex_strerror(err));
        return 2;
    }
    atomic_store(&S.pool_base, pools_in_use());
    atomic_store(&S.pool_peak, pools_in_use());
    atomic_store(&S.rss_base, adv_rss_kb());
    S.fds_base = adv_fd_count();
    atomic_store(&S.rss_peak, adv_rss_kb());
    CHECK(pthread_create(&S.sampler, NULL, sampler_main, NULL) == 0);
    bex_addr got;
    bex_listener_addr(S.l, &got);
    adv_say(wr, "port %u", ntohs(got.in4.sin_port));
    for (;;) {
        char c = adv_get_cmd(rd, -1);
        if (c == 'r')
            report();
        else if (c == 'q' || c == 0)
            break;
    }
    return teardown(scale);
}
