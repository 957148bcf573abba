/* SPDX-License-Identifier: Apache-2.0 */
/* common/hash.h and common/list.h against simple references. */
#include <errno.h>

#include "common/hash.h"
#include "common/ihash.h"
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

/* common/ihash.h: the caller's array of keys, a free stack of its indexes,
 * and a reference (where each key is, or BEX__IHASH_NONE). */
#define IKEYS  3000
#define ISLOTS 1200 /* indexes of the array: at most this many keys at once */
static uint64_t ikeys[ISLOTS];
static int ihash_weak; /* 1: a hash of 7 values (long runs that wrap) */

static uint64_t ihash_of(uint64_t key)
{
    return ihash_weak ? key % 7 : (key * 0x9e3779b97f4a7c15ull) >> 17;
}

static uint64_t ihash_idx(const void *ctx, uint32_t idx)
{
    return ihash_of(((const uint64_t *)ctx)[idx]);
}

static bool ihash_eq(const void *ctx, uint32_t idx, const void *key)
{
    return ((const uint64_t *)ctx)[idx] == *(const uint64_t *)key;
}

/* Random inserts (reusing freed indexes) and removals checked against the
 * reference after every step, and every key looked up now and then. */
static int ihash_run(int steps)
{
    static uint32_t where[IKEYS], free_idx[ISLOTS];
    uint32_t n_free = 0, next_idx = 0;
    for (uint32_t k = 0; k < IKEYS; k++)
        where[k] = BEX__IHASH_NONE;
    struct bex__ihash h = {0};
    CHECK(bex__ihash_find(&h, 0, ihash_eq, ikeys, &(uint64_t){0}) == BEX__IHASH_NONE);
    for (int step = 0; step < steps; step++) {
        uint64_t k = next_rand() % IKEYS, key = k * 1024;
        uint32_t got = bex__ihash_find(&h, ihash_of(key), ihash_eq, ikeys, &key);
        CHECK_EQ(got, where[k]);
        if (where[k] == BEX__IHASH_NONE && (n_free || next_idx < ISLOTS) && next_rand() % 3) {
            uint32_t idx = n_free ? free_idx[--n_free] : next_idx++;
            CHECK_OK(bex__ihash_reserve(&h, bex__ihash_len(&h) + 1, ihash_idx, ikeys));
            ikeys[idx] = key;
            bex__ihash_insert(&h, ihash_of(key), idx);
            where[k] = idx;
        } else if (where[k] != BEX__IHASH_NONE) {
            bex__ihash_remove(&h, ihash_of(key), where[k], ihash_idx, ikeys);
            free_idx[n_free++] = where[k];
            where[k] = BEX__IHASH_NONE;
        }
        CHECK_EQ(bex__ihash_len(&h), next_idx - n_free);
        CHECK(2 * h.len <= h.cap);
        if (step % 499 == 0)
            for (uint64_t j = 0; j < IKEYS; j++) {
                uint64_t kj = j * 1024;
                CHECK_EQ(bex__ihash_find(&h, ihash_of(kj), ihash_eq, ikeys, &kj), where[j]);
            }
    }
    /* removing what is not there changes nothing */
    uint32_t len = bex__ihash_len(&h);
    bex__ihash_remove(&h, 0, ISLOTS + 1, ihash_idx, ikeys);
    CHECK_EQ(bex__ihash_len(&h), len);
    CHECK_EQ(bex__ihash_reserve(&h, BEX__IHASH_MAX + 1, ihash_idx, ikeys), -ENOSPC);
    bex__ihash_free(&h);
    CHECK_EQ(bex__ihash_len(&h), 0);
    return 0;
}

static int ihash_random(void)
{
    ihash_weak = 0;
    return ihash_run(200000);
}

static int ihash_collide(void)
{
    ihash_weak = 1;
    return ihash_run(40000);
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
    bex__list_insert_after(&it[4].link, &it[1].link); /* 3 2 4 1 0 */
    int order2[5] = {3, 2, 4, 1, 0};
    k = 0;
    bex__list_foreach(pos, &head) CHECK_EQ(bex__list_entry(pos, struct item, link)->v, order2[k++]);
    CHECK_EQ(k, 5);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(hash_random), BEX_CASE(hash_iterate), BEX_CASE(ihash_random),
              BEX_CASE(ihash_collide), BEX_CASE(list_ops))
