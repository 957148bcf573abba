/* SPDX-License-Identifier: Apache-2.0 */
/* The protocol-speaking attacker. See peer.h. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "adv.h"
#include "peer.h"

#define WR_RECV (1ull << 32)
#define WR_SEND (2ull << 32)

static void say_err(const char *what, int err)
{
    fprintf(stderr, "attacker: %s: %s\n", what, strerror(err < 0 ? -err : err));
}

/* A TCP connection from local to srv, blocking, with our port. */
static int tcp_connect(struct in_addr local, const bex_addr *srv, uint16_t *lport)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    bex_addr me = {.in4 = {.sin_family = AF_INET, .sin_addr = local}};
    if (bind(fd, (struct sockaddr *)&me, sizeof me) ||
        connect(fd, (const struct sockaddr *)srv, sizeof *srv)) {
        int err = -errno;
        close(fd);
        return err;
    }
    bex_addr got;
    socklen_t sl = sizeof got;
    getsockname(fd, (struct sockaddr *)&got, &sl);
    *lport = ntohs(got.in4.sin_port);
    return fd;
}

static int post_recv(struct adv_peer *p, uint32_t i)
{
    /* one buffer, as bex posts them: header-free DATA lands at its start, a
     * control message's header fills its first 32 bytes */
    struct ibv_sge sge = {(uintptr_t)(p->rbuf + (size_t)i * PEER_EAGER), PEER_EAGER, p->mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = WR_RECV | i, .sg_list = &sge, .num_sge = 1}, *bad;
    return bex__rdma_err(ibv_post_recv(p->qp, &wr, &bad));
}

static int post_send(struct adv_peer *p, struct ibv_send_wr *wr)
{
    uint64_t seq = p->wr_seq++;
    wr->wr_id = WR_SEND | seq;
    wr->send_flags |= IBV_SEND_SIGNALED;
    p->wc_status[seq % 1024] = 0xff;
    struct ibv_send_wr *bad;
    int rc = bex__rdma_err(ibv_post_send(p->qp, wr, &bad));
    if (rc)
        return rc;
    p->sq_out++;
    return 0;
}

/* ---- setup ---- */

/* Read one setup message: its 8-byte preamble, then the rest. A refusal
 * notice from the server is returned as its error. */
static int read_setup(int fd, uint8_t *buf, size_t cap, size_t *len, int64_t dl)
{
    int rc = bex__hello_read_all(fd, buf, BEX__SETUP_PRE_LEN, dl);
    if (rc)
        return rc;
    int kind = bex__setup_peek(buf, len);
    if (kind < 0)
        return kind;
    if (*len > cap)
        return -EBADMSG;
    rc = bex__hello_read_all(fd, buf + BEX__SETUP_PRE_LEN, *len - BEX__SETUP_PRE_LEN, dl);
    if (rc)
        return rc;
    if (kind == BEX__SETUP_NOTICE) {
        uint32_t st =
            (uint32_t)buf[4] << 24 | (uint32_t)buf[5] << 16 | (uint32_t)buf[6] << 8 | buf[7];
        return st ? (st < 4096 ? -(int)st : -EPROTO) : 0;
    }
    return kind;
}

static int to_rts(struct adv_peer *p)
{
    struct bex__rdma_peer peer = {.qpn = p->theirs.qpn,
                                  .psn = p->theirs.psn,
                                  .active_mtu = p->theirs.mtu,
                                  .rd_atomic = p->theirs.rd_atomic};
    memcpy(peer.gid.raw, p->theirs.gid, 16);
    int rc = bex__rdma_qp_to_rtr(p->qp, p->dev, &p->path, &peer, &p->conn);
    if (!rc)
        rc = bex__rdma_qp_to_rts(p->qp, p->dev, p->mine.psn, &peer, &p->conn);
    return rc;
}

