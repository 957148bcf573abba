/* SPDX-License-Identifier: Apache-2.0 */
/* Header-free DATA (docs/protocol.md, "Header-free DATA: the immediate"),
 * without a device: an engine over a stand-in QP (bex__engine_create_nodev)
 * whose post_send/post_recv record the work requests, and a test that plays
 * the NIC and the peer. Checks what goes on the wire (SEND_WITH_IMM of the
 * payload alone, the immediate's stream and credits, inline, the header
 * kept on a stream the immediate cannot name, credits beyond the
 * immediate's field left for the next message), what the receive side
 * posts (one buffer per receive) and hands up, and that every immediate or
 * header no valid peer sends fails the engine with -EPROTO, logged once. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/engine.h"
#include "harness.h"
#include "engine_test.h"

enum { SQ_REC = 256, RQ_REC = 8192 };

struct rsend {
    struct ibv_send_wr wr;
    struct ibv_sge sge[2];
};
struct rrecv {
    uint64_t wr_id;
    int num_sge;
    struct ibv_sge sge;
};

static struct {
    bex_mem_pool *pool, *landing;
    struct bex__log log;
    struct bex__stats stats;
    struct bex__engine_shared sh;
    struct ibv_context ctx;
    struct ibv_qp qp;
    struct ibv_pd pd;
    struct bex__engine *e;
    struct rsend sq[SQ_REC];
    uint32_t nsq;
    struct rrecv rq[RQ_REC];
    uint32_t rq_head, nrq;
    int fails, fail_err, errors_logged, warnings_logged, done;
    char warning[512]; /* the last violation logged */
    uint32_t msg_stream;
    void *msg_buf;
    size_t msg_len;
    int msgs;
} T;

static int fk_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    (void)qp, (void)bad;
    for (; wr; wr = wr->next) {
        if (T.nsq == SQ_REC)
            abort(); /* a test posts far fewer */
        struct rsend *r = &T.sq[T.nsq++];
        r->wr = *wr;
        r->wr.next = NULL;
        if (wr->num_sge > 0)
            memcpy(r->sge, wr->sg_list, sizeof(struct ibv_sge) * (size_t)wr->num_sge);
        r->wr.sg_list = r->sge;
    }
    return 0;
}

static int fk_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    (void)qp, (void)bad;
    for (; wr; wr = wr->next) {
        struct rrecv *r = &T.rq[(T.rq_head + T.nrq++) % RQ_REC];
        r->wr_id = wr->wr_id;
        r->num_sge = wr->num_sge;
        if (wr->num_sge >= 1)
            r->sge = wr->sg_list[0];
    }
    return 0;
}

static void up_on_up(struct bex__xport *e)
{
    (void)e;
}
static void up_on_msg(struct bex__xport *e, uint32_t stream, void *buf, size_t len)
{
    (void)e;
    if (T.msg_buf)
        bex_mem_free(T.msg_buf);
    T.msg_stream = stream;
    T.msg_buf = buf;
    T.msg_len = len;
    T.msgs++;
}
static void up_on_open(struct bex__xport *e, uint32_t stream)
{
    (void)e, (void)stream;
}
static void up_on_peer_close(struct bex__xport *e, uint32_t stream)
{
    (void)e, (void)stream;
}
static void up_on_send_done(struct bex__xport *e, struct bex__msg *m, int status)
{
    (void)e, (void)status;
    bex_mem_free(m->buf);
    free(m);
    T.done++;
}
static void up_on_stream_closed(struct bex__xport *e, struct bex__stream *st)
{
    (void)e, (void)st;
}
static int up_on_direct(struct bex__xport *e, uint32_t imm)
{
    (void)e, (void)imm;
    return -EPROTO;
}
static void up_on_fail(struct bex__xport *e, int err)
{
    (void)e;
    T.fails++;
    T.fail_err = err;
}
static const struct bex__transport_upcalls ops = {BEX_TEST_UP_ON};

static void log_sink(int level, const char *msg, void *arg)
{
    (void)arg;
    if (level == BEX_LOG_ERROR)
        T.errors_logged++;
    /* a peer's fault: one WARN (ERROR is for our own faults, issue 26) */
    if (level == BEX_LOG_WARN && strstr(msg, "protocol violation by the peer")) {
        T.warnings_logged++;
        snprintf(T.warning, sizeof T.warning, "%s", msg);
    }
}

