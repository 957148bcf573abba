/* SPDX-License-Identifier: Apache-2.0 */
/* The PS client: Pushes kept for a replica that failed them while another
 * replica of the shard took them, sent to it again once it answers
 * (ps_internal.h, "Pushes kept for a replica that failed them"), and the
 * shared bodies they are kept in (ps_internal.h, "a Push body shared"). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bex/ps.h"
#include "common/list.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"
#include "sock/ctx_access.h"

#define PAUSE_MAX_NS 1000000000ull
#define RESEND_MS    10000u /* one resend's deadline */

/* One replica's kept Pushes. */
struct bex__ps_krep {
    struct bex__ps_keep *k;
    bex_rpc_channel *ch;
    bex_addr addr;
    struct bex__list q; /* struct kept, oldest first */
    _Atomic uint32_t n;
    uint64_t bytes;
    bool busy;                 /* the oldest is out */
    uint64_t due_ns, pause_ns; /* its next send (0: none due) */
    struct bex__list l;        /* in k->reps */
};

struct kept {
    struct bex__list l;
    uint64_t seq;
    size_t len;
    void *body; /* shared (bex__ps_pbody_alloc), one of its holders */
};

/* ---- shared bodies ---- */

static struct bex__ps_pbody *pbody_of(void *body, size_t len)
{
    return (struct bex__ps_pbody *)(void *)((uint8_t *)body + ((len + 7) & ~(size_t)7));
}

void *bex__ps_pbody_alloc(bex_ctx *ctx, size_t len)
{
    if (len > SIZE_MAX / 2)
        return NULL;
    void *b = bex_rpc_alloc(ctx, ((len + 7) & ~(size_t)7) + sizeof(struct bex__ps_pbody));
    if (b)
        *pbody_of(b, len) = (struct bex__ps_pbody){.refs = 1, .body = b};
    return b;
}

void bex__ps_pbody_get(void *body, size_t len)
{
    atomic_fetch_add_explicit(&pbody_of(body, len)->refs, 1, memory_order_relaxed);
}

/* One holder less of the shared body at arg (a borrow's release, under its
 * channel's lock: it only counts and frees memory). */
static void pbody_release(void *arg)
{
    struct bex__ps_pbody *pb = arg;
    if (atomic_fetch_sub_explicit(&pb->refs, 1, memory_order_acq_rel) == 1)
        bex_rpc_free(pb->body);
}

void bex__ps_pbody_put(void *body, size_t len)
{
    if (body)
        pbody_release(pbody_of(body, len));
}

bool bex__ps_pbody_alone(void *body, size_t len)
{
    return atomic_load_explicit(&pbody_of(body, len)->refs, memory_order_acquire) == 1;
}

int bex__ps_pbody_call(bex_rpc_channel *ch, uint32_t method, void *body, size_t len,
                       const bex_rpc_call_opts *opts, bex_rpc_done_fn done, void *user)
{
    struct bex__ps_pbody *pb = pbody_of(body, len);
    struct bex__rpc_borrow bw = {.release = pbody_release, .arg = pb};
    atomic_fetch_add_explicit(&pb->refs, 1, memory_order_relaxed);
    int rc =
        bex__rpc_call_ext(ch, BEX_PS_SERVICE, method, body, len, NULL, 0, opts, done, user, &bw);
    if (rc) /* nothing sent: the call holds it no more (the caller does) */
        atomic_fetch_sub_explicit(&pb->refs, 1, memory_order_relaxed);
    return rc;
}

/* ---- kept Pushes ---- */

static void kept_free(struct kept *n)
{
    bex__ps_pbody_put(n->body, n->len);
    free(n);
}