/* The plain setup: our hello, theirs and their ready, our ready. */
static int setup_plain(struct adv_peer *p, int64_t dl)
{
    int rc = bex__hello_send(p->fd, &p->mine, dl);
    if (rc)
        return rc;
    uint8_t buf[BEX__SETUP_MAX_LEN];
    size_t len;
    rc = read_setup(p->fd, buf, sizeof buf, &len, dl);
    if (rc < 0)
        return rc;
    if (rc != BEX__SETUP_HELLO)
        return -EPROTO;
    if ((rc = bex__hello_decode(buf, len, &p->theirs)))
        return rc;
    if ((rc = read_setup(p->fd, buf, sizeof buf, &len, dl)) < 0)
        return rc;
    if ((rc = to_rts(p)))
        return rc;
    return p->o.no_ready ? 0 : bex__hello_ready_send(p->fd, 0, dl);
}

/* With a secret (docs/protocol.md, "Authenticated setup"): OPEN, the
 * server's CHALLENGE, our PROOF, its HELLO (verified), then our HELLO and
 * ready, its ready. */
static int setup_auth(struct adv_peer *p, int64_t dl)
{
    struct bex__auth_transcript t;
    uint8_t key[BEX__AUTH_KEY_LEN], m[BEX__SETUP_MAX_LEN + BEX__READY_LEN], mac[BEX__AUTH_MAC_LEN];
    size_t len;
    int rc = bex__auth_key(p->o.secret, strlen(p->o.secret), key);
    if (!rc)
        rc = bex__auth_nonce(t.nonce_c);
    if (rc)
        return rc;
    bex__auth_encode(BEX__AUTH_OPEN, t.nonce_c, m);
    if ((rc = bex__hello_write_all(p->fd, m, BEX__AUTH_SHORT_LEN, dl)))
        return rc;
    if ((rc = read_setup(p->fd, m, sizeof m, &len, dl)) < 0)
        return rc;
    if ((rc = bex__auth_decode(m, len, BEX__AUTH_CHALLENGE, t.nonce_l)))
        return rc;
    bex_addr me, them;
    socklen_t sl = sizeof me;
    getsockname(p->fd, (struct sockaddr *)&me, &sl);
    sl = sizeof them;
    getpeername(p->fd, (struct sockaddr *)&them, &sl);
    bex__auth_ends(&t, me.in4.sin_addr.s_addr, me.in4.sin_port, them.in4.sin_addr.s_addr,
                   them.in4.sin_port);
    bex__auth_mac(key, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, mac);
    bex__auth_encode(BEX__AUTH_PROOF, mac, m);
    if ((rc = bex__hello_write_all(p->fd, m, BEX__AUTH_SHORT_LEN, dl)))
        return rc;
    if ((rc = read_setup(p->fd, m, sizeof m, &len, dl)) < 0)
        return rc;
    if ((rc = bex__auth_decode_hello(m, len, &p->theirs, mac)))
        return rc;
    uint8_t hello_l[BEX__HELLO_LEN], hello_c[BEX__HELLO_LEN];
    memcpy(hello_l, m + BEX__AUTH_HDR_LEN, BEX__HELLO_LEN);
    if ((rc = bex__auth_verify(key, BEX__AUTH_MAC_HELLO_L, &t, hello_l, NULL, mac)))
        return rc;
    if ((rc = to_rts(p)))
        return rc;
    p->mine.conn_id = p->theirs.conn_id; /* the listener picks it here */
    bex__hello_encode(&p->mine, hello_c);
    bex__auth_mac(key, BEX__AUTH_MAC_HELLO_C, &t, hello_l, hello_c, mac);
    bex__auth_encode_hello(hello_c, mac, m);
    size_t n = BEX__AUTH_HELLO_LEN;
    if (!p->o.no_ready) {
        uint8_t r[BEX__READY_LEN] = {0x42, 0x45, 0x58, 0x52, 0, 0, 0, 0}; /* "BEXR", 0 */
        memcpy(m + n, r, sizeof r);
        n += sizeof r;
    }
    if ((rc = bex__hello_write_all(p->fd, m, n, dl)))
        return rc;
    rc = read_setup(p->fd, m, sizeof m, &len, dl);
    return rc < 0 ? rc : 0;
}

