/* SPDX-License-Identifier: Apache-2.0 */
/* bex-perf: bex's data path measured the way perftest measures verbs.
 *
 *   server: bex-perf -s --local ADDR [-p PORT] [--eager B] [--spin-us N] [--runs N]
 *   client: bex-perf -c SERVER --local ADDR [-p PORT] --test lat|bw|frag [options]
 *
 * lat   one message outstanding: the client sends --size bytes, the server
 *       echoes the same buffer back, --iters times after --warmup round
 *       trips. The ping-pong runs inside the I/O thread's callbacks (on_recv
 *       sends the next message: the client, too, the buffer it received),
 *       so no thread hop is measured, and a sample is one cycle-counter
 *       read and one store, as in perftest (the mean is the window's ticks
 *       over its round trips; the sort is the report's). Reports half
 *       the round trip like perftest's *_lat: median (perftest's t_typical),
 *       P99, min, mean, max.
 *   bw    --size-byte messages (1 MiB) client -> server over --sockets
 *       sockets of one engine, --outstanding messages in flight; the server
 *       answers each with a 32-byte message. Reports payload MiB/s (2^20
 *       bytes per second: perftest's "MB/sec" column is the same unit) and
 *       messages/s, between the response to message --warmup and the last.
 *   frag  bw once per fragment size of --frag-list (paper Figure 10); the
 *       fragment size is the sender's configuration, so the client builds a
 *       fresh context for each.
 *
 * Many connections (bw --conns N, paper Figure 11): N connections, each its
 * own engine (RC QP): socket i goes to port -p + i % --ports (the server
 * listens on --ports consecutive ports; a context has one connection per
 * server address), from ceil(N / --ports) client contexts. Each connection
 * runs its own closed loop of --outstanding / N messages in flight (at
 * least one; the first --outstanding % N connections one more), on its I/O
 * thread, so nothing is shared between I/O threads but two atomic counters.
 * At most 16 connections are in setup at once (a server closes the oldest
 * of more than setup_max setups).
 *
 * Competing streams (lat --streams K, paper Figure 13): K more sockets on
 * the latency socket's engine each stream --stream-size messages (1 MiB),
 * --outstanding of them in flight per stream, for as long as the latency
 * test runs; the stream bytes answered during the measured round trips are
 * reported as stream_mib_s.
 *
 * Session protocol: the first message on each socket is a 32-byte setup
 * (magic, version, response size; 0 = echo); the server sends it back when
 * it is ready. Every later message is answered per the setup.
 *
 * The server serves any number of clients one after another or at once,
 * and exits cleanly on SIGINT/SIGTERM, or once --runs sockets have closed
 * (a client run opens one socket, or --sockets of them).
 * With --json every result is one JSON object on one line. */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <glob.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include "bex/sock.h"

#define PERF_MAGIC   0x46505842u /* "BXPF" */
#define PERF_VERSION 1
#define SETUP_LEN    32
#define RESP_LEN     32
#define DEFAULT_PORT 18516
#define SETUP_TAG    ((void *)(uintptr_t)UINTPTR_MAX)

enum test { T_NONE, T_LAT, T_BW, T_FRAG };

struct opts {
    bool server, json;
    const char *client;
    struct in_addr local;
    bool have_local;
    uint16_t port;
    enum test test;
    size_t size;
    uint64_t iters, warmup;
    uint32_t outstanding, sockets;
    uint32_t frag, eager, spin_us, sq_depth, rq_depth;
    uint32_t remote_access; /* BEX_REMOTE_ACCESS_* */
    uint32_t ka_timeout_ms; /* 0: the library's */
    uint32_t ka_ms;         /* keepalive_ms; 0: the library's */
    uint32_t io_threads, srq_depth, poll_mode, transport, setup_max;
    uint32_t connect_timeout_ms; /* 0: the library's (3000) */
    uint8_t qp_timeout;
    uint32_t conns, ports; /* conns 0: not the many-connection mode */
    uint32_t streams, stream_size;
    bool outstanding_set;
    uint32_t frag_list[32];
    int n_frag_list;
    long runs;
    unsigned timeout_s;
    bool size_set, iters_set;
    bool steady;      /* bw --conns: no drain in the measured window */
    uint32_t idle_ms; /* lat: connected and idle this long before the test */
};

/* ---------------- small helpers ---------------- */

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The latency loop reads a cycle counter, like perftest: on this project's
 * test VMs clock_gettime() is a system call plus an emulated HPET read,
 * which would add microseconds to every sample. Ticks are converted with a
 * rate measured against CLOCK_MONOTONIC over the run itself. */
static uint64_t ticks(void)
{
#if defined(__x86_64__) || defined(__i386__)
    return __rdtsc();
#else
    return mono_ns();
#endif
}

static double cpu_seconds(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static void put32(uint8_t *p, uint32_t v)
{
    v = htonl(v);
    memcpy(p, &v, 4);
}

static uint32_t get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return ntohl(v);
}

static void setup_encode(uint8_t *p, uint32_t resp)
{
    memset(p, 0, SETUP_LEN);
    put32(p, PERF_MAGIC);
    put32(p + 4, PERF_VERSION);
    put32(p + 8, resp);
}

static int setup_decode(const uint8_t *p, size_t len, uint32_t *resp)
{
    if (len != SETUP_LEN || get32(p) != PERF_MAGIC || get32(p + 4) != PERF_VERSION)
        return -EPROTO;
    *resp = get32(p + 8);
    return 0;
}

static void fill_cfg(const struct opts *o, bex_ctx_config *c, uint32_t frag)
{
    memset(c, 0, sizeof(*c));
    c->local_addr = bex_addr_ipv4(o->local.s_addr, 0);
    c->eager_max = o->eager;
    c->frag_size = frag;
    c->poll_spin_us = o->spin_us;
    c->sq_depth = o->sq_depth;
    c->rq_depth = o->rq_depth;
    c->remote_access = o->remote_access;
    c->keepalive_timeout_ms = o->ka_timeout_ms;
    c->keepalive_ms = o->ka_ms;
    c->io_threads = o->io_threads;
    c->srq_depth = o->srq_depth;
    c->poll_mode = o->poll_mode;
    c->transport = o->transport;
    c->qp_timeout = o->qp_timeout;
    c->setup_max = o->setup_max;
    c->connect_timeout_ms = o->connect_timeout_ms;
}

static const char *mode_name(bex_ctx *ctx)
{
    return bex_ctx_remote_access(ctx) == BEX_REMOTE_ACCESS_WINDOW ? "window" : "landing";
}

/* A one-shot "wait until the I/O thread says so". */
#define GATE_TIMEOUT 1 /* gate_wait's own timeout (not a failure's -ETIMEDOUT) */
struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void gate_init(struct gate *g)
{
    pthread_condattr_t a;
    pthread_mutex_init(&g->mu, NULL);
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cv, &a);
    pthread_condattr_destroy(&a);
}

static void gate_destroy(struct gate *g)
{
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}

