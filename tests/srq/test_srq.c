/* SPDX-License-Identifier: Apache-2.0 */
/* SRQ mode (issue 8 item 2): one shared receive queue per I/O thread, with
 * per-peer credits (src/transport/rdma/srq.h). RDMA on rxe0/rxe1 in the VM
 * (label rxe). One process: a server context on ADDR0, clients on ADDR1.
 *
 * - mode: with srq_depth set, each I/O thread has a shared queue, every QP
 *   of the thread draws on it (no receive queue of its own; its receives
 *   complete on the queue's CQ, so an engine reserves sq_depth + 2 CQ
 *   entries), each peer holds its share, messages both ways arrive intact,
 *   and the shares go back when the peers leave.
 * - shares: a queue of 64 receives and shares of 16 take four peers; a fifth
 *   is refused (-ENOSPC, the server being RDMA-only); once one leaves, a
 *   fifth gets its share.
 * - starve: a peer that stops being read (the application holds every
 *   message of peer A, so the received-memory limit stops the refills) does
 *   not starve peer B of shared receives: B's messages up to its share
 *   arrive while A's are held; once A's are freed, everything arrives.
 * - starve_unshared: the control for starve, with per-peer accounting off
 *   (bex__srq_unshared_test: every peer granted the whole queue): the same
 *   run leaves B's messages without a receive while A's are held, so
 *   starve can see a starved peer. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sock/echo.h"
#include "transport/rdma/srq.h"

static struct in_addr addr0, addr1;

/* ---- server: keeps or frees what arrives, echoes when asked ---- */

#define HOLD_MAX 4096

struct srv {
    struct local_srv base; /* first: what the shared callbacks take */
    _Atomic long recvd_a, recvd_b, bad;
    bool echo;           /* send every message back */
    _Atomic bool hold_a; /* keep messages of peer 'A' (do not free them) */
    void *held[HOLD_MAX];
    _Atomic long n_held;
};

/* byte 0 names the sending peer, bytes 1..4 the message's number */
static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct srv *v = user;
    uint8_t *p = buf;
    if (len < 5)
        atomic_fetch_add(&v->bad, 1);
    if (v->echo && len >= 5) {
        waiter_add(&v->base.w, &v->recvd_b, 1);
        if (bex_sock_send(s, buf, len, NULL))
            bex_mem_free(buf);
        return;
    }
    if (len >= 5 && p[0] == 'A' && atomic_load(&v->hold_a)) {
        long i = atomic_fetch_add(&v->n_held, 1);
        CHECK(i < HOLD_MAX);
        v->held[i] = buf;
        waiter_add(&v->base.w, &v->recvd_a, 1);
        return;
    }
    waiter_add(&v->base.w, len >= 5 && p[0] == 'A' ? &v->recvd_a : &v->recvd_b, 1);
    bex_mem_free(buf);
}

static bex_listener *srv_listen(bex_ctx *ctx, struct srv *v, bex_addr *out)
{
    return local_listen(ctx, addr0, &v->base, srv_recv, out);
}

/* ---- clients ---- */

struct cli {
    struct local_cli base; /* first: what the shared callbacks take */
    _Atomic long failed, recvd, sent_done;
    _Atomic int err;
};

static void cli_connect(bex_sock *s, int err, void *user)
{
    (void)s;
    struct cli *c = user;
    if (err) {
        atomic_store(&c->err, err);
        waiter_add(c->base.w, &c->failed, 1);
    } else {
        waiter_add(c->base.w, &c->base.connected, 1);
    }
}

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct cli *c = user;
    CHECK(len >= 5);
    bex_mem_free(buf);
    waiter_add(c->base.w, &c->recvd, 1);
}

static void cli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s;
    (void)len;
    (void)mu;
    (void)status;
    struct cli *c = user;
    bex_mem_free(buf);
    waiter_add(c->base.w, &c->sent_done, 1);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    (void)s;
    struct cli *c = user;
    atomic_store(&c->err, err);
    waiter_add(c->base.w, &c->failed, 1);
}

static bex_sock *cli_open(bex_ctx *ctx, const bex_addr *to, struct cli *c)
{
    bex_sock_ops ops = {.on_connect = cli_connect,
                        .on_recv = cli_recv,
                        .on_send_done = cli_done,
                        .on_error = cli_error,
                        .on_close = local_cli_closed};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(ctx, to, &ops, c, &s));
    return s;
}

static void send_tagged(bex_ctx *ctx, bex_sock *s, char who, uint32_t n, size_t len)
{
    uint8_t *b = bex_sock_alloc(ctx, len);
    CHECK(b);
    memset(b, 0x5a, len);
    b[0] = (uint8_t)who;
    memcpy(b + 1, &n, 4);
    CHECK_OK(bex_sock_send(s, b, len, NULL));
}

