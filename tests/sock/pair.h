/* SPDX-License-Identifier: Apache-2.0 */
/* Two-process test scaffolding for socket tests on real RDMA devices.
 *
 * pair_run() forks: the child is the server, on BEX_TEST_ADDR0 (rxe0); the
 * parent is the client, on BEX_TEST_ADDR1 (rxe1). The server listens on an
 * ephemeral port and tells the parent which one through a pipe. Each side
 * runs its function; the parent reaps the child with a deadline and the
 * case passes only if both sides return 0.
 *
 * The server tears down for real: when the parent says it is done
 * (pair_wait_parent), the listener is closed, every accepted socket is
 * closed and its on_close awaited, then the context (and a pool the test
 * gave it) is destroyed and the process leaves through exit(), so that the
 * sanitizers' leak check runs there too. A teardown that hangs, a socket
 * whose on_close never comes, or a buffer of the pool still live fails the
 * case. Callback state of a server must therefore live until its function
 * returns after pair_wait_parent() (or pair_server_close()); a server that
 * uses pair_wait_done() instead keeps it alive past its return.
 *
 * Every deadline here and in the tests is written unscaled and stretched by
 * BEX_TEST_TIME_SCALE (harness.h) where it is waited for. */
#ifndef BEX_TEST_PAIR_H
#define BEX_TEST_PAIR_H

#include <arpa/inet.h>
#include <dirent.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bex/sock.h"
#include "harness.h"
#include "sock/internal.h" /* struct bex_sock: the ops an on_accept installed */

struct pair {
    bex_ctx *ctx;
    bex_listener *l;          /* server */
    bex_addr srv;             /* client: where the server listens */
    pid_t child;              /* client: the server's pid */
    int to_child, from_child; /* client: pipes to/from the server */
    int to_parent, from_parent;
    /* server: the test's listener callbacks (pair_listen wraps them) */
    bex_listener_ops accept_ops;
    void *accept_user;
    bool closed;      /* server: pair_server_close ran */
    int close_failed; /* server: it failed */
};

/* The transport under test: BEX_TEST_TRANSPORT=tcp runs a case over the TCP
 * transport (natively, on loopback addresses when BEX_TEST_ADDR0/1 are not
 * set); otherwise over RDMA. */
static inline bool pair_tcp(void)
{
    const char *t = getenv("BEX_TEST_TRANSPORT");
    return t && strcmp(t, "tcp") == 0;
}

static inline int pair_addrs(struct in_addr *a0, struct in_addr *a1)
{
    const char *s0 = getenv("BEX_TEST_ADDR0"), *s1 = getenv("BEX_TEST_ADDR1");
    if (pair_tcp() && (!s0 || !s1)) { /* the cases read them too */
        setenv("BEX_TEST_ADDR0", "127.0.0.1", 1);
        setenv("BEX_TEST_ADDR1", "127.0.0.2", 1);
        s0 = getenv("BEX_TEST_ADDR0");
        s1 = getenv("BEX_TEST_ADDR1");
    }
    if (!s0 || !s1 || inet_pton(AF_INET, s0, a0) != 1 || inet_pton(AF_INET, s1, a1) != 1)
        return bex_test_skip("BEX_TEST_ADDR0/1 not set (run under scripts/rxe-vm)");
    return 0;
}

/* A case returns at once with the skip (or failure) its set-up decides,
 * as in PAIR_NEED(pair_addrs(&a0, &a1)). */
#define PAIR_NEED(setup)                                                                           \
    do {                                                                                           \
        int rc_ = (setup);                                                                         \
        if (rc_)                                                                                   \
            return rc_;                                                                            \
    } while (0)

static inline uint64_t pair_now_ms(void)
{
    return bex_test_now_ms();
}

static inline void pair_sleep_ms(unsigned ms)
{
    bex_test_sleep_ms(ms);
}

/* Deterministic content: byte i of message (seed) */
static inline void fill_pattern(uint8_t *p, size_t len, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < len; i++) {
        if ((i & 3) == 0)
            x = x * 1103515245u + 12345u;
        p[i] = (uint8_t)(x >> ((i & 3) * 8));
    }
}

