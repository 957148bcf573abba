/* SPDX-License-Identifier: Apache-2.0 */
/* The PS client: a request's keys split by shard, one sub-request per
 * shard, all out at once; the request completes when the last sub-request
 * does. Each sub-request carries the request's deadline, so the request
 * completes by then too.
 *
 * Fetch: one directory-mode channel per shard; the directory picks the
 * replica (nearest healthy) and the channel fails over to another.
 * Push: one sub-request per replica of each shard (BEX_PS_PUSH_PRIMARY:
 * per shard, to its primary, the first replica listed), each on a channel of
 * that replica alone, so that a retry after a lost answer goes to the same
 * server with the same (client id, sequence) and its dedup window applies
 * it once. The Push channels follow the directory (its generation): a
 * replica keeps its channel while it is listed; the channel of one the
 * directory no longer lists is retired once nothing is out on it and
 * nothing kept for it (push_sweep), so that a directory whose replicas
 * change address cannot grow the client without bound.
 *
 * A Fetch is a read: a sub-request that failed for its connection, came
 * back in doubt (-EIO) or was refused for now is issued again on its
 * shard's channel by the retry thread (a pause later, within the
 * deadline), from the keys the request kept: its channel's attempts may
 * all have gone to a replica that died while the shard's other one was
 * held back by the directory (a quarantine's one probe out).
 * bex_ps_fetch_into's parts (client_mem.c) go on the same queue: an entry
 * is a struct bex__ps_retry, whose fn sends its part again. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/cfg.h"
#include "common/list.h"
#include "bex/ps.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"

#define MAX_SHARDS 4096u
/* Channels of replicas gone from the directory that still keep Pushes (or
 * have calls out): past these, the longest gone one's are dropped. */
#define GONE_MAX 8u

/* A Push channel: one replica's. */
struct pch {
    bex_dir_replica r;
    bex_rpc_channel *ch;
    struct bex__ps_krep *kr; /* the Pushes kept for it */
    struct bex__list l;      /* in c->all, or c->dead */
    _Atomic uint32_t out;    /* holders of ch: Push parts, calls (taken under c->mu) */
    uint64_t gone;           /* 0: listed; else when it left the lists (c->gone_tick) */
    bool mark, busy;         /* push_mark's; push_sweep's: a resend out, passed over */
};

struct shard_reps {
    size_t n;
    struct pch **r;
};

struct bex_ps_client {
    bex_ctx *ctx;
    bex_dir *dir;
    char svc[BEX_DIR_NAME_MAX + 1];
    char loc[BEX_DIR_LOCALITY_MAX + 1];
    bool has_loc;
    uint32_t n_shards;
    uint32_t timeout_ms, attempt_timeout_ms, connect_timeout_ms;
    uint32_t max_attempts, budget_burst, budget_permille; /* the channels' (0: default) */
    uint32_t push_mode;                                   /* BEX_PS_PUSH_* */
    bex_rpc_channel **ch;        /* Fetch: a directory-mode channel per shard */
    pthread_mutex_t mu;          /* the Push channels below */
    uint64_t gen;                /* the directory generation push follows */
    struct shard_reps *push;     /* per shard (NULL until the first Push) */
    struct bex__list all;        /* struct pch.l: every Push channel the client has */
    uint64_t n_pch;              /* the Push channels the client has (all and dead) */
    uint64_t gone_tick;          /* channels that left the lists, counted */
    size_t n_gone;               /* those of all not listed now */
    struct bex__list dead;       /* struct pch.l retired: for the retry thread to destroy */
    bex_ps_client_stats retired; /* the counters of channels destroyed */
    /* A Push's id, the same at every replica (a restarted replica's
     * catch-up tells by it which Pushes its peer applied): this client's
     * random id and a sequence per Push, and its random token: the
     * replicas key their dedup record by (id, token), so a peer that
     * learns the id alone cannot touch it (docs/security.md, "Dedup keys and Push ids"). */
    uint64_t push_client, push_tok[2];
    _Atomic uint64_t push_seq;
    /* BEX_PS_PUSH_PRIMARY: per shard, the replica (index into push[s])
     * taken for primary; Pushes, and Fetches of any mode, to send again
     * (retry_main), under mu */
    uint32_t *prim;
    _Atomic uint64_t *epoch; /* per shard: the primary's term its last answer gave (0: none) */
    struct bex__list rq; /* struct bex__ps_retry.rl, oldest first (one pause for all: in order) */
    uint64_t retry_ns;
    pthread_t rthr;
    pthread_cond_t rcv;
    bool rthr_on, rstop;
    struct bex__ps_keep keep; /* Pushes a replica failed, to send it again */
};

struct op;
struct sub {
    struct op *op;
    bex_rpc_channel *ch; /* NULL: a shard without replica */
    uint32_t shard, n;
    uint32_t *pos; /* the keys' places in the caller's arrays */
    uint32_t idx;  /* its place among the request's sub-requests */
    /* BEX_PS_PUSH_PRIMARY: its body kept to send again, until rt.end_ns
     * (a Fetch: sent again from op->keys until rt.end_ns) */
    uint8_t *copy;
    size_t len;
    uint32_t pi; /* the replica index it went to */
    struct bex__ps_retry rt;
    int status;
    /* BEX_PS_PUSH_ALL, a shard of several replicas: its replica's kept
     * Pushes; the body it was sent from (shared: ps_internal.h, "a Push
     * body shared"), held until the request ends, kept without a copy
     * when its replica failed it while another took it */
    struct bex__ps_krep *kr;
    uint8_t *body;
    size_t blen;
    struct pch *pch; /* a Push's: its channel's, held until the request ends */
};

