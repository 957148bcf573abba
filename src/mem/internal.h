/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc internals, shared by the files of src/mem/.
 *
 * Address layout. A chunk is 4 MiB, aligned to 4 MiB, registered once. It
 * is cut into 64 spans of 64 KiB. Span 0 holds the chunk header: one 128-byte
 * descriptor per span (so a span's descriptor is found from any pointer by
 * masking) followed by the MR and the pool's bookkeeping. Spans 1..63 are
 * handed to per-thread heaps in runs of one or more contiguous spans:
 *   - a small run (1..8 spans) is carved into blocks of one size class;
 *   - a medium run (1..32 spans) is one allocation of up to 2 MiB;
 * Anything larger gets its own 4 MiB-aligned mapping ("huge"), whose header
 * looks like a chunk header with only descriptor 0 in use, so the same
 * masking finds it.
 *
 * Ownership. Each heap belongs to one thread at a time. A span's owner-only
 * fields are touched by the owning thread alone (no atomics); other threads
 * touch xfree (a lock-free stack of blocks freed remotely) and, through it,
 * the heap's xspans stack. The pool mutex guards chunk bitmaps, the chunk
 * and heap lists and huge mappings: slow paths only. */
#ifndef BEX_MEM_INTERNAL_H
#define BEX_MEM_INTERNAL_H

#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/mem.h"
#include "common/list.h"
#include "mem/lookup.h"

#define BEX__MEM_LIKELY(x)   __builtin_expect(!!(x), 1)
#define BEX__MEM_UNLIKELY(x) __builtin_expect(!!(x), 0)

#define BEX__MEM_CHUNK_SHIFT       22
#define BEX__MEM_CHUNK_SIZE        ((size_t)1 << BEX__MEM_CHUNK_SHIFT)
#define BEX__MEM_CHUNK_MASK        (BEX__MEM_CHUNK_SIZE - 1)
#define BEX__MEM_SPAN_SHIFT        16
#define BEX__MEM_SPAN_SIZE         ((size_t)1 << BEX__MEM_SPAN_SHIFT)
#define BEX__MEM_SPANS             64 /* spans per chunk, span 0 is the header */
#define BEX__MEM_SPANS_USABLE_MASK (~(uint64_t)1)
#define BEX__MEM_PAGE              4096

/* Size classes: 16-byte steps up to 128 B, then 4 classes per power of two
 * up to 32 KiB (worst internal waste 20 %). */
#define BEX__MEM_NCLS      40
#define BEX__MEM_SMALL_MAX ((size_t)32768)
/* Medium: whole-span runs up to 2 MiB. */
#define BEX__MEM_MAX_RUN    32
#define BEX__MEM_MEDIUM_MAX ((size_t)BEX__MEM_MAX_RUN << BEX__MEM_SPAN_SHIFT)

enum bex__mem_kind {
    BEX__MEM_FREE = 0, /* in the chunk's free bitmap */
    BEX__MEM_CACHED,   /* free run parked in a heap's cache */
    BEX__MEM_SMALL,    /* run carved into blocks of one class */
    BEX__MEM_MEDIUM,   /* run that is one allocation */
    BEX__MEM_HUGE,     /* descriptor 0 of a huge mapping */
    BEX__MEM_TAIL,     /* non-first span of a small run */
    BEX__MEM_LANDING,  /* span of a landing chunk (pages tracked in its land) */
};

/* xfree word, the one field other threads write:
 *   bits 4..47  top block of a stack of blocks freed by other threads;
 *   bits 48..63 how many blocks that stack holds (so the owner accounts for
 *               them without walking it);
 *   bit 0 (NOTIFY) the owner detached the run from its class list (full, or
 *               a medium run) and wants to hear about the next remote free;
 *               it may stay set after the owner re-attaches the run itself;
 *   bit 1 (QUEUED) a remote freer found NOTIFY, cleared it and pushed the
 *               run on heap->xspans; drain() clears it. A queued run is never
 *               released before drain() has seen it. */
#define BEX__MEM_XNOTIFY    ((uintptr_t)1)
#define BEX__MEM_XQUEUED    ((uintptr_t)2)
#define BEX__MEM_XFLAGS     (BEX__MEM_XNOTIFY | BEX__MEM_XQUEUED)
#define BEX__MEM_XPTR_MASK  ((((uintptr_t)1 << 48) - 1) & ~(uintptr_t)15)
#define BEX__MEM_XCNT_SHIFT 48

#define BEX__MEM_NO_CLASS 0xff /* cls of runs that are not small */

struct bex__mem_heap;

struct bex__mem_span {
    /* first line: owner-only; the free fast path reads heap, cls and
     * block_size of the run's head */
    void *free; /* local free list (blocks back in the run) */
    struct bex__mem_heap *heap;
    struct bex__list link; /* class list, or heap cache list */
    uint32_t used;         /* blocks not in the run: held by the user, in the
                              heap's bin, or freed remotely and not collected */
    uint32_t nfree;        /* blocks on the local free list */
    uint32_t capacity;     /* blocks in the run */
    uint32_t block_size;
    uint32_t bump; /* small: bytes of the run carved so far;
                      medium: offset of the block in the run */
    uint8_t kind;
    uint8_t cls;        /* size class, BEX__MEM_NO_CLASS if not small */
    uint8_t attached;   /* in the heap's class list */
    uint8_t offset;     /* descriptors back to the run's head (TAIL only) */
    uint8_t span_count; /* run length in spans (head only) */
    uint8_t xclean;     /* medium: xfree is known to hold just NOTIFY */
    /* second line: written by other threads */
    alignas(64) _Atomic uintptr_t xfree;
    struct bex__mem_span *xnext; /* link in heap->xspans, written by the queuer */
};

struct bex__mem_bin;

/* What the free fast path needs of a span, packed four to a cache line so
 * the lookups of a large working set stay in L1 (the descriptors are two
 * lines each). For a span of a small run, the descriptor's heap and the
 * heap's bin of its cls: the free pushes there without working out the bin
 * from the class (issue 25 item 2). For every other span the ownerless
 * heap and NULL, so that the free's one test of the heap's owner sends it
 * to the slow path (which reads the descriptor). */
struct bex__mem_fast {
    struct bex__mem_heap *heap;
    struct bex__mem_bin *bin;
};

struct bex__mem_chunk {
    struct bex__mem_span spans[BEX__MEM_SPANS];
    struct bex__mem_fast fast[BEX__MEM_SPANS];
    bex_mem_region mr;
    struct bex_mem_pool *pool;
    size_t map_size; /* bytes mapped */
    size_t usable;   /* huge: bytes usable at the user pointer */
    /* owning heap only (pool lock while the pool holds it empty): */
    uint64_t free_mask;     /* bit i = span i free */
    unsigned max_run;       /* longest run of free spans */
    struct bex__list blink; /* heap bucket by max_run / pool empty list */
    /* pool lock: */
    struct bex__list link;      /* all regular chunks / huge lists */
    struct bex__mem_land *land; /* landing chunks: page map, in span 0 */
};

/* Cache colour of chunk headers. Chunks are 4 MiB aligned, so headers at
 * their very start would all map to the same few cache sets, and the
 * descriptors of many chunks would evict each other. The header sits at
 * an offset derived from the chunk's address bits instead, which costs two
 * ALU operations per lookup and no memory access. The step is 1 KiB, the
 * size of the fast descriptors' array: a pointer's bits 16..26 (span
 * index, then colour) shifted down by 12 are then its fast descriptor's
 * offset from the array at colour 0, one shift and one mask
 * (bex__mem_fast_of; a step of 512 took five operations more on every
 * free, issue 25 item 2). The arrays of the 32 colours tile the cache's
 * sets as evenly as with the smaller step (every array and every
 * descriptor table spans at least 1 KiB). */
#define BEX__MEM_COLOURS      32
#define BEX__MEM_COLOUR_SHIFT 10
#define BEX__MEM_COLOUR_STEP  ((size_t)1 << BEX__MEM_COLOUR_SHIFT)

/* User data of a huge mapping starts here; descriptor 0 covers it. */
#define BEX__MEM_HUGE_HDR                                                                          \
    (((BEX__MEM_COLOURS - 1) * BEX__MEM_COLOUR_STEP + sizeof(struct bex__mem_chunk) +              \
      BEX__MEM_PAGE - 1) &                                                                         \
     ~(size_t)(BEX__MEM_PAGE - 1))

/* Landing chunks (pools of kind BEX_MEM_POOL_LANDING) hold peer-writable
 * payloads only. Only spans 1..63 are registered; the header, with this
 * page map right behind it, stays in the unregistered span 0. Allocations
 * are runs of whole pages tracked here, out of band: nothing bemalloc reads
 * is ever stored in a page a peer may write, free or not. Pool lock. */
#define BEX__MEM_LAND_PAGES  ((unsigned)(BEX__MEM_CHUNK_SIZE / BEX__MEM_PAGE)) /* 1024 */
#define BEX__MEM_LAND_FIRST  ((unsigned)(BEX__MEM_SPAN_SIZE / BEX__MEM_PAGE))  /* 16 */
#define BEX__MEM_LAND_USABLE (BEX__MEM_LAND_PAGES - BEX__MEM_LAND_FIRST)       /* 1008 */
struct bex__mem_land {
    uint64_t free[BEX__MEM_LAND_PAGES / 64]; /* bit p: page p is free */
    uint16_t len[BEX__MEM_LAND_PAGES];       /* pages of the run starting at p, else 0 */
    unsigned nfree;                          /* free pages */
};

/* Per-class cache of free blocks in front of the runs, tcmalloc-style:
 * the owner's frees push here and its allocations pop here, so the fast
 * paths never write a run descriptor, and a block just freed is the next
 * one handed out (still in cache). Overflow goes back to the runs. The
 * bin itself (struct bex__mem_bin) is mem/lookup.h's, whose
 * bex__mem_bin_take pops one for a caller that holds its thread's bin. */
#define BEX__MEM_BIN_BYTES 524288u /* a bin's limit: this many bytes, 16..1024 blocks */

struct bex__mem_heap {
    /* first: a bin's address is the heap's plus 16 times its class (one
     * add fewer an allocation) */
    struct bex__mem_bin bins[BEX__MEM_NCLS];
    _Atomic uint64_t owner; /* thread id of the owner, BEX__MEM_NO_OWNER if none */
    _Atomic int64_t delta;  /* bytes moved out of runs (to users or bins) and not
                               yet added to the pool counter; slow paths only */
    struct bex__mem_span *active[BEX__MEM_NCLS];   /* class lists' first, or the empty span */
    struct bex__list cls[BEX__MEM_NCLS];           /* class lists (span link) */
    struct bex__list by_run[BEX__MEM_SPANS];       /* owned chunks by longest free run */
    uint64_t run_mask;                             /* bit k: by_run[k] not empty */
    unsigned colour;                               /* next cache colour of a medium run */
    struct bex__list rcache[BEX__MEM_MAX_RUN + 1]; /* free runs by length, LIFO */
    uint8_t rcache_len[BEX__MEM_MAX_RUN + 1];
    size_t rcache_bytes;
    struct bex_mem_pool *pool;
    struct bex__mem_heap *all_next;                     /* pool lock */
    struct bex__mem_heap *orphan_next;                  /* pool lock */
    alignas(64) _Atomic(struct bex__mem_span *) xspans; /* queued by remote freers */
};

#define BEX__MEM_NO_OWNER UINT64_MAX

/* What differs between pool kinds, behind the pool: pool.c reaches a kind
 * only through these, so the layering is pool.c (chunks, mappings, heaps
 * lists, registry) < landing.c (landing pools: page maps) < heap.c
 * (general pools: per-thread heaps; the public entry points, which pick a
 * kind's ops at creation). */
struct bex__mem_kind_ops {
    /* Whether blocks of the pool are still out (pool lock held). */
    bool (*busy)(bex_mem_pool *pool);
    /* General pools: a heap's cached blocks back to their runs, and a
     * heap's runs tidied (orphans); NULL for kinds without heaps. */
    void (*heap_flush)(struct bex__mem_heap *h);
    void (*heap_tidy)(struct bex__mem_heap *h);
};

struct bex_mem_pool {
    /* read-mostly: every allocation reads id */
    uint64_t id; /* unique for the process lifetime; thread caches key on it */
    int kind;    /* BEX_MEM_POOL_*, fixed at creation */
    const struct bex__mem_kind_ops *ops; /* the kind's */
    bex_mem_registrar reg;
    size_t retain;
    /* written on slow paths: kept off id's cache line */
    alignas(64) pthread_mutex_t lock;
    struct bex__list chunks; /* all regular chunks (link) */
    struct bex__list empty;  /* retained empty chunks (blink), LIFO */
    struct bex__list huge_live;
    struct bex__list huge_cached;
    size_t retained_bytes; /* empty chunks + cached huge mappings */
    struct bex__mem_heap *heaps;
    struct bex__mem_heap *orphans;
    _Atomic size_t norphans;   /* hint, read without the lock */
    struct bex__list reg_link; /* registry of live pools */

    alignas(64) _Atomic size_t registered_bytes;
    _Atomic size_t peak_registered_bytes;
    _Atomic size_t nchunks;
    _Atomic uint64_t registrations;
    _Atomic uint64_t deregistrations;
    _Atomic int64_t in_use; /* flushed from heap deltas */
    _Atomic int64_t peak_in_use;
};

extern struct bex__mem_span bex__mem_empty_span;
extern struct bex__mem_heap bex__mem_ownerless_heap;
extern const uint32_t bex__mem_class_size[BEX__MEM_NCLS];
extern const uint8_t bex__mem_class_spans[BEX__MEM_NCLS];

/* Start of the chunk (or huge mapping) holding p. */
static inline uintptr_t bex__mem_base_of(const void *p)
{
    return (uintptr_t)p & ~(uintptr_t)BEX__MEM_CHUNK_MASK;
}

/* The colour's offset (colour * BEX__MEM_COLOUR_STEP) of the chunk
 * holding p: its address bits 22..26 moved down to bits 10..14. */
static inline uintptr_t bex__mem_colour_off(uintptr_t p)
{
    return (p >> (BEX__MEM_CHUNK_SHIFT - BEX__MEM_COLOUR_SHIFT)) &
           ((uintptr_t)(BEX__MEM_COLOURS - 1) << BEX__MEM_COLOUR_SHIFT);
}

static inline struct bex__mem_chunk *bex__mem_header_at(uintptr_t base)
{
    return (struct bex__mem_chunk *)(base + bex__mem_colour_off(base));
}

/* The fast descriptor of the span holding p (any pointer into a chunk,
 * or into a huge mapping's first span): its colour's header and its span
 * index from one shift and mask (see BEX__MEM_COLOUR_STEP; pool.c checks
 * the geometry). */
static inline const struct bex__mem_fast *bex__mem_fast_of(const void *p)
{
    uintptr_t off = ((uintptr_t)p >> (BEX__MEM_SPAN_SHIFT - 4)) &
                    ((uintptr_t)(BEX__MEM_COLOURS * BEX__MEM_SPANS - 1) << 4);
    return (const struct bex__mem_fast *)(bex__mem_base_of(p) +
                                          offsetof(struct bex__mem_chunk, fast) + off);
}

static inline struct bex__mem_chunk *bex__mem_chunk_of(const void *p)
{
    return (struct bex__mem_chunk *)(bex__mem_base_of(p) + bex__mem_colour_off((uintptr_t)p));
}

