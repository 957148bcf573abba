/* SPDX-License-Identifier: Apache-2.0 */
/* Two processes, one RC QP pair over two real devices.
 *
 * The parent is the server on BEX_TEST_ADDR0, the forked child the client on
 * BEX_TEST_ADDR1. Each picks its device from the local address of its TCP
 * connection, they exchange hellos and readiness over TCP, bring their QPs
 * to RTS, and then:
 *   1. server -> client SEND: a rendezvous (address, rkey, length) of a
 *      1 MiB destination buffer;
 *   2. client: 1 MiB by RDMA WRITE in 64 KiB fragments, one doorbell, the
 *      last fragment a WRITE_WITH_IMM whose immediate is the checksum;
 *   3. client -> server: 64 SENDs of assorted sizes (each with its checksum);
 *   4. server checks everything and SENDs an ACK with what it saw; the
 *      client checks the ACK.
 * Both processes must succeed. Every wait is bounded (DEADLINE_MS, stretched
 * by BEX_TEST_TIME_SCALE); the parent reaps the child (killing it past its
 * deadline), and the child dies with the parent. Both tear down everything
 * and leave through exit(), so that the sanitizers' leak check runs in each. */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "rdma/rdma.h"
#include "conn/hello_io.h"
#include "rdma_test.h"

#define WRITE_LEN   (1u << 20)
#define FRAG_LEN    (64u << 10)
#define NFRAGS      (WRITE_LEN / FRAG_LEN)
#define NMSGS       64
#define SLOT_LEN    8192u
#define RQ_DEPTH    80 /* NMSGS + 1 WRITE_WITH_IMM, with room to spare */
#define SQ_DEPTH    32
#define BATCH       16
#define DEADLINE_MS 30000 /* unscaled: see deadline_ms() */
#define WRITE_SEED  0xb0e5

_Static_assert(NFRAGS <= SQ_DEPTH, "the WRITE chain must fit the send queue");

enum { MSG_RENDEZVOUS = 1, MSG_DATA, MSG_ACK };

/* What travels in a SEND, in host order: both ends are the same build on the
 * same host. (The engine's real control messages will be encoded.) */
struct msg {
    uint32_t type;
    uint32_t seq;
    uint32_t len; /* payload bytes after the header */
    uint32_t status;
    uint64_t sum; /* FNV-1a of the payload */
    uint64_t addr;
    uint32_t rkey;
    uint32_t count;
};

/* Buffer layout of one side: [write area | receive slots | send slots]. */
#define RECV_OFF ((size_t)WRITE_LEN)
#define SEND_OFF (RECV_OFF + (size_t)RQ_DEPTH * SLOT_LEN)
#define AREA_LEN (SEND_OFF + (size_t)NMSGS * SLOT_LEN)

struct side {
    const char *who;
    int fd;
    int64_t deadline;
    struct bex__rdma_dev *dev;
    struct bex__rdma_path path;
    struct bex__rdma_td *td;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    uint8_t *area;
    struct ibv_mr *mr;
    struct bex__hello mine, theirs;
    struct bex__rdma_peer peer;
    int credits; /* the peer's receives we may still consume */
};

static int64_t deadline_ms(void)
{
    return (int64_t)DEADLINE_MS * bex_test_time_scale();
}

/* A failed step: one line per message (the two processes share stderr, so
 * it is written in one call), and TEST_FAILED for the callers to pass up. */
#define TEST_FAILED (-100000)
#define FAILF(s, ...)                                                                              \
    do {                                                                                           \
        char m_[512];                                                                              \
        int n_ = snprintf(m_, sizeof m_, "[%s] %s:%d: ", (s)->who, __FILE__, __LINE__);            \
        snprintf(m_ + n_, sizeof m_ - (size_t)n_, __VA_ARGS__);                                    \
        fprintf(stderr, "%s\n", m_);                                                               \
        return TEST_FAILED;                                                                        \
    } while (0)

#define TRY(s, expr)                                                                               \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        if (rc_ == TEST_FAILED)                                                                    \
            return rc_;                                                                            \
        if (rc_ != 0)                                                                              \
            FAILF(s, "%s: %d (%s)", #expr, rc_, bex_strerror(rc_));                                \
    } while (0)