static int setup_addrs(void)
{
    int rc = pair_addrs(&addr0, &addr1);
    if (rc)
        return rc;
    if (pair_tcp())
        return bex_test_skip("SRQ mode is RDMA's");
    return 0;
}

/* ---- cases ---- */

#define MODE_PEERS 3

static int mode(void)
{
    PAIR_NEED(setup_addrs());
    struct srv v = {.base.w = WAITER_INIT, .echo = true};
    bex_ctx_config sc = {.srq_depth = 256, .rq_depth = 16, .io_threads = 2};
    bex_ctx *sctx = local_ctx(&sc, addr0);
    bex_ctx_config cc = {.srq_depth = 256, .rq_depth = 16};
    bex_ctx *cctx[MODE_PEERS];
    for (int i = 0; i < MODE_PEERS; i++)
        cctx[i] = local_ctx(&cc, addr1);
    for (uint32_t t = 0; t < 2; t++) {
        struct bex__srq *q = sctx->io[t].sh.srq;
        CHECK(q && q->srq && q->cq);
        CHECK_EQ(q->cap, 256);
        CHECK_EQ(q->granted, 0);
        CHECK_EQ(q->posted, 0); /* nothing posted before a peer comes */
    }
    bex_addr a;
    bex_listener *l = srv_listen(sctx, &v, &a);
    struct cli c[MODE_PEERS];
    bex_sock *s[MODE_PEERS];
    for (int i = 0; i < MODE_PEERS; i++) {
        c[i] = (struct cli){.base.w = &v.base.w};
        s[i] = cli_open(cctx[i], &a, &c[i]);
        CHECK_OK(wait_count(&v.base.w, &c[i].base.connected, 1, 10000));
    }
    CHECK_OK(wait_count(&v.base.w, &v.base.accepted, MODE_PEERS, 10000));
    /* 3 peers over the server's 2 threads; each holds a share of 16 */
    uint32_t granted = 0, peers = 0;
    for (uint32_t t = 0; t < 2; t++) {
        struct bex__io *io = &sctx->io[t];
        struct bex__srq *q = io->sh.srq;
        granted += q->granted;
        peers += q->peers;
        CHECK_EQ(q->granted, q->peers * 16);
        /* (posted and held change with every receive: not read from here,
         * the thread writes them without a lock) */
        uint32_t engines = 0;
        struct bex__list *n;
        bex__list_foreach(n, &io->conns)
        {
            struct conn *cn = bex__conn_of(n);
            if (!cn->eng)
                continue;
            engines++;
            CHECK_EQ(cn->cqe_reserved, 32 + 2); /* sq_depth + 2: no receives */
        }
        CHECK_EQ(engines, q->peers);
    }
    CHECK_EQ(peers, MODE_PEERS);
    CHECK_EQ(granted, MODE_PEERS * 16);
    /* every QP draws on its thread's queue: the queue knows it by number */
    for (uint32_t t = 0; t < 2; t++) {
        struct bex__srq *q = sctx->io[t].sh.srq;
        struct bex__list *n;
        bex__list_foreach(n, &sctx->io[t].conns)
        {
            struct conn *cn = bex__conn_of(n);
            CHECK(cn->eng);
            struct bex__engine_local loc;
            bex__engine_local(cn->eng, &loc);
            CHECK_EQ(loc.rq_depth, 16); /* the peer's credits: the share */
            bool found = false;
            for (uint32_t i = 0; i < q->map_cap; i++)
                found |= q->map[i].qpn == loc.qpn && q->map[i].e == cn->eng;
            CHECK(found);
        }
    }
    bex_sock_stats st;
    bex_ctx_stats(sctx, &st);
    CHECK_EQ(st.srq_credits, MODE_PEERS * 16);
    CHECK(st.srq_posted >= MODE_PEERS * 16);
    CHECK_EQ(st.srq_refused, 0);
    /* messages both ways, more than a share, several times over */
    for (int round = 0; round < 4; round++)
        for (int i = 0; i < MODE_PEERS; i++)
            for (uint32_t k = 0; k < 40; k++)
                send_tagged(cctx[i], s[i], 'B', k, 100 + 97 * k);
    for (int i = 0; i < MODE_PEERS; i++) {
        CHECK_OK(wait_count(&v.base.w, &c[i].recvd, 160, 20000));
        CHECK_OK(wait_count(&v.base.w, &c[i].sent_done, 160, 20000));
    }
    CHECK_EQ(atomic_load(&v.bad), 0);
    bex_ctx_stats(sctx, &st);
    CHECK_EQ(st.msgs_recv, MODE_PEERS * 160);
    CHECK_EQ(st.tcp_conns, 0);
    for (int i = 0; i < MODE_PEERS; i++)
        bex_sock_close(s[i]);
    for (int i = 0; i < MODE_PEERS; i++)
        CHECK_OK(wait_count(&v.base.w, &c[i].base.closed, 1, 10000));
    CHECK_OK(wait_count(&v.base.w, &v.base.closed, MODE_PEERS, 10000));
    for (int i = 0; i < MODE_PEERS; i++)
        CHECK_OK(bex_ctx_destroy(cctx[i]));
    /* the connections went with the peers' contexts: the shares are back */
    bool back = false;
    for (int tries = 0; tries < 500 && !back; tries++) {
        bex_ctx_stats(sctx, &st);
        back = st.srq_credits == 0 && st.engines == 0;
        if (!back)
            pair_sleep_ms(10 * time_scale());
    }
    CHECK(back);
    /* the receives stay posted for the next peers */
    CHECK(st.srq_posted >= MODE_PEERS * 16);
    CHECK_OK(bex_listener_close(l));
    CHECK_OK(bex_ctx_destroy(sctx));
    return 0;
}