void bex__ps_keep_init(struct bex__ps_keep *k, bex_ctx *ctx, const _Atomic uint64_t *seq,
                       uint32_t max, uint64_t max_bytes, uint32_t pause_ms)
{
    *k = (struct bex__ps_keep){.ctx = ctx, .seq = seq};
    k->max = max && max < BEX__PS_IDS_WINDOW ? max : BEX__PS_IDS_WINDOW;
    k->max_bytes = max_bytes ? max_bytes : 16ull << 20;
    k->pause_ns = (uint64_t)(pause_ms ? pause_ms : 50) * 1000000ull;
    bex__list_init(&k->reps);
    pthread_mutex_init(&k->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&k->cv, &ca);
    pthread_condattr_destroy(&ca);
}

void bex__ps_keep_stop(struct bex__ps_keep *k)
{
    pthread_mutex_lock(&k->mu);
    k->stop = true;
    pthread_cond_signal(&k->cv);
    bool on = k->on;
    pthread_mutex_unlock(&k->mu);
    if (on)
        pthread_join(k->thr, NULL);
}

void bex__ps_keep_free(struct bex__ps_keep *k)
{
    struct bex__list *l;
    while ((l = bex__list_first(&k->reps))) {
        struct bex__ps_krep *r = bex__list_entry(l, struct bex__ps_krep, l);
        bex__list_remove(l);
        struct bex__list *n;
        while ((n = bex__list_first(&r->q))) {
            bex__list_remove(n);
            kept_free(bex__list_entry(n, struct kept, l));
        }
        free(r);
    }
    pthread_cond_destroy(&k->cv);
    pthread_mutex_destroy(&k->mu);
}

struct bex__ps_krep *bex__ps_keep_rep(struct bex__ps_keep *k, bex_rpc_channel *ch,
                                      const bex_addr *addr)
{
    struct bex__ps_krep *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->k = k;
    r->ch = ch;
    r->addr = *addr;
    r->pause_ns = k->pause_ns;
    bex__list_init(&r->q);
    pthread_mutex_lock(&k->mu);
    bex__list_push_tail(&k->reps, &r->l);
    pthread_mutex_unlock(&k->mu);
    return r;
}

bool bex__ps_keepable(int st)
{
    /* not -EPERM, -ESTALE (an answer about the Push itself), nor a bad
     * request (-EINVAL, -ENOSPC, ...): sent again it would fail again */
    return st == -EAGAIN || st == -EIO || st == -ECONNREFUSED || st == -ECONNRESET ||
           st == -ECONNABORTED || st == -EHOSTUNREACH || st == -ENETUNREACH || st == -EPIPE ||
           st == -ENOTCONN || st == -ETIMEDOUT || st == -ESHUTDOWN;
}

/* The kept Push n of r dropped, for why (under k->mu): that replica misses it. */
static void drop(struct bex__ps_keep *k, struct bex__ps_krep *r, struct kept *n, const char *why)
{
    char a[BEX_ADDR_STRLEN];
    bex__log(bex__ctx_log(k->ctx), BEX_LOG_WARN,
             "ps client: a Push (sequence %llu) kept for replica %s dropped (%s): that replica "
             "misses it",
             (unsigned long long)n->seq, bex_addr_format(&r->addr, true, a, sizeof a), why);
    bex__list_remove(&n->l);
    atomic_fetch_sub(&r->n, 1);
    r->bytes -= n->len;
    k->held--;
    kept_free(n);
    atomic_fetch_add(&k->dropped, 1);
}

/* The oldest of r that is not out (under k->mu), or NULL. */
static struct kept *oldest_idle(struct bex__ps_krep *r)
{
    struct bex__list *n = bex__list_first(&r->q);
    if (n && r->busy)
        n = n->next != &r->q ? n->next : NULL;
    return n ? bex__list_entry(n, struct kept, l) : NULL;
}

static void *keep_main(void *arg);

