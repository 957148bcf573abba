/* SPDX-License-Identifier: Apache-2.0 */
/* Receive-credit flow control of the engine, over the fake transport: a
 * sender never has more receive-consuming requests posted than the peer
 * granted (the harness checks that at every post, fake.c note_post), keeps
 * the last credit for a CREDIT message, gets credits back as the peer
 * reposts, and the peer withholds them while its received bytes are at
 * recv_bytes_max (sh->recv_max). */
#include <time.h>

#include "fake/fake.h"
#include "harness.h"
#include "transport/rdma/engine_internal.h"

static uint32_t delivered_from(struct fk_pair *p, int from)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < p->n_msgs; i++)
        n += p->msgs[i].from == from && p->msgs[i].delivered;
    return n;
}

/* The peer's receive completions wait: the sender posts rq_depth - 1
 * messages (the last credit is kept for a CREDIT message) and no more,
 * whatever its queue holds. */
static int reserve_kept(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 1);
    struct fk_stream *st = fk_open(&p);
    for (int i = 0; i < 50; i++)
        fk_send(&p, st, 100, false);
    /* side 1 never processes a receive: credits cannot come back */
    for (int round = 0; round < 100; round++) {
        fk_progress(&p, 0);
        while (fk_exec(&p, 0))
            ;
        while (fk_send_cqe(&p, 0))
            ;
    }
    /* OPEN + 14 DATA = 15 = rq_depth - 1 receives consumed */
    CHECK_EQ(p.s[0].consumers_posted, c.rq_depth - 1);
    CHECK_EQ(p.s[0].min_credits_left, 1);
    /* one receive left at the peer, and the spare ones it posts beyond
     * the credits it grants (bex__engine_rq_spare) */
    CHECK_EQ(p.s[1].rq_n, 1 + bex__engine_rq_spare(&p.s[1].sh, c.rq_depth));
    CHECK(atomic_load(&p.s[0].stats.credit_stalls) > 0);
    fk_quiesce(&p);
    CHECK_EQ(delivered_from(&p, 0), 50);
    fk_pair_fini(&p);
    return 0;
}

/* One-way traffic, far more messages than receives: the peer has nothing
 * to carry credits in, so CREDIT messages bring them back. */
static int come_back(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 2);
    struct fk_stream *st = fk_open(&p);
    uint32_t n = 20 * c.rq_depth;
    for (uint32_t i = 0; i < n; i++)
        fk_send(&p, st, 8 + i % 1000, false);
    fk_quiesce(&p);
    CHECK_EQ(delivered_from(&p, 0), n);
    CHECK(atomic_load(&p.s[1].stats.credit_msgs) > 0);
    /* more consumed than ever posted at once: credits were reused */
    CHECK(p.s[0].consumers_posted > c.rq_depth);
    for (uint32_t i = 0; i < p.n_msgs; i++)
        CHECK_EQ(p.msgs[i].status, 0);
    fk_pair_fini(&p);
    return 0;
}

static uint64_t held_bytes(struct fk_side *s)
{
    uint64_t b = 0;
    for (uint32_t i = 0; i < s->n_held; i++)
        b += bex_mem_usable_size(s->held[i]);
    return b;
}

/* The receiver's application keeps what it receives: at recv_bytes_max
 * consumed receives are not reposted, their credits are withheld, and the
 * sender stops; once the application frees, the timer tick refills and the
 * rest comes. */
static int withheld_recv_max(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 3);
    const uint64_t max = 8 * 1024;
    p.s[1].sh.recv_max = max;
    p.s[1].hold_recv = true;
    struct fk_stream *st = fk_open(&p);
    const uint32_t n = 100;
    for (uint32_t i = 0; i < n; i++)
        fk_send(&p, st, 1000, false);
    void *probe = bex_mem_alloc(p.s[1].recv_pool, c.eager_max);
    uint64_t eager = bex_mem_usable_size(probe);
    bex_mem_free(probe);
    /* what may be held: the limit, plus what the receives posted before it
     * was reached can still bring */
    const uint64_t bound = max + (uint64_t)c.rq_depth * eager;
    uint32_t rounds = 0, stalls = 0;
    while (delivered_from(&p, 0) < n) {
        CHECK(rounds++ < 1000);
        fk_quiesce(&p);
        CHECK(held_bytes(&p.s[1]) <= bound);
        if (delivered_from(&p, 0) == n)
            break;
        /* stopped: the receiver withholds credits (not every receive is
         * posted), and the sender still has messages */
        CHECK(p.s[1].rq_n < c.rq_depth);
        CHECK(held_bytes(&p.s[1]) + eager > max);
        stalls++;
        fk_release_held(&p, 1);
        /* the engine learns of the frees from an exact count, at most once
         * per clock tick of the coarse clock */
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
        fk_tick(&p, 1, 1);
    }
    CHECK(stalls >= 5); /* 100 messages through an 8 KiB limit */
    CHECK(atomic_load(&p.s[1].stats.recv_paused) > 0);
    fk_pair_fini(&p);
    return 0;
}

