/* SPDX-License-Identifier: Apache-2.0 */
/* The I/O thread's poll turn over RDMA, and the counters Figure 11's
 * per-message counts rest on (rxe; one process, two contexts: a server on
 * ADDR0, a client on ADDR1).
 *
 * - one_chain: a turn takes every completion its CQ holds (up to
 *   WC_TURN_MAX, src/conn/thread.c) before its progress calls, so the
 *   answers to many messages that arrived together leave in one chain.
 *   The server's I/O thread is held in the callback of a first message
 *   while the client sends HELD more, until the server's rxe has taken
 *   them all and written their completions (its rdma_recvs and sent_pkts
 *   counters: land() says why both): all wait in the server's CQ. (The
 *   client's on_send_done is no sign: a send is handed back on the peer's credit acknowledgement,
 *   which the held thread does not send.) Released, the server echoes each from
 *   its callback. With a turn of one batch of 64 completions the HELD
 *   answers took HELD / 64 doorbells (ibv_post_send calls) and more; now
 *   two: the first message's answer, then the rest. This is Figure 11's
 *   count at many QPs with several messages each (docs/benchmarks.md), on
 *   one QP where it can be made exact. The server's poll_recvs and
 *   poll_recv_conns say the same from the receive side: the HELD
 *   receives were dispatched in one turn.
 * - late_chain: a turn that took more than one completion polls its CQ
 *   again until a poll gives nothing, so that the completions that
 *   arrived while it dispatched are answered in the same chain. The
 *   server's thread is held twice: in the first message's callback while
 *   LATE_A more land in its CQ (the next turn takes them in one poll),
 *   then in the callback of the first of those while LATE_B more land.
 *   Released, the turn that polled the LATE_A polls again and finds the
 *   LATE_B: their answers leave in one doorbell, after the first
 *   message's (a turn that ended on a poll of less than a batch: three).
 *   This is Figure 11's split at 1024 QPs with several messages each
 *   (docs/benchmarks.md): a QP's answers that land while the turn
 *   dispatches others left in a doorbell of their own.
 * - keepalive_count: an idle connection's keepalive WRITEs are counted
 *   (bex_sock_stats.keepalive_writes), each a doorbell of its own and in
 *   no SEND or WRITE count, so that a benchmark can tell them from its
 *   messages' posts.
 * - loop_counts: the loop's polls and system calls are counted
 *   (bex_sock_stats.cq_polls, cq_polls_empty, cq_arms, cq_events,
 *   loop_waits, loop_sleeps, loop_wake_reads, loop_wakes: Figure 11's
 *   polls and system calls per message). A client in event mode sends
 *   PINGS messages one after another; the server holds the first until
 *   the client's thread, asleep on an armed CQ, has read a completion
 *   event (its keepalive WRITE's: every 100 ms while it waits). Each
 *   answer came in a poll of its own, and no poll that found something
 *   took nothing: PINGS <= polls that found any <= completions. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sock/echo.h"

#define MSG_LEN 256
#define HELD    512 /* 8 batches of 64 */

static struct in_addr addr0, addr1;

/* Room for every message at once, both ways: credits (rq_depth) and a
 * chain of HELD + 1 sends (sq_depth); and a keepalive timeout longer than
 * the hold (the held server writes no keepalive: at the default 2 s the
 * client failed the connection in the VM). The setup of connections this
 * deep (1024 receives each side) outlasted bex's 3 s connect timeout once
 * in the VM at host load 12 (one_chain, -ETIMEDOUT at its connect): the
 * rig waits 10 s for it, so the context does too (both scaled). */
static const bex_ctx_config roomy = {.io_threads = 1,
                                     .rq_depth = 1024,
                                     .sq_depth = 1024,
                                     .keepalive_timeout_ms = 60000,
                                     .credit_timeout_ms = 60000,
                                     .connect_timeout_ms = 10000};

struct hold_srv {
    struct local_srv base; /* first: what the shared callbacks take */
    _Atomic long held, got;
    _Atomic int release; /* the holds released so far */
    int holds;           /* how many of the first messages hold (1 or 2) */
};

