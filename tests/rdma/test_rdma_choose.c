/* SPDX-License-Identifier: Apache-2.0 */
/* The device choice against fake GID tables (bex__rdma_choose; issue 27
 * item 5): what rxe cannot show. No device needed (label unit).
 *  - roce_v2: IPv4 (::ffff:a.b.c.d) and IPv6 (the address) RoCE v2 GIDs are
 *    chosen; an ACTIVE port wins over an inactive one listed first; a GID
 *    index past 255 is not chosen; only inactive matches: -ENETDOWN.
 *  - roce_v1: a port with only a RoCE v1 GID of the address is chosen with
 *    route ROCE_V1 (no LID); where the v2 GID exists too, v2 wins.
 *  - ib_ipoib: an InfiniBand port whose port GID is the IPoIB netdev's is
 *    chosen with route IB and the port's LID; an ACTIVE port without a
 *    unicast LID (no subnet manager) is not ACTIVE for the choice.
 *  - not_chosen: an InfiniBand port when the address is on no IPoIB netdev,
 *    a RoCE-typed GID on an InfiniBand port, an Ethernet port's IB-typed
 *    GID: -ENODEV (the context then says why and works over TCP); an
 *    address of another family: -EAFNOSUPPORT.
 *  - ipoib_gid: the port GID from a fake getifaddrs list: the netdev that
 *    has the address, its 20-byte InfiniBand hardware address; an
 *    Ethernet netdev or an unknown address: -ENODEV. */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if_arp.h>
#include <netpacket/packet.h>
#include <stddef.h>
#include <string.h>

#include "harness.h"
#include "rdma/rdma.h"

static struct bex__rdma_gid_row row(const char *dev, uint8_t port, uint32_t index, uint32_t type,
                                    uint8_t ll, bool active, const char *ip)
{
    struct bex__rdma_gid_row r = {.dev = dev,
                                  .port = port,
                                  .index = index,
                                  .gid_type = type,
                                  .link_layer = ll,
                                  .active = active};
    bex_addr a;
    CHECK_OK(bex_addr_parse(ip, 0, &a));
    CHECK_OK(bex__rdma_gid_from_addr(&a, &r.gid));
    return r;
}

static bex_addr A(const char *ip)
{
    bex_addr a;
    CHECK_OK(bex_addr_parse(ip, 0, &a));
    return a;
}

#define ETH IBV_LINK_LAYER_ETHERNET
#define IB  IBV_LINK_LAYER_INFINIBAND
#define V1  IBV_GID_TYPE_ROCE_V1
#define V2  IBV_GID_TYPE_ROCE_V2

static int roce_v2(void)
{
    struct bex__rdma_gid_row t[] = {
        row("mlx5_0", 1, 2, V2, ETH, false, "10.0.0.1"),  /* the address, port down */
        row("mlx5_1", 1, 300, V2, ETH, true, "10.0.0.1"), /* index past 255 */
        row("mlx5_1", 2, 3, V2, ETH, true, "10.0.0.1"),   /* the one */
        row("mlx5_1", 2, 4, V2, ETH, true, "fd00::1"),
        row("mlx5_1", 2, 5, V1, ETH, true, "fd00::1"),
    };
    struct bex__rdma_path p;
    bex_addr a4 = A("10.0.0.1"), a6 = A("fd00::1"), other = A("10.0.0.9");
    CHECK_OK(bex__rdma_choose(t, 5, &a4, NULL, &p));
    CHECK(!strcmp(p.dev_name, "mlx5_1") && p.port == 2 && p.gid_index == 3);
    CHECK(p.route == BEX__RDMA_ROUTE_ROCE_V2 && p.lid == 0);
    CHECK_OK(bex__rdma_choose(t, 5, &a6, NULL, &p));
    CHECK(!strcmp(p.dev_name, "mlx5_1") && p.port == 2 && p.gid_index == 4);
    CHECK(!memcmp(p.gid.raw, &a6.in6.sin6_addr, 16));
    CHECK_EQ(bex__rdma_choose(t, 1, &a4, NULL, &p), -ENETDOWN);
    CHECK_EQ(bex__rdma_choose(t, 5, &other, NULL, &p), -ENODEV);
    return 0;
}

