/* The PS shard: tables of rows in memory, the Fetch/Push wire format's
 * strict decoder, the optimizers, and snapshots (docs/protocol.md,
 * "Parameter server").
 *
 * A table is an open-addressing hash of key -> row index over a growing row
 * array (weights, then Adagrad's accumulators, per row). One mutex per
 * shard: handlers run on I/O threads and a snapshot may run on another. */
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
#include <unistd.h>

#include "bex/ps.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"

/* rows of a table at most: its hash's slot count (2 x rows) fits in a u32 */
#define BEX__PS_ROWS_MAX (1u << 30)

struct table {
    bex_ps_table_config cfg;
    uint32_t width; /* floats per row: dim, or 2 x dim with Adagrad */
    uint64_t *keys; /* row -> key */
    float *vals;    /* row -> width floats */
    uint32_t n_rows, cap_rows;
    uint32_t *slots; /* hash slot -> row + 1 (0: empty) */
    uint32_t n_slots;
    /* served (under the shard's lock): requests, rows, and the time a
     * request took in the shard, from its decoding to its answer */
    uint64_t fetches, pushes, rows_fetched, rows_pushed;
    struct bex__rpc_hist lat[2]; /* Fetch, Push */
};

struct reg {
    struct bex_ps_shard *s;
    bex_ctx *ctx;
    uint32_t method;
};

struct bex_ps_shard {
    uint32_t shard, n_shards;
    struct reg regs[2]; /* the handlers' user pointers */
    struct table *tables;
    size_t n_tables;
    pthread_mutex_t mu;
    struct bex__log log;
    bex_ps_shard_stats st;
};

/* ---- hashing ---- */

uint64_t bex__ps_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

float bex_ps_init_value(uint32_t table, uint64_t key, uint32_t col, float s)
{
    uint64_t h = bex__ps_mix(bex__ps_mix(((uint64_t)table << 32) | col) ^ key);
    /* the top 24 bits: exact in a float */
    float u = (float)(h >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
    return (2.0f * u - 1.0f) * s;
}

uint32_t bex_ps_key_shard(uint64_t key, uint32_t n_shards)
{
    if (n_shards <= 1)
        return 0;
    return (uint32_t)(bex__ps_mix(key) % n_shards);
}

/* ---- tables ---- */

static void table_defaults(bex_ps_table_config *c)
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

static struct table *find_table(bex_ps_shard *s, uint32_t id)
{
    for (size_t i = 0; i < s->n_tables; i++)
        if (s->tables[i].cfg.id == id)
            return &s->tables[i];
    return NULL;
}

/* A key's first hash slot: another hash than the shard's (bex_ps_key_shard
 * uses bex__ps_mix(key) mod n_shards, so its low bits are the same for
 * every key of a shard with a power-of-two count). */
static uint32_t slot_of(uint64_t key, uint32_t mask)
{
    return (uint32_t)bex__ps_mix(key ^ 0xd6e8feb86659fd93ull) & mask;
}

/* The row of key, or UINT32_MAX. */
static uint32_t row_find(const struct table *t, uint64_t key)
{
    if (!t->n_slots)
        return UINT32_MAX;
    uint32_t mask = t->n_slots - 1;
    for (uint32_t i = slot_of(key, mask);; i = (i + 1) & mask) {
        uint32_t r = t->slots[i];
        if (!r)
            return UINT32_MAX;
        if (t->keys[r - 1] == key)
            return r - 1;
    }
}

static void slot_put(uint32_t *slots, uint32_t n_slots, uint64_t key, uint32_t row)
{
    uint32_t mask = n_slots - 1;
    uint32_t i = slot_of(key, mask);
    while (slots[i])
        i = (i + 1) & mask;
    slots[i] = row + 1;
}

/* Room for extra more rows (the load factor stays <= 1/2). */
static int table_reserve(struct table *t, uint32_t extra)
{
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
        t->cap_rows = (uint32_t)cap;
    }
    if (want * 2 > t->n_slots) {
        uint64_t n = t->n_slots ? t->n_slots : 128;
        while (n < want * 2)
            n *= 2;
        uint32_t *sl = calloc(n, sizeof *sl);
        if (!sl)
            return -ENOMEM;
        for (uint32_t r = 0; r < t->n_rows; r++)
            slot_put(sl, (uint32_t)n, t->keys[r], r);
        free(t->slots);
        t->slots = sl;
        t->n_slots = (uint32_t)n;
    }
    return 0;
}

