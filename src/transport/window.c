/* SPDX-License-Identifier: Apache-2.0 */
/* The adaptive send window's controller and the per-destination bound
 * (window.h). */
#include "transport/window.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static uint32_t clamp(const struct bex__wnd_params *p, uint64_t v)
{
    if (v < p->min)
        return p->min;
    return v > p->max ? p->max : (uint32_t)v;
}

void bex__wnd_init(struct bex__wnd *w, const struct bex__wnd_params *p)
{
    memset(w, 0, sizeof(*w));
    w->p = *p;
    w->cwnd = clamp(p, p->init);
}

void bex__wnd_save(const struct bex__wnd *w, uint64_t now_us, struct bex__wnd_memo *m)
{
    *m = (struct bex__wnd_memo){.cwnd = w->cwnd, .base_us = w->base_us, .at_us = now_us};
}

bool bex__wnd_resume(struct bex__wnd *w, const struct bex__wnd_memo *m, uint64_t now_us)
{
    if (!m->base_us || now_us < m->at_us || now_us - m->at_us > BEX__WND_MEMO_MAX_US)
        return false;
    w->cwnd = clamp(&w->p, m->cwnd);
    w->base_us = m->base_us;
    /* the first sample ends this (empty) epoch: the memo's base becomes
     * the last epoch's minimum (base_update) */
    w->cur_min_us = m->base_us;
    w->epoch_end_us = 0;
    return true;
}

/* Below the target: BEX__WND_AI bytes more per window of bytes completed. */
static void grow(struct bex__wnd *w, uint32_t bytes)
{
    w->acc += (uint64_t)bytes * BEX__WND_AI;
    uint64_t inc = w->acc / w->cwnd;
    w->acc %= w->cwnd;
    w->cwnd = clamp(&w->p, (uint64_t)w->cwnd + inc);
}

/* BETA x how far v is above limit, of v (0 at or below it). */
static uint64_t excess_permille(uint32_t v, uint32_t limit)
{
    return v > limit ? (uint64_t)BEX__WND_BETA_PERMILLE * (v - limit) / v : 0;
}

/* Above the target or high_us: a cut in proportion to the excess (the
 * larger one), then none for one delay. */
static void cut(struct bex__wnd *w, uint32_t queue_us, uint32_t delay_us, uint64_t now_us)
{
    uint64_t pm = excess_permille(queue_us, w->p.target_us);
    uint64_t hi = w->p.high_us ? excess_permille(delay_us, w->p.high_us) : 0;
    if (hi > pm)
        pm = hi;
    if (pm > BEX__WND_MAX_CUT_PERMILLE)
        pm = BEX__WND_MAX_CUT_PERMILLE;
    if (pm < BEX__WND_MIN_CUT_PERMILLE)
        pm = BEX__WND_MIN_CUT_PERMILLE;
    w->cwnd = clamp(&w->p, w->cwnd - (uint64_t)w->cwnd * pm / 1000);
    w->next_cut_us = now_us + delay_us;
    w->acc = 0;
    w->cuts++;
}

/* The base: the smallest delay of all time, or with a ceiling and an
 * epoch, of this epoch and the last (a windowed minimum, as BBR's of the
 * round-trip time). Of all time, the engines that started on an empty path
 * keep a base the ones that started behind a standing queue never see:
 * for the same delay the first see more queueing than the others, cut
 * while the others grow, and sit at the floor (test_window.fair16). */
static void base_update(struct bex__wnd *w, uint32_t d, uint64_t now_us)
{
    if (!w->p.base_max_us || !w->p.base_epoch_us) {
        if (w->base_us == 0 || d < w->base_us)
            w->base_us = d;
        return;
    }
    if (now_us >= w->epoch_end_us) {
        w->prev_min_us = w->cur_min_us;
        w->cur_min_us = 0;
        w->epoch_end_us = now_us + w->p.base_epoch_us;
    }
    if (w->cur_min_us == 0 || d < w->cur_min_us)
        w->cur_min_us = d;
    w->base_us = w->prev_min_us && w->prev_min_us < w->cur_min_us ? w->prev_min_us : w->cur_min_us;
}

