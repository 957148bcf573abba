/* SPDX-License-Identifier: Apache-2.0 */
/* Landing pools (bemalloc memory a peer may write), over a recording fake
 * registrar: the registered ranges hold payload pages only, every byte of
 * them may be scribbled on without harm to the allocator, buffers are
 * freed from any thread, the counters add up. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bex/mem.h"
#include "harness.h"
#include "mem/internal.h"
#include "mem/lookup.h"

#define REG_MAX 4096

struct rec {
    pthread_mutex_t lock;
    struct {
        char *addr;
        size_t len;
        int live;
    } r[REG_MAX];
    unsigned n;
};

static int rec_reg(void *ctx, bex_mem_region *mr)
{
    struct rec *f = ctx;
    pthread_mutex_lock(&f->lock);
    CHECK(f->n < REG_MAX);
    unsigned i = f->n++;
    f->r[i].addr = mr->addr;
    f->r[i].len = mr->length;
    f->r[i].live = 1;
    mr->lkey = i + 1;
    mr->rkey = (i + 1) | 0x80000000u;
    mr->handle = &f->r[i];
    pthread_mutex_unlock(&f->lock);
    return 0;
}

static void rec_dereg(void *ctx, bex_mem_region *mr)
{
    struct rec *f = ctx;
    pthread_mutex_lock(&f->lock);
    CHECK(f->r[mr->lkey - 1].live);
    f->r[mr->lkey - 1].live = 0;
    pthread_mutex_unlock(&f->lock);
}

static struct rec *rec_new(void)
{
    struct rec *f = calloc(1, sizeof(*f));
    CHECK(f);
    pthread_mutex_init(&f->lock, NULL);
    return f;
}

static bex_mem_pool *landing_pool(struct rec *f, size_t retain)
{
    bex_mem_registrar reg = {.reg = rec_reg, .dereg = rec_dereg, .ctx = f};
    bex_mem_config cfg = {.kind = BEX_MEM_POOL_LANDING, .retain_bytes = retain};
    bex_mem_pool *pool;
    CHECK_OK(bex_mem_pool_create(&reg, &cfg, &pool));
    CHECK_EQ(bex_mem_pool_kind(pool), BEX_MEM_POOL_LANDING);
    return pool;
}

/* [a, a+alen) and [b, b+blen) share no byte. */
static int disjoint(const void *a, size_t alen, const void *b, size_t blen)
{
    return (const char *)a + alen <= (const char *)b || (const char *)b + blen <= (const char *)a;
}

/* Every byte bemalloc keeps about p's chunk or mapping lies outside every
 * live registered range. */
static void check_meta_outside(struct rec *f, const void *p)
{
    struct bex__mem_chunk *c = bex__mem_chunk_of(p);
    if (bex__mem_huge_multi) {
        struct bex__mem_chunk *h = bex__mem_huge_lookup(p);
        if (h)
            c = h;
    }
    for (unsigned i = 0; i < f->n; i++) {
        if (!f->r[i].live)
            continue;
        CHECK(disjoint(c, sizeof(*c), f->r[i].addr, f->r[i].len));
        if (c->land)
            CHECK(disjoint(c->land, sizeof(*c->land), f->r[i].addr, f->r[i].len));
    }
}

/* Layout: every buffer is page-aligned payload inside its region; the
 * region starts past the header (span 0 of a chunk, the header pages of a
 * huge mapping) and nothing bemalloc reads is inside any region. */