/* A queue of 64 receives, shares of 16: four peers, a fifth refused. */
static int shares(void)
{
    PAIR_NEED(setup_addrs());
    struct srv v = {.base.w = WAITER_INIT, .echo = true};
    bex_ctx_config sc = {.srq_depth = 64, .rq_depth = 16, .transport = BEX_TRANSPORT_RDMA};
    bex_ctx *sctx = local_ctx(&sc, addr0);
    bex_addr a;
    bex_listener *l = srv_listen(sctx, &v, &a);
    bex_ctx_config cc = {.rq_depth = 16, .transport = BEX_TRANSPORT_RDMA};
    enum { N = 6 };
    bex_ctx *cctx[N];
    struct cli c[N];
    bex_sock *s[N];
    for (int i = 0; i < 5; i++) {
        cctx[i] = local_ctx(&cc, addr1);
        c[i] = (struct cli){.base.w = &v.base.w};
        s[i] = cli_open(cctx[i], &a, &c[i]);
        if (i < 4) {
            CHECK_OK(wait_count(&v.base.w, &c[i].base.connected, 1, 10000));
            send_tagged(cctx[i], s[i], 'B', (uint32_t)i, 64);
            CHECK_OK(wait_count(&v.base.w, &c[i].recvd, 1, 10000));
        }
    }
    /* the fifth: no share left, refused by name */
    CHECK_OK(wait_count(&v.base.w, &c[4].failed, 1, 10000));
    CHECK_EQ(atomic_load(&c[4].base.connected), 0);
    CHECK_EQ(atomic_load(&c[4].err), -ENOSPC);
    bex_sock_stats st;
    bex_ctx_stats(sctx, &st);
    CHECK_EQ(st.srq_credits, 64);
    CHECK_EQ(st.srq_refused, 1);
    CHECK_EQ(st.engines, 4);
    bex_sock_close(s[4]);
    CHECK_OK(wait_count(&v.base.w, &c[4].base.closed, 1, 10000));
    CHECK_OK(bex_ctx_destroy(cctx[4]));
    /* one leaves: its share goes back, and a newcomer gets it */
    bex_sock_close(s[0]);
    CHECK_OK(wait_count(&v.base.w, &c[0].base.closed, 1, 10000));
    CHECK_OK(bex_ctx_destroy(cctx[0]));
    bool back = false;
    for (int tries = 0; tries < 500 && !back; tries++) {
        bex_ctx_stats(sctx, &st);
        back = st.srq_credits == 48;
        if (!back)
            pair_sleep_ms(10 * time_scale());
    }
    CHECK(back);
    cctx[5] = local_ctx(&cc, addr1);
    c[5] = (struct cli){.base.w = &v.base.w};
    s[5] = cli_open(cctx[5], &a, &c[5]);
    CHECK_OK(wait_count(&v.base.w, &c[5].base.connected, 1, 10000));
    for (uint32_t k = 0; k < 64; k++)
        send_tagged(cctx[5], s[5], 'B', k, 200);
    CHECK_OK(wait_count(&v.base.w, &c[5].recvd, 64, 10000));
    bex_ctx_stats(sctx, &st);
    CHECK_EQ(st.srq_credits, 64);
    CHECK_EQ(st.srq_refused, 1);
    for (int i = 1; i < N; i++) {
        if (i == 4)
            continue;
        bex_sock_close(s[i]);
        CHECK_OK(wait_count(&v.base.w, &c[i].base.closed, 1, 10000));
        CHECK_OK(bex_ctx_destroy(cctx[i]));
    }
    CHECK_OK(bex_listener_close(l));
    CHECK_OK(bex_ctx_destroy(sctx));
    return 0;
}

