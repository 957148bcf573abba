/* SPDX-License-Identifier: Apache-2.0 */
/* The rdma module on a real device: device choice by address, the shared
 * device handle, resource helpers and their error paths, QP transitions. */
#include <arpa/inet.h>

#include "harness.h"
#include "rdma/internal.h"
#include "rdma/rdma.h"
#include "rdma_test.h"

static int device_choice(void)
{
    struct test_addrs ta;
    int rc = test_need_rdma(&ta);
    if (rc)
        return rc;

    struct bex__rdma_path p0, p1;
    CHECK_OK(bex__rdma_find_ipv4(ta.a0, &p0));
    CHECK_OK(bex__rdma_find_ipv4(ta.a1, &p1));
    fprintf(stderr, "%s -> %s/%u gid %u; %s -> %s/%u gid %u\n", ta.s0, p0.dev_name, p0.port,
            p0.gid_index, ta.s1, p1.dev_name, p1.port, p1.gid_index);
    union ibv_gid g;
    bex__rdma_gid_from_ipv4(ta.a0, &g);
    CHECK(memcmp(&g, &p0.gid, 16) == 0);
    bex__rdma_gid_from_ipv4(ta.a1, &g);
    CHECK(memcmp(&g, &p1.gid, 16) == 0);
    /* The test setup puts the two addresses on two devices, so that traffic
     * crosses a wire instead of one device's loopback. */
    CHECK(strcmp(p0.dev_name, p1.dev_name) != 0);

    /* the GID index really is a RoCEv2 entry holding that address */
    struct bex__rdma_dev *dev;
    struct bex__rdma_path pp;
    CHECK_OK(bex__rdma_dev_open_ipv4(ta.a0, &dev, &pp));
    CHECK(strcmp(pp.dev_name, p0.dev_name) == 0 && pp.gid_index == p0.gid_index);
    CHECK(bex__rdma_mtu_bytes(pp.active_mtu) >= 256);
    struct ibv_gid_entry e;
    CHECK_OK(bex__rdma_err(ibv_query_gid_ex(dev->ctx, pp.port, pp.gid_index, &e, 0)));
    CHECK_EQ(e.gid_type, IBV_GID_TYPE_ROCE_V2);
    CHECK(memcmp(&e.gid, &pp.gid, 16) == 0);
    CHECK_OK(bex__rdma_dev_close(dev));

    struct in_addr lo;
    inet_pton(AF_INET, "127.0.0.1", &lo);
    CHECK_EQ(bex__rdma_find_ipv4(lo, &pp), -ENODEV);

    /* the fallbacks for older kernels find the same entries */
    for (int mode = 1; mode <= 2; mode++) {
        bex__rdma_gid_query_mode = mode;
        struct bex__rdma_path q0, q1;
        CHECK_OK(bex__rdma_find_ipv4(ta.a0, &q0));
        CHECK_OK(bex__rdma_find_ipv4(ta.a1, &q1));
        CHECK(strcmp(q0.dev_name, p0.dev_name) == 0 && q0.port == p0.port &&
              q0.gid_index == p0.gid_index && memcmp(&q0.gid, &p0.gid, 16) == 0);
        CHECK(strcmp(q1.dev_name, p1.dev_name) == 0 && q1.gid_index == p1.gid_index);
        CHECK_EQ(bex__rdma_find_ipv4(lo, &pp), -ENODEV);
    }
    bex__rdma_gid_query_mode = 0;
    return 0;
}

static int device_handle(void)
{
    struct test_addrs ta;
    int rc = test_need_rdma(&ta);
    if (rc)
        return rc;
    struct bex__rdma_path path;
    CHECK_OK(bex__rdma_find_ipv4(ta.a0, &path));

    /* one context and one PD per device, however often it is opened */
    struct bex__rdma_dev *a, *b;
    CHECK_OK(bex__rdma_dev_open(path.dev_name, &a));
    CHECK_OK(bex__rdma_dev_open(path.dev_name, &b));
    CHECK(a == b && a->pd && a->ctx && a->pd->context == a->ctx);
    CHECK(a->nports >= path.port);
    const struct bex__rdma_port *pt = &a->ports[path.port - 1];
    CHECK_EQ(pt->state, IBV_PORT_ACTIVE);
    CHECK_EQ(pt->link_layer, IBV_LINK_LAYER_ETHERNET);
    fprintf(stderr,
            "%s: active MTU %d, max MTU %d, lid %u, %d GIDs, max_qp_wr %d, max_sge %d, "
            "max_cqe %d, max_qp_rd_atom %d\n",
            a->name, bex__rdma_mtu_bytes(pt->active_mtu), bex__rdma_mtu_bytes(pt->max_mtu), pt->lid,
            pt->gid_tbl_len, a->attr.max_qp_wr, a->attr.max_sge, a->attr.max_cqe,
            a->attr.max_qp_rd_atom);

    struct bex__rdma_port q;
    CHECK_OK(bex__rdma_port_query(a, path.port, &q));
    CHECK_EQ(q.active_mtu, pt->active_mtu);
    CHECK_EQ(bex__rdma_port_query(a, 0, &q), -EINVAL);
    CHECK_EQ(bex__rdma_port_query(a, (uint8_t)(a->nports + 1), &q), -EINVAL);

    CHECK_OK(bex__rdma_dev_close(b));
    /* still open: the first reference remains */
    struct ibv_pd *pd = ibv_alloc_pd(a->ctx);
    CHECK(pd);
    ibv_dealloc_pd(pd);
    CHECK_OK(bex__rdma_dev_close(a));

    /* a fresh open after the last close works again */
    CHECK_OK(bex__rdma_dev_open(path.dev_name, &a));
    CHECK_OK(bex__rdma_dev_close(a));
    return 0;
}

