/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: the ids of applied Pushes (deduplication of retried
 * Pushes per client). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "bex/ps.h"
#include "common/ihash.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"
#include "ps/shard_internal.h"

/* ---- the ids of applied Pushes ---- */

/* An id's hash in the index of clients. */
static uint64_t idkey_hash(const struct idkey *k)
{
    uint64_t h = bex__ps_mix(k->client ^ 0x2545f4914f6cdd1dull);
    return bex__ps_mix(h ^ bex__ps_mix(k->tok[0] ^ h) ^ k->tok[1]);
}

static uint64_t idc_hash(const void *c, uint32_t i)
{
    return idkey_hash(&((const struct idc *)c)[i].k);
}

static bool idc_eq(const void *c, uint32_t i, const void *key)
{
    const struct idkey *a = &((const struct idc *)c)[i].k, *b = key;
    return a->client == b->client && a->tok[0] == b->tok[0] && a->tok[1] == b->tok[1];
}

struct idc *bex__ps_ids_find(const struct idset *d, const struct idkey *key)
{
    uint32_t i = bex__ihash_find(&d->idx, idkey_hash(key), idc_eq, d->c, key);
    return i != BEX__IHASH_NONE ? &d->c[i] : NULL;
}

int bex__ps_ids_has(const struct idset *d, const struct idkey *key, uint64_t seq)
{
    const struct idc *c = bex__ps_ids_find(d, key);
    if (!c || seq > c->max)
        return ID_NEW;
    if (c->max - seq >= IDS_WINDOW)
        return ID_OLD;
    return (c->bits[(seq % IDS_WINDOW) / 64] >> (seq % 64)) & 1 ? ID_SEEN : ID_NEW;
}

static void lru_unlink(struct idset *d, uint32_t i)
{
    struct idc *c = &d->c[i];
    if (c->prev != IDS_NIL)
        d->c[c->prev].next = c->next;
    else
        d->head = c->next;
    if (c->next != IDS_NIL)
        d->c[c->next].prev = c->prev;
    else
        d->tail = c->prev;
}

/* Record i (unlinked) first in the order. */
static void lru_push_front(struct idset *d, uint32_t i)
{
    struct idc *c = &d->c[i];
    c->prev = IDS_NIL;
    c->next = d->head;
    if (d->head != IDS_NIL)
        d->c[d->head].prev = i;
    d->head = i;
    if (d->tail == IDS_NIL)
        d->tail = i;
}

/* Seen now: first in the order. */
static void ids_touch(struct idset *d, struct idc *c, uint64_t now)
{
    uint32_t i = (uint32_t)(c - d->c);
    c->touch_ns = now;
    if (d->head == i)
        return;
    lru_unlink(d, i);
    lru_push_front(d, i);
}

/* Room for one more record: the array and the index grown. -ENOMEM. */
static int ids_grow(struct idset *d)
{
    if (d->n == d->cap) {
        uint32_t cap = d->cap ? 2 * d->cap : 16;
        struct idc *nc = realloc(d->c, cap * sizeof *nc);
        if (!nc)
            return -ENOMEM;
        d->c = nc;
        d->cap = cap;
    }
    return bex__ihash_reserve(&d->idx, d->n + 1, idc_hash, d->c) ? -ENOMEM : 0;
}

/* A new record for key (not there), seen at now. With lim clients held, the
 * least recently seen is forgotten when it was seen before now - horizon
 * (its retries are over); else -EAGAIN: a retriable refusal, nothing
 * evicted. O(1) (amortized). -ENOMEM. */
int bex__ps_ids_new(struct idset *d, const struct idkey *key, uint64_t now, uint32_t lim,
                    uint64_t horizon, struct idc **out)
{
    uint32_t i;
    if (d->n >= lim && d->tail != IDS_NIL) {
        i = d->tail;
        if (now - d->c[i].touch_ns < horizon)
            return -EAGAIN;
        lru_unlink(d, i);
        bex__ihash_remove(&d->idx, idkey_hash(&d->c[i].k), i, idc_hash, d->c);
    } else {
        int rc = ids_grow(d);
        if (rc)
            return rc;
        i = d->n++;
    }
    struct idc *c = &d->c[i];
    *c = (struct idc){.k = *key, .prev = IDS_NIL, .next = IDS_NIL, .touch_ns = now};
    if (d->n == 1)
        d->head = d->tail = IDS_NIL; /* the first: the order was empty */
    bex__ihash_insert(&d->idx, idkey_hash(key), i);
    lru_push_front(d, i);
    *out = c;
    return 0;
}

