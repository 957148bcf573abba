/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc per-thread heaps: the allocation and free paths.
 *
 * Fast paths (alloc and free of a small block by the thread that owns its
 * heap) touch one thread-local word, the heap and one span descriptor, with
 * plain loads and stores only. Everything else is a slow path: refilling a
 * class from remote frees, carving, a new run, medium runs, remote frees
 * (one CAS), and thread exit. */
#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/cfg.h"
#include "mem/internal.h"
#include "mem/lookup.h"

/* Slow paths stay out of line, so the fast paths need no stack frame. */
#define BEX__MEM_SLOW __attribute__((noinline, cold))

/* In-use bytes a heap may accumulate before adding them to the pool
 * counter: bounds the error of the stats without a shared atomic per op. */
#define FLUSH_BYTES ((int64_t)4 << 20)

/* The empty class list: never written. */
struct bex__mem_span bex__mem_empty_span;
/* Owner of huge mappings and chunk headers: nobody, so frees of those take
 * the remote path, which knows them by their kind. */
struct bex__mem_heap bex__mem_ownerless_heap = {.owner = BEX__MEM_NO_OWNER};

struct tls_ent {
    uint64_t pool_id;
    struct bex__mem_heap *heap;
};

/* Per-thread state. The last pool used is cached in the first two fields:
 * most threads use one pool; the one used before it in the next two (an
 * I/O thread alternates its receive pool and its context's). Pools are
 * matched by id, never by address, so a pool created where a destroyed
 * one was never inherits its heaps. */
struct tls {
    uint64_t pool_id;
    struct bex__mem_heap *heap;
    uint64_t prev_pool_id;
    struct bex__mem_heap *prev_heap;
    uint64_t tid; /* 0 until the thread first needs a heap */
    struct tls_ent *ents;
    unsigned n, cap;
    uint64_t lookups; /* heap_get_slow's searches (bex__mem_heap_lookups) */
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

static inline void bin_count_add(struct bex__mem_bin *b, uint32_t d)
{
    atomic_store_explicit(&b->count,
                          (uint16_t)(atomic_load_explicit(&b->count, memory_order_relaxed) + d),
                          memory_order_relaxed);
}

/* h's bin of class c, for the fast paths. The empty asm hides how b was
 * made, so that the bin's count (an _Atomic member) is reached from b: GCC
 * otherwise computes its address again from h and c, apart from the list's
 * (four instructions for a relaxed load and store that are plain moves,
 * issue 25 item 2). */
static inline struct bex__mem_bin *bin_at(struct bex__mem_heap *h, unsigned c)
{
    struct bex__mem_bin *b = &h->bins[c];
    __asm__("" : "+r"(b));
    return b;
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
        bex__list_push_head(&h->cls[s->cls], &s->link);
        h->active[s->cls] = s;
        return;
    }
    /* Behind the head: the head is being consumed, and a run that comes
     * back usually holds only a few free blocks. */
    bex__list_insert_after(&head->link, &s->link);
}

static void list_remove(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    bex__list_remove(&s->link);
    if (h->active[s->cls] == s) {
        struct bex__list *f = bex__list_first(&h->cls[s->cls]);
        h->active[s->cls] =
            f ? bex__list_entry(f, struct bex__mem_span, link) : &bex__mem_empty_span;
    }
    s->attached = 0;
}

/* ---- runs ------------------------------------------------------------------ */

/* Runs come out of chunks the heap owns, without locks: each owned chunk
 * sits in a bucket by its longest free run, so a request for n spans goes
 * to the chunk whose longest run fits it most tightly (best fit keeps long
 * runs whole), and freed runs coalesce in the chunk's bitmap at once. */

static uint64_t span_bits(unsigned i, unsigned n)
{
    return (n >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1)) << i;
}

/* Length of the run of free spans in m that contains span i. */
static unsigned hole_at(uint64_t m, unsigned i)
{
    uint64_t below = ~m & (((uint64_t)1 << i) - 1);
    unsigned start = below ? 64u - (unsigned)__builtin_clzll(below) : 0;
    uint64_t above = ~m >> i;
    unsigned end = above ? i + (unsigned)__builtin_ctzll(above) : 64;
    return end - start;
}

/* Take n spans from mask *m: the smallest hole that fits (best fit keeps
 * big holes big); returns its start and sets *max_run for the new mask. */
static unsigned take_hole(uint64_t *m, unsigned n, unsigned *max_run)
{
    uint64_t rest = *m;
    unsigned best = 0, best_len = 65, top = 0, second = 0;
    while (rest) {
        unsigned start = (unsigned)__builtin_ctzll(rest);
        uint64_t zeros = ~(rest >> start);
        unsigned len = zeros ? (unsigned)__builtin_ctzll(zeros) : 64 - start;
        if (len >= n && len < best_len) {
            best = start;
            best_len = len;
        }
        if (len > top) {
            second = top;
            top = len;
        } else if (len > second) {
            second = len;
        }
        rest &= ~span_bits(start, len);
    }
    *m &= ~span_bits(best, n);
    unsigned left = best_len - n;
    /* the longest hole shrank only if it was the one taken */
    unsigned longest = best_len == top ? second : top;
    *max_run = left > longest ? left : longest;
    return best;
}

static void bucket_remove(struct bex__mem_heap *h, struct bex__mem_chunk *c)
{
    bex__list_remove(&c->blink);
    if (bex__list_empty(&h->by_run[c->max_run]))
        h->run_mask &= ~((uint64_t)1 << c->max_run);
}

static void bucket_insert(struct bex__mem_heap *h, struct bex__mem_chunk *c)
{
    bex__list_push_head(&h->by_run[c->max_run], &c->blink);
    h->run_mask |= (uint64_t)1 << c->max_run;
}

/* n contiguous free spans; NULL + errno when the pool can't grow. */
static struct bex__mem_span *chunk_run_get(struct bex__mem_heap *h, unsigned n)
{
    uint64_t fit = h->run_mask & (~(uint64_t)0 << n);
    struct bex__mem_chunk *c;
    if (fit) {
        c = bex__list_entry(h->by_run[__builtin_ctzll(fit)].next, struct bex__mem_chunk, blink);
    } else {
        c = bex__mem_pool_chunk_get(h->pool);
        if (!c)
            return NULL;
        bucket_insert(h, c);
    }
    bucket_remove(h, c);
    unsigned i = take_hole(&c->free_mask, n, &c->max_run);
    bucket_insert(h, c);
    struct bex__mem_span *s = &c->spans[i];
    s->span_count = (uint8_t)n;
    s->offset = 0;
    return s;
}

static void chunk_run_put(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    struct bex__mem_chunk *c = bex__mem_chunk_of(s);
    unsigned i = (unsigned)(s - c->spans);
    s->kind = BEX__MEM_FREE;
    s->free = NULL;
    bucket_remove(h, c);
    c->free_mask |= span_bits(i, s->span_count);
    unsigned len = hole_at(c->free_mask, i);
    if (len > c->max_run)
        c->max_run = len;
    if (c->free_mask == BEX__MEM_SPANS_USABLE_MASK) {
        /* Empty: back to the pool at once, where any heap can take it; a
         * heap keeping its own spare measured 20 MiB more peak RSS at 8
         * threads and no faster. */
        bex__mem_pool_chunk_put(h->pool, c);
        return;
    }
    bucket_insert(h, c);
}

/* In front of the chunks, a few free runs per length, LIFO: a run freed
 * and asked for again at the same length (the common case in a steady
 * state) skips the chunk's bitmap and buckets, whose lines are cold. */
#define RCACHE_PER_LEN 2
#define RCACHE_BYTES   ((size_t)512 << 10)

static struct bex__mem_span *run_get(struct bex__mem_heap *h, unsigned n)
{
    struct bex__list *f = bex__list_first(&h->rcache[n]);
    if (f) {
        struct bex__mem_span *s = bex__list_entry(f, struct bex__mem_span, link);
        bex__list_remove(f);
        h->rcache_len[n]--;
        h->rcache_bytes -= (size_t)n << BEX__MEM_SPAN_SHIFT;
        return s;
    }
    return chunk_run_get(h, n);
}

static void run_put(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    unsigned n = s->span_count;
    size_t bytes = (size_t)n << BEX__MEM_SPAN_SHIFT;
    if (n <= BEX__MEM_MAX_RUN && h->rcache_len[n] < RCACHE_PER_LEN &&
        h->rcache_bytes + bytes <= RCACHE_BYTES) {
        s->kind = BEX__MEM_CACHED;
        s->free = NULL;
        bex__list_push_head(&h->rcache[n], &s->link);
        h->rcache_len[n]++;
        h->rcache_bytes += bytes;
        return;
    }
    chunk_run_put(h, s);
}

static void rcache_flush(struct bex__mem_heap *h)
{
    for (unsigned n = 1; n <= BEX__MEM_MAX_RUN; n++) {
        struct bex__list *f;
        while ((f = bex__list_first(&h->rcache[n]))) {
            bex__list_remove(f);
            chunk_run_put(h, bex__list_entry(f, struct bex__mem_span, link));
        }
        h->rcache_len[n] = 0;
    }
    h->rcache_bytes = 0;
}

/* ---- remote frees ---------------------------------------------------------- */

/* Put a stack taken from xfree onto the run's local list. */
static void take_remote(struct bex__mem_heap *h, struct bex__mem_span *s, uintptr_t x)
{
    void *list = (void *)(x & BEX__MEM_XPTR_MASK);
    if (!list)
        return;
    uint32_t n = (uint32_t)(x >> BEX__MEM_XCNT_SHIFT);
    s->used -= n;
    s->nfree += n;
    add_delta(h, -(int64_t)n * s->block_size);
    if (s->free) {
        void *t = list;
        while (*(void **)t)
            t = *(void **)t;
        *(void **)t = s->free;
    }
    s->free = list;
}

/* Take the remotely freed blocks of an attached run, keeping its flags. */
static void collect(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    uintptr_t x = atomic_load_explicit(&s->xfree, memory_order_relaxed);
    if (!(x & BEX__MEM_XPTR_MASK))
        return;
    while (!atomic_compare_exchange_weak_explicit(&s->xfree, &x, x & BEX__MEM_XFLAGS,
                                                  memory_order_acquire, memory_order_relaxed))
        ;
    take_remote(h, s, x);
}

/* An empty small run goes back to its chunk, unless it is the class's
 * active run (keeping that one stops a lone alloc/free pair from cycling a
 * run) or a remote freer has queued it (drain() must see it first). */
static void maybe_release(struct bex__mem_heap *h, struct bex__mem_span *s)
{
    if (s->used == 0 && h->active[s->cls] != s &&
        !(atomic_load_explicit(&s->xfree, memory_order_relaxed) & BEX__MEM_XQUEUED)) {
        list_remove(h, s);
        run_put(h, s);
    }
}

/* Take back the runs other threads queued: detached small runs that got a
 * remote free, and medium runs freed remotely. */
static void drain(struct bex__mem_heap *h)
{
    struct bex__mem_span *s = atomic_exchange_explicit(&h->xspans, NULL, memory_order_acquire);
    while (s) {
        struct bex__mem_span *next = s->xnext;
        /* Clears QUEUED and NOTIFY too: the run is attached again below. */
        take_remote(h, s, atomic_exchange_explicit(&s->xfree, 0, memory_order_acquire));
        s->xclean = 0;
        if (s->kind == BEX__MEM_MEDIUM) {
            run_put(h, s);
        } else {
            if (!s->attached)
                list_insert(h, s);
            maybe_release(h, s);
        }
        s = next;
    }
}

/* ---- small allocations ---------------------------------------------------- */

/* A block goes back from a bin to its run (bins hold only the heap's own
 * blocks: other threads' frees go to the run's remote list). */
static void block_return(struct bex__mem_heap *h, void *p)
{
    struct bex__mem_span *s = bex__mem_span_of(p);
    assert(s->heap == h);
    *(void **)p = s->free;
    s->free = p;
    s->nfree++;
    s->used--;
    add_delta(h, -(int64_t)s->block_size);
    if (!s->attached)
        list_insert(h, s); /* was full; NOTIFY may stay set, see xfree */
    maybe_release(h, s);
}

/* The bin overflowed: return half of it to the runs. */
BEX__MEM_SLOW static void bin_spill(struct bex__mem_heap *h, struct bex__mem_bin *b)
{
    for (uint32_t k = b->limit / 2; k > 0; k--) {
        void *p = b->list;
        b->list = *(void **)p;
        bin_count_add(b, (uint32_t)-1);
        block_return(h, p);
    }
}

void bex__mem_heap_flush_bins(struct bex__mem_heap *h)
{
    for (unsigned c = 0; c < BEX__MEM_NCLS; c++) {
        struct bex__mem_bin *b = &h->bins[c];
        while (b->list) {
            void *p = b->list;
            b->list = *(void **)p;
            block_return(h, p);
        }
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
    }
}

/* Refill an empty bin from run s: up to half a bin of its free blocks. */
static void bin_fill(struct bex__mem_heap *h, struct bex__mem_bin *b, struct bex__mem_span *s)
{
    uint32_t want = b->limit / 2 ? b->limit / 2 : 1;
    if (s->nfree <= want) {
        b->list = s->free;
        atomic_store_explicit(&b->count, (uint16_t)s->nfree, memory_order_relaxed);
        add_delta(h, (int64_t)s->nfree * s->block_size);
        s->used += s->nfree;
        s->free = NULL;
        s->nfree = 0;
        return;
    }
    void *first = s->free, *last = first;
    for (uint32_t k = 1; k < want; k++)
        last = *(void **)last;
    s->free = *(void **)last;
    *(void **)last = NULL;
    s->nfree -= want;
    s->used += want;
    add_delta(h, (int64_t)want * s->block_size);
    b->list = first;
    atomic_store_explicit(&b->count, (uint16_t)want, memory_order_relaxed);
}

/* Carve never-used blocks of run s straight into the bin, about a page at
 * a time, so a run's pages are touched only when needed. */
static bool bin_carve(struct bex__mem_heap *h, struct bex__mem_bin *b, struct bex__mem_span *s)
{
    uint32_t bs = s->block_size, total = s->capacity * bs;
    if (s->bump >= total)
        return false;
    char *base = bex__mem_span_base(s) + s->bump;
    uint32_t n = (total - s->bump) / bs;
    uint32_t batch = bs >= BEX__MEM_PAGE ? 1 : BEX__MEM_PAGE / bs;
    if (batch > b->limit / 2)
        batch = b->limit / 2 ? b->limit / 2 : 1;
    if (n > batch)
        n = batch;
    for (uint32_t i = 0; i + 1 < n; i++)
        *(void **)(base + (size_t)i * bs) = base + (size_t)(i + 1) * bs;
    *(void **)(base + (size_t)(n - 1) * bs) = NULL;
    b->list = base;
    atomic_store_explicit(&b->count, (uint16_t)n, memory_order_relaxed);
    s->bump += n * bs;
    s->used += n;
    add_delta(h, (int64_t)n * bs);
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
    s->nfree = 0;
    s->bump = 0;
    s->free = NULL;
    s->heap = h;
    atomic_store_explicit(&s->xfree, 0, memory_order_relaxed);
    s->xclean = 0;
    /* Tails carry heap and class too: the free fast path reads only the
     * descriptor of the span holding the block. */
    for (unsigned j = 1; j < n; j++) {
        s[j].offset = (uint8_t)j;
        s[j].kind = BEX__MEM_TAIL;
        s[j].heap = h;
        s[j].cls = (uint8_t)c;
    }
    struct bex__mem_chunk *ch = bex__mem_chunk_of(s);
    for (unsigned j = 0, i = (unsigned)(s - ch->spans); j < n; j++)
        ch->fast[i + j] = (struct bex__mem_fast){h, &h->bins[c]};
    return s;
}

/* The bin of class c is empty: refill it from the class's runs. */
BEX__MEM_SLOW static void *small_refill(struct bex__mem_heap *h, unsigned c)
{
    struct bex__mem_bin *b = &h->bins[c];
    maybe_flush(h, false);
    /* Runs queued by remote frees hold free blocks: take them back before
     * this class grows, whichever class they belong to. */
    if (atomic_load_explicit(&h->xspans, memory_order_relaxed))
        drain(h);
    for (;;) {
        struct bex__mem_span *s = h->active[c];
        if (s != &bex__mem_empty_span) {
            if (!s->free)
                collect(h, s);
            if (s->free)
                bin_fill(h, b, s);
            else if (!bin_carve(h, b, s))
                goto full;
            void *p = b->list;
            b->list = *(void **)p;
            bin_count_add(b, (uint32_t)-1);
            return p;
        full:
            /* Detach the full run; the next remote free into it queues it
             * on h->xspans. NOTIFY may already be set from an earlier
             * detach: then no atomic write at all. */
            {
                uintptr_t x = atomic_load_explicit(&s->xfree, memory_order_relaxed);
                if (x & BEX__MEM_XPTR_MASK)
                    continue; /* a remote free just arrived: collect it */
                if (!(x & BEX__MEM_XNOTIFY) && !atomic_compare_exchange_strong_explicit(
                                                   &s->xfree, &x, x | BEX__MEM_XNOTIFY,
                                                   memory_order_acq_rel, memory_order_relaxed))
                    continue;
                list_remove(h, s);
            }
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

BEX__MEM_SLOW static void *medium_alloc(struct bex__mem_heap *h, size_t size)
{
    if (atomic_load_explicit(&h->xspans, memory_order_relaxed))
        drain(h);
    maybe_flush(h, false);
    unsigned n = (unsigned)((size + BEX__MEM_SPAN_SIZE - 1) >> BEX__MEM_SPAN_SHIFT);
    struct bex__mem_span *s = run_get(h, n);
    if (!s)
        return NULL;
    s->kind = BEX__MEM_MEDIUM;
    s->cls = BEX__MEM_NO_CLASS;
    s->heap = h;
    /* (ownerless: its free takes the slow path, which reads s) */
    bex__mem_chunk_of(s)->fast[s - bex__mem_chunk_of(s)->spans] =
        (struct bex__mem_fast){&bex__mem_ownerless_heap, NULL};
    s->block_size = (uint32_t)n << BEX__MEM_SPAN_SHIFT;
    s->capacity = 1;
    s->used = 1;
    s->free = NULL;
    s->attached = 0;
    /* Cache colour: start successive runs at different 4 KiB offsets when
     * the run's slack allows, so the first lines of buffers do not all fall
     * into the same few cache sets (runs are 64 KiB aligned). */
    size_t slack = ((size_t)n << BEX__MEM_SPAN_SHIFT) - size;
    unsigned colours = (unsigned)(slack / BEX__MEM_PAGE) + 1;
    if (colours > 16)
        colours = 16;
    s->bump = (uint32_t)((h->colour++ % colours) * BEX__MEM_PAGE);
    s->block_size -= s->bump; /* usable bytes */
    /* Born detached: its free, if remote, queues it on h->xspans. A run
     * that was medium and freed by us still holds exactly that: skip the
     * store (and the cold line). */
    if (!s->xclean) {
        atomic_store_explicit(&s->xfree, BEX__MEM_XNOTIFY, memory_order_relaxed);
        s->xclean = 1;
    }
    add_delta(h, s->block_size);
    return bex__mem_span_base(s) + s->bump;
}

/* Collect every remote free of a heap, and give its empty runs and its
 * cache back to the pool. The caller owns h: its thread, or exclusively
 * (thread exit, orphan reclaim). */
void bex__mem_heap_tidy(struct bex__mem_heap *h)
{
    bex__mem_heap_flush_bins(h);
    drain(h);
    for (unsigned c = 0; c < BEX__MEM_NCLS; c++) {
        struct bex__list *pos, *tmp;
        bex__list_foreach_safe(pos, tmp, &h->cls[c])
        {
            struct bex__mem_span *s = bex__list_entry(pos, struct bex__mem_span, link);
            collect(h, s);
            if (s->used == 0 &&
                !(atomic_load_explicit(&s->xfree, memory_order_relaxed) & BEX__MEM_XQUEUED)) {
                list_remove(h, s);
                run_put(h, s);
            }
        }
    }
    rcache_flush(h); /* chunks that become empty go back to the pool */
    maybe_flush(h, true);
}

static void heap_abandon(bex_mem_pool *pool, struct bex__mem_heap *h)
{
    bex__mem_heap_tidy(h);
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
    tl.pool_id = tl.prev_pool_id = 0;
    tl.heap = tl.prev_heap = NULL;
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
    tl.pool_id = tl.prev_pool_id = 0;
    tl.heap = tl.prev_heap = NULL;
}

/* Make (id, h) the cached pool, the one it replaces the previous. */
static struct bex__mem_heap *heap_use(uint64_t id, struct bex__mem_heap *h)
{
    if (tl.pool_id != id) {
        tl.prev_pool_id = tl.pool_id;
        tl.prev_heap = tl.heap;
    }
    tl.pool_id = id;
    tl.heap = h;
    return h;
}

BEX__MEM_SLOW static struct bex__mem_heap *heap_get_slow(bex_mem_pool *pool)
{
    if (!pool) {
        errno = EINVAL;
        return NULL;
    }
    if (!tl.tid)
        tl.tid = atomic_fetch_add_explicit(&next_tid, 1, memory_order_relaxed);
    tl.lookups++;
    for (unsigned i = 0; i < tl.n; i++) {
        if (tl.ents[i].pool_id == pool->id)
            return heap_use(pool->id, tl.ents[i].heap);
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
    return heap_use(pool->id, h);
}

/* ---- the general kind's pool ops ------------------------------------------ */

/* Blocks still out in the run headed by s, without changing anything:
 * those handed out minus those freed remotely and not yet collected. */
static uint32_t run_live(struct bex__mem_span *s)
{
    if (s->kind != BEX__MEM_SMALL && s->kind != BEX__MEM_MEDIUM)
        return 0;
    uintptr_t x = atomic_load_explicit(&s->xfree, memory_order_acquire);
    return s->used - (uint32_t)(x >> BEX__MEM_XCNT_SHIFT);
}

static bool general_busy(bex_mem_pool *pool)
{
    struct bex__list *pos;
    bex__list_foreach(pos, &pool->chunks)
    {
        struct bex__mem_chunk *c = bex__list_entry(pos, struct bex__mem_chunk, link);
        for (unsigned i = 1; i < BEX__MEM_SPANS;) {
            if (c->free_mask & ((uint64_t)1 << i)) {
                i++;
                continue;
            }
            struct bex__mem_span *s = &c->spans[i];
            if (run_live(s))
                return true;
            i += s->span_count ? s->span_count : 1;
        }
    }
    return false;
}

static const struct bex__mem_kind_ops general_ops = {
    .busy = general_busy,
    .heap_flush = bex__mem_heap_flush_bins,
    .heap_tidy = bex__mem_heap_tidy,
};

/* Landing pools never have heaps: their ops need no heap work. */
int bex_mem_pool_create(const bex_mem_registrar *reg, const bex_mem_config *cfg, bex_mem_pool **out)
{
    bex_mem_config c;
    BEX__CFG_TAKE(cfg, c);
    if (!reg || !reg->reg || !reg->dereg || !out)
        return -EINVAL;
    if (cfg && cfg->kind != BEX_MEM_POOL_GENERAL && cfg->kind != BEX_MEM_POOL_LANDING)
        return -EINVAL;
    bool landing = cfg && cfg->kind == BEX_MEM_POOL_LANDING;
    return bex__mem_pool_new(reg, cfg, landing ? &bex__mem_landing_ops : &general_ops, out);
}

/* ---- public entry points --------------------------------------------------- */

/* First allocation of this thread from this pool (or a switch of pools):
 * find or make the heap, then take the normal path. */
BEX__MEM_SLOW static void *alloc_slow(bex_mem_pool *pool, size_t size)
{
    /* Landing pools have no heaps: tl never names one, so they always come
     * here, and the general pools' fast path pays nothing for them. */
    if (pool && pool->kind == BEX_MEM_POOL_LANDING)
        return bex__mem_land_alloc(pool, size);
    if (!heap_get_slow(pool))
        return NULL;
    return bex_mem_alloc(pool, size);
}

void *bex_mem_alloc(bex_mem_pool *pool, size_t size)
{
    if (BEX__MEM_UNLIKELY(!pool || tl.pool_id != pool->id)) {
        /* the pool used before the last (an I/O thread alternates two):
         * swapped in here, without alloc_slow's call */
        if (!pool || tl.prev_pool_id != pool->id || !tl.prev_heap)
            return alloc_slow(pool, size); /* a tail call: no frame here */
        heap_use(pool->id, tl.prev_heap);
    }
    struct bex__mem_heap *h = tl.heap;
    unsigned c;
    /* a message's size first: one test where the small bound's and the
     * class table's were two */
    if (BEX__MEM_LIKELY(size <= 1024))
        c = bex__mem_class_lut_small[(size + 15) >> 4];
    else if (size <= BEX__MEM_SMALL_MAX)
        c = bex__mem_class_lut_big[(size + 127) >> 7];
    else if (size <= BEX__MEM_MEDIUM_MAX)
        return medium_alloc(h, size);
    else
        return bex__mem_huge_alloc(pool, size);
    struct bex__mem_bin *b = bin_at(h, c);
    void *p = b->list;
    if (BEX__MEM_LIKELY(p != NULL)) {
        b->list = *(void **)p;
        bin_count_add(b, (uint32_t)-1);
        return p;
    }
    return small_refill(h, c);
}

struct bex__mem_bin bex__mem_bin_none;

struct bex__mem_bin *bex__mem_thread_bin(bex_mem_pool *pool, size_t size)
{
    if (!pool || pool->kind == BEX_MEM_POOL_LANDING || size > BEX__MEM_SMALL_MAX)
        return NULL;
    struct bex__mem_heap *h = tl.pool_id == pool->id ? tl.heap : heap_get_slow(pool);
    return h ? &h->bins[bex__mem_class_of(size)] : NULL;
}

/* bex__mem_alloc_usable's every case but a hit in the cached pool's bin */
BEX__MEM_SLOW static void *alloc_usable_slow(bex_mem_pool *pool, size_t size, size_t *usable)
{
    void *p = bex_mem_alloc(pool, size);
    if (p)
        *usable = bex_mem_usable_size(p);
    return p;
}

/* A small block's usable size is its class's, known here
 * (bex_mem_usable_size after the allocation was some 24 instructions a
 * message over TCP, issue 25 item 2); the rest is a tail call. */
void *bex__mem_alloc_usable(bex_mem_pool *pool, size_t size, size_t *usable)
{
    if (BEX__MEM_LIKELY(pool && tl.pool_id == pool->id)) {
        unsigned c;
        /* a message's size first, as in bex_mem_alloc */
        if (BEX__MEM_LIKELY(size <= 1024))
            c = bex__mem_class_lut_small[(size + 15) >> 4];
        else if (size <= BEX__MEM_SMALL_MAX)
            c = bex__mem_class_lut_big[(size + 127) >> 7];
        else
            return alloc_usable_slow(pool, size, usable);
        struct bex__mem_bin *b = bin_at(tl.heap, c);
        void *p = b->list;
        if (BEX__MEM_LIKELY(p != NULL)) {
            b->list = *(void **)p;
            bin_count_add(b, (uint32_t)-1);
            *usable = bex__mem_class_size[c];
            return p;
        }
    }
    return alloc_usable_slow(pool, size, usable);
}

BEX__MEM_SLOW static void free_remote(struct bex__mem_span *s, void *p)
{
    if (s->kind == BEX__MEM_HUGE) {
        bex__mem_huge_free(bex__mem_chunk_of(p));
        return;
    }
    if (s->kind == BEX__MEM_LANDING) {
        bex__mem_land_free(p);
        return;
    }
    /* Read the heap before the push: once the block is on the stack the
     * owner may collect it and recycle the run. */
    struct bex__mem_heap *h = s->heap;
    uintptr_t old = atomic_load_explicit(&s->xfree, memory_order_relaxed), nw;
    do {
        *(void **)p = (void *)(old & BEX__MEM_XPTR_MASK);
        nw = (((old >> BEX__MEM_XCNT_SHIFT) + 1) << BEX__MEM_XCNT_SHIFT) | (uintptr_t)p |
             (old & BEX__MEM_XQUEUED);
        if (old & BEX__MEM_XNOTIFY)
            nw |= BEX__MEM_XQUEUED;
    } while (!atomic_compare_exchange_weak_explicit(&s->xfree, &old, nw, memory_order_acq_rel,
                                                    memory_order_relaxed));
    if ((old & BEX__MEM_XFLAGS) == BEX__MEM_XNOTIFY) {
        /* We turned NOTIFY into QUEUED, so we alone queue the run; it cannot
         * be released before drain() sees it, so it stays valid. */
        struct bex__mem_span *top = atomic_load_explicit(&h->xspans, memory_order_relaxed);
        do {
            s->xnext = top;
        } while (!atomic_compare_exchange_weak_explicit(&h->xspans, &top, s, memory_order_release,
                                                        memory_order_relaxed));
    }
}

/* Everything but a small block freed by its owner. */
BEX__MEM_SLOW static void free_slow(void *ptr)
{
    struct bex__mem_span *s = bex__mem_span_of(ptr);
    struct bex__mem_heap *h = s->heap;
    if (atomic_load_explicit(&h->owner, memory_order_relaxed) == tl.tid) {
        /* our own medium run */
        add_delta(h, -(int64_t)s->block_size);
        s->used = 0;
        run_put(h, s);
        return;
    }
    free_remote(s, ptr);
}

void bex_mem_free(void *ptr)
{
    if (!ptr)
        return;
    /* heap and bin of the span holding the block (head or tail alike);
     * the heap is the ownerless one unless the span is small, so its
     * owner's test says both (bex__mem_fast) */
    const struct bex__mem_fast *f = bex__mem_fast_of(ptr);
    struct bex__mem_heap *h = f->heap;
    /* read with the heap (the descriptor is the chunk's header, always
     * mapped; used only when the thread owns the heap): a load from f's
     * address, where reading it after the test kept f's own (issue 25
     * item 2: one instruction a free) */
    struct bex__mem_bin *b = f->bin;
    if (BEX__MEM_LIKELY(atomic_load_explicit(&h->owner, memory_order_relaxed) == tl.tid)) {
        *(void **)ptr = b->list;
        b->list = ptr;
        uint32_t n = atomic_load_explicit(&b->count, memory_order_relaxed); /* before */
        atomic_store_explicit(&b->count, (uint16_t)(n + 1), memory_order_relaxed);
        if (BEX__MEM_UNLIKELY(n >= b->limit)) /* n + 1 > limit */
            bin_spill(h, b);
        return;
    }
    free_slow(ptr);
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
    /* a small block: its class, in the descriptor bex_mem_free reads too
     * (the run's head descriptor and its kind were some 12 instructions
     * more a received message, issue 25 item 2) */
    const struct bex__mem_fast *f = bex__mem_fast_of(ptr);
    if (BEX__MEM_LIKELY(f->bin != NULL))
        return bex__mem_class_size[f->bin->cls];
    struct bex__mem_span *s = bex__mem_span_of(ptr);
    switch (s->kind) {
    case BEX__MEM_SMALL:
        return s->block_size;
    case BEX__MEM_MEDIUM:
        return s->block_size;
    case BEX__MEM_HUGE:
        return bex__mem_chunk_of(ptr)->usable;
    case BEX__MEM_LANDING:
        return bex__mem_land_usable(ptr);
    default:
        return 0;
    }
}

/* bex_mem_mr while a huge mapping longer than a chunk exists */
BEX__MEM_SLOW static const bex_mem_region *mr_slow(const void *ptr)
{
    return &header_of(ptr)->mr;
}

/* header_of's common case inline, the other a tail call: no register
 * saved (issue 25 item 2: every received message's fresh buffer asks) */
const bex_mem_region *bex_mem_mr(const void *ptr)
{
    if (!ptr)
        return NULL;
    if (BEX__MEM_UNLIKELY(atomic_load_explicit(&bex__mem_huge_multi, memory_order_relaxed)))
        return mr_slow(ptr);
    return &bex__mem_chunk_of(ptr)->mr;
}

bex_mem_pool *bex_mem_pool_of(const void *ptr)
{
    if (!ptr)
        return NULL;
    return header_of(ptr)->pool;
}

uint64_t bex__mem_heap_lookups(void)
{
    return tl.lookups;
}

/* The calling thread's heap of pool, or NULL: never creates one. */
static struct bex__mem_heap *heap_find(const bex_mem_pool *pool)
{
    if (tl.pool_id == pool->id)
        return tl.heap;
    for (unsigned i = 0; i < tl.n; i++)
        if (tl.ents[i].pool_id == pool->id)
            return tl.ents[i].heap;
    return NULL;
}

void bex_mem_pool_collect(bex_mem_pool *pool)
{
    struct bex__mem_heap *h = pool ? heap_find(pool) : NULL;
    if (!h)
        return;
    /* detached runs (full small ones, medium ones) that got a remote free */
    drain(h);
    /* and the attached runs of every class, whose remote frees wait in xfree */
    for (unsigned c = 0; c < BEX__MEM_NCLS; c++) {
        struct bex__list *pos;
        bex__list_foreach(pos, &h->cls[c])
            collect(h, bex__list_entry(pos, struct bex__mem_span, link));
    }
    maybe_flush(h, true);
}
