/* SPDX-License-Identifier: Apache-2.0 */
/* The transport choice (issue 8): a peer without an RDMA device, or one
 * that wants TCP, reaches an RDMA listener on the same port and exchanges
 * messages over TCP; RDMA-only sides refuse such peers.
 *
 * The server is the usual pair server on BEX_TEST_ADDR0 (rxe0). A "no
 * device" client is a context on 127.0.0.1 in AUTO mode: no RDMA device has
 * that address, so the context works over TCP alone, and connects to the
 * listener's address across the VM's loopback. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/fault.h"
#include "pair.h"

#define N_MSG 64

struct fsrv {
    int expect_tcp; /* tcp_conns the server must see while the client talks */
    int failed;
    bool fail_qp; /* fault builds: the server's QP does not come up */
};

static void fecho_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)user;
    if (bex_sock_send(s, buf, len, NULL))
        bex_mem_free(buf);
}

static const bex_sock_ops fecho_ops = {.on_recv = fecho_recv};

static void fecho_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    bex_sock_set_user(s, &fecho_ops, user);
}

static int fsrv_main(struct pair *p, void *arg)
{
    struct fsrv *f = arg;
#ifdef BEX_FAULT_INJECT
    if (f->fail_qp)
        bex__fault_arm(BEX__FAULT_QP_UP, 1, -EIO, 0, NULL, NULL);
#endif
    bex_listener_ops lops = {.on_accept = fecho_accept};
    pair_listen(p, &lops, f);
    /* while the client talks, its connections must be of the kinds it
     * expects; none over TCP at all when it expects none */
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    bex_sock_stats st = {0};
    while (f->expect_tcp && pair_now_ms() < end) {
        bex_ctx_stats(p->ctx, &st);
        if (st.tcp_conns == (uint64_t)f->expect_tcp)
            break;
        pair_sleep_ms(5);
    }
    pair_wait_done(p);
    if (!f->expect_tcp)
        bex_ctx_stats(p->ctx, &st);
    if (st.tcp_conns != (uint64_t)f->expect_tcp) {
        fprintf(stderr, "server: %llu connections over TCP, want %d\n",
                (unsigned long long)st.tcp_conns, f->expect_tcp);
        f->failed = 1;
    }
    if (pair_server_close(p))
        f->failed = 1;
    return f->failed;
}

/* ---------------- a client that checks echoes ---------------- */

struct fcli {
    struct waiter w;
    _Atomic long connected, recvd, done, errors, bad;
    int conn_status;
};

static void fcli_connect(bex_sock *s, int status, void *user)
{
    (void)s;
    struct fcli *c = user;
    c->conn_status = status;
    atomic_fetch_add(&c->connected, 1);
    waiter_signal(&c->w);
}

static void fcli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct fcli *c = user;
    uint32_t seed;
    memcpy(&seed, buf, 4);
    if (check_pattern((uint8_t *)buf + 4, len - 4, seed))
        atomic_fetch_add(&c->bad, 1);
    bex_mem_free(buf);
    atomic_fetch_add(&c->recvd, 1);
    waiter_signal(&c->w);
}

static void fcli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu;
    struct fcli *c = user;
    if (status)
        atomic_fetch_add(&c->errors, 1);
    bex_mem_free(buf);
    atomic_fetch_add(&c->done, 1);
    waiter_signal(&c->w);
}

static void fcli_error(bex_sock *s, int err, void *user)
{
    (void)s, (void)err;
    struct fcli *c = user;
    atomic_fetch_add(&c->errors, 1);
    waiter_signal(&c->w);
}

static const bex_sock_ops fcli_ops = {
    .on_connect = fcli_connect,
    .on_recv = fcli_recv,
    .on_send_done = fcli_done,
    .on_error = fcli_error,
};

