/* SPDX-License-Identifier: Apache-2.0 */
/* RPC client: channels over an endpoint list, calls with deadlines,
 * retries within a budget, counters and a latency histogram.
 *
 * One mutex per channel guards everything of it; socket callbacks (I/O
 * thread), the timer thread and callers take it. Completions are collected
 * under it and run after it is released, so a completion may call again. */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/cfg.h"
#include "common/log.h"
#include "common/util.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"
#include "sock/ctx_access.h"
#include "rpc/client_internal.h"

uint64_t bex__rpc_rnd(struct bex_rpc_channel *ch)
{
    /* xorshift64*: retry coin flips, not security */
    uint64_t x = ch->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    ch->rng = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* ---- links and endpoints (under ch->mu) ---- */

void bex__rpc_ep_put(struct endpoint *ep)
{
    if (--ep->refs)
        return;
    free(ep->locality);
    free(ep);
}

static int check_endpoints(const bex_rpc_endpoint *eps, size_t n)
{
    if (!eps || n == 0 || n > 4096)
        return -EINVAL;
    for (size_t i = 0; i < n; i++)
        if (!bex_addr_valid(&eps[i].addr) || !bex_addr_port(&eps[i].addr) ||
            eps[i].transport > BEX_TRANSPORT_TCP)
            return -EINVAL;
    return 0;
}

static bool ep_same(const struct endpoint *ep, const bex_rpc_endpoint *e)
{
    return bex_addr_equal(&ep->addr, &e->addr) && ep->transport == e->transport;
}

/* The list for eps[0..n): endpoints of old (n_old of them) with the same
 * address and transport are taken over (with their connection), the rest
 * made. Takes nothing from old on failure. */
static int build_eps(const bex_rpc_endpoint *eps, size_t n, struct endpoint **old, size_t n_old,
                     struct endpoint ***out)
{
    struct endpoint **v = calloc(n, sizeof(*v));
    char **loc = calloc(n, sizeof(*loc));
    if (!v || !loc)
        goto err_free;
    for (size_t i = 0; i < n; i++)
        if (eps[i].locality && !(loc[i] = strdup(eps[i].locality)))
            goto err_free;
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < n_old && !v[i]; k++)
            if (old[k] && ep_same(old[k], &eps[i])) {
                bool dup = false; /* the same endpoint listed twice: one */
                for (size_t j = 0; j < i; j++)
                    dup |= v[j] == old[k];
                if (!dup)
                    v[i] = old[k];
            }
        if (!v[i] && !(v[i] = calloc(1, sizeof(*v[i]))))
            goto err_new;
    }
    for (size_t i = 0; i < n; i++) {
        bool kept = false;
        for (size_t k = 0; k < n_old; k++)
            kept |= v[i] == old[k];
        if (kept) {
            free(v[i]->locality);
        } else {
            v[i]->addr = eps[i].addr;
            v[i]->transport = eps[i].transport;
            v[i]->refs = 1;
        }
        v[i]->locality = loc[i];
    }
    free(loc);
    *out = v;
    return 0;

err_new:
    for (size_t i = 0; i < n; i++) {
        bool kept = false;
        for (size_t k = 0; k < n_old; k++)
            kept |= v[i] == old[k];
        if (!kept)
            free(v[i]);
    }
err_free:
    if (loc)
        for (size_t i = 0; i < n; i++)
            free(loc[i]);
    free(loc);
    free(v);
    return -ENOMEM;
}

