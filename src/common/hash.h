/* SPDX-License-Identifier: Apache-2.0 */
/* An open-addressing hash map from 64-bit keys to non-NULL pointers: the
 * one hash table of bex.
 *
 * Linear probing over a power-of-two table kept at most half full
 * (Fibonacci hashing spreads sequential ids), and backward-shift deletion,
 * so there are no tombstones and a lookup stops at the first empty slot.
 * The table grows (doubling) on insertion and never shrinks; it belongs to
 * one thread or to whoever holds the lock that guards it.
 *
 * Iteration (bex__hmap_next) may remove the entry it just returned, and
 * nothing else; inserting while iterating is not allowed. Keys wider than
 * 64 bits are the caller's: hash them to a key here and compare the rest
 * in the value. */
#ifndef BEX_COMMON_HASH_H
#define BEX_COMMON_HASH_H

#include <stdint.h>

struct bex__hmap_slot {
    uint64_t key;
    void *val; /* NULL: empty */
};

struct bex__hmap {
    struct bex__hmap_slot *slots;
    uint32_t cap;  /* slots, a power of two (0 before the first insertion) */
    uint32_t len;  /* entries */
    uint8_t shift; /* 64 - log2(cap) */
};

/* Where an iteration stands: start with BEX__HMAP_ITER_INIT. */
struct bex__hmap_iter {
    uint32_t pos, left;
    int started;
};
#define BEX__HMAP_ITER_INIT                                                                        \
    {                                                                                              \
        0, 0, 0                                                                                    \
    }

/* An empty map with room for about n entries before it grows (0: grow on
 * the first insertion). Returns 0 or -ENOMEM. A zeroed struct is a valid
 * empty map too. */
int bex__hmap_init(struct bex__hmap *m, uint32_t n);
/* Frees the table (not the values); the map is then empty and reusable. */
void bex__hmap_free(struct bex__hmap *m);

/* The value of key, or NULL. */
void *bex__hmap_get(const struct bex__hmap *m, uint64_t key);
/* Adds key -> val (val not NULL). Returns 0, -EEXIST when the key is
 * there (the map is unchanged) or -ENOMEM (the map is unchanged). */
int bex__hmap_put(struct bex__hmap *m, uint64_t key, void *val);
/* Removes key; returns its value, or NULL when it was not there. */
void *bex__hmap_del(struct bex__hmap *m, uint64_t key);

static inline uint32_t bex__hmap_len(const struct bex__hmap *m)
{
    return m->len;
}

/* The next entry of an iteration (its key in *key when key is not NULL),
 * or NULL when every entry was returned. Every entry present for the whole
 * iteration is returned exactly once. */
void *bex__hmap_next(const struct bex__hmap *m, struct bex__hmap_iter *it, uint64_t *key);

#endif
