/* SPDX-License-Identifier: Apache-2.0 */
/* A hand-made bex peer for tests: one RC queue pair that does the hello by
 * hand and then sends exactly the headers a test asks for. It plays a peer
 * that breaks the rules a bex engine relies on (never answers a rendezvous
 * request, never returns a credit, ignores the limits of the hello), which a
 * bex context never does by itself.
 *
 * It keeps the keepalive going (rp_pump), so the bex side sees a live peer:
 * only the rule being broken can end the connection. It never reposts a
 * receive, so it never grants a credit beyond its hello's recv_depth. */
#ifndef BEX_TEST_RAWPEER_H
#define BEX_TEST_RAWPEER_H

#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include "transport/rdma/engine.h"
#include "harness.h"
#include "rdma/rdma.h"
#include "conn/hello_io.h"

#define RP_SLOTS 1024 /* receives it can post */
#define RP_EAGER 1024 /* payload bytes a receive takes */
#define RP_SLOT  (BEX__HDR_LEN + RP_EAGER)
#define RP_SENDS 128  /* send header buffers, reused in turn */
#define RP_RECVQ 1024 /* received headers kept for the test */

struct rp_opts {
    uint16_t recv_depth; /* credits granted (receives posted, up to RP_SLOTS) */
    uint16_t max_rndv;
    uint32_t max_msg;
    uint32_t eager_max; /* <= RP_EAGER */
    bool no_recvs;      /* grant recv_depth credits in the hello but post no
                           receive: a peer lying about its credits (RNR) */
};

struct rawpeer {
    struct bex__rdma_dev *dev;
    struct bex__rdma_path path;
    struct in_addr addr; /* ours: the TCP side is bound to it, as the GID says */
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *mr;
    uint8_t *mem; /* receive slots | send headers | keepalive source | keepalive word */
    size_t mem_len;
    int fd;
    uint32_t psn;
    struct bex__hello peer;
    uint32_t credits; /* the peer's receives we may still use */
    uint32_t sent;    /* send headers used so far */
    uint32_t unacked; /* sends not yet completed */
    uint64_t ka_seq, ka_next;
    int failed; /* first completion error (a negative errno), or 0 */
    struct bex__hdr got[RP_RECVQ];
    uint32_t ngot;
};

static inline uint8_t *rp_send_buf(struct rawpeer *rp, uint32_t i)
{
    return rp->mem + (size_t)RP_SLOTS * RP_SLOT + (size_t)(i % RP_SENDS) * BEX__HDR_LEN;
}

static inline uint64_t *rp_ka_src(struct rawpeer *rp)
{
    return (uint64_t *)(rp->mem + (size_t)RP_SLOTS * RP_SLOT + (size_t)RP_SENDS * BEX__HDR_LEN);
}

static inline uint64_t *rp_ka_word(struct rawpeer *rp)
{
    return rp_ka_src(rp) + 8;
}

static inline uint64_t rp_now_ms(void)
{
    return bex_test_now_ms();
}

