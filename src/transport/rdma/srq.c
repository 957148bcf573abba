/* SPDX-License-Identifier: Apache-2.0 */
/* SRQ mode: an I/O thread's shared receive queue and its per-peer
 * accounting. See srq.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "mem/lookup.h"
#include "transport/rdma/srq.h"
#include "transport/thread.h"
#include "transport/transport.h"
#include "common/log.h"
#include "loop/loop.h"
#include "bex/common.h"

/* q->said: a refused share is logged once, again after a release. */
#define SRQ_SAID_FULL 1u

static int srq_create(struct bex__engine_shared *sh, uint32_t depth, uint32_t rbuf_len,
                      struct ibv_cq *cq, struct ibv_srq *stand_in, struct bex__srq **out)
{
    struct bex__srq *q = calloc(1, sizeof(*q));
    if (!q)
        return -ENOMEM;
    q->sh = sh;
    q->cq = cq;
    q->cap = depth;
    q->rbuf_len = rbuf_len;
    q->slots = calloc(depth, sizeof(*q->slots));
    q->pool = calloc(depth, sizeof(*q->pool));
    q->map_cap = 64;
    q->map = calloc(q->map_cap, sizeof(*q->map));
    q->wcs = calloc(depth, sizeof(*q->wcs));
    q->pend = calloc(depth, sizeof(*q->pend));
    q->dying = calloc(depth, sizeof(*q->dying));
    q->last_wqe = calloc(depth, sizeof(*q->last_wqe));
    q->drain_ms = BEX__SRQ_DRAIN_MS;
    int err = -ENOMEM;
    if (!q->slots || !q->pool || !q->map || !q->wcs || !q->pend || !q->dying || !q->last_wqe)
        goto err_free;
    q->stand_in = stand_in != NULL;
    if (stand_in) {
        q->srq = stand_in;
    } else {
        struct ibv_srq_init_attr a = {.attr = {.max_wr = depth, .max_sge = 1}};
        errno = 0;
        q->srq = ibv_create_srq(sh->pd, &a);
        if (!q->srq) {
            err = errno ? -errno : -ENOMEM;
            goto err_free;
        }
    }
    pthread_mutex_init(&q->last_mu, NULL);
    *out = q;
    return 0;
err_free:
    free(q->slots);
    free(q->pool);
    free(q->map);
    free(q->wcs);
    free(q->pend);
    free(q->dying);
    free(q->last_wqe);
    free(q);
    return err;
}

int bex__srq_create(struct bex__engine_shared *sh, uint32_t depth, uint32_t rbuf_len,
                    struct ibv_cq *cq, struct bex__srq **out)
{
    return srq_create(sh, depth, rbuf_len, cq, NULL, out);
}

int bex__srq_create_nodev(struct bex__engine_shared *sh, uint32_t depth, uint32_t rbuf_len,
                          struct ibv_cq *cq, struct ibv_srq *stand_in, struct bex__srq **out)
{
    if (!stand_in)
        return -EINVAL;
    return srq_create(sh, depth, rbuf_len, cq, stand_in, out);
}

void bex__srq_destroy(struct bex__srq *q)
{
    if (!q)
        return;
    bex__srq_reap(q, 0, true, NULL, NULL); /* the draining QPs: none may outlive the queue */
    if (q->srq && !q->stand_in)
        ibv_destroy_srq(q->srq);
    BEX__STAT_ADD(q->sh->stats, srq_posted, -(uint64_t)q->posted);
    for (uint32_t i = 0; i < q->made; i++) {
        void *b = q->slots[i].buf;
        if (b) {
            bex__recv_posted(q->sh, -(int64_t)bex_mem_usable_size(b));
            bex_mem_free(b);
        }
    }
    free(q->slots);
    free(q->pool);
    free(q->map);
    free(q->wcs);
    free(q->pend);
    free(q->dying);
    free(q->last_wqe);
    pthread_mutex_destroy(&q->last_mu);
    free(q);
}

/* ---- completions: a ring in front of the CQ ---- */

/* Poll once into the ring's free space after its tail (at most max
 * completions): how many came, or the poll's negative count. */
