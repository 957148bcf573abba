/* The PS client: a request's keys split by shard, one sub-request per
 * shard on that shard's channel (directory mode: the directory picks the
 * replica), all out at once; the request completes when the last
 * sub-request does. Each sub-request carries the request's deadline, so
 * the request completes by then too. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "bex/ps.h"
#include "ps/ps_internal.h"

#define MAX_SHARDS 4096u

struct bex_ps_client {
    bex_ctx *ctx;
    uint32_t n_shards;
    uint32_t timeout_ms;
    bex_rpc_channel **ch;
};

struct op;
struct sub {
    struct op *op;
    uint32_t n;
    uint32_t *pos; /* the keys' places in the caller's arrays */
};

struct op {
    _Atomic uint32_t left; /* sub-requests not complete, + 1 while issuing */
    _Atomic int status;
    uint32_t method, table, dim;
    float *rows; /* Fetch: the caller's */
    bex_ps_done_fn done;
    void *user;
    struct sub *subs; /* n_shards, in the same block */
};

int bex_ps_client_create(bex_ctx *ctx, const bex_ps_client_config *cfg, bex_ps_client **out)
{
    if (!ctx || !cfg || !cfg->dir || !out)
        return -EINVAL;
    const char *svc = cfg->service ? cfg->service : "ps";
    uint32_t n = cfg->n_shards;
    if (n == 0)
        while (n < MAX_SHARDS && bex_dir_replicas(cfg->dir, svc, n, NULL, 0) > 0)
            n++;
    if (n == 0 || n > MAX_SHARDS)
        return -EINVAL;
    bex_ps_client *c = calloc(1, sizeof *c);
    if (!c)
        return -ENOMEM;
    c->ch = calloc(n, sizeof *c->ch);
    if (!c->ch) {
        free(c);
        return -ENOMEM;
    }
    c->ctx = ctx;
    c->timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : 1000;
    for (uint32_t i = 0; i < n; i++) {
        bex_rpc_channel_config cc = {
            .dir = cfg->dir,
            .service = svc,
            .shard = i,
            .locality = cfg->locality,
            .name = "ps",
            .request_timeout_ms = c->timeout_ms,
            .attempt_timeout_ms = cfg->attempt_timeout_ms,
            .connect_timeout_ms = cfg->connect_timeout_ms ? cfg->connect_timeout_ms : 1000,
        };
        int rc = bex_rpc_channel_create(ctx, &cc, &c->ch[i]);
        if (rc) {
            c->n_shards = i;
            bex_ps_client_destroy(c);
            return rc;
        }
    }
    c->n_shards = n;
    *out = c;
    return 0;
}

void bex_ps_client_destroy(bex_ps_client *c)
{
    if (!c)
        return;
    for (uint32_t i = 0; i < c->n_shards; i++)
        bex_rpc_channel_destroy(c->ch[i]);
    free(c->ch);
    free(c);
}

static void op_put(struct op *op)
{
    if (atomic_fetch_sub(&op->left, 1) != 1)
        return;
    op->done(atomic_load(&op->status), op->user);
    free(op);
}

static void op_fail(struct op *op, int status)
{
    int zero = 0;
    atomic_compare_exchange_strong(&op->status, &zero, status);
}

static void sub_done(int status, void *body, size_t len, void *user)
{
    struct sub *sb = user;
    struct op *op = sb->op;
    if (status == 0)
        status = bex__ps_check_resp(op->method, body, len, op->table, sb->n, op->dim);
    if (status == 0 && op->method == BEX_PS_M_FETCH) {
        const uint8_t *p = (const uint8_t *)body + BEX__PS_HDR_LEN;
        for (uint32_t i = 0; i < sb->n; i++) {
            float *row = op->rows + (size_t)sb->pos[i] * op->dim;
            for (uint32_t d = 0; d < op->dim; d++, p += 4)
                row[d] = bex__ps_getf(p);
        }
    }
    if (status)
        op_fail(op, status);
    bex_rpc_free(body);
    op_put(op);
}

