/* SPDX-License-Identifier: Apache-2.0 */
/* bex-allocbench driver: runs one (allocator, workload, threads) cell of
 * the allocator benchmark in its own process and prints one result line.
 *
 * Built once per allocator. With BEX_BENCH_BEMALLOC it calls bex_mem_alloc
 * (no-op or mlock registrar); otherwise it calls malloc/free, and which
 * allocator answers is decided by what the executable was linked with
 * (glibc, jemalloc, tcmalloc, mimalloc all export malloc). The driver checks
 * at start-up which library really serves malloc, so a mis-link shows up
 * as an error rather than as a wrong number.
 *
 * Every allocator does the same work: a fixed number of operations, so the
 * pages touched (hence peak RSS) compare like with like; the rate is those
 * operations over the CPU time the process spent on them.
 *
 * usage: drv ALLOCATOR WORKLOAD THREADS OPS
 * prints: ops=N cpu=S wall=S served_by=PATH */
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifdef BEX_BENCH_BEMALLOC
#include "bex/mem.h"
static bex_mem_pool *pool;
#define ALLOC(n) bex_mem_alloc(pool, (n))
#define FREE(p)  bex_mem_free(p)
#else
#define ALLOC(n) malloc(n)
#define FREE(p)  free(p)
#endif

#define MAX_THREADS 64
#define SIZE_TABLE  4096 /* sizes drawn in advance: no libm in the loop */
#define QCAP        32   /* hand-off ring per thread, power of two; bounds the extra live set */
#define HANDOFF_PCT 10

struct ring {
    /* single producer (the left neighbour), single consumer (the owner) */
    alignas(64) _Atomic unsigned head;
    alignas(64) _Atomic unsigned tail;
    void *slot[QCAP];
};

struct worker {
    alignas(64) _Atomic uint64_t ops; /* of the measured part */
    pthread_t tid;
    unsigned id;
    struct ring in;
};

static struct worker *workers;
static unsigned nthreads, nslots;
static uint64_t iters; /* measured iterations per thread */
static uint32_t sizes[SIZE_TABLE];
static pthread_barrier_t phase; /* workers + main: warm-up done, measured part done */

static inline uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static int ring_push(struct ring *r, void *p)
{
    unsigned t = atomic_load_explicit(&r->tail, memory_order_relaxed);
    unsigned h = atomic_load_explicit(&r->head, memory_order_acquire);
    if (t - h == QCAP)
        return 0;
    r->slot[t & (QCAP - 1)] = p;
    atomic_store_explicit(&r->tail, t + 1, memory_order_release);
    return 1;
}

static void *ring_pop(struct ring *r)
{
    unsigned h = atomic_load_explicit(&r->head, memory_order_relaxed);
    unsigned t = atomic_load_explicit(&r->tail, memory_order_acquire);
    if (h == t)
        return NULL;
    void *p = r->slot[h & (QCAP - 1)];
    atomic_store_explicit(&r->head, h + 1, memory_order_release);
    return p;
}

static void *touch(void *p, size_t n)
{
    if (!p) {
        fprintf(stderr, "allocation of %zu bytes failed\n", n);
        exit(2);
    }
    ((volatile char *)p)[0] = 1;
    ((volatile char *)p)[n - 1] = 1;
    return p;
}

/* One iteration replaces a random slot of the thread's working set: the
 * old buffer is freed here, or (HANDOFF_PCT %) handed to the right
 * neighbour, which frees it; then a new buffer is allocated and touched.
 * One operation = one allocation or one free. */
static uint64_t run_iters(struct worker *w, void **slot, struct ring *right, uint64_t *rng,
                          uint64_t n)
{
    uint64_t ops = 0;
    for (uint64_t it = 0; it < n; it++) {
        uint64_t r = rng_next(rng);
        unsigned i = (unsigned)(r % nslots);
        if ((r >> 32) % 100 < HANDOFF_PCT && ring_push(right, slot[i])) {
            /* freed (and counted) by the neighbour */
        } else {
            FREE(slot[i]);
            ops++;
        }
        size_t sz = sizes[(r >> 20) & (SIZE_TABLE - 1)];
        slot[i] = touch(ALLOC(sz), sz);
        ops++;
        for (int j = 0; j < 2; j++) {
            void *p = ring_pop(&w->in);
            if (!p)
                break;
            FREE(p);
            ops++;
        }
    }
    return ops;
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct ring *right = &workers[(w->id + 1) % nthreads].in;
    uint64_t rng = 0x9e3779b97f4a7c15ull ^ ((uint64_t)(w->id + 1) * 0xbf58476d1ce4e5b9ull);
    void **slot = calloc(nslots, sizeof(void *));
    if (!slot)
        exit(2);
    for (unsigned i = 0; i < nslots; i++) {
        size_t n = sizes[rng_next(&rng) & (SIZE_TABLE - 1)];
        slot[i] = touch(ALLOC(n), n);
    }
    run_iters(w, slot, right, &rng, (uint64_t)nslots * 4); /* warm-up */
    pthread_barrier_wait(&phase);
    atomic_store_explicit(&w->ops, run_iters(w, slot, right, &rng, iters), memory_order_relaxed);
    pthread_barrier_wait(&phase);
    for (unsigned i = 0; i < nslots; i++)
        FREE(slot[i]);
    free(slot);
    return NULL;
}

