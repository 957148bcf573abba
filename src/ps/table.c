/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: tables of rows (the key -> row hash, rows, optimizers). */
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

/* ---- tables ---- */

void bex__ps_table_defaults(bex_ps_table_config *c)
{
    if (c->lr == 0)
        c->lr = 0.01f;
    if (c->init_scale == 0)
        c->init_scale = 0.01f;
    if (c->adagrad_init == 0)
        c->adagrad_init = 0.1f;
    if (c->adagrad_eps == 0)
        c->adagrad_eps = 1e-8f;
    if (c->max_rows == 0)
        c->max_rows = 1u << 20;
}

struct table *bex__ps_find_table(bex_ps_shard *s, uint32_t id)
{
    for (size_t i = 0; i < s->n_tables; i++)
        if (s->tables[i].cfg.id == id)
            return &s->tables[i];
    return NULL;
}

/* A key's hash in the row index: another hash than the shard's
 * (bex_ps_key_shard uses bex__ps_mix(key) mod n_shards, so its low bits are
 * the same for every key of a shard with a power-of-two count). */
static uint64_t key_hash(uint64_t key)
{
    return bex__ps_mix(key ^ 0xd6e8feb86659fd93ull);
}

static uint64_t row_hash(const void *t, uint32_t row)
{
    return key_hash(((const struct table *)t)->keys[row]);
}

static bool row_eq(const void *t, uint32_t row, const void *key)
{
    return ((const struct table *)t)->keys[row] == *(const uint64_t *)key;
}

/* The row of key, or UINT32_MAX. */
uint32_t bex__ps_row_find(const struct table *t, uint64_t key)
{
    return bex__ihash_find(&t->idx, key_hash(key), row_eq, t, &key);
}

/* Room for extra more rows (the load factor stays <= 1/2). */
int bex__ps_table_reserve(struct table *t, uint32_t extra)
{
    if (!extra) /* a Fetch of rows that exist: room was made when they came */
        return 0;
    uint64_t want = (uint64_t)t->n_rows + extra;
    if (want > t->cfg.max_rows)
        return -ENOSPC;
    if (want > t->cap_rows) {
        uint64_t cap = t->cap_rows ? t->cap_rows : 64;
        while (cap < want)
            cap *= 2;
        if (cap > t->cfg.max_rows)
            cap = t->cfg.max_rows;
        uint64_t *k = realloc(t->keys, cap * sizeof *k);
        if (!k)
            return -ENOMEM;
        t->keys = k;
        float *v = realloc(t->vals, cap * t->width * sizeof *v);
        if (!v)
            return -ENOMEM;
        t->vals = v;
        size_t ow = ((size_t)t->cap_rows + 63) / 64, nw = ((size_t)cap + 63) / 64;
        uint64_t *d = realloc(t->dirty, nw * sizeof *d);
        if (!d)
            return -ENOMEM;
        memset(d + ow, 0, (nw - ow) * sizeof *d);
        t->dirty = d;
        t->cap_rows = (uint32_t)cap;
    }
    return bex__ihash_reserve(&t->idx, (uint32_t)want, row_hash, t);
}

/* The row of key, created with its initial values when new; room must
 * have been reserved. */
float *bex__ps_row_get(struct table *t, uint64_t key)
{
    uint32_t r = bex__ps_row_find(t, key);
    if (r == UINT32_MAX) {
        r = t->n_rows++;
        t->keys[r] = key;
        float *v = t->vals + (size_t)r * t->width;
        for (uint32_t c = 0; c < t->cfg.dim; c++)
            v[c] = bex_ps_init_value(t->cfg.id, key, c, t->cfg.init_scale);
        if (t->cfg.optimizer == BEX_PS_ADAGRAD)
            for (uint32_t c = 0; c < t->cfg.dim; c++)
                v[t->cfg.dim + c] = t->cfg.adagrad_init;
        bex__ihash_insert(&t->idx, key_hash(key), r);
    }
    return t->vals + (size_t)r * t->width;
}

void bex__ps_row_dirty(struct table *t, const float *v)
{
    size_t r = (size_t)(v - t->vals) / t->width;
    t->dirty[r / 64] |= 1ull << (r % 64);
}

/* Keys among keys[0..n) without a row yet (duplicates counted: an upper
 * bound, enough to reserve). */
uint32_t bex__ps_missing_rows(const struct table *t, const uint64_t *keys, uint32_t n)
{
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        if (bex__ps_row_find(t, keys[i]) == UINT32_MAX)
            m++;
    return m;
}

void bex__ps_apply(const struct table *t, float *v, const float *g)
{
    uint32_t d = t->cfg.dim;
    if (t->cfg.optimizer == BEX_PS_SGD) {
        for (uint32_t c = 0; c < d; c++)
            v[c] -= t->cfg.lr * g[c];
    } else {
        float *acc = v + d;
        for (uint32_t c = 0; c < d; c++) {
            acc[c] += g[c] * g[c];
            v[c] -= t->cfg.lr * g[c] / (sqrtf(acc[c]) + t->cfg.adagrad_eps);
        }
    }
}
