/* SPDX-License-Identifier: Apache-2.0 */
/* The open-addressing hash map of common/hash.h. */
#include "common/hash.h"

#include <errno.h>
#include <stdlib.h>

#define MIN_CAP 8u

static inline uint32_t home(const struct bex__hmap *m, uint64_t key)
{
    return (uint32_t)((key * 0x9e3779b97f4a7c15ull) >> m->shift);
}

static int alloc_table(struct bex__hmap *m, uint32_t cap)
{
    struct bex__hmap_slot *s = calloc(cap, sizeof *s);
    if (!s)
        return -ENOMEM;
    uint8_t bits = 0;
    while ((1u << bits) < cap)
        bits++;
    m->slots = s;
    m->cap = cap;
    m->shift = (uint8_t)(64 - bits);
    return 0;
}

int bex__hmap_init(struct bex__hmap *m, uint32_t n)
{
    *m = (struct bex__hmap){0};
    if (n == 0)
        return 0;
    if (n > (1u << 30))
        return -ENOMEM;
    uint32_t cap = MIN_CAP;
    while (cap < 2 * n)
        cap *= 2;
    return alloc_table(m, cap);
}

void bex__hmap_free(struct bex__hmap *m)
{
    free(m->slots);
    *m = (struct bex__hmap){0};
}

static uint32_t find(const struct bex__hmap *m, uint64_t key, int *found)
{
    uint32_t mask = m->cap - 1, i = home(m, key);
    while (m->slots[i].val && m->slots[i].key != key)
        i = (i + 1) & mask;
    *found = m->slots[i].val != NULL;
    return i;
}

void *bex__hmap_get(const struct bex__hmap *m, uint64_t key)
{
    int found;
    if (m->len == 0)
        return NULL;
    uint32_t i = find(m, key, &found);
    return found ? m->slots[i].val : NULL;
}

/* Doubles the table (or makes the first one), rehashing every entry. */
static int grow(struct bex__hmap *m)
{
    struct bex__hmap old = *m;
    if (old.cap >= (1u << 31))
        return -ENOMEM;
    if (alloc_table(m, old.cap ? 2 * old.cap : MIN_CAP) != 0) {
        *m = old;
        return -ENOMEM;
    }
    m->len = old.len;
    for (uint32_t j = 0; j < old.cap; j++) {
        if (!old.slots[j].val)
            continue;
        int found;
        uint32_t i = find(m, old.slots[j].key, &found);
        m->slots[i] = old.slots[j];
    }
    free(old.slots);
    return 0;
}

int bex__hmap_put(struct bex__hmap *m, uint64_t key, void *val)
{
    int found;
    if (m->cap) {
        find(m, key, &found);
        if (found)
            return -EEXIST;
    }
    if (2 * (m->len + 1) > m->cap && grow(m) != 0)
        return -ENOMEM;
    uint32_t i = find(m, key, &found);
    m->slots[i] = (struct bex__hmap_slot){key, val};
    m->len++;
    return 0;
}

/* Backward-shift deletion: the entries after the hole that would not be
 * found across it move back into it, so no tombstone is needed. An entry
 * moves only to a slot before its old one, within its run of full slots. */
void *bex__hmap_del(struct bex__hmap *m, uint64_t key)
{
    int found;
    if (m->len == 0)
        return NULL;
    uint32_t mask = m->cap - 1, hole = find(m, key, &found);
    if (!found)
        return NULL;
    void *val = m->slots[hole].val;
    for (uint32_t j = (hole + 1) & mask; m->slots[j].val; j = (j + 1) & mask) {
        uint32_t h = home(m, m->slots[j].key);
        /* j's entry may fill the hole unless its home lies in (hole, j] */
        if (((j - h) & mask) >= ((j - hole) & mask)) {
            m->slots[hole] = m->slots[j];
            hole = j;
        }
    }
    m->slots[hole] = (struct bex__hmap_slot){0};
    m->len--;
    return val;
}

/* Walks the slots downwards, starting just below an empty slot: a run of
 * full slots never contains an empty one, so every slot after the current
 * one within its run was walked already, and deleting the current entry
 * (which moves only such entries back, to slots at or after the current
 * one) neither hides an entry from the walk nor shows one twice. */
void *bex__hmap_next(const struct bex__hmap *m, struct bex__hmap_iter *it, uint64_t *key)
{
    if (!it->started) {
        it->started = 1;
        it->left = m->cap;
        if (m->len == 0)
            it->left = 0;
        for (it->pos = 0; it->left && m->slots[it->pos].val; it->pos++)
            ;
    }
    uint32_t mask = m->cap - 1;
    while (it->left) {
        it->left--;
        it->pos = (it->pos - 1) & mask;
        const struct bex__hmap_slot *s = &m->slots[it->pos];
        if (s->val) {
            if (key)
                *key = s->key;
            return s->val;
        }
    }
    return NULL;
}
