/* SPDX-License-Identifier: Apache-2.0 */
/* Receives a dying QP took (issue 23 item 6). SRQ mode, RDMA on rxe in the
 * VM (label rxe); one process: a server context on ADDR0 (one I/O thread,
 * a queue of 32 receives, shares of 16), raw peers (tests/adversary/peer.c)
 * on ADDR1.
 *
 * dying_peers: an honest peer holds its share while 40 peers, one after
 * the other, connect, start a SEND of 1 MiB (1024 packets at rxe's MTU:
 * more than the 128 the sender may have unacknowledged, so the tail never
 * leaves) and die (QP destroyed, TCP closed). Each took a shared receive
 * for the SEND it never finished. Then the count of posted receives is
 * exact (the honest peer's share and the spare, every one really posted),
 * and the honest peer pushes its whole share of SENDs at once with no
 * receiver-not-ready. Before the fix the dying QPs were destroyed at once
 * and their receives lost for good (those of the SENDs that did not arrive
 * whole), and the burst met RNR.
 *
 * last_wqe_event: with srq_drain_ms of ten minutes, a peer dies mid-SEND:
 * its QP drains (srq_draining 1, its receive flushed back at once: rxe
 * raises no event), and is still draining a second later; an
 * IBV_EVENT_QP_LAST_WQE_REACHED for it, handed over from this thread as
 * another I/O thread would (bex__srq_async), ends its wait: it is
 * destroyed within seconds. A QP still draining when the context goes is
 * destroyed with it. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "sock/echo.h"
#include "transport/rdma/srq.h"
#include "../adversary/peer.h"

#define DEPTH 32
#define SHARE 16
#define DYING 40
#define BIG   (1u << 20)

struct srv {
    struct local_srv base;
    _Atomic long recvd;
};

static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    (void)len;
    struct srv *v = user;
    bex_mem_free(buf);
    waiter_add(&v->base.w, &v->recvd, 1);
}

/* A peer that takes a shared receive for a SEND it never finishes. */
static void die_mid_send(struct in_addr local, const bex_addr *srv)
{
    struct adv_peer p;
    struct adv_peer_opts o = {0};
    CHECK_OK(adv_peer_open(&p, local, srv, &o));
    struct ibv_sge sge = {(uintptr_t)p.src, BIG, p.mr->lkey};
    struct ibv_send_wr wr = {.wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND},
                       *bad;
    CHECK_EQ(ibv_post_send(p.qp, &wr, &bad), 0);
    CHECK_OK(bex__rdma_qp_destroy(p.qp)); /* the rest of the SEND never leaves */
    p.qp = NULL;
    pair_sleep_ms(20); /* the first packets reach the server */
    adv_peer_destroy(&p);
}

static bex_sock_stats stats_of(bex_ctx *ctx)
{
    bex_sock_stats st;
    bex_ctx_stats(ctx, &st);
    return st;
}

static uint64_t srq_stat(bex_ctx *ctx, bool posted)
{
    bex_sock_stats st = stats_of(ctx);
    return posted ? st.srq_posted : st.engines;
}

/* Poll the honest peer until ctx's srq_draining is n: whether it came. */
static bool draining_is(bex_ctx *ctx, struct adv_peer *h, uint64_t n, unsigned ms)
{
    uint64_t end = bex_test_now_ms() + (uint64_t)ms * bex_test_time_scale();
    while (stats_of(ctx).srq_draining != n && bex_test_now_ms() < end)
        adv_peer_poll(h, 10);
    return stats_of(ctx).srq_draining == n;
}

static int last_wqe_event(void)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    if (pair_tcp())
        return bex_test_skip("SRQ mode is RDMA's");
    struct srv v = {.base.w = WAITER_INIT};
    bex_ctx_config sc = {.srq_depth = DEPTH,
                         .rq_depth = SHARE,
                         .eager_max = 1u << 20,
                         .io_threads = 1,
                         .srq_drain_ms = 600000};
    bex_ctx *sctx = local_ctx(&sc, a0);
    bex_addr at;
    bex_listener *l = local_listen(sctx, a0, &v.base, srv_recv, &at);
    struct adv_peer h;
    struct adv_peer_opts o = {0};
    CHECK_OK(adv_peer_open(&h, a1, &at, &o));
    die_mid_send(a1, &at);
    CHECK(draining_is(sctx, &h, 1, 10000));
    uint64_t want = SHARE + BEX__SRQ_SPARE < DEPTH ? SHARE + BEX__SRQ_SPARE : DEPTH;
    uint64_t end = bex_test_now_ms() + 10000ull * bex_test_time_scale();
    while (srq_stat(sctx, true) != want && bex_test_now_ms() < end)
        adv_peer_poll(&h, 10);
    CHECK_EQ(srq_stat(sctx, true), want); /* flushed back while the QP drains */
    adv_peer_poll(&h, 1000);
    CHECK_EQ(stats_of(sctx).srq_draining, 1); /* no event from rxe: it waits */
    /* the event, from another thread than the queue's */
    struct bex__srq *q = sctx->io[0].sh.srq;
    struct ibv_async_event ev = {.element.qp = __atomic_load_n(&q->dying[0].qp, __ATOMIC_ACQUIRE),
                                 .event_type = IBV_EVENT_QP_LAST_WQE_REACHED};
    bex__srq_async(&ev);
    CHECK(draining_is(sctx, &h, 0, 5000));
    CHECK_EQ(srq_stat(sctx, true), want);
    /* one more, left draining when the context goes */
    die_mid_send(a1, &at);
    CHECK(draining_is(sctx, &h, 1, 10000));
    adv_peer_destroy(&h);
    CHECK_OK(bex_listener_close(l));
    CHECK_OK(bex_ctx_destroy(sctx));
    return 0;
}

