/* SPDX-License-Identifier: Apache-2.0 */
/* Fuzz target: the engine's real receive handling (bex__engine_complete ->
 * recv_completed -> handle_ctl), fed a sequence of events per input, so that
 * state builds up: a RNDV_REQ and then the WRITE_WITH_IMM naming its slot,
 * OPEN then CLOSE, credits returned until they overflow, a completion error
 * in the middle of a rendezvous, and so on.
 *
 * The harness plays everything around one engine made by
 * bex__engine_create_nodev over a pool with the no-op registrar:
 *  - the NIC: a stand-in QP whose post_send/post_recv record the work
 *    requests; receives are consumed in posting order; a SEND is scattered
 *    into the receive's buffers as a NIC would; sends complete in order,
 *    one completion per signaled request; a QP in error flushes everything
 *    (on rxe, optionally, a receive posted after the error never completes);
 *  - the peer: sends any header (structured or raw bytes), header-free DATA
 *    (SEND_WITH_IMM, the immediate carrying stream and credits) or a
 *    SEND_WITH_IMM with any immediate at all, answers our rendezvous
 *    requests, writes with immediate into the destinations our engine
 *    granted (or with any immediate at all); stream ids start just below
 *    the immediate's limit when the mode byte says so (bit 7), so that
 *    DATA of both encodings, header-free and with a header, goes both ways;
 *  - the sock layer: opens, sends on and closes streams, accepts OPENs,
 *    fails the engine, passes time (keepalive, drain timeout).
 *
 * Invariants checked (FZ_CHECK aborts):
 *  - the QP's queues never hold more than the engine created them for; no
 *    send is posted to a QP that is not ready or has been destroyed;
 *  - what the engine posts points into live messages it owns: payload
 *    slices of queued messages, and writes go to the destination the peer
 *    gave for that message;
 *  - on_msg hands up exactly what the peer sent (the receive's buffer and
 *    bytes for DATA, payload at its start whatever the encoding; the
 *    granted buffer, length and stream for rendezvous); in window mode a
 *    rendezvous buffer goes up with no window bound over it any more;
 *  - our DATA is header-free on a stream the immediate names (one SGE, the
 *    whole message, an immediate that decodes to its stream), with a header
 *    only beyond, and then fits the peer's receive buffer;
 *  - every message is handed back exactly once; with status 0 only after
 *    its last work request completed successfully; never while a work
 *    request on a live QP still points into it;
 *  - on_fail comes exactly once, after every message has been handed back
 *    and every stream let go; nothing is called back after it; between the
 *    inputs' operations the engine is either up or failed;
 *  - after destroy, the pool has every byte back (no leak of receive or
 *    rendezvous buffers).
 * The input format is below (struct rd, run_op); the seed corpus is made by
 * tests/fuzz/make_seeds.py. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <string.h>

#include "transport/rdma/engine.h"
#include "fuzz.h"
#include "engine_test.h"
#include "wire/hello.h"

enum {
    QCAP = 128,      /* recorded work requests per queue (sq, rq <= 33) */
    MAX_MSGS = 256,  /* application messages per input */
    MAX_STR = 64,    /* streams per input */
    MAX_OPS = 1024,  /* operations per input, repeats included */
    MAX_REC = 1024,  /* rendezvous records per input */
    MAX_HELD = 2048, /* buffers the application holds until the end */
    WRITE_MAX = 4096 /* bytes the peer writes into a granted buffer */
};
#define PEER_KA_ADDR 0x5000000000ull
#define PEER_KA_RKEY 0x77u
#define PEER_DST     0x100000000000ull /* the peer's destinations, 1 TiB apart */

enum { M_FREE, M_ENGINE, M_DONE };

struct hmsg {
    struct bex__msg m;
    int state;
    bool acked; /* its last work request completed successfully */
    bool inl;   /* posted inline: its bytes copied at posting (the engine may
                   report it once the peer's credits cover it, before a
                   signaled completion retires its request) */
    uint8_t seed;
};

struct hstream {
    struct bex__stream st;
    uint32_t id;
    bool used, dead, close_asked, peer_closed, closed_cb;
};

struct swr {
    struct ibv_send_wr wr; /* copy; sg_list points to sge */
    struct ibv_sge sge[2];
};

struct rwr {
    uint64_t wr_id;
    int num_sge;
    struct ibv_sge sge[2];
    bool stuck; /* posted to a QP in error, on rxe: never completes */
};

/* a rendezvous request of the peer, and what our engine answered */
struct preq {
    uint32_t id, len, stream;
    bool answered;
};
struct grant {
    uint64_t addr;
    uint32_t len, stream, imm;
    bool used;
};
/* a rendezvous request of our engine, and what the peer answered */
struct ereq {
    uint32_t id, len, stream;
};
struct answer {
    uint64_t addr;
    uint32_t rkey, len, slot;
};

#define MAX_BINDS 512
struct fz {
    bex_mem_pool *pool;    /* general pool: messages, headers, eager receives */
    bex_mem_pool *landing; /* rendezvous destinations only */
    struct bex__log log;
    struct bex__stats stats;
    struct bex__engine_shared sh;
    struct ibv_context ctx;
    struct ibv_qp qp;
    struct ibv_pd pd; /* window mode: windows come from the stand-in's ops */
    int live_mw;      /* windows allocated and not deallocated */
    uint32_t next_mw_key;
    struct bind {
        uint64_t addr, len;
        uint32_t key;
    } binds[MAX_BINDS]; /* window mode: bindings posted and not invalidated */
    uint32_t n_binds;
    struct bex__engine *e;
    struct bex__engine_config cfg;
    bool client, rxe, started, repeating;
    uint32_t peer_eager;
    volatile uint64_t *ka_local; /* where the peer's keepalive WRITE lands */
    int fails;                   /* on_fail calls */
    int inject;                  /* 1: the next post_send fails, 2: the next post_recv */
    uint64_t clock;              /* virtual ms added to the real clock */
    uint32_t next_stream;
    uint32_t sid_base; /* stream ids: sid_base + a byte of the input */
    uint32_t ops;

    uint32_t sq_head, sq_n, rq_head, rq_n;
    uint32_t n_msgs, n_str, n_preq, n_grant, n_ereq, n_ans, n_exposed, n_held;

    /* what the completion being delivered may hand up */
    enum { X_NONE, X_DATA, X_RNDV } x_kind;
    void *x_buf;
    uint32_t x_len, x_stream;
    const uint8_t *x_bytes;
    struct grant *x_grant;
    int x_msgs; /* on_msg calls during this completion */
};

static struct fz F;

/* The tables: not cleared between inputs (entries are written when added);
 * the counts in F say how many are valid. */
static struct {
    struct swr sq[QCAP]; /* posted sends the NIC has not completed */
    struct rwr rq[QCAP]; /* posted receives */
    struct hmsg msgs[MAX_MSGS];
    struct hstream str[MAX_STR];
    struct preq preq[MAX_REC];
    struct grant grant[MAX_REC];
    struct ereq ereq[MAX_REC];
    struct answer ans[MAX_REC];
    uint32_t exposed[64];
    void *held[MAX_HELD]; /* buffers handed up: freed at the end */
} B;