static int roce_v1(void)
{
    struct bex__rdma_gid_row t[] = {
        row("mlx4_0", 1, 0, V1, ETH, true, "fe80::1"),  /* the default GID */
        row("mlx4_0", 1, 1, V1, ETH, true, "10.0.0.1"), /* RoCE v1 only */
        row("mlx5_0", 1, 2, V1, ETH, true, "10.0.0.2"),
        row("mlx5_0", 1, 3, V2, ETH, true, "10.0.0.2"),
    };
    t[1].lid = 0x33; /* a LID an Ethernet port might report: not used */
    struct bex__rdma_path p;
    bex_addr a = A("10.0.0.1"), both = A("10.0.0.2");
    CHECK_OK(bex__rdma_choose(t, 4, &a, NULL, &p));
    CHECK(!strcmp(p.dev_name, "mlx4_0") && p.port == 1 && p.gid_index == 1);
    CHECK(p.route == BEX__RDMA_ROUTE_ROCE_V1 && p.lid == 0);
    CHECK_OK(bex__rdma_choose(t, 4, &both, NULL, &p));
    CHECK(p.gid_index == 3 && p.route == BEX__RDMA_ROUTE_ROCE_V2);
    return 0;
}

#define IBT IBV_GID_TYPE_IB

static int ib_ipoib(void)
{
    struct bex__rdma_gid_row t[] = {
        row("mlx5_2", 1, 0, IBT, IB, true, "fe80::2:c903:0:9"), /* no SM: LID 0 */
        row("mlx5_3", 1, 0, IBT, IB, true, "fe80::2:c903:0:1"),
        row("mlx5_3", 1, 1, IBT, IB, true, "fec0::2:c903:0:1"),
        row("mlx5_4", 1, 0, IBT, IBV_LINK_LAYER_UNSPECIFIED, true, "fe80::2:c903:0:4"),
    };
    t[1].lid = 0x0102;
    t[3].lid = BEX__HELLO_LID_MAX;
    struct bex__rdma_path p;
    bex_addr a = A("192.168.7.1");
    union ibv_gid g = t[1].gid;
    CHECK_OK(bex__rdma_choose(t, 4, &a, &g, &p));
    CHECK(!strcmp(p.dev_name, "mlx5_3") && p.port == 1 && p.gid_index == 0);
    CHECK(p.route == BEX__RDMA_ROUTE_IB && p.lid == 0x0102);
    CHECK(!memcmp(p.gid.raw, g.raw, 16));
    g = t[3].gid; /* an old provider's UNSPECIFIED link layer is InfiniBand */
    CHECK_OK(bex__rdma_choose(t, 4, &a, &g, &p));
    CHECK(p.route == BEX__RDMA_ROUTE_IB && p.lid == BEX__HELLO_LID_MAX);
    g = t[0].gid;
    CHECK_EQ(bex__rdma_choose(t, 4, &a, &g, &p), -ENETDOWN);
    t[0].lid = 0xc001; /* multicast: no unicast LID either */
    CHECK_EQ(bex__rdma_choose(t, 4, &a, &g, &p), -ENETDOWN);
    return 0;
}

