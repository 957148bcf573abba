/* bemalloc per-thread heaps: the allocation and free paths.
 *
 * Fast paths (alloc and free of a small block by the thread that owns its
 * heap) touch one thread-local word, the heap and one span descriptor, with
 * plain loads and stores only. Everything else is a slow path: refilling a
 * class from remote frees, carving, a new run, medium runs, remote frees
 * (one CAS), and thread exit. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "mem/internal.h"

/* Free runs a heap keeps for itself before giving them back to the pool. */
#define HEAP_CACHE_MAX ((size_t)4 << 20)
/* In-use bytes a heap may accumulate before adding them to the pool
 * counter: bounds the error of the stats without a shared atomic per op. */
#define FLUSH_BYTES ((int64_t)256 << 10)

/* The empty class list: its free list is always NULL, so the fast path
 * needs no separate NULL test. Never written. */
struct bex__mem_span bex__mem_empty_span;
/* Owner of huge mappings and chunk headers: nobody, so frees of those take
 * the remote path, which knows them by their kind. */
struct bex__mem_heap bex__mem_ownerless_heap = {.owner = BEX__MEM_NO_OWNER};

struct tls_ent {
    uint64_t pool_id;
    struct bex__mem_heap *heap;
};

/* Per-thread state. The last pool used is cached in the first two fields:
 * most threads use one pool. Pools are matched by id, never by address, so
 * a pool created where a destroyed one was never inherits its heaps. */
struct tls {
    uint64_t pool_id;
    struct bex__mem_heap *heap;
    uint64_t tid; /* 0 until the thread first needs a heap */
    struct tls_ent *ents;
    unsigned n, cap;
};

/* initial-exec: a global-dynamic TLS access from libbex.so would cost a
 * __tls_get_addr call on every allocation. */
static _Thread_local struct tls tl __attribute__((tls_model("initial-exec")));

static pthread_key_t exit_key;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;
static int exit_key_err;
static _Atomic uint64_t next_tid = 1;

/* Owner-only counter, readable by stats: a relaxed load and store, not an
 * atomic add, which would lock the bus on every allocation. */
static inline void add_delta(struct bex__mem_heap *h, int64_t d)
{
    atomic_store_explicit(&h->delta, atomic_load_explicit(&h->delta, memory_order_relaxed) + d,
                          memory_order_relaxed);
}

static void maybe_flush(struct bex__mem_heap *h, bool all)
{
    int64_t d = atomic_load_explicit(&h->delta, memory_order_relaxed);
    if (d != 0 && (all || d >= FLUSH_BYTES || d <= -FLUSH_BYTES)) {
        bex__mem_pool_note_in_use(h->pool, d);
        atomic_store_explicit(&h->delta, 0, memory_order_relaxed);
    }
}

/* ---- class lists (owner-only) --------------------------------------------- */

static void list_insert(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    struct bex__mem_span *head = h->active[s->cls];
    s->attached = 1;
    if (head == &bex__mem_empty_span) {
        s->prev = s->next = NULL;
        h->active[s->cls] = s;
        return;
    }
    /* Behind the head: the head is being consumed, and a span that comes
     * back usually holds only a few free blocks. */
    s->prev = head;
    s->next = head->next;
    if (head->next)
        head->next->prev = s;
    head->next = s;
}

static void list_remove(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        h->active[s->cls] = s->next ? s->next : &bex__mem_empty_span;
    if (s->next)
        s->next->prev = s->prev;
    s->attached = 0;
}

/* ---- runs ------------------------------------------------------------------ */

static struct bex__mem_span *run_get(struct bex__mem_heap *h, unsigned n)
{
    struct bex__mem_span *s = h->cache[n];
    if (s) {
        h->cache[n] = s->next;
        h->cache_bytes -= (size_t)n << BEX__MEM_SPAN_SHIFT;
        return s;
    }
    return bex__mem_pool_run_alloc(h->pool, n);
}

static void run_put(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    size_t bytes = (size_t)s->span_count << BEX__MEM_SPAN_SHIFT;
    s->free = NULL;
    if (h->cache_bytes + bytes <= HEAP_CACHE_MAX) {
        s->kind = BEX__MEM_CACHED;
        s->next = h->cache[s->span_count];
        h->cache[s->span_count] = s;
        h->cache_bytes += bytes;
        return;
    }
    bex__mem_pool_run_free(h->pool, s);
}

/* ---- remote frees ---------------------------------------------------------- */

/* Move blocks that other threads freed (the xfree word x, already taken)
 * onto the span's local list. */