static inline void rp_init(struct rawpeer *rp, struct in_addr a, const struct rp_opts *o)
{
    memset(rp, 0, sizeof(*rp));
    rp->fd = -1;
    rp->addr = a;
    CHECK_OK(bex__rdma_dev_open_ipv4(a, &rp->dev, &rp->path));
    CHECK_OK(bex__rdma_cq_create(rp->dev, 4096, NULL, &rp->cq));
    struct bex__rdma_qp_config qc = {.send_cq = rp->cq,
                                     .recv_cq = rp->cq,
                                     .sq_depth = 256,
                                     .rq_depth = RP_SLOTS,
                                     .max_send_sge = 1,
                                     .max_recv_sge = 1};
    CHECK_OK(bex__rdma_qp_create(rp->dev, &qc, &rp->qp, NULL));
    CHECK_OK(bex__rdma_qp_to_init(rp->qp, &rp->path, NULL));
    rp->mem_len = ((size_t)RP_SLOTS * RP_SLOT + RP_SENDS * BEX__HDR_LEN + 128 + 4095) & ~4095ul;
    rp->mem = aligned_alloc(4096, rp->mem_len);
    CHECK(rp->mem);
    memset(rp->mem, 0, rp->mem_len);
    rp->mr = ibv_reg_mr(rp->dev->pd, rp->mem, rp->mem_len,
                        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    CHECK(rp->mr);
    uint32_t n = o->no_recvs ? 0 : o->recv_depth < RP_SLOTS ? o->recv_depth : RP_SLOTS;
    for (uint32_t i = 0; i < n; i++) {
        struct ibv_sge sge = {(uintptr_t)(rp->mem + (size_t)i * RP_SLOT), RP_SLOT, rp->mr->lkey};
        struct ibv_recv_wr wr = {.wr_id = (1ull << 32) | i, .sg_list = &sge, .num_sge = 1}, *bad;
        CHECK_OK(bex__rdma_err(ibv_post_recv(rp->qp, &wr, &bad)));
    }
    rp->psn = bex__rdma_random_psn();
}

static inline void rp_hello(struct rawpeer *rp, const struct rp_opts *o, uint64_t conn_id,
                            struct bex__hello *h)
{
    memset(h, 0, sizeof(*h));
    h->qpn = rp->qp->qp_num;
    h->psn = rp->psn;
    memcpy(h->gid, rp->path.gid.raw, 16);
    h->mtu = (uint8_t)rp->path.active_mtu;
    h->rd_atomic = bex__rdma_dest_rd_atomic(rp->dev, NULL);
    h->recv_depth = o->recv_depth;
    h->sq_depth = 256;
    h->max_msg = o->max_msg;
    h->frag_size = 65536;
    h->conn_id = conn_id;
    h->eager_max = o->eager_max;
    h->ka_addr = (uintptr_t)rp_ka_word(rp);
    h->ka_rkey = rp->mr->rkey;
    h->max_rndv = o->max_rndv;
}

static inline void rp_up(struct rawpeer *rp)
{
    struct bex__rdma_peer p = {.qpn = rp->peer.qpn,
                               .psn = rp->peer.psn,
                               .active_mtu = (enum ibv_mtu)rp->peer.mtu,
                               .rd_atomic = rp->peer.rd_atomic};
    memcpy(p.gid.raw, rp->peer.gid, 16);
    CHECK_OK(bex__rdma_qp_to_rtr(rp->qp, rp->dev, &rp->path, &p, NULL));
    CHECK_OK(bex__rdma_qp_to_rts(rp->qp, rp->dev, rp->psn, &p, NULL));
    rp->credits = rp->peer.recv_depth;
}

/* Connect to a bex listener as a client. Returns 0, or the error of the
 * exchange (a listener that refuses the hello closes the connection). */
static inline int rp_connect(struct rawpeer *rp, const bex_addr *to, const struct rp_opts *o)
{
    rp->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(rp->fd >= 0);
    bex_addr me = {.in4 = {.sin_family = AF_INET, .sin_addr = rp->addr}};
    CHECK(bind(rp->fd, (struct sockaddr *)&me, sizeof(me)) == 0);
    CHECK(connect(rp->fd, (const struct sockaddr *)to, sizeof(*to)) == 0);
    int64_t dl = bex__hello_now_ms() + 10000;
    struct bex__hello mine;
    rp_hello(rp, o, bex__rdma_random_u64(), &mine);
    CHECK_OK(bex__hello_send(rp->fd, &mine, dl));
    int rc = bex__hello_recv(rp->fd, &rp->peer, dl);
    if (rc)
        return rc;
    rp_up(rp);
    CHECK_OK(bex__hello_ready_send(rp->fd, 0, dl));
    uint32_t st;
    rc = bex__hello_ready_recv(rp->fd, &st, dl);
    return rc ? rc : st ? -EPROTO : 0;
}

/* Accept one bex client on listening socket lfd and bring the QP up. */
static inline void rp_accept(struct rawpeer *rp, int lfd, const struct rp_opts *o)
{
    rp->fd = accept(lfd, NULL, NULL);
    CHECK(rp->fd >= 0);
    int64_t dl = bex__hello_now_ms() + 10000;
    CHECK_OK(bex__hello_recv(rp->fd, &rp->peer, dl));
    struct bex__hello mine;
    rp_hello(rp, o, rp->peer.conn_id, &mine);
    rp_up(rp);
    CHECK_OK(bex__hello_send(rp->fd, &mine, dl));
    CHECK_OK(bex__hello_ready_send(rp->fd, 0, dl));
    uint32_t st;
    CHECK_OK(bex__hello_ready_recv(rp->fd, &st, dl));
    CHECK_EQ(st, 0);
}

/* Reap completions: received headers go to got[], send completions free
 * their buffers. Returns how many receives arrived. */
static inline int rp_reap(struct rawpeer *rp)
{
    struct ibv_wc wc[32];
    int n, got = 0;
    while ((n = ibv_poll_cq(rp->cq, 32, wc)) > 0) {
        for (int i = 0; i < n; i++) {
            if (wc[i].status != IBV_WC_SUCCESS) {
                if (!rp->failed)
                    rp->failed = bex__rdma_wc_errno(wc[i].status);
                if (!(wc[i].wr_id >> 32))
                    rp->unacked--;
                continue;
            }
            if (!(wc[i].wr_id >> 32)) {
                rp->unacked--;
                continue;
            }
            if (wc[i].opcode != IBV_WC_RECV)
                continue; /* a write with immediate: not used by these tests */
            uint32_t slot = (uint32_t)wc[i].wr_id;
            struct bex__hdr h;
            /* DATA comes header-free: stream and credits in the immediate */
            int rc = wc[i].wc_flags & IBV_WC_WITH_IMM
                         ? bex__imm_decode(ntohl(wc[i].imm_data), wc[i].byte_len, &h)
                         : bex__hdr_decode(rp->mem + (size_t)slot * RP_SLOT, wc[i].byte_len, &h);
            if (rc == 0 && rp->ngot < RP_RECVQ) {
                rp->got[rp->ngot++] = h;
                rp->credits += h.credits;
            }
            got++;
        }
    }
    return got;
}

/* Keep the peer's keepalive word moving; reap completions. */
static inline void rp_pump(struct rawpeer *rp)
{
    rp_reap(rp);
    uint64_t now = rp_now_ms();
    if (now < rp->ka_next || rp->failed)
        return;
    rp->ka_next = now + 100;
    *rp_ka_src(rp) = ++rp->ka_seq;
    struct ibv_sge sge = {(uintptr_t)rp_ka_src(rp), 8, rp->mr->lkey};
    struct ibv_send_wr wr = {.wr_id = 0,
                             .sg_list = &sge,
                             .num_sge = 1,
                             .opcode = IBV_WR_RDMA_WRITE,
                             .send_flags = IBV_SEND_SIGNALED},
                       *bad;
    wr.wr.rdma.remote_addr = rp->peer.ka_addr;
    wr.wr.rdma.rkey = rp->peer.ka_rkey;
    if (ibv_post_send(rp->qp, &wr, &bad) == 0)
        rp->unacked++;
}

/* Send one header (a credit of the peer's is used; the caller checks).
 * Returns 0, or -ETIMEDOUT when earlier sends stay unacknowledged for 5 s
 * (the peer's QP is gone; rxe may take long to report it). */
static inline int rp_send(struct rawpeer *rp, const struct bex__hdr *h)
{
    uint64_t end = rp_now_ms() + 5000;
    while (rp->unacked >= RP_SENDS - 8 && !rp->failed) {
        rp_reap(rp);
        if (rp_now_ms() > end)
            return -ETIMEDOUT;
    }
    CHECK(rp->credits > 0);
    uint8_t *b = rp_send_buf(rp, rp->sent++);
    bex__hdr_encode(h, b);
    struct ibv_sge sge = {(uintptr_t)b, BEX__HDR_LEN, rp->mr->lkey};
    struct ibv_send_wr wr = {.wr_id = 0,
                             .sg_list = &sge,
                             .num_sge = 1,
                             .opcode = IBV_WR_SEND,
                             .send_flags = IBV_SEND_SIGNALED},
                       *bad;
    int rc = bex__rdma_err(ibv_post_send(rp->qp, &wr, &bad));
    if (rc)
        return rc;
    rp->unacked++;
    rp->credits--;
    return 0;
}

/* Pump for up to ms milliseconds or until the peer closes the TCP
 * connection (its engine failed). Returns true if it closed. */
static inline bool rp_wait_closed(struct rawpeer *rp, unsigned ms)
{
    uint64_t end = rp_now_ms() + ms;
    while (rp_now_ms() < end) {
        rp_pump(rp);
        struct pollfd pf = {.fd = rp->fd, .events = POLLIN};
        if (poll(&pf, 1, 5) == 1) {
            char c;
            ssize_t n = recv(rp->fd, &c, 1, MSG_DONTWAIT);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
                return true;
        }
    }
    return false;
}

static inline void rp_fini(struct rawpeer *rp)
{
    if (rp->fd >= 0)
        close(rp->fd);
    bex__rdma_qp_destroy(rp->qp);
    ibv_dereg_mr(rp->mr);
    free(rp->mem);
    bex__rdma_cq_destroy(rp->cq);
    bex__rdma_dev_close(rp->dev);
}

#endif