/* Creation limits and the EBUSY answers of teardown in the wrong order. */
static int resources(void)
{
    struct test_addrs ta;
    int rc = test_need_rdma(&ta);
    if (rc)
        return rc;
    struct bex__rdma_dev *dev;
    struct bex__rdma_path path;
    CHECK_OK(bex__rdma_dev_open_ipv4(ta.a0, &dev, &path));

    struct bex__rdma_td *td = NULL;
    rc = bex__rdma_td_alloc(dev, &td);
    fprintf(stderr, "thread domain: %s\n", rc ? bex_strerror(rc) : "supported");
    CHECK(rc == 0 || rc == -EOPNOTSUPP);
    CHECK_OK(bex__rdma_td_free(td));

    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    CHECK_OK(bex__rdma_channel_create(dev, &ch));
    CHECK_EQ(bex__rdma_cq_create(dev, dev->attr.max_cqe + 1, NULL, &cq), -EINVAL);
    CHECK_EQ(bex__rdma_cq_create(dev, -1, NULL, &cq), -EINVAL);
    CHECK_OK(bex__rdma_cq_create(dev, 0, ch, &cq));
    CHECK(cq->cqe >= 1);

    struct ibv_qp *qp;
    struct bex__rdma_qp_config qc = {.send_cq = cq};
    CHECK_EQ(bex__rdma_qp_create(dev, &qc, &qp, NULL), -EINVAL);
    qc.recv_cq = cq;
    qc.sq_depth = (uint32_t)dev->attr.max_qp_wr + 1;
    CHECK_EQ(bex__rdma_qp_create(dev, &qc, &qp, NULL), -EINVAL);
    qc.sq_depth = 0;
    qc.max_send_sge = (uint32_t)dev->attr.max_sge + 1;
    CHECK_EQ(bex__rdma_qp_create(dev, &qc, &qp, NULL), -EINVAL);
    qc.max_send_sge = 0;
    qc.max_inline = 64;
    struct ibv_qp_cap cap;
    CHECK_OK(bex__rdma_qp_create(dev, &qc, &qp, &cap));
    fprintf(stderr, "default QP granted: sq %u rq %u send sge %u recv sge %u inline %u\n",
            cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge,
            cap.max_inline_data);
    CHECK(cap.max_send_wr >= 32 && cap.max_recv_wr >= 32 && cap.max_inline_data >= 64);

    /* an SRQ-based QP has no receive queue of its own */
    struct ibv_srq_init_attr sa = {.attr = {.max_wr = 64, .max_sge = 1}};
    struct ibv_srq *srq = ibv_create_srq(dev->pd, &sa);
    CHECK(srq);
    struct ibv_qp *sqp;
    struct bex__rdma_qp_config sc = {.send_cq = cq, .recv_cq = cq, .srq = srq};
    CHECK_OK(bex__rdma_qp_create(dev, &sc, &sqp, NULL));
    CHECK_OK(bex__rdma_qp_destroy(sqp));
    CHECK_OK(bex__rdma_err(ibv_destroy_srq(srq)));

    /* wrong teardown order is refused, and nothing is lost by refusing */
    CHECK_EQ(bex__rdma_dev_close(dev), -EBUSY);
    CHECK_EQ(bex__rdma_cq_destroy(cq), -EBUSY);
    CHECK_OK(bex__rdma_qp_destroy(qp));
    CHECK_EQ(bex__rdma_channel_destroy(ch), -EBUSY);
    CHECK_OK(bex__rdma_cq_destroy(cq));
    CHECK_OK(bex__rdma_channel_destroy(ch));
    CHECK_OK(bex__rdma_qp_destroy(NULL));
    CHECK_OK(bex__rdma_cq_destroy(NULL));
    CHECK_OK(bex__rdma_channel_destroy(NULL));
    CHECK_OK(bex__rdma_dev_close(dev));
    return 0;
}

static enum ibv_qp_state qp_state(struct ibv_qp *qp)
{
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;
    CHECK_OK(bex__rdma_err(ibv_query_qp(qp, &a, IBV_QP_STATE, &ia)));
    return a.qp_state;
}