/* seq applied by c (seen now). */
static void ids_mark(struct idset *d, struct idc *c, uint64_t seq, uint64_t now)
{
    ids_touch(d, c, now);
    if (seq > c->max) {
        if (seq - c->max >= IDS_WINDOW)
            memset(c->bits, 0, sizeof c->bits);
        else
            for (uint64_t q = c->max + 1; q <= seq; q++)
                c->bits[(q % IDS_WINDOW) / 64] &= ~(1ull << (q % 64));
        c->max = seq;
    } else if (c->max - seq >= IDS_WINDOW) {
        return; /* older than the window: not recorded */
    }
    c->bits[(seq % IDS_WINDOW) / 64] |= 1ull << (seq % 64);
}

void bex__ps_ids_free(struct idset *d)
{
    free(d->c);
    bex__ihash_free(&d->idx);
    *d = (struct idset){.head = IDS_NIL, .tail = IDS_NIL};
}

/* A client id new to the shard may come from this request (under s->mu):
 * the shard's rate of new clients (a token bucket of one second's worth)
 * and the connection's count (req NULL: bex_ps_shard_serve, no
 * connection) allow it. */
static bool new_client_allowed(bex_ps_shard *s, const bex_rpc_req *req, uint64_t now)
{
    uint64_t iv = 1000000000ull / s->new_rate;
    if (s->new_tat < now)
        s->new_tat = now;
    if (s->new_tat - now > (uint64_t)(s->new_rate - 1) * iv)
        return false;
    if (req && !bex__rpc_req_conn_admit(req, s->new_per_conn))
        return false;
    s->new_tat += iv;
    return true;
}

/* The client record of a Push with an id (under s->mu): found, or made
 * when the shard admits a new client (new_client_allowed, the table's
 * room). 0, -EAGAIN (refused, retriable), -ENOMEM. */
static int push_client(bex_ps_shard *s, const struct pushid *id, uint64_t now, struct idc **out)
{
    if ((*out = bex__ps_ids_find(&s->ids, &id->k)))
        return 0;
    int rc = -EAGAIN;
    if (s->ids.n < s->ids_max ||
        (s->ids.tail != IDS_NIL && now - s->ids.c[s->ids.tail].touch_ns >= s->horizon_ns))
        if (!id->served || new_client_allowed(s, id->req, now))
            rc = bex__ps_ids_new(&s->ids, &id->k, now, s->ids_max, s->horizon_ns, out);
    if (rc == -EAGAIN) {
        s->st.clients_refused++;
        bex__log(&s->log, BEX_LOG_WARN,
                 "ps shard %u: a new client refused (%u held, rate %u/s): retriable", s->shard,
                 s->ids.n, s->new_rate);
    }
    return rc;
}

/* Apply a decoded Push (under s->mu): once per id. Returns 0 (applied, or
 * its id was applied already: not again), -ESTALE (its id is more than
 * IDS_WINDOW behind its client's highest: applied or not, the shard cannot
 * tell), -EAGAIN (a new client refused: push_client), -ENOSPC, -ENOMEM
 * (nothing changed). *applied (may be NULL) tells which. id: NULL for a
 * Push without an id. */
int bex__ps_push_apply_locked(bex_ps_shard *s, struct table *t, uint32_t n, const uint64_t *keys,
                              const float *g, const struct pushid *id, bool *applied)
{
    if (applied)
        *applied = false;
    int has = id ? bex__ps_ids_has(&s->ids, &id->k, id->seq) : ID_NEW;
    uint64_t now = bex__rpc_now_ns();
    if (has == ID_SEEN) {
        /* a retry: its client is alive (the horizon counts from here) */
        ids_touch(&s->ids, bex__ps_ids_find(&s->ids, &id->k), now);
        s->st.dup_ids++;
        return 0;
    }
    if (has == ID_OLD) {
        s->st.stale_ids++;
        return -ESTALE;
    }
    struct idc *c = NULL;
    int rc = id ? push_client(s, id, now, &c) : 0;
    if (rc == 0)
        rc = bex__ps_table_reserve(t, bex__ps_missing_rows(t, keys, n));
    if (rc)
        return rc;
    if (c)
        ids_mark(&s->ids, c, id->seq, now);
    for (uint32_t i = 0; i < n; i++) {
        float *v = bex__ps_row_get(t, keys[i]);
        bex__ps_apply(t, v, g + (size_t)i * t->cfg.dim);
        bex__ps_row_dirty(t, v);
    }
    s->st.pushes++;
    s->st.rows_pushed += n;
    t->pushes++;
    t->rows_pushed += n;
    if (applied)
        *applied = true;
    return 0;
}
