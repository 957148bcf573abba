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
#include <stdatomic.h>
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
    _Atomic uint64_t zero; /* sub-requests without a copy */
    /* a Push from it: the transports reading it, + 1 while it starts; the
     * call whose done waits for its return (waited for), or NULL */
    _Atomic uint32_t lends;
    struct zcall *lent_z;
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

uint64_t bex_ps_rows_zero(float *rows)
{
    pthread_mutex_lock(&reg_mu);
    struct ubuf *u = find_locked(rows);
    uint64_t z = u ? atomic_load_explicit(&u->zero, memory_order_relaxed) : 0;
    pthread_mutex_unlock(&reg_mu);
    return z;
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

static int check_args(bex_ps_client *c, uint32_t dim, const uint64_t *keys, size_t n,
                      const float *rows, bex_ps_done_fn done)
{
    if (!c || !done || !rows || dim == 0 || dim > BEX_PS_DIM_MAX || (n && !keys) ||
        n > BEX_PS_KEYS_MAX)
        return -EINVAL;
    return 0;
}

/* ---- the keys by shard ---- */

/* One shard's keys, keys[a..b); a Fetch lands keys[a..e) in the array
 * (the rest, under the next part's headers, come by a copying call). */
struct run {
    uint32_t shard, a, b, e;
};

#define RUNS_ON_STACK 8
#define SEEN_ON_STACK 1024 /* shards */

struct runs {
    struct run *r;
    uint32_t n;
    struct run st[RUNS_ON_STACK];
};

static void runs_free(struct runs *rs)
{
    if (rs->r != rs->st)
        free(rs->r);
}

/* keys[0..n) by shard into rs: 0, -EINVAL (a shard's keys in two runs:
 * not grouped), -ENOMEM. */
static int runs_get(const bex_ps_client *c, const uint64_t *keys, size_t n, struct runs *rs)
{
    uint32_t ns = bex__ps_client_shards(c);
    rs->r = rs->st;
    rs->n = n ? 1 : 0;
    rs->st[0] = (struct run){.shard = 0, .a = 0, .b = (uint32_t)n};
    if (ns <= 1) /* one shard: no key to hash (a third of a 1024-key Push's instructions) */
        return 0;
    size_t most = n < ns ? n : ns;
    uint64_t seen_st[SEEN_ON_STACK / 64] = {0};
    uint64_t *seen = ns <= SEEN_ON_STACK ? seen_st : calloc((ns + 63) / 64, 8);
    rs->r = most <= RUNS_ON_STACK ? rs->st : malloc(most * sizeof *rs->r);
    rs->n = 0;
    int rc = seen && rs->r ? 0 : -ENOMEM;
    for (size_t i = 0; !rc && i < n; i++) {
        uint32_t s = bex_ps_key_shard(keys[i], ns);
        if (rs->n && rs->r[rs->n - 1].shard == s) {
            rs->r[rs->n - 1].b = (uint32_t)i + 1;
            continue;
        }
        if (seen[s / 64] & (1ull << (s % 64)))
            rc = -EINVAL;
        seen[s / 64] |= 1ull << (s % 64);
        rs->r[rs->n++] = (struct run){.shard = s, .a = (uint32_t)i, .b = (uint32_t)i + 1};
    }
    if (seen != seen_st)
        free(seen);
    if (rc && rs->r)
        runs_free(rs);
    return rc;
}

/* Where each run's part lands (e), when the answer's headers land in
 * front of its rows (an RDMA context): over the last rows of the run
 * before, which that run's part must then not land (they are fetched by a
 * copying call and put in place at the end). Returns how many rows that is. */
static uint32_t runs_plan(struct runs *rs, uint32_t dim, bool landing)
{
    uint32_t head = BEX_RPC_HDR_LEN + BEX__PS_HDR_LEN;
    uint32_t m = landing ? (head + 4 * dim - 1) / (4 * dim) : 0;
    uint32_t limit = rs->r[rs->n - 1].b, tails = 0;
    for (uint32_t j = rs->n; j-- > 0;) {
        struct run *r = &rs->r[j];
        r->e = r->b < limit ? r->b : limit;
        r->e = r->e > r->a ? r->e : r->a;
        tails += r->b - r->e;
        if (r->e > r->a)
            limit = r->a > m ? r->a - m : 0;
    }
    return tails;
}

/* Every landing part within the wire's bounds (else the copying way,
 * which refuses what is past them). */
static bool runs_fit(const struct runs *rs, uint32_t dim)
{
    for (uint32_t j = 0; j < rs->n; j++) {
        uint32_t k = rs->r[j].e - rs->r[j].a;
        if (bex__ps_req_len(BEX_PS_M_FETCH, k, dim) > BEX_PS_BODY_MAX ||
            BEX__PS_HDR_LEN + 4 * (size_t)k * dim > BEX_PS_BODY_MAX)
            return false;
    }
    return true;
}

/* ---- one call in parts ---- */

struct zcall;

struct zpart {
    struct zcall *z;
    uint32_t first, n;
    bex_ps_replica_result *res; /* Push: the caller's entry (or NULL) */
    uint32_t shard;             /* Fetch: its shard's, and its retry */
    struct bex__ps_retry rt;
    void *hold; /* Push: its channel's (bex__ps_client_push_one) */
};

/* A call on an array: its parts (one per shard, and the copying one), the
 * caller's done when the last ends. */
struct zcall {
    bex_ps_client *c;
    _Atomic uint32_t pending; /* parts in flight, +1 while starting */
    _Atomic int status;       /* the first error */
    struct ubuf *u;
    bool release; /* Fetch: the array is let go when the last part ends */
    uint32_t table, dim, n_tail;
    bex_ps_done_fn done;
    void *user;
    uint64_t *tail_keys; /* n_tail: the rows a copying call fetched... */
    float *tail_rows;
    uint32_t *tail_at; /* ...and their positions in the array */
    uint64_t *keys;    /* a Fetch's keys, kept to issue a part again (or NULL) */
    struct zpart part[];
};

/* A call of parts on u, with room for tails rows fetched by a copying
 * call and for n_keys keys kept. */
static struct zcall *zcall_new(struct ubuf *u, uint32_t parts, uint32_t tails, uint32_t n_keys,
                               uint32_t table, uint32_t dim, bex_ps_done_fn done, void *user)
{
    size_t head = sizeof(struct zcall) + parts * sizeof(struct zpart);
    head = (head + 7) & ~(size_t)7;
    size_t rows = 4 * (size_t)tails * dim;
    struct zcall *z =
        malloc(head + 8 * (size_t)n_keys + 8 * (size_t)tails + rows + 4 * (size_t)tails);
    if (!z)
        return NULL;
    *z = (struct zcall){
        .u = u, .table = table, .dim = dim, .n_tail = tails, .done = done, .user = user};
    uint8_t *p = (uint8_t *)z + head;
    z->keys = n_keys ? (uint64_t *)(void *)p : NULL;
    p += 8 * (size_t)n_keys;
    z->tail_keys = (uint64_t *)(void *)p;
    z->tail_rows = (float *)(void *)(p + 8 * (size_t)tails);
    z->tail_at = (uint32_t *)(void *)(p + 8 * (size_t)tails + rows);
    atomic_init(&z->pending, parts + 1);
    for (uint32_t i = 0; i < parts; i++)
        z->part[i] = (struct zpart){.z = z};
    return z;
}

/* A part of z ended (or was never sent) with status. */
static void part_end(struct zcall *z, int status)
{
    int none = 0;
    if (status)
        atomic_compare_exchange_strong(&z->status, &none, status);
    if (atomic_fetch_sub_explicit(&z->pending, 1, memory_order_acq_rel) != 1)
        return;
    int st = atomic_load(&z->status);
    float *rows = rows_of(z->u);
    for (uint32_t i = 0; st == 0 && i < z->n_tail; i++)
        memcpy(rows + (size_t)z->tail_at[i] * z->dim, z->tail_rows + (size_t)i * z->dim,
               4 * (size_t)z->dim);
    if (z->release)
        ubuf_release(z->u); /* done runs once the array is retired */
    z->done(st, z->user);
    free(z);
}

static void copy_part_done(int status, void *user)
{
    part_end(user, status);
}

/* Starting z ended after sent of its parts (the rest never sent, rc the
 * error that stopped it): 0 (z's done will run), or rc (nothing was sent,
 * z freed). */
static int zcall_started(struct zcall *z, uint32_t sent, uint32_t parts, int rc)
{
    atomic_fetch_sub_explicit(&z->pending, parts - sent, memory_order_acq_rel);
    if (rc && sent == 0) {
        if (z->release)
            ubuf_release(z->u);
        free(z);
        return rc;
    }
    part_end(z, rc);
    return 0;
}

/* ---- Fetch into the array ---- */

/* Fetch part p failed with status: issued again later as bex_ps_fetch's
 * parts are (its keys kept), else ended. */
static void fetch_failed(struct zpart *p, int status)
{
    struct zcall *z = p->z;
    if (!z->keys || !bex__ps_fetch_retry(z->c, &p->rt, p->shard, status))
        part_end(z, status);
}

static void fetch_done(int status, void *body, size_t len, void *user)
{
    struct zpart *p = user;
    struct zcall *z = p->z;
    /* body is the array's (rows - header): checked, never freed */
    if (status == 0)
        status = bex__ps_check_resp(BEX_PS_M_FETCH, body, len, z->table, p->n, z->dim);
    if (status)
        fetch_failed(p, status);
    else
        part_end(z, 0);
}

/* TCP only (the context has no RDMA device): the answer arrives in a
 * receive buffer either way (bex_rpc_call_into would copy it from there,
 * after opening a socket of its own per call): one copy of the rows, in
 * order, no decode. */
static void fetch_done_copy(int status, void *body, size_t len, void *user)
{
    struct zpart *p = user;
    struct zcall *z = p->z;
    if (status == 0)
        status = bex__ps_check_resp(BEX_PS_M_FETCH, body, len, z->table, p->n, z->dim);
    if (status == 0)
        memcpy(rows_of(z->u) + (size_t)p->first * z->dim, (uint8_t *)body + BEX__PS_HDR_LEN,
               4 * (size_t)p->n * z->dim);
    bex_rpc_free(body);
    if (status)
        fetch_failed(p, status);
    else
        part_end(z, 0);
}

/* Fetch's part p (its keys from keys) into its slice of the array, with
 * timeout_ms. On 0 p's call is out: p and its call may end at once. */
static int fetch_send(bex_ps_client *c, struct zpart *p, const uint64_t *keys, uint32_t timeout_ms)
{
    struct zcall *z = p->z;
    bex_ctx *ctx = bex__ps_client_ctx(c);
    size_t len = bex__ps_req_len(BEX_PS_M_FETCH, p->n, z->dim);
    uint8_t *b = bex_rpc_alloc(ctx, len);
    if (!b)
        return -ENOMEM;
    struct bex__ps_hdr h = {.table = z->table, .n = p->n, .dim = z->dim};
    bex__ps_hdr_put(b, &h);
    memcpy(b + BEX__PS_HDR_LEN, keys + p->first, 8 * (size_t)p->n);
    uint8_t *dst = (uint8_t *)(rows_of(z->u) + (size_t)p->first * z->dim) - BEX__PS_HDR_LEN;
    size_t cap = BEX__PS_HDR_LEN + 4 * (size_t)p->n * z->dim;
    bex_rpc_call_opts o = {.timeout_ms = timeout_ms};
    bex_rpc_channel *ch = bex__ps_client_fetch_ch(c, p->shard);
    int rc = bex_ctx_pd(ctx) ? bex__rpc_call_ext(ch, BEX_PS_SERVICE, BEX_PS_M_FETCH, b, len, dst,
                                                 cap, &o, fetch_done, p, NULL)
                             : bex_rpc_call(ch, BEX_PS_SERVICE, BEX_PS_M_FETCH, b, len, &o,
                                            fetch_done_copy, p, NULL);
    if (rc)
        bex_rpc_free(b); /* else p's call may have ended already: z, p gone */
    return rc;
}

/* Fetch part p's retry (bex__ps_fetch_retry): sent again from the keys
 * kept, within its deadline, or ended with status. */
static void fetch_retry(bex_ps_client *c, struct bex__ps_retry *rt, int status)
{
    struct zpart *p = bex__list_entry(rt, struct zpart, rt);
    if (status == 0 &&
        (status = fetch_send(c, p, p->z->keys, bex__ps_retry_left_ms(rt, bex__rpc_now_ns()))))
        fetch_failed(p, status);
    else if (status)
        part_end(p->z, status);
}

/* The copying part: the rows under the other parts' headers. */
static int fetch_tails(bex_ps_client *c, struct zcall *z, const struct runs *rs,
                       const uint64_t *keys)
{
    uint32_t t = 0;
    for (uint32_t j = 0; j < rs->n; j++)
        for (uint32_t i = rs->r[j].e; i < rs->r[j].b; i++) {
            z->tail_at[t] = i;
            z->tail_keys[t++] = keys[i];
        }
    return bex_ps_fetch(c, z->table, z->dim, z->tail_keys, t, z->tail_rows, copy_part_done, z);
}

/* Every part of a Fetch into the array (claimed: let go on an error). */
static int fetch_parts(bex_ps_client *c, struct ubuf *u, const struct runs *rs, uint32_t tails,
                       uint32_t table, uint32_t dim, const uint64_t *keys, bex_ps_done_fn done,
                       void *user)
{
    uint32_t parts = tails ? 1 : 0, sent = 0;
    for (uint32_t j = 0; j < rs->n; j++)
        parts += rs->r[j].e > rs->r[j].a;
    /* the keys kept for a part issued again, as bex_ps_fetch keeps its own */
    uint32_t n_keys = bex__ps_client_fetch_retries(c) ? rs->r[rs->n - 1].b : 0;
    struct zcall *z = zcall_new(u, parts, tails, n_keys, table, dim, done, user);
    if (!z) {
        ubuf_release(u);
        return -ENOMEM;
    }
    z->c = c;
    z->release = true;
    if (n_keys)
        memcpy(z->keys, keys, 8 * (size_t)n_keys);
    uint32_t timeout_ms = bex__ps_client_timeout(c);
    uint64_t end_ns = bex__rpc_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    int rc = tails ? fetch_tails(c, z, rs, keys) : 0;
    sent += tails && !rc;
    for (uint32_t j = 0; !rc && j < rs->n; j++) {
        const struct run *r = &rs->r[j];
        if (r->e == r->a)
            continue;
        struct zpart *p = &z->part[sent];
        *p = (struct zpart){.z = z,
                            .first = r->a,
                            .n = r->e - r->a,
                            .shard = r->shard,
                            .rt = {.end_ns = end_ns, .fn = fetch_retry}};
        rc = fetch_send(c, p, keys, timeout_ms);
        sent += !rc;
        if (!rc) /* z lives while starting (a retry's send counts no more) */
            atomic_fetch_add_explicit(&u->zero, 1, memory_order_relaxed);
    }
    return zcall_started(z, sent, parts, rc);
}

int bex_ps_fetch_into(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                      size_t n, float *rows, bex_ps_done_fn done, void *user)
{
    int rc = check_args(c, dim, keys, n, rows, done);
    struct ubuf *u = NULL;
    if (rc || (rc = claim(rows, bex__ps_client_ctx(c), n, dim, &u)))
        return rc;
    struct runs rs;
    if ((rc = runs_get(c, keys, n, &rs))) {
        ubuf_release(u);
        return rc;
    }
    bool landing = bex_ctx_pd(bex__ps_client_ctx(c)) != NULL;
    uint32_t tails = rs.n ? runs_plan(&rs, dim, landing) : 0;
    if (rs.n && WIRE_NATIVE && runs_fit(&rs, dim))
        rc = fetch_parts(c, u, &rs, tails, table, dim, keys, done, user);
    else { /* the copying way */
        ubuf_release(u);
        rc = bex_ps_fetch(c, table, dim, keys, n, rows, done, user);
    }
    runs_free(&rs);
    return rc;
}

/* ---- Push from the array ---- */

static void push_done(int status, void *body, size_t len, void *user)
{
    struct zpart *p = user;
    struct zcall *z = p->z;
    if (status == 0)
        status = bex__ps_check_resp(BEX_PS_M_PUSH, body, len, z->table, p->n, z->dim);
    bex_rpc_free(body);
    if (p->res)
        p->res->status = status;
    bex__ps_client_push_put(p->hold);
    part_end(z, status);
}

/* A transport let go of the array for one part of a Push (a borrow's
 * release, under its channel's lock: it only marks and wakes), or the
 * Push's start is over: the last one lets the array go and, for a Push
 * waited for, ends the part that stands for the array's return. */
static void lend_end(void *arg)
{
    struct ubuf *u = arg;
    if (atomic_fetch_sub_explicit(&u->lends, 1, memory_order_acq_rel) != 1)
        return;
    struct zcall *z = u->lent_z;
    ubuf_release(u);
    if (z)
        part_end(z, 0);
}

/* Part p's request through ch: body (len bytes, header room in front),
 * then tail (tail_len bytes of the array, 0: the body is the array's
 * own), both read by the transport until lend_end. */
static int lend_send(bex_ps_client *c, struct zpart *p, bex_rpc_channel *ch, void *body, size_t len,
                     void *tail, size_t tail_len)
{
    struct ubuf *u = p->z->u;
    bex_rpc_call_opts o = {.timeout_ms = bex__ps_client_timeout(c)};
    struct bex__rpc_borrow bw = {.release = lend_end, .arg = u, .tail = tail, .tail_len = tail_len};
    atomic_fetch_add_explicit(&u->lends, 1, memory_order_relaxed);
    int rc = bex__rpc_call_ext(ch, BEX_PS_SERVICE, BEX_PS_M_PUSH, body, len, NULL, 0, &o, push_done,
                               p, &bw);
    if (rc) /* the start's own count keeps it above 0 */
        atomic_fetch_sub_explicit(&u->lends, 1, memory_order_relaxed);
    else
        atomic_fetch_add_explicit(&u->zero, 1, memory_order_relaxed);
    return rc;
}

/* The first run's part, in place: its headers and keys written in front
 * of its rows, the array's first, and sent from there. Sent last: its
 * keys may move over the array's other key slots. */
static int push_in_place(bex_ps_client *c, struct zpart *p, bex_rpc_channel *ch,
                         const struct bex__ps_hdr *h, const uint64_t *keys)
{
    struct zcall *z = p->z;
    uint64_t *slots = (uint64_t *)(void *)rows_of(z->u) - p->n;
    if (keys != slots)
        memmove(slots, keys, 8 * (size_t)p->n); /* keys may be the array's own slots */
    uint8_t *body = (uint8_t *)slots - BEX__PS_ID_LEN - BEX__PS_HDR_LEN;
    bex__ps_hdr_put(body, h);
    size_t len = BEX__PS_HDR_LEN + BEX__PS_ID_LEN + 8 * (size_t)p->n + 4 * (size_t)p->n * z->dim;
    return lend_send(c, p, ch, body, len, NULL, 0);
}

/* Another run's part, gathered: its headers and keys in a buffer of their
 * own (the keys copied, 8 bytes a row), then its rows straight from the
 * array (bex_sock_sendv: writev over TCP, SGEs over RDMA). */
static int push_gathered(bex_ps_client *c, struct zpart *p, bex_rpc_channel *ch,
                         const struct bex__ps_hdr *h, const uint64_t *keys)
{
    struct zcall *z = p->z;
    size_t len = BEX__PS_HDR_LEN + BEX__PS_ID_LEN + 8 * (size_t)p->n;
    uint8_t *b = bex_rpc_alloc(bex__ps_client_ctx(c), len);
    if (!b)
        return -ENOMEM;
    bex__ps_hdr_put(b, h);
    memcpy(b + BEX__PS_HDR_LEN + BEX__PS_ID_LEN, keys + p->first, 8 * (size_t)p->n);
    float *rows = rows_of(z->u) + (size_t)p->first * z->dim;
    int rc = lend_send(c, p, ch, b, len, rows, 4 * (size_t)p->n * z->dim);
    if (rc)
        bex_rpc_free(b);
    return rc;
}

/* What a Push from an array was asked, and how far its start is. */
struct push_args {
    uint32_t table, dim;
    const uint64_t *keys;
    float *grads;
    bex_ps_replica_result *res;
    size_t cap;
    size_t used; /* entries of res given out, in run order (may pass cap) */
};

/* Run r's part by a copying bex_ps_push_report of its slice (its shard has
 * several replicas, or the part is past the wire's bounds). */
static int push_copied(bex_ps_client *c, struct zcall *z, struct push_args *a, const struct run *r)
{
    size_t k = 0, room = a->used < a->cap ? a->cap - a->used : 0;
    int rc = bex_ps_push_report(c, a->table, a->dim, a->keys + r->a, r->b - r->a,
                                a->grads + (size_t)r->a * a->dim, room ? a->res + a->used : NULL,
                                room, &k, copy_part_done, z);
    if (rc == 0)
        a->used += k;
    return rc;
}

/* Whether run r's shard takes its part without a copy (then through *ch,
 * with h and its replica's address in its result entry p->res): 0, -ENOENT
 * (it does not: copy), or an error. */
static int push_route(bex_ps_client *c, struct push_args *a, const struct run *r, struct zpart *p,
                      bex_rpc_channel **ch, struct bex__ps_hdr *h)
{
    uint32_t n = r->b - r->a;
    *h = (struct bex__ps_hdr){.table = a->table, .n = n, .dim = a->dim};
    if (ROOM - BEX_RPC_HDR_LEN + 8 * (size_t)n + 4 * (size_t)n * a->dim > BEX_PS_BODY_MAX)
        return -ENOENT;
    bex_addr addr;
    void *hold;
    int rc = bex__ps_client_push_one(c, r->shard, ch, &addr, h, &hold);
    if (rc)
        return rc;
    *p = (struct zpart){.z = p->z, .first = r->a, .n = n, .hold = hold};
    if (a->used < a->cap) {
        p->res = &a->res[a->used];
        *p->res = (bex_ps_replica_result){.shard = r->shard, .addr = addr, .status = -EINPROGRESS};
    }
    a->used++;
    return 0;
}

/* Run j's part (not the first's), gathered or copied: 0 or its error. */
static int push_other(bex_ps_client *c, struct zcall *z, struct push_args *a, const struct run *r,
                      struct zpart *p)
{
    bex_rpc_channel *ch;
    struct bex__ps_hdr h;
    int rc = push_route(c, a, r, p, &ch, &h);
    if (rc == -ENOENT)
        return push_copied(c, z, a, r);
    if (rc == 0 && (rc = push_gathered(c, p, ch, &h, a->keys))) {
        bex__ps_client_push_put(p->hold); /* not sent */
        if (p->res)
            p->res->status = rc;
    }
    return rc;
}

/* Every part of a Push from the array (claimed), one per run in order:
 * the first in place when its shard takes it at one replica, every
 * other's rows gathered from the array when its shard does; the rest
 * copied. sync: done waits for the array's return too. */
static int push_parts(bex_ps_client *c, struct ubuf *u, const struct runs *rs, struct push_args *a,
                      size_t *n_res, bex_ps_done_fn done, void *user, bool sync)
{
    uint32_t parts = rs->n + sync, sent = 0;
    struct zcall *z = zcall_new(u, rs->n, 0, 0, a->table, a->dim, done, user);
    if (!z) {
        ubuf_release(u);
        return -ENOMEM;
    }
    atomic_store(&z->pending, parts + 1);
    atomic_store(&u->lends, 1); /* the start's own, until it is over */
    u->lent_z = sync ? z : NULL;
    bex_rpc_channel *ch0 = NULL;
    struct bex__ps_hdr h0;
    int rc = push_route(c, a, &rs->r[0], &z->part[0], &ch0, &h0);
    if (rc == -ENOENT) /* first: it reads the keys before any move */
        rc = push_copied(c, z, a, &rs->r[0]);
    else
        ch0 = rc ? NULL : ch0;
    sent += !rc && !ch0;
    for (uint32_t j = 1; !rc && j < rs->n; j++) {
        rc = push_other(c, z, a, &rs->r[j], &z->part[j]);
        sent += !rc;
    }
    if (ch0 && !rc && !(rc = push_in_place(c, &z->part[0], ch0, &h0, a->keys)))
        sent++;
    else if (ch0) { /* not sent */
        bex__ps_client_push_put(z->part[0].hold);
        if (z->part[0].res)
            z->part[0].res->status = rc ? rc : -ECANCELED;
    }
    if (n_res)
        *n_res = sent ? a->used : 0;
    if (sync && sent)
        sent++; /* the array's return, which lend_end reports */
    else
        u->lent_z = NULL;
    lend_end(u);
    return zcall_started(z, sent, parts, rc);
}

static int push_from(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                     float *grads, bex_ps_replica_result *res, size_t cap, size_t *n_res,
                     bex_ps_done_fn done, void *user, bool sync)
{
    int rc = check_args(c, dim, keys, n, grads, done);
    struct ubuf *u = NULL;
    if (rc || (cap && !res) || (rc = claim(grads, bex__ps_client_ctx(c), n, dim, &u)))
        return rc ? rc : -EINVAL;
    struct runs rs;
    if ((rc = runs_get(c, keys, n, &rs))) {
        ubuf_release(u);
        return rc;
    }
    struct push_args a = {
        .table = table, .dim = dim, .keys = keys, .grads = grads, .res = res, .cap = cap};
    if (rs.n && WIRE_NATIVE)
        rc = push_parts(c, u, &rs, &a, n_res, done, user, sync); /* lets the array go */
    else {
        ubuf_release(u);
        rc = bex_ps_push_report(c, table, dim, keys, n, grads, res, cap, n_res, done, user);
    }
    runs_free(&rs);
    return rc;
}

int bex_ps_push_from(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                     float *grads, bex_ps_replica_result *res, size_t cap, size_t *n_res,
                     bex_ps_done_fn done, void *user)
{
    return push_from(c, table, dim, keys, n, grads, res, cap, n_res, done, user, false);
}

/* ---- waiting: the RPC layer's waiter (one futex word, one wake-up) ---- */

static void sync_done(int status, void *user)
{
    bex__rpc_wait_done(status, NULL, 0, user);
}

static int wait_array(struct bex__rpc_wait *w, int rc, float *rows)
{
    if (rc)
        return rc;
    void *body;
    size_t len;
    rc = bex__rpc_wait(w, &body, &len);
    /* the copying way's array (a Push's own let go before done): free */
    pthread_mutex_lock(&reg_mu);
    struct ubuf *u;
    while ((u = find_locked(rows)) && u->busy)
        pthread_cond_wait(&reg_cv, &reg_mu);
    pthread_mutex_unlock(&reg_mu);
    return rc;
}

int bex_ps_fetch_into_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                           size_t n, float *rows)
{
    struct bex__rpc_wait w = BEX__RPC_WAIT_INIT;
    return wait_array(&w, bex_ps_fetch_into(c, table, dim, keys, n, rows, sync_done, &w), rows);
}

int bex_ps_push_from_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                          size_t n, float *grads, bex_ps_replica_result *res, size_t cap,
                          size_t *n_res)
{
    /* sync: the call completes once the array is back too, so that its
     * caller wakes once, not at the answer and again at the array's return */
    struct bex__rpc_wait w = BEX__RPC_WAIT_INIT;
    return wait_array(
        &w, push_from(c, table, dim, keys, n, grads, res, cap, n_res, sync_done, &w, true), grads);
}