/* An engine that is up, with rq receives of eager bytes posted; the peer
 * granted peer_rq credits and takes peer_eager bytes by SEND. */
static int up(uint32_t rq, uint32_t eager, uint32_t peer_rq, uint32_t peer_eager)
{
    bex_mem_pool *pool = T.pool, *landing = T.landing;
    if (!pool) {
        bex_mem_registrar reg;
        bex_mem_registrar_noop(&reg);
        bex_mem_config lc = {.kind = BEX_MEM_POOL_LANDING};
        CHECK_OK(bex_mem_pool_create(&reg, NULL, &pool));
        CHECK_OK(bex_mem_pool_create(&reg, &lc, &landing));
    }
    memset(&T, 0, sizeof T);
    T.pool = pool;
    T.landing = landing;
    bex__log_init(&T.log, log_sink, NULL, BEX_LOG_DEBUG);
    T.ctx.ops.post_send = fk_post_send;
    T.ctx.ops.post_recv = fk_post_recv;
    T.qp.context = &T.ctx;
    T.qp.qp_num = 0x123;
    T.pd.context = &T.ctx;
    T.sh = (struct bex__engine_shared){.pool = pool,
                                       .recv_pool = pool,
                                       .landing = landing,
                                       .pd = &T.pd,
                                       .stats = &T.stats,
                                       .log = &T.log};
    /* the tests' engine settings, but for what these cases were written
     * against: a deeper send queue, rq and eager as asked, 64 KiB
     * fragments and the library's default timers */
    struct bex__engine_config cfg = bex_test_engine_config();
    cfg.sq_depth = 64;
    cfg.rq_depth = rq;
    cfg.eager_max = eager;
    cfg.frag_size = 65536;
    cfg.rndv_ahead = 4;
    cfg.keepalive_ms = 100;
    cfg.keepalive_timeout_ms = 2000;
    cfg.rndv_timeout_ms = 30000;
    cfg.credit_timeout_ms = 30000;
    CHECK_OK(bex__engine_create_nodev(&T.sh, &cfg, &ops, 1, NULL, &T.qp, &T.e));
    struct bex__engine_peer peer = {.rdma = {.qpn = 2, .psn = 1, .active_mtu = IBV_MTU_1024},
                                    .rq_depth = peer_rq,
                                    .max_rndv = 16,
                                    .eager_max = peer_eager,
                                    .max_msg = 1u << 20,
                                    .ka_addr = 0x5000,
                                    .ka_rkey = 1};
    CHECK_OK(bex__engine_connect(T.e, &peer));
    bex__engine_start(T.e);
    CHECK(bex__engine_is_up(T.e));
    return 0;
}

static void down(void)
{
    if (!bex__engine_is_dead(T.e))
        bex__engine_fail(T.e, -ECONNRESET);
    bex__engine_destroy(T.e);
    if (T.msg_buf)
        bex_mem_free(T.msg_buf);
    T.msg_buf = NULL;
    bex__log_fini(&T.log);
}

static void fill(uint8_t *p, size_t n, uint8_t seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(seed + i * 7);
}

static int send_msg(struct bex__stream *st, size_t len, uint8_t seed)
{
    struct bex__msg *m = calloc(1, sizeof *m);
    CHECK(m != NULL);
    m->len = len;
    m->buf = bex_mem_alloc(T.pool, len ? len : 1);
    CHECK(m->buf != NULL);
    m->lkey = bex_mem_mr(m->buf)->lkey;
    fill(m->buf, len, seed);
    bex__engine_send(st, m);
    return 0;
}

/* The peer's SEND (with immediate imm if imm >= 0) into the next receive. */
static int deliver(const void *bytes, uint32_t n, int64_t imm)
{
    CHECK(T.nrq > 0);
    struct rrecv *r = &T.rq[T.rq_head];
    T.rq_head = (T.rq_head + 1) % RQ_REC;
    T.nrq--;
    CHECK_EQ(r->num_sge, 1);
    CHECK(n <= r->sge.length);
    memcpy((void *)(uintptr_t)r->sge.addr, bytes, n);
    struct ibv_wc wc = {.wr_id = r->wr_id, .opcode = IBV_WC_RECV, .byte_len = n};
    if (imm >= 0) {
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.imm_data = htonl((uint32_t)imm);
    }
    bex__engine_complete(T.e, &wc);
    return 0;
}

