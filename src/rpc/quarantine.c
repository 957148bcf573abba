/* SPDX-License-Identifier: Apache-2.0 */
/* The service directory: quarantine (a node's failures within a window,
 * its hold-down and probes). */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "bex/sock.h"
#include "common/log.h"
#include "common/util.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"
#include "rpc/dir_impl.h"

/* ---- quarantine (under d->mu) ---- */

__attribute__((format(printf, 3, 4))) bool bex__dir_defer(struct pending *p, int level,
                                                          const char *fmt, ...)
{
    if (p->n == (int)ARRAY_SIZE(p->l))
        return false;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->l[p->n].text, sizeof p->l[p->n].text, fmt, ap);
    va_end(ap);
    p->l[p->n++].level = level;
    return true;
}

void bex__dir_flush(bex_dir *d, const struct pending *p)
{
    for (int i = 0; i < p->n; i++)
        bex__log(&d->log, p->l[i].level, "%s", p->l[i].text);
}

bool bex__dir_shard_has(const struct shard *sh, const struct bex__dir_node *n)
{
    for (size_t i = 0; i < sh->n; i++)
        if (sh->reps[i] == n)
            return true;
    return false;
}

/* Whether shard sh keeps a healthy replica besides n. */
static bool healthy_besides(const struct shard *sh, const struct bex__dir_node *n)
{
    for (size_t i = 0; i < sh->n; i++)
        if (sh->reps[i] != n && sh->reps[i]->state == BEX_DIR_HEALTHY)
            return true;
    return false;
}

/* Whether every shard n serves keeps a replica outside quarantine without n. */
static bool may_quarantine(bex_dir *d, const struct bex__dir_node *n)
{
    for (struct service *s = d->services; s; s = s->next)
        for (uint32_t k = 0; k < s->n_shards; k++) {
            const struct shard *sh = &s->shards[k];
            if (bex__dir_shard_has(sh, n) && !healthy_besides(sh, n))
                return false;
        }
    return true;
}

static const char *kind_name(int outcome)
{
    return outcome == BEX_DIR_CONN_FAIL ? "connection" : "request";
}

/* n, a healthy node, failed (outcome) and is the last replica outside
 * quarantine of some shard it serves: the quarantined replicas of those
 * shards are probed now rather than after their period, so that "never all
 * replicas of a shard at once" holds when that last one fails too, not
 * only when a quarantine starts (else every call of the shard would go to
 * the failing node until a period ended). A probe answered lifts the
 * quarantine as usual; a failed one starts another period, and the next
 * failure of n releases another probe: one call more per failure of n,
 * only while n keeps failing. A replica whose probe is out (another call's,
 * not answered yet) gets another one so too: else the calls that fail on n
 * would have nowhere but n to go until that probe's outcome (seen: a
 * ranker's Fetch retried on a replica killed with -9 until it failed).
 * Counted each time, logged once until a lift. */
static void release_early(bex_dir *d, const struct bex__dir_node *n, int outcome, uint64_t now,
                          struct pending *pl)
{
    for (struct service *s = d->services; s; s = s->next)
        for (uint32_t k = 0; k < s->n_shards; k++) {
            const struct shard *sh = &s->shards[k];
            if (!bex__dir_shard_has(sh, n) || healthy_besides(sh, n))
                continue;
            for (size_t i = 0; i < sh->n; i++) {
                struct bex__dir_node *q = sh->reps[i];
                if (q == n || now >= q->until)
                    continue;
                if (q->state == BEX_DIR_PROBING && q->probe_out) {
                    /* its probe out (another call's) holds the calls back
                     * as a quarantine does: another beside it (a probe
                     * as the first, its period over: not an early one) */
                    q->probe_out = false;
                    q->st.early_probes++;
                    continue;
                }
                if (q->state != BEX_DIR_QUARANTINED)
                    continue;
                q->state = BEX_DIR_PROBING;
                q->probe_out = false;
                q->early = true;
                q->st.early_probes++;
                /* logged once, when the line was kept */
                if (bex__log_first(&q->logged, DIR_LOGGED_EARLY) &&
                    !bex__dir_defer(pl, BEX_LOG_WARN,
                                    "dir: node %s probed before its quarantine ends: %s, the last "
                                    "replica of %s shard %u outside quarantine, failed (%s)",
                                    q->name, n->name, s->name, k, kind_name(outcome)))
                    q->logged &= ~(uint32_t)DIR_LOGGED_EARLY;
            }
        }
}

/* n passed a threshold (or failed its probe): quarantine it unless it is
 * the last healthy replica of a shard. */
