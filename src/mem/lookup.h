/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc's shortcuts for the rest of the library's per-message paths:
 * region and pool of a buffer in one go (bex_mem_mr + bex_mem_pool_of each
 * find the chunk header again), a block's region inline, and an
 * allocation that says its usable size. */
#ifndef BEX_MEM_LOOKUP_H
#define BEX_MEM_LOOKUP_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/mem.h"

/* pool.c's region table (every 4 MiB slot a mapping of bemalloc's covers,
 * two levels: see there), for the inline lookup below; its geometry and
 * where a chunk header keeps its region and pool are checked against
 * mem/internal.h's in pool.c. */
struct bex__mem_chunk;
#define BEX__MEM_LOOKUP_SHIFT 22 /* BEX__MEM_CHUNK_SHIFT */
#define BEX__MEM_LOOKUP_L1    13
#define BEX__MEM_LOOKUP_L2    (47 - BEX__MEM_LOOKUP_SHIFT - BEX__MEM_LOOKUP_L1)
/* offsetof(struct bex__mem_chunk, mr); pool right after it */
#define BEX__MEM_LOOKUP_MR_OFF 9216
extern _Atomic(_Atomic(struct bex__mem_chunk *) *) bex__mem_huge_l1[1u << BEX__MEM_LOOKUP_L1];
/* a header's cache colour (BEX__MEM_COLOURS, BEX__MEM_COLOUR_STEP) */
#define BEX__MEM_LOOKUP_COLOURS      32
#define BEX__MEM_LOOKUP_COLOUR_SHIFT 10
#define BEX__MEM_LOOKUP_COLOUR_STEP  ((size_t)1 << BEX__MEM_LOOKUP_COLOUR_SHIFT)

/* bex_mem_mr(block) for a block's first byte (a pointer bex_mem_alloc
 * returned, of any pool and size): the header of the mapping it lies in is
 * the one at the start of its 4 MiB slot, a huge mapping's too (its data
 * starts within its first slot; only pointers further into a huge mapping
 * longer than a chunk need bex_mem_mr's table). Inline and without checks:
 * the engine asks it of every fresh receive buffer (bex_mem_mr's call was
 * some 15 instructions a message, issue 25 item 2). */
static inline const bex_mem_region *bex__mem_block_mr(const void *block)
{
    uintptr_t base = (uintptr_t)block & ~(((uintptr_t)1 << BEX__MEM_LOOKUP_SHIFT) - 1);
    /* the colour's offset straight from the address bits (internal.h's
     * bex__mem_colour_off) */
    uintptr_t colour_off =
        ((uintptr_t)block >> (BEX__MEM_LOOKUP_SHIFT - BEX__MEM_LOOKUP_COLOUR_SHIFT)) &
        ((uintptr_t)(BEX__MEM_LOOKUP_COLOURS - 1) << BEX__MEM_LOOKUP_COLOUR_SHIFT);
    return (const bex_mem_region *)(base + colour_off + BEX__MEM_LOOKUP_MR_OFF);
}

/* The registered region of the mapping holding ptr, and in *pool the pool
 * it belongs to; NULL (and *pool NULL) when no pool mapped memory at ptr
 * (malloc's, the stack, a freed huge mapping): any pointer may be asked.
 * Inline: every send checks its buffer with it (a call was some 8
 * instructions more a send, issue 25 item 2). */
static inline const bex_mem_region *bex__mem_lookup(const void *ptr, bex_mem_pool **pool)
{
    /* a caller's pointer, not yet known to be bemalloc's: its header is
     * read only once the region table says a mapping of ours is there */
    uintptr_t slot = (uintptr_t)ptr >> BEX__MEM_LOOKUP_SHIFT;
    size_t i1 = (slot >> BEX__MEM_LOOKUP_L2) & ((1u << BEX__MEM_LOOKUP_L1) - 1);
    _Atomic(struct bex__mem_chunk *) *l2 =
        atomic_load_explicit(&bex__mem_huge_l1[i1], memory_order_acquire);
    struct bex__mem_chunk *c =
        __builtin_expect(l2 != NULL, 1)
            ? atomic_load_explicit(&l2[slot & ((1u << BEX__MEM_LOOKUP_L2) - 1)],
                                   memory_order_acquire)
            : NULL;
    if (!c) {
        *pool = NULL;
        return NULL;
    }
    const bex_mem_region *mr = (const bex_mem_region *)((const char *)c + BEX__MEM_LOOKUP_MR_OFF);
    *pool = *(bex_mem_pool *const *)(const void *)(mr + 1);
    return mr;
}

/* bex_mem_alloc(pool, size), and when it returns a block its usable size
 * (bex_mem_usable_size) in *usable (not NULL): one call where a received
 * message's buffer took two (heap.c). */
void *bex__mem_alloc_usable(bex_mem_pool *pool, size_t size, size_t *usable);

/* A thread's cache of free blocks of one size class of a general pool (a
 * bin of the thread's heap: heap.c's allocations pop it, its frees push
 * it). count is written by the owner only, with a relaxed load and store;
 * the pool's stats read it. */
struct bex__mem_bin {
    void *list;
    _Atomic uint16_t count; /* at most limit + 1 */
    uint16_t cls;           /* its class (bex_mem_usable_size from a span's bin) */
    uint32_t limit;
};

/* The calling thread's bin of size's class in pool, for a thread that
 * allocates blocks of one size from one pool over and over (an I/O
 * thread's receive buffers): bex__mem_bin_take pops it inline, without
 * bex_mem_alloc's call, its test of the thread's cached pool (a swap when
 * the thread alternates two pools) and its class lookup (some 30
 * instructions a received message, issue 25 item 2). NULL when the pool
 * has no bins for size (a landing pool, a block above the small classes)
 * or the thread's heap cannot be made. The bin is the calling thread's:
 * only it may take from it, until it exits or the pool is destroyed. */
struct bex__mem_bin *bex__mem_thread_bin(bex_mem_pool *pool, size_t size);

/* A bin that is always empty (never written: bex__mem_bin_take of it
 * reads its list alone), for a caller's "no bin yet" without a test of its
 * own. */
extern struct bex__mem_bin bex__mem_bin_none;

/* A block of b's class from b (the calling thread's, bex__mem_thread_bin,
 * or bex__mem_bin_none), or NULL when b is empty: then bex_mem_alloc
 * refills it. */
static inline void *bex__mem_bin_take(struct bex__mem_bin *b)
{
    void *p = b->list;
    if (__builtin_expect(p != NULL, 1)) {
        b->list = *(void **)p;
        atomic_store_explicit(&b->count,
                              (uint16_t)(atomic_load_explicit(&b->count, memory_order_relaxed) - 1),
                              memory_order_relaxed);
    }
    return p;
}

#endif