static int handshake(struct adv_peer *p, bex_addr const *srv, struct in_addr local)
{
    int64_t dl = bex__hello_now_ms() + 10000 * (int64_t)adv_scale();
    int fd = tcp_connect(local, srv, &p->lport);
    if (fd < 0)
        return fd;
    p->fd = fd;
    return p->o.secret ? setup_auth(p, dl) : setup_plain(p, dl);
}

int adv_peer_open(struct adv_peer *p, struct in_addr local, const bex_addr *srv,
                  const struct adv_peer_opts *o)
{
    memset(p, 0, sizeof *p);
    p->fd = -1;
    if (o)
        p->o = *o;
    if (!p->o.recv_depth)
        p->o.recv_depth = 32;
    if (!p->o.posted)
        p->o.posted = p->o.recv_depth < PEER_RECV_MAX ? p->o.recv_depth : PEER_RECV_MAX;
    if (p->o.posted > PEER_RECV_MAX)
        p->o.posted = PEER_RECV_MAX;
    if (!p->o.max_rndv)
        p->o.max_rndv = 4;
    if (!p->o.eager_max)
        p->o.eager_max = PEER_EAGER;
    /* fail fast when the server's QP is gone */
    p->conn = (struct bex__rdma_conn_config){.retry_cnt = 3, .rnr_retry = 3};
    int rc = bex__rdma_dev_open_ipv4(local, &p->dev, &p->path);
    if (rc) {
        say_err("device", rc);
        return rc;
    }
    p->memlen = PEER_RECV_MAX * (BEX__HDR_LEN + PEER_EAGER) + PEER_SEND_MAX * BEX__HDR_LEN +
                PEER_EAGER + 64 + PEER_SRC_SIZE + (size_t)PEER_LAND * PEER_LAND_SIZE;
    if (posix_memalign((void **)&p->mem, 4096, p->memlen))
        return -ENOMEM;
    memset(p->mem, 0, p->memlen);
    uint8_t *q = p->mem;
    p->rhdr = q;
    q += PEER_RECV_MAX * BEX__HDR_LEN;
    p->rbuf = q;
    q += (size_t)PEER_RECV_MAX * PEER_EAGER;
    p->shdr = q;
    q += PEER_SEND_MAX * BEX__HDR_LEN;
    p->spay = q;
    q += PEER_EAGER;
    p->ka_in = (volatile uint64_t *)q;
    p->ka_out = (uint64_t *)(q + 8);
    q += 64;
    p->src = q;
    memset(p->src, PEER_ATTACK, PEER_SRC_SIZE);
    q += PEER_SRC_SIZE;
    p->land = q;
    p->mr =
        ibv_reg_mr(p->dev->pd, p->mem, p->memlen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!p->mr)
        return bex__rdma_errno();
    if ((rc = bex__rdma_cq_create(p->dev, 1024, NULL, &p->cq)))
        return rc;
    struct bex__rdma_qp_config qc = {.send_cq = p->cq,
                                     .recv_cq = p->cq,
                                     .sq_depth = PEER_SEND_MAX + 8,
                                     .rq_depth = PEER_RECV_MAX + 1,
                                     .max_send_sge = 2,
                                     .max_recv_sge = 2};
    if ((rc = bex__rdma_qp_create(p->dev, &qc, &p->qp, NULL)))
        return rc;
    if ((rc = bex__rdma_qp_to_init(p->qp, &p->path, &p->conn)))
        return rc;
    for (uint32_t i = 0; i < p->o.posted; i++)
        if ((rc = post_recv(p, i)))
            return rc;
    struct bex__hello *h = &p->mine;
    h->qpn = p->qp->qp_num;
    h->psn = bex__rdma_random_psn();
    memcpy(h->gid, p->path.gid.raw, 16);
    h->mtu = (uint8_t)p->path.active_mtu;
    h->rd_atomic = bex__rdma_dest_rd_atomic(p->dev, &p->conn);
    h->recv_depth = p->o.recv_depth;
    h->sq_depth = PEER_SEND_MAX;
    h->max_msg = BEX__HELLO_MAX_MSG;
    h->frag_size = 65536;
    h->conn_id = bex__rdma_random_u64();
    h->eager_max = p->o.eager_max;
    h->ka_addr = (uintptr_t)p->ka_in;
    h->ka_rkey = p->mr->rkey;
    h->max_rndv = p->o.max_rndv;
    if ((rc = handshake(p, srv, local))) {
        if (rc == -ECONNRESET || rc == -EPIPE || rc == -EACCES || rc == -EPROTO || rc == -EBADMSG) {
            p->closed = true;
            p->closed_ms = adv_now_ms();
        }
        return rc;
    }
    fcntl(p->fd, F_SETFL, fcntl(p->fd, F_GETFL) | O_NONBLOCK);
    p->credits = p->theirs.recv_depth;
    p->up = true;
    p->ka_next = adv_now_ms();
    return 0;
}