static void gate_signal(struct gate *g)
{
    pthread_mutex_lock(&g->mu);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* Wait until *v >= want, or *fail is set, or timeout_s passes. Returns 0,
 * the failure (negative: a connect's -ETIMEDOUT among them), or
 * GATE_TIMEOUT. Every change of *v and *fail is followed by
 * gate_signal, so the wait sleeps until one comes (no periodic wake-up:
 * a measured run's instructions do not grow with its length in time). */
static int gate_wait(struct gate *g, _Atomic long *v, long want, _Atomic int *fail,
                     unsigned timeout_s)
{
    struct timespec end;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_sec += (time_t)timeout_s;
    int rc = 0;
    pthread_mutex_lock(&g->mu);
    while (atomic_load(v) < want && !(rc = atomic_load(fail))) {
        if (pthread_cond_timedwait(&g->cv, &g->mu, &end) == ETIMEDOUT && atomic_load(v) < want &&
            !(rc = atomic_load(fail))) {
            rc = GATE_TIMEOUT;
            break;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return rc;
}

/* ---------------- server ---------------- */

struct srv_sock {
    struct server *srv;
    bex_sock *s;
    bool ready;
    uint32_t resp;
    /* apart: side by side GCC adds both in vector registers, seven
     * instructions a message for two adds */
    uint64_t msgs;
    struct srv_sock *prev, *next;
    uint64_t bytes;
};

struct server {
    bex_ctx *ctx;
    const struct opts *o;
    pthread_mutex_t mu; /* the list of live sockets: main thread closes them */
    struct srv_sock *live;
    _Atomic long sessions, n_live;
    pthread_t main; /* woken by SIGUSR1 once --runs sockets have closed */
};

/* The first message on a socket: the client's setup (cold, out of
 * srv_recv's frame). */
static __attribute__((noinline, cold)) void srv_setup(bex_sock *s, void *buf, size_t len,
                                                      struct srv_sock *ss)
{
    if (setup_decode(buf, len, &ss->resp) || ss->resp > (1u << 30)) {
        fprintf(stderr, "bex-perf server: bad setup message (%zu bytes)\n", len);
        bex_mem_free(buf);
        bex_sock_close(s);
        return;
    }
    ss->ready = true;
    /* the setup goes back as it came: the client starts on it */
    if (bex_sock_send(s, buf, len, NULL))
        bex_mem_free(buf);
}

/* A response of its own size (--resp) for each message. */
static __attribute__((noinline)) void srv_respond(bex_sock *s, void *buf, struct srv_sock *ss)
{
    bex_mem_free(buf);
    void *r = bex_sock_alloc(ss->srv->ctx, ss->resp);
    if (!r) {
        fprintf(stderr, "bex-perf server: out of registered memory\n");
        bex_sock_close(s);
        return;
    }
    memset(r, 0, ss->resp);
    if (bex_sock_send(s, r, ss->resp, NULL))
        bex_mem_free(r);
}

/* The echo inline, the rest tail calls: the frame keeps only the buffer
 * (ib_send_lat's loop counts and posts; the setup's and --resp's
 * registers were saved for every message, issue 25 item 2). */
static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct srv_sock *ss = user;
    if (__builtin_expect(!ss->ready, 0)) {
        srv_setup(s, buf, len, ss);
        return;
    }
    ss->msgs++;
    ss->bytes += len;
    if (ss->resp != 0) {
        srv_respond(s, buf, ss);
        return;
    }
    /* echo: the received buffer is the reply (zero copy) */
    if (bex_sock_send(s, buf, len, NULL))
        bex_mem_free(buf);
}

static void srv_send_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu, (void)status, (void)user;
    bex_mem_free(buf);
}

static void srv_error(bex_sock *s, int err, void *user)
{
    (void)err, (void)user;
    bex_sock_close(s);
}

static void srv_close(bex_sock *s, void *user)
{
    (void)s;
    struct srv_sock *ss = user;
    struct server *srv = ss->srv;
    pthread_mutex_lock(&srv->mu);
    if (ss->prev)
        ss->prev->next = ss->next;
    else
        srv->live = ss->next;
    if (ss->next)
        ss->next->prev = ss->prev;
    pthread_mutex_unlock(&srv->mu);
    if (!srv->o->json && ss->ready)
        fprintf(stderr, "bex-perf server: session done: %" PRIu64 " messages, %" PRIu64 " bytes\n",
                ss->msgs, ss->bytes);
    free(ss);
    atomic_fetch_sub(&srv->n_live, 1);
    long done = atomic_fetch_add(&srv->sessions, 1) + 1;
    if (srv->o->runs > 0 && done == (long)srv->o->runs)
        pthread_kill(srv->main, SIGUSR1);
}

static const bex_sock_ops srv_ops = {.on_recv = srv_recv,
                                     .on_send_done = srv_send_done,
                                     .on_error = srv_error,
                                     .on_close = srv_close};

static void srv_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    struct server *srv = user;
    struct srv_sock *ss = calloc(1, sizeof(*ss));
    if (!ss) {
        bex_sock_close(s);
        return;
    }
    ss->srv = srv;
    ss->s = s;
    pthread_mutex_lock(&srv->mu);
    ss->next = srv->live;
    if (srv->live)
        srv->live->prev = ss;
    srv->live = ss;
    pthread_mutex_unlock(&srv->mu);
    atomic_fetch_add(&srv->n_live, 1);
    bex_sock_set_user(s, &srv_ops, ss);
}

/* The whole process's empty loop turns and epoll_wait calls, on stderr
 * (bench/cost/run reads them: busy polling's empty turns are subtracted
 * from its instructions). */
static void report_turns(const char *who, bex_ctx *const *ctxs, uint32_t n)
{
    uint64_t empty = 0, waits = 0;
    for (uint32_t i = 0; i < n; i++) {
        bex_sock_stats st;
        bex_ctx_stats(ctxs[i], &st);
        empty += st.empty_turns;
        waits += st.loop_waits;
    }
    fprintf(stderr, "%s: %" PRIu64 " empty loop turns, %" PRIu64 " loop waits\n", who, empty,
            waits);
}

static int run_server(const struct opts *o)
{
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGUSR1); /* srv_close: --runs sockets have closed */
    /* blocked before the I/O thread exists, so only sigwaitinfo sees them */
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);

    struct server srv = {.o = o, .main = pthread_self()};
    pthread_mutex_init(&srv.mu, NULL);
    bex_ctx_config cfg;
    fill_cfg(o, &cfg, o->frag);
    int err = bex_ctx_create(&cfg, &srv.ctx);
    if (err) {
        fprintf(stderr, "bex-perf server: bex_ctx_create: %s\n", bex_strerror(err));
        return 1;
    }
    uint32_t nl = o->ports ? o->ports : 1;
    bex_listener **ls = calloc(nl, sizeof(*ls));
    if (!ls || (uint32_t)o->port + nl - 1 > 65535) {
        fprintf(stderr, "bex-perf server: %s\n", ls ? "ports beyond 65535" : "out of memory");
        free(ls);
        bex_ctx_destroy(srv.ctx);
        return 1;
    }
    bex_listener_ops lops = {.on_accept = srv_accept};
    for (uint32_t i = 0; i < nl; i++) {
        bex_addr a = {.in4 = {.sin_family = AF_INET,
                              .sin_port = htons((uint16_t)(o->port + i)),
                              .sin_addr = o->local}};
        err = bex_listen(srv.ctx, &a, &lops, &srv, &ls[i]);
        if (err) {
            fprintf(stderr, "bex-perf server: bex_listen on port %u: %s\n", o->port + i,
                    bex_strerror(err));
            for (uint32_t j = 0; j < i; j++)
                bex_listener_close(ls[j]);
            free(ls);
            bex_ctx_destroy(srv.ctx);
            return 1;
        }
    }
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &o->local, ip, sizeof(ip));
    if (nl > 1)
        printf("bex-perf server: listening on %s:%u..%u\n", ip, o->port, o->port + nl - 1);
    else
        printf("bex-perf server: listening on %s:%u\n", ip, o->port);
    fflush(stdout);

    /* asleep until a signal: no periodic wake-up (a measured run's
     * instructions do not grow with its length in time) */
    for (;;) {
        int sig = sigwaitinfo(&sigs, NULL);
        if (sig == SIGINT || sig == SIGTERM)
            break;
        if (o->runs > 0 && atomic_load(&srv.sessions) >= o->runs)
            break;
    }
    for (uint32_t i = 0; i < nl; i++)
        bex_listener_close(ls[i]);
    free(ls);
    pthread_mutex_lock(&srv.mu);
    for (struct srv_sock *ss = srv.live; ss; ss = ss->next)
        bex_sock_close(ss->s);
    pthread_mutex_unlock(&srv.mu);
    uint64_t end = mono_ns() + 30000000000ull;
    while (atomic_load(&srv.n_live) > 0 && mono_ns() < end)
        usleep(10000);
    int rc = atomic_load(&srv.n_live) == 0 ? 0 : 1;
    if (rc)
        fprintf(stderr, "bex-perf server: %ld sockets did not close\n", atomic_load(&srv.n_live));
    report_turns("bex-perf server", &srv.ctx, 1);
    bex_ctx_destroy(srv.ctx);
    pthread_mutex_destroy(&srv.mu);
    return rc;
}

/* ---------------- client ---------------- */

struct client;

/* A socket of the client. A flow (a --conns connection, a --streams
 * stream) runs its own closed loop of up to w messages in flight; its
 * fields are touched only by its socket's I/O thread once it runs. */
struct csock {
    struct client *cl;
    bex_sock *s;
    bex_ctx *ctx;
    bool ready;
    uint32_t resp_len; /* asked of the server in the setup (0: echo) */
    bool flow;
    size_t size;
    uint32_t w, nbufs, nfree, *freeb;
    void **bufs;
    uint64_t sent, resp;
};

/* The RDMA devices' port counters (rdma_rxe's names; a device without one
 * counts 0): packets, and the protocol's retries and refusals. */
static const char *const hw_names[] = {"sent_pkts",          "rcvd_pkts",    "duplicate_request",
                                       "out_of_seq_request", "rcvd_rnr_err", "send_rnr_err",
                                       "rcvd_seq_err",       "ack_deferred", "completer_retry_err",
                                       "retry_exceeded_err"};
#define HW_N (sizeof hw_names / sizeof hw_names[0])

/* What the OS counted over the measured phase: this process's user and
 * system CPU and context switches (getrusage), and the whole machine's
 * CPU split and context switches (/proc/stat, in USER_HZ ticks). */
struct phase_os {
    double user_s, sys_s;
    long nvcsw, nivcsw;
    unsigned long long m[8]; /* user nice system idle iowait irq softirq steal */
    unsigned long long ctxt;
    unsigned long long hw[HW_N]; /* RDMA devices' counters, summed */
};

