/* SPDX-License-Identifier: Apache-2.0 */
/* The adaptive send window's controller as a pure function, and the
 * per-destination bound (transport/window.h; issue 24 item 3):
 *  - grows: delays at the base grow the window by about BEX__WND_AI per
 *    window of completed bytes, up to max and not beyond.
 *  - cuts: a queueing delay above the target cuts the window in proportion
 *    to the excess, by at most half, once per delay (a second sample
 *    before then changes nothing), never below min; cuts are counted.
 *  - base: the base delay is the smallest sample; a delay that falls to
 *    the target or below grows the window again.
 *  - senders: N controllers behind one simulated bottleneck (queueing
 *    delay = bytes in flight / rate) keep the queue near the target: the
 *    queueing delay settles within [target / 4, 3 x target], and each
 *    sender's window is smaller with 16 senders than with 4.
 *  - incast16: the 16-sender incast of docs/benchmarks.md in miniature,
 *    with the context's defaults but the target and the base ceiling
 *    (both 40 ms, as bench/ps/incast-adaptive): a queue that 16 windows
 *    at 4 KB overflow, half the senders starting behind a standing queue;
 *    after the first half of the run nothing is dropped, and no batch
 *    waits past rxe's retransmission timeout (it would be resent while
 *    still queued).
 *  - high: a delay above high_us (half the retransmission timeout) is cut
 *    whatever the base, by the larger of its and the target's cut; it
 *    never grows the window; high_us 0 is none.
 *  - dest: the shared bound: an engine with bytes in flight takes only
 *    what fits, an engine alone always may; give returns them; one entry
 *    per address, freed with its last reference; no bound, no entry.
 *  - handover: an engine's controller state (window, base delay) left in
 *    its destination's entry at its end starts the next engine to that
 *    address: the entry outlives its last reference while it holds the
 *    memo; the successor has the window and the base, so it cuts at a
 *    queue a fresh controller would take for its base (and grow into);
 *    a memo of no sample, or older than BEX__WND_MEMO_MAX_US, is not
 *    used; with a base epoch the handed base ages out as the successor's
 *    own would.
 *  - memo_bound: memo-only entries are bounded (a server that ever more
 *    addresses connect to): 3 x BEX__WND_MEMOS_MAX addresses each leave a
 *    memo and the table keeps the newest BEX__WND_MEMOS_MAX, the oldest
 *    starting afresh; entries engines hold are never dropped; once the
 *    table is over its cap, memos older than BEX__WND_MEMO_MAX_US go
 *    first, all of them. */
#include <arpa/inet.h>
#include <stdlib.h>
#include <string.h>

#include "sock/internal.h"
#include "transport/window.h"
#include "harness.h"

static const struct bex__wnd_params P = {
    .min = 4096, .max = 65536, .init = 16384, .target_us = 100};

static int grows(void)
{
    struct bex__wnd w;
    bex__wnd_init(&w, &P);
    CHECK_EQ(w.cwnd, 16384);
    uint64_t t = 0;
    /* one window's worth of bytes at the base delay: +AI */
    CHECK(bex__wnd_sample(&w, 50, 16384, t += 50) == BEX__WND_AI);
    CHECK_EQ(w.cwnd, 16384 + BEX__WND_AI);
    CHECK_EQ(w.base_us, 50);
    /* small batches add up to the same increase */
    uint32_t before = w.cwnd;
    for (int i = 0; i < 4; i++)
        bex__wnd_sample(&w, 60, before / 4, t += 60);
    CHECK(w.cwnd >= before + BEX__WND_AI * 95 / 100 && w.cwnd <= before + BEX__WND_AI);
    for (int i = 0; i < 10000; i++)
        bex__wnd_sample(&w, 50, w.cwnd, t += 50);
    CHECK_EQ(w.cwnd, P.max);
    CHECK_EQ(w.cuts, 0);
    /* the first window is clamped into [min, max] */
    struct bex__wnd_params q = P;
    q.init = 1;
    bex__wnd_init(&w, &q);
    CHECK_EQ(w.cwnd, P.min);
    q.init = 1u << 30;
    bex__wnd_init(&w, &q);
    CHECK_EQ(w.cwnd, P.max);
    return 0;
}

