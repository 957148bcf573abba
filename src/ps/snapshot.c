/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: snapshots (writing and loading a shard's state). */
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

/* ---- snapshots ---- */

/* "BEXPSNAP", u32 version, shard, n_shards, n_tables; per table u32 id,
 * dim, optimizer, n_rows, then n_rows x (u64 key, width floats); version
 * 3: then the ids of the Pushes applied (as in a copy); then the
 * BLAKE2b-256 (crypto_generichash) of everything before it. Version 1
 * (no ids) is still loaded, and 2 (ids without tokens: taken as the zero
 * token, which no bex_ps_client sends). */
static const char snap_magic[8] = {'B', 'E', 'X', 'P', 'S', 'N', 'A', 'P'};
#define SNAP_VERSION 4 /* 4: the replication position after the ids */
#define COPY_VERSION 3 /* 3: the replication position after the ids */
#define SNAP_HASH    crypto_generichash_BYTES

void bex__ps_wr_bytes(struct bex__ps_wr *w, const void *p, size_t n)
{
    if (w->err)
        return;
    crypto_generichash_update(&w->h, p, n);
    if (fwrite(p, 1, n, w->f) != n)
        w->err = -EIO;
}

void bex__ps_wr32(struct bex__ps_wr *w, uint32_t v)
{
    uint8_t b[4];
    bex__ps_put32(b, v);
    bex__ps_wr_bytes(w, b, 4);
}

void bex__ps_wr64(struct bex__ps_wr *w, uint64_t v)
{
    uint8_t b[8];
    bex__ps_put64(b, v);
    bex__ps_wr_bytes(w, b, 8);
}

/* shard, n_shards, n_tables, then every table's rows (under s->mu). */
static void wr_tables(struct bex__ps_wr *w, bex_ps_shard *s)
{
    bex__ps_wr32(w, s->shard);
    bex__ps_wr32(w, s->n_shards);
    bex__ps_wr32(w, (uint32_t)s->n_tables);
    uint8_t row[8 + 8 * BEX_PS_DIM_MAX];
    for (size_t i = 0; i < s->n_tables; i++) {
        const struct table *t = &s->tables[i];
        bex__ps_wr32(w, t->cfg.id);
        bex__ps_wr32(w, t->cfg.dim);
        bex__ps_wr32(w, t->cfg.optimizer);
        bex__ps_wr32(w, t->n_rows);
        for (uint32_t r = 0; r < t->n_rows; r++) {
            bex__ps_put64(row, t->keys[r]);
            const float *v = t->vals + (size_t)r * t->width;
            for (uint32_t c = 0; c < t->width; c++)
                bex__ps_putf(row + 8 + 4 * (size_t)c, v[c]);
            bex__ps_wr_bytes(w, row, 8 + 4 * (size_t)t->width);
        }
    }
}

/* The ids of the Pushes applied: u32 clients; per client u64 id, 2 x u64
 * token, u64 highest sequence, IDS_WINDOW / 64 u64 bitmap words (under
 * s->mu). */
void bex__ps_wr_ids(struct bex__ps_wr *w, bex_ps_shard *s)
{
    bex__ps_wr32(w, s->ids.n);
    for (uint32_t i = 0; i < s->ids.n; i++) {
        const struct idc *c = &s->ids.c[i];
        bex__ps_wr64(w, c->k.client);
        bex__ps_wr64(w, c->k.tok[0]);
        bex__ps_wr64(w, c->k.tok[1]);
        bex__ps_wr64(w, c->max);
        for (uint32_t k = 0; k < IDS_WINDOW / 64; k++)
            bex__ps_wr64(w, c->bits[k]);
    }
}

int bex_ps_shard_snapshot(bex_ps_shard *s, const char *path)
{
    if (!s || !path)
        return -EINVAL;
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 5);
    if (!tmp)
        return -ENOMEM;
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);
    struct bex__ps_wr w = {.f = fopen(tmp, "wb")};
    if (!w.f) {
        int rc = -errno;
        free(tmp);
        return rc;
    }
    crypto_generichash_init(&w.h, NULL, 0, SNAP_HASH);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t t0 = bex__rpc_now_ns();
    pthread_mutex_lock(&s->mu);
    bex__ps_wr_bytes(&w, snap_magic, sizeof snap_magic);
    bex__ps_wr32(&w, SNAP_VERSION);
    wr_tables(&w, s);
    bex__ps_wr_ids(&w, s);
    uint64_t session, lsn; /* one cut with the rows: under s->mu */
    bex__ps_repl_position(s, &session, &lsn);
    bex__ps_wr64(&w, session);
    bex__ps_wr64(&w, lsn);
    pthread_mutex_unlock(&s->mu);
    uint8_t sum[SNAP_HASH];
    crypto_generichash_final(&w.h, sum, sizeof sum);
    if (!w.err && fwrite(sum, 1, sizeof sum, w.f) != sizeof sum)
        w.err = -EIO;
    if (!w.err && (fflush(w.f) || fsync(fileno(w.f))))
        w.err = -errno;
    if (fclose(w.f) && !w.err)
        w.err = -EIO;
    if (!w.err && rename(tmp, path))
        w.err = -errno;
    if (w.err)
        unlink(tmp);
    else
        bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: snapshot written to %s", s->shard, path);
    pthread_mutex_lock(&s->mu);
    bex__ps_snap_written_locked(s, 0, (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec,
                                bex__rpc_now_ns() - t0, 0, 0, w.err);
    pthread_mutex_unlock(&s->mu);
    free(tmp);
    return w.err;
}

