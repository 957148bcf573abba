/* SPDX-License-Identifier: Apache-2.0 */
/* The pointer-linked binary heap of common/heap.h. The tree is complete:
 * node k (1-based, in level order) has children 2k and 2k+1, so the bits
 * of k below its leading one spell the path from the root to it (0 left,
 * 1 right). Nodes move by relinking, never by copying, since callers hold
 * pointers to them. */
#include "common/heap.h"

#include <stddef.h>

/* The link that points at node k (1-based), and k's parent. */
static struct bex__heap_node **slot_of(struct bex__heap *h, uint32_t k,
                                       struct bex__heap_node **parent)
{
    uint32_t path = 0, depth = 0;
    for (; k >= 2; k >>= 1, depth++)
        path = (path << 1) | (k & 1);
    struct bex__heap_node **link = &h->min;
    *parent = NULL;
    for (; depth > 0; depth--, path >>= 1) {
        *parent = *link;
        link = (path & 1) ? &(*link)->right : &(*link)->left;
    }
    return link;
}

/* Exchanges child c with its parent p in the tree. */
static void swap_with_parent(struct bex__heap *h, struct bex__heap_node *c)
{
    struct bex__heap_node *p = c->parent, *cl = c->left, *cr = c->right, *sibling;
    struct bex__heap_node *gp = p->parent;
    if (p->left == c) {
        sibling = p->right;
        c->left = p;
        c->right = sibling;
    } else {
        sibling = p->left;
        c->right = p;
        c->left = sibling;
    }
    if (sibling)
        sibling->parent = c;
    c->parent = gp;
    if (!gp)
        h->min = c;
    else if (gp->left == p)
        gp->left = c;
    else
        gp->right = c;
    p->parent = c;
    p->left = cl;
    p->right = cr;
    if (cl)
        cl->parent = p;
    if (cr)
        cr->parent = p;
}

static void sift_up(struct bex__heap *h, struct bex__heap_node *n)
{
    while (n->parent && h->less(n, n->parent))
        swap_with_parent(h, n);
}

static void sift_down(struct bex__heap *h, struct bex__heap_node *n)
{
    for (;;) {
        struct bex__heap_node *s = n;
        if (n->left && h->less(n->left, s))
            s = n->left;
        if (n->right && h->less(n->right, s))
            s = n->right;
        if (s == n)
            return;
        swap_with_parent(h, s);
    }
}

void bex__heap_insert(struct bex__heap *h, struct bex__heap_node *node)
{
    struct bex__heap_node *parent;
    struct bex__heap_node **link = slot_of(h, h->n + 1, &parent);
    node->left = node->right = NULL;
    node->parent = parent;
    *link = node;
    h->n++;
    sift_up(h, node);
}

void bex__heap_remove(struct bex__heap *h, struct bex__heap_node *node)
{
    struct bex__heap_node *parent;
    struct bex__heap_node **link = slot_of(h, h->n, &parent);
    struct bex__heap_node *last = *link;
    *link = NULL; /* the last node leaves its place (may be node's child link) */
    h->n--;
    if (last == node)
        return;
    /* the last node takes the removed node's place, then finds its own */
    last->left = node->left;
    last->right = node->right;
    last->parent = node->parent;
    if (last->left)
        last->left->parent = last;
    if (last->right)
        last->right->parent = last;
    if (!node->parent)
        h->min = last;
    else if (node->parent->left == node)
        node->parent->left = last;
    else
        node->parent->right = last;
    sift_down(h, last);
    sift_up(h, last);
}