struct client {
    const struct opts *o;
    bex_ctx *ctx;   /* ctxs[0] */
    bex_ctx **ctxs; /* --conns: one per --ports connections */
    uint32_t nctx;
    enum test test;
    size_t size;
    struct gate g;
    _Atomic long connected, ready, closed, finished;
    _Atomic int fail;
    struct csock *cs;
    uint32_t ncs;
    /* total: messages sent; the measured window runs from the answer to
     * message warm to the answer to message end (= total, or total less
     * the load in flight with --steady) */
    uint64_t total, warm, iters, end;

    /* lat: the first message's buffer (bex's once sent: it comes back
     * freed); every later message is the echo received, sent back as it
     * came, as the server does. A round trip's own work is perftest's: one
     * cycle-counter read and one store (lat_recv). The next sample goes to
     * *lnext, which moves by lstep (0 in the warm-up: its samples
     * overwrite one spare word); lleft answers to the next mark (the
     * warm-up's end, the run's) */
    void *lbuf;
    uint64_t last_tick, *samples, *lnext, lstep, lleft, lspare;
    uint64_t warm_tick; /* the answer to message warm: the window's start */
    uint64_t t0_tick, t1_tick, t0_ns, t1_ns;

    /* bw */
    void **bufs;
    uint32_t nbufs, *freeb, nfree, rr;
    uint64_t sent, resp;

    /* flows: messages claimed and answered over all of them (--conns), and
     * stream messages answered (--streams) */
    _Atomic uint64_t asent, aresp, stream_resp;
    uint64_t stream0, stream1;

    bex_sock_stats st0, st1;
    double cpu0, cpu1;
    struct phase_os os0, os1;
    /* at the first connect: a failed run's counters are since then */
    bex_sock_stats st_b;
    double cpu_b;
    struct phase_os os_b;
};

/* (out of line: the latency callbacks' fast path stays short) */
static void __attribute__((noinline, cold)) cl_fail(struct client *cl, int err)
{
    int zero = 0;
    atomic_compare_exchange_strong(&cl->fail, &zero, err ? err : -EIO);
    gate_signal(&cl->g);
}

/* The counters of every client context, summed. */
static void stats_all(struct client *cl, bex_sock_stats *out)
{
    memset(out, 0, sizeof(*out));
    for (uint32_t i = 0; i < cl->nctx; i++) {
        bex_sock_stats one;
        bex_ctx_stats(cl->ctxs[i], &one);
        uint64_t *d = (uint64_t *)out, *v = (uint64_t *)&one;
        for (size_t k = 0; k < sizeof(one) / sizeof(uint64_t); k++)
            d[k] += v[k];
        if (one.max_inflight_bytes > out->max_inflight_bytes)
            out->max_inflight_bytes = one.max_inflight_bytes;
    }
}

/* With --conns, phase_start and phase_end may run on different I/O
 * threads: the mutex orders their writes before the report reads them. */

static void phase_os_read(struct phase_os *o)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    o->user_s = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6;
    o->sys_s = (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    o->nvcsw = ru.ru_nvcsw;
    o->nivcsw = ru.ru_nivcsw;
    memset(o->m, 0, sizeof o->m);
    o->ctxt = 0;
    FILE *f = fopen("/proc/stat", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "cpu ", 4))
            sscanf(line + 4, "%llu %llu %llu %llu %llu %llu %llu %llu", &o->m[0], &o->m[1],
                   &o->m[2], &o->m[3], &o->m[4], &o->m[5], &o->m[6], &o->m[7]);
        else if (!strncmp(line, "ctxt ", 5))
            sscanf(line + 5, "%llu", &o->ctxt);
    }
    fclose(f);
    memset(o->hw, 0, sizeof o->hw);
    for (size_t i = 0; i < HW_N; i++) {
        glob_t g;
        char pat[128];
        snprintf(pat, sizeof pat, "/sys/class/infiniband/*/ports/*/hw_counters/%s", hw_names[i]);
        if (glob(pat, 0, NULL, &g) != 0)
            continue;
        for (size_t k = 0; k < g.gl_pathc; k++) {
            FILE *h = fopen(g.gl_pathv[k], "r");
            unsigned long long v = 0;
            if (h && fscanf(h, "%llu", &v) == 1)
                o->hw[i] += v;
            if (h)
                fclose(h);
        }
        globfree(&g);
    }
}

static void print_os_json(const struct phase_os *a, const struct phase_os *b)
{
    static const char *const nm[8] = {"user",   "nice", "system",  "idle",
                                      "iowait", "irq",  "softirq", "steal"};
    printf(",\"os_user_s\":%.3f,\"os_sys_s\":%.3f,\"os_nvcsw\":%ld,\"os_nivcsw\":%ld,"
           "\"os_ctxt\":%llu",
           b->user_s - a->user_s, b->sys_s - a->sys_s, b->nvcsw - a->nvcsw, b->nivcsw - a->nivcsw,
           b->ctxt - a->ctxt);
    for (int i = 0; i < 8; i++)
        printf(",\"m_%s\":%llu", nm[i], b->m[i] - a->m[i]);
    for (size_t i = 0; i < HW_N; i++)
        printf(",\"hw_%s\":%llu", hw_names[i], b->hw[i] - a->hw[i]);
}

static void phase_start(struct client *cl)
{
    pthread_mutex_lock(&cl->g.mu);
    stats_all(cl, &cl->st0);
    cl->stream0 = atomic_load(&cl->stream_resp);
    phase_os_read(&cl->os0);
    cl->cpu0 = cpu_seconds();
    cl->t0_ns = mono_ns();
    cl->t0_tick = ticks();
    pthread_mutex_unlock(&cl->g.mu);
}

/* The measured window's end: its times and counters. */
static void phase_record(struct client *cl)
{
    pthread_mutex_lock(&cl->g.mu);
    cl->t1_tick = ticks();
    cl->t1_ns = mono_ns();
    cl->stream1 = atomic_load(&cl->stream_resp);
    cl->cpu1 = cpu_seconds();
    phase_os_read(&cl->os1);
    stats_all(cl, &cl->st1);
    pthread_mutex_unlock(&cl->g.mu);
}

/* The last answer: the run is over. */
static void phase_finish(struct client *cl)
{
    pthread_mutex_lock(&cl->g.mu);
    atomic_store(&cl->finished, 1);
    pthread_cond_broadcast(&cl->g.cv);
    pthread_mutex_unlock(&cl->g.mu);
}

static void phase_end(struct client *cl)
{
    phase_record(cl);
    phase_finish(cl);
}

/* Send on flow c while its window and buffers allow, at most max messages.
 * A --conns flow claims each message from the run's total first. After a
 * successful send c is not read again before the loop test does (max 1:
 * not at all), so another thread may start a flow that its own I/O thread
 * then runs. */
static void flow_issue(struct client *cl, struct csock *c, uint32_t max)
{
    uint32_t n = 0;
    while (n < max && c->sent - c->resp < c->w && c->nfree && !atomic_load(&cl->finished) &&
           !atomic_load_explicit(&cl->fail, memory_order_relaxed)) {
        if (cl->test == T_BW && atomic_fetch_add(&cl->asent, 1) >= cl->total)
            return;
        uint32_t b = c->freeb[--c->nfree];
        c->sent++;
        n++;
        int err = bex_sock_send(c->s, c->bufs[b], c->size, (void *)(uintptr_t)b);
        if (err) {
            c->freeb[c->nfree++] = b;
            c->sent--;
            cl_fail(cl, err);
            return;
        }
    }
}

static void flow_recv(struct client *cl, struct csock *c, size_t len)
{
    if (len != RESP_LEN) {
        fprintf(stderr, "bex-perf: response of %zu bytes, expected %d\n", len, RESP_LEN);
        cl_fail(cl, -EPROTO);
        return;
    }
    c->resp++;
    if (cl->test != T_BW) {
        atomic_fetch_add_explicit(&cl->stream_resp, 1, memory_order_relaxed);
    } else {
        uint64_t r = atomic_fetch_add(&cl->aresp, 1) + 1;
        if (r == cl->warm)
            phase_start(cl);
        if (r == cl->end)
            phase_record(cl);
        if (r == cl->total) {
            phase_finish(cl);
            return;
        }
    }
    flow_issue(cl, c, UINT32_MAX);
}

/* lat: the latency socket's callbacks from its setup's answer on
 * (cl_recv sets them; user: the client). */

/* Round trips answered so far (a report's, after a timeout). */
static uint64_t lat_count(const struct client *cl)
{
    if (cl->test != T_LAT)
        return 0;
    return cl->lstep ? cl->warm + (uint64_t)(cl->lnext - cl->samples) : cl->warm - cl->lleft;
}

/* The answer to message warm (the window starts: the samples from here
 * are kept) or to the last one (returns true: the run is over). */