static int layout(void)
{
    struct rec *f = rec_new();
    bex_mem_pool *pool = landing_pool(f, 0);
    const size_t sizes[] = {0,       1,         4096,          4097,      65536,  100000,
                            1 << 20, (2 << 20), (2 << 20) + 1, (4 << 20), 9 << 20};
    enum { N = sizeof sizes / sizeof sizes[0] };
    void *p[N];
    for (int i = 0; i < N; i++) {
        p[i] = bex_mem_alloc(pool, sizes[i]);
        CHECK(p[i]);
        size_t u = bex_mem_usable_size(p[i]);
        CHECK(u >= sizes[i] && u >= 1);
        CHECK_EQ((uintptr_t)p[i] % 4096, 0);
        CHECK_EQ(u % 4096, 0);
        CHECK(bex_mem_pool_of(p[i]) == pool);
        const bex_mem_region *r = bex_mem_mr(p[i]);
        CHECK((char *)p[i] >= (char *)r->addr && (char *)p[i] + u <= (char *)r->addr + r->length);
        /* an interior pointer finds the same region */
        CHECK(bex_mem_mr((char *)p[i] + u - 1) == r);
        CHECK(bex__mem_block_mr(p[i]) == r); /* the engine's inline lookup of a block */
        uintptr_t base = bex__mem_base_of(p[i]);
        if (sizes[i] <= BEX__MEM_MEDIUM_MAX) {
            CHECK_EQ((uintptr_t)r->addr, base + BEX__MEM_SPAN_SIZE);
            CHECK_EQ(r->length, BEX__MEM_CHUNK_SIZE - BEX__MEM_SPAN_SIZE);
        } else {
            CHECK_EQ((uintptr_t)r->addr, base + BEX__MEM_HUGE_HDR);
            CHECK_EQ((uintptr_t)r->addr, (uintptr_t)p[i]);
            CHECK_EQ(r->length, u);
        }
        memset(p[i], 0x5a, u);
    }
    for (int i = 0; i < N; i++) {
        check_meta_outside(f, p[i]);
        for (int j = 0; j < i; j++)
            CHECK(disjoint(p[i], bex_mem_usable_size(p[i]), p[j], bex_mem_usable_size(p[j])));
    }
    /* a general pool on the same registrar: one region per whole chunk */
    bex_mem_registrar reg = {.reg = rec_reg, .dereg = rec_dereg, .ctx = f};
    bex_mem_pool *gen;
    CHECK_OK(bex_mem_pool_create(&reg, NULL, &gen));
    CHECK_EQ(bex_mem_pool_kind(gen), BEX_MEM_POOL_GENERAL);
    void *g = bex_mem_alloc(gen, 100);
    CHECK_EQ((uintptr_t)bex_mem_mr(g)->addr, bex__mem_base_of(g));
    bex_mem_free(g);
    CHECK_OK(bex_mem_pool_destroy(gen));
    for (int i = 0; i < N; i++)
        bex_mem_free(p[i]);
    CHECK_OK(bex_mem_pool_destroy(pool));
    /* bad kinds are refused */
    bex_mem_config bad = {.kind = 7};
    CHECK_EQ(bex_mem_pool_create(&reg, &bad, &gen), -EINVAL);
    CHECK_EQ(bex_mem_pool_kind(NULL), -EINVAL);
    free(f);
    return 0;
}

/* A peer holding a chunk's key may write any byte of its registered range,
 * live buffers and free pages alike, at any time. Scribble over all of it
 * between operations: the allocator must go on handing out disjoint
 * buffers, and account exactly. (A general pool would crash here: its free
 * lists live in freed blocks.) */
static void scribble_all(struct rec *f, uint8_t v)
{
    pthread_mutex_lock(&f->lock);
    for (unsigned i = 0; i < f->n; i++)
        if (f->r[i].live)
            memset(f->r[i].addr, v, f->r[i].len);
    pthread_mutex_unlock(&f->lock);
}

static int scribble(void)
{
    struct rec *f = rec_new();
    bex_mem_pool *pool = landing_pool(f, 0);
    enum { N = 600 };
    static void *p[N];
    static size_t len[N];
    uint32_t x = 12345;
    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < N; i++) {
            x = x * 1103515245u + 12345u;
            if (p[i] && (x >> 16) % 3 == 0) {
                bex_mem_free(p[i]);
                p[i] = NULL;
            } else if (!p[i]) {
                len[i] = 1 + ((x >> 8) % 5 == 0 ? (x >> 4) % (3u << 20) : (x >> 4) % 70000);
                p[i] = bex_mem_alloc(pool, len[i]);
                CHECK(p[i]);
            }
        }
        scribble_all(f, (uint8_t)(0xa0 + round));
        /* disjoint: tag each live buffer's first and last byte, check */
        for (int i = 0; i < N; i++)
            if (p[i]) {
                ((uint8_t *)p[i])[0] = (uint8_t)i;
                ((uint8_t *)p[i])[len[i] - 1] = (uint8_t)(i >> 3);
            }
        for (int i = 0; i < N; i++)
            if (p[i]) {
                CHECK_EQ(((uint8_t *)p[i])[0], (uint8_t)i);
                CHECK_EQ(((uint8_t *)p[i])[len[i] - 1], (uint8_t)(i >> 3));
                check_meta_outside(f, p[i]);
            }
        bex_mem_stats st;
        bex_mem_pool_stats(pool, &st);
        size_t sum = 0;
        for (int i = 0; i < N; i++)
            if (p[i])
                sum += bex_mem_usable_size(p[i]);
        CHECK_EQ(st.in_use_bytes, sum);
    }
    for (int i = 0; i < N; i++)
        bex_mem_free(p[i]);
    CHECK_OK(bex_mem_pool_destroy(pool));
    free(f);
    return 0;
}

/* Buffers allocated by one thread and freed by others, concurrently. */
#define XT_THREADS 4
#define XT_ITERS   3000
#define XT_SLOTS   64