/* Both ways, small receive queues, completions delayed at random: the
 * harness checks every post against the credits granted so far. */
static int random_schedules(void)
{
    bool reached = false;
    for (uint64_t seed = 1; seed <= 200; seed++) {
        struct bex__engine_config c0, c1;
        fk_default_config(&c0);
        fk_default_config(&c1);
        c0.rq_depth = 4 + (uint32_t)(seed % 5);
        c1.rq_depth = 4 + (uint32_t)(seed / 5 % 5);
        c0.sq_depth = c1.sq_depth = 8u << (seed % 3);
        struct fk_pair p;
        fk_pair_init(&p, &c0, &c1, seed);
        struct fk_stream *st[3];
        for (int i = 0; i < 3; i++)
            st[i] = fk_open(&p);
        fk_quiesce(&p); /* the OPENs are through: both sides have the streams */
        uint32_t sent = 0;
        for (int step = 0; step < 200; step++) {
            if (fk_rand(&p, 4) == 0 && sent < 300) {
                int side = (int)fk_rand(&p, 2);
                struct fk_stream *s = st[fk_rand(&p, 3)];
                if (side)
                    s = fk_stream(&p, 1, s->id);
                uint32_t len = fk_rand(&p, 8) ? 8 + fk_rand(&p, 1000) : 2000 + fk_rand(&p, 20000);
                fk_send(&p, s, len, false);
                sent++;
            }
            fk_random_steps(&p, 20);
        }
        fk_quiesce(&p);
        for (uint32_t i = 0; i < p.n_msgs; i++)
            CHECK_EQ(p.msgs[i].delivered, 1);
        reached |= p.s[0].min_credits_left <= 1 || p.s[1].min_credits_left <= 1;
        fk_pair_fini(&p);
    }
    CHECK(reached); /* some schedule ran a side down to its reserve */
    return 0;
}

/* A ping-pong of small (inline) messages: a chain of them goes unsignaled
 * while fewer than sq / 4 requests are unretired (send.c, chain_quiet), so
 * a side signals about one doorbell in eight (at most a quarter asserted;
 * before, every doorbell was signaled, a send completion per message).
 * Every message is still reported delivered, by the peer's credits before
 * its request is retired; and once both sides are quiet, ticks retire
 * what is left with a signaled keepalive write: no executed request of
 * either side waits for a completion. */
static int ping_pong_signals(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 5);
    p.virt_clock = true;
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    struct fk_stream *back = fk_stream(&p, 1, st->id);
    CHECK(back != NULL);
    uint64_t sig0[2], calls0[2];
    for (int i = 0; i < 2; i++) {
        sig0[i] = atomic_load(&p.s[i].stats.signaled);
        calls0[i] = atomic_load(&p.s[i].stats.post_send_calls);
    }
    enum { ROUNDS = 64 };
    for (int r = 0; r < ROUNDS; r++) {
        fk_send(&p, st, 32, false);
        fk_quiesce(&p);
        fk_send(&p, back, 32, false);
        fk_quiesce(&p);
    }
    for (int i = 0; i < 2; i++) {
        uint64_t sig = atomic_load(&p.s[i].stats.signaled) - sig0[i];
        uint64_t calls = atomic_load(&p.s[i].stats.post_send_calls) - calls0[i];
        fprintf(stderr, "side %d: %llu doorbells, %llu signaled\n", i, (unsigned long long)calls,
                (unsigned long long)sig);
        CHECK(calls >= ROUNDS);
        CHECK(sig * 4 <= calls);
    }
    /* the last message's credit goes back alone, ack_delay_us (real time)
     * after it arrived */
    uint64_t end = bex__now_ms() + 30000;
    while (!p.msgs[p.n_msgs - 1].done && bex__now_ms() < end)
        fk_quiesce(&p);
    for (int t = 0; t < 3; t++) {
        fk_tick(&p, 0, 100);
        fk_tick(&p, 1, 0);
        fk_quiesce(&p);
    }
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(p.s[i].wire_n, 0);
        CHECK_EQ(p.s[i].done_n, 0); /* retired */
    }
    CHECK(!fk_dead(&p, 0) && !fk_dead(&p, 1));
    CHECK_EQ(p.n_msgs, 2 * ROUNDS);
    for (uint32_t i = 0; i < p.n_msgs; i++) {
        CHECK_EQ(p.msgs[i].delivered, 1);
        CHECK_EQ(p.msgs[i].done, 1);
        CHECK_EQ(p.msgs[i].status, 0);
    }
    fk_pair_fini(&p);
    return 0;
}

