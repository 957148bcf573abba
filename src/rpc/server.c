/* SPDX-License-Identifier: Apache-2.0 */
/* RPC server: dispatch by (service, method), answers from any thread, the
 * dedup window of state-changing methods. */
#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cfg.h"
#include "common/hash.h"
#include "common/list.h"
#include "common/log.h"
#include "common/util.h"
#include "rpc/internal.h"
#include "sock/ctx_access.h"

struct method {
    uint32_t service, method, flags;
    bex_rpc_handler fn;
    void *user;
    /* under srv->mu: requests answered by the handler, those with an
     * error status, and the time from dispatch to the answer */
    uint64_t answered, errors;
    struct bex__rpc_hist *hist;
};

/* An accepted connection's life: OPEN -> CLOSING (we called
 * bex_sock_close: nothing more is sent, what arrives is dropped) ->
 * CLOSED (its on_close ran: s is gone). CLOSED is final. Changed only by
 * conn_move; conn_close is the one way to CLOSING. */
enum conn_state { C_OPEN, C_CLOSING, C_CLOSED };

/* Lines a connection logs once (c->said, bex__log_once). */
enum { CONN_SAID_MALFORMED = 1u << 0 };

/* One accepted socket. Referenced by the server's list until on_close and
 * by every request of it not answered yet. */
struct conn {
    struct bex_rpc_server *srv;
    bex_sock *s;
    int refs;
    enum conn_state state;
    uint32_t said; /* CONN_SAID_* (under srv->mu) */
    /* new client ids of a handler's dedup table it brought
     * (bex__rpc_req_conn_admit) */
    _Atomic uint32_t new_clients;
    uint32_t dc_new; /* new clients of the dedup window it brought (srv->mu) */
    /* the destination a DEST message gave for call dest_call's answer
     * (bex_rpc_call_into: one call per socket) */
    bool has_dest;
    uint64_t dest_call;
    struct bex__rpc_dest dest;
    struct bex__list lnode; /* the server's connections */
};

/* Dedup window slot of one sequence. */
enum { SLOT_EMPTY = 0, SLOT_PENDING, SLOT_DONE, SLOT_DONE_UNKEPT };
struct dslot {
    uint64_t seq;
    uint8_t state;
    int32_t status;
    uint32_t len;
    void *resp; /* malloc'd copy of the answer's body (SLOT_DONE) */
    /* SLOT_PENDING: the latest retry that arrived meanwhile (its connection,
     * referenced, and header): the first answer goes there too, since the
     * first request's connection may be the one that failed */
    struct conn *wc;
    struct bex__rpc_hdr wh;
};

struct dclient {
    uint64_t id;
    uint8_t tok[BEX__RPC_TOK_LEN]; /* with id, the key */
    uint64_t max_seq;              /* highest sequence seen of a WRITE */
    uint64_t touch_ns;             /* last seen */
    uint32_t pending;              /* SLOT_PENDING slots */
    struct dslot *slots;
    struct bex__list chain; /* a ring of the clients whose key hashes the same */
    struct bex__list lru;   /* the server's clients, most recent first */
};

struct bex_rpc_req {
    struct bex_rpc_server *srv;
    struct conn *c;
    struct bex__rpc_hdr h;
    bool write;
    size_t mi;         /* its method's index (the table is fixed once listening) */
    uint64_t start_ns; /* dispatched to the handler */
};

#define SPARE_REQS 16

struct bex_rpc_server {
    bex_ctx *ctx;
    struct bex__log *log;
    uint32_t window, max_clients, resp_max;
    /* a client is forgotten only after horizon_ns unseen with nothing
     * pending; new ones: new_rate a second (new_tat: the token bucket's
     * theoretical arrival time), new_per_conn per connection */
    uint64_t horizon_ns, new_tat;
    uint32_t new_rate, new_per_conn;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct method *methods;
    size_t n_methods;
    bex_listener *l;
    bool listening, destroyed;
    bool draining; /* bex_rpc_server_drain waits on cv for refs == 1 */
    struct bex__list conns;
    int refs; /* 1 until destroy + one per request not answered */
    /* answered requests' records kept for the next ones (under mu): no
     * allocation per request (issue 25 item 5) */
    struct bex_rpc_req *spare[SPARE_REQS];
    unsigned n_spare;
    struct bex__hmap dcs; /* dc_key -> the clients with that key */
    struct bex__list lru; /* dclient.lru */
    uint32_t n_clients;
    bex_rpc_server_stats st;
};

void *bex_rpc_alloc(bex_ctx *ctx, size_t len)
{
    if (!ctx || len > (size_t)INT32_MAX - BEX_RPC_HDR_LEN)
        return NULL;
    uint8_t *p = bex_sock_alloc(ctx, len + BEX_RPC_HDR_LEN);
    return p ? p + BEX_RPC_HDR_LEN : NULL;
}

void bex_rpc_free(void *body)
{
    if (body)
        bex_mem_free(bex__rpc_hdr_of(body));
}