void adv_peer_destroy(struct adv_peer *p)
{
    if (p->qp)
        bex__rdma_qp_destroy(p->qp);
    if (p->cq)
        bex__rdma_cq_destroy(p->cq);
    if (p->mr)
        ibv_dereg_mr(p->mr);
    free(p->mem);
    if (p->fd >= 0)
        close(p->fd);
    if (p->dev)
        bex__rdma_dev_close(p->dev);
    memset(p, 0, sizeof *p);
    p->fd = -1;
}

/* ---- the event loop ---- */

static int send_hdr(struct adv_peer *p, struct bex__hdr *h, uint32_t len, bool count_credit)
{
    if (p->qp_err || !p->up)
        return -EPIPE;
    uint8_t *hb = p->shdr + (p->wr_seq % PEER_SEND_MAX) * BEX__HDR_LEN;
    uint32_t back = p->to_return > 0xffff ? 0xffff : p->to_return;
    h->credits = (uint16_t)back;
    bex__hdr_encode(h, hb);
    struct ibv_sge sge[2] = {{(uintptr_t)hb, BEX__HDR_LEN, p->mr->lkey},
                             {(uintptr_t)p->spay, len, p->mr->lkey}};
    struct ibv_send_wr wr = {.sg_list = sge, .num_sge = len ? 2 : 1, .opcode = IBV_WR_SEND};
    if (h->type == BEX__MSG_DATA && h->stream <= BEX__IMM_STREAM_MAX) {
        /* as bex sends DATA: header-free, stream and credits in the immediate */
        back = back > BEX__IMM_CREDITS_MAX ? BEX__IMM_CREDITS_MAX : back;
        wr.opcode = IBV_WR_SEND_WITH_IMM;
        wr.imm_data = htonl(bex__imm_encode(h->stream, back));
        wr.sg_list = &sge[1];
        wr.num_sge = len ? 1 : 0;
    }
    int rc = post_send(p, &wr);
    if (rc)
        return rc;
    p->to_return -= back;
    if (count_credit && p->credits)
        p->credits--;
    p->sends++;
    return 0;
}

