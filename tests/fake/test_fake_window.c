/* SPDX-License-Identifier: Apache-2.0 */
/* The per-engine send window over the fake transport: payload bytes posted
 * and not completed never exceed send_window (the harness checks that at
 * every post, fake.c note_post), and the engine does fill it. */
#include "fake/fake.h"
#include "harness.h"

/* Send completions of side 0 are held back: the engine posts fragments of
 * a large message until the next one would not fit the window, and waits.
 * Each completion then lets exactly what it freed go. */
static int bound_reached(void)
{
    static const uint32_t windows[] = {4096, 6144, 8192, 12288, 65536};
    for (uint32_t wi = 0; wi < sizeof windows / sizeof windows[0]; wi++) {
        struct bex__engine_config c;
        fk_default_config(&c);
        c.send_window = windows[wi];
        c.sq_depth = 64;
        struct fk_pair p;
        fk_pair_init(&p, &c, &c, wi + 1);
        struct fk_stream *st = fk_open(&p);
        fk_quiesce(&p);
        struct fk_msg *big = fk_send(&p, st, 256 * 1024, true);
        uint32_t frag = c.frag_size < c.send_window ? c.frag_size : c.send_window;
        for (int round = 0; round < 50; round++) {
            for (int i = 0; i < 2; i++) {
                fk_progress(&p, i);
                while (fk_exec(&p, i))
                    ;
                while (fk_recv_cqe(&p, i))
                    ;
            }
        }
        /* full: what is in flight fits, one more fragment would not */
        CHECK(p.s[0].inflight <= c.send_window);
        CHECK(p.s[0].inflight + frag > c.send_window);
        CHECK(p.s[0].inflight > 0);
        CHECK(atomic_load(&p.s[0].stats.window_stalls) > 0);
        CHECK(!big->final_posted);
        fk_quiesce(&p);
        CHECK_EQ(big->delivered, 1);
        CHECK_EQ(p.s[0].max_inflight, c.send_window / frag * frag);
        fk_pair_fini(&p);
    }
    return 0;
}

/* Many sockets, small and large messages both ways, some into exposed
 * buffers, completions late at random: the window holds on every post. */
static int bound_kept(void)
{
    uint64_t fullest = 0;
    for (uint64_t seed = 1; seed <= 100; seed++) {
        struct bex__engine_config c;
        fk_default_config(&c);
        c.send_window = 4096u << (seed % 4);
        c.frag_size = 1024u << (seed / 4 % 4);
        c.eager_max = 1024;
        struct fk_pair p;
        fk_pair_init(&p, &c, &c, seed);
        struct fk_stream *st[4];
        for (int i = 0; i < 4; i++)
            st[i] = fk_open(&p);
        fk_quiesce(&p);
        for (int step = 0; step < 150; step++) {
            if (fk_rand(&p, 3) == 0) {
                int side = (int)fk_rand(&p, 2);
                struct fk_stream *s = st[fk_rand(&p, 4)];
                if (side)
                    s = fk_stream(&p, 1, s->id);
                uint32_t kind = fk_rand(&p, 3);
                uint32_t len = kind == 0 ? 8 + fk_rand(&p, 1000) : 1024 + fk_rand(&p, 64 * 1024);
                fk_send(&p, s, len, kind == 2);
            }
            fk_random_steps(&p, 20);
        }
        fk_quiesce(&p);
        for (uint32_t i = 0; i < p.n_msgs; i++)
            CHECK_EQ(p.msgs[i].delivered, 1);
        for (int i = 0; i < 2; i++) {
            uint64_t r = p.s[i].max_inflight * 100 / c.send_window;
            if (r > fullest)
                fullest = r;
        }
        fk_pair_fini(&p);
    }
    CHECK_EQ(fullest, 100); /* some schedule filled a window exactly */
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(bound_kept), BEX_CASE(bound_reached))
