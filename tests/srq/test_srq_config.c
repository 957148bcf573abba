/* SPDX-License-Identifier: Apache-2.0 */
/* bex_ctx_config.srq_depth's checks, which run before any device is opened
 * (so no RDMA device is needed). */
#include <arpa/inet.h>

#include "bex/sock.h"
#include "harness.h"

static int create(uint32_t srq_depth, uint32_t rq_depth)
{
    bex_ctx_config cfg = {.srq_depth = srq_depth, .rq_depth = rq_depth};
    bex_addr_parse("127.0.0.1", 0, &cfg.local_addr);
    bex_ctx *ctx = NULL;
    int rc = bex_ctx_create(&cfg, &ctx);
    if (rc == 0)
        bex_ctx_destroy(ctx);
    return rc;
}

/* A queue must hold at least one peer's share, and at most 32768 receives. */
static int srq_depth_range(void)
{
    CHECK_EQ(create(63, 0), -EINVAL); /* below the default share of 64 */
    CHECK_EQ(create(15, 16), -EINVAL);
    CHECK_EQ(create(32769, 0), -EINVAL);
    CHECK_EQ(create(1u << 31, 8), -EINVAL);
    /* accepted ones get past the check (then work over TCP alone where
     * 127.0.0.1 has no device) */
    CHECK(create(0, 0) != -EINVAL);
    CHECK(create(64, 0) != -EINVAL);
    CHECK(create(16, 16) != -EINVAL);
    CHECK(create(32768, 4) != -EINVAL);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(srq_depth_range))
