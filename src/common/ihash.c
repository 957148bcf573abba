/* SPDX-License-Identifier: Apache-2.0 */
/* The compact index hash of common/ihash.h. */
#include "common/ihash.h"

#include <errno.h>
#include <stdlib.h>

#define MIN_CAP 16u

int bex__ihash_reserve(struct bex__ihash *h, uint32_t n, bex__ihash_hash_fn hash, const void *ctx)
{
    if (n > BEX__IHASH_MAX)
        return -ENOSPC;
    if (2 * (uint64_t)n <= h->cap)
        return 0;
    uint32_t cap = h->cap ? h->cap : MIN_CAP;
    while (cap < 2 * n)
        cap *= 2;
    uint32_t *slots = calloc(cap, sizeof *slots);
    if (!slots)
        return -ENOMEM;
    struct bex__ihash old = *h;
    *h = (struct bex__ihash){.slots = slots, .cap = cap};
    for (uint32_t j = 0; j < old.cap; j++)
        if (old.slots[j])
            bex__ihash_insert(h, hash(ctx, old.slots[j] - 1), old.slots[j] - 1);
    free(old.slots);
    return 0;
}

void bex__ihash_free(struct bex__ihash *h)
{
    free(h->slots);
    *h = (struct bex__ihash){0};
}

/* Backward-shift deletion: the entries after the hole that would not be
 * found across it move back into it. An entry moves only to a slot before
 * its old one, within its run of full slots. */
void bex__ihash_remove(struct bex__ihash *h, uint64_t hash_of_idx, uint32_t idx,
                       bex__ihash_hash_fn hash, const void *ctx)
{
    if (h->len == 0)
        return;
    uint32_t mask = h->cap - 1, hole = (uint32_t)hash_of_idx & mask;
    while (h->slots[hole] != idx + 1) {
        if (!h->slots[hole])
            return;
        hole = (hole + 1) & mask;
    }
    for (uint32_t j = (hole + 1) & mask; h->slots[j]; j = (j + 1) & mask) {
        uint32_t home = (uint32_t)hash(ctx, h->slots[j] - 1) & mask;
        /* j's entry may fill the hole unless its home lies in (hole, j] */
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            h->slots[hole] = h->slots[j];
            hole = j;
        }
    }
    h->slots[hole] = 0;
    h->len--;
}