static int cuts(void)
{
    struct bex__wnd w;
    bex__wnd_init(&w, &P);
    uint64_t t = 1000;
    bex__wnd_sample(&w, 50, 0, t); /* base 50, no bytes: no growth */
    CHECK_EQ(w.cwnd, 16384);
    /* queueing 150 us, 50 over the target: cut 0.8 x 50 / 150 = 26.6 % */
    int64_t d = bex__wnd_sample(&w, 200, 4096, t += 10);
    CHECK(d < 0);
    CHECK_EQ(w.cwnd, 16384 - 16384 * 266 / 1000);
    CHECK_EQ(w.cuts, 1);
    /* within the delay of that sample: no second cut */
    CHECK(bex__wnd_sample(&w, 5000, 4096, t += 100) == 0);
    CHECK_EQ(w.cuts, 1);
    /* after it, a huge delay: at most half */
    uint32_t before = w.cwnd;
    bex__wnd_sample(&w, 5000, 4096, t += 200);
    CHECK_EQ(w.cwnd, before / 2);
    CHECK_EQ(w.cuts, 2);
    for (int i = 0; i < 50; i++)
        bex__wnd_sample(&w, 5000, 4096, t += 5000);
    CHECK_EQ(w.cwnd, P.min);
    CHECK(w.cuts >= 3);
    /* at the target exactly: no cut, growth */
    before = w.cwnd;
    CHECK(bex__wnd_sample(&w, 150, w.cwnd, t += 5000) > 0);
    CHECK(w.cwnd > before);
    return 0;
}

static int base(void)
{
    struct bex__wnd w;
    bex__wnd_init(&w, &P);
    uint64_t t = 0;
    bex__wnd_sample(&w, 400, 0, t += 400);
    CHECK_EQ(w.base_us, 400);
    bex__wnd_sample(&w, 300, 0, t += 400);
    CHECK_EQ(w.base_us, 300);
    bex__wnd_sample(&w, 900, 0, t += 900);
    CHECK_EQ(w.base_us, 300);
    CHECK_EQ(w.last_us, 900);
    CHECK_EQ(w.cuts, 1); /* 600 queueing, target 100 */
    /* a zero delay is a base of 1 us, not "none yet" */
    bex__wnd_init(&w, &P);
    bex__wnd_sample(&w, 0, 0, 1);
    CHECK_EQ(w.base_us, 1);
    return 0;
}

/* n controllers, one bottleneck of rate bytes/us, base 50 us, for steps
 * rounds; the mean queueing delay of the last quarter and each sender's
 * mean window then. Each controller's first sample sees the queue empty
 * (its base); the windows start at P.init. */
static void simulate(uint32_t n, uint32_t rate, int steps, double *queue_us, double *wnd)
{
    struct bex__wnd w[16];
    uint64_t t = 50;
    for (uint32_t i = 0; i < n; i++) { /* each first sees the queue empty */
        bex__wnd_init(&w[i], &P);
        bex__wnd_sample(&w[i], 50, 0, t);
    }
    double qsum = 0, wsum = 0;
    int counted = 0;
    for (int s = 0; s < steps; s++) {
        uint64_t inflight = 0;
        for (uint32_t i = 0; i < n; i++)
            inflight += w[i].cwnd;
        uint32_t q = (uint32_t)(inflight / rate);
        t += 50 + q;
        for (uint32_t i = 0; i < n; i++)
            bex__wnd_sample(&w[i], 50 + q, w[i].cwnd, t);
        if (s >= steps * 3 / 4) {
            qsum += q;
            wsum += (double)inflight / n;
            counted++;
        }
    }
    *queue_us = qsum / counted;
    *wnd = wsum / counted;
}

