/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc pools: chunks and their registration, huge mappings,
 * statistics and teardown. Everything here runs on slow paths, under the
 * pool mutex; registration and mmap/munmap run outside it, so one thread
 * registering a chunk does not stall the others' span refills. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "mem/internal.h"
#include "mem/lookup.h"

#define DEFAULT_RETAIN ((size_t)64 << 20)

const uint32_t bex__mem_class_size[BEX__MEM_NCLS] = {
    16,   32,   48,   64,   80,    96,    112,   128,   160,   192,   224,   256,   320,  384,
    448,  512,  640,  768,  896,   1024,  1280,  1536,  1792,  2048,  2560,  3072,  3584, 4096,
    5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768,
};
/* Size -> class without arithmetic: by 16 B up to 1 KiB, by 128 B above
 * (every class boundary above 1 KiB is a multiple of 256). */
const uint8_t bex__mem_class_lut_small[65] = {
    0,  0,  1,  2,  3,  4,  5,  6,  7,  8,  8,  9,  9,  10, 10, 11, 11, 12, 12, 12, 12, 13,
    13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15, 16, 16, 16, 16, 16, 16, 16, 16, 17, 17, 17,
    17, 17, 17, 17, 17, 18, 18, 18, 18, 18, 18, 18, 18, 19, 19, 19, 19, 19, 19, 19, 19,
};
const uint8_t bex__mem_class_lut_big[257] = {
    20, 20, 20, 20, 20, 20, 20, 20, 20, 20, 20, 21, 21, 22, 22, 23, 23, 24, 24, 24, 24, 25, 25, 25,
    25, 26, 26, 26, 26, 27, 27, 27, 27, 28, 28, 28, 28, 28, 28, 28, 28, 29, 29, 29, 29, 29, 29, 29,
    29, 30, 30, 30, 30, 30, 30, 30, 30, 31, 31, 31, 31, 31, 31, 31, 31, 32, 32, 32, 32, 32, 32, 32,
    32, 32, 32, 32, 32, 32, 32, 32, 32, 33, 33, 33, 33, 33, 33, 33, 33, 33, 33, 33, 33, 33, 33, 33,
    33, 34, 34, 34, 34, 34, 34, 34, 34, 34, 34, 34, 34, 34, 34, 34, 34, 35, 35, 35, 35, 35, 35, 35,
    35, 35, 35, 35, 35, 35, 35, 35, 35, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36,
    36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 36, 37, 37, 37, 37, 37, 37, 37,
    37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37, 37,
    37, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38, 38,
    38, 38, 38, 38, 38, 38, 38, 38, 38, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39,
    39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39, 39,
};

/* Spans per small run: enough for at least 16 blocks, so big classes do
 * not churn through runs; capped at 8 spans (512 KiB). */
const uint8_t bex__mem_class_spans[BEX__MEM_NCLS] = {
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8,
};

/* ---- registry of live pools ---------------------------------------------
 * A thread's exit handler must know whether the pools it holds heaps of
 * still exist; pools are looked up by id under this mutex, which
 * bex_mem_pool_destroy() also takes, so the two never overlap. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static struct bex__list registry = {&registry, &registry};
static _Atomic uint64_t next_pool_id = 1;

void bex__mem_registry_lock(void)
{
    pthread_mutex_lock(&registry_lock);
}
void bex__mem_registry_unlock(void)
{
    pthread_mutex_unlock(&registry_lock);
}

bex_mem_pool *bex__mem_registry_find(uint64_t id)
{
    struct bex__list *pos;
    bex__list_foreach(pos, &registry)
    {
        bex_mem_pool *p = bex__list_entry(pos, bex_mem_pool, reg_link);
        if (p->id == id)
            return p;
    }
    return NULL;
}

/* ---- the region table -----------------------------------------------------
 * Every mapping (regular chunk, landing chunk, huge mapping) enters each
 * 4 MiB slot it covers in a two-level table, so that any address can be
 * asked whether bemalloc mapped it (bex__mem_region_of: a caller's pointer
 * checked before its header is read) and, inside a huge mapping longer
 * than 4 MiB, where its header is (masking an interior pointer lands on
 * user data there): bex_mem_mr() accepts interior pointers. The free and
 * lookup fast paths consult it only while such a mapping exists. */
