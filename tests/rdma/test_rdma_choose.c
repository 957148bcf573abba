/* SPDX-License-Identifier: Apache-2.0 */
/* The device choice against fake GID tables (bex__rdma_choose; issue 27
 * item 5): what rxe cannot show. No device needed (label unit).
 *  - roce_v2: IPv4 (::ffff:a.b.c.d) and IPv6 (the address) RoCE v2 GIDs are
 *    chosen; an ACTIVE port wins over an inactive one listed first; a GID
 *    index past 255 is not chosen; only inactive matches: -ENETDOWN.
 *  - not_chosen: a RoCE v1 GID of the address, an InfiniBand port's GID
 *    (LID routing), an IB-type GID: -ENODEV (the context then says why and
 *    works over TCP); an address of another family: -EAFNOSUPPORT. */
#include <arpa/inet.h>
#include <errno.h>
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
    CHECK_OK(bex__rdma_choose(t, 5, &a4, &p));
    CHECK(!strcmp(p.dev_name, "mlx5_1") && p.port == 2 && p.gid_index == 3);
    CHECK_OK(bex__rdma_choose(t, 5, &a6, &p));
    CHECK(!strcmp(p.dev_name, "mlx5_1") && p.port == 2 && p.gid_index == 4);
    CHECK(!memcmp(p.gid.raw, &a6.in6.sin6_addr, 16));
    CHECK_EQ(bex__rdma_choose(t, 1, &a4, &p), -ENETDOWN);
    CHECK_EQ(bex__rdma_choose(t, 5, &other, &p), -ENODEV);
    return 0;
}

static int not_chosen(void)
{
    struct bex__rdma_gid_row t[] = {
        row("mlx4_0", 1, 0, V1, ETH, true, "10.0.0.1"),             /* RoCE v1 only */
        row("mlx5_ib", 1, 0, V2, IB, true, "fd00::2"),              /* an IB port */
        row("mlx5_ib", 1, 1, IBV_GID_TYPE_IB, IB, true, "fe80::1"), /* its port GID */
    };
    struct bex__rdma_path p;
    bex_addr a4 = A("10.0.0.1"), a6 = A("fd00::2"), ll = A("fe80::1"), none = {0};
    CHECK_EQ(bex__rdma_choose(t, 3, &a4, &p), -ENODEV);
    CHECK_EQ(bex__rdma_choose(t, 3, &a6, &p), -ENODEV);
    CHECK_EQ(bex__rdma_choose(t, 3, &ll, &p), -ENODEV);
    CHECK_EQ(bex__rdma_choose(t, 3, &none, &p), -EAFNOSUPPORT);
    return 0;
}

BEX_TEST_MAIN({"roce_v2", roce_v2}, {"not_chosen", not_chosen})