static int senders(void)
{
    double q4, w4, q16, w16;
    /* 1000 bytes/us: the target (100 us) is 100 KB in flight in all */
    simulate(4, 1000, 4000, &q4, &w4);
    simulate(16, 1000, 4000, &q16, &w16);
    fprintf(stderr, "4 senders: queueing %.0f us, window %.0f; 16: %.0f us, %.0f\n", q4, w4, q16,
            w16);
    CHECK(q4 >= P.target_us / 4.0 && q4 <= 3.0 * P.target_us);
    CHECK(q16 >= P.target_us / 4.0 && q16 <= 3.0 * P.target_us);
    CHECK(w16 < w4 / 2);
    CHECK(w4 > P.min && w4 < P.max && w16 >= P.min);
    /* 100 bytes/us: 16 x min (4 KB) is 655 us of queue; the bound, not
     * the target, holds then: every window sits at min */
    simulate(16, 100, 4000, &q16, &w16);
    CHECK(w16 <= P.min * 1.1);
    return 0;
}

/* The incast16 bottleneck (the window's defaults but the target and the
 * base ceiling): 2 Mbit/s (0.25 bytes/us), a 48 KB queue (less
 * than 16 x 4 KB, as the 64 KB tbf queue less the Fetches and control
 * messages beside the Pushes was in the 16-sender runs), 1 ms base delay
 * (Soft-RoCE in a VM), rxe's retransmission timeout at qp_timeout 14. */
#define I16_N     16
#define I16_Q     (48 * 1024)
#define I16_BASE  1000u
#define I16_RTO   67000u
#define I16_STEPS 8000

/* One round: every active sender has its window in flight; in an order
 * that turns each round, what does not fit the queue is dropped and its
 * batch completes a timeout later. Returns the batches dropped. */
static int i16_round(struct bex__wnd *w, int active, int s, uint64_t *t, int *over_rto)
{
    uint64_t inflight = 0, longest = 0;
    for (int i = 0; i < active; i++)
        inflight += w[i].cwnd;
    uint64_t queued = inflight < I16_Q ? inflight : I16_Q, acc = 0;
    uint32_t delay = I16_BASE + (uint32_t)(queued * 4); /* 0.25 bytes/us */
    int drops = 0;
    for (int k = 0; k < active; k++) {
        struct bex__wnd *x = &w[(k + s) % active];
        acc += x->cwnd;
        uint32_t d = delay + (acc > I16_Q ? I16_RTO : 0);
        drops += acc > I16_Q;
        *over_rto += acc <= I16_Q && d >= I16_RTO;
        longest = d > longest ? d : longest;
        bex__wnd_sample(x, d, x->cwnd, *t + d);
    }
    *t += longest;
    return drops;
}

/* The incast16 run: drops in each half, the windows' sum at the end, and
 * per sender the mean window over the last quarter (share[]). */
struct i16_out {
    int first, late;
    int rto_first, rto_late; /* batches not dropped whose delay passed the RTO */
    uint64_t inflight;
    uint32_t last_base;
    double share[I16_N];
};

