/* SPDX-License-Identifier: Apache-2.0 */
/* The fake transport: see fake.h. */
#include "fake/fake.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_test.h"

#define MSG_MAGIC 0x4d534b46u /* "FKSM": the first word of every payload */

void fk_fatal(const char *file, int line, const char *what)
{
    fprintf(stderr, "%s:%d: FK_CHECK failed: %s\n", file, line, what);
    exit(1);
}

static struct fk_side *side_of_qp(struct ibv_qp *qp)
{
    return (struct fk_side *)((char *)qp->context - offsetof(struct fk_side, ctx));
}

static struct fk_side *peer_of(struct fk_side *s)
{
    return &s->pair->s[!s->idx];
}

uint32_t fk_rand(struct fk_pair *p, uint32_t below)
{
    /* xorshift64*: the same schedule for the same seed on every machine */
    p->rng ^= p->rng >> 12;
    p->rng ^= p->rng << 25;
    p->rng ^= p->rng >> 27;
    uint64_t r = p->rng * 2685821657736338717ull;
    return below ? (uint32_t)((r >> 32) % below) : 0;
}

bool fk_dead(struct fk_pair *p, int side)
{
    return bex__engine_is_dead(p->s[side].e);
}

/* A destroyed QP (RESET: the engine failed) loses everything it held. */
static void reap(struct fk_side *s)
{
    if (s->qp.state != IBV_QPS_RESET)
        return;
    s->wire_n = s->done_n = s->rq_n = s->rcq_n = 0;
    s->inflight = 0;
}

/* ---------------- payloads ---------------- */

/* Payload bytes: message idx carries PAT[off(idx) + i] at byte i (after its
 * 8-byte tag), so that filling and checking are a memcpy and a memcmp. */
enum { PAT_SPREAD = 8192, PAT_LEN = (1 << 20) + PAT_SPREAD };
static uint8_t PAT[PAT_LEN];

static const uint8_t *pattern(uint32_t idx)
{
    static bool made;
    if (!made) {
        uint32_t x = 0x9e3779b9u;
        for (uint32_t i = 0; i < PAT_LEN; i++) {
            x = x * 1103515245u + 12345u;
            PAT[i] = (uint8_t)(x >> 24);
        }
        made = true;
    }
    return PAT + (idx * 97u) % PAT_SPREAD;
}

static void fill(struct fk_msg *m)
{
    uint8_t *b = m->m.buf;
    uint32_t w[2] = {MSG_MAGIC, m->idx};
    FK_CHECK(m->m.len <= PAT_LEN - PAT_SPREAD);
    memcpy(b, w, sizeof w);
    memcpy(b + 8, pattern(m->idx) + 8, m->m.len - 8);
}

/* The message a delivered buffer holds, checked whole. */
static struct fk_msg *identify(struct fk_pair *p, const void *buf, size_t len)
{
    const uint8_t *b = buf;
    FK_CHECK(len >= 8);
    uint32_t w[2];
    memcpy(w, b, sizeof w);
    FK_CHECK(w[0] == MSG_MAGIC && w[1] < p->n_msgs);
    struct fk_msg *m = &p->msgs[w[1]];
    FK_CHECK(m->m.len == len);
    FK_CHECK(memcmp(b + 8, pattern(m->idx) + 8, len - 8) == 0); /* what was sent */
    return m;
}

/* The live message of side `from` whose buffer holds addr (NULL if none). */
static struct fk_msg *msg_at(struct fk_pair *p, int from, uint64_t addr)
{
    for (uint32_t i = 0; i < p->n_msgs; i++) {
        struct fk_msg *m = &p->msgs[i];
        uint64_t b = (uintptr_t)m->m.buf;
        if (m->from == from && !m->done && addr >= b && addr < b + m->m.len)
            return m;
    }
    return NULL;
}

/* ---------------- the engine calls up (the sock layer's part) ---------------- */

static struct fk_side *side_of(struct bex__engine *e)
{
    return bex__engine_user(e);
}

struct fk_stream *fk_stream(struct fk_pair *p, int side, uint32_t id)
{
    struct fk_side *s = &p->s[side];
    for (uint32_t i = 0; i < s->n_streams; i++)
        if (s->streams[i].used && s->streams[i].id == id)
            return &s->streams[i];
    return NULL;
}

static void up_on_up(struct bex__xport *x)
{
    struct bex__engine *e = bex__engine_of(x);
    FK_CHECK(side_of(e)->fails == 0);
}

static void delivered(struct fk_side *s, struct fk_msg *m, uint32_t stream)
{
    FK_CHECK(s->fails == 0);
    FK_CHECK(m->from != s->idx);
    FK_CHECK(m->arrived);        /* its last request was executed */
    FK_CHECK(m->delivered == 0); /* exactly once */
    FK_CHECK(m->stream == stream);
    m->delivered++;
    s->delivered++;
    struct fk_stream *st = fk_stream(s->pair, s->idx, stream);
    if (st) {
        /* in its stream's order (a refused message may leave a gap) */
        FK_CHECK(m->seq >= st->rx_seq);
        st->rx_seq = m->seq + 1;
    }
}

