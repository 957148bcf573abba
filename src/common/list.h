/* SPDX-License-Identifier: Apache-2.0 */
/* An intrusive doubly linked list: the one list of bex.
 *
 * A list is a head node; elements embed a struct bex__list and are found
 * from it with bex__list_entry (container_of). The head and every element
 * not on a list link to themselves, so bex__list_remove is idempotent and
 * bex__list_linked tells whether an element is on a list. No allocation,
 * no locking: a list belongs to whoever owns its head. */
#ifndef BEX_COMMON_LIST_H
#define BEX_COMMON_LIST_H

#include <stdbool.h>
#include <stddef.h>

#include "common/util.h"

struct bex__list {
    struct bex__list *next, *prev;
};

/* A head or element that is on no list. */
static inline void bex__list_init(struct bex__list *n)
{
    n->next = n->prev = n;
}

static inline bool bex__list_empty(const struct bex__list *head)
{
    return head->next == head;
}

/* Whether an element (initialised with bex__list_init) is on a list. */
static inline bool bex__list_linked(const struct bex__list *n)
{
    return n->next != n;
}

static inline void bex__list__between(struct bex__list *n, struct bex__list *prev,
                                      struct bex__list *next)
{
    n->prev = prev;
    n->next = next;
    prev->next = n;
    next->prev = n;
}

/* Append n (on no list) at the tail: FIFO order with bex__list_first. */
static inline void bex__list_push_tail(struct bex__list *head, struct bex__list *n)
{
    bex__list__between(n, head->prev, head);
}

static inline void bex__list_push_head(struct bex__list *head, struct bex__list *n)
{
    bex__list__between(n, head, head->next);
}

/* Insert n (on no list) right after pos, an element or the head. */
static inline void bex__list_insert_after(struct bex__list *pos, struct bex__list *n)
{
    bex__list__between(n, pos, pos->next);
}

/* Take n off its list (nothing if it is on none); n is then on no list. */
static inline void bex__list_remove(struct bex__list *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    bex__list_init(n);
}

/* Move every element of from (in order) onto to, which must be empty;
 * from is then empty. O(1). */
static inline void bex__list_take_all(struct bex__list *from, struct bex__list *to)
{
    if (bex__list_empty(from))
        return;
    to->next = from->next;
    to->prev = from->prev;
    to->next->prev = to;
    to->prev->next = to;
    bex__list_init(from);
}

/* The first element, or NULL for an empty list. */
static inline struct bex__list *bex__list_first(const struct bex__list *head)
{
    return bex__list_empty(head) ? NULL : head->next;
}

/* Move the first element to the tail (a round-robin turn); O(1). */
static inline void bex__list_rotate(struct bex__list *head)
{
    if (!bex__list_empty(head)) {
        struct bex__list *n = head->next;
        bex__list_remove(n);
        bex__list_push_tail(head, n);
    }
}

#define bex__list_entry(ptr, type, member) bex__container_of(ptr, type, member)

/* Walk a list; the body must not remove pos (use the _safe form). */
#define bex__list_foreach(pos, head)                                                               \
    for ((pos) = (head)->next; (pos) != (head); (pos) = (pos)->next)

/* Walk a list whose body may remove pos (and only pos). */
#define bex__list_foreach_safe(pos, tmp, head)                                                     \
    for ((pos) = (head)->next, (tmp) = (pos)->next; (pos) != (head);                               \
         (pos) = (tmp), (tmp) = (pos)->next)

#endif