static int not_chosen(void)
{
    struct bex__rdma_gid_row t[] = {
        row("mlx5_ib", 1, 0, V2, IB, true, "fd00::2"),   /* RoCE type on IB */
        row("mlx5_ib", 1, 1, IBT, IB, true, "fe80::1"),  /* its port GID */
        row("mlx5_0", 1, 0, IBT, ETH, true, "10.0.0.1"), /* IB type on Ethernet */
    };
    t[1].lid = 5;
    struct bex__rdma_path p;
    bex_addr a4 = A("10.0.0.1"), a6 = A("fd00::2"), ll = A("fe80::1"), none = {0};
    CHECK_EQ(bex__rdma_choose(t, 3, &a4, NULL, &p), -ENODEV);
    CHECK_EQ(bex__rdma_choose(t, 3, &a6, NULL, &p), -ENODEV);
    CHECK_EQ(bex__rdma_choose(t, 3, &ll, NULL, &p), -ENODEV); /* not on IPoIB */
    union ibv_gid other = t[0].gid;
    CHECK_EQ(bex__rdma_choose(t, 3, &a4, &other, &p), -ENODEV);
    CHECK_EQ(bex__rdma_choose(t, 3, &none, NULL, &p), -EAFNOSUPPORT);
    return 0;
}

/* A link entry as glibc's getifaddrs makes it: a sockaddr_ll whose
 * address runs past sll_addr[8] (20 bytes for IPoIB). */
struct fake_link {
    struct sockaddr_ll ll;
    uint8_t more[16];
};

static void link_entry(struct ifaddrs *ifa, struct fake_link *l, char *name, uint16_t hatype,
                       uint8_t halen, const uint8_t *hw)
{
    memset(l, 0, sizeof *l);
    l->ll.sll_family = AF_PACKET;
    l->ll.sll_hatype = hatype;
    l->ll.sll_halen = halen;
    memcpy((uint8_t *)l + offsetof(struct sockaddr_ll, sll_addr), hw, halen);
    *ifa = (struct ifaddrs){.ifa_name = name, .ifa_addr = (struct sockaddr *)(void *)l};
}

static int ipoib_gid(void)
{
    static const uint8_t ib_hw[20] = {0x00, 0x00, 0x10, 0x49, 0xfe, 0x80, 0,    0, 0, 0,
                                      0,    0,    0x00, 0x02, 0xc9, 0x03, 0x00, 0, 0, 0x01};
    static const uint8_t eth_hw[6] = {0x02, 0, 0, 0, 0, 1};
    char ib0[] = "ib0", eth0[] = "eth0";
    struct fake_link l_ib, l_eth;
    struct ifaddrs e[4];
    bex_addr on_ib = A("192.168.7.1"), on_eth = A("10.0.0.1"), v6 = A("fd00::7"),
             nowhere = A("10.9.9.9");
    e[0] = (struct ifaddrs){.ifa_name = eth0, .ifa_addr = &on_eth.sa};
    link_entry(&e[1], &l_eth, eth0, ARPHRD_ETHER, 6, eth_hw);
    link_entry(&e[2], &l_ib, ib0, ARPHRD_INFINIBAND, 20, ib_hw);
    e[3] = (struct ifaddrs){.ifa_name = ib0, .ifa_addr = &on_ib.sa};
    for (int i = 0; i < 3; i++)
        e[i].ifa_next = &e[i + 1];
    union ibv_gid g;
    CHECK_OK(bex__rdma_ipoib_gid(e, &on_ib, &g));
    CHECK(!memcmp(g.raw, ib_hw + 4, 16));
    CHECK_EQ(bex__rdma_ipoib_gid(e, &on_eth, &g), -ENODEV);
    CHECK_EQ(bex__rdma_ipoib_gid(e, &nowhere, &g), -ENODEV);
    e[3].ifa_addr = &v6.sa; /* IPv6 over IPoIB */
    CHECK_OK(bex__rdma_ipoib_gid(e, &v6, &g));
    CHECK(!memcmp(g.raw, ib_hw + 4, 16));
    l_ib.ll.sll_halen = 8; /* not a 20-byte InfiniBand address */
    CHECK_EQ(bex__rdma_ipoib_gid(e, &v6, &g), -ENODEV);
    return 0;
}

BEX_TEST_MAIN({"roce_v2", roce_v2}, {"roce_v1", roce_v1}, {"ib_ipoib", ib_ipoib},
              {"not_chosen", not_chosen}, {"ipoib_gid", ipoib_gid})