static void up_on_msg(struct bex__xport *x, uint32_t stream, void *buf, size_t len)
{
    struct bex__engine *e = bex__engine_of(x);
    struct fk_side *s = side_of(e);
    if (s->x_release) {
        /* the sender gave the destination back unwritten: it does so only
         * when this side closed the socket, whose sock layer then frees
         * whatever arrives (docs/protocol.md) */
        struct fk_stream *st = fk_stream(s->pair, s->idx, stream);
        FK_CHECK(st && st->close_asked);
        s->releases++;
        bex_mem_free(buf);
        return;
    }
    struct fk_msg *m = identify(s->pair, buf, len);
    FK_CHECK(!m->m.direct);
    delivered(s, m, stream);
    if (s->hold_recv && s->n_held < FK_MAX_HELD)
        s->held[s->n_held++] = buf;
    else
        bex_mem_free(buf);
    if (s->pair->on_msg)
        s->pair->on_msg(s->pair, s->idx, stream);
}

static void up_on_open(struct bex__xport *x, uint32_t stream)
{
    struct bex__engine *e = bex__engine_of(x);
    struct fk_side *s = side_of(e);
    FK_CHECK(s->fails == 0);
    if (fk_stream(s->pair, s->idx, stream) || s->n_streams == FK_MAX_STREAMS) {
        bex__engine_fail(e, -EPROTO);
        return;
    }
    struct fk_stream *st = &s->streams[s->n_streams++];
    memset(st, 0, sizeof(*st));
    st->used = st->attached = st->opened = true;
    st->side = s->idx;
    st->id = stream;
    bex__engine_attach(e, &st->st, stream, false);
}

static void up_on_peer_close(struct bex__xport *x, uint32_t stream)
{
    struct bex__engine *e = bex__engine_of(x);
    struct fk_side *s = side_of(e);
    FK_CHECK(s->fails == 0);
    struct fk_stream *st = fk_stream(s->pair, s->idx, stream);
    if (!st || st->peer_closed)
        return;
    st->peer_closed = true;
    bex__engine_peer_closed(&st->st);
}

static bool refers_to(const struct fk_wr *w, const struct fk_msg *m)
{
    uint64_t b = (uintptr_t)m->m.buf, end = b + m->m.len;
    /* an inline request's bytes were copied at posting (the stand-in reads
     * them later, but only before the peer's receive that reports it) */
    if (w->wr.send_flags & IBV_SEND_INLINE)
        return false;
    for (int i = w->wr.opcode == IBV_WR_SEND ? 1 : 0; i < w->wr.num_sge; i++)
        if (w->sge[i].addr < end && w->sge[i].addr + w->sge[i].length > b)
            return true;
    return false;
}

static void up_on_send_done(struct bex__xport *x, struct bex__msg *bm, int status)
{
    struct bex__engine *e = bex__engine_of(x);
    struct fk_side *s = side_of(e);
    struct fk_msg *m = (struct fk_msg *)bm;
    FK_CHECK(s->fails == 0);
    FK_CHECK(!s->in_send_now); /* the transport's send_now contract */
    FK_CHECK(m >= s->pair->msgs && m < s->pair->msgs + s->pair->n_msgs && m->from == s->idx);
    FK_CHECK(m->done == 0); /* handed back exactly once */
    m->done = 1;
    m->status = status;
    if (status == 0) /* its last request completed, or went inline and the peer has it */
        FK_CHECK(m->final_acked || (m->final_inline && m->delivered == 1));
    else if (status == -ECANCELED)
        FK_CHECK(!m->final_posted); /* never delivered: its last request never left */
    else if (status == -EIO)
        FK_CHECK(m->final_posted); /* in doubt: the peer's NIC may have taken it */
    else
        FK_CHECK(status < 0 && !m->final_posted); /* refused before any of it went */
    /* the NIC is done with it: no request of a live QP points into it */
    if (s->qp.state != IBV_QPS_RESET) {
        for (uint32_t i = 0; i < s->wire_n; i++)
            FK_CHECK(!refers_to(&s->wire[(s->wire_head + i) % FK_QCAP], m));
        for (uint32_t i = 0; i < s->done_n; i++)
            FK_CHECK(!refers_to(&s->done[(s->done_head + i) % FK_QCAP], m));
    }
}

static void up_on_stream_closed(struct bex__xport *x, struct bex__stream *bst)
{
    struct bex__engine *e = bex__engine_of(x);
    struct fk_side *s = side_of(e);
    struct fk_stream *st = (struct fk_stream *)bst;
    FK_CHECK(s->fails == 0 && st->side == s->idx && !st->closed_cb && st->peer_closed);
    FK_CHECK(bst->eng == NULL);
    st->closed_cb = true;
}