/* N_MSG echoes of sizes from 4 B to 1 MiB over socket s of ctx. */
static int echo_round(bex_ctx *ctx, bex_sock *s, struct fcli *c)
{
    long r0 = atomic_load(&c->recvd), d0 = atomic_load(&c->done);
    for (uint32_t i = 0; i < N_MSG; i++) {
        size_t len = i % 8 == 7 ? (1u << 20) : 4 + ((size_t)i * 997) % 20000;
        uint8_t *b = bex_sock_alloc(ctx, len);
        CHECK(b != NULL);
        uint32_t seed = i + 1;
        memcpy(b, &seed, 4);
        fill_pattern(b + 4, len - 4, seed);
        CHECK_OK(bex_sock_send(s, b, len, NULL));
    }
    CHECK_OK(wait_count(&c->w, &c->recvd, r0 + N_MSG, 30000));
    CHECK_OK(wait_count(&c->w, &c->done, d0 + N_MSG, 10000));
    CHECK_EQ(atomic_load(&c->bad), 0);
    CHECK_EQ(atomic_load(&c->errors), 0);
    return 0;
}

static int close_wait(bex_sock *s)
{
    bex_sock_close(s);
    return 0;
}

/* A context on 127.0.0.1 (no RDMA device has it): TCP alone. */
static bex_ctx *nodev_ctx(uint32_t transport)
{
    bex_ctx_config cfg = {.transport = transport};
    bex_addr_parse("127.0.0.1", 0, &cfg.local_addr);
    cfg.keepalive_timeout_ms = 2000 * time_scale();
    cfg.connect_timeout_ms = 3000 * time_scale();
    bex_ctx *ctx = NULL;
    int err = bex_ctx_create(&cfg, &ctx);
    if (err) {
        fprintf(stderr, "bex_ctx_create on 127.0.0.1: %s\n", bex_strerror(err));
        exit(1);
    }
    return ctx;
}

static int nodev_client(struct pair *p, void *arg)
{
    (void)arg;
    /* RDMA only cannot work without a device */
    {
        bex_ctx_config cfg = {.transport = BEX_TRANSPORT_RDMA};
        bex_addr_parse("127.0.0.1", 0, &cfg.local_addr);
        bex_ctx *bad = NULL;
        CHECK_EQ(bex_ctx_create(&cfg, &bad), -ENODEV);
    }
    bex_ctx *ctx = nodev_ctx(BEX_TRANSPORT_AUTO);
    CHECK(bex_ctx_pd(ctx) == NULL);
    static struct fcli c = {.w = WAITER_INIT};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(ctx, &p->srv, &fcli_ops, &c, &s));
    CHECK_OK(wait_count(&c.w, &c.connected, 1, 10000));
    CHECK_EQ(c.conn_status, 0);
    bex_sock_stats st;
    bex_ctx_stats(ctx, &st);
    CHECK_EQ(st.engines, 1);
    CHECK_EQ(st.tcp_conns, 1);
    CHECK_OK(echo_round(ctx, s, &c));
    close_wait(s);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

/* A peer without a device reaches an RDMA listener (AUTO) on its port. */
static int no_device(void)
{
    static struct fsrv f = {.expect_tcp = 1};
    return pair_run(NULL, fsrv_main, &f, NULL, nodev_client, NULL, 60);
}

/* A client with a device that asks for TCP on one connection and RDMA (the
 * context's AUTO) on another to the same listener: two connections, one of
 * each kind, both carrying echoes. */