/* Payload size of data message i: the edges around the 1024-byte MTU of a
 * 1500-byte veth and the slot size first, then a spread. */
static uint32_t msg_len(int i)
{
    static const uint32_t edge[] = {
        0,    1,    7,    1024 - sizeof(struct msg),    1024 - sizeof(struct msg) + 1,
        1024, 2048, 4096, SLOT_LEN - sizeof(struct msg)};
    if ((size_t)i < sizeof edge / sizeof edge[0])
        return edge[i];
    return (uint32_t)((i * 2654435761u) % (SLOT_LEN - sizeof(struct msg) + 1));
}

static uint32_t imm_of(uint64_t sum)
{
    return (uint32_t)(sum ^ (sum >> 32));
}

/* One completion, sleeping on the channel when the CQ is empty. */
static int wait_wc(struct side *s, struct ibv_wc *wc)
{
    for (;;) {
        int n = ibv_poll_cq(s->cq, 1, wc);
        if (n > 0)
            goto got;
        if (n < 0)
            FAILF(s, "ibv_poll_cq: %d", n);
        TRY(s, bex__rdma_err(ibv_req_notify_cq(s->cq, 0)));
        /* a completion that arrived before the arm raised no event */
        n = ibv_poll_cq(s->cq, 1, wc);
        if (n > 0)
            goto got;
        int64_t left = s->deadline - bex__hello_now_ms();
        if (left <= 0)
            FAILF(s, "timed out waiting for a completion");
        struct pollfd p = {.fd = s->ch->fd, .events = POLLIN};
        if (poll(&p, 1, left > 100 ? 100 : (int)left) > 0) {
            struct ibv_cq *ecq;
            void *ectx;
            if (ibv_get_cq_event(s->ch, &ecq, &ectx) == 0)
                ibv_ack_cq_events(ecq, 1);
        }
    }
got:
    if (wc->status != IBV_WC_SUCCESS)
        FAILF(s, "completion wr_id %llu opcode %d: %s (vendor_err 0x%x) -> %s",
              (unsigned long long)wc->wr_id, wc->opcode, ibv_wc_status_str(wc->status),
              wc->vendor_err, bex_strerror(bex__rdma_wc_errno(wc->status)));
    return 0;
}

static int post_recv_slot(struct side *s, uint32_t slot)
{
    struct ibv_sge sge = {
        .addr = (uintptr_t)(s->area + RECV_OFF + (size_t)slot * SLOT_LEN),
        .length = SLOT_LEN,
        .lkey = s->mr->lkey,
    };
    struct ibv_recv_wr wr = {.wr_id = slot, .sg_list = &sge, .num_sge = 1}, *bad;
    return bex__rdma_err(ibv_post_recv(s->qp, &wr, &bad));
}

/* A header-only control message (rendezvous, ack) from send slot `slot`. */
static int post_send_msg(struct side *s, uint32_t slot, const struct msg *m)
{
    uint8_t *p = s->area + SEND_OFF + (size_t)slot * SLOT_LEN;
    memcpy(p, m, sizeof *m);
    if (s->credits <= 0)
        FAILF(s, "no receive credit left at the peer");
    s->credits--;
    struct ibv_sge sge = {.addr = (uintptr_t)p, .length = (uint32_t)sizeof *m, .lkey = s->mr->lkey};
    struct ibv_send_wr wr = {.wr_id = 1000 + slot,
                             .sg_list = &sge,
                             .num_sge = 1,
                             .opcode = IBV_WR_SEND,
                             .send_flags = IBV_SEND_SIGNALED},
                       *bad;
    return bex__rdma_err(ibv_post_send(s->qp, &wr, &bad));
}

