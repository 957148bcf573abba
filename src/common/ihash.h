/* SPDX-License-Identifier: Apache-2.0 */
/* A compact index hash: open addressing over 4-byte slots, each holding an
 * index into an array the caller owns (the PS rows, the push-id clients).
 *
 * Where common/hash.h keeps the key and a pointer (16 bytes a slot), this
 * keeps only index + 1 (0: empty); the keys stay in the caller's array,
 * and the caller hashes and compares them through two functions it passes:
 * hash(ctx, index), the 64-bit hash of the element at index, and, for a
 * lookup, eq(ctx, index, key). The home slot is hash & (cap - 1), so the
 * caller's hash must be well mixed in its low bits.
 *
 * Linear probing over a power-of-two table kept at most half full, with
 * backward-shift deletion (no tombstones). Room is reserved ahead
 * (bex__ihash_reserve), so an insertion cannot fail; the table grows by
 * doubling and never shrinks. No locking: it belongs to whoever owns the
 * caller's array. A zeroed struct is an empty index. */
#ifndef BEX_COMMON_IHASH_H
#define BEX_COMMON_IHASH_H

#include <assert.h>
#include <stdbool.h>
#include <stdint.h>

/* Indexes at most: the slots (2 x that) fit in a u32. */
#define BEX__IHASH_MAX  (1u << 30)
#define BEX__IHASH_NONE UINT32_MAX

struct bex__ihash {
    uint32_t *slots; /* slot -> index + 1 (0: empty) */
    uint32_t cap;    /* slots, a power of two (0 before the first reserve) */
    uint32_t len;    /* indexes held */
};

typedef uint64_t (*bex__ihash_hash_fn)(const void *ctx, uint32_t idx);
typedef bool (*bex__ihash_eq_fn)(const void *ctx, uint32_t idx, const void *key);

/* Room for n indexes in all (n <= BEX__IHASH_MAX), rehashing those held
 * (their hashes through hash(ctx, idx)) when the table grows. Returns 0,
 * -ENOSPC (n too big) or -ENOMEM; on error the index is unchanged. */
int bex__ihash_reserve(struct bex__ihash *h, uint32_t n, bex__ihash_hash_fn hash, const void *ctx);
/* Frees the slots; the index is then empty and reusable. */
void bex__ihash_free(struct bex__ihash *h);
/* Takes idx, held with the given hash, out of the index (nothing if it is
 * not there); the others' hashes come from hash(ctx, idx). */
void bex__ihash_remove(struct bex__ihash *h, uint64_t hash_of_idx, uint32_t idx,
                       bex__ihash_hash_fn hash, const void *ctx);

/* The index whose element equals key (eq(ctx, index, key)), for key's hash,
 * or BEX__IHASH_NONE. Inline, so a constant eq is inlined too: the PS row
 * lookup is on the data path. */
static inline uint32_t bex__ihash_find(const struct bex__ihash *h, uint64_t hash,
                                       bex__ihash_eq_fn eq, const void *ctx, const void *key)
{
    if (h->len == 0)
        return BEX__IHASH_NONE;
    uint32_t mask = h->cap - 1;
    for (uint32_t i = (uint32_t)hash & mask;; i = (i + 1) & mask) {
        uint32_t s = h->slots[i];
        if (!s)
            return BEX__IHASH_NONE;
        if (eq(ctx, s - 1, key))
            return s - 1;
    }
}

/* Adds idx (not held; its element's key not held either) with its hash;
 * room must have been reserved for it. */
static inline void bex__ihash_insert(struct bex__ihash *h, uint64_t hash, uint32_t idx)
{
    assert(2 * ((uint64_t)h->len + 1) <= h->cap && idx < BEX__IHASH_MAX);
    uint32_t mask = h->cap - 1, i = (uint32_t)hash & mask;
    while (h->slots[i])
        i = (i + 1) & mask;
    h->slots[i] = idx + 1;
    h->len++;
}

static inline uint32_t bex__ihash_len(const struct bex__ihash *h)
{
    return h->len;
}

#endif
