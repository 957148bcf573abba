/* SPDX-License-Identifier: Apache-2.0 */
/* SRQ mode: a receive completion of a destroyed QP must never reach the
 * engine of a new QP that got the same QP number (issue 8 item 2).
 *
 * The shared queue's completions are routed by wc->qp_num. A QP destroyed
 * with completions still in the shared CQ leaves them there; a new QP may
 * be given the freed number (rxe and mlx5 allocate cyclically, but wrap),
 * and the old peer's messages would then be delivered on the new
 * connection and charged to its credits.
 *
 * Deterministic, without a device: engines over stand-in QPs
 * (bex__engine_create_nodev) on a shared queue over a stand-in SRQ and CQ
 * (bex__srq_create_nodev), whose verbs are this file's: posted SRQ
 * receives wait in a list, a peer's SEND takes the oldest one and puts its
 * completion in the CQ, the test says when the I/O thread polls
 * (bex__srq_next + bex__engine_srq_complete, as src/sock/io.c does).
 *
 * Cases:
 *  reused_qpn   A's peer opened stream 7 and sent two messages whose
 *               completions are still in the CQ when A fails and is
 *               destroyed; B takes A's QP number and its own peer opens
 *               stream 1 and sends one message. Polling must give B
 *               exactly its peer's OPEN and message, and charge B with
 *               exactly those two receives.
 *  others_kept  A's completions are interleaved with those of C (another
 *               QP, alive): whatever A's leaving does with the CQ, C gets
 *               all of its own, in order, and B (A's number) none.
 *  poll_fails   the CQ fails while A's leaving looks at it: the failure
 *               reaches the I/O thread (bex__srq_next returns it), which
 *               fails every engine of the thread.
 *  chain        one message arrives on each of N engines: the receives
 *               they give back in one poll turn go onto the shared queue
 *               in one ibv_post_srq_recv, not one per engine (issue 24
 *               item 2, Figure 11 at 1024 QPs), and every one of them is
 *               posted before an engine's next send (its credit) goes. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "transport/rdma/engine.h"
#include "transport/rdma/srq.h"
#include "engine_test.h"
#include "wire/hdr.h"

enum { DEPTH = 64, RQ = 16, MAXQ = 256, MAXEV = 64 };

/* ---------------- the stand-in NIC ---------------- */

static struct ibv_context nic;
static struct ibv_srq srq_standin;
static struct ibv_cq cq_standin;

static struct ibv_recv_wr posted[MAXQ]; /* SRQ receives, oldest first */
static struct ibv_sge posted_sge[MAXQ];
static uint32_t n_posted;
static struct ibv_wc cq[MAXQ]; /* the shared CQ, oldest first */
static uint32_t cq_head, cq_n;
static int poll_fail; /* the next poll returns this (negative) */

static uint32_t srq_posts;             /* ibv_post_srq_recv calls */
static uint32_t sends, posted_at_send; /* post_send calls; n_posted at the last */

static int fake_post_srq_recv(struct ibv_srq *s, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    (void)bad;
    srq_posts++;
    CHECK(s == &srq_standin);
    for (; wr; wr = wr->next) {
        CHECK(n_posted < MAXQ && wr->num_sge == 1);
        posted[n_posted] = *wr;
        posted_sge[n_posted] = wr->sg_list[0];
        posted[n_posted].sg_list = &posted_sge[n_posted];
        posted[n_posted].next = NULL;
        n_posted++;
    }
    return 0;
}

static int fake_poll_cq(struct ibv_cq *c, int num, struct ibv_wc *wc)
{
    CHECK(c == &cq_standin);
    if (poll_fail) {
        int f = poll_fail;
        poll_fail = 0;
        cq_n = 0; /* a failing CQ loses what it had */
        return f;
    }
    int n = 0;
    while (n < num && cq_n) {
        wc[n++] = cq[cq_head % MAXQ];
        cq_head++;
        cq_n--;
    }
    return n;
}

/* Sends of the engines under test: accepted, never executed (nothing here
 * needs them), never completed. */
static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    (void)qp;
    (void)wr;
    (void)bad;
    sends++;
    posted_at_send = n_posted;
    return 0;
}

static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    (void)qp;
    (void)wr;
    (void)bad;
    CHECK(!"a QP of an SRQ-mode engine has no receive queue of its own");
    return EINVAL;
}