static bool __attribute__((noinline)) lat_mark(struct client *cl)
{
    if (cl->lstep) {
        phase_end(cl);
        return true;
    }
    cl->warm_tick = cl->last_tick;
    phase_start(cl);
    cl->lnext = cl->samples;
    cl->lstep = 1;
    cl->lleft = cl->iters;
    return false;
}

/* An echo of the wrong length, or one after the run failed. */
static void __attribute__((noinline)) lat_odd(struct client *cl, void *buf, size_t len)
{
    bex_mem_free(buf);
    if (atomic_load(&cl->fail))
        return;
    fprintf(stderr, "bex-perf: echo of %zu bytes, expected %zu\n", len, cl->size);
    cl_fail(cl, -EPROTO);
}

/* The echo goes back as the next message. */
static void lat_echo(bex_sock *s, void *buf, size_t len, struct client *cl)
{
    int err = bex_sock_send(s, buf, len, NULL);
    if (err) {
        bex_mem_free(buf);
        cl_fail(cl, err);
    }
}

/* The sample that ends the warm-up or the run (lat_mark), then the echo
 * back unless the run is over. */
static void __attribute__((noinline))
lat_marked(bex_sock *s, void *buf, size_t len, struct client *cl)
{
    if (lat_mark(cl))
        bex_mem_free(buf);
    else
        lat_echo(s, buf, len, cl);
}

/* The echo: its sample, and it goes back as the next message. The rare
 * cases are tail calls, so the frame keeps only what the send's failure
 * needs (four registers were saved a message, issue 25 item 2). */
static void lat_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    uint64_t now = ticks();
    struct client *cl = user;
    if (len != cl->size || atomic_load_explicit(&cl->fail, memory_order_relaxed)) {
        lat_odd(cl, buf, len);
        return;
    }
    uint64_t *p = cl->lnext;
    *p = now - cl->last_tick;
    cl->lnext = p + cl->lstep;
    cl->last_tick = now;
    if (--cl->lleft == 0) {
        lat_marked(s, buf, len, cl);
        return;
    }
    lat_echo(s, buf, len, cl);
}

/* Every buffer sent on the latency socket is bex's (the setup's, the first
 * message's, the echoes received): freed here. */
static void lat_send_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu;
    if (status)
        cl_fail(user, status);
    bex_mem_free(buf);
}

static void bw_issue(struct client *cl)
{
    while (cl->sent < cl->total && cl->sent - cl->resp < cl->o->outstanding && cl->nfree) {
        uint32_t b = cl->freeb[--cl->nfree];
        struct csock *c = &cl->cs[cl->rr++ % cl->ncs];
        int err = bex_sock_send(c->s, cl->bufs[b], cl->size, (void *)(uintptr_t)b);
        if (err) {
            cl->freeb[cl->nfree++] = b;
            cl_fail(cl, err);
            return;
        }
        cl->sent++;
    }
}

static void bw_recv(struct client *cl, size_t len)
{
    if (len != RESP_LEN) {
        fprintf(stderr, "bex-perf: response of %zu bytes, expected %d\n", len, RESP_LEN);
        cl_fail(cl, -EPROTO);
        return;
    }
    cl->resp++;
    if (cl->resp == cl->warm)
        phase_start(cl);
    if (cl->resp == cl->total) {
        phase_end(cl);
        return;
    }
    bw_issue(cl);
}

static void start_test(struct client *cl)
{
    /* flows first: one message each (their own threads do the rest) */
    for (uint32_t i = 0; i < cl->ncs; i++)
        if (cl->cs[i].flow)
            flow_issue(cl, &cl->cs[i], 1);
    if (cl->o->conns) {
        if (cl->warm == 0)
            phase_start(cl);
        return;
    }
    if (cl->test == T_LAT) {
        cl->last_tick = ticks();
        if (cl->warm == 0) {
            cl->warm_tick = cl->last_tick;
            phase_start(cl);
        }
        /* the first message: its buffer is bex's from here on */
        void *b = cl->lbuf;
        cl->lbuf = NULL;
        int err = bex_sock_send(cl->cs[0].s, b, cl->size, NULL);
        if (err) {
            bex_mem_free(b);
            cl_fail(cl, err);
        }
    } else {
        if (cl->warm == 0)
            phase_start(cl);
        bw_issue(cl);
    }
}

static void lat_error(bex_sock *s, int err, void *user);
static void lat_close(bex_sock *s, void *user);
static const bex_sock_ops lat_ops = {.on_recv = lat_recv,
                                     .on_send_done = lat_send_done,
                                     .on_error = lat_error,
                                     .on_close = lat_close};

static void cl_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct csock *c = user;
    struct client *cl = c->cl;
    (void)s;
    if (!c->ready) {
        uint32_t resp;
        int bad = setup_decode(buf, len, &resp);
        bex_mem_free(buf);
        if (bad) {
            cl_fail(cl, -EPROTO);
            return;
        }
        c->ready = true;
        /* the latency socket's own callbacks from here on (immediate: this
         * is its I/O thread) */
        if (!c->flow && cl->test == T_LAT) {
            int err = bex_sock_set_user(s, &lat_ops, cl);
            if (err) {
                cl_fail(cl, err);
                return;
            }
        }
        if (atomic_fetch_add(&cl->ready, 1) + 1 == (long)cl->ncs) {
            if (cl->o->idle_ms) /* client_run starts it after the idle time */
                gate_signal(&cl->g);
            else
                start_test(cl);
        }
        return;
    }
    bex_mem_free(buf);
    if (atomic_load_explicit(&cl->fail, memory_order_relaxed) || atomic_load(&cl->finished))
        return;
    if (c->flow)
        flow_recv(cl, c, len);
    else
        bw_recv(cl, len);
}

static void cl_send_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    struct csock *c = user;
    struct client *cl = c->cl;
    (void)s, (void)len;
    if (mu == SETUP_TAG) {
        bex_mem_free(buf);
        if (status)
            cl_fail(cl, status);
        return;
    }
    if (status) {
        cl_fail(cl, status);
        return;
    }
    uint32_t b = (uint32_t)(uintptr_t)mu;
    if (c->flow) {
        c->freeb[c->nfree++] = b;
        flow_issue(cl, c, UINT32_MAX);
    } else {
        cl->freeb[cl->nfree++] = b;
        if (!atomic_load(&cl->finished) && !atomic_load_explicit(&cl->fail, memory_order_relaxed))
            bw_issue(cl);
    }
}

static void cl_connect(bex_sock *s, int status, void *user)
{
    struct csock *c = user;
    struct client *cl = c->cl;
    if (status) {
        fprintf(stderr, "bex-perf: connect: %s\n", bex_strerror(status));
        cl_fail(cl, status);
        return;
    }
    uint8_t *b = bex_sock_alloc(c->ctx, SETUP_LEN);
    if (!b) {
        cl_fail(cl, -ENOMEM);
        return;
    }
    setup_encode(b, c->resp_len);
    int err = bex_sock_send(s, b, SETUP_LEN, SETUP_TAG);
    if (err) {
        bex_mem_free(b);
        cl_fail(cl, err);
        return;
    }
    atomic_fetch_add(&cl->connected, 1);
    gate_signal(&cl->g);
}

static void lat_error(bex_sock *s, int err, void *user)
{
    struct client *cl = user;
    (void)s;
    if (!atomic_load(&cl->finished))
        fprintf(stderr, "bex-perf: socket error: %s\n", bex_strerror(err));
    cl_fail(cl, err);
}

static void lat_close(bex_sock *s, void *user)
{
    struct client *cl = user;
    (void)s;
    atomic_fetch_add(&cl->closed, 1);
    gate_signal(&cl->g);
}

static void cl_error(bex_sock *s, int err, void *user)
{
    lat_error(s, err, ((struct csock *)user)->cl);
}

static void cl_close(bex_sock *s, void *user)
{
    lat_close(s, ((struct csock *)user)->cl);
}

