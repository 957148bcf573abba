/* SPDX-License-Identifier: Apache-2.0 */
/* Bounded resources (issue 7, part 3) on real RDMA devices: what a peer,
 * well-behaved or not, may make a context hold, and the timeouts that end
 * in an error instead of a hang. Two processes (pair.h); the cases that need
 * a peer breaking the protocol use the hand-made one of rawpeer.h. */
#include <fcntl.h>
#include <netinet/tcp.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include "echo.h"
#include "rawpeer.h"

/* Log lines say which process wrote them. */
static void tagged_log(int level, const char *msg, void *arg)
{
    (void)level;
    fprintf(stderr, "[%s] bex: %s\n", (const char *)arg, msg);
}

/* pair_run with each side's log lines tagged. */
static int run(const bex_ctx_config *scfg, pair_fn sfn, void *sarg, const bex_ctx_config *ccfg,
               pair_fn cfn, void *carg, unsigned timeout_s)
{
    bex_ctx_config s = scfg ? *scfg : (bex_ctx_config){0};
    bex_ctx_config c = ccfg ? *ccfg : (bex_ctx_config){0};
    s.log_fn = c.log_fn = tagged_log;
    s.log_arg = (void *)"server";
    c.log_arg = (void *)"client";
    /* pair_run stretches keepalive and connect timeouts under sanitizers */
    return pair_run(&s, sfn, sarg, &c, cfn, carg, timeout_s);
}

/* ---------------- an echo server ---------------- */

struct esrv {
    _Atomic long accepted, recvd;
};

static void esrv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct esrv *e = user;
    atomic_fetch_add(&e->recvd, 1);
    if (bex_sock_send(s, buf, len, NULL) != 0)
        bex_mem_free(buf);
}

static const bex_sock_ops esrv_ops = {
    .on_recv = esrv_recv, .on_send_done = echo_srv_done, .on_error = echo_srv_error};

static void esrv_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    struct esrv *e = user;
    atomic_fetch_add(&e->accepted, 1);
    bex_sock_set_user(s, &esrv_ops, user);
}

static int echo_server(struct pair *p, void *arg)
{
    struct esrv *e = arg ? arg : &(struct esrv){0};
    bex_listener_ops lops = {.on_accept = esrv_accept};
    pair_listen(p, &lops, e);
    pair_wait_parent(p);
    return 0;
}

/* ---------------- a client ---------------- */

#define MAXS 16

struct cli {
    struct waiter w;
    _Atomic long connected, recvd, done, send_err, errors, closed;
    _Atomic long send_eio; /* of send_err: in doubt (-EIO) */
    int conn_status[MAXS], err[MAXS], last_send_status;
    _Atomic long sock_recvd[MAXS], sock_errors[MAXS];
    int bad;
    bex_sock *socks[MAXS];
};

static int sock_index(struct cli *c, bex_sock *s)
{
    for (int i = 0; i < MAXS; i++)
        if (c->socks[i] == s)
            return i;
    return 0;
}

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct cli *c = user;
    /* [0..3] seed, rest pattern(seed) */
    uint32_t seed = 0;
    if (len >= 4)
        memcpy(&seed, buf, 4);
    if (len >= 4 && check_pattern((uint8_t *)buf + 4, len - 4, seed))
        c->bad++;
    bex_mem_free(buf);
    atomic_fetch_add(&c->sock_recvd[sock_index(c, s)], 1);
    atomic_fetch_add(&c->recvd, 1);
    waiter_signal(&c->w);
}

static void cli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    struct cli *c = user;
    (void)s, (void)len, (void)mu;
    if (status) {
        c->last_send_status = status;
        atomic_fetch_add(&c->send_err, 1);
        if (status == -EIO)
            atomic_fetch_add(&c->send_eio, 1);
    }
    bex_mem_free(buf);
    atomic_fetch_add(&c->done, 1);
    waiter_signal(&c->w);
}

static void cli_connect(bex_sock *s, int status, void *user)
{
    struct cli *c = user;
    c->conn_status[sock_index(c, s)] = status;
    atomic_fetch_add(&c->connected, 1);
    waiter_signal(&c->w);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    struct cli *c = user;
    int i = sock_index(c, s);
    c->err[i] = err;
    atomic_fetch_add(&c->sock_errors[i], 1);
    atomic_fetch_add(&c->errors, 1);
    waiter_signal(&c->w);
}

