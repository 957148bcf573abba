/* SPDX-License-Identifier: Apache-2.0 */
/* bex_mem_pool_collect: blocks another thread frees count as in use until
 * the allocating thread collects them. The receive limit of a context
 * (src/engine/engine.c, recv_room) relies on this to see the frees of the
 * application's threads. */
#include <pthread.h>
#include <stdint.h>

#include "bex/mem.h"
#include "harness.h"

enum { N = 600 };
static void *bufs[N];

static void *free_all(void *arg)
{
    (void)arg;
    for (int i = 0; i < N; i++)
        bex_mem_free(bufs[i]);
    return NULL;
}

static size_t in_use(bex_mem_pool *pool)
{
    bex_mem_stats st;
    bex_mem_pool_stats(pool, &st);
    return st.in_use_bytes;
}

static int remote_frees(void)
{
    bex_mem_registrar reg;
    bex_mem_registrar_noop(&reg);
    bex_mem_pool *pool;
    CHECK_OK(bex_mem_pool_create(&reg, NULL, &pool));
    /* eager-sized blocks, a medium and a huge one: every kind of run */
    size_t want = 0, huge = 0;
    for (int i = 0; i < N; i++) {
        size_t len = i == 0 ? (1u << 20) : i == 1 ? (6u << 20) : 8192;
        bufs[i] = bex_mem_alloc(pool, len);
        CHECK(bufs[i]);
        want += bex_mem_usable_size(bufs[i]);
    }
    huge = bex_mem_usable_size(bufs[1]);
    CHECK_EQ(in_use(pool), want);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, free_all, NULL) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    /* freed by another thread: the huge mapping is counted at once, the
     * rest waits in this thread's runs */
    size_t before = in_use(pool);
    fprintf(stderr, "in use after remote frees: %zu of %zu\n", before, want);
    CHECK_EQ(before, want - huge);
    bex_mem_pool_collect(pool);
    CHECK_EQ(in_use(pool), 0);
    /* a thread without a heap in the pool: nothing happens */
    bex_mem_pool_collect(pool);
    CHECK_EQ(bex_mem_pool_destroy(pool), 0);
    return 0;
}

static int same_registrar(void)
{
    bex_mem_registrar reg, got;
    bex_mem_registrar_noop(&reg);
    bex_mem_pool *pool;
    CHECK_OK(bex_mem_pool_create(&reg, NULL, &pool));
    bex_mem_pool_registrar(pool, &got);
    CHECK(got.reg == reg.reg && got.dereg == reg.dereg && got.ctx == reg.ctx);
    CHECK_EQ(bex_mem_pool_destroy(pool), 0);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(remote_frees), BEX_CASE(same_registrar))