static int per_conn_client(struct pair *p, void *arg)
{
    (void)arg;
    static struct fcli ct = {.w = WAITER_INIT}, cr = {.w = WAITER_INIT};
    bex_connect_opts o = {.flags = BEX_CONNECT_TRANSPORT, .transport = BEX_TRANSPORT_TCP};
    bex_connect_opts bad = {.flags = 1u << 7};
    bex_sock *st_, *sr;
    CHECK_EQ(bex_sock_connect_opts(p->ctx, &p->srv, &fcli_ops, &ct, &bad, &st_), -EINVAL);
    CHECK_OK(bex_sock_connect_opts(p->ctx, &p->srv, &fcli_ops, &ct, &o, &st_));
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &fcli_ops, &cr, &sr));
    CHECK_OK(wait_count(&ct.w, &ct.connected, 1, 10000));
    CHECK_OK(wait_count(&cr.w, &cr.connected, 1, 10000));
    CHECK_EQ(ct.conn_status, 0);
    CHECK_EQ(cr.conn_status, 0);
    bex_sock_stats st;
    bex_ctx_stats(p->ctx, &st);
    CHECK_EQ(st.engines, 2);
    CHECK_EQ(st.tcp_conns, 1);
    CHECK_OK(echo_round(p->ctx, st_, &ct));
    CHECK_OK(echo_round(p->ctx, sr, &cr));
    close_wait(st_);
    close_wait(sr);
    return 0;
}

static int per_connection(void)
{
    static struct fsrv f = {.expect_tcp = 1};
    return pair_run(NULL, fsrv_main, &f, NULL, per_conn_client, NULL, 60);
}

/* An RDMA-only listener refuses a peer without a device: the peer's
 * on_connect reports -EPROTONOSUPPORT (the listener's notice). */
static int refuse_client(struct pair *p, void *arg)
{
    (void)arg;
    bex_ctx *ctx = nodev_ctx(BEX_TRANSPORT_AUTO);
    static struct fcli c = {.w = WAITER_INIT};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(ctx, &p->srv, &fcli_ops, &c, &s));
    CHECK_OK(wait_count(&c.w, &c.connected, 1, 10000));
    CHECK_EQ(c.conn_status, -EPROTONOSUPPORT);
    bex_sock_close(s);
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

static int rdma_only(void)
{
    static struct fsrv f = {.expect_tcp = 0};
    bex_ctx_config scfg = {.transport = BEX_TRANSPORT_RDMA};
    return pair_run(&scfg, fsrv_main, &f, NULL, refuse_client, NULL, 60);
}

#ifdef BEX_FAULT_INJECT
/* Built again with the library's fault points (tests/fault/CMakeLists.txt):
 * both hellos offer RDMA, then one QP does not come up. */

/* An AUTO client whose QP fails (its hello went first: a FALLBACK notice)
 * or whose server's QP fails (the server answers with a NO_RDMA hello):
 * either way both go on over TCP on the same connection. */
static int qp_client(struct pair *p, void *arg)
{
    bool mine = *(bool *)arg;
    if (mine)
        bex__fault_arm(BEX__FAULT_QP_UP, 1, -EIO, 0, NULL, NULL);
    static struct fcli c;
    c = (struct fcli){.w = WAITER_INIT};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &fcli_ops, &c, &s));
    CHECK_OK(wait_count(&c.w, &c.connected, 1, 10000));
    CHECK_EQ(c.conn_status, 0);
    if (mine)
        CHECK(bex__fault_fired(BEX__FAULT_QP_UP));
    bex_sock_stats st;
    bex_ctx_stats(p->ctx, &st);
    CHECK_EQ(st.engines, 1);
    CHECK_EQ(st.tcp_conns, 1);
    CHECK_OK(echo_round(p->ctx, s, &c));
    close_wait(s);
    return 0;
}

static int qp_fails_client(void)
{
    static struct fsrv f = {.expect_tcp = 1};
    static bool mine = true;
    return pair_run(NULL, fsrv_main, &f, NULL, qp_client, &mine, 60);
}

static int qp_fails_server(void)
{
    static struct fsrv f = {.expect_tcp = 1, .fail_qp = true};
    static bool mine = false;
    return pair_run(NULL, fsrv_main, &f, NULL, qp_client, &mine, 60);
}

BEX_TEST_MAIN(BEX_CASE(no_device), BEX_CASE(per_connection), BEX_CASE(rdma_only),
              BEX_CASE(qp_fails_client), BEX_CASE(qp_fails_server))
#else
BEX_TEST_MAIN(BEX_CASE(no_device), BEX_CASE(per_connection), BEX_CASE(rdma_only))
#endif