/* Device, QP in INIT with receives posted, and our hello, before talking. */
static int setup_local(struct side *s)
{
    struct sockaddr_in local;
    socklen_t sl = sizeof local;
    if (getsockname(s->fd, (struct sockaddr *)&local, &sl) != 0)
        FAILF(s, "getsockname: %s", strerror(errno));
    TRY(s, bex__rdma_dev_open_ipv4(local.sin_addr, &s->dev, &s->path));
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &local.sin_addr, ip, sizeof ip);
    fprintf(stderr, "[%s] %s -> %s port %u gid index %u, active MTU %d\n", s->who, ip,
            s->path.dev_name, s->path.port, s->path.gid_index,
            bex__rdma_mtu_bytes(s->path.active_mtu));

    int rc = bex__rdma_td_alloc(s->dev, &s->td);
    if (rc == -EOPNOTSUPP)
        fprintf(stderr, "[%s] thread domains: not supported, QP on the plain PD\n", s->who);
    else if (rc < 0)
        FAILF(s, "bex__rdma_td_alloc: %s", bex_strerror(rc));

    TRY(s, bex__rdma_channel_create(s->dev, &s->ch));
    TRY(s, bex__rdma_cq_create(s->dev, 2 * (RQ_DEPTH + SQ_DEPTH), s->ch, &s->cq));
    struct bex__rdma_qp_config qc = {
        .send_cq = s->cq,
        .recv_cq = s->cq,
        .pd = s->td ? s->td->pd : NULL,
        .sq_depth = SQ_DEPTH,
        .rq_depth = RQ_DEPTH,
    };
    struct ibv_qp_cap cap;
    TRY(s, bex__rdma_qp_create(s->dev, &qc, &s->qp, &cap));
    if (cap.max_send_wr < SQ_DEPTH || cap.max_recv_wr < RQ_DEPTH)
        FAILF(s, "granted sq %u rq %u", cap.max_send_wr, cap.max_recv_wr);

    s->area = aligned_alloc(4096, AREA_LEN);
    if (!s->area)
        FAILF(s, "out of memory");
    memset(s->area, 0, AREA_LEN);
    s->mr =
        ibv_reg_mr(s->dev->pd, s->area, AREA_LEN, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!s->mr)
        FAILF(s, "ibv_reg_mr: %s (is RLIMIT_MEMLOCK large enough?)", strerror(errno));

    TRY(s, bex__rdma_qp_to_init(s->qp, &s->path, NULL));
    /* Receives go in before the peer can learn our QPN. */
    for (uint32_t i = 0; i < RQ_DEPTH; i++)
        TRY(s, post_recv_slot(s, i));

    s->mine = (struct bex__hello){
        .qpn = s->qp->qp_num,
        .psn = bex__rdma_random_psn(),
        .mtu = (uint8_t)s->path.active_mtu,
        .rd_atomic = bex__rdma_dest_rd_atomic(s->dev, NULL),
        .recv_depth = RQ_DEPTH,
        .sq_depth = SQ_DEPTH,
        .max_msg = WRITE_LEN,
        .frag_size = FRAG_LEN,
        .conn_id = bex__rdma_random_u64(),
        /* this test drives its QP by hand: no engine keepalive, one
         * "rendezvous" (the 1 MiB WRITE target) */
        .ka_addr = (uintptr_t)s->area,
        .ka_rkey = s->mr->rkey,
        .max_rndv = 1,
    };
    memcpy(s->mine.gid, s->path.gid.raw, 16);
    return 0;
}