#define L1_BITS 13
#define L2_BITS (47 - BEX__MEM_CHUNK_SHIFT - L1_BITS)
/* (named for mem/lookup.h's inline bex__mem_lookup, which reads it) */
#define huge_l1 bex__mem_huge_l1
_Atomic(_Atomic(struct bex__mem_chunk *) *) huge_l1[1u << L1_BITS];
_Static_assert(BEX__MEM_LOOKUP_SHIFT == BEX__MEM_CHUNK_SHIFT && BEX__MEM_LOOKUP_L1 == L1_BITS &&
                   BEX__MEM_LOOKUP_L2 == L2_BITS,
               "mem/lookup.h's region table is this one");
_Static_assert(offsetof(struct bex__mem_chunk, mr) == BEX__MEM_LOOKUP_MR_OFF &&
                   offsetof(struct bex__mem_chunk, pool) ==
                       BEX__MEM_LOOKUP_MR_OFF + sizeof(bex_mem_region),
               "mem/lookup.h reads a chunk's region and pool at these offsets");
_Static_assert(BEX__MEM_LOOKUP_COLOURS == BEX__MEM_COLOURS &&
                   BEX__MEM_LOOKUP_COLOUR_SHIFT == BEX__MEM_COLOUR_SHIFT &&
                   BEX__MEM_HUGE_HDR < BEX__MEM_CHUNK_SIZE,
               "mem/lookup.h's bex__mem_block_mr finds a header as bex__mem_chunk_of does");
/* bex__mem_fast_of's one shift and mask: a colour's step is the fast
 * array's size, 16 bytes an entry, and a huge mapping's user data starts in
 * its first span (descriptor 0 is the one its frees read). */
_Static_assert(sizeof(struct bex__mem_fast) == 16 &&
                   BEX__MEM_SPANS * sizeof(struct bex__mem_fast) == BEX__MEM_COLOUR_STEP &&
                   BEX__MEM_SPAN_SHIFT - 4 == BEX__MEM_CHUNK_SHIFT - BEX__MEM_COLOUR_SHIFT &&
                   BEX__MEM_HUGE_HDR < BEX__MEM_SPAN_SIZE,
               "bex__mem_fast_of's geometry");
_Atomic size_t bex__mem_huge_multi;

/* Install the table's second level i1 (mapped on first use): it, or
 * NULL when the mapping failed. */
static _Atomic(struct bex__mem_chunk *) *huge_l2_create(size_t i1)
{
    size_t len = sizeof(_Atomic(struct bex__mem_chunk *)) << L2_BITS;
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    _Atomic(struct bex__mem_chunk *) *expect = NULL;
    if (atomic_compare_exchange_strong_explicit(&huge_l1[i1], &expect, m, memory_order_acq_rel,
                                                memory_order_acquire))
        return m;
    munmap(m, len); /* another thread installed it first */
    return expect;
}

/* The table's entry for addr's slot: NULL when its second level does not
 * exist and create is false (or its mapping failed). Inline: with create
 * false (every lookup) it is a shift, two loads and a test. */
static inline __attribute__((always_inline)) _Atomic(struct bex__mem_chunk *) *
huge_slot(uintptr_t addr, bool create)
{
    uintptr_t slot = addr >> BEX__MEM_CHUNK_SHIFT;
    size_t i1 = (slot >> L2_BITS) & ((1u << L1_BITS) - 1);
    _Atomic(struct bex__mem_chunk *) *l2 = atomic_load_explicit(&huge_l1[i1], memory_order_acquire);
    if (__builtin_expect(!l2, 0)) {
        if (!create)
            return NULL;
        l2 = huge_l2_create(i1);
        if (!l2)
            return NULL;
    }
    return &l2[slot & ((1u << L2_BITS) - 1)];
}

struct bex__mem_chunk *bex__mem_huge_lookup(const void *p)
{
    _Atomic(struct bex__mem_chunk *) *e = huge_slot((uintptr_t)p, false);
    return e ? atomic_load_explicit(e, memory_order_acquire) : NULL;
}

struct bex__mem_chunk *bex__mem_region_of(const void *p)
{
    return bex__mem_huge_lookup(p);
}

/* Enter c in (val c) or take it out of (val NULL) every slot it covers. */
static int huge_table_set(struct bex__mem_chunk *c, struct bex__mem_chunk *val)
{
    uintptr_t base = bex__mem_base_of(c);
    uintptr_t a = base, end = base + c->map_size;
    for (; a < end; a += BEX__MEM_CHUNK_SIZE) {
        _Atomic(struct bex__mem_chunk *) *e = huge_slot(a, val != NULL);
        if (!e)
            return -ENOMEM; /* only when creating; the caller unwinds */
        atomic_store_explicit(e, val, memory_order_release);
    }
    return 0;
}

