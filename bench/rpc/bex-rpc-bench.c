/* SPDX-License-Identifier: Apache-2.0 */
/* bex-rpc-bench: echo RPC latency and rate over bex RPC (issue 9 item 10;
 * bench/rpc/compare runs it against gRPC C++, bench/grpc).
 *
 *   server: bex-rpc-bench -s --local ADDR [-p PORT] [--transport auto|rdma|tcp]
 *   client: bex-rpc-bench -c SERVER --local ADDR [-p PORT] [--transport ...]
 *                         [--size B] [--outstanding K] [--iters N] [--warmup W] [--json]
 *                         [--stdin]
 *   matrix: bex-rpc-bench --matrix [--transport ...] [--iters N] [--json]
 *           forks a server on BEX_TEST_ADDR0 (default 127.0.0.1) and runs
 *           the client on BEX_TEST_ADDR1 (127.0.0.2) for 64 B, 4 KiB and
 *           64 KiB bodies with 1 and 64 calls outstanding.
 *   (all: [--keepalive-timeout MS], the contexts' keepalive timeout;
 *   [--eager B], their eager_max: over RDMA, bodies up to B bytes (plus
 *   the RPC header) go by SEND, larger ones by rendezvous; [--poll
 *   spin-sleep|busy|event], their I/O threads' poll_mode.)
 *
 * --stdin: the client runs one cell per line of its standard input, "SIZE
 * OUTSTANDING ITERS WARMUP", each as a run of its own (a new channel, so a
 * new connection) in the same context, until end of file: a runner can
 * alternate stacks cell by cell without starting a process per cell (in
 * the emulated VM a start costs seconds).
 *
 * The client keeps K calls outstanding: each completion sends the next call
 * from the completion itself, with the response body as the next request
 * (bodies are never copied or allocated per call). Latency is measured per
 * call from bex_rpc_call to its completion; the report gives P50, P99,
 * mean and calls/s over --iters calls after --warmup. Retries are off and
 * the deadline is 10 s, so a lost call shows up as an error, not as a
 * retry. With --json each result is one JSON object on one line.
 *
 * --into: each call is bex_rpc_call_into, the answer's body going into a
 * destination of the slot's own (bex_rpc_alloc_dest, exposed per call over
 * RDMA and written by the server's WRITE; copied over TCP); the next
 * request is a fresh bex_rpc_alloc body (not initialised), since the
 * answer stays in the destination. The JSON gets "into":true. */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bex/rpc.h"

#define SVC          1
#define M_ECHO       1
#define DEFAULT_PORT 18520