struct op {
    bex_ps_client *c;
    _Atomic uint32_t left; /* sub-requests not complete, + 1 while issuing */
    _Atomic int status;
    uint32_t method, table, dim;
    float *rows;          /* Fetch: the caller's */
    const uint64_t *keys; /* Fetch: a copy of the caller's (in the same block) */
    bex_ps_done_fn done;
    void *user;
    bex_ps_replica_result *res; /* Push: the caller's, res_cap entries */
    size_t res_cap;
    struct sub *subs; /* in the same block */
    size_t n_subs;
    uint64_t seq; /* a Push's id sequence */
};

static void *retry_main(void *arg);

/* The retry queue, empty, and its thread not started; no Push channel
 * (the thread destroys the retired ones). */
static void retry_init(bex_ps_client *c)
{
    bex__list_init(&c->all);
    bex__list_init(&c->dead);
    bex__list_init(&c->rq);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->rcv, &ca);
    pthread_condattr_destroy(&ca);
}

/* The retry thread, started on first need (a Fetch to send again) or
 * with the client (BEX_PS_PUSH_PRIMARY). Under c->mu. */
static int retry_thread(bex_ps_client *c)
{
    if (c->rthr_on)
        return 0;
    if (c->rstop || pthread_create(&c->rthr, NULL, retry_main, c))
        return -ENOMEM;
    c->rthr_on = true;
    return 0;
}

