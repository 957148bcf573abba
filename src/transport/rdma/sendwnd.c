/* SPDX-License-Identifier: Apache-2.0 */
/* The engine's send window: the static bound (cfg.send_window) or the
 * adaptive controller (transport/window.h), and the engine's share of its
 * destination's aggregate bound. See engine.h. */
#include "transport/rdma/engine_internal.h"

static bool adaptive(const struct bex__engine *e)
{
    return e->cfg.wnd_mode == BEX_WINDOW_ADAPTIVE;
}

void bex__engine_wnd_init(struct bex__engine *e)
{
    if (!adaptive(e))
        return;
    bex__wnd_init(&e->wnd, &e->cfg.wnd);
    BEX__STAT_ADD(e->stats, window_bytes, e->wnd.cwnd);
}

/* With the adaptive window the engine starts where the last engine to ip
 * left off (its memo: window and base delay), when there was one. */
void bex__engine_set_dest(struct bex__engine *e, uint32_t ip)
{
    if (e->dest)
        return;
    struct bex__wnd_memo m;
    e->dest = bex__wnd_dest_get(e->cfg.dests, ip, adaptive(e) ? &m : NULL);
    if (e->dest) {
        e->quiet_max = 0; /* its bound counts bytes: every chain signaled */
        bex__engine_alone_sync(e);
    }
    if (!e->dest || !adaptive(e))
        return;
    uint32_t old = e->wnd.cwnd;
    if (bex__wnd_resume(&e->wnd, &m, bex__now_us()))
        BEX__STAT_ADD(e->stats, window_bytes, (uint64_t)e->wnd.cwnd - old);
}

/* The engine's window now: 0 for none. */
uint32_t bex__engine_window(const struct bex__engine *e)
{
    return adaptive(e) ? e->wnd.cwnd : e->cfg.send_window;
}

bool bex__engine_window_take(struct bex__engine *e, uint32_t bytes)
{
    uint32_t w = bex__engine_window(e);
    bool alone = e->inflight == 0;
    if (bytes == 0)
        return true;
    if (w && !alone && e->inflight + bytes > w) {
        BEX__STAT_ADD(e->stats, window_stalls, 1);
        return false;
    }
    if (!e->dest)
        return true;
    uint64_t now;
    if (!bex__wnd_dest_take(e->dest, bytes, alone, &now)) {
        BEX__STAT_ADD(e->stats, dest_bound_hits, 1);
        return false;
    }
    if (now > atomic_load_explicit(&e->stats->dest_max_inflight, memory_order_relaxed))
        atomic_store_explicit(&e->stats->dest_max_inflight, now, memory_order_relaxed);
    return true;
}

/* A batch is posted: its last (signaled) slot s remembers when and how
 * many payload bytes, for the delay sample at its completion (a batch of
 * control messages alone is a sample too: a small one, near the base). */
void bex__engine_wnd_posted(struct bex__engine *e, struct sslot *s, uint32_t bytes)
{
    s->post_us = adaptive(e) ? bex__now_us() : 0;
    s->batch_bytes = bytes;
}

void bex__engine_wnd_completed(struct bex__engine *e, struct sslot *s)
{
    if (!s->post_us)
        return;
    uint64_t now = bex__now_us();
    uint64_t d = now - s->post_us;
    s->post_us = 0;
    uint64_t cuts = e->wnd.cuts;
    int64_t delta =
        bex__wnd_sample(&e->wnd, d > UINT32_MAX ? UINT32_MAX : (uint32_t)d, s->batch_bytes, now);
    struct bex__stats *st = e->stats;
    BEX__STAT_ADD(st, window_bytes, (uint64_t)delta);
    BEX__STAT_ADD(st, window_cuts, e->wnd.cuts - cuts);
    atomic_store_explicit(&st->window_delay_us, e->wnd.last_us, memory_order_relaxed);
    uint64_t b = atomic_load_explicit(&st->window_base_us, memory_order_relaxed);
    if (!b || e->wnd.base_us < b)
        atomic_store_explicit(&st->window_base_us, e->wnd.base_us, memory_order_relaxed);
}

/* The engine goes: its bytes in flight off its destination, its
 * controller's state left there for the next engine, its window off the
 * gauge. */
void bex__engine_wnd_fini(struct bex__engine *e)
{
    bex__engine_window_give(e, e->inflight);
    struct bex__wnd_memo m = {0};
    if (adaptive(e))
        bex__wnd_save(&e->wnd, bex__now_us(), &m);
    bex__wnd_dest_put(e->cfg.dests, e->dest, &m);
    e->dest = NULL;
    if (adaptive(e))
        BEX__STAT_ADD(e->stats, window_bytes, (uint64_t)0 - e->wnd.cwnd);
}