/* A peer's SEND arrives on QP qpn: it takes the oldest posted receive (an
 * RNR here would be the accounting's failure) and its completion joins
 * the CQ. hdr: a control message's header; else a header-free DATA of
 * payload on stream. */
static void arrive(uint32_t qpn, const struct bex__hdr *hdr, uint32_t stream, const char *payload)
{
    CHECK(n_posted > 0);
    struct ibv_recv_wr r = posted[0];
    struct ibv_sge sge = posted_sge[0];
    memmove(posted, posted + 1, (n_posted - 1) * sizeof(*posted));
    memmove(posted_sge, posted_sge + 1, (n_posted - 1) * sizeof(*posted_sge));
    n_posted--;
    for (uint32_t i = 0; i < n_posted; i++)
        posted[i].sg_list = &posted_sge[i];
    struct ibv_wc wc = {.wr_id = r.wr_id, .status = IBV_WC_SUCCESS, .qp_num = qpn};
    if (hdr) {
        CHECK(sge.length >= BEX__HDR_LEN);
        bex__hdr_encode(hdr, (uint8_t *)(uintptr_t)sge.addr);
        wc.opcode = IBV_WC_RECV;
        wc.byte_len = BEX__HDR_LEN;
    } else {
        uint32_t len = (uint32_t)strlen(payload) + 1;
        CHECK(sge.length >= len);
        memcpy((void *)(uintptr_t)sge.addr, payload, len);
        wc.opcode = IBV_WC_RECV;
        wc.byte_len = len;
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.imm_data = htonl(bex__imm_encode(stream, 0));
    }
    CHECK(cq_n < MAXQ);
    cq[(cq_head + cq_n++) % MAXQ] = wc;
}

static void arrive_open(uint32_t qpn, uint32_t stream)
{
    struct bex__hdr h = {.type = BEX__MSG_OPEN, .stream = stream};
    arrive(qpn, &h, 0, NULL);
}

/* ---------------- the sock layer's side: what each engine was handed ---------------- */

struct conn {
    const char *name;
    struct ibv_qp qp;
    struct bex__engine *e;
    bool up;
    int fails, fail_err;
    uint32_t opens[MAXEV], n_opens;
    char msgs[MAXEV][32];
    uint32_t msg_stream[MAXEV], n_msgs;
};

static struct conn *conn_of(struct bex__xport *x)
{
    return bex__engine_user(bex__engine_of(x));
}

static void up_on_up(struct bex__xport *x)
{
    conn_of(x)->up = true;
}

static void up_on_msg(struct bex__xport *x, uint32_t stream, void *buf, size_t len)
{
    struct conn *c = conn_of(x);
    CHECK(c->n_msgs < MAXEV && len <= sizeof c->msgs[0]);
    memcpy(c->msgs[c->n_msgs], buf, len);
    c->msgs[c->n_msgs][sizeof c->msgs[0] - 1] = 0;
    c->msg_stream[c->n_msgs++] = stream;
    bex_mem_free(buf);
}

static void up_on_open(struct bex__xport *x, uint32_t stream)
{
    struct conn *c = conn_of(x);
    CHECK(c->n_opens < MAXEV);
    c->opens[c->n_opens++] = stream;
}

static void up_on_peer_close(struct bex__xport *x, uint32_t stream)
{
    (void)x;
    (void)stream;
}

static void up_on_send_done(struct bex__xport *x, struct bex__msg *m, int status)
{
    (void)x;
    (void)m;
    (void)status;
    CHECK(!"nothing is sent");
}

static void up_on_stream_closed(struct bex__xport *x, struct bex__stream *st)
{
    (void)x;
    (void)st;
}

static int up_on_direct(struct bex__xport *x, uint32_t imm)
{
    (void)x;
    (void)imm;
    return -EPROTO;
}

static void up_on_fail(struct bex__xport *x, int err)
{
    struct conn *c = conn_of(x);
    c->fails++;
    c->fail_err = err;
}

static const struct bex__transport_upcalls ops = {BEX_TEST_UP_ON};

/* ---------------- the I/O thread ---------------- */

static struct bex__log lg;
static struct bex__stats stats;
static struct bex__engine_shared sh;
static struct bex__engine_config cfg;
static bex_mem_pool *pool, *recv_pool, *landing;
static uint32_t next_id = 1;

static void log_sink(int level, const char *msg, void *arg)
{
    (void)arg;
    if (getenv("SRQ_VERBOSE"))
        fprintf(stderr, "  [log %d] %s\n", level, msg);
}

