/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc: an allocator whose memory is already registered with the NIC.
 *
 * Memory comes from 4 MiB chunks, aligned to their size, each registered
 * once through a *registrar* when the chunk is mapped and deregistered when
 * it is returned to the system. The chunk header holds the memory region, so
 * bex_mem_mr() finds the MR of any pointer in O(1) by masking the pointer.
 * Allocations larger than a chunk get their own aligned, separately
 * registered mapping, found the same way.
 *
 * Threads: every function may be called from any thread. A buffer may be
 * freed by a thread other than the one that allocated it (the usual case
 * for received messages handed to application threads).
 *
 * bemalloc does not interpose malloc(): it lives beside the process's own
 * allocator and serves network-bound buffers only. */
#ifndef BEX_MEM_H
#define BEX_MEM_H

#include <stddef.h>
#include <stdint.h>

#include "bex/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with -fvisibility=hidden: what is declared here is
 * its interface, everything else stays inside. */
#pragma GCC visibility push(default)

struct ibv_pd;
struct ibv_context;

/* A registered region as bemalloc reports it. For a pointer p returned by
 * bex_mem_alloc(), [p, p + bex_mem_usable_size(p)) lies inside
 * [addr, addr + length). In a landing pool the region is exactly the
 * payload pages of p's chunk (or huge mapping), nothing else. */
typedef struct bex_mem_region {
    void *addr;    /* start of the registered region */
    size_t length; /* its length in bytes */
    uint32_t lkey; /* local key, for scatter/gather entries */
    uint32_t rkey; /* remote key, for a peer's WRITE/READ */
    void *handle;  /* the registrar's own object (struct ibv_mr * for verbs) */
} bex_mem_region;

/* How a pool registers memory. reg() fills lkey, rkey and handle of *mr
 * (addr and length are already set) and returns 0 or a negative errno;
 * dereg() undoes it. Both are called rarely (once per chunk), never on the
 * allocation fast path, possibly from any thread that allocates. */
typedef struct bex_mem_registrar {
    int (*reg)(void *ctx, bex_mem_region *mr);
    void (*dereg)(void *ctx, bex_mem_region *mr);
    void *ctx;
} bex_mem_registrar;

/* Default access flags of the verbs registrar. */
#define BEX_MEM_ACCESS_DEFAULT 0 /* local write only: no peer may touch it */

/* A registrar over a verbs protection domain: ibv_reg_mr(pd, ..., access).
 * access = 0 means IBV_ACCESS_LOCAL_WRITE alone: memory a peer must not
 * reach. Memory a peer may write belongs in a landing pool (below),
 * registered with IBV_ACCESS_REMOTE_WRITE (or IBV_ACCESS_MW_BIND, for
 * memory windows). access may carry optional flags, which a provider
 * without them ignores: a bex context adds IBV_ACCESS_RELAXED_ORDERING
 * (bex_ctx_config.relaxed_ordering). The PD must outlive every pool using
 * it. */
void bex_mem_registrar_verbs(bex_mem_registrar *out, struct ibv_pd *pd, int access);

/* A registrar that registers nothing (TCP-only use); keys are 0. */
void bex_mem_registrar_noop(bex_mem_registrar *out);

/* Pool kinds.
 * GENERAL: the allocator described above; its chunk headers and free lists
 *   live inside the registered chunks, so its registrar must grant no
 *   remote access.
 * LANDING: memory a peer may write (rendezvous destinations, exposed
 *   buffers). Each allocation is a run of whole pages (4 KiB aligned, usable
 *   size a multiple of 4 KiB) in a chunk whose registered range holds
 *   payload pages only: every piece of bookkeeping (header, page map, the
 *   free state of a page) lies outside it, so what a peer writes through
 *   the chunk's key, anywhere, can only change payload bytes. Allocation and
 *   free take the pool lock (no per-thread caches): meant for buffers of a
 *   few KiB and up, not for small hot objects. */
enum { BEX_MEM_POOL_GENERAL = 0, BEX_MEM_POOL_LANDING = 1 };

/* Pool configuration; zero in any field means its default. */
/* clang-format off */
#define BEX_MEM_CONFIG_INIT {.size = sizeof(bex_mem_config)}
/* clang-format on */
typedef struct bex_mem_config {
    size_t size;         /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    size_t retain_bytes; /* fully free chunk bytes kept registered
                            (default 64 MiB); beyond this, empty chunks
                            are deregistered and unmapped */
    int kind;            /* BEX_MEM_POOL_* (GENERAL) */
} bex_mem_config;

typedef struct bex_mem_pool bex_mem_pool;

/* Create a pool. *reg is copied. cfg may be NULL. Returns 0 or -ENOMEM /
 * -EINVAL (also for an unknown kind). */