static inline int check_pattern(const uint8_t *p, size_t len, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < len; i++) {
        if ((i & 3) == 0)
            x = x * 1103515245u + 12345u;
        if (p[i] != (uint8_t)(x >> ((i & 3) * 8))) {
            fprintf(stderr, "pattern mismatch at byte %zu of %zu (seed %u)\n", i, len, seed);
            return -1;
        }
    }
    return 0;
}

/* Small blocking "wait until" on a condition set from I/O callbacks. */
struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
};
#define WAITER_INIT                                                                                \
    {                                                                                              \
        PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER                                        \
    }

static inline void waiter_signal(struct waiter *w)
{
    pthread_mutex_lock(&w->mu);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* Add n to *ctr and wake the waiters, under the waiter's lock. A callback
 * whose last act this is may have its state freed as soon as a waiter sees
 * the new count: wait_count reads the count under the same lock, so it sees
 * it only once this thread has let go of the state (an on_close counted
 * before the lock let the test free the state while the I/O thread was
 * still signalling: TSan, test_teardown_rxe.stop_kill_stream). */
static inline void waiter_add(struct waiter *w, _Atomic long *ctr, long n)
{
    pthread_mutex_lock(&w->mu);
    atomic_fetch_add(ctr, n);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* Sanitizer builds run several times slower in the emulated VM: every
 * liveness deadline of the socket tests is multiplied by this. */
static inline unsigned time_scale(void)
{
    return bex_test_time_scale();
}

/* Wait until *flag >= want or timeout_ms (unscaled: stretched here by
 * time_scale()) passes; returns 0 or -1. */
static inline int wait_count(struct waiter *w, _Atomic long *flag, long want, unsigned timeout_ms)
{
    uint64_t end = pair_now_ms() + (uint64_t)timeout_ms * time_scale();
    pthread_mutex_lock(&w->mu);
    while (atomic_load(flag) < want) {
        uint64_t now = pair_now_ms();
        if (now >= end)
            break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + (end - now > 50 ? 50 : end - now) * 1000000ull;
        ts.tv_sec += (time_t)(ns / 1000000000ull);
        ts.tv_nsec = (long)(ns % 1000000000ull);
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    pthread_mutex_unlock(&w->mu);
    return atomic_load(flag) >= want ? 0 : -1;
}

/* Wait until *flag >= want while it moves: fails (-1) only when a whole
 * stall_ms (stretched by time_scale()) passed without the count growing.
 * For a long chain of events whose total time the host's load decides (an
 * echo chain of thousands), where the property is that it never stops. */
static inline int wait_moving(struct waiter *w, _Atomic long *flag, long want, unsigned stall_ms)
{
    long last = atomic_load(flag);
    while (wait_count(w, flag, want, stall_ms)) {
        long now = atomic_load(flag);
        if (now == last)
            return -1;
        last = now;
    }
    return 0;
}

/* An RDMA hardware counter summed over every rxe device, or -1. */
static inline long long rxe_counter(const char *name)
{
    long long sum = -1;
    DIR *d = opendir("/sys/class/infiniband");
    if (!d)
        return -1;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        char path[512];
        snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/1/hw_counters/%s", de->d_name,
                 name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        long long v;
        if (fscanf(f, "%lld", &v) == 1)
            sum = (sum < 0 ? 0 : sum) + v;
        fclose(f);
    }
    closedir(d);
    return sum;
}

typedef int (*pair_fn)(struct pair *p, void *arg);

/* Print every thread's stack of a process (when gdb is there), so that a
 * hang in CI leaves evidence rather than only a timeout. */
static inline void pair_dump_stacks(pid_t pid)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd,
             "command -v gdb >/dev/null && gdb -p %d -batch -ex 'thread apply all bt' 2>&1 "
             "| grep -E '^#|^Thread' >&2",
             (int)pid);
    if (system(cmd) != 0)
        fprintf(stderr, "(no stacks for pid %d)\n", (int)pid);
}

/* A watchdog for the client side: if the case is still running past its
 * deadline, dump both processes' stacks and fail. */
