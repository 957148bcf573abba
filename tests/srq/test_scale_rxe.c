/* SPDX-License-Identifier: Apache-2.0 */
/* Scale (issue 8 item 6): 2000 connections to one listening context over
 * RDMA in SRQ mode, from several client processes in the VM; each
 * connection exchanges messages, then everything is torn down. Label rxe.
 *
 * The server (this process, on ADDR0) is one context with 2 I/O threads in
 * SRQ mode (shares of 8 receives of 1 KiB) listening on PORTS ports: a
 * client context has one connection per listener address (sockets to one
 * address share it), so PROCS client processes (on ADDR1) of CTXS contexts
 * each connect once to every port: PROCS x CTXS x PORTS connections, each
 * its own QP on both sides. Every connection sends MSGS messages and gets
 * them echoed. The counts are checked on both sides, and with the kernel's
 * resource tracking (`rdma resource show`, per device: the server is on
 * rxe0, the clients on rxe1): every QP is there while the connections are
 * up, and none is left after the teardown. RSS and QP/CQ counts are
 * printed (docs/testing.md has the figures). The clients are forked
 * before the server makes anything of RDMA (no verbs resources cross a
 * fork). */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "sock/pair.h"
#include "transport/rdma/srq.h"

#define PORTS_MAX 250
#define PROCS     4
#define CTXS      2
/* BEX_TEST_SCALE_PORTS=n (at most 250) scales the run down, for a look */
static int PORTS = PORTS_MAX;
#define CONNS    (PORTS * PROCS * CTXS)
#define PER_PROC (PORTS * CTXS)
#define MSGS     4
#define MSG_LEN  256
#define SHARE    8
/* connections a client context has in setup at once */
#define WINDOW 16

static struct in_addr addr0, addr1;

/* what a client process reports, twice: after its echoes, after its close */
struct report {
    int32_t ok;
    int32_t connected, failed, echoes;
    int32_t up_ms, echo_ms;
    int64_t rss_kb;
};

static long rss_kb(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
            break;
    fclose(f);
    return kb;
}

/* Descriptors: one TCP connection per connection, kept open. The VM's
 * default soft limit is 1024, the hard one 4096 (scripts/rxe-vm raises
 * both to 65536): raise the soft one (and the hard one, where allowed). */
static int raise_nofile(rlim_t want)
{
    struct rlimit r;
    CHECK(getrlimit(RLIMIT_NOFILE, &r) == 0);
    if (r.rlim_cur >= want)
        return 0;
    struct rlimit up = {want, r.rlim_max > want ? r.rlim_max : want};
    if (setrlimit(RLIMIT_NOFILE, &up) == 0)
        return 0;
    r.rlim_cur = r.rlim_max;
    CHECK(setrlimit(RLIMIT_NOFILE, &r) == 0);
    if (r.rlim_cur < want) {
        fprintf(stderr, "RLIMIT_NOFILE: %llu descriptors, %llu needed\n",
                (unsigned long long)r.rlim_cur, (unsigned long long)want);
        return -1;
    }
    return 0;
}

/* The kernel's count of resources of kind ("qp", "cq", "srq") on device
 * dev, from the summary of `rdma resource show` (a listing of each QP takes
 * minutes with thousands of them in the emulated VM). Nothing else runs in
 * the VM meanwhile: the server is on rxe0 (ADDR0), the clients on rxe1. */
static long res_dev(const char *dev, const char *kind)
{
    FILE *f = popen("rdma resource show 2>&1", "r");
    CHECK(f);
    char line[512], d[32], pat[16];
    snprintf(d, sizeof d, " %s: ", dev);
    snprintf(pat, sizeof pat, " %s ", kind);
    long n = -1;
    while (fgets(line, sizeof line, f)) {
        const char *p = strstr(line, pat);
        if (strstr(line, d) && p)
            n = atol(p + strlen(pat));
    }
    pclose(f);
    return n;
}