static int i16_run(struct i16_out *o)
{
    bex_ctx_config c = {.send_window_mode = BEX_WINDOW_ADAPTIVE,
                        .send_window_target_us = 40000,
                        .send_window_base_max_us = 40000,
                        .qp_timeout = 14}; /* the context's default: 67 ms */
    CHECK_OK(bex__ctx_window_check(&c));
    struct bex__wnd_params p;
    bex__ctx_window_params(&c, &p);
    CHECK_EQ(p.init, 16384);
    CHECK_EQ(p.high_us, 33554);
    struct bex__wnd w[I16_N];
    uint64_t t = 0;
    int active = 0;
    memset(o, 0, sizeof(*o));
    for (int s = 0; s < I16_STEPS; s++) {
        /* half start at once (their first sample sees the queue empty),
         * the rest one by one once a queue stands */
        int want = s == 0 ? I16_N / 2 : s < 100 ? active : active + (s % 10 == 0 && active < I16_N);
        for (; active < want; active++) {
            bex__wnd_init(&w[active], &p);
            if (s == 0)
                bex__wnd_sample(&w[active], I16_BASE, 0, t);
        }
        int rto = 0, d = i16_round(w, active, s, &t, &rto);
        if (s < I16_STEPS / 2) {
            o->first += d;
            o->rto_first += rto;
        } else {
            o->late += d;
            o->rto_late += rto;
        }
        for (int i = 0; s >= I16_STEPS * 3 / 4 && i < active; i++)
            o->share[i] += w[i].cwnd / (I16_STEPS / 4.0);
    }
    CHECK_EQ(active, I16_N);
    for (int i = 0; i < I16_N; i++)
        o->inflight += w[i].cwnd;
    for (int i = 0; getenv("WND_VERBOSE") && i < I16_N; i++)
        fprintf(stderr, "  sender %d: window %u base %u last %u cuts %llu\n", i, w[i].cwnd,
                w[i].base_us, w[i].last_us, (unsigned long long)w[i].cuts);
    o->last_base = w[I16_N - 1].base_us;
    return 0;
}

static int incast16(void)
{
    struct i16_out o;
    CHECK_OK(i16_run(&o));
    fprintf(stderr,
            "incast16: drops %d then %d; past the RTO %d then %d; windows %llu bytes in all, "
            "last base %u us\n",
            o.first, o.late, o.rto_first, o.rto_late, (unsigned long long)o.inflight, o.last_base);
    CHECK_EQ(o.late, 0);
    /* no batch waits past the RTO (rxe would resend it, still queued):
     * without high_us every one of the second half did, the bases at the
     * 40 ms ceiling and the windows at 2153 bytes, 139 ms of delay */
    CHECK_EQ(o.rto_late, 0);
    CHECK(o.inflight <= I16_Q);
    return 0;
}

/* high_us: a delay above it is cut though the base (here at its ceiling)
 * makes it no queueing, and never grows the window; at or below it the
 * target rules as before. */
static int high(void)
{
    struct bex__wnd_params p = P;
    p.base_max_us = 400;
    p.high_us = 500;
    struct bex__wnd w;
    bex__wnd_init(&w, &p);
    uint64_t t = 0;
    bex__wnd_sample(&w, 450, 0, t += 450); /* base 400 (the ceiling) */
    CHECK_EQ(w.base_us, 400);
    /* 500: queueing 100, at the target, at high_us: growth */
    CHECK(bex__wnd_sample(&w, 500, w.cwnd, t += 500) > 0);
    CHECK_EQ(w.cuts, 0);
    /* 1000: the larger of the two cuts, the target's (0.8 x 500 / 600,
     * at most half) over high_us's (0.8 x 500 / 1000) */
    uint32_t before = w.cwnd;
    bex__wnd_sample(&w, 1000, w.cwnd, t += 1000);
    CHECK_EQ(w.cwnd, before / 2);
    /* a target no queue here reaches: high_us alone cuts */
    p.target_us = 100000;
    bex__wnd_init(&w, &p);
    t = 0;
    bex__wnd_sample(&w, 400, 0, t += 400);
    before = w.cwnd;
    /* 1000 is 600 of queueing, far below the target: the cut is high's,
     * 0.8 x 500 / 1000 = 400 permille */
    CHECK(bex__wnd_sample(&w, 1000, 4096, t += 1000) < 0);
    CHECK_EQ(w.cwnd, before - before * 400 / 1000);
    CHECK_EQ(w.cuts, 1);
    /* above high_us within the cut's delay: neither cut nor growth */
    before = w.cwnd;
    CHECK(bex__wnd_sample(&w, 600, 4096, t += 100) == 0);
    CHECK_EQ(w.cwnd, before);
    /* at high_us: growth again */
    CHECK(bex__wnd_sample(&w, 500, w.cwnd, t += 2000) > 0);
    /* high_us 0: none (the target alone) */
    p.high_us = 0;
    bex__wnd_init(&w, &p);
    bex__wnd_sample(&w, 400, 0, 400);
    CHECK(bex__wnd_sample(&w, 5000, 4096, 6000) > 0);
    CHECK_EQ(w.cuts, 0);
    return 0;
}