static int ring_poll(struct bex__srq *q, int max)
{
    uint32_t tail = (q->wc_head + q->wc_n) % q->cap;
    uint32_t room = q->cap - q->wc_n;
    if (room > q->cap - tail)
        room = q->cap - tail; /* contiguous: up to the array's end */
    if ((uint32_t)max > room)
        max = (int)room;
    if (max <= 0)
        return 0;
    int n = bex__rdma_poll_cq(q->cq, max, &q->wcs[tail]);
    bex__stat_poll(q->sh->stats, n);
    if (n > 0)
        q->wc_n += (uint32_t)n;
    return n;
}

int bex__srq_next(struct bex__srq *q, struct ibv_wc *wc)
{
    if (!q->wc_n && q->cq_err) { /* a poll of forget_qp failed */
        int err = q->cq_err;
        q->cq_err = 0;
        return err;
    }
    if (!q->wc_n) {
        int n = ring_poll(q, 64);
        if (n <= 0)
            return n;
    }
    *wc = q->wcs[q->wc_head];
    q->wc_head = (q->wc_head + 1) % q->cap;
    q->wc_n--;
    return 1;
}

/* QP qpn is destroyed: no completion of it may be handed out any more,
 * since a new QP may be given its number and would be charged with the
 * old peer's messages (tests/srq/test_srq_reuse.c). Once ibv_destroy_qp
 * has returned the QP completes nothing more, but what it completed may
 * still be in the CQ (rxe leaves it there; mlx5's provider cleans it
 * out): poll the CQ empty into the ring (it holds every posted receive's
 * completion), then take the QP's completions out of the ring, their
 * receives back to the pool; the other QPs' stay, in order. */
static void forget_qp(struct bex__srq *q, uint32_t qpn)
{
    while (!q->cq_err) {
        int n = ring_poll(q, 64);
        if (n < 0)
            q->cq_err = n; /* for the I/O thread: bex__srq_next */
        if (n <= 0)
            break;
    }
    uint32_t keep = 0;
    for (uint32_t i = 0; i < q->wc_n; i++) {
        const struct ibv_wc *w = &q->wcs[(q->wc_head + i) % q->cap];
        if (w->qp_num == qpn) {
            q->posted--;
            BEX__STAT_ADD(q->sh->stats, srq_posted, (uint64_t)-1);
            q->pool[q->n_pool++] = (uint32_t)w->wr_id & ~BEX__SRQ_WR_RECV;
            continue;
        }
        if (keep != i)
            q->wcs[(q->wc_head + keep) % q->cap] = *w;
        keep++;
    }
    q->wc_n = keep;
}

/* ---- QP number -> engine: linear probing, deletion by backward shift ---- */

static uint32_t map_home(const struct bex__srq *q, uint32_t qpn)
{
    return (qpn * 0x9e3779b1u) & (q->map_cap - 1);
}

static struct bex__srq_ent *map_find(struct bex__srq *q, uint32_t qpn)
{
    for (uint32_t i = map_home(q, qpn);; i = (i + 1) & (q->map_cap - 1)) {
        if (q->map[i].qpn == qpn)
            return &q->map[i];
        if (!q->map[i].qpn)
            return NULL;
    }
}

static void map_insert(struct bex__srq_ent *map, uint32_t cap, uint32_t qpn, struct bex__engine *e)
{
    uint32_t i = (qpn * 0x9e3779b1u) & (cap - 1);
    while (map[i].qpn)
        i = (i + 1) & (cap - 1);
    map[i] = (struct bex__srq_ent){qpn, e};
}

static int map_put(struct bex__srq *q, uint32_t qpn, struct bex__engine *e)
{
    if ((q->peers + 1) * 2 > q->map_cap) { /* at most half full: short probes */
        uint32_t cap = q->map_cap * 2;
        struct bex__srq_ent *m = calloc(cap, sizeof(*m));
        if (!m)
            return -ENOMEM;
        for (uint32_t i = 0; i < q->map_cap; i++)
            if (q->map[i].qpn)
                map_insert(m, cap, q->map[i].qpn, q->map[i].e);
        free(q->map);
        q->map = m;
        q->map_cap = cap;
    }
    map_insert(q->map, q->map_cap, qpn, e);
    return 0;
}

