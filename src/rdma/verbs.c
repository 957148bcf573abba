/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "common/fault.h"
#include "rdma/internal.h"
#include "rdma/rdma.h"

/* Transition defaults; the comments in rdma.h explain the units. */
enum {
    DEF_TIMEOUT = 14,
    DEF_RETRY_CNT = 7,
    DEF_RNR_RETRY = 7,
    DEF_MIN_RNR_TIMER = 12,
    DEF_RD_ATOMIC = 16,
    DEF_HOP_LIMIT = 64,
    DEF_SQ_DEPTH = 32,
    DEF_RQ_DEPTH = 32,
    DEF_CQE = 256,
};

/* Zero means the default, BEX__RDMA_ZERO means a real zero. */
static uint8_t pick(uint8_t v, uint8_t def)
{
    if (v == BEX__RDMA_ZERO)
        return 0;
    return v ? v : def;
}

static const struct bex__rdma_conn_config no_config;

struct bex__rdma_verbs_ops bex__rdma_ops = {.modify_qp = ibv_modify_qp};

enum bex__rdma_route bex__rdma_route_of(uint8_t link_layer, uint32_t gid_type)
{
    if (link_layer != IBV_LINK_LAYER_ETHERNET)
        return BEX__RDMA_ROUTE_IB;
    return gid_type == IBV_GID_TYPE_ROCE_V1 ? BEX__RDMA_ROUTE_ROCE_V1 : BEX__RDMA_ROUTE_ROCE_V2;
}

int bex__rdma_wc_errno(enum ibv_wc_status status)
{
    switch (status) {
    case IBV_WC_SUCCESS:
        return 0;
    case IBV_WC_WR_FLUSH_ERR:
        return -ECANCELED;
    case IBV_WC_RETRY_EXC_ERR:
        return -ETIMEDOUT;
    case IBV_WC_RNR_RETRY_EXC_ERR:
        return -ENOBUFS;
    case IBV_WC_LOC_LEN_ERR:
        return -EMSGSIZE;
    case IBV_WC_REM_INV_REQ_ERR:
        return -EINVAL;
    case IBV_WC_LOC_PROT_ERR:
        return -EFAULT;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_MW_BIND_ERR:
        return -EACCES;
    default:
        return -EIO;
    }
}

int bex__rdma_mtu_bytes(enum ibv_mtu mtu)
{
    switch (mtu) {
    case IBV_MTU_256:
        return 256;
    case IBV_MTU_512:
        return 512;
    case IBV_MTU_1024:
        return 1024;
    case IBV_MTU_2048:
        return 2048;
    case IBV_MTU_4096:
        return 4096;
    }
    return 0;
}

/* ---- completion queues ----------------------------------------------- */

int bex__rdma_channel_create(struct bex__rdma_dev *dev, struct ibv_comp_channel **out)
{
    struct ibv_comp_channel *ch = ibv_create_comp_channel(dev->ctx);
    if (!ch)
        return bex__rdma_errno();
    /* An I/O thread polls the fd with others; a blocking read of an empty
     * channel inside ibv_get_cq_event would stall all of them. */
    int fl = fcntl(ch->fd, F_GETFL);
    if (fl < 0 || fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        int rc = -errno;
        ibv_destroy_comp_channel(ch);
        return rc;
    }
    *out = ch;
    return 0;
}

int bex__rdma_channel_destroy(struct ibv_comp_channel *ch)
{
    if (!ch)
        return 0;
    return bex__rdma_err(ibv_destroy_comp_channel(ch));
}

int bex__rdma_cq_create(struct bex__rdma_dev *dev, int cqe, struct ibv_comp_channel *ch,
                        struct ibv_cq **out)
{
    if (cqe == 0)
        cqe = DEF_CQE < dev->attr.max_cqe ? DEF_CQE : dev->attr.max_cqe;
    if (cqe < 0 || cqe > dev->attr.max_cqe)
        return -EINVAL;
    struct ibv_cq *cq = ibv_create_cq(dev->ctx, cqe, NULL, ch, 0);
    if (!cq)
        return bex__rdma_errno();
    *out = cq;
    return 0;
}

int bex__rdma_cq_destroy(struct ibv_cq *cq)
{
    if (!cq)
        return 0;
    return bex__rdma_err(ibv_destroy_cq(cq));
}

int bex__rdma_cq_resize(struct ibv_cq *cq, int cqe)
{
    if (cqe <= 0)
        return -EINVAL;
    return bex__rdma_err(ibv_resize_cq(cq, cqe));
}

/* ---- thread domains -------------------------------------------------- */

/* The thread-domain verbs, or a test's stand-in for a device that has
 * them (BEX__FAULT_TD: only in the fault-injection build). */
static struct ibv_td *td_verb_alloc(struct bex__rdma_dev *dev)
{
    const struct bex__fault_td_ops *f = BEX__FAULT_TD();
    if (f)
        return f->alloc_td(f->arg, dev->ctx);
    struct ibv_td_init_attr tattr = {0};
    return ibv_alloc_td(dev->ctx, &tattr);
}

static struct ibv_pd *td_verb_parent(struct bex__rdma_dev *dev, struct ibv_td *td)
{
    const struct bex__fault_td_ops *f = BEX__FAULT_TD();
    if (f)
        return f->alloc_parent(f->arg, dev->ctx, dev->pd, td);
    struct ibv_parent_domain_init_attr pattr = {.pd = dev->pd, .td = td};
    return ibv_alloc_parent_domain(dev->ctx, &pattr);
}

static int td_verb_dealloc_pd(struct ibv_pd *pd)
{
    const struct bex__fault_td_ops *f = BEX__FAULT_TD();
    return f ? f->dealloc_pd(f->arg, pd) : ibv_dealloc_pd(pd);
}

static int td_verb_dealloc_td(struct ibv_td *td)
{
    const struct bex__fault_td_ops *f = BEX__FAULT_TD();
    return f ? f->dealloc_td(f->arg, td) : ibv_dealloc_td(td);
}

int bex__rdma_td_alloc(struct bex__rdma_dev *dev, struct bex__rdma_td **out)
{
    int rc;
    struct bex__rdma_td *t = calloc(1, sizeof *t);
    if (!t)
        return -ENOMEM;

    errno = 0;
    t->td = td_verb_alloc(dev);
    if (!t->td) {
        rc = bex__rdma_errno();
        goto err_free;
    }
    errno = 0;
    t->pd = td_verb_parent(dev, t->td);
    if (!t->pd) {
        rc = bex__rdma_errno();
        goto err_dealloc_td;
    }
    *out = t;
    return 0;

err_dealloc_td:
    td_verb_dealloc_td(t->td);
err_free:
    free(t);
    /* Providers without the verb answer EOPNOTSUPP through libibverbs'
     * stubs, some older ones ENOSYS: callers only need "not here". */
    return rc == -ENOSYS ? -EOPNOTSUPP : rc;
}

int bex__rdma_td_free(struct bex__rdma_td *t)
{
    if (!t)
        return 0;
    int rc = bex__rdma_err(td_verb_dealloc_pd(t->pd));
    if (rc < 0)
        return rc;
    rc = bex__rdma_err(td_verb_dealloc_td(t->td));
    /* The parent domain is gone, so the TD can only fail if the provider is
     * broken; free our memory either way rather than leak it. */
    free(t);
    return rc;
}

/* ---- queue pairs ----------------------------------------------------- */

int bex__rdma_qp_create(struct bex__rdma_dev *dev, const struct bex__rdma_qp_config *cfg,
                        struct ibv_qp **out, struct ibv_qp_cap *cap_out)
{
    if (!cfg->send_cq || !cfg->recv_cq)
        return -EINVAL;
    uint32_t sq = cfg->sq_depth ? cfg->sq_depth : DEF_SQ_DEPTH;
    uint32_t rq = cfg->srq ? 0 : (cfg->rq_depth ? cfg->rq_depth : DEF_RQ_DEPTH);
    uint32_t ssge = cfg->max_send_sge ? cfg->max_send_sge : 1;
    uint32_t rsge = cfg->srq ? 0 : (cfg->max_recv_sge ? cfg->max_recv_sge : 1);
    /* Checked here so a bad config says EINVAL on every provider; some
     * report it as ENOMEM, rxe as EINVAL. */
    uint32_t max_wr = (uint32_t)dev->attr.max_qp_wr, max_sge = (uint32_t)dev->attr.max_sge;
    if (sq > max_wr || rq > max_wr || ssge > max_sge || rsge > max_sge)
        return -EINVAL;

