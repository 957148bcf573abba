/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA engine: memory windows (window mode): binds and invalidations,
 * exposed buffers' windows and destinations bound ahead, split from
 * engine.c along its banner. See engine.h. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/engine_internal.h"

/* ---------------- memory windows (window mode) ---------------- */

int bex__engine_wop_push(struct bex__engine *e, const struct wop *w)
{
    if (e->wq_n == e->wq_cap) {
        uint32_t cap = e->wq_cap ? e->wq_cap * 2 : 64;
        struct wop *q = malloc(cap * sizeof(*q));
        if (!q)
            return -ENOMEM;
        for (uint32_t i = 0; i < e->wq_n; i++)
            q[i] = e->wq[(e->wq_head + i) % e->wq_cap];
        free(e->wq);
        e->wq = q;
        e->wq_cap = cap;
        e->wq_head = 0;
    }
    e->wq[(e->wq_head + e->wq_n) % e->wq_cap] = *w;
    e->wq_n++;
    bex__engine_alone_sync(e);
    return 0;
}

void bex__engine_prep_wops(struct bex__engine *e)
{
    while (e->wq_n && bex__engine_free_slots(e)) {
        struct wop *w = &e->wq[e->wq_head];
        e->wq_head = (e->wq_head + 1) % e->wq_cap;
        e->wq_n--;
        struct sslot *s = bex__engine_slot_take(e);
        if (w->inv) {
            s->wr.opcode = IBV_WR_LOCAL_INV;
            s->wr.invalidate_rkey = w->rkey;
            s->free_mw = w->dealloc ? w->mw : NULL;
        } else {
            const bex_mem_region *r = bex_mem_mr(w->addr);
            s->wr.opcode = IBV_WR_BIND_MW;
            s->wr.bind_mw.mw = w->mw;
            s->wr.bind_mw.rkey = w->rkey;
            s->wr.bind_mw.bind_info = (struct ibv_mw_bind_info){
                .mr = r->handle,
                .addr = (uintptr_t)w->addr,
                .length = w->len,
                .mw_access_flags = IBV_ACCESS_REMOTE_WRITE,
            };
        }
    }
    bex__engine_alone_sync(e);
}

void bex__engine_bind_window(struct bex__engine *e, struct ibv_mw *mw, uint32_t rkey, void *addr,
                             uint32_t len)
{
    if (e->xw_n == e->xw_cap) {
        uint32_t cap = e->xw_cap ? e->xw_cap * 2 : 16;
        struct ibv_mw **n = realloc(e->xw, cap * sizeof(*n));
        if (!n) {
            ibv_dealloc_mw(mw);
            bex__engine_fail_now(e, -ENOMEM);
            return;
        }
        e->xw = n;
        e->xw_cap = cap;
    }
    e->xw[e->xw_n++] = mw; /* ours from now on (see the header) */
    if (e->state == E_DEAD)
        return; /* no QP: bex__engine_destroy deallocates it */
    struct wop w = {.mw = mw, .addr = addr, .rkey = rkey, .len = len};
    if (bex__engine_wop_push(e, &w))
        bex__engine_fail_now(e, -ENOMEM);
}

void bex__engine_retire_window(struct bex__engine *e, struct ibv_mw *mw, uint32_t rkey, bool bound)
{
    bool ours = false;
    for (uint32_t i = 0; i < e->xw_n; i++) {
        if (e->xw[i] == mw) {
            e->xw[i] = e->xw[--e->xw_n];
            ours = true;
            break;
        }
    }
    if (bound && !ours)
        return; /* bound here once, and released with the QP already */
    struct wop w = {.mw = mw, .rkey = rkey, .inv = true, .dealloc = true};
    if (bound && e->state != E_DEAD) {
        if (bex__engine_wop_push(e, &w) == 0)
            return;
        ibv_dealloc_mw(mw); /* before fail_now destroys the QP it is bound on */
        bex__engine_fail_now(e, -ENOMEM);
        return;
    }
    /* not bound, or its QP is gone */
    ibv_dealloc_mw(mw);
}

/* A rendezvous slot's transfer is over (delivered): its window goes at
 * once, before the buffer is handed up. Deallocating revokes the key when
 * the call returns (no invalidation: never one of an unbound window), and
 * the next transfer of the slot binds a fresh window. Not a LOCAL_INV:
 * rxe holds a LOCAL_INV until every earlier work request of the QP has
 * completed (rxe_wqe_is_fenced, the "local invalidate fence" it makes
 * mandatory), a round trip to the peer, and the answers and credits posted
 * after it wait as long; that cost window mode much of its throughput
 * (docs/benchmarks.md). */