struct opts {
    bool server, matrix, json, from_stdin, into;
    const char *client;
    struct in_addr local;
    bool have_local;
    uint16_t port;
    uint32_t transport;
    size_t size;
    uint32_t outstanding;
    uint64_t iters, warmup;
    uint32_t ka_timeout_ms; /* 0: the library's */
    uint32_t eager_max;     /* 0: the library's */
    uint32_t poll_mode;     /* BEX_POLL_* (0: spin-sleep, the library's) */
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static const char *transport_name(uint32_t t)
{
    return t == BEX_TRANSPORT_RDMA ? "rdma" : t == BEX_TRANSPORT_TCP ? "tcp" : "auto";
}

static void die(const char *what, int err)
{
    fprintf(stderr, "bex-rpc-bench: %s: %s\n", what, bex_strerror(err));
    exit(1);
}

/* ---------------- server ---------------- */

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

static void h_echo(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    bex_rpc_reply(req, 0, body, len);
}

/* Serve until SIGINT/SIGTERM, or until ready_fd's peer closes (matrix). */
static int run_server(const struct opts *o, int ready_fd, int quit_fd)
{
    bex_ctx_config c = {.local_addr = bex_addr_ipv4(o->local.s_addr, 0),
                        .transport = o->transport,
                        .keepalive_timeout_ms = o->ka_timeout_ms,
                        .eager_max = o->eager_max,
                        .poll_mode = o->poll_mode};
    bex_ctx *ctx;
    int err = bex_ctx_create(&c, &ctx);
    if (err)
        die("bex_ctx_create", err);
    bex_rpc_server *srv;
    if ((err = bex_rpc_server_create(ctx, NULL, &srv)) ||
        (err = bex_rpc_server_register(srv, SVC, M_ECHO, 0, h_echo, NULL)))
        die("rpc server", err);
    bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_port = htons(o->port), .sin_addr = o->local}};
    if ((err = bex_rpc_server_listen(srv, &a)))
        die("bex_rpc_server_listen", err);
    bex_addr got;
    bex_rpc_server_addr(srv, &got);
    if (ready_fd >= 0) {
        if (write(ready_fd, &got.in4.sin_port, sizeof got.in4.sin_port) != sizeof got.in4.sin_port)
            die("ready pipe", -errno);
        char q;
        ssize_t r = read(quit_fd, &q, 1);
        (void)r;
    } else {
        fprintf(stderr, "bex-rpc-bench: serving on %s:%u (%s)\n", inet_ntoa(o->local),
                ntohs(got.in4.sin_port), transport_name(o->transport));
        signal(SIGINT, on_signal);
        signal(SIGTERM, on_signal);
        while (!stop_flag)
            pause();
    }
    bex_rpc_server_destroy(srv);
    bex_ctx_destroy(ctx);
    return 0;
}

/* ---------------- client ---------------- */

struct run {
    bex_ctx *ctx;
    size_t size;
    bex_rpc_channel *ch;
    uint64_t total; /* calls to complete: warmup + iters */
    uint64_t warmup;
    _Atomic uint64_t issued, completed;
    uint64_t *lat_ns; /* per measured call */
    _Atomic uint64_t errors;
    uint64_t t_first, t_last; /* ns: completion of the last warm-up call, of the last call */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    bool into;
};

struct slot {
    struct run *r;
    uint64_t t0;
    void *dst; /* --into: this slot's destination */
};

static void call_done(int status, void *body, size_t len, void *user);

static void issue(struct slot *s, void *body, size_t len)
{
    struct run *r = s->r;
    if (atomic_fetch_add(&r->issued, 1) >= r->total) {
        bex_rpc_free(body);
        return;
    }
    s->t0 = now_ns();
    int err = r->into ? bex_rpc_call_into(r->ch, SVC, M_ECHO, body, len, s->dst, r->size, NULL,
                                          call_done, s, NULL)
                      : bex_rpc_call(r->ch, SVC, M_ECHO, body, len, NULL, call_done, s, NULL);
    if (err)
        die("bex_rpc_call", err);
}