static int up_on_direct(struct bex__xport *xp, uint32_t imm)
{
    struct bex__engine *e = bex__engine_of(xp);
    struct fk_side *s = side_of(e);
    FK_CHECK(s->fails == 0);
    for (uint32_t i = 0; i < s->n_exposed; i++) {
        struct fk_exposed *x = &s->exposed[i];
        if (x->used && x->imm == imm) {
            struct fk_msg *m = identify(s->pair, (void *)(uintptr_t)x->addr, x->len);
            FK_CHECK(m == x->msg && m->m.direct);
            delivered(s, m, m->stream);
            x->used = false;
            return 0;
        }
    }
    return -EPROTO;
}

static void up_on_fail(struct bex__xport *x, int err)
{
    struct bex__engine *e = bex__engine_of(x);
    struct fk_side *s = side_of(e);
    FK_CHECK(++s->fails == 1 && err < 0);
    FK_CHECK(!s->in_send_now); /* no failure inside a socket's send either */
    FK_CHECK(bex__engine_is_dead(e) && s->qp.state == IBV_QPS_RESET); /* the QP went first */
    s->fail_err = err;
    /* every message of this side has been handed back, every stream let go */
    struct fk_pair *p = s->pair;
    for (uint32_t i = 0; i < p->n_msgs; i++)
        if (p->msgs[i].from == s->idx)
            FK_CHECK(p->msgs[i].done == 1);
    for (uint32_t i = 0; i < s->n_streams; i++)
        FK_CHECK(!s->streams[i].used || s->streams[i].st.eng == NULL);
}

static const struct bex__transport_upcalls fk_ops = {BEX_TEST_UP_ON};

/* ---------------- the stand-in QP: posting ---------------- */

static bool is_write(const struct ibv_send_wr *wr)
{
    return wr->opcode == IBV_WR_RDMA_WRITE || wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
}

/* A SEND's header: the first entry of a plain SEND, or what the immediate
 * of a header-free DATA (SEND_WITH_IMM of the payload alone) stands for. */
static bool decode_send(const struct fk_wr *w, struct bex__hdr *h)
{
    if (w->wr.opcode == IBV_WR_SEND_WITH_IMM) {
        FK_CHECK(w->wr.num_sge <= 1);
        uint32_t len = w->wr.num_sge ? w->sge[0].length : 0;
        FK_CHECK(bex__imm_decode(ntohl(w->wr.imm_data), len, h) == 0);
        return true;
    }
    if (w->wr.opcode != IBV_WR_SEND || w->wr.num_sge < 1 || w->sge[0].length != BEX__HDR_LEN)
        return false;
    uint32_t total = 0;
    for (int i = 0; i < w->wr.num_sge; i++)
        total += w->sge[i].length;
    FK_CHECK(bex__hdr_decode((const uint8_t *)(uintptr_t)w->sge[0].addr, total, h) == 0);
    return true;
}

static void note_post(struct fk_side *s, struct fk_wr *w)
{
    struct fk_side *peer = peer_of(s);
    struct fk_pair *p = s->pair;
    struct bex__hdr h;
    bool is_send = decode_send(w, &h);
    FK_CHECK(is_send || is_write(&w->wr)); /* no windows here: nothing else */
    /* the send window's bytes, as the engine counts them */
    w->payload = 0;
    if (is_send && h.type == BEX__MSG_DATA)
        w->payload = h.len;
    else if (is_write(&w->wr) && w->wr.num_sge == 1 && w->wr.wr.rdma.remote_addr != peer->ka_addr)
        w->payload = w->sge[0].length;
    if (is_write(&w->wr) && w->wr.wr.rdma.remote_addr == peer->ka_addr)
        s->ka_writes++;
    /* the message this request is the last of */
    w->fin = NULL;
    /* the payload's entry: after the header, or alone when header-free */
    int pay = w->wr.opcode == IBV_WR_SEND ? 1 : 0;
    if (is_send && h.type == BEX__MSG_DATA && h.len)
        w->fin = msg_at(p, s->idx, w->sge[pay].addr);
    else if (w->wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM && w->wr.num_sge == 1) {
        struct fk_msg *m = msg_at(p, s->idx, w->sge[0].addr);
        FK_CHECK(m && w->sge[0].addr + w->sge[0].length == (uintptr_t)m->m.buf + m->m.len);
        w->fin = m;
    }
    if (w->fin) {
        FK_CHECK(!w->fin->final_posted);
        w->fin->final_posted = true;
        w->fin->final_inline = (w->wr.send_flags & IBV_SEND_INLINE) != 0;
        w->fin->posted_bytes_at = s->payload_posted;
    }
    /* credits: receive-consuming requests never exceed what the peer granted,
     * and all but CREDIT messages leave the last one free */
    if (w->wr.opcode == IBV_WR_SEND || w->wr.opcode == IBV_WR_SEND_WITH_IMM ||
        w->wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
        s->consumers_posted++;
        uint64_t reserve = is_send && h.type == BEX__MSG_CREDIT ? 0 : 1;
        FK_CHECK(s->consumers_posted + reserve <= s->credits_granted);
        uint64_t left = s->credits_granted - s->consumers_posted;
        if (left < s->min_credits_left)
            s->min_credits_left = (uint32_t)left;
    }
    /* the send window */
    s->inflight += w->payload;
    if (s->inflight > s->max_inflight)
        s->max_inflight = s->inflight;
    if (s->cfg.send_window)
        FK_CHECK(s->inflight <= s->cfg.send_window);
    s->payload_posted += w->payload;
    /* rendezvous bookkeeping: requests go to the peer's list, answers
     * become this side's grants */
    if (is_send && h.type == BEX__MSG_RNDV_REQ) {
        s->last_req_id = h.id;
        FK_CHECK(peer->n_pending_req < FK_MAX_GRANTS);
        peer->pending_req_id[peer->n_pending_req] = h.id;
        peer->pending_req_len[peer->n_pending_req++] = h.len;
    } else if (is_send && h.type == BEX__MSG_RNDV_RESP) {
        uint32_t i = 0;
        while (i < s->n_pending_req && s->pending_req_id[i] != h.id)
            i++;
        FK_CHECK(i < s->n_pending_req); /* an answer to a request that was made */
        uint32_t len = s->pending_req_len[i];
        s->pending_req_id[i] = s->pending_req_id[--s->n_pending_req];
        s->pending_req_len[i] = s->pending_req_len[s->n_pending_req];
        if (h.status == 0) {
            uint32_t k = 0;
            while (k < s->n_grants && s->grants[k].used)
                k++;
            FK_CHECK(k < FK_MAX_GRANTS);
            if (k == s->n_grants)
                s->n_grants++;
            s->grants[k] =
                (struct fk_grant){.addr = h.addr, .len = len, .imm = h.stream, .used = true};
        }
    }
    if (p->on_post && w->payload)
        p->on_post(p, s->idx, w, msg_at(p, s->idx, w->sge[pay].addr));
}