/* ---- starvation: peer A's messages held, peer B goes on ---- */

#define A_MSGS     64
#define B_MSGS     12
#define STARVE_LEN 512

/* Returns how many of B's messages arrived while A's were held. */
static long starve_run(bool unshared)
{
    struct srv v = {.base.w = WAITER_INIT};
    atomic_store(&v.hold_a, true);
    bex__srq_unshared_test = unshared;
    /* the server: a queue of 32 receives, shares of 16 (two peers); the
     * received-memory limit is 8 buffers, so holding A's messages stops
     * every refill */
    bex_ctx_config sc = {.srq_depth = 32,
                         .rq_depth = 16,
                         .eager_max = 1024,
                         .recv_bytes_max = 8 * 1024,
                         .transport = BEX_TRANSPORT_RDMA};
    bex_ctx *sctx = local_ctx(&sc, addr0);
    bex_addr a;
    bex_listener *l = srv_listen(sctx, &v, &a);
    /* A's sends wait for credit for as long as the case runs */
    bex_ctx_config cc = {.credit_timeout_ms = 600000, .transport = BEX_TRANSPORT_RDMA};
    bex_ctx *actx = local_ctx(&cc, addr1), *bctx = local_ctx(&cc, addr1);
    struct cli ca = {.base.w = &v.base.w}, cb = {.base.w = &v.base.w};
    bex_sock *sa = cli_open(actx, &a, &ca), *sb = cli_open(bctx, &a, &cb);
    CHECK_OK(wait_count(&v.base.w, &ca.base.connected, 1, 10000));
    CHECK_OK(wait_count(&v.base.w, &cb.base.connected, 1, 10000));
    /* A floods; the application keeps all of it */
    for (uint32_t k = 0; k < A_MSGS; k++)
        send_tagged(actx, sa, 'A', k, STARVE_LEN);
    /* until A is stuck: nothing more of it for half a second */
    long last = -1;
    for (int i = 0; i < 200; i++) {
        pair_sleep_ms(250 * time_scale());
        long now = atomic_load(&v.recvd_a);
        if (now == last)
            break;
        last = now;
    }
    fprintf(stderr, "%s: %ld of A's %d messages arrived and are held\n",
            unshared ? "unshared" : "shared", last, A_MSGS);
    CHECK(last >= 8 && last < A_MSGS);
    /* B sends fewer than its share */
    for (uint32_t k = 0; k < B_MSGS; k++)
        send_tagged(bctx, sb, 'B', k, STARVE_LEN);
    (void)wait_count(&v.base.w, &v.recvd_b, B_MSGS, unshared ? 3000 : 10000);
    long got_b = atomic_load(&v.recvd_b);
    fprintf(stderr, "%s: %ld of B's %d messages arrived while A's were held\n",
            unshared ? "unshared" : "shared", got_b, B_MSGS);
    CHECK_EQ(atomic_load(&v.recvd_a), last); /* A stayed stuck meanwhile */
    /* the application reads A again: every message arrives */
    atomic_store(&v.hold_a, false);
    long n = atomic_load(&v.n_held);
    for (long i = 0; i < n; i++)
        bex_mem_free(v.held[i]);
    CHECK_OK(wait_count(&v.base.w, &v.recvd_a, A_MSGS, 20000));
    CHECK_OK(wait_count(ca.base.w, &ca.sent_done, A_MSGS, 20000));
    if (!unshared) {
        CHECK_OK(wait_count(&v.base.w, &v.recvd_b, B_MSGS, 20000));
        CHECK_OK(wait_count(&v.base.w, &cb.sent_done, B_MSGS, 20000));
    }
    CHECK_EQ(atomic_load(&v.bad), 0);
    bex_sock_close(sa);
    bex_sock_close(sb);
    CHECK_OK(wait_count(&v.base.w, &ca.base.closed, 1, 10000));
    CHECK_OK(wait_count(&v.base.w, &cb.base.closed, 1, 10000));
    CHECK_OK(bex_ctx_destroy(actx));
    CHECK_OK(bex_ctx_destroy(bctx));
    CHECK_OK(bex_listener_close(l));
    CHECK_OK(bex_ctx_destroy(sctx));
    bex__srq_unshared_test = 0;
    return got_b;
}

static int starve(void)
{
    PAIR_NEED(setup_addrs());
    CHECK_EQ(starve_run(false), B_MSGS);
    return 0;
}

static int starve_unshared(void)
{
    PAIR_NEED(setup_addrs());
    /* without shares A took the receives B's messages needed */
    CHECK(starve_run(true) < B_MSGS);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(mode), BEX_CASE(shares), BEX_CASE(starve), BEX_CASE(starve_unshared))