void bex__ps_keep_add(struct bex__ps_keep *k, struct bex__ps_krep *r, uint64_t seq, void *body,
                      size_t len)
{
    struct kept *n = malloc(sizeof *n);
    pthread_mutex_lock(&k->mu);
    if (!k->on && !k->stop && n && pthread_create(&k->thr, NULL, keep_main, k) == 0)
        k->on = true;
    if (!n || !k->on || len > k->max_bytes) {
        pthread_mutex_unlock(&k->mu);
        free(n);
        atomic_fetch_add(&k->dropped, 1);
        return;
    }
    struct kept *o;
    while ((atomic_load(&r->n) >= k->max || r->bytes + len > k->max_bytes) && (o = oldest_idle(r)))
        drop(k, r, o, "past the bound of Pushes kept per replica");
    bex__ps_pbody_get(body, len); /* taken over: no copy */
    *n = (struct kept){.seq = seq, .len = len, .body = body};
    bex__list_push_tail(&r->q, &n->l);
    /* the first one kept: a time set when the last one went (sent or
     * dropped) is no one's, and the thread may wait for no time at all */
    bool first = atomic_fetch_add(&r->n, 1) == 0;
    r->bytes += len;
    k->held++;
    atomic_fetch_add(&k->kept, 1);
    if (!r->busy && (!r->due_ns || first)) {
        r->due_ns = bex__rpc_now_ns() + r->pause_ns;
        pthread_cond_signal(&k->cv);
    }
    pthread_mutex_unlock(&k->mu);
}

void bex__ps_keep_ok(struct bex__ps_keep *k, struct bex__ps_krep *r)
{
    if (!atomic_load(&r->n))
        return;
    pthread_mutex_lock(&k->mu);
    if (!r->busy && atomic_load(&r->n)) {
        r->pause_ns = k->pause_ns;
        r->due_ns = bex__rpc_now_ns();
        pthread_cond_signal(&k->cv);
    }
    pthread_mutex_unlock(&k->mu);
}

uint32_t bex__ps_keep_count(struct bex__ps_krep *r)
{
    return atomic_load(&r->n);
}

bool bex__ps_keep_retire(struct bex__ps_keep *k, struct bex__ps_krep *r, bool force)
{
    pthread_mutex_lock(&k->mu);
    uint32_t n = atomic_load(&r->n);
    if (r->busy || (n && !force)) {
        pthread_mutex_unlock(&k->mu);
        return false;
    }
    if (n) {
        char a[BEX_ADDR_STRLEN];
        bex__log(bex__ctx_log(k->ctx), BEX_LOG_WARN,
                 "ps client: Pushes kept for replica %s dropped (%u; the directory no longer "
                 "lists it, past the bound of such replicas kept): that replica misses them",
                 bex_addr_format(&r->addr, true, a, sizeof a), n);
    }
    struct bex__list *l;
    while ((l = bex__list_first(&r->q))) {
        bex__list_remove(l);
        r->bytes -= bex__list_entry(l, struct kept, l)->len;
        kept_free(bex__list_entry(l, struct kept, l));
        k->held--;
        atomic_fetch_add(&k->dropped, 1);
    }
    bex__list_remove(&r->l);
    pthread_mutex_unlock(&k->mu);
    free(r);
    return true;
}

void bex__ps_keep_stats(struct bex__ps_keep *k, bex_ps_client_stats *out)
{
    /* under mu, where a kept Push leaves held and enters resent or
     * dropped in one step: read before it, dropped could miss Pushes held
     * no more (kept = held + resent + dropped would not hold) */
    pthread_mutex_lock(&k->mu);
    out->push_kept = atomic_load(&k->kept);
    out->push_resent = atomic_load(&k->resent);
    out->push_dropped = atomic_load(&k->dropped);
    out->push_held = k->held;
    pthread_mutex_unlock(&k->mu);
}

/* A resend of r's oldest ended: an answer that is not a Push's (a
 * replica's malformed one) is not taken for applied, as a Push's own part
 * is not (-EBADMSG, client.c sub_done). */