/* After the hellos: RTR, RTS, and readiness both ways. */
static int connect_qp(struct side *s)
{
    if (s->theirs.flags & BEX__HELLO_F_NO_RDMA)
        FAILF(s, "peer has no RDMA");
    s->peer.qpn = s->theirs.qpn;
    s->peer.psn = s->theirs.psn;
    memcpy(s->peer.gid.raw, s->theirs.gid, 16);
    s->peer.active_mtu = (enum ibv_mtu)s->theirs.mtu;
    s->peer.rd_atomic = s->theirs.rd_atomic;
    s->credits = s->theirs.recv_depth;
    fprintf(stderr, "[%s] qpn %u psn %u <-> peer qpn %u psn %u, peer grants %d credits\n", s->who,
            s->mine.qpn, s->mine.psn, s->peer.qpn, s->peer.psn, s->credits);

    TRY(s, bex__rdma_qp_to_rtr(s->qp, s->dev, &s->path, &s->peer, NULL));
    TRY(s, bex__rdma_qp_to_rts(s->qp, s->dev, s->mine.psn, &s->peer, NULL));
    struct ibv_qp_attr qa;
    struct ibv_qp_init_attr qi;
    TRY(s, bex__rdma_err(ibv_query_qp(s->qp, &qa, IBV_QP_STATE | IBV_QP_PATH_MTU, &qi)));
    if (qa.qp_state != IBV_QPS_RTS)
        FAILF(s, "QP state %d after RTS", qa.qp_state);
    fprintf(stderr, "[%s] RTS, path MTU %d\n", s->who, bex__rdma_mtu_bytes(qa.path_mtu));

    TRY(s, bex__hello_ready_send(s->fd, 0, s->deadline));
    uint32_t st;
    TRY(s, bex__hello_ready_recv(s->fd, &st, s->deadline));
    if (st != 0)
        FAILF(s, "peer not ready: %s", strerror((int)st));
    return 0;
}

static int teardown(struct side *s)
{
    int bad = 0;
    if (s->qp) {
        /* ERR first: flushes whatever is still posted (our spare receives). */
        bad |= bex__rdma_qp_to_err(s->qp) != 0;
        bad |= bex__rdma_qp_destroy(s->qp) != 0;
    }
    if (s->mr)
        bad |= ibv_dereg_mr(s->mr) != 0;
    free(s->area);
    bad |= bex__rdma_cq_destroy(s->cq) != 0;
    bad |= bex__rdma_channel_destroy(s->ch) != 0;
    bad |= bex__rdma_td_free(s->td) != 0;
    bad |= bex__rdma_dev_close(s->dev) != 0;
    if (s->fd >= 0)
        close(s->fd);
    if (bad)
        FAILF(s, "teardown reported an error");
    return 0;
}

/* ---- server ---------------------------------------------------------- */