static bex_ctx_config base_cfg(uint32_t threads, uint32_t srq_depth)
{
    const char *no = getenv("BEX_TEST_SCALE_NOSRQ"); /* for a comparison */
    if (no && atoi(no))
        srq_depth = 0;
    return (bex_ctx_config){
        .io_threads = threads,
        .srq_depth = srq_depth,
        .rq_depth = SHARE,
        .sq_depth = 16,
        .eager_max = 1024,
        .transport = BEX_TRANSPORT_RDMA,
        /* 4000 engines: keepalive writes every 100 ms would be 40,000 a
         * second, more than the emulated rxe moves */
        .keepalive_ms = 2000,
        .keepalive_timeout_ms = 60000,
        /* the ACK timeout (4.096 us x 2^18, about 1 s, instead of 67 ms):
         * with thousands of QPs the emulated rxe takes longer than 67 ms
         * to answer, every QP retransmits, and the duplicates slow it
         * further (1.1 million duplicate requests seen at 800
         * connections) */
        .qp_timeout = 18,
        .connect_timeout_ms = 60000,
        .setup_max = 1024,
        /* ten I/O threads on the VM's two CPUs: none spins */
        .poll_mode = BEX_POLL_EVENT,
    };
}

/* ---- client process ---- */

struct cli {
    struct waiter w;
    _Atomic long connected, failed, recvd, sent_done, closed;
};

static void c_connect(bex_sock *s, int err, void *user)
{
    (void)s;
    struct cli *c = user;
    if (err)
        fprintf(stderr, "client %d: connect: %s\n", (int)getpid(), bex_strerror(err));
    waiter_add(&c->w, err ? &c->failed : &c->connected, 1);
}

static void c_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct cli *c = user;
    uint8_t *p = buf;
    if (len == MSG_LEN && check_pattern(p + 1, len - 1, p[0]) == 0)
        waiter_add(&c->w, &c->recvd, 1);
    bex_mem_free(buf);
}

static void c_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s;
    (void)len;
    (void)mu;
    struct cli *c = user;
    bex_mem_free(buf);
    if (!status)
        waiter_add(&c->w, &c->sent_done, 1);
}

static void c_error(bex_sock *s, int err, void *user)
{
    (void)s;
    (void)user;
    fprintf(stderr, "client %d: socket error: %s\n", (int)getpid(), bex_strerror(err));
}

static void c_closed(bex_sock *s, void *user)
{
    (void)s;
    struct cli *c = user;
    waiter_add(&c->w, &c->closed, 1);
}

static int client_main(int rd, int wr)
{
    static struct cli c = {.w = WAITER_INIT};
    uint16_t ports[PORTS_MAX];
    CHECK(read(rd, ports, sizeof ports) == sizeof ports);
    uint64_t t_start = pair_now_ms();
    CHECK_OK(raise_nofile(PER_PROC + 256));
    bex_ctx *ctx[CTXS];
    for (int k = 0; k < CTXS; k++) {
        bex_ctx_config b = base_cfg(1, 4096);
        bex_ctx_config s = scaled(&b, addr1);
        CHECK_OK(bex_ctx_create(&s, &ctx[k]));
    }
    static bex_sock *socks[PORTS_MAX * CTXS];
    bex_sock_ops ops = {.on_connect = c_connect,
                        .on_recv = c_recv,
                        .on_send_done = c_done,
                        .on_error = c_error,
                        .on_close = c_closed};
    long started = 0;
    for (int i = 0; i < PORTS; i++) {
        for (int k = 0; k < CTXS; k++) {
            /* at most WINDOW setups per context under way */
            CHECK_OK(wait_count(&c.w, &c.connected, started + 1 - WINDOW * CTXS, 60000));
            bex_addr to = {.in4 = {.sin_family = AF_INET, .sin_port = ports[i], .sin_addr = addr0}};
            CHECK_OK(bex_sock_connect(ctx[k], &to, &ops, &c, &socks[started]));
            started++;
        }
        if (atomic_load(&c.failed))
            break;
    }
    int rc = wait_count(&c.w, &c.connected, PER_PROC, 60000);
    uint64_t t_up = pair_now_ms();
    struct report r = {.connected = (int32_t)atomic_load(&c.connected),
                       .failed = (int32_t)atomic_load(&c.failed)};
    if (!rc) {
        for (long i = 0; i < PER_PROC; i++) {
            for (int m = 0; m < MSGS; m++) {
                uint8_t *b = bex_sock_alloc(ctx[i % CTXS], MSG_LEN);
                CHECK(b);
                uint32_t seed = (uint32_t)(i * MSGS + m) & 0xff;
                b[0] = (uint8_t)seed; /* the echo is checked against it */
                fill_pattern(b + 1, MSG_LEN - 1, seed);
                CHECK_OK(bex_sock_send(socks[i], b, MSG_LEN, NULL));
            }
        }
        rc = wait_count(&c.w, &c.recvd, (long)PER_PROC * MSGS, 60000);
        rc |= wait_count(&c.w, &c.sent_done, (long)PER_PROC * MSGS, 60000);
    }
    r.echoes = (int32_t)atomic_load(&c.recvd);
    r.up_ms = (int32_t)(t_up - t_start);
    r.echo_ms = (int32_t)(pair_now_ms() - t_up);
    r.ok = rc == 0 && r.failed == 0;
    r.rss_kb = rss_kb(getpid());
    CHECK(write(wr, &r, sizeof r) == sizeof r);
    /* the server counts and says when to close */
    char go;
    CHECK(read(rd, &go, 1) == 1);
    for (long i = 0; i < started; i++)
        bex_sock_close(socks[i]);
    rc |= wait_count(&c.w, &c.closed, started, 60000);
    for (int k = 0; k < CTXS; k++)
        rc |= bex_ctx_destroy(ctx[k]);
    r.ok = rc == 0;
    r.rss_kb = rss_kb(getpid());
    CHECK(write(wr, &r, sizeof r) == sizeof r);
    /* alive until the server has counted what is left on rxe1 */
    CHECK(read(rd, &go, 1) == 1);
    return rc ? 1 : 0;
}