static const bex_sock_ops cl_ops = {.on_connect = cl_connect,
                                    .on_recv = cl_recv,
                                    .on_send_done = cl_send_done,
                                    .on_error = cl_error,
                                    .on_close = cl_close};

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void print_stats_json(const struct client *cl)
{
    const bex_sock_stats *a = &cl->st0, *b = &cl->st1;
    print_os_json(&cl->os0, &cl->os1);
    printf(",\"cpu_s\":%.3f,\"post_send_calls\":%" PRIu64 ",\"sends_posted\":%" PRIu64
           ",\"writes_posted\":%" PRIu64 ",\"signaled\":%" PRIu64 ",\"post_recv_calls\":%" PRIu64
           ",\"credit_stalls\":%" PRIu64 ",\"window_stalls\":%" PRIu64 ",\"credit_msgs\":%" PRIu64
           ",\"max_inflight_bytes\":%" PRIu64 ",\"rndv_prebound\":%" PRIu64
           ",\"keepalive_writes\":%" PRIu64 ",\"poll_recvs\":%" PRIu64
           ",\"poll_recv_conns\":%" PRIu64 ",\"empty_turns\":%" PRIu64,
           cl->cpu1 - cl->cpu0, b->post_send_calls - a->post_send_calls,
           b->sends_posted - a->sends_posted, b->writes_posted - a->writes_posted,
           b->signaled - a->signaled, b->post_recv_calls - a->post_recv_calls,
           b->credit_stalls - a->credit_stalls, b->window_stalls - a->window_stalls,
           b->credit_msgs - a->credit_msgs, b->max_inflight_bytes,
           b->rndv_prebound - a->rndv_prebound, b->keepalive_writes - a->keepalive_writes,
           b->poll_recvs - a->poll_recvs, b->poll_recv_conns - a->poll_recv_conns,
           b->empty_turns - a->empty_turns);
    /* the loops' polls and system calls (Figure 11's per-message counts) */
    printf(",\"cq_polls\":%" PRIu64 ",\"cq_polls_empty\":%" PRIu64 ",\"cq_arms\":%" PRIu64
           ",\"cq_events\":%" PRIu64 ",\"loop_waits\":%" PRIu64 ",\"loop_sleeps\":%" PRIu64
           ",\"loop_wake_reads\":%" PRIu64 ",\"loop_wakes\":%" PRIu64,
           b->cq_polls - a->cq_polls, b->cq_polls_empty - a->cq_polls_empty,
           b->cq_arms - a->cq_arms, b->cq_events - a->cq_events, b->loop_waits - a->loop_waits,
           b->loop_sleeps - a->loop_sleeps, b->loop_wake_reads - a->loop_wake_reads,
           b->loop_wakes - a->loop_wakes);
}

static const char *poll_name(uint32_t m)
{
    return m == BEX_POLL_BUSY ? "busy" : m == BEX_POLL_EVENT ? "event" : "spin";
}

static const char *transport_name(uint32_t t)
{
    return t == BEX_TRANSPORT_TCP ? "tcp" : t == BEX_TRANSPORT_RDMA ? "rdma" : "auto";
}

/* The run's setting of the options that shape it, and (--conns) the
 * connections it had. */
static void print_cfg_json(const struct client *cl)
{
    const struct opts *o = cl->o;
    printf(",\"io_threads\":%u,\"srq_depth\":%u,\"poll_mode\":\"%s\",\"transport\":\"%s\","
           "\"tcp_conns\":%" PRIu64 ",\"connect_timeout_ms\":%u", /* 0: the library's */
           o->io_threads ? o->io_threads : 1, o->srq_depth, poll_name(o->poll_mode),
           transport_name(o->transport), cl->st1.tcp_conns, o->connect_timeout_ms);
    if (o->conns)
        printf(",\"conns\":%u,\"ports\":%u,\"contexts\":%u,\"engines\":%" PRIu64
               ",\"srq_credits\":%" PRIu64 ",\"srq_refused\":%" PRIu64,
               o->conns, o->ports ? o->ports : 1, cl->nctx, cl->st1.engines, cl->st1.srq_credits,
               cl->st1.srq_refused);
    if (o->steady)
        printf(",\"steady\":true");
    if (o->ka_ms)
        printf(",\"keepalive_ms\":%u", o->ka_ms);
}

static void print_stats_text(const struct client *cl, uint64_t msgs)
{
    const bex_sock_stats *a = &cl->st0, *b = &cl->st1;
    double m = msgs ? (double)msgs : 1;
    fprintf(
        stderr,
        "  per message: %.2f post_send calls, %.2f SENDs, %.2f WRITEs, %.2f signaled, "
        "%.3f post_recv calls; credit stalls %" PRIu64 ", window stalls %" PRIu64
        ", credit msgs %" PRIu64 "; CPU %.2f s\n",
        (double)(b->post_send_calls - a->post_send_calls) / m,
        (double)(b->sends_posted - a->sends_posted) / m,
        (double)(b->writes_posted - a->writes_posted) / m, (double)(b->signaled - a->signaled) / m,
        (double)(b->post_recv_calls - a->post_recv_calls) / m, b->credit_stalls - a->credit_stalls,
        b->window_stalls - a->window_stalls, b->credit_msgs - a->credit_msgs, cl->cpu1 - cl->cpu0);
}

static void report_lat(struct client *cl)
{
    uint64_t n = cl->iters;
    double dticks = (double)(cl->t1_tick - cl->t0_tick);
    double ns_per_tick = dticks > 0 ? (double)(cl->t1_ns - cl->t0_ns) / dticks : 1.0;
    qsort(cl->samples, n, sizeof(uint64_t), cmp_u64);
    /* the samples' sum: each is the difference of two answers' ticks */
    double sum = (double)(cl->last_tick - cl->warm_tick);
    /* half the round trip, in microseconds */
    double f = ns_per_tick / 2000.0;
    double min = (double)cl->samples[0] * f, max = (double)cl->samples[n - 1] * f;
    double med = (double)cl->samples[n / 2] * f;
    uint64_t i99 = (uint64_t)((double)n * 0.99);
    double p99 = (double)cl->samples[i99 < n ? i99 : n - 1] * f;
    double mean = sum / (double)n * f;
    double secs = (double)(cl->t1_ns - cl->t0_ns) / 1e9;
    double stream_mib_s = secs > 0 ? (double)(cl->stream1 - cl->stream0) *
                                         (double)cl->o->stream_size / secs / 1048576.0
                                   : 0;
    if (cl->o->json) {
        printf("{\"test\":\"lat\",\"size\":%zu,\"iters\":%" PRIu64 ",\"warmup\":%" PRIu64
               ",\"median_us\":%.2f,\"p99_us\":%.2f,\"min_us\":%.2f,\"mean_us\":%.2f,"
               "\"max_us\":%.2f,\"eager\":%u,\"spin_us\":%u,\"remote_access\":\"%s\"",
               cl->size, n, cl->warm, med, p99, min, mean, max, cl->o->eager, cl->o->spin_us,
               mode_name(cl->ctx));
        if (cl->o->streams)
            printf(",\"streams\":%u,\"stream_size\":%u,\"stream_outstanding\":%u,\"frag\":%u,"
                   "\"stream_mib_s\":%.2f",
                   cl->o->streams, cl->o->stream_size, cl->o->outstanding, cl->o->frag,
                   stream_mib_s);
        print_cfg_json(cl);
        print_stats_json(cl);
        printf("}\n");
    } else {
        printf(" %-8s %-11s %-10s %-10s %-12s %-10s %-10s\n", "#bytes", "#iterations", "t_min[us]",
               "t_max[us]", "t_typical[us]", "t_avg[us]", "99%[us]");
        printf(" %-8zu %-11" PRIu64 " %-10.2f %-10.2f %-12.2f %-10.2f %-10.2f\n", cl->size, n, min,
               max, med, mean, p99);
        if (cl->o->streams)
            printf(" with %u streams of %u-byte messages on the engine (frag %u): %.2f MiB/s\n",
                   cl->o->streams, cl->o->stream_size, cl->o->frag, stream_mib_s);
        print_stats_text(cl, n * 2);
    }
    fflush(stdout);
}

/* A run that failed (--json): its counters from the first connect to
 * now, the RDMA devices' (rxe's retries, refusals and packets) among
 * them, as one line "failed run: {...}" (no result line: a reader of
 * results skips it). What a stall leaves to look at. */
static void report_failed(struct client *cl)
{
    phase_record(cl);
    cl->st0 = cl->st_b;
    cl->os0 = cl->os_b;
    cl->cpu0 = cl->cpu_b;
    printf("failed run: {\"test\":\"failed\",\"outstanding\":%u,\"sockets\":%u,\"connected\":%ld,"
           "\"answered\":%" PRIu64,
           cl->o->outstanding, cl->ncs, atomic_load(&cl->connected),
           cl->o->conns ? atomic_load(&cl->aresp) : cl->resp);
    print_cfg_json(cl);
    print_stats_json(cl);
    printf("}\n");
    fflush(stdout);
}