/* ---- a peer whose credits acknowledge what it does not have ---- */

/* Side 0 (its stream open, quiet) queues n messages of len bytes and
 * posts what its credits let it; none executed yet. */
static struct fk_stream *queue_posted(struct fk_pair *p, struct fk_msg **m, int n, uint32_t len)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    fk_pair_init(p, &c, &c, 3);
    struct fk_stream *st = fk_open(p);
    fk_quiesce(p);
    for (int i = 0; i < n; i++)
        m[i] = fk_send(p, st, len, false);
    fk_progress(p, 0);
    return st;
}

/* Credits from the peer (a CREDIT message as its engine never sends),
 * taken by side 0. */
static void forged_credits(struct fk_pair *p, uint32_t n)
{
    struct bex__hdr h = {.type = BEX__MSG_CREDIT, .credits = (uint16_t)n};
    fk_inject_hdr(p, 0, &h);
    CHECK(fk_recv_cqe(p, 0));
    fk_progress(p, 0);
}

/* The peer acknowledges the 4 messages posted (1000 bytes each, not
 * inline: their requests read the caller's buffers) before its NIC has
 * any of them, as many credits as side 0's requests took, no more (the
 * most a lie can claim unnoticed): none is reported, no send slot comes
 * free, until the NIC executes and retires their requests; then they are
 * reported delivered, once each. The real credits that follow are more
 * than were ever granted: side 0 fails the connection (-EPROTO), every
 * message already handed back. (fk_pair_fini checks each message's end
 * against what the NIC did.) */
static int overack_posted(void)
{
    struct fk_pair p;
    struct fk_msg *m[4];
    queue_posted(&p, m, 4, 1000);
    struct bex__engine *e = p.s[0].e;
    for (int i = 0; i < 4; i++)
        CHECK(m[i]->final_posted && !m[i]->final_inline);
    uint32_t taken = e->peer_rq - e->peer_credits, slots = bex__engine_free_slots(e);
    CHECK(taken >= 4);
    forged_credits(&p, taken);
    CHECK(!fk_dead(&p, 0));
    CHECK_EQ(bex__engine_free_slots(e), slots);
    for (int i = 0; i < 4; i++)
        CHECK_EQ(m[i]->done, 0);
    while (fk_exec(&p, 0))
        ;
    while (fk_send_cqe(&p, 0))
        ;
    fk_progress(&p, 0);
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(m[i]->done, 1);
        CHECK_EQ(m[i]->status, 0);
    }
    /* the peer's own credits (the last ones ack_delay_us, real time, after
     * its engine took the messages): more than granted */
    uint64_t end = bex__now_ms() + 30000;
    do
        fk_quiesce(&p);
    while (!fk_dead(&p, 0) && bex__now_ms() < end);
    CHECK(fk_dead(&p, 0));
    CHECK_EQ(p.s[0].fail_err, -EPROTO);
    for (int i = 0; i < 4; i++)
        CHECK_EQ(m[i]->delivered, 1);
    fk_pair_fini(&p);
    return 0;
}

/* Credits past every receive side 0's requests took (40 messages queued,
 * those its credits allowed posted, none executed): a violation, side 0
 * fails the connection (-EPROTO) before taking them; no message is
 * reported delivered (posted ones come back in doubt, -EIO, the others
 * never sent, -ECANCELED), no crash. */
