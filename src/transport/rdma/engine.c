/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA engine: one RC QP, its work-request chain, receive buffers,
 * credits, rendezvous, send window and keepalive. See engine.h. */
#include <arpa/inet.h>
#include <assert.h>
#include <endian.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "transport/rdma/engine_internal.h"

/* ---------------- creation ---------------- */

/* A stand-in QP (bex__engine_create_nodev) goes through the states that
 * ibv_modify_qp would take a real one to, and nothing else happens; RESET
 * stands for destroyed. */
int bex__engine_nodev_to(struct bex__engine *e, enum ibv_qp_state s)
{
    e->qp->state = s;
    return 0;
}

/* The engine's fields from its configuration; nothing allocated yet. */
static void engine_init(struct bex__engine *e, struct bex__engine_shared *sh,
                        const struct bex__engine_config *cfg,
                        const struct bex__transport_upcalls *ops, uint32_t id, void *user,
                        bool nodev)
{
    e->sh = sh;
    e->stats = sh->stats;
    e->cfg = *cfg;
    if (!e->cfg.ack_delay_us)
        e->cfg.ack_delay_us = BEX__ENGINE_ACK_DELAY_US;
    e->ops = ops;
    e->x.ops = &bex__rdma_transport;
    e->x.user = user;
    e->id = id;
    snprintf(e->name, sizeof e->name, "engine %u", id);
    e->user = user;
    e->nodev = nodev;
    e->sq = cfg->sq_depth;
    /* no chain goes unsignaled while a send window counts bytes (their
     * completion gives them back) or in window mode (its operations wait
     * for an empty queue); bex__engine_set_dest clears it too */
    bool windowed = cfg->send_window || cfg->wnd_mode == BEX_WINDOW_ADAPTIVE || sh->windows;
    e->quiet_max = windowed ? 0 : e->sq / 4;
    e->rq = cfg->rq_depth;
    e->k = e->rq / 2;
    e->rbuf_len = cfg->eager_max > BEX__HDR_LEN ? cfg->eager_max : BEX__HDR_LEN;
    e->recv_max = cfg->eager_max < cfg->max_msg ? cfg->eager_max : cfg->max_msg;
    e->max_rndv = cfg->rndv_max;
    e->frag = cfg->frag_size;
    if (cfg->send_window && cfg->send_window < e->frag)
        e->frag = cfg->send_window;
    e->rbin = &bex__mem_bin_none;
    /* an engine's harness may leave the counters' pointer unset: the
     * thread's own then (bex__recv_acct_of's default), set once here so
     * that the receive path reads it without a test (thread.h) */
    if (!sh->recv_acct)
        sh->recv_acct = &sh->recv_own;
    e->state = E_INIT;
    bex__engine_alone_sync(e);
    bex__stream_set_init(&e->streams);
    e->head = e->post = e->tail = e->sig_end = e->dscan = SEND_CNT_START;
    e->srq_cur = NO_SLOT;
}

uint32_t bex__engine_rq_spare(const struct bex__engine_shared *sh, uint32_t rq_depth)
{
    if (sh->srq)
        return 0; /* the shared queue's reposts are batched per poll turn */
    /* an eighth: one ibv_post_recv per 9 messages at the default 64 */
    uint32_t spare = rq_depth / 8 < 1 ? 1 : rq_depth / 8 > 32 ? 32 : rq_depth / 8;
    if (sh->dev) {
        uint32_t most = (uint32_t)sh->dev->attr.max_qp_wr;
        spare = most <= rq_depth ? 0 : most - rq_depth < spare ? most - rq_depth : spare;
    }
    return spare;
}

/* The engine's tables: send slots, receive slots (not in SRQ mode), the
 * control, rendezvous and release queues. */
