/* SPDX-License-Identifier: Apache-2.0 */
/* common/heap.h and common/timer.h against a sorted reference. */
#include "common/timer.h"
#include "common/util.h"
#include "harness.h"

#define N 2000

static uint64_t rng = 2463534242ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static struct bex__timer tm[N];
static uint64_t fired_at[N];
static uint64_t order[N];
static unsigned nfired;
static uint64_t clock_now;

static void on_fire(struct bex__timer *t)
{
    size_t i = (size_t)(t - tm);
    CHECK(!t->active);
    CHECK(t->due <= clock_now);
    fired_at[i] = clock_now;
    order[nfired++] = i;
}

/* Random starts, restarts and stops; then time moves in random steps and
 * every timer must fire once, at its last deadline, in deadline order,
 * and never a stopped one. */
static int timers_random(void)
{
    struct bex__timers ts;
    static uint64_t due[N]; /* 0: stopped */
    bex__timers_init(&ts);
    for (int i = 0; i < N; i++)
        bex__timer_init(&tm[i], on_fire);
    for (int step = 0; step < 20000; step++) {
        int i = (int)(next_rand() % N);
        if (next_rand() % 4) {
            due[i] = 1 + next_rand() % 100000;
            bex__timer_start(&ts, &tm[i], due[i]);
        } else {
            bex__timer_stop(&ts, &tm[i]);
            due[i] = 0;
        }
        CHECK(ts.heap.n <= N);
    }
    unsigned running = 0;
    uint64_t min = UINT64_MAX;
    for (int i = 0; i < N; i++)
        if (due[i]) {
            running++;
            if (due[i] < min)
                min = due[i];
        }
    CHECK_EQ(ts.heap.n, running);
    CHECK_EQ(bex__timers_next(&ts), min);
    while (bex__timers_next(&ts) != UINT64_MAX) {
        clock_now += 1 + next_rand() % 500;
        bex__timers_run(&ts, clock_now);
        CHECK(bex__timers_next(&ts) > clock_now);
    }
    CHECK_EQ(nfired, running);
    for (unsigned k = 0; k < nfired; k++) {
        uint64_t i = order[k];
        CHECK(due[i] != 0);
        CHECK(fired_at[i] >= due[i]);
        if (k)
            CHECK(tm[order[k - 1]].due <= tm[i].due);
    }
    return 0;
}

static struct bex__timers self_ts;
static unsigned self_runs;
static void again(struct bex__timer *t)
{
    self_runs++;
    bex__timer_start(&self_ts, t, 0); /* already due: must not spin */
}

/* A callback that restarts its own timer in the past runs once per call. */
static int timers_no_spin(void)
{
    struct bex__timer t;
    bex__timers_init(&self_ts);
    bex__timer_init(&t, again);
    bex__timer_start(&self_ts, &t, 5);
    CHECK_EQ(bex__timers_run(&self_ts, 4), 0);
    CHECK_EQ(bex__timers_run(&self_ts, 10), 1);
    CHECK_EQ(bex__timers_run(&self_ts, 10), 1);
    CHECK_EQ(self_runs, 2);
    bex__timer_stop(&self_ts, &t);
    bex__timer_stop(&self_ts, &t); /* stopping a stopped timer: nothing */
    CHECK_EQ(bex__timers_next(&self_ts), UINT64_MAX);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(timers_random), BEX_CASE(timers_no_spin))