/* The first `holds` messages each hold the thread until released; every
 * one is echoed (bex frees the buffer once sent: no on_send_done here). */
static void hold_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct hold_srv *h = user;
    long k = atomic_fetch_add(&h->got, 1);
    if (k < h->holds) {
        waiter_add(&h->base.w, &h->held, 1);
        unsigned limit = 60000 * time_scale();
        for (unsigned t = 0; atomic_load(&h->release) <= k && t < limit; t++)
            pair_sleep_ms(1);
        CHECK(atomic_load(&h->release) > k);
    }
    if (bex_sock_send(s, buf, len, NULL) != 0)
        bex_mem_free(buf);
}

/* A counter of the rxe device under ctx (/sys/class/infiniband), or -1. */
static long long dev_counter(bex_ctx *ctx, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/1/hw_counters/%s",
             bex_ctx_pd(ctx)->context->device->name, name);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long long v = -1;
    if (fscanf(f, "%lld", &v) != 1)
        v = -1;
    fclose(f);
    return v;
}

struct cli {
    struct local_cli base;
    _Atomic long recvd, done, bad;
};

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct cli *c = user;
    if (len != MSG_LEN)
        atomic_fetch_add(&c->bad, 1);
    bex_mem_free(buf);
    waiter_add(c->base.w, &c->recvd, 1);
}

static void cli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu;
    struct cli *c = user;
    if (status != 0)
        atomic_fetch_add(&c->bad, 1);
    bex_mem_free(buf);
    waiter_add(c->base.w, &c->done, 1);
}

/* Both cases' pair: a server (hold_recv) on ADDR0 and a client on ADDR1,
 * contexts of cfg, the client connected. */
struct rig {
    struct hold_srv h;
    bex_ctx *sctx, *cctx;
    bex_listener *l;
    struct cli c;
    bex_sock *s;
};

static void rig_open(struct rig *r, const bex_ctx_config *cfg, int holds)
{
    r->h = (struct hold_srv){.base.w = WAITER_INIT, .holds = holds};
    r->sctx = local_ctx(cfg, addr0);
    r->cctx = local_ctx(cfg, addr1);
    bex_addr a;
    r->l = local_listen(r->sctx, addr0, &r->h.base, hold_recv, &a);
    r->c = (struct cli){.base.w = &r->h.base.w};
    static const bex_sock_ops ops = {.on_connect = local_cli_connect,
                                     .on_recv = cli_recv,
                                     .on_send_done = cli_done,
                                     .on_close = local_cli_closed};
    CHECK_OK(bex_sock_connect(r->cctx, &a, &ops, &r->c, &r->s));
    CHECK_OK(wait_count(&r->h.base.w, &r->c.base.connected, 1, 10000));
}

static void rig_close(struct rig *r)
{
    CHECK_EQ(atomic_load(&r->c.bad), 0);
    bex_sock_close(r->s);
    CHECK_OK(wait_count(&r->h.base.w, &r->c.base.closed, 1, 10000));
    CHECK_OK(wait_count(&r->h.base.w, &r->h.base.closed, 1, 10000));
    CHECK_OK(bex_listener_close(r->l));
    CHECK_OK(bex_ctx_destroy(r->cctx));
    CHECK_OK(bex_ctx_destroy(r->sctx));
}

/* rig_open's pair with the server's thread held in the first message's
 * callback; *r0: the server's rxe's rdma_recvs counter then; *pre (may be
 * NULL): the server's stats before the first message was sent. */
static void rig_hold(struct rig *r, int holds, long long *r0, bex_sock_stats *pre)
{
    rig_open(r, &roomy, holds);
    if (pre)
        bex_ctx_stats(r->sctx, pre);
    local_send(r->cctx, r->s, MSG_LEN);
    CHECK_OK(wait_count(&r->h.base.w, &r->h.held, 1, 10000));
    *r0 = dev_counter(r->sctx, "rdma_recvs");
    CHECK(*r0 >= 0);
}

/* The server's answers between s0 and s1 (at least `answers` SENDs) left
 * in two doorbells: the first message's answer, then the others in one
 * chain (a keepalive or a credit message may take a doorbell of its own). */