int bex_rpc_server_create(bex_ctx *ctx, const bex_rpc_server_config *cfg, bex_rpc_server **out)
{
    bex_rpc_server_config c;
    BEX__CFG_TAKE(cfg, c);
    if (!ctx || !out || (cfg && cfg->dedup_new_per_sec > 1000000000u))
        return -EINVAL;
    struct bex_rpc_server *srv = calloc(1, sizeof(*srv));
    if (!srv)
        return -ENOMEM;
    srv->ctx = ctx;
    srv->log = bex__ctx_log(ctx);
    bex__list_init(&srv->conns);
    bex__list_init(&srv->lru);
    srv->window = cfg && cfg->dedup_window ? cfg->dedup_window : 256;
    srv->max_clients = cfg && cfg->dedup_clients ? cfg->dedup_clients : 1024;
    srv->resp_max = cfg && cfg->dedup_resp_max ? cfg->dedup_resp_max : 65536;
    srv->horizon_ns = (cfg && cfg->dedup_horizon_ms ? cfg->dedup_horizon_ms : 300000) * 1000000ull;
    srv->new_rate = cfg && cfg->dedup_new_per_sec ? cfg->dedup_new_per_sec : 1000;
    srv->new_per_conn = cfg && cfg->dedup_new_per_conn ? cfg->dedup_new_per_conn : 64;
    srv->refs = 1;
    pthread_mutex_init(&srv->mu, NULL);
    pthread_cond_init(&srv->cv, NULL);
    *out = srv;
    return 0;
}

int bex_rpc_server_register(bex_rpc_server *srv, uint32_t service, uint32_t method, uint32_t flags,
                            bex_rpc_handler fn, void *user)
{
    if (!srv || !fn || (flags & ~(uint32_t)BEX_RPC_METHOD_WRITE) || srv->listening ||
        service == BEX_RPC_SERVICE_PING)
        return -EINVAL;
    for (size_t i = 0; i < srv->n_methods; i++)
        if (srv->methods[i].service == service && srv->methods[i].method == method)
            return -EEXIST;
    struct bex__rpc_hist *h = calloc(1, sizeof(*h));
    struct method *m = h ? realloc(srv->methods, (srv->n_methods + 1) * sizeof(*m)) : NULL;
    if (!m) {
        free(h);
        return -ENOMEM;
    }
    m[srv->n_methods++] = (struct method){service, method, flags, fn, user, .hist = h};
    srv->methods = m;
    return 0;
}

/* Read-only once listening: no lock. A linear scan: servers register a
 * handful of methods. */
static const struct method *find_method(const struct bex_rpc_server *srv, uint32_t service,
                                        uint32_t method)
{
    for (size_t i = 0; i < srv->n_methods; i++)
        if (srv->methods[i].service == service && srv->methods[i].method == method)
            return &srv->methods[i];
    return NULL;
}

static void conn_put_locked(struct conn *c);

/* Empty a slot (under srv->mu, or at the server's end). */
static void slot_clear(struct dslot *sl)
{
    free(sl->resp);
    if (sl->wc)
        conn_put_locked(sl->wc);
    *sl = (struct dslot){0};
}

static void dc_free_slots(struct dclient *d, uint32_t window)
{
    for (uint32_t i = 0; i < window; i++)
        slot_clear(&d->slots[i]);
    free(d->slots);
}

static void srv_free(struct bex_rpc_server *srv)
{
    struct bex__list *pos, *tmp;
    bex__list_foreach_safe(pos, tmp, &srv->lru)
    {
        struct dclient *d = bex__list_entry(pos, struct dclient, lru);
        dc_free_slots(d, srv->window);
        free(d);
    }
    bex__hmap_free(&srv->dcs);
    while (srv->n_spare)
        free(srv->spare[--srv->n_spare]);
    for (size_t i = 0; i < srv->n_methods; i++)
        free(srv->methods[i].hist);
    free(srv->methods);
    pthread_mutex_destroy(&srv->mu);
    pthread_cond_destroy(&srv->cv);
    free(srv);
}

/* Under srv->mu. */
static void conn_put_locked(struct conn *c)
{
    if (--c->refs == 0)
        free(c);
}

/* ---- dedup window (under srv->mu) ---- */

/* The map's key of a client (its id and token, 20 bytes, folded): two
 * clients may share one, so the map's value is a chain. */
static uint64_t dc_key(uint64_t id, const uint8_t *tok)
{
    uint64_t t0, t1 = 0;
    memcpy(&t0, tok, 8);
    memcpy(&t1, tok + 8, 4);
    return (id ^ (t0 * 0xBF58476D1CE4E5B9ull) ^ (t1 << 17)) * 0x9E3779B97F4A7C15ull;
}