/* BEX_FUZZ_TRACE=1 (replay runner): print each operation and upcall. */
static void trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void trace(const char *fmt, ...)
{
    static int on = -1;
    if (on < 0)
        on = getenv("BEX_FUZZ_TRACE") != NULL;
    if (!on)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* ---------------- input ---------------- */

struct rd {
    const uint8_t *p;
    size_t n;
};

static uint8_t u8(struct rd *r)
{
    if (!r->n)
        return 0;
    r->n--;
    return *r->p++;
}
static uint16_t u16(struct rd *r)
{
    uint16_t lo = u8(r);
    return (uint16_t)(lo | (uint16_t)u8(r) << 8);
}
static uint32_t u32(struct rd *r)
{
    uint32_t lo = u16(r);
    return lo | (uint32_t)u16(r) << 16;
}

/* ---------------- helpers ---------------- */

/* Payload bytes: pattern(seed)[i] = PAT[seed + i], so that filling and
 * checking are a memcpy and a memcmp (the fuzzer's coverage hooks make a
 * byte loop slow). */
enum { PAT_LEN = 65536 + 512 };
static uint8_t PAT[PAT_LEN];

static const uint8_t *pattern(uint8_t seed)
{
    if (!PAT[1])
        for (uint32_t i = 0, x = 0x9e3779b9u; i < PAT_LEN; i++) {
            x = x * 1103515245u + 12345u;
            PAT[i] = (uint8_t)(x >> 24) | 1; /* never 0: PAT[1] says filled */
        }
    return PAT + seed;
}

static void hold(void *buf)
{
    if (F.n_held < MAX_HELD)
        B.held[F.n_held++] = buf;
    else
        bex_mem_free(buf);
}

static bool qp_dead(void)
{
    return F.qp.state == IBV_QPS_RESET;
}

static uint64_t now_ms(void)
{
    return bex__now_ms() + F.clock;
}

/* The live message whose buffer holds [addr, addr + len), or NULL. A
 * zero-length slice matches the message it starts in. */
static struct hmsg *msg_at(uint64_t addr, uint32_t len)
{
    for (uint32_t i = 0; i < F.n_msgs; i++) {
        struct hmsg *h = &B.msgs[i];
        uint64_t b = (uintptr_t)h->m.buf, end = b + (h->m.len ? h->m.len : 1);
        if (addr >= b && addr < end)
            return addr + len <= b + h->m.len || len == 0 ? h : NULL;
    }
    return NULL;
}

static bool refers_to(const struct swr *w, const struct hmsg *h)
{
    uint64_t b = (uintptr_t)h->m.buf, end = b + (h->m.len ? h->m.len : 1);
    /* a SEND's first entry is its header, in the engine's own area */
    /* an inline request's bytes were copied at posting: it reads none */
    if (w->wr.send_flags & IBV_SEND_INLINE)
        return false;
    for (int i = w->wr.opcode == IBV_WR_SEND ? 1 : 0; i < w->wr.num_sge; i++) {
        uint64_t a = w->sge[i].addr, l = w->sge[i].length;
        if (a < end && (l ? a + l > b : a >= b))
            return true;
    }
    return false;
}

static struct hstream *stream_by_id(uint32_t id)
{
    for (uint32_t i = 0; i < F.n_str; i++)
        if (B.str[i].used && B.str[i].id == id && !B.str[i].dead)
            return &B.str[i];
    return NULL;
}

/* ---------------- the peer reads what we post ---------------- */

/* A SEND of ours: the peer learns our rendezvous answers and requests. */
static void peer_sees_send(const struct swr *w)
{
    if (w->wr.num_sge < 1 || w->sge[0].length != BEX__HDR_LEN)
        return;
    uint32_t total = 0;
    for (int i = 0; i < w->wr.num_sge; i++)
        total += w->sge[i].length;
    struct bex__hdr h;
    FZ_CHECK(bex__hdr_decode((const uint8_t *)(uintptr_t)w->sge[0].addr, total, &h) == 0);
    trace("  posted SEND type %u stream 0x%x len %u id 0x%x status %d credits %u", h.type, h.stream,
          h.len, h.id, h.status, h.credits);
    if (h.type == BEX__MSG_DATA) {
        /* payload: a live, small message of ours, whole; with a header only
         * where the immediate cannot name the stream, and then header and
         * payload fit the peer's buffer (eager_max, at least a header) */
        FZ_CHECK(h.len <= F.peer_eager && h.stream > BEX__IMM_STREAM_MAX);
        FZ_CHECK(h.len == 0 || h.len + BEX__HDR_LEN <= F.peer_eager);
        if (h.len) {
            FZ_CHECK(w->wr.num_sge == 2);
            struct hmsg *m = msg_at(w->sge[1].addr, w->sge[1].length);
            FZ_CHECK(m && m->state == M_ENGINE);
            FZ_CHECK((uintptr_t)m->m.buf == w->sge[1].addr && m->m.len == h.len);
        }
    } else if (h.type == BEX__MSG_RNDV_RESP) {
        /* our engine answers one of the peer's requests */
        uint32_t i = 0;
        while (i < F.n_preq && (B.preq[i].answered || B.preq[i].id != h.id))
            i++;
        FZ_CHECK(i < F.n_preq); /* an answer to a request never made */
        B.preq[i].answered = true;
        if (h.status == 0 && F.n_grant < MAX_REC) {
            FZ_CHECK(h.addr != 0);
            /* a destination is landing memory, never the general pool's */
            void *d = (void *)(uintptr_t)h.addr;
            FZ_CHECK(bex_mem_pool_of(d) == F.landing && bex_mem_usable_size(d) >= B.preq[i].len);
            if (F.sh.windows) {
                /* the key is a window's, bound over exactly this buffer
                 * by a request posted before the answer */
                uint32_t k = 0;
                while (k < F.n_binds && F.binds[k].key != h.rkey)
                    k++;
                FZ_CHECK(k < F.n_binds && F.binds[k].addr == h.addr &&
                         F.binds[k].len == B.preq[i].len);
            }
            B.grant[F.n_grant++] = (struct grant){
                .addr = h.addr, .len = B.preq[i].len, .stream = B.preq[i].stream, .imm = h.stream};
        }
    } else if (h.type == BEX__MSG_RNDV_REQ) {
        FZ_CHECK(h.len > 0);
        if (F.n_ereq < MAX_REC)
            B.ereq[F.n_ereq++] = (struct ereq){.id = h.id, .len = h.len, .stream = h.stream};
    }
}

/* A header-free DATA of ours: the immediate names a stream of ours, the one
 * entry is a live, small message, whole. */
static void peer_sees_data(const struct swr *w)
{
    struct bex__hdr h;
    uint32_t len = w->wr.num_sge ? w->sge[0].length : 0;
    FZ_CHECK(bex__imm_decode(ntohl(w->wr.imm_data), len, &h) == 0);
    trace("  posted DATA stream 0x%x len %u credits %u%s", h.stream, len, h.credits,
          w->wr.send_flags & IBV_SEND_INLINE ? " inline" : "");
    FZ_CHECK(w->wr.num_sge <= 1 && len <= F.peer_eager);
    FZ_CHECK(w->wr.num_sge == 0 || len > 0);
    FZ_CHECK(!(w->wr.send_flags & IBV_SEND_INLINE) || len <= BEX__ENGINE_INLINE);
    FZ_CHECK(h.stream <= BEX__IMM_STREAM_MAX);
    bool known = false;
    for (uint32_t i = 0; i < F.n_str && !known; i++)
        known = B.str[i].used && B.str[i].id == h.stream;
    FZ_CHECK(known);
    if (len) {
        struct hmsg *m = msg_at(w->sge[0].addr, len);
        FZ_CHECK(m && m->state == M_ENGINE && m->m.st);
        FZ_CHECK(((struct hstream *)m->m.st)->id == h.stream); /* st is its first member */
        FZ_CHECK((uintptr_t)m->m.buf == w->sge[0].addr && m->m.len == len);
        m->inl = (w->wr.send_flags & IBV_SEND_INLINE) != 0;
    }
}

/* A WRITE of ours: a slice of a live message, to where the peer said. */
static void peer_sees_write(const struct swr *w)
{
    if (w->wr.num_sge == 0) {
        /* a destination given back unwritten: one the peer granted */
        FZ_CHECK(w->wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM);
        uint32_t i = 0;
        while (i < F.n_ans && B.ans[i].addr != w->wr.wr.rdma.remote_addr)
            i++;
        FZ_CHECK(i < F.n_ans && B.ans[i].rkey == w->wr.wr.rdma.rkey &&
                 B.ans[i].slot == ntohl(w->wr.imm_data));
        trace("  posted release");
        return;
    }
    trace("  posted WRITE%s len %u", w->wr.opcode == IBV_WR_RDMA_WRITE ? "" : "_WITH_IMM",
          w->sge[0].length);
    FZ_CHECK(w->wr.num_sge == 1);
    if (w->wr.wr.rdma.remote_addr == PEER_KA_ADDR) {
        FZ_CHECK(w->wr.opcode == IBV_WR_RDMA_WRITE && w->wr.wr.rdma.rkey == PEER_KA_RKEY);
        FZ_CHECK(w->sge[0].length == 8);
        return;
    }
    struct hmsg *m = msg_at(w->sge[0].addr, w->sge[0].length);
    FZ_CHECK(m && m->state == M_ENGINE);
    uint64_t off = w->sge[0].addr - (uintptr_t)m->m.buf;
    FZ_CHECK(w->wr.wr.rdma.remote_addr == m->m.raddr + off && w->wr.wr.rdma.rkey == m->m.rkey);
    if (!m->m.direct) {
        /* the destination is one the peer gave for a message this long */
        uint32_t i = 0;
        while (i < F.n_ans && B.ans[i].addr != m->m.raddr)
            i++;
        FZ_CHECK(i < F.n_ans && B.ans[i].rkey == m->m.rkey && B.ans[i].len == m->m.len);
    }
    if (w->wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
        FZ_CHECK(off + w->sge[0].length == m->m.len); /* the last fragment */
        FZ_CHECK(ntohl(w->wr.imm_data) == m->m.imm);
    }
}

/* ---------------- the stand-in QP ---------------- */

static int fk_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    (void)qp;
    FZ_CHECK(F.qp.state == IBV_QPS_RTS || F.qp.state == IBV_QPS_ERR);
    if (F.inject == 1) {
        F.inject = 0;
        *bad = wr;
        return ENOMEM;
    }
    /* Window operations go out alone: posted on an empty send queue, in a
     * chain of window operations only, and nothing is posted while one is
     * outstanding. rxe executes a bind or an invalidation a second time
     * when a retransmission covers it (engine.c, wops_hold); with nothing
     * unacknowledged around it, none can. (A QP in error sends nothing.) */
    if (F.qp.state == IBV_QPS_RTS) {
        bool wop_chain = false, other = false;
        for (const struct ibv_send_wr *x = wr; x; x = x->next) {
            if (x->opcode == IBV_WR_BIND_MW || x->opcode == IBV_WR_LOCAL_INV)
                wop_chain = true;
            else
                other = true;
        }
        for (uint32_t k = 0; k < F.sq_n; k++) {
            enum ibv_wr_opcode op = B.sq[(F.sq_head + k) % QCAP].wr.opcode;
            FZ_CHECK(op != IBV_WR_BIND_MW && op != IBV_WR_LOCAL_INV);
        }
        FZ_CHECK(!wop_chain || (!other && F.sq_n == 0));
    }
    for (; wr; wr = wr->next) {
        FZ_CHECK(F.sq_n < F.cfg.sq_depth); /* the QP's send queue */
        FZ_CHECK(wr->num_sge >= 0 && wr->num_sge <= 2);
        struct swr *w = &B.sq[(F.sq_head + F.sq_n++) % QCAP];
        w->wr = *wr;
        w->wr.next = NULL;
        if (wr->num_sge)
            memcpy(w->sge, wr->sg_list, sizeof(struct ibv_sge) * (size_t)wr->num_sge);
        w->wr.sg_list = w->sge;
        if (F.qp.state == IBV_QPS_ERR)
            continue; /* flushed unsent */
        switch (wr->opcode) {
        case IBV_WR_SEND:
            peer_sees_send(w);
            break;
        case IBV_WR_SEND_WITH_IMM:
            peer_sees_data(w);
            break;
        case IBV_WR_RDMA_WRITE:
        case IBV_WR_RDMA_WRITE_WITH_IMM:
            peer_sees_write(w);
            break;
        case IBV_WR_BIND_MW: {
            /* window mode only: a window of ours over landing memory, remote
             * write only, with a key whose index is the window's */
            FZ_CHECK(F.sh.windows && wr->num_sge == 0);
            const struct ibv_mw_bind_info *bi = &wr->bind_mw.bind_info;
            void *d = (void *)(uintptr_t)bi->addr;
            FZ_CHECK(wr->bind_mw.mw && wr->bind_mw.mw->pd == &F.pd);
            FZ_CHECK(bex_mem_pool_of(d) == F.landing && bex_mem_usable_size(d) >= bi->length);
            FZ_CHECK(bi->mw_access_flags == IBV_ACCESS_REMOTE_WRITE);
            FZ_CHECK((wr->bind_mw.rkey & ~0xffu) == (wr->bind_mw.mw->rkey & ~0xffu));
            trace("  posted BIND_MW len %zu key 0x%x", (size_t)bi->length, wr->bind_mw.rkey);
            /* a window has one binding at a time: a new one replaces it */
            for (uint32_t k = 0; k < F.n_binds; k++)
                if (F.binds[k].key >> 8 == wr->bind_mw.rkey >> 8)
                    F.binds[k--] = F.binds[--F.n_binds];
            FZ_CHECK(F.n_binds < MAX_BINDS);
            F.binds[F.n_binds++] =
                (struct bind){.addr = bi->addr, .len = bi->length, .key = wr->bind_mw.rkey};
            break;
        }
        case IBV_WR_LOCAL_INV:
            FZ_CHECK(F.sh.windows && wr->num_sge == 0);
            trace("  posted LOCAL_INV key 0x%x", wr->invalidate_rkey);
            for (uint32_t k = 0; k < F.n_binds; k++)
                if (F.binds[k].key == wr->invalidate_rkey)
                    F.binds[k--] = F.binds[--F.n_binds];
            break;
        default:
            FZ_CHECK(!"an opcode the engine never uses");
        }
    }
    return 0;
}

