/* SPDX-License-Identifier: Apache-2.0 */
/* bex-engine-fake: the RDMA engine's per-message path counted without a
 * device or a VM. ROUNDS 32-byte ping-pongs between two engines joined by
 * the fake NIC of tests/fake (fake.h), side 1 answering from the upcall of
 * each message as bex-perf's server does. Run under callgrind twice, at
 * two lengths, and take the difference (bench/cost/callgrind-diff): the
 * engine's functions count what they count a side on rxe, times two (both
 * sides run here), but bex__engine_progress, which the fake's driver calls
 * about three times a side a round trip (the I/O thread about once).
 *   valgrind --tool=callgrind --callgrind-out-file=cg.200 build/bench/cost/bex-engine-fake 200
 *   valgrind --tool=callgrind --callgrind-out-file=cg.1200 build/bench/cost/bex-engine-fake 1200
 *   bench/cost/callgrind-diff 1000 cg.200 cg.1200 1
 * The fake's own checks (fk_*) are in the counts too: read the engine's
 * functions only. A second argument "now": side 1 answers by
 * bex__engine_send_now, as a socket's send from a callback does (the
 * sock layer's direct send), rather than bex__engine_send. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake/fake.h"

static void answer_in_upcall(struct fk_pair *p, int side, uint32_t stream)
{
    if (side == 1)
        fk_send(p, fk_stream(p, 1, stream), 32, false);
}

static void answer_now_in_upcall(struct fk_pair *p, int side, uint32_t stream)
{
    if (side == 1)
        fk_send_now(p, fk_stream(p, 1, stream), 32);
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 0;
    if (rounds <= 0 || rounds > FK_MAX_MSGS / 2 - 8) {
        fprintf(stderr, "usage: bex-engine-fake ROUNDS (1 to %d) [now]\n", FK_MAX_MSGS / 2 - 8);
        return 2;
    }
    struct bex__engine_config c;
    fk_default_config(&c);
    static struct fk_pair p;
    fk_pair_init(&p, &c, &c, 8);
    p.virt_clock = true;
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    p.on_msg = argc > 2 && strcmp(argv[2], "now") == 0 ? answer_now_in_upcall : answer_in_upcall;
    for (int r = 0; r < rounds; r++) {
        struct fk_msg *m = fk_send(&p, st, 32, false);
        fk_quiesce(&p);
        /* the answer arrived, and carried the credit that reports m */
        if (m->done != 1 || p.msgs[p.n_msgs - 1].delivered != 1) {
            fprintf(stderr, "bex-engine-fake: round %d: the answer or its report is missing\n", r);
            return 1;
        }
    }
    p.on_msg = NULL;
    fk_pair_fini(&p);
    printf("bex-engine-fake: %d round trips\n", rounds);
    return 0;
}
