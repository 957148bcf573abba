/* SPDX-License-Identifier: Apache-2.0 */
/* RPC client: the recovery ladder (each endpoint's steps after failed
 * connections), the choice of an endpoint and the start, retry and move
 * of an attempt. */
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
    char a[BEX_ADDR_STRLEN], msg[192];
    bex_addr_format(&ep->addr, false, a, sizeof a);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    bex__log(ch->log, level, "rpc channel %s: endpoint %s:%u: %s", ch->name, a,
             bex_addr_port(&ep->addr), msg);
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
        char a[BEX_ADDR_STRLEN];
        bex_addr_format(&ep->addr, false, a, sizeof a);
        bex__log(ch->log, BEX_LOG_WARN,
                 "rpc channel %s: endpoint %s:%u failed (%s): calls go to other replicas", ch->name,
                 a, bex_addr_port(&ep->addr), bex_strerror(err));
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

static bool call_refused(struct bex_rpc_channel *ch, struct call *c, struct endpoint *ep);

/* l failed: no call waits for an earlier attempt out on it any more. */
static void held_drop(struct bex_rpc_channel *ch, const struct link *l)
{
    struct bex__list *pos;
    bex__list_foreach(pos, &ch->live)
    {
        struct call *c = bex__list_entry(pos, struct call, lnode);
        if (c->held == l)
            c->held = NULL;
    }
}

bool bex__rpc_link_fail(struct bex_rpc_channel *ch, struct link *l, int err, struct call **done)
{
    return bex__rpc_link_fail_ex(ch, l, err, false, done);
}

/* l failed with err: its endpoint's failure counted and reported (once,
 * bex__rpc_ep_conn_failed), its socket closed, the calls out on it retried or
 * completed. unsent: it never came up (on_connect said so), so nothing
 * sent on it was sent: its calls' attempts were refused, not executed.
 * Returns whether the failure took a step of the recovery ladder (the
 * calls it moves spend no budget). */
