/* SPDX-License-Identifier: Apache-2.0 */
/* RPC client: the socket callbacks of its links (I/O thread): connections
 * coming up or failing, sends done, answers taken. */
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

/* ---- socket callbacks (I/O thread) ---- */

/* A connection to ep is up (or, when the ladder made it, answered): the
 * endpoint is no longer suspect. */
void bex__rpc_ep_reachable(struct bex_rpc_channel *ch, struct endpoint *ep)
{
    if (ep->suspect) {
        char a[BEX_ADDR_STRLEN];
        bex_addr_format(&ep->addr, false, a, sizeof a);
        bex__log(ch->log, BEX_LOG_WARN, "rpc channel %s: endpoint %s:%u reachable again", ch->name,
                 a, bex_addr_port(&ep->addr));
    }
    ep->suspect = false;
}

void bex__rpc_on_connect(bex_sock *s, int status, void *user)
{
    (void)s;
    struct link *l = user;
    struct bex_rpc_channel *ch = l->ch;
    struct call *done = NULL;
    pthread_mutex_lock(&ch->mu);
    if (status) {
        bex__rpc_link_fail_ex(ch, l, status, true, &done); /* never up: nothing sent */
    } else if (l->state == L_CONNECTING && l->ping && !l->proven) {
        bex__rpc_link_move(ch, l, L_UP); /* its ping must be answered within probe_ns from now */
        l->t_start = bex__rpc_now_ns();
        if (l->t_start + ch->probe_ns < ch->timer_next)
            pthread_cond_broadcast(&ch->cv);
    } else if (l->state == L_CONNECTING) {
        bex__rpc_link_move(ch, l, L_UP);
        bex__rpc_ep_reachable(ch, l->ep);
    }
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, done);
}

void bex__rpc_on_error(bex_sock *s, int err, void *user)
{
    (void)s;
    struct link *l = user;
    struct bex_rpc_channel *ch = l->ch;
    struct call *done = NULL;
    pthread_mutex_lock(&ch->mu);
    bex__rpc_link_fail(ch, l, err ? err : -ECONNRESET, &done);
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, done);
}

void bex__rpc_on_close(bex_sock *s, void *user)
{
    (void)s;
    struct link *l = user;
    struct bex_rpc_channel *ch = l->ch;
    pthread_mutex_lock(&ch->mu);
    bex__list_remove(&l->lnode);
    if (l->ep->cur == l)
        l->ep->cur = NULL;
    bex__rpc_ep_put(l->ep);
    /* calls still naming l as their attempt's link are failed by now
     * (bex__rpc_link_fail ran before the close), so nothing points to l */
    pthread_cond_broadcast(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
    free(l);
}

void bex__rpc_on_send_done(bex_sock *s, void *buf, size_t len, void *msg_user, int status,
                           void *user)
{
    (void)s;
    (void)buf;
    (void)len;
    struct link *l = user;
    struct bex_rpc_channel *ch = l->ch;
    struct call *c = msg_user;
    struct call *done = NULL;
    pthread_mutex_lock(&ch->mu);
    if (msg_user == (void *)l) { /* a ping */
        bex_mem_free(buf);
        /* refused by the peer: the link failed its proof; not delivered
         * or in doubt: the connection failed, and bex__rpc_on_connect or bex__rpc_on_error
         * says how */
        if (status == -ENOMEM || status == -EMSGSIZE)
            bex__rpc_link_fail(ch, l, status, &done);
        pthread_mutex_unlock(&ch->mu);
        bex__rpc_run_done(ch, done);
        return;
    }
    if (status && status != -ENOMEM && status != -EMSGSIZE && l->state == L_CONNECTING) {
        /* the connection failed before it was up: bex__rpc_on_connect follows and
         * says why (the calls on it move then) */
    } else if (status && status != -ENOMEM && status != -EMSGSIZE && l->state == L_UP) {
        /* not delivered, or in doubt: the connection failed (its bex__rpc_on_error
         * follows the sends it hands back), and with it every call on it */
        bex__rpc_link_fail(ch, l, status == -ECANCELED ? -ECONNRESET : status, &done);
    } else if (status && bex__rpc_call_live(c) && c->link == l) {
        if (c->held == l)
            c->held = NULL; /* a send of it on l failed: wait for none there */
        bex__rpc_attempt_failed(ch, c, status, false, &done);
    }
    bex__rpc_call_put(ch, c);
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, done);
}