/* ---------------- cases ---------------- */

/* The immediate's layout is a contract with peers running other builds. */
static int imm_codec(void)
{
    CHECK_EQ(bex__imm_encode(5, 3), 0x40001403u);
    CHECK_EQ(bex__imm_encode(BEX__IMM_STREAM_MAX, BEX__IMM_CREDITS_MAX), 0x7fffffffu);
    struct bex__hdr h;
    CHECK_OK(bex__imm_decode(0x40001403u, 77, &h));
    CHECK(h.type == BEX__MSG_DATA && h.stream == 5 && h.credits == 3 && h.len == 77);
    CHECK(h.flags == 0 && h.id == 0 && h.addr == 0 && h.rkey == 0 && h.status == 0);
    /* every kind but DATA is refused, whatever the rest */
    const uint32_t rest[] = {0, 1, 0x3fffffff, 0x12345678 & 0x3fffffff};
    for (uint32_t kind = 0; kind < 4; kind++)
        for (size_t i = 0; i < sizeof rest / sizeof rest[0]; i++)
            CHECK_EQ(bex__imm_decode(kind << 30 | rest[i], 0, &h),
                     kind == BEX__IMM_KIND_DATA ? 0 : -EPROTO);
    /* round trip over the field edges */
    const uint32_t streams[] = {0, 1, 1023, 1024, BEX__IMM_STREAM_MAX};
    const uint32_t credits[] = {0, 1, 512, BEX__IMM_CREDITS_MAX};
    for (size_t i = 0; i < 5; i++)
        for (size_t j = 0; j < 4; j++) {
            CHECK_OK(bex__imm_decode(bex__imm_encode(streams[i], credits[j]), 1, &h));
            CHECK(h.stream == streams[i] && h.credits == credits[j]);
        }
    return 0;
}

/* Receives: one buffer each, eager_max bytes, at least a header's 32. */
static int recv_posted(void)
{
    const uint32_t eagers[] = {0, 16, 32, 8192};
    for (size_t i = 0; i < 4; i++) {
        CHECK_OK(up(8, eagers[i], 8, 1024));
        CHECK_EQ(T.nrq, 8 + bex__engine_rq_spare(&T.sh, 8)); /* the credits and the spare */
        for (uint32_t k = 0; k < T.nrq; k++) {
            CHECK_EQ(T.rq[k].num_sge, 1);
            CHECK_EQ(T.rq[k].sge.length, eagers[i] > 32 ? eagers[i] : 32);
        }
        down();
    }
    return 0;
}

/* DATA goes as SEND_WITH_IMM of the payload alone; OPEN keeps its header. */
static int send_imm(void)
{
    CHECK_OK(up(8, 1024, 16, 1024));
    struct bex__stream st;
    bex__engine_attach(T.e, &st, 7, true);
    CHECK_OK(send_msg(&st, 32, 1));
    CHECK_OK(send_msg(&st, 0, 2));
    CHECK_OK(send_msg(&st, 1000, 3));
    bex__engine_progress(T.e);
    CHECK_EQ(T.nsq, 4);
    /* OPEN: a plain SEND of the header */
    struct bex__hdr h;
    CHECK(T.sq[0].wr.opcode == IBV_WR_SEND && T.sq[0].wr.num_sge == 1);
    CHECK_OK(bex__hdr_decode((const uint8_t *)(uintptr_t)T.sq[0].sge[0].addr, T.sq[0].sge[0].length,
                             &h));
    CHECK(h.type == BEX__MSG_OPEN && h.stream == 7);
    const size_t lens[] = {32, 0, 1000};
    for (int i = 1; i <= 3; i++) {
        const struct ibv_send_wr *w = &T.sq[i].wr;
        CHECK(w->opcode == IBV_WR_SEND_WITH_IMM);
        CHECK_OK(bex__imm_decode(ntohl(w->imm_data), 0, &h));
        CHECK(h.stream == 7 && h.credits == 0);
        CHECK_EQ(w->num_sge, lens[i - 1] ? 1 : 0);
        if (lens[i - 1])
            CHECK_EQ(T.sq[i].sge[0].length, lens[i - 1]);
        /* small ones inline (the stand-in grants BEX__ENGINE_INLINE) */
        CHECK_EQ(!!(w->send_flags & IBV_SEND_INLINE), lens[i - 1] && lens[i - 1] <= 256);
    }
    CHECK(T.sq[3].wr.send_flags & IBV_SEND_SIGNALED); /* the batch's last */
    down();
    CHECK_EQ(T.done, 3);
    return 0;
}

