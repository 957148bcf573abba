/* SPDX-License-Identifier: Apache-2.0 */
/* The QP attributes of each route (issue 27 item 5: RoCE v1 and
 * InfiniBand, which rxe cannot run), driven through bex__rdma_qp_to_init
 * and bex__rdma_qp_to_rtr against a fake device whose modify_qp records
 * what it is given (bex__rdma_ops). No device needed (label unit).
 *  - roce_v2: GRH to the peer's GID from the address's GID index, hop
 *    limit 64, no DLID; the mask of RTR.
 *  - roce_v1: the same attributes (the GID index's type makes the frame).
 *  - ib_lid: a peer GID in the link-local subnet (fe80::/64): LID routing,
 *    DLID = the peer's LID, no GRH.
 *  - ib_grh: a global peer GID: DLID and a GRH.
 *  - ib_bad_lid: an InfiniBand peer with LID 0 or a multicast LID:
 *    -EINVAL, modify_qp never called.
 *  - route_of: the route from the port's link layer and the GID's type.
 *  - from_hello: the whole InfiniBand chain: the device choice on a fake
 *    GID table (IPoIB port GID), the hello that path sends (route, LID,
 *    GID) through the wire codec, the peer made of it, and RTR: DLID =
 *    the sender's LID, no GRH (link-local GID). */
#include <arpa/inet.h>
#include <errno.h>
#include <string.h>

#include "harness.h"
#include "rdma/internal.h"
#include "rdma/rdma.h"

static struct {
    int calls;
    struct ibv_qp_attr attr;
    int mask;
} rec;

static int record_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
    (void)qp;
    rec.calls++;
    rec.attr = *attr;
    rec.mask = mask;
    return 0;
}

static struct bex__rdma_dev fake_dev = {
    .attr = {.max_qp_rd_atom = 16, .max_qp_init_rd_atom = 16, .phys_port_cnt = 2},
    .name = "fake0",
    .nports = 2,
};
static int fake_qp_storage;
#define FAKE_QP ((struct ibv_qp *)(void *)&fake_qp_storage)

static union ibv_gid gid(const char *text)
{
    union ibv_gid g;
    CHECK(inet_pton(AF_INET6, text, g.raw) == 1);
    return g;
}

#define RTR_MASK                                                                                   \
    (IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |                \
     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)

/* INIT then RTR on path to peer; the RTR attributes stay in rec. */
static int drive(const struct bex__rdma_path *path, const struct bex__rdma_peer *peer)
{
    struct bex__rdma_conn_config cfg = {.sl = 3};
    bex__rdma_ops.modify_qp = record_modify_qp;
    memset(&rec, 0, sizeof rec);
    CHECK_OK(bex__rdma_qp_to_init(FAKE_QP, path, &cfg));
    CHECK_EQ(rec.attr.port_num, path->port);
    CHECK_OK(bex__rdma_qp_to_rtr(FAKE_QP, &fake_dev, path, peer, &cfg));
    CHECK_EQ(rec.calls, 2);
    CHECK_EQ(rec.mask, RTR_MASK);
    const struct ibv_qp_attr *a = &rec.attr;
    CHECK_EQ(a->qp_state, IBV_QPS_RTR);
    CHECK_EQ(a->path_mtu, IBV_MTU_1024); /* min of 1024 and 4096 */
    CHECK_EQ(a->dest_qp_num, peer->qpn);
    CHECK_EQ(a->rq_psn, peer->psn);
    CHECK_EQ(a->ah_attr.port_num, path->port);
    CHECK_EQ(a->ah_attr.sl, 3);
    CHECK_EQ(a->ah_attr.src_path_bits, 0);
    return 0;
}

static int check_grh(const struct bex__rdma_path *path, const struct bex__rdma_peer *peer)
{
    const struct ibv_ah_attr *ah = &rec.attr.ah_attr;
    CHECK_EQ(ah->is_global, 1);
    CHECK(!memcmp(ah->grh.dgid.raw, peer->gid.raw, 16));
    CHECK_EQ(ah->grh.sgid_index, path->gid_index);
    CHECK_EQ(ah->grh.hop_limit, 64);
    CHECK_EQ(ah->grh.traffic_class, 0);
    CHECK_EQ(ah->grh.flow_label, 0);
    return 0;
}

static struct bex__rdma_path path_of(uint8_t route, uint16_t lid)
{
    struct bex__rdma_path p = {.port = 2, .gid_index = 5, .active_mtu = IBV_MTU_1024};
    p.route = route;
    p.lid = lid;
    return p;
}

static struct bex__rdma_peer peer_of(const char *g, uint16_t lid)
{
    struct bex__rdma_peer p = {.qpn = 0x12345, .psn = 0xabcde, .active_mtu = IBV_MTU_4096};
    p.gid = gid(g);
    p.lid = lid;
    return p;
}

static int roce_v2(void)
{
    struct bex__rdma_path path = path_of(BEX__RDMA_ROUTE_ROCE_V2, 0);
    struct bex__rdma_peer peer = peer_of("::ffff:10.0.0.2", 0);
    CHECK_OK(drive(&path, &peer));
    CHECK_OK(check_grh(&path, &peer));
    CHECK_EQ(rec.attr.ah_attr.dlid, 0);
    return 0;
}