static int server_run(struct side *s)
{
    TRY(s, setup_local(s));
    TRY(s, bex__hello_recv(s->fd, &s->theirs, s->deadline));
    s->mine.conn_id = s->theirs.conn_id; /* echo: the client matches on it */
    TRY(s, bex__hello_send(s->fd, &s->mine, s->deadline));
    TRY(s, connect_qp(s));

    /* 1. rendezvous: where the client may write */
    struct msg rv = {.type = MSG_RENDEZVOUS,
                     .addr = (uintptr_t)s->area,
                     .rkey = s->mr->rkey,
                     .count = WRITE_LEN};
    TRY(s, post_send_msg(s, 0, &rv));

    uint8_t *expect = malloc(WRITE_LEN > SLOT_LEN ? WRITE_LEN : SLOT_LEN);
    if (!expect)
        FAILF(s, "out of memory");
    int got_imm = 0, sends_done = 0, next_seq = 0, rc = TEST_FAILED;
    uint64_t all_sums = 0;
    uint32_t next_slot = 0;
    while (!(got_imm && next_seq == NMSGS && sends_done == 1)) {
        struct ibv_wc wc;
        if (wait_wc(s, &wc) != 0)
            goto out;
        if (wc.opcode == IBV_WC_SEND) {
            sends_done++;
            continue;
        }
        /* RC delivers in order and receives are consumed in posting order. */
        if (wc.wr_id != next_slot) {
            fprintf(stderr, "[server] receive slot %llu, expected %u\n",
                    (unsigned long long)wc.wr_id, next_slot);
            goto out;
        }
        next_slot++;
        if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
            if (got_imm || next_seq != 0 || !(wc.wc_flags & IBV_WC_WITH_IMM)) {
                fprintf(stderr, "[server] unexpected WRITE_WITH_IMM (flags 0x%x)\n", wc.wc_flags);
                goto out;
            }
            uint64_t sum = test_fnv1a(s->area, WRITE_LEN);
            test_fill(expect, WRITE_LEN, WRITE_SEED);
            fprintf(stderr, "[server] WRITE_WITH_IMM: imm 0x%08x, byte_len %u\n",
                    ntohl(wc.imm_data), wc.byte_len);
            if (ntohl(wc.imm_data) != imm_of(sum) || memcmp(s->area, expect, WRITE_LEN) != 0) {
                fprintf(stderr, "[server] 1 MiB WRITE payload differs (imm 0x%08x, local 0x%08x)\n",
                        ntohl(wc.imm_data), imm_of(sum));
                goto out;
            }
            got_imm = 1;
            continue;
        }
        if (wc.opcode != IBV_WC_RECV) {
            fprintf(stderr, "[server] unexpected opcode %d\n", wc.opcode);
            goto out;
        }
        if (!got_imm) {
            fprintf(stderr, "[server] SEND overtook the WRITE_WITH_IMM\n");
            goto out;
        }
        const uint8_t *p = s->area + RECV_OFF + wc.wr_id * SLOT_LEN;
        struct msg m;
        if (wc.byte_len < sizeof m) {
            fprintf(stderr, "[server] short message: %u bytes\n", wc.byte_len);
            goto out;
        }
        memcpy(&m, p, sizeof m);
        uint32_t want_len = msg_len(next_seq);
        test_fill(expect, want_len, (uint64_t)next_seq + 1);
        if (m.type != MSG_DATA || m.seq != (uint32_t)next_seq || m.len != want_len ||
            wc.byte_len != sizeof m + m.len || m.sum != test_fnv1a(p + sizeof m, m.len) ||
            memcmp(p + sizeof m, expect, want_len) != 0) {
            fprintf(stderr,
                    "[server] message %d bad: type %u seq %u len %u (want %u) byte_len %u\n",
                    next_seq, m.type, m.seq, m.len, want_len, wc.byte_len);
            goto out;
        }
        all_sums ^= m.sum + (uint64_t)next_seq;
        next_seq++;
    }
    fprintf(stderr, "[server] 1 MiB WRITE and %d SENDs verified\n", NMSGS);

    /* 4. tell the client what we saw */
    struct msg ack = {.type = MSG_ACK,
                      .count = (uint32_t)next_seq,
                      .sum = all_sums,
                      .addr = test_fnv1a(s->area, WRITE_LEN)};
    if (post_send_msg(s, 1, &ack) != 0)
        goto out;
    for (;;) {
        struct ibv_wc wc;
        if (wait_wc(s, &wc) != 0)
            goto out;
        if (wc.opcode == IBV_WC_SEND)
            break;
        fprintf(stderr, "[server] stray completion opcode %d\n", wc.opcode);
        goto out;
    }
    rc = 0;
out:
    free(expect);
    return rc;
}

/* ---- client ---------------------------------------------------------- */