static void dc_evict(struct bex_rpc_server *srv, struct dclient *old)
{
    bex__list_remove(&old->lru);
    uint64_t key = dc_key(old->id, old->tok);
    struct dclient *next = bex__list_entry(old->chain.next, struct dclient, chain);
    bex__list_remove(&old->chain);
    if (bex__hmap_get(&srv->dcs, key) == old) {
        bex__hmap_del(&srv->dcs, key);
        /* into the slot just freed: cannot fail */
        if (next != old) {
            int rc = bex__hmap_put(&srv->dcs, key, next);
            assert(rc == 0);
            (void)rc;
        }
    }
    dc_free_slots(old, srv->window);
    free(old);
    srv->n_clients--;
}

/* The client of h's id and token in the ring of those whose key hashes
 * the same (head: the one the map holds, or NULL), or NULL. */
static struct dclient *dc_match(struct dclient *head, const struct bex__rpc_hdr *h)
{
    struct dclient *d = head;
    if (head)
        do {
            if (d->id == h->client_id && !memcmp(d->tok, h->tok, BEX__RPC_TOK_LEN))
                return d;
            d = bex__list_entry(d->chain.next, struct dclient, chain);
        } while (d != head);
    return NULL;
}

/* Whether a new client may come from c now (the per-second token bucket,
 * the connection's count); counted when it may. */
static bool dc_admit(struct bex_rpc_server *srv, struct conn *c, uint64_t now)
{
    uint64_t iv = 1000000000ull / srv->new_rate;
    if (srv->new_tat < now)
        srv->new_tat = now;
    if (srv->new_tat - now > (uint64_t)(srv->new_rate - 1) * iv || c->dc_new >= srv->new_per_conn)
        return false;
    srv->new_tat += iv;
    c->dc_new++;
    return true;
}

/* The record of the client (h's id and token), seen now. create (a
 * request on c): made when missing, if dc_admit allows and there is room
 * (the least recently seen client forgotten only when nothing of it is
 * pending and it was unseen for the horizon: its retries are over); else
 * NULL with *full set (-EAGAIN to the peer), or NULL (no memory). */
static struct dclient *dc_find(struct bex_rpc_server *srv, const struct bex__rpc_hdr *h,
                               struct conn *c, bool *full)
{
    uint64_t now = bex__rpc_now_ns();
    uint64_t key = dc_key(h->client_id, h->tok);
    struct dclient *head = bex__hmap_get(&srv->dcs, key), *d = dc_match(head, h);
    if (d) {
        bex__list_remove(&d->lru);
        bex__list_push_head(&srv->lru, &d->lru);
        d->touch_ns = now;
        return d;
    }
    if (!c)
        return NULL;
    struct dclient *old =
        bex__list_empty(&srv->lru) ? NULL : bex__list_entry(srv->lru.prev, struct dclient, lru);
    bool room = srv->n_clients < srv->max_clients ||
                (old && !old->pending && now - old->touch_ns >= srv->horizon_ns);
    if (!room || !dc_admit(srv, c, now)) {
        *full = true;
        return NULL;
    }
    if (srv->n_clients >= srv->max_clients) {
        dc_evict(srv, old);
        head = bex__hmap_get(&srv->dcs, key);
    }
    d = calloc(1, sizeof(*d));
    if (!d)
        return NULL;
    d->slots = calloc(srv->window, sizeof(*d->slots));
    if (!d->slots) {
        free(d);
        return NULL;
    }
    d->id = h->client_id;
    memcpy(d->tok, h->tok, BEX__RPC_TOK_LEN);
    d->touch_ns = now;
    bex__list_init(&d->chain);
    if (head) {
        bex__list_push_tail(&head->chain, &d->chain);
    } else if (bex__hmap_put(&srv->dcs, key, d) != 0) {
        free(d->slots);
        free(d);
        return NULL;
    }
    bex__list_push_head(&srv->lru, &d->lru);
    srv->n_clients++;
    return d;
}

/* What to do with a WRITE request. */
enum { DD_APPLY, DD_PENDING, DD_REPLAY, DD_STALE, DD_FULL, DD_NOMEM };

static int dedup_check(struct bex_rpc_server *srv, const struct bex__rpc_hdr *h, struct conn *c,
                       struct dslot *replay, struct dslot **pending)
{
    bool full = false;
    struct dclient *d = dc_find(srv, h, c, &full);
    if (!d)
        return full ? DD_FULL : DD_NOMEM;
    uint64_t w = srv->window;
    if (d->max_seq >= w && h->seq <= d->max_seq - w)
        return DD_STALE; /* older than the window: applied or not, we cannot tell */
    struct dslot *sl = &d->slots[h->seq % w];
    if (sl->seq == h->seq && sl->state != SLOT_EMPTY) {
        if (sl->state == SLOT_PENDING) {
            *pending = sl;
            return DD_PENDING;
        }
        if (sl->state == SLOT_DONE_UNKEPT)
            return DD_STALE;
        *replay = *sl;
        return DD_REPLAY;
    }
    /* a sequence the window does not hold: the slot's old occupant (if
     * any) is out of the window by now */
    if (sl->state == SLOT_PENDING)
        d->pending--;
    slot_clear(sl);
    *sl = (struct dslot){.seq = h->seq, .state = SLOT_PENDING};
    d->pending++;
    if (h->seq > d->max_seq)
        d->max_seq = h->seq;
    return DD_APPLY;
}

