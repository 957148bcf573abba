/* SPDX-License-Identifier: Apache-2.0 */
/* Keepalive writes of the engine, over the fake transport: an engine that
 * posts messages the peer receives (SEND, WRITE_WITH_IMM) writes no
 * keepalive word, because the peer counts every receive as a sign of life
 * (engine.c, bex__engine_tick); a quiet engine writes one every
 * keepalive_ms, and neither side times out either way. At 1024 connections
 * with one message each in flight, the writes were 0.4 extra doorbells and
 * signaled completions per message (docs/benchmarks.md, qp-scale). */
#include "fake/fake.h"
#include "harness.h"

/* Both sides tick, rounds times, step_ms apart; before each tick, when
 * talk is set, each side sends one message on st (side 1 on its half). */
static void run_rounds(struct fk_pair *p, struct fk_stream *st, uint32_t rounds, uint32_t step_ms,
                       bool talk)
{
    struct fk_stream *back = fk_stream(p, 1, st->id);
    for (uint32_t r = 0; r < rounds; r++) {
        if (talk) {
            fk_send(p, st, 64, false);
            fk_send(p, back, 64, false);
        }
        fk_quiesce(p);
        fk_tick(p, 0, step_ms);
        fk_tick(p, 1, 0);
        fk_quiesce(p);
    }
}

/* Ping-pong at ten messages per keepalive period for 5 s: no keepalive
 * writes after the first tick (the code before wrote one per second and
 * side: 5 or 6 each); every message arrives. */
static int quiet_when_busy(void)
{
    struct bex__engine_config c;
    fk_default_config(&c); /* keepalive_ms 1000 */
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 11);
    p.virt_clock = true;
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    CHECK(fk_stream(&p, 1, st->id) != NULL);
    /* the first tick of a side may find its first keepalive due */
    uint32_t before[2] = {p.s[0].ka_writes, p.s[1].ka_writes};
    run_rounds(&p, st, 50, 100, true);
    CHECK(p.s[0].ka_writes - before[0] <= 1);
    CHECK(p.s[1].ka_writes - before[1] <= 1);
    CHECK(!fk_dead(&p, 0) && !fk_dead(&p, 1));
    for (uint32_t i = 0; i < p.n_msgs; i++)
        CHECK_EQ(p.msgs[i].delivered, 1);
    fk_pair_fini(&p);
    return 0;
}

/* Nothing to send for 5 s: each side still writes its word about once a
 * second. */
static int writes_when_quiet(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 12);
    p.virt_clock = true;
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    uint32_t before[2] = {p.s[0].ka_writes, p.s[1].ka_writes};
    run_rounds(&p, st, 50, 100, false);
    for (int i = 0; i < 2; i++) {
        uint32_t n = p.s[i].ka_writes - before[i];
        CHECK(n >= 4 && n <= 6);
    }
    CHECK(!fk_dead(&p, 0) && !fk_dead(&p, 1));
    fk_pair_fini(&p);
    return 0;
}

/* A short keepalive timeout (keepalive_ms 100, timeout 350): one side
 * sends a message every 50 ms and the other only returns credits (a CREDIT
 * message every k = 8 receives, 400 ms apart, beyond the timeout), then both
 * go quiet: no side ever times out, since the one that does not hear from a
 * message writes its word, and the quiet side's peer hears its writes. */
static int alive_one_way(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    c.keepalive_ms = 100;
    c.keepalive_timeout_ms = 350;
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 13);
    p.virt_clock = true;
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    uint32_t before1 = p.s[1].ka_writes;
    for (uint32_t r = 0; r < 100; r++) {
        fk_send(&p, st, 64, false);
        fk_quiesce(&p);
        fk_tick(&p, 0, 50);
        fk_tick(&p, 1, 0);
        fk_quiesce(&p);
    }
    CHECK(!fk_dead(&p, 0) && !fk_dead(&p, 1));
    CHECK(p.s[1].ka_writes > before1); /* the receiving side kept writing */
    run_rounds(&p, st, 40, 50, false);
    CHECK(!fk_dead(&p, 0) && !fk_dead(&p, 1));
    for (uint32_t i = 0; i < p.n_msgs; i++)
        CHECK_EQ(p.msgs[i].delivered, 1);
    fk_pair_fini(&p);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(quiet_when_busy), BEX_CASE(writes_when_quiet), BEX_CASE(alive_one_way))
