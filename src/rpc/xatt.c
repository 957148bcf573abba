/* SPDX-License-Identifier: Apache-2.0 */
/* RPC client: attempts with a destination (bex_rpc_call_into): each on a
 * socket of its own, so that ending one retires the destination's exposure. */
#include <arpa/inet.h>
#include <assert.h>
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

/* ---- attempts with a destination (bex_rpc_call_into) ---- */

static void x_on_connect(bex_sock *s, int status, void *user);
static void x_on_recv(bex_sock *s, void *buf, size_t len, void *user);
static void x_on_send_done(bex_sock *s, void *buf, size_t len, void *msg_user, int status,
                           void *user);
static void x_on_error(bex_sock *s, int err, void *user);
static void x_on_close(bex_sock *s, void *user);

static const bex_sock_ops xatt_ops = {
    .on_connect = x_on_connect,
    .on_recv = x_on_recv,
    .on_send_done = x_on_send_done,
    .on_error = x_on_error,
    .on_close = x_on_close,
};

/* c's attempt on ep (bex__rpc_start_attempt picked it): a socket of its own on
 * the endpoint's connection as the ladder has it (joining the channel's
 * link's when there is one, the same options), which takes ladder steps,
 * counts and reports as a link does. */
int bex__rpc_xatt_open(struct bex_rpc_channel *ch, struct call *c, struct endpoint *ep)
{
    struct xatt *xa = calloc(1, sizeof(*xa));
    if (!xa)
        return -ENOMEM;
    *xa = (struct xatt){.ch = ch, .c = c, .ep = ep, .state = XA_PROBING};
    bex_connect_opts o = bex__rpc_ladder_connect(ch, ep, &xa->rung, &xa->tcp, &xa->gen);
    int err = bex_sock_connect_opts(ch->ctx, &ep->addr, &xatt_ops, xa, &o, &xa->s);
    if (err) {
        free(xa);
        return err;
    }
    ep->refs++;
    c->refs++;
    c->xa = xa;
    ep->xprobing++; /* PROBING */
    return 0;
}

static const char *const xatt_names[] = {"PROBING", "OPEN", "CLOSING", "CLOSED"};

/* The one place xa->state changes (under ch->mu): each move is named in
 * the debug log; one our own code must never make asserts (every move
 * is ours: the socket layer reports on_close once, and only after
 * bex_sock_close; a peer's answer is checked before it proves the
 * socket). Leaving PROBING takes xa off its endpoint's count. */
static void xatt_move(struct xatt *xa, enum xatt_state to)
{
    enum xatt_state from = xa->state;
    assert((from == XA_PROBING && (to == XA_OPEN || to == XA_CLOSING)) ||
           (from == XA_OPEN && to == XA_CLOSING) || (from == XA_CLOSING && to == XA_CLOSED));
    assert(to != XA_CLOSED || !xa->armed);
    xa->state = to;
    if (from == XA_PROBING)
        xa->ep->xprobing--;
    struct bex_rpc_channel *ch = xa->ch;
    if (ch->log && ch->log->level >= BEX_LOG_DEBUG)
        bex__log(ch->log, BEX_LOG_DEBUG, "rpc channel %s: attempt %p (call %llu) %s -> %s",
                 ch->name, (void *)xa, (unsigned long long)xa->c->id, xatt_names[from],
                 xatt_names[to]);
}

/* xa's socket no longer probes its endpoint: it was answered over, or
 * came up at step OK. */
static void xatt_probed(struct xatt *xa)
{
    if (xa->state == XA_PROBING)
        xatt_move(xa, XA_OPEN);
}

/* End xa's attempt: its socket closes (and probes no more). */
void bex__rpc_xatt_end(struct xatt *xa)
{
    if (!bex__rpc_xatt_live(xa))
        return;
    xatt_move(xa, XA_CLOSING);
    bex_sock_close(xa->s);
}

/* xa's exposure came back or was delivered: what waited for it goes on. */
static void xatt_retired(struct bex_rpc_channel *ch, struct xatt *xa, struct call **done)
{
    struct call *c = xa->c;
    if (xa->armed || c->xa != xa)
        return;
    if (c->state == CALL_PARKED) {
        bex__rpc_call_move(ch, c, CALL_DONE);
        c->dnext = *done;
        *done = c;
    } else if (c->state == CALL_WAITING) {
        bex__rpc_call_move(ch, c, CALL_LIVE);
        bool step;
        int err = bex__rpc_start_attempt(ch, c, c->ep, NULL, &step, done);
        if (err)
            bex__rpc_attempt_failed_ex(ch, c, err, false, step, done);
    }
}