int bex_rpc_channel_create(bex_ctx *ctx, const bex_rpc_channel_config *cfg, bex_rpc_channel **out)
{
    bex_rpc_channel_config taken;
    BEX__CFG_TAKE(cfg, taken);
    bool dir = cfg && cfg->dir;
    if (!ctx || !cfg || !out || cfg->retry_permille > 1000 ||
        (dir ? cfg->endpoints || cfg->n_endpoints || !cfg->service
             : check_endpoints(cfg->endpoints, cfg->n_endpoints)))
        return -EINVAL;
    /* the dedup token must be unguessable: no weaker fallback */
    uint8_t tok[BEX__RPC_TOK_LEN];
    if (getrandom(tok, sizeof tok, 0) != sizeof tok)
        return -EIO;
    struct bex_rpc_channel *ch = calloc(1, sizeof(*ch));
    if (!ch)
        return -ENOMEM;
    bex__list_init(&ch->live);
    bex__list_init(&ch->links);
    memcpy(ch->tok, tok, sizeof tok);
    int err = -ENOMEM;
    ch->ctx = ctx;
    ch->log = bex__ctx_log(ctx);
    ch->name = strdup(cfg->name ? cfg->name : "default");
    if (dir) {
        ch->dir = cfg->dir;
        ch->shard = cfg->shard;
        ch->service = strdup(cfg->service);
        ch->locality = cfg->locality ? strdup(cfg->locality) : NULL;
        if (!ch->name || !ch->service || (cfg->locality && !ch->locality))
            goto err_free;
    } else if (!ch->name || build_eps(cfg->endpoints, cfg->n_endpoints, NULL, 0, &ch->eps)) {
        goto err_free;
    }
    ch->n_eps = cfg->n_endpoints;
    ch->tr_ns = (cfg->request_timeout_ms ? cfg->request_timeout_ms : 40) * 1000000ull;
    ch->tc_ns = (cfg->connect_timeout_ms ? cfg->connect_timeout_ms : 10) * 1000000ull;
    ch->attempt_ns = cfg->attempt_timeout_ms * 1000000ull;
    ch->holddown_ns = (cfg->holddown_ms ? cfg->holddown_ms : 100) * 1000000ull;
    ch->rdma_retry_ns = (cfg->rdma_retry_ms ? cfg->rdma_retry_ms : 30000) * 1000000ull;
    ch->probe_ns = cfg->probe_timeout_ms ? cfg->probe_timeout_ms * 1000000ull : ch->tc_ns;
    ch->max_attempts = cfg->max_attempts ? cfg->max_attempts : 3;
    ch->retry_permille = cfg->retry_permille ? cfg->retry_permille : 1000;
    ch->budget_permille = cfg->retry_budget_permille ? cfg->retry_budget_permille : 100;
    ch->budget_burst = cfg->retry_budget_burst ? cfg->retry_budget_burst : 10;
    ch->tokens = (int64_t)ch->budget_burst * 1000;
    ch->client_id = cfg->client_id;
    while (!ch->client_id)
        if (getrandom(&ch->client_id, sizeof ch->client_id, 0) != sizeof ch->client_id)
            ch->client_id = bex__rpc_now_ns() ^ (uint64_t)(uintptr_t)ch;
    ch->rng = ch->client_id | 1;
    pthread_mutex_init(&ch->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&ch->cv, &ca);
    pthread_condattr_destroy(&ca);
    err = -pthread_create(&ch->timer, NULL, bex__rpc_timer_main, ch);
    if (err)
        goto err_sync;
    *out = ch;
    return 0;

err_sync:
    pthread_cond_destroy(&ch->cv);
    bex__hmap_free(&ch->calls);
    pthread_mutex_destroy(&ch->mu);
err_free:
    if (ch->eps)
        for (size_t i = 0; i < ch->n_eps; i++)
            bex__rpc_ep_put(ch->eps[i]);
    free(ch->eps);
    free(ch->service);
    free(ch->locality);
    free(ch->name);
    free(ch);
    return err;
}

void *bex_rpc_alloc_dest(bex_ctx *ctx, size_t cap)
{
    if (!ctx || cap > (size_t)INT32_MAX - BEX_RPC_HDR_LEN)
        return NULL;
    uint8_t *p = bex_sock_alloc_exposable(ctx, cap + BEX_RPC_HDR_LEN);
    return p ? p + BEX_RPC_HDR_LEN : NULL;
}

static int call_start(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body,
                      size_t len, void *dst, size_t cap, const bex_rpc_call_opts *opts,
                      bex_rpc_done_fn done, void *user, uint64_t *call_id,
                      const struct bex__rpc_borrow *bw);

int bex_rpc_call(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body, size_t len,
                 const bex_rpc_call_opts *opts, bex_rpc_done_fn done, void *user, uint64_t *call_id)
{
    return call_start(ch, service, method, body, len, NULL, 0, opts, done, user, call_id, NULL);
}

int bex_rpc_call_into(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body,
                      size_t len, void *dst, size_t cap, const bex_rpc_call_opts *opts,
                      bex_rpc_done_fn done, void *user, uint64_t *call_id)
{
    /* dst as bex_rpc_alloc_dest gave it: landing memory of the channel's
     * context, cap bytes and the header room in front */
    if (!ch || !dst || cap > (size_t)INT32_MAX - BEX_RPC_HDR_LEN ||
        bex_mem_pool_of(bex__rpc_hdr_of(dst)) != bex_ctx_landing_pool(ch->ctx) ||
        bex_mem_usable_size(bex__rpc_hdr_of(dst)) < cap + BEX_RPC_HDR_LEN)
        return -EINVAL;
    return call_start(ch, service, method, body, len, dst, cap, opts, done, user, call_id, NULL);
}