static int overack_beyond(void)
{
    struct fk_pair p;
    static struct fk_msg *m[40];
    queue_posted(&p, m, 40, 100);
    struct bex__engine *e = p.s[0].e;
    uint32_t taken = e->peer_rq - e->peer_credits;
    CHECK(taken >= 1 && !m[39]->final_posted);
    forged_credits(&p, taken + 1);
    CHECK(fk_dead(&p, 0));
    CHECK_EQ(p.s[0].fail_err, -EPROTO);
    fk_quiesce(&p);
    for (int i = 0; i < 40; i++) {
        CHECK_EQ(m[i]->done, 1);
        CHECK(m[i]->status == (m[i]->final_posted ? -EIO : -ECANCELED));
    }
    fk_pair_fini(&p);
    return 0;
}

/* A ping-pong reposts its receives in chains: the spare receives posted
 * beyond the credits pay for the credits that go back with each answer
 * (the stand-in NIC checks that every SEND finds a posted receive), so
 * an ibv_post_recv is made every spare + 1 messages, not every message;
 * the delivery reports still come with the answers. */
static int ping_pong_reposts(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 6);
    p.virt_clock = true;
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    struct fk_stream *back = fk_stream(&p, 1, st->id);
    CHECK(back != NULL);
    uint32_t spare = bex__engine_rq_spare(&p.s[0].sh, c.rq_depth);
    CHECK(spare >= 1);
    uint64_t calls0[2];
    for (int i = 0; i < 2; i++)
        calls0[i] = atomic_load(&p.s[i].stats.post_recv_calls);
    enum { ROUNDS = 64 };
    for (int r = 0; r < ROUNDS; r++) {
        fk_send(&p, st, 32, false);
        fk_quiesce(&p);
        fk_send(&p, back, 32, false);
        fk_quiesce(&p);
        /* the message before this answer is reported: the answer carried
         * the credit of its receive */
        CHECK_EQ(p.msgs[p.n_msgs - 2].done, 1);
    }
    for (int i = 0; i < 2; i++) {
        uint64_t calls = atomic_load(&p.s[i].stats.post_recv_calls) - calls0[i];
        fprintf(stderr, "side %d: %llu ibv_post_recv for %d messages received (spare %u)\n", i,
                (unsigned long long)calls, ROUNDS, spare);
        CHECK(calls >= 1);
        CHECK(calls <= ROUNDS / (spare + 1) + 1);
    }
    CHECK(!fk_dead(&p, 0) && !fk_dead(&p, 1));
    fk_pair_fini(&p);
    return 0;
}

/* Side 1 answers every message from its upcall, as bex-perf's server
 * does (the engine prepares the answer at once, bex__engine_send). */
static void answer_in_upcall(struct fk_pair *p, int side, uint32_t stream)
{
    if (side == 1)
        fk_send(p, fk_stream(p, 1, stream), 32, false);
}

/* An answer sent from the upcall of the message it answers carries that
 * message's credit: the message is reported as soon as the answer
 * arrives, and no CREDIT message goes alone. */
static int upcall_answer_credits(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 8);
    p.virt_clock = true;
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    p.on_msg = answer_in_upcall;
    uint64_t credit0 = atomic_load(&p.s[1].stats.credit_msgs);
    enum { ROUNDS = 32 };
    for (int r = 0; r < ROUNDS; r++) {
        struct fk_msg *m = fk_send(&p, st, 32, false);
        fk_quiesce(&p);
        CHECK_EQ(p.msgs[p.n_msgs - 1].delivered, 1); /* the answer */
        CHECK_EQ(m->done, 1);                        /* reported by its credit */
    }
    CHECK_EQ(atomic_load(&p.s[1].stats.credit_msgs) - credit0, 0);
    p.on_msg = NULL;
    CHECK(!fk_dead(&p, 0) && !fk_dead(&p, 1));
    fk_pair_fini(&p);
    return 0;
}

/* The spare receives are no credits: a peer that sends past the rq_depth
 * it was granted (its messages' credits not yet back to it) lands in
 * one and is told off, where before it met RNR. */