/* xa's attempt failed with err: retry or complete, if it is still the
 * call's current one. conn: its connection failed (as a link's failure:
 * the ladder, the counters, the directory; the calls it moves spend no
 * budget), not only this socket (a malformed answer, a refused message). */
static void xatt_failed(struct bex_rpc_channel *ch, struct xatt *xa, int err, bool conn,
                        struct call **done)
{
    struct call *c = xa->c;
    bex__rpc_xatt_end(xa);
    if (c->xa != xa || c->state != CALL_LIVE)
        return;
    bool moved = conn && bex__rpc_ep_conn_failed(ch, xa->ep, xa->rung, xa->gen, err);
    xa->ep->failures++;
    bex__rpc_attempt_failed_ex(ch, c, err, false, moved, done);
}

static void x_on_connect(bex_sock *s, int status, void *user)
{
    struct xatt *xa = user;
    struct bex_rpc_channel *ch = xa->ch;
    struct call *c = xa->c, *done = NULL;
    pthread_mutex_lock(&ch->mu);
    /* a connection the ladder made proves itself by an answer (a failed
     * one probes no more either: xatt_failed ends it) */
    if (!status && xa->rung == BEX_RPC_LADDER_OK)
        xatt_probed(xa);
    if (!status && xa->rung == BEX_RPC_LADDER_OK)
        bex__rpc_ep_reachable(ch, xa->ep);
    if (status) {
        xatt_failed(ch, xa, status, true, &done);
    } else if (bex__rpc_xatt_live(xa) && c->xa == xa && bex__rpc_call_live(c)) {
        /* over RDMA the answer is written into the destination (header
         * in its room, then the body); over TCP, where an exposed buffer
         * must be written whole, it comes as a message and is copied */
        struct bex__rpc_dest d = {.cap = (uint32_t)c->cap};
        int err = 0;
        if (bex_sock_transport(s) == BEX_TRANSPORT_RDMA) {
            bex_remote_buf rb;
            err = bex_sock_expose(s, bex__rpc_hdr_of(c->dst), (uint32_t)(c->cap + BEX_RPC_HDR_LEN),
                                  &xa->armed, &rb);
            if (!err) {
                xa->armed = true;
                d = (struct bex__rpc_dest){rb.addr, rb.rkey, rb.token, (uint32_t)c->cap};
            }
        }
        uint8_t *m = err ? NULL : bex_sock_alloc(ch->ctx, BEX_RPC_HDR_LEN + BEX__RPC_DEST_LEN);
        if (!err && !m)
            err = -ENOMEM;
        if (!err) {
            struct bex__rpc_hdr h;
            const char *why;
            bex__rpc_hdr_decode(c->msg, c->len, &h, &why); /* ours: well-formed */
            h.kind = BEX__RPC_DEST;
            h.flags = 0;
            h.body_len = BEX__RPC_DEST_LEN;
            h.timeout_ms = 0;
            bex__rpc_hdr_encode(&h, m);
            bex__rpc_dest_encode(&d, m + BEX_RPC_HDR_LEN);
            err = bex_sock_send(s, m, BEX_RPC_HDR_LEN + BEX__RPC_DEST_LEN, &xa->dest_tag);
            if (err)
                bex_mem_free(m);
        }
        if (!err) {
            err = bex_sock_send(s, c->msg, c->len, c);
            if (!err)
                c->refs++;
        }
        if (err)
            xatt_failed(ch, xa, err, false, &done);
    }
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, done);
}

static void x_on_error(bex_sock *s, int err, void *user)
{
    (void)s;
    struct xatt *xa = user;
    struct bex_rpc_channel *ch = xa->ch;
    struct call *done = NULL;
    pthread_mutex_lock(&ch->mu);
    /* the socket layer handed the exposure back before this */
    xatt_failed(ch, xa, err ? err : -ECONNRESET, true, &done);
    xatt_retired(ch, xa, &done);
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, done);
}

static void x_on_send_done(bex_sock *s, void *buf, size_t len, void *msg_user, int status,
                           void *user)
{
    (void)s;
    (void)len;
    struct xatt *xa = user;
    struct bex_rpc_channel *ch = xa->ch;
    struct call *c = xa->c, *done = NULL;
    pthread_mutex_lock(&ch->mu);
    if (msg_user == &xa->armed) {
        /* the exposure came back undelivered: retired */
        xa->armed = false;
        xatt_retired(ch, xa, &done);
    } else {
        if (msg_user == &xa->dest_tag)
            bex_mem_free(buf);
        else
            bex__rpc_call_put(ch, c); /* the request: c->msg stays the call's */
        /* refused by the peer: this attempt's; not delivered or in
         * doubt: the connection failed */
        if (status)
            xatt_failed(ch, xa, status == -ECANCELED ? -ECONNRESET : status,
                        status != -ENOMEM && status != -EMSGSIZE, &done);
    }
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, done);
}

