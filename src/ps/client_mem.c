/* SPDX-License-Identifier: Apache-2.0 */
/* The PS client's calls on caller memory (bex_ps_fetch_into,
 * bex_ps_push_from): arrays of bex_ps_rows_alloc, laid out as a Push body
 * with its header room in front,
 *   [RPC header room][PS header][Push id][n keys][n * dim floats]
 * so that a Push is sent from the array itself, and a Fetch's answer (RPC
 * header, PS header, rows) lands with its rows on the array's rows. The
 * arrays are found by their rows' address in a process-wide table (the
 * table, not the array, holds what is known about them: a peer may write
 * the array). The wire is little-endian: on another host every call takes
 * the copying way. */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "bex/ps.h"
#include "bex/sock.h"
#include "common/hash.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"
#include "sock/ctx_access.h"

#define ROOM (BEX_RPC_HDR_LEN + BEX__PS_HDR_LEN + BEX__PS_ID_LEN)

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define WIRE_NATIVE 1
#else
#define WIRE_NATIVE 0
#endif

struct ubuf {
    bex_ctx *ctx;
    uint8_t *base;
    size_t bytes;
    uint32_t n, dim;
    bool busy, freeing;
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t reg_cv = PTHREAD_COND_INITIALIZER;
static struct bex__hmap reg;
static bool reg_init;

static float *rows_of(const struct ubuf *u)
{
    return (float *)(void *)(u->base + ROOM + 8 * (size_t)u->n);
}

static uint64_t *keys_of(const struct ubuf *u)
{
    return (uint64_t *)(void *)(u->base + ROOM);
}

float *bex_ps_rows_alloc(bex_ctx *ctx, uint32_t n, uint32_t dim)
{
    if (!ctx || n == 0 || n > BEX_PS_KEYS_MAX || dim == 0 || dim > BEX_PS_DIM_MAX) {
        errno = EINVAL;
        return NULL;
    }
    struct ubuf *u = calloc(1, sizeof *u);
    if (!u) {
        errno = ENOMEM;
        return NULL;
    }
    *u = (struct ubuf){.ctx = ctx, .n = n, .dim = dim};
    u->bytes = ROOM + 8 * (size_t)n + 4 * (size_t)n * dim;
    u->base = bex__ctx_user_alloc(ctx, u->bytes);
    int err = u->base ? 0 : errno;
    pthread_mutex_lock(&reg_mu);
    if (!err && !reg_init)
        err = bex__hmap_init(&reg, 16) ? ENOMEM : 0;
    reg_init = reg_init || !err;
    if (!err && bex__hmap_put(&reg, (uintptr_t)rows_of(u), u))
        err = ENOMEM;
    pthread_mutex_unlock(&reg_mu);
    if (err) {
        bex__ctx_user_free(ctx, u->base, u->bytes);
        free(u);
        errno = err;
        return NULL;
    }
    return rows_of(u);
}

/* The array of rows (under reg_mu), or NULL. */
static struct ubuf *find_locked(const float *rows)
{
    return reg_init && rows ? bex__hmap_get(&reg, (uintptr_t)rows) : NULL;
}

static void ubuf_free(struct ubuf *u)
{
    bex__ctx_user_free(u->ctx, u->base, u->bytes);
    free(u);
}

int bex_ps_rows_free(float *rows)
{
    pthread_mutex_lock(&reg_mu);
    struct ubuf *u = find_locked(rows);
    bool now = u && !u->busy;
    if (u && now)
        bex__hmap_del(&reg, (uintptr_t)rows);
    else if (u)
        u->freeing = true; /* freed when its call lets it go */
    pthread_mutex_unlock(&reg_mu);
    if (now)
        ubuf_free(u);
    return u ? 0 : -EINVAL;
}

uint64_t *bex_ps_rows_keys(float *rows)
{
    pthread_mutex_lock(&reg_mu);
    struct ubuf *u = find_locked(rows);
    pthread_mutex_unlock(&reg_mu);
    return u ? keys_of(u) : NULL;
}

int bex_ps_rows_busy(float *rows)
{
    pthread_mutex_lock(&reg_mu);
    struct ubuf *u = find_locked(rows);
    int rc = u ? u->busy : -EINVAL;
    pthread_mutex_unlock(&reg_mu);
    return rc;
}

/* A call no longer uses u (reg_mu not held). */
static void ubuf_release(void *arg)
{
    struct ubuf *u = arg;
    pthread_mutex_lock(&reg_mu);
    u->busy = false;
    bool gone = u->freeing;
    if (gone)
        bex__hmap_del(&reg, (uintptr_t)rows_of(u));
    pthread_cond_broadcast(&reg_cv);
    pthread_mutex_unlock(&reg_mu);
    if (gone)
        ubuf_free(u);
}

/* Claim the array of rows for a call of n rows of dim on ctx: 0, or
 * -EINVAL, -ENOBUFS, -EBUSY. */
static int claim(const float *rows, bex_ctx *ctx, size_t n, uint32_t dim, struct ubuf **out)
{
    pthread_mutex_lock(&reg_mu);
    struct ubuf *u = find_locked(rows);
    int rc = 0;
    if (!u || u->ctx != ctx || u->freeing)
        rc = -EINVAL;
    else if (n > u->n || n * dim > (size_t)u->n * u->dim)
        rc = -ENOBUFS;
    else if (u->busy)
        rc = -EBUSY;
    else
        u->busy = true;
    pthread_mutex_unlock(&reg_mu);
    *out = u;
    return rc;
}

/* The one shard every key belongs to, or -1. */
static long one_shard(const bex_ps_client *c, const uint64_t *keys, size_t n)
{
    uint32_t ns = bex__ps_client_shards(c);
    uint32_t s = bex_ps_key_shard(keys[0], ns);
    for (size_t i = 1; i < n; i++)
        if (bex_ps_key_shard(keys[i], ns) != s)
            return -1;
    return s;
}

static int check_args(bex_ps_client *c, uint32_t dim, const uint64_t *keys, size_t n,
                      const float *rows, bex_ps_done_fn done)
{
    if (!c || !done || !rows || dim == 0 || dim > BEX_PS_DIM_MAX || (n && !keys) ||
        n > BEX_PS_KEYS_MAX)
        return -EINVAL;
    return 0;
}

struct zop {
    struct ubuf *u;
    uint32_t table, n, dim, method;
    bex_ps_done_fn done;
    void *user;
    bex_ps_replica_result *res; /* Push: the caller's, one entry (or NULL) */
};

static void fetch_done(int status, void *body, size_t len, void *user)
{
    struct zop *op = user;
    /* body is the array's (rows - header): checked, never freed */
    if (status == 0)
        status = bex__ps_check_resp(BEX_PS_M_FETCH, body, len, op->table, op->n, op->dim);
    ubuf_release(op->u); /* call_into: done runs once the array is retired */
    op->done(status, op->user);
    free(op);
}

/* TCP only (the context has no RDMA device): the answer arrives in a
 * receive buffer either way (bex_rpc_call_into would copy it from there,
 * after opening a socket of its own per call): one copy of the rows, in
 * order, no decode. */
static void fetch_done_copy(int status, void *body, size_t len, void *user)
{
    struct zop *op = user;
    if (status == 0)
        status = bex__ps_check_resp(BEX_PS_M_FETCH, body, len, op->table, op->n, op->dim);
    if (status == 0)
        memcpy(rows_of(op->u), (uint8_t *)body + BEX__PS_HDR_LEN, 4 * (size_t)op->n * op->dim);
    bex_rpc_free(body);
    ubuf_release(op->u);
    op->done(status, op->user);
    free(op);
}

/* Fetch's sub-request from the array (claimed): 0 or an error (released). */
static int fetch_send(bex_ps_client *c, struct zop *op, uint32_t shard, const uint64_t *keys)
{
    bex_ctx *ctx = bex__ps_client_ctx(c);
    size_t len = bex__ps_req_len(BEX_PS_M_FETCH, op->n, op->dim);
    uint8_t *b = bex_rpc_alloc(ctx, len);
    if (!b)
        return -ENOMEM;
    struct bex__ps_hdr h = {.table = op->table, .n = op->n, .dim = op->dim};
    bex__ps_hdr_put(b, &h);
    memcpy(b + BEX__PS_HDR_LEN, keys, 8 * (size_t)op->n);
    uint8_t *dst = (uint8_t *)rows_of(op->u) - BEX__PS_HDR_LEN;
    size_t cap = BEX__PS_HDR_LEN + 4 * (size_t)op->n * op->dim;
    bex_rpc_call_opts o = {.timeout_ms = bex__ps_client_timeout(c)};
    bex_rpc_channel *ch = bex__ps_client_fetch_ch(c, shard);
    int rc = bex_ctx_pd(ctx) ? bex__rpc_call_ext(ch, BEX_PS_SERVICE, BEX_PS_M_FETCH, b, len, dst,
                                                 cap, &o, fetch_done, op, NULL)
                             : bex_rpc_call(ch, BEX_PS_SERVICE, BEX_PS_M_FETCH, b, len, &o,
                                            fetch_done_copy, op, NULL);
    if (rc)
        bex_rpc_free(b);
    return rc;
}

int bex_ps_fetch_into(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                      size_t n, float *rows, bex_ps_done_fn done, void *user)
{
    int rc = check_args(c, dim, keys, n, rows, done);
    struct ubuf *u = NULL;
    if (rc || (rc = claim(rows, bex__ps_client_ctx(c), n, dim, &u)))
        return rc;
    long s = n ? one_shard(c, keys, n) : -1;
    /* the copying way (which also refuses a request or answer past the
     * wire's bounds) */
    if (s < 0 || !WIRE_NATIVE ||
        bex__ps_req_len(BEX_PS_M_FETCH, (uint32_t)n, dim) > BEX_PS_BODY_MAX ||
        BEX__PS_HDR_LEN + 4 * n * (size_t)dim > BEX_PS_BODY_MAX) {
        ubuf_release(u);
        return bex_ps_fetch(c, table, dim, keys, n, rows, done, user);
    }
    struct zop *op = malloc(sizeof *op);
    if (!op) {
        ubuf_release(u);
        return -ENOMEM;
    }
    *op = (struct zop){
        .u = u, .table = table, .n = (uint32_t)n, .dim = dim, .done = done, .user = user};
    rc = fetch_send(c, op, (uint32_t)s, keys);
    if (rc) {
        ubuf_release(u);
        free(op);
    }
    return rc;
}

static void push_done(int status, void *body, size_t len, void *user)
{
    struct zop *op = user;
    if (status == 0)
        status = bex__ps_check_resp(BEX_PS_M_PUSH, body, len, op->table, op->n, op->dim);
    bex_rpc_free(body);
    if (op->res)
        op->res->status = status;
    op->done(status, op->user);
    free(op);
}

/* Push from the array (claimed) to its shard's one replica: 0, -ENOENT (not
 * one replica: the copying way), or an error. */
static int push_send(bex_ps_client *c, struct zop *op, uint32_t shard, const uint64_t *keys)
{
    struct bex__ps_hdr h = {.table = op->table, .n = op->n, .dim = op->dim};
    bex_rpc_channel *ch;
    bex_addr addr;
    int rc = bex__ps_client_push_one(c, shard, &ch, &addr, &h);
    if (rc)
        return rc;
    uint64_t *slots = keys_of(op->u);
    if (keys != slots)
        memcpy(slots, keys, 8 * (size_t)op->n);
    uint8_t *body = op->u->base + BEX_RPC_HDR_LEN;
    bex__ps_hdr_put(body, &h);
    size_t len = BEX__PS_HDR_LEN + BEX__PS_ID_LEN + 8 * (size_t)op->n + 4 * (size_t)op->n * op->dim;
    if (op->res)
        *op->res = (bex_ps_replica_result){.shard = shard, .addr = addr, .status = -EINPROGRESS};
    bex_rpc_call_opts o = {.timeout_ms = bex__ps_client_timeout(c)};
    struct bex__rpc_borrow bw = {.release = ubuf_release, .arg = op->u};
    return bex__rpc_call_ext(ch, BEX_PS_SERVICE, BEX_PS_M_PUSH, body, len, NULL, 0, &o, push_done,
                             op, &bw);
}

int bex_ps_push_from(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                     float *grads, bex_ps_replica_result *res, size_t cap, size_t *n_res,
                     bex_ps_done_fn done, void *user)
{
    int rc = check_args(c, dim, keys, n, grads, done);
    struct ubuf *u = NULL;
    if (rc || (cap && !res) || (rc = claim(grads, bex__ps_client_ctx(c), n, dim, &u)))
        return rc ? rc : -EINVAL;
    long s = n ? one_shard(c, keys, n) : -1;
    /* without a copy: the whole array (its keys right in front of its rows) */
    bool zero = s >= 0 && WIRE_NATIVE && n == u->n && dim == u->dim &&
                ROOM - BEX_RPC_HDR_LEN + 8 * n + 4 * n * (size_t)dim <= BEX_PS_BODY_MAX;
    struct zop *op = zero ? malloc(sizeof *op) : NULL;
    if (op) {
        *op = (struct zop){.u = u,
                           .table = table,
                           .n = (uint32_t)n,
                           .dim = dim,
                           .done = done,
                           .user = user,
                           .res = cap ? res : NULL};
        rc = push_send(c, op, (uint32_t)s, keys);
        if (rc == 0 && n_res)
            *n_res = 1;
        if (rc == 0)
            return 0; /* the call releases the array */
        free(op);
        if (rc != -ENOENT) {
            ubuf_release(u);
            return rc;
        }
    } else if (zero) {
        ubuf_release(u);
        return -ENOMEM;
    }
    ubuf_release(u);
    return bex_ps_push_report(c, table, dim, keys, n, grads, res, cap, n_res, done, user);
}

/* ---- waiting ---- */

struct zwait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    int status;
};

static void zwait_done(int status, void *user)
{
    struct zwait *w = user;
    pthread_mutex_lock(&w->mu);
    w->done = true;
    w->status = status;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static int zwait(struct zwait *w, int rc, float *rows)
{
    if (rc)
        return rc;
    pthread_mutex_lock(&w->mu);
    while (!w->done)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    pthread_mutex_lock(&reg_mu); /* until the transport lets the array go */
    struct ubuf *u;
    while ((u = find_locked(rows)) && u->busy)
        pthread_cond_wait(&reg_cv, &reg_mu);
    pthread_mutex_unlock(&reg_mu);
    return w->status;
}

int bex_ps_fetch_into_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                           size_t n, float *rows)
{
    struct zwait w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    return zwait(&w, bex_ps_fetch_into(c, table, dim, keys, n, rows, zwait_done, &w), rows);
}

int bex_ps_push_from_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                          size_t n, float *grads, bex_ps_replica_result *res, size_t cap,
                          size_t *n_res)
{
    struct zwait w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    return zwait(&w,
                 bex_ps_push_from(c, table, dim, keys, n, grads, res, cap, n_res, zwait_done, &w),
                 grads);
}