/* Our answer to a rendezvous request of the server: a landing slot. */
static void answer_reqs(struct adv_peer *p)
{
    while (p->nreq_q && p->credits > 1 && p->sq_out < PEER_SEND_MAX) {
        struct bex__hdr q = p->req_q[0];
        memmove(p->req_q, p->req_q + 1, (p->nreq_q - 1) * sizeof q);
        p->nreq_q--;
        struct bex__hdr r = {.type = BEX__MSG_RNDV_RESP, .id = q.id};
        int slot = -1;
        for (int i = 0; i < PEER_LAND && q.len <= PEER_LAND_SIZE; i++)
            if (!p->land_busy[i]) {
                slot = i;
                break;
            }
        if (slot < 0) {
            r.status = -ENOMEM;
        } else {
            p->land_busy[slot] = true;
            r.addr = (uintptr_t)(p->land + (size_t)slot * PEER_LAND_SIZE);
            r.rkey = p->mr->rkey;
            r.stream = (uint32_t)slot;
        }
        send_hdr(p, &r, 0, true);
    }
}

static void on_recv(struct adv_peer *p, const struct ibv_wc *wc)
{
    uint32_t i = (uint32_t)wc->wr_id;
    if (wc->opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        uint32_t slot = ntohl(wc->imm_data);
        if (slot < PEER_LAND)
            p->land_busy[slot] = false;
        p->imm_recv++;
    } else {
        struct bex__hdr h;
        int rc = wc->wc_flags & IBV_WC_WITH_IMM
                     ? bex__imm_decode(ntohl(wc->imm_data), wc->byte_len, &h)
                     : bex__hdr_decode(p->rbuf + (size_t)i * PEER_EAGER, wc->byte_len, &h);
        if (rc == 0) {
            p->credits += h.credits;
            switch (h.type) {
            case BEX__MSG_RNDV_RESP:
                if (p->nresp < PEER_RESP_MAX)
                    p->resp[p->nresp++] = (struct adv_resp){.id = h.id,
                                                            .status = h.status,
                                                            .addr = h.addr,
                                                            .rkey = h.rkey,
                                                            .slot = h.stream};
                break;
            case BEX__MSG_RNDV_REQ:
                p->req_recv++;
                if (!p->o.ignore_rndv && p->nreq_q < 64)
                    p->req_q[p->nreq_q++] = h;
                break;
            case BEX__MSG_DATA:
                p->data_recv++;
                break;
            case BEX__MSG_CREDIT:
                p->credit_recv++;
                break;
            case BEX__MSG_CLOSE:
                p->close_recv++;
                break;
            }
        }
    }
    if (p->o.hold_credits) {
        p->held++;
        return;
    }
    if (post_recv(p, i) == 0)
        p->to_return++;
}

static void check_tcp(struct adv_peer *p)
{
    if (p->closed || p->fd < 0)
        return;
    char b[256];
    ssize_t n = recv(p->fd, b, sizeof b, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        p->closed = true;
        p->closed_ms = adv_now_ms();
    }
}

static void poll_once(struct adv_peer *p)
{
    struct ibv_wc wc[32];
    int n;
    while (p->cq && (n = ibv_poll_cq(p->cq, 32, wc)) > 0) {
        for (int k = 0; k < n; k++) {
            if (wc[k].status != IBV_WC_SUCCESS && !p->qp_err)
                p->qp_err = wc[k].status;
            if (wc[k].wr_id & WR_RECV) {
                if (wc[k].status == IBV_WC_SUCCESS)
                    on_recv(p, &wc[k]);
            } else {
                p->sq_out--;
                p->wc_status[(wc[k].wr_id & 0xffffffffu) % 1024] = (uint8_t)wc[k].status;
            }
        }
    }
    check_tcp(p);
    if (!p->up || p->qp_err)
        return;
    uint64_t now = adv_now_ms();
    if (now >= p->ka_next && p->sq_out < PEER_SEND_MAX) {
        /* keepalive: a live, paying attacker is not timed out */
        p->ka_next = now + 100;
        *p->ka_out = ++p->ka_seq;
        struct ibv_sge sge = {(uintptr_t)p->ka_out, 8, p->mr->lkey};
        struct ibv_send_wr wr = {.sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE};
        wr.wr.rdma.remote_addr = p->theirs.ka_addr;
        wr.wr.rdma.rkey = p->theirs.ka_rkey;
        post_send(p, &wr);
    }
    answer_reqs(p);
    if (!p->o.hold_credits && p->to_return >= p->o.posted / 2 && p->credits > 0 &&
        p->sq_out < PEER_SEND_MAX) {
        struct bex__hdr h = {.type = BEX__MSG_CREDIT};
        send_hdr(p, &h, 0, true);
    }
}