static int request(bex_ps_client *c, uint32_t method, uint32_t table, uint32_t dim,
                   const uint64_t *keys, size_t n, float *rows, const float *grads,
                   bex_ps_done_fn done, void *user)
{
    if (!c || !done || dim == 0 || dim > BEX_PS_DIM_MAX || (n && !keys) || n > BEX_PS_KEYS_MAX ||
        (n && method == BEX_PS_M_FETCH && !rows) || (n && method == BEX_PS_M_PUSH && !grads))
        return -EINVAL;
    size_t ns = c->n_shards;
    struct op *op = calloc(1, sizeof *op + ns * sizeof(struct sub) + (n ? n : 1) * 4);
    if (!op)
        return -ENOMEM;
    *op = (struct op){.method = method,
                      .table = table,
                      .dim = dim,
                      .rows = rows,
                      .done = done,
                      .user = user,
                      .subs = (struct sub *)(op + 1)};
    uint32_t *pos = (uint32_t *)(op->subs + ns);
    for (size_t i = 0; i < n; i++)
        op->subs[bex_ps_key_shard(keys[i], c->n_shards)].n++;
    uint32_t at = 0, issue = 0;
    for (size_t s = 0; s < ns; s++) {
        struct sub *sb = &op->subs[s];
        sb->op = op;
        sb->pos = pos + at;
        at += sb->n;
        if (sb->n)
            issue++;
        if (bex__ps_req_len(method, sb->n, dim) > BEX_PS_BODY_MAX ||
            (size_t)BEX__PS_HDR_LEN + 4 * (size_t)sb->n * dim > BEX_PS_BODY_MAX) {
            free(op);
            return -E2BIG;
        }
        sb->n = 0; /* counted again below as the places are filled */
    }
    for (size_t i = 0; i < n; i++) {
        struct sub *sb = &op->subs[bex_ps_key_shard(keys[i], c->n_shards)];
        sb->pos[sb->n++] = (uint32_t)i;
    }
    atomic_store(&op->left, issue + 1);
    bex_rpc_call_opts opts = {.timeout_ms = c->timeout_ms};
    for (size_t s = 0; s < ns; s++) {
        struct sub *sb = &op->subs[s];
        if (!sb->n)
            continue;
        size_t len = bex__ps_req_len(method, sb->n, dim);
        uint8_t *b = bex_rpc_alloc(c->ctx, len);
        if (!b) {
            op_fail(op, -ENOMEM);
            op_put(op);
            continue;
        }
        bex__ps_hdr_put(b, &(struct bex__ps_hdr){.table = table, .n = sb->n, .dim = dim});
        uint8_t *p = b + BEX__PS_HDR_LEN;
        for (uint32_t i = 0; i < sb->n; i++, p += 8)
            bex__ps_put64(p, keys[sb->pos[i]]);
        if (method == BEX_PS_M_PUSH)
            for (uint32_t i = 0; i < sb->n; i++) {
                const float *g = grads + (size_t)sb->pos[i] * dim;
                for (uint32_t d = 0; d < dim; d++, p += 4)
                    bex__ps_putf(p, g[d]);
            }
        int rc = bex_rpc_call(c->ch[s], BEX_PS_SERVICE, method, b, len, &opts, sub_done, sb, NULL);
        if (rc) {
            bex_rpc_free(b);
            op_fail(op, rc);
            op_put(op);
        }
    }
    op_put(op); /* the issuing guard: done may run here */
    return 0;
}

int bex_ps_fetch(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                 float *rows, bex_ps_done_fn done, void *user)
{
    return request(c, BEX_PS_M_FETCH, table, dim, keys, n, rows, NULL, done, user);
}

int bex_ps_push(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                const float *grads, bex_ps_done_fn done, void *user)
{
    return request(c, BEX_PS_M_PUSH, table, dim, keys, n, NULL, grads, done, user);
}

struct waitr {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    int status;
};

static void sync_done(int status, void *user)
{
    struct waitr *w = user;
    pthread_mutex_lock(&w->mu);
    w->status = status;
    w->done = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static int wait_for(struct waitr *w, int rc)
{
    pthread_mutex_lock(&w->mu);
    while (rc == 0 && !w->done)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    return rc ? rc : w->status;
}

int bex_ps_fetch_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                      size_t n, float *rows)
{
    struct waitr w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    return wait_for(&w, bex_ps_fetch(c, table, dim, keys, n, rows, sync_done, &w));
}

int bex_ps_push_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                     const float *grads)
{
    struct waitr w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    return wait_for(&w, bex_ps_push(c, table, dim, keys, n, grads, sync_done, &w));
}
