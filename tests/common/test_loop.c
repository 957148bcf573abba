/* SPDX-License-Identifier: Apache-2.0 */
/* loop/loop.h: the wake-up protocol between pushers and a sleeping loop. */
#include <errno.h>
#include <unistd.h>

#include "harness.h"
#include "loop/loop.h"

/* The eventfd's count (the writes since the last read), 0 if none. */
static uint64_t evfd_count(struct bex__loop *l)
{
    uint64_t v = 0;
    if (read(l->evfd, &v, sizeof v) != (ssize_t)sizeof v)
        return 0;
    return v;
}

/* Commands pushed one after another while the loop sleeps wake it once
 * (one eventfd write: a Fetch over 8 shards pushes 8 calls in a row,
 * issue 25 item 5); every command is taken, in order; and the next sleep
 * is woken again. */
static int wake_once(void)
{
    struct bex__loop l;
    CHECK_OK(bex__loop_init(&l));
    struct bex__cmd c[3];
    for (int round = 0; round < 2; round++) {
        bex__loop_sleep_begin(&l);
        for (int i = 0; i < 3; i++)
            bex__loop_push(&l, &c[i], 10 * round + i);
        CHECK_EQ(evfd_count(&l), 1);
        bex__loop_sleep_end(&l);
        struct bex__cmd *t = bex__loop_take(&l);
        for (int i = 0; i < 3; i++, t = t->next) {
            CHECK(t == &c[i]);
            CHECK_EQ(t->type, 10 * round + i);
        }
        CHECK(t == NULL);
    }
    /* awake: a push writes nothing (the loop looks before it sleeps) */
    bex__loop_push(&l, &c[0], 0);
    CHECK_EQ(evfd_count(&l), 0);
    CHECK(bex__loop_take(&l) == &c[0]);
    bex__loop_fini(&l);
    return 0;
}

/* The loop's timer (bex__loop_timer): its expiry ends a wait that has no
 * timeout, not before its deadline, and is consumed there (no event
 * returned, tfd_due back to 0); armed again after an expiry it never read
 * (edge-triggered), it ends the next wait again; a command's wake-up
 * while it is armed leaves it armed; a deadline already past ends the
 * next wait at once. */
static int timer_edges(void)
{
    struct bex__loop l;
    CHECK_OK(bex__loop_init(&l));
    CHECK_EQ(l.tfd_due, 0);
    struct epoll_event ev[4];
    for (int round = 0; round < 3; round++) {
        uint64_t due = bex__now_us() + 3000;
        bex__loop_timer(&l, due);
        CHECK_EQ(l.tfd_due, due);
        CHECK_EQ(bex__loop_wait(&l, ev, 4, -1), 0);
        CHECK(bex__now_us() >= due);
        CHECK_EQ(l.tfd_due, 0);
    }
    /* armed far ahead: a command wakes the wait, the timer stays armed */
    uint64_t far = bex__now_us() + 3600ull * 1000000;
    bex__loop_timer(&l, far);
    struct bex__cmd c;
    bex__loop_sleep_begin(&l);
    bex__loop_push(&l, &c, 1);
    CHECK_EQ(bex__loop_wait(&l, ev, 4, -1), 0);
    bex__loop_sleep_end(&l);
    CHECK(bex__loop_take(&l) == &c);
    CHECK_EQ(l.tfd_due, far);
    /* re-armed for a time already past: the next wait ends at once */
    uint64_t past = bex__now_us() - 1;
    bex__loop_timer(&l, past);
    CHECK_EQ(l.tfd_due, past);
    CHECK_EQ(bex__loop_wait(&l, ev, 4, -1), 0);
    CHECK_EQ(l.tfd_due, 0);
    /* 0 disarms: no expiry after the deadline it replaced */
    bex__loop_timer(&l, bex__now_us() + 1000);
    bex__loop_timer(&l, 0);
    CHECK_EQ(l.tfd_due, 0);
    CHECK_EQ(bex__loop_wait(&l, ev, 4, 20), 0);
    uint64_t v;
    CHECK(read(l.tfd, &v, sizeof v) < 0 && errno == EAGAIN);
    bex__loop_fini(&l);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(wake_once), BEX_CASE(timer_edges))
