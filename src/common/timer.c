/* SPDX-License-Identifier: Apache-2.0 */
/* Timers on the intrusive heap (common/timer.h). */
#include "common/timer.h"

#include "common/util.h"

static bool timer_less(const struct bex__heap_node *a, const struct bex__heap_node *b)
{
    const struct bex__timer *x = bex__container_of(a, struct bex__timer, node);
    const struct bex__timer *y = bex__container_of(b, struct bex__timer, node);
    return x->due < y->due || (x->due == y->due && x->seq < y->seq);
}

void bex__timers_init(struct bex__timers *ts)
{
    bex__heap_init(&ts->heap, timer_less);
    ts->seq = 0;
    atomic_init(&ts->heap_ops, 0);
}

static void count_ops(struct bex__timers *ts, uint64_t n)
{
    atomic_store_explicit(&ts->heap_ops,
                          atomic_load_explicit(&ts->heap_ops, memory_order_relaxed) + n,
                          memory_order_relaxed);
}

void bex__timer_init(struct bex__timer *t, bex__timer_cb cb)
{
    *t = (struct bex__timer){.cb = cb};
}

void bex__timer_start(struct bex__timers *ts, struct bex__timer *t, uint64_t due)
{
    count_ops(ts, t->active ? 2 : 1);
    if (t->active)
        bex__heap_remove(&ts->heap, &t->node);
    t->due = due;
    t->seq = ts->seq++;
    t->active = true;
    bex__heap_insert(&ts->heap, &t->node);
}

void bex__timer_stop(struct bex__timers *ts, struct bex__timer *t)
{
    if (!t->active)
        return;
    count_ops(ts, 1);
    bex__heap_remove(&ts->heap, &t->node);
    t->active = false;
}

unsigned bex__timers_run(struct bex__timers *ts, uint64_t now)
{
    unsigned fired = 0, budget = ts->heap.n;
    while (fired < budget) {
        struct bex__heap_node *n = bex__heap_min(&ts->heap);
        if (!n)
            break;
        struct bex__timer *t = bex__container_of(n, struct bex__timer, node);
        if (t->due > now)
            break;
        bex__timer_stop(ts, t);
        fired++;
        t->cb(t);
    }
    return fired;
}