static double now(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t total_ops(void)
{
    uint64_t s = 0;
    for (unsigned i = 0; i < nthreads; i++)
        s += atomic_load_explicit(&workers[i].ops, memory_order_relaxed);
    return s;
}

#ifdef BEX_BENCH_BEMALLOC
/* Registration that costs what pinning costs: mlock the chunk. */
static int mlock_reg(void *ctx, bex_mem_region *mr)
{
    (void)ctx;
    if (mlock(mr->addr, mr->length) != 0)
        return -errno;
    mr->lkey = mr->rkey = 1;
    mr->handle = NULL;
    return 0;
}

static void mlock_dereg(void *ctx, bex_mem_region *mr)
{
    (void)ctx;
    munlock(mr->addr, mr->length);
}
#endif

/* Which shared object serves malloc in this process. */
static const char *malloc_provider(void)
{
    Dl_info di;
    void *(*volatile fn)(size_t) = malloc;
    if (dladdr((void *)fn, &di) && di.dli_fname)
        return di.dli_fname;
    return "?";
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s ALLOCATOR WORKLOAD THREADS OPS\n", argv[0]);
        return 2;
    }
    const char *alloc = argv[1], *workload = argv[2];
    nthreads = (unsigned)atoi(argv[3]);
    double total = atof(argv[4]);
    if (nthreads < 1 || nthreads > MAX_THREADS || total < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }

    const char *served = malloc_provider();
#ifdef BEX_BENCH_BEMALLOC
    bex_mem_registrar reg;
    if (strcmp(alloc, "bemalloc") == 0) {
        bex_mem_registrar_noop(&reg);
    } else if (strcmp(alloc, "bemalloc-mlock") == 0) {
        reg = (bex_mem_registrar){.reg = mlock_reg, .dereg = mlock_dereg, .ctx = NULL};
    } else {
        fprintf(stderr, "this driver serves bemalloc and bemalloc-mlock, not %s\n", alloc);
        return 2;
    }
    int rc = bex_mem_pool_create(&reg, NULL, &pool);
    if (rc != 0) {
        fprintf(stderr, "bex_mem_pool_create: %s\n", strerror(-rc));
        return 2;
    }
    served = "bemalloc";
#else
    const char *want = strcmp(alloc, "glibc") == 0 ? "/libc.so" : alloc;
    if (!strstr(served, want)) {
        fprintf(stderr, "malloc is served by %s, not %s: refusing to measure\n", served, alloc);
        return 3;
    }
#endif

    /* Working sets: about 16 MiB per thread for small, 64 MiB for large. */
    uint64_t rng = 12345;
    if (strcmp(workload, "small") == 0) {
        /* 16 B - 16 KiB, uniform ("linear") */
        for (unsigned i = 0; i < SIZE_TABLE; i++)
            sizes[i] = 16 + (uint32_t)(rng_next(&rng) % (16384 - 16 + 1));
        nslots = 2048;
    } else if (strcmp(workload, "large") == 0) {
        /* 64 KiB - 1 MiB, exponential above 64 KiB (mean 192 KiB), redrawn
         * when beyond 1 MiB */
        for (unsigned i = 0; i < SIZE_TABLE; i++) {
            double s;
            do {
                double u = ((double)(rng_next(&rng) >> 11) + 0.5) / 9007199254740992.0;
                s = 65536.0 - log(u) * 196608.0;
            } while (s > 1048576.0);
            sizes[i] = (uint32_t)s;
        }
        nslots = 256;
    } else {
        fprintf(stderr, "unknown workload %s\n", workload);
        return 2;
    }

    /* about two operations per iteration */
    iters = (uint64_t)(total / 2.0 / nthreads) + 1;
    pthread_barrier_init(&phase, NULL, nthreads + 1);
    workers = aligned_alloc(64, sizeof(*workers) * nthreads);
    if (!workers)
        return 2;
    memset(workers, 0, sizeof(*workers) * nthreads);
    for (unsigned i = 0; i < nthreads; i++) {
        workers[i].id = i;
        if (pthread_create(&workers[i].tid, NULL, worker_main, &workers[i]) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            return 2;
        }
    }
    pthread_barrier_wait(&phase);
    double cpu0 = now(CLOCK_PROCESS_CPUTIME_ID), wall0 = now(CLOCK_MONOTONIC);
    pthread_barrier_wait(&phase);
    double cpu1 = now(CLOCK_PROCESS_CPUTIME_ID), wall1 = now(CLOCK_MONOTONIC);
    uint64_t ops = total_ops();
#ifdef BEX_BENCH_BEMALLOC
    if (getenv("BEX_ALLOCBENCH_STATS")) {
        bex_mem_stats st;
        bex_mem_pool_stats(pool, &st);
        fprintf(stderr,
                "bemalloc: in use %.1f MiB (peak %.1f), registered %.1f MiB (peak %.1f), "
                "%zu chunks, %llu registrations\n",
                st.in_use_bytes / 1048576.0, st.peak_in_use_bytes / 1048576.0,
                st.registered_bytes / 1048576.0, st.peak_registered_bytes / 1048576.0, st.chunks,
                (unsigned long long)st.registrations);
    }
#endif
    for (unsigned i = 0; i < nthreads; i++)
        pthread_join(workers[i].tid, NULL);
    for (unsigned i = 0; i < nthreads; i++)
        for (void *p; (p = ring_pop(&workers[i].in)) != NULL;)
            FREE(p);
    printf("ops=%llu cpu=%.6f wall=%.6f served_by=%s\n", (unsigned long long)ops, cpu1 - cpu0,
           wall1 - wall0, served);
    fflush(stdout);
    free(workers);
#ifdef BEX_BENCH_BEMALLOC
    rc = bex_mem_pool_destroy(pool);
    if (rc != 0) {
        fprintf(stderr, "bex_mem_pool_destroy: %s\n", strerror(-rc));
        return 4;
    }
#endif
    return 0;
}