static void thread_init(void)
{
    memset(&nic, 0, sizeof nic);
    nic.ops.post_srq_recv = fake_post_srq_recv;
    nic.ops.poll_cq = fake_poll_cq;
    nic.ops.post_send = fake_post_send;
    nic.ops.post_recv = fake_post_recv;
    srq_standin = (struct ibv_srq){.context = &nic};
    cq_standin = (struct ibv_cq){.context = &nic};
    n_posted = cq_head = cq_n = 0;
    bex_mem_registrar reg;
    bex_mem_registrar_noop(&reg);
    bex_mem_config lc = {.kind = BEX_MEM_POOL_LANDING};
    CHECK_OK(bex_mem_pool_create(&reg, NULL, &pool));
    CHECK_OK(bex_mem_pool_create(&reg, NULL, &recv_pool));
    CHECK_OK(bex_mem_pool_create(&reg, &lc, &landing));
    bex__log_init(&lg, log_sink, NULL, BEX_LOG_DEBUG);
    memset(&stats, 0, sizeof stats);
    sh = (struct bex__engine_shared){
        .pool = pool, .landing = landing, .recv_pool = recv_pool, .stats = &stats, .log = &lg};
    cfg = bex_test_engine_config();
    cfg.rq_depth = RQ;
    CHECK_OK(bex__srq_create_nodev(&sh, DEPTH, cfg.eager_max, &cq_standin, &srq_standin, &sh.srq));
}

/* Receives the queue accounts for are all somewhere: posted, held by an
 * engine, or in the pool; and the stand-in SRQ holds the posted ones (no
 * receive of this file is lost mid-SEND). */
static void check_conserved(void)
{
    struct bex__srq *q = sh.srq;
    CHECK_EQ(q->posted + q->held + q->n_pool, q->made);
    CHECK_EQ(q->posted, n_posted + cq_n + q->wc_n);
}

/* lost: receives whose completions a failed CQ lost (counted posted) */
static void thread_fini(uint32_t lost)
{
    n_posted += lost;
    check_conserved();
    CHECK_EQ(sh.srq->held, 0);
    CHECK_EQ(sh.srq->granted, 0);
    bex__srq_destroy(sh.srq);
    sh.srq = NULL;
    bex_mem_pool *pools[3] = {pool, recv_pool, landing};
    for (int k = 0; k < 3; k++) {
        bex_mem_stats st;
        bex_mem_pool_collect(pools[k]);
        bex_mem_pool_stats(pools[k], &st);
        CHECK_EQ(st.in_use_bytes, 0); /* every buffer came back */
        CHECK_OK(bex_mem_pool_destroy(pools[k]));
    }
    bex__log_fini(&lg);
}

/* A connection's engine, on QP number qpn, up with a peer granting RQ. */
static void conn_up(struct conn *c, const char *name, uint32_t qpn)
{
    memset(c, 0, sizeof(*c));
    c->name = name;
    c->qp = (struct ibv_qp){.context = &nic, .qp_num = qpn, .state = IBV_QPS_RESET};
    CHECK_OK(bex__engine_create_nodev(&sh, &cfg, &ops, next_id++, c, &c->qp, &c->e));
    struct bex__engine_peer peer = {
        .rdma = {.qpn = 0x900 + qpn},
        .rq_depth = RQ,
        .max_rndv = 16,
        .eager_max = cfg.eager_max,
        .max_msg = cfg.max_msg,
    };
    CHECK_OK(bex__engine_connect(c->e, &peer));
    bex__engine_start(c->e);
    CHECK(c->up && c->fails == 0);
}

/* The connection goes (its peer hung up, say): the engine fails, then is
 * destroyed, its QP with it, as the sock layer does. */
static void conn_down(struct conn *c)
{
    if (!bex__engine_is_dead(c->e))
        bex__engine_fail(c->e, -ECONNRESET);
    CHECK(c->qp.state == IBV_QPS_RESET);
    bex__engine_destroy(c->e);
    c->e = NULL;
}

/* The I/O thread polls the shared CQ until nothing is left (as
 * src/sock/io.c's poll_cqs, turn after turn): the poll's result. */
static int io_poll(void)
{
    struct ibv_wc wc;
    int rc;
    while ((rc = bex__srq_next(sh.srq, &wc)) > 0)
        (void)bex__engine_srq_complete(sh.srq, &wc);
    bex__srq_flush(sh.srq); /* the turn's reposts, as poll_cqs */
    return rc;
}

