/* SPDX-License-Identifier: Apache-2.0 */
/* loop/loop.h: the wake-up protocol between pushers and a sleeping loop. */
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

BEX_TEST_MAIN(BEX_CASE(wake_once))