static int fk_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    struct fk_side *s = side_of_qp(qp);
    (void)bad;
    s->post_calls++;
    /* the engine learns of an error only from its completion: until then
     * it may post to a QP in error (flushed, never executed) */
    FK_CHECK(s->qp.state == IBV_QPS_RTS || s->qp.state == IBV_QPS_ERR);
    for (; wr; wr = wr->next) {
        FK_CHECK(s->wire_n + s->done_n < s->cfg.sq_depth); /* the QP's send queue */
        FK_CHECK(wr->num_sge >= 0 && wr->num_sge <= 2);
        struct fk_wr *w = &s->wire[(s->wire_head + s->wire_n++) % FK_QCAP];
        memset(w, 0, sizeof(*w));
        w->wr = *wr;
        w->wr.next = NULL;
        if (wr->num_sge)
            memcpy(w->sge, wr->sg_list, sizeof(struct ibv_sge) * (size_t)wr->num_sge);
        w->wr.sg_list = w->sge;
        note_post(s, w);
    }
    return 0;
}

static int fk_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    struct fk_side *s = side_of_qp(qp);
    FK_CHECK(s->qp.state != IBV_QPS_RESET);
    for (uint32_t i = 0; wr; wr = wr->next, i++) {
        if (s->fail_recv && i == s->recv_take) {
            *bad = wr;      /* those ahead of it are posted */
            return ENOBUFS; /* as verbs returns it: a positive errno */
        }
        /* the QP's receive queue: the credits granted and the spare receives */
        FK_CHECK(s->rq_n < s->cfg.rq_depth + bex__engine_rq_spare(&s->sh, s->cfg.rq_depth));
        FK_CHECK(wr->num_sge >= 1 && wr->num_sge <= 2);
        struct fk_rwr *r = &s->rq[(s->rq_head + s->rq_n++) % FK_QCAP];
        r->wr_id = wr->wr_id;
        r->num_sge = wr->num_sge;
        memcpy(r->sge, wr->sg_list, sizeof(struct ibv_sge) * (size_t)wr->num_sge);
    }
    return 0;
}

/* ---------------- the NIC executes ---------------- */

static struct fk_rwr *take_recv(struct fk_side *s)
{
    FK_CHECK(s->rq_n > 0); /* RNR: a request consumed a receive that was not there */
    struct fk_rwr *r = &s->rq[s->rq_head];
    s->rq_head = (s->rq_head + 1) % FK_QCAP;
    s->rq_n--;
    return r;
}

static struct fk_wc *push_rcq(struct fk_side *s, const struct ibv_wc *wc, uint16_t credits)
{
    FK_CHECK(s->rcq_n < FK_QCAP);
    struct fk_wc *c = &s->rcq[(s->rcq_head + s->rcq_n++) % FK_QCAP];
    c->wc = *wc;
    c->credits = credits;
    c->release = false;
    return c;
}