struct pair_watchdog {
    pthread_t t;
    pid_t child;
    unsigned seconds;
    _Atomic int done;
};

static inline void *pair_watch(void *arg)
{
    struct pair_watchdog *w = arg;
    for (unsigned i = 0; i < w->seconds * 10; i++) {
        if (atomic_load(&w->done))
            return NULL;
        pair_sleep_ms(100);
    }
    fprintf(stderr, "watchdog: the case hangs after %u s; stacks follow\n", w->seconds);
    pair_dump_stacks(getpid());
    pair_dump_stacks(w->child);
    kill(w->child, SIGKILL);
    _exit(1);
}

/* When set, the server process builds its context's pool with this (before
 * the context exists), e.g. to inject registration failures. The server
 * destroys that pool after its context (every buffer must be free by then)
 * and then calls pair_server_pool_release, when set, to drop what the pool
 * needed (e.g. a device reference). */
static bex_mem_pool *(*pair_server_pool)(struct in_addr addr);
/* The same for its landing pool (rendezvous destinations, exposed buffers). */
static bex_mem_pool *(*pair_server_landing)(struct in_addr addr);
static void (*pair_server_pool_release)(void);

/* ---- server side: accepted sockets, tracked until their on_close ---- */

struct pair_ssock {
    bex_sock *s;
    void (*on_close)(bex_sock *s, void *user); /* the test's own, if any */
    struct pair_ssock *next;
};

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct pair_ssock *live; /* accepted, on_close not yet reported */
    long accepted, closed;
} pair_srv = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0};

static inline void pair_srv_on_close(bex_sock *s, void *user)
{
    pthread_mutex_lock(&pair_srv.mu);
    struct pair_ssock **pp = &pair_srv.live;
    while (*pp && (*pp)->s != s)
        pp = &(*pp)->next;
    struct pair_ssock *t = *pp;
    pthread_mutex_unlock(&pair_srv.mu);
    CHECK(t); /* every on_close we see is of a socket we track */
    if (t->on_close)
        t->on_close(s, user);
    /* unlinked only now: the teardown waits for the test's on_close too */
    pthread_mutex_lock(&pair_srv.mu);
    for (pp = &pair_srv.live; *pp != t; pp = &(*pp)->next)
        ;
    *pp = t->next;
    pair_srv.closed++;
    pthread_cond_broadcast(&pair_srv.cv);
    pthread_mutex_unlock(&pair_srv.mu);
    free(t);
}

/* The test's on_accept, then our on_close hook over the ops it installed
 * (read on the I/O thread, which is the one writing them). A server that
 * replaces a socket's ops later loses the hook, and the teardown then
 * fails waiting for that socket. */
static inline void pair_srv_on_accept(bex_listener *l, bex_sock *s, void *user)
{
    struct pair *p = user;
    if (p->accept_ops.on_accept)
        p->accept_ops.on_accept(l, s, p->accept_user);
    else
        bex_sock_close(s); /* what bex does for a listener without one */
    struct pair_ssock *t = calloc(1, sizeof(*t));
    CHECK(t);
    t->s = s;
    t->on_close = s->ops.on_close;
    bex_sock_ops ops = s->ops;
    ops.on_close = pair_srv_on_close;
    pthread_mutex_lock(&pair_srv.mu);
    t->next = pair_srv.live;
    pair_srv.live = t;
    pair_srv.accepted++;
    pthread_mutex_unlock(&pair_srv.mu);
    CHECK_OK(bex_sock_set_user(s, &ops, s->user)); /* on the I/O thread: at once */
}

/* Server side: close the listener and every accepted socket, and wait
 * (20 s, scaled) until each has reported on_close. Idempotent; returns 0,
 * or -1 (and says which sockets are left). pair_wait_parent() calls it. */