static void map_del(struct bex__srq *q, uint32_t qpn)
{
    struct bex__srq_ent *hit = map_find(q, qpn);
    if (!hit)
        return;
    uint32_t mask = q->map_cap - 1, i = (uint32_t)(hit - q->map);
    q->map[i].qpn = 0;
    /* move later entries of the run back into the hole they may probe past */
    for (uint32_t j = (i + 1) & mask; q->map[j].qpn; j = (j + 1) & mask) {
        uint32_t h = map_home(q, q->map[j].qpn);
        if (((j - h) & mask) >= ((j - i) & mask)) {
            q->map[i] = q->map[j];
            q->map[j].qpn = 0;
            i = j;
        }
    }
}

/* ---- slots ---- */

static int slot_fill(struct bex__srq *q, struct bex__rslot *s)
{
    void *b = bex_mem_alloc(q->sh->recv_pool, q->rbuf_len);
    if (!b)
        return -ENOMEM;
    int64_t size = (int64_t)bex_mem_usable_size(b);
    bex__recv_allocated(q->sh, size);
    bex__recv_posted(q->sh, size);
    s->buf = b;
    s->sge = (struct ibv_sge){(uintptr_t)b, q->rbuf_len, bex__mem_block_mr(b)->lkey};
    return 0;
}

static int post_chain(struct bex__srq *q, const uint32_t *idx, uint32_t n)
{
    if (!n)
        return 0;
    for (uint32_t i = 0; i < n; i++)
        q->slots[idx[i]].wr.next = i + 1 < n ? &q->slots[idx[i + 1]].wr : NULL;
    struct ibv_recv_wr *bad;
    int rc = ibv_post_srq_recv(q->srq, &q->slots[idx[0]].wr, &bad);
    BEX__STAT_ADD(q->sh->stats, post_recv_calls, 1);
    if (rc)
        return bex__rdma_err(rc);
    q->posted += n;
    BEX__STAT_ADD(q->sh->stats, srq_posted, n);
    return 0;
}

/* Post receives until posted + held reaches want (at most: as far as the
 * pool and memory go). Slots come from the pool, those with a buffer
 * first, then new ones. */
static int top_up(struct bex__srq *q, uint32_t want)
{
    uint32_t chain[64], n = 0;
    int err = 0;
    while (q->posted + q->held + n < want) {
        uint32_t i;
        if (q->n_pool) {
            i = q->pool[--q->n_pool];
        } else if (q->made < q->cap) {
            i = q->made++;
            struct bex__rslot *s = &q->slots[i];
            s->wr.wr_id = BEX__SRQ_WR_ID(i);
            s->wr.sg_list = &s->sge;
            s->wr.num_sge = 1;
        } else {
            break;
        }
        if (!q->slots[i].buf && (err = slot_fill(q, &q->slots[i]))) {
            q->pool[q->n_pool++] = i;
            break;
        }
        chain[n++] = i;
        if (n == sizeof chain / sizeof chain[0]) {
            if ((err = post_chain(q, chain, n)))
                break;
            n = 0;
        }
    }
    if (n && !err)
        err = post_chain(q, chain, n);
    if (err)
        for (uint32_t k = 0; k < n; k++)
            q->pool[q->n_pool++] = chain[k];
    return err;
}

/* Post receives again up to the credits granted (and the spare), after
 * receives went back to the pool: those a peer consumed beyond its share
 * before its engine failed on it (the NIC hands out shared receives at
 * line rate, the violation is seen only when the completions are polled)
 * may back the other peers' credits. Without this the queue stays short
 * and the other peers' SENDs meet receiver-not-ready until their
 * keepalive ends them (test_adversary.srq). Best effort: an allocation
 * that fails now is tried again at the next grant or release. */