static void cli_close(bex_sock *s, void *user)
{
    struct cli *c = user;
    (void)s;
    waiter_add(&c->w, &c->closed, 1);
}

static const bex_sock_ops cli_ops = {.on_connect = cli_connect,
                                     .on_recv = cli_recv,
                                     .on_send_done = cli_done,
                                     .on_error = cli_error,
                                     .on_close = cli_close};

static void cli_wait(struct cli *c, _Atomic long *what, long want, unsigned ms, int line)
{
    if (wait_count(&c->w, what, want, ms) == 0) /* scaled by wait_count */
        return;
    fprintf(stderr,
            "line %d: timed out waiting (%ld of %ld); recvd %ld done %ld send_err %ld "
            "errors %ld\n",
            line, atomic_load(what), want, atomic_load(&c->recvd), atomic_load(&c->done),
            atomic_load(&c->send_err), atomic_load(&c->errors));
    exit(1);
}
#define CLI_WAIT(c, field, want, ms) cli_wait((c), &(c)->field, (want), (ms), __LINE__)

static struct cli *cli_new(void)
{
    struct cli *c = calloc(1, sizeof(*c));
    CHECK(c);
    pthread_mutex_init(&c->w.mu, NULL);
    pthread_cond_init(&c->w.cv, NULL);
    return c;
}

static void *make_msg(bex_ctx *ctx, uint32_t seed, size_t len)
{
    uint8_t *b = bex_sock_alloc(ctx, len < 4 ? 4 : len);
    CHECK(b);
    memcpy(b, &seed, 4);
    fill_pattern(b + 4, len - 4, seed);
    return b;
}

/* One socket to the server; n echoes of len bytes come back intact. */
static void cli_echo(struct pair *p, struct cli *c, int si, int n, size_t len)
{
    long before = atomic_load(&c->recvd);
    for (int i = 0; i < n; i++)
        CHECK_OK(bex_sock_send(c->socks[si], make_msg(p->ctx, (uint32_t)(si * 1000 + i), len), len,
                               NULL));
    CLI_WAIT(c, recvd, before + n, 20000);
    CHECK_EQ(c->bad, 0);
}

static void cli_close_all(struct cli *c, int n)
{
    long before = atomic_load(&c->closed);
    for (int i = 0; i < n; i++)
        bex_sock_close(c->socks[i]);
    CLI_WAIT(c, closed, before + n, 20000);
}

/* A client with one socket, connected to the server. */
static struct cli *cli_connected(struct pair *p)
{
    struct cli *c = cli_new();
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &cli_ops, c, &c->socks[0]));
    CLI_WAIT(c, connected, 1, 10000);
    CHECK_EQ(c->conn_status[0], 0);
    return c;
}

/* After an attack: a real client still gets its n echoes of len bytes. */
static void cli_still_served(struct pair *p, int n, size_t len)
{
    struct cli *c = cli_connected(p);
    cli_echo(p, c, 0, n, len);
    cli_close_all(c, 1);
    free(c);
}

/* A raw peer on ADDR1 connecting to the server with a hello of o:
 * rp_connect's result. */
static int rp_to_server(struct rawpeer *rp, struct pair *p, const struct rp_opts *o)
{
    struct in_addr a0, a1;
    CHECK_OK(pair_addrs(&a0, &a1));
    rp_init(rp, a1, o);
    return rp_connect(rp, &p->srv, o);
}

/* ---------------- connections in setup ---------------- */

/* 300 TCP connections that never say hello do not lock a client out: they
 * reserve no CQ entries, and past setup_max the oldest gives way. Before,
 * each reserved sq + rq + 2 CQ entries at accept: 167 filled the CQ and
 * every later connection, the real client's too, was reset. */
enum { IDLE_N = 300 };