static int send_answer(struct bex_rpc_server *srv, struct conn *c, const struct bex__rpc_hdr *rq,
                       uint8_t kind, int status, void *body, size_t len);

static void dedup_record(struct bex_rpc_server *srv, const struct bex__rpc_hdr *h, int status,
                         const void *body, size_t len)
{
    struct dclient *d = dc_find(srv, h, NULL, NULL);
    if (!d)
        return; /* forgotten meanwhile */
    struct dslot *sl = &d->slots[h->seq % srv->window];
    if (sl->seq != h->seq || sl->state != SLOT_PENDING)
        return;
    d->pending--;
    if (sl->wc) {
        /* a retry waits for this answer: a copy goes to it */
        void *copy = bex_rpc_alloc(srv->ctx, len);
        if (copy) {
            if (len)
                memcpy(copy, body, len);
            if (!send_answer(srv, sl->wc, &sl->wh, BEX__RPC_RESPONSE, status, copy, len))
                srv->st.dup_replayed++;
        }
        conn_put_locked(sl->wc);
        sl->wc = NULL;
    }
    if (status == -EAGAIN || status == -EBUSY) {
        /* "not applied, try again" (the client retries these): a retry
         * must be applied, not answered from here */
        slot_clear(sl);
        return;
    }
    sl->status = status;
    sl->len = (uint32_t)len;
    sl->state = SLOT_DONE_UNKEPT;
    if (len <= srv->resp_max) {
        sl->resp = len ? malloc(len) : NULL;
        if (len && !sl->resp)
            return;
        if (len)
            memcpy(sl->resp, body, len);
        sl->state = SLOT_DONE;
    }
}

/* ---- a connection's state (under srv->mu) ---- */

static const char *const conn_names[] = {"OPEN", "CLOSING", "CLOSED"};

/* The one place c->state changes: each move is named in the debug log;
 * one our own code must never make asserts (the socket layer runs
 * on_close once, and only after bex_sock_close). */
static void conn_move(struct bex_rpc_server *srv, struct conn *c, enum conn_state to)
{
    enum conn_state from = c->state;
    assert((from == C_OPEN && to == C_CLOSING) || (from == C_CLOSING && to == C_CLOSED));
    c->state = to;
    if (srv->log && srv->log->level >= BEX_LOG_DEBUG)
        bex__log(srv->log, BEX_LOG_DEBUG, "rpc server: connection %p %s -> %s", (void *)c,
                 conn_names[from], conn_names[to]);
}

/* Close c's socket unless that was done: nothing more is sent on it. */
static void conn_close(struct bex_rpc_server *srv, struct conn *c)
{
    if (c->state != C_OPEN)
        return;
    conn_move(srv, c, C_CLOSING);
    bex_sock_close(c->s);
}

/* ---- sending answers ---- */

/* Send an answer (kind, status) to the request h on c: body is an RPC body
 * (or NULL: a header-only one is made). Under srv->mu. Frees body on
 * failure. */
static int send_answer(struct bex_rpc_server *srv, struct conn *c, const struct bex__rpc_hdr *rq,
                       uint8_t kind, int status, void *body, size_t len)
{
    if (!body) {
        body = bex_rpc_alloc(srv->ctx, 0);
        if (!body)
            return -ENOMEM;
        len = 0;
    }
    if (c->state != C_OPEN) {
        bex_rpc_free(body);
        return -EPIPE;
    }
    /* bex_rpc_call_into: the answer goes to the caller's destination, an
     * exposed buffer (RDMA) written whole, header first; one that does
     * not fit is refused with nothing written (the client checks too) */
    const struct bex__rpc_dest *d = NULL;
    if ((rq->flags & BEX__RPC_F_DEST) && c->has_dest && c->dest_call == rq->call_id)
        d = &c->dest;
    if (d && len > d->cap) {
        bex_rpc_free(body);
        if (!(body = bex_rpc_alloc(srv->ctx, 0)))
            return -ENOMEM;
        len = 0;
        kind = BEX__RPC_ERROR;
        status = -EMSGSIZE;
    }
    uint8_t *hdr = bex__rpc_hdr_of(body);
    bex__rpc_answer_encode(rq, kind, status, (uint32_t)len, hdr);
    int err;
    if (d && d->token && status != -EMSGSIZE) {
        bex_remote_buf rb = {.addr = d->addr,
                             .rkey = d->rkey,
                             .len = (uint32_t)(len + BEX_RPC_HDR_LEN),
                             .token = d->token};
        c->has_dest = false; /* the exposure takes one write */
        err = bex_sock_send_direct(c->s, hdr, len + BEX_RPC_HDR_LEN, &rb, NULL);
    } else {
        err = bex_sock_send(c->s, hdr, len + BEX_RPC_HDR_LEN, NULL);
    }
    if (err) {
        bex_rpc_free(body);
        return err;
    }
    srv->st.replies++;
    return 0;
}