static void refill(struct bex__srq *q)
{
    uint32_t want = q->granted + BEX__SRQ_SPARE > q->cap ? q->cap : q->granted + BEX__SRQ_SPARE;
    if (q->granted && q->posted + q->held < want)
        (void)top_up(q, want);
}

uint32_t bex__srq_unshared_test;

int bex__srq_grant(struct bex__srq *q, struct bex__engine *e, uint32_t qpn, uint32_t share)
{
    if (share > q->cap - q->granted && !bex__srq_unshared_test) {
        bex__log_once(q->sh->log, &q->said, SRQ_SAID_FULL, BEX_LOG_WARN,
                      "shared receive queue full: %u of %u receives granted to %u peers, no share "
                      "of %u for another (srq_depth)",
                      q->granted, q->cap, q->peers, share);
        BEX__STAT_ADD(q->sh->stats, srq_refused, 1);
        return -ENOSPC;
    }
    int err = map_put(q, qpn, e);
    if (err)
        return err;
    uint32_t need = q->granted + share;
    if (bex__srq_unshared_test && need > q->cap)
        need = q->cap; /* oversubscribed: what the test shows goes wrong */
    uint32_t want = need + BEX__SRQ_SPARE > q->cap ? q->cap : need + BEX__SRQ_SPARE;
    err = top_up(q, want);
    if (!err && q->posted + q->held < need)
        err = -ENOMEM;
    if (err) {
        map_del(q, qpn);
        return err;
    }
    q->granted += share;
    q->peers++;
    BEX__STAT_ADD(q->sh->stats, srq_credits, share);
    return 0;
}

void bex__srq_release(struct bex__srq *q, uint32_t qpn, uint32_t share, const uint32_t *a,
                      uint32_t na, const uint32_t *b, uint32_t nb)
{
    map_del(q, qpn);
    forget_qp(q, qpn);
    q->granted -= share;
    q->peers--;
    BEX__STAT_ADD(q->sh->stats, srq_credits, -(uint64_t)share);
    q->held -= na + nb;
    for (uint32_t i = 0; i < na; i++)
        q->pool[q->n_pool++] = a[i];
    for (uint32_t i = 0; i < nb; i++)
        q->pool[q->n_pool++] = b[i];
    q->said &= ~SRQ_SAID_FULL; /* full again after this release: say so again */
    refill(q);
}

struct bex__engine *bex__srq_arrived(struct bex__srq *q, uint32_t idx, uint32_t qpn)
{
    q->posted--;
    BEX__STAT_ADD(q->sh->stats, srq_posted, (uint64_t)-1);
    struct bex__srq_ent *hit = map_find(q, qpn);
    if (!hit) {
        /* its QP is gone, and forget_qp missed it (ibv_destroy_qp failed,
         * and the QP only went to the error state, keeping its number):
         * the receive is the pool's again */
        q->pool[q->n_pool++] = idx;
        refill(q);
        return NULL;
    }
    q->held++;
    return hit->e;
}

uint64_t bex__srq_post(struct bex__srq *q, const uint32_t *idx, uint32_t n)
{
    memcpy(q->pend + q->n_pend, idx, n * sizeof(*idx));
    q->n_pend += n;
    q->held -= n;
    q->posted += n;
    BEX__STAT_ADD(q->sh->stats, srq_posted, n);
    return q->flushes + 1;
}

void bex__srq_flush(struct bex__srq *q)
{
    uint32_t n = q->n_pend;
    if (!n)
        return;
    q->n_pend = 0;
    q->flushes++;
    /* post_chain counts them posted again */
    q->posted -= n;
    BEX__STAT_ADD(q->sh->stats, srq_posted, -(uint64_t)n);
    int err = post_chain(q, q->pend, n);
    if (!err)
        return;
    bex__log(q->sh->log, BEX_LOG_ERROR, "ibv_post_srq_recv of %u receives: %s", n,
             bex_strerror(err));
    for (uint32_t i = 0; i < n; i++)
        q->pool[q->n_pool++] = q->pend[i];
    if (!q->cq_err)
        q->cq_err = err;
}

void bex__srq_return(struct bex__srq *q, uint32_t idx)
{
    q->held--;
    q->pool[q->n_pool++] = idx;
    refill(q);
}