static int fk_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    (void)qp;
    FZ_CHECK(F.qp.state != IBV_QPS_RESET);
    if (F.inject == 2) {
        F.inject = 0;
        *bad = wr;
        return ENOMEM;
    }
    for (; wr; wr = wr->next) {
        /* the QP's receive queue: the credits granted and the spare receives */
        FZ_CHECK(F.rq_n < F.cfg.rq_depth + bex__engine_rq_spare(&F.sh, F.cfg.rq_depth));
        FZ_CHECK(wr->num_sge >= 0 && wr->num_sge <= 2);
        struct rwr *w = &B.rq[(F.rq_head + F.rq_n++) % QCAP];
        w->wr_id = wr->wr_id;
        w->num_sge = wr->num_sge;
        if (wr->num_sge)
            memcpy(w->sge, wr->sg_list, sizeof(struct ibv_sge) * (size_t)wr->num_sge);
        w->stuck = F.rxe && F.qp.state == IBV_QPS_ERR;
        /* the buffers are the pool's and as long as they say */
        for (int i = 0; i < w->num_sge; i++)
            FZ_CHECK(bex_mem_usable_size((void *)(uintptr_t)w->sge[i].addr) >= w->sge[i].length);
    }
    return 0;
}

/* ---------------- the NIC completes ---------------- */