static int engine_tables(struct bex__engine *e, bool srq)
{
    e->ss = calloc(e->sq, sizeof(*e->ss));
    e->rs = srq ? NULL : calloc(e->rslots, sizeof(*e->rs));
    e->unposted = calloc(e->rslots, sizeof(*e->unposted));
    e->starved = calloc(e->rslots, sizeof(*e->starved));
    /* one answer per rendezvous slot, one refusal per receive (see
     * bex__engine_refuse_stream) */
    e->ctl_cap = e->max_rndv + e->rq + CTLQ_EXTRA;
    e->ctlq = calloc(e->ctl_cap, sizeof(*e->ctlq));
    e->rin = calloc(e->max_rndv, sizeof(*e->rin));
    e->rout = calloc(e->max_rndv, sizeof(*e->rout));
    e->relq = calloc(e->max_rndv, sizeof(*e->relq));
    e->rin_wait = calloc(e->max_rndv, sizeof(*e->rin_wait));
    if (!e->ss || (!e->rs && !srq) || !e->unposted || !e->starved || !e->ctlq || !e->rin ||
        !e->rout || !e->relq || !e->rin_wait)
        return -ENOMEM;
    return 0;
}

/* The registered header area and the keepalive word. */
static int engine_areas(struct bex__engine *e)
{
    /* One registered area for the headers of control messages (and the
     * keepalive sequence): one per send slot. */
    size_t hdr_bytes = (size_t)e->sq * BEX__HDR_LEN;
    e->hdr_area = bex_mem_alloc(e->sh->pool, hdr_bytes);
    if (!e->hdr_area)
        return errno ? -errno : -ENOMEM;
    memset(e->hdr_area, 0, hdr_bytes);
    e->hdr_lkey = bex_mem_mr(e->hdr_area)->lkey;
    /* The keepalive word is the one long-lived target any connected peer
     * holds a key to: it gets a page of its own and a region of exactly its
     * 8 bytes, so that key reaches nothing else. */
    void *ka = mmap(NULL, KA_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ka == MAP_FAILED)
        return -errno;
    e->ka_local = ka;
    errno = 0;
    /* without a device nothing is registered: the peer gets key 0 (see
     * bex__engine_local) and the stand-in NIC writes nothing there */
    if (!e->nodev)
        e->ka_mr = ibv_reg_mr(e->sh->dev->pd, ka, sizeof(uint64_t),
                              IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!e->ka_mr && !e->nodev)
        return errno ? -errno : -ENOMEM;
    for (uint32_t i = 0; i < e->sq; i++) {
        e->ss[i].hdr = e->hdr_area + (size_t)i * BEX__HDR_LEN;
        e->ss[i].wr.sg_list = e->ss[i].sge; /* for good: slot_take_send */
    }
    return 0;
}

/* The engine's own receive buffers (none in SRQ mode). */
static int engine_recv_bufs(struct bex__engine *e, bool srq)
{
    for (uint32_t i = 0; !srq && i < e->rslots; i++) {
        struct bex__rslot *r = &e->rs[i];
        void *buf = bex__engine_recv_alloc(e, e->sh->recv_pool, e->rbuf_len);
        if (!buf)
            return errno ? -errno : -ENOMEM;
        bex__engine_slot_set_buf(e, r, buf);
        r->wr.wr_id = wrid(e, WR_RECV | i);
        r->wr.sg_list = &r->sge;
        r->wr.num_sge = 1;
    }
    /* As many again registered ahead: the refills of the receives the
     * application holds would otherwise stop this thread for a registration
     * at each new chunk (tens of ms on Soft-RoCE). Best effort: a failure
     * shows at the refill, which copes with it. */
    (void)bex_mem_pool_reserve(e->sh->recv_pool, e->rslots, e->rbuf_len);
    return 0;
}

/* Send SGEs a QP asks for: a header and BEX__SEG_MAX gathered buffers,
 * as far as the device allows (2 at least: a header and a payload). A
 * gathered message needing more goes by rendezvous, one SGE a WRITE. */
static uint32_t send_sges(const struct bex__engine_shared *sh)
{
    uint32_t most = BEX__SEG_MAX + 1;
    if (!sh->dev)
        return most;
    uint32_t dev = (uint32_t)sh->dev->attr.max_sge;
    return dev < most ? (dev > 2 ? dev : 2) : most;
}

