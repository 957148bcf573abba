/* SPDX-License-Identifier: Apache-2.0 */
/* A context's RDMA provider options (bex_ctx_config: relaxed_ordering,
 * traffic_class, service_level, flow_label, thread_domains): their checks,
 * their defaults, and the thread-domain choice of an I/O thread. */
#include <errno.h>

#include "sock/internal.h"

/* DSCP 26 (AF31) with the ECN bits clear: the code point RoCE deployments
 * usually map to the priority that has PFC on, so a fabric configured that
 * way carries bex in its lossless class without per-application settings
 * (the paper's deployment runs RDMA in such a class). A fabric that does
 * not know DSCP 26 treats it as best effort, as it would 0. The ECN bits
 * are the NIC's: DCQCN sets ECT itself where it runs. */
#define TRAFFIC_CLASS_DEF 104u

int bex__ctx_rdma_opts_check(const bex_ctx_config *c)
{
    if (c->relaxed_ordering > BEX_SWITCH_OFF || c->thread_domains > BEX_SWITCH_OFF)
        return -EINVAL;
    /* 0..255 as is, BEX_TRAFFIC_CLASS(v) = 0x100 | v */
    if (c->traffic_class > 0x1ffu)
        return -EINVAL;
    /* RoCE: the SL is the 3-bit 802.1p priority; the flow label is 20 bits */
    if (c->service_level > 7 || c->flow_label > 0xfffffu)
        return -EINVAL;
    return 0;
}

void bex__ctx_qos(const bex_ctx_config *c, struct bex__rdma_conn_config *out)
{
    out->traffic_class = (uint8_t)(c->traffic_class ? c->traffic_class & 0xffu : TRAFFIC_CLASS_DEF);
    out->sl = (uint8_t)c->service_level;
    out->flow_label = c->flow_label;
}

int bex__ctx_reg_access(const bex_ctx_config *c, int access)
{
    /* Safe for every pool of the context: what a peer writes into one is
     * read after the completion of the write (a WRITE_WITH_IMM or SEND),
     * and a completion orders every write of the QP before it. */
    if (c->relaxed_ordering != BEX_SWITCH_OFF)
        access |= IBV_ACCESS_RELAXED_ORDERING;
    return access;
}

/* A thread domain tells the provider that one thread drives these QPs (no
 * locks, a doorbell of its own); QPs go on its parent domain over the
 * device's one PD. Without them (rxe: EOPNOTSUPP) AUTO puts the QPs on the
 * PD itself, said once per process; ON fails the context. */
int bex__io_td_pick(bex_ctx *ctx, struct bex__io *io)
{
    static _Atomic uint32_t td_said;
    uint32_t want = ctx->cfg.thread_domains;
    if (want == BEX_SWITCH_OFF)
        return 0;
    int err = bex__rdma_td_alloc(ctx->dev, &io->td);
    if (!err) {
        io->sh.pd = io->td->pd;
        return 0;
    }
    io->td = NULL;
    if (want == BEX_SWITCH_ON) {
        bex__log(
            &ctx->log, BEX_LOG_ERROR,
            "bex_ctx_create: thread_domains ON, but %s gave an I/O thread no thread domain (%s)",
            ctx->dev->name, bex_strerror(err));
        return err;
    }
    bex__log_once_atomic(&ctx->log, &td_said, 1, BEX_LOG_INFO,
                         "%s: no thread domains (%s): QPs on the protection domain itself",
                         ctx->dev->name, bex_strerror(err));
    return 0;
}
