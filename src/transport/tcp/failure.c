/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport: failure (everything handed back, the protocol
 * violation handler), split from tcp.c along its banner. See tcp.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "transport/tcp/tcp_internal.h"

/* ---------------- failure ---------------- */

void bex__tcp_done(struct bex__tcp *t, struct bex__msg *m, int status)
{
    t->up->on_send_done(&t->x, m, status);
}

void bex__tcp_part_free(struct bex__tcp *t, struct part *p)
{
    bex__tcp_part_unhold(t, p);
    if (!p->direct && p->buf)
        bex_mem_free(p->buf); /* the estimate learns of it at its next exact count */
    bex__tcp_part_release(t, p);
}

/* p's entry goes: t->one is free again, an allocated one freed. */
void bex__tcp_fail(struct bex__xport *x, int err)
{
    struct bex__tcp *t = tcp_of(x);
    if (t->state == T_DEAD)
        return;
    bex__tcp_move(t, T_DEAD);
    t->x.due_us = 0;
    /* the fd is the connection's: it closes it on on_fail; from here on
     * nothing is written or read, so every buffer is ours to hand back */
    for (uint32_t i = 0; i < t->out_n; i++) {
        struct out_frame *f = &t->out[(t->out_head + i) % OUT_MAX];
        if (f->m && f->last)
            bex__tcp_done(t, f->m, -ECANCELED); /* never written whole */
    }
    t->out_n = 0;
    while (t->ack_head) { /* written whole, the peer may or may not hold it */
        struct bex__msg *m = t->ack_head;
        t->ack_head = m->next;
        bex__tcp_done(t, m, -EIO);
    }
    t->ack_tail = NULL;
    t->ack_n = 0;
    struct bex__stream *st;
    bex__stream_foreach(st, &t->streams, it)
    {
        struct bex__msg *m = bex__stream_take_queue(st);
        while (m) {
            struct bex__msg *next = m->next;
            bex__tcp_done(t, m, -ECANCELED);
            m = next;
        }
        bex__stream_move(st, BEX__SE_FAIL);
        /* unlinked: the sock layer lets go of them in on_fail */
        bex__stream_unlink(&t->streams, st);
    }
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    struct part *p;
    while ((p = bex__hmap_next(&t->parts, &it, NULL))) {
        bex__hmap_del(&t->parts, p->stream);
        bex__tcp_part_free(t, p);
    }
    if (t->one_busy)
        bex__tcp_part_free(t, &t->one);
    t->parts_n = 0;
    t->cur = NULL;
    t->up->on_fail(&t->x, err);
}

/* The peer broke the protocol: one log line, then the connection goes. */
void bex__tcp_violation(struct bex__tcp *t, const char *what)
{
    bex__tcp_fail(&t->x, bex__stream_violation(t->sh->log, t->cfg.name, "TCP", &t->said, what));
}
