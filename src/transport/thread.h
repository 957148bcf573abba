/* SPDX-License-Identifier: Apache-2.0 */
/* Per-I/O-thread resources every transport instance of the thread shares
 * (RDMA engines and TCP connections alike): the device, CQ and SRQ of the
 * RDMA engines, the pools, statistics and log, and the context's received
 * memory accounting. Below both transports: rdma/ and tcp/ include it,
 * neither includes the other. */
#ifndef BEX_TRANSPORT_THREAD_H
#define BEX_TRANSPORT_THREAD_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "bex/mem.h"
#include "rdma/rdma.h"

/* Received memory, counted per context (thread.c): bytes allocated by the
 * I/O threads (only grows; frees are learnt from exact counts) and bytes
 * in posted receive buffers; and the connections holding partly received
 * messages, among which the TCP transport shares the budget (tcp.c). */
struct bex__recv_acct {
    _Atomic int64_t allocated, posted;
    _Atomic int32_t holders; /* TCP connections holding partly received messages */
};

struct bex__srq;

/* Per-I/O-thread resources every engine of the thread shares. */
struct bex__engine_shared {
    struct bex__rdma_dev *dev;
    struct bex__rdma_path path; /* device, port, GID index, active MTU */
    struct bex__rdma_conn_config conn;
    struct ibv_pd *pd;     /* dev->pd, or a thread domain's parent domain */
    struct ibv_cq *cq;     /* the I/O thread's CQ, for every queue */
    struct bex__srq *srq;  /* SRQ mode: the thread's shared receive queue (srq.h);
                              NULL: a receive queue per QP */
    bex_mem_pool *pool;    /* general pool: headers, SEND buffers (local access only) */
    bex_mem_pool *landing; /* peer-writable payloads: rendezvous destinations
                              (a BEX_MEM_POOL_LANDING pool the context owns) */
    bool windows;          /* window mode: landing memory is registered MW_BIND and
                              each destination is reached through a type-2 window
                              bound on its engine's QP (docs/security.md) */
    struct bex__stats *stats;
    struct bex__log *log; /* the context's logger */
    /* Received buffers (eager receives and rendezvous destinations) come from
     * recv_pool, which only the I/O threads allocate from, and are bounded
     * per context: see bex__recv_room() in thread.c. */
    bex_mem_pool *recv_pool;
    uint64_t recv_max; /* received-but-not-freed bytes allowed; 0 = no limit */
    /* the context's counters, shared by its I/O threads (NULL: recv_own;
     * an RDMA engine's creation sets it to recv_own then, so that its
     * receive path reads it without bex__recv_acct_of's test) */
    struct bex__recv_acct *recv_acct;
    struct bex__recv_acct recv_own;
    int64_t recv_base;       /* this thread's last exact count less the allocated
                                counter then: base + allocated is never below the truth */
    uint64_t recv_refreshed; /* bex__now_ms() of this thread's last exact count */
};

/* The context's counters (sh->recv_acct, or the thread's own). These
 * and the three below inline: the engine asks and counts once or twice a
 * message (issue 25 item 2: bex__recv_room's call and frame were 17
 * instructions a round trip for one estimate). */
static inline struct bex__recv_acct *bex__recv_acct_of(struct bex__engine_shared *sh)
{
    return sh->recv_acct ? sh->recv_acct : &sh->recv_own;
}

/* The estimate of what the context holds (a: bex__recv_acct_of(sh)) says
 * want may come? With
 * nothing held, one message of any size may: a limit below max_msg slows,
 * it never stops, a connection. */
static inline bool bex__recv_room_at(struct bex__engine_shared *sh, struct bex__recv_acct *a,
                                     uint64_t want)
{
    int64_t held = sh->recv_base + atomic_load_explicit(&a->allocated, memory_order_relaxed) -
                   atomic_load_explicit(&a->posted, memory_order_relaxed);
    return held <= 0 || (uint64_t)held + want <= sh->recv_max;
}

static inline bool bex__recv_room_in(struct bex__engine_shared *sh, uint64_t want)
{
    return bex__recv_room_at(sh, bex__recv_acct_of(sh), want);
}

/* The estimate said full: an exact count (at most once a clock tick), and
 * the answer on it (thread.c). */
bool bex__recv_room_exact(struct bex__engine_shared *sh, uint64_t want);

/* May want more bytes be received (recv_max)? */
static inline bool bex__recv_room(struct bex__engine_shared *sh, uint64_t want)
{
    if (!sh->recv_max || bex__recv_room_in(sh, want))
        return true;
    return bex__recv_room_exact(sh, want);
}

/* A received buffer of size bytes was allocated / posted (+) or taken
 * from a posted receive (-); _at: a is bex__recv_acct_of(sh), read once
 * by a caller that asks the estimate too. */
static inline void bex__recv_allocated_at(struct bex__recv_acct *a, int64_t size)
{
    atomic_fetch_add(&a->allocated, size);
}

static inline void bex__recv_allocated(struct bex__engine_shared *sh, int64_t size)
{
    bex__recv_allocated_at(bex__recv_acct_of(sh), size);
}

static inline void bex__recv_posted(struct bex__engine_shared *sh, int64_t size)
{
    atomic_fetch_add_explicit(&bex__recv_acct_of(sh)->posted, size, memory_order_relaxed);
}

#endif