/* The same run: the senders that started behind the standing queue (the
 * second half) learned a larger base than the first, so they see less
 * queueing in the same delay. Their mean windows must stay within 1.5x of
 * the first half's (a Push waits on its sender's share of the
 * bottleneck: an unfair share is the slowest Pushes, the P99). */
static int fair16(void)
{
    struct i16_out o;
    CHECK_OK(i16_run(&o));
    double lo = 1e18, hi = 0, early = 0, late = 0;
    for (int i = 0; i < I16_N; i++) {
        lo = o.share[i] < lo ? o.share[i] : lo;
        hi = o.share[i] > hi ? o.share[i] : hi;
        if (i < I16_N / 2)
            early += o.share[i] / (I16_N / 2);
        else
            late += o.share[i] / (I16_N / 2);
    }
    fprintf(stderr,
            "fair16: mean window of the first half %.0f, of the late half %.0f; "
            "smallest %.0f, largest %.0f bytes\n",
            early, late, lo, hi);
    CHECK(hi <= 1.5 * lo);
    return 0;
}

static int dest(void)
{
    struct bex__wnd_dests d;
    CHECK_OK(bex__wnd_dests_init(&d, 10000));
    uint32_t a = inet_addr("10.0.0.1"), b = inet_addr("10.0.0.2");
    struct bex__wnd_dest *x = bex__wnd_dest_get(&d, a, NULL), *y = bex__wnd_dest_get(&d, a, NULL);
    struct bex__wnd_dest *z = bex__wnd_dest_get(&d, b, NULL);
    CHECK(x && x == y && z && z != x);
    CHECK_EQ(x->refs, 2);
    uint64_t now;
    CHECK(bex__wnd_dest_take(x, 6000, false, &now));
    CHECK_EQ(now, 6000);
    CHECK(!bex__wnd_dest_take(x, 6000, false, &now)); /* 12000 > 10000 */
    CHECK_EQ(atomic_load(&x->inflight), 6000);
    CHECK(bex__wnd_dest_take(x, 6000, true, &now)); /* alone: always */
    CHECK_EQ(now, 12000);
    CHECK(bex__wnd_dest_take(z, 10000, false, &now)); /* its own bound */
    bex__wnd_dest_give(x, 6000);
    CHECK(bex__wnd_dest_take(x, 4000, false, &now));
    CHECK_EQ(now, 10000);
    bex__wnd_dest_put(&d, y, NULL);
    CHECK_EQ(x->refs, 1);
    CHECK_EQ(bex__hmap_len(&d.map), 2);
    bex__wnd_dest_put(&d, x, NULL);
    bex__wnd_dest_put(&d, z, NULL);
    CHECK_EQ(bex__hmap_len(&d.map), 0);
    bex__wnd_dest_put(&d, NULL, NULL);
    bex__wnd_dests_free(&d);
    /* no bound: no entry */
    CHECK_OK(bex__wnd_dests_init(&d, 0));
    CHECK(bex__wnd_dest_get(&d, a, NULL) == NULL);
    CHECK(bex__wnd_dest_get(NULL, a, NULL) == NULL);
    bex__wnd_dests_free(&d);
    return 0;
}

/* The incast bench's settings: target and base ceiling 40 ms, epoch 2 s. */
static const struct bex__wnd_params PH = {.min = 1024,
                                          .max = 262144,
                                          .init = 16384,
                                          .target_us = 40000,
                                          .base_max_us = 40000,
                                          .base_epoch_us = 2000000};