static void call_done(int status, void *body, size_t len, void *user)
{
    struct slot *s = user;
    struct run *r = s->r;
    uint64_t t = now_ns();
    uint64_t n = atomic_fetch_add(&r->completed, 1);
    if (r->into) {
        /* body is the slot's destination: the caller's, never freed */
        if (!status && len != r->size)
            status = -EBADMSG;
        body = NULL;
        len = 0;
    }
    if (status) {
        atomic_fetch_add(&r->errors, 1);
        fprintf(stderr, "bex-rpc-bench: call failed: %s\n", bex_strerror(status));
    }
    if (n >= r->warmup)
        r->lat_ns[n - r->warmup] = t - s->t0;
    if (n + 1 == r->warmup)
        r->t_first = t;
    if (n + 1 == r->total) {
        r->t_last = t;
        bex_rpc_free(body);
        pthread_mutex_lock(&r->mu);
        r->done = true;
        pthread_cond_signal(&r->cv);
        pthread_mutex_unlock(&r->mu);
        return;
    }
    if (status || len != r->size) {
        /* a failed call's body is gone with it: a fresh one */
        bex_rpc_free(body);
        len = r->size;
        if (!(body = bex_rpc_alloc(r->ctx, len)))
            die("bex_rpc_alloc", -ENOMEM);
    }
    issue(s, body, len);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int run_client(const struct opts *o, bex_addr srv, bex_ctx *ctx)
{
    bex_rpc_endpoint ep = {.addr = srv, .transport = o->transport};
    bex_rpc_channel_config cc = {.endpoints = &ep,
                                 .n_endpoints = 1,
                                 .name = "bench",
                                 .request_timeout_ms = 10000,
                                 .connect_timeout_ms = 10000,
                                 .max_attempts = 1};
    struct run r = {.ctx = ctx,
                    .size = o->size,
                    .total = o->warmup + o->iters,
                    .warmup = o->warmup,
                    .mu = PTHREAD_MUTEX_INITIALIZER,
                    .cv = PTHREAD_COND_INITIALIZER,
                    .into = o->into};
    int err = bex_rpc_channel_create(ctx, &cc, &r.ch);
    if (err)
        die("bex_rpc_channel_create", err);
    /* the connection first, outside the measurement */
    if ((err = bex_rpc_call_sync(r.ch, SVC, M_ECHO, NULL, 0, NULL, NULL, NULL)))
        die("first call", err);
    r.lat_ns = calloc(o->iters ? o->iters : 1, sizeof(uint64_t));
    struct slot *slots = calloc(o->outstanding, sizeof(*slots));
    if (!r.lat_ns || !slots)
        die("calloc", -ENOMEM);
    uint64_t t_start = now_ns();
    for (uint32_t i = 0; i < o->outstanding; i++) {
        slots[i].r = &r;
        if (o->into && !(slots[i].dst = bex_rpc_alloc_dest(ctx, o->size)))
            die("bex_rpc_alloc_dest", -ENOMEM);
        void *b = bex_rpc_alloc(ctx, o->size);
        if (!b)
            die("bex_rpc_alloc", -ENOMEM);
        memset(b, (int)i, o->size);
        issue(&slots[i], b, o->size);
    }
    pthread_mutex_lock(&r.mu);
    while (!r.done)
        pthread_cond_wait(&r.cv, &r.mu);
    pthread_mutex_unlock(&r.mu);
    /* the other slots' last calls may still be out: destroy waits for them */
    bex_rpc_channel_stats st;
    bex_rpc_channel_stats_get(r.ch, &st);
    bex_rpc_channel_destroy(r.ch);
    if (!o->warmup)
        r.t_first = t_start;
    qsort(r.lat_ns, o->iters, sizeof(uint64_t), cmp_u64);
    double sum = 0;
    for (uint64_t i = 0; i < o->iters; i++)
        sum += (double)r.lat_ns[i];
    double p50 = o->iters ? (double)r.lat_ns[(o->iters - 1) / 2] / 1000.0 : 0;
    double p99 = o->iters ? (double)r.lat_ns[(o->iters * 99 - 1) / 100] / 1000.0 : 0;
    double mean = o->iters ? sum / (double)o->iters / 1000.0 : 0;
    double secs = (double)(r.t_last - r.t_first) / 1e9;
    double rate = secs > 0 ? (double)o->iters / secs : 0;
    uint64_t errors = atomic_load(&r.errors);
    if (o->json)
        printf("{\"bench\":\"bex-rpc\",\"transport\":\"%s\",\"size\":%zu,\"outstanding\":%u,"
               "\"iters\":%llu,\"p50_us\":%.2f,\"p99_us\":%.2f,\"mean_us\":%.2f,"
               "\"calls_per_s\":%.0f,\"errors\":%llu%s}\n",
               transport_name(o->transport), o->size, o->outstanding, (unsigned long long)o->iters,
               p50, p99, mean, rate, (unsigned long long)errors, o->into ? ",\"into\":true" : "");
    else
        printf("%-5s %8zu B %3u out: P50 %9.2f us  P99 %9.2f us  mean %9.2f us  %10.0f calls/s"
               "  errors %llu\n",
               transport_name(o->transport), o->size, o->outstanding, p50, p99, mean, rate,
               (unsigned long long)errors);
    fflush(stdout);
    for (uint32_t i = 0; i < o->outstanding; i++)
        bex_rpc_free(slots[i].dst);
    free(slots);
    free(r.lat_ns);
    return errors ? 1 : 0;
}

static int run_matrix(struct opts *o)
{
    const char *s0 = getenv("BEX_TEST_ADDR0"), *s1 = getenv("BEX_TEST_ADDR1");
    struct in_addr a0, a1;
    if (inet_pton(AF_INET, s0 ? s0 : "127.0.0.1", &a0) != 1 ||
        inet_pton(AF_INET, s1 ? s1 : "127.0.0.2", &a1) != 1)
        die("BEX_TEST_ADDR0/1", -EINVAL);
    int up[2], down[2];
    if (pipe(up) || pipe(down))
        die("pipe", -errno);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        die("fork", -errno);
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        struct opts so = *o;
        so.local = a0;
        so.port = 0;
        exit(run_server(&so, up[1], down[0]));
    }
    close(up[1]);
    close(down[0]);
    uint16_t port;
    if (read(up[0], &port, sizeof port) != sizeof port)
        die("server did not start", -EIO);
    bex_addr srv = {.in4 = {.sin_family = AF_INET, .sin_port = port, .sin_addr = a0}};
    bex_ctx_config c = {.local_addr = bex_addr_ipv4(a1.s_addr, 0),
                        .transport = o->transport,
                        .keepalive_timeout_ms = o->ka_timeout_ms,
                        .eager_max = o->eager_max,
                        .poll_mode = o->poll_mode};
    bex_ctx *ctx;
    int err = bex_ctx_create(&c, &ctx);
    if (err)
        die("bex_ctx_create", err);
    static const size_t sizes[] = {64, 4096, 65536};
    static const uint32_t outs[] = {1, 64};
    int rc = 0;
    for (size_t i = 0; i < 3; i++)
        for (size_t k = 0; k < 2; k++) {
            o->size = sizes[i];
            o->outstanding = outs[k];
            rc |= run_client(o, srv, ctx);
        }
    bex_ctx_destroy(ctx);
    close(down[1]);
    int status;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status))
        rc = 1;
    return rc;
}