static void check_two_doorbells(const bex_sock_stats *s0, const bex_sock_stats *s1, long answers)
{
    uint64_t calls = s1->post_send_calls - s0->post_send_calls;
    uint64_t ka = s1->keepalive_writes - s0->keepalive_writes;
    uint64_t credits = s1->credit_msgs - s0->credit_msgs;
    fprintf(stderr,
            "%ld answers: %llu ibv_post_send calls, of them at most %llu keepalive writes "
            "and %llu credit messages; %llu SENDs\n",
            answers, (unsigned long long)calls, (unsigned long long)ka, (unsigned long long)credits,
            (unsigned long long)(s1->sends_posted - s0->sends_posted));
    CHECK(s1->sends_posted - s0->sends_posted >= (uint64_t)answers); /* the counters count */
    CHECK(calls <= 2 + ka + credits);
}

/* Send n messages from the client and wait until the server's rxe has
 * taken them all and written their completions: their completions wait in
 * the server's CQ while its thread is held. rxe counts rdma_recvs just
 * before it writes a receive's completion, so the count alone let a test
 * release the thread while a guest preempted there had not written the
 * last one yet (late_chain: 3 doorbells, once in the VM under load). It
 * sends a message's ACK (every message of one packet asks for one) after
 * writing its completion: so also wait for n packets more from the server
 * (sent_pkts; the held thread posts nothing). */
static void land(struct rig *r, int n, long long *r0)
{
    long long p0 = dev_counter(r->sctx, "sent_pkts");
    CHECK(p0 >= 0);
    for (int i = 0; i < n; i++)
        local_send(r->cctx, r->s, MSG_LEN);
    uint64_t end = pair_now_ms() + 30000ull * time_scale();
    while ((dev_counter(r->sctx, "rdma_recvs") < *r0 + n ||
            dev_counter(r->sctx, "sent_pkts") < p0 + n) &&
           pair_now_ms() < end)
        pair_sleep_ms(1);
    CHECK(dev_counter(r->sctx, "rdma_recvs") >= *r0 + n);
    CHECK(dev_counter(r->sctx, "sent_pkts") >= p0 + n);
    *r0 += n;
}

static int one_chain(void)
{
    PAIR_NEED(pair_addrs(&addr0, &addr1));
    if (pair_tcp())
        return bex_test_skip("completion queues are RDMA's");
    struct rig r;
    long long r0;
    bex_sock_stats pre;
    rig_hold(&r, 1, &r0, &pre);
    /* every SEND taken by the server's rxe: its completion waits in the
     * server's CQ, the thread still held */
    land(&r, HELD, &r0);
    CHECK_EQ(atomic_load(&r.c.recvd), 0);
    bex_sock_stats s0, s1;
    bex_ctx_stats(r.sctx, &s0);
    atomic_store(&r.h.release, 1);
    CHECK_OK(wait_count(&r.h.base.w, &r.c.recvd, HELD + 1, 30000));
    bex_ctx_stats(r.sctx, &s1);
    /* the first answer, then the HELD others in one chain */
    check_two_doorbells(&s0, &s1, HELD + 1);
    /* the HELD receives were one connection's in one poll turn
     * (bex_sock_stats.poll_recv_conns counts a connection once a turn).
     * Counted from before the first message: that turn may be theirs too
     * (a turn that polled more than one completion, the first message's
     * and another, polls again after its dispatch, which the hold was in:
     * the HELD came in the same turn, and their answers left in the first
     * one's doorbell; CI saw 0 turns between s0 and s1 once). So the HELD
     * + 1 share at most two turns; any other receive (the client's credit
     * messages) may have a turn of its own (a turn of one batch: 9) */
    uint64_t recvs = s1.poll_recvs - pre.poll_recvs,
             turns = s1.poll_recv_conns - pre.poll_recv_conns;
    fprintf(stderr, "%llu receives polled in %llu connection-turns (%llu of them since the hold)\n",
            (unsigned long long)recvs, (unsigned long long)turns,
            (unsigned long long)(s1.poll_recv_conns - s0.poll_recv_conns));
    CHECK(recvs >= HELD + 1);
    CHECK(turns >= 1 && turns <= 2 + (recvs - HELD - 1));
    rig_close(&r);
    return 0;
}