/* The QP (or the stand-in), in the INIT state. */
static int engine_qp(struct bex__engine *e, bool srq, struct ibv_qp *stand_in)
{
    struct bex__engine_shared *sh = e->sh;
    struct bex__rdma_qp_config qc = {
        .send_cq = sh->cq,
        .recv_cq = srq ? sh->srq->cq : sh->cq,
        .srq = srq ? sh->srq->srq : NULL,
        .pd = sh->pd,
        .sq_depth = e->sq,
        .rq_depth = e->rslots,
        .max_send_sge = send_sges(sh),
        .max_recv_sge = 1,
        .max_inline = BEX__ENGINE_INLINE,
    };
    int err;
    if (e->nodev) {
        e->qp = stand_in;
        e->max_inline = BEX__ENGINE_INLINE; /* the stand-in copies nothing: any value works */
        e->max_sge = qc.max_send_sge;
        err = 0;
    } else {
        struct ibv_qp_cap cap;
        err = bex__rdma_qp_create(sh->dev, &qc, &e->qp, &cap);
        if (err == -EINVAL || err == -ENOMEM) {
            /* a device without (this much) inline data: payloads by gather */
            qc.max_inline = 0;
            err = bex__rdma_qp_create(sh->dev, &qc, &e->qp, &cap);
        }
        if (!err) {
            e->max_inline = cap.max_inline_data;
            e->max_sge = cap.max_send_sge < qc.max_send_sge ? cap.max_send_sge : qc.max_send_sge;
        }
    }
    if (err)
        return err;
    return e->nodev ? bex__engine_nodev_to(e, IBV_QPS_INIT)
                    : bex__rdma_qp_to_init(e->qp, &sh->path, &sh->conn);
}

/* The receives the peer will be granted, ready before the peer can learn
 * our QPN: in SRQ mode our share of the thread's queue, posted there;
 * else every receive of our own, so that no SEND can ever find an empty
 * receive queue. */
static int engine_receives(struct bex__engine *e, bool srq)
{
    if (srq) {
        e->qpn = e->qp->qp_num;
        int err = bex__srq_grant(e->sh->srq, e, e->qpn, e->rq);
        if (err)
            return err;
        e->srq_in = true;
        return 0;
    }
    for (uint32_t i = 0; i < e->rslots; i++)
        e->rs[i].wr.next = i + 1 < e->rslots ? &e->rs[i + 1].wr : NULL;
    struct ibv_recv_wr *bad;
    int err = bex__rdma_err(bex__rdma_post_recv(e->qp, &e->rs[0].wr, &bad));
    if (err)
        return err;
    BEX__STAT_ADD(e->stats, post_recv_calls, 1);
    return 0;
}

static int engine_create(struct bex__engine_shared *sh, const struct bex__engine_config *cfg,
                         const struct bex__transport_upcalls *ops, uint32_t id, void *user,
                         struct ibv_qp *stand_in, struct bex__engine **out)
{
    if (cfg->sq_depth == 0 || (cfg->sq_depth & (cfg->sq_depth - 1)))
        return -EINVAL; /* the slot mapping needs a power of two */
    struct bex__engine *e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    engine_init(e, sh, cfg, ops, id, user, stand_in != NULL);
    /* SRQ mode: the receives are the shared queue's, of the same size */
    bool srq = sh->srq != NULL;
    if (srq && sh->srq->rbuf_len != e->rbuf_len) {
        free(e);
        return -EINVAL;
    }
    if (srq && bex__srq_unshared_test) { /* tests: no per-peer accounting */
        e->rq = sh->srq->cap;
        e->k = e->rq / 2;
    }
    e->rslots = e->rq + bex__engine_rq_spare(sh, e->rq);
    e->slack = e->rslots - e->rq; /* all posted, rq of them granted */
    int err = engine_tables(e, srq);
    if (!err)
        err = engine_areas(e);
    if (!err)
        err = engine_recv_bufs(e, srq);
    if (!err)
        err = engine_qp(e, srq, stand_in);
    if (!err)
        err = engine_receives(e, srq);
    if (err)
        goto err_destroy;
    e->psn = bex__rdma_random_psn();
    bex__engine_wnd_init(e); /* last: undone by bex__engine_destroy */
    *out = e;
    return 0;

err_destroy:
    bex__engine_destroy(e);
    return err;
}

/* Forget queued window operations, deallocating the windows handed over
 * for retirement. */