    struct ibv_qp_init_attr ia = {
        .send_cq = cfg->send_cq,
        .recv_cq = cfg->recv_cq,
        .srq = cfg->srq,
        .cap =
            {
                .max_send_wr = sq,
                .max_recv_wr = rq,
                .max_send_sge = ssge,
                .max_recv_sge = rsge,
                .max_inline_data = cfg->max_inline,
            },
        .qp_type = IBV_QPT_RC,
        .sq_sig_all = 0,
    };
    struct ibv_qp *qp = ibv_create_qp(cfg->pd ? cfg->pd : dev->pd, &ia);
    if (!qp)
        return bex__rdma_errno();
    if (cap_out)
        *cap_out = ia.cap;
    *out = qp;
    return 0;
}

int bex__rdma_qp_destroy(struct ibv_qp *qp)
{
    if (!qp)
        return 0;
    return bex__rdma_err(ibv_destroy_qp(qp));
}

static uint8_t cap_rd_atomic(uint8_t want, int dev_max)
{
    if (dev_max < 0)
        dev_max = 0;
    return want < dev_max ? want : (uint8_t)(dev_max > 255 ? 255 : dev_max);
}

uint8_t bex__rdma_dest_rd_atomic(const struct bex__rdma_dev *dev,
                                 const struct bex__rdma_conn_config *cfg)
{
    if (!cfg)
        cfg = &no_config;
    return cap_rd_atomic(pick(cfg->max_dest_rd_atomic, DEF_RD_ATOMIC), dev->attr.max_qp_rd_atom);
}

int bex__rdma_qp_to_init(struct ibv_qp *qp, const struct bex__rdma_path *path,
                         const struct bex__rdma_conn_config *cfg)
{
    if (!cfg)
        cfg = &no_config;
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_INIT,
        .pkey_index = 0,
        .port_num = path->port,
        /* No REMOTE_READ: the protocol never reads, and a peer that may not
         * read cannot copy out what any key it holds reaches. */
        .qp_access_flags =
            cfg->access ? (int)cfg->access : IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE,
    };
    return bex__rdma_err(bex__rdma_ops.modify_qp(
        qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS));
}

/* Whether an InfiniBand peer is reached without a GRH: its GID is zero or
 * in the link-local subnet prefix fe80::/64, the subnet's own (IBTA: a GRH
 * only crosses routers). */
static bool ib_gid_local(const union ibv_gid *g)
{
    static const uint8_t ll[8] = {0xfe, 0x80};
    static const union ibv_gid zero;
    return memcmp(g->raw, ll, 8) == 0 || memcmp(g, &zero, sizeof zero) == 0;
}

/* The peer's address for RTR by path->route; -EINVAL for an InfiniBand
 * peer whose LID is not unicast (a peer's bad hello, not our bug). */
static int fill_ah(struct ibv_ah_attr *ah, const struct bex__rdma_path *path,
                   const struct bex__rdma_peer *peer, const struct bex__rdma_conn_config *cfg)
{
    memset(ah, 0, sizeof *ah);
    ah->port_num = path->port;
    ah->sl = cfg->sl;
    bool grh = true;
    if (path->route == BEX__RDMA_ROUTE_IB) {
        if (peer->lid == 0 || peer->lid >= 0xc000) /* 0xc000..: multicast, permissive */
            return -EINVAL;
        ah->dlid = peer->lid;
        grh = !ib_gid_local(&peer->gid);
    }
    /* RoCE v1 and v2 differ only in the type of the sgid_index's GID: the
     * provider builds the frame from it. */
    if (grh) {
        ah->is_global = 1;
        ah->grh.dgid = peer->gid;
        ah->grh.sgid_index = path->gid_index;
        ah->grh.hop_limit = pick(cfg->hop_limit, DEF_HOP_LIMIT);
        ah->grh.flow_label = cfg->flow_label;
        ah->grh.traffic_class = cfg->traffic_class;
    }
    return 0;
}