/* The row of key, created with its initial values when new; room must
 * have been reserved. */
static float *row_get(struct table *t, uint64_t key)
{
    uint32_t r = row_find(t, key);
    if (r == UINT32_MAX) {
        r = t->n_rows++;
        t->keys[r] = key;
        float *v = t->vals + (size_t)r * t->width;
        for (uint32_t c = 0; c < t->cfg.dim; c++)
            v[c] = bex_ps_init_value(t->cfg.id, key, c, t->cfg.init_scale);
        if (t->cfg.optimizer == BEX_PS_ADAGRAD)
            for (uint32_t c = 0; c < t->cfg.dim; c++)
                v[t->cfg.dim + c] = t->cfg.adagrad_init;
        slot_put(t->slots, t->n_slots, key, r);
    }
    return t->vals + (size_t)r * t->width;
}

/* Keys among keys[0..n) without a row yet (duplicates counted: an upper
 * bound, enough to reserve). */
static uint32_t missing_rows(const struct table *t, const uint64_t *keys, uint32_t n)
{
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        if (row_find(t, keys[i]) == UINT32_MAX)
            m++;
    return m;
}

static void apply(const struct table *t, float *v, const float *g)
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

/* ---- snapshots ---- */

/* "BEXPSNAP", u32 version, shard, n_shards, n_tables; per table u32 id,
 * dim, optimizer, n_rows, then n_rows x (u64 key, width floats); then the
 * BLAKE2b-256 (crypto_generichash) of everything before it. */
static const char snap_magic[8] = {'B', 'E', 'X', 'P', 'S', 'N', 'A', 'P'};
#define SNAP_VERSION 1
#define SNAP_HASH    crypto_generichash_BYTES

struct wr {
    FILE *f;
    crypto_generichash_state h;
    int err;
};

static void wr_bytes(struct wr *w, const void *p, size_t n)
{
    if (w->err)
        return;
    crypto_generichash_update(&w->h, p, n);
    if (fwrite(p, 1, n, w->f) != n)
        w->err = -EIO;
}

static void wr32(struct wr *w, uint32_t v)
{
    uint8_t b[4];
    bex__ps_put32(b, v);
    wr_bytes(w, b, 4);
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
    struct wr w = {.f = fopen(tmp, "wb")};
    if (!w.f) {
        int rc = -errno;
        free(tmp);
        return rc;
    }
    crypto_generichash_init(&w.h, NULL, 0, SNAP_HASH);
    pthread_mutex_lock(&s->mu);
    wr_bytes(&w, snap_magic, sizeof snap_magic);
    wr32(&w, SNAP_VERSION);
    wr32(&w, s->shard);
    wr32(&w, s->n_shards);
    wr32(&w, (uint32_t)s->n_tables);
    uint8_t row[8 + 8 * BEX_PS_DIM_MAX];
    for (size_t i = 0; i < s->n_tables; i++) {
        const struct table *t = &s->tables[i];
        wr32(&w, t->cfg.id);
        wr32(&w, t->cfg.dim);
        wr32(&w, t->cfg.optimizer);
        wr32(&w, t->n_rows);
        for (uint32_t r = 0; r < t->n_rows; r++) {
            bex__ps_put64(row, t->keys[r]);
            const float *v = t->vals + (size_t)r * t->width;
            for (uint32_t c = 0; c < t->width; c++)
                bex__ps_putf(row + 8 + 4 * (size_t)c, v[c]);
            wr_bytes(&w, row, 8 + 4 * (size_t)t->width);
        }
    }
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
    free(tmp);
    return w.err;
}

struct rd {
    const uint8_t *p;
    size_t left;
};

static int rd32(struct rd *r, uint32_t *v)
{
    if (r->left < 4)
        return -EINVAL;
    *v = bex__ps_get32(r->p);
    r->p += 4;
    r->left -= 4;
    return 0;
}

/* Load rows from the file at path into s (empty, tables configured). The
 * checksum is verified before anything is read; then every count is
 * checked against what is left. */