/* ---------------- cases ---------------- */

enum { QPN_A = 0x11, QPN_C = 0x22 };

static int reused_qpn(void)
{
    thread_init();
    struct conn a, b;
    conn_up(&a, "A", QPN_A);
    check_conserved();
    /* A's peer opens stream 7: A gets it */
    arrive_open(QPN_A, 7);
    CHECK_EQ(io_poll(), 0);
    CHECK_EQ(a.n_opens, 1);
    CHECK_EQ(a.opens[0], 7);
    /* its receive went back to the queue at the turn's end (bex__srq_flush),
     * its credit not yet to the peer */
    CHECK_EQ(sh.srq->held, 0);
    CHECK_EQ(bex__engine_charged(a.e), 1);
    /* two messages of A's peer arrive; before the thread polls them, A's
     * connection goes */
    arrive(QPN_A, NULL, 7, "old peer 1");
    arrive(QPN_A, NULL, 7, "old peer 2");
    conn_down(&a);
    CHECK_EQ(a.fails, 1);
    CHECK_EQ(sh.srq->held, 0); /* what A held went back with its share */
    CHECK_EQ(sh.srq->granted, 0);
    /* B's QP is given A's number; its peer opens stream 1 and sends */
    conn_up(&b, "B", QPN_A);
    arrive_open(QPN_A, 1);
    arrive(QPN_A, NULL, 1, "new peer");
    CHECK_EQ(io_poll(), 0);
    /* B got its own peer's traffic and nothing of A's */
    for (uint32_t i = 0; i < b.n_msgs; i++)
        fprintf(stderr, "B was handed \"%s\" on stream %u\n", b.msgs[i], b.msg_stream[i]);
    for (uint32_t i = 0; i < b.n_opens; i++)
        fprintf(stderr, "B was handed an OPEN of stream %u\n", b.opens[i]);
    CHECK_EQ(b.fails, 0);
    CHECK_EQ(b.n_opens, 1);
    CHECK_EQ(b.opens[0], 1);
    CHECK_EQ(b.n_msgs, 1);
    CHECK(strcmp(b.msgs[0], "new peer") == 0);
    CHECK_EQ(b.msg_stream[0], 1);
    /* and B is charged with exactly its peer's two receives: the OPEN's
     * and the message's (its slot refilled), posted again at the turn's
     * end, their credits owed to B's peer */
    CHECK_EQ(bex__engine_charged(b.e), 2);
    CHECK_EQ(sh.srq->held, 0);
    CHECK_EQ(sh.srq->granted, RQ);
    check_conserved();
    conn_down(&b);
    CHECK_EQ(io_poll(), 0);
    thread_fini(0);
    return 0;
}

static int others_kept(void)
{
    thread_init();
    struct conn a, b, c;
    conn_up(&a, "A", QPN_A);
    conn_up(&c, "C", QPN_C);
    arrive_open(QPN_A, 7);
    arrive_open(QPN_C, 3);
    CHECK_EQ(io_poll(), 0);
    CHECK_EQ(a.n_opens, 1);
    CHECK_EQ(c.n_opens, 1);
    /* in the CQ: A's and C's messages, interleaved */
    char want[5][16];
    for (int i = 0; i < 5; i++) {
        snprintf(want[i], sizeof want[i], "c%d", i);
        arrive(QPN_A, NULL, 7, "old peer");
        arrive(QPN_C, NULL, 3, want[i]);
    }
    conn_down(&a);
    conn_up(&b, "B", QPN_A);
    CHECK_EQ(io_poll(), 0);
    CHECK_EQ(c.fails, 0);
    CHECK_EQ(c.n_msgs, 5);
    for (int i = 0; i < 5; i++) {
        CHECK(strcmp(c.msgs[i], want[i]) == 0); /* all of C's, in order */
        CHECK_EQ(c.msg_stream[i], 3);
    }
    CHECK_EQ(b.fails, 0);
    CHECK_EQ(b.n_msgs, 0);
    CHECK_EQ(b.n_opens, 0);
    /* C is charged with its OPEN's receive and its messages' (refilled,
     * posted again at the turn's end): 6, B none */
    CHECK_EQ(bex__engine_charged(c.e), 6);
    CHECK_EQ(bex__engine_charged(b.e), 0);
    CHECK_EQ(sh.srq->held, 0);
    check_conserved();
    conn_down(&b);
    conn_down(&c);
    CHECK_EQ(io_poll(), 0);
    thread_fini(0);
    return 0;
}