#define LATE_A 8
#define LATE_B 8
static int late_chain(void)
{
    PAIR_NEED(pair_addrs(&addr0, &addr1));
    if (pair_tcp())
        return bex_test_skip("completion queues are RDMA's");
    struct rig r;
    long long r0;
    rig_hold(&r, 2, &r0, NULL);
    land(&r, LATE_A, &r0);
    bex_sock_stats s0, s1;
    bex_ctx_stats(r.sctx, &s0);
    atomic_store(&r.h.release, 1); /* the first message's answer goes */
    /* the next turn polls the LATE_A at once; the first of them holds */
    CHECK_OK(wait_count(&r.h.base.w, &r.h.held, 2, 10000));
    land(&r, LATE_B, &r0);
    CHECK_EQ(atomic_load(&r.h.got), 2); /* the LATE_B wait in the CQ */
    atomic_store(&r.h.release, 2);
    CHECK_OK(wait_count(&r.h.base.w, &r.c.recvd, 1 + LATE_A + LATE_B, 30000));
    bex_ctx_stats(r.sctx, &s1);
    /* the first message's answer, then the LATE_A and LATE_B answers in
     * one chain (a turn that stopped at a poll of less than a batch: 3) */
    check_two_doorbells(&s0, &s1, 1 + LATE_A + LATE_B);
    rig_close(&r);
    return 0;
}

#define KA_WANT 3
static int keepalive_count(void)
{
    PAIR_NEED(pair_addrs(&addr0, &addr1));
    if (pair_tcp())
        return bex_test_skip("keepalive WRITEs are RDMA's");
    bex_ctx_config cfg = {.io_threads = 1, .keepalive_ms = 100};
    struct rig r;
    rig_open(&r, &cfg, 0);
    bex_ctx *cctx = r.cctx;
    local_send(cctx, r.s, MSG_LEN);
    CHECK_OK(wait_count(&r.h.base.w, &r.c.recvd, 1, 10000));
    CHECK_OK(wait_count(&r.h.base.w, &r.c.done, 1, 10000));
    bex_sock_stats s0, s1;
    pair_quiet_stats(cctx, &s0);
    /* idle now: what the client posts from here is keepalives, and the
     * credits for the answer it took, if they had not gone back yet (a
     * CREDIT message: seen under ASan, where the window opens sooner
     * against the client's timing) */
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    do {
        pair_sleep_ms(10);
        pair_quiet_stats(cctx, &s1);
    } while (s1.keepalive_writes < s0.keepalive_writes + KA_WANT && pair_now_ms() < end);
    uint64_t ka = s1.keepalive_writes - s0.keepalive_writes;
    uint64_t credits = s1.credit_msgs - s0.credit_msgs;
    uint64_t calls = s1.post_send_calls - s0.post_send_calls;
    fprintf(stderr,
            "idle: %llu keepalive writes, %llu WRITEs, %llu SENDs (%llu credit messages), "
            "%llu doorbells\n",
            (unsigned long long)ka, (unsigned long long)(s1.writes_posted - s0.writes_posted),
            (unsigned long long)(s1.sends_posted - s0.sends_posted), (unsigned long long)credits,
            (unsigned long long)calls);
    CHECK(ka >= KA_WANT);
    CHECK_EQ(s1.writes_posted - s0.writes_posted, 0);     /* (data WRITEs only) */
    CHECK(credits <= 1);                                  /* one answer's credits at most */
    CHECK_EQ(s1.sends_posted - s0.sends_posted, credits); /* no SEND but a CREDIT */
    /* no doorbell but the keepalives' and the credit message's (under
     * ASan 3 keepalive writes once took 2 doorbells: not explained, so
     * the lower bound is only that they take doorbells at all) */
    CHECK(calls >= 1 && calls <= ka + credits);
    rig_close(&r);
    return 0;
}