static int idle_client(struct pair *p, void *arg)
{
    (void)arg;
    static int fds[IDLE_N];
    for (int i = 0; i < IDLE_N; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        CHECK(fds[i] >= 0);
        CHECK(connect(fds[i], (const struct sockaddr *)&p->srv, sizeof(p->srv)) == 0);
    }
    pair_sleep_ms(500); /* the server has accepted them all */
    struct cli *c = cli_connected(p);
    cli_echo(p, c, 0, 20, 3000);
    cli_echo(p, c, 0, 4, 300000);
    /* the server evicted the oldest idle connections: they were closed */
    int closed = 0;
    for (int i = 0; i < IDLE_N; i++) {
        char b;
        struct pollfd pf = {.fd = fds[i], .events = POLLIN};
        if (poll(&pf, 1, 0) == 1 && recv(fds[i], &b, 1, MSG_DONTWAIT) <= 0)
            closed++;
    }
    fprintf(stderr, "%d of %d idle connections closed by the server\n", closed, IDLE_N);
    CHECK(closed >= IDLE_N - 64);
    for (int i = 0; i < IDLE_N; i++)
        close(fds[i]);
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int idle_setup(void)
{
    /* a setup deadline far beyond the case: only eviction can let the
     * client in */
    bex_ctx_config scfg = {.connect_timeout_ms = 60000};
    return run(&scfg, echo_server, NULL, NULL, idle_client, NULL, 60);
}

/* A connection in setup is closed at its deadline. */
static int deadline_client(struct pair *p, void *arg)
{
    (void)arg;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    CHECK(connect(fd, (const struct sockaddr *)&p->srv, sizeof(p->srv)) == 0);
    uint64_t t0 = pair_now_ms();
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    CHECK(poll(&pf, 1, (int)(5000 * time_scale())) == 1);
    char b;
    CHECK(recv(fd, &b, 1, 0) <= 0);
    uint64_t dt = pair_now_ms() - t0;
    fprintf(stderr, "idle connection closed after %llu ms\n", (unsigned long long)dt);
    CHECK(dt >= 900);
    close(fd);
    return 0;
}

static int setup_deadline(void)
{
    bex_ctx_config scfg = {.connect_timeout_ms = 1000};
    return run(&scfg, echo_server, NULL, NULL, deadline_client, NULL, 30);
}

/* ---------------- EMFILE on accept ---------------- */

/* The server runs out of descriptors while a client connects: its I/O
 * thread must not spin on the readable listener (CPU time stays low), and
 * accepting resumes once descriptors are free. */
static int emfile_server(struct pair *p, void *arg)
{
    (void)arg;
    struct esrv e = {0};
    bex_listener_ops lops = {.on_accept = esrv_accept};
    pair_listen(p, &lops, &e);
    struct rlimit rl;
    CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
    rl.rlim_cur = 128;
    CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
    static int fill[256];
    int nfill = 0;
    for (int fd; nfill < 256 && (fd = dup(p->to_parent)) >= 0;)
        fill[nfill++] = fd;
    CHECK(errno == EMFILE);
    char go = 'f';
    CHECK(write(p->to_parent, &go, 1) == 1);               /* descriptors are full */
    CHECK(read(p->from_parent, &go, 1) == 1 && go == 'c'); /* the client connects */
    pair_sleep_ms(300);
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    uint64_t t0 = pair_now_ms();
    pair_sleep_ms(2000);
    getrusage(RUSAGE_SELF, &r1);
    uint64_t wall = pair_now_ms() - t0;
    long cpu_us = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) * 1000000L +
                  (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) +
                  (r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) * 1000000L +
                  (r1.ru_stime.tv_usec - r0.ru_stime.tv_usec);
    fprintf(stderr, "server: %ld us of CPU in %llu ms while out of descriptors\n", cpu_us,
            (unsigned long long)wall);
    for (int i = 0; i < nfill; i++)
        close(fill[i]);
    /* a spinning I/O thread burns the whole 2 s; an idle one, ticking every
     * 10 ms, a few ms (some 250 ms under TSan) */
    int rc = cpu_us > (long)wall * 1000 / 3 ? 1 : 0;
    pair_wait_parent(p);
    CHECK(atomic_load(&e.accepted) == 1);
    return rc;
}

static int emfile_client(struct pair *p, void *arg)
{
    (void)arg;
    char b;
    CHECK(read(p->from_child, &b, 1) == 1 && b == 'f');
    struct cli *c = cli_new();
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &cli_ops, c, &c->socks[0]));
    b = 'c';
    CHECK(write(p->to_child, &b, 1) == 1);
    /* the server frees its descriptors after about 2.3 s */
    CLI_WAIT(c, connected, 1, 15000);
    CHECK_EQ(c->conn_status[0], 0);
    cli_echo(p, c, 0, 10, 1000);
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int emfile_backoff(void)
{
    bex_ctx_config cfg = {.connect_timeout_ms = 20000};
    return run(&cfg, emfile_server, NULL, &cfg, emfile_client, NULL, 60);
}

