/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: cut files (docs/protocol.md, "Cut files"): one shard's
 * state at a consistent cut of the whole model, full or only the rows
 * changed since the cut before, and the restore of a chain of them (a
 * full one and the incremental ones after it). */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bex/ps.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "ps/shard_internal.h"

/* "BEXPSCUT", u32 version, u32 shard, u32 n_shards, u64 cut id, u64 prev
 * (the cut this one is incremental to; 0: full), u64 session, u64 lsn
 * (the replication position), u32 n_tables; per table u32 id, dim,
 * optimizer, n_rows, then n_rows x (u64 key, width floats); then the ids
 * of the Pushes applied (as in a snapshot); then the BLAKE2b-256 of
 * everything before it. */
static const char cut_magic[8] = {'B', 'E', 'X', 'P', 'S', 'C', 'U', 'T'};
#define CUT_VERSION   1
#define CUT_CHAIN_MAX 1024u /* files one restore follows, at most */

int bex__ps_cut_path(char *out, size_t cap, const char *dir, uint32_t shard, uint64_t id)
{
    int n = snprintf(out, cap, "%s/shard%u-cut%" PRIu64 ".snap", dir, shard, id);
    return n < 0 || (size_t)n >= cap ? -ENAMETOOLONG : 0;
}

static bool row_is_dirty(const struct table *t, uint32_t r)
{
    return (t->dirty[r / 64] >> (r % 64)) & 1;
}

/* Table t's rows (all, or the dirty ones), its dirty marks cleared. */
static uint64_t wr_table(struct bex__ps_wr *w, struct table *t, bool all)
{
    uint32_t n = 0;
    for (uint32_t r = 0; r < t->n_rows; r++)
        n += all || row_is_dirty(t, r);
    bex__ps_wr32(w, t->cfg.id);
    bex__ps_wr32(w, t->cfg.dim);
    bex__ps_wr32(w, t->cfg.optimizer);
    bex__ps_wr32(w, n);
    uint8_t row[8 + 8 * BEX_PS_DIM_MAX];
    for (uint32_t r = 0; r < t->n_rows; r++) {
        if (!all && !row_is_dirty(t, r))
            continue;
        bex__ps_put64(row, t->keys[r]);
        const float *v = t->vals + (size_t)r * t->width;
        for (uint32_t c = 0; c < t->width; c++)
            bex__ps_putf(row + 8 + 4 * (size_t)c, v[c]);
        bex__ps_wr_bytes(w, row, 8 + 4 * (size_t)t->width);
    }
    if (t->dirty)
        memset(t->dirty, 0, ((size_t)t->cap_rows + 63) / 64 * sizeof *t->dirty);
    return n;
}

int bex__ps_cut_make(bex_ps_shard *s, uint64_t id, uint64_t prev, char **buf, size_t *len,
                     uint64_t *rows)
{
    *buf = NULL;
    *len = 0;
    *rows = 0;
    struct bex__ps_wr w = {.f = open_memstream(buf, len)};
    if (!w.f)
        return -ENOMEM;
    crypto_generichash_init(&w.h, NULL, 0, crypto_generichash_BYTES);
    uint64_t session, lsn;
    bex__ps_repl_position(s, &session, &lsn);
    bex__ps_wr_bytes(&w, cut_magic, sizeof cut_magic);
    bex__ps_wr32(&w, CUT_VERSION);
    bex__ps_wr32(&w, s->shard);
    bex__ps_wr32(&w, s->n_shards);
    bex__ps_wr64(&w, id);
    bex__ps_wr64(&w, prev);
    bex__ps_wr64(&w, session);
    bex__ps_wr64(&w, lsn);
    bex__ps_wr32(&w, (uint32_t)s->n_tables);
    for (size_t i = 0; i < s->n_tables; i++)
        *rows += wr_table(&w, &s->tables[i], prev == 0);
    bex__ps_wr_ids(&w, s);
    return bex__ps_wr_finish(&w, buf, len);
}

/* One file of a chain, read and checked (its checksum, shard, id). */
struct cutf {
    uint8_t *buf;
    size_t size;
    struct bex__ps_rd r; /* after the header */
    uint64_t id, prev;
};

static int cut_read(bex_ps_shard *s, const char *dir, uint64_t id, struct cutf *f)
{
    char path[4096], what[4200];
    int rc = bex__ps_cut_path(path, sizeof path, dir, s->shard, id);
    if (rc)
        return rc;
    snprintf(what, sizeof what, "cut file %s", path);
    if ((rc = bex__ps_read_file(path, &f->buf, &f->size))) {
        bex__log(&s->log, BEX_LOG_ERROR, "ps shard %u: %s: %s", s->shard, what,
                 rc == -EINVAL ? "too short to be a cut file (truncated)" : bex_strerror(rc));
        return rc;
    }
    uint32_t version, shard, n_shards;
    uint64_t session, lsn;
    if ((rc = bex__ps_check_sum(s, f->buf, f->size, cut_magic, 1, CUT_VERSION, what, &version,
                                &f->r)))
        return rc; /* logged: a truncated or corrupt file fails its checksum */
    if (bex__ps_rd32(&f->r, &shard) || bex__ps_rd32(&f->r, &n_shards) ||
        bex__ps_rd64(&f->r, &f->id) || bex__ps_rd64(&f->r, &f->prev) ||
        bex__ps_rd64(&f->r, &session) || bex__ps_rd64(&f->r, &lsn) || shard != s->shard ||
        n_shards != s->n_shards || f->id != id || f->prev >= id) {
        bex__log(&s->log, BEX_LOG_ERROR, "ps shard %u: %s: not cut %" PRIu64 " of this shard",
                 s->shard, what, id);
        return -EINVAL;
    }
    return 0;
}

