/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: requests (Fetch and Push handlers on the I/O threads). */
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
#include "common/log.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"
#include "ps/shard_internal.h"

/* ---- requests ---- */

/* Is key this shard's? A row is made only for a key that is (a client
 * with another shard count would otherwise create rows no one fetches):
 * with one shard every key is, else the check inline (issue 25 item 5). */
static inline bool key_ours(const bex_ps_shard *s, uint64_t key)
{
    return s->n_shards <= 1 || bex__ps_key_shard_n(key, s->n_shards) == s->shard;
}

/* The n keys at p into keys; each must be this shard's. */
static int read_keys(const bex_ps_shard *s, const uint8_t *p, uint32_t n, uint64_t *keys)
{
    for (uint32_t i = 0; i < n; i++) {
        keys[i] = bex__ps_get64(p + 8 * (size_t)i);
        if (!key_ours(s, keys[i]))
            return -EINVAL;
    }
    return 0;
}

/* Room in t for the rows of a Fetch's keys that have none, under s->mu.
 * Only those keys are checked for this shard (-EINVAL): a key with a row is
 * the shard's, as every row was made for a key checked (a Fetch's or a
 * Push's here, a primary's forward, a snapshot or catch-up of this shard),
 * so a Fetch of rows that exist spends no hash a key on the check (issue 25
 * item 5: the check was some 20 instructions a key, at more than one shard
 * alone, a fifth of what spreading a Fetch over shards added). */
static int fetch_room(const bex_ps_shard *s, struct table *t, const uint64_t *keys, uint32_t n)
{
    uint32_t missing = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (bex__ps_row_find(t, keys[i]) != UINT32_MAX)
            continue;
        if (!key_ours(s, keys[i]))
            return -EINVAL;
        missing++;
    }
    /* (rows that all exist, a Fetch's common case, need no room: no call) */
    return missing ? bex__ps_table_reserve(t, missing) : 0;
}

/* keys of a Fetch read into a stack array rather than the heap (2 KiB) */
#define FETCH_KEYS_SMALL 256

int bex__ps_serve_fetch(bex_ps_shard *s, bex_ctx *ctx, const struct bex__ps_hdr *h,
                        const uint8_t *p, uint64_t t0, uint64_t *t1, void **resp, size_t *resp_len)
{
    struct table *t = bex__ps_find_table(s, h->table);
    if (!t || t->cfg.dim != h->dim)
        return -EINVAL;
    size_t out_len = BEX__PS_HDR_LEN + (size_t)h->n * h->dim * 4;
    uint8_t *out = bex_rpc_alloc(ctx, out_len);
    if (!out)
        return -ENOMEM;
    /* a sub-request's keys (a Fetch spread over shards has few each) on
     * the stack: no allocation per sub-request (issue 25 item 5) */
    uint64_t small[FETCH_KEYS_SMALL];
    uint64_t *keys = h->n <= FETCH_KEYS_SMALL ? small : malloc(h->n * sizeof *keys);
    if (!keys) {
        bex_rpc_free(out);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < h->n; i++)
        keys[i] = bex__ps_get64(p + 8 * (size_t)i);
    pthread_mutex_lock(&s->mu);
    /* catching up: its rows are not the shard's yet (retryable: the client
     * fails over to another replica) */
    int rc = bex__ps_shard_catching(s) ? -EAGAIN : fetch_room(s, t, keys, h->n);
    if (rc == 0) {
        uint8_t *q = out + BEX__PS_HDR_LEN;
        for (uint32_t i = 0; i < h->n; i++) {
            const float *v = bex__ps_row_get(t, keys[i]);
            for (uint32_t c = 0; c < h->dim; c++, q += 4)
                bex__ps_putf(q, v[c]);
        }
        s->st.fetches++;
        s->st.rows_fetched += h->n;
        t->fetches++;
        t->rows_fetched += h->n;
        *t1 = bex__rpc_now_ns();
        bex__rpc_hist_add(&t->lat[0], *t1 - t0);
    }
    pthread_mutex_unlock(&s->mu);
    if (keys != small)
        free(keys);
    if (rc) {
        bex_rpc_free(out);
        return rc;
    }
    bex__ps_hdr_put(out, &(struct bex__ps_hdr){.table = h->table, .n = h->n, .dim = h->dim});
    *resp = out;
    *resp_len = out_len;
    return 0;
}