/* The peer's memory a WRITE may reach: a granted destination, an exposed
 * buffer, the keepalive word. */
static bool write_target_ok(struct fk_side *peer, uint64_t addr, uint32_t len)
{
    if (addr == peer->ka_addr)
        return len == 8;
    for (uint32_t i = 0; i < peer->n_grants; i++) {
        struct fk_grant *g = &peer->grants[i];
        if (g->used && addr >= g->addr && addr + len <= g->addr + g->len)
            return true;
    }
    for (uint32_t i = 0; i < peer->n_exposed; i++) {
        struct fk_exposed *x = &peer->exposed[i];
        if (x->used && addr >= x->addr && addr + len <= x->addr + x->len)
            return true;
    }
    return false;
}

static void apply(struct fk_side *s, struct fk_wr *w)
{
    struct fk_side *peer = peer_of(s);
    if (w->wr.opcode == IBV_WR_SEND || w->wr.opcode == IBV_WR_SEND_WITH_IMM) {
        static uint8_t bytes[BEX__HDR_LEN + (1u << 20)];
        uint32_t n = 0;
        for (int i = 0; i < w->wr.num_sge; i++) {
            FK_CHECK(n + w->sge[i].length <= sizeof bytes);
            memcpy(bytes + n, (void *)(uintptr_t)w->sge[i].addr, w->sge[i].length);
            n += w->sge[i].length;
        }
        struct fk_rwr *r = take_recv(peer);
        uint32_t off = 0;
        for (int i = 0; i < r->num_sge && off < n; i++) {
            uint32_t k = n - off < r->sge[i].length ? n - off : r->sge[i].length;
            memcpy((void *)(uintptr_t)r->sge[i].addr, bytes + off, k);
            off += k;
        }
        FK_CHECK(off == n); /* the receive was large enough */
        struct bex__hdr h;
        struct ibv_wc wc = {.wr_id = r->wr_id, .opcode = IBV_WC_RECV, .byte_len = n};
        if (w->wr.opcode == IBV_WR_SEND_WITH_IMM) {
            FK_CHECK(bex__imm_decode(ntohl(w->wr.imm_data), n, &h) == 0);
            wc.wc_flags = IBV_WC_WITH_IMM;
            wc.imm_data = w->wr.imm_data;
        } else {
            FK_CHECK(bex__hdr_decode(bytes, n, &h) == 0);
        }
        push_rcq(peer, &wc, h.credits);
        return;
    }
    if (w->wr.num_sge) {
        uint64_t a = w->wr.wr.rdma.remote_addr;
        uint32_t len = w->sge[0].length;
        FK_CHECK(write_target_ok(peer, a, len));
        memcpy((void *)(uintptr_t)a, (void *)(uintptr_t)w->sge[0].addr, len);
    }
    if (w->wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
        uint32_t imm = ntohl(w->wr.imm_data);
        uint32_t len = w->wr.num_sge ? w->sge[0].length : 0;
        if (!(imm & BEX__IMM_DIRECT)) {
            /* the end of a granted destination: written, or given back */
            uint32_t i = 0;
            while (i < peer->n_grants && !(peer->grants[i].used && peer->grants[i].imm == imm))
                i++;
            FK_CHECK(i < peer->n_grants);
            peer->grants[i].used = false;
        }
        struct fk_rwr *r = take_recv(peer);
        struct ibv_wc wc = {.wr_id = r->wr_id,
                            .opcode = IBV_WC_RECV_RDMA_WITH_IMM,
                            .byte_len = len,
                            .imm_data = w->wr.imm_data,
                            .wc_flags = IBV_WC_WITH_IMM};
        push_rcq(peer, &wc, 0)->release = !(imm & BEX__IMM_DIRECT) && w->wr.num_sge == 0;
    }
}

bool fk_exec(struct fk_pair *p, int side)
{
    struct fk_side *s = &p->s[side];
    reap(s);
    if (!s->wire_n || s->qp.state != IBV_QPS_RTS)
        return false;
    struct fk_wr *w = &s->wire[s->wire_head];
    if (s->hold_writes && is_write(&w->wr) && w->wr.wr.rdma.remote_addr != peer_of(s)->ka_addr)
        return false;
    s->wire_head = (s->wire_head + 1) % FK_QCAP;
    s->wire_n--;
    struct fk_wr *d = &s->done[(s->done_head + s->done_n++) % FK_QCAP];
    *d = *w;
    d->wr.sg_list = d->sge;
    if (peer_of(s)->qp.state != IBV_QPS_RTS) {
        d->status = IBV_WC_RETRY_EXC_ERR; /* nobody answers */
    } else if (s->fail_next) {
        s->fail_next = false;
        d->status = IBV_WC_REM_ACCESS_ERR;
    } else {
        d->status = IBV_WC_SUCCESS;
        apply(s, d);
        if (d->fin)
            d->fin->arrived = true;
    }
    if (d->status != IBV_WC_SUCCESS)
        s->qp.state = IBV_QPS_ERR; /* the rest is flushed: nothing more executes */
    return true;
}