void bex__engine_rin_unbind(struct bex__engine *e, struct rndv_in *in)
{
    (void)e;
    if (!in->mw)
        return;
    ibv_dealloc_mw(in->mw);
    in->mw = NULL;
    in->bound = false;
}

/* Window mode binds a destination's window before the answer naming it
 * may go, and binds go out alone (wops_hold): on a busy queue the answer
 * waits for the peer's ACK of everything posted before, then for the
 * bind's completion, per rendezvous. So, while the send queue is idle
 * anyway, the engine binds up to SPARE_MAX destinations ahead, of the
 * length the peer last asked for, and a request of that length takes one
 * and is answered at once (up to SPARE_BYTES in all: larger messages
 * take long enough to write that one bind more is little).
 *
 * What a spare exposes: its window is bound on this QP only (type 2), to
 * its buffer only, with a key the peer has not been told; the peer it
 * would go to is the only one that could write it, and a guessed key that
 * is wrong kills the connection (remote access error). Its memory counts
 * against the context's receive budget (recv_room) and, with the
 * destinations granted, against rndv_bytes_max; spares of another length
 * are dropped once no window operation is pending, and all of them when a
 * request must wait for room. */
static void spare_free(struct bex__engine *e, struct spare *sp)
{
    ibv_dealloc_mw(sp->mw); /* no invalidation: safe whatever its state */
    bex__engine_recv_free(e, sp->buf);
    e->spare_bytes -= sp->len;
    *sp = (struct spare){0};
}

/* All of them; with window operations queued or in flight only at
 * teardown (a queued bind names its window). */
void bex__engine_spare_drop(struct bex__engine *e)
{
    while (e->spare_n)
        spare_free(e, &e->spare[--e->spare_n]);
}

bool bex__engine_spare_has(struct bex__engine *e, uint32_t len)
{
    for (uint32_t i = 0; i < e->spare_n; i++)
        if (e->spare[i].len == len)
            return true;
    return false;
}

/* A spare of len bytes, or false. */
bool bex__engine_spare_take(struct bex__engine *e, uint32_t len, struct spare *out)
{
    for (uint32_t i = 0; i < e->spare_n; i++) {
        if (e->spare[i].len == len) {
            *out = e->spare[i];
            e->spare[i] = e->spare[--e->spare_n];
            e->spare[e->spare_n] = (struct spare){0};
            e->spare_bytes -= len;
            return true;
        }
    }
    return false;
}

/* Bind spares when nothing else is queued, prepared or in flight: the
 * binds then run at once, alone, and hold nothing up. True if any was
 * queued. */
bool bex__engine_spare_fill(struct bex__engine *e)
{
    uint32_t len = e->spare_want;
    if (e->state != E_UP || !e->sh->windows || !len || e->head != e->tail || e->wq_n ||
        e->wop_busy || e->ctl_n || e->rel_n || e->wait_n)
        return false; /* (a failed post in progress() leaves no QP) */
    for (uint32_t i = 0; i < e->spare_n;) {
        if (e->spare[i].len != len) {
            struct spare sp = e->spare[i];
            e->spare[i] = e->spare[--e->spare_n];
            e->spare[e->spare_n] = sp;
            spare_free(e, &e->spare[e->spare_n]);
        } else {
            i++;
        }
    }
    bool any = false;
    uint32_t max = e->max_rndv < SPARE_MAX ? e->max_rndv : SPARE_MAX;
    while (e->spare_n < max && e->spare_bytes + len <= SPARE_BYTES &&
           e->rin_bytes + e->spare_bytes + len <= e->cfg.rndv_bytes_max &&
           bex__engine_recv_room(e, len)) {
        void *buf = bex__engine_recv_alloc(e, bex__engine_rndv_pool(e->sh), len);
        if (!buf)
            break;
        struct ibv_mw *mw = ibv_alloc_mw(e->sh->pd, IBV_MW_TYPE_2);
        if (!mw) {
            bex__engine_recv_free(e, buf);
            break;
        }
        struct wop w = {.mw = mw, .addr = buf, .rkey = ibv_inc_rkey(mw->rkey), .len = len};
        if (bex__engine_wop_push(e, &w)) {
            ibv_dealloc_mw(mw);
            bex__engine_recv_free(e, buf);
            break;
        }
        e->spare[e->spare_n++] = (struct spare){.buf = buf, .mw = mw, .key = w.rkey, .len = len};
        e->spare_bytes += len;
        any = true;
    }
    return any;
}