void bex__rpc_on_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct link *l = user;
    struct bex_rpc_channel *ch = l->ch;
    struct call *done = NULL;
    struct bex__rpc_hdr h;
    const char *why = NULL;
    pthread_mutex_lock(&ch->mu);
    if (l->said & LINK_SAID_MALFORMED) {
        pthread_mutex_unlock(&ch->mu);
        bex_mem_free(buf);
        return;
    }
    int err = bex__rpc_hdr_decode(buf, len, &h, &why);
    struct call *c = NULL;
    bool ping = !err && (h.call_id >> 63); /* our probes' ids; calls count from 1 */
    if (!err && h.kind == BEX__RPC_REQUEST)
        why = "a request on a client connection";
    else if (!err && h.client_id != ch->client_id)
        why = "another client's id";
    else if (ping && (h.service != BEX_RPC_SERVICE_PING || h.method != 0))
        why = "an answer naming another method";
    if (!why && !ping) {
        c = bex__rpc_call_find(ch, h.call_id);
        if (c && (c->service != h.service || c->method != h.method))
            why = "an answer naming another method";
    }
    if (why) {
        ch->st.bad_header++;
        bex__log_once(ch->log, &l->said, LINK_SAID_MALFORMED, BEX_LOG_WARN,
                      "rpc channel %s: malformed answer (%s): connection closed", ch->name, why);
        bex__rpc_link_fail(ch, l, -EPROTO, &done);
        pthread_mutex_unlock(&ch->mu);
        bex_mem_free(buf);
        bex__rpc_run_done(ch, done);
        return;
    }
    if (!l->proven && l->state != L_FAILED) /* a failed one proves nothing any more */
        bex__rpc_link_proven(ch, l);
    if (ping) {
        pthread_mutex_unlock(&ch->mu);
        bex_mem_free(buf);
        return;
    }
    bex__rpc_ep_answered(ch, l->ep, l->tcp, h.status, c != NULL);
    if (!c) {
        ch->st.late_responses++; /* completed already: timed out, cancelled */
        pthread_mutex_unlock(&ch->mu);
        bex_mem_free(buf);
        return;
    }
    size_t blen = len - BEX_RPC_HDR_LEN;
    void *body = blen ? (uint8_t *)buf + BEX_RPC_HDR_LEN : NULL;
    if (!blen)
        bex_mem_free(buf);
    if (c->held == l)
        c->held = NULL; /* answered over l: no answer to wait for there any more */
    if (h.status && bex__rpc_retryable(h.status, true) && c->link == l) {
        bex_rpc_free(body);
        bex__rpc_attempt_failed(ch, c, h.status, true, &done);
    } else if (h.status && bex__rpc_retryable(h.status, true)) {
        /* an earlier attempt's refusal: the current attempt may still do */
        bex_rpc_free(body);
    } else {
        bex__rpc_complete(ch, c, h.status, body, blen, h.status ? K_REMOTE : K_OK, &done);
    }
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, done);
}

/* Directory mode: after the directory changed, close the connections to
 * nodes the shard no longer lists (a server deregistered, a file
 * reloaded); the calls out on them are retried on the others, as after
 * bex_rpc_channel_set_endpoints. Runs on the timer thread, so within about
 * a second of the change. */
void bex__rpc_dir_prune(struct bex_rpc_channel *ch, struct call **done)
{
    uint64_t g = bex_dir_generation(ch->dir);
    if (g == ch->dir_gen)
        return;
    ch->dir_gen = g;
    /* a retry may prepend an endpoint to deps: the walk goes on safely */
    for (struct endpoint *ep = ch->deps; ep; ep = ep->dnext) {
        if ((ep->cur || ep->probe) &&
            !bex__dir_in_shard(ch->dir, ch->service, ch->shard, ep->node)) {
            if (ep->cur)
                bex__rpc_link_fail(ch, ep->cur, -ECONNABORTED, done);
            if (ep->probe)
                bex__rpc_link_fail(ch, ep->probe, -ECONNABORTED, done);
        }
        if (!bex__dir_in_shard(ch->dir, ch->service, ch->shard, ep->node))
            bex__rpc_xatt_fail_ep(ch, ep, -ECONNABORTED, done);
    }
}

/* Step 3: try RDMA to ep again, on a connection of its own carrying a
 * ping (BEX_RPC_SERVICE_PING) and no call; explicitly RDMA, so that the
 * socket layer's own fallback cannot pass TCP off as RDMA. */
static void probe_open(struct bex_rpc_channel *ch, struct endpoint *ep, struct call **done)
{
    ch->st.rdma_retries++;
    ep->rdma_retry_at = bex__rpc_now_ns() + ch->rdma_retry_ns; /* unless it works */
    struct link *l = calloc(1, sizeof(*l));
    int err = -ENOMEM;
    if (!l)
        goto fail;
    *l = (struct link){.ch = ch,
                       .ep = ep,
                       .state = L_CONNECTING,
                       .t_start = bex__rpc_now_ns(),
                       .rung = ep->rung,
                       .gen = ep->fail_gen,
                       .probe = true};
    bex_connect_opts o = {.flags = BEX_CONNECT_TRANSPORT, .transport = BEX_TRANSPORT_RDMA};
    err = bex_sock_connect_opts(ch->ctx, &ep->addr, &bex__rpc_link_ops, l, &o, &l->s);
    if (err)
        goto fail;
    ep->refs++;
    bex__list_push_head(&ch->links, &l->lnode);
    ep->probe = l;
    err = bex__rpc_send_ping(ch, l);
    if (err)
        bex__rpc_link_fail(ch, l, err, done);
    return;

fail:
    free(l);
    bex__rpc_ladder_log(ch, ep, BEX_LOG_INFO,
                        "RDMA still unusable (%s): staying on TCP, next try in %llu ms",
                        bex_strerror(err), (unsigned long long)(ch->rdma_retry_ns / 1000000ull));
}

bool bex__rpc_link_has_calls(struct bex_rpc_channel *ch, const struct link *l)
{
    const struct bex__list *pos;
    bex__list_foreach(pos, &ch->live)
    {
        const struct call *c = bex__list_entry(pos, const struct call, lnode);
        if (c->link == l || c->held == l)
            return true;
    }
    return false;
}

/* The ladder's timed work for ep: step 3's RDMA retries. Returns when it
 * is next due (0: nothing). */
uint64_t bex__rpc_ladder_tick(struct bex_rpc_channel *ch, struct endpoint *ep, uint64_t now,
                              struct call **done)
{
    if (ep->rung != BEX_RPC_LADDER_TCP || ep->probe)
        return 0;
    if (now < ep->rdma_retry_at)
        return ep->rdma_retry_at;
    probe_open(ch, ep, done);
    return ep->probe ? 0 : ep->rdma_retry_at;
}
