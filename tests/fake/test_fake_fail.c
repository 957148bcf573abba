/* SPDX-License-Identifier: Apache-2.0 */
/* Failure mid-transfer over the fake transport: whatever the moment and the
 * cause, every message is handed back exactly once, before on_fail, with
 * the status bex/sock.h promises, and the status agrees with what the NIC
 * did to it (fake.c up_on_send_done and fk_check_final):
 *   0           its last request completed, and the peer delivered it
 *               (unless the peer failed before it processed the completion);
 *   -ECANCELED  its last request was never posted, and nothing delivered it;
 *   -EIO        its last request was posted and never completed (it may or
 *               may not have been delivered).
 * Traffic: several sockets both ways, small messages, rendezvous and
 * writes into exposed buffers, completions late at random. */
#include <errno.h>

#include "fake/fake.h"
#include "harness.h"
#include "transport/rdma/engine_internal.h"

enum { HOW_LOCAL, HOW_NIC, HOW_PEER, HOW_CLOSE_THEN_LOCAL, HOW_COUNT };

static uint32_t seen[4]; /* statuses over all seeds: 0, -ECANCELED, -EIO, other */

static void tally(struct fk_pair *p)
{
    for (uint32_t i = 0; i < p->n_msgs; i++) {
        int s = p->msgs[i].status;
        seen[s == 0 ? 0 : s == -ECANCELED ? 1 : s == -EIO ? 2 : 3]++;
    }
}

static struct fk_stream *pick(struct fk_pair *p, struct fk_stream **st, uint32_t n, int side)
{
    struct fk_stream *s = st[fk_rand(p, n)];
    return side ? fk_stream(p, 1, s->id) : s;
}

static void traffic(struct fk_pair *p, struct fk_stream **st, uint32_t n, uint32_t steps)
{
    for (uint32_t step = 0; step < steps; step++) {
        if (fk_rand(p, 3) == 0 && p->n_msgs < 600) {
            int side = (int)fk_rand(p, 2);
            struct fk_stream *s = pick(p, st, n, side);
            uint32_t kind = fk_rand(p, 4);
            uint32_t len = kind < 2 ? 8 + fk_rand(p, 1000) : 1025 + fk_rand(p, 40000);
            if (s && !fk_dead(p, side))
                fk_send(p, s, len, kind == 3);
        }
        fk_random_steps(p, 8);
    }
}

/* One run: traffic, a failure of kind `how` at a random moment, drain. */
static void run(uint64_t seed, int how)
{
    struct bex__engine_config c0, c1;
    fk_default_config(&c0);
    fk_default_config(&c1);
    c0.rq_depth = 4 + (uint32_t)(seed % 13);
    c1.rq_depth = 4 + (uint32_t)(seed / 13 % 13);
    c0.send_window = seed % 3 ? 0 : 8192;
    c0.frag_size = 1024u << (seed % 4);
    c1.frag_size = 2048;
    struct fk_pair p;
    fk_pair_init(&p, &c0, &c1, seed);
    struct fk_stream *st[4];
    for (int i = 0; i < 4; i++)
        st[i] = fk_open(&p);
    fk_quiesce(&p);
    traffic(&p, st, 4, 20 + fk_rand(&p, 200));
    switch (how) {
    case HOW_LOCAL: /* the sock layer fails the connection */
        bex__engine_fail(p.s[0].e, -ECONNRESET);
        break;
    case HOW_NIC: /* a request of side 0 fails: an error completion */
        p.s[0].fail_next = true;
        break;
    case HOW_PEER: /* the peer goes away */
        bex__engine_fail(p.s[1].e, -ECONNRESET);
        break;
    case HOW_CLOSE_THEN_LOCAL: /* sockets close both ways, then a failure */
        for (int i = 0; i < 2; i++) {
            struct fk_stream *s = pick(&p, st, 4, i);
            if (s && s->st.eng && !s->close_asked) {
                s->close_asked = true;
                bex__engine_close_stream(&s->st);
            }
        }
        traffic(&p, st, 4, fk_rand(&p, 100));
        bex__engine_fail(p.s[fk_rand(&p, 2)].e, -ECONNRESET);
        break;
    }
    /* the other side goes on until it meets the failure; sends keep coming */
    traffic(&p, st, 4, 100);
    fk_quiesce(&p);
    if (how == HOW_NIC)
        CHECK(fk_dead(&p, 0) || p.s[0].fail_next);
    /* the end: what still lives is failed by its sock layer */
    for (int i = 0; i < 2; i++)
        if (!fk_dead(&p, i))
            bex__engine_fail(p.s[i].e, -ECONNRESET);
    fk_check_final(&p);
    tally(&p);
    fk_pair_fini(&p);
}