static int snapshot_load(bex_ps_shard *s, const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct stat st;
    int rc = 0;
    uint8_t *buf = NULL;
    if (fstat(fd, &st)) {
        rc = -errno;
        goto out;
    }
    if (!S_ISREG(st.st_mode) || st.st_size < (off_t)(sizeof snap_magic + 16 + SNAP_HASH)) {
        rc = -EINVAL;
        goto out;
    }
    size_t size = (size_t)st.st_size;
    buf = malloc(size);
    if (!buf) {
        rc = -ENOMEM;
        goto out;
    }
    for (size_t got = 0; got < size;) {
        ssize_t n = read(fd, buf + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            rc = n < 0 ? -errno : -EIO;
            goto out;
        }
        got += (size_t)n;
    }
    uint8_t sum[SNAP_HASH];
    crypto_generichash(sum, sizeof sum, buf, size - SNAP_HASH, NULL, 0);
    if (sodium_memcmp(sum, buf + size - SNAP_HASH, SNAP_HASH) != 0) {
        bex__log(&s->log, BEX_LOG_ERROR, "ps snapshot %s: checksum mismatch", path);
        rc = -EINVAL;
        goto out;
    }
    struct rd r = {.p = buf + sizeof snap_magic, .left = size - SNAP_HASH - sizeof snap_magic};
    uint32_t version, shard, n_shards, n_tables;
    if (memcmp(buf, snap_magic, sizeof snap_magic) || rd32(&r, &version) ||
        version != SNAP_VERSION || rd32(&r, &shard) || rd32(&r, &n_shards) || rd32(&r, &n_tables) ||
        shard != s->shard || n_shards != s->n_shards || n_tables != s->n_tables) {
        bex__log(&s->log, BEX_LOG_ERROR,
                 "ps snapshot %s: not of this shard (version, shard, shard count or tables)", path);
        rc = -EINVAL;
        goto out;
    }
    bool seen[BEX_PS_TABLES_MAX] = {false};
    for (uint32_t i = 0; i < n_tables; i++) {
        uint32_t id, dim, opt, n_rows;
        if (rd32(&r, &id) || rd32(&r, &dim) || rd32(&r, &opt) || rd32(&r, &n_rows)) {
            rc = -EINVAL;
            goto out;
        }
        struct table *t = find_table(s, id);
        if (!t || seen[t - s->tables] || t->cfg.dim != dim || t->cfg.optimizer != opt) {
            bex__log(&s->log, BEX_LOG_ERROR, "ps snapshot %s: table %u does not match the config",
                     path, id);
            rc = -EINVAL;
            goto out;
        }
        seen[t - s->tables] = true;
        size_t row_len = 8 + 4 * (size_t)t->width;
        if (n_rows > t->cfg.max_rows || r.left / row_len < n_rows) {
            rc = -EINVAL;
            goto out;
        }
        if ((rc = table_reserve(t, n_rows)))
            goto out;
        for (uint32_t k = 0; k < n_rows; k++, r.p += row_len, r.left -= row_len) {
            uint64_t key = bex__ps_get64(r.p);
            if (row_find(t, key) != UINT32_MAX) {
                rc = -EINVAL; /* a key twice */
                goto out;
            }
            float *v = row_get(t, key);
            for (uint32_t c = 0; c < t->width; c++)
                v[c] = bex__ps_getf(r.p + 8 + 4 * (size_t)c);
        }
    }
    if (r.left)
        rc = -EINVAL;
    else
        bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: snapshot %s loaded", s->shard, path);
out:
    free(buf);
    close(fd);
    return rc;
}

/* ---- shard ---- */

static void tables_free(struct table *ts, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(ts[i].keys);
        free(ts[i].vals);
        free(ts[i].slots);
    }
    free(ts);
}