/* A stream the immediate cannot name: DATA keeps the header, and goes by
 * rendezvous once header and payload do not fit the peer's buffer. */
static int send_big_stream(void)
{
    CHECK_OK(up(8, 1024, 16, 256));
    struct bex__stream st;
    uint32_t id = BEX__IMM_STREAM_MAX + 1;
    bex__engine_attach(T.e, &st, id, true);
    CHECK_OK(send_msg(&st, 100, 1));
    CHECK_OK(send_msg(&st, 0, 2));
    CHECK_OK(send_msg(&st, 256 - 32, 3)); /* fits with its header */
    CHECK_OK(send_msg(&st, 256 - 31, 4)); /* does not: rendezvous */
    bex__engine_progress(T.e);
    CHECK_EQ(T.nsq, 5); /* OPEN, 3 DATA, RNDV_REQ */
    struct bex__hdr h;
    const uint32_t lens[] = {100, 0, 224};
    for (int i = 1; i <= 3; i++) {
        const struct rsend *r = &T.sq[i];
        CHECK(r->wr.opcode == IBV_WR_SEND);
        CHECK_EQ(r->wr.num_sge, lens[i - 1] ? 2 : 1);
        CHECK_EQ(r->sge[0].length, BEX__HDR_LEN);
        CHECK_OK(bex__hdr_decode((const uint8_t *)(uintptr_t)r->sge[0].addr,
                                 BEX__HDR_LEN + lens[i - 1], &h));
        CHECK(h.type == BEX__MSG_DATA && h.stream == id && h.len == lens[i - 1]);
    }
    CHECK_OK(bex__hdr_decode((const uint8_t *)(uintptr_t)T.sq[4].sge[0].addr, BEX__HDR_LEN, &h));
    CHECK(h.type == BEX__MSG_RNDV_REQ && h.stream == id && h.len == 225);
    down();
    return 0;
}

/* Received DATA of both encodings: the payload at the buffer's start. */
static int recv_data(void)
{
    CHECK_OK(up(8, 1024, 16, 1024));
    uint8_t pay[1024 + BEX__HDR_LEN];
    fill(pay, 1000, 9);
    uint64_t posted = T.rq[T.rq_head].sge.addr;
    CHECK_OK(deliver(pay, 1000, bex__imm_encode(5, 0)));
    CHECK(T.fails == 0 && T.msgs == 1 && T.msg_stream == 5 && T.msg_len == 1000);
    CHECK((uintptr_t)T.msg_buf == posted && memcmp(T.msg_buf, pay, 1000) == 0);
    CHECK_OK(deliver(pay, 0, bex__imm_encode(6, 0)));
    CHECK(T.fails == 0 && T.msgs == 2 && T.msg_stream == 6 && T.msg_len == 0);
    /* with the header, on a stream beyond the immediate's */
    struct bex__hdr h = {.type = BEX__MSG_DATA, .stream = BEX__IMM_STREAM_MAX + 9, .len = 900};
    bex__hdr_encode(&h, pay);
    fill(pay + BEX__HDR_LEN, 900, 4);
    posted = T.rq[T.rq_head].sge.addr;
    CHECK_OK(deliver(pay, BEX__HDR_LEN + 900, -1));
    CHECK(T.fails == 0 && T.msgs == 3 && T.msg_stream == h.stream && T.msg_len == 900);
    uint8_t want[900];
    fill(want, 900, 4);
    CHECK((uintptr_t)T.msg_buf == posted && memcmp(T.msg_buf, want, 900) == 0);
    /* a control message leaves its buffer posted: no message goes up */
    struct bex__hdr c = {.type = BEX__MSG_CREDIT};
    bex__hdr_encode(&c, pay);
    CHECK_OK(deliver(pay, BEX__HDR_LEN, -1));
    CHECK(T.fails == 0 && T.msgs == 3);
    down();
    return 0;
}

/* What no valid peer sends fails the engine with -EPROTO, logged once,
 * with what it was: the operator tells a peer's fault from the NIC's
 * (docs/benchmarks.md, "Protocol violations under heavy loss"). */
