/* SPDX-License-Identifier: Apache-2.0 */
/* common/hash.h and common/list.h against simple references. */
#include <errno.h>

#include "common/hash.h"
#include "common/list.h"
#include "harness.h"

#define KEYS 5000

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Random puts and deletes over a small key space (collisions, runs that
 * wrap) checked against a plain array after every step. */
static int hash_random(void)
{
    static uint64_t vals[KEYS]; /* 0: absent */
    struct bex__hmap m;
    CHECK_OK(bex__hmap_init(&m, 0));
    uint32_t live = 0;
    for (int step = 0; step < 200000; step++) {
        uint64_t k = next_rand() % KEYS;
        uint64_t key = k * 1024; /* strided keys: the hash must spread them */
        if (next_rand() % 3) {
            int rc = bex__hmap_put(&m, key, (void *)(uintptr_t)(step + 1));
            if (vals[k]) {
                CHECK_EQ(rc, -EEXIST);
            } else {
                CHECK_EQ(rc, 0);
                vals[k] = (uint64_t)step + 1;
                live++;
            }
        } else {
            void *v = bex__hmap_del(&m, key);
            CHECK_EQ((uintptr_t)v, vals[k]);
            if (vals[k])
                live--;
            vals[k] = 0;
        }
        CHECK_EQ(bex__hmap_len(&m), live);
        if (step % 997 == 0)
            for (uint64_t j = 0; j < KEYS; j++)
                CHECK_EQ((uintptr_t)bex__hmap_get(&m, j * 1024), vals[j]);
    }
    CHECK(2 * m.len <= m.cap);
    bex__hmap_free(&m);
    CHECK(bex__hmap_get(&m, 0) == NULL);
    return 0;
}

/* Iteration returns every entry once, also when it deletes as it goes. */
static int hash_iterate(void)
{
    static uint8_t seen[KEYS];
    struct bex__hmap m;
    CHECK_OK(bex__hmap_init(&m, 16));
    for (int round = 0; round < 50; round++) {
        memset(seen, 0, sizeof seen);
        uint32_t n = 0;
        for (uint64_t k = 1; k < KEYS; k++)
            if (next_rand() % 2 && bex__hmap_put(&m, k, (void *)(uintptr_t)k) == 0)
                n++;
        n = bex__hmap_len(&m);
        struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
        uint64_t key;
        void *v;
        uint32_t got = 0, deleted = 0;
        while ((v = bex__hmap_next(&m, &it, &key))) {
            CHECK_EQ((uintptr_t)v, key);
            CHECK(seen[key] == 0);
            seen[key] = 1;
            got++;
            if (next_rand() % 2) { /* delete the current entry */
                CHECK(bex__hmap_del(&m, key) == v);
                deleted++;
            }
        }
        CHECK_EQ(got, n);
        CHECK_EQ(bex__hmap_len(&m), n - deleted);
        for (uint64_t k = 1; k < KEYS; k++)
            if (seen[k] && bex__hmap_get(&m, k))
                CHECK_EQ((uintptr_t)bex__hmap_get(&m, k), k);
    }
    bex__hmap_free(&m);
    return 0;
}

struct item {
    int v;
    struct bex__list link;
};

static int list_ops(void)
{
    struct bex__list head, *pos, *tmp;
    struct item it[5];
    bex__list_init(&head);
    CHECK(bex__list_empty(&head));
    CHECK(bex__list_first(&head) == NULL);
    for (int i = 0; i < 5; i++) {
        it[i].v = i;
        bex__list_init(&it[i].link);
        CHECK(!bex__list_linked(&it[i].link));
        bex__list_push_tail(&head, &it[i].link);
        CHECK(bex__list_linked(&it[i].link));
    }
    int want = 0;
    bex__list_foreach(pos, &head) CHECK_EQ(bex__list_entry(pos, struct item, link)->v, want++);
    CHECK_EQ(want, 5);
    bex__list_rotate(&head); /* 1 2 3 4 0 */
    CHECK_EQ(bex__list_entry(bex__list_first(&head), struct item, link)->v, 1);
    bex__list_foreach_safe(pos, tmp, &head) if (bex__list_entry(pos, struct item, link)->v % 2)
        bex__list_remove(pos);     /* 2 4 0 */
    bex__list_remove(&it[1].link); /* a second removal changes nothing */
    int order[3] = {2, 4, 0}, k = 0;
    bex__list_foreach(pos, &head) CHECK_EQ(bex__list_entry(pos, struct item, link)->v, order[k++]);
    CHECK_EQ(k, 3);
    bex__list_push_head(&head, &it[3].link);
    CHECK_EQ(bex__list_entry(bex__list_first(&head), struct item, link)->v, 3);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(hash_random), BEX_CASE(hash_iterate), BEX_CASE(list_ops))