static int client_run(struct side *s)
{
    TRY(s, setup_local(s));
    TRY(s, bex__hello_send(s->fd, &s->mine, s->deadline));
    TRY(s, bex__hello_recv(s->fd, &s->theirs, s->deadline));
    if (s->theirs.conn_id != s->mine.conn_id)
        FAILF(s, "server answered for connection %llx, not ours",
              (unsigned long long)s->theirs.conn_id);
    TRY(s, connect_qp(s));
    if (s->credits < NMSGS + 1)
        FAILF(s, "peer grants %d credits, the test needs %d", s->credits, NMSGS + 1);

    /* 1. wait for the rendezvous */
    struct ibv_wc wc;
    TRY(s, wait_wc(s, &wc));
    if (wc.opcode != IBV_WC_RECV || wc.wr_id != 0)
        FAILF(s, "expected the rendezvous, got opcode %d wr_id %llu", wc.opcode,
              (unsigned long long)wc.wr_id);
    struct msg rv;
    memcpy(&rv, s->area + RECV_OFF, sizeof rv);
    if (rv.type != MSG_RENDEZVOUS || rv.count != WRITE_LEN)
        FAILF(s, "bad rendezvous: type %u len %u", rv.type, rv.count);

    /* 2. 1 MiB of WRITEs, one doorbell, only the last signaled */
    test_fill(s->area, WRITE_LEN, WRITE_SEED);
    uint64_t wsum = test_fnv1a(s->area, WRITE_LEN);
    struct ibv_sge sge[NFRAGS];
    struct ibv_send_wr wr[NFRAGS], *bad;
    memset(wr, 0, sizeof wr);
    for (uint32_t i = 0; i < NFRAGS; i++) {
        sge[i] = (struct ibv_sge){.addr = (uintptr_t)(s->area + (size_t)i * FRAG_LEN),
                                  .length = FRAG_LEN,
                                  .lkey = s->mr->lkey};
        wr[i].wr_id = 2000 + i;
        wr[i].sg_list = &sge[i];
        wr[i].num_sge = 1;
        wr[i].opcode = IBV_WR_RDMA_WRITE;
        wr[i].wr.rdma.remote_addr = rv.addr + (uint64_t)i * FRAG_LEN;
        wr[i].wr.rdma.rkey = rv.rkey;
        wr[i].next = i + 1 < NFRAGS ? &wr[i + 1] : NULL;
    }
    wr[NFRAGS - 1].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr[NFRAGS - 1].imm_data = htonl(imm_of(wsum));
    wr[NFRAGS - 1].send_flags = IBV_SEND_SIGNALED;
    if (s->credits-- <= 0) /* WRITE_WITH_IMM consumes a receive */
        FAILF(s, "no credit for the WRITE_WITH_IMM");
    TRY(s, bex__rdma_err(ibv_post_send(s->qp, wr, &bad)));
    TRY(s, wait_wc(s, &wc));
    if (wc.opcode != IBV_WC_RDMA_WRITE || wc.wr_id != 2000 + NFRAGS - 1)
        FAILF(s, "expected the WRITE_WITH_IMM completion, got opcode %d wr_id %llu", wc.opcode,
              (unsigned long long)wc.wr_id);

    /* 3. 64 SENDs in batches of 16, last of each batch signaled */
    uint64_t all_sums = 0;
    uint8_t payload[SLOT_LEN];
    for (int b = 0; b < NMSGS; b += BATCH) {
        struct ibv_sge ss[BATCH];
        struct ibv_send_wr sw[BATCH];
        memset(sw, 0, sizeof sw);
        for (int k = 0; k < BATCH; k++) {
            int i = b + k;
            struct msg m = {.type = MSG_DATA, .seq = (uint32_t)i, .len = msg_len(i)};
            test_fill(payload, m.len, (uint64_t)i + 1);
            m.sum = test_fnv1a(payload, m.len);
            all_sums ^= m.sum + (uint64_t)i;
            uint8_t *p = s->area + SEND_OFF + (size_t)i * SLOT_LEN;
            memcpy(p, &m, sizeof m);
            memcpy(p + sizeof m, payload, m.len);
            ss[k] = (struct ibv_sge){
                .addr = (uintptr_t)p, .length = (uint32_t)sizeof m + m.len, .lkey = s->mr->lkey};
            sw[k].wr_id = 3000 + (uint64_t)i;
            sw[k].sg_list = &ss[k];
            sw[k].num_sge = 1;
            sw[k].opcode = IBV_WR_SEND;
            sw[k].send_flags = k == BATCH - 1 ? IBV_SEND_SIGNALED : 0;
            sw[k].next = k + 1 < BATCH ? &sw[k + 1] : NULL;
            if (s->credits-- <= 0)
                FAILF(s, "out of credits at message %d", i);
        }
        TRY(s, bex__rdma_err(ibv_post_send(s->qp, sw, &bad)));
        TRY(s, wait_wc(s, &wc));
        if (wc.opcode != IBV_WC_SEND || wc.wr_id != 3000 + (uint64_t)(b + BATCH - 1))
            FAILF(s, "batch %d: completion opcode %d wr_id %llu", b / BATCH, wc.opcode,
                  (unsigned long long)wc.wr_id);
    }

    /* 4. the server's verdict */
    TRY(s, wait_wc(s, &wc));
    if (wc.opcode != IBV_WC_RECV || wc.wr_id != 1)
        FAILF(s, "expected the ACK, got opcode %d wr_id %llu", wc.opcode,
              (unsigned long long)wc.wr_id);
    struct msg ack;
    memcpy(&ack, s->area + RECV_OFF + SLOT_LEN, sizeof ack);
    if (ack.type != MSG_ACK || ack.count != NMSGS || ack.sum != all_sums || ack.addr != wsum)
        FAILF(s, "server saw count %u sum %llx write %llx; sent %d %llx %llx", ack.count,
              (unsigned long long)ack.sum, (unsigned long long)ack.addr, NMSGS,
              (unsigned long long)all_sums, (unsigned long long)wsum);
    fprintf(stderr, "[client] server confirmed 1 MiB WRITE and %d SENDs\n", NMSGS);
    return 0;
}