/* A Push's table (checked against h), keys (this shard's) and gradients
 * (finite) read from p into *keys and *g (malloc'd; freed on error).
 * 0, -EINVAL, -ENOMEM. */
int bex__ps_push_read(bex_ps_shard *s, const struct bex__ps_hdr *h, const uint8_t *p,
                      struct table **t, uint64_t **keys, float **g)
{
    *t = bex__ps_find_table(s, h->table);
    *keys = NULL;
    *g = NULL;
    if (!*t || (*t)->cfg.dim != h->dim)
        return -EINVAL;
    size_t nf = (size_t)h->n * h->dim;
    uint64_t *k = malloc((h->n ? h->n : 1) * sizeof *k);
    float *v = malloc((nf ? nf : 1) * sizeof *v);
    int rc = k && v ? read_keys(s, p, h->n, k) : -ENOMEM;
    const uint8_t *gp = p + 8 * (size_t)h->n;
    for (size_t i = 0; i < nf && !rc; i++) {
        v[i] = bex__ps_getf(gp + 4 * i);
        if (!isfinite(v[i]))
            rc = -EINVAL; /* one bad value refuses the whole Push */
    }
    if (rc) {
        free(k);
        free(v);
        return rc;
    }
    *keys = k;
    *g = v;
    return 0;
}

int bex__ps_serve_push(bex_ps_shard *s, bex_ctx *ctx, const struct bex__ps_hdr *h, const uint8_t *p,
                       const bex_rpc_req *req, void **resp, size_t *resp_len)
{
    bool has_id = h->flags & BEX__PS_F_ID;
    struct pushid id = {.k = {h->id_client, {h->id_tok[0], h->id_tok[1]}},
                        .seq = h->id_seq,
                        .served = true,
                        .req = req};
    struct table *t;
    uint64_t *keys;
    float *g;
    int rc = bex__ps_push_read(s, h, p, &t, &keys, &g);
    if (rc)
        return rc;
    size_t nf = (size_t)h->n * h->dim;
    uint8_t *out = bex_rpc_alloc(ctx, BEX__PS_HDR_LEN);
    if (!out) {
        rc = -ENOMEM;
        goto done;
    }
    pthread_mutex_lock(&s->mu);
    if (bex__ps_shard_catching(s)) {
        /* held, checked whole: applied (or found in the peer's copy) when
         * the catch-up ends */
        size_t bytes = sizeof(struct held) + (size_t)h->n * 8 + nf * 4;
        struct held *hd = NULL;
        if (s->held_bytes + bytes > s->held_max)
            rc = -EAGAIN; /* not applied: the client retries */
        else if (!(hd = malloc(sizeof *hd)))
            rc = -ENOMEM;
        if (hd) {
            *hd = (struct held){.t = t,
                                .n = h->n,
                                .has_id = has_id,
                                .id = id,
                                .keys = keys,
                                .g = g,
                                .bytes = bytes};
            keys = NULL;
            g = NULL;
            *s->held_tail = hd;
            s->held_tail = &hd->next;
            s->held_bytes += bytes;
            s->st.held++;
        }
    } else {
        rc = bex__ps_push_apply_locked(s, t, h->n, keys, g, has_id ? &id : NULL, NULL);
    }
    pthread_mutex_unlock(&s->mu);
    if (rc)
        goto done;
    bex__ps_hdr_put(out, &(struct bex__ps_hdr){.table = h->table, .n = h->n, .dim = h->dim});
    *resp = out;
    *resp_len = BEX__PS_HDR_LEN;
    out = NULL;
done:
    free(keys);
    free(g);
    bex_rpc_free(out);
    return rc;
}