static inline int pair_server_close(struct pair *p)
{
    if (p->closed)
        return p->close_failed ? -1 : 0;
    p->closed = true;
    if (p->l) {
        bex_listener_close(p->l);
        p->l = NULL;
    }
    /* a socket still in the list has not returned from on_close, so it is
     * alive while we hold the lock; closing one twice is allowed */
    pthread_mutex_lock(&pair_srv.mu);
    for (struct pair_ssock *t = pair_srv.live; t; t = t->next)
        bex_sock_close(t->s);
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (pair_srv.live && pair_now_ms() < end) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&pair_srv.cv, &pair_srv.mu, &ts);
    }
    long left = 0;
    for (struct pair_ssock *t = pair_srv.live; t; t = t->next)
        left++;
    if (left)
        fprintf(stderr,
                "server: %ld of %ld accepted sockets never reported on_close after "
                "bex_sock_close\n",
                left, pair_srv.accepted);
    pthread_mutex_unlock(&pair_srv.mu);
    p->close_failed = left != 0;
    return left ? -1 : 0;
}

/* The server's log: as bex's own (stderr), or the test's hook; an error
 * logged while the context is destroyed (e.g. its pool still has live
 * buffers) fails the case. */
static struct {
    bex_log_fn fn;
    void *arg;
    _Atomic int destroying, errors;
} pair_srv_log;

static inline void pair_srv_log_fn(int level, const char *msg, void *arg)
{
    (void)arg;
    if (level <= BEX_LOG_ERROR && atomic_load(&pair_srv_log.destroying)) {
        atomic_fetch_add(&pair_srv_log.errors, 1);
        fprintf(stderr, "server: error while destroying the context: %s\n", msg);
    }
    if (pair_srv_log.fn)
        pair_srv_log.fn(level, msg, pair_srv_log.arg);
    else
        fprintf(stderr, "bex (server): %s\n", msg);
}

/* The server process after its function returned rc: tear down and leave
 * through exit(). */
static inline int pair_pool_gone(bex_mem_pool *pool)
{
    int err = bex_mem_pool_destroy(pool);
    if (err)
        fprintf(stderr, "server: bex_mem_pool_destroy: %s (buffers still live)\n",
                bex_strerror(err));
    return err;
}

static inline void pair_server_exit(struct pair *p, bex_mem_pool *pool, bex_mem_pool *landing,
                                    int rc)
{
    if (rc) {
        /* a failed server function may have left callbacks pointing into
         * its stack: leave at once, the failure is reported already */
        fflush(NULL);
        _exit(1);
    }
    if (pair_server_close(p))
        rc = 1;
    atomic_store(&pair_srv_log.destroying, 1);
    int err = bex_ctx_destroy(p->ctx);
    if (err) {
        fprintf(stderr, "server: bex_ctx_destroy: %s\n", bex_strerror(err));
        rc = 1;
    }
    if (atomic_load(&pair_srv_log.errors))
        rc = 1;
    int perr = 0;
    if (pool && pair_pool_gone(pool))
        perr = 1;
    if (landing && pair_pool_gone(landing))
        perr = 1;
    if (perr)
        rc = 1;
    else if ((pool || landing) && pair_server_pool_release)
        pair_server_pool_release();
    close(p->to_parent);
    close(p->from_parent);
    exit(rc ? 1 : 0);
}

