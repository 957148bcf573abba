/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport: received memory (recv_bytes_max: the connection's
 * share, holders), split from tcp.c along its banner. See tcp.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "transport/tcp/tcp_internal.h"

/* ---------------- received memory (recv_bytes_max) ---------------- */

static _Atomic int32_t *holders(struct bex__tcp *t)
{
    return &(t->sh->recv_acct ? t->sh->recv_acct : &t->sh->recv_own)->holders;
}

/* What this connection may hold of partly received messages: with no other
 * connection of the context holding any, the whole budget; else its share,
 * which leaves room for one more holder, so that a few peers that start
 * large messages and stall cannot take the budget from every other (they
 * fail by the rate check, too_slow). */
uint64_t bex__tcp_recv_share(struct bex__tcp *t)
{
    int32_t n = atomic_load_explicit(holders(t), memory_order_relaxed) - (t->holding ? 1 : 0);
    return bex__recv_share(t->sh->recv_max, n, t->cfg.share_min);
}

/* part_bytes changed: keep the context's count of holders, and start the
 * rate window when the connection begins to hold. */
void bex__tcp_hold_note(struct bex__tcp *t)
{
    bool h = t->state != T_DEAD && t->part_bytes > 0;
    if (h == t->holding)
        return;
    t->holding = h;
    atomic_fetch_add_explicit(holders(t), h ? 1 : -1, memory_order_relaxed);
    if (h) {
        t->rate_ms = t->rx_ms; /* (only a read starts holding) */
        t->rate_rx = t->part_rx;
    }
}

void bex__tcp_part_unhold(struct bex__tcp *t, const struct part *p)
{
    if (p->held) {
        t->part_bytes -= p->len;
        bex__tcp_hold_note(t);
    }
}