bool fk_send_cqe(struct fk_pair *p, int side)
{
    struct fk_side *s = &p->s[side];
    reap(s);
    uint32_t k = 0;
    while (k < s->done_n) {
        struct fk_wr *w = &s->done[(s->done_head + k) % FK_QCAP];
        if ((w->wr.send_flags & IBV_SEND_SIGNALED) || w->status != IBV_WC_SUCCESS)
            break;
        k++;
    }
    if (k == s->done_n)
        return false; /* nothing signaled has been executed yet */
    struct ibv_wc wc = {0};
    /* an error completion retires nothing for the engine: what went before
     * it unsignaled stays in doubt */
    bool ok = s->done[(s->done_head + k) % FK_QCAP].status == IBV_WC_SUCCESS;
    for (uint32_t i = 0; i <= k; i++) {
        struct fk_wr *w = &s->done[s->done_head];
        s->done_head = (s->done_head + 1) % FK_QCAP;
        s->done_n--;
        wc.wr_id = w->wr.wr_id;
        wc.status = w->status;
        wc.opcode = w->wr.opcode == IBV_WR_SEND || w->wr.opcode == IBV_WR_SEND_WITH_IMM
                        ? IBV_WC_SEND
                        : IBV_WC_RDMA_WRITE;
        if (ok) {
            s->inflight -= w->payload;
            if (w->fin)
                w->fin->final_acked = true;
        }
    }
    bex__engine_complete(s->e, &wc);
    reap(s);
    reap(peer_of(s));
    return true;
}

bool fk_recv_cqe(struct fk_pair *p, int side)
{
    struct fk_side *s = &p->s[side];
    reap(s);
    if (!s->rcq_n)
        return false;
    struct fk_wc c = s->rcq[s->rcq_head];
    s->rcq_head = (s->rcq_head + 1) % FK_QCAP;
    s->rcq_n--;
    if (c.wc.opcode == IBV_WC_RECV)
        s->credits_granted += c.credits;
    s->x_release = c.release;
    bex__engine_complete(s->e, &c.wc);
    s->x_release = false;
    reap(s);
    reap(peer_of(s));
    return true;
}

bool fk_progress(struct fk_pair *p, int side)
{
    struct fk_side *s = &p->s[side];
    uint64_t posts = s->post_calls;
    FK_CHECK(!bex__engine_progress_xport(bex__engine_xport(s->e)));
    bool any = s->post_calls != posts;
    reap(s);
    reap(peer_of(s));
    return any;
}

void fk_tick(struct fk_pair *p, int side, uint64_t advance_ms)
{
    p->clock += advance_ms;
    if (p->virt_clock && !p->clock_base)
        p->clock_base = bex__now_ms();
    bex__engine_tick(p->s[side].e, (p->virt_clock ? p->clock_base : bex__now_ms()) + p->clock);
    reap(&p->s[side]);
    reap(&p->s[!side]);
}

void fk_quiesce(struct fk_pair *p)
{
    for (uint32_t round = 0; round < 1000000; round++) {
        bool any = false;
        for (int i = 0; i < 2; i++) {
            any |= fk_progress(p, i);
            while (fk_exec(p, i))
                any = true;
        }
        for (int i = 0; i < 2; i++) {
            while (fk_recv_cqe(p, i))
                any = true;
            while (fk_send_cqe(p, i))
                any = true;
        }
        if (!any)
            return;
    }
    FK_CHECK(!"fk_quiesce: still moving after 10^6 rounds");
}

void fk_random_steps(struct fk_pair *p, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        int side = (int)fk_rand(p, 2);
        uint32_t r = fk_rand(p, 100);
        if (r < 30)
            fk_progress(p, side);
        else if (r < 60)
            fk_exec(p, side);
        else if (r < 80)
            fk_recv_cqe(p, side);
        else
            fk_send_cqe(p, side);
    }
}

/* ---------------- as the peer ---------------- */

void fk_inject_write_imm(struct fk_pair *p, int side, uint32_t imm)
{
    struct fk_side *s = &p->s[side];
    struct fk_rwr *r = take_recv(s);
    struct ibv_wc wc = {.wr_id = r->wr_id,
                        .opcode = IBV_WC_RECV_RDMA_WITH_IMM,
                        .imm_data = htonl(imm),
                        .wc_flags = IBV_WC_WITH_IMM};
    push_rcq(s, &wc, 0);
}

void fk_inject_hdr(struct fk_pair *p, int side, const struct bex__hdr *h)
{
    struct fk_side *s = &p->s[side];
    struct fk_rwr *r = take_recv(s);
    FK_CHECK(r->sge[0].length >= BEX__HDR_LEN);
    bex__hdr_encode(h, (uint8_t *)(uintptr_t)r->sge[0].addr);
    struct ibv_wc wc = {.wr_id = r->wr_id, .opcode = IBV_WC_RECV, .byte_len = BEX__HDR_LEN};
    push_rcq(s, &wc, h->credits);
}