static int local_fail(void)
{
    memset(seen, 0, sizeof seen);
    for (uint64_t seed = 1; seed <= 150; seed++)
        run(seed, HOW_LOCAL);
    CHECK(seen[0] > 0 && seen[1] > 0 && seen[2] > 0);
    return 0;
}

static int nic_error(void)
{
    memset(seen, 0, sizeof seen);
    for (uint64_t seed = 1; seed <= 150; seed++)
        run(seed, HOW_NIC);
    CHECK(seen[0] > 0 && seen[1] > 0 && seen[2] > 0);
    return 0;
}

static int peer_fail(void)
{
    memset(seen, 0, sizeof seen);
    for (uint64_t seed = 1; seed <= 150; seed++)
        run(seed, HOW_PEER);
    CHECK(seen[0] > 0 && seen[1] > 0 && seen[2] > 0);
    return 0;
}

static int random_schedules(void)
{
    memset(seen, 0, sizeof seen);
    for (uint64_t seed = 1; seed <= 400; seed++)
        run(seed * 7919, (int)(seed % HOW_COUNT));
    CHECK(seen[0] > 0 && seen[1] > 0 && seen[2] > 0);
    return 0;
}

/* A small message sent with no other stream waiting is prepared at once
 * (bex__engine_send) and posted by the next progress call: a failure
 * in between hands it back never sent (-ECANCELED), not in doubt. */
static int prepared_unsent(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 11);
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    struct fk_msg *m = fk_send(&p, st, 32, false);
    CHECK_EQ(m->done, 0);
    bex__engine_fail(p.s[0].e, -ECONNRESET);
    CHECK_EQ(m->done, 1);
    CHECK_EQ(m->status, -ECANCELED);
    CHECK(!m->final_posted);
    fk_quiesce(&p);
    bex__engine_fail(p.s[1].e, -ECONNRESET);
    fk_check_final(&p);
    fk_pair_fini(&p);
    return 0;
}

/* The peer's CLOSE of a stream whose OPEN it never got (ours is still
 * to send): an illegal move of the stream's state, and the peer's, so its
 * engine fails with -EPROTO, the process goes on, and what the stream
 * queued comes back never sent (issue 26 item 4). */
static int peer_close_unopened(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 1);
    struct fk_stream *st = fk_open(&p); /* no progress yet: OPEN not sent */
    struct fk_msg *m = fk_send(&p, st, 64, false);
    struct bex__hdr h = {.type = BEX__MSG_CLOSE, .stream = st->id};
    fk_inject_hdr(&p, 0, &h);
    CHECK(fk_recv_cqe(&p, 0));
    CHECK(fk_dead(&p, 0));
    CHECK_EQ(p.s[0].fail_err, -EPROTO);
    CHECK(!m->final_posted);
    CHECK_EQ(m->status, -ECANCELED);
    fk_pair_fini(&p);
    return 0;
}

/* The peer's readiness notice a second time, once its engine is UP: a
 * move the engine's state does not take, driven by the peer, so its engine
 * fails with -EPROTO (a violation) and the process goes on. */
static int peer_ready_twice(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 1);
    CHECK(!fk_dead(&p, 0));
    bex__engine_start(p.s[0].e);
    CHECK(fk_dead(&p, 0));
    CHECK_EQ(p.s[0].fail_err, -EPROTO);
    CHECK(!fk_dead(&p, 1));
    fk_pair_fini(&p);
    return 0;
}

