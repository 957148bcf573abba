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
#include <sys/random.h>

#include "common/log.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"
#include "sock/ctx_access.h"
#include "rpc/client_internal.h"

static uint64_t rnd(struct bex_rpc_channel *ch)
{
    /* xorshift64*: retry coin flips, not security */
    uint64_t x = ch->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    ch->rng = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* ---- calls (under ch->mu) ---- */

static size_t bucket(uint64_t id)
{
    return (size_t)(id % CALL_BUCKETS);
}

struct call *bex__rpc_call_find(struct bex_rpc_channel *ch, uint64_t id)
{
    for (struct call *c = ch->htab[bucket(id)]; c; c = c->hnext)
        if (c->id == id)
            return c;
    return NULL;
}

void bex__rpc_call_put(struct bex_rpc_channel *ch, struct call *c)
{
    if (--c->refs)
        return;
    bex_mem_free(c->msg);
    free(c);
    if (--ch->n_calls == 0)
        pthread_cond_broadcast(&ch->cv);
}

/* ---- directory mode: outcomes for quarantine (under ch->mu) ---- */

void bex__rpc_dir_report(struct bex_rpc_channel *ch, struct endpoint *ep, int outcome)
{
    if (ch->dir && ep && ep->node)
        bex__dir_report_node(ch->dir, ep->node, outcome, false, bex__rpc_now_ns());
}

/* c's attempt no longer counts as outstanding on its node */
static void dir_release(struct bex_rpc_channel *ch, struct call *c)
{
    if (c->counted)
        bex__dir_report_node(ch->dir, c->counted->node, BEX_DIR_DONE, true, bex__rpc_now_ns());
    c->counted = NULL;
}

/* xa's socket no longer probes its endpoint: it failed, closed, was
 * answered over, or came up at step OK. */
void bex__rpc_xatt_probed(struct xatt *xa)
{
    if (xa->probing) {
        xa->probing = false;
        xa->ep->xprobing--;
    }
}

/* End xa's attempt: its socket closes (and probes no more). */
void bex__rpc_xatt_end(struct xatt *xa)
{
    bex__rpc_xatt_probed(xa);
    if (!xa->closing) {
        xa->closing = true;
        bex_sock_close(xa->s);
    }
}

/* Take c off the books with status; its completion runs once the lock is
 * released (bex__rpc_run_done). */
void bex__rpc_complete(struct bex_rpc_channel *ch, struct call *c, int status, void *resp,
                       size_t resp_len, int kind, struct call **done)
{
    if (!c->live) {
        if (!c->dst || resp != c->dst)
            bex_rpc_free(resp);
        return;
    }
    c->live = false;
    struct call **pp = &ch->htab[bucket(c->id)];
    while (*pp != c)
        pp = &(*pp)->hnext;
    *pp = c->hnext;
    if (c->prev)
        c->prev->next = c->next;
    else
        ch->live = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->status = status;
    c->resp = resp;
    c->resp_len = resp_len;
    /* an attempt out (a link's, or a destination's own socket not being
     * ended for a next one) timed out with the call */
    if (kind == K_TIMEOUT && (c->link || (c->xa && !c->xa->closing)))
        bex__rpc_dir_report(ch, c->ep, BEX_DIR_REQ_FAIL);
    dir_release(ch, c);
    switch (kind) {
    case K_OK:
        ch->st.ok++;
        break;
    case K_TIMEOUT:
        ch->st.fail_timeout++;
        break;
    case K_CONN:
        ch->st.fail_conn++;
        break;
    case K_REMOTE:
        ch->st.fail_remote++;
        break;
    default:
        ch->st.fail_cancel++;
        break;
    }
    if (kind != K_OK)
        ch->st.failed++;
    bex__rpc_hist_add(&ch->hist, bex__rpc_now_ns() - c->t_start);
    if (c->dst) {
        /* the destination is the caller's again only once retired: the
         * attempt's socket closes, and done runs when its exposure comes
         * back (xatt_retired) */
        c->resp = c->dst;
        c->want_attempt = false;
        if (c->xa)
            bex__rpc_xatt_end(c->xa);
        if (c->xa && c->xa->armed) {
            c->parked = true;
            return;
        }
    }
    c->dnext = *done;
    *done = c;
}

void bex__rpc_run_done(struct bex_rpc_channel *ch, struct call *done)
{
    /* oldest first: reverse the stack */
    struct call *r = NULL;
    while (done) {
        struct call *n = done->dnext;
        done->dnext = r;
        r = done;
        done = n;
    }
    for (struct call *c = r, *n; c; c = n) {
        n = c->dnext;
        c->done(c->status, c->resp, c->resp_len, c->user);
        pthread_mutex_lock(&ch->mu);
        bex__rpc_call_put(ch, c);
        pthread_mutex_unlock(&ch->mu);
    }
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
        if (eps[i].addr.sin_family != AF_INET || !eps[i].addr.sin_port ||
            eps[i].transport > BEX_TRANSPORT_TCP)
            return -EINVAL;
    return 0;
}

static bool ep_same(const struct endpoint *ep, const bex_rpc_endpoint *e)
{
    return ep->addr.sin_addr.s_addr == e->addr.sin_addr.s_addr &&
           ep->addr.sin_port == e->addr.sin_port && ep->transport == e->transport;
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

/* ---- recovery ladder (under ch->mu) ----
 *
 * Each endpoint climbs it on its own: OK -> (a connection to it fails)
 * RECONNECT: the next connection is a new one as configured (over RDMA, a
 * new QP) -> (that one fails too before anything was answered over it)
 * REPLICA: its calls go to other replicas while the hold-down lasts ->
 * (it is used again) TCP, when it may use RDMA at all; from there RDMA is
 * probed every rdma_retry_ns by a connection of its own that carries a
 * ping and no call, and replaces the TCP one once the ping is answered.
 * An answer over the reconnection brings the endpoint back to OK as well.
 * Calls out on a connection whose failure took a step (OK -> RECONNECT,
 * RECONNECT -> REPLICA) are moved without spending the retry budget or an
 * attempt: those steps come twice at most at the start and after each
 * answer the endpoint gave, so they cannot storm a service, and a replica dying under load (every
 * call out on it failing at once) loses none of them to the budget. */

static bool ep_may_rdma(struct bex_rpc_channel *ch, const struct endpoint *ep)
{
    return ep->transport == BEX_TRANSPORT_RDMA ||
           (ep->transport == BEX_TRANSPORT_AUTO && bex_ctx_pd(ch->ctx));
}

__attribute__((format(printf, 4, 5))) void bex__rpc_ladder_log(struct bex_rpc_channel *ch,
                                                               const struct endpoint *ep, int level,
                                                               const char *fmt, ...)
{
    char a[INET_ADDRSTRLEN], msg[192];
    inet_ntop(AF_INET, &ep->addr.sin_addr, a, sizeof a);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    bex__log(ch->log, level, "rpc channel %s: endpoint %s:%u: %s", ch->name, a,
             ntohs(ep->addr.sin_port), msg);
}

/* Whether a replica other than ep is at step OK, and not failed since its
 * last connection came up: where step 2 sends calls. One that is on the
 * ladder itself (RDMA failing for the whole service) does not count. */
static bool ladder_others(struct bex_rpc_channel *ch, const struct endpoint *ep)
{
    for (size_t i = 0; i < ch->n_eps; i++)
        if (ch->eps[i] != ep && ch->eps[i]->rung == BEX_RPC_LADDER_OK && !ch->eps[i]->suspect)
            return true;
    for (const struct endpoint *e = ch->deps; e; e = e->dnext)
        if (e != ep && e->rung == BEX_RPC_LADDER_OK && !e->suspect)
            return true;
    return false;
}

/* A connection of ep made at step rung failed (err). Returns whether this
 * took a step, so that the calls out on it move without the budget. (A
 * connection that was answered over is at step OK by then.) */
static bool ladder_failed(struct bex_rpc_channel *ch, struct endpoint *ep, int rung, int err)
{
    if (rung != ep->rung)
        return false; /* a connection from before the endpoint's last step */
    bool rdma = ep_may_rdma(ch, ep);
    if (ep->rung == BEX_RPC_LADDER_OK) {
        ep->rung = BEX_RPC_LADDER_RECONNECT;
        ch->st.ladder_reconnects++;
        bex__rpc_ladder_log(ch, ep, BEX_LOG_WARN, "%s connection failed (%s): step 1, reconnecting",
                            rdma ? "RDMA" : "its", bex_strerror(err));
        return true;
    }
    if (ep->rung == BEX_RPC_LADDER_RECONNECT) {
        ep->rung = BEX_RPC_LADDER_REPLICA;
        ch->st.ladder_replicas++;
        bool others = ladder_others(ch, ep);
        bex__rpc_ladder_log(ch, ep, BEX_LOG_WARN, "reconnection failed (%s): step 2, %s%s",
                            bex_strerror(err),
                            others ? "calls go to other replicas"
                            : rdma ? "no other replica on RDMA"
                                   : "no other replica",
                            rdma ? (others ? ", then TCP" : ", TCP now") : "");
        return true;
    }
    return false;
}

/* How long ep is avoided after a failure of its connection: the hold-down,
 * except at step 2 with no other replica to go to, when its TCP connection
 * (step 3) is what calls need next. */
static uint64_t ladder_down_until(struct bex_rpc_channel *ch, const struct endpoint *ep)
{
    if (ep->rung == BEX_RPC_LADDER_REPLICA && ep_may_rdma(ch, ep) && !ladder_others(ch, ep))
        return 0;
    return bex__rpc_now_ns() + ch->holddown_ns;
}

/* A connection of ep, made at step rung when its fail_gen was gen, failed
 * with err, as a socket on it (the channel's link, or an attempt with a
 * destination, which has a socket of its own on the same connection) saw
 * it: the ladder's step, the counters, the hold-down, the directory's
 * report and the log, once per failure however many sockets of the
 * connection report it. Returns whether the calls out on it move without
 * the budget (the failure took a step of the ladder). */
bool bex__rpc_ep_conn_failed(struct bex_rpc_channel *ch, struct endpoint *ep, int rung,
                             uint64_t gen, int err)
{
    /* not removal, not destroy, not a malformed answer (the socket's own) */
    bool conn = err != -ECONNABORTED && err != -ECANCELED && err != -EPROTO;
    if (conn && gen != ep->fail_gen)
        return ep->fail_stepped && gen + 1 == ep->fail_gen; /* counted already */
    bool step = false;
    if (conn) {
        step = ladder_failed(ch, ep, rung, err);
        ep->fail_gen++;
        ep->fail_stepped = step;
    }
    if (err != -ECONNABORTED && err != -ECANCELED) {
        ch->st.conn_failures++;
        ep->conn_failures++;
    }
    ep->down_until = ladder_down_until(ch, ep);
    bool was_suspect = ep->suspect;
    ep->suspect = true;
    if (conn)
        bex__rpc_dir_report(ch, ep, BEX_DIR_CONN_FAIL);
    if (!was_suspect && err != -ECANCELED && err != -ECONNABORTED) {
        /* once per transition: the endpoint stays suspect until a
         * connection to it is up again */
        ch->st.endpoints_down++;
        char a[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &ep->addr.sin_addr, a, sizeof a);
        bex__log(ch->log, BEX_LOG_WARN,
                 "rpc channel %s: endpoint %s:%u failed (%s): calls go to other replicas", ch->name,
                 a, ntohs(ep->addr.sin_port), bex_strerror(err));
    }
    return step;
}

/* An answer came over a connection of ep made at step rung: when that was
 * step 1 or 2 and still is the endpoint's, it worked: back to OK.
 * Returns whether it did. */
bool bex__rpc_ladder_proven(struct bex_rpc_channel *ch, struct endpoint *ep, int rung)
{
    if (rung != ep->rung ||
        (ep->rung != BEX_RPC_LADDER_RECONNECT && ep->rung != BEX_RPC_LADDER_REPLICA))
        return false;
    if (ep->rung == BEX_RPC_LADDER_RECONNECT)
        ch->st.ladder_recovered++;
    bex__rpc_ladder_log(ch, ep, BEX_LOG_WARN, "answered again: recovered at step %d", ep->rung);
    ep->rung = BEX_RPC_LADDER_OK;
    return true;
}

/* An answer (status: its header's) from ep, over the ladder's TCP
 * fallback or not, to a call still out (live) or not (late, or a ping's:
 * counted all the same): the counters and, for a live call, the
 * directory's report. */
void bex__rpc_ep_answered(struct bex_rpc_channel *ch, struct endpoint *ep, bool tcp, int status,
                          bool live)
{
    ep->answers++;
    if (tcp)
        ep->tcp_answers++;
    if (live)
        bex__rpc_dir_report(
            ch, ep, status && bex__rpc_retryable(status, true) ? BEX_DIR_REQ_FAIL : BEX_DIR_OK);
}

/* An answer came over l: the step it was made at worked. */
void bex__rpc_link_proven(struct bex_rpc_channel *ch, struct link *l)
{
    struct endpoint *ep = l->ep;
    l->proven = true;
    if (l->probe) {
        /* RDMA answered again: it carries the endpoint's calls from now on;
         * the TCP connection takes no more and goes once its calls are
         * done (the timer thread closes it) */
        l->probe = false;
        if (ep->probe == l)
            ep->probe = NULL;
        if (ep->cur && ep->cur != l)
            ep->cur->retiring = true;
        ep->cur = l;
        ep->rung = BEX_RPC_LADDER_OK;
        l->rung = BEX_RPC_LADDER_OK;
        ch->st.rdma_restored++;
        bex__rpc_ladder_log(ch, ep, BEX_LOG_WARN, "RDMA works again: calls leave TCP");
        return;
    }
    if (l->ping && l->state == L_UP)
        bex__rpc_ep_reachable(ch, ep); /* held back until now: see bex__rpc_on_connect */
    if (bex__rpc_ladder_proven(ch, ep, l->rung))
        l->rung = BEX_RPC_LADDER_OK;
}

/* The transport of ep's next connection, taking step 3 when it is due. */
static uint32_t ladder_transport(struct bex_rpc_channel *ch, struct endpoint *ep)
{
    if (!ep_may_rdma(ch, ep))
        return ep->transport;
    if (ep->rung == BEX_RPC_LADDER_REPLICA) {
        ep->rung = BEX_RPC_LADDER_TCP;
        ep->rdma_retry_at = bex__rpc_now_ns() + ch->rdma_retry_ns;
        ch->st.ladder_tcp++;
        bex__rpc_ladder_log(ch, ep, BEX_LOG_WARN, "step 3, over TCP (RDMA tried again in %llu ms)",
                            (unsigned long long)(ch->rdma_retry_ns / 1000000ull));
        if (ch->timer_next > ep->rdma_retry_at || !ch->timer_next)
            pthread_cond_broadcast(&ch->cv);
    }
    return ep->rung == BEX_RPC_LADDER_TCP ? BEX_TRANSPORT_TCP : ep->transport;
}

/* The options of ep's next connection, as its step on the ladder has it
 * (taking step 3 when due), for a link or an attempt with a destination
 * alike, and what that socket records: the step, whether it is the
 * ladder's TCP fallback, the endpoint's fail_gen. */
bex_connect_opts bex__rpc_ladder_connect(struct bex_rpc_channel *ch, struct endpoint *ep, int *rung,
                                         bool *tcp, uint64_t *gen)
{
    bex_connect_opts o = {0};
    uint32_t t = ladder_transport(ch, ep);
    *rung = ep->rung;
    *tcp = t == BEX_TRANSPORT_TCP && ep_may_rdma(ch, ep);
    *gen = ep->fail_gen;
    if (t) {
        o.flags = BEX_CONNECT_TRANSPORT;
        o.transport = t;
    }
    return o;
}

/* A connection to ep could not even be started (err, e.g. -ENODEV: RDMA
 * asked of a context without a device): a failed connection as far as
 * the ladder goes. Returns whether that took a step. */
static bool connect_refused(struct bex_rpc_channel *ch, struct endpoint *ep, int err)
{
    return err != -ENOMEM && err != -EINVAL && ladder_failed(ch, ep, ep->rung, err);
}

static int link_open(struct bex_rpc_channel *ch, struct endpoint *ep, struct link **out);

/* l failed with err: its endpoint's failure counted and reported (once,
 * bex__rpc_ep_conn_failed), its socket closed, the calls out on it retried or
 * completed. Returns whether the failure took a step of the recovery
 * ladder (the calls it moves spend no budget). */
bool bex__rpc_link_fail(struct bex_rpc_channel *ch, struct link *l, int err, struct call **done)
{
    if (l->state == L_FAILED)
        return false;
    l->state = L_FAILED;
    if (l->probe) {
        /* step 3's RDMA retry failed: the endpoint stays on TCP (no call
         * was on this connection, its health is not in question) */
        struct endpoint *ep = l->ep;
        if (ep->probe == l)
            ep->probe = NULL;
        ep->rdma_retry_at = bex__rpc_now_ns() + ch->rdma_retry_ns;
        if (err != -ECONNABORTED && err != -ECANCELED)
            bex__rpc_ladder_log(ch, ep, BEX_LOG_INFO,
                                "RDMA still unusable (%s): staying on TCP, next try in %llu ms",
                                bex_strerror(err),
                                (unsigned long long)(ch->rdma_retry_ns / 1000000ull));
        bex_sock_close(l->s);
        return false;
    }
    if (l->retiring) {
        /* the endpoint is on RDMA again: only this old TCP connection's
         * calls are concerned, not the endpoint's health */
        bex_sock_close(l->s);
        for (struct call *c = ch->live, *n; c; c = n) {
            n = c->next;
            if (c->link == l)
                bex__rpc_attempt_failed(ch, c, err, false, done);
        }
        return false;
    }
    if (l->ep->cur == l)
        l->ep->cur = NULL;
    bool step = bex__rpc_ep_conn_failed(ch, l->ep, l->rung, l->gen, err);
    bex_sock_close(l->s);
    /* a retry never lands on l (it failed), and completing a call unlinks
     * that call alone: the saved next stays valid */
    for (struct call *c = ch->live, *n; c; c = n) {
        n = c->next;
        if (c->link == l)
            bex__rpc_attempt_failed_ex(ch, c, err, false, step, done);
    }
    /* step 2 with no other replica on RDMA: TCP (step 3) is what the
     * next calls need; its connection is started now, not by the first
     * of them (no call may have been on the failed reconnection) */
    struct endpoint *ep = l->ep;
    struct link *nl;
    if (step && !ep->cur && ep->rung == BEX_RPC_LADDER_REPLICA && !ep->down_until &&
        ep_may_rdma(ch, ep) && !ch->destroying)
        link_open(ch, ep, &nl);
    return step;
}

const bex_sock_ops bex__rpc_link_ops = {
    .on_connect = bex__rpc_on_connect,
    .on_recv = bex__rpc_on_recv,
    .on_send_done = bex__rpc_on_send_done,
    .on_error = bex__rpc_on_error,
    .on_close = bex__rpc_on_close,
};

/* Send a ping (docs/protocol.md, "Ping") first on l: its answer proves
 * the connection. */
int bex__rpc_send_ping(struct bex_rpc_channel *ch, struct link *l)
{
    uint8_t *m = bex_sock_alloc(ch->ctx, BEX_RPC_HDR_LEN);
    if (!m)
        return -ENOMEM;
    struct bex__rpc_hdr h = {.kind = BEX__RPC_REQUEST,
                             .service = BEX_RPC_SERVICE_PING,
                             .call_id = (1ull << 63) | ++ch->next_ping,
                             .client_id = ch->client_id,
                             .timeout_ms = (uint32_t)(ch->probe_ns / 1000000ull)};
    bex__rpc_hdr_encode(&h, m);
    int err = bex_sock_send(l->s, m, BEX_RPC_HDR_LEN, l); /* msg_user l: a ping */
    if (err)
        bex_mem_free(m);
    else
        l->ping = true;
    return err;
}

static int link_open(struct bex_rpc_channel *ch, struct endpoint *ep, struct link **out)
{
    struct link *l = calloc(1, sizeof(*l));
    if (!l)
        return -ENOMEM;
    l->ch = ch;
    l->ep = ep;
    ep->refs++;
    l->state = L_CONNECTING;
    l->t_start = bex__rpc_now_ns();
    bex_connect_opts o = bex__rpc_ladder_connect(ch, ep, &l->rung, &l->tcp, &l->gen);
    /* callbacks wait for ch->mu, which we hold: l->s is set before any */
    int err = bex_sock_connect_opts(ch->ctx, &ep->addr, &bex__rpc_link_ops, l, &o, &l->s);
    if (err) {
        ep->refs--;
        free(l);
        return err;
    }
    l->next = ch->links;
    ch->links = l;
    ep->cur = l;
    /* step 1's reconnection proves itself by a ping, not by the calls it
     * carries (a handler may take its time) */
    if (l->rung == BEX_RPC_LADDER_RECONNECT)
        bex__rpc_send_ping(ch, l);
    /* the timer watches Tc */
    if (l->t_start + ch->tc_ns < ch->timer_next)
        pthread_cond_broadcast(&ch->cv);
    *out = l;
    return 0;
}

/* The next endpoint for an attempt: round robin over those not held down,
 * other than exclude when there is another; else the one back soonest. An
 * endpoint that failed and is being connected again (the first call after
 * its hold-down probes it) takes no further calls until that connection is
 * up, when another endpoint is there: otherwise every call of the moment
 * would queue on a connection that may well be refused again, each then
 * needing a retry. */
static struct endpoint *dir_choose_ep(struct bex_rpc_channel *ch, const struct endpoint *exclude);

/* ep failed and a connection to it is being made again (its link, or an
 * attempt with a destination's socket): that one probes it. */
static bool ep_probed(const struct endpoint *ep)
{
    return ep->suspect && (ep->cur || ep->xprobing);
}

static struct endpoint *choose_ep(struct bex_rpc_channel *ch, const struct endpoint *exclude)
{
    if (ch->dir)
        return dir_choose_ep(ch, exclude);
    uint64_t now = bex__rpc_now_ns();
    struct endpoint *soonest = NULL;
    for (size_t i = 0; i < ch->n_eps; i++) {
        size_t k = (ch->rr + i) % ch->n_eps;
        struct endpoint *ep = ch->eps[k];
        if (ep == exclude && ch->n_eps > 1)
            continue;
        if (ep->down_until <= now && !(ep_probed(ep) && ch->n_eps > 1)) {
            ch->rr = (k + 1) % ch->n_eps;
            return ep;
        }
        if (!soonest || ep->down_until < soonest->down_until)
            soonest = ep;
    }
    /* every other one is held down or being reconnected: the failed one,
     * if it may take calls now (step 2 with no other replica on RDMA:
     * its TCP connection) */
    for (size_t i = 0; i < ch->n_eps; i++)
        if (ch->eps[i] == exclude && exclude->down_until <= now && !ep_probed(exclude))
            return ch->eps[i];
    return soonest ? soonest : ch->eps[0];
}

struct dir_avoid {
    struct bex_rpc_channel *ch;
    const struct endpoint *exclude;
    uint64_t now;
};

static struct endpoint *dir_ep_of(struct bex_rpc_channel *ch, const struct bex__dir_node *n)
{
    for (struct endpoint *ep = ch->deps; ep; ep = ep->dnext)
        if (ep->node == n)
            return ep;
    return NULL;
}

/* The channel's own exclusions, as in choose_ep: the failed attempt's
 * endpoint, one held down, one being probed by its reconnection. */
static bool dir_avoid_fn(void *arg, const struct bex__dir_node *n)
{
    const struct dir_avoid *a = arg;
    const struct endpoint *ep = dir_ep_of(a->ch, n);
    return ep && (ep == a->exclude || ep->down_until > a->now || ep_probed(ep));
}

/* Directory mode: the directory picks the node (locality, load,
 * quarantine); NULL when the shard has no replica. */
static struct endpoint *dir_choose_ep(struct bex_rpc_channel *ch, const struct endpoint *exclude)
{
    struct dir_avoid a = {ch, exclude, bex__rpc_now_ns()};
    struct bex__dir_node *n;
    if (bex__dir_pick_node(ch->dir, ch->service, ch->shard, ch->locality, dir_avoid_fn, &a, a.now,
                           &n))
        return NULL;
    struct endpoint *ep = dir_ep_of(ch, n);
    if (!ep && (ep = calloc(1, sizeof(*ep)))) {
        bex_dir_replica r;
        bex__dir_node_info(ch->dir, n, &r);
        ep->addr = r.addr;
        ep->transport = r.transport;
        ep->node = n;
        ep->refs = 1; /* the deps list's */
        ep->dnext = ch->deps;
        ch->deps = ep;
    }
    if (!ep) {
        bex__dir_report_node(ch->dir, n, BEX_DIR_DONE, true, a.now);
        return NULL;
    }
    return ep;
}

static _Atomic(void (*)(bex_sock *)) send_hook;

void bex__rpc_send_hook(void (*fn)(bex_sock *s))
{
    atomic_store_explicit(&send_hook, fn, memory_order_release);
}

/* Send c on an endpoint (not exclude when there is another): on the
 * endpoint's link, or (a call with a destination) on a socket of its own
 * (bex__rpc_xatt_open). Returns 0 or the error that kept the attempt from
 * starting; *step: that error was a connection failure that took a step
 * of the recovery ladder. A link found failed here fails now (bex__rpc_link_fail:
 * its other calls go to done or elsewhere). */
int bex__rpc_start_attempt(struct bex_rpc_channel *ch, struct call *c,
                           const struct endpoint *exclude, bool *step, struct call **done)
{
    *step = false;
    c->link = NULL;
    c->attempt_deadline = 0;
    if (c->dst) {
        /* a fresh exposure per attempt, and never two at once: the last
         * one is retired first (its socket closed, the attempt goes on
         * when the exposure comes back: xatt_retired) */
        if (c->xa)
            bex__rpc_xatt_end(c->xa);
        if (c->xa && c->xa->armed) {
            c->want_attempt = true;
            return 0;
        }
    }
    struct endpoint *ep = choose_ep(ch, exclude);
    c->attempts++;
    if (ch->dir) {
        /* the new pick counts as outstanding; the old attempt's no more */
        dir_release(ch, c);
        if (!ep)
            return -EHOSTUNREACH; /* c->ep stays: the last endpoint tried */
        c->counted = ep;
    }
    c->ep = ep;
    struct link *l = c->dst ? NULL : ep->cur;
    int err = 0;
    if (c->dst) {
        err = bex__rpc_xatt_open(ch, c, ep);
        if (err)
            *step = connect_refused(ch, ep, err);
    } else if (!l) {
        err = link_open(ch, ep, &l);
        if (err)
            *step = connect_refused(ch, ep, err);
    }
    if (!err && !c->dst) {
        void (*hook)(bex_sock *) = atomic_load_explicit(&send_hook, memory_order_acquire);
        if (hook)
            hook(l->s);
        err = bex_sock_send(l->s, c->msg, c->len, c);
        if (err == -EPIPE) {
            /* the connection failed and its failure callback is waiting
             * for ch->mu: it fails now, as that callback would have it
             * (the endpoint counted once, its node's connection failure
             * reported, its link dropped), so that the retry sees the
             * endpoint failed rather than finding this link again, and a
             * quarantined replica is released for it when this was the
             * shard's last one (src/rpc/dir.c, release_early) */
            *step = bex__rpc_link_fail(ch, l, err, done);
            return err;
        }
    }
    if (err) {
        if (err != -EINVAL && err != -EMSGSIZE && err != -ENOMEM)
            ep->down_until = ladder_down_until(ch, ep); /* the connection's fault */
        return err;
    }
    ch->st.attempts++;
    ep->attempts++;
    if (exclude && ep != exclude)
        ch->st.failovers++;
    if (!c->dst) {
        c->refs++;
        c->link = l;
    }
    c->attempt_deadline = ch->attempt_ns ? bex__rpc_now_ns() + ch->attempt_ns : 0;
    if (c->attempt_deadline && c->attempt_deadline < ch->timer_next)
        pthread_cond_broadcast(&ch->cv);
    return 0;
}

bool bex__rpc_retryable(int err, bool remote)
{
    if (remote)
        return err == -EAGAIN || err == -EBUSY;
    return err != -ENOMEM && err != -EINVAL && err != -EMSGSIZE;
}

/* Whether c may be tried again after err: attempts left, time left, the
 * coin, then the budget (only a retry that happens spends a token). */
bool bex__rpc_may_retry(struct bex_rpc_channel *ch, struct call *c, int err, bool remote)
{
    if ((c->flags & BEX_RPC_CALL_NO_RETRY) || c->attempts - c->moves >= ch->max_attempts ||
        !bex__rpc_retryable(err, remote) || bex__rpc_now_ns() >= c->deadline || ch->destroying)
        return false;
    if (ch->retry_permille < 1000 && rnd(ch) % 1000 >= ch->retry_permille)
        return false;
    if (ch->tokens < 1000) {
        ch->st.retry_throttled++;
        return false;
    }
    ch->tokens -= 1000;
    return true;
}

/* Whether the recovery ladder may move c after its connection failed:
 * as a retry, less the coin and the budget, and not counted against
 * max_attempts (bounded by the ladder's steps, and per call). */
#define LADDER_MOVES_MAX 8
static bool may_move(struct bex_rpc_channel *ch, struct call *c, int err)
{
    return !(c->flags & BEX_RPC_CALL_NO_RETRY) && ch->max_attempts > 1 &&
           c->moves < LADDER_MOVES_MAX && bex__rpc_retryable(err, false) &&
           bex__rpc_now_ns() < c->deadline && !ch->destroying;
}

/* The current attempt of c failed with err: retry, or complete with err.
 * moved: its connection's failure took a step of the recovery ladder. */
void bex__rpc_attempt_failed_ex(struct bex_rpc_channel *ch, struct call *c, int err, bool remote,
                                bool moved, struct call **done)
{
    if (!c->live)
        return;
    if (c->ep && c->link)
        c->ep->failures++;
    c->link = NULL;
    c->attempt_deadline = 0;
    if (err == -EIO)
        c->in_doubt = true;
    for (;;) {
        bool mv = moved && may_move(ch, c, err);
        if (!mv && !bex__rpc_may_retry(ch, c, err, remote))
            break;
        ch->st.retries++;
        if (mv) {
            c->moves++;
            ch->st.ladder_moves++;
        }
        int e = bex__rpc_start_attempt(ch, c, c->ep, &moved, done);
        if (!e)
            return;
        err = e;
        remote = false;
    }
    /* a later attempt's failure to get there does not undo an earlier one
     * that may have: the call stays in doubt */
    if (!remote && c->in_doubt)
        err = -EIO;
    bex__rpc_complete(ch, c, err, NULL, 0, remote ? K_REMOTE : K_CONN, done);
}

void bex__rpc_attempt_failed(struct bex_rpc_channel *ch, struct call *c, int err, bool remote,
                             struct call **done)
{
    bex__rpc_attempt_failed_ex(ch, c, err, remote, false, done);
}

/* ---- API ---- */

int bex_rpc_channel_create(bex_ctx *ctx, const bex_rpc_channel_config *cfg, bex_rpc_channel **out)
{
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
                      bex_rpc_done_fn done, void *user, uint64_t *call_id);

int bex_rpc_call(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body, size_t len,
                 const bex_rpc_call_opts *opts, bex_rpc_done_fn done, void *user, uint64_t *call_id)
{
    return call_start(ch, service, method, body, len, NULL, 0, opts, done, user, call_id);
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
    return call_start(ch, service, method, body, len, dst, cap, opts, done, user, call_id);
}

static int call_start(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body,
                      size_t len, void *dst, size_t cap, const bex_rpc_call_opts *opts,
                      bex_rpc_done_fn done, void *user, uint64_t *call_id)
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
    struct call *c = malloc(sizeof(*c));
    if (!c) {
        if (own_body)
            bex_rpc_free(body);
        return -ENOMEM;
    }
    uint64_t now = bex__rpc_now_ns();
    uint64_t tmo_ns = opts && opts->timeout_ms ? opts->timeout_ms * 1000000ull : ch->tr_ns;
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
        .live = true,
        .dst = dst,
        .cap = cap,
    };
    struct call *dl = NULL;
    pthread_mutex_lock(&ch->mu);
    if (ch->destroying) {
        pthread_mutex_unlock(&ch->mu);
        free(c);
        if (own_body)
            bex_rpc_free(body);
        return -EPIPE;
    }
    c->id = ++ch->next_id;
    struct bex__rpc_hdr h = {
        .kind = BEX__RPC_REQUEST,
        .flags = dst ? BEX__RPC_F_DEST : 0,
        .service = service,
        .method = method,
        .call_id = c->id,
        .client_id = ch->client_id,
        .seq = ++ch->next_seq,
        .body_len = (uint32_t)len,
        .timeout_ms = (uint32_t)(tmo_ns / 1000000ull),
    };
    memcpy(h.tok, ch->tok, sizeof h.tok);
    /* written once: every attempt sends these same bytes (the same
     * client id, token and sequence, whatever the connection), and
     * attempts may be out at once */
    bex__rpc_hdr_encode(&h, c->msg);
    ch->tokens += ch->budget_permille;
    if (ch->tokens > (int64_t)ch->budget_burst * 1000)
        ch->tokens = (int64_t)ch->budget_burst * 1000;
    c->hnext = ch->htab[bucket(c->id)];
    ch->htab[bucket(c->id)] = c;
    c->next = ch->live;
    if (c->next)
        c->next->prev = c;
    ch->live = c;
    ch->n_calls++;
    ch->st.calls++;
    if (call_id)
        *call_id = c->id;
    if (c->deadline < ch->timer_next || !ch->timer_next)
        pthread_cond_broadcast(&ch->cv);
    bool step;
    int err = bex__rpc_start_attempt(ch, c, NULL, &step, &dl);
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
        for (struct call *c = ch->live; c; c = c->next)
            if (c->ep == old[k])
                c->ep = NULL;
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

void bex__rpc_wait_done(int status, void *body, size_t len, void *user)
{
    struct bex__rpc_wait *w = user;
    pthread_mutex_lock(&w->mu);
    w->status = status;
    w->body = body;
    w->len = len;
    w->done = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

int bex__rpc_wait(struct bex__rpc_wait *w, void **body, size_t *len)
{
    pthread_mutex_lock(&w->mu);
    while (!w->done)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
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
    struct bex__rpc_wait w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
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
    while (ch->live)
        bex__rpc_complete(ch, ch->live, -ECANCELED, NULL, 0, K_CANCEL, &dl);
    for (struct link *l = ch->links; l; l = l->next)
        bex__rpc_link_fail(ch, l, -ECANCELED, &dl);
    ch->stop = true;
    pthread_cond_broadcast(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, dl);
    pthread_join(ch->timer, NULL);
    pthread_mutex_lock(&ch->mu);
    /* every socket's bex__rpc_on_close, and with it every send's bex__rpc_on_send_done */
    while (ch->links || ch->n_calls)
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
    pthread_cond_destroy(&ch->cv);
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
    static const struct {
        const char *metric, *help;
        size_t off;
    } ctrs[] = {
        {"bex_rpc_calls_total", "Calls accepted", offsetof(bex_rpc_channel_stats, calls)},
        {"bex_rpc_ok_total", "Calls completed with status 0", offsetof(bex_rpc_channel_stats, ok)},
        {"bex_rpc_attempts_total", "Requests sent, retries included",
         offsetof(bex_rpc_channel_stats, attempts)},
        {"bex_rpc_retries_total", "Attempts after the first",
         offsetof(bex_rpc_channel_stats, retries)},
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
    for (size_t i = 0; i < sizeof ctrs / sizeof ctrs[0]; i++) {
        uint64_t v;
        memcpy(&v, (const char *)&s + ctrs[i].off, sizeof v);
        OUT("# HELP %s %s.\n# TYPE %s counter\n%s{channel=\"%s\"} %llu\n", ctrs[i].metric,
            ctrs[i].help, ctrs[i].metric, ctrs[i].metric, name, (unsigned long long)v);
    }
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
    static const struct {
        const char *metric, *help;
        size_t off;
    } ectrs[] = {
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
    for (size_t k = 0; k < sizeof ectrs / sizeof ectrs[0]; k++) {
        OUT("# HELP %s %s.\n# TYPE %s counter\n", ectrs[k].metric, ectrs[k].help, ectrs[k].metric);
        for (size_t i = 0; i < ne; i++) {
            char ip[INET_ADDRSTRLEN], loc[160];
            inet_ntop(AF_INET, &es[i].addr.sin_addr, ip, sizeof ip);
            bex__prom_escape(es[i].locality, loc, sizeof loc);
            uint64_t v;
            memcpy(&v, (const char *)&es[i] + ectrs[k].off, sizeof v);
            OUT("%s{channel=\"%s\",endpoint=\"%s:%u\",locality=\"%s\"} %llu\n", ectrs[k].metric,
                name, ip, ntohs(es[i].addr.sin_port), loc, (unsigned long long)v);
        }
    }
    OUT("# HELP bex_rpc_endpoint_ladder_step Recovery ladder step of the endpoint (0 ok, "
        "1 reconnecting, 2 other replicas first, 3 over TCP).\n"
        "# TYPE bex_rpc_endpoint_ladder_step gauge\n");
    for (size_t i = 0; i < ne; i++) {
        char ip[INET_ADDRSTRLEN], loc[160];
        inet_ntop(AF_INET, &es[i].addr.sin_addr, ip, sizeof ip);
        bex__prom_escape(es[i].locality, loc, sizeof loc);
        OUT("bex_rpc_endpoint_ladder_step{channel=\"%s\",endpoint=\"%s:%u\",locality=\"%s\"} "
            "%u\n",
            name, ip, ntohs(es[i].addr.sin_port), loc, es[i].ladder);
    }
#undef OUT
    return o.n > INT32_MAX ? INT32_MAX : (int)o.n;
}