int bex__rpc_call_ext(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body,
                      size_t len, void *dst, size_t cap, const bex_rpc_call_opts *opts,
                      bex_rpc_done_fn done, void *user, const struct bex__rpc_borrow *bw)
{
    if (dst && (!ch || cap > (size_t)INT32_MAX - BEX_RPC_HDR_LEN ||
                bex_mem_pool_of(bex__rpc_hdr_of(dst)) != bex_ctx_landing_pool(ch->ctx)))
        return -EINVAL;
    if (bw && bw->tail &&
        (dst || !body || bw->tail_len == 0 || !bw->release ||
         bw->tail_len > (size_t)INT32_MAX - BEX_RPC_HDR_LEN - len))
        return -EINVAL;
    return call_start(ch, service, method, body, len, dst, cap, opts, done, user, NULL, bw);
}

/* c's request header, in front of its body: written once, so every
 * attempt sends these same bytes (the same client id, token and sequence,
 * whatever the connection), and attempts may be out at once. */
static void call_encode(bex_rpc_channel *ch, struct call *c, size_t len, uint64_t tmo_ns)
{
    struct bex__rpc_hdr h = {
        .kind = BEX__RPC_REQUEST,
        .flags = c->dst ? BEX__RPC_F_DEST : 0,
        .service = c->service,
        .method = c->method,
        .call_id = c->id,
        .client_id = ch->client_id,
        .seq = ++ch->next_seq,
        .body_len = (uint32_t)len,
        .timeout_ms = (uint32_t)(tmo_ns / 1000000ull),
    };
    memcpy(h.tok, ch->tok, sizeof h.tok);
    bex__rpc_hdr_encode(&h, c->msg);
}

/* A channel's spare call, or a new one (under ch->mu: calls are freed on
 * the I/O thread) */
static struct call *call_new_locked(bex_rpc_channel *ch)
{
    struct call *c = ch->spare;
    if (!c)
        return malloc(sizeof(*c));
    ch->spare = c->dnext;
    ch->n_spare--;
    return c;
}

static void spares_free(bex_rpc_channel *ch)
{
    while (ch->spare) {
        struct call *n = ch->spare->dnext;
        free(ch->spare);
        ch->spare = n;
    }
    ch->n_spare = 0;
}

static int call_start(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body,
                      size_t len, void *dst, size_t cap, const bex_rpc_call_opts *opts,
                      bex_rpc_done_fn done, void *user, uint64_t *call_id,
                      const struct bex__rpc_borrow *bw)
{
    if (!ch || !done || (!body && len) || len > (size_t)INT32_MAX - BEX_RPC_HDR_LEN ||
        (opts && (opts->flags & ~(uint32_t)BEX_RPC_CALL_NO_RETRY)))
        return -EINVAL;
    if (body) {
        /* the header goes in front of body: refuse memory bex_rpc_alloc
         * cannot have given */
        bex_mem_pool *pool = bex_mem_pool_of(body);
        if (pool != bex_ctx_pool(ch->ctx) && pool != bex_ctx_recv_pool(ch->ctx) &&
            pool != bex_ctx_landing_pool(ch->ctx))
            return -EINVAL;
    }
    bool own_body = !body;
    if (own_body && !(body = bex_rpc_alloc(ch->ctx, 0)))
        return -ENOMEM;
    uint64_t now = bex__rpc_now_ns();
    uint64_t tmo_ns = opts && opts->timeout_ms ? opts->timeout_ms * 1000000ull : ch->tr_ns;
    pthread_mutex_lock(&ch->mu);
    struct call *c = ch->destroying ? NULL : call_new_locked(ch);
    if (!c) {
        int err = ch->destroying ? -EPIPE : -ENOMEM;
        pthread_mutex_unlock(&ch->mu);
        if (own_body)
            bex_rpc_free(body);
        return err;
    }
    *c = (struct call){
        .service = service,
        .method = method,
        .flags = opts ? opts->flags : 0,
        .msg = bex__rpc_hdr_of(body),
        .len = len + BEX_RPC_HDR_LEN,
        .done = done,
        .user = user,
        .t_start = now,
        .deadline = now + tmo_ns,
        .refs = 1,
        .state = CALL_LIVE,
        .dst = dst,
        .cap = cap,
        .borrow = bw ? *bw : (struct bex__rpc_borrow){0},
    };
    struct call *dl = NULL;
    c->id = ++ch->next_id;
    if (bex__hmap_put(&ch->calls, c->id, c) != 0) {
        pthread_mutex_unlock(&ch->mu);
        free(c);
        if (own_body)
            bex_rpc_free(body);
        return -ENOMEM;
    }
    call_encode(ch, c, len + c->borrow.tail_len, tmo_ns);
    ch->tokens += ch->budget_permille;
    if (ch->tokens > (int64_t)ch->budget_burst * 1000)
        ch->tokens = (int64_t)ch->budget_burst * 1000;
    bex__list_push_head(&ch->live, &c->lnode);
    ch->n_calls++;
    ch->st.calls++;
    if (call_id)
        *call_id = c->id;
    if (c->deadline < ch->timer_next || !ch->timer_next)
        pthread_cond_broadcast(&ch->cv);
    bool step;
    int err = bex__rpc_start_attempt(ch, c, NULL, NULL, &step, &dl);
    if (err)
        bex__rpc_attempt_failed_ex(ch, c, err, false, step, &dl);
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, dl);
    return 0;
}