bool bex__rpc_link_fail_ex(struct bex_rpc_channel *ch, struct link *l, int err, bool unsent,
                           struct call **done)
{
    if (l->state == L_FAILED)
        return false;
    bex__rpc_link_move(ch, l, L_FAILED);
    held_drop(ch, l);
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
        struct bex__list *pos, *tmp;
        bex__list_foreach_safe(pos, tmp, &ch->live)
        {
            struct call *c = bex__list_entry(pos, struct call, lnode);
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
    struct bex__list *pos, *tmp;
    bex__list_foreach_safe(pos, tmp, &ch->live)
    {
        struct call *c = bex__list_entry(pos, struct call, lnode);
        if (c->link != l)
            continue;
        if (unsent)
            c->refused_new = call_refused(ch, c, l->ep);
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
    bex__list_init(&l->lnode);
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
    bex__list_push_head(&ch->links, &l->lnode);
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
static struct endpoint *dir_choose_ep(struct bex_rpc_channel *ch, const struct endpoint *exclude,
                                      uint64_t refused);

/* ep's bit in a call's refused set, given on first use (64 a channel,
 * then shared: a shared bit only counts an attempt more). */
static uint64_t ep_bit(struct bex_rpc_channel *ch, struct endpoint *ep)
{
    if (!ep->bit)
        ep->bit = 1ull << (ch->next_bit++ % 64);
    return ep->bit;
}

/* c's attempt on ep was refused before its request was sent: ep joins the
 * call's refused set. Returns whether it was ep's first refusal of c (the
 * retry after it is not counted: ep is not tried again for c while
 * another endpoint is there, so these retries are at most one per
 * endpoint). */
static bool call_refused(struct bex_rpc_channel *ch, struct call *c, struct endpoint *ep)
{
    uint64_t b = ep_bit(ch, ep);
    bool first = !(c->refused & b);
    c->refused |= b;
    return first;
}

/* ep failed and a connection to it is being made again (its link, or an
 * attempt with a destination's socket): that one probes it. */
static bool ep_probed(const struct endpoint *ep)
{
    return ep->suspect && (ep->cur || ep->xprobing);
}

static struct endpoint *choose_ep(struct bex_rpc_channel *ch, const struct endpoint *exclude,
                                  uint64_t refused)
{
    if (ch->dir)
        return dir_choose_ep(ch, exclude, refused);
    uint64_t now = bex__rpc_now_ns();
    struct endpoint *soonest = NULL;
    for (size_t i = 0; i < ch->n_eps; i++) {
        size_t k = (ch->rr + i) % ch->n_eps;
        struct endpoint *ep = ch->eps[k];
        if ((ep == exclude || (ep->bit & refused)) && ch->n_eps > 1)
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
    uint64_t now, refused;
};

static struct endpoint *dir_ep_of(struct bex_rpc_channel *ch, const struct bex__dir_node *n)
{
    for (struct endpoint *ep = ch->deps; ep; ep = ep->dnext)
        if (ep->node == n)
            return ep;
    return NULL;
}

/* The channel's own exclusions, as in choose_ep: the failed attempt's
 * endpoint, one that refused the call, one held down, one being probed by
 * its reconnection. */
static bool dir_avoid_fn(void *arg, const struct bex__dir_node *n)
{
    const struct dir_avoid *a = arg;
    const struct endpoint *ep = dir_ep_of(a->ch, n);
    return ep &&
           (ep == a->exclude || (ep->bit & a->refused) || ep->down_until > a->now || ep_probed(ep));
}

/* Directory mode: the directory picks the node (locality, load,
 * quarantine); NULL when the shard has no replica. */
static struct endpoint *dir_choose_ep(struct bex_rpc_channel *ch, const struct endpoint *exclude,
                                      uint64_t refused)
{
    struct dir_avoid a = {ch, exclude, bex__rpc_now_ns(), refused};
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

/* c's request on s: its first send in the call's own descriptor (no
 * allocation), a retry's in one of bex's (the first may still be out) */
static int send_call(bex_sock *s, struct call *c)
{
    if (c->borrow.tail) { /* header and body, then the caller's tail: gathered */
        struct iovec iov[2] = {{c->msg, c->len}, {c->borrow.tail, c->borrow.tail_len}};
        return bex_sock_sendv(s, iov, 2, c);
    }
    if (c->sreq_used)
        return bex_sock_send(s, c->msg, c->len, c);
    int err = bex_sock_send_req(s, &c->sreq, c->msg, c->len, c);
    c->sreq_used = !err;
    return err;
}
/* Whether ep brings c nothing new while an attempt of it is out on keep:
 * ep refused c before, or keep is the earlier attempt c holds (c->held)
 * and ep is its endpoint (the request is there already). Then the pick is
 * given back to the directory, not used. */
static bool nothing_new(struct bex_rpc_channel *ch, const struct call *c, struct endpoint *ep,
                        const struct link *keep)
{
    if (!keep || !ep || ((ep->bit & c->refused) == 0 && !(keep == c->held && ep == keep->ep)))
        return false;
    if (ch->dir)
        bex__dir_report_node(ch->dir, ep->node, BEX_DIR_DONE, true, bex__rpc_now_ns());
    return true;
}

/* c's request was refused by l's socket (-EPIPE): the connection failed
 * and its failure callback is waiting for ch->mu. It fails now, as that
 * callback would have it (the endpoint counted once, its node's connection
 * failure reported, its link dropped), so that the retry sees the endpoint
 * failed rather than finding this link again, and a quarantined replica is
 * released for it when this was the shard's last one (src/rpc/dir.c,
 * release_early). Returns the socket's own error (a refused connection's
 * -ECONNREFUSED, which the socket layer records before it marks the socket
 * failed), not the send's -EPIPE; *step as bex__rpc_start_attempt's. */
static int send_refused(struct bex_rpc_channel *ch, struct call *c, struct link *l, bool *step,
                        struct call **done)
{
    struct endpoint *ep = l->ep;
    int why = bex_sock_last_error(l->s, NULL, 0);
    int err = why ? why : -EPIPE;
    *step = bex__rpc_link_fail(ch, l, err, done);
    c->refused_new = call_refused(ch, c, ep); /* refused by the socket: not sent */
    return err;
}

/* Send c on an endpoint (not exclude when there is another, nor one that
 * refused c): on the endpoint's link, or (a call with a destination) on a
 * socket of its own (bex__rpc_xatt_open). Returns 0 or the error that kept
 * the attempt from starting; *step: that error was a connection failure
 * that took a step of the recovery ladder; -EALREADY: keep (an attempt of
 * c still out, NULL: none) is all there is (nothing_new), no attempt
 * made. A link found failed here fails now (bex__rpc_link_fail: its other
 * calls go to done or elsewhere). A connection refused here, before the
 * request was sent, sets c->refused_new on the endpoint's first refusal
 * of c. */
int bex__rpc_start_attempt(struct bex_rpc_channel *ch, struct call *c,
                           const struct endpoint *exclude, const struct link *keep, bool *step,
                           struct call **done)
{
    *step = false;
    c->refused_new = false;
    c->link = NULL;
    c->attempt_deadline = 0;
    if (c->dst) {
        /* a fresh exposure per attempt, and never two at once: the last
         * one is retired first (its socket closed, the attempt goes on
         * when the exposure comes back: xatt_retired) */
        if (c->xa)
            bex__rpc_xatt_end(c->xa);
        if (c->xa && c->xa->armed) {
            bex__rpc_call_move(ch, c, CALL_WAITING);
            return 0;
        }
    }
    struct endpoint *ep = choose_ep(ch, exclude, c->refused);
    if (nothing_new(ch, c, ep, keep))
        return -EALREADY;
    c->attempts++;
    if (ch->dir) {
        /* the new pick counts as outstanding; the old attempt's no more */
        bex__rpc_dir_release(ch, c);
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
    if (err && err != -ENOMEM && err != -EINVAL)
        c->refused_new = call_refused(ch, c, ep); /* no connection: nothing sent */
    if (!err && !c->dst) {
        void (*hook)(bex_sock *) = atomic_load_explicit(&send_hook, memory_order_acquire);
        if (hook)
            hook(l->s);
        err = send_call(l->s, c);
        if (err == -EPIPE)
            return send_refused(ch, c, l, step, done);
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
    if ((c->flags & BEX_RPC_CALL_NO_RETRY) ||
        c->attempts - c->moves - c->unsent >= ch->max_attempts ||
        !bex__rpc_retryable(err, remote) || bex__rpc_now_ns() >= c->deadline || ch->destroying)
        return false;
    if (ch->retry_permille < 1000 && bex__rpc_rnd(ch) % 1000 >= ch->retry_permille)
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
static bool may_retry_free(struct bex_rpc_channel *ch, struct call *c, int err)
{
    return !(c->flags & BEX_RPC_CALL_NO_RETRY) && ch->max_attempts > 1 &&
           bex__rpc_retryable(err, false) && bex__rpc_now_ns() < c->deadline && !ch->destroying;
}

static bool may_move(struct bex_rpc_channel *ch, struct call *c, int err)
{
    return c->moves < LADDER_MOVES_MAX && may_retry_free(ch, c, err);
}

/* c's attempts after the one out on c->held came to nothing: the call
 * waits for that one (its answer, its connection's failure, or the
 * deadline) rather than failing while it may still be answered. Returns
 * whether it does. */
static bool wait_held(struct bex_rpc_channel *ch, struct call *c)
{
    struct link *h = c->held;
    c->held = NULL;
    if (!h || h->state == L_FAILED || c->dst || ch->destroying)
        return false;
    bex__rpc_dir_release(ch, c); /* the failed attempt's pick */
    c->link = h;
    c->ep = h->ep;
    c->attempt_deadline = 0;
    return true;
}

/* The current attempt of c failed with err: retry, or complete with err.
 * moved: its connection's failure took a step of the recovery ladder. */
void bex__rpc_attempt_failed_ex(struct bex_rpc_channel *ch, struct call *c, int err, bool remote,
                                bool moved, struct call **done)
{
    if (!bex__rpc_call_live(c))
        return;
    if (c->ep && c->link)
        c->ep->failures++;
    c->link = NULL;
    c->attempt_deadline = 0;
    if (err == -EIO)
        c->in_doubt = true;
    for (;;) {
        /* a first refusal by its endpoint (nothing sent): retried as a
         * ladder's move is, without an attempt, coin or token */
        bool fresh = c->refused_new && may_retry_free(ch, c, err);
        c->refused_new = false;
        bool mv = moved && may_move(ch, c, err);
        bool token = !mv && !fresh;
        if (token && !bex__rpc_may_retry(ch, c, err, remote))
            break;
        ch->st.retries++;
        if (mv) {
            c->moves++;
            ch->st.ladder_moves++;
        } else if (fresh) {
            c->unsent++;
        }
        int e = bex__rpc_start_attempt(ch, c, c->ep, c->held, &moved, done);
        if (!e)
            return;
        if (e == -EALREADY) { /* nothing new: the held attempt is all there is */
            ch->st.retries--;
            if (token)
                ch->tokens += 1000;
            break;
        }
        err = e;
        remote = false;
    }
    if (wait_held(ch, c))
        return;
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