static int dying_peers(void)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    if (pair_tcp())
        return bex_test_skip("SRQ mode is RDMA's");
    struct srv v = {.base.w = WAITER_INIT};
    bex_ctx_config sc = {
        .srq_depth = DEPTH, .rq_depth = SHARE, .eager_max = 1u << 20, .io_threads = 1};
    bex_ctx *sctx = local_ctx(&sc, a0);
    bex_addr at;
    bex_listener *l = local_listen(sctx, a0, &v.base, srv_recv, &at);
    struct adv_peer h;
    struct adv_peer_opts o = {0};
    CHECK_OK(adv_peer_open(&h, a1, &at, &o));
    CHECK_EQ(h.credits, SHARE);
    for (int i = 0; i < DYING; i++) {
        die_mid_send(a1, &at);
        adv_peer_poll(&h, 0); /* keepalive */
        /* the server sees the death (TCP closed) before the next comes */
        uint64_t end = bex_test_now_ms() + 10000ull * bex_test_time_scale();
        while (srq_stat(sctx, false) > 1 && bex_test_now_ms() < end)
            adv_peer_poll(&h, 5);
        CHECK_EQ(srq_stat(sctx, false), 1);
    }
    /* the honest peer's share and the spare (within the queue): every
     * receive a dying QP took is back, none counted that is not posted */
    uint64_t want = SHARE + BEX__SRQ_SPARE < DEPTH ? SHARE + BEX__SRQ_SPARE : DEPTH;
    uint64_t end = bex_test_now_ms() + 10000ull * bex_test_time_scale();
    while (srq_stat(sctx, true) != want && bex_test_now_ms() < end)
        adv_peer_poll(&h, 10);
    /* (the queue's own fields are the I/O thread's: only the counters
     * are read from here, TSan) */
    printf("after %d deaths: posted %llu (want %llu)\n", DYING,
           (unsigned long long)srq_stat(sctx, true), (unsigned long long)want);
    CHECK_EQ(srq_stat(sctx, true), want);
    /* the whole share at once: an OPEN and SHARE - 1 DATA; a receive that
     * is counted but not posted would show as an RNR NAK (rxe's counter) */
    long long rnr0 = rxe_counter("send_rnr_err");
    struct bex__hdr oh = {.type = BEX__MSG_OPEN, .stream = 1};
    int rc = adv_peer_send(&h, &oh, 0, 2000);
    uint32_t sent = 0;
    while (!rc && sent + 1 < SHARE) {
        struct bex__hdr dh = {.type = BEX__MSG_DATA, .stream = 1, .len = 64};
        memset(h.spay, 'H', 64);
        if (!(rc = adv_peer_send(&h, &dh, 64, 2000)))
            sent++;
    }
    end = bex_test_now_ms() + 10000ull * bex_test_time_scale();
    while (atomic_load(&v.recvd) < SHARE - 1 && !h.qp_err && bex_test_now_ms() < end)
        adv_peer_poll(&h, 10);
    printf("honest burst: %u of %d posted (%s), %ld delivered, peer QP error: %s\n", sent,
           SHARE - 1, strerror(-rc), atomic_load(&v.recvd),
           h.qp_err ? ibv_wc_status_str((enum ibv_wc_status)h.qp_err) : "none");
    long long rnr = rxe_counter("send_rnr_err") - rnr0;
    printf("RNR NAKs during the burst: %lld\n", rnr);
    CHECK_EQ(rnr, 0);
    CHECK_EQ(h.qp_err, 0); /* (the peer's rnr_retry is 3) */
    CHECK_OK(rc);
    CHECK_EQ(atomic_load(&v.recvd), SHARE - 1);
    adv_peer_destroy(&h);
    CHECK_OK(bex_listener_close(l));
    CHECK_OK(bex_ctx_destroy(sctx));
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(dying_peers), BEX_CASE(last_wqe_event))