__attribute__((noreturn)) static void usage(int status)
{
    fprintf(status ? stderr : stdout,
            "usage: bex-rpc-bench -s --local ADDR [-p PORT] [--transport auto|rdma|tcp]\n"
            "       bex-rpc-bench -c SERVER --local ADDR [-p PORT] [--transport T]\n"
            "                     [--size B] [--outstanding K] [--iters N] [--warmup W]"
            " [--json] [--stdin] [--into]\n"
            "       bex-rpc-bench --matrix [--transport T] [--iters N] [--json]\n");
    exit(status);
}

int main(int argc, char **argv)
{
    struct opts o = {
        .port = DEFAULT_PORT, .size = 64, .outstanding = 1, .iters = 10000, .warmup = 1000};
    static const struct option lo[] = {{"server", no_argument, NULL, 's'},
                                       {"client", required_argument, NULL, 'c'},
                                       {"local", required_argument, NULL, 'l'},
                                       {"port", required_argument, NULL, 'p'},
                                       {"transport", required_argument, NULL, 't'},
                                       {"size", required_argument, NULL, 'S'},
                                       {"outstanding", required_argument, NULL, 'o'},
                                       {"iters", required_argument, NULL, 'n'},
                                       {"warmup", required_argument, NULL, 'w'},
                                       {"json", no_argument, NULL, 'j'},
                                       {"matrix", no_argument, NULL, 'm'},
                                       {"keepalive-timeout", required_argument, NULL, 'k'},
                                       {"eager", required_argument, NULL, 'e'},
                                       {"poll", required_argument, NULL, 'P'},
                                       {"stdin", no_argument, NULL, 'I'},
                                       {"into", no_argument, NULL, 'D'},
                                       {"help", no_argument, NULL, 'h'},
                                       {"version", no_argument, NULL, 'V'},
                                       {NULL, 0, NULL, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "sc:l:p:", lo, NULL)) != -1) {
        switch (ch) {
        case 'V':
            printf("%s %s\n", "bex-rpc-bench", bex_version_string());
            exit(0);
        case 'h':
            usage(0);
        case 's':
            o.server = true;
            break;
        case 'c':
            o.client = optarg;
            break;
        case 'l':
            if (inet_pton(AF_INET, optarg, &o.local) != 1)
                usage(2);
            o.have_local = true;
            break;
        case 'p':
            o.port = (uint16_t)atoi(optarg);
            break;
        case 't':
            if (!strcmp(optarg, "rdma"))
                o.transport = BEX_TRANSPORT_RDMA;
            else if (!strcmp(optarg, "tcp"))
                o.transport = BEX_TRANSPORT_TCP;
            else if (!strcmp(optarg, "auto"))
                o.transport = BEX_TRANSPORT_AUTO;
            else
                usage(2);
            break;
        case 'S':
            o.size = (size_t)strtoull(optarg, NULL, 0);
            break;
        case 'o':
            o.outstanding = (uint32_t)atoi(optarg);
            break;
        case 'n':
            o.iters = strtoull(optarg, NULL, 0);
            break;
        case 'w':
            o.warmup = strtoull(optarg, NULL, 0);
            break;
        case 'j':
            o.json = true;
            break;
        case 'D':
            o.into = true;
            break;
        case 'm':
            o.matrix = true;
            break;
        case 'k':
            o.ka_timeout_ms = (uint32_t)atoi(optarg);
            break;
        case 'e':
            o.eager_max = (uint32_t)strtoul(optarg, NULL, 0);
            break;
        case 'I':
            o.from_stdin = true;
            break;
        case 'P':
            if (bex_poll_mode_parse(optarg, &o.poll_mode))
                usage(2);
            break;
        default:
            usage(2);
        }
    }
    if (o.outstanding < 1 || o.iters < 1)
        usage(2);
    if (o.matrix)
        return run_matrix(&o);
    if (!o.have_local || o.server == !!o.client)
        usage(2);
    if (o.server)
        return run_server(&o, -1, -1);
    bex_addr srv = {.in4 = {.sin_family = AF_INET, .sin_port = htons(o.port)}};
    if (inet_pton(AF_INET, o.client, &srv.in4.sin_addr) != 1)
        usage(2);
    bex_ctx_config c = {.local_addr = bex_addr_ipv4(o.local.s_addr, 0),
                        .transport = o.transport,
                        .keepalive_timeout_ms = o.ka_timeout_ms,
                        .eager_max = o.eager_max,
                        .poll_mode = o.poll_mode};
    bex_ctx *ctx;
    int err = bex_ctx_create(&c, &ctx);
    if (err)
        die("bex_ctx_create", err);
    int rc = 0;
    if (!o.from_stdin) {
        rc = run_client(&o, srv, ctx);
    } else {
        /* one cell per line; a malformed line ends the run with status 2 */
        char line[256];
        while (fgets(line, sizeof line, stdin)) {
            unsigned long long sz, k, n, w;
            if (sscanf(line, "%llu %llu %llu %llu", &sz, &k, &n, &w) != 4 || k < 1 || n < 1 ||
                k > UINT32_MAX) {
                fprintf(stderr, "bex-rpc-bench: --stdin: bad line: %s", line);
                rc = 2;
                break;
            }
            o.size = (size_t)sz;
            o.outstanding = (uint32_t)k;
            o.iters = n;
            o.warmup = w;
            rc |= run_client(&o, srv, ctx);
        }
    }
    bex_ctx_destroy(ctx);
    return rc;
}
