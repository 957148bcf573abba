/* SPDX-License-Identifier: Apache-2.0 */
/* The fragment scheduler's fairness bound (paper §6.1, docs/architecture.md
 * "Scheduler"): with n sockets that have work on one engine and fragment
 * size S, at most (n-1)S payload bytes of the other sockets are posted
 * between two turns of a socket, and a socket that gets work waits for at
 * most (n-1)S bytes of the others before its first request goes.
 *
 * The sockets send into buffers the peer exposed (no rendezvous): a socket
 * waiting for a rendezvous answer has no turn to take (it leaves the ring
 * until the answer comes), and the bound is about sockets that have work.
 * Message lengths are multiples of S, so every fragment is S bytes, and
 * the peer has receives enough that no last fragment waits for a credit
 * while others' middle fragments go. */
#include "fake/fake.h"
#include "harness.h"

enum { MAX_POSTS = 1 << 16 };
static struct {
    uint32_t stream[MAX_POSTS];
    uint32_t bytes[MAX_POSTS];
    uint32_t n;
} rec;

static void record(struct fk_pair *p, int side, const struct fk_wr *w, struct fk_msg *m)
{
    (void)p;
    if (side != 0)
        return;
    CHECK(m != NULL && rec.n < MAX_POSTS);
    rec.stream[rec.n] = m->stream;
    rec.bytes[rec.n++] = w->payload;
}

static void config(struct bex__engine_config *c)
{
    fk_default_config(c);
    c->frag_size = 4096;
    c->rq_depth = 128;
    c->sq_depth = 32;
}

/* n sockets, each with a few messages of 4..8 fragments, completions at
 * random: between two posts of a socket, the others posted at most
 * (n-1)S, and while all are busy exactly that. */
static int between_turns(void)
{
    const uint32_t S = 4096;
    for (uint32_t n = 2; n <= 6; n++) {
        for (uint64_t seed = 1; seed <= 20; seed++) {
            struct bex__engine_config c;
            config(&c);
            struct fk_pair p;
            fk_pair_init(&p, &c, &c, seed * 10 + n);
            p.on_post = record;
            rec.n = 0;
            struct fk_stream *st[8];
            for (uint32_t i = 0; i < n; i++)
                st[i] = fk_open(&p);
            fk_quiesce(&p);
            for (uint32_t k = 0; k < 3; k++)
                for (uint32_t i = 0; i < n; i++)
                    fk_send(&p, st[i], S * (4 + fk_rand(&p, 5)), true);
            for (int step = 0; step < 20000 && p.s[1].delivered < 3 * n; step++)
                fk_random_steps(&p, 1);
            fk_quiesce(&p);
            CHECK_EQ(p.s[1].delivered, 3 * n);
            uint64_t widest = 0;
            for (uint32_t i = 0; i < n; i++) {
                uint64_t others = 0;
                bool seen = false;
                for (uint32_t k = 0; k < rec.n; k++) {
                    CHECK_EQ(rec.bytes[k], S);
                    if (rec.stream[k] != st[i]->id) {
                        others += rec.bytes[k];
                        continue;
                    }
                    if (seen) {
                        if (others > (n - 1) * S)
                            fprintf(stderr, "n %u seed %llu: socket %u waited for %llu bytes\n", n,
                                    (unsigned long long)seed, st[i]->id,
                                    (unsigned long long)others);
                        CHECK(others <= (n - 1) * S);
                        if (others > widest)
                            widest = others;
                    }
                    seen = true;
                    others = 0;
                }
            }
            /* while every socket had work, each waited for all the others */
            CHECK_EQ(widest, (n - 1) * S);
            fk_pair_fini(&p);
        }
    }
    return 0;
}

/* n-1 sockets stream; one more gets a small message now and then: before
 * it goes, the others post at most (n-1)S (it is served last in the round
 * it joins, not after the others' queues). */
static int newcomer(void)
{
    const uint32_t S = 4096;
    for (uint32_t n = 2; n <= 6; n++) {
        for (uint64_t seed = 1; seed <= 10; seed++) {
            struct bex__engine_config c;
            config(&c);
            struct fk_pair p;
            fk_pair_init(&p, &c, &c, seed * 10 + n);
            struct fk_stream *st[8];
            for (uint32_t i = 0; i < n; i++)
                st[i] = fk_open(&p);
            fk_quiesce(&p);
            for (uint32_t i = 1; i < n; i++)
                for (uint32_t k = 0; k < 3; k++)
                    fk_send(&p, st[i], S * 32, true);
            struct fk_msg *small[64];
            uint32_t n_small = 0;
            uint64_t waited_max = 0;
            for (int step = 0; step < 4000; step++) {
                /* one at a time: a second one would wait behind the first */
                if (fk_rand(&p, 40) == 0 && n_small < 64 &&
                    (n_small == 0 || small[n_small - 1]->final_posted))
                    small[n_small++] = fk_send(&p, st[0], 64, false);
                fk_random_steps(&p, 1);
            }
            fk_quiesce(&p);
            CHECK(n_small > 10);
            for (uint32_t k = 0; k < n_small; k++) {
                CHECK_EQ(small[k]->delivered, 1);
                /* payload bytes the engine posted from its enqueue to it */
                uint64_t waited = small[k]->posted_bytes_at - small[k]->post_bytes_at;
                CHECK(waited <= (n - 1) * S);
                if (waited > waited_max)
                    waited_max = waited;
            }
            CHECK(waited_max >= S); /* the others did have work */
            fk_pair_fini(&p);
        }
    }
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(between_turns), BEX_CASE(newcomer))