static void complete(const struct ibv_wc *wc)
{
    trace("  completion wr 0x%llx status %d", (unsigned long long)wc->wr_id, wc->status);
    F.x_msgs = 0;
    bex__engine_complete(F.e, wc);
    F.x_kind = X_NONE;
}

/* Success completion of the sends up to the next signaled one. */
static void nic_send_ok(void)
{
    if (F.qp.state != IBV_QPS_RTS)
        return;
    uint32_t k = 0;
    while (k < F.sq_n && !(B.sq[(F.sq_head + k) % QCAP].wr.send_flags & IBV_SEND_SIGNALED))
        k++;
    if (k == F.sq_n)
        return;
    struct ibv_wc wc = {0};
    for (uint32_t i = 0; i <= k; i++) {
        struct swr *w = &B.sq[F.sq_head];
        F.sq_head = (F.sq_head + 1) % QCAP;
        F.sq_n--;
        if ((w->wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM && w->wr.num_sge == 1) ||
            (w->wr.opcode == IBV_WR_SEND_WITH_IMM && w->wr.num_sge == 1) ||
            (w->wr.opcode == IBV_WR_SEND && w->wr.num_sge == 2)) {
            uint64_t a = w->sge[w->wr.num_sge - 1].addr;
            struct hmsg *m = msg_at(a, 0);
            /* the message of a request that reads nothing of it (inline:
             * its bytes copied at posting; or empty) may have been reported
             * already (the peer's credits covered it) */
            bool reported = m && m->state != M_ENGINE &&
                            ((w->wr.send_flags & IBV_SEND_INLINE) || m->m.len == 0);
            if (!reported) {
                FZ_CHECK(m && m->state == M_ENGINE);
                m->acked = true;
            }
        }
        wc.wr_id = w->wr.wr_id;
        wc.opcode = w->wr.opcode == IBV_WR_SEND || w->wr.opcode == IBV_WR_SEND_WITH_IMM
                        ? IBV_WC_SEND
                    : w->wr.opcode == IBV_WR_BIND_MW   ? IBV_WC_BIND_MW
                    : w->wr.opcode == IBV_WR_LOCAL_INV ? IBV_WC_LOCAL_INV
                                                       : IBV_WC_RDMA_WRITE;
    }
    wc.status = IBV_WC_SUCCESS;
    complete(&wc);
}

/* A QP in error: every request still queued completes flushed, sends first
 * (an error marks the QP for the whole of both queues). */
static void nic_flush(void)
{
    for (int rounds = 0; F.qp.state == IBV_QPS_ERR && rounds < 8; rounds++) {
        bool any = false;
        while (F.sq_n && F.qp.state == IBV_QPS_ERR) {
            struct swr w = B.sq[F.sq_head];
            F.sq_head = (F.sq_head + 1) % QCAP;
            F.sq_n--;
            struct ibv_wc wc = {.wr_id = w.wr.wr_id, .status = IBV_WC_WR_FLUSH_ERR};
            complete(&wc);
            any = true;
        }
        while (F.rq_n && F.qp.state == IBV_QPS_ERR && !B.rq[F.rq_head].stuck) {
            struct rwr w = B.rq[F.rq_head];
            F.rq_head = (F.rq_head + 1) % QCAP;
            F.rq_n--;
            struct ibv_wc wc = {
                .wr_id = w.wr_id, .status = IBV_WC_WR_FLUSH_ERR, .opcode = IBV_WC_RECV};
            complete(&wc);
            any = true;
        }
        if (!any)
            break;
    }
    if (qp_dead())
        F.sq_n = F.rq_n = 0; /* destroyed: the NIC let go of everything */
}

/* An error completion on one queue; the QP goes to error. */
static void nic_error(uint8_t how)
{
    static const enum ibv_wc_status st[] = {IBV_WC_RETRY_EXC_ERR,     IBV_WC_REM_ACCESS_ERR,
                                            IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_LOC_PROT_ERR,
                                            IBV_WC_REM_OP_ERR,        IBV_WC_LOC_LEN_ERR};
    if (F.qp.state != IBV_QPS_RTS && F.qp.state != IBV_QPS_RTR)
        return;
    struct ibv_wc wc = {.status = st[(how >> 1) % 6]};
    if (how & 1) {
        if (!F.rq_n)
            return;
        wc.wr_id = B.rq[F.rq_head].wr_id;
        wc.opcode = IBV_WC_RECV;
        F.rq_head = (F.rq_head + 1) % QCAP;
        F.rq_n--;
    } else {
        if (!F.sq_n)
            return;
        wc.wr_id = B.sq[F.sq_head].wr.wr_id;
        F.sq_head = (F.sq_head + 1) % QCAP;
        F.sq_n--;
    }
    F.qp.state = IBV_QPS_ERR;
    complete(&wc);
}

/* The next posted receive, or NULL (the peer's message would meet RNR). */
static struct rwr *next_recv(void)
{
    if ((F.qp.state != IBV_QPS_RTS && F.qp.state != IBV_QPS_RTR) || !F.rq_n)
        return NULL;
    struct rwr *w = &B.rq[F.rq_head];
    F.rq_head = (F.rq_head + 1) % QCAP;
    F.rq_n--;
    return w;
}