static inline bex_ctx_config scaled(const bex_ctx_config *in, struct in_addr a)
{
    bex_ctx_config c = in ? *in : (bex_ctx_config){0};
    c.local_addr = bex_addr_ipv4(a.s_addr, 0);
    if (pair_tcp())
        c.transport = BEX_TRANSPORT_TCP;
    /* BEX_TEST_IO_THREADS=n: contexts with n I/O threads */
    const char *io = getenv("BEX_TEST_IO_THREADS");
    if (io && !c.io_threads)
        c.io_threads = (uint32_t)atoi(io);
    /* BEX_TEST_SRQ=1: SRQ mode, a shared queue of 1024 receives per I/O
     * thread (16 peers' shares at the default rq_depth) */
    const char *srq = getenv("BEX_TEST_SRQ");
    if (srq && atoi(srq) && !c.srq_depth) {
        uint32_t rq = c.rq_depth ? c.rq_depth : 64;
        c.srq_depth = rq * 4 > 1024 ? rq * 4 : 1024;
    }
    /* BEX_TEST_WINDOWS=1: window mode (a memory window per destination) */
    const char *win = getenv("BEX_TEST_WINDOWS");
    if (win && atoi(win) && !c.remote_access && !pair_tcp())
        c.remote_access = BEX_REMOTE_ACCESS_WINDOW;
    if (!c.keepalive_timeout_ms)
        c.keepalive_timeout_ms = 2000;
    c.keepalive_timeout_ms *= time_scale();
    /* the ACK timeout: about 1 s (4.096 us x 2^18), not bex's 67 ms (14),
     * unless the case sets one. In the VM under load (and a sanitizer) an
     * ACK often comes later than 67 ms: rxe retransmits what arrived, and
     * its retransmission paths fail now and then (a retransmitted WRITE
     * refused as "remote invalid request", a SEND delivered twice), ending
     * cases that test none of that (docs/testing.md, "thirteenth
     * session"). A case about loss sets its own (packet_loss: 14). */
    if (!c.qp_timeout)
        c.qp_timeout = 18;
    if (!c.connect_timeout_ms)
        c.connect_timeout_ms = 3000; /* bex's default */
    c.connect_timeout_ms *= time_scale();
    /* the progress rule's window (a granted rendezvous destination must be
     * written within recv_rate_ms + len / recv_min_rate): a sanitizer's
     * slowdown is no slow peer (under TSan in the VM the unscaled 5 s
     * failed packet_loss and io2.rxe.multiplex) */
    if (!c.recv_rate_ms)
        c.recv_rate_ms = 5000; /* bex's default */
    c.recv_rate_ms *= time_scale();
    return c;
}

/* Fill cfg->local_addr and run server_fn(sarg) in a child on ADDR0,
 * client_fn(carg) here on ADDR1. The configs may be NULL (defaults). */
static inline int pair_run(const bex_ctx_config *scfg, pair_fn server_fn, void *sarg,
                           const bex_ctx_config *ccfg, pair_fn client_fn, void *carg,
                           unsigned timeout_s)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    int up[2], down[2];
    signal(SIGPIPE, SIG_IGN); /* a server killed on purpose closes its pipe */
    CHECK(pipe(up) == 0 && pipe(down) == 0);
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        struct pair p = {.to_parent = up[1], .from_parent = down[0]};
        bex_ctx_config c = scaled(scfg, a0);
        if (pair_server_pool)
            c.pool = pair_server_pool(a0);
        if (pair_server_landing)
            c.landing_pool = pair_server_landing(a0);
        pair_srv_log.fn = c.log_fn;
        pair_srv_log.arg = c.log_arg;
        c.log_fn = pair_srv_log_fn;
        int err = bex_ctx_create(&c, &p.ctx);
        if (err) {
            fprintf(stderr, "server: bex_ctx_create: %s\n", bex_strerror(err));
            _exit(2);
        }
        pair_server_exit(&p, pair_server_pool ? c.pool : NULL,
                         pair_server_landing ? c.landing_pool : NULL, server_fn(&p, sarg));
    }
    close(up[1]);
    close(down[0]);
    struct pair p = {.child = pid, .from_child = up[0], .to_child = down[1]};
    bex_ctx_config c = scaled(ccfg, a1);
    int err = bex_ctx_create(&c, &p.ctx);
    if (err) {
        fprintf(stderr, "client: bex_ctx_create: %s\n", bex_strerror(err));
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return 1;
    }
    /* below CTest's 240 s (both scaled), so the stacks are printed before
     * CTest kills us */
    struct pair_watchdog wd = {.child = pid, .seconds = 180 * time_scale()};
    CHECK(pthread_create(&wd.t, NULL, pair_watch, &wd) == 0);
    uint16_t port = 0;
    struct pollfd pf = {.fd = p.from_child, .events = POLLIN};
    if (poll(&pf, 1, (int)(30000 * time_scale())) != 1 ||
        read(p.from_child, &port, sizeof port) != sizeof port) {
        fprintf(stderr, "client: server did not report its port\n");
        pair_dump_stacks(pid);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        atomic_store(&wd.done, 1);
        pthread_join(wd.t, NULL);
        return 1;
    }
    p.srv = (bex_addr){.in4 = {.sin_family = AF_INET, .sin_port = port, .sin_addr = a0}};
    rc = client_fn(&p, carg);
    /* tell the server we are done, then reap it with a deadline */
    char bye = 'q';
    if (write(p.to_child, &bye, 1) < 0) {
        /* the server may be dead on purpose */
    }
    int status = 0;
    uint64_t end = pair_now_ms() + timeout_s * 1000ull * time_scale();
    pid_t w;
    while ((w = waitpid(pid, &status, WNOHANG)) == 0 && pair_now_ms() < end)
        pair_sleep_ms(20);
    if (w == 0) {
        fprintf(stderr, "server did not finish in %u s\n", timeout_s * time_scale());
        pair_dump_stacks(pid);
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        rc = 1;
    } else if (w == pid && p.child && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        if (WIFEXITED(status))
            fprintf(stderr, "server failed (exit status %d)\n", WEXITSTATUS(status));
        else
            fprintf(stderr, "server failed (signal %d)\n", WTERMSIG(status));
        rc = 1;
    }
    bex_ctx_destroy(p.ctx);
    atomic_store(&wd.done, 1);
    pthread_join(wd.t, NULL);
    return rc;
}

