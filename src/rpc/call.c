/* SPDX-License-Identifier: Apache-2.0 */
/* RPC client: the call table, a call's completion and the directory's
 * outcome reports. */
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

/* ---- calls (under ch->mu) ---- */

struct call *bex__rpc_call_find(struct bex_rpc_channel *ch, uint64_t id)
{
    return bex__hmap_get(&ch->calls, id);
}

void bex__rpc_call_put(struct bex_rpc_channel *ch, struct call *c)
{
    if (--c->refs)
        return;
    if (c->borrow.release)
        c->borrow.release(c->borrow.arg); /* the caller's body (or tail), no longer read */
    if (!c->borrow.release || c->borrow.tail)
        bex_mem_free(c->msg);
    if (ch->n_spare < BEX__RPC_CALL_SPARE) {
        c->dnext = ch->spare;
        ch->spare = c;
        ch->n_spare++;
    } else {
        free(c);
    }
    /* only bex_rpc_channel_destroy waits for none: the timer thread,
     * which waits on the same condition, is not woken per call */
    if (--ch->n_calls == 0 && ch->destroying)
        pthread_cond_broadcast(&ch->cv);
}

/* ---- directory mode: outcomes for quarantine (under ch->mu) ---- */

void bex__rpc_dir_report(struct bex_rpc_channel *ch, struct endpoint *ep, int outcome)
{
    if (ch->dir && ep && ep->node)
        bex__dir_report_node(ch->dir, ep->node, outcome, false, bex__rpc_now_ns());
}

/* c's attempt no longer counts as outstanding on its node */
void bex__rpc_dir_release(struct bex_rpc_channel *ch, struct call *c)
{
    if (c->counted)
        bex__dir_report_node(ch->dir, c->counted->node, BEX_DIR_DONE, true, bex__rpc_now_ns());
    c->counted = NULL;
}

/* Take c off the books with status; its completion runs once the lock is
 * released (bex__rpc_run_done). */
void bex__rpc_complete(struct bex_rpc_channel *ch, struct call *c, int status, void *resp,
                       size_t resp_len, int kind, struct call **done)
{
    if (!bex__rpc_call_live(c)) {
        if (!c->dst || resp != c->dst)
            bex_rpc_free(resp);
        return;
    }
    bex__hmap_del(&ch->calls, c->id);
    bex__list_remove(&c->lnode);
    c->held = NULL;
    c->status = status;
    c->resp = resp;
    c->resp_len = resp_len;
    /* an attempt out (a link's, or a destination's own socket not being
     * ended for a next one) timed out with the call */
    if (kind == K_TIMEOUT && (c->link || (c->xa && bex__rpc_xatt_live(c->xa))))
        bex__rpc_dir_report(ch, c->ep, BEX_DIR_REQ_FAIL);
    bex__rpc_dir_release(ch, c);
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
        if (c->xa)
            bex__rpc_xatt_end(c->xa);
        if (c->xa && c->xa->armed) {
            bex__rpc_call_move(ch, c, CALL_PARKED);
            return;
        }
    }
    bex__rpc_call_move(ch, c, CALL_DONE);
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

/* ---- states of links and calls (under ch->mu) ---- */

static const char *const link_names[] = {"CONNECTING", "UP", "FAILED"};
static const char *const call_names[] = {"LIVE", "WAITING", "PARKED", "DONE"};

void bex__rpc_link_move(struct bex_rpc_channel *ch, struct link *l, enum link_state to)
{
    enum link_state from = l->state;
    assert((from == L_CONNECTING && (to == L_UP || to == L_FAILED)) ||
           (from == L_UP && to == L_FAILED));
    l->state = to;
    if (ch->log && ch->log->level >= BEX_LOG_DEBUG)
        bex__log(ch->log, BEX_LOG_DEBUG, "rpc channel %s: link %p %s -> %s", ch->name, (void *)l,
                 link_names[from], link_names[to]);
}

void bex__rpc_call_move(struct bex_rpc_channel *ch, struct call *c, enum call_state to)
{
    enum call_state from = c->state;
    assert((from == CALL_LIVE && to != CALL_LIVE) || (from == CALL_WAITING && to != CALL_WAITING) ||
           (from == CALL_PARKED && to == CALL_DONE));
    c->state = to;
    /* every call completes: its moves are logged only when asked for */
    if (ch->log && ch->log->level >= BEX_LOG_DEBUG)
        bex__log(ch->log, BEX_LOG_DEBUG, "rpc channel %s: call %llu %s -> %s", ch->name,
                 (unsigned long long)c->id, call_names[from], call_names[to]);
}