/* ---- server ---- */

struct srv {
    struct waiter w;
    _Atomic long accepted, closed, echoed;
};

static void s_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct srv *v = user;
    waiter_add(&v->w, &v->echoed, 1);
    if (bex_sock_send(s, buf, len, NULL))
        bex_mem_free(buf);
}

static void s_close(bex_sock *s, void *user)
{
    (void)s;
    struct srv *v = user;
    waiter_add(&v->w, &v->closed, 1);
}

static void s_error(bex_sock *s, int err, void *user)
{
    (void)err;
    (void)user;
    bex_sock_close(s); /* the peer closed */
}

static void s_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    struct srv *v = user;
    bex_sock_ops ops = {.on_recv = s_recv, .on_error = s_error, .on_close = s_close};
    bex_sock_set_user(s, &ops, v);
    waiter_add(&v->w, &v->accepted, 1);
}

static int read_report(int fd, struct report *r, unsigned timeout_ms)
{
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, (int)(timeout_ms * time_scale())) != 1)
        return -1;
    return read(fd, r, sizeof *r) == sizeof *r ? 0 : -1;
}

static pid_t kids[PROCS];

/* A failed check exits: the clients must not outlive the case, and the
 * server's I/O threads, still running, must not hold up its exit. */
static void kill_kids(void)
{
    bool any = false;
    for (int p = 0; p < PROCS; p++)
        if (kids[p] > 0 && kill(kids[p], SIGKILL) == 0) {
            waitpid(kids[p], NULL, 0);
            any = true;
        }
    if (any)
        _exit(1);
}

