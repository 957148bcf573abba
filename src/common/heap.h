/* SPDX-License-Identifier: Apache-2.0 */
/* An intrusive binary min-heap: nodes are linked by pointers (no array, so
 * inserting never allocates and cannot fail), ordered by a comparison the
 * caller gives. The timers of common/timer.h are its user. O(log n) insert
 * and remove of any node, O(1) minimum. One owner, no locking. */
#ifndef BEX_COMMON_HEAP_H
#define BEX_COMMON_HEAP_H

#include <stdbool.h>
#include <stdint.h>

struct bex__heap_node {
    struct bex__heap_node *left, *right, *parent;
};

/* Whether a sorts before b. */
typedef bool (*bex__heap_less_fn)(const struct bex__heap_node *a, const struct bex__heap_node *b);

struct bex__heap {
    struct bex__heap_node *min; /* the root */
    uint32_t n;
    bex__heap_less_fn less;
};

static inline void bex__heap_init(struct bex__heap *h, bex__heap_less_fn less)
{
    h->min = 0;
    h->n = 0;
    h->less = less;
}

/* The smallest node, or NULL when the heap is empty. */
static inline struct bex__heap_node *bex__heap_min(const struct bex__heap *h)
{
    return h->min;
}

/* Adds a node that is on no heap. */
void bex__heap_insert(struct bex__heap *h, struct bex__heap_node *node);
/* Removes a node that is on this heap. */
void bex__heap_remove(struct bex__heap *h, struct bex__heap_node *node);

#endif