struct xt {
    bex_mem_pool *pool;
    _Atomic(void *) slot[XT_SLOTS];
    _Atomic int bad;
};

static void *xt_main(void *arg)
{
    struct xt *t = arg;
    uint32_t x = (uint32_t)(uintptr_t)pthread_self();
    for (int i = 0; i < XT_ITERS; i++) {
        x = x * 1103515245u + 12345u;
        size_t len = 16 + (x >> 8) % 200000; /* room for the length itself */
        uint8_t *p = bex_mem_alloc(t->pool, len);
        if (!p) {
            atomic_store(&t->bad, 1);
            return NULL;
        }
        memset(p, (int)(len & 0xff), len);
        memcpy(p, &len, sizeof(len));
        /* swap into a shared slot; free whatever was there (another
         * thread's buffer, usually), after checking it is intact */
        uint8_t *old = atomic_exchange(&t->slot[(x >> 4) % XT_SLOTS], p);
        if (old) {
            size_t olen = 0;
            memcpy(&olen, old, sizeof(olen));
            if (olen > sizeof(olen) &&
                (old[olen - 1] != (uint8_t)(olen & 0xff) || bex_mem_usable_size(old) < olen))
                atomic_store(&t->bad, 1);
            bex_mem_free(old);
        }
    }
    return NULL;
}

static int cross_thread(void)
{
    struct rec *f = rec_new();
    struct xt t = {.pool = landing_pool(f, 8u << 20)};
    pthread_t th[XT_THREADS];
    for (int i = 0; i < XT_THREADS; i++)
        CHECK_EQ(pthread_create(&th[i], NULL, xt_main, &t), 0);
    for (int i = 0; i < XT_THREADS; i++)
        pthread_join(th[i], NULL);
    CHECK_EQ(atomic_load(&t.bad), 0);
    CHECK_EQ(bex_mem_pool_destroy(t.pool), -EBUSY); /* the slots still hold buffers */
    for (int i = 0; i < XT_SLOTS; i++)
        bex_mem_free(atomic_load(&t.slot[i]));
    bex_mem_stats st;
    bex_mem_pool_stats(t.pool, &st);
    CHECK_EQ(st.in_use_bytes, 0);
    CHECK_OK(bex_mem_pool_destroy(t.pool));
    for (unsigned i = 0; i < f->n; i++)
        CHECK_EQ(f->r[i].live, 0);
    free(f);
    return 0;
}

/* Counters: in-use bytes are usable sizes, registered bytes the payload
 * ranges; empty chunks beyond retain_bytes are deregistered at once. */
static int stats(void)
{
    struct rec *f = rec_new();
    bex_mem_pool *pool = landing_pool(f, BEX__MEM_CHUNK_SIZE); /* keep one empty chunk */
    bex_mem_stats st;
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.in_use_bytes, 0);
    CHECK_EQ(st.registered_bytes, 0);
    /* three chunks' worth of 1 MiB buffers (three fit in a chunk) */
    enum { N = 9 };
    void *p[N];
    for (int i = 0; i < N; i++)
        CHECK(p[i] = bex_mem_alloc(pool, 1 << 20));
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.in_use_bytes, (size_t)N << 20);
    CHECK_EQ(st.chunks, 3);
    CHECK_EQ(st.registrations, 3);
    CHECK_EQ(st.registered_bytes, 3 * (BEX__MEM_CHUNK_SIZE - BEX__MEM_SPAN_SIZE));
    void *h = bex_mem_alloc(pool, 5 << 20);
    CHECK(h);
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.in_use_bytes, ((size_t)N << 20) + bex_mem_usable_size(h));
    CHECK_EQ(st.registered_bytes,
             3 * (BEX__MEM_CHUNK_SIZE - BEX__MEM_SPAN_SIZE) + bex_mem_usable_size(h));
    CHECK(st.peak_in_use_bytes >= st.in_use_bytes);
    bex_mem_free(h); /* 5 MiB > retain: deregistered */
    for (int i = 0; i < N; i++)
        bex_mem_free(p[i]);
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.in_use_bytes, 0);
    CHECK_EQ(st.chunks, 1); /* one empty chunk retained */
    CHECK_EQ(st.deregistrations, 3);
    /* the retained chunk serves the next allocation without registering */
    void *q = bex_mem_alloc(pool, 4096);
    bex_mem_pool_stats(pool, &st);
    CHECK_EQ(st.registrations, 4);
    CHECK_EQ(st.in_use_bytes, 4096);
    bex_mem_free(q);
    CHECK_OK(bex_mem_pool_destroy(pool));
    free(f);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(layout), BEX_CASE(scribble), BEX_CASE(cross_thread), BEX_CASE(stats))