int bex_ps_shard_create(const bex_ps_shard_config *cfg, bex_ps_shard **out)
{
    if (!cfg || !out || cfg->n_shards == 0 || cfg->shard >= cfg->n_shards || !cfg->tables ||
        cfg->n_tables == 0 || cfg->n_tables > BEX_PS_TABLES_MAX)
        return -EINVAL;
    for (size_t i = 0; i < cfg->n_tables; i++) {
        const bex_ps_table_config *t = &cfg->tables[i];
        if (t->dim == 0 || t->dim > BEX_PS_DIM_MAX ||
            (t->optimizer != BEX_PS_SGD && t->optimizer != BEX_PS_ADAGRAD) || !isfinite(t->lr) ||
            t->lr < 0 || !isfinite(t->init_scale) || t->init_scale < 0 ||
            !isfinite(t->adagrad_init) || t->adagrad_init < 0 || !isfinite(t->adagrad_eps) ||
            t->adagrad_eps < 0 || t->max_rows > BEX__PS_ROWS_MAX)
            return -EINVAL;
        for (size_t j = 0; j < i; j++)
            if (cfg->tables[j].id == t->id)
                return -EINVAL;
    }
    if (sodium_init() < 0)
        return -ENOMEM;
    bex_ps_shard *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    s->tables = calloc(cfg->n_tables, sizeof *s->tables);
    if (!s->tables) {
        free(s);
        return -ENOMEM;
    }
    s->n_tables = cfg->n_tables;
    s->shard = cfg->shard;
    s->n_shards = cfg->n_shards;
    for (size_t i = 0; i < cfg->n_tables; i++) {
        struct table *t = &s->tables[i];
        t->cfg = cfg->tables[i];
        table_defaults(&t->cfg);
        t->width = t->cfg.optimizer == BEX_PS_ADAGRAD ? 2 * t->cfg.dim : t->cfg.dim;
    }
    pthread_mutex_init(&s->mu, NULL);
    bex__log_init(&s->log, cfg->log_fn, cfg->log_arg, BEX_LOG_INFO);
    if (cfg->snapshot_path) {
        int rc = snapshot_load(s, cfg->snapshot_path);
        if (rc == -ENOENT) {
            bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: no snapshot at %s, starting empty",
                     s->shard, cfg->snapshot_path);
        } else if (rc) {
            bex__log(&s->log, BEX_LOG_ERROR, "ps shard %u: snapshot %s not loaded: %s", s->shard,
                     cfg->snapshot_path, bex_strerror(rc));
            bex_ps_shard_destroy(s);
            return rc;
        }
    }
    *out = s;
    return 0;
}

void bex_ps_shard_destroy(bex_ps_shard *s)
{
    if (!s)
        return;
    tables_free(s->tables, s->n_tables);
    pthread_mutex_destroy(&s->mu);
    bex__log_fini(&s->log);
    free(s);
}

void bex_ps_shard_stats_get(bex_ps_shard *s, bex_ps_shard_stats *out)
{
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    out->rows = 0;
    for (size_t i = 0; i < s->n_tables; i++)
        out->rows += s->tables[i].n_rows;
    pthread_mutex_unlock(&s->mu);
}