/* The peer's SEND of bytes[0..n), with immediate imm if imm >= 0:
 * scattered into the next receive. Returns whether it arrived (a receive
 * was posted, the bytes fit). */
static bool peer_send_imm(const uint8_t *bytes, uint32_t n, int64_t imm)
{
    struct rwr *w = next_recv();
    if (!w)
        return false;
    uint64_t cap = 0;
    for (int i = 0; i < w->num_sge; i++)
        cap += w->sge[i].length;
    struct ibv_wc wc = {.wr_id = w->wr_id, .opcode = IBV_WC_RECV, .byte_len = n};
    if (imm >= 0) {
        wc.wc_flags = IBV_WC_WITH_IMM;
        wc.imm_data = htonl((uint32_t)imm);
    }
    if (n > cap) {
        wc.status = IBV_WC_LOC_LEN_ERR;
        F.qp.state = IBV_QPS_ERR;
        complete(&wc);
        return false;
    }
    uint32_t off = 0;
    for (int i = 0; i < w->num_sge && off < n; i++) {
        uint32_t k = n - off < w->sge[i].length ? n - off : w->sge[i].length;
        memcpy((void *)(uintptr_t)w->sge[i].addr, bytes + off, k);
        off += k;
    }
    /* what on_msg may hand up: the payload, at the start of the buffer
     * (after a header, the engine moves it there) */
    struct bex__hdr h;
    bool valid =
        imm >= 0 ? bex__imm_decode((uint32_t)imm, n, &h) == 0 : bex__hdr_decode(bytes, n, &h) == 0;
    if (valid && h.type == BEX__MSG_RNDV_REQ && F.n_preq < MAX_REC) {
        /* a request of the peer (structured or raw bytes alike): the
         * engine's answer, posted later, is matched against it */
        B.preq[F.n_preq++] = (struct preq){.id = h.id, .len = h.len, .stream = h.stream};
    }
    if (valid && h.type == BEX__MSG_DATA && w->num_sge == 1) {
        F.x_kind = X_DATA;
        F.x_buf = (void *)(uintptr_t)w->sge[0].addr;
        F.x_len = h.len;
        F.x_stream = h.stream;
        F.x_bytes = imm >= 0 ? bytes : bytes + BEX__HDR_LEN;
    }
    complete(&wc);
    return true;
}

static bool peer_send(const uint8_t *bytes, uint32_t n)
{
    return peer_send_imm(bytes, n, -1);
}

/* The peer's WRITE_WITH_IMM: into the granted buffer imm names, if any. */
static void peer_write_imm(uint32_t imm)
{
    struct grant *g = NULL;
    if (!(imm & BEX__IMM_DIRECT))
        for (uint32_t i = 0; i < F.n_grant && !g; i++)
            if (!B.grant[i].used && B.grant[i].imm == imm)
                g = &B.grant[i];
    struct rwr *w = next_recv();
    if (!w)
        return;
    if (g) {
        /* the RDMA WRITE before the immediate lands */
        uint8_t *dst = (uint8_t *)(uintptr_t)g->addr;
        FZ_CHECK(bex_mem_usable_size(dst) >= g->len);
        memcpy(dst, pattern((uint8_t)imm), g->len < WRITE_MAX ? g->len : WRITE_MAX);
        F.x_kind = X_RNDV;
        F.x_grant = g;
    }
    struct ibv_wc wc = {.wr_id = w->wr_id,
                        .opcode = IBV_WC_RECV_RDMA_WITH_IMM,
                        .byte_len = g ? g->len : 0,
                        .imm_data = htonl(imm),
                        .wc_flags = IBV_WC_WITH_IMM};
    complete(&wc);
}

/* ---------------- the engine calls up (the sock layer's part) ---------------- */

static void check_failed_clean(void)
{
    for (uint32_t i = 0; i < F.n_msgs; i++)
        FZ_CHECK(B.msgs[i].state != M_ENGINE);
    for (uint32_t i = 0; i < F.n_str; i++)
        FZ_CHECK(!B.str[i].used || B.str[i].st.eng == NULL);
}

static void up_on_up(struct bex__xport *x)
{
    struct bex__engine *e = bex__engine_of(x);
    FZ_CHECK(e == F.e && F.fails == 0);
}

static void up_on_msg(struct bex__xport *x, uint32_t stream, void *buf, size_t len)
{
    struct bex__engine *e = bex__engine_of(x);
    trace("  on_msg stream %u len %zu", stream, len);
    FZ_CHECK(e == F.e && F.fails == 0);
    FZ_CHECK(++F.x_msgs == 1); /* one message per completion */
    if (F.x_kind == X_DATA) {
        FZ_CHECK(buf == F.x_buf && len == F.x_len && stream == F.x_stream);
        FZ_CHECK(len == 0 || memcmp(buf, F.x_bytes, len) == 0);
    } else {
        FZ_CHECK(F.x_kind == X_RNDV);
        struct grant *g = F.x_grant;
        FZ_CHECK(!g->used && (uintptr_t)buf == g->addr && len == g->len && stream == g->stream);
        g->used = true;
        FZ_CHECK(memcmp(buf, pattern((uint8_t)g->imm), len < WRITE_MAX ? len : WRITE_MAX) == 0);
        /* window mode: the key the peer wrote through is dead before the
         * buffer goes up (no binding over it is left) */
        for (uint32_t k = 0; F.sh.windows && k < F.n_binds; k++)
            FZ_CHECK(F.binds[k].addr >= g->addr + g->len ||
                     F.binds[k].addr + F.binds[k].len <= g->addr);
    }
    FZ_CHECK(bex_mem_pool_of(buf) == (F.x_kind == X_RNDV ? F.landing : F.pool) &&
             bex_mem_usable_size(buf) >= len);
    hold(buf);
}

static void sock_fail_conn(int err)
{
    if (!bex__engine_is_dead(F.e))
        bex__engine_fail(F.e, err);
}

static void up_on_open(struct bex__xport *x, uint32_t stream)
{
    struct bex__engine *e = bex__engine_of(x);
    trace("  on_open %u", stream);
    FZ_CHECK(e == F.e && F.fails == 0);
    if (F.client || stream_by_id(stream)) {
        sock_fail_conn(-EPROTO);
        return;
    }
    if (F.n_str == MAX_STR) {
        /* as the sock layer at its stream limit: refuse with a CLOSE */
        if (bex__engine_refuse_stream(e, stream))
            sock_fail_conn(-EPROTO);
        return;
    }
    struct hstream *s = &B.str[F.n_str++];
    memset(s, 0, sizeof(*s));
    s->used = true;
    s->id = stream;
    bex__engine_attach(e, &s->st, stream, false);
}

static void up_on_peer_close(struct bex__xport *x, uint32_t stream)
{
    struct bex__engine *e = bex__engine_of(x);
    trace("  on_peer_close %u", stream);
    FZ_CHECK(e == F.e && F.fails == 0);
    struct hstream *s = stream_by_id(stream);
    if (!s)
        return;
    /* as the sock layer: the engine answers with our CLOSE */
    s->dead = true;
    s->peer_closed = true;
    bex__engine_peer_closed(&s->st);
}