/* BEX_PS_PUSH_PRIMARY: the primary per shard, the retry thread. */
static int retry_start(bex_ps_client *c, uint32_t n)
{
    if (!(c->prim = calloc(n, sizeof *c->prim)) || !(c->epoch = calloc(n, sizeof *c->epoch)))
        return -ENOMEM;
    pthread_mutex_lock(&c->mu);
    int rc = retry_thread(c);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

static void retry_stop(bex_ps_client *c)
{
    pthread_mutex_lock(&c->mu);
    c->rstop = true;
    pthread_cond_signal(&c->rcv);
    bool on = c->rthr_on;
    pthread_mutex_unlock(&c->mu);
    if (on)
        pthread_join(c->rthr, NULL);
}

int bex_ps_client_create(bex_ctx *ctx, const bex_ps_client_config *cfg, bex_ps_client **out)
{
    bex_ps_client_config taken;
    BEX__CFG_TAKE(cfg, taken);
    if (!ctx || !cfg || !cfg->dir || !out)
        return -EINVAL;
    const char *svc = cfg->service ? cfg->service : "ps";
    if (strlen(svc) > BEX_DIR_NAME_MAX ||
        (cfg->locality && strlen(cfg->locality) > BEX_DIR_LOCALITY_MAX))
        return -EINVAL;
    uint32_t n = cfg->n_shards;
    if (n == 0)
        while (n < MAX_SHARDS && bex_dir_replicas(cfg->dir, svc, n, NULL, 0) > 0)
            n++;
    if (n == 0 || n > MAX_SHARDS || cfg->push_mode > BEX_PS_PUSH_PRIMARY)
        return -EINVAL;
    /* the Push token must be unguessable: no weaker fallback */
    uint64_t tok[2];
    if (getrandom(tok, sizeof tok, 0) != sizeof tok)
        return -EIO;
    bex_ps_client *c = calloc(1, sizeof *c);
    if (!c)
        return -ENOMEM;
    c->ch = calloc(n, sizeof *c->ch);
    if (!c->ch) {
        free(c);
        return -ENOMEM;
    }
    pthread_mutex_init(&c->mu, NULL);
    retry_init(c);
    bex__ps_keep_init(&c->keep, ctx, &c->push_seq, cfg->push_resend_max, cfg->push_resend_bytes,
                      cfg->primary_retry_ms);
    c->ctx = ctx;
    c->dir = cfg->dir;
    snprintf(c->svc, sizeof c->svc, "%s", svc);
    if (cfg->locality) {
        snprintf(c->loc, sizeof c->loc, "%s", cfg->locality);
        c->has_loc = true;
    }
    while (!c->push_client)
        if (getrandom(&c->push_client, sizeof c->push_client, 0) != sizeof c->push_client)
            c->push_client = bex__ps_mix((uint64_t)(uintptr_t)c ^ (uint64_t)time(NULL));
    memcpy(c->push_tok, tok, sizeof tok);
    c->timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : 1000;
    c->attempt_timeout_ms = cfg->attempt_timeout_ms;
    c->connect_timeout_ms = cfg->connect_timeout_ms ? cfg->connect_timeout_ms : 1000;
    c->max_attempts = cfg->max_attempts;
    c->budget_burst = cfg->retry_budget_burst;
    c->budget_permille = cfg->retry_budget_permille;
    c->push_mode = cfg->push_mode;
    c->retry_ns = (uint64_t)(cfg->primary_retry_ms ? cfg->primary_retry_ms : 50) * 1000000ull;
    if (c->push_mode == BEX_PS_PUSH_PRIMARY && retry_start(c, n)) {
        bex_ps_client_destroy(c);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < n; i++) {
        bex_rpc_channel_config cc = {
            .dir = cfg->dir,
            .service = svc,
            .shard = i,
            .locality = cfg->locality,
            .name = "ps",
            .request_timeout_ms = c->timeout_ms,
            .attempt_timeout_ms = c->attempt_timeout_ms,
            .connect_timeout_ms = c->connect_timeout_ms,
            .max_attempts = c->max_attempts,
            .retry_budget_burst = c->budget_burst,
            .retry_budget_permille = c->budget_permille,
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

static void reps_free(struct shard_reps *sr, uint32_t n)
{
    if (!sr)
        return;
    for (uint32_t i = 0; i < n; i++)
        free(sr[i].r);
    free(sr);
}

void bex_ps_client_destroy(bex_ps_client *c)
{
    if (!c)
        return;
    retry_stop(c); /* its queue answered -ECANCELED; calls out end so too */
    bex__ps_keep_stop(&c->keep);
    for (uint32_t i = 0; i < c->n_shards; i++)
        bex_rpc_channel_destroy(c->ch[i]);
    for (int i = 0; i < 2; i++) {
        struct bex__list *n;
        while ((n = bex__list_first(i ? &c->dead : &c->all))) {
            bex__list_remove(n);
            struct pch *p = bex__list_entry(n, struct pch, l);
            bex_rpc_channel_destroy(p->ch);
            free(p);
        }
    }
    reps_free(c->push, c->n_shards);
    bex__ps_keep_free(&c->keep);
    pthread_cond_destroy(&c->rcv);
    free(c->prim);
    free((void *)c->epoch);
    pthread_mutex_destroy(&c->mu);
    free(c->ch);
    free(c);
}

static void stats_add(bex_ps_client_stats *o, const bex_rpc_channel_stats *st)
{
    o->calls += st->calls;
    o->ok += st->ok;
    o->failed += st->failed;
    o->attempts += st->attempts;
    o->retries += st->retries;
    o->retry_throttled += st->retry_throttled;
    o->failovers += st->failovers;
    o->conn_failures += st->conn_failures;
}

/* The channel of replica r, made on first need. Under c->mu. */
static struct pch *pch_of(bex_ps_client *c, const bex_dir_replica *r)
{
    struct bex__list *n;
    bex__list_foreach(n, &c->all)
    {
        struct pch *p = bex__list_entry(n, struct pch, l);
        if (bex_addr_equal(&p->r.addr, &r->addr) && p->r.transport == r->transport)
            return p;
    }
    struct pch *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->r = *r;
    bex_rpc_endpoint ep = {.addr = r->addr, .locality = r->locality, .transport = r->transport};
    bex_rpc_channel_config cc = {
        .endpoints = &ep,
        .n_endpoints = 1,
        .name = "ps-push",
        .request_timeout_ms = c->timeout_ms,
        .attempt_timeout_ms = c->attempt_timeout_ms,
        .connect_timeout_ms = c->connect_timeout_ms,
        .max_attempts = c->max_attempts,
        .retry_budget_burst = c->budget_burst,
        .retry_budget_permille = c->budget_permille,
    };
    if (bex_rpc_channel_create(c->ctx, &cc, &p->ch)) {
        free(p);
        return NULL;
    }
    if (!(p->kr = bex__ps_keep_rep(&c->keep, p->ch, &r->addr))) {
        bex_rpc_channel_destroy(p->ch);
        free(p);
        return NULL;
    }
    bex__list_push_tail(&c->all, &p->l);
    c->n_pch++;
    return p;
}

/* Which channels c->push lists (gone 0), and since when the others are not
 * (gone: c->gone_tick's then). Under c->mu. */
static void push_mark(bex_ps_client *c)
{
    struct bex__list *n;
    bex__list_foreach(n, &c->all) bex__list_entry(n, struct pch, l)->mark = false;
    for (uint32_t s = 0; s < c->n_shards; s++)
        for (size_t i = 0; i < c->push[s].n; i++)
            c->push[s].r[i]->mark = true;
    c->n_gone = 0;
    bex__list_foreach(n, &c->all)
    {
        struct pch *p = bex__list_entry(n, struct pch, l);
        if (p->mark)
            p->gone = 0;
        else if (c->n_gone++, !p->gone)
            p->gone = ++c->gone_tick;
    }
}

/* p (its kept Pushes' record freed), moved from c->all to the retry
 * thread to destroy (or to bex_ps_client_destroy, when that thread is not
 * there). Under c->mu. */
static void push_retire(bex_ps_client *c, struct pch *p)
{
    bex__list_remove(&p->l);
    c->n_gone--;
    p->kr = NULL;
    bex__list_push_tail(&c->dead, &p->l);
    if (retry_thread(c) == 0)
        pthread_cond_signal(&c->rcv);
}

/* The longest gone channel of c->all that nothing holds (not passed over
 * as busy), or NULL. Under c->mu. */
static struct pch *gone_oldest(bex_ps_client *c)
{
    struct pch *old = NULL;
    struct bex__list *n;
    bex__list_foreach(n, &c->all)
    {
        struct pch *p = bex__list_entry(n, struct pch, l);
        if (p->gone && !p->busy && !atomic_load(&p->out) && (!old || p->gone < old->gone))
            old = p;
    }
    return old;
}

/* The channels of replicas gone from the directory retired: each that
 * nothing holds and nothing is kept for; past GONE_MAX gone ones that
 * stay, the longest gone that nothing holds too, its kept Pushes dropped
 * (counted, logged). Under c->mu. */
static void push_sweep(bex_ps_client *c)
{
    struct bex__list *n, *nx;
    bex__list_foreach_safe(n, nx, &c->all)
    {
        struct pch *p = bex__list_entry(n, struct pch, l);
        p->busy = false;
        /* the count first: no lock taken for one that keeps Pushes */
        if (p->gone && !atomic_load(&p->out) && !bex__ps_keep_count(p->kr) &&
            bex__ps_keep_retire(&c->keep, p->kr, false))
            push_retire(c, p);
    }
    struct pch *old;
    while (c->n_gone > GONE_MAX && (old = gone_oldest(c)))
        if (bex__ps_keep_retire(&c->keep, old->kr, true))
            push_retire(c, old);
        else
            old->busy = true; /* a resend of it out: the next sweep's */
}

/* Make c->push follow the directory's replicas. Under c->mu. 0 or -ENOMEM
 * (the old lists kept). */
static int push_refresh(bex_ps_client *c)
{
    uint64_t g = bex_dir_generation(c->dir);
    if (c->push && g == c->gen) {
        if (c->n_gone)
            push_sweep(c);
        return 0;
    }
    struct shard_reps *nw = calloc(c->n_shards, sizeof *nw);
    if (!nw)
        return -ENOMEM;
    bex_dir_replica reps[BEX_PS_REPLICAS_MAX];
    for (uint32_t s = 0; s < c->n_shards; s++) {
        size_t nr = bex_dir_replicas(c->dir, c->svc, s, reps, BEX_PS_REPLICAS_MAX);
        if (nr > BEX_PS_REPLICAS_MAX)
            nr = BEX_PS_REPLICAS_MAX;
        if (!nr)
            continue;
        nw[s].r = calloc(nr, sizeof *nw[s].r);
        if (!nw[s].r) {
            reps_free(nw, c->n_shards);
            return -ENOMEM;
        }
        for (size_t i = 0; i < nr; i++) {
            struct pch *p = pch_of(c, &reps[i]);
            if (!p) {
                reps_free(nw, c->n_shards);
                return -ENOMEM;
            }
            nw[s].r[nw[s].n++] = p;
        }
    }
    reps_free(c->push, c->n_shards);
    c->push = nw;
    c->gen = g;
    push_mark(c);
    push_sweep(c);
    return 0;
}

void bex_ps_client_stats_get(bex_ps_client *c, bex_ps_client_stats *out)
{
    bex_rpc_channel_stats st;
    pthread_mutex_lock(&c->mu);
    /* the destroyed Push channels' counters: reap summed them with
     * stats_add, whose fields alone they hold */
    *out = c->retired;
    for (int i = 0; i < 2; i++) {
        struct bex__list *n;
        bex__list_foreach(n, i ? &c->dead : &c->all)
        {
            bex_rpc_channel_stats_get(bex__list_entry(n, struct pch, l)->ch, &st);
            stats_add(out, &st);
        }
    }
    out->push_channels = c->n_pch;
    pthread_mutex_unlock(&c->mu);
    for (uint32_t i = 0; i < c->n_shards; i++) {
        bex_rpc_channel_stats_get(c->ch[i], &st);
        stats_add(out, &st);
    }
    bex__ps_keep_stats(&c->keep, out);
}

/* A Push's parts ended: in each shard some replica took, a part a replica
 * failed so that it may take it later is kept for it (client_keep.c), in
 * the body it was sent from; a replica that took it sends its kept ones
 * now. The parts' holds of their bodies dropped. */
static void keep_settle(struct op *op)
{
    struct bex__ps_keep *k = &op->c->keep;
    for (size_t i = 0, j; i < op->n_subs; i = j) {
        struct sub *sb = &op->subs[i];
        bool ok = false;
        for (j = i; j < op->n_subs && op->subs[j].shard == sb->shard; j++)
            ok |= op->subs[j].status == 0 && op->subs[j].kr;
        for (size_t q = i; q < j && ok; q++) {
            struct sub *o = &op->subs[q];
            if (o->status == 0)
                bex__ps_keep_ok(k, o->kr);
            else if (o->kr && o->body && bex__ps_keepable(o->status))
                bex__ps_keep_add(k, o->kr, op->seq, o->body, o->blen);
        }
        for (size_t q = i; q < j; q++) {
            bex__ps_pbody_put(op->subs[q].body, op->subs[q].blen);
            op->subs[q].body = NULL;
        }
    }
}

/* sb holds p (a Push part's channel), the one it held before let go.
 * Under c->mu. */
static void push_hold(struct sub *sb, struct pch *p)
{
    atomic_fetch_add(&p->out, 1);
    bex__ps_client_push_put(sb->pch);
    sb->pch = p;
}

void bex__ps_client_push_put(void *hold)
{
    struct pch *p = hold;
    if (p)
        atomic_fetch_sub(&p->out, 1);
}

static void op_put(struct op *op)
{
    if (atomic_fetch_sub(&op->left, 1) != 1)
        return;
    if (op->method == BEX_PS_M_PUSH) {
        keep_settle(op);
        for (size_t i = 0; i < op->n_subs; i++)
            bex__ps_client_push_put(op->subs[i].pch);
    }
    op->done(atomic_load(&op->status), op->user);
    free(op);
}

static void op_fail(struct op *op, int status)
{
    int zero = 0;
    atomic_compare_exchange_strong(&op->status, &zero, status);
}

/* A sub-request ended with status (before done runs). */
static void sub_end(struct sub *sb, int status)
{
    struct op *op = sb->op;
    sb->status = status;
    if (op->res && sb->idx < op->res_cap)
        op->res[sb->idx].status = status;
    if (status)
        op_fail(op, status);
    op_put(op);
}

/* ---- BEX_PS_PUSH_PRIMARY: a Push sent again after a failover ---- */

static bool retryable(int st)
{
    /* -EIO (in doubt: sent, its answer lost) too: the id makes a resend safe */
    return st == -EPERM || st == -ESTALE || st == -EAGAIN || st == -EIO || st == -ECONNREFUSED ||
           st == -ECONNRESET || st == -ECONNABORTED || st == -EHOSTUNREACH || st == -ENETUNREACH ||
           st == -EPIPE || st == -ENOTCONN || st == -ETIMEDOUT || st == -ESHUTDOWN;
}

/* Queue rt, a part of shard that failed with status, to be sent again
 * (true); a Push's (push: the replica index pi it went to) primary taken
 * to be the next replica unless the answer was -EAGAIN; false when it may
 * not be (a Fetch: an answer of a primary's, -EPERM or -ESTALE, is not
 * its; with max_attempts 1 nothing is retried; a shard of one replica
 * fails fast). */
static bool retry_queue(bex_ps_client *c, struct bex__ps_retry *rt, uint32_t shard, int status,
                        bool push, uint32_t pi)
{
    uint64_t now = bex__rpc_now_ns();
    if (!retryable(status) ||
        (!push && (status == -EPERM || status == -ESTALE || c->max_attempts == 1)) ||
        now + c->retry_ns >= rt->end_ns)
        return false;
    /* a Fetch of a shard with one replica: its channel reconnected already
     * (the recovery ladder); the caller hears of the failure now */
    if (!push && bex_dir_replicas(c->dir, c->svc, shard, NULL, 0) < 2)
        return false;
    pthread_mutex_lock(&c->mu);
    bool ok = !c->rstop && retry_thread(c) == 0;
    if (ok) {
        if (push && status != -EAGAIN && c->prim[shard] == pi) {
            c->prim[shard]++;
            atomic_store(&c->epoch[shard], 0); /* the next primary's term is not known */
        }
        rt->at_ns = now + c->retry_ns;
        bex__list_push_tail(&c->rq, &rt->rl);
        pthread_cond_signal(&c->rcv);
    }
    pthread_mutex_unlock(&c->mu);
    return ok;
}

bool bex__ps_fetch_retry(bex_ps_client *c, struct bex__ps_retry *rt, uint32_t shard, int status)
{
    return retry_queue(c, rt, shard, status, false, 0);
}

static bool retry_later(bex_ps_client *c, struct sub *sb, int status)
{
    return retry_queue(c, &sb->rt, sb->shard, status, sb->op->method == BEX_PS_M_PUSH, sb->pi);
}

static void sub_done(int status, void *body, size_t len, void *user);
static uint8_t *sub_body(bex_ps_client *c, struct sub *sb, const uint64_t *keys, const float *grads,
                         uint64_t id_seq, size_t *len);

/* A Fetch's sb again on its shard's channel, until its deadline. */
static void resend_fetch(bex_ps_client *c, struct sub *sb)
{
    uint64_t now = bex__rpc_now_ns();
    size_t len;
    uint8_t *b = sub_body(c, sb, sb->op->keys, NULL, 0, &len);
    int rc = -ENOMEM;
    if (b) {
        bex_rpc_call_opts o = {.timeout_ms = bex__ps_retry_left_ms(&sb->rt, now)};
        if ((rc = bex_rpc_call(sb->ch, BEX_PS_SERVICE, BEX_PS_M_FETCH, b, len, &o, sub_done, sb,
                               NULL)))
            bex_rpc_free(b);
    }
    if (rc)
        sub_done(rc, NULL, 0, sb);
}

/* sb to the replica taken for primary now (the directory re-read). */
static void resend(bex_ps_client *c, struct sub *sb)
{
    if (sb->op->method == BEX_PS_M_FETCH) {
        resend_fetch(c, sb);
        return;
    }
    pthread_mutex_lock(&c->mu);
    int rc = push_refresh(c);
    size_t n = rc ? 0 : c->push[sb->shard].n;
    bex_rpc_channel *ch = NULL;
    if (n) {
        sb->pi = c->prim[sb->shard];
        ch = c->push[sb->shard].r[sb->pi % n]->ch;
        push_hold(sb, c->push[sb->shard].r[sb->pi % n]);
    }
    pthread_mutex_unlock(&c->mu);
    uint64_t now = bex__rpc_now_ns();
    uint8_t *b = ch ? bex_rpc_alloc(c->ctx, sb->len) : NULL;
    rc = !ch ? (rc ? rc : -EHOSTUNREACH) : b ? 0 : -ENOMEM;
    if (b) {
        memcpy(b, sb->copy, sb->len);
        bex__ps_put64(b + BEX__PS_HDR_LEN + BEX__PS_ID_LEN, atomic_load(&c->epoch[sb->shard]));
        bex_rpc_call_opts o = {.timeout_ms = bex__ps_retry_left_ms(&sb->rt, now)};
        if ((rc = bex_rpc_call(ch, BEX_PS_SERVICE, BEX_PS_M_PUSH, b, sb->len, &o, sub_done, sb,
                               NULL)))
            bex_rpc_free(b);
    }
    if (rc)
        sub_done(rc, NULL, 0, sb);
}

/* A sub-request's retry: sent again, or ended with status. */
static void sub_retry(bex_ps_client *c, struct bex__ps_retry *rt, int status)
{
    struct sub *sb = bex__list_entry(rt, struct sub, rt);
    if (status == 0) {
        resend(c, sb);
        return;
    }
    free(sb->copy);
    sb->copy = NULL;
    sub_end(sb, status);
}

/* The oldest queued (under c->mu), unlinked when due (else *at_ns its
 * time, NULL). */
static struct bex__ps_retry *retry_due(bex_ps_client *c, uint64_t *at_ns)
{
    struct bex__list *n = bex__list_first(&c->rq);
    if (!n)
        return NULL;
    struct bex__ps_retry *rt = bex__list_entry(n, struct bex__ps_retry, rl);
    *at_ns = rt->at_ns;
    if (rt->at_ns > bex__rpc_now_ns())
        return NULL;
    bex__list_remove(n);
    return rt;
}

/* The retired Push channels destroyed (under c->mu, released meanwhile):
 * nothing holds them, no call is out on them; their counters kept. */
static void reap(bex_ps_client *c)
{
    struct bex__list *n;
    while ((n = bex__list_first(&c->dead))) {
        bex__list_remove(n);
        struct pch *p = bex__list_entry(n, struct pch, l);
        bex_rpc_channel_stats st;
        bex_rpc_channel_stats_get(p->ch, &st);
        stats_add(&c->retired, &st);
        pthread_mutex_unlock(&c->mu);
        bex_rpc_channel_destroy(p->ch);
        free(p);
        pthread_mutex_lock(&c->mu);
        c->n_pch--;
    }
}

static void *retry_main(void *arg)
{
    bex_ps_client *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->rstop) {
        uint64_t at = 0;
        reap(c);
        struct bex__ps_retry *rt = retry_due(c, &at);
        if (rt) {
            pthread_mutex_unlock(&c->mu);
            rt->fn(c, rt, 0);
            pthread_mutex_lock(&c->mu);
        } else if (at) {
            struct timespec ts = {(time_t)(at / 1000000000ull), (long)(at % 1000000000ull)};
            pthread_cond_timedwait(&c->rcv, &c->mu, &ts);
        } else {
            pthread_cond_wait(&c->rcv, &c->mu);
        }
    }
    struct bex__list *n;
    while ((n = bex__list_first(&c->rq))) {
        struct bex__ps_retry *rt = bex__list_entry(n, struct bex__ps_retry, rl);
        bex__list_remove(n);
        pthread_mutex_unlock(&c->mu);
        rt->fn(c, rt, -ECANCELED);
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static void sub_done(int status, void *body, size_t len, void *user)
{
    struct sub *sb = user;
    struct op *op = sb->op;
    if (status == 0)
        status = bex__ps_check_resp(op->method, body, len, op->table, sb->n, op->dim);
    if (sb->copy && status == 0 && bex__ps_resp_epoch(body, len))
        atomic_store(&op->c->epoch[sb->shard], bex__ps_resp_epoch(body, len));
    if (status && (sb->copy || op->keys) && retry_later(op->c, sb, status)) {
        bex_rpc_free(body);
        return;
    }
    free(sb->copy);
    sb->copy = NULL;
    if (status == 0 && op->method == BEX_PS_M_FETCH) {
        const uint8_t *p = (const uint8_t *)body + BEX__PS_HDR_LEN;
        for (uint32_t i = 0; i < sb->n; i++) {
            float *row = op->rows + (size_t)sb->pos[i] * op->dim;
            for (uint32_t d = 0; d < op->dim; d++, p += 4)
                row[d] = bex__ps_getf(p);
        }
    }
    bex_rpc_free(body);
    sub_end(sb, status);
}

/* The count of keys per shard in *cnt (calloc'd), or -E2BIG when a
 * shard's sub-request or its answer would not fit a body. */
static int shard_counts(bex_ps_client *c, uint32_t method, uint32_t dim, const uint64_t *keys,
                        size_t n, uint32_t **out)
{
    size_t ns = c->n_shards;
    uint32_t *cnt = calloc(ns, sizeof *cnt);
    if (!cnt)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        cnt[bex_ps_key_shard(keys[i], c->n_shards)]++;
    for (size_t s = 0; s < ns; s++)
        if (bex__ps_req_len(method, cnt[s], dim) +
                    (method == BEX_PS_M_PUSH ? BEX__PS_ID_LEN + BEX__PS_EPOCH_LEN : 0) >
                BEX_PS_BODY_MAX ||
            (size_t)BEX__PS_HDR_LEN + 4 * (size_t)cnt[s] * dim > BEX_PS_BODY_MAX) {
            free(cnt);
            return -E2BIG;
        }
    *out = cnt;
    return 0;
}

/* Shard s's subs from op->subs[k] on (a Fetch's one, a Push's one per
 * replica, or one without a channel when it has none), with their
 * results' first state; returns the next k. Push: under c->mu. */
static size_t shard_subs(bex_ps_client *c, struct op *op, size_t s, uint32_t cnt, uint32_t *pos,
                         size_t k, bool push, bex_ps_replica_result *res, size_t res_cap)
{
    size_t nr = push ? c->push[s].n : 1;
    size_t first = push && c->prim && nr ? c->prim[s] % nr : 0; /* primary mode: one */
    for (size_t r = first; r < (nr ? nr : 1) && (r == first || !c->prim); r++, k++) {
        struct sub *sb = &op->subs[k];
        *sb = (struct sub){.op = op,
                           .shard = (uint32_t)s,
                           .n = cnt,
                           .pos = pos,
                           .idx = (uint32_t)k,
                           .pi = (uint32_t)r};
        sb->ch = push ? (nr ? c->push[s].r[r]->ch : NULL) : c->ch[s];
        if (push && nr)
            push_hold(sb, c->push[s].r[r]);
        if (push && !c->prim && nr > 1)
            sb->kr = c->push[s].r[r]->kr;
        if (res && k < res_cap) {
            res[k] = (bex_ps_replica_result){.shard = (uint32_t)s, .status = -EINPROGRESS};
            if (push && nr)
                res[k].addr = c->push[s].r[r]->r.addr;
        }
    }
    return k;
}

/* sb's request encoded (*len bytes, from bex_rpc_alloc; a shared body,
 * bex__ps_pbody_alloc, when sb->kr), or NULL. */
static uint8_t *sub_body(bex_ps_client *c, struct sub *sb, const uint64_t *keys, const float *grads,
                         uint64_t id_seq, size_t *len)
{
    struct op *op = sb->op;
    uint32_t method = op->method;
    bool push = method == BEX_PS_M_PUSH;
    uint32_t table = op->table, dim = op->dim;
    struct bex__ps_hdr h = {.table = table, .n = sb->n, .dim = dim};
    if (push)
        h = (struct bex__ps_hdr){.table = table,
                                 .n = sb->n,
                                 .dim = dim,
                                 .flags = BEX__PS_F_ID,
                                 .id_client = c->push_client,
                                 .id_seq = id_seq,
                                 .id_tok = {c->push_tok[0], c->push_tok[1]}};
    if (push && c->prim) {
        /* the term the client knows (0: none yet): another primary's refuses */
        h.flags |= BEX__PS_F_EPOCH;
        h.epoch = atomic_load(&c->epoch[sb->shard]);
    }
    *len = bex__ps_req_len(method, sb->n, dim) + (push ? BEX__PS_ID_LEN : 0) +
           ((h.flags & BEX__PS_F_EPOCH) ? BEX__PS_EPOCH_LEN : 0);
    uint8_t *b = sb->kr ? bex__ps_pbody_alloc(c->ctx, *len) : bex_rpc_alloc(c->ctx, *len);
    if (!b)
        return NULL;
    bex__ps_hdr_put(b, &h);
    uint8_t *p = b + bex__ps_keys_off(&h);
    for (uint32_t j = 0; j < sb->n; j++, p += 8)
        bex__ps_put64(p, keys[sb->pos[j]]);
    if (push)
        for (uint32_t j = 0; j < sb->n; j++) {
            const float *g = grads + (size_t)sb->pos[j] * dim;
            for (uint32_t d = 0; d < dim; d++, p += 4)
                bex__ps_putf(p, g[d]);
        }
    return b;
}

/* sb's request encoded and called; a failure ends sb at once. */
static void send_sub(bex_ps_client *c, struct sub *sb, const uint64_t *keys, const float *grads,
                     uint64_t id_seq, const bex_rpc_call_opts *opts)
{
    struct op *op = sb->op;
    uint32_t method = op->method;
    bool push = method == BEX_PS_M_PUSH;
    if (!sb->ch) {
        sub_end(sb, -EHOSTUNREACH);
        return;
    }
    size_t len;
    uint8_t *b = sub_body(c, sb, keys, grads, id_seq, &len);
    if (!b) {
        sub_end(sb, -ENOMEM);
        return;
    }
    if (sb->kr) { /* held: kept, without a copy, if its replica fails it */
        sb->body = b;
        sb->blen = len;
        int rc = bex__ps_pbody_call(sb->ch, method, b, len, opts, sub_done, sb);
        if (rc)
            sub_done(rc, NULL, 0, sb);
        return;
    }
    if (push && c->prim && (sb->copy = malloc(len))) {
        memcpy(sb->copy, b, len); /* to send again after a failover */
        sb->len = len;
        sb->rt.end_ns = bex__rpc_now_ns() + (uint64_t)opts->timeout_ms * 1000000ull;
    }
    int rc = bex_rpc_call(sb->ch, BEX_PS_SERVICE, method, b, len, opts, sub_done, sb, NULL);
    if (rc) {
        bex_rpc_free(b);
        sub_done(rc, NULL, 0, sb);
    }
}

/* op's sub-requests sent (a Fetch's with its deadline, to send again),
 * then its issuing guard dropped: done may run here. */
static void send_all(bex_ps_client *c, struct op *op, size_t n_subs, const uint64_t *keys,
                     const float *grads, uint64_t id_seq)
{
    bex_rpc_call_opts opts = {.timeout_ms = c->timeout_ms};
    uint64_t end_ns = op->keys ? bex__rpc_now_ns() + (uint64_t)c->timeout_ms * 1000000ull : 0;
    op->n_subs = n_subs;
    op->seq = id_seq;
    for (size_t i = 0; i < n_subs; i++) {
        op->subs[i].rt.fn = sub_retry;
        if (end_ns)
            op->subs[i].rt.end_ns = end_ns;
        send_sub(c, &op->subs[i], keys, grads, id_seq, &opts);
    }
    op_put(op);
}

static int request(bex_ps_client *c, uint32_t method, uint32_t table, uint32_t dim,
                   const uint64_t *keys, size_t n, float *rows, const float *grads,
                   bex_ps_replica_result *res, size_t res_cap, size_t *n_res, uint64_t seq,
                   bex_ps_done_fn done, void *user)
{
    if (!c || !done || dim == 0 || dim > BEX_PS_DIM_MAX || (n && !keys) || n > BEX_PS_KEYS_MAX ||
        (n && method == BEX_PS_M_FETCH && !rows) || (n && method == BEX_PS_M_PUSH && !grads) ||
        (res_cap && !res))
        return -EINVAL;
    size_t ns = c->n_shards;
    uint32_t *cnt;
    int err = shard_counts(c, method, dim, keys, n, &cnt);
    if (err)
        return err;
    bool push = method == BEX_PS_M_PUSH;
    if (push)
        pthread_mutex_lock(&c->mu);
    int rc = push ? push_refresh(c) : 0;
    /* the sub-requests: Fetch one per shard with keys, Push one per
     * replica of such a shard (one without replica: one that fails) */
    size_t n_subs = 0;
    for (size_t s = 0; s < ns && !rc; s++)
        if (cnt[s])
            n_subs += push && c->push[s].n && !c->prim ? c->push[s].n : 1;
    struct op *op = NULL;
    size_t nk = push ? 0 : n; /* a Fetch's keys kept, to send it again */
    if (!rc &&
        !(op = calloc(1, sizeof *op + n_subs * sizeof(struct sub) + nk * 8 + (n ? n : 1) * 4)))
        rc = -ENOMEM;
    if (rc) {
        if (push)
            pthread_mutex_unlock(&c->mu);
        free(cnt);
        return rc;
    }
    *op = (struct op){.c = c,
                      .method = method,
                      .table = table,
                      .dim = dim,
                      .rows = rows,
                      .done = done,
                      .user = user,
                      .res = res,
                      .res_cap = res_cap,
                      .subs = (struct sub *)(op + 1)};
    uint64_t *kc = (uint64_t *)(op->subs + n_subs);
    uint32_t *pos = (uint32_t *)(kc + nk);
    op->keys = nk ? memcpy(kc, keys, nk * 8) : NULL;
    /* each shard's key places, then its subs (sharing them) */
    uint32_t *at = calloc(ns, sizeof *at);
    size_t k = 0;
    uint32_t off = 0;
    if (!at) {
        if (push)
            pthread_mutex_unlock(&c->mu);
        free(cnt);
        free(op);
        return -ENOMEM;
    }
    for (size_t s = 0; s < ns; s++) {
        at[s] = off;
        off += cnt[s];
        if (cnt[s])
            k = shard_subs(c, op, s, cnt[s], pos + at[s], k, push, res, res_cap);
    }
    if (push)
        pthread_mutex_unlock(&c->mu);
    for (size_t i = 0; i < n; i++) {
        uint32_t s = bex_ps_key_shard(keys[i], c->n_shards);
        pos[at[s]++] = (uint32_t)i;
    }
    free(at);
    free(cnt);
    if (n_res)
        *n_res = push ? n_subs : 0;
    atomic_store(&op->left, (uint32_t)n_subs + 1);
    uint64_t id_seq = push && !seq ? atomic_fetch_add(&c->push_seq, 1) + 1 : seq;
    send_all(c, op, n_subs, keys, grads, id_seq);
    return 0;
}

int bex_ps_fetch(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                 float *rows, bex_ps_done_fn done, void *user)
{
    return request(c, BEX_PS_M_FETCH, table, dim, keys, n, rows, NULL, NULL, 0, NULL, 0, done,
                   user);
}

int bex_ps_push(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                const float *grads, bex_ps_done_fn done, void *user)
{
    return request(c, BEX_PS_M_PUSH, table, dim, keys, n, NULL, grads, NULL, 0, NULL, 0, done,
                   user);
}

int bex_ps_push_report(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                       size_t n, const float *grads, bex_ps_replica_result *res, size_t cap,
                       size_t *n_res, bex_ps_done_fn done, void *user)
{
    return request(c, BEX_PS_M_PUSH, table, dim, keys, n, NULL, grads, res, cap, n_res, 0, done,
                   user);
}

uint64_t bex_ps_push_next_seq(bex_ps_client *c)
{
    return c ? atomic_fetch_add(&c->push_seq, 1) + 1 : 0;
}

int bex_ps_push_seq(bex_ps_client *c, uint64_t seq, uint32_t table, uint32_t dim,
                    const uint64_t *keys, size_t n, const float *grads, bex_ps_replica_result *res,
                    size_t cap, size_t *n_res, bex_ps_done_fn done, void *user)
{
    if (!seq)
        return -EINVAL;
    return request(c, BEX_PS_M_PUSH, table, dim, keys, n, NULL, grads, res, cap, n_res, seq, done,
                   user);
}

/* The blocking forms wait with the RPC layer's waiter (one call waited for). */
static void sync_done(int status, void *user)
{
    bex__rpc_wait_done(status, NULL, 0, user);
}

static int wait_for(struct bex__rpc_wait *w, int rc)
{
    if (rc)
        return rc; /* not started: nothing to wait for */
    void *body;
    size_t len;
    return bex__rpc_wait(w, &body, &len);
}

int bex_ps_fetch_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                      size_t n, float *rows)
{
    struct bex__rpc_wait w = BEX__RPC_WAIT_INIT;
    return wait_for(&w, bex_ps_fetch(c, table, dim, keys, n, rows, sync_done, &w));
}

int bex_ps_push_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                     const float *grads)
{
    struct bex__rpc_wait w = BEX__RPC_WAIT_INIT;
    return wait_for(&w, bex_ps_push(c, table, dim, keys, n, grads, sync_done, &w));
}

int bex_ps_push_report_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                            size_t n, const float *grads, bex_ps_replica_result *res, size_t cap,
                            size_t *n_res)
{
    struct bex__rpc_wait w = BEX__RPC_WAIT_INIT;
    return wait_for(
        &w, bex_ps_push_report(c, table, dim, keys, n, grads, res, cap, n_res, sync_done, &w));
}

int bex_ps_push_seq_sync(bex_ps_client *c, uint64_t seq, uint32_t table, uint32_t dim,
                         const uint64_t *keys, size_t n, const float *grads,
                         bex_ps_replica_result *res, size_t cap, size_t *n_res)
{
    struct bex__rpc_wait w = BEX__RPC_WAIT_INIT;
    return wait_for(
        &w, bex_ps_push_seq(c, seq, table, dim, keys, n, grads, res, cap, n_res, sync_done, &w));
}

/* ---- for the calls on caller memory (client_mem.c) ---- */

bex_ctx *bex__ps_client_ctx(const bex_ps_client *c)
{
    return c->ctx;
}

uint32_t bex__ps_client_shards(const bex_ps_client *c)
{
    return c->n_shards;
}

uint32_t bex__ps_client_timeout(const bex_ps_client *c)
{
    return c->timeout_ms;
}

bex_rpc_channel *bex__ps_client_fetch_ch(const bex_ps_client *c, uint32_t shard)
{
    return c->ch[shard];
}

bool bex__ps_client_fetch_retries(const bex_ps_client *c)
{
    return c->max_attempts != 1;
}

int bex__ps_client_push_one(bex_ps_client *c, uint32_t shard, bex_rpc_channel **ch, bex_addr *addr,
                            struct bex__ps_hdr *h, void **hold)
{
    pthread_mutex_lock(&c->mu);
    int rc = push_refresh(c);
    if (rc == 0 && c->push[shard].n != 1)
        rc = -ENOENT;
    if (rc == 0) {
        struct pch *p = c->push[shard].r[0];
        *ch = p->ch;
        *addr = p->r.addr;
        atomic_fetch_add(&p->out, 1);
        *hold = p;
    }
    pthread_mutex_unlock(&c->mu);
    if (rc)
        return rc;
    h->flags = BEX__PS_F_ID;
    h->id_client = c->push_client;
    h->id_seq = atomic_fetch_add(&c->push_seq, 1) + 1;
    h->id_tok[0] = c->push_tok[0];
    h->id_tok[1] = c->push_tok[1];
    return 0;
}