static int recv_rejects(void)
{
    uint8_t b[256] = {0}, resp[BEX__HDR_LEN];
    struct bex__hdr small = {.type = BEX__MSG_DATA, .stream = 3, .len = 8};
    bex__hdr_encode(&small, b);
    /* an answer to a rendezvous request never asked (slot 0, generation 1) */
    struct bex__hdr answer = {
        .type = BEX__MSG_RNDV_RESP, .id = 1u << 16, .addr = 0x1000, .rkey = 7};
    bex__hdr_encode(&answer, resp);
    struct {
        const char *what;
        uint32_t eager, len;
        int64_t imm;
        const char *why;      /* what the WARN says */
        const uint8_t *bytes; /* NULL: b */
    } bad[] = {
        {"kind 0", 64, 8, 0u << 30 | 3u << 10, "a SEND_WITH_IMM of a reserved kind", NULL},
        {"kind 2", 64, 8, 2u << 30 | 3u << 10, "immediate 0x80000c00", NULL},
        {"kind 3", 64, 8, 3u << 30 | 3u << 10, "immediate 0xc0000c00", NULL},
        {"more credits than granted", 64, 8, bex__imm_encode(3, 1),
         "1 credits back (type 1, stream 3, 8 bytes, QP 291), 16 held: above the 16 it granted",
         NULL},
        /* the buffer holds a header's 32 bytes, eager_max is 16 */
        {"longer than eager_max", 16, 17, bex__imm_encode(3, 0), "a DATA of 17 bytes (eager_max 16",
         NULL},
        {"a DATA header on a stream the immediate names", 64, BEX__HDR_LEN + 8, -1,
         "a SEND whose header does not decode (receive 0, 40 bytes: 01 00 0000 03000000 "
         "08000000",
         NULL},
        {"an answer to no request", 64, BEX__HDR_LEN, -1,
         "an answer (status 0) to rendezvous request 0 of generation 1, which is not asked", resp},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_OK(up(8, bad[i].eager, 16, 1024));
        CHECK_OK(deliver(bad[i].bytes ? bad[i].bytes : b, bad[i].len, bad[i].imm));
        if (T.fails != 1 || T.fail_err != -EPROTO || T.msgs != 0 || T.warnings_logged != 1 ||
            T.errors_logged != 0 || !strstr(T.warning, bad[i].why)) {
            fprintf(stderr,
                    "%s: fails %d err %d msgs %d warnings logged %d errors logged %d\n"
                    "  logged: %s\n  wanted: ...%s...\n",
                    bad[i].what, T.fails, T.fail_err, T.msgs, T.warnings_logged, T.errors_logged,
                    T.warning, bad[i].why);
            return -1;
        }
        down();
    }
    return 0;
}

/* Credits beyond the immediate's 1023 wait for the next message. */
static int credits_spill(void)
{
    CHECK_OK(up(4096, 64, 64, 1024)); /* k = 2048: reposted 2048 at a time */
    uint8_t b[8] = {0};
    for (int i = 0; i < 2048; i++)
        CHECK_OK(deliver(b, sizeof b, bex__imm_encode(1, 0)));
    CHECK(T.fails == 0 && T.msgs == 2048);
    struct bex__stream st;
    bex__engine_attach(T.e, &st, 4, false);
    for (int i = 0; i < 3; i++)
        CHECK_OK(send_msg(&st, 16, (uint8_t)i));
    uint32_t before = T.nsq;
    bex__engine_progress(T.e);
    CHECK_EQ(T.nsq - before, 3); /* no CREDIT message: the DATA carried them */
    const uint32_t want[] = {1023, 1023, 2};
    for (int i = 0; i < 3; i++) {
        struct bex__hdr h;
        CHECK(T.sq[before + i].wr.opcode == IBV_WR_SEND_WITH_IMM);
        CHECK_OK(bex__imm_decode(ntohl(T.sq[before + i].wr.imm_data), 16, &h));
        CHECK_EQ(h.credits, want[i]);
    }
    down();
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(imm_codec), BEX_CASE(recv_posted), BEX_CASE(send_imm),
              BEX_CASE(send_big_stream), BEX_CASE(recv_data), BEX_CASE(recv_rejects),
              BEX_CASE(credits_spill))