int bex_rpc_reply(bex_rpc_req *req, int status, void *body, size_t len)
{
    return bex__rpc_reply_at(req, status, body, len, 0);
}

int bex__rpc_reply_at(bex_rpc_req *req, int status, void *body, size_t len, uint64_t now)
{
    if (!req)
        return -EINVAL;
    struct bex_rpc_server *srv = req->srv;
    if (status > 0 || status < -4095 || len > (size_t)INT32_MAX - BEX_RPC_HDR_LEN) {
        bex_rpc_free(body);
        status = -EINVAL; /* the caller still gets an answer */
        body = NULL;
        len = 0;
    }
    if (!body)
        len = 0;
    if (!now)
        now = bex__rpc_now_ns();
    pthread_mutex_lock(&srv->mu);
    struct method *m = &srv->methods[req->mi];
    m->answered++;
    m->errors += status != 0;
    bex__rpc_hist_add(m->hist, now - req->start_ns);
    if (req->write)
        dedup_record(srv, &req->h, status, body, len);
    int err = send_answer(srv, req->c, &req->h, BEX__RPC_RESPONSE, status, body, len);
    conn_put_locked(req->c);
    bool last = --srv->refs == 0;
    if (srv->draining)
        pthread_cond_broadcast(&srv->cv);
    if (!last && srv->n_spare < SPARE_REQS) {
        srv->spare[srv->n_spare++] = req;
        req = NULL;
    }
    pthread_mutex_unlock(&srv->mu);
    if (req) /* (kept for the next request: no call to free) */
        free(req);
    if (last)
        srv_free(srv);
    return err;
}

void bex_rpc_req_ids(const bex_rpc_req *req, uint64_t *client_id, uint64_t *seq)
{
    if (client_id)
        *client_id = req->h.client_id;
    if (seq)
        *seq = req->h.seq;
}

uint64_t bex__rpc_req_start_ns(const bex_rpc_req *req)
{
    return req->start_ns;
}

bool bex__rpc_req_conn_admit(const bex_rpc_req *req, uint32_t max)
{
    /* req holds a reference on its connection */
    uint32_t n = atomic_load_explicit(&req->c->new_clients, memory_order_relaxed);
    do {
        if (n >= max)
            return false;
    } while (!atomic_compare_exchange_weak_explicit(&req->c->new_clients, &n, n + 1,
                                                    memory_order_relaxed, memory_order_relaxed));
    return true;
}

/* ---- socket callbacks (I/O thread) ---- */

static void conn_refuse(struct bex_rpc_server *srv, struct conn *c, const char *why)
{
    /* once per connection: later messages of it are dropped unlogged */
    if (bex__log_first(&c->said, CONN_SAID_MALFORMED)) {
        srv->st.bad_header++;
        bex__log(srv->log, BEX_LOG_WARN,
                 "rpc server: malformed request header (%s): connection closed", why);
    }
    conn_close(srv, c);
}

/* A WRITE request's dedup outcome, under srv->mu: -1 to apply it, else it
 * was answered or parked here: 1 when buf is still the caller's to free,
 * 0 when the answer took it. */
static int write_dedup(struct bex_rpc_server *srv, struct conn *c, const struct bex__rpc_hdr *h,
                       void *body)
{
    struct dslot sl, *pend = NULL;
    switch (dedup_check(srv, h, c, &sl, &pend)) {
    case DD_APPLY:
        return -1;
    case DD_PENDING:
        /* the first one is being applied: not again; its answer goes
         * where it came from and to this retry (the latest one) */
        srv->st.dup_pending++;
        if (pend->wc)
            conn_put_locked(pend->wc);
        pend->wc = c;
        pend->wh = *h;
        c->refs++;
        return 1;
    case DD_REPLAY: {
        srv->st.dup_replayed++;
        void *copy = bex_rpc_alloc(srv->ctx, sl.len);
        if (!copy) {
            send_answer(srv, c, h, BEX__RPC_ERROR, -ENOMEM, body, 0);
            return 0;
        }
        if (sl.len)
            memcpy(copy, sl.resp, sl.len);
        send_answer(srv, c, h, BEX__RPC_RESPONSE, sl.status, copy, sl.len);
        return 1;
    }
    case DD_STALE:
        srv->st.stale++;
        send_answer(srv, c, h, BEX__RPC_ERROR, -ESTALE, body, 0);
        return 0;
    case DD_FULL:
        /* a new client id, refused rather than forgetting one whose
         * retries may still come: retriable */
        srv->st.clients_refused++;
        bex__log(srv->log, BEX_LOG_WARN,
                 "rpc server: a WRITE of a new client refused -EAGAIN (%u clients held, "
                 "%u new a second, %u a connection at most)",
                 srv->n_clients, srv->new_rate, srv->new_per_conn);
        send_answer(srv, c, h, BEX__RPC_ERROR, -EAGAIN, body, 0);
        return 0;
    default:
        send_answer(srv, c, h, BEX__RPC_ERROR, -ENOMEM, body, 0);
        return 0;
    }
}