static void drop_wops(struct bex__engine *e)
{
    for (; e->wq_n; e->wq_n--, e->wq_head = (e->wq_head + 1) % e->wq_cap)
        if (e->wq[e->wq_head].dealloc)
            ibv_dealloc_mw(e->wq[e->wq_head].mw);
    bex__engine_alone_sync(e);
}

/* Before the QP is destroyed, every window that may still be bound on it
 * goes: a bound window holds a reference to its QP, and rxe's destroy then
 * waits for it (the I/O thread stalls, its other engines miss their
 * keepalives); its MR cannot be deregistered either. Deallocating is no
 * invalidation, so it is safe whatever the window's state. */
void bex__engine_release_windows(struct bex__engine *e)
{
    for (uint32_t i = 0; e->rin && i < e->max_rndv; i++) {
        if (e->rin[i].mw) {
            ibv_dealloc_mw(e->rin[i].mw);
            e->rin[i].mw = NULL;
            e->rin[i].bound = false;
        }
    }
    for (uint32_t i = 0; e->ss && i < e->sq; i++) {
        if (e->ss[i].free_mw) {
            ibv_dealloc_mw(e->ss[i].free_mw);
            e->ss[i].free_mw = NULL;
        }
    }
    if (e->wq)
        drop_wops(e);
    bex__engine_spare_drop(e);
    for (uint32_t i = 0; i < e->xw_n; i++)
        ibv_dealloc_mw(e->xw[i]);
    e->xw_n = 0;
}

int bex__engine_create(struct bex__engine_shared *sh, const struct bex__engine_config *cfg,
                       const struct bex__transport_upcalls *ops, uint32_t id, void *user,
                       struct bex__engine **out)
{
    return engine_create(sh, cfg, ops, id, user, NULL, out);
}

int bex__engine_create_nodev(struct bex__engine_shared *sh, const struct bex__engine_config *cfg,
                             const struct bex__transport_upcalls *ops, uint32_t id, void *user,
                             struct ibv_qp *stand_in, struct bex__engine **out)
{
    if (!stand_in)
        return -EINVAL;
    return engine_create(sh, cfg, ops, id, user, stand_in, out);
}

/* Also the tail of bex__engine_create's cleanup ladder: every field may
 * still be NULL (calloc), and bex_mem_free(NULL) is a no-op. */
void bex__engine_destroy(struct bex__engine *e)
{
    if (!e)
        return;
    if (e->holding)
        atomic_fetch_sub_explicit(bex__engine_holders(e), 1, memory_order_relaxed);
    bex__engine_release_windows(e);
    bex__engine_wnd_fini(e);
    if (e->qp && e->nodev)
        bex__engine_nodev_to(e, IBV_QPS_RESET);
    else if (e->qp && e->srq_in)
        bex__srq_retire(e->sh->srq, e->qp); /* drains the receive it may hold */
    else if (e->qp)
        bex__rdma_qp_destroy(e->qp);
    bex__engine_srq_leave(e);
    for (uint32_t i = 0; e->rs && i < e->rslots; i++)
        bex__engine_recv_free(e, bex__engine_slot_take_buf(e, &e->rs[i]));
    for (uint32_t i = 0; e->rin && i < e->max_rndv; i++)
        if (e->rin[i].used)
            bex__engine_recv_free(e, e->rin[i].buf);
    free(e->wq);
    free(e->xw);
    bex_mem_free(e->hdr_area);
    if (e->ka_mr)
        ibv_dereg_mr(e->ka_mr);
    if (e->ka_local)
        munmap((void *)e->ka_local, KA_PAGE);
    free(e->ss);
    free(e->rs);
    free(e->unposted);
    free(e->starved);
    free(e->rin_wait);
    free(e->ctlq);
    free(e->rin);
    free(e->rout);
    free(e->relq);
    free(e);
}

void *bex__engine_user(struct bex__engine *e)
{
    return e->user;
}
struct bex__xport *bex__engine_xport(struct bex__engine *e)
{
    return &e->x;
}
_Static_assert(offsetof(struct bex__engine, x) == 0, "bex__engine_of: the xport comes first");
uint32_t bex__engine_id(struct bex__engine *e)
{
    return e->id;
}

