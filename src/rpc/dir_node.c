/* SPDX-License-Identifier: Apache-2.0 */
/* The service directory: its nodes (addresses), kept for the directory's
 * life. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "bex/sock.h"
#include "common/log.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"
#include "rpc/dir_impl.h"

/* ---- nodes (under d->mu) ---- */

struct bex__dir_node *bex__dir_node_lookup(bex_dir *d, const bex_addr *addr)
{
    for (struct bex__dir_node *n = d->nodes; n; n = n->next)
        if (bex__dir_same_addr(&n->r.addr, addr))
            return n;
    return NULL;
}

static int ring_init(struct fail_ring *r, uint32_t max)
{
    r->cap = max + 1;
    r->t = calloc(r->cap, sizeof(*r->t));
    return r->t ? 0 : -ENOMEM;
}

/* Record a failure at now; true when more than cap - 1 fell in the window. */
bool bex__dir_ring_add(struct fail_ring *r, uint64_t now, uint64_t window)
{
    r->t[r->head] = now;
    r->head = (r->head + 1) % r->cap;
    if (r->n < r->cap)
        r->n++;
    /* full: head is the oldest of the last cap failures */
    return r->n == r->cap && now - r->t[r->head] <= window;
}

void bex__dir_node_free(struct bex__dir_node *n)
{
    free(n->conn.t);
    free(n->req.t);
    free(n);
}

/* The node at r's address, made if new; its replica data updated. */
int bex__dir_node_get(bex_dir *d, const bex_dir_replica *r, struct bex__dir_node **out)
{
    struct bex__dir_node *n = bex__dir_node_lookup(d, &r->addr);
    if (!n) {
        if (d->n_nodes >= d->max_nodes)
            return -ENOSPC;
        n = calloc(1, sizeof(*n));
        if (!n || ring_init(&n->conn, d->conn_max) || ring_init(&n->req, d->req_max)) {
            if (n)
                bex__dir_node_free(n);
            return -ENOMEM;
        }
        bex_addr_format(&r->addr, true, n->name, sizeof n->name);
        n->next = d->nodes;
        d->nodes = n;
        d->n_nodes++;
    }
    n->r = *r;
    *out = n;
    return 0;
}