int64_t bex__wnd_sample(struct bex__wnd *w, uint32_t delay_us, uint32_t bytes, uint64_t now_us)
{
    uint32_t old = w->cwnd;
    w->last_us = delay_us;
    base_update(w, delay_us ? delay_us : 1, now_us);
    /* An engine that starts behind a standing queue never sees the path
     * empty: its smallest sample holds the queue, which it would then keep
     * (and add to until drops). A base above the ceiling is such a queue. */
    if (w->p.base_max_us && w->base_us > w->p.base_max_us)
        w->base_us = w->p.base_max_us;
    uint32_t queue_us = delay_us > w->base_us ? delay_us - w->base_us : 0;
    bool high = w->p.high_us && delay_us > w->p.high_us;
    if (queue_us <= w->p.target_us && !high)
        grow(w, bytes);
    else if (now_us >= w->next_cut_us)
        cut(w, queue_us, delay_us, now_us);
    return (int64_t)w->cwnd - (int64_t)old;
}

int bex__wnd_dests_init(struct bex__wnd_dests *d, uint64_t bound)
{
    memset(d, 0, sizeof(*d));
    d->bound = bound;
    return -pthread_mutex_init(&d->lock, NULL);
}

void bex__wnd_dests_free(struct bex__wnd_dests *d)
{
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    for (void *x; (x = bex__hmap_next(&d->map, &it, NULL));)
        free(x);
    bex__hmap_free(&d->map);
    pthread_mutex_destroy(&d->lock);
}

struct bex__wnd_dest *bex__wnd_dest_get(struct bex__wnd_dests *d, uint32_t ip,
                                        struct bex__wnd_memo *memo)
{
    if (memo)
        *memo = (struct bex__wnd_memo){0};
    if (!d || !d->bound)
        return NULL;
    pthread_mutex_lock(&d->lock);
    struct bex__wnd_dest *x = bex__hmap_get(&d->map, ip);
    if (!x && (x = calloc(1, sizeof(*x)))) {
        x->ip = ip;
        x->bound = d->bound;
        if (bex__hmap_put(&d->map, ip, x)) {
            free(x);
            x = NULL;
        }
    }
    if (x) {
        if (x->refs++ == 0 && x->memo.base_us)
            d->memos--; /* memo-only no more */
        if (memo)
            *memo = x->memo;
    }
    pthread_mutex_unlock(&d->lock);
    return x;
}

static void drop_entry(struct bex__wnd_dests *d, struct bex__wnd_dest *x)
{
    bex__hmap_del(&d->map, x->ip);
    free(x);
}

/* Over BEX__WND_MEMOS_MAX memo-only entries (under the lock): drop those
 * whose memo is older than BEX__WND_MEMO_MAX_US at now_us (the newest
 * memo's time), then, while still over, the oldest. O(table) per call: it
 * runs only when an engine goes with the table full of memos. */
static void trim_memos(struct bex__wnd_dests *d, uint64_t now_us)
{
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    struct bex__wnd_dest *oldest = NULL;
    for (struct bex__wnd_dest *x; (x = bex__hmap_next(&d->map, &it, NULL));) {
        if (x->refs || !x->memo.base_us)
            continue;
        if (x->memo.at_us + BEX__WND_MEMO_MAX_US < now_us) {
            drop_entry(d, x); /* iteration may remove what it returned */
            d->memos--;
        } else if (!oldest || x->memo.at_us < oldest->memo.at_us) {
            oldest = x;
        }
    }
    if (d->memos > BEX__WND_MEMOS_MAX && oldest) {
        drop_entry(d, oldest);
        d->memos--;
    }
}

void bex__wnd_dest_put(struct bex__wnd_dests *d, struct bex__wnd_dest *x,
                       const struct bex__wnd_memo *memo)
{
    if (!x)
        return;
    pthread_mutex_lock(&d->lock);
    if (memo && memo->base_us)
        x->memo = *memo;
    if (--x->refs == 0) {
        if (!x->memo.base_us) {
            drop_entry(d, x);
        } else if (++d->memos > BEX__WND_MEMOS_MAX) {
            trim_memos(d, x->memo.at_us);
        }
    }
    pthread_mutex_unlock(&d->lock);
}

bool bex__wnd_dest_take(struct bex__wnd_dest *x, uint64_t bytes, bool alone, uint64_t *now)
{
    uint64_t cur = atomic_load_explicit(&x->inflight, memory_order_relaxed);
    do {
        if (!alone && cur + bytes > x->bound)
            return false;
    } while (!atomic_compare_exchange_weak_explicit(&x->inflight, &cur, cur + bytes,
                                                    memory_order_relaxed, memory_order_relaxed));
    *now = cur + bytes;
    return true;
}

void bex__wnd_dest_give(struct bex__wnd_dest *x, uint64_t bytes)
{
    atomic_fetch_sub_explicit(&x->inflight, bytes, memory_order_relaxed);
}