/* ---------------- a hello whose depths cannot work ---------------- */

/* A hello granting one receive credit leaves no credit for data (SENDs keep
 * the last one for a CREDIT message): refused, and the listener goes on. */
static int depth_client(struct pair *p, void *arg)
{
    (void)arg;
    struct rawpeer rp;
    struct rp_opts o = {.recv_depth = 1, .max_rndv = 16, .max_msg = 1u << 20, .eager_max = 1024};
    int rc = rp_to_server(&rp, p, &o);
    fprintf(stderr, "hello with recv_depth 1: %s\n", bex_strerror(rc));
    CHECK(rc != 0); /* no answer: the connection is closed */
    rp_fini(&rp);
    /* recv_depth 4 works */
    o.recv_depth = 4;
    CHECK_OK(rp_to_server(&rp, p, &o));
    rp_fini(&rp);
    /* and a real client still gets its echoes */
    cli_still_served(p, 10, 1000);
    return 0;
}

static int hello_depth(void)
{
    return run(NULL, echo_server, NULL, NULL, depth_client, NULL, 60);
}

/* ---------------- largest message ---------------- */

/* The server takes at most 1 MiB: the client refuses larger sends at once
 * once it knows, hands back with -EMSGSIZE one queued before it knew, and
 * its other messages, before and after, go through in order. */
static int maxmsg_client(struct pair *p, void *arg)
{
    (void)arg;
    struct cli *c = cli_new();
    /* sent right after the connect, before the hello (a TCP round trip and
     * QP set-up away): the limit is not known yet */
    void *m1 = make_msg(p->ctx, 1, 5000), *m2 = make_msg(p->ctx, 2, (1u << 20) + 1),
         *m3 = make_msg(p->ctx, 3, 1u << 20);
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &cli_ops, c, &c->socks[0]));
    CHECK_OK(bex_sock_send(c->socks[0], m1, 5000, NULL));
    CHECK_OK(bex_sock_send(c->socks[0], m2, (1u << 20) + 1, NULL));
    CHECK_OK(bex_sock_send(c->socks[0], m3, 1u << 20, NULL));
    CLI_WAIT(c, connected, 1, 10000);
    CHECK_EQ(c->conn_status[0], 0);
    CLI_WAIT(c, done, 3, 20000);
    CHECK_EQ(atomic_load(&c->send_err), 1);
    CHECK_EQ(c->last_send_status, -EMSGSIZE);
    CLI_WAIT(c, recvd, 2, 20000);
    CHECK_EQ(c->bad, 0);
    /* now it is known: refused at the call, nothing is reported */
    void *big = make_msg(p->ctx, 4, 2u << 20);
    CHECK_EQ(bex_sock_send(c->socks[0], big, 2u << 20, NULL), -EMSGSIZE);
    bex_mem_free(big);
    cli_echo(p, c, 0, 2, 1u << 20);
    CHECK_EQ(atomic_load(&c->errors), 0);
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int max_msg(void)
{
    bex_ctx_config scfg = {.max_msg = 1u << 20};
    return run(&scfg, echo_server, NULL, NULL, maxmsg_client, NULL, 60);
}

/* A peer that ignores the agreed max_msg (a request above it; here 300 of
 * 2 GiB + 1, which used to queue one error answer each without bound) has
 * its engine failed; the listener goes on. */
static int oversize_client(struct pair *p, void *arg)
{
    (void)arg;
    struct rawpeer rp;
    struct rp_opts o = {.recv_depth = 64, .max_rndv = 16, .max_msg = 1u << 20, .eager_max = 1024};
    CHECK_OK(rp_to_server(&rp, p, &o));
    CHECK(rp.credits >= 300);
    /* the server fails the engine at the first; the rest may not get through */
    uint32_t sent = 0;
    for (uint32_t i = 0; i < 300; i++) {
        struct bex__hdr h = {
            .type = BEX__MSG_RNDV_REQ, .stream = 1, .len = 0x80000001u + i, .id = i};
        if (rp_send(&rp, &h) || rp.failed)
            break;
        sent++;
    }
    fprintf(stderr, "client: %u requests posted (%s)\n", sent, bex_strerror(rp.failed));
    CHECK(rp_wait_closed(&rp, 5000 * time_scale()));
    CHECK_EQ(rp.peer.max_msg, 64u << 20); /* the default, told in the hello */
    rp_fini(&rp);
    cli_still_served(p, 4, 100000);
    return 0;
}