static void report_bw(struct client *cl, uint32_t frag, enum test shown)
{
    double secs = (double)(cl->t1_ns - cl->t0_ns) / 1e9;
    uint64_t msgs = cl->end - cl->warm;
    double mib_s = (double)msgs * (double)cl->size / secs / 1048576.0;
    double msg_s = (double)msgs / secs;
    const char *name = shown == T_FRAG ? "frag" : "bw";
    if (cl->o->json) {
        printf("{\"test\":\"%s\",\"size\":%zu,\"frag\":%u,\"iters\":%" PRIu64 ",\"warmup\":%" PRIu64
               ",\"outstanding\":%u,\"sockets\":%u,\"seconds\":%.3f,"
               "\"mib_s\":%.2f,\"msg_s\":%.1f,\"unit\":\"MiB/s\",\"spin_us\":%u,"
               "\"remote_access\":\"%s\"",
               name, cl->size, frag, msgs, cl->warm, cl->o->outstanding, cl->ncs, secs, mib_s,
               msg_s, cl->o->spin_us, mode_name(cl->ctx));
        print_cfg_json(cl);
        print_stats_json(cl);
        printf("}\n");
    } else {
        if (shown != T_FRAG || frag == cl->o->frag_list[0])
            printf(" %-10s %-10s %-11s %-8s %-14s %-12s\n", "#bytes", "frag", "#iterations",
                   "sockets", "BW[MiB/sec]", "msg/s");
        char fs[16] = "default";
        if (frag)
            snprintf(fs, sizeof(fs), "%u", frag);
        printf(" %-10zu %-10s %-11" PRIu64 " %-8u %-14.2f %-12.1f\n", cl->size, fs, msgs, cl->ncs,
               mib_s, msg_s);
        if (cl->o->conns)
            printf(" %u connections (engines %" PRIu64 ") from %u contexts, %u I/O threads, "
                   "srq_depth %u\n",
                   cl->o->conns, cl->st1.engines, cl->nctx,
                   cl->o->io_threads ? cl->o->io_threads : 1, cl->o->srq_depth);
        print_stats_text(cl, msgs);
    }
    fflush(stdout);
}

/* Give flow c its window and buffers (from its context). */
static int flow_init(struct client *cl, struct csock *c, uint32_t idx)
{
    const struct opts *o = cl->o;
    c->flow = true;
    if (o->conns) {
        c->size = o->size;
        c->w = o->outstanding / o->conns + (idx < o->outstanding % o->conns);
        if (c->w == 0)
            c->w = 1;
    } else {
        c->size = o->stream_size;
        c->w = o->outstanding;
    }
    c->nbufs = c->w + 2;
    c->bufs = calloc(c->nbufs, sizeof(void *));
    c->freeb = calloc(c->nbufs, sizeof(uint32_t));
    if (!c->bufs || !c->freeb)
        return -ENOMEM;
    for (uint32_t i = 0; i < c->nbufs; i++) {
        c->bufs[i] = bex_sock_alloc(c->ctx, c->size);
        if (!c->bufs[i])
            return -ENOMEM;
        memset(c->bufs[i], (int)i, c->size);
        c->freeb[c->nfree++] = i;
    }
    return 0;
}

/* One client run: its contexts, its sockets, one test, teardown. */
static int client_run(const struct opts *o, enum test test, uint32_t frag, enum test shown)
{
    struct client cl = {.o = o, .test = test, .size = o->size};
    gate_init(&cl.g);
    int rc = 1;
    uint32_t ports = o->ports ? o->ports : 1;
    if (o->conns)
        cl.ncs = o->conns;
    else
        cl.ncs = test == T_LAT ? 1 + o->streams : o->sockets;
    cl.nctx = o->conns ? (o->conns + ports - 1) / ports : 1;
    cl.iters = o->iters;
    cl.warm = o->warmup;
    cl.end = cl.warm + cl.iters;
    /* --steady: every answer of the window is followed by a request (the
     * load in flight is sent after it and drained unmeasured), so the
     * counts per message are of the closed loop, not of its drain */
    cl.total = cl.end + (o->steady ? o->outstanding : 0);
    cl.cs = calloc(cl.ncs, sizeof(*cl.cs));
    cl.ctxs = calloc(cl.nctx, sizeof(*cl.ctxs));
    if (!cl.cs || !cl.ctxs)
        goto out;
    bex_ctx_config cfg;
    fill_cfg(o, &cfg, frag);
    for (uint32_t i = 0; i < cl.nctx; i++) {
        int err = bex_ctx_create(&cfg, &cl.ctxs[i]);
        if (err) {
            fprintf(stderr, "bex-perf: bex_ctx_create: %s\n", bex_strerror(err));
            goto out_free;
        }
    }
    cl.ctx = cl.ctxs[0];
    if (test == T_LAT) {
        /* malloc: its pages are touched by the run, not zeroed first */
        cl.samples = malloc(cl.iters * sizeof(uint64_t));
        cl.lnext = cl.warm ? &cl.lspare : cl.samples;
        cl.lstep = cl.warm ? 0 : 1;
        cl.lleft = cl.warm ? cl.warm : cl.iters;
        cl.lbuf = bex_sock_alloc(cl.ctx, cl.size ? cl.size : 1);
        if (!cl.samples || !cl.lbuf) {
            fprintf(stderr, "bex-perf: out of memory\n");
            goto out_free;
        }
        memset(cl.lbuf, 0xa5, cl.size);
    } else if (!o->conns) {
        cl.nbufs = o->outstanding + 2;
        cl.bufs = calloc(cl.nbufs, sizeof(void *));
        cl.freeb = calloc(cl.nbufs, sizeof(uint32_t));
        if (!cl.bufs || !cl.freeb)
            goto out_free;
        for (uint32_t i = 0; i < cl.nbufs; i++) {
            cl.bufs[i] = bex_sock_alloc(cl.ctx, cl.size ? cl.size : 1);
            if (!cl.bufs[i]) {
                fprintf(stderr, "bex-perf: out of registered memory\n");
                goto out_free;
            }
            memset(cl.bufs[i], (int)i, cl.size);
            cl.freeb[cl.nfree++] = i;
        }
    }
    for (uint32_t i = 0; i < cl.ncs; i++) {
        struct csock *c = &cl.cs[i];
        c->cl = &cl;
        c->ctx = cl.ctxs[o->conns ? i / ports : 0];
        c->resp_len = test == T_LAT && i == 0 ? 0 : RESP_LEN;
        if ((o->conns || (test == T_LAT && i > 0)) && flow_init(&cl, c, i)) {
            fprintf(stderr, "bex-perf: out of registered memory\n");
            goto out_free;
        }
    }
    bex_addr srv = {.in4 = {.sin_family = AF_INET}};
    if (inet_pton(AF_INET, o->client, &srv.in4.sin_addr) != 1) {
        fprintf(stderr, "bex-perf: bad server address '%s'\n", o->client);
        goto out_free;
    }
    stats_all(&cl, &cl.st_b);
    phase_os_read(&cl.os_b);
    cl.cpu_b = cpu_seconds();
    uint32_t opened = 0;
    for (; opened < cl.ncs; opened++) {
        struct csock *c = &cl.cs[opened];
        srv.in4.sin_port = htons((uint16_t)(o->port + (o->conns ? opened % ports : 0)));
        /* --conns: at most 16 connections in setup at once */
        if (o->conns && opened >= 16 &&
            gate_wait(&cl.g, &cl.connected, (long)opened - 15, &cl.fail, o->timeout_s)) {
            fprintf(stderr, "bex-perf: %ld of %u connections made\n", atomic_load(&cl.connected),
                    cl.ncs);
            cl_fail(&cl, -ETIMEDOUT);
            break;
        }
        int err = bex_sock_connect(c->ctx, &srv, &cl_ops, c, &c->s);
        if (err) {
            fprintf(stderr, "bex-perf: bex_sock_connect: %s\n", bex_strerror(err));
            cl_fail(&cl, err);
            break;
        }
    }
    if (o->idle_ms && !atomic_load(&cl.fail) &&
        !gate_wait(&cl.g, &cl.ready, (long)cl.ncs, &cl.fail, o->timeout_s)) {
        struct timespec idle = {o->idle_ms / 1000, (long)(o->idle_ms % 1000) * 1000000L};
        while (nanosleep(&idle, &idle) && errno == EINTR)
            ;
        start_test(&cl); /* (its first send from this thread, the rest from callbacks) */
    }
    if (!atomic_load(&cl.fail)) {
        int err = gate_wait(&cl.g, &cl.finished, 1, &cl.fail, o->timeout_s);
        if (err == GATE_TIMEOUT)
            fprintf(stderr,
                    "bex-perf: no result within %u s (connected %ld, ready %ld, sent %" PRIu64
                    ", answered %" PRIu64 ", round trips %" PRIu64 ")\n",
                    o->timeout_s, atomic_load(&cl.connected), atomic_load(&cl.ready),
                    o->conns ? atomic_load(&cl.aresp) : cl.sent,
                    o->conns ? atomic_load(&cl.aresp) : cl.resp, lat_count(&cl));
        else if (err)
            fprintf(stderr, "bex-perf: test failed: %s\n", bex_strerror(err));
        else
            rc = 0;
        if (rc && o->json)
            report_failed(&cl);
    }
    for (uint32_t i = 0; i < opened; i++)
        bex_sock_close(cl.cs[i].s);
    if (gate_wait(&cl.g, &cl.closed, (long)opened, &(_Atomic int){0}, 60)) {
        fprintf(stderr, "bex-perf: sockets did not close\n");
        rc = 1;
    }
    if (rc == 0) {
        if (test == T_LAT)
            report_lat(&cl);
        else
            report_bw(&cl, frag, shown);
    }
out_free:
    if (cl.nctx && cl.ctxs && cl.ctxs[cl.nctx - 1])
        report_turns("bex-perf", cl.ctxs, cl.nctx);
    /* every send has been reported by now (on_close comes after them); the
     * first message's buffer is still ours if it was never sent */
    bex_mem_free(cl.lbuf);
    for (uint32_t i = 0; cl.bufs && i < cl.nbufs; i++)
        bex_mem_free(cl.bufs[i]);
    for (uint32_t i = 0; cl.cs && i < cl.ncs; i++) {
        struct csock *c = &cl.cs[i];
        for (uint32_t j = 0; c->bufs && j < c->nbufs; j++)
            bex_mem_free(c->bufs[j]);
        free(c->bufs);
        free(c->freeb);
    }
    for (uint32_t i = 0; cl.ctxs && i < cl.nctx; i++)
        if (cl.ctxs[i])
            bex_ctx_destroy(cl.ctxs[i]);
out:
    free(cl.samples);
    free(cl.bufs);
    free(cl.freeb);
    free(cl.cs);
    free(cl.ctxs);
    gate_destroy(&cl.g);
    return rc;
}