int bex_ps_shard_prometheus(bex_ps_shard *const *shards, size_t n, char *buf, size_t cap)
{
    if ((n && !shards) || (!buf && cap))
        return -EINVAL;
    for (size_t k = 0; k < n; k++)
        if (!shards[k])
            return -EINVAL;
    if (cap)
        buf[0] = 0;
    /* copies under each shard's lock (a table's histograms are some KB),
     * printed outside them */
    struct table **ts = calloc(n ? n : 1, sizeof *ts);
    uint64_t *malformed = calloc(n ? n : 1, sizeof *malformed);
    int rc = ts && malformed ? 0 : -ENOMEM;
    for (size_t k = 0; k < n && !rc; k++) {
        bex_ps_shard *s = shards[k];
        if (!(ts[k] = malloc(s->n_tables * sizeof *ts[k]))) {
            rc = -ENOMEM;
            break;
        }
        pthread_mutex_lock(&s->mu);
        memcpy(ts[k], s->tables, s->n_tables * sizeof *ts[k]);
        malformed[k] = s->st.malformed;
        pthread_mutex_unlock(&s->mu);
    }
    struct bex__prom o = {buf, cap, 0};
    static const struct {
        const char *metric, *help;
        size_t off;
    } ctrs[] = {
        {"bex_ps_fetches_total", "Fetches served", offsetof(struct table, fetches)},
        {"bex_ps_pushes_total", "Pushes applied", offsetof(struct table, pushes)},
        {"bex_ps_rows_fetched_total", "Rows returned by Fetches",
         offsetof(struct table, rows_fetched)},
        {"bex_ps_rows_pushed_total", "Rows updated by Pushes", offsetof(struct table, rows_pushed)},
    };
    /* a metric family's samples together, every shard's */
    for (size_t i = 0; i < sizeof ctrs / sizeof ctrs[0] && !rc; i++) {
        bex__prom_printf(&o, "# HELP %s %s.\n# TYPE %s counter\n", ctrs[i].metric, ctrs[i].help,
                         ctrs[i].metric);
        for (size_t k = 0; k < n; k++)
            for (size_t t = 0; t < shards[k]->n_tables; t++) {
                uint64_t v;
                memcpy(&v, (const char *)&ts[k][t] + ctrs[i].off, sizeof v);
                bex__prom_printf(&o, "%s{shard=\"%u\",table=\"%u\"} %llu\n", ctrs[i].metric,
                                 shards[k]->shard, ts[k][t].cfg.id, (unsigned long long)v);
            }
    }
    if (!rc) {
        bex__prom_printf(&o, "# HELP bex_ps_rows Rows held.\n# TYPE bex_ps_rows gauge\n");
        for (size_t k = 0; k < n; k++)
            for (size_t t = 0; t < shards[k]->n_tables; t++)
                bex__prom_printf(&o, "bex_ps_rows{shard=\"%u\",table=\"%u\"} %u\n",
                                 shards[k]->shard, ts[k][t].cfg.id, ts[k][t].n_rows);
        bex__prom_printf(&o, "# HELP bex_ps_malformed_total Request bodies refused.\n"
                             "# TYPE bex_ps_malformed_total counter\n");
        for (size_t k = 0; k < n; k++)
            bex__prom_printf(&o, "bex_ps_malformed_total{shard=\"%u\"} %llu\n", shards[k]->shard,
                             (unsigned long long)malformed[k]);
        bex__prom_printf(&o, "# HELP bex_ps_serve_seconds Time a request took in the shard, "
                             "decoding to answer.\n# TYPE bex_ps_serve_seconds histogram\n");
        for (size_t k = 0; k < n; k++)
            for (size_t t = 0; t < shards[k]->n_tables; t++)
                for (int m = 0; m < 2; m++) {
                    char lb[96];
                    snprintf(lb, sizeof lb, "shard=\"%u\",table=\"%u\",method=\"%s\"",
                             shards[k]->shard, ts[k][t].cfg.id, m ? "push" : "fetch");
                    bex__prom_hist(&o, "bex_ps_serve_seconds", lb, &ts[k][t].lat[m]);
                }
    }
    for (size_t k = 0; ts && k < n; k++)
        free(ts[k]);
    free(ts);
    free(malformed);
    if (rc) {
        if (cap)
            buf[0] = 0;
        return rc;
    }
    return o.n > INT32_MAX ? INT32_MAX : (int)o.n;
}

/* ---- requests ---- */

/* The n keys at p into keys; each must be this shard's (a client with
 * another shard count would otherwise create rows no one fetches). */
static int read_keys(const bex_ps_shard *s, const uint8_t *p, uint32_t n, uint64_t *keys)
{
    for (uint32_t i = 0; i < n; i++) {
        keys[i] = bex__ps_get64(p + 8 * (size_t)i);
        if (bex_ps_key_shard(keys[i], s->n_shards) != s->shard)
            return -EINVAL;
    }
    return 0;
}

