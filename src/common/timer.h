/* SPDX-License-Identifier: Apache-2.0 */
/* Timers of one thread: a min-heap by deadline (common/heap.h). The thread
 * asks for the nearest deadline to bound its poll (bex__timers_next) and
 * runs what is due after it wakes (bex__timers_run). A timer carries its
 * callback; starting an active timer moves it. Times are whatever clock the
 * owner uses (the I/O threads': microseconds of CLOCK_MONOTONIC). One
 * owner, no locking, no allocation. */
#ifndef BEX_COMMON_TIMER_H
#define BEX_COMMON_TIMER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/heap.h"
#include "common/util.h"

struct bex__timer;
typedef void (*bex__timer_cb)(struct bex__timer *t);

struct bex__timer {
    struct bex__heap_node node; /* private */
    uint64_t due;
    uint64_t seq; /* private: equal deadlines run in start order */
    bex__timer_cb cb;
    bool active;
};

struct bex__timers {
    struct bex__heap heap;
    uint64_t seq;
    _Atomic uint64_t heap_ops; /* inserts and removes (one writer; tests read) */
};

void bex__timers_init(struct bex__timers *ts);
/* A timer that is not running, calling cb when it fires. */
void bex__timer_init(struct bex__timer *t, bex__timer_cb cb);
/* Runs t at due (again, if it was running: the old deadline is dropped). */
void bex__timer_start(struct bex__timers *ts, struct bex__timer *t, uint64_t due);
/* Stops t; nothing if it is not running. */
void bex__timer_stop(struct bex__timers *ts, struct bex__timer *t);
/* The nearest deadline, or UINT64_MAX when no timer runs. Inline: an
 * I/O loop asks twice a round trip (issue 25). */
static inline uint64_t bex__timers_next(const struct bex__timers *ts)
{
    const struct bex__heap_node *n = bex__heap_min(&ts->heap);
    return n ? bex__container_of(n, struct bex__timer, node)->due : UINT64_MAX;
}
/* Fires, in deadline order, the timers due at or before now (each is
 * stopped before its callback, which may start or stop any timer), but no
 * more callbacks than timers were running at the call: a callback that
 * starts its timer again for a time already past cannot keep this loop
 * busy (what is left fires at the next call). Returns how many fired. */
unsigned bex__timers_run(struct bex__timers *ts, uint64_t now);

#endif