static int roce_v1(void)
{
    struct bex__rdma_path path = path_of(BEX__RDMA_ROUTE_ROCE_V1, 0);
    struct bex__rdma_peer peer = peer_of("fe80::211:22ff:fe33:4455", 0);
    CHECK_OK(drive(&path, &peer));
    CHECK_OK(check_grh(&path, &peer)); /* RoCE always carries a GRH */
    CHECK_EQ(rec.attr.ah_attr.dlid, 0);
    return 0;
}

static int ib_lid(void)
{
    struct bex__rdma_path path = path_of(BEX__RDMA_ROUTE_IB, 7);
    struct bex__rdma_peer peer = peer_of("fe80::2:c903:0:1", 9);
    CHECK_OK(drive(&path, &peer));
    const struct ibv_ah_attr *ah = &rec.attr.ah_attr;
    CHECK_EQ(ah->is_global, 0);
    CHECK_EQ(ah->dlid, 9);
    static const struct ibv_global_route zero;
    CHECK(!memcmp(&ah->grh, &zero, sizeof zero));
    return 0;
}

static int ib_grh(void)
{
    struct bex__rdma_path path = path_of(BEX__RDMA_ROUTE_IB, 7);
    struct bex__rdma_peer peer = peer_of("fec0::2:c903:0:1", 0x0123);
    CHECK_OK(drive(&path, &peer));
    CHECK_OK(check_grh(&path, &peer));
    CHECK_EQ(rec.attr.ah_attr.dlid, 0x0123);
    return 0;
}

static int ib_bad_lid(void)
{
    struct bex__rdma_path path = path_of(BEX__RDMA_ROUTE_IB, 7);
    bex__rdma_ops.modify_qp = record_modify_qp;
    static const uint16_t bad[] = {0, 0xc000, 0xffff};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct bex__rdma_peer peer = peer_of("fe80::2:c903:0:1", bad[i]);
        memset(&rec, 0, sizeof rec);
        CHECK_EQ(bex__rdma_qp_to_rtr(FAKE_QP, &fake_dev, &path, &peer, NULL), -EINVAL);
        CHECK_EQ(rec.calls, 0);
    }
    return 0;
}

static int route_of(void)
{
    CHECK_EQ(bex__rdma_route_of(IBV_LINK_LAYER_ETHERNET, IBV_GID_TYPE_ROCE_V2),
             BEX__RDMA_ROUTE_ROCE_V2);
    CHECK_EQ(bex__rdma_route_of(IBV_LINK_LAYER_ETHERNET, IBV_GID_TYPE_ROCE_V1),
             BEX__RDMA_ROUTE_ROCE_V1);
    CHECK_EQ(bex__rdma_route_of(IBV_LINK_LAYER_INFINIBAND, IBV_GID_TYPE_IB), BEX__RDMA_ROUTE_IB);
    /* verbs reports IB ports of old providers as unspecified */
    CHECK_EQ(bex__rdma_route_of(IBV_LINK_LAYER_UNSPECIFIED, IBV_GID_TYPE_IB), BEX__RDMA_ROUTE_IB);
    return 0;
}

static int from_hello(void)
{
    struct bex__rdma_gid_row row = {.dev = "mlx5_0",
                                    .port = 1,
                                    .index = 0,
                                    .gid_type = IBV_GID_TYPE_IB,
                                    .link_layer = IBV_LINK_LAYER_INFINIBAND,
                                    .active = true,
                                    .lid = 0x0102,
                                    .gid = gid("fe80::2:c903:0:1")};
    bex_addr ipoib_addr;
    CHECK_OK(bex_addr_parse("192.168.7.1", 0, &ipoib_addr));
    struct bex__rdma_path sender;
    CHECK_OK(bex__rdma_choose(&row, 1, &ipoib_addr, &row.gid, &sender));

    struct bex__hello h = {.qpn = 0x4242, .psn = 77, .mtu = IBV_MTU_4096, .rd_atomic = 4};
    h.recv_depth = h.sq_depth = h.max_rndv = 1;
    h.max_msg = h.frag_size = 4096;
    h.conn_id = h.ka_addr = 1;
    h.route = sender.route;
    h.lid = sender.lid;
    memcpy(h.gid, sender.gid.raw, 16);
    uint8_t buf[BEX__HELLO_LEN];
    bex__hello_encode(&h, buf);
    struct bex__hello got;
    CHECK_OK(bex__hello_decode(buf, sizeof buf, &got));
    struct bex__rdma_peer peer;
    bex__rdma_peer_of_hello(&got, &peer);

    struct bex__rdma_path path = path_of(got.route, 7);
    CHECK_OK(drive(&path, &peer));
    const struct ibv_ah_attr *ah = &rec.attr.ah_attr;
    CHECK_EQ(rec.attr.dest_qp_num, 0x4242);
    CHECK_EQ(ah->dlid, 0x0102);
    CHECK_EQ(ah->is_global, 0);
    return 0;
}

BEX_TEST_MAIN({"roce_v2", roce_v2}, {"roce_v1", roce_v1}, {"ib_lid", ib_lid}, {"ib_grh", ib_grh},
              {"ib_bad_lid", ib_bad_lid}, {"route_of", route_of}, {"from_hello", from_hello})