static void quarantine(bex_dir *d, struct bex__dir_node *n, int outcome, uint64_t now,
                       struct pending *pl)
{
    bool probe = n->state == BEX_DIR_PROBING;
    bool early = n->early;
    n->early = false;
    if (!may_quarantine(d, n)) {
        n->st.quarantine_refused++;
        n->state = BEX_DIR_HEALTHY;
        n->probe_out = false;
        if (bex__log_first(&n->logged, DIR_LOGGED_REFUSED))
            bex__dir_defer(
                pl, BEX_LOG_WARN,
                "dir: node %s not quarantined despite %s failures: it is the last replica "
                "of a shard outside quarantine",
                n->name, kind_name(outcome));
        /* it cannot go, and the other replicas of its shard are
         * quarantined: they are probed now (a node failing this much is
         * what release_early is for) */
        release_early(d, n, outcome, now, pl);
        return;
    }
    n->state = BEX_DIR_QUARANTINED;
    n->until = now + d->quarantine_ns;
    n->probe_out = false;
    n->st.quarantines++;
    /* a new count after the period: the failures that led here are done */
    n->conn.n = n->req.n = 0;
    if (probe) {
        n->st.probe_failures++;
        /* early probes come as often as the last healthy replica fails:
         * their failures are logged once (counted each time) */
        if (!early || bex__log_first(&n->logged, DIR_LOGGED_EARLY_FAIL))
            bex__dir_defer(pl, BEX_LOG_WARN,
                           "dir: node %s failed its %sprobe (%s): quarantined again "
                           "for %llu ms%s",
                           n->name, early ? "early " : "", kind_name(outcome),
                           (unsigned long long)(d->quarantine_ns / 1000000),
                           early ? " (later early probes' failures are not logged)" : "");
    } else {
        bex__dir_defer(
            pl, BEX_LOG_WARN,
            "dir: node %s quarantined for %llu ms: more than %u %s failures within %llu ms",
            n->name, (unsigned long long)(d->quarantine_ns / 1000000),
            outcome == BEX_DIR_CONN_FAIL ? d->conn_max : d->req_max, kind_name(outcome),
            (unsigned long long)(d->window_ns / 1000000));
    }
}

/* A quarantine whose period is over becomes ready for a probe; a probe
 * never reported expires. */
void bex__dir_node_tick(struct bex__dir_node *n, uint64_t now)
{
    if (n->state == BEX_DIR_QUARANTINED && now >= n->until) {
        n->state = BEX_DIR_PROBING;
        n->probe_out = false;
        n->early = false;
    } else if (n->state == BEX_DIR_PROBING && n->probe_out && now >= n->until) {
        n->probe_out = false;
    }
}

void bex__dir_report_node(bex_dir *d, struct bex__dir_node *n, int outcome, bool done, uint64_t now)
{
    struct pending pl = {0};
    pthread_mutex_lock(&d->mu);
    if (done && n->st.outstanding)
        n->st.outstanding--;
    bex__dir_node_tick(n, now);
    switch (outcome) {
    case BEX_DIR_OK:
        n->st.ok++;
        if (n->state == BEX_DIR_PROBING) {
            n->state = BEX_DIR_HEALTHY;
            n->probe_out = false;
            n->early = false;
            n->logged = 0;
            n->st.lifts++;
            bex__dir_defer(&pl, BEX_LOG_WARN, "dir: node %s answered its probe: quarantine lifted",
                           n->name);
        }
        break;
    case BEX_DIR_CONN_FAIL:
    case BEX_DIR_REQ_FAIL: {
        bool conn = outcome == BEX_DIR_CONN_FAIL;
        if (conn)
            n->st.conn_failures++;
        else
            n->st.req_failures++;
        bool over = bex__dir_ring_add(conn ? &n->conn : &n->req, now, d->window_ns);
        if (n->state == BEX_DIR_PROBING && n->probe_out)
            quarantine(d, n, outcome, now, &pl);
        else if (n->state == BEX_DIR_HEALTHY && over)
            quarantine(d, n, outcome, now, &pl);
        else if (n->state == BEX_DIR_HEALTHY && conn)
            /* one connection failure is enough: the node is unreachable
             * now, and a shard whose other replicas are quarantined has
             * nowhere else to go (a request failure may be the call's
             * own: that waits for the threshold, in quarantine()) */
            release_early(d, n, outcome, now, &pl);
        break;
    }
    default:
        break;
    }
    pthread_mutex_unlock(&d->mu);
    bex__dir_flush(d, &pl);
}
