/* SPDX-License-Identifier: Apache-2.0 */
/* bex_ctx_create's configuration checks, which run before any device is
 * opened (so no RDMA device is needed). */
#include <arpa/inet.h>

#include "bex/sock.h"
#include "harness.h"

static int create(uint32_t sq_depth)
{
    bex_ctx_config cfg = {.sq_depth = sq_depth};
    inet_pton(AF_INET, "127.0.0.1", &cfg.local_addr);
    bex_ctx *ctx = NULL;
    int rc = bex_ctx_create(&cfg, &ctx);
    if (rc == 0)
        bex_ctx_destroy(ctx);
    return rc;
}

/* Send slots are indexed by a 32-bit counter that wraps: only a power-of-two
 * chain maps it continuously, so other depths are refused. */
static int sq_depth_pow2(void)
{
    const uint32_t bad[] = {3, 24, 100, 1000, 4095};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_EQ(create(bad[i]), -EINVAL);
    /* accepted ones get past the check (then fail on the missing device,
     * or succeed where 127.0.0.1 has one) */
    const uint32_t good[] = {2, 32, 4096};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        CHECK(create(good[i]) != -EINVAL);
    CHECK_EQ(create(8192), -EINVAL); /* beyond the limit */
    return 0;
}

/* The names programs take for --poll map to their modes; anything else is
 * refused and leaves the mode as it was. */
static int poll_mode_parse(void)
{
    uint32_t m = 99;
    CHECK_EQ(bex_poll_mode_parse("spin-sleep", &m), 0);
    CHECK_EQ(m, BEX_POLL_SPIN_SLEEP);
    CHECK_EQ(bex_poll_mode_parse("busy", &m), 0);
    CHECK_EQ(m, BEX_POLL_BUSY);
    CHECK_EQ(bex_poll_mode_parse("event", &m), 0);
    CHECK_EQ(m, BEX_POLL_EVENT);
    const char *bad[] = {NULL, "", "Busy", "spin", "events", "busy "};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        m = 99;
        CHECK_EQ(bex_poll_mode_parse(bad[i], &m), -EINVAL);
        CHECK_EQ(m, 99);
    }
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(sq_depth_pow2), BEX_CASE(poll_mode_parse))