/* The copy a restarted peer pulls: "BEXPSCPY", u32 version, the tables as
 * in a snapshot, then the ids of the Pushes applied (wr_ids),
 * then the BLAKE2b-256 of everything before it. Made under s->mu: the
 * rows and the ids are one cut. */
static const char copy_magic[8] = {'B', 'E', 'X', 'P', 'S', 'C', 'P', 'Y'};

int bex__ps_copy_make(bex_ps_shard *s, char **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    struct bex__ps_wr w = {.f = open_memstream(buf, len)};
    if (!w.f)
        return -ENOMEM;
    crypto_generichash_init(&w.h, NULL, 0, SNAP_HASH);
    bex__ps_wr_bytes(&w, copy_magic, sizeof copy_magic);
    bex__ps_wr32(&w, COPY_VERSION);
    wr_tables(&w, s);
    bex__ps_wr_ids(&w, s);
    uint64_t session, lsn;
    bex__ps_repl_position(s, &session, &lsn);
    bex__ps_wr64(&w, session);
    bex__ps_wr64(&w, lsn);
    return bex__ps_wr_finish(&w, buf, len);
}

int bex__ps_wr_finish(struct bex__ps_wr *w, char **buf, size_t *len)
{
    uint8_t sum[SNAP_HASH];
    crypto_generichash_final(&w->h, sum, sizeof sum);
    if (!w->err && fwrite(sum, 1, sizeof sum, w->f) != sizeof sum)
        w->err = -ENOMEM;
    if (fclose(w->f) && !w->err)
        w->err = -ENOMEM;
    if (w->err) {
        free(*buf);
        *buf = NULL;
        *len = 0;
    }
    return w->err ? -ENOMEM : 0;
}

int bex__ps_rd32(struct bex__ps_rd *r, uint32_t *v)
{
    if (r->left < 4)
        return -EINVAL;
    *v = bex__ps_get32(r->p);
    r->p += 4;
    r->left -= 4;
    return 0;
}

int bex__ps_rd64(struct bex__ps_rd *r, uint64_t *v)
{
    if (r->left < 8)
        return -EINVAL;
    *v = bex__ps_get64(r->p);
    r->p += 8;
    r->left -= 8;
    return 0;
}

/* buf (size bytes) ends with the BLAKE2b-256 of the rest and starts with
 * magic and a version from lo to hi: 0, *version and *r after them, or
 * -EINVAL. */