/* ---- mapping and registration ------------------------------------------ */

static void stat_max(_Atomic size_t *peak, size_t v)
{
    size_t cur = atomic_load_explicit(peak, memory_order_relaxed);
    while (v > cur && !atomic_compare_exchange_weak_explicit(peak, &cur, v, memory_order_relaxed,
                                                             memory_order_relaxed))
        ;
}

/* mmap len bytes aligned to a chunk: over-map, then trim both ends. */
static void *map_aligned(size_t len)
{
    size_t over = len + BEX__MEM_CHUNK_SIZE - BEX__MEM_PAGE;
    char *raw = mmap(NULL, over, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    char *al = (char *)(((uintptr_t)raw + BEX__MEM_CHUNK_MASK) & ~(uintptr_t)BEX__MEM_CHUNK_MASK);
    if (al > raw)
        munmap(raw, (size_t)(al - raw));
    if (raw + over > al + len)
        munmap(al + len, (size_t)(raw + over - (al + len)));
    if ((uintptr_t)al + len > ((uintptr_t)1 << 47)) {
        /* xfree packs a count above bit 48: refuse addresses it can't hold. */
        munmap(al, len);
        errno = ENOMEM;
        return NULL;
    }
    return al;
}

/* Map a chunk-aligned region of len bytes and register [reg_off, len) of
 * it (landing pools keep their header out of the registered range); its
 * header is set up except for kind-specific fields. Returns NULL with errno
 * set. */
struct bex__mem_chunk *bex__mem_region_create(bex_mem_pool *pool, size_t len, size_t reg_off)
{
    void *base = map_aligned(len);
    if (!base)
        return NULL;
    struct bex__mem_chunk *c = bex__mem_header_at((uintptr_t)base);
    c->mr.addr = (char *)base + reg_off;
    c->mr.length = len - reg_off;
    c->pool = pool;
    c->map_size = len;
    int rc = pool->reg.reg(pool->reg.ctx, &c->mr);
    if (rc != 0) {
        munmap(base, len);
        errno = rc < 0 ? -rc : rc;
        return NULL;
    }
    if (huge_table_set(c, c) != 0) {
        huge_table_set(c, NULL);
        pool->reg.dereg(pool->reg.ctx, &c->mr);
        munmap(base, len);
        errno = ENOMEM;
        return NULL;
    }
    atomic_fetch_add_explicit(&pool->registrations, 1, memory_order_relaxed);
    size_t r =
        atomic_fetch_add_explicit(&pool->registered_bytes, c->mr.length, memory_order_relaxed) +
        c->mr.length;
    stat_max(&pool->peak_registered_bytes, r);
    atomic_fetch_add_explicit(&pool->nchunks, 1, memory_order_relaxed);
    return c;
}

void bex__mem_region_destroy(bex_mem_pool *pool, struct bex__mem_chunk *c)
{
    size_t len = c->map_size;
    huge_table_set(c, NULL);
    pool->reg.dereg(pool->reg.ctx, &c->mr);
    atomic_fetch_add_explicit(&pool->deregistrations, 1, memory_order_relaxed);
    atomic_fetch_sub_explicit(&pool->registered_bytes, c->mr.length, memory_order_relaxed);
    atomic_fetch_sub_explicit(&pool->nchunks, 1, memory_order_relaxed);
    munmap((void *)bex__mem_base_of(c), len);
}

/* ---- chunks ---------------------------------------------------------------
 * Regular chunks belong to one heap at a time, which cuts runs out of them
 * without locks (see heap.c). The pool only hands out empty chunks and
 * takes them back: it keeps up to retain_bytes of them registered. */

/* Put a new chunk at the head of the pool's list (pool lock held). */
void bex__mem_pool_chunk_link(bex_mem_pool *pool, struct bex__mem_chunk *c)
{
    bex__list_push_head(&pool->chunks, &c->link);
}

/* A new registered chunk, empty, on the pool's list. NULL + errno. */
static struct bex__mem_chunk *chunk_new(bex_mem_pool *pool)
{
    struct bex__mem_chunk *c = bex__mem_region_create(pool, BEX__MEM_CHUNK_SIZE, 0);
    if (!c)
        return NULL;
    c->free_mask = BEX__MEM_SPANS_USABLE_MASK;
    c->max_run = BEX__MEM_SPANS - 1;
    /* Descriptor 0 is never a run; a stray free of a header pointer takes
     * the ownerless path instead of corrupting a heap. */
    c->spans[0].kind = BEX__MEM_HUGE;
    c->spans[0].cls = BEX__MEM_NO_CLASS;
    c->spans[0].heap = &bex__mem_ownerless_heap;
    for (unsigned i = 0; i < BEX__MEM_SPANS; i++) /* no run yet (bex__mem_fast) */
        c->fast[i] = (struct bex__mem_fast){&bex__mem_ownerless_heap, NULL};
    pthread_mutex_lock(&pool->lock);
    bex__mem_pool_chunk_link(pool, c);
    pthread_mutex_unlock(&pool->lock);
    return c;
}

/* An empty chunk for a heap: a retained one, else a new registration.
 * NULL + errno. */
struct bex__mem_chunk *bex__mem_pool_chunk_get(bex_mem_pool *pool)
{
    for (int round = 0;; round++) {
        pthread_mutex_lock(&pool->lock);
        struct bex__list *e = bex__list_first(&pool->empty);
        struct bex__mem_chunk *c = e ? bex__list_entry(e, struct bex__mem_chunk, blink) : NULL;
        if (c) {
            bex__list_remove(e);
            pool->retained_bytes -= BEX__MEM_CHUNK_SIZE;
        }
        pthread_mutex_unlock(&pool->lock);
        if (c)
            return c;
        /* Dead threads' heaps may hold chunks that remote frees emptied
         * after they died: look there before growing. */
        if (round > 0 || !atomic_load_explicit(&pool->norphans, memory_order_relaxed) ||
            !bex__mem_pool_reclaim(pool))
            break;
    }
    return chunk_new(pool);
}

/* Blocks of size bytes (small or medium) that one chunk's usable spans hold. */
static size_t blocks_per_chunk(size_t size)
{
    size_t usable = (size_t)(BEX__MEM_SPANS - 1) << BEX__MEM_SPAN_SHIFT;
    if (size <= BEX__MEM_SMALL_MAX) {
        unsigned c = bex__mem_class_of(size);
        size_t run = (size_t)bex__mem_class_spans[c] << BEX__MEM_SPAN_SHIFT;
        return (usable / run) * (run / bex__mem_class_size[c]);
    }
    return (BEX__MEM_SPANS - 1) / ((size + BEX__MEM_SPAN_SIZE - 1) >> BEX__MEM_SPAN_SHIFT);
}

int bex_mem_pool_reserve(bex_mem_pool *pool, size_t count, size_t size)
{
    if (!pool || pool->kind != BEX_MEM_POOL_GENERAL || size > BEX__MEM_MEDIUM_MAX)
        return -EINVAL;
    if (!count || !size)
        return 0;
    size_t per = blocks_per_chunk(size);
    size_t want = count / per + (count % per != 0);
    if (want > pool->retain / BEX__MEM_CHUNK_SIZE)
        want = pool->retain / BEX__MEM_CHUNK_SIZE; /* more would be released again */
    pthread_mutex_lock(&pool->lock);
    size_t have = 0;
    struct bex__list *pos;
    bex__list_foreach(pos, &pool->empty)
    {
        if (have == want)
            break;
        have++;
    }
    pthread_mutex_unlock(&pool->lock);
    for (; have < want; have++) {
        struct bex__mem_chunk *c = chunk_new(pool);
        if (!c)
            return errno ? -errno : -ENOMEM;
        /* retained (kept empty for the next heap that needs one) unless the
         * retention is full of huge mappings: then it is released at once,
         * and so would any more */
        if (!bex__mem_pool_chunk_put(pool, c))
            break;
    }
    return 0;
}

/* A heap gives back an empty chunk: retained up to retain_bytes, else
 * deregistered and unmapped. Whether it was retained. */
bool bex__mem_pool_chunk_put(bex_mem_pool *pool, struct bex__mem_chunk *c)
{
    bool release = false;
    pthread_mutex_lock(&pool->lock);
    if (pool->retained_bytes + BEX__MEM_CHUNK_SIZE > pool->retain) {
        bex__list_remove(&c->link);
        release = true;
    } else {
        bex__list_push_head(&pool->empty, &c->blink);
        pool->retained_bytes += BEX__MEM_CHUNK_SIZE;
    }
    pthread_mutex_unlock(&pool->lock);
    if (release)
        bex__mem_region_destroy(pool, c);
    return !release;
}

/* ---- huge allocations ---------------------------------------------------- */

void *bex__mem_huge_alloc(bex_mem_pool *pool, size_t size)
{
    if (size > ((size_t)1 << 46)) {
        errno = ENOMEM;
        return NULL;
    }
    size_t len = (BEX__MEM_HUGE_HDR + size + BEX__MEM_PAGE - 1) & ~(size_t)(BEX__MEM_PAGE - 1);
    struct bex__mem_chunk *c = NULL;

    /* A retained mapping no more than twice the need keeps steady-state
     * huge traffic off the registrar without wasting much. */
    pthread_mutex_lock(&pool->lock);
    struct bex__list *pos;
    bex__list_foreach(pos, &pool->huge_cached)
    {
        struct bex__mem_chunk *h = bex__list_entry(pos, struct bex__mem_chunk, link);
        if (h->map_size >= len && h->map_size / 2 <= len && (!c || h->map_size < c->map_size))
            c = h;
    }
    if (c) {
        bex__list_remove(&c->link);
        pool->retained_bytes -= c->map_size;
        bex__list_push_head(&pool->huge_live, &c->link);
    }
    pthread_mutex_unlock(&pool->lock);

    if (!c) {
        /* A landing mapping registers its user data only, not its header. */
        c = bex__mem_region_create(pool, len,
                                   pool->kind == BEX_MEM_POOL_LANDING ? BEX__MEM_HUGE_HDR : 0);
        if (!c)
            return NULL;
        if (c->map_size > BEX__MEM_CHUNK_SIZE)
            atomic_fetch_add_explicit(&bex__mem_huge_multi, 1, memory_order_relaxed);
        struct bex__mem_span *s = &c->spans[0];
        s->kind = BEX__MEM_HUGE;
        s->cls = BEX__MEM_NO_CLASS;
        s->heap = &bex__mem_ownerless_heap;
        c->fast[0] = (struct bex__mem_fast){&bex__mem_ownerless_heap, NULL};
        s->span_count = 1;
        pthread_mutex_lock(&pool->lock);
        bex__list_push_head(&pool->huge_live, &c->link);
        pthread_mutex_unlock(&pool->lock);
    }
    c->usable = c->map_size - BEX__MEM_HUGE_HDR;
    bex__mem_pool_note_in_use(pool, (int64_t)c->usable);
    return (char *)bex__mem_base_of(c) + BEX__MEM_HUGE_HDR;
}

void bex__mem_huge_free(struct bex__mem_chunk *c)
{
    bex_mem_pool *pool = c->pool;
    bool release = false;
    bex__mem_pool_note_in_use(pool, -(int64_t)c->usable);
    pthread_mutex_lock(&pool->lock);
    bex__list_remove(&c->link);
    if (pool->retained_bytes + c->map_size > pool->retain) {
        release = true;
    } else {
        pool->retained_bytes += c->map_size;
        bex__list_push_head(&pool->huge_cached, &c->link);
    }
    pthread_mutex_unlock(&pool->lock);
    if (release) {
        if (c->map_size > BEX__MEM_CHUNK_SIZE)
            atomic_fetch_sub_explicit(&bex__mem_huge_multi, 1, memory_order_relaxed);
        bex__mem_region_destroy(pool, c);
    }
}

/* ---- heaps --------------------------------------------------------------- */

/* A heap for a thread that has none in this pool: a dead thread's heap if
 * one is waiting (its spans and blocks come along), else a new one. */
struct bex__mem_heap *bex__mem_pool_heap_adopt(bex_mem_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    struct bex__mem_heap *h = pool->orphans;
    if (h) {
        pool->orphans = h->orphan_next;
        h->orphan_next = NULL;
        atomic_fetch_sub_explicit(&pool->norphans, 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(&pool->lock);
    if (h)
        return h;

    h = aligned_alloc(64, (sizeof(*h) + 63) & ~(size_t)63);
    if (!h)
        return NULL;
    memset(h, 0, sizeof(*h));
    atomic_init(&h->owner, BEX__MEM_NO_OWNER);
    atomic_init(&h->delta, 0);
    atomic_init(&h->xspans, NULL);
    for (unsigned c = 0; c < BEX__MEM_NCLS; c++) {
        uint32_t lim = BEX__MEM_BIN_BYTES / bex__mem_class_size[c];
        h->bins[c].limit = lim < 16 ? 16 : lim > 1024 ? 1024 : lim;
        h->bins[c].cls = (uint16_t)c;
        h->active[c] = &bex__mem_empty_span;
    }
    for (unsigned k = 0; k < BEX__MEM_SPANS; k++)
        bex__list_init(&h->by_run[k]);
    for (unsigned c = 0; c < BEX__MEM_NCLS; c++)
        bex__list_init(&h->cls[c]);
    for (unsigned n = 0; n <= BEX__MEM_MAX_RUN; n++)
        bex__list_init(&h->rcache[n]);
    h->pool = pool;
    pthread_mutex_lock(&pool->lock);
    h->all_next = pool->heaps;
    pool->heaps = h;
    pthread_mutex_unlock(&pool->lock);
    return h;
}

/* Heaps of dead threads keep receiving remote frees that nobody collects
 * until a new thread adopts them. Before the pool grows (and for stats),
 * take them off the orphan list for a moment and tidy them. Returns whether
 * there was any orphan. */
bool bex__mem_pool_reclaim(bex_mem_pool *pool)
{
    pthread_mutex_lock(&pool->lock);
    struct bex__mem_heap *list = pool->orphans;
    pool->orphans = NULL;
    pthread_mutex_unlock(&pool->lock);
    if (!list)
        return false;
    struct bex__mem_heap *last = NULL;
    for (struct bex__mem_heap *h = list; h; h = h->orphan_next) {
        pool->ops->heap_tidy(h);
        last = h;
    }
    pthread_mutex_lock(&pool->lock);
    last->orphan_next = pool->orphans;
    pool->orphans = list;
    pthread_mutex_unlock(&pool->lock);
    return true;
}

void bex__mem_pool_heap_orphan(bex_mem_pool *pool, struct bex__mem_heap *h)
{
    pthread_mutex_lock(&pool->lock);
    atomic_store_explicit(&h->owner, BEX__MEM_NO_OWNER, memory_order_relaxed);
    h->orphan_next = pool->orphans;
    pool->orphans = h;
    atomic_fetch_add_explicit(&pool->norphans, 1, memory_order_relaxed);
    pthread_mutex_unlock(&pool->lock);
}

/* ---- statistics ---------------------------------------------------------- */

static void note_peak(bex_mem_pool *pool, int64_t v)
{
    int64_t cur = atomic_load_explicit(&pool->peak_in_use, memory_order_relaxed);
    while (v > cur && !atomic_compare_exchange_weak_explicit(
                          &pool->peak_in_use, &cur, v, memory_order_relaxed, memory_order_relaxed))
        ;
}

void bex__mem_pool_note_in_use(bex_mem_pool *pool, int64_t delta)
{
    int64_t v = atomic_fetch_add_explicit(&pool->in_use, delta, memory_order_relaxed) + delta;
    if (delta > 0)
        note_peak(pool, v);
}

void bex_mem_pool_stats(bex_mem_pool *pool, bex_mem_stats *out)
{
    memset(out, 0, sizeof(*out));
    if (!pool)
        return;
    bex__mem_pool_reclaim(pool);
    pthread_mutex_lock(&pool->lock);
    /* Blocks out of their runs, less those parked in bins (free to the
     * user): exact for a quiescent pool. */
    int64_t in_use = atomic_load_explicit(&pool->in_use, memory_order_relaxed);
    for (struct bex__mem_heap *h = pool->heaps; h; h = h->all_next) {
        in_use += atomic_load_explicit(&h->delta, memory_order_relaxed);
        for (unsigned c = 0; c < BEX__MEM_NCLS; c++)
            in_use -= (int64_t)atomic_load_explicit(&h->bins[c].count, memory_order_relaxed) *
                      bex__mem_class_size[c];
    }
    pthread_mutex_unlock(&pool->lock);
    if (in_use < 0)
        in_use = 0; /* a remote free can be counted before its allocation is flushed */
    note_peak(pool, in_use);
    out->registered_bytes = atomic_load_explicit(&pool->registered_bytes, memory_order_relaxed);
    out->peak_registered_bytes =
        atomic_load_explicit(&pool->peak_registered_bytes, memory_order_relaxed);
    out->chunks = atomic_load_explicit(&pool->nchunks, memory_order_relaxed);
    out->registrations = atomic_load_explicit(&pool->registrations, memory_order_relaxed);
    out->deregistrations = atomic_load_explicit(&pool->deregistrations, memory_order_relaxed);
    out->in_use_bytes = (size_t)in_use;
    out->peak_in_use_bytes = (size_t)atomic_load_explicit(&pool->peak_in_use, memory_order_relaxed);
}

void bex_mem_pool_registrar(const bex_mem_pool *pool, bex_mem_registrar *out)
{
    *out = pool->reg;
}

/* ---- create / destroy ---------------------------------------------------- */

int bex__mem_pool_new(const bex_mem_registrar *reg, const bex_mem_config *cfg,
                      const struct bex__mem_kind_ops *ops, bex_mem_pool **out)
{
    bex_mem_pool *pool = aligned_alloc(64, (sizeof(*pool) + 63) & ~(size_t)63);
    if (!pool)
        return -ENOMEM;
    memset(pool, 0, sizeof(*pool));
    pool->reg = *reg;
    pool->kind = cfg ? cfg->kind : BEX_MEM_POOL_GENERAL;
    pool->ops = ops;
    pool->retain = cfg && cfg->retain_bytes ? cfg->retain_bytes : DEFAULT_RETAIN;
    int rc = pthread_mutex_init(&pool->lock, NULL);
    if (rc != 0) {
        free(pool);
        return -rc;
    }
    atomic_init(&pool->registered_bytes, 0);
    atomic_init(&pool->peak_registered_bytes, 0);
    atomic_init(&pool->nchunks, 0);
    atomic_init(&pool->registrations, 0);
    atomic_init(&pool->deregistrations, 0);
    atomic_init(&pool->in_use, 0);
    atomic_init(&pool->peak_in_use, 0);
    atomic_init(&pool->norphans, 0);
    bex__list_init(&pool->chunks);
    bex__list_init(&pool->empty);
    bex__list_init(&pool->huge_live);
    bex__list_init(&pool->huge_cached);
    pool->id = atomic_fetch_add_explicit(&next_pool_id, 1, memory_order_relaxed);
    bex__mem_registry_lock();
    bex__list_push_head(&registry, &pool->reg_link);
    bex__mem_registry_unlock();
    *out = pool;
    return 0;
}

int bex_mem_pool_kind(const bex_mem_pool *pool)
{
    return pool ? pool->kind : -EINVAL;
}

static bool pool_busy(bex_mem_pool *pool)
{
    return !bex__list_empty(&pool->huge_live) || pool->ops->busy(pool);
}

int bex_mem_pool_destroy(bex_mem_pool *pool)
{
    if (!pool)
        return -EINVAL;
    bex__mem_registry_lock();
    /* Blocks parked in heap bins count as used by their runs: put them
     * back first. Invisible to users, so it is no change on -EBUSY. */
    pthread_mutex_lock(&pool->lock);
    struct bex__mem_heap *heaps = pool->heaps;
    pthread_mutex_unlock(&pool->lock);
    for (struct bex__mem_heap *h = heaps; h; h = h->all_next)
        pool->ops->heap_flush(h);
    pthread_mutex_lock(&pool->lock);
    bool busy = pool_busy(pool);
    pthread_mutex_unlock(&pool->lock);
    if (busy) {
        bex__mem_registry_unlock();
        return -EBUSY;
    }
    bex__list_remove(&pool->reg_link);
    bex__mem_registry_unlock();

    /* No thread may use the pool now: heaps and caches die with it. */
    struct bex__list *pos, *tmp;
    bex__list_foreach_safe(pos, tmp, &pool->chunks)
    {
        bex__mem_region_destroy(pool, bex__list_entry(pos, struct bex__mem_chunk, link));
    }
    bex__list_foreach_safe(pos, tmp, &pool->huge_cached)
    {
        struct bex__mem_chunk *c = bex__list_entry(pos, struct bex__mem_chunk, link);
        if (c->map_size > BEX__MEM_CHUNK_SIZE)
            atomic_fetch_sub_explicit(&bex__mem_huge_multi, 1, memory_order_relaxed);
        bex__mem_region_destroy(pool, c);
    }
    while (pool->heaps) {
        struct bex__mem_heap *h = pool->heaps;
        pool->heaps = h->all_next;
        free(h);
    }
    pthread_mutex_destroy(&pool->lock);
    free(pool);
    return 0;
}