static void up_on_send_done(struct bex__xport *x, struct bex__msg *bm, int status)
{
    struct bex__engine *e = bex__engine_of(x);
    FZ_CHECK(e == F.e && F.fails == 0);
    struct hmsg *m = (struct hmsg *)bm;
    trace("  on_send_done msg %d status %d", (int)(m - B.msgs), status);
    FZ_CHECK(m >= B.msgs && m < B.msgs + F.n_msgs && m->state == M_ENGINE);
    FZ_CHECK(status <= 0);
    if (status == 0)
        FZ_CHECK(m->acked || m->m.len == 0 || m->inl);
    if (status == -ECANCELED)
        FZ_CHECK(!m->acked); /* "never delivered", yet its last request went through */
    /* the NIC must be done with it: no queued request of a live QP points
     * in (one that reads nothing of it may: an inline request's bytes were
     * copied at posting, an empty message has none, and the engine reports
     * either once the peer's credits cover it, before its retirement) */
    if (!qp_dead() && m->m.len)
        for (uint32_t i = 0; i < F.sq_n; i++)
            FZ_CHECK(!refers_to(&B.sq[(F.sq_head + i) % QCAP], m));
    m->state = M_DONE;
}

static void up_on_stream_closed(struct bex__xport *x, struct bex__stream *st)
{
    struct bex__engine *e = bex__engine_of(x);
    FZ_CHECK(e == F.e && F.fails == 0);
    struct hstream *s = (struct hstream *)st;
    trace("  on_stream_closed %u", s->id);
    FZ_CHECK(s >= B.str && s < B.str + F.n_str && !s->closed_cb);
    FZ_CHECK(s->peer_closed); /* both CLOSEs are through */
    FZ_CHECK(st->eng == NULL);
    s->closed_cb = true;
    s->dead = true;
}

static int up_on_direct(struct bex__xport *x, uint32_t imm)
{
    struct bex__engine *e = bex__engine_of(x);
    trace("  on_direct 0x%x", imm);
    FZ_CHECK(e == F.e && F.fails == 0);
    FZ_CHECK(imm & BEX__IMM_DIRECT);
    FZ_CHECK(++F.x_msgs == 1);
    for (uint32_t i = 0; i < F.n_exposed; i++) {
        if (B.exposed[i] == imm) {
            B.exposed[i] = B.exposed[--F.n_exposed];
            return 0;
        }
    }
    return -EPROTO;
}

static void up_on_fail(struct bex__xport *x, int err)
{
    struct bex__engine *e = bex__engine_of(x);
    trace("  on_fail %d", err);
    FZ_CHECK(e == F.e && ++F.fails == 1);
    FZ_CHECK(err < 0 && bex__engine_is_dead(e) && !bex__engine_is_up(e));
    FZ_CHECK(qp_dead()); /* the QP went first */
    check_failed_clean();
    for (uint32_t i = 0; i < F.n_str; i++)
        B.str[i].dead = true;
}

static const struct bex__transport_upcalls up_ops = {BEX_TEST_UP_ON};

static void log_sink(int level, const char *msg, void *arg)
{
    (void)level;
    (void)msg;
    (void)arg;
}

/* ---------------- operations ---------------- */

enum {
    OP_RECV_RAW,    /* n:u8, n bytes: a SEND of exactly these bytes */
    OP_RECV_DATA,   /* stream:u8 credits:u8 len:u16: DATA with a payload */
    OP_RECV_REQ,    /* stream:u8 credits:u8 len:u32 id:u32: RNDV_REQ */
    OP_RECV_RESP,   /* k:u8 status:u8 credits:u8 rkey:u32 slot:u32: RNDV_RESP */
    OP_RECV_CREDIT, /* credits:u16 */
    OP_RECV_OPEN,   /* stream:u8 credits:u8 */
    OP_RECV_CLOSE,  /* stream:u8 credits:u8 */
    OP_WRITE_GRANT, /* k:u8: WRITE_WITH_IMM naming the k-th granted slot */
    OP_WRITE_IMM,   /* imm:u32: WRITE_WITH_IMM with any immediate */
    OP_SEND_OK,     /* the sends up to the next signaled one complete */
    OP_NIC_ERROR,   /* how:u8: an error completion, the QP goes to error */
    OP_APP_OPEN,    /* the application opens a stream (client) */
    OP_APP_SEND,    /* k:u8 len:u16 flags:u8 raddr:u8 */
    OP_APP_CLOSE,   /* k:u8 */
    OP_TICK,        /* ms:u16: time passes (x16 with the top bit) */
    OP_KEEPALIVE,   /* the peer's keepalive WRITE lands */
    OP_FAIL,        /* the sock layer fails the connection */
    OP_INJECT,      /* which:u8: the next post_send (even) or post_recv fails */
    OP_EXPOSE,      /* tok:u16: the application exposes a buffer */
    OP_START,       /* the peer is ready: bex__engine_start */
    OP_REPEAT,      /* n:u8: run the next operation n times */
    OP_RECV_IMM,    /* imm:u32 len:u16: a SEND_WITH_IMM with any immediate */
    OP_COUNT
};

static uint16_t credits_of(uint8_t c)
{
    /* mostly a few credits back; with the top bit any 7-bit count */
    return c & 0x80 ? (uint16_t)(c & 0x7f) : (uint16_t)(c & 3);
}

static bool send_hdr(const struct bex__hdr *h, const uint8_t *payload, uint32_t plen)
{
    static uint8_t buf[BEX__HDR_LEN + 65536 + 64];
    bex__hdr_encode(h, buf);
    if (plen)
        memcpy(buf + BEX__HDR_LEN, payload, plen);
    return peer_send(buf, BEX__HDR_LEN + plen);
}

static void app_send(struct rd *r)
{
    uint8_t k = u8(r);
    uint16_t len = u16(r);
    uint8_t flags = u8(r);
    uint8_t dst = u8(r);
    if (!F.started || F.n_msgs == MAX_MSGS || !F.n_str)
        return;
    struct hstream *s = &B.str[k % F.n_str];
    /* the sock layer hands a dead socket's sends back itself */
    if (s->dead || !s->st.eng)
        return;
    struct hmsg *m = &B.msgs[F.n_msgs];
    memset(m, 0, sizeof(*m));
    m->m.len = len % 12000u; /* a few fragments at most */
    m->m.buf = bex_mem_alloc(F.pool, m->m.len);
    if (!m->m.buf)
        return;
    F.n_msgs++;
    m->seed = flags;
    memcpy(m->m.buf, pattern(m->seed), m->m.len);
    if (flags & 1) {
        /* a send into the peer's exposed buffer (bex_send_to) */
        m->m.direct = true;
        m->m.raddr = PEER_DST / 2 + (uint64_t)dst * 0x100000;
        m->m.rkey = dst;
        m->m.imm = BEX__IMM_DIRECT | (uint32_t)dst << 8 | flags;
    }
    m->m.lkey = m->m.len ? bex_mem_mr(m->m.buf)->lkey : 0;
    m->state = M_ENGINE;
    bex__engine_send(&s->st, &m->m);
}

