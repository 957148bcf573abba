/* SPDX-License-Identifier: Apache-2.0 */
/* bex-idle: what an idle I/O thread costs (issue 26 item 7): wake-ups a
 * second and CPU of a server context's I/O thread while N connections sit
 * idle, in each poll mode.
 *
 *   bex-idle --conns N --poll-mode event|spin|busy [--transport tcp|rdma]
 *            [--addr A] [--client-addr B] [--seconds S] [--keepalive-ms K]
 *
 * --addr is the server's address (127.0.0.1), --client-addr the client
 * context's (the same by default; over RDMA in the Soft-RoCE VM the other
 * device's: --addr 10.99.0.1 --client-addr 10.99.0.2).
 * A --keepalive-ms above 1000 gets a keepalive_timeout_ms of ten times it
 * (the library's 2000 would refuse it): bench/perf/idle-cg idles with
 * keepalive_ms 60000, so that its window holds ticks and no keepalives.
 *
 * The server (this process) has one I/O thread and listens on N ports
 * (port 0 each); a child process with one context of its own opens one
 * connection to each, so the server's thread holds N connections (N
 * engines over RDMA). Once every connection is up and a second has passed,
 * the server's non-main threads (its I/O thread; bex starts no other) are
 * sampled from /proc/self/task/<tid>/{status,stat} over S seconds:
 * voluntary context switches (each one a sleep that ended: a wake-up),
 * involuntary ones, and user+system CPU time. Output: one JSON line.
 * The client's thread is not measured. */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <inttypes.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>

#include "bex/sock.h"

/* Under callgrind (bench/perf/idle-cg) the window's instructions alone:
 * counts zeroed at its start, dumped at its end (no-ops otherwise). */
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define IDLE_WINDOW_START() CALLGRIND_ZERO_STATS
#define IDLE_WINDOW_END()   CALLGRIND_DUMP_STATS_AT("idle window")
#else
#define IDLE_WINDOW_START() ((void)0)
#define IDLE_WINDOW_END()   ((void)0)
#endif

/* How long the connections may take to come up (s): RDMA engines under
 * callgrind in the VM come up at about two a second. */
#define SETUP_S 600

struct opts {
    uint32_t conns, poll_mode, transport, keepalive_ms;
    double seconds;
    struct in_addr addr, client_addr;
    bool client_addr_set;
    const char *poll_name;
};

static _Atomic uint32_t accepted, connected, failed;

static void on_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    (void)s;
    (void)user;
    atomic_fetch_add(&accepted, 1);
}

static void on_connect(bex_sock *s, int status, void *user)
{
    (void)s;
    (void)user;
    atomic_fetch_add(status == 0 ? &connected : &failed, 1);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: bex-idle --conns N --poll-mode event|spin|busy [--transport tcp|rdma]\n"
               "                [--addr A] [--client-addr B] [--seconds S] [--keepalive-ms K]\n");
}