static void take_remote(struct bex__mem_heap *h, struct bex__mem_span *s, uintptr_t x)
{
    void *list = (void *)(x & BEX__MEM_XPTR_MASK);
    if (!list)
        return;
    uint32_t n = (uint32_t)(x >> BEX__MEM_XCNT_SHIFT);
    s->used -= n;
    add_delta(h, -(int64_t)n * s->block_size);
    if (s->free) {
        void *t = list;
        while (*(void **)t)
            t = *(void **)t;
        *(void **)t = s->free;
    }
    s->free = list;
}

static bool collect(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    if (atomic_load_explicit(&s->xfree, memory_order_relaxed) == 0)
        return false;
    take_remote(h, s, atomic_exchange_explicit(&s->xfree, 0, memory_order_acquire));
    return s->free != NULL;
}

/* An empty small run goes back to the cache unless it is the class's active
 * run: keeping that one stops a single alloc/free pair from cycling a run. */
static void maybe_release(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    if (s->used == 0 && h->active[s->cls] != s) {
        list_remove(h, s);
        run_put(h, s);
    }
}

/* Take back the spans other threads queued after freeing into them while
 * they were detached (full small runs, medium runs). */
static void drain(struct bex__mem_heap *h)
{
    struct bex__mem_span *s = atomic_exchange_explicit(&h->xspans, NULL, memory_order_acquire);
    while (s) {
        struct bex__mem_span *next = s->xnext;
        take_remote(h, s, atomic_exchange_explicit(&s->xfree, 0, memory_order_acquire));
        if (s->kind == BEX__MEM_MEDIUM) {
            run_put(h, s);
        } else {
            list_insert(h, s);
            maybe_release(h, s);
        }
        s = next;
    }
}

/* ---- small allocations ---------------------------------------------------- */

static inline void *pop(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    void *b = s->free;
    s->free = *(void **)b;
    s->used++;
    add_delta(h, s->block_size);
    return b;
}

/* Thread the next stretch of never-used blocks onto the free list; about a
 * page at a time, so a run's pages are touched only when needed. */
static bool carve(struct bex__mem_span *s)
{
    uint32_t bs = s->block_size, total = s->capacity * bs;
    if (s->bump >= total)
        return false;
    char *base = bex__mem_span_base(s) + s->bump;
    uint32_t n = (total - s->bump) / bs;
    uint32_t batch = bs >= BEX__MEM_PAGE ? 1 : BEX__MEM_PAGE / bs;
    if (n > batch)
        n = batch;
    for (uint32_t i = 0; i + 1 < n; i++)
        *(void **)(base + (size_t)i * bs) = base + (size_t)(i + 1) * bs;
    *(void **)(base + (size_t)(n - 1) * bs) = NULL;
    s->free = base;
    s->bump += n * bs;
    return true;
}

static struct bex__mem_span *span_new(struct bex__mem_heap *h, unsigned c)
{
    unsigned n = bex__mem_class_spans[c];
    struct bex__mem_span *s = run_get(h, n);
    if (!s)
        return NULL;
    s->kind = BEX__MEM_SMALL;
    s->cls = (uint8_t)c;
    s->block_size = bex__mem_class_size[c];
    s->capacity = (uint32_t)(((size_t)n << BEX__MEM_SPAN_SHIFT) / s->block_size);
    s->used = 0;
    s->bump = 0;
    s->free = NULL;
    s->heap = h;
    atomic_store_explicit(&s->xfree, 0, memory_order_relaxed);
    for (unsigned j = 1; j < n; j++) {
        s[j].offset = j;
        s[j].kind = BEX__MEM_TAIL;
    }
    return s;
}

static void *small_slow(struct bex__mem_heap *h, unsigned c)
{
    maybe_flush(h, false);
    for (;;) {
        struct bex__mem_span *s = h->active[c];
        if (s != &bex__mem_empty_span) {
            if (s->free || collect(h, s) || carve(s))
                return pop(h, s);
            /* Full: detach it, so frees find it again (see free paths). The
             * CAS fails only if a remote free just arrived: use that. */
            uintptr_t expect = 0;
            if (atomic_compare_exchange_strong_explicit(&s->xfree, &expect, BEX__MEM_XDETACHED,
                                                        memory_order_acq_rel,
                                                        memory_order_relaxed))
                list_remove(h, s);
            continue;
        }
        if (atomic_load_explicit(&h->xspans, memory_order_relaxed)) {
            drain(h);
            if (h->active[c] != &bex__mem_empty_span)
                continue;
        }
        s = span_new(h, c);
        if (!s)
            return NULL;
        list_insert(h, s);
    }
}

/* ---- medium allocations ---------------------------------------------------- */