int bex__ps_check_sum(bex_ps_shard *s, const uint8_t *buf, size_t size, const char *magic,
                      uint32_t lo, uint32_t hi, const char *what, uint32_t *version,
                      struct bex__ps_rd *r)
{
    if (size < 8 + 4 + 12 + SNAP_HASH)
        return -EINVAL;
    uint8_t sum[SNAP_HASH];
    crypto_generichash(sum, sizeof sum, buf, size - SNAP_HASH, NULL, 0);
    if (sodium_memcmp(sum, buf + size - SNAP_HASH, SNAP_HASH) != 0) {
        bex__log(&s->log, BEX_LOG_ERROR, "ps %s: checksum mismatch", what);
        return -EINVAL;
    }
    *r = (struct bex__ps_rd){.p = buf + 8, .left = size - SNAP_HASH - 8};
    if (memcmp(buf, magic, 8) || bex__ps_rd32(r, version) || *version < lo || *version > hi) {
        bex__log(&s->log, BEX_LOG_ERROR, "ps %s: not a file of its kind, version %u to %u", what,
                 lo, hi);
        return -EINVAL;
    }
    return 0;
}

/* The ids section at r into ids (empty); tok: with tokens (else the
 * zero token). Every client is taken as seen now: its retries may still
 * come. */
int bex__ps_load_ids(struct bex__ps_rd *r, struct idset *ids, bool tok)
{
    uint32_t n;
    size_t each = (tok ? 32 : 16) + IDS_WINDOW / 8;
    if (bex__ps_rd32(r, &n) || n > IDS_LOAD_MAX || r->left / each < n)
        return -EINVAL;
    uint64_t now = bex__rpc_now_ns();
    for (uint32_t i = 0; i < n; i++) {
        struct idkey k = {0};
        uint64_t max = 0;
        bex__ps_rd64(r, &k.client);
        if (tok) {
            bex__ps_rd64(r, &k.tok[0]);
            bex__ps_rd64(r, &k.tok[1]);
        }
        bex__ps_rd64(r, &max);
        if (bex__ps_ids_find(ids, &k))
            return -EINVAL; /* a client twice */
        struct idc *c;
        int rc = bex__ps_ids_new(ids, &k, now, UINT32_MAX, 0, &c);
        if (rc)
            return rc;
        c->max = max;
        for (uint32_t w = 0; w < IDS_WINDOW / 64; w++)
            bex__ps_rd64(r, &c->bits[w]);
    }
    return 0;
}

/* The tables at r (shard, shard count, tables, rows) into dst[] (s's
 * tables' configs, empty), every count checked against what is left. */
static int load_tables(bex_ps_shard *s, struct table *dst, struct bex__ps_rd *r, const char *what)
{
    uint32_t shard, n_shards, n_tables;
    if (bex__ps_rd32(r, &shard) || bex__ps_rd32(r, &n_shards) || bex__ps_rd32(r, &n_tables) ||
        shard != s->shard || n_shards != s->n_shards || n_tables != s->n_tables) {
        bex__log(&s->log, BEX_LOG_ERROR, "ps %s: not of this shard (shard, shard count or tables)",
                 what);
        return -EINVAL;
    }
    bool seen[BEX_PS_TABLES_MAX] = {false};
    for (uint32_t i = 0; i < n_tables; i++) {
        uint32_t id, dim, opt, n_rows;
        if (bex__ps_rd32(r, &id) || bex__ps_rd32(r, &dim) || bex__ps_rd32(r, &opt) ||
            bex__ps_rd32(r, &n_rows))
            return -EINVAL;
        struct table *c = bex__ps_find_table(s, id);
        if (!c || seen[c - s->tables] || c->cfg.dim != dim || c->cfg.optimizer != opt) {
            bex__log(&s->log, BEX_LOG_ERROR, "ps %s: table %u does not match the config", what, id);
            return -EINVAL;
        }
        seen[c - s->tables] = true;
        struct table *t = &dst[c - s->tables];
        size_t row_len = 8 + 4 * (size_t)t->width;
        if (n_rows > t->cfg.max_rows || r->left / row_len < n_rows)
            return -EINVAL;
        int rc = bex__ps_table_reserve(t, n_rows);
        if (rc)
            return rc;
        for (uint32_t k = 0; k < n_rows; k++, r->p += row_len, r->left -= row_len) {
            uint64_t key = bex__ps_get64(r->p);
            if (bex__ps_row_find(t, key) != UINT32_MAX)
                return -EINVAL; /* a key twice */
            float *v = bex__ps_row_get(t, key);
            for (uint32_t c2 = 0; c2 < t->width; c2++)
                v[c2] = bex__ps_getf(r->p + 8 + 4 * (size_t)c2);
        }
    }
    return 0;
}