static void run_op(struct rd *r);

static void run_op_once(uint8_t op, struct rd *r)
{
    struct bex__hdr h = {0};
    switch (op) {
    case OP_RECV_RAW: {
        uint8_t n = u8(r);
        uint8_t buf[256];
        uint32_t k = 0;
        while (k < n && r->n)
            buf[k++] = u8(r);
        peer_send(buf, k);
        break;
    }
    case OP_RECV_DATA: {
        /* as a peer sends it: header-free where the immediate names the
         * stream, else with the header */
        h.type = BEX__MSG_DATA;
        uint8_t sb = u8(r);
        h.stream = F.sid_base + sb;
        h.credits = credits_of(u8(r));
        h.len = u16(r) % (F.cfg.eager_max + 64);
        if (h.stream <= BEX__IMM_STREAM_MAX)
            peer_send_imm(pattern(sb), h.len, bex__imm_encode(h.stream, h.credits));
        else
            send_hdr(&h, pattern(sb), h.len);
        break;
    }
    case OP_RECV_IMM: {
        uint32_t imm = u32(r);
        uint16_t len = u16(r);
        peer_send_imm(pattern((uint8_t)imm), len % (F.cfg.eager_max + 64), imm);
        break;
    }
    case OP_RECV_REQ: {
        h.type = BEX__MSG_RNDV_REQ;
        h.stream = F.sid_base + u8(r);
        h.credits = credits_of(u8(r));
        h.len = u32(r);
        if (!(h.len & 0x80000000u))
            h.len %= 65536; /* mostly sizes a test can write */
        h.id = u32(r);
        send_hdr(&h, NULL, 0);
        break;
    }
    case OP_RECV_RESP: {
        uint8_t k = u8(r), status = u8(r);
        h.type = BEX__MSG_RNDV_RESP;
        h.credits = credits_of(u8(r));
        h.rkey = u32(r);
        h.stream = u32(r) & ~BEX__IMM_DIRECT; /* the peer's slot: our immediate */
        h.status = status & 0x80 ? -(int32_t)(status & 0x7f) : 0;
        if (F.n_ereq) {
            struct ereq *q = &B.ereq[k % F.n_ereq];
            h.id = q->id;
            h.addr = PEER_DST * (F.n_ans + 1);
            if (h.status == 0 && F.n_ans < MAX_REC)
                B.ans[F.n_ans++] = (struct answer){
                    .addr = h.addr, .rkey = h.rkey, .len = q->len, .slot = h.stream};
        } else {
            h.id = (uint32_t)k << 16 | k;
            h.addr = PEER_DST;
        }
        send_hdr(&h, NULL, 0);
        break;
    }
    case OP_RECV_CREDIT:
        h.type = BEX__MSG_CREDIT;
        h.credits = u16(r);
        send_hdr(&h, NULL, 0);
        break;
    case OP_RECV_OPEN:
    case OP_RECV_CLOSE:
        h.type = op == OP_RECV_OPEN ? BEX__MSG_OPEN : BEX__MSG_CLOSE;
        h.stream = F.sid_base + u8(r);
        h.credits = credits_of(u8(r));
        send_hdr(&h, NULL, 0);
        break;
    case OP_WRITE_GRANT: {
        uint8_t k = u8(r);
        peer_write_imm(F.n_grant ? B.grant[k % F.n_grant].imm : k);
        break;
    }
    case OP_WRITE_IMM:
        peer_write_imm(u32(r));
        break;
    case OP_SEND_OK:
        nic_send_ok();
        break;
    case OP_NIC_ERROR:
        nic_error(u8(r));
        break;
    case OP_APP_OPEN:
        if (F.client && F.started && !bex__engine_is_dead(F.e) && F.n_str < MAX_STR) {
            struct hstream *s = &B.str[F.n_str++];
            memset(s, 0, sizeof(*s));
            s->used = true;
            s->id = F.next_stream++;
            bex__engine_attach(F.e, &s->st, s->id, true);
        }
        break;
    case OP_APP_SEND:
        app_send(r);
        break;
    case OP_APP_CLOSE: {
        uint8_t k = u8(r);
        if (!F.n_str)
            break;
        struct hstream *s = &B.str[k % F.n_str];
        if (s->close_asked)
            break;
        s->close_asked = true;
        /* as bex_sock_close: the queue goes, then CLOSE */
        if (!s->dead && s->st.eng)
            bex__engine_close_stream(&s->st);
        break;
    }
    case OP_TICK: {
        uint16_t ms = u16(r);
        F.clock += ms & 0x8000 ? (uint64_t)(ms & 0x7fff) * 16 : ms;
        bex__engine_tick(F.e, now_ms());
        break;
    }
    case OP_KEEPALIVE:
        if (F.qp.state == IBV_QPS_RTS)
            *F.ka_local = *F.ka_local + 1;
        break;
    case OP_FAIL:
        sock_fail_conn(-ECONNRESET);
        break;
    case OP_INJECT:
        F.inject = u8(r) & 1 ? 2 : 1;
        break;
    case OP_EXPOSE: {
        uint16_t tok = u16(r);
        if (F.n_exposed < 64)
            B.exposed[F.n_exposed++] = BEX__IMM_DIRECT | tok;
        break;
    }
    case OP_START:
        if (!F.started) {
            F.started = true;
            bex__engine_start(F.e);
        }
        break;
    case OP_REPEAT: {
        uint8_t n = u8(r);
        if (F.repeating)
            break; /* not nested: an input stays short to run */
        F.repeating = true;
        struct rd save = *r;
        for (uint32_t i = 0; i < n && F.ops < MAX_OPS; i++) {
            *r = save;
            run_op(r);
        }
        F.repeating = false;
        break;
    }
    }
}

/* After each operation: what the I/O loop does, then the invariants. */
static void settle(void)
{
    bex__engine_progress(F.e);
    if (bex__engine_is_dead(F.e) && F.qp.state != IBV_QPS_RESET)
        FZ_CHECK(F.qp.state == IBV_QPS_ERR); /* a failing engine moved its QP */
    nic_flush();
    if (F.started && !bex__engine_is_dead(F.e))
        FZ_CHECK(bex__engine_is_up(F.e));
    if (F.fails)
        FZ_CHECK(bex__engine_is_dead(F.e) && qp_dead());
}

static void run_op(struct rd *r)
{
    if (F.ops++ >= MAX_OPS)
        return;
    uint8_t op = u8(r) % OP_COUNT;
    trace("op %u", op);
    run_op_once(op, r);
    settle();
}

/* ---------------- one input ---------------- */

/* One pool for the whole run (its chunks are kept for the next input); it
 * must be empty between inputs. */
static void reset(void)
{
    static bex_mem_pool *pool, *landing;
    if (!pool) {
        bex_mem_registrar reg;
        bex_mem_registrar_noop(&reg);
        bex_mem_config lc = {.kind = BEX_MEM_POOL_LANDING};
        FZ_CHECK(bex_mem_pool_create(&reg, NULL, &pool) == 0);
        FZ_CHECK(bex_mem_pool_create(&reg, &lc, &landing) == 0);
    }
    memset(&F, 0, sizeof(F));
    F.pool = pool;
    F.landing = landing;
}