static int beyond_credits(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 7);
    fk_quiesce(&p);
    CHECK(bex__engine_rq_spare(&p.s[1].sh, c.rq_depth) >= 1);
    /* side 1 handles every one but never progresses: the credits stay
     * with it (charged) */
    struct bex__hdr h = {.type = BEX__MSG_CREDIT};
    for (uint32_t i = 0; i < c.rq_depth; i++) {
        fk_inject_hdr(&p, 1, &h);
        CHECK(fk_recv_cqe(&p, 1));
        CHECK(!fk_dead(&p, 1));
    }
    CHECK_EQ(bex__engine_charged(p.s[1].e), c.rq_depth);
    fk_inject_hdr(&p, 1, &h);
    CHECK(fk_recv_cqe(&p, 1));
    CHECK(fk_dead(&p, 1));
    fk_pair_fini(&p);
    return 0;
}

/* Side 1 connected, not yet up (the peer's readiness notice not come):
 * it has posted nothing a credit could acknowledge (requests are posted
 * only while up), so its peer_credits are all it granted. */
static void connected_not_up(struct fk_pair *p)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    fk_pair_connect(p, &c, &c, 11);
    bex__engine_start(p->s[0].e);
    CHECK(!bex__engine_is_up(p->s[1].e) && !fk_dead(p, 1));
    CHECK_EQ(p->s[1].e->peer_credits, p->s[1].e->peer_rq);
}

/* Credits from a peer before side 1 is up are more than side 1 ever
 * granted: a violation, side 1 fails the connection (-EPROTO) on the
 * credits' bound, the first thing it reads of the message. Nothing goes
 * up, no buffer is taken from the receive pool for it, no credit is
 * counted or acknowledgement reported, nothing is held or waited for on
 * the peer's say-so (fk_pair_fini: every pool has its bytes back). */
static int credits_before_up(void)
{
    struct fk_pair p;
    connected_not_up(&p);
    bex_mem_stats before, after;
    bex_mem_pool_collect(p.s[1].recv_pool);
    bex_mem_pool_stats(p.s[1].recv_pool, &before);
    struct bex__hdr h = {.type = BEX__MSG_CREDIT, .credits = 1};
    fk_inject_hdr(&p, 1, &h);
    CHECK(fk_recv_cqe(&p, 1));
    CHECK(fk_dead(&p, 1));
    CHECK_EQ(p.s[1].fail_err, -EPROTO);
    CHECK_EQ(p.s[1].delivered, 0);
    bex_mem_pool_collect(p.s[1].recv_pool);
    bex_mem_pool_stats(p.s[1].recv_pool, &after);
    CHECK(after.in_use_bytes <= before.in_use_bytes);
    fk_pair_fini(&p);
    return 0;
}

/* A CREDIT that returns none before side 1 is up is a control message
 * like any: handled (since the sixteenth session a message's credits no
 * longer decide whether it is dropped before the engine is up; before,
 * one with credits was dropped and its receive lost), its receive kept
 * for reposting and its credit charged to the peer, as it would be once
 * up; side 1 then comes up. (A ping-pong after it would fail side 0: the
 * credit side 1 returns for the forged message is one side 0 never
 * spent.) */
static int no_credits_before_up(void)
{
    struct fk_pair p;
    connected_not_up(&p);
    struct bex__engine *e = p.s[1].e;
    uint32_t unposted = e->n_unposted;
    struct bex__hdr h = {.type = BEX__MSG_CREDIT};
    fk_inject_hdr(&p, 1, &h);
    CHECK(fk_recv_cqe(&p, 1));
    CHECK(!fk_dead(&p, 1));
    CHECK_EQ(e->peer_credits, e->peer_rq);
    CHECK_EQ(e->n_unposted, unposted + 1);
    CHECK_EQ(bex__engine_charged(e), 1);
    CHECK_EQ(p.s[1].delivered, 0);
    bex__engine_start(e);
    CHECK(bex__engine_is_up(e));
    fk_pair_fini(&p);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(reserve_kept), BEX_CASE(come_back), BEX_CASE(withheld_recv_max),
              BEX_CASE(random_schedules), BEX_CASE(ping_pong_signals), BEX_CASE(overack_posted),
              BEX_CASE(overack_beyond), BEX_CASE(ping_pong_reposts), BEX_CASE(beyond_credits),
              BEX_CASE(upcall_answer_credits), BEX_CASE(credits_before_up),
              BEX_CASE(no_credits_before_up))