/* The whole file at path into *buf (malloc'd) and *size: 0, -errno,
 * -EINVAL (not a regular file or too short to be a snapshot), -ENOMEM. */
int bex__ps_read_file(const char *path, uint8_t **buf, size_t *size)
{
    *buf = NULL;
    *size = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct stat st;
    int rc = 0;
    uint8_t *b = NULL;
    if (fstat(fd, &st)) {
        rc = -errno;
        goto out;
    }
    if (!S_ISREG(st.st_mode) || st.st_size < (off_t)(sizeof snap_magic + 16 + SNAP_HASH)) {
        rc = -EINVAL;
        goto out;
    }
    size_t n = (size_t)st.st_size;
    if (!(b = malloc(n))) {
        rc = -ENOMEM;
        goto out;
    }
    for (size_t got = 0; got < n;) {
        ssize_t k = read(fd, b + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            rc = k < 0 ? -errno : -EIO;
            goto out;
        }
        got += (size_t)k;
    }
    *buf = b;
    *size = n;
    b = NULL;
out:
    free(b);
    close(fd);
    return rc;
}

/* Load rows from the file at path into s (empty, tables configured). The
 * checksum is verified before anything is read; then every count is
 * checked against what is left. */
int bex__ps_snapshot_load(bex_ps_shard *s, const char *path)
{
    uint8_t *buf;
    size_t size;
    int rc = bex__ps_read_file(path, &buf, &size);
    if (rc)
        return rc;
    char what[256];
    snprintf(what, sizeof what, "snapshot %s", path);
    struct bex__ps_rd r;
    uint32_t version;
    if ((rc = bex__ps_check_sum(s, buf, size, snap_magic, 1, SNAP_VERSION, what, &version, &r)) ||
        (rc = load_tables(s, s->tables, &r, what)) ||
        (version >= 2 && (rc = bex__ps_load_ids(&r, &s->ids, version >= 3))))
        goto out;
    s->rp.snap_session = s->rp.snap_lsn = 0;
    if (version >= 4 &&
        (bex__ps_rd64(&r, &s->rp.snap_session) || bex__ps_rd64(&r, &s->rp.snap_lsn))) {
        rc = -EINVAL;
        goto out;
    }
    if (r.left)
        rc = -EINVAL;
    else
        bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: snapshot %s loaded", s->shard, path);
out:
    free(buf);
    return rc;
}

/* Empty tables with s's configs (for a copy to be loaded into). */
struct table *bex__ps_tables_like(const bex_ps_shard *s)
{
    struct table *ts = calloc(s->n_tables, sizeof *ts);
    if (!ts)
        return NULL;
    for (size_t i = 0; i < s->n_tables; i++) {
        ts[i].cfg = s->tables[i].cfg;
        ts[i].width = s->tables[i].width;
    }
    return ts;
}

/* A peer's copy (buf, size bytes) into dst (from bex__ps_tables_like) and ids. */
int bex__ps_copy_load(bex_ps_shard *s, const uint8_t *buf, size_t size, struct table *dst,
                      struct idset *ids)
{
    struct bex__ps_rd r;
    uint32_t version;
    int rc =
        bex__ps_check_sum(s, buf, size, copy_magic, 2, COPY_VERSION, "catch-up copy", &version, &r);
    if (rc || (rc = load_tables(s, dst, &r, "catch-up copy")) ||
        (rc = bex__ps_load_ids(&r, ids, true)))
        return rc;
    /* the maker's replication position (version 3) */
    s->rp.cut_session = s->rp.cut_lsn = 0;
    if (version >= 3 && (bex__ps_rd64(&r, &s->rp.cut_session) || bex__ps_rd64(&r, &s->rp.cut_lsn)))
        return -EINVAL;
    return r.left ? -EINVAL : 0;
}

/* The peer's cut lacks Pushes this replica applied (its snapshot's ids):
 * a client the cut does not know, or whose highest sequence is lower. The
 * peer is behind (itself restarted from an older snapshot): its copy
 * would lose them. */
bool bex__ps_ids_behind(const struct idset *mine, const struct idset *cut)
{
    for (uint32_t i = 0; i < mine->n; i++) {
        const struct idc *p = bex__ps_ids_find(cut, &mine->c[i].k);
        if (!p || p->max < mine->c[i].max)
            return true;
    }
    return false;
}