/* The request in buf to m's handler; called under srv->mu, which it
 * releases. */
static void dispatch(struct bex_rpc_server *srv, struct conn *c, const struct bex__rpc_hdr *h,
                     const struct method *m, bool write, void *buf, size_t len)
{
    void *body = (uint8_t *)buf + BEX_RPC_HDR_LEN;
    /* the clock read before the record is filled, and the record filled
     * field by field: as one compound literal around the call, the
     * compiler kept two more copies of h on the stack (issue 25 item 5) */
    uint64_t start_ns = bex__rpc_now_ns();
    struct bex_rpc_req *req = srv->n_spare ? srv->spare[--srv->n_spare] : malloc(sizeof(*req));
    if (!req) {
        send_answer(srv, c, h, BEX__RPC_ERROR, -ENOMEM, body, 0);
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    req->srv = srv;
    req->c = c;
    req->h = *h;
    req->write = write;
    req->mi = (size_t)(m - srv->methods);
    req->start_ns = start_ns;
    c->refs++;
    srv->refs++;
    srv->st.requests++;
    pthread_mutex_unlock(&srv->mu);
    size_t blen = len - BEX_RPC_HDR_LEN;
    if (!blen) {
        bex_mem_free(buf);
        body = NULL;
    }
    m->fn(req, body, blen, m->user);
}

static void on_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct conn *c = user;
    struct bex_rpc_server *srv = c->srv;
    struct bex__rpc_hdr h;
    const char *why;
    pthread_mutex_lock(&srv->mu);
    if (c->state != C_OPEN) {
        pthread_mutex_unlock(&srv->mu);
        bex_mem_free(buf);
        return;
    }
    if (bex__rpc_hdr_decode(buf, len, &h, &why) ||
        (h.kind != BEX__RPC_REQUEST && h.kind != BEX__RPC_DEST)) {
        conn_refuse(srv, c, why ? why : "not a request");
        pthread_mutex_unlock(&srv->mu);
        bex_mem_free(buf);
        return;
    }
    if (h.kind == BEX__RPC_DEST) {
        /* where the answer to the request that follows goes */
        if (bex__rpc_dest_decode((uint8_t *)buf + BEX_RPC_HDR_LEN, &c->dest)) {
            conn_refuse(srv, c, "malformed destination");
        } else {
            c->has_dest = true;
            c->dest_call = h.call_id;
        }
        pthread_mutex_unlock(&srv->mu);
        bex_mem_free(buf);
        return;
    }
    if ((h.flags & BEX__RPC_F_DEST) && (!c->has_dest || c->dest_call != h.call_id)) {
        conn_refuse(srv, c, "a request for a destination not given");
        pthread_mutex_unlock(&srv->mu);
        bex_mem_free(buf);
        return;
    }
    void *body = (uint8_t *)buf + BEX_RPC_HDR_LEN;
    if (h.service == BEX_RPC_SERVICE_PING && h.method == 0) {
        /* the recovery ladder's probe: the answer is the proof */
        srv->st.pings++;
        send_answer(srv, c, &h, BEX__RPC_RESPONSE, 0, body, 0);
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    const struct method *m = find_method(srv, h.service, h.method);
    if (!m) {
        srv->st.no_method++;
        send_answer(srv, c, &h, BEX__RPC_ERROR, -ENOSYS, body, 0);
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    bool write = m->flags & BEX_RPC_METHOD_WRITE;
    if (write) {
        int r = write_dedup(srv, c, &h, body);
        if (r >= 0) {
            pthread_mutex_unlock(&srv->mu);
            if (r)
                bex_mem_free(buf);
            return;
        }
    }
    dispatch(srv, c, &h, m, write, buf, len);
}

static void on_error(bex_sock *s, int err, void *user)
{
    (void)err;
    struct conn *c = user;
    (void)s;
    pthread_mutex_lock(&c->srv->mu);
    conn_close(c->srv, c);
    pthread_mutex_unlock(&c->srv->mu);
}

static void on_close(bex_sock *s, void *user)
{
    (void)s;
    struct conn *c = user;
    struct bex_rpc_server *srv = c->srv;
    pthread_mutex_lock(&srv->mu);
    conn_move(srv, c, C_CLOSED);
    bex__list_remove(&c->lnode);
    pthread_cond_broadcast(&srv->cv);
    conn_put_locked(c);
    pthread_mutex_unlock(&srv->mu);
}

static const bex_sock_ops conn_ops = {
    .on_recv = on_recv,
    .on_error = on_error,
    .on_close = on_close,
};

static void on_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    struct bex_rpc_server *srv = user;
    struct conn *c = calloc(1, sizeof(*c));
    if (!c) {
        bex_sock_close(s);
        return;
    }
    c->srv = srv;
    c->s = s;
    c->refs = 1;
    bex__list_init(&c->lnode);
    pthread_mutex_lock(&srv->mu);
    if (srv->destroyed) {
        pthread_mutex_unlock(&srv->mu);
        free(c);
        bex_sock_close(s);
        return;
    }
    bex__list_push_head(&srv->conns, &c->lnode);
    srv->st.conns++;
    pthread_mutex_unlock(&srv->mu);
    /* on the I/O thread: takes effect at once */
    if (bex_sock_set_user(s, &conn_ops, c)) {
        /* cannot happen from a callback; keep the ladder honest anyway */
        bex_sock_close(s);
    }
}

int bex_rpc_server_listen(bex_rpc_server *srv, const bex_addr *addr)
{
    if (!srv || !addr || srv->listening)
        return -EINVAL;
    static const bex_listener_ops lops = {.on_accept = on_accept};
    srv->listening = true; /* the method table is fixed from here on */
    int err = bex_listen(srv->ctx, addr, &lops, srv, &srv->l);
    if (err) {
        srv->listening = false;
        return err;
    }
    return 0;
}

void bex_rpc_server_addr(const bex_rpc_server *srv, bex_addr *out)
{
    if (srv->l)
        bex_listener_addr(srv->l, out);
    else
        *out = (bex_addr){0};
}

void bex_rpc_server_stats_get(bex_rpc_server *srv, bex_rpc_server_stats *out)
{
    pthread_mutex_lock(&srv->mu);
    *out = srv->st;
    pthread_mutex_unlock(&srv->mu);
}

/* What bex_rpc_server_prometheus prints of one server, copied under its
 * lock. */
struct prom_snap {
    char name[256]; /* escaped */
    bex_rpc_server_stats st;
    size_t nm;
    struct method *ms;
    struct bex__rpc_hist *hs;
};

static void snap_label(const void *st, const void *arg, char *labels, size_t cap)
{
    (void)arg;
    const struct prom_snap *s =
        (const struct prom_snap *)((const char *)st - offsetof(struct prom_snap, st));
    snprintf(labels, cap, "server=\"%s\"", s->name);
}

/* Every server's methods, in order. */
struct method_iter {
    const struct prom_snap *sn;
    size_t n, k, j;
};

static const void *method_next(void *arg, const void **cur, char *labels, size_t cap)
{
    struct method_iter *it = arg;
    if (!*cur)
        it->k = it->j = 0;
    while (it->k < it->n && it->j >= it->sn[it->k].nm) {
        it->k++;
        it->j = 0;
    }
    if (it->k >= it->n)
        return NULL;
    const struct prom_snap *s = &it->sn[it->k];
    const struct method *m = &s->ms[it->j++];
    snprintf(labels, cap, "server=\"%s\",service=\"%u\",method=\"%u\"", s->name, m->service,
             m->method);
    *cur = m;
    return m;
}

static const struct bex__prom_ctr server_ctrs[] = {
    {"bex_rpc_server_requests_total", "Requests dispatched to handlers",
     offsetof(bex_rpc_server_stats, requests)},
    {"bex_rpc_server_replies_total", "Answers sent", offsetof(bex_rpc_server_stats, replies)},
    {"bex_rpc_server_no_method_total", "Requests for an unregistered method",
     offsetof(bex_rpc_server_stats, no_method)},
    {"bex_rpc_server_bad_header_total", "Connections closed for a malformed header",
     offsetof(bex_rpc_server_stats, bad_header)},
    {"bex_rpc_server_dup_replayed_total", "WRITE retries answered with the first answer",
     offsetof(bex_rpc_server_stats, dup_replayed)},
    {"bex_rpc_server_dup_pending_total", "WRITE retries while the first was not answered",
     offsetof(bex_rpc_server_stats, dup_pending)},
    {"bex_rpc_server_stale_total", "WRITE retries past the dedup window",
     offsetof(bex_rpc_server_stats, stale)},
    {"bex_rpc_server_clients_refused_total",
     "WRITE requests of a new client id refused (-EAGAIN): dedup table full or past a rate",
     offsetof(bex_rpc_server_stats, clients_refused)},
    {"bex_rpc_server_conns_total", "Connections accepted", offsetof(bex_rpc_server_stats, conns)},
};

static const struct bex__prom_ctr method_ctrs[] = {
    {"bex_rpc_server_method_answered_total", "Requests of the method its handler answered",
     offsetof(struct method, answered)},
    {"bex_rpc_server_method_errors_total", "Requests of the method answered with an error status",
     offsetof(struct method, errors)},
};

int bex_rpc_server_prometheus(bex_rpc_server *const *srvs, const char *const *names, size_t n,
                              char *buf, size_t cap)
{
    if ((n && !srvs) || (!buf && cap))
        return -EINVAL;
    for (size_t i = 0; i < n; i++)
        if (!srvs[i])
            return -EINVAL;
    if (cap)
        buf[0] = 0;
    struct prom_snap *sn = calloc(n ? n : 1, sizeof(*sn));
    int rc = sn ? 0 : -ENOMEM;
    for (size_t k = 0; k < n && !rc; k++) {
        bex_rpc_server *srv = srvs[k];
        size_t nm = srv->n_methods; /* fixed once listening */
        sn[k].ms = calloc(nm ? nm : 1, sizeof(*sn[k].ms));
        sn[k].hs = calloc(nm ? nm : 1, sizeof(*sn[k].hs));
        if (!sn[k].ms || !sn[k].hs) {
            rc = -ENOMEM;
            break;
        }
        bex__prom_escape(names && names[k] ? names[k] : "default", sn[k].name, sizeof sn[k].name);
        pthread_mutex_lock(&srv->mu);
        sn[k].st = srv->st;
        sn[k].nm = nm;
        for (size_t i = 0; i < nm; i++) {
            sn[k].ms[i] = srv->methods[i];
            sn[k].hs[i] = *srv->methods[i].hist;
        }
        pthread_mutex_unlock(&srv->mu);
    }
    struct bex__prom o = {buf, cap, 0};
    /* a metric family's samples together, every server's */
    struct bex__prom_array sa = {sn ? &sn[0].st : NULL, n, sizeof *sn, snap_label, NULL};
    if (!rc)
        bex__prom_counters(&o, server_ctrs, ARRAY_SIZE(server_ctrs), bex__prom_array_next, &sa);
    struct method_iter mi = {sn, n, 0, 0};
    if (!rc)
        bex__prom_counters(&o, method_ctrs, ARRAY_SIZE(method_ctrs), method_next, &mi);
    if (!rc)
        bex__prom_printf(&o, "# HELP bex_rpc_server_latency_seconds Time from a request's "
                             "dispatch to its handler's answer.\n"
                             "# TYPE bex_rpc_server_latency_seconds histogram\n");
    for (size_t k = 0; k < n && !rc; k++)
        for (size_t j = 0; j < sn[k].nm; j++) {
            char lb[320];
            snprintf(lb, sizeof lb, "server=\"%s\",service=\"%u\",method=\"%u\"", sn[k].name,
                     sn[k].ms[j].service, sn[k].ms[j].method);
            bex__prom_hist(&o, "bex_rpc_server_latency_seconds", lb, &sn[k].hs[j]);
        }
    for (size_t k = 0; sn && k < n; k++) {
        free(sn[k].ms);
        free(sn[k].hs);
    }
    free(sn);
    if (rc) {
        if (cap)
            buf[0] = 0;
        return rc;
    }
    return o.n > INT32_MAX ? INT32_MAX : (int)o.n;
}

int bex_rpc_server_drain(bex_rpc_server *srv, uint32_t timeout_ms)
{
    if (!srv)
        return -EINVAL;
    if (bex__ctx_on_io_thread(srv->ctx))
        return -EDEADLK;
    if (srv->l) {
        bex_listener_close(srv->l);
        srv->l = NULL;
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    uint64_t ns = (uint64_t)dl.tv_nsec + (uint64_t)timeout_ms * 1000000u;
    dl.tv_sec += (time_t)(ns / 1000000000u);
    dl.tv_nsec = (long)(ns % 1000000000u);
    pthread_mutex_lock(&srv->mu);
    srv->draining = true;
    int rc = 0;
    while (srv->refs > 1 && rc == 0)
        rc = pthread_cond_timedwait(&srv->cv, &srv->mu, &dl);
    rc = srv->refs > 1 ? -ETIMEDOUT : 0;
    pthread_mutex_unlock(&srv->mu);
    return rc;
}

int bex_rpc_server_destroy(bex_rpc_server *srv)
{
    if (!srv)
        return 0;
    if (bex__ctx_on_io_thread(srv->ctx))
        return -EDEADLK;
    if (srv->l) {
        bex_listener_close(srv->l);
        srv->l = NULL;
    }
    pthread_mutex_lock(&srv->mu);
    srv->destroyed = true;
    struct bex__list *pos;
    bex__list_foreach(pos, &srv->conns)
    {
        struct conn *c = bex__list_entry(pos, struct conn, lnode);
        conn_close(srv, c);
    }
    while (!bex__list_empty(&srv->conns))
        pthread_cond_wait(&srv->cv, &srv->mu);
    bool last = --srv->refs == 0;
    pthread_mutex_unlock(&srv->mu);
    if (last)
        srv_free(srv);
    return 0;
}

void bex__rpc_req_close_conn(bex_rpc_req *req)
{
    struct conn *c = req->c;
    pthread_mutex_lock(&req->srv->mu);
    conn_close(req->srv, c);
    pthread_mutex_unlock(&req->srv->mu);
}