/* Each transition with its attributes as the device reports them back. */
static int transitions(void)
{
    struct test_addrs ta;
    int rc = test_need_rdma(&ta);
    if (rc)
        return rc;
    struct bex__rdma_dev *dev;
    struct bex__rdma_path path;
    CHECK_OK(bex__rdma_dev_open_ipv4(ta.a0, &dev, &path));
    struct ibv_cq *cq;
    CHECK_OK(bex__rdma_cq_create(dev, 64, NULL, &cq));
    struct ibv_qp *a, *b;
    struct bex__rdma_qp_config qc = {.send_cq = cq, .recv_cq = cq};
    CHECK_OK(bex__rdma_qp_create(dev, &qc, &a, NULL));
    CHECK_OK(bex__rdma_qp_create(dev, &qc, &b, NULL));
    CHECK_EQ(qp_state(a), IBV_QPS_RESET);

    CHECK_OK(bex__rdma_qp_to_init(a, &path, NULL));
    CHECK_EQ(qp_state(a), IBV_QPS_INIT);
    struct ibv_qp_attr at;
    struct ibv_qp_init_attr ia;
    CHECK_OK(bex__rdma_err(ibv_query_qp(a, &at, IBV_QP_ACCESS_FLAGS | IBV_QP_PORT, &ia)));
    CHECK_EQ(at.qp_access_flags, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE); /* no READ */
    CHECK_EQ(at.port_num, path.port);

    /* a peer with a smaller MTU wins the path MTU */
    struct bex__rdma_peer peer = {.qpn = b->qp_num,
                                  .psn = 0x123456,
                                  .gid = path.gid,
                                  .active_mtu = IBV_MTU_512,
                                  .rd_atomic = 4};
    struct bex__rdma_peer bad = peer;
    bad.active_mtu = (enum ibv_mtu)9;
    CHECK_EQ(bex__rdma_qp_to_rtr(a, dev, &path, &bad, NULL), -EINVAL);
    bad = peer;
    bad.qpn = 0x1000000;
    CHECK_EQ(bex__rdma_qp_to_rtr(a, dev, &path, &bad, NULL), -EINVAL);
    CHECK_EQ(qp_state(a), IBV_QPS_INIT);

    struct bex__rdma_conn_config cc = {
        .min_rnr_timer = 5, .timeout = 10, .retry_cnt = 3, .rnr_retry = BEX__RDMA_ZERO};
    CHECK_OK(bex__rdma_qp_to_rtr(a, dev, &path, &peer, &cc));
    CHECK_EQ(qp_state(a), IBV_QPS_RTR);
    CHECK_OK(
        bex__rdma_err(ibv_query_qp(a, &at,
                                   IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                       IBV_QP_MIN_RNR_TIMER | IBV_QP_AV | IBV_QP_MAX_DEST_RD_ATOMIC,
                                   &ia)));
    CHECK_EQ(at.path_mtu, IBV_MTU_512);
    CHECK_EQ(at.dest_qp_num, b->qp_num);
    CHECK_EQ(at.rq_psn, 0x123456);
    CHECK_EQ(at.min_rnr_timer, 5);
    CHECK_EQ(at.ah_attr.is_global, 1);
    CHECK_EQ(at.ah_attr.grh.sgid_index, path.gid_index);
    CHECK_EQ(at.ah_attr.grh.hop_limit, 64);
    CHECK(memcmp(&at.ah_attr.grh.dgid, &path.gid, 16) == 0);
    CHECK_EQ(at.max_dest_rd_atomic, bex__rdma_dest_rd_atomic(dev, &cc));

    CHECK_EQ(bex__rdma_qp_to_rts(a, dev, 0x1000000, &peer, &cc), -EINVAL);
    CHECK_OK(bex__rdma_qp_to_rts(a, dev, 0xabcdef, &peer, &cc));
    CHECK_EQ(qp_state(a), IBV_QPS_RTS);
    CHECK_OK(bex__rdma_err(ibv_query_qp(a, &at,
                                        IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                            IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
                                        &ia)));
    CHECK_EQ(at.sq_psn, 0xabcdef);
    CHECK_EQ(at.timeout, 10);
    CHECK_EQ(at.retry_cnt, 3);
    CHECK_EQ(at.rnr_retry, 0);
    CHECK_EQ(at.max_rd_atomic, 4); /* capped by what the peer offered */

    /* an invalid transition is the device's EINVAL, as a negative code */
    CHECK_EQ(bex__rdma_qp_to_init(a, &path, NULL), -EINVAL);

    CHECK_OK(bex__rdma_qp_to_err(a));
    CHECK_EQ(qp_state(a), IBV_QPS_ERR);
    /* the kernel refuses RESET -> ERR; the helper treats it as done */
    CHECK_OK(bex__rdma_qp_to_err(b));
    CHECK_EQ(qp_state(b), IBV_QPS_RESET);

    CHECK_OK(bex__rdma_qp_destroy(a));
    CHECK_OK(bex__rdma_qp_destroy(b));
    CHECK_OK(bex__rdma_cq_destroy(cq));
    CHECK_OK(bex__rdma_dev_close(dev));
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(device_choice), BEX_CASE(device_handle), BEX_CASE(resources),
              BEX_CASE(transitions))