static void *medium_alloc(struct bex__mem_heap *h, size_t size)
{
    if (atomic_load_explicit(&h->xspans, memory_order_relaxed))
        drain(h);
    maybe_flush(h, false);
    unsigned n = (unsigned)((size + BEX__MEM_SPAN_SIZE - 1) >> BEX__MEM_SPAN_SHIFT);
    struct bex__mem_span *s = run_get(h, n);
    if (!s)
        return NULL;
    s->kind = BEX__MEM_MEDIUM;
    s->heap = h;
    s->block_size = (uint32_t)n << BEX__MEM_SPAN_SHIFT;
    s->capacity = 1;
    s->used = 1;
    s->free = NULL;
    s->attached = 0;
    /* Born detached: its one free, if remote, queues it on h->xspans. */
    atomic_store_explicit(&s->xfree, BEX__MEM_XDETACHED, memory_order_relaxed);
    add_delta(h, s->block_size);
    return bex__mem_span_base(s);
}

/* ---- thread heaps ---------------------------------------------------------- */

/* Collect every remote free of a heap nobody owns (the caller holds it
 * exclusively), and give its empty runs and its cache back to the pool. */
void bex__mem_heap_tidy(bex_mem_pool *pool, struct bex__mem_heap *h)
{
    drain(h);
    for (unsigned c = 0; c < BEX__MEM_NCLS; c++) {
        struct bex__mem_span *s = h->active[c];
        while (s && s != &bex__mem_empty_span) {
            struct bex__mem_span *next = s->next;
            collect(h, s);
            if (s->used == 0) {
                list_remove(h, s);
                s->free = NULL;
                bex__mem_pool_run_free(pool, s);
            }
            s = next;
        }
    }
    for (unsigned n = 1; n <= BEX__MEM_MAX_RUN; n++) {
        while (h->cache[n]) {
            struct bex__mem_span *s = h->cache[n];
            h->cache[n] = s->next;
            bex__mem_pool_run_free(pool, s);
        }
    }
    h->cache_bytes = 0;
    maybe_flush(h, true);
}

static void heap_abandon(bex_mem_pool *pool, struct bex__mem_heap *h)
{
    bex__mem_heap_tidy(pool, h);
    /* What is left holds live blocks; it waits for the next thread that
     * needs a heap in this pool, and meanwhile for bex__mem_pool_reclaim. */
    bex__mem_pool_heap_orphan(pool, h);
}

/* pthread key destructor: hand every heap of this thread back to its pool
 * (if the pool still exists), so its spans are reused, not stranded. */
static void thread_exit(void *arg)
{
    (void)arg;
    bex__mem_registry_lock();
    for (unsigned i = 0; i < tl.n; i++) {
        bex_mem_pool *pool = bex__mem_registry_find(tl.ents[i].pool_id);
        if (pool)
            heap_abandon(pool, tl.ents[i].heap);
    }
    bex__mem_registry_unlock();
    free(tl.ents);
    tl.ents = NULL;
    tl.n = tl.cap = 0;
    tl.pool_id = 0;
    tl.heap = NULL;
}

static void make_exit_key(void)
{
    exit_key_err = pthread_key_create(&exit_key, thread_exit);
}

/* Forget entries of destroyed pools (their heaps are gone). */
static void prune_dead(void)
{
    unsigned k = 0;
    bex__mem_registry_lock();
    for (unsigned i = 0; i < tl.n; i++)
        if (bex__mem_registry_find(tl.ents[i].pool_id))
            tl.ents[k++] = tl.ents[i];
    bex__mem_registry_unlock();
    tl.n = k;
    tl.pool_id = 0;
    tl.heap = NULL;
}

static struct bex__mem_heap *heap_get_slow(bex_mem_pool *pool)
{
    if (!pool) {
        errno = EINVAL;
        return NULL;
    }
    if (!tl.tid)
        tl.tid = atomic_fetch_add_explicit(&next_tid, 1, memory_order_relaxed);
    for (unsigned i = 0; i < tl.n; i++) {
        if (tl.ents[i].pool_id == pool->id) {
            tl.pool_id = pool->id;
            tl.heap = tl.ents[i].heap;
            return tl.heap;
        }
    }
    pthread_once(&exit_once, make_exit_key);
    if (exit_key_err) {
        errno = exit_key_err;
        return NULL;
    }
    if (tl.n == tl.cap) {
        if (tl.n >= 8)
            prune_dead();
        if (tl.n == tl.cap) {
            unsigned cap = tl.cap ? tl.cap * 2 : 4;
            struct tls_ent *e = realloc(tl.ents, cap * sizeof(*e));
            if (!e) {
                errno = ENOMEM;
                return NULL;
            }
            tl.ents = e;
            tl.cap = cap;
        }
    }
    struct bex__mem_heap *h = bex__mem_pool_heap_adopt(pool);
    if (!h) {
        errno = ENOMEM;
        return NULL;
    }
    atomic_store_explicit(&h->owner, tl.tid, memory_order_relaxed);
    tl.ents[tl.n].pool_id = pool->id;
    tl.ents[tl.n].heap = h;
    tl.n++;
    pthread_setspecific(exit_key, &tl);
    tl.pool_id = pool->id;
    tl.heap = h;
    return h;
}