/* ---- QPs draining ---- */

static void qp_destroy_now(struct bex__srq *q, struct ibv_qp *qp)
{
    uint32_t qpn = qp->qp_num;
    int rc = bex__rdma_qp_destroy(qp);
    if (rc) /* it keeps its number: bex__srq_arrived takes what it completes */
        bex__log(q->sh->log, BEX_LOG_ERROR, "QP %u: ibv_destroy_qp: %s", qpn, bex_strerror(rc));
}

void bex__srq_retire(struct bex__srq *q, struct ibv_qp *qp)
{
    if (q->n_dying < q->cap && !q->stand_in) {
        /* for bex__srq_async, on whatever thread (release: it reads the
         * QP's fields, tests/srq/test_srq_dying.c reads dying[].qp) */
        __atomic_store_n(&qp->qp_context, q, __ATOMIC_RELEASE);
        if (bex__rdma_qp_to_err(qp) == 0) {
            struct bex__srq_dying *d = &q->dying[q->n_dying++];
            d->qpn = qp->qp_num;
            d->until_ms = bex__now_ms() + q->drain_ms;
            d->cq_idx = d->cqe = 0;
            __atomic_store_n(&d->qp, qp, __ATOMIC_RELEASE);
            BEX__STAT_ADD(q->sh->stats, srq_draining, 1);
            return;
        }
        __atomic_store_n(&qp->qp_context, NULL, __ATOMIC_RELAXED);
    }
    qp_destroy_now(q, qp);
}

/* Whether a LAST_WQE_REACHED of QP qpn came (taken out of the list). */
static bool last_seen(struct bex__srq *q, uint32_t qpn)
{
    bool hit = false;
    pthread_mutex_lock(&q->last_mu);
    for (uint32_t i = 0; i < q->n_last;) {
        if (q->last_wqe[i] == qpn) {
            q->last_wqe[i] = q->last_wqe[--q->n_last];
            hit = true;
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&q->last_mu);
    return hit;
}

bool bex__srq_hold_cq(struct bex__srq *q, uint32_t qpn, uint32_t cq_idx, uint32_t cqe)
{
    for (uint32_t i = 0; i < q->n_dying; i++) {
        if (q->dying[i].qpn == qpn) {
            q->dying[i].cq_idx = cq_idx;
            q->dying[i].cqe = cqe;
            return true;
        }
    }
    return false;
}

bool bex__srq_reap(struct bex__srq *q, uint64_t now_ms, bool at_exit,
                   void (*cq_back)(void *arg, uint32_t cq_idx, uint32_t cqe), void *arg)
{
    bool gone = false;
    for (uint32_t i = 0; i < q->n_dying;) {
        struct bex__srq_dying d = q->dying[i];
        if (!at_exit && now_ms < d.until_ms && !last_seen(q, d.qpn)) {
            i++;
            continue;
        }
        q->dying[i] = q->dying[--q->n_dying];
        BEX__STAT_ADD(q->sh->stats, srq_draining, (uint64_t)-1);
        /* ibv_destroy_qp waits for every async event of the QP to be
         * acknowledged: none is handed to us after it */
        qp_destroy_now(q, d.qp);
        (void)last_seen(q, d.qpn);
        forget_qp(q, d.qpn);
        if (cq_back && d.cqe)
            cq_back(arg, d.cq_idx, d.cqe);
        gone = true;
    }
    if (gone)
        refill(q);
    return q->n_dying > 0;
}

void bex__srq_async(const struct ibv_async_event *ev)
{
    if (ev->event_type != IBV_EVENT_QP_LAST_WQE_REACHED)
        return;
    struct bex__srq *q = __atomic_load_n(&ev->element.qp->qp_context, __ATOMIC_ACQUIRE);
    if (!q)
        return;
    pthread_mutex_lock(&q->last_mu);
    if (q->n_last < q->cap) /* else drain_ms ends its wait */
        q->last_wqe[q->n_last++] = ev->element.qp->qp_num;
    pthread_mutex_unlock(&q->last_mu);
}