/* An answer on an attempt's socket: written into the destination (buf is
 * its header room; len the exposed length) or a message (copied into the
 * destination). A write into a destination that names another call, or
 * a body longer than the destination, is a hostile or broken server:
 * refused like a malformed answer. */
static void x_on_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct xatt *xa = user;
    struct bex_rpc_channel *ch = xa->ch;
    struct call *c = xa->c, *done = NULL;
    pthread_mutex_lock(&ch->mu);
    bool into = (uint8_t *)buf == bex__rpc_hdr_of(c->dst);
    if (into) {
        xa->armed = false; /* delivered: the socket layer revoked its key */
        size_t blen = bex__rpc_hdr_body_len(buf);
        len = blen <= c->cap ? blen + BEX_RPC_HDR_LEN : 0;
    }
    struct bex__rpc_hdr h;
    const char *why = NULL;
    int err = len ? bex__rpc_hdr_decode(buf, len, &h, &why) : -EBADMSG;
    if (!len)
        why = "an answer longer than the destination";
    else if (!err && (h.kind == BEX__RPC_REQUEST || h.kind == BEX__RPC_DEST))
        why = "a request on a client connection";
    else if (!err && h.client_id != ch->client_id)
        why = "another client's id";
    else if (!err && (h.call_id != c->id || h.service != c->service || h.method != c->method))
        why = into ? "a write into another call's destination" : "an answer naming another call";
    bool current = c->xa == xa && c->state == CALL_LIVE;
    if (why) {
        ch->st.bad_header++;
        if (bex__rpc_xatt_live(xa))
            bex__log(ch->log, BEX_LOG_WARN,
                     "rpc channel %s: malformed answer (%s): attempt's socket closed", ch->name,
                     why);
        xatt_failed(ch, xa, -EPROTO, false, &done);
    } else {
        /* the connection works, at the step it was made at */
        bex__rpc_ep_answered(ch, xa->ep, xa->tcp, h.status, current);
        xatt_probed(xa);
        bex__rpc_ep_reachable(ch, xa->ep);
        bex__rpc_ladder_proven(ch, xa->ep, xa->rung);
        if (!current) {
            ch->st.late_responses++;
        } else {
            bex__rpc_xatt_end(xa); /* one answer per attempt */
            size_t blen = h.body_len;
            if (h.status && bex__rpc_retryable(h.status, true)) {
                bex__rpc_attempt_failed(ch, c, h.status, true, &done);
            } else if (!into && blen > c->cap) {
                /* a server that did not check: nothing is copied */
                bex__rpc_complete(ch, c, -EMSGSIZE, c->dst, 0, K_REMOTE, &done);
            } else {
                if (!into && blen)
                    memcpy(c->dst, (uint8_t *)buf + BEX_RPC_HDR_LEN, blen);
                bex__rpc_complete(ch, c, h.status, c->dst, blen, h.status ? K_REMOTE : K_OK, &done);
            }
        }
    }
    if (into)
        xatt_retired(ch, xa, &done);
    pthread_mutex_unlock(&ch->mu);
    if (!into)
        bex_mem_free(buf);
    bex__rpc_run_done(ch, done);
}

static void x_on_close(bex_sock *s, void *user)
{
    (void)s;
    struct xatt *xa = user;
    struct bex_rpc_channel *ch = xa->ch;
    struct call *c = xa->c, *done = NULL;
    pthread_mutex_lock(&ch->mu);
    xa->armed = false; /* exposures come back before bex__rpc_on_close */
    xatt_move(xa, XA_CLOSED);
    xatt_retired(ch, xa, &done);
    if (c->xa == xa)
        c->xa = NULL;
    bex__rpc_ep_put(xa->ep);
    pthread_mutex_unlock(&ch->mu);
    bex__rpc_run_done(ch, done);
    pthread_mutex_lock(&ch->mu);
    bex__rpc_call_put(ch, c);
    pthread_cond_broadcast(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
    free(xa);
}

/* The attempts with a destination out on ep end as if their connection
 * failed with err (ep removed from the list or the directory). */
void bex__rpc_xatt_fail_ep(struct bex_rpc_channel *ch, const struct endpoint *ep, int err,
                           struct call **done)
{
    /* completing a call unlinks it alone: the saved next stays valid */
    struct bex__list *pos, *tmp;
    bex__list_foreach_safe(pos, tmp, &ch->live)
    {
        struct call *c = bex__list_entry(pos, struct call, lnode);
        if (c->xa && c->xa->ep == ep && bex__rpc_xatt_live(c->xa))
            xatt_failed(ch, c->xa, err, false, done);
    }
}