/* ---------------- set-up, messages, the end ---------------- */

void fk_default_config(struct bex__engine_config *c)
{
    *c = bex_test_engine_config();
}

static void log_sink(int level, const char *msg, void *arg)
{
    struct fk_side *s = arg;
    if (s->pair->verbose || getenv("FK_VERBOSE"))
        fprintf(stderr, "  [side %d log %d] %s\n", s->idx, level, msg);
}

static void side_init(struct fk_pair *p, int idx, const struct bex__engine_config *cfg)
{
    struct fk_side *s = &p->s[idx];
    s->pair = p;
    s->idx = idx;
    s->cfg = *cfg;
    s->min_credits_left = UINT32_MAX;
    bex_mem_registrar reg;
    bex_mem_registrar_noop(&reg);
    bex_mem_config lc = {.kind = BEX_MEM_POOL_LANDING};
    FK_CHECK(bex_mem_pool_create(&reg, NULL, &s->pool) == 0);
    FK_CHECK(bex_mem_pool_create(&reg, NULL, &s->recv_pool) == 0);
    FK_CHECK(bex_mem_pool_create(&reg, &lc, &s->landing) == 0);
    bex__log_init(&s->log, log_sink, s, BEX_LOG_DEBUG);
    s->ctx.ops.post_send = fk_post_send;
    s->ctx.ops.post_recv = fk_post_recv;
    s->qp.context = &s->ctx;
    s->qp.qp_num = 0x100 + (uint32_t)idx;
    s->qp.state = IBV_QPS_RESET;
    s->sh = (struct bex__engine_shared){.pool = s->pool,
                                        .landing = s->landing,
                                        .recv_pool = s->recv_pool,
                                        .stats = &s->stats,
                                        .log = &s->log};
    FK_CHECK(bex__engine_create_nodev(&s->sh, &s->cfg, &fk_ops, 1 + (uint32_t)idx, s, &s->qp,
                                      &s->e) == 0);
    FK_CHECK(s->qp.state == IBV_QPS_INIT &&
             s->rq_n == cfg->rq_depth + bex__engine_rq_spare(&s->sh, cfg->rq_depth));
}

void fk_pair_connect(struct fk_pair *p, const struct bex__engine_config *c0,
                     const struct bex__engine_config *c1, uint64_t seed)
{
    memset(p, 0, sizeof(*p));
    p->rng = seed * 0x9e3779b97f4a7c15ull + 1;
    p->msgs = calloc(FK_MAX_MSGS, sizeof(*p->msgs));
    FK_CHECK(p->msgs != NULL);
    side_init(p, 0, c0);
    side_init(p, 1, c1);
    struct bex__engine_local l[2];
    for (int i = 0; i < 2; i++) {
        bex__engine_local(p->s[i].e, &l[i]);
        p->s[i].ka_addr = l[i].ka_addr;
    }
    for (int i = 0; i < 2; i++) {
        const struct bex__engine_local *o = &l[!i];
        struct bex__engine_peer peer = {
            .rdma = {.qpn = o->qpn, .psn = o->psn},
            .rq_depth = o->rq_depth,
            .max_rndv = o->max_rndv,
            .eager_max = o->eager_max,
            .max_msg = o->max_msg,
            .ka_addr = o->ka_addr,
            .ka_rkey = o->ka_rkey,
        };
        FK_CHECK(bex__engine_connect(p->s[i].e, &peer) == 0);
        FK_CHECK(p->s[i].qp.state == IBV_QPS_RTS);
        p->s[i].credits_granted = o->rq_depth;
    }
}

void fk_pair_init(struct fk_pair *p, const struct bex__engine_config *c0,
                  const struct bex__engine_config *c1, uint64_t seed)
{
    fk_pair_connect(p, c0, c1, seed);
    for (int i = 0; i < 2; i++)
        bex__engine_start(p->s[i].e);
}

struct fk_stream *fk_open(struct fk_pair *p)
{
    struct fk_side *s = &p->s[0];
    FK_CHECK(s->n_streams < FK_MAX_STREAMS);
    struct fk_stream *st = &s->streams[s->n_streams++];
    memset(st, 0, sizeof(*st));
    st->used = st->attached = true;
    st->side = 0;
    st->id = s->n_streams;
    bex__engine_attach(s->e, &st->st, st->id, true);
    return st;
}

/* A message of len bytes on st, ready to go (fk_send, fk_send_now); NULL
 * when st has no engine any more. */