static int serve_fetch(bex_ps_shard *s, bex_ctx *ctx, const struct bex__ps_hdr *h, const uint8_t *p,
                       void **resp, size_t *resp_len)
{
    struct table *t = find_table(s, h->table);
    if (!t || t->cfg.dim != h->dim)
        return -EINVAL;
    size_t out_len = BEX__PS_HDR_LEN + (size_t)h->n * h->dim * 4;
    uint8_t *out = bex_rpc_alloc(ctx, out_len);
    if (!out)
        return -ENOMEM;
    uint64_t *keys = malloc((h->n ? h->n : 1) * sizeof *keys);
    if (!keys) {
        bex_rpc_free(out);
        return -ENOMEM;
    }
    int rc = read_keys(s, p, h->n, keys);
    if (rc) {
        free(keys);
        bex_rpc_free(out);
        return rc;
    }
    pthread_mutex_lock(&s->mu);
    rc = table_reserve(t, missing_rows(t, keys, h->n));
    if (rc == 0) {
        uint8_t *q = out + BEX__PS_HDR_LEN;
        for (uint32_t i = 0; i < h->n; i++) {
            const float *v = row_get(t, keys[i]);
            for (uint32_t c = 0; c < h->dim; c++, q += 4)
                bex__ps_putf(q, v[c]);
        }
        s->st.fetches++;
        s->st.rows_fetched += h->n;
        t->fetches++;
        t->rows_fetched += h->n;
    }
    pthread_mutex_unlock(&s->mu);
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

static int serve_push(bex_ps_shard *s, bex_ctx *ctx, const struct bex__ps_hdr *h, const uint8_t *p,
                      void **resp, size_t *resp_len)
{
    struct table *t = find_table(s, h->table);
    if (!t || t->cfg.dim != h->dim)
        return -EINVAL;
    size_t nf = (size_t)h->n * h->dim;
    uint64_t *keys = malloc((h->n ? h->n : 1) * sizeof *keys);
    float *g = malloc((nf ? nf : 1) * sizeof *g);
    uint8_t *out = bex_rpc_alloc(ctx, BEX__PS_HDR_LEN);
    int rc = 0;
    if (!keys || !g || !out) {
        rc = -ENOMEM;
        goto done;
    }
    if ((rc = read_keys(s, p, h->n, keys)))
        goto done;
    const uint8_t *gp = p + 8 * (size_t)h->n;
    for (size_t i = 0; i < nf; i++) {
        g[i] = bex__ps_getf(gp + 4 * i);
        if (!isfinite(g[i])) {
            rc = -EINVAL; /* one bad value refuses the whole Push */
            goto done;
        }
    }
    pthread_mutex_lock(&s->mu);
    rc = table_reserve(t, missing_rows(t, keys, h->n));
    if (rc == 0) {
        for (uint32_t i = 0; i < h->n; i++)
            apply(t, row_get(t, keys[i]), g + (size_t)i * h->dim);
        s->st.pushes++;
        s->st.rows_pushed += h->n;
        t->pushes++;
        t->rows_pushed += h->n;
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

int bex_ps_shard_serve(bex_ps_shard *s, bex_ctx *ctx, uint32_t method, const void *body, size_t len,
                       void **resp, size_t *resp_len)
{
    if (method != BEX_PS_M_FETCH && method != BEX_PS_M_PUSH)
        return -ENOSYS;
    struct bex__ps_hdr h;
    uint64_t t0 = bex__rpc_now_ns();
    int rc = bex__ps_decode(method, body, len, &h);
    if (rc == 0) {
        const uint8_t *p = (const uint8_t *)body + BEX__PS_HDR_LEN;
        rc = method == BEX_PS_M_FETCH ? serve_fetch(s, ctx, &h, p, resp, resp_len)
                                      : serve_push(s, ctx, &h, p, resp, resp_len);
    }
    if (rc == 0) {
        /* the table exists: the request was served */
        uint64_t ns = bex__rpc_now_ns() - t0;
        pthread_mutex_lock(&s->mu);
        bex__rpc_hist_add(&find_table(s, h.table)->lat[method == BEX_PS_M_PUSH], ns);
        pthread_mutex_unlock(&s->mu);
    }
    if (rc == -EINVAL || rc == -E2BIG) {
        pthread_mutex_lock(&s->mu);
        s->st.malformed++;
        pthread_mutex_unlock(&s->mu);
        /* rate-limited by the logger: a peer can send many */
        bex__log(&s->log, BEX_LOG_WARN, "ps shard %u: %s body of %zu bytes refused: %s", s->shard,
                 method == BEX_PS_M_FETCH ? "Fetch" : "Push", len, bex_strerror(rc));
    }
    return rc;
}

static void handler(bex_rpc_req *req, void *body, size_t len, void *user)
{
    struct reg *r = user;
    void *resp = NULL;
    size_t rlen = 0;
    int rc = bex_ps_shard_serve(r->s, r->ctx, r->method, body, len, &resp, &rlen);
    bex_rpc_free(body);
    bex_rpc_reply(req, rc, resp, rlen);
}

int bex_ps_shard_register(bex_ps_shard *s, bex_rpc_server *srv, bex_ctx *ctx)
{
    if (!s || !srv || !ctx)
        return -EINVAL;
    struct reg *regs = s->regs;
    regs[0] = (struct reg){s, ctx, BEX_PS_M_FETCH};
    regs[1] = (struct reg){s, ctx, BEX_PS_M_PUSH};
    for (int i = 0; i < 2; i++) {
        int rc = bex_rpc_server_register(srv, BEX_PS_SERVICE, regs[i].method,
                                         bex__ps_method_flags(regs[i].method), handler, &regs[i]);
        if (rc)
            return rc;
    }
    return 0;
}