uint32_t bex__engine_qpn(struct bex__engine *e)
{
    return e->qpn;
}
const char *bex__engine_state_name(enum bex__engine_state s)
{
    static const char *const names[] = {
        [E_INIT] = "INIT", [E_CONNECTED] = "CONNECTED", [E_UP] = "UP", [E_DEAD] = "DEAD"};
    return (unsigned)s < ARRAY_SIZE(names) ? names[s] : "?";
}

void bex__engine_move(struct bex__engine *e, enum bex__engine_state to)
{
    enum bex__engine_state from = e->state;
    assert((from == E_INIT && to == E_CONNECTED) || (from == E_CONNECTED && to == E_UP) ||
           (from != E_DEAD && to == E_DEAD));
    if (e->sh->log && e->sh->log->level >= BEX_LOG_DEBUG)
        bex__log(e->sh->log, BEX_LOG_DEBUG, "%s: %s -> %s", e->name, bex__engine_state_name(from),
                 bex__engine_state_name(to));
    e->state = to;
    bex__engine_alone_sync(e);
}

bool bex__engine_is_up(struct bex__engine *e)
{
    return e->state == E_UP;
}
uint32_t bex__engine_charged(const struct bex__engine *e)
{
    return e->n_unposted - e->n_credited + e->n_starved + e->to_return;
}

bool bex__engine_is_dead(struct bex__engine *e)
{
    return e->state == E_DEAD;
}

void bex__engine_local(struct bex__engine *e, struct bex__engine_local *out)
{
    out->qpn = e->qp->qp_num;
    out->psn = e->psn;
    out->rq_depth = e->rq;
    out->max_rndv = e->max_rndv;
    out->eager_max = e->cfg.eager_max;
    out->max_msg = e->cfg.max_msg;
    out->ka_addr = (uintptr_t)e->ka_local;
    out->ka_rkey = e->nodev ? 0 : e->ka_mr->rkey;
}

int bex__engine_check_peer(const struct bex__engine_peer *p)
{
    return p->rq_depth < BEX__ENGINE_MIN_DEPTH ? -EPROTO : 0;
}

uint32_t bex__engine_peer_max_msg(struct bex__engine *e)
{
    return e->peer_max_msg;
}

int bex__engine_connect(struct bex__engine *e, const struct bex__engine_peer *p)
{
    if (e->state != E_INIT)
        return -EINVAL;
    int err = bex__engine_check_peer(p);
    if (err)
        return err;
    err = e->nodev ? bex__engine_nodev_to(e, IBV_QPS_RTR)
                   : bex__rdma_qp_to_rtr(e->qp, e->sh->dev, &e->sh->path, &p->rdma, &e->sh->conn);
    if (!err && e->nodev)
        err = bex__engine_nodev_to(e, IBV_QPS_RTS);
    else if (!err)
        err = bex__rdma_qp_to_rts(e->qp, e->sh->dev, e->psn, &p->rdma, &e->sh->conn);
    if (err)
        return err;
    e->peer_credits = p->rq_depth;
    e->peer_rq = p->rq_depth;
    e->peer_max_rndv = p->max_rndv < e->max_rndv ? p->max_rndv : e->max_rndv;
    e->peer_eager = p->eager_max;
    e->peer_max_msg = p->max_msg;
    e->eager_lim = p->eager_max < p->max_msg ? p->eager_max : p->max_msg;
    e->peer_ka_addr = p->ka_addr;
    e->peer_ka_rkey = p->ka_rkey;
    bex__engine_move(e, E_CONNECTED);
    return 0;
}

void bex__engine_start(struct bex__engine *e)
{
    if (e->state == E_DEAD)
        return;                    /* it failed before the peer's notice came */
    if (e->state != E_CONNECTED) { /* the peer's notice out of turn: before its hello, or twice */
        bex__engine_fail(e, bex__engine_violation(e, "a readiness notice in state %s",
                                                  bex__engine_state_name(e->state)));
        return;
    }
    bex__engine_move(e, E_UP);
    uint64_t now = bex__now_ms();
    e->ka_last_ms = now;
    e->ka_next_ms = now;
    e->ops->on_up(&e->x);
}