static struct fk_msg *msg_new(struct fk_pair *p, struct fk_stream *st, uint32_t len, bool direct)
{
    struct fk_side *s = &p->s[st->side];
    struct fk_side *peer = peer_of(s);
    FK_CHECK(len >= 8 && p->n_msgs < FK_MAX_MSGS);
    if (!st->st.eng)
        return NULL; /* the sock layer refuses it itself */
    struct fk_msg *m = &p->msgs[p->n_msgs];
    memset(m, 0, sizeof(*m));
    m->idx = p->n_msgs++;
    m->from = s->idx;
    m->stream = st->id;
    m->seq = st->tx_seq++;
    m->exposed = -1;
    m->m.len = len;
    m->m.buf = bex_mem_alloc(s->pool, len);
    FK_CHECK(m->m.buf != NULL);
    fill(m);
    m->post_bytes_at = s->payload_posted;
    if (direct) {
        /* the peer exposes a buffer for it, as bex_sock_expose does */
        FK_CHECK(peer->n_exposed < FK_MAX_EXPOSED);
        struct fk_exposed *x = &peer->exposed[peer->n_exposed];
        void *b = bex_mem_alloc(peer->landing, len);
        FK_CHECK(b != NULL);
        *x = (struct fk_exposed){.addr = (uintptr_t)b,
                                 .len = len,
                                 .imm = BEX__IMM_DIRECT | (peer->n_exposed + 1),
                                 .msg = m,
                                 .used = true};
        m->exposed = (int)peer->n_exposed++;
        m->m.direct = true;
        m->m.raddr = x->addr;
        m->m.rkey = 0;
        m->m.imm = x->imm;
    }
    m->m.lkey = m->m.len ? bex_mem_mr(m->m.buf)->lkey : 0;
    return m;
}

struct fk_msg *fk_send(struct fk_pair *p, struct fk_stream *st, uint32_t len, bool direct)
{
    struct fk_msg *m = msg_new(p, st, len, direct);
    if (m)
        bex__engine_send(&st->st, &m->m);
    return m;
}

struct fk_msg *fk_send_now(struct fk_pair *p, struct fk_stream *st, uint32_t len)
{
    struct fk_msg *m = msg_new(p, st, len, false);
    if (!m)
        return NULL;
    struct fk_side *s = &p->s[st->side];
    s->in_send_now = true;
    struct bex__msg *back = bex__engine_send_now(&st->st, &m->m, NULL);
    s->in_send_now = false;
    if (back) {
        FK_CHECK(back == &m->m && m->done == 0);
        bex__engine_send(&st->st, back);
    }
    return m;
}

void fk_release_held(struct fk_pair *p, int side)
{
    struct fk_side *s = &p->s[side];
    for (uint32_t i = 0; i < s->n_held; i++)
        bex_mem_free(s->held[i]);
    s->n_held = 0;
}

void fk_check_final(struct fk_pair *p)
{
    for (uint32_t i = 0; i < p->n_msgs; i++) {
        struct fk_msg *m = &p->msgs[i];
        if (m->done != 1)
            fprintf(stderr, "message %u (side %d, stream %u, %zu bytes): handed back %d times\n", i,
                    m->from, m->stream, m->m.len, m->done);
        FK_CHECK(m->done == 1);
        FK_CHECK(m->delivered <= 1);
        switch (m->status) {
        case 0:
            /* the peer's engine held it (its credit came back): delivered */
            FK_CHECK(m->arrived && (m->final_acked || m->final_inline));
            FK_CHECK(m->delivered == 1);
            break;
        case -ECANCELED:
            FK_CHECK(!m->final_posted && !m->arrived && m->delivered == 0);
            break;
        case -EIO:
            FK_CHECK(m->final_posted);
            break;
        default:
            FK_CHECK(m->status < 0 && !m->final_posted && m->delivered == 0);
        }
    }
}

void fk_pair_fini(struct fk_pair *p)
{
    /* what is in flight lands (a test that failed a side has drained it) */
    for (int i = 0; i < 2; i++)
        p->s[i].hold_writes = false;
    fk_quiesce(p);
    for (int i = 0; i < 2; i++)
        if (!fk_dead(p, i))
            bex__engine_fail(p->s[i].e, -ECONNRESET);
    fk_check_final(p);
    for (int i = 0; i < 2; i++) {
        struct fk_side *s = &p->s[i];
        FK_CHECK(s->fails == 1);
        bex__engine_destroy(s->e);
        fk_release_held(p, i);
        for (uint32_t k = 0; k < s->n_exposed; k++)
            bex_mem_free((void *)(uintptr_t)s->exposed[k].addr);
    }
    for (uint32_t i = 0; i < p->n_msgs; i++)
        bex_mem_free(p->msgs[i].m.buf);
    for (int i = 0; i < 2; i++) {
        struct fk_side *s = &p->s[i];
        bex_mem_pool *pools[3] = {s->pool, s->recv_pool, s->landing};
        for (int k = 0; k < 3; k++) {
            bex_mem_stats st;
            bex_mem_pool_collect(pools[k]);
            bex_mem_pool_stats(pools[k], &st);
            FK_CHECK(st.in_use_bytes == 0); /* every buffer came back */
            FK_CHECK(bex_mem_pool_destroy(pools[k]) == 0);
        }
        bex__log_fini(&s->log);
    }
    free(p->msgs);
}