static int handover(void)
{
    struct bex__wnd_dests d;
    CHECK_OK(bex__wnd_dests_init(&d, 262144));
    uint32_t a = inet_addr("10.0.0.1");
    struct bex__wnd_memo m;
    /* the first engine: no memo yet; it learns a 1 ms base, then a queue
     * of 60 ms cuts it (every delay apart: each cut is seen first) */
    struct bex__wnd w1;
    bex__wnd_init(&w1, &PH);
    struct bex__wnd_dest *x = bex__wnd_dest_get(&d, a, &m);
    CHECK(x);
    CHECK_EQ(m.base_us, 0);
    uint64_t t = 1000000;
    bex__wnd_sample(&w1, 1000, 4096, t);
    for (int i = 0; i < 6; i++) {
        t += 70000;
        bex__wnd_sample(&w1, 61000, 4096, t);
    }
    CHECK(w1.cuts >= 5);
    CHECK(w1.cwnd < PH.init / 2);
    CHECK_EQ(w1.base_us, 1000);
    /* it goes (the connection failed): its state stays with the address */
    bex__wnd_save(&w1, t, &m);
    bex__wnd_dest_put(&d, x, &m);
    CHECK_EQ(bex__hmap_len(&d.map), 1);
    /* its successor, 5 s later */
    struct bex__wnd_memo got;
    struct bex__wnd_dest *y = bex__wnd_dest_get(&d, a, &got);
    CHECK(y == x);
    CHECK_EQ(y->refs, 1);
    CHECK_EQ(got.cwnd, w1.cwnd);
    CHECK_EQ(got.base_us, 1000);
    struct bex__wnd w2, fresh;
    bex__wnd_init(&w2, &PH);
    bex__wnd_init(&fresh, &PH);
    t += 5000000;
    CHECK(bex__wnd_resume(&w2, &got, t));
    CHECK_EQ(w2.cwnd, w1.cwnd);
    CHECK_EQ(w2.base_us, 1000);
    /* the queue is still there (61 ms): the successor cuts at once; a
     * fresh controller takes it for its base and grows */
    t += 1000;
    uint32_t before = w2.cwnd;
    bex__wnd_sample(&w2, 61000, 4096, t);
    bex__wnd_sample(&fresh, 61000, 4096, t);
    fprintf(stderr, "handover: successor %u -> %u bytes; fresh %u -> %u\n", before, w2.cwnd,
            PH.init, fresh.cwnd);
    CHECK(w2.cwnd < before);
    CHECK_EQ(w2.cuts, 1);
    CHECK(fresh.cwnd > PH.init);
    CHECK_EQ(fresh.cuts, 0);
    /* the handed base ages out as the successor's own would: two epochs
     * of 2 ms samples and the base is 2 ms */
    for (int i = 0; i < 3; i++) {
        t += PH.base_epoch_us;
        bex__wnd_sample(&w2, 2000, 1024, t);
    }
    CHECK_EQ(w2.base_us, 2000);
    /* an engine that had no sample leaves no memo: the last one stays */
    struct bex__wnd w3;
    bex__wnd_init(&w3, &PH);
    struct bex__wnd_dest *z = bex__wnd_dest_get(&d, a, NULL);
    bex__wnd_save(&w3, t, &m);
    CHECK_EQ(m.base_us, 0);
    bex__wnd_dest_put(&d, z, &m);
    bex__wnd_save(&w2, t, &m);
    bex__wnd_dest_put(&d, y, &m);
    y = bex__wnd_dest_get(&d, a, &got);
    CHECK_EQ(got.cwnd, w2.cwnd);
    CHECK_EQ(got.base_us, 2000);
    /* too old: a start from scratch */
    struct bex__wnd w4;
    bex__wnd_init(&w4, &PH);
    CHECK(!bex__wnd_resume(&w4, &got, got.at_us + BEX__WND_MEMO_MAX_US + 1));
    CHECK_EQ(w4.cwnd, PH.init);
    CHECK_EQ(w4.base_us, 0);
    CHECK(bex__wnd_resume(&w4, &got, got.at_us + BEX__WND_MEMO_MAX_US));
    bex__wnd_dest_put(&d, y, NULL);
    /* an address whose engines left no memo: its entry goes as before */
    uint32_t b = inet_addr("10.0.0.2");
    x = bex__wnd_dest_get(&d, b, NULL);
    CHECK_EQ(bex__hmap_len(&d.map), 2);
    bex__wnd_dest_put(&d, x, NULL);
    CHECK_EQ(bex__hmap_len(&d.map), 1);
    bex__wnd_dests_free(&d); /* the memo's entry freed here (ASan) */
    return 0;
}

