/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA engine: received memory (the context's recv_bytes_max budget
 * and the engine's receive slots), split from engine.c along its banner.
 * See engine.h. */
#include <assert.h>
#include <stdlib.h>

#include "transport/rdma/engine_internal.h"

/* Received memory: the accounting is the I/O thread's (transport/thread.c);
 * what follows is the engine's use of it. */

/* Engines and TCP connections holding received memory their peer has yet
 * to write (rndv_share, and tcp.c) */
_Atomic int32_t *bex__engine_holders(struct bex__engine *e)
{
    return &bex__recv_acct_of(e->sh)->holders;
}

/* Where rendezvous destinations come from: the landing pool (counted as
 * received memory too). */
bex_mem_pool *bex__engine_rndv_pool(struct bex__engine_shared *sh)
{
    return sh->landing; /* the only memory a peer may write */
}

void *bex__engine_recv_alloc(struct bex__engine *e, bex_mem_pool *pool, size_t len)
{
    void *b = bex_mem_alloc(pool, len);
    if (b)
        bex__recv_allocated(e->sh, (int64_t)bex_mem_usable_size(b));
    return b;
}

/* A received buffer that never reached the application goes back (the
 * estimate learns of it at its next exact count). */
void bex__engine_recv_free(struct bex__engine *e, void *b)
{
    (void)e;
    if (!b)
        return;
    bex_mem_free(b);
}

void bex__engine_slot_set_buf(struct bex__engine *e, struct bex__rslot *r, void *buf)
{
    r->sge.length = e->rbuf_len; /* (bex__engine_slot_put's refills keep it) */
    bex__engine_slot_put(e, r, buf, NULL);
    bex__recv_posted(e->sh, bex__engine_rbuf_usable(e, buf));
}

/* The slot's buffer goes up to the application (or back to the pool). */
void *bex__engine_slot_take_buf(struct bex__engine *e, struct bex__rslot *r)
{
    void *buf = r->buf;
    r->buf = NULL;
    if (buf)
        bex__recv_posted(e->sh, -bex__engine_rbuf_usable(e, buf));
    return buf;
}

void bex__engine_hold_starved(struct bex__engine *e, uint32_t idx)
{
    e->starved[e->n_starved++] = idx;
    if (idx == e->srq_cur)
        e->srq_cur = NO_SLOT;
}

/* SRQ mode: the engine's QP is gone; its share and the receives its peer
 * consumed go back to the thread's pool. */
void bex__engine_srq_leave(struct bex__engine *e)
{
    if (!e->srq_in)
        return;
    e->srq_in = false;
    struct bex__srq *q = e->sh->srq;
    bex__srq_release(q, e->qpn, e->rq, e->unposted, e->n_unposted, e->starved, e->n_starved);
    e->n_unposted = e->n_starved = 0;
}