static int poll_fails(void)
{
    thread_init();
    struct conn a, c;
    conn_up(&a, "A", QPN_A);
    conn_up(&c, "C", QPN_C);
    arrive(QPN_A, NULL, 7, "old peer");
    arrive(QPN_C, NULL, 3, "c");
    poll_fail = -5; /* the next poll of the CQ fails */
    conn_down(&a);
    int rc = io_poll();
    /* the thread learns of the failure, however the poll came: from A's
     * leaving or from the thread's own */
    CHECK(rc < 0);
    CHECK_EQ(c.n_msgs, 0); /* lost with the CQ */
    /* the thread fails every engine of the queue (cq_failed in io.c) */
    bex__engine_fail(c.e, -EIO);
    CHECK_EQ(c.fails, 1);
    conn_down(&c);
    CHECK_EQ(io_poll(), 0);
    CHECK_EQ(sh.srq->held, 0);
    CHECK_EQ(sh.srq->granted, 0);
    /* the lost completions' receives are counted posted forever (as a QP
     * destroyed mid-SEND): nothing else is missing */
    CHECK_EQ(sh.srq->posted + sh.srq->n_pool, sh.srq->made);
    thread_fini(2);
    return 0;
}

/* N_CHAIN engines with shares of RQ_CHAIN; a credit update goes once
 * half a share waits (the engine's k), so M_CHAIN messages each make every
 * engine send one at its next progress, ack delay or not */
enum { N_CHAIN = 8, RQ_CHAIN = DEPTH / N_CHAIN, M_CHAIN = RQ_CHAIN / 2 };

/* M_CHAIN messages from the peer of each QP in [first, first + n) */
static void arrive_each(uint32_t first, uint32_t n)
{
    for (uint32_t m = 0; m < M_CHAIN; m++)
        for (uint32_t i = 0; i < n; i++)
            arrive(first + i, NULL, 1, "m");
}

static int chain(void)
{
    thread_init();
    cfg.rq_depth = RQ_CHAIN; /* every engine's share fits the queue */
    static struct conn c[N_CHAIN];
    for (uint32_t i = 0; i < N_CHAIN; i++)
        conn_up(&c[i], "C", 0x40 + i);
    uint32_t before = n_posted;
    /* one poll turn: messages on every QP */
    srq_posts = 0;
    arrive_each(0x40, N_CHAIN);
    CHECK_EQ(io_poll(), 0);
    for (uint32_t i = 0; i < N_CHAIN; i++)
        CHECK_EQ(c[i].n_msgs, M_CHAIN);
    /* then each engine's progress, whose sends carry the credits back */
    uint32_t s_turn = sends;
    for (uint32_t i = 0; i < N_CHAIN; i++)
        (void)bex__engine_progress(c[i].e);
    CHECK_EQ(sends - s_turn, N_CHAIN); /* each engine's credit update went */
    fprintf(stderr, "%u receives given back in %u ibv_post_srq_recv calls\n", N_CHAIN * M_CHAIN,
            srq_posts);
    CHECK_EQ(n_posted, before); /* every one posted again */
    CHECK_EQ(srq_posts, 1);
    CHECK_EQ(sh.srq->held, 0);
    check_conserved();
    /* receives given back outside a turn's flush are posted before their
     * engine's next send (their credits) goes */
    arrive_each(0x40, 1);
    struct ibv_wc wc;
    for (uint32_t m = 0; m < M_CHAIN; m++) { /* no flush: the turn goes on */
        CHECK_EQ(bex__srq_next(sh.srq, &wc), 1);
        (void)bex__engine_srq_complete(sh.srq, &wc);
    }
    CHECK_EQ(n_posted, before - M_CHAIN);
    uint32_t s0 = sends;
    (void)bex__engine_progress(c[0].e);
    CHECK_EQ(sends, s0 + 1);          /* the credit update went */
    CHECK_EQ(posted_at_send, before); /* after its receives were posted */
    CHECK_EQ(io_poll(), 0);
    check_conserved();
    for (uint32_t i = 0; i < N_CHAIN; i++)
        conn_down(&c[i]);
    CHECK_EQ(io_poll(), 0);
    thread_fini(0);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(reused_qpn), BEX_CASE(others_kept), BEX_CASE(poll_fails), BEX_CASE(chain))