int bex_mem_pool_create(const bex_mem_registrar *reg, const bex_mem_config *cfg,
                        bex_mem_pool **out);

/* Register ahead: make sure the pool holds, empty and registered, enough
 * chunks for count more allocations of size bytes (small or medium: at most
 * 2 MiB), so that they do not stop for a registration (a few ms on a real
 * NIC for 4 MiB, tens of ms on Soft-RoCE). Counts only fully empty chunks
 * (free space in chunks already in use comes on top), and at most
 * retain_bytes of them (more would be released again). For a caller that
 * knows a burst of allocations is coming, such as an engine that will
 * refill its receive buffers while the application holds the ones it got.
 * 0, -EINVAL (NULL, a landing pool, a huge size) or the registrar's error. */
int bex_mem_pool_reserve(bex_mem_pool *pool, size_t count, size_t size);

/* The pool's BEX_MEM_POOL_* kind, or -EINVAL for NULL. */
int bex_mem_pool_kind(const bex_mem_pool *pool);

/* Destroy a pool: deregisters and unmaps all its memory. Every buffer of the
 * pool must have been freed, and no thread may use the pool any more.
 * Returns 0, or -EBUSY (and destroys nothing) when buffers are still live. */
int bex_mem_pool_destroy(bex_mem_pool *pool);

/* Allocate size bytes (size 0 gives a minimal buffer), 16-byte aligned (and
 * 4 KiB aligned from 64 KiB up; always 4 KiB aligned in a landing pool). Registered and owned by
 * the caller. Returns NULL when memory or registration fails (errno set to ENOMEM or the
 * registrar's error). */
void *bex_mem_alloc(bex_mem_pool *pool, size_t size);

/* Free a buffer from bex_mem_alloc(); any thread; NULL is ignored. */
void bex_mem_free(void *ptr);

/* Bytes usable at ptr (>= the size asked for). */
size_t bex_mem_usable_size(const void *ptr);

/* The registered region covering ptr, in O(1). ptr may point anywhere inside
 * a live allocation. The result stays valid while the allocation is live. */
const bex_mem_region *bex_mem_mr(const void *ptr);

/* The pool a live buffer belongs to. */
bex_mem_pool *bex_mem_pool_of(const void *ptr);

typedef struct bex_mem_stats {
    size_t registered_bytes;  /* bytes currently registered */
    size_t chunks;            /* chunks (and large mappings) currently mapped */
    uint64_t registrations;   /* successful reg() calls so far */
    uint64_t deregistrations; /* dereg() calls so far */
    size_t in_use_bytes;      /* bytes handed out and not yet freed (usable sizes);
                                 a buffer freed by a thread other than its
                                 allocator's counts until that heap collects it */
    size_t peak_in_use_bytes; /* sampled on slow paths and at each stats call:
                                 may miss short peaks, may include up to a few
                                 MiB per thread of cached free blocks */
    size_t peak_registered_bytes;
} bex_mem_stats;

/* A snapshot of the pool's counters (approximate while other threads run). */
void bex_mem_pool_stats(bex_mem_pool *pool, bex_mem_stats *out);

/* Take back into the calling thread's heap of pool every block other threads
 * have freed into it so far, and publish the heap's counts: after this, the
 * next bex_mem_pool_stats() counts those frees. Without it a remote free
 * counts as in use until the allocating thread happens to need the block's
 * run again. For a pool one thread allocates from while others free (the
 * buffers a context receives). Cheap (no system call, the pool lock only for
 * runs that became empty); a thread without a heap in pool does nothing. */
void bex_mem_pool_collect(bex_mem_pool *pool);

/* The registrar pool was created with (a copy): to make a sibling pool that
 * registers its memory the same way. */
void bex_mem_pool_registrar(const bex_mem_pool *pool, bex_mem_registrar *out);

/* The process-wide default pool, the paper's Figure 3 shape:
 *   bex_mem_default_init(ctx);  void *p = bex_mem_default_alloc(n);
 *   const bex_mem_region *mr = bex_mem_mr(p);  bex_mem_free(p);
 * init with a device context registers with a verbs registrar on the
 * process's one PD of that device (the one every bex context on the device
 * uses: bex_ctx_pd), allocating none of its own; ctx == NULL gives a no-op
 * registrar. Returns 0, -EALREADY when already initialized, or an error. */
int bex_mem_default_init(struct ibv_context *ctx);
/* The default pool's PD (NULL before init or with ctx == NULL). */
struct ibv_pd *bex_mem_default_pd(void);
bex_mem_pool *bex_mem_default_pool(void);
void *bex_mem_default_alloc(size_t size);
/* Tear the default pool down (same rules as bex_mem_pool_destroy). */
int bex_mem_default_fini(void);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif
