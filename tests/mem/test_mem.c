/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc unit tests, over a counting fake registrar (no device needed). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bex/mem.h"
#include "harness.h"
#include "mem/internal.h"
#include "mem/lookup.h"

/* ---- fake registrar -------------------------------------------------------- */

#define FAKE_MAX 8192

struct fake_region {
    void *addr;
    size_t len;
    uint32_t key;
    int live;
};

struct fake {
    pthread_mutex_t lock;
    unsigned long calls;   /* reg() calls */
    unsigned long fail_at; /* fail call number fail_at (1-based); 0 = never */
    int fail_after;        /* and every call after it */
    int err;               /* negative errno to fail with */
    unsigned long regs, deregs;
    struct fake_region r[FAKE_MAX];
    unsigned n;
};

static int fake_reg(void *ctx, bex_mem_region *mr)
{
    struct fake *f = ctx;
    pthread_mutex_lock(&f->lock);
    unsigned long call = ++f->calls;
    if (f->fail_at && (call == f->fail_at || (f->fail_after && call > f->fail_at))) {
        pthread_mutex_unlock(&f->lock);
        return f->err;
    }
    CHECK(f->n < FAKE_MAX);
    struct fake_region *r = &f->r[f->n++];
    r->addr = mr->addr;
    r->len = mr->length;
    r->key = (uint32_t)f->n;
    r->live = 1;
    mr->lkey = r->key;
    mr->rkey = r->key | 0x80000000u;
    mr->handle = r;
    f->regs++;
    pthread_mutex_unlock(&f->lock);
    return 0;
}

static void fake_dereg(void *ctx, bex_mem_region *mr)
{
    struct fake *f = ctx;
    pthread_mutex_lock(&f->lock);
    struct fake_region *r = mr->handle;
    CHECK(r >= f->r && r < f->r + f->n);
    CHECK(r->live);
    CHECK(r->addr == mr->addr && r->len == mr->length && r->key == mr->lkey);
    r->live = 0;
    f->deregs++;
    pthread_mutex_unlock(&f->lock);
}

static struct fake *fake_new(void)
{
    struct fake *f = calloc(1, sizeof(*f));
    CHECK(f);
    pthread_mutex_init(&f->lock, NULL);
    return f;
}

static unsigned fake_live(struct fake *f)
{
    unsigned live = 0;
    pthread_mutex_lock(&f->lock);
    for (unsigned i = 0; i < f->n; i++)
        live += (unsigned)f->r[i].live;
    pthread_mutex_unlock(&f->lock);
    return live;
}

static bex_mem_pool *pool_new(struct fake *f, size_t retain)
{
    bex_mem_registrar reg = {.reg = fake_reg, .dereg = fake_dereg, .ctx = f};
    bex_mem_config cfg = {.retain_bytes = retain};
    bex_mem_pool *pool = NULL;
    CHECK_OK(bex_mem_pool_create(&reg, &cfg, &pool));
    return pool;
}

/* Every byte of the buffer lies in the live region bex_mem_mr reports, for
 * the first and the last byte alike; alignment is as documented. */
static void check_buf(struct fake *f, bex_mem_pool *pool, void *p, size_t size)
{
    CHECK(p != NULL);
    size_t us = bex_mem_usable_size(p);
    CHECK(us >= size);
    CHECK(us >= 1);
    CHECK((uintptr_t)p % 16 == 0);
    if (size >= 65536)
        CHECK((uintptr_t)p % 4096 == 0);
    const bex_mem_region *mr = bex_mem_mr(p);
    CHECK(mr != NULL);
    char *lo = mr->addr, *hi = lo + mr->length;
    CHECK((char *)p >= lo && (char *)p + us <= hi);
    CHECK(bex_mem_mr((char *)p + us - 1) == mr);
    CHECK(bex_mem_mr((char *)p + us / 2) == mr);
    CHECK(bex__mem_block_mr(p) == mr); /* the engine's inline lookup of a block */
    CHECK(bex_mem_pool_of(p) == pool);
    if (f) {
        struct fake_region *r = mr->handle;
        pthread_mutex_lock(&f->lock);
        CHECK(r >= f->r && r < f->r + f->n);
        CHECK(r->live && r->addr == mr->addr && r->len == mr->length);
        CHECK(r->key == mr->lkey && (r->key | 0x80000000u) == mr->rkey);
        pthread_mutex_unlock(&f->lock);
    }
}

static void fill(void *p, size_t n, uint32_t seed)
{
    unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        c[i] = (unsigned char)(seed * 31u + i * 7u + (i >> 8));
}

static int verify(const void *p, size_t n, uint32_t seed)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        if (c[i] != (unsigned char)(seed * 31u + i * 7u + (i >> 8)))
            return 0;
    return 1;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static void finish(bex_mem_pool *pool, struct fake *f)
{
    CHECK_OK(bex_mem_pool_destroy(pool));
    CHECK_EQ(fake_live(f), 0);
    CHECK_EQ(f->regs, f->deregs);
    pthread_mutex_destroy(&f->lock);
    free(f);
}

/* ---- cases ----------------------------------------------------------------- */

static const size_t boundary_sizes[] = {
    0,
    1,
    15,
    16,
    17,
    31,
    32,
    33,
    100,
    127,
    128,
    129,
    255,
    256,
    257,
    1000,
    1023,
    1024,
    1025,
    2047,
    2048,
    2049,
    4095,
    4096,
    4097,
    8191,
    8192,
    8193,
    16383,
    16384,
    16385,
    32767,
    32768,
    32769,
    65535,
    65536,
    65537,
    131071,
    131072,
    131073,
    1048576,
    2097151,
    2097152,
    2097153,
    4194304 - 65536,
    4194303,
    4194304,
    4194305,
    9 * 1048576 + 7,
    20 * 1048576,
};
#define NSIZES (sizeof boundary_sizes / sizeof boundary_sizes[0])

static int sizes_covered(void)
{
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, 0);
    void *p[NSIZES];
    for (size_t i = 0; i < NSIZES; i++) {
        p[i] = bex_mem_alloc(pool, boundary_sizes[i]);
        check_buf(f, pool, p[i], boundary_sizes[i]);
        fill(p[i], bex_mem_usable_size(p[i]), (uint32_t)i);
    }
    for (size_t i = 0; i < NSIZES; i++) {
        CHECK(verify(p[i], bex_mem_usable_size(p[i]), (uint32_t)i));
        bex_mem_free(p[i]);
    }
    /* bex__mem_alloc_usable (TCP's received buffers) says what
     * bex_mem_usable_size says: at every boundary size, a block from the
     * bin each second time (its first call may refill the bin) */
    for (size_t i = 0; i < NSIZES; i++) {
        for (int k = 0; k < 2; k++) {
            size_t u = 0;
            void *q = bex__mem_alloc_usable(pool, boundary_sizes[i], &u);
            check_buf(f, pool, q, boundary_sizes[i]);
            CHECK_EQ(u, bex_mem_usable_size(q));
            bex_mem_free(q);
        }
    }
    bex_mem_free(NULL);
    CHECK_EQ(bex_mem_usable_size(NULL), 0);
    finish(pool, f);
    return 0;
}

/* Interior pointers of a mapping longer than a chunk find its region. */
static int huge_interior(void)
{
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, 1);
    size_t sz = 13 * 1048576 + 5;
    char *p = bex_mem_alloc(pool, sz);
    check_buf(f, pool, p, sz);
    const bex_mem_region *mr = bex_mem_mr(p);
    for (size_t off = 0; off < sz; off += 1048576 / 3)
        CHECK(bex_mem_mr(p + off) == mr);
    CHECK(bex_mem_mr(p + sz - 1) == mr);
    /* A regular chunk allocated meanwhile is still found by masking. */
    void *q = bex_mem_alloc(pool, 100);
    check_buf(f, pool, q, 100);
    bex_mem_free(q);
    bex_mem_free(p);
    bex_mem_stats st;
    bex_mem_pool_stats(pool, &st);
    CHECK(st.deregistrations >= 1); /* retain of 1 byte: released at once */
    finish(pool, f);
    return 0;
}

struct live {
    void *p;
    size_t size;
    uint32_t seed;
};

static size_t random_size(uint64_t *rng)
{
    uint64_t r = rng_next(rng);
    switch (r % 16) {
    case 0:
        return (size_t)(r >> 8) % 300000;
    case 1:
        return (r >> 8) % 64 == 0 ? 4194304 + (size_t)(r >> 20) % 3000000 : 70000;
    case 2:
    case 3:
    case 4:
        return (size_t)(r >> 8) % 16384;
    default:
        return (size_t)(r >> 8) % 512;
    }
}

/* The size -> class tables give the smallest class that fits. */
static int size_classes(void)
{
    for (size_t size = 0; size <= BEX__MEM_SMALL_MAX; size++) {
        unsigned c = bex__mem_class_of(size);
        CHECK(c < BEX__MEM_NCLS);
        CHECK(bex__mem_class_size[c] >= size);
        CHECK(c == 0 || bex__mem_class_size[c - 1] < size);
    }
    for (unsigned c = 0; c < BEX__MEM_NCLS; c++) {
        CHECK(bex__mem_class_size[c] % 16 == 0);
        CHECK(((size_t)bex__mem_class_spans[c] << BEX__MEM_SPAN_SHIFT) / bex__mem_class_size[c] >=
              8);
    }
    return 0;
}

static int no_overlap(void)
{
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, 0);
    enum { N = 3000 };
    struct live *l = calloc(N, sizeof(*l));
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < N; i++) {
            if (l[i].p)
                continue;
            l[i].size = random_size(&rng);
            l[i].seed = (uint32_t)rng_next(&rng);
            l[i].p = bex_mem_alloc(pool, l[i].size);
            check_buf(f, pool, l[i].p, l[i].size);
            fill(l[i].p, l[i].size, l[i].seed);
        }
        for (int i = 0; i < N; i++)
            CHECK(verify(l[i].p, l[i].size, l[i].seed));
        for (int i = 0; i < N; i++) {
            if (rng_next(&rng) % 2) {
                bex_mem_free(l[i].p);
                l[i].p = NULL;
            }
        }
    }
    for (int i = 0; i < N; i++)
        bex_mem_free(l[i].p);
    free(l);
    bex_mem_stats st;
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.in_use_bytes, 0);
    finish(pool, f);
    return 0;
}

static int stats_in_use(void)
{
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, 0);
    void *p[NSIZES];
    size_t sum = 0;
    for (size_t i = 0; i < NSIZES; i++) {
        p[i] = bex_mem_alloc(pool, boundary_sizes[i]);
        CHECK(p[i]);
        sum += bex_mem_usable_size(p[i]);
    }
    bex_mem_stats st;
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.in_use_bytes, sum);
    CHECK(st.peak_in_use_bytes >= sum);
    CHECK(st.chunks >= 1 && st.registrations == st.chunks);
    CHECK(st.registered_bytes >= sum && st.peak_registered_bytes >= st.registered_bytes);
    for (size_t i = 0; i < NSIZES; i++)
        bex_mem_free(p[i]);
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.in_use_bytes, 0);
    CHECK(st.peak_in_use_bytes >= sum);
    finish(pool, f);
    return 0;
}

static int pools_and_bad_args(void)
{
    bex_mem_registrar noop;
    bex_mem_registrar_noop(&noop);
    bex_mem_pool *a, *b, *bad = NULL;
    CHECK_EQ(bex_mem_pool_create(NULL, NULL, &bad), -EINVAL);
    bex_mem_registrar half = {.reg = noop.reg};
    CHECK_EQ(bex_mem_pool_create(&half, NULL, &bad), -EINVAL);
    CHECK_OK(bex_mem_pool_create(&noop, NULL, &a));
    CHECK_OK(bex_mem_pool_create(&noop, NULL, &b));
    errno = 0;
    CHECK(bex_mem_alloc(NULL, 10) == NULL && errno == EINVAL);
    CHECK_EQ(bex_mem_pool_destroy(NULL), -EINVAL);
    /* Alternate pools on one thread: each buffer knows its own pool. */
    void *pa[64], *pb[64];
    for (int i = 0; i < 64; i++) {
        pa[i] = bex_mem_alloc(a, (size_t)i * 100);
        pb[i] = bex_mem_alloc(b, (size_t)i * 100);
        check_buf(NULL, a, pa[i], (size_t)i * 100);
        check_buf(NULL, b, pb[i], (size_t)i * 100);
        CHECK(bex_mem_mr(pa[i])->lkey == 0 && bex_mem_mr(pa[i])->rkey == 0);
    }
    for (int i = 0; i < 64; i++) {
        bex_mem_free(pa[i]);
        bex_mem_free(pb[i]);
    }
    CHECK_OK(bex_mem_pool_destroy(a));
    /* Pools created and destroyed repeatedly on one thread. */
    for (int i = 0; i < 40; i++) {
        bex_mem_pool *c;
        CHECK_OK(bex_mem_pool_create(&noop, NULL, &c));
        void *x = bex_mem_alloc(c, 1000);
        void *y = bex_mem_alloc(b, 1000);
        check_buf(NULL, c, x, 1000);
        bex_mem_free(x);
        bex_mem_free(y);
        CHECK_OK(bex_mem_pool_destroy(c));
    }
    CHECK_OK(bex_mem_pool_destroy(b));
    return 0;
}

/* A thread alternating two pools (an I/O thread's receive buffers and
 * its answers) finds each pool's heap without searching its list: two
 * allocations a sub-request went the slow way (bench/cost/ps-fanout). */
static int two_pools_cached(void)
{
    bex_mem_registrar noop;
    bex_mem_registrar_noop(&noop);
    bex_mem_pool *a, *b;
    CHECK_OK(bex_mem_pool_create(&noop, NULL, &a));
    CHECK_OK(bex_mem_pool_create(&noop, NULL, &b));
    bex_mem_free(bex_mem_alloc(a, 100));
    bex_mem_free(bex_mem_alloc(b, 100));
    uint64_t before = bex__mem_heap_lookups();
    for (int i = 0; i < 100; i++) {
        void *x = bex_mem_alloc(a, 100), *y = bex_mem_alloc(b, 2000);
        check_buf(NULL, a, x, 100);
        check_buf(NULL, b, y, 2000);
        bex_mem_free(x);
        bex_mem_free(y);
    }
    CHECK_EQ(bex__mem_heap_lookups() - before, 0);
    /* a third pool is searched for, and the two last used stay cached */
    bex_mem_pool *c;
    CHECK_OK(bex_mem_pool_create(&noop, NULL, &c));
    bex_mem_free(bex_mem_alloc(c, 100));
    bex_mem_free(bex_mem_alloc(a, 100));
    before = bex__mem_heap_lookups();
    bex_mem_free(bex_mem_alloc(c, 100));
    bex_mem_free(bex_mem_alloc(a, 100));
    CHECK_EQ(bex__mem_heap_lookups() - before, 0);
    CHECK_OK(bex_mem_pool_destroy(c));
    /* a pool created where a destroyed one was is not taken for it */
    CHECK_OK(bex_mem_pool_create(&noop, NULL, &c));
    void *z = bex_mem_alloc(c, 100);
    check_buf(NULL, c, z, 100);
    bex_mem_free(z);
    CHECK_OK(bex_mem_pool_destroy(c));
    CHECK_OK(bex_mem_pool_destroy(a));
    CHECK_OK(bex_mem_pool_destroy(b));
    return 0;
}

static int destroy_busy(void)
{
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, 0);
    const size_t sizes[] = {10, 40000, 1000000, 6000000};
    for (size_t i = 0; i < 4; i++) {
        void *p = bex_mem_alloc(pool, sizes[i]);
        CHECK(p);
        CHECK_EQ(bex_mem_pool_destroy(pool), -EBUSY);
        CHECK(bex_mem_mr(p)->length > 0); /* nothing was destroyed */
        memset(p, 1, sizes[i]);
        bex_mem_free(p);
    }
    finish(pool, f);
    return 0;
}

/* ---- cross-thread ---------------------------------------------------------- */

struct xarg {
    bex_mem_pool *pool;
    void **bufs;
    size_t n;
    pthread_barrier_t *bar;
};

static void *alloc_many(void *a)
{
    struct xarg *x = a;
    for (size_t i = 0; i < x->n; i++) {
        size_t sz = (i * 97) % 20000 + (i % 50 == 0 ? 300000 : 0);
        x->bufs[i] = bex_mem_alloc(x->pool, sz);
        CHECK(x->bufs[i]);
        fill(x->bufs[i], sz < 64 ? sz : 64, (uint32_t)i);
    }
    if (x->bar) {
        pthread_barrier_wait(x->bar); /* main frees them all */
        pthread_barrier_wait(x->bar);
        /* Reuse what the other thread freed. */
        for (size_t i = 0; i < x->n; i++)
            x->bufs[i] = bex_mem_alloc(x->pool, (i * 97) % 20000);
        for (size_t i = 0; i < x->n; i++)
            bex_mem_free(x->bufs[i]);
    }
    return NULL;
}

static int cross_thread_free(void)
{
    struct fake *f = fake_new();
    /* Retain everything: the second round must reuse, not re-register. */
    bex_mem_pool *pool = pool_new(f, (size_t)1 << 30);
    enum { N = 8000 };
    void **bufs = calloc(N, sizeof(void *));
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    struct xarg x = {pool, bufs, N, &bar};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, alloc_many, &x) == 0);
    pthread_barrier_wait(&bar);
    for (size_t i = 0; i < N; i++) {
        size_t sz = (i * 97) % 20000;
        CHECK(verify(bufs[i], sz < 64 ? sz : 64, (uint32_t)i));
        bex_mem_free(bufs[i]);
    }
    bex_mem_stats st;
    bex_mem_pool_stats(pool, &st);
    uint64_t regs = st.registrations;
    pthread_barrier_wait(&bar);
    pthread_join(t, NULL);
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.registrations, regs); /* the second round reused the memory */
    CHECK_EQ(st.in_use_bytes, 0);
    pthread_barrier_destroy(&bar);
    free(bufs);
    finish(pool, f);
    return 0;
}

/* A thread exits with live buffers; others free them; the next thread
 * adopts its heap; everything is returned at the end. */
static int thread_exit_adopt(void)
{
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, 0);
    enum { N = 5000 };
    void **bufs = calloc(N, sizeof(void *));
    struct xarg x = {pool, bufs, N, NULL};
    for (int round = 0; round < 4; round++) {
        pthread_t t;
        CHECK(pthread_create(&t, NULL, alloc_many, &x) == 0);
        pthread_join(t, NULL);
        CHECK_EQ(bex_mem_pool_destroy(pool), -EBUSY);
        for (size_t i = 0; i < N; i++)
            bex_mem_free(bufs[i]);
    }
    bex_mem_stats st;
    bex_mem_pool_stats(pool, &st);
    /* Adoption reuses the dead threads' spans instead of mapping more. */
    CHECK(st.peak_registered_bytes <= 8 * (size_t)4194304 * 4);
    free(bufs);
    finish(pool, f);
    return 0;
}

/* A thread holds heaps of two pools; one pool is destroyed while the
 * thread lives on; the thread's exit must skip it and orphan the other. */
struct two_pools {
    bex_mem_pool *a, *b;
    pthread_barrier_t bar;
};

static void *use_two_pools(void *arg)
{
    struct two_pools *tp = arg;
    for (int i = 0; i < 100; i++) {
        bex_mem_free(bex_mem_alloc(tp->a, (size_t)i * 300));
        bex_mem_free(bex_mem_alloc(tp->b, (size_t)i * 300));
    }
    void *keep = bex_mem_alloc(tp->b, 5000);
    CHECK(keep);
    pthread_barrier_wait(&tp->bar); /* main destroys a */
    pthread_barrier_wait(&tp->bar);
    for (int i = 0; i < 100; i++)
        bex_mem_free(bex_mem_alloc(tp->b, 70000));
    return keep; /* freed by main after the exit */
}

static int destroyed_pool_thread_exit(void)
{
    struct fake *fa = fake_new(), *fb = fake_new();
    struct two_pools tp;
    tp.a = pool_new(fa, 0);
    tp.b = pool_new(fb, 0);
    pthread_barrier_init(&tp.bar, NULL, 2);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, use_two_pools, &tp) == 0);
    pthread_barrier_wait(&tp.bar);
    finish(tp.a, fa);
    /* a new pool may land where a was: the thread must not mistake it */
    struct fake *fc = fake_new();
    bex_mem_pool *c = pool_new(fc, 0);
    pthread_barrier_wait(&tp.bar);
    void *keep;
    pthread_join(t, &keep);
    CHECK_EQ(bex_mem_pool_destroy(tp.b), -EBUSY);
    check_buf(fb, tp.b, keep, 5000);
    bex_mem_free(keep); /* into the dead thread's orphaned heap */
    void *x = bex_mem_alloc(c, 100);
    check_buf(fc, c, x, 100);
    bex_mem_free(x);
    finish(c, fc);
    finish(tp.b, fb);
    pthread_barrier_destroy(&tp.bar);
    return 0;
}

/* ---- randomized stress with hand-off between threads ---------------------- */

#define STRESS_THREADS 4
#define QCAP           1024

struct msg {
    uint32_t magic, seed;
    uint64_t size;
};

struct queue {
    pthread_mutex_t lock;
    void *item[QCAP];
    unsigned head, tail;
};

struct stress {
    bex_mem_pool *pool;
    struct fake *f;
    struct queue q[STRESS_THREADS];
    _Atomic int stop;
    _Atomic unsigned long ops;
};

struct sarg {
    struct stress *st;
    int id;
};

static int q_push(struct queue *q, void *p)
{
    pthread_mutex_lock(&q->lock);
    int ok = q->tail - q->head < QCAP;
    if (ok)
        q->item[q->tail++ % QCAP] = p;
    pthread_mutex_unlock(&q->lock);
    return ok;
}

static void *q_pop(struct queue *q)
{
    void *p = NULL;
    pthread_mutex_lock(&q->lock);
    if (q->head != q->tail)
        p = q->item[q->head++ % QCAP];
    pthread_mutex_unlock(&q->lock);
    return p;
}

static void check_and_free(struct msg *m)
{
    CHECK(m->magic == 0xb3a110c);
    size_t n = (size_t)m->size - sizeof(*m);
    CHECK(bex_mem_usable_size(m) >= m->size);
    CHECK(verify(m + 1, n < 256 ? n : 256, m->seed));
    if (n > 256)
        CHECK(verify((char *)(m + 1) + n - 1, 1, m->seed + 1));
    bex_mem_free(m);
}

static void *stress_thread(void *a)
{
    struct sarg *sa = a;
    struct stress *st = sa->st;
    uint64_t rng = 0x1234567ull * (uint64_t)(sa->id + 1);
    enum { SLOTS = 256 };
    struct msg *slot[SLOTS] = {0};
    unsigned long ops = 0;
    while (!atomic_load_explicit(&st->stop, memory_order_relaxed)) {
        for (int k = 0; k < 64; k++, ops++) {
            unsigned i = (unsigned)(rng_next(&rng) % SLOTS);
            if (slot[i]) {
                struct queue *q =
                    &st->q[(unsigned)(sa->id + 1 + rng_next(&rng) % (STRESS_THREADS - 1)) %
                           STRESS_THREADS];
                if (rng_next(&rng) % 3 != 0 || !q_push(q, slot[i]))
                    check_and_free(slot[i]);
                slot[i] = NULL;
            }
            size_t size = sizeof(struct msg) + random_size(&rng) / 4;
            struct msg *m = bex_mem_alloc(st->pool, size);
            CHECK(m);
            m->magic = 0xb3a110c;
            m->seed = (uint32_t)rng_next(&rng);
            m->size = size;
            size_t n = size - sizeof(*m);
            fill(m + 1, n < 256 ? n : 256, m->seed);
            if (n > 256)
                fill((char *)(m + 1) + n - 1, 1, m->seed + 1);
            if (rng_next(&rng) % 64 == 0) {
                const bex_mem_region *mr = bex_mem_mr((char *)m + size - 1);
                CHECK((char *)m >= (char *)mr->addr &&
                      (char *)m + size <= (char *)mr->addr + mr->length);
            }
            slot[i] = m;
            for (void *p; (p = q_pop(&st->q[sa->id])) != NULL;)
                check_and_free(p);
        }
    }
    for (unsigned i = 0; i < SLOTS; i++)
        if (slot[i])
            check_and_free(slot[i]);
    atomic_fetch_add(&st->ops, ops);
    return NULL;
}

static int stress(void)
{
    struct stress *st = calloc(1, sizeof(*st));
    st->f = fake_new();
    st->pool = pool_new(st->f, (size_t)8 << 20);
    for (int i = 0; i < STRESS_THREADS; i++)
        pthread_mutex_init(&st->q[i].lock, NULL);
    const char *env = getenv("BEX_STRESS_SECONDS");
    double secs = env ? atof(env) : 3.0;
    /* Threads come and go, so heaps get orphaned and adopted mid-run. */
    int generations = 3;
    for (int g = 0; g < generations; g++) {
        pthread_t t[STRESS_THREADS];
        struct sarg sa[STRESS_THREADS];
        atomic_store(&st->stop, 0);
        for (int i = 0; i < STRESS_THREADS; i++) {
            sa[i] = (struct sarg){st, i};
            CHECK(pthread_create(&t[i], NULL, stress_thread, &sa[i]) == 0);
        }
        struct timespec ts = {
            (time_t)(secs / generations),
            (long)((secs / generations - (double)(time_t)(secs / generations)) * 1e9)};
        nanosleep(&ts, NULL);
        atomic_store(&st->stop, 1);
        for (int i = 0; i < STRESS_THREADS; i++)
            pthread_join(t[i], NULL);
        for (int i = 0; i < STRESS_THREADS; i++)
            for (void *p; (p = q_pop(&st->q[i])) != NULL;)
                check_and_free(p);
    }
    bex_mem_stats s;
    bex_mem_pool_stats(st->pool, &s);
    fprintf(stderr, "stress: %lu ops, peak registered %zu MiB, regs %lu deregs %lu\n",
            (unsigned long)st->ops, s.peak_registered_bytes >> 20, (unsigned long)s.registrations,
            (unsigned long)s.deregistrations);
    CHECK_EQ(s.in_use_bytes, 0);
    finish(st->pool, st->f);
    for (int i = 0; i < STRESS_THREADS; i++)
        pthread_mutex_destroy(&st->q[i].lock);
    free(st);
    return 0;
}

/* ---- registration behaviour ------------------------------------------------ */

static void churn(bex_mem_pool *pool, int iters, uint64_t *rng)
{
    enum { SLOTS = 64 };
    void *slot[SLOTS] = {0};
    size_t slot_base[SLOTS];
    uint64_t srng = 7;
    for (unsigned k = 0; k < SLOTS; k++)
        slot_base[k] = random_size(&srng) % 2000000;
    for (int i = 0; i < iters; i++) {
        unsigned k = (unsigned)(rng_next(rng) % SLOTS);
        bex_mem_free(slot[k]);
        /* Each slot keeps to its own size range, so the live set is bounded
         * as in a real steady state; slot 0 holds huge buffers. */
        uint64_t r = rng_next(rng);
        size_t base = k == 0 ? (size_t)5 << 20 : slot_base[k];
        size_t size = base + (size_t)(r % (base / 8 + 1));
        slot[k] = bex_mem_alloc(pool, size);
        CHECK(slot[k]);
        ((char *)slot[k])[0] = 1;
    }
    for (unsigned k = 0; k < SLOTS; k++)
        bex_mem_free(slot[k]);
}

static int steady_registrations(void)
{
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, 0);
    uint64_t rng = 42;
    for (int r = 0; r < 3; r++)
        churn(pool, 20000, &rng); /* warm-up */
    bex_mem_stats a, b;
    bex_mem_pool_stats(pool, &a);
    for (int r = 0; r < 5; r++)
        churn(pool, 20000, &rng);
    bex_mem_pool_stats(pool, &b);
    fprintf(stderr, "registrations %lu -> %lu\n", (unsigned long)a.registrations,
            (unsigned long)b.registrations);
    CHECK_EQ(b.registrations, a.registrations);
    CHECK_EQ(b.deregistrations, a.deregistrations);
    finish(pool, f);
    return 0;
}

/* Allocate n blocks of size; the registrations that took. */
static unsigned long regs_during(struct fake *f, bex_mem_pool *pool, size_t n, size_t size)
{
    void **p = calloc(n, sizeof(*p));
    CHECK(p);
    unsigned long before = f->regs;
    for (size_t i = 0; i < n; i++) {
        CHECK((p[i] = bex_mem_alloc(pool, size)) != NULL);
        check_buf(f, pool, p[i], size);
    }
    unsigned long regs = f->regs - before;
    for (size_t i = 0; i < n; i++)
        bex_mem_free(p[i]);
    free(p);
    return regs;
}

/* bex_mem_pool_reserve registers ahead, so that the allocations it was
 * told of register nothing on the way: an engine refilling its receive
 * buffers stopped for a registration at each new chunk (tens of ms on
 * Soft-RoCE), a 40 ms tail in the RPC benchmark. */
static int reserve_ahead(void)
{
    static const struct {
        size_t n, size;
    } cases[] = {{100, 65600}, {1000, 8208}, {30, ((size_t)1 << 20) + 1}};
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        size_t n = cases[k].n, size = cases[k].size;
        /* without: the allocations register as they go */
        struct fake *f = fake_new();
        bex_mem_pool *pool = pool_new(f, 0);
        CHECK(regs_during(f, pool, n, size) >= 2);
        finish(pool, f);
        /* with: all of it up front, once */
        f = fake_new();
        pool = pool_new(f, 0);
        CHECK_OK(bex_mem_pool_reserve(pool, n, size));
        unsigned long ahead = f->regs;
        CHECK(ahead >= 2);
        CHECK_OK(bex_mem_pool_reserve(pool, n, size)); /* already there */
        CHECK_EQ(f->regs, ahead);
        CHECK_EQ(regs_during(f, pool, n, size), 0);
        finish(pool, f);
    }
    /* capped at retain_bytes: 100 x 128 KiB runs would need 4 chunks */
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, (size_t)8 << 20);
    CHECK_OK(bex_mem_pool_reserve(pool, 100, 65600));
    CHECK_EQ(f->regs, 2);
    CHECK_OK(bex_mem_pool_reserve(pool, 0, 65600));
    CHECK_EQ(bex_mem_pool_reserve(pool, 1, ((size_t)2 << 20) + 1), -EINVAL); /* huge */
    CHECK_EQ(bex_mem_pool_reserve(NULL, 1, 64), -EINVAL);
    CHECK_EQ(f->regs, 2);
    finish(pool, f);
    return 0;
}

static int chunks_released(void)
{
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, (size_t)4 << 20);
    enum { N = 96 };
    void *p[N];
    for (int i = 0; i < N; i++) {
        p[i] = bex_mem_alloc(pool, 1048576 + (size_t)(i % 3) * 4096);
        CHECK(p[i]);
    }
    void *h[3];
    for (int i = 0; i < 3; i++)
        CHECK((h[i] = bex_mem_alloc(pool, (size_t)(6 + i) << 20)) != NULL);
    bex_mem_stats a, b;
    bex_mem_pool_stats(pool, &a);
    CHECK(a.registered_bytes >= (size_t)N << 20);
    for (int i = 0; i < N; i++)
        bex_mem_free(p[i]);
    for (int i = 0; i < 3; i++)
        bex_mem_free(h[i]);
    bex_mem_pool_stats(pool, &b);
    fprintf(stderr, "registered %zu -> %zu MiB, deregs %lu\n", a.registered_bytes >> 20,
            b.registered_bytes >> 20, (unsigned long)b.deregistrations);
    CHECK(b.deregistrations > a.deregistrations);
    /* Left: the retained 4 MiB, the thread's run cache, partly used chunks. */
    CHECK(b.registered_bytes <= (size_t)16 << 20);
    CHECK(b.chunks < a.chunks);
    CHECK_EQ(f->regs - f->deregs, b.chunks);
    finish(pool, f);
    return 0;
}

