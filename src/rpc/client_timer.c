/* SPDX-License-Identifier: Apache-2.0 */
/* RPC client: the timer thread (deadlines, attempt timeouts, Tc, the
 * recovery ladder's ticks). */
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

/* ---- timer thread: deadlines, attempt timeouts, Tc, the ladder ---- */

/* c's attempt passed attempt_timeout_ms: a failure of it for the
 * endpoint's counters and the directory, and a retry when the call may
 * have one (attempts, deadline, coin, budget), on another endpoint when
 * there is one that did not refuse the call. A link's attempt stays out
 * (its answer is still taken) and, the retry on another link, is held
 * (c->held): should the retry and those after it come to nothing (a dead
 * replica refusing them), the call waits for it rather than failing. An
 * attempt with a destination is abandoned (bex__rpc_start_attempt ends
 * it), as two would share the destination, and the retry exposes it
 * afresh once the transport no longer writes it. With no retry the
 * attempt stays out until the call's deadline. */
static void attempt_timed_out(struct bex_rpc_channel *ch, struct call *c, struct call **done)
{
    c->attempt_deadline = 0;
    struct link *pl = c->link;
    struct endpoint *pe = c->ep;
    if (pe)
        pe->failures++;
    bex__rpc_dir_report(ch, pe, BEX_DIR_REQ_FAIL);
    if (!bex__rpc_may_retry(ch, c, -ETIMEDOUT, false))
        return;
    ch->st.retries++;
    bool step;
    int err = bex__rpc_start_attempt(ch, c, pe, c->dst ? NULL : pl, &step, done);
    if (!err) {
        if (pl && c->link != pl && pl->state != L_FAILED && !c->held)
            c->held = pl;
        return;
    }
    if (err == -EALREADY) { /* only endpoints that refused the call: pl goes on */
        ch->st.retries--;
        ch->tokens += 1000;
        c->link = pl;
        c->ep = pe;
        return;
    }
    if (c->dst) {
        bex__rpc_attempt_failed_ex(ch, c, err, false, step, done); /* the first one was ended */
    } else if (!pl || pl->state == L_FAILED) {
        /* its link was found failed by the retry (bex__rpc_start_attempt failed it
         * while the call was on none): nothing answers the first any more */
        c->ep = pe;
        bex__rpc_attempt_failed_ex(ch, c, err, false, step, done);
    } else {
        /* no second attempt now: the first may still answer */
        c->refused_new = false;
        c->link = pl;
        c->ep = pe;
    }
}

void *bex__rpc_timer_main(void *arg)
{
    struct bex_rpc_channel *ch = arg;
    pthread_mutex_lock(&ch->mu);
    while (!ch->stop) {
        uint64_t now = bex__rpc_now_ns();
        uint64_t next = now + 1000000000ull;
        struct call *done = NULL;
        if (ch->dir)
            bex__rpc_dir_prune(ch, &done);
        struct bex__list *lp;
        bex__list_foreach(lp, &ch->links)
        {
            struct link *l = bex__list_entry(lp, struct link, lnode);
            if (l->retiring && l->state != L_FAILED && !bex__rpc_link_has_calls(ch, l)) {
                bex__rpc_link_move(ch, l, L_FAILED); /* not a failure: nothing to count */
                bex_sock_close(l->s);
                continue;
            }
            /* up within Tc; the ladder's, then its ping answered within
             * probe_ns */
            uint64_t due;
            if (l->state == L_CONNECTING)
                due = l->t_start + ch->tc_ns;
            else if (l->ping && !l->proven && l->state == L_UP)
                due = l->t_start + ch->probe_ns;
            else
                continue;
            if (now >= due)
                bex__rpc_link_fail(ch, l, -ETIMEDOUT, &done);
            else if (due < next)
                next = due;
        }
        for (size_t i = 0; i < ch->n_eps; i++) {
            uint64_t due = bex__rpc_ladder_tick(ch, ch->eps[i], now, &done);
            if (due && due < next)
                next = due;
        }
        for (struct endpoint *ep = ch->deps; ep; ep = ep->dnext) {
            uint64_t due = bex__rpc_ladder_tick(ch, ep, now, &done);
            if (due && due < next)
                next = due;
        }
        struct bex__list *pos, *tmp;
        bex__list_foreach_safe(pos, tmp, &ch->live)
        {
            struct call *c = bex__list_entry(pos, struct call, lnode);
            if (now >= c->deadline) {
                bex__rpc_complete(ch, c, -ETIMEDOUT, NULL, 0, K_TIMEOUT, &done);
                continue;
            }
            if (c->attempt_deadline && now >= c->attempt_deadline)
                attempt_timed_out(ch, c, &done);
            if (bex__rpc_call_live(c) && c->deadline < next)
                next = c->deadline;
            if (bex__rpc_call_live(c) && c->attempt_deadline && c->attempt_deadline < next)
                next = c->attempt_deadline;
        }
        if (done) {
            pthread_mutex_unlock(&ch->mu);
            bex__rpc_run_done(ch, done);
            pthread_mutex_lock(&ch->mu);
            continue;
        }
        ch->timer_next = next;
        uint64_t until = bex__rpc_clock_sleep_until(next);
        struct timespec ts = {(time_t)(until / 1000000000ull), (long)(until % 1000000000ull)};
        pthread_cond_timedwait(&ch->cv, &ch->mu, &ts);
        ch->timer_next = 0;
    }
    pthread_mutex_unlock(&ch->mu);
    return NULL;
}