#define PINGS 32
static int loop_counts(void)
{
    PAIR_NEED(pair_addrs(&addr0, &addr1));
    if (pair_tcp())
        return bex_test_skip("completion queues are RDMA's");
    bex_ctx_config cfg = {.io_threads = 1,
                          .poll_mode = BEX_POLL_EVENT,
                          .keepalive_ms = 100,
                          .keepalive_timeout_ms = 60000,
                          .credit_timeout_ms = 60000};
    struct rig r;
    rig_open(&r, &cfg, 1);
    bex_ctx *cctx = r.cctx;
    bex_sock_stats s0, s1;
    bex_ctx_stats(cctx, &s0);
    local_send(cctx, r.s, MSG_LEN);
    CHECK_OK(wait_count(&r.h.base.w, &r.h.held, 1, 10000));
    /* the client waits: asleep with its CQ armed, a completion (its
     * keepalive's, at least) raises an event that it reads */
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    do {
        pair_sleep_ms(1);
        bex_ctx_stats(cctx, &s1);
    } while (s1.cq_events == s0.cq_events && pair_now_ms() < end);
    CHECK(s1.cq_events > s0.cq_events);
    atomic_store(&r.h.release, 1);
    CHECK_OK(wait_count(&r.h.base.w, &r.c.recvd, 1, 30000));
    for (long i = 1; i < PINGS; i++) {
        local_send(cctx, r.s, MSG_LEN);
        CHECK_OK(wait_count(&r.h.base.w, &r.c.recvd, i + 1, 30000));
    }
    bex_ctx_stats(cctx, &s1);
#define D(f) (s1.f - s0.f)
    fprintf(stderr,
            "%d answers: %llu polls (%llu empty), %llu receives and %llu signaled sends; "
            "%llu CQ armings, %llu events read; %llu epoll_waits (%llu slept), "
            "%llu eventfd reads, %llu eventfd writes\n",
            PINGS, (unsigned long long)D(cq_polls), (unsigned long long)D(cq_polls_empty),
            (unsigned long long)D(poll_recvs), (unsigned long long)D(signaled),
            (unsigned long long)D(cq_arms), (unsigned long long)D(cq_events),
            (unsigned long long)D(loop_waits), (unsigned long long)D(loop_sleeps),
            (unsigned long long)D(loop_wake_reads), (unsigned long long)D(loop_wakes));
    CHECK(D(cq_polls) >= D(cq_polls_empty));
    uint64_t found = D(cq_polls) - D(cq_polls_empty);
    /* each answer in a poll of its own (the next request left after the
     * callback of the one before), each of those polls took at least one
     * completion: a receive, or a signaled send's (one posted before s0
     * at most: the connection's last setup write) */
    CHECK(found >= PINGS);
    CHECK(D(poll_recvs) >= PINGS);
    CHECK(found <= D(poll_recvs) + D(signaled) + 1);
    /* sleeping: the poll after arming found the CQ empty */
    CHECK(D(cq_polls_empty) >= 1);
    CHECK(D(loop_sleeps) >= 1 && D(loop_sleeps) <= D(loop_waits));
    /* an event needs an arming before it (the CQ may have been armed at
     * s0), and is read after an epoll_wait reported the channel */
    CHECK(D(cq_arms) >= 1 && D(cq_events) <= D(cq_arms) + 1);
    CHECK(D(cq_events) <= D(loop_waits));
    /* the test's sends woke the sleeping thread: writes to its eventfd,
     * read after a wait (one write may have come before s0, and a read
     * takes every write since the last) */
    CHECK(D(loop_wakes) >= 1);
    CHECK(D(loop_wake_reads) >= 1 && D(loop_wake_reads) <= D(loop_wakes) + 1);
    CHECK(D(loop_wake_reads) <= D(loop_waits));
    /* a ping-pong chains nothing: a doorbell a request at least */
    CHECK(D(post_send_calls) >= PINGS);
#undef D
    rig_close(&r);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(one_chain), BEX_CASE(late_chain), BEX_CASE(keepalive_count),
              BEX_CASE(loop_counts))