static inline unsigned bex__mem_span_index(const void *p)
{
    return (unsigned)(((uintptr_t)p >> BEX__MEM_SPAN_SHIFT) & (BEX__MEM_SPANS - 1));
}

static inline char *bex__mem_span_base(struct bex__mem_span *s)
{
    uintptr_t base = bex__mem_base_of(s);
    struct bex__mem_chunk *c = bex__mem_header_at(base);
    return (char *)base + ((size_t)(s - c->spans) << BEX__MEM_SPAN_SHIFT);
}

/* The head descriptor of the run holding p (p from bex_mem_alloc). */
static inline struct bex__mem_span *bex__mem_span_of(const void *p)
{
    struct bex__mem_span *s = &bex__mem_chunk_of(p)->spans[bex__mem_span_index(p)];
    return s - s->offset;
}

extern const uint8_t bex__mem_class_lut_small[65];
extern const uint8_t bex__mem_class_lut_big[257];

/* size <= BEX__MEM_SMALL_MAX */
static inline unsigned bex__mem_class_of(size_t size)
{
    if (size <= 1024)
        return bex__mem_class_lut_small[(size + 15) >> 4];
    return bex__mem_class_lut_big[(size + 127) >> 7];
}

/* pool.c: run and chunk management (pool lock taken inside). */
struct bex__mem_chunk *bex__mem_region_create(bex_mem_pool *pool, size_t len, size_t reg_off);
void bex__mem_region_destroy(bex_mem_pool *pool, struct bex__mem_chunk *c);
struct bex__mem_chunk *bex__mem_pool_chunk_get(bex_mem_pool *pool);
bool bex__mem_pool_chunk_put(bex_mem_pool *pool, struct bex__mem_chunk *c);
void bex__mem_pool_chunk_link(bex_mem_pool *pool, struct bex__mem_chunk *c);
void *bex__mem_huge_alloc(bex_mem_pool *pool, size_t size);
void bex__mem_huge_free(struct bex__mem_chunk *c);
void bex__mem_pool_note_in_use(bex_mem_pool *pool, int64_t delta);
struct bex__mem_heap *bex__mem_pool_heap_adopt(bex_mem_pool *pool);
void bex__mem_pool_heap_orphan(bex_mem_pool *pool, struct bex__mem_heap *h);
bool bex__mem_pool_reclaim(bex_mem_pool *pool);
/* A pool of cfg's kind, whose kind-specific work ops does
 * (bex_mem_pool_create's checks already made). */
int bex__mem_pool_new(const bex_mem_registrar *reg, const bex_mem_config *cfg,
                      const struct bex__mem_kind_ops *ops, bex_mem_pool **out);
/* landing.c: landing pools (pool lock taken inside). */
void *bex__mem_land_alloc(bex_mem_pool *pool, size_t size);
void bex__mem_land_free(void *p);
size_t bex__mem_land_usable(const void *p);
extern const struct bex__mem_kind_ops bex__mem_landing_ops;
/* heap.c */
void bex__mem_heap_tidy(struct bex__mem_heap *h);
void bex__mem_heap_flush_bins(struct bex__mem_heap *h);
/* The calling thread's searches of its list of heaps (the slow path of an
 * allocation from a pool that is not one of the last it used). */
uint64_t bex__mem_heap_lookups(void);

/* pool.c: registry of live pools, for thread-exit handlers. */
void bex__mem_registry_lock(void);
void bex__mem_registry_unlock(void);
bex_mem_pool *bex__mem_registry_find(uint64_t id);
/* pool.c: huge mappings longer than a chunk, for interior-pointer lookup. */
extern _Atomic size_t bex__mem_huge_multi;
struct bex__mem_chunk *bex__mem_huge_lookup(const void *p);
/* The header of the mapping of any pool holding p, NULL if bemalloc mapped
 * nothing there (any pointer; two loads, no lock). */
struct bex__mem_chunk *bex__mem_region_of(const void *p);

#endif