static int rndv_oversize(void)
{
    bex_ctx_config scfg = {.rq_depth = 512};
    return run(&scfg, echo_server, NULL, NULL, oversize_client, NULL, 60);
}

/* More rendezvous requests in flight than the server advertised: the peer
 * ignored the agreement, its engine fails. */
static int flood_client(struct pair *p, void *arg)
{
    (void)arg;
    struct rawpeer rp;
    struct rp_opts o = {.recv_depth = 64, .max_rndv = 16, .max_msg = 1u << 20, .eager_max = 1024};
    CHECK_OK(rp_to_server(&rp, p, &o));
    CHECK_EQ(rp.peer.max_rndv, 8);
    for (uint32_t i = 0; i < 8; i++) {
        struct bex__hdr h = {.type = BEX__MSG_RNDV_REQ, .stream = 1, .len = 100000, .id = i};
        CHECK_OK(rp_send(&rp, &h));
    }
    CHECK(!rp_wait_closed(&rp, 1000)); /* within the limit: fine */
    struct bex__hdr h = {.type = BEX__MSG_RNDV_REQ, .stream = 1, .len = 100000, .id = 8};
    CHECK_OK(rp_send(&rp, &h));
    CHECK(rp_wait_closed(&rp, 5000 * time_scale()));
    rp_fini(&rp);
    return 0;
}

static int rndv_flood(void)
{
    bex_ctx_config scfg = {.rndv_max = 8};
    return run(&scfg, echo_server, NULL, NULL, flood_client, NULL, 60);
}

/* ---------------- sockets per connection ---------------- */

/* streams_max 4: a fifth and sixth socket on the connection are refused
 * (they fail with -ECONNRESET), the first four work; once one closes, a
 * new one may open. */
static int streams_client(struct pair *p, void *arg)
{
    (void)arg;
    struct cli *c = cli_new();
    for (int i = 0; i < 6; i++) {
        CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &cli_ops, c, &c->socks[i]));
        CLI_WAIT(c, connected, i + 1, 10000);
        CHECK_EQ(c->conn_status[i], 0);
    }
    CLI_WAIT(c, errors, 2, 10000);
    for (int i = 0; i < 6; i++) {
        if (i < 4) {
            CHECK_EQ(atomic_load(&c->sock_errors[i]), 0);
            cli_echo(p, c, i, 3, 2000);
        } else {
            CHECK_EQ(atomic_load(&c->sock_errors[i]), 1);
            CHECK_EQ(c->err[i], -ECONNRESET);
        }
    }
    bex_sock_stats st;
    bex_ctx_stats(p->ctx, &st);
    CHECK_EQ(st.engines, 1);
    /* close a refused one and an accepted one: a new socket may open */
    long closed = atomic_load(&c->closed);
    bex_sock_close(c->socks[4]);
    bex_sock_close(c->socks[0]);
    CLI_WAIT(c, closed, closed + 2, 10000);
    pair_sleep_ms(300); /* the server has let go of its side */
    c->socks[0] = NULL;
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &cli_ops, c, &c->socks[0]));
    CLI_WAIT(c, connected, 7, 10000);
    cli_echo(p, c, 0, 3, 2000);
    CHECK_EQ(atomic_load(&c->sock_errors[0]), 0);
    bex_sock *rest[] = {c->socks[0], c->socks[1], c->socks[2], c->socks[3], c->socks[5]};
    closed = atomic_load(&c->closed);
    for (int i = 0; i < 5; i++)
        bex_sock_close(rest[i]);
    CLI_WAIT(c, closed, closed + 5, 10000);
    free(c);
    return 0;
}

static int streams_max(void)
{
    bex_ctx_config scfg = {.streams_max = 4};
    return run(&scfg, echo_server, NULL, NULL, streams_client, NULL, 60);
}

/* A peer that opens sockets without end: at most streams_max are made, each
 * further OPEN is answered with a CLOSE, the listener goes on. */
static int openflood_server(struct pair *p, void *arg)
{
    struct esrv *e = arg;
    bex_listener_ops lops = {.on_accept = esrv_accept};
    pair_listen(p, &lops, e);
    pair_wait_parent(p);
    long n = atomic_load(&e->accepted);
    fprintf(stderr, "server: %ld sockets accepted\n", n);
    return n == 8 ? 0 : 1;
}

static int openflood_client(struct pair *p, void *arg)
{
    (void)arg;
    struct rawpeer rp;
    struct rp_opts o = {.recv_depth = 512, .max_rndv = 16, .max_msg = 1u << 20, .eager_max = 1024};
    CHECK_OK(rp_to_server(&rp, p, &o));
    for (uint32_t i = 1; i <= 400; i++) {
        struct bex__hdr h = {.type = BEX__MSG_OPEN, .stream = i};
        CHECK_OK(rp_send(&rp, &h));
    }
    uint64_t end = pair_now_ms() + 5000 * time_scale();
    while (rp.ngot < 392 && pair_now_ms() < end)
        rp_pump(&rp);
    pair_sleep_ms(200);
    rp_reap(&rp);
    /* CLOSEs for streams 9..400 in order; credit updates may come between */
    uint32_t closes = 0;
    for (uint32_t i = 0; i < rp.ngot; i++) {
        if (rp.got[i].type == BEX__MSG_CREDIT)
            continue;
        CHECK_EQ(rp.got[i].type, BEX__MSG_CLOSE);
        CHECK_EQ(rp.got[i].stream, 9 + closes);
        closes++;
    }
    fprintf(stderr, "client: %u answers, %u of them CLOSE\n", rp.ngot, closes);
    CHECK_EQ(closes, 392);
    CHECK(!rp_wait_closed(&rp, 200));
    rp_fini(&rp);
    return 0;
}

static int open_flood(void)
{
    bex_ctx_config scfg = {.streams_max = 8, .rq_depth = 512};
    struct esrv e = {0};
    return run(&scfg, openflood_server, &e, NULL, openflood_client, NULL, 60);
}

/* ---------------- received bytes per context ---------------- */

/* The application holds what it receives for 3 s: the context holds at most
 * recv_bytes_max (plus the receives posted at the time), the sender is
 * paced, and once the application frees, everything arrives intact. Before,
 * each received buffer was replaced at once: memory grew with the backlog. */
#define RL_LIMIT (2u << 20)
#define RL_SMALL 400 /* eager, first: receive buffers of 8 KiB each */
#define RL_BIG   20  /* 256 KiB by rendezvous */
#define RL_N     (RL_SMALL + RL_BIG)

struct rlsrv {
    pthread_mutex_t mu;
    void *held[RL_N];
    size_t held_len[RL_N];
    int nheld;
    _Atomic int recvd;
    size_t held_bytes, max_held, max_pool;
    bool release; /* free at once from now on */
    int bad;
};

static void rl_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct rlsrv *r = user;
    (void)s;
    uint32_t seed;
    memcpy(&seed, buf, 4);
    if ((int)seed != atomic_load(&r->recvd) || check_pattern((uint8_t *)buf + 4, len - 4, seed))
        r->bad++;
    bex_mem_stats st;
    bex_mem_pool_stats(bex_mem_pool_of(buf), &st);
    pthread_mutex_lock(&r->mu);
    r->recvd++;
    if (st.in_use_bytes > r->max_pool)
        r->max_pool = st.in_use_bytes;
    if (r->release) {
        pthread_mutex_unlock(&r->mu);
        bex_mem_free(buf);
        return;
    }
    r->held[r->nheld] = buf;
    r->held_len[r->nheld++] = len;
    r->held_bytes += len;
    if (r->held_bytes > r->max_held)
        r->max_held = r->held_bytes;
    pthread_mutex_unlock(&r->mu);
}

static const bex_sock_ops rl_ops = {
    .on_recv = rl_recv, .on_send_done = echo_srv_done, .on_error = echo_srv_error};

static void rl_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    bex_sock_set_user(s, &rl_ops, user);
}