/* ---------------- command line ---------------- */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: bex-perf -s --local ADDR [options]          (server)\n"
            "       bex-perf -c SERVER --local ADDR [options]   (client)\n"
            "  -s, --server          serve until SIGINT/SIGTERM (or --runs)\n"
            "  -c, --client ADDR     run a test against the server at ADDR\n"
            "  -p, --port PORT       server port (%d)\n"
            "      --local ADDR      local IPv4 address; chooses the RDMA device (required)\n"
            "  -t, --test T          lat | bw | frag (lat)\n"
            "      --size BYTES      message size (lat 32, bw/frag 1048576)\n"
            "  -n, --iters N         measured messages (lat 1000, bw 200, frag 64)\n"
            "      --warmup N        unmeasured messages first (lat 100, bw/frag outstanding)\n"
            "      --outstanding N   bw: messages in flight (16)\n"
            "      --sockets N       bw: sockets multiplexed on one engine (1)\n"
            "      --frag BYTES      ctx frag_size (library default)\n"
            "      --frag-list LIST  frag: comma-separated sizes (1K,2K,4K,8K,16K,32K,64K,256K)\n"
            "      --eager BYTES     ctx eager_max (library default); the receiver's decides\n"
            "      --spin-us N       ctx poll_spin_us (library default)\n"
            "      --sq-depth N, --rq-depth N   ctx queue depths (library default)\n"
            "      --runs N          server: exit after N sockets have closed\n"
            "      --timeout S       client: give up after S seconds per run (300)\n"
            "      --json            one JSON object per result line\n"
            "      --remote-access M auto | landing | window: ctx remote_access (auto);\n"
            "                        the receiver's decides how its destinations are reached\n"
            "      --keepalive-timeout MS  ctx keepalive_timeout_ms (library default), e.g.\n"
            "                        longer on a loaded host where the VM stalls\n"
            "      --keepalive-ms MS ctx keepalive_ms (library default)\n"
            "      --conns N         bw: N connections (engines), each its own closed loop of\n"
            "                        --outstanding / N messages in flight (at least 1)\n"
            "      --steady          bw --conns: the measured window ends --outstanding\n"
            "                        answers before the last (those drain unmeasured), so\n"
            "                        every answer in it is followed by a request\n"
            "      --ports P         server: listen on P consecutive ports from -p; client\n"
            "                        (--conns): spread connections over them (1)\n"
            "      --streams K       lat: K sockets on the same engine stream --stream-size\n"
            "                        messages, --outstanding each, during the test (0)\n"
            "      --stream-size B   lat --streams: their message size (1048576)\n"
            "      --io-threads N    ctx io_threads (1)\n"
            "      --srq-depth N     ctx srq_depth: SRQ mode (0: off)\n"
            "      --poll-mode M     spin | busy | event: ctx poll_mode (spin: spin-then-sleep)\n"
            "      --transport T     auto | rdma | tcp: ctx transport (auto)\n"
            "      --qp-timeout N    ctx qp_timeout (verbs ACK timeout exponent; 14)\n"
            "      --setup-max N     ctx setup_max (64)\n"
            "      --connect-timeout MS  ctx connect_timeout_ms (3000); many connections\n"
            "                        set up at once on a slow host need more\n"
            "      --idle-ms MS      lat: once connected, idle MS ms before the test\n"
            "                        (bench/cost/run: what an empty loop turn costs)\n",
            DEFAULT_PORT);
}

/* "64K", "1M", "4096" -> bytes (suffixes only when sizes); 0 on error. */
static uint64_t parse_num(const char *s, bool sizes)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *s == '-')
        return 0;
    if (sizes && (*end == 'k' || *end == 'K'))
        v <<= 10, end++;
    else if (sizes && (*end == 'm' || *end == 'M'))
        v <<= 20, end++;
    else if (sizes && (*end == 'g' || *end == 'G'))
        v <<= 30, end++;
    return *end ? 0 : v;
}