static int c2000(void)
{
    int rc = pair_addrs(&addr0, &addr1);
    if (rc)
        return rc;
    if (pair_tcp())
        return bex_test_skip("SRQ mode is RDMA's");
    const char *np = getenv("BEX_TEST_SCALE_PORTS");
    if (np && atoi(np) > 0 && atoi(np) < PORTS_MAX)
        PORTS = atoi(np);
    uint64_t t0 = pair_now_ms();
    static const char *const kinds[3] = {"qp", "cq", "srq"};
    long base[2][3];
    for (int k = 0; k < 3; k++) {
        base[0][k] = res_dev("rxe0", kinds[k]);
        base[1][k] = res_dev("rxe1", kinds[k]);
        CHECK(base[0][k] >= 0 && base[1][k] >= 0);
    }
    int to_kid[PROCS], from_kid[PROCS];
    fflush(NULL);
    for (int p = 0; p < PROCS; p++) {
        int down[2], up[2];
        CHECK(pipe(down) == 0 && pipe(up) == 0);
        kids[p] = fork();
        CHECK(kids[p] >= 0);
        if (kids[p] == 0) {
            for (int q = 0; q < p; q++) {
                close(to_kid[q]);
                close(from_kid[q]);
            }
            close(down[1]);
            close(up[0]);
            _exit(client_main(down[0], up[1]));
        }
        close(down[0]);
        close(up[1]);
        if (p == 0)
            atexit(kill_kids);
        to_kid[p] = down[1];
        from_kid[p] = up[0];
    }
    pid_t me = getpid();
    CHECK_OK(raise_nofile(CONNS + PORTS + 256));
    static struct srv v = {.w = WAITER_INIT};
    /* each thread's queue: its half of the peers' shares, and room */
    bex_ctx_config b = base_cfg(2, 8192);
    bex_ctx_config sc = scaled(&b, addr0);
    bex_ctx *sctx;
    CHECK_OK(bex_ctx_create(&sc, &sctx));
    static bex_listener *l[PORTS_MAX];
    uint16_t ports[PORTS_MAX] = {0};
    bex_listener_ops lops = {.on_accept = s_accept};
    for (int i = 0; i < PORTS; i++) {
        bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_addr = addr0}}, got;
        CHECK_OK(bex_listen(sctx, &a, &lops, &v, &l[i]));
        bex_listener_addr(l[i], &got);
        ports[i] = got.in4.sin_port;
    }
    for (int p = 0; p < PROCS; p++)
        CHECK(write(to_kid[p], ports, sizeof ports) == sizeof ports);
    /* every client connected and got its echoes */
    int bad = 0;
    long client_rss = 0;
    for (int p = 0; p < PROCS; p++) {
        struct report r = {0};
        if (read_report(from_kid[p], &r, 240000)) {
            fprintf(stderr, "client %d: no report\n", (int)kids[p]);
            bad = 1;
            continue;
        }
        fprintf(stderr,
                "client %d: %d connected in %d ms, %d failed, %d echoes in %d ms, RSS %lld kB\n",
                (int)kids[p], r.connected, r.up_ms, r.failed, r.echoes, r.echo_ms,
                (long long)r.rss_kb);
        bad |= !r.ok || r.connected != PER_PROC || r.echoes != PER_PROC * MSGS;
        client_rss += r.rss_kb;
    }
    uint64_t t1 = pair_now_ms();
    CHECK_OK(wait_count(&v.w, &v.accepted, CONNS, 10000));
    bex_sock_stats st;
    bex_ctx_stats(sctx, &st);
    fprintf(stderr,
            "up: %d connections in %llu ms; server: engines %llu, over TCP %llu, SRQ credits "
            "%llu, receives posted %llu, refused %llu, messages %llu in, %llu out; clients' "
            "RSS %ld kB in all\n",
            CONNS, (unsigned long long)(t1 - t0), (unsigned long long)st.engines,
            (unsigned long long)st.tcp_conns, (unsigned long long)st.srq_credits,
            (unsigned long long)st.srq_posted, (unsigned long long)st.srq_refused,
            (unsigned long long)st.msgs_recv, (unsigned long long)st.msgs_sent, client_rss);
    uint32_t cqs = 0;
    for (uint32_t t = 0; t < sctx->n_io; t++)
        cqs += sctx->io[t].n_cq + (sctx->io[t].sh.srq != NULL);
    fprintf(stderr, "server CQs made: %u (per-thread CQs and the shared queues' CQs)\n", cqs);
    /* the kernel's count */
    long qp0 = res_dev("rxe0", "qp") - base[0][0], cq0 = res_dev("rxe0", "cq") - base[0][1],
         srq0 = res_dev("rxe0", "srq") - base[0][2];
    long qp1 = res_dev("rxe1", "qp") - base[1][0], cq1 = res_dev("rxe1", "cq") - base[1][1],
         srq1 = res_dev("rxe1", "srq") - base[1][2];
    fprintf(stderr, "up: server (rxe0) QPs %ld, CQs %ld, SRQs %ld, RSS %ld kB\n", qp0, cq0, srq0,
            rss_kb(me));
    fprintf(stderr, "up: clients (rxe1) QPs %ld, CQs %ld, SRQs %ld\n", qp1, cq1, srq1);
    /* retransmissions and RNR NAKs so far (rxe's counters, both devices):
     * a shared queue that ran dry would show as send_rnr_err */
    fprintf(stderr,
            "rxe: duplicate_request %lld, completer_retry_err %lld, send_err %lld, "
            "send_rnr_err %lld\n",
            rxe_counter("duplicate_request"), rxe_counter("completer_retry_err"),
            rxe_counter("send_err"), rxe_counter("send_rnr_err"));
    CHECK_EQ(bad, 0);
    CHECK_EQ(st.engines, CONNS);
    CHECK_EQ(st.tcp_conns, 0);
    CHECK_EQ(st.srq_credits, (uint64_t)CONNS * SHARE);
    CHECK_EQ(st.srq_refused, 0);
    CHECK_OK(wait_count(&v.w, &v.echoed, (long)CONNS * MSGS, 10000));
    CHECK_EQ(qp0, CONNS);
    CHECK_EQ(srq0, 2); /* one per I/O thread */
    CHECK_EQ(cq0, cqs);
    CHECK_EQ(qp1, CONNS);
    CHECK_EQ(srq1, PROCS * CTXS);
    /* teardown: the clients close every socket, the server's follow */
    for (int p = 0; p < PROCS; p++)
        CHECK(write(to_kid[p], "c", 1) == 1);
    for (int p = 0; p < PROCS; p++) {
        struct report r = {0};
        CHECK_OK(read_report(from_kid[p], &r, 120000));
        fprintf(stderr, "client %d closed, RSS %lld kB\n", (int)kids[p], (long long)r.rss_kb);
        bad |= !r.ok;
    }
    /* the clients destroyed their contexts and still live: nothing of
     * theirs is left on rxe1 */
    qp1 = res_dev("rxe1", "qp") - base[1][0];
    cq1 = res_dev("rxe1", "cq") - base[1][1];
    srq1 = res_dev("rxe1", "srq") - base[1][2];
    fprintf(stderr, "down: clients (rxe1) QPs %ld, CQs %ld, SRQs %ld\n", qp1, cq1, srq1);
    CHECK_EQ(qp1 + cq1 + srq1, 0);
    for (int p = 0; p < PROCS; p++) {
        CHECK(write(to_kid[p], "x", 1) == 1);
        int status = 0;
        CHECK(waitpid(kids[p], &status, 0) == kids[p]);
        kids[p] = 0;
        bad |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    CHECK_EQ(bad, 0);
    CHECK_OK(wait_count(&v.w, &v.closed, CONNS, 60000));
    bool gone = false;
    for (int tries = 0; tries < 3000 && !gone; tries++) {
        bex_ctx_stats(sctx, &st);
        /* a gone connection's QP drains in the error state (up to
         * srq_drain_ms) before it is destroyed */
        gone = st.engines == 0 && st.srq_credits == 0 && st.srq_draining == 0;
        if (!gone)
            pair_sleep_ms(10);
    }
    fprintf(stderr, "down after %llu ms: engines %llu, SRQ credits %llu\n",
            (unsigned long long)(pair_now_ms() - t1), (unsigned long long)st.engines,
            (unsigned long long)st.srq_credits);
    qp0 = res_dev("rxe0", "qp") - base[0][0];
    fprintf(stderr, "down: server (rxe0) QPs %ld, RSS %ld kB\n", qp0, rss_kb(me));
    CHECK(gone);
    CHECK_EQ(qp0, 0);
    for (int i = 0; i < PORTS; i++)
        CHECK_OK(bex_listener_close(l[i]));
    CHECK_OK(bex_ctx_destroy(sctx));
    /* as found */
    for (int k = 0; k < 3; k++) {
        CHECK_EQ(res_dev("rxe0", kinds[k]), base[0][k]);
        CHECK_EQ(res_dev("rxe1", kinds[k]), base[1][k]);
    }
    fprintf(stderr, "total %llu ms\n", (unsigned long long)(pair_now_ms() - t0));
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(c2000))