static unsigned maps_count(void)
{
    FILE *fp = fopen("/proc/self/maps", "r");
    CHECK(fp);
    unsigned n = 0;
    for (int ch; (ch = fgetc(fp)) != EOF;)
        n += ch == '\n';
    fclose(fp);
    return n;
}

static int registrar_failure(void)
{
    struct fake *f = fake_new();
    bex_mem_pool *pool = pool_new(f, 0);
    f->err = -EPERM;
    f->fail_at = 1;
    f->fail_after = 1;
    const size_t sizes[] = {0, 100, 20000, 70000, 2000000, 5000000, 30000000};
    unsigned before = 0;
    for (int r = 0; r < 50; r++) {
        if (r == 10)
            before = maps_count(); /* after the first rounds settle libc and sanitizers */
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            errno = 0;
            CHECK(bex_mem_alloc(pool, sizes[i]) == NULL);
            CHECK_EQ(errno, EPERM);
        }
    }
    unsigned after = maps_count();
    fprintf(stderr, "mappings %u -> %u\n", before, after);
    CHECK(after <= before + 2); /* nothing mapped stays behind */
    bex_mem_stats st;
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.chunks, 0);
    CHECK_EQ(st.registered_bytes, 0);
    CHECK_EQ(st.registrations, 0);
    CHECK_EQ(st.in_use_bytes, 0);

    /* Transient: only the next call fails; the one after succeeds. */
    f->err = -ENOMEM;
    f->fail_after = 0;
    f->fail_at = f->calls + 1;
    errno = 0;
    CHECK(bex_mem_alloc(pool, 64) == NULL && errno == ENOMEM);
    void *p = bex_mem_alloc(pool, 64);
    check_buf(f, pool, p, 64);
    /* Fail the second chunk while the first one is in use. */
    f->fail_at = f->calls + 1;
    void *big[80];
    int got = 0, failed = 0;
    for (int i = 0; i < 80; i++) {
        big[i] = bex_mem_alloc(pool, 1000000);
        if (big[i]) {
            got++;
        } else {
            failed++;
            CHECK_EQ(errno, ENOMEM);
        }
    }
    CHECK_EQ(failed, 1);
    for (int i = 0; i < 80; i++)
        bex_mem_free(big[i]);
    bex_mem_free(p);
    finish(pool, f);
    return 0;
}

static int default_pool(void)
{
    errno = 0;
    CHECK(bex_mem_default_alloc(10) == NULL);
    CHECK(bex_mem_default_pool() == NULL);
    CHECK_EQ(bex_mem_default_fini(), -EINVAL);
    CHECK_OK(bex_mem_default_init(NULL));
    CHECK_EQ(bex_mem_default_init(NULL), -EALREADY);
    CHECK(bex_mem_default_pd() == NULL);
    void *p = bex_mem_default_alloc(5000);
    check_buf(NULL, bex_mem_default_pool(), p, 5000);
    const bex_mem_region *mr = bex_mem_mr(p);
    CHECK(mr->lkey == 0 && mr->rkey == 0 && mr->handle == NULL);
    CHECK_EQ(bex_mem_default_fini(), -EBUSY);
    bex_mem_free(p);
    CHECK_OK(bex_mem_default_fini());
    CHECK(bex_mem_default_alloc(10) == NULL);
    CHECK_OK(bex_mem_default_init(NULL));
    CHECK_OK(bex_mem_default_fini());
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(size_classes), BEX_CASE(sizes_covered), BEX_CASE(huge_interior),
              BEX_CASE(no_overlap), BEX_CASE(stats_in_use), BEX_CASE(pools_and_bad_args),
              BEX_CASE(destroy_busy), BEX_CASE(cross_thread_free), BEX_CASE(thread_exit_adopt),
              BEX_CASE(destroyed_pool_thread_exit), BEX_CASE(stress),
              BEX_CASE(steady_registrations), BEX_CASE(chunks_released),
              BEX_CASE(registrar_failure), BEX_CASE(default_pool), BEX_CASE(reserve_ahead),
              BEX_CASE(two_pools_cached))
