/* The RDMA engine: received memory (the context's recv_bytes_max budget
 * and the engine's receive slots), split from engine.c along its banner.
 * See engine.h. */
#include <assert.h>
#include <stdlib.h>

#include "transport/rdma/engine_internal.h"

/* ---------------- received memory ----------------
 *
 * Received buffers (eager receives and rendezvous destinations) come from
 * the context's recv_pool, which only the I/O threads allocate from. What
 * the context holds of it = in use - posted: messages handed to the
 * application and not yet freed, plus destinations being written. The
 * engine allocates no more of it while that is at recv_max: a consumed
 * receive then stays unposted (its credit is not returned: the peer is
 * paced), a rendezvous request waits for its answer.
 *
 * The application frees received buffers from any thread (bex_mem_free),
 * and the context's I/O threads all allocate, so the count is kept this
 * way: every allocation adds its usable size to the context's allocated
 * counter at once (an atomic shared by the threads), frees are learnt from
 * an exact count (collect the thread's heap, read the pools' stats), taken
 * only when the estimate says "full", at most once per clock tick. A
 * thread's estimate is its last exact count plus what every thread
 * allocated since (the counter was read before the count: an allocation in
 * between is counted twice, never missed), so it is never below the truth,
 * and every decision to hold back is made on a count that was exact a
 * moment before. Another thread's frees not yet collected by it count as
 * in use; each thread collects its heaps on its timer tick. */

static struct bex__recv_acct *recv_acct(struct bex__engine_shared *sh)
{
    return sh->recv_acct ? sh->recv_acct : &sh->recv_own;
}

/* Engines and TCP connections holding received memory their peer has yet
 * to write (rndv_share, and tcp.c) */
_Atomic int32_t *bex__engine_holders(struct bex__engine *e)
{
    return &recv_acct(e->sh)->holders;
}

/* Where rendezvous destinations come from: the landing pool (counted as
 * received memory too). */
bex_mem_pool *bex__engine_rndv_pool(struct bex__engine_shared *sh)
{
    return sh->landing; /* the only memory a peer may write */
}

static void recv_refresh(struct bex__engine_shared *sh)
{
    uint64_t now = bex__now_ms();
    if (sh->recv_refreshed == now)
        return;
    sh->recv_refreshed = now;
    int64_t before = atomic_load(&recv_acct(sh)->allocated);
    bex_mem_stats st;
    bex_mem_pool_collect(sh->recv_pool);
    bex_mem_pool_stats(sh->recv_pool, &st);
    int64_t exact = (int64_t)st.in_use_bytes;
    if (bex__engine_rndv_pool(sh) && bex__engine_rndv_pool(sh) != sh->recv_pool) {
        bex_mem_pool_collect(bex__engine_rndv_pool(sh));
        bex_mem_pool_stats(bex__engine_rndv_pool(sh), &st);
        exact += (int64_t)st.in_use_bytes;
    }
    sh->recv_base = exact - before;
}

/* May want more bytes be received? With nothing held, one message of any
 * size may: a limit below max_msg slows, it never stops, a connection. */
bool bex__recv_room(struct bex__engine_shared *sh, uint64_t want)
{
    if (!sh->recv_max)
        return true;
    struct bex__recv_acct *a = recv_acct(sh);
    for (int pass = 0;; pass++) {
        int64_t held = sh->recv_base + atomic_load_explicit(&a->allocated, memory_order_relaxed) -
                       atomic_load_explicit(&a->posted, memory_order_relaxed);
        if (held <= 0 || (uint64_t)held + want <= sh->recv_max)
            return true;
        if (pass)
            return false;
        recv_refresh(sh);
    }
}

void bex__recv_allocated(struct bex__engine_shared *sh, int64_t size)
{
    atomic_fetch_add(&recv_acct(sh)->allocated, size);
}

void bex__recv_posted(struct bex__engine_shared *sh, int64_t size)
{
    atomic_fetch_add_explicit(&recv_acct(sh)->posted, size, memory_order_relaxed);
}

bool bex__engine_recv_room(struct bex__engine *e, uint64_t want)
{
    return bex__recv_room(e->sh, want);
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

/* The usable bytes of buf, a receive buffer (rbuf_len bytes from the
 * receive pool): looked up once, the same for every one. */
int64_t bex__engine_rbuf_usable(struct bex__engine *e, const void *buf)
{
    if (!e->rbuf_usable)
        e->rbuf_usable = (uint32_t)bex_mem_usable_size(buf);
    assert(bex_mem_usable_size(buf) == e->rbuf_usable);
    return e->rbuf_usable;
}

void bex__engine_slot_put(struct bex__engine *e, struct bex__rslot *r, void *buf)
{
    r->buf = buf;
    r->sge = (struct ibv_sge){(uintptr_t)buf, e->rbuf_len, bex_mem_mr(buf)->lkey};
}

void bex__engine_slot_set_buf(struct bex__engine *e, struct bex__rslot *r, void *buf)
{
    bex__engine_slot_put(e, r, buf);
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

/* Receive slot idx: the engine's own, or in SRQ mode the shared queue's. */
struct bex__rslot *bex__engine_rslot_at(struct bex__engine *e, uint32_t idx)
{
    return e->sh->srq ? &e->sh->srq->slots[idx] : &e->rs[idx];
}

/* A consumed receive is kept for reposting (with its buffer) or starved
 * (without): in SRQ mode the slot is the engine's charge from now on. */
void bex__engine_hold_unposted(struct bex__engine *e, uint32_t idx)
{
    e->unposted[e->n_unposted++] = idx;
    if (idx == e->srq_cur)
        e->srq_cur = NO_SLOT;
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
