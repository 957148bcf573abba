/* SPDX-License-Identifier: Apache-2.0 */
/* A clock for the RPC layer (bex__rpc_clock_hook) that a case stops and
 * moves: the real monotonic one while still_ns is 0, else standing at
 * still_ns, so that deadlines, Tc and hold-downs are judged on the clock
 * they are kept by, whatever the host's load. Hook still_clock before the
 * channels exist (their timer threads look at it every millisecond from
 * the start). One per test program. */
#ifndef BEX_TEST_STILL_CLOCK_H
#define BEX_TEST_STILL_CLOCK_H

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

static _Atomic uint64_t still_ns; /* 0: the real clock */

static inline uint64_t still_real_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
}

static inline uint64_t still_clock(void)
{
    uint64_t v = atomic_load(&still_ns);
    return v ? v : still_real_ns();
}

/* The clock stops, a second ahead of the real one (past every time read
 * from it so far: it stays monotonic); its time. */
static inline uint64_t still_freeze(void)
{
    atomic_store(&still_ns, still_real_ns() + 1000000000ull);
    return atomic_load(&still_ns);
}

static inline void still_advance_ms(uint64_t ms)
{
    atomic_fetch_add(&still_ns, ms * 1000000ull);
}

#endif
