/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc landing pools: peer-writable memory that holds payloads only.
 *
 * A landing chunk registers spans 1..63 (the payload pages) and nothing
 * else; its header and page map sit in span 0, outside the registered
 * range. An allocation is a run of whole pages; which pages are free and
 * how long each run is are recorded in the page map, never in the pages
 * themselves (a free list threaded through freed blocks would let a peer
 * that still holds the chunk's key steer the allocator). Larger requests
 * take a huge mapping whose header page(s) are likewise left unregistered
 * (pool.c). Everything runs under the pool lock: rendezvous buffers are
 * allocated once per large message, not per small one. */
#include <assert.h>
#include <errno.h>
#include <string.h>

#include "mem/internal.h"

_Static_assert((BEX__MEM_COLOURS - 1) * BEX__MEM_COLOUR_STEP + sizeof(struct bex__mem_chunk) + 64 +
                       sizeof(struct bex__mem_land) <=
                   BEX__MEM_SPAN_SIZE,
               "a landing chunk's header and page map must fit in its unregistered span 0");

/* Set (free) or clear (taken) n bits of m from bit p. */
static void bits_put(uint64_t *m, unsigned p, unsigned n, bool set)
{
    while (n) {
        unsigned off = p % 64, k = 64 - off < n ? 64 - off : n;
        uint64_t mask = (k == 64 ? ~(uint64_t)0 : (((uint64_t)1 << k) - 1)) << off;
        if (set)
            m[p / 64] |= mask;
        else
            m[p / 64] &= ~mask;
        p += k;
        n -= k;
    }
}

/* First run of n free pages, or -1. Skips whole words of taken or free
 * pages at a time. */
static int find_run(const uint64_t *m, unsigned n)
{
    unsigned run = 0, start = 0;
    for (unsigned p = 0; p < BEX__MEM_LAND_PAGES;) {
        unsigned left = 64 - p % 64;
        uint64_t w = m[p / 64] >> (p % 64);
        if (w & 1) {
            unsigned ones = ~w ? (unsigned)__builtin_ctzll(~w) : left;
            if (ones > left)
                ones = left;
            if (!run)
                start = p;
            run += ones;
            if (run >= n)
                return (int)start;
            p += ones;
        } else {
            unsigned zeros = w ? (unsigned)__builtin_ctzll(w) : left;
            run = 0;
            p += zeros;
        }
    }
    return -1;
}

static unsigned page_of(const void *p)
{
    return (unsigned)(((uintptr_t)p & BEX__MEM_CHUNK_MASK) / BEX__MEM_PAGE);
}

/* Map and register a fresh landing chunk; NULL + errno. */
static struct bex__mem_chunk *chunk_new(bex_mem_pool *pool)
{
    struct bex__mem_chunk *c =
        bex__mem_region_create(pool, BEX__MEM_CHUNK_SIZE, BEX__MEM_SPAN_SIZE);
    if (!c)
        return NULL;
    /* Every descriptor sends bex_mem_free() to the slow path (ownerless,
     * no class), which knows landing spans by their kind. Descriptor 0 is
     * the header, as in a general chunk. */
    c->spans[0].kind = BEX__MEM_HUGE;
    c->spans[0].cls = BEX__MEM_NO_CLASS;
    c->spans[0].heap = &bex__mem_ownerless_heap;
    c->fast[0] = (struct bex__mem_fast){&bex__mem_ownerless_heap, NULL};
    for (unsigned i = 1; i < BEX__MEM_SPANS; i++) {
        c->spans[i].kind = BEX__MEM_LANDING;
        c->spans[i].cls = BEX__MEM_NO_CLASS;
        c->spans[i].heap = &bex__mem_ownerless_heap;
        c->fast[i] = (struct bex__mem_fast){&bex__mem_ownerless_heap, NULL};
    }
    struct bex__mem_land *l = (struct bex__mem_land *)(((uintptr_t)(c + 1) + 63) & ~(uintptr_t)63);
    memset(l, 0, sizeof(*l));
    bits_put(l->free, BEX__MEM_LAND_FIRST, BEX__MEM_LAND_USABLE, true);
    l->nfree = BEX__MEM_LAND_USABLE;
    c->land = l;
    return c;
}

/* Take n pages of c at page p (pool lock held). */
static void *take(struct bex__mem_chunk *c, int p, unsigned n)
{
    struct bex__mem_land *l = c->land;
    bits_put(l->free, (unsigned)p, n, false);
    l->len[p] = (uint16_t)n;
    l->nfree -= n;
    return (char *)bex__mem_base_of(c) + (size_t)p * BEX__MEM_PAGE;
}

void *bex__mem_land_alloc(bex_mem_pool *pool, size_t size)
{
    if (size > BEX__MEM_MEDIUM_MAX)
        return bex__mem_huge_alloc(pool, size);
    unsigned n = size ? (unsigned)((size + BEX__MEM_PAGE - 1) / BEX__MEM_PAGE) : 1;
    void *out = NULL;
    pthread_mutex_lock(&pool->lock);
    struct bex__list *pos;
    bex__list_foreach(pos, &pool->chunks)
    {
        struct bex__mem_chunk *c = bex__list_entry(pos, struct bex__mem_chunk, link);
        if (c->land->nfree < n)
            continue;
        int p = find_run(c->land->free, n);
        if (p < 0)
            continue;
        if (c->land->nfree == BEX__MEM_LAND_USABLE)
            pool->retained_bytes -= BEX__MEM_CHUNK_SIZE; /* a retained empty chunk */
        out = take(c, p, n);
        break;
    }
    pthread_mutex_unlock(&pool->lock);
    if (!out) {
        /* Register outside the lock: frees and other allocations go on. */
        struct bex__mem_chunk *c = chunk_new(pool);
        if (!c)
            return NULL;
        pthread_mutex_lock(&pool->lock);
        bex__mem_pool_chunk_link(pool, c);
        out = take(c, find_run(c->land->free, n), n);
        pthread_mutex_unlock(&pool->lock);
    }
    bex__mem_pool_note_in_use(pool, (int64_t)n * BEX__MEM_PAGE);
    return out;
}

void bex__mem_land_free(void *ptr)
{
    struct bex__mem_chunk *c = bex__mem_chunk_of(ptr);
    bex_mem_pool *pool = c->pool;
    struct bex__mem_land *l = c->land;
    unsigned p = page_of(ptr);
    bool release = false;
    pthread_mutex_lock(&pool->lock);
    unsigned n = l->len[p];
    if (n == 0 || ((uintptr_t)ptr & (BEX__MEM_PAGE - 1))) {
        pthread_mutex_unlock(&pool->lock);
        assert(!"bex_mem_free: not the start of a live landing buffer");
        return;
    }
    l->len[p] = 0;
    bits_put(l->free, p, n, true);
    l->nfree += n;
    if (l->nfree == BEX__MEM_LAND_USABLE) {
        if (pool->retained_bytes + BEX__MEM_CHUNK_SIZE > pool->retain) {
            bex__list_remove(&c->link);
            release = true;
        } else {
            pool->retained_bytes += BEX__MEM_CHUNK_SIZE;
        }
    }
    pthread_mutex_unlock(&pool->lock);
    bex__mem_pool_note_in_use(pool, -(int64_t)n * BEX__MEM_PAGE);
    if (release)
        bex__mem_region_destroy(pool, c);
}

size_t bex__mem_land_usable(const void *ptr)
{
    /* The run is live and the caller's: its entry does not change under us
     * (other entries may, which is no race on this one). */
    return (size_t)bex__mem_chunk_of(ptr)->land->len[page_of(ptr)] * BEX__MEM_PAGE;
}

static bool land_busy(bex_mem_pool *pool)
{
    struct bex__list *pos;
    bex__list_foreach(pos, &pool->chunks)
    {
        if (bex__list_entry(pos, struct bex__mem_chunk, link)->land->nfree != BEX__MEM_LAND_USABLE)
            return true;
    }
    return false;
}

const struct bex__mem_kind_ops bex__mem_landing_ops = {.busy = land_busy};