/* Server side: listen on an ephemeral port, report it to the parent.
 * Accepted sockets are tracked for the teardown (pair_server_close). */
static inline void pair_listen(struct pair *p, const bex_listener_ops *ops, void *user)
{
    bex_addr a = {.in4 = {.sin_family = AF_INET}};
    a.in4.sin_addr.s_addr = inet_addr(getenv("BEX_TEST_ADDR0"));
    p->accept_ops = ops ? *ops : (bex_listener_ops){0};
    p->accept_user = user;
    bex_listener_ops wrap = {.on_accept = pair_srv_on_accept};
    CHECK_OK(bex_listen(p->ctx, &a, &wrap, p, &p->l));
    bex_addr got;
    bex_listener_addr(p->l, &got);
    CHECK(write(p->to_parent, &got.in4.sin_port, sizeof got.in4.sin_port) ==
          sizeof got.in4.sin_port);
}

/* Server side: block until the parent says it is done (or is gone); close
 * nothing. For a server that checks the state the client left before the
 * teardown closes anything; its callback state must outlive its function
 * (the teardown runs after it returns). */
/* The counters of the I/O loops' own turns, which move while a thread
 * spins whether or not anything is sent (busy polling never stops): left
 * out of pair_quiet_stats's comparison. */
static inline void pair_stats_no_loop(bex_sock_stats *s)
{
    s->cq_polls = s->cq_polls_empty = s->cq_arms = s->cq_events = 0;
    s->loop_waits = s->loop_sleeps = s->loop_wake_reads = s->loop_wakes = 0;
    s->empty_turns = 0;
}

/* Counters that are read apart while the I/O thread may be posting (a
 * keepalive): two snapshots 1 ms apart until they agree, the loops' own
 * turn counters aside (2000 tries, then the test fails). */
static inline void pair_quiet_stats(bex_ctx *ctx, bex_sock_stats *out)
{
    bex_sock_stats again;
    for (int i = 0; i < 2000; i++) {
        bex_ctx_stats(ctx, out);
        pair_sleep_ms(1);
        bex_ctx_stats(ctx, &again);
        bex_sock_stats a = *out;
        pair_stats_no_loop(&a);
        pair_stats_no_loop(&again);
        if (memcmp(&a, &again, sizeof again) == 0)
            return;
    }
    fprintf(stderr, "the counters never held still for 1 ms\n");
    exit(1);
}

static inline void pair_wait_done(struct pair *p)
{
    char c;
    ssize_t r = read(p->from_parent, &c, 1);
    (void)r;
}

/* Server side: pair_wait_done, then close the listener and every accepted
 * socket (pair_server_close), while the server function's state is still
 * there for their callbacks. */
static inline void pair_wait_parent(struct pair *p)
{
    pair_wait_done(p);
    pair_server_close(p);
}

#endif