int bex__rdma_qp_to_rtr(struct ibv_qp *qp, struct bex__rdma_dev *dev,
                        const struct bex__rdma_path *path, const struct bex__rdma_peer *peer,
                        const struct bex__rdma_conn_config *cfg)
{
    if (!cfg)
        cfg = &no_config;
    if (!bex__rdma_mtu_bytes(path->active_mtu) || !bex__rdma_mtu_bytes(peer->active_mtu))
        return -EINVAL;
    if (peer->qpn > 0xffffffu || peer->psn > 0xffffffu)
        return -EINVAL;
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTR,
        /* The enum grows with the size, so min of enums = min of sizes. */
        .path_mtu = path->active_mtu < peer->active_mtu ? path->active_mtu : peer->active_mtu,
        .dest_qp_num = peer->qpn,
        .rq_psn = peer->psn,
        .max_dest_rd_atomic = bex__rdma_dest_rd_atomic(dev, cfg),
        .min_rnr_timer = pick(cfg->min_rnr_timer, DEF_MIN_RNR_TIMER),
    };
    if (fill_ah(&a.ah_attr, path, peer, cfg))
        return -EINVAL;
    return bex__rdma_err(bex__rdma_ops.modify_qp(
        qp, &a,
        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER));
}

int bex__rdma_qp_to_rts(struct ibv_qp *qp, struct bex__rdma_dev *dev, uint32_t psn,
                        const struct bex__rdma_peer *peer, const struct bex__rdma_conn_config *cfg)
{
    if (!cfg)
        cfg = &no_config;
    if (psn > 0xffffffu)
        return -EINVAL;
    /* More outstanding READs than the responder has resources for would
     * make it NAK them: never ask for more than the peer offered. */
    uint8_t rd =
        cap_rd_atomic(pick(cfg->max_rd_atomic, DEF_RD_ATOMIC), dev->attr.max_qp_init_rd_atom);
    if (rd > peer->rd_atomic)
        rd = peer->rd_atomic;
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTS,
        .sq_psn = psn,
        .timeout = pick(cfg->timeout, DEF_TIMEOUT),
        .retry_cnt = pick(cfg->retry_cnt, DEF_RETRY_CNT),
        .rnr_retry = pick(cfg->rnr_retry, DEF_RNR_RETRY),
        .max_rd_atomic = rd,
    };
    return bex__rdma_err(bex__rdma_ops.modify_qp(qp, &a,
                                                 IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                                                     IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                                     IBV_QP_MAX_QP_RD_ATOMIC));
}

int bex__rdma_qp_to_err(struct ibv_qp *qp)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    int rc = bex__rdma_err(bex__rdma_ops.modify_qp(qp, &a, IBV_QP_STATE));
    if (rc != -EINVAL)
        return rc;
    /* Linux refuses RESET -> ERR (its transition table allows only INIT from
     * RESET). A QP in RESET holds no work requests, so there is nothing to
     * flush and "in error or never started" is what the caller wanted. */
    struct ibv_qp_init_attr ia;
    if (ibv_query_qp(qp, &a, IBV_QP_STATE, &ia) == 0 && a.qp_state == IBV_QPS_RESET)
        return 0;
    return rc;
}

/* ---- randomness ------------------------------------------------------ */

/* splitmix64: spreads a weak seed (clock, pid, counter) over all bits. */
static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t random64(void)
{
    uint64_t v;
    /* GRND_NONBLOCK: in a freshly booted VM the pool may not be ready yet,
     * and a PSN does not need secrecy, only to differ between connections
     * (so stale packets of an old QP are not taken for new ones). */
    if (getrandom(&v, sizeof v, GRND_NONBLOCK) == (ssize_t)sizeof v)
        return v;
    static _Atomic uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t seed = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    seed ^= (uint64_t)getpid() << 32;
    seed ^= atomic_fetch_add_explicit(&counter, 1, memory_order_relaxed) * 0x2545f4914f6cdd1dull;
    return mix64(seed);
}

uint32_t bex__rdma_random_psn(void)
{
    return (uint32_t)random64() & 0xffffffu;
}

uint64_t bex__rdma_random_u64(void)
{
    uint64_t v;
    do
        v = random64();
    while (v == 0);
    return v;
}