/* A positive 32-bit option value; prints the complaint itself. */
static int parse_u32(const char *name, const char *s, uint32_t *out, bool sizes)
{
    uint64_t v = parse_num(s, sizes);
    if (v == 0 || v > UINT32_MAX) {
        fprintf(stderr, "bex-perf: bad %s '%s'\n", name, s);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static int parse_args(int argc, char **argv, struct opts *o)
{
    enum {
        O_LOCAL = 256,
        O_SIZE,
        O_WARM,
        O_OUT,
        O_SOCKS,
        O_FRAG,
        O_FLIST,
        O_EAGER,
        O_SPIN,
        O_SQ,
        O_RQ,
        O_RUNS,
        O_TIMEOUT,
        O_JSON,
        O_REMOTE,
        O_KA,
        O_KAMS,
        O_CONNS,
        O_PORTS,
        O_STREAMS,
        O_SSIZE,
        O_IOT,
        O_SRQ,
        O_POLL,
        O_TRANSPORT,
        O_QPTO,
        O_SETUPMAX,
        O_CONNTO,
        O_STEADY,
        O_IDLE
    };
    static const struct option lo[] = {{"server", no_argument, NULL, 's'},
                                       {"client", required_argument, NULL, 'c'},
                                       {"port", required_argument, NULL, 'p'},
                                       {"test", required_argument, NULL, 't'},
                                       {"iters", required_argument, NULL, 'n'},
                                       {"local", required_argument, NULL, O_LOCAL},
                                       {"size", required_argument, NULL, O_SIZE},
                                       {"warmup", required_argument, NULL, O_WARM},
                                       {"outstanding", required_argument, NULL, O_OUT},
                                       {"sockets", required_argument, NULL, O_SOCKS},
                                       {"frag", required_argument, NULL, O_FRAG},
                                       {"frag-list", required_argument, NULL, O_FLIST},
                                       {"eager", required_argument, NULL, O_EAGER},
                                       {"spin-us", required_argument, NULL, O_SPIN},
                                       {"sq-depth", required_argument, NULL, O_SQ},
                                       {"rq-depth", required_argument, NULL, O_RQ},
                                       {"runs", required_argument, NULL, O_RUNS},
                                       {"timeout", required_argument, NULL, O_TIMEOUT},
                                       {"json", no_argument, NULL, O_JSON},
                                       {"remote-access", required_argument, NULL, O_REMOTE},
                                       {"keepalive-timeout", required_argument, NULL, O_KA},
                                       {"keepalive-ms", required_argument, NULL, O_KAMS},
                                       {"conns", required_argument, NULL, O_CONNS},
                                       {"steady", no_argument, NULL, O_STEADY},
                                       {"idle-ms", required_argument, NULL, O_IDLE},
                                       {"ports", required_argument, NULL, O_PORTS},
                                       {"streams", required_argument, NULL, O_STREAMS},
                                       {"stream-size", required_argument, NULL, O_SSIZE},
                                       {"io-threads", required_argument, NULL, O_IOT},
                                       {"srq-depth", required_argument, NULL, O_SRQ},
                                       {"poll-mode", required_argument, NULL, O_POLL},
                                       {"transport", required_argument, NULL, O_TRANSPORT},
                                       {"qp-timeout", required_argument, NULL, O_QPTO},
                                       {"setup-max", required_argument, NULL, O_SETUPMAX},
                                       {"connect-timeout", required_argument, NULL, O_CONNTO},
                                       {"help", no_argument, NULL, 'h'},
                                       {"version", no_argument, NULL, 'V'},
                                       {NULL, 0, NULL, 0}};
    static const uint32_t def_frags[] = {1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144};
    *o = (struct opts){
        .port = DEFAULT_PORT, .test = T_LAT, .outstanding = 16, .sockets = 1, .timeout_s = 300};
    bool warm_set = false;
    uint32_t v;
    int c;
    while ((c = getopt_long(argc, argv, "sc:p:t:n:h", lo, NULL)) != -1) {
        switch (c) {
        case 's':
            o->server = true;
            break;
        case 'c':
            o->client = optarg;
            break;
        case 'p':
            if (parse_u32("port", optarg, &v, false) || v > 65535)
                return -1;
            o->port = (uint16_t)v;
            break;
        case 't':
            if (!strcmp(optarg, "lat"))
                o->test = T_LAT;
            else if (!strcmp(optarg, "bw"))
                o->test = T_BW;
            else if (!strcmp(optarg, "frag"))
                o->test = T_FRAG;
            else {
                fprintf(stderr, "bex-perf: unknown test '%s'\n", optarg);
                return -1;
            }
            break;
        case 'n':
            if (parse_u32("iters", optarg, &v, false))
                return -1;
            o->iters = v;
            o->iters_set = true;
            break;
        case O_LOCAL:
            if (inet_pton(AF_INET, optarg, &o->local) != 1) {
                fprintf(stderr, "bex-perf: bad --local '%s'\n", optarg);
                return -1;
            }
            o->have_local = true;
            break;
        case O_SIZE:
            if (parse_u32("size", optarg, &v, true))
                return -1;
            o->size = v;
            o->size_set = true;
            break;
        case O_WARM:
            /* 0 is allowed: measure from the first message */
            if (strcmp(optarg, "0") && parse_u32("warmup", optarg, &v, false))
                return -1;
            o->warmup = strcmp(optarg, "0") ? v : 0;
            warm_set = true;
            break;
        case O_OUT:
            if (parse_u32("outstanding", optarg, &o->outstanding, false))
                return -1;
            o->outstanding_set = true;
            break;
        case O_KAMS:
            if (parse_u32("keepalive-ms", optarg, &o->ka_ms, false))
                return -1;
            break;
        case O_CONNS:
            if (parse_u32("conns", optarg, &o->conns, false) || o->conns > 65536)
                return -1;
            break;
        case O_PORTS:
            if (parse_u32("ports", optarg, &o->ports, false) || o->ports > 65535)
                return -1;
            break;
        case O_STREAMS:
            /* 0 is allowed: the baseline of the same test */
            if (strcmp(optarg, "0") &&
                (parse_u32("streams", optarg, &o->streams, false) || o->streams > 64))
                return -1;
            if (!strcmp(optarg, "0"))
                o->streams = 0;
            break;
        case O_SSIZE:
            if (parse_u32("stream-size", optarg, &o->stream_size, true) ||
                o->stream_size > (1u << 30))
                return -1;
            break;
        case O_IOT:
            if (parse_u32("io-threads", optarg, &o->io_threads, false))
                return -1;
            break;
        case O_SRQ:
            if (parse_u32("srq-depth", optarg, &o->srq_depth, false))
                return -1;
            break;
        case O_POLL:
            if (!strcmp(optarg, "spin"))
                o->poll_mode = BEX_POLL_SPIN_SLEEP;
            else if (!strcmp(optarg, "busy"))
                o->poll_mode = BEX_POLL_BUSY;
            else if (!strcmp(optarg, "event"))
                o->poll_mode = BEX_POLL_EVENT;
            else {
                fprintf(stderr, "bex-perf: --poll-mode is spin, busy or event\n");
                return -1;
            }
            break;
        case O_TRANSPORT:
            if (!strcmp(optarg, "auto"))
                o->transport = BEX_TRANSPORT_AUTO;
            else if (!strcmp(optarg, "rdma"))
                o->transport = BEX_TRANSPORT_RDMA;
            else if (!strcmp(optarg, "tcp"))
                o->transport = BEX_TRANSPORT_TCP;
            else {
                fprintf(stderr, "bex-perf: --transport is auto, rdma or tcp\n");
                return -1;
            }
            break;
        case O_QPTO:
            if (parse_u32("qp-timeout", optarg, &v, false) || v > 31)
                return -1;
            o->qp_timeout = (uint8_t)v;
            break;
        case O_SETUPMAX:
            if (parse_u32("setup-max", optarg, &o->setup_max, false))
                return -1;
            break;
        case O_STEADY:
            o->steady = true;
            break;
        case O_IDLE:
            if (parse_u32("idle-ms", optarg, &o->idle_ms, false))
                return -1;
            break;
        case O_CONNTO:
            if (parse_u32("connect-timeout", optarg, &o->connect_timeout_ms, false))
                return -1;
            break;
        case O_SOCKS:
            if (parse_u32("sockets", optarg, &o->sockets, false) || o->sockets > 1024)
                return -1;
            break;
        case O_FRAG:
            if (parse_u32("frag", optarg, &o->frag, true))
                return -1;
            break;
        case O_FLIST: {
            char *dup = strdup(optarg), *save = NULL;
            o->n_frag_list = 0;
            for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (o->n_frag_list == 32 || parse_u32("fragment size", t, &v, true)) {
                    free(dup);
                    return -1;
                }
                o->frag_list[o->n_frag_list++] = v;
            }
            free(dup);
            break;
        }
        case O_EAGER:
            if (parse_u32("eager", optarg, &o->eager, true))
                return -1;
            break;
        case O_SPIN:
            if (parse_u32("spin-us", optarg, &o->spin_us, false))
                return -1;
            break;
        case O_SQ:
            if (parse_u32("sq-depth", optarg, &o->sq_depth, false))
                return -1;
            break;
        case O_KA:
            if (parse_u32("keepalive-timeout", optarg, &o->ka_timeout_ms, false))
                return -1;
            break;
        case O_RQ:
            if (parse_u32("rq-depth", optarg, &o->rq_depth, false))
                return -1;
            break;
        case O_RUNS:
            if (parse_u32("runs", optarg, &v, false))
                return -1;
            o->runs = v;
            break;
        case O_TIMEOUT:
            if (parse_u32("timeout", optarg, &o->timeout_s, false))
                return -1;
            break;
        case O_JSON:
            o->json = true;
            break;
        case O_REMOTE:
            if (strcmp(optarg, "auto") == 0)
                o->remote_access = BEX_REMOTE_ACCESS_AUTO;
            else if (strcmp(optarg, "landing") == 0)
                o->remote_access = BEX_REMOTE_ACCESS_LANDING;
            else if (strcmp(optarg, "window") == 0)
                o->remote_access = BEX_REMOTE_ACCESS_WINDOW;
            else {
                fprintf(stderr, "bex-perf: --remote-access is auto, landing or window\n");
                return -1;
            }
            break;
        case 'h':
            usage(stdout);
            exit(0);
        case 'V':
            printf("bex-perf %s\n", bex_version_string());
            exit(0);
        default:
            return -1;
        }
    }
    if (optind < argc || o->server == !!o->client) {
        fprintf(stderr, "bex-perf: give exactly one of -s or -c ADDR\n");
        return -1;
    }
    if (!o->have_local) {
        fprintf(stderr, "bex-perf: --local ADDR is required (it chooses the RDMA device)\n");
        return -1;
    }
    if (!o->size_set)
        o->size = o->test == T_LAT ? 32 : 1048576;
    if (!o->iters_set)
        o->iters = o->test == T_LAT ? 1000 : o->test == T_BW ? 200 : 64;
    if (!warm_set)
        o->warmup = o->test == T_LAT ? 100 : o->outstanding;
    if (o->conns && o->test != T_BW) {
        fprintf(stderr, "bex-perf: --conns is for --test bw\n");
        return -1;
    }
    if (o->steady && !o->conns) {
        fprintf(stderr, "bex-perf: --steady is for --conns\n");
        return -1;
    }
    if (o->idle_ms && (o->test != T_LAT || o->streams)) {
        fprintf(stderr, "bex-perf: --idle-ms is for --test lat without --streams\n");
        return -1;
    }
    if (o->streams && o->test != T_LAT) {
        fprintf(stderr, "bex-perf: --streams is for --test lat\n");
        return -1;
    }
    if (!o->stream_size)
        o->stream_size = 1048576;
    if (o->test == T_LAT && o->size > (1u << 30)) {
        fprintf(stderr, "bex-perf: lat size too large\n");
        return -1;
    }
    if (o->n_frag_list == 0) {
        memcpy(o->frag_list, def_frags, sizeof(def_frags));
        o->n_frag_list = (int)(sizeof(def_frags) / sizeof(def_frags[0]));
    }
    return 0;
}

int main(int argc, char **argv)
{
    struct opts o;
    if (parse_args(argc, argv, &o)) {
        usage(stderr);
        return 2;
    }
    if (o.server)
        return run_server(&o);
    if (o.test != T_FRAG)
        return client_run(&o, o.test, o.frag, o.test);
    int rc = 0;
    for (int i = 0; i < o.n_frag_list && rc == 0; i++)
        rc = client_run(&o, T_BW, o.frag_list[i], T_FRAG);
    return rc;
}