/* A row of the file at r (key, width floats) onto t: replaced or made. */
static int row_put(struct table *t, const uint8_t *p)
{
    uint64_t key = bex__ps_get64(p);
    int rc = bex__ps_table_reserve(t, bex__ps_row_find(t, key) == UINT32_MAX);
    if (rc)
        return rc;
    float *v = bex__ps_row_get(t, key);
    for (uint32_t c = 0; c < t->width; c++)
        v[c] = bex__ps_getf(p + 8 + 4 * (size_t)c);
    return 0;
}

/* The tables of f over s's rows (the rows it holds replace or add). */
static int cut_apply(bex_ps_shard *s, struct cutf *f)
{
    uint32_t n_tables;
    struct bex__ps_rd *r = &f->r;
    if (bex__ps_rd32(r, &n_tables) || n_tables != s->n_tables)
        return -EINVAL;
    bool seen[BEX_PS_TABLES_MAX] = {false};
    for (uint32_t i = 0; i < n_tables; i++) {
        uint32_t id, dim, opt, n_rows;
        if (bex__ps_rd32(r, &id) || bex__ps_rd32(r, &dim) || bex__ps_rd32(r, &opt) ||
            bex__ps_rd32(r, &n_rows))
            return -EINVAL;
        struct table *t = bex__ps_find_table(s, id);
        if (!t || seen[t - s->tables] || t->cfg.dim != dim || t->cfg.optimizer != opt) {
            bex__log(&s->log, BEX_LOG_ERROR,
                     "ps shard %u: cut %" PRIu64 ": table %u does not match the config", s->shard,
                     f->id, id);
            return -EINVAL;
        }
        seen[t - s->tables] = true;
        size_t row_len = 8 + 4 * (size_t)t->width;
        if (r->left / row_len < n_rows)
            return -EINVAL;
        for (uint32_t k = 0; k < n_rows; k++, r->p += row_len, r->left -= row_len) {
            int rc = row_put(t, r->p);
            if (rc)
                return rc;
        }
    }
    /* the ids: the newest file's are the shard's (each file has them all) */
    bex__ps_ids_free(&s->ids);
    int rc = bex__ps_load_ids(r, &s->ids, true);
    return rc ? rc : r->left ? -EINVAL : 0;
}

/* The chain ending at id, newest first, into fs (at most CUT_CHAIN_MAX). */
static int chain_read(bex_ps_shard *s, const char *dir, uint64_t id, struct cutf *fs, uint32_t *n)
{
    *n = 0;
    for (uint64_t cur = id;;) {
        if (*n == CUT_CHAIN_MAX) {
            bex__log(&s->log, BEX_LOG_ERROR,
                     "ps shard %u: cut %" PRIu64 ": more than %u files to its full cut", s->shard,
                     id, CUT_CHAIN_MAX);
            return -ELOOP;
        }
        int rc = cut_read(s, dir, cur, &fs[*n]);
        if (rc) {
            free(fs[*n].buf);
            if (rc == -ENOENT && cur != id)
                bex__log(&s->log, BEX_LOG_ERROR,
                         "ps shard %u: cut %" PRIu64 " is incremental to cut %" PRIu64
                         ", whose file is missing",
                         s->shard, fs[*n - 1].id, cur);
            return rc;
        }
        cur = fs[(*n)++].prev;
        if (!cur)
            return 0;
    }
}

int bex__ps_cut_restore(bex_ps_shard *s, const char *dir, uint64_t id, uint32_t *chain)
{
    struct cutf *fs = calloc(CUT_CHAIN_MAX, sizeof *fs);
    if (!fs)
        return -ENOMEM;
    uint32_t n = 0;
    int rc = chain_read(s, dir, id, fs, &n);
    for (uint32_t i = n; i-- > 0 && !rc;)
        if ((rc = cut_apply(s, &fs[i])) == -EINVAL)
            bex__log(&s->log, BEX_LOG_ERROR, "ps shard %u: cut file of cut %" PRIu64 " malformed",
                     s->shard, fs[i].id);
    for (uint32_t i = 0; i < n; i++)
        free(fs[i].buf);
    free(fs);
    if (rc == 0) {
        /* loaded rows are the cut's: none changed since */
        for (size_t i = 0; i < s->n_tables; i++)
            if (s->tables[i].dirty)
                memset(s->tables[i].dirty, 0,
                       ((size_t)s->tables[i].cap_rows + 63) / 64 * sizeof(uint64_t));
        *chain = n;
        bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: cut %" PRIu64 " restored (%u files)",
                 s->shard, id, n);
    }
    return rc;
}