/* Side 1 answers every message from its upcall by bex__engine_send_now,
 * as a socket's send from a callback does (bex_sock_send on its I/O
 * thread), and its receives cannot be posted again. The repost that
 * returns the credits the answer is to carry fails the engine: outside the
 * send, so that nothing comes back to the application inside its
 * bex_sock_send (fk_send_now checks), and the answer is handed back once
 * afterwards, never sent (-ECANCELED). Before, the repost ran inside
 * send_now and handed the answer back there. */
static struct fk_msg *answered;

static void answer_now(struct fk_pair *p, int side, uint32_t stream)
{
    if (side != 1)
        return;
    struct fk_msg *m = fk_send_now(p, fk_stream(p, 1, stream), 32);
    if (m)
        answered = m;
}

static int repost_fails_in_send(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 12);
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    p.on_msg = answer_now;
    p.s[1].fail_recv = true;
    /* the spare receives pay for the first answers' credits: a repost
     * comes within rq_depth messages */
    for (uint32_t r = 0; r < 2 * c.rq_depth && !fk_dead(&p, 1); r++) {
        fk_send(&p, st, 32, false);
        fk_quiesce(&p);
    }
    CHECK(fk_dead(&p, 1));
    CHECK_EQ(p.s[1].fail_err, -ENOBUFS);
    CHECK(answered != NULL);
    CHECK_EQ(answered->done, 1);
    CHECK_EQ(answered->status, -ECANCELED);
    CHECK(!answered->final_posted);
    p.on_msg = NULL;
    p.s[1].fail_recv = false;
    fk_pair_fini(&p);
    return 0;
}

/* The same with a chain the NIC takes in part: ibv_post_recv posts the
 * chain's first receive and fails at its second (bad). The failure still
 * waits for the progress call after the send; the receive posted is
 * counted as posted (the fake's receive queue holds it once, and a second
 * post of it would overfill the queue: fk_post_recv's check), and the
 * answer comes back once, never sent. */
static uint32_t rq_before, rq_after, partial_sends;
static bool alive_after;

static void answer_partly(struct fk_pair *p, int side, uint32_t stream)
{
    if (side != 1)
        return;
    uint32_t before = p->s[1].rq_n;
    struct fk_msg *m = fk_send_now(p, fk_stream(p, 1, stream), 32);
    if (m)
        answered = m;
    if (!fk_dead(p, 1) && p->s[1].rq_n != before) {
        /* this send reposted: its chain went in part */
        rq_before = before;
        rq_after = p->s[1].rq_n;
        alive_after = !fk_dead(p, 1) && m && m->done == 0;
        partial_sends++;
    }
}

static int repost_partly_in_send(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 12);
    struct fk_stream *st = fk_open(&p);
    fk_quiesce(&p);
    answered = NULL;
    p.on_msg = answer_partly;
    p.s[1].fail_recv = true;
    p.s[1].recv_take = 1;
    for (uint32_t r = 0; r < 2 * c.rq_depth && !fk_dead(&p, 1); r++) {
        fk_send(&p, st, 32, false);
        fk_quiesce(&p);
    }
    CHECK(fk_dead(&p, 1));
    CHECK_EQ(p.s[1].fail_err, -ENOBUFS);
    CHECK_EQ(partial_sends, 1);
    CHECK_EQ(rq_after, rq_before + 1); /* the chain's first receive, once */
    CHECK(alive_after);                /* failed by the progress call after the send */
    CHECK(answered != NULL);
    CHECK_EQ(answered->done, 1);
    CHECK_EQ(answered->status, -ECANCELED);
    CHECK(!answered->final_posted);
    p.on_msg = NULL;
    p.s[1].fail_recv = false;
    fk_pair_fini(&p);
    return 0;
}

/* After a repost that failed in a direct send (repost_err kept, the
 * answer queued, the engine to fail at the next progress call), nothing
 * more is prepared to go alone: here the answer's stream is detached (its
 * answer handed back), so no stream waits in the ring, and another
 * stream's send comes before the progress call. It must be queued, not
 * prepared, so that a tick (keepalive due) posts no message of an engine
 * that is about to fail: the fake NIC's count of receive-consuming posts
 * does not move, and the message comes back once, never sent
 * (-ECANCELED), with the engine's failure. On main before, the chain the
 * NIC took in part left the slack to cover the second send's credit, so
 * that it was prepared alone and the tick posted it (-EIO). */