static int parse(int argc, char **argv, struct opts *o)
{
    static const struct option lo[] = {{"conns", 1, 0, 'n'},       {"poll-mode", 1, 0, 'm'},
                                       {"transport", 1, 0, 't'},   {"addr", 1, 0, 'a'},
                                       {"seconds", 1, 0, 's'},     {"keepalive-ms", 1, 0, 'k'},
                                       {"client-addr", 1, 0, 'c'}, {"help", 0, 0, 'h'},
                                       {"version", 0, 0, 'V'},     {0, 0, 0, 0}};
    *o = (struct opts){
        .conns = 1024, .transport = BEX_TRANSPORT_TCP, .seconds = 10, .poll_name = "spin"};
    inet_pton(AF_INET, "127.0.0.1", &o->addr);
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'n':
            o->conns = (uint32_t)strtoul(optarg, NULL, 10);
            break;
        case 'm':
            o->poll_name = optarg;
            break;
        case 't':
            if (strcmp(optarg, "tcp") && strcmp(optarg, "rdma")) {
                fprintf(stderr, "bex-idle: --transport: '%s' is neither tcp nor rdma\n", optarg);
                return 2;
            }
            o->transport = strcmp(optarg, "tcp") ? BEX_TRANSPORT_RDMA : BEX_TRANSPORT_TCP;
            break;
        case 'a':
            if (inet_pton(AF_INET, optarg, &o->addr) != 1) {
                fprintf(stderr, "bex-idle: --addr: '%s' is not an IPv4 address\n", optarg);
                return 2;
            }
            break;
        case 'c':
            if (inet_pton(AF_INET, optarg, &o->client_addr) != 1) {
                fprintf(stderr, "bex-idle: --client-addr: '%s' is not an IPv4 address\n", optarg);
                return 2;
            }
            o->client_addr_set = true;
            break;
        case 's':
            o->seconds = atof(optarg);
            break;
        case 'k':
            o->keepalive_ms = (uint32_t)strtoul(optarg, NULL, 10);
            break;
        case 'h':
            usage(stdout);
            exit(0);
        case 'V':
            printf("bex-idle %s\n", bex_version_string());
            exit(0);
        default:
            usage(stderr);
            return 2;
        }
    }
    const char *pm = strcmp(o->poll_name, "spin") == 0 ? "spin-sleep" : o->poll_name;
    if (bex_poll_mode_parse(pm, &o->poll_mode) != 0) {
        fprintf(stderr, "bex-idle: --poll-mode: '%s' is not event, spin or busy\n", o->poll_name);
        return 2;
    }
    if (!o->client_addr_set)
        o->client_addr = o->addr;
    if (o->conns == 0 || o->conns > 4096 || o->seconds <= 0) {
        fprintf(stderr, "bex-idle: --conns must be 1..4096 and --seconds above 0\n");
        return 2;
    }
    return 0;
}

static int make_ctx(const struct opts *o, struct in_addr local, bex_ctx **ctx)
{
    bex_ctx_config cfg = {.local_addr = bex_addr_ipv4(local.s_addr, 0),
                          .io_threads = 1,
                          .poll_mode = o->poll_mode,
                          .transport = o->transport,
                          .keepalive_ms = o->keepalive_ms,
                          /* the library's 2000 refuses a keepalive_ms above 1000 */
                          .keepalive_timeout_ms = o->keepalive_ms > 1000 ? 10 * o->keepalive_ms : 0,
                          .rq_depth = 16,
                          .eager_max = 1024,
                          .connect_timeout_ms = SETUP_S * 1000,
                          .setup_max = o->conns,
                          .log_level = BEX_LOG_ERROR};
    int rc = bex_ctx_create(&cfg, ctx);
    if (rc)
        fprintf(stderr, "bex-idle: bex_ctx_create: %s\n", bex_strerror(rc));
    return rc;
}

/* The child: one connection to each port, then wait to be killed. */
static void client(const struct opts *o, const uint16_t *ports, int ready_fd)
{
    bex_ctx *ctx;
    if (make_ctx(o, o->client_addr, &ctx))
        _exit(1);
    static const bex_sock_ops ops = {.on_connect = on_connect};
    for (uint32_t i = 0; i < o->conns; i++) {
        bex_addr a = {
            .in4 = {.sin_family = AF_INET, .sin_addr = o->addr, .sin_port = htons(ports[i])}};
        bex_sock *s;
        int rc = bex_sock_connect(ctx, &a, &ops, NULL, &s);
        if (rc) {
            fprintf(stderr, "bex-idle: connect %u: %s\n", i, bex_strerror(rc));
            _exit(1);
        }
    }
    while (atomic_load(&connected) + atomic_load(&failed) < o->conns)
        usleep(10000);
    char r = atomic_load(&failed) ? 'F' : 'K';
    if (write(ready_fd, &r, 1) != 1)
        _exit(1);
    for (;;)
        pause();
}

struct sample {
    uint64_t vol, invol, ticks;
};

