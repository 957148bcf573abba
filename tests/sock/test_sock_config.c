/* SPDX-License-Identifier: Apache-2.0 */
/* bex_ctx_create's configuration checks, which run before any device is
 * opened (so no RDMA device is needed). */
#include <arpa/inet.h>

#include "bex/sock.h"
#include "harness.h"
#include "sock/internal.h" /* bex__ctx_qos, bex__ctx_reg_access */

static int create(uint32_t sq_depth)
{
    bex_ctx_config cfg = {.sq_depth = sq_depth};
    bex_addr_parse("127.0.0.1", 0, &cfg.local_addr);
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

static int create_cfg(bex_ctx_config cfg)
{
    bex_addr_parse("127.0.0.1", 0, &cfg.local_addr);
    cfg.transport = BEX_TRANSPORT_TCP; /* past the checks, no device needed */
    bex_ctx *ctx = NULL;
    int rc = bex_ctx_create(&cfg, &ctx);
    if (rc == 0)
        bex_ctx_destroy(ctx);
    return rc;
}

/* The RDMA provider options (issue 24 item 1) refuse what no device takes. */
static int rdma_opts_range(void)
{
    CHECK_EQ(create_cfg((bex_ctx_config){.relaxed_ordering = 3}), -EINVAL);
    CHECK_EQ(create_cfg((bex_ctx_config){.thread_domains = 3}), -EINVAL);
    CHECK_EQ(create_cfg((bex_ctx_config){.traffic_class = 0x200}), -EINVAL);
    CHECK_EQ(create_cfg((bex_ctx_config){.service_level = 8}), -EINVAL);
    CHECK_EQ(create_cfg((bex_ctx_config){.flow_label = 0x100000}), -EINVAL);
    CHECK_OK(create_cfg((bex_ctx_config){.relaxed_ordering = BEX_SWITCH_OFF,
                                         .thread_domains = BEX_SWITCH_ON,
                                         .traffic_class = BEX_TRAFFIC_CLASS(0),
                                         .service_level = 7,
                                         .flow_label = 0xfffff}));
    CHECK_OK(create_cfg((bex_ctx_config){.traffic_class = 255}));
    return 0;
}

/* What the QPs and registrations get from the options: the default traffic
 * class 104 (DSCP 26), an explicit 0 through BEX_TRAFFIC_CLASS, relaxed
 * ordering unless OFF. */
static int rdma_opts_defaults(void)
{
    struct bex__rdma_conn_config q = {0};
    bex__ctx_qos(&(bex_ctx_config){0}, &q);
    CHECK_EQ(q.traffic_class, 104);
    CHECK_EQ(q.sl, 0);
    CHECK_EQ(q.flow_label, 0);
    bex__ctx_qos(&(bex_ctx_config){.traffic_class = BEX_TRAFFIC_CLASS(0)}, &q);
    CHECK_EQ(q.traffic_class, 0);
    bex__ctx_qos(
        &(bex_ctx_config){.traffic_class = 46 << 2, .service_level = 3, .flow_label = 0xabcde}, &q);
    CHECK_EQ(q.traffic_class, 184);
    CHECK_EQ(q.sl, 3);
    CHECK_EQ(q.flow_label, 0xabcde);
    const int lw = IBV_ACCESS_LOCAL_WRITE;
    CHECK_EQ(bex__ctx_reg_access(&(bex_ctx_config){0}, lw), lw | IBV_ACCESS_RELAXED_ORDERING);
    CHECK_EQ(bex__ctx_reg_access(&(bex_ctx_config){.relaxed_ordering = BEX_SWITCH_ON}, lw),
             lw | IBV_ACCESS_RELAXED_ORDERING);
    CHECK_EQ(bex__ctx_reg_access(&(bex_ctx_config){.relaxed_ordering = BEX_SWITCH_OFF}, lw), lw);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(sq_depth_pow2), BEX_CASE(poll_mode_parse), BEX_CASE(rdma_opts_range),
              BEX_CASE(rdma_opts_defaults))