static int rl_server(struct pair *p, void *arg)
{
    (void)arg;
    static struct rlsrv r = {.mu = PTHREAD_MUTEX_INITIALIZER};
    bex_listener_ops lops = {.on_accept = rl_accept};
    pair_listen(p, &lops, &r);
    /* hold for 3 s after the first message, then free from this thread (a
     * thread other than the I/O thread: the frees are remote) */
    while (!r.recvd)
        pair_sleep_ms(5);
    pair_sleep_ms(3000 * time_scale());
    pthread_mutex_lock(&r.mu);
    int held_then = r.recvd;
    r.release = true;
    for (int i = 0; i < r.nheld; i++)
        bex_mem_free(r.held[i]);
    r.nheld = 0;
    r.held_bytes = 0;
    pthread_mutex_unlock(&r.mu);
    uint64_t end = pair_now_ms() + 30000 * time_scale();
    while (r.recvd < RL_N && pair_now_ms() < end)
        pair_sleep_ms(5);
    bex_sock_stats st;
    bex_ctx_stats(p->ctx, &st);
    fprintf(stderr,
            "server: %d received while holding, %d in all; most held %zu bytes, recv pool "
            "in use at most %zu; %llu pauses\n",
            held_then, r.recvd, r.max_held, r.max_pool, (unsigned long long)st.recv_paused);
    int rc = 0;
    if (r.recvd != RL_N || r.bad || held_then >= RL_N || st.recv_paused == 0)
        rc = 1;
    /* the limit, plus the 64 receive buffers of 8 KiB that may fill before
     * the engine can hold back */
    if (r.max_held > RL_LIMIT + 64 * 8192 || r.max_pool > RL_LIMIT + 2 * 64 * 8192)
        rc = 1;
    pair_wait_parent(p);
    return rc;
}

