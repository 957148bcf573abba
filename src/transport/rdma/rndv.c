/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA engine: rendezvous, receiver side (the answers to a peer's
 * requests, its destinations and their share of the received budget),
 * split from engine.c along its banner. See engine.h. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/engine_internal.h"

/* ---------------- rendezvous, receiver side ---------------- */

/* Keep the context's count of holders (TCP connections count there too:
 * tcp.c); called from the tick, so a share may lag by one tick. */
void bex__engine_hold_sync(struct bex__engine *e)
{
    bool h = e->state == E_UP && e->rin_bytes > 0;
    if (h != e->holding)
        atomic_fetch_add_explicit(bex__engine_holders(e), h ? 1 : -1, memory_order_relaxed);
    e->holding = h;
}

/* What the engine's destinations may come to: with no other holder in the
 * context, anything; else a share that leaves room for one more, so that a
 * few peers cannot take the context's whole budget (as over TCP). */
static uint64_t rndv_share(struct bex__engine *e)
{
    int32_t n =
        atomic_load_explicit(bex__engine_holders(e), memory_order_relaxed) - (e->holding ? 1 : 0);
    return bex__recv_share(e->sh->recv_max, n, e->cfg.share_min);
}

/* A request fits when the peer's destinations stay within rndv_bytes_max
 * and its share of the context's budget, and the context may receive that
 * much more (one fits whatever its size when none is allocated and no
 * other peer holds any: a limit below max_msg slows, never stops). */
static bool rndv_fits(struct bex__engine *e, uint32_t len)
{
    if (e->rin_bytes && e->rin_bytes + len > e->cfg.rndv_bytes_max)
        return false;
    if (e->rin_bytes + len > rndv_share(e))
        return false;
    return bex__engine_spare_has(e, len) ||
           bex__engine_recv_room(e, len); /* a spare is allocated already */
}

/* Allocate the destination of request slot i and queue the answer. */
static int rin_bind(struct bex__engine *e, struct rndv_in *in);

static int rndv_answer(struct bex__engine *e, uint32_t i)
{
    struct rndv_in *in = &e->rin[i];
    struct bex__hdr r = {.type = BEX__MSG_RNDV_RESP, .id = in->req_id};
    struct spare sp;
    if (e->sh->windows && bex__engine_spare_take(e, in->len, &sp)) {
        /* bound ahead: the answer need not wait for a bind */
        bex__engine_rin_unbind(e, in); /* none left from its last transfer, normally */
        in->buf = sp.buf;
        in->mw = sp.mw; /* the slot's own window was deallocated on delivery */
        in->key = sp.key;
        in->bound = true;
        e->rin_bytes += in->len;
        r.addr = (uintptr_t)sp.buf;
        r.rkey = sp.key;
        r.stream = ((uint32_t)in->gen << 16) | i;
        BEX__STAT_ADD(e->stats, rndv_prebound, 1);
        return bex__engine_queue_ctl(e, &r);
    }
    void *buf = bex__engine_recv_alloc(e, bex__engine_rndv_pool(e->sh), in->len);
    if (!buf) {
        r.status = -ENOMEM; /* the sender hands this message back, and goes on */
        in->used = false;
        e->rin_used--;
    } else {
        in->buf = buf;
        e->rin_bytes += in->len;
        r.addr = (uintptr_t)buf;
        r.rkey = bex_mem_mr(buf)->rkey;
        r.stream = ((uint32_t)in->gen << 16) | i;
        if (e->sh->windows) {
            int err = rin_bind(e, in);
            if (err) {
                bex__engine_recv_free(e, buf);
                in->buf = NULL;
                e->rin_bytes -= in->len;
                in->used = false;
                e->rin_used--;
                r = (struct bex__hdr){.type = BEX__MSG_RNDV_RESP, .id = in->req_id, .status = err};
            } else {
                r.rkey = in->key; /* the window's, not the chunk's */
            }
        }
    }
    return bex__engine_queue_ctl(e, &r);
}

/* Answer deferred requests, oldest first, while they fit. */
int bex__engine_rndv_resume(struct bex__engine *e)
{
    while (e->wait_n) {
        uint32_t i = e->rin_wait[e->wait_head];
        if (!rndv_fits(e, e->rin[i].len))
            return 0;
        e->wait_head = (e->wait_head + 1) % e->max_rndv;
        e->wait_n--;
        int rc = rndv_answer(e, i);
        if (rc)
            return rc;
    }
    return 0;
}

int bex__engine_rndv_request(struct bex__engine *e, const struct bex__hdr *h)
{
    if (h->len == 0 || h->len > e->cfg.max_msg)
        return bex__engine_violation(e, "a rendezvous request of %u bytes (max_msg %u)", h->len,
                                     e->cfg.max_msg);
    /* An error answer holds no slot, but the sender counts the request until
     * it reads the answer: count it until it is posted. */
    if (e->rin_used + e->ctl_errs >= e->max_rndv)
        return bex__engine_violation(e, "more than %u rendezvous requests in flight", e->max_rndv);
    uint32_t i = 0;
    while (e->rin[i].used) /* rin_used < max_rndv: a free slot exists */
        i++;
    struct rndv_in *in = &e->rin[i];
    in->used = true;
    in->granted = false;
    in->buf = NULL;
    in->gen = (uint16_t)((in->gen + 1) & 0x7fff);
    in->len = h->len;
    in->stream = h->stream;
    in->req_id = h->id;
    e->rin_used++;
    e->spare_want = h->len;
    /* spares of another length, or all when this must wait for room, give
     * their memory back (not while a bind that names one is pending) */
    if (e->spare_n && !e->wq_n && !e->wop_busy &&
        (e->wait_n || !rndv_fits(e, h->len) || !bex__engine_spare_has(e, h->len)))
        bex__engine_spare_drop(e);
    /* in order: a request never overtakes one deferred before it */
    if (e->wait_n || !rndv_fits(e, h->len)) {
        e->rin_wait[(e->wait_head + e->wait_n) % e->max_rndv] = i;
        e->wait_n++;
        BEX__STAT_ADD(e->stats, recv_paused, 1);
        return 0;
    }
    return rndv_answer(e, i);
}

/* Window mode: bind the slot's window (allocated on first use) to its
 * new buffer with a fresh key; the key is what the answer carries. */
static int rin_bind(struct bex__engine *e, struct rndv_in *in)
{
    if (!in->mw) {
        errno = 0;
        in->mw = ibv_alloc_mw(e->sh->pd, IBV_MW_TYPE_2);
        if (!in->mw)
            return errno ? -errno : -ENOMEM;
    }
    /* mw->rkey is the key of the last posted bind (post_pending) */
    struct wop w = {
        .mw = in->mw, .addr = in->buf, .rkey = ibv_inc_rkey(in->mw->rkey), .len = in->len};
    int err = bex__engine_wop_push(e, &w);
    if (err)
        return err;
    in->key = w.rkey;
    in->bound = true;
    return 0;
}