/* ---- the two processes ----------------------------------------------- */

static int child_main(const struct test_addrs *ta, uint16_t port, pid_t parent)
{
    /* If the parent dies (ctest timeout), so does this process. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
        return 1;
    struct side s = {.who = "client", .fd = -1, .deadline = bex__hello_now_ms() + deadline_ms()};
    s.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s.fd < 0)
        return 1;
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_addr = ta->a1};
    struct sockaddr_in srv = {.sin_family = AF_INET, .sin_addr = ta->a0, .sin_port = htons(port)};
    if (bind(s.fd, (struct sockaddr *)&me, sizeof me) != 0 ||
        connect(s.fd, (struct sockaddr *)&srv, sizeof srv) != 0) {
        fprintf(stderr, "[client] connect %s -> %s:%u: %s\n", ta->s1, ta->s0, port,
                strerror(errno));
        close(s.fd);
        return 1;
    }
    int rc = client_run(&s);
    rc |= teardown(&s);
    return rc ? 1 : 0;
}

/* Wait for the child until the deadline, then kill it; always reap it. */
static int reap(pid_t pid, int64_t deadline)
{
    int st = 0;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            break;
        if (r < 0 && errno != EINTR) {
            fprintf(stderr, "waitpid: %s\n", strerror(errno));
            return 1;
        }
        if (bex__hello_now_ms() > deadline) {
            fprintf(stderr, "client did not finish in time: killing it\n");
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return 1;
        }
        usleep(20000);
    }
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
        return 0;
    if (WIFSIGNALED(st))
        fprintf(stderr, "client killed by signal %d\n", WTERMSIG(st));
    else
        fprintf(stderr, "client exited with %d\n", WEXITSTATUS(st));
    return 1;
}

static int rc_pair(void)
{
    struct test_addrs ta;
    int rc = test_need_rdma(&ta);
    if (rc)
        return rc;

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(lfd >= 0);
    struct sockaddr_in la = {.sin_family = AF_INET, .sin_addr = ta.a0};
    socklen_t ll = sizeof la;
    if (bind(lfd, (struct sockaddr *)&la, sizeof la) != 0) {
        fprintf(stderr, "bind %s: %s\n", ta.s0, strerror(errno));
        return 1;
    }
    CHECK(listen(lfd, 4) == 0);
    CHECK(getsockname(lfd, (struct sockaddr *)&la, &ll) == 0);
    uint16_t port = ntohs(la.sin_port);

    fflush(stderr);
    pid_t parent = getpid();
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(lfd);
        exit(child_main(&ta, port, parent));
    }

    struct side s = {.who = "server", .fd = -1, .deadline = bex__hello_now_ms() + deadline_ms()};
    int srv_rc = -1;
    struct pollfd p = {.fd = lfd, .events = POLLIN};
    if (poll(&p, 1, (int)deadline_ms()) == 1) {
        s.fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (s.fd >= 0)
            srv_rc = server_run(&s);
        else
            fprintf(stderr, "[server] accept: %s\n", strerror(errno));
    } else {
        fprintf(stderr, "[server] no client connected\n");
    }
    close(lfd);
    srv_rc |= teardown(&s);
    int cli_rc = reap(pid, s.deadline + 5000 * (int64_t)bex_test_time_scale());
    fprintf(stderr, "server %s, client %s\n", srv_rc ? "FAILED" : "ok", cli_rc ? "FAILED" : "ok");
    return srv_rc || cli_rc ? 1 : 0;
}

BEX_TEST_MAIN(BEX_CASE(rc_pair))