/* Window mode: the stand-in's windows (ibv_alloc_mw/ibv_dealloc_mw are
 * inline calls through the context's ops). Keys index the window in their
 * upper 24 bits, as a device's do. */
static struct ibv_mw *fk_alloc_mw(struct ibv_pd *pd, enum ibv_mw_type type)
{
    FZ_CHECK(pd == &F.pd && type == IBV_MW_TYPE_2 && F.sh.windows);
    struct ibv_mw *mw = calloc(1, sizeof(*mw));
    FZ_CHECK(mw != NULL);
    mw->context = &F.ctx;
    mw->pd = pd;
    mw->type = type;
    mw->rkey = ++F.next_mw_key << 8;
    F.live_mw++;
    return mw;
}

static int fk_dealloc_mw(struct ibv_mw *mw)
{
    FZ_CHECK(mw && mw->pd == &F.pd && F.live_mw > 0);
    F.live_mw--;
    /* its binding goes with it: the key works nowhere any more */
    for (uint32_t k = 0; k < F.n_binds; k++)
        if (F.binds[k].key >> 8 == mw->rkey >> 8)
            F.binds[k--] = F.binds[--F.n_binds];
    free(mw);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reset();
    bex__log_init(&F.log, log_sink, NULL, BEX_LOG_DEBUG);
    F.sh = (struct bex__engine_shared){.pool = F.pool, .stats = &F.stats, .log = &F.log};
    F.ctx.ops.post_send = fk_post_send;
    F.ctx.ops.post_recv = fk_post_recv;
    F.ctx.ops.alloc_mw = fk_alloc_mw;
    F.ctx.ops.dealloc_mw = fk_dealloc_mw;
    F.qp.context = &F.ctx;
    F.pd.context = &F.ctx;
    F.sh.pd = &F.pd;
    F.sh.landing = F.landing;
    F.qp.qp_num = 0x123;
    F.qp.state = IBV_QPS_RESET;

    struct rd in = {data, size};
    uint8_t mode = u8(&in);
    F.client = mode & 1;
    F.rxe = mode & 2;
    static const uint32_t eagers[] = {0, 16, 32, 64, 256, 1024, 4096, 8192};
    F.cfg.sq_depth = 2u << (u8(&in) % 5); /* a power of two, 2..32 */
    F.cfg.rq_depth = 4 + u8(&in) % 29;
    F.cfg.eager_max = eagers[u8(&in) % 8];
    uint8_t b = u8(&in);
    F.cfg.frag_size = 256u << (b % 5);
    F.cfg.send_window = (b >> 3) % 4 == 0 ? 0 : 256u << ((b >> 5) % 6);
    F.cfg.rndv_ahead = u8(&in) % 9;
    F.cfg.keepalive_ms = 100;
    F.cfg.keepalive_timeout_ms = 2000;
    /* limits: small ones from the mode byte, else the context's defaults */
    F.cfg.max_msg = mode & 4 ? 65536 : 64u << 20;
    F.cfg.rndv_max = mode & 8 ? 4 : 256;
    F.cfg.rndv_bytes_max = mode & 16 ? 65536 : (uint64_t)256 << 20;
    F.cfg.rndv_timeout_ms = 30000;
    F.cfg.credit_timeout_ms = 30000;
    F.sh.recv_pool = F.pool;
    F.sh.recv_max = mode & 32 ? 65536 : 0;
    F.sh.windows = mode & 64; /* window mode: rendezvous through bound windows */
    /* streams around the immediate's limit: DATA with and without a header */
    F.sid_base = mode & 128 ? BEX__IMM_STREAM_MAX - 3 : 0;
    F.next_stream = F.sid_base;

    /* the peer's hello, through the real decoder */
    struct bex__hello ph = {.qpn = 2,
                            .psn = 1,
                            .gid = {0xfe, 0x80, [15] = 1},
                            .mtu = 5,
                            .sq_depth = 32,
                            .max_msg = BEX__HELLO_MAX_MSG,
                            .frag_size = 65536,
                            .conn_id = 1,
                            .ka_addr = PEER_KA_ADDR,
                            .ka_rkey = PEER_KA_RKEY};
    ph.recv_depth = u16(&in);
    ph.max_rndv = u16(&in);
    ph.eager_max = u32(&in) % (BEX__HELLO_MAX_EAGER + 2);
    uint8_t wire[BEX__HELLO_LEN];
    bex__hello_encode(&ph, wire);
    struct bex__hello got;
    if (bex__hello_decode(wire, sizeof wire, &got) != 0)
        return 0; /* refused at the door */

    FZ_CHECK(bex__engine_create_nodev(&F.sh, &F.cfg, &up_ops, 1, NULL, &F.qp, &F.e) == 0);
    FZ_CHECK(F.qp.state == IBV_QPS_INIT &&
             F.rq_n == F.cfg.rq_depth + bex__engine_rq_spare(&F.sh, F.cfg.rq_depth));
    struct bex__engine_local l;
    bex__engine_local(F.e, &l);
    F.ka_local = (volatile uint64_t *)(uintptr_t)l.ka_addr;
    F.peer_eager = got.eager_max;
    struct bex__engine_peer peer = {
        .rdma = {.qpn = got.qpn, .psn = got.psn, .active_mtu = got.mtu},
        .rq_depth = got.recv_depth,
        .max_rndv = got.max_rndv,
        .eager_max = got.eager_max,
        .ka_addr = got.ka_addr,
        .ka_rkey = got.ka_rkey,
        .max_msg = got.max_msg,
    };
    memcpy(peer.rdma.gid.raw, got.gid, 16);
    if (bex__engine_connect(F.e, &peer) == 0) {
        FZ_CHECK(F.qp.state == IBV_QPS_RTS);
        while (in.n && F.ops < MAX_OPS)
            run_op(&in);

        /* the end: the sock layer fails the connection, the NIC flushes,
         * the drain timeout ends a drain that cannot finish */
        sock_fail_conn(-ECONNRESET);
        nic_flush();
        if (!F.fails) {
            F.clock += 1001;
            bex__engine_tick(F.e, now_ms());
        }
        FZ_CHECK(F.fails == 1);
        check_failed_clean();
    }
    bex__engine_destroy(F.e);
    for (uint32_t i = 0; i < F.n_held; i++)
        bex_mem_free(B.held[i]);
    for (uint32_t i = 0; i < F.n_msgs; i++)
        bex_mem_free(B.msgs[i].m.buf);
    bex_mem_stats ms;
    bex_mem_pool_stats(F.pool, &ms);
    FZ_CHECK(ms.in_use_bytes == 0); /* every receive buffer came back */
    bex_mem_pool_stats(F.landing, &ms);
    FZ_CHECK(ms.in_use_bytes == 0); /* every rendezvous destination came back */
    FZ_CHECK(F.live_mw == 0);       /* every window was deallocated */
    bex__log_fini(&F.log);
    return 0;
}