int bex_rpc_cancel(bex_rpc_channel *ch, uint64_t call_id)
{
    if (!ch)
        return -EINVAL;
    struct call *dl = NULL;
    pthread_mutex_lock(&ch->mu);
    struct call *c = bex__rpc_call_find(ch, call_id);
    if (c)
        bex__rpc_complete(ch, c, -ECANCELED, NULL, 0, K_CANCEL, &dl);
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, dl);
    return c ? 0 : -ENOENT;
}

int bex_rpc_channel_set_endpoints(bex_rpc_channel *ch, const bex_rpc_endpoint *eps, size_t n)
{
    if (!ch || ch->dir || check_endpoints(eps, n))
        return -EINVAL;
    struct call *dl = NULL;
    pthread_mutex_lock(&ch->mu);
    struct endpoint **v;
    int err = ch->destroying ? -EPIPE : build_eps(eps, n, ch->eps, ch->n_eps, &v);
    if (err) {
        pthread_mutex_unlock(&ch->mu);
        return err;
    }
    struct endpoint **old = ch->eps;
    size_t n_old = ch->n_eps;
    ch->eps = v;
    ch->n_eps = n;
    ch->rr = 0;
    for (size_t k = 0; k < n_old; k++) {
        bool kept = false;
        for (size_t i = 0; i < n; i++)
            kept |= v[i] == old[k];
        if (kept)
            continue;
        /* removed: no call may name it as the one to avoid, its connection
         * goes and the calls on it are tried on the new list */
        struct bex__list *pos;
        bex__list_foreach(pos, &ch->live)
        {
            struct call *c = bex__list_entry(pos, struct call, lnode);
            if (c->ep == old[k])
                c->ep = NULL;
        }
        if (old[k]->cur)
            bex__rpc_link_fail(ch, old[k]->cur, -ECONNABORTED, &dl);
        if (old[k]->probe)
            bex__rpc_link_fail(ch, old[k]->probe, -ECONNABORTED, &dl);
        bex__rpc_xatt_fail_ep(ch, old[k], -ECONNABORTED, &dl);
        bex__rpc_ep_put(old[k]);
    }
    free(old);
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, dl);
    return 0;
}

static void futex_wait(_Atomic uint32_t *w, uint32_t v)
{
    syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0);
}

void bex__rpc_wait_done(int status, void *body, size_t len, void *user)
{
    struct bex__rpc_wait *w = user;
    w->status = status;
    w->body = body;
    w->len = len;
    /* after this store the waiter may return and w be gone: the wake
     * names only the address (a later waiter there wakes, looks, and
     * sleeps again) */
    if (atomic_exchange_explicit(&w->state, 2, memory_order_acq_rel) == 1)
        syscall(SYS_futex, &w->state, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

int bex__rpc_wait(struct bex__rpc_wait *w, void **body, size_t *len)
{
    uint32_t v = 0;
    if (atomic_compare_exchange_strong_explicit(&w->state, &v, 1, memory_order_acq_rel,
                                                memory_order_acquire)) {
        while (atomic_load_explicit(&w->state, memory_order_acquire) == 1)
            futex_wait(&w->state, 1);
    }
    *body = w->body;
    *len = w->len;
    return w->status;
}

int bex_rpc_call_sync(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body,
                      size_t len, const bex_rpc_call_opts *opts, void **resp, size_t *resp_len)
{
    if (!ch)
        return -EINVAL;
    if (bex__ctx_on_io_thread(ch->ctx) || pthread_equal(pthread_self(), ch->timer))
        return -EDEADLK;
    struct bex__rpc_wait w = BEX__RPC_WAIT_INIT;
    int err = bex_rpc_call(ch, service, method, body, len, opts, bex__rpc_wait_done, &w, NULL);
    if (err)
        return err;
    void *b;
    size_t n;
    int status = bex__rpc_wait(&w, &b, &n);
    if (resp)
        *resp = b;
    else
        bex_rpc_free(b);
    if (resp_len)
        *resp_len = n;
    return status;
}

int bex_rpc_channel_destroy(bex_rpc_channel *ch)
{
    if (!ch)
        return 0;
    if (bex__ctx_on_io_thread(ch->ctx) || pthread_equal(pthread_self(), ch->timer))
        return -EDEADLK;
    struct call *dl = NULL;
    pthread_mutex_lock(&ch->mu);
    ch->destroying = true;
    while (!bex__list_empty(&ch->live))
        bex__rpc_complete(ch, bex__list_entry(ch->live.next, struct call, lnode), -ECANCELED, NULL,
                          0, K_CANCEL, &dl);
    struct bex__list *pos;
    bex__list_foreach(pos, &ch->links)
        bex__rpc_link_fail(ch, bex__list_entry(pos, struct link, lnode), -ECANCELED, &dl);
    ch->stop = true;
    pthread_cond_broadcast(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, dl);
    pthread_join(ch->timer, NULL);
    pthread_mutex_lock(&ch->mu);
    /* every socket's bex__rpc_on_close, and with it every send's bex__rpc_on_send_done */
    while (!bex__list_empty(&ch->links) || ch->n_calls)
        pthread_cond_wait(&ch->cv, &ch->mu);
    pthread_mutex_unlock(&ch->mu);
    for (size_t i = 0; i < ch->n_eps; i++)
        bex__rpc_ep_put(ch->eps[i]);
    free(ch->eps);
    while (ch->deps) {
        struct endpoint *n = ch->deps->dnext;
        bex__rpc_ep_put(ch->deps);
        ch->deps = n;
    }
    free(ch->service);
    free(ch->locality);
    free(ch->name);
    spares_free(ch);
    pthread_cond_destroy(&ch->cv);
    bex__hmap_free(&ch->calls);
    pthread_mutex_destroy(&ch->mu);
    free(ch);
    return 0;
}

void bex_rpc_channel_stats_get(bex_rpc_channel *ch, bex_rpc_channel_stats *out)
{
    pthread_mutex_lock(&ch->mu);
    *out = ch->st;
    if (ch->hist.count)
        out->lat_mean_us = (double)ch->hist.sum_ns / (double)ch->hist.count / 1000.0;
    out->lat_p50_us = bex__rpc_hist_quantile(&ch->hist, 0.5) / 1000.0;
    out->lat_p99_us = bex__rpc_hist_quantile(&ch->hist, 0.99) / 1000.0;
    out->lat_p999_us = bex__rpc_hist_quantile(&ch->hist, 0.999) / 1000.0;
    pthread_mutex_unlock(&ch->mu);
}

size_t bex_rpc_channel_endpoint_stats(bex_rpc_channel *ch, bex_rpc_endpoint_stats *out, size_t cap)
{
    pthread_mutex_lock(&ch->mu);
    size_t n = ch->n_eps;
    for (size_t i = 0; i < n && i < cap; i++) {
        const struct endpoint *ep = ch->eps[i];
        out[i] = (bex_rpc_endpoint_stats){.addr = ep->addr,
                                          .attempts = ep->attempts,
                                          .answers = ep->answers,
                                          .failures = ep->failures,
                                          .conn_failures = ep->conn_failures,
                                          .ladder = (uint32_t)ep->rung,
                                          .tcp_answers = ep->tcp_answers};
        snprintf(out[i].locality, sizeof out[i].locality, "%s", ep->locality ? ep->locality : "");
    }
    /* directory mode: the endpoints made for the nodes chosen so far */
    for (const struct endpoint *ep = ch->deps; ep; ep = ep->dnext, n++) {
        if (n >= cap)
            continue;
        bex_dir_replica r;
        bex__dir_node_info(ch->dir, ep->node, &r);
        out[n] = (bex_rpc_endpoint_stats){.addr = ep->addr,
                                          .attempts = ep->attempts,
                                          .answers = ep->answers,
                                          .failures = ep->failures,
                                          .conn_failures = ep->conn_failures,
                                          .ladder = (uint32_t)ep->rung,
                                          .tcp_answers = ep->tcp_answers};
        snprintf(out[n].locality, sizeof out[n].locality, "%s", r.locality);
    }
    pthread_mutex_unlock(&ch->mu);
    return n;
}

static void chan_label(const void *obj, const void *name, char *labels, size_t cap)
{
    (void)obj;
    snprintf(labels, cap, "channel=\"%s\"", (const char *)name);
}

static void ep_label(const void *obj, const void *name, char *labels, size_t cap)
{
    const bex_rpc_endpoint_stats *e = obj;
    char ip[BEX_ADDR_STRLEN], loc[160];
    bex_addr_format(&e->addr, false, ip, sizeof ip);
    bex__prom_escape(e->locality, loc, sizeof loc);
    snprintf(labels, cap, "channel=\"%s\",endpoint=\"%s:%u\",locality=\"%s\"", (const char *)name,
             ip, bex_addr_port(&e->addr), loc);
}

static const struct bex__prom_ctr chan_ctrs[] = {
    {"bex_rpc_calls_total", "Calls accepted", offsetof(bex_rpc_channel_stats, calls)},
    {"bex_rpc_ok_total", "Calls completed with status 0", offsetof(bex_rpc_channel_stats, ok)},
    {"bex_rpc_attempts_total", "Requests sent, retries included",
     offsetof(bex_rpc_channel_stats, attempts)},
    {"bex_rpc_retries_total", "Attempts after the first", offsetof(bex_rpc_channel_stats, retries)},
    {"bex_rpc_retry_throttled_total", "Retries refused by the retry budget",
     offsetof(bex_rpc_channel_stats, retry_throttled)},
    {"bex_rpc_late_responses_total", "Answers to completed calls, dropped",
     offsetof(bex_rpc_channel_stats, late_responses)},
    {"bex_rpc_bad_header_total", "Connections closed for a malformed answer",
     offsetof(bex_rpc_channel_stats, bad_header)},
    {"bex_rpc_conn_failures_total", "Connections failed or timed out",
     offsetof(bex_rpc_channel_stats, conn_failures)},
    {"bex_rpc_failovers_total", "Retries sent to another endpoint",
     offsetof(bex_rpc_channel_stats, failovers)},
    {"bex_rpc_endpoints_down_total", "Endpoints that went from reachable to failed",
     offsetof(bex_rpc_channel_stats, endpoints_down)},
    {"bex_rpc_ladder_reconnects_total", "Recovery ladder step 1: reconnections",
     offsetof(bex_rpc_channel_stats, ladder_reconnects)},
    {"bex_rpc_ladder_replicas_total",
     "Recovery ladder step 2: reconnections failed, other replicas first",
     offsetof(bex_rpc_channel_stats, ladder_replicas)},
    {"bex_rpc_ladder_tcp_total", "Recovery ladder step 3: RDMA endpoints reached over TCP",
     offsetof(bex_rpc_channel_stats, ladder_tcp)},
    {"bex_rpc_ladder_recovered_total", "Reconnections (step 1) that worked",
     offsetof(bex_rpc_channel_stats, ladder_recovered)},
    {"bex_rpc_ladder_moves_total", "Calls moved off a failed connection by a ladder step",
     offsetof(bex_rpc_channel_stats, ladder_moves)},
    {"bex_rpc_rdma_retries_total", "RDMA probes from the TCP fallback",
     offsetof(bex_rpc_channel_stats, rdma_retries)},
    {"bex_rpc_rdma_restored_total", "RDMA probes that worked: endpoints back on RDMA",
     offsetof(bex_rpc_channel_stats, rdma_restored)},
};

static const struct bex__prom_ctr ep_ctrs[] = {
    {"bex_rpc_endpoint_attempts_total", "Attempts sent to the endpoint",
     offsetof(bex_rpc_endpoint_stats, attempts)},
    {"bex_rpc_endpoint_answers_total", "Answers received from the endpoint",
     offsetof(bex_rpc_endpoint_stats, answers)},
    {"bex_rpc_endpoint_failures_total", "Attempts to the endpoint that failed or timed out",
     offsetof(bex_rpc_endpoint_stats, failures)},
    {"bex_rpc_endpoint_conn_failures_total", "Connections to the endpoint that failed",
     offsetof(bex_rpc_endpoint_stats, conn_failures)},
    {"bex_rpc_endpoint_tcp_answers_total", "Answers over the recovery ladder's TCP fallback",
     offsetof(bex_rpc_endpoint_stats, tcp_answers)},
};

int bex_rpc_channel_prometheus(bex_rpc_channel *ch, char *buf, size_t cap)
{
    bex_rpc_channel_stats s;
    bex_rpc_channel_stats_get(ch, &s);
    pthread_mutex_lock(&ch->mu);
    uint64_t count = ch->hist.count, sum_ns = ch->hist.sum_ns;
    pthread_mutex_unlock(&ch->mu);
    char name[256];
    bex__prom_escape(ch->name, name, sizeof name);
    struct bex__prom o = {buf, cap, 0};
#define OUT(...) bex__prom_printf(&o, __VA_ARGS__)
    struct bex__prom_array one = {&s, 1, sizeof s, chan_label, name};
    bex__prom_counters(&o, chan_ctrs, ARRAY_SIZE(chan_ctrs), bex__prom_array_next, &one);
    OUT("# HELP bex_rpc_failures_total Calls completed with an error, by kind.\n"
        "# TYPE bex_rpc_failures_total counter\n");
    const struct {
        const char *kind;
        uint64_t v;
    } fk[] = {{"timeout", s.fail_timeout},
              {"connection", s.fail_conn},
              {"remote", s.fail_remote},
              {"cancelled", s.fail_cancel}};
    for (size_t i = 0; i < 4; i++)
        OUT("bex_rpc_failures_total{channel=\"%s\",kind=\"%s\"} %llu\n", name, fk[i].kind,
            (unsigned long long)fk[i].v);
    OUT("# HELP bex_rpc_latency_seconds Latency of completed calls.\n"
        "# TYPE bex_rpc_latency_seconds summary\n");
    const struct {
        const char *q;
        double us;
    } qs[] = {{"0.5", s.lat_p50_us}, {"0.99", s.lat_p99_us}, {"0.999", s.lat_p999_us}};
    for (size_t i = 0; i < 3; i++)
        OUT("bex_rpc_latency_seconds{channel=\"%s\",quantile=\"%s\"} %.9g\n", name, qs[i].q,
            qs[i].us / 1e6);
    OUT("bex_rpc_latency_seconds_sum{channel=\"%s\"} %.9g\n", name, (double)sum_ns / 1e9);
    OUT("bex_rpc_latency_seconds_count{channel=\"%s\"} %llu\n", name, (unsigned long long)count);
    /* per endpoint (the list as it is now) */
    bex_rpc_endpoint_stats es[64];
    size_t ne = bex_rpc_channel_endpoint_stats(ch, es, 64);
    if (ne > 64)
        ne = 64; /* a longer list is cut: bex_rpc_channel_endpoint_stats has it all */
    struct bex__prom_array eps = {es, ne, sizeof es[0], ep_label, name};
    bex__prom_counters(&o, ep_ctrs, ARRAY_SIZE(ep_ctrs), bex__prom_array_next, &eps);
    OUT("# HELP bex_rpc_endpoint_ladder_step Recovery ladder step of the endpoint (0 ok, "
        "1 reconnecting, 2 other replicas first, 3 over TCP).\n"
        "# TYPE bex_rpc_endpoint_ladder_step gauge\n");
    for (size_t i = 0; i < ne; i++) {
        char ip[BEX_ADDR_STRLEN], loc[160];
        bex_addr_format(&es[i].addr, false, ip, sizeof ip);
        bex__prom_escape(es[i].locality, loc, sizeof loc);
        OUT("bex_rpc_endpoint_ladder_step{channel=\"%s\",endpoint=\"%s:%u\",locality=\"%s\"} "
            "%u\n",
            name, ip, bex_addr_port(&es[i].addr), loc, es[i].ladder);
    }
#undef OUT
    return o.n > INT32_MAX ? INT32_MAX : (int)o.n;
}