static int rl_client(struct pair *p, void *arg)
{
    (void)arg;
    struct cli *c = cli_connected(p);
    for (uint32_t i = 0; i < RL_N; i++) {
        size_t len = i < RL_SMALL ? 4000 : 256 * 1024;
        CHECK_OK(bex_sock_send(c->socks[0], make_msg(p->ctx, i, len), len, NULL));
    }
    CLI_WAIT(c, done, RL_N, 40000);
    CHECK_EQ(atomic_load(&c->send_err), 0);
    CHECK_EQ(atomic_load(&c->errors), 0);
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int recv_limit(void)
{
    bex_ctx_config scfg = {.recv_bytes_max = RL_LIMIT};
    return run(&scfg, rl_server, NULL, NULL, rl_client, NULL, 90);
}

/* ---------------- a live peer that stops answering ---------------- */

/* The server is hand-made: it keeps the keepalive going, but never answers
 * a rendezvous request (timeouts.rndv) or never returns a credit
 * (timeouts.credit). The client's engine fails with -ETIMEDOUT after the
 * configured time and every send comes back through on_send_done; before,
 * they waited forever. */
struct stall {
    int mode; /* 0: rendezvous unanswered, 1: credits withheld */
};

static int stall_server(struct pair *p, void *arg)
{
    struct stall *st = arg;
    struct in_addr a0, a1;
    CHECK_OK(pair_addrs(&a0, &a1));
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(lfd >= 0);
    bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    socklen_t sl = sizeof(a);
    CHECK(bind(lfd, (struct sockaddr *)&a, sizeof(a)) == 0 && listen(lfd, 4) == 0 &&
          getsockname(lfd, (struct sockaddr *)&a, &sl) == 0);
    CHECK(write(p->to_parent, &a.in4.sin_port, sizeof a.in4.sin_port) == sizeof a.in4.sin_port);
    struct rawpeer rp;
    struct rp_opts o = {
        .recv_depth = st->mode ? 8 : 64, .max_rndv = 16, .max_msg = 1u << 30, .eager_max = 1024};
    rp_init(&rp, a0, &o);
    rp_accept(&rp, lfd, &o);
    /* live, but deaf: until the client gives up on us */
    bool closed = rp_wait_closed(&rp, 20000 * time_scale());
    fprintf(stderr, "server: %u headers received; connection %s\n", rp.ngot,
            closed ? "closed by the client" : "still open");
    rp_fini(&rp);
    close(lfd);
    pair_wait_parent(p);
    return closed ? 0 : 1;
}

static int stall_client(struct pair *p, void *arg)
{
    struct stall *st = arg;
    struct cli *c = cli_connected(p);
    int n = st->mode ? 20 : 4;
    uint64_t t0 = pair_now_ms();
    for (int i = 0; i < n; i++) {
        size_t len = st->mode ? 100 : (i == 3 ? 100 : 100000);
        CHECK_OK(bex_sock_send(c->socks[0], make_msg(p->ctx, (uint32_t)i, len), len, NULL));
    }
    CLI_WAIT(c, errors, 1, 8000);
    uint64_t dt = pair_now_ms() - t0;
    fprintf(stderr, "client: error %s after %llu ms\n", bex_strerror(c->err[0]),
            (unsigned long long)dt);
    CHECK_EQ(c->err[0], -ETIMEDOUT);
    CHECK(dt >= 1000);
    CLI_WAIT(c, done, n, 2000);
    /* rendezvous: nothing was delivered. Credits: the 6 sent before the
     * credits ran out (8 credits: the OPEN takes one, and one is kept for a
     * CREDIT message) reached the peer, which never acknowledged them (no
     * credit back): in doubt, -EIO; the rest never left, -ECANCELED */
    CHECK_EQ(atomic_load(&c->send_err), n);
    if (st->mode)
        CHECK_EQ(atomic_load(&c->send_eio), 6);
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int timeouts(int mode)
{
    struct stall st = {.mode = mode};
    bex_ctx_config ccfg = {.rndv_timeout_ms = 1000, .credit_timeout_ms = 1000};
    return run(NULL, stall_server, &st, &ccfg, stall_client, &st, 60);
}

static int rndv_timeout(void)
{
    return timeouts(0);
}

static int credit_timeout(void)
{
    return timeouts(1);
}

/* ---------------- a granted destination never written ---------------- */

/* Issue 23 item 5: a peer that asks for rendezvous destinations, is
 * granted them and never writes them, keeping alive, held them (and the
 * context's receive budget) for good. Now each must be written within
 * recv_rate_ms + len / recv_min_rate (defaults: 5 s + 1 s a MiB) of its
 * grant: the engine fails then, not before, and a real client is served. */
static int grant_client(struct pair *p, void *arg)
{
    (void)arg;
    struct rawpeer rp;
    struct rp_opts o = {.recv_depth = 64, .max_rndv = 16, .max_msg = 1u << 20, .eager_max = 1024};
    CHECK_OK(rp_to_server(&rp, p, &o));
    for (uint32_t i = 0; i < 2; i++) {
        struct bex__hdr h = {.type = BEX__MSG_RNDV_REQ, .stream = 1, .len = 1u << 20, .id = i};
        CHECK_OK(rp_send(&rp, &h));
    }
    uint64_t t0 = pair_now_ms();
    int granted = 0;
    while (granted < 2 && pair_now_ms() - t0 < 5000 * time_scale()) {
        rp_pump(&rp);
        granted = 0;
        for (uint32_t i = 0; i < rp.ngot; i++)
            granted += rp.got[i].type == BEX__MSG_RNDV_RESP && rp.got[i].status == 0;
    }
    CHECK_EQ(granted, 2);
    bool closed = rp_wait_closed(&rp, 20000 * time_scale());
    uint64_t dt = pair_now_ms() - t0;
    fprintf(stderr, "client: 2 grants of 1 MiB never written: %s after %llu ms\n",
            closed ? "closed" : "still open", (unsigned long long)dt);
    CHECK(closed);
    CHECK(dt >= 5000); /* not before its deadline (6 s from the grant) */
    rp_fini(&rp);
    cli_still_served(p, 4, 100000);
    return 0;
}

static int grant_stall(void)
{
    return run(NULL, echo_server, NULL, NULL, grant_client, NULL, 60);
}

BEX_TEST_MAIN(BEX_CASE(idle_setup), BEX_CASE(setup_deadline), BEX_CASE(emfile_backoff),
              BEX_CASE(hello_depth), BEX_CASE(max_msg), BEX_CASE(rndv_oversize),
              BEX_CASE(rndv_flood), BEX_CASE(streams_max), BEX_CASE(open_flood),
              BEX_CASE(recv_limit), BEX_CASE(rndv_timeout), BEX_CASE(credit_timeout),
              BEX_CASE(grant_stall))