void adv_peer_poll(struct adv_peer *p, unsigned ms)
{
    uint64_t end = adv_now_ms() + ms;
    do {
        poll_once(p);
        if (ms)
            usleep(200);
    } while (adv_now_ms() < end);
}

int adv_peer_send(struct adv_peer *p, struct bex__hdr *h, uint32_t len, unsigned wait_ms)
{
    uint64_t end = adv_now_ms() + wait_ms;
    for (;;) {
        poll_once(p);
        if (p->qp_err || p->closed)
            return -EPIPE;
        if (p->credits > 1 && p->sq_out < PEER_SEND_MAX)
            return send_hdr(p, h, len, true);
        if (adv_now_ms() >= end)
            return -EAGAIN;
        usleep(200);
    }
}

int adv_peer_send_nocredit(struct adv_peer *p, struct bex__hdr *h, uint32_t len)
{
    poll_once(p);
    return send_hdr(p, h, len, false);
}

void adv_peer_fill(struct adv_peer *p, uint8_t b)
{
    memset(p->src, b, PEER_SRC_SIZE);
}

int adv_peer_write_post(struct adv_peer *p, uint64_t raddr, uint32_t rkey, uint32_t len,
                        int64_t imm)
{
    if (p->qp_err || !p->up)
        return -EPIPE;
    if (len > PEER_SRC_SIZE)
        len = PEER_SRC_SIZE;
    struct ibv_sge sge = {(uintptr_t)p->src, len, p->mr->lkey};
    struct ibv_send_wr wr = {.sg_list = &sge,
                             .num_sge = len ? 1 : 0,
                             .opcode = imm >= 0 ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE};
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    if (imm >= 0) {
        wr.imm_data = htonl((uint32_t)imm);
        if (p->credits)
            p->credits--;
    }
    return post_send(p, &wr);
}

int adv_peer_write(struct adv_peer *p, uint64_t raddr, uint32_t rkey, uint32_t len, int64_t imm,
                   unsigned wait_ms)
{
    uint64_t end = adv_now_ms() + wait_ms;
    while (p->sq_out >= PEER_SEND_MAX && adv_now_ms() < end)
        poll_once(p);
    uint64_t seq = p->wr_seq;
    int rc = adv_peer_write_post(p, raddr, rkey, len, imm);
    if (rc)
        return rc;
    for (;;) {
        poll_once(p);
        uint8_t st = p->wc_status[seq % 1024];
        if (st != 0xff)
            return st;
        if (adv_now_ms() >= end)
            return -ETIMEDOUT;
        usleep(200);
    }
}

const struct adv_resp *adv_peer_wait_resp(struct adv_peer *p, uint32_t id, unsigned wait_ms)
{
    uint64_t end = adv_now_ms() + wait_ms;
    for (;;) {
        for (uint32_t i = 0; i < p->nresp; i++)
            if (p->resp[i].id == id)
                return &p->resp[i];
        if (p->qp_err || p->closed || adv_now_ms() >= end)
            return NULL;
        poll_once(p);
        usleep(200);
    }
}

int adv_peer_wait_closed(struct adv_peer *p, unsigned wait_ms)
{
    uint64_t end = adv_now_ms() + wait_ms;
    for (;;) {
        poll_once(p);
        if (p->closed)
            return 0;
        if (adv_now_ms() >= end)
            return -ETIMEDOUT;
        usleep(500);
    }
}
