/* SPDX-License-Identifier: Apache-2.0 */
/* Per-I/O-thread resources both transports share: the context's received
 * memory accounting (see thread.h). Moved from the RDMA engine, whose
 * rendezvous destinations (the landing pool) it counts with the receive
 * pool. */
#include <stdatomic.h>

#include "loop/loop.h"
#include "transport/thread.h"

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

static void recv_refresh(struct bex__engine_shared *sh)
{
    uint64_t now = bex__now_ms();
    if (sh->recv_refreshed == now)
        return;
    sh->recv_refreshed = now;
    int64_t before = atomic_load(&bex__recv_acct_of(sh)->allocated);
    bex_mem_stats st;
    bex_mem_pool_collect(sh->recv_pool);
    bex_mem_pool_stats(sh->recv_pool, &st);
    int64_t exact = (int64_t)st.in_use_bytes;
    if (sh->landing && sh->landing != sh->recv_pool) {
        bex_mem_pool_collect(sh->landing);
        bex_mem_pool_stats(sh->landing, &st);
        exact += (int64_t)st.in_use_bytes;
    }
    sh->recv_base = exact - before;
}

/* The estimate said full: an exact count, and the answer on it (out of
 * line: the common answer, from the estimate, saves no registers for this
 * one; issue 25 item 5). */
bool bex__recv_room_exact(struct bex__engine_shared *sh, uint64_t want)
{
    recv_refresh(sh);
    return bex__recv_room_in(sh, want);
}