/* Sums the counters of every thread of this process but the main one. */
static int sample_threads(struct sample *out)
{
    *out = (struct sample){0};
    pid_t self = (pid_t)syscall(SYS_gettid);
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return -errno;
    struct dirent *e;
    while ((e = readdir(d))) {
        pid_t tid = (pid_t)atoi(e->d_name);
        if (tid <= 0 || tid == self)
            continue;
        char path[64], line[256];
        snprintf(path, sizeof path, "/proc/self/task/%d/status", tid);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        while (fgets(line, sizeof line, f)) {
            unsigned long long v;
            if (sscanf(line, "voluntary_ctxt_switches: %llu", &v) == 1)
                out->vol += v;
            else if (sscanf(line, "nonvoluntary_ctxt_switches: %llu", &v) == 1)
                out->invol += v;
        }
        fclose(f);
        snprintf(path, sizeof path, "/proc/self/task/%d/stat", tid);
        f = fopen(path, "r");
        if (!f)
            continue;
        char buf[1024];
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        char *p = strrchr(buf, ')'); /* the name may hold spaces */
        unsigned long long ut = 0, st = 0;
        if (p &&
            sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) == 2)
            out->ticks += ut + st;
    }
    closedir(d);
    return 0;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int listen_all(const struct opts *o, bex_ctx *ctx, uint16_t *ports)
{
    static const bex_listener_ops lops = {.on_accept = on_accept};
    for (uint32_t i = 0; i < o->conns; i++) {
        bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_addr = o->addr}};
        bex_listener *l;
        int rc = bex_listen(ctx, &a, &lops, NULL, &l);
        if (rc) {
            fprintf(stderr, "bex-idle: listen %u: %s\n", i, bex_strerror(rc));
            return rc;
        }
        bex_listener_addr(l, &a);
        ports[i] = ntohs(a.in4.sin_port);
    }
    return 0;
}

int main(int argc, char **argv)
{
    struct opts o;
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc;
    struct rlimit rl = {65536, 65536};
    setrlimit(RLIMIT_NOFILE, &rl);
    bex_ctx *ctx;
    uint16_t *ports = calloc(o.conns, sizeof *ports);
    if (!ports || make_ctx(&o, o.addr, &ctx) || listen_all(&o, ctx, ports))
        return 1;
    int pfd[2];
    if (pipe(pfd))
        return 1;
    pid_t pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        client(&o, ports, pfd[1]);
    }
    close(pfd[1]);
    char r = 0;
    ssize_t got = read(pfd[0], &r, 1);
    double t0 = now_s();
    while (atomic_load(&accepted) < o.conns && now_s() - t0 < SETUP_S)
        usleep(10000);
    if (got != 1 || r != 'K' || atomic_load(&accepted) != o.conns) {
        fprintf(stderr, "bex-idle: %u of %u connections up\n", atomic_load(&accepted), o.conns);
        kill(pid, SIGKILL);
        return 1;
    }
    /* TCP: a connection writes a keepalive at its first tick once
     * keepalive_ms / 8 has passed since its last write (the set-up's), a
     * round the window should not hold */
    usleep((useconds_t)(1000 + o.keepalive_ms / 8) * 1000);
    /* the window starts half-way between two whole seconds of the
     * monotonic clock, the grid of an idle connection's ticks (at a
     * keepalive_ms of a second or more), so that with whole --seconds no
     * round of ticks straddles either of its ends */
    double g = now_s();
    usleep((useconds_t)((floor(g) + 1.5 - g) * 1e6));
    struct sample a, b;
    sample_threads(&a);
    double s0 = now_s();
    IDLE_WINDOW_START();
    double left = s0 + o.seconds - now_s();
    if (left > 0)
        usleep((useconds_t)(left * 1e6));
    IDLE_WINDOW_END();
    sample_threads(&b);
    double dt = now_s() - s0;
    long hz = sysconf(_SC_CLK_TCK);
    printf("{\"conns\":%u,\"poll_mode\":\"%s\",\"transport\":\"%s\",\"keepalive_ms\":%u,"
           "\"seconds\":%.2f,\"wakeups_per_s\":%.1f,\"preempted_per_s\":%.1f,\"cpu_pct\":%.1f}\n",
           o.conns, o.poll_name, o.transport == BEX_TRANSPORT_TCP ? "tcp" : "rdma", o.keepalive_ms,
           dt, (double)(b.vol - a.vol) / dt, (double)(b.invol - a.invol) / dt,
           100.0 * (double)(b.ticks - a.ticks) / (double)hz / dt);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return 0;
}