static uint32_t nth_ip(uint32_t i)
{
    return htonl(0x0a000000u + i);
}

/* Addresses [from, to) each get an engine that goes leaving a memo made
 * at t0 + i. */
static int leave_memos(struct bex__wnd_dests *d, uint32_t from, uint32_t to, uint64_t t0)
{
    for (uint32_t i = from; i < to; i++) {
        struct bex__wnd_dest *x = bex__wnd_dest_get(d, nth_ip(i), NULL);
        CHECK(x);
        struct bex__wnd_memo m = {.cwnd = 8192, .base_us = 1000, .at_us = t0 + i};
        bex__wnd_dest_put(d, x, &m);
    }
    return 0;
}

static int memo_bound(void)
{
    struct bex__wnd_dests d;
    CHECK_OK(bex__wnd_dests_init(&d, 262144));
    const uint32_t cap = BEX__WND_MEMOS_MAX, n = 3 * cap, held = 4;
    uint64_t t0 = 1000000;
    struct bex__wnd_dest *live[4];
    for (uint32_t i = 0; i < held; i++)
        CHECK((live[i] = bex__wnd_dest_get(&d, nth_ip(n + i), NULL)));
    CHECK_OK(leave_memos(&d, 0, n, t0));
    fprintf(stderr, "memo_bound: %u addresses left memos, %u entries kept (cap %u, %u held)\n", n,
            bex__hmap_len(&d.map), cap, held);
    CHECK_EQ(bex__hmap_len(&d.map), cap + held);
    for (uint32_t i = 0; i < held; i++) {
        CHECK(bex__wnd_dest_get(&d, nth_ip(n + i), NULL) == live[i]);
        CHECK_EQ(live[i]->refs, 2);
        bex__wnd_dest_put(&d, live[i], NULL);
    }
    /* the newest memo kept, the oldest gone (its address starts afresh) */
    struct bex__wnd_memo got;
    struct bex__wnd_dest *x = bex__wnd_dest_get(&d, nth_ip(n - 1), &got);
    CHECK_EQ(got.at_us, t0 + n - 1);
    bex__wnd_dest_put(&d, x, NULL);
    x = bex__wnd_dest_get(&d, nth_ip(0), &got);
    CHECK_EQ(got.base_us, 0);
    bex__wnd_dest_put(&d, x, NULL);
    CHECK_EQ(bex__hmap_len(&d.map), cap + held);
    /* one memo past the cap, made after all others went stale: they go */
    CHECK_OK(leave_memos(&d, n + held, n + held + 1, t0 + n + BEX__WND_MEMO_MAX_US));
    CHECK_EQ(bex__hmap_len(&d.map), 1 + held);
    for (uint32_t i = 0; i < held; i++)
        bex__wnd_dest_put(&d, live[i], NULL);
    CHECK_EQ(bex__hmap_len(&d.map), 1);
    bex__wnd_dests_free(&d);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(grows), BEX_CASE(cuts), BEX_CASE(base), BEX_CASE(senders), BEX_CASE(fair16),
              BEX_CASE(incast16), BEX_CASE(high), BEX_CASE(dest), BEX_CASE(handover),
              BEX_CASE(memo_bound))
