/* SPDX-License-Identifier: Apache-2.0 */
/* The parts of the rdma module that need no device: PSNs, ids, MTU sizes,
 * completion-status translation, GID mapping, and device choice on an
 * address no device has. */
#include <arpa/inet.h>

#include "harness.h"
#include "rdma/rdma.h"

static int random_values(void)
{
    uint32_t first = bex__rdma_random_psn(), ors = 0;
    int differ = 0;
    for (int i = 0; i < 10000; i++) {
        uint32_t p = bex__rdma_random_psn();
        CHECK(p <= 0xffffffu);
        ors |= p;
        differ |= p != first;
        CHECK(bex__rdma_random_u64() != 0);
    }
    CHECK(differ);
    CHECK_EQ(ors, 0xffffff); /* every one of the 24 bits shows up */
    CHECK(bex__rdma_random_u64() != bex__rdma_random_u64());
    return 0;
}

static int mtu_sizes(void)
{
    CHECK_EQ(bex__rdma_mtu_bytes(IBV_MTU_256), 256);
    CHECK_EQ(bex__rdma_mtu_bytes(IBV_MTU_1024), 1024);
    CHECK_EQ(bex__rdma_mtu_bytes(IBV_MTU_4096), 4096);
    CHECK_EQ(bex__rdma_mtu_bytes((enum ibv_mtu)0), 0);
    CHECK_EQ(bex__rdma_mtu_bytes((enum ibv_mtu)6), 0);
    return 0;
}

static int error_translation(void)
{
    CHECK_EQ(bex__rdma_err(0), 0);
    CHECK_EQ(bex__rdma_err(EINVAL), -EINVAL);
    CHECK_EQ(bex__rdma_err(-EBUSY), -EBUSY);
    errno = ENOMEM;
    CHECK_EQ(bex__rdma_err(-1), -ENOMEM);
    CHECK_EQ(bex__rdma_errno(), -ENOMEM);
    errno = 0;
    CHECK_EQ(bex__rdma_errno(), -EIO); /* NULL without errno is still an error */

    CHECK_EQ(bex__rdma_wc_errno(IBV_WC_SUCCESS), 0);
    CHECK_EQ(bex__rdma_wc_errno(IBV_WC_WR_FLUSH_ERR), -ECANCELED);
    CHECK_EQ(bex__rdma_wc_errno(IBV_WC_RETRY_EXC_ERR), -ETIMEDOUT);
    CHECK_EQ(bex__rdma_wc_errno(IBV_WC_RNR_RETRY_EXC_ERR), -ENOBUFS);
    CHECK_EQ(bex__rdma_wc_errno(IBV_WC_REM_ACCESS_ERR), -EACCES);
    CHECK_EQ(bex__rdma_wc_errno(IBV_WC_LOC_LEN_ERR), -EMSGSIZE);
    CHECK_EQ(bex__rdma_wc_errno(IBV_WC_FATAL_ERR), -EIO);
    /* every failure status is an error, never 0 */
    for (int st = 1; st <= IBV_WC_TM_RNDV_INCOMPLETE; st++)
        CHECK(bex__rdma_wc_errno((enum ibv_wc_status)st) < 0);
    return 0;
}

static int gid_mapping(void)
{
    struct in_addr ip;
    CHECK(inet_pton(AF_INET, "10.99.0.2", &ip) == 1);
    union ibv_gid g;
    bex__rdma_gid_from_ipv4(ip, &g);
    static const uint8_t want[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 99, 0, 2};
    CHECK(memcmp(g.raw, want, 16) == 0);
    return 0;
}

/* 192.0.2.1 (TEST-NET-1) is nobody's address: -ENODEV with or without
 * devices. */
static int find_unknown_ip(void)
{
    struct in_addr ip;
    CHECK(inet_pton(AF_INET, "192.0.2.1", &ip) == 1);
    struct bex__rdma_path path;
    CHECK_EQ(bex__rdma_find_ipv4(ip, &path), -ENODEV);
    struct bex__rdma_dev *dev = NULL;
    CHECK_EQ(bex__rdma_dev_open_ipv4(ip, &dev, &path), -ENODEV);
    CHECK(dev == NULL);
    CHECK_EQ(bex__rdma_dev_open("bex-no-such-device", &dev), -ENODEV);
    CHECK_EQ(bex__rdma_dev_close(NULL), 0);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(random_values), BEX_CASE(mtu_sizes), BEX_CASE(error_translation),
              BEX_CASE(gid_mapping), BEX_CASE(find_unknown_ip))