static void resent(int status, void *body, size_t len, void *user)
{
    struct bex__ps_krep *r = user;
    struct bex__ps_keep *k = r->k;
    pthread_mutex_lock(&k->mu);
    struct kept *n = bex__list_entry(bex__list_first(&r->q), struct kept, l);
    if (status == 0)
        status = bex__ps_check_resp(
            BEX_PS_M_PUSH, body, len, bex__ps_hdr_get32((uint8_t *)n->body + 4),
            bex__ps_hdr_get32((uint8_t *)n->body + 8), bex__ps_hdr_get32((uint8_t *)n->body + 12));
    bex_rpc_free(body);
    r->busy = false;
    uint64_t now = bex__rpc_now_ns();
    if (status == 0) {
        bex__list_remove(&n->l);
        atomic_fetch_sub(&r->n, 1);
        r->bytes -= n->len;
        k->held--;
        kept_free(n);
        atomic_fetch_add(&k->resent, 1);
        r->pause_ns = k->pause_ns;
        r->due_ns = now;
    } else if (bex__ps_keepable(status) && !k->stop) {
        r->pause_ns = r->pause_ns * 2 < PAUSE_MAX_NS ? r->pause_ns * 2 : PAUSE_MAX_NS;
        r->due_ns = now + r->pause_ns;
    } else {
        drop(k, r, n, bex_strerror(status));
        r->due_ns = now;
    }
    pthread_cond_signal(&k->cv);
    pthread_mutex_unlock(&k->mu);
}

/* r's oldest sent again (under k->mu, released meanwhile), or dropped when
 * its sequence fell out of the replicas' window. */
static void send_oldest(struct bex__ps_keep *k, struct bex__ps_krep *r)
{
    struct kept *n = bex__list_entry(bex__list_first(&r->q), struct kept, l);
    uint64_t newest = atomic_load(k->seq);
    if (newest > n->seq && newest - n->seq >= BEX__PS_IDS_WINDOW) {
        drop(k, r, n, "its sequence 1024 or more behind the client's newest");
        r->due_ns = bex__rpc_now_ns();
        return;
    }
    /* sent from the body itself, unless another holds it (an attempt that
     * sent it before, not let go by its transport yet): the RPC header in
     * front of it is that attempt's; then from a copy, kept instead */
    void *b = n->body;
    size_t len = n->len;
    if (!bex__ps_pbody_alone(b, len)) {
        void *f = bex__ps_pbody_alloc(k->ctx, len);
        if (f) {
            memcpy(f, b, len);
            bex__ps_pbody_put(b, len);
            n->body = f;
        }
        b = f;
    }
    r->busy = true;
    r->due_ns = 0;
    pthread_mutex_unlock(&k->mu);
    bex_rpc_call_opts o = {.timeout_ms = RESEND_MS, .flags = 0};
    int rc = b ? bex__ps_pbody_call(r->ch, BEX_PS_M_PUSH, b, len, &o, resent, r) : -ENOMEM;
    if (rc)
        resent(rc == -ENOMEM ? -EAGAIN : rc, NULL, 0, r);
    pthread_mutex_lock(&k->mu);
}

/* The replica whose kept Pushes are due first (under k->mu), NULL when
 * none; *at its time. */
static struct bex__ps_krep *next_due(struct bex__ps_keep *k, uint64_t *at)
{
    struct bex__ps_krep *best = NULL;
    struct bex__list *pos;
    bex__list_foreach(pos, &k->reps)
    {
        struct bex__ps_krep *r = bex__list_entry(pos, struct bex__ps_krep, l);
        if (!r->busy && r->due_ns && atomic_load(&r->n) && (!best || r->due_ns < best->due_ns))
            best = r;
    }
    *at = best ? best->due_ns : 0;
    return best;
}

static void *keep_main(void *arg)
{
    struct bex__ps_keep *k = arg;
    pthread_mutex_lock(&k->mu);
    while (!k->stop) {
        uint64_t at;
        struct bex__ps_krep *r = next_due(k, &at);
        if (r && at <= bex__rpc_now_ns()) {
            send_oldest(k, r);
        } else if (r) {
            struct timespec ts = {(time_t)(at / 1000000000ull), (long)(at % 1000000000ull)};
            pthread_cond_timedwait(&k->cv, &k->mu, &ts);
        } else {
            pthread_cond_wait(&k->cv, &k->mu);
        }
    }
    pthread_mutex_unlock(&k->mu);
    return NULL;
}
