/* SPDX-License-Identifier: Apache-2.0 */
/* A context's send-window settings (bex_ctx_config.send_window_*): their
 * defaults and checks, what the engines get of them, and the table of
 * per-destination bounds the engines share (transport/window.h). */
#include <errno.h>
#include <stdint.h>

#include "sock/internal.h"

#define WND_MIN_DEF       1024u
#define WND_MAX_DEF       262144u
#define WND_INIT_DEF      16384u
#define WND_TARGET_US_DEF 1000u
#define WND_DEST_DEF      262144u
#define WND_EPOCH_MS_DEF  2000u

int bex__ctx_window_check(bex_ctx_config *c)
{
    if (c->send_window_mode > BEX_WINDOW_ADAPTIVE)
        return -EINVAL;
    if (!c->send_window_min)
        c->send_window_min = WND_MIN_DEF;
    if (!c->send_window_max)
        c->send_window_max = WND_MAX_DEF;
    if (!c->send_window_target_us)
        c->send_window_target_us = WND_TARGET_US_DEF;
    if (!c->send_window_base_epoch_ms)
        c->send_window_base_epoch_ms = WND_EPOCH_MS_DEF;
    if (!c->send_window_dest && c->send_window_mode == BEX_WINDOW_ADAPTIVE)
        c->send_window_dest = WND_DEST_DEF;
    /* a window below a header-free SEND's worth would only add work requests */
    if (c->send_window_min < 256 || c->send_window_min > c->send_window_max)
        return -EINVAL;
    return 0;
}

void bex__ctx_window_params(const bex_ctx_config *c, struct bex__wnd_params *p)
{
    /* the verbs local ACK timeout: 4.096 us << qp_timeout, 0 infinite */
    uint64_t rto_us = c->qp_timeout ? (4096ull << c->qp_timeout) / 1000 : 0;
    *p = (struct bex__wnd_params){.min = c->send_window_min,
                                  .max = c->send_window_max,
                                  .init = c->send_window ? c->send_window : WND_INIT_DEF,
                                  .target_us = c->send_window_target_us,
                                  .base_max_us = c->send_window_base_max_us,
                                  .base_epoch_us = c->send_window_base_epoch_ms * 1000ull,
                                  .high_us = rto_us / 2 > UINT32_MAX ? UINT32_MAX
                                                                     : (uint32_t)(rto_us / 2)};
}

void bex__ctx_window_init(bex_ctx *ctx)
{
    const bex_ctx_config *c = &ctx->cfg;
    uint64_t dest = c->send_window_dest == UINT32_MAX ? 0 : c->send_window_dest;
    /* cannot fail on Linux (a default mutex) */
    (void)bex__wnd_dests_init(&ctx->dests, dest);
    struct bex__engine_config *e = &ctx->ecfg;
    e->wnd_mode = c->send_window_mode;
    bex__ctx_window_params(c, &e->wnd);
    e->dests = dest ? &ctx->dests : NULL;
}

void bex__ctx_window_fini(bex_ctx *ctx)
{
    bex__wnd_dests_free(&ctx->dests);
}

/* An I/O thread's gauges into the context's: the smallest base delay, the
 * largest last sample and aggregate seen (the sums are bex_ctx_stats'). */
void bex__ctx_window_stats(struct bex__stats *s, bex_sock_stats *o)
{
    uint64_t b = atomic_load_explicit(&s->window_base_us, memory_order_relaxed);
    if (b && (!o->window_base_us || b < o->window_base_us))
        o->window_base_us = b;
    uint64_t d = atomic_load_explicit(&s->window_delay_us, memory_order_relaxed);
    if (d > o->window_delay_us)
        o->window_delay_us = d;
    uint64_t m = atomic_load_explicit(&s->dest_max_inflight, memory_order_relaxed);
    if (m > o->dest_max_inflight)
        o->dest_max_inflight = m;
}