/* ---- public entry points --------------------------------------------------- */

void *bex_mem_alloc(bex_mem_pool *pool, size_t size)
{
    struct bex__mem_heap *h;
    if (BEX__MEM_LIKELY(pool && tl.pool_id == pool->id))
        h = tl.heap;
    else if (!(h = heap_get_slow(pool)))
        return NULL;
    if (BEX__MEM_LIKELY(size <= BEX__MEM_SMALL_MAX)) {
        unsigned c = bex__mem_class_of(size);
        struct bex__mem_span *s = h->active[c];
        void *b = s->free;
        if (BEX__MEM_LIKELY(b != NULL)) {
            s->free = *(void **)b;
            s->used++;
            add_delta(h, bex__mem_class_size[c]);
            return b;
        }
        return small_slow(h, c);
    }
    if (size <= BEX__MEM_MEDIUM_MAX)
        return medium_alloc(h, size);
    return bex__mem_huge_alloc(pool, size);
}

static void free_local_slow(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    if (s->kind == BEX__MEM_MEDIUM) {
        run_put(h, s);
        return;
    }
    if (!s->attached) {
        /* Full and detached. If a remote free already cleared the flag, that
         * thread queued the span on h->xspans and drain() re-attaches it. */
        uintptr_t old = atomic_fetch_and_explicit(&s->xfree, ~BEX__MEM_XDETACHED,
                                                  memory_order_acq_rel);
        if (!(old & BEX__MEM_XDETACHED))
            return;
        list_insert(h, s);
    }
    maybe_release(h, s);
}

static void free_remote(struct bex__mem_span *s, void *p)
{
    if (s->kind == BEX__MEM_HUGE) {
        bex__mem_huge_free(bex__mem_chunk_of(p));
        return;
    }
    /* Read the heap before the push: once the block is on the stack the
     * owner may collect it and recycle the span. */
    struct bex__mem_heap *h = s->heap;
    uintptr_t old = atomic_load_explicit(&s->xfree, memory_order_relaxed), nw;
    do {
        *(void **)p = (void *)(old & BEX__MEM_XPTR_MASK);
        nw = ((((old >> BEX__MEM_XCNT_SHIFT) + 1)) << BEX__MEM_XCNT_SHIFT) | (uintptr_t)p;
    } while (!atomic_compare_exchange_weak_explicit(&s->xfree, &old, nw, memory_order_acq_rel,
                                                    memory_order_relaxed));
    if (old & BEX__MEM_XDETACHED) {
        /* We cleared the flag, so we alone queue the span; the owner cannot
         * reach it until then, so it stays valid. */
        struct bex__mem_span *top = atomic_load_explicit(&h->xspans, memory_order_relaxed);
        do {
            s->xnext = top;
        } while (!atomic_compare_exchange_weak_explicit(&h->xspans, &top, s, memory_order_release,
                                                        memory_order_relaxed));
    }
}

void bex_mem_free(void *ptr)
{
    if (!ptr)
        return;
    struct bex__mem_span *s = bex__mem_span_of(ptr);
    struct bex__mem_heap *h = s->heap;
    if (BEX__MEM_LIKELY(atomic_load_explicit(&h->owner, memory_order_relaxed) == tl.tid)) {
        *(void **)ptr = s->free;
        s->free = ptr;
        add_delta(h, -(int64_t)s->block_size);
        if (BEX__MEM_UNLIKELY(--s->used == 0 || !s->attached))
            free_local_slow(h, s);
        return;
    }
    free_remote(s, ptr);
}

static struct bex__mem_chunk *header_of(const void *p)
{
    if (BEX__MEM_UNLIKELY(atomic_load_explicit(&bex__mem_huge_multi, memory_order_relaxed))) {
        struct bex__mem_chunk *c = bex__mem_huge_lookup(p);
        if (c)
            return c;
    }
    return bex__mem_chunk_of(p);
}

size_t bex_mem_usable_size(const void *ptr)
{
    if (!ptr)
        return 0;
    struct bex__mem_span *s = bex__mem_span_of(ptr);
    switch (s->kind) {
    case BEX__MEM_SMALL:
        return s->block_size;
    case BEX__MEM_MEDIUM:
        return (size_t)s->span_count << BEX__MEM_SPAN_SHIFT;
    case BEX__MEM_HUGE:
        return bex__mem_chunk_of(ptr)->usable;
    default:
        return 0;
    }
}

const bex_mem_region *bex_mem_mr(const void *ptr)
{
    if (!ptr)
        return NULL;
    return &header_of(ptr)->mr;
}

bex_mem_pool *bex_mem_pool_of(const void *ptr)
{
    if (!ptr)
        return NULL;
    return header_of(ptr)->pool;
}