static bool failed_in_send;
static uint32_t failed_stream;

static void answer_until_failed(struct fk_pair *p, int side, uint32_t stream)
{
    if (side != 1 || failed_in_send)
        return;
    fk_send_now(p, fk_stream(p, 1, stream), 32);
    if (!fk_dead(p, 1) && p->s[1].e->repost_err) {
        failed_in_send = true;
        failed_stream = stream;
    }
}

/* Side 0's messages on a, answered by side 1, until an answer's repost
 * failed in its send: every step as fk_quiesce's, but side 1's progress
 * call never comes after that failure. */
static void exchange_until_failed(struct fk_pair *p, struct fk_stream *a, uint32_t rounds)
{
    for (uint32_t r = 0; r < rounds && !failed_in_send; r++) {
        fk_send(p, a, 32, false);
        for (uint32_t step = 0; step < 1000 && !failed_in_send; step++) {
            bool any = fk_progress(p, 0);
            while (fk_exec(p, 0))
                any = true;
            while (!failed_in_send && fk_recv_cqe(p, 1))
                any = true;
            if (failed_in_send)
                break;
            any |= fk_progress(p, 1);
            while (fk_exec(p, 1))
                any = true;
            for (int i = 0; i < 2; i++)
                while (fk_send_cqe(p, i))
                    any = true;
            while (fk_recv_cqe(p, 0))
                any = true;
            if (!any)
                break;
        }
    }
}

static int repost_failed_then_lone(void)
{
    struct bex__engine_config c;
    fk_default_config(&c);
    struct fk_pair p;
    fk_pair_init(&p, &c, &c, 12);
    p.virt_clock = true;
    struct fk_stream *a = fk_open(&p), *b = fk_open(&p);
    fk_quiesce(&p);
    failed_in_send = false;
    p.on_msg = answer_until_failed;
    p.s[1].fail_recv = true;
    p.s[1].recv_take = 1; /* the chain goes in part: the slack grows */
    exchange_until_failed(&p, a, 2 * c.rq_depth);
    CHECK(failed_in_send);
    CHECK(!fk_dead(&p, 1));
    CHECK_EQ(failed_stream, a->id);
    /* the failed answer's stream goes (its answer back, never sent) */
    struct fk_stream *a1 = fk_stream(&p, 1, a->id);
    bex__engine_detach(&a1->st);
    a1->attached = false;
    uint64_t posted = p.s[1].consumers_posted;
    struct fk_msg *m = fk_send_now(&p, fk_stream(&p, 1, b->id), 32);
    CHECK(m != NULL);
    CHECK_EQ(m->done, 0);
    /* two ticks: the first puts the keepalive off (the peer heard from
     * us), the second finds it due and posts what is prepared */
    fk_tick(&p, 1, 0);
    fk_tick(&p, 1, 2 * c.keepalive_ms);
    CHECK_EQ(p.s[1].consumers_posted, posted);
    CHECK(!fk_dead(&p, 1));
    fk_progress(&p, 1);
    CHECK(fk_dead(&p, 1));
    CHECK_EQ(p.s[1].fail_err, -ENOBUFS);
    CHECK_EQ(m->done, 1);
    CHECK_EQ(m->status, -ECANCELED);
    CHECK(!m->final_posted);
    p.on_msg = NULL;
    p.s[1].fail_recv = false;
    fk_pair_fini(&p);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(local_fail), BEX_CASE(nic_error), BEX_CASE(peer_fail),
              BEX_CASE(random_schedules), BEX_CASE(peer_close_unopened), BEX_CASE(peer_ready_twice),
              BEX_CASE(prepared_unsent), BEX_CASE(repost_fails_in_send),
              BEX_CASE(repost_partly_in_send), BEX_CASE(repost_failed_then_lone))
