/* SPDX-License-Identifier: Apache-2.0 */
/* A shard's failover agent in etcd mode (include/bex/ps.h,
 * bex_ps_failover_start; docs/architecture.md, "Replication"): one thread
 * per shard that holds a lease, campaigns while no replica is primary,
 * leads (removing from the replica set the backups the shard reports) or
 * follows (re-syncing from each new primary). */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bex/ps.h"
#include "common/cfg.h"
#include "common/log.h"
#include "ps/shard_internal.h"
#include "rpc/elect.h"

#define SET_MAX 1024 /* the set key's text */

enum { SAID_ETCD = 1, SAID_OUT = 2, SAID_FRESH = 4, SAID_BADSET = 8 };

struct bex_ps_failover {
    bex_ps_shard *s;
    bex_ctx *ctx;
    char *url, key[256], set_key[256], joined_key[256];
    bex_rpc_endpoint reps[BEX_PS_REPLICAS_MAX];
    char names[BEX_PS_REPLICAS_MAX][BEX_ADDR_STRLEN];
    size_t n;
    uint32_t self, ttl_ms, margin_ms, resync_ms;
    bex__elect *el;
    bool fit; /* holds every acknowledged Push: synced once, or led */
    /* a replica the others do not list: the term its JOIN was answered
     * in, when it may send the next */
    uint64_t join_epoch, join_ns;
    uint32_t said;
    pthread_t thr;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop, kicked, hold;
};

static void kick(void *arg)
{
    struct bex_ps_failover *f = arg;
    pthread_mutex_lock(&f->mu);
    f->kicked = true;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* Whether name is one of the comma-separated set. */
static bool in_set(const char *set, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = set; p && *p;) {
        const char *e = strchr(p, ',');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == n && !memcmp(p, name, n))
            return true;
        p = e ? e + 1 : NULL;
    }
    return false;
}

/* The set text of the replicas in set (all when set is NULL) but skip. */
static void set_text(const struct bex_ps_failover *f, const char *set, int skip, char *out,
                     size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (size_t i = 0; i < f->n; i++)
        if ((int)i != skip && (!set || in_set(set, f->names[i])) && o < cap)
            o += (size_t)snprintf(out + o, cap - o, "%s%s", o ? "," : "", f->names[i]);
}

static int index_of(const struct bex_ps_failover *f, const char *name)
{
    for (size_t i = 0; i < f->n; i++)
        if (!strcmp(f->names[i], name))
            return (int)i;
    return -1;
}

/* A replica that joined the running shard (its name from the joined
 * key, or from the primary's backups) listed from now on: 0, or -ENOSPC
 * (BEX_PS_REPLICAS_MAX listed), -EINVAL (not an address). The joined
 * key holds names only: a joined replica's transport is this one's. */
static int learn(struct bex_ps_failover *f, const char *name, uint32_t transport)
{
    bex_addr a;
    if (index_of(f, name) >= 0)
        return 0;
    if (f->n >= BEX_PS_REPLICAS_MAX)
        return -ENOSPC;
    if (bex_addr_parse(name, 0, &a) || !bex_addr_port(&a))
        return -EINVAL;
    f->reps[f->n] = (bex_rpc_endpoint){.addr = a, .transport = transport};
    snprintf(f->names[f->n], sizeof f->names[f->n], "%s", name);
    f->n++;
    bex__log(&f->s->log, BEX_LOG_INFO, "ps shard %u: replica %s joined the shard", f->s->shard,
             name);
    return 0;
}

/* Backup b's name ("a.b.c.d:port" or "[v6]:port"). */
static void bk_name(const bex_ps_shard *s, uint32_t b, char *name, size_t cap)
{
    bex_addr_format(&s->rp.bk[b].addr, true, name, cap);
}

/* A new term: the set's members copy from this primary first; client
 * Pushes wait (-EAGAIN) until each answers a probe in step, at most
 * forward_timeout_ms (one that is not then is removed on its first
 * forward, and rejoins later). */
static void await_set(struct bex_ps_failover *f, const bool *out, size_t nb)
{
    bex_ps_shard *s = f->s;
    bex__ps_repl_pause(s, 0);
    uint64_t end = bex__rpc_now_ns() + (uint64_t)s->rp.fwd_timeout_ms * 1000000ull;
    for (uint32_t b = 0; b < nb; b++)
        while (!out[b] && bex__ps_repl_probe(s, b) && bex__rpc_now_ns() < end) {
            struct timespec ts = {0, 10000000};
            nanosleep(&ts, NULL);
        }
    bex__ps_repl_resume(s);
}

/* Won epoch: the set (written at the first term), then lead its other
 * members. */
static void lead(struct bex_ps_failover *f, uint64_t epoch, const char *set, bool set_absent)
{
    char text[SET_MAX];
    bex_rpc_endpoint bk[BEX_PS_REPLICAS_MAX];
    bool out[BEX_PS_REPLICAS_MAX];
    size_t nb = 0;
    set_text(f, set_absent ? NULL : set, -1, text, sizeof text);
    if (set_absent && bex__elect_put_if(f->url, f->set_key, text, f->key, epoch))
        return; /* the term ended already: the next round sees it */
    for (size_t i = 0; i < f->n; i++)
        if (i != f->self) {
            out[nb] = !in_set(text, f->names[i]); /* probed, rejoins when in step */
            bk[nb++] = f->reps[i];
        }
    int rc = bex__ps_repl_lead(f->s, epoch, f->el, bk, out, nb);
    f->fit = rc == 0;
    if (rc == 0)
        await_set(f, out, nb);
    bex__log(&f->s->log, rc ? BEX_LOG_ERROR : BEX_LOG_INFO,
             "ps shard %u: primary for epoch %llu, %zu other replicas, set %s%s%s", f->s->shard,
             (unsigned long long)epoch, nb, text, rc ? ": " : "", rc ? bex_strerror(rc) : "");
}

/* As primary of epoch: remove the backups the shard waits for. */
static void removals(struct bex_ps_failover *f, uint64_t epoch, const char *set)
{
    uint32_t b[BEX_PS_REPLICAS_MAX];
    size_t n = bex__ps_repl_removals(f->s, b, BEX_PS_REPLICAS_MAX);
    char cur[SET_MAX], text[SET_MAX];
    snprintf(cur, sizeof cur, "%s", set);
    for (size_t i = 0; i < n; i++) {
        char name[BEX_ADDR_STRLEN];
        bk_name(f->s, b[i], name, sizeof name);
        set_text(f, cur, index_of(f, name), text, sizeof text);
        int rc = bex__elect_put_if(f->url, f->set_key, text, f->key, epoch);
        if (rc == 0)
            snprintf(cur, sizeof cur, "%s", text);
        bex__log(&f->s->log, rc ? BEX_LOG_ERROR : BEX_LOG_WARN,
                 "ps shard %u: backup %s %s the replica set (epoch %llu)%s%s", f->s->shard, name,
                 rc ? "could not be removed from" : "removed from", (unsigned long long)epoch,
                 rc ? ": " : "", rc ? bex_strerror(rc) : "");
        bex__ps_repl_removed(f->s, b[i], rc);
    }
}

/* Backup b (out of the set) back in: client Pushes paused (none in
 * flight), b probed until it copied and is in step (resync_ms at most),
 * then put back in the set (guarded by epoch). Returns 0 when back. */
static int rejoin(struct bex_ps_failover *f, uint64_t epoch, const char *set, uint32_t b)
{
    bex_ps_shard *s = f->s;
    char name[BEX_ADDR_STRLEN], text[SET_MAX + BEX_ADDR_STRLEN + 2];
    bk_name(s, b, name, sizeof name);
    int rc = bex__ps_repl_probe(s, b); /* a live one starts its copy on this */
    if (rc && rc != -ESTALE && rc != -EAGAIN)
        return rc; /* not there */
    if (!(rc = bex__ps_repl_pause(s, s->rp.fwd_timeout_ms))) {
        uint64_t end = bex__rpc_now_ns() + (uint64_t)f->resync_ms * 1000000ull;
        while ((rc = bex__ps_repl_probe(s, b)) && (rc == -ESTALE || rc == -EAGAIN) &&
               bex__rpc_now_ns() < end) {
            struct timespec ts = {0, 10000000};
            nanosleep(&ts, NULL);
        }
    }
    if (rc == 0) {
        int w = snprintf(text, sizeof text, "%s%s%s", set, *set ? "," : "", name);
        rc = w < 0 || (size_t)w >= SET_MAX
                 ? -ENAMETOOLONG /* the set key's text is bounded */
                 : bex__elect_put_if(f->url, f->set_key, text, f->key, epoch);
    }
    if (rc == 0) {
        pthread_mutex_lock(&s->mu);
        if (s->rp.bk[b].state == BK_OUT)
            bex__ps_backup_move(s, b, BK_UP);
        s->st.rejoins++;
        pthread_mutex_unlock(&s->mu);
    }
    bex__ps_repl_resume(s);
    bex__log(&s->log, rc ? BEX_LOG_WARN : BEX_LOG_INFO,
             "ps shard %u: backup %s %s the replica set (epoch %llu)%s%s", s->shard, name,
             rc ? "could not rejoin" : "caught up and rejoined", (unsigned long long)epoch,
             rc ? ": " : "", rc ? bex_strerror(rc) : "");
    return rc;
}

/* As primary: try the backups out of the set, one a step, each at most
 * every second. */
static void rejoins(struct bex_ps_failover *f, uint64_t epoch)
{
    bex_ps_shard *s = f->s;
    uint64_t now = bex__rpc_now_ns();
    char set[SET_MAX];
    uint64_t cr, mr;
    for (uint32_t b = 0;; b++) {
        char name[BEX_ADDR_STRLEN];
        pthread_mutex_lock(&s->mu);
        bool more = b < s->rp.n_bk,
             due = more && s->rp.bk[b].state == BK_OUT && now >= s->rp.bk[b].probe_ns;
        if (due) {
            s->rp.bk[b].probe_ns = now + 1000000000ull;
            bk_name(s, b, name, sizeof name);
        }
        pthread_mutex_unlock(&s->mu);
        if (!more)
            return;
        /* one JOIN added is let in once its name is in the joined key */
        if (due && index_of(f, name) >= 0 &&
            !bex__elect_get(f->url, f->set_key, &cr, &mr, set, sizeof set)) {
            rejoin(f, epoch, set, b);
            return;
        }
    }
}

/* As primary of epoch: a backup JOIN added (join.c) that this agent does
 * not list yet: its name appended to the joined key (guarded by epoch),
 * where every replica reads it (set_check), then listed here. */
static void record_joined(struct bex_ps_failover *f, uint64_t epoch)
{
    bex_ps_shard *s = f->s;
    for (uint32_t b = 0;; b++) {
        char name[BEX_ADDR_STRLEN], cur[SET_MAX], text[SET_MAX];
        pthread_mutex_lock(&s->mu);
        bool more = b < s->rp.n_bk;
        uint32_t tr = more ? s->rp.bk[b].transport : 0;
        if (more)
            bk_name(s, b, name, sizeof name);
        pthread_mutex_unlock(&s->mu);
        if (!more)
            return;
        if (index_of(f, name) >= 0)
            continue;
        uint64_t cr, mr;
        int rc = bex__elect_get(f->url, f->joined_key, &cr, &mr, cur, sizeof cur);
        if (!rc && !in_set(cur, name)) {
            int w = snprintf(text, sizeof text, "%s%s%s", cur, *cur ? "," : "", name);
            rc = w < 0 || (size_t)w >= sizeof text
                     ? -ENAMETOOLONG /* the key's text is bounded */
                     : bex__elect_put_if(f->url, f->joined_key, text, f->key, epoch);
        }
        if (!rc)
            rc = learn(f, name, tr);
        if (rc)
            bex__log(&s->log, BEX_LOG_WARN,
                     "ps shard %u: replica %s joined, but could not be recorded in etcd (%s): "
                     "it stays out of the replica set",
                     s->shard, name, bex_strerror(rc));
    }
}

/* Not listed by the primary (added to the running shard), out of the
 * set: ask the primary of epoch (replica i) to JOIN, once a term, again
 * a second later when refused for now. -EEXIST: it lists this one. */
static void maybe_join(struct bex_ps_failover *f, uint64_t epoch, int i, const char *set)
{
    uint64_t now = bex__rpc_now_ns();
    if (!set || in_set(set, f->names[f->self]) || f->join_epoch == epoch || now < f->join_ns)
        return;
    f->join_ns = now + 1000000000ull;
    int rc = bex__ps_join_fenced_call(f->s, f->ctx, &f->reps[i], &f->reps[f->self], epoch,
                                      f->s->rp.fwd_timeout_ms);
    if (rc == 0 || rc == -EEXIST)
        f->join_epoch = epoch;
    if (rc != -EEXIST)
        bex__log(&f->s->log, rc ? BEX_LOG_WARN : BEX_LOG_INFO,
                 "ps shard %u: JOIN at the primary %s (epoch %llu): %s", f->s->shard, f->names[i],
                 (unsigned long long)epoch, rc ? bex_strerror(rc) : "added, out of the set");
}

/* The entry of l bytes at p, not listed here: listed when the joined key
 * (read into joined once a check, *read) names it; its index, or -1. */
static int joined_index(struct bex_ps_failover *f, const char *p, size_t l, char *joined,
                        bool *read)
{
    char name[BEX_ADDR_STRLEN];
    uint64_t cr, mr;
    memcpy(name, p, l);
    name[l] = 0;
    if (!*read && bex__elect_get(f->url, f->joined_key, &cr, &mr, joined, SET_MAX))
        joined[0] = 0;
    *read = true;
    if (!in_set(joined, name) || learn(f, name, f->reps[f->self].transport))
        return -1;
    return index_of(f, name);
}

/* The set as read from etcd, checked: an entry that names none of the
 * replicas (malformed, unknown, twice) is left out of set and said once
 * (until a good set is read). Anyone who can write etcd can write the
 * set; trusted, a set naming no replica here stopped every campaign for
 * good. Returns whether an entry was left out. */
static bool set_check(struct bex_ps_failover *f, char *set, size_t cap)
{
    char ok[SET_MAX], was[SET_MAX], joined[SET_MAX] = "";
    size_t o = 0;
    bool bad = false, read = false;
    ok[0] = 0;
    snprintf(was, sizeof was, "%s", set);
    for (const char *p = set; p && *p;) {
        const char *e = strchr(p, ',');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        int k = -1;
        for (size_t i = 0; i < f->n && k < 0; i++)
            if (strlen(f->names[i]) == l && !memcmp(p, f->names[i], l))
                k = (int)i;
        if (k < 0 && l < BEX_ADDR_STRLEN)
            k = joined_index(f, p, l, joined, &read);
        if (k < 0 || in_set(ok, f->names[k]))
            bad = true;
        else if (o < sizeof ok)
            o += (size_t)snprintf(ok + o, sizeof ok - o, "%s%s", o ? "," : "", f->names[k]);
        p = e ? e + 1 : NULL;
    }
    if (bad && bex__log_first(&f->said, SAID_BADSET))
        bex__log(&f->s->log, BEX_LOG_WARN,
                 "ps shard %u: the replica set in etcd (%.200s) names replicas this one does not "
                 "know or is malformed: those entries are ignored",
                 f->s->shard, was);
    if (!bad)
        f->said &= ~(uint32_t)SAID_BADSET;
    snprintf(set, cap, "%s", ok);
    return bad;
}

/* As primary of epoch, after a bad set was read: its own set written back
 * (itself and the backups it forwards to), into set. */
static void set_heal(struct bex_ps_failover *f, uint64_t epoch, char *set, size_t cap)
{
    bex_ps_shard *s = f->s;
    char text[SET_MAX];
    size_t o = (size_t)snprintf(text, sizeof text, "%s", f->names[f->self]);
    pthread_mutex_lock(&s->mu);
    for (uint32_t b = 0; b < s->rp.n_bk && o < sizeof text; b++)
        if (s->rp.bk[b].state != BK_OUT) {
            char name[BEX_ADDR_STRLEN];
            bk_name(s, b, name, sizeof name);
            o += (size_t)snprintf(text + o, sizeof text - o, ",%s", name);
        }
    pthread_mutex_unlock(&s->mu);
    int rc = o < sizeof text ? bex__elect_put_if(f->url, f->set_key, text, f->key, epoch)
                             : -ENAMETOOLONG;
    if (rc == 0) {
        snprintf(set, cap, "%s", text);
        f->said &= ~(uint32_t)SAID_BADSET; /* a bad one written again is said again */
    }
    bex__log(&s->log, rc ? BEX_LOG_ERROR : BEX_LOG_INFO,
             "ps shard %u: replica set %s %s (epoch %llu)%s%s", s->shard, text,
             rc ? "could not be written back" : "written back", (unsigned long long)epoch,
             rc ? ": " : "", rc ? bex_strerror(rc) : "");
}

/* etcd's keys now: 0, or the failure (logged once until etcd answers). */
static int read_keys(struct bex_ps_failover *f, uint64_t *epoch, char *holder, size_t hcap,
                     uint64_t *set_rev, char *set, size_t scap)
{
    uint64_t mr, scr;
    int rc = bex__elect_get(f->url, f->key, epoch, &mr, holder, hcap);
    if (!rc)
        rc = bex__elect_get(f->url, f->set_key, &scr, set_rev, set, scap);
    if (rc && bex__log_first(&f->said, SAID_ETCD))
        bex__log(&f->s->log, BEX_LOG_WARN, "ps shard %u: waiting for etcd at %s (%s)", f->s->shard,
                 f->url, bex_strerror(rc));
    if (!rc)
        f->said &= ~(uint32_t)SAID_ETCD;
    return rc;
}

/* No primary: campaign if this replica may (in the set, holding every
 * acknowledged Push). */
static void campaign(struct bex_ps_failover *f, uint64_t set_rev, const char *set)
{
    const char *me = f->names[f->self];
    if (set_rev && !in_set(set, me)) {
        if (bex__log_first(&f->said, SAID_OUT))
            bex__log(&f->s->log, BEX_LOG_INFO,
                     "ps shard %u: waiting for a primary (%s is not in the replica set %s)",
                     f->s->shard, me, set);
        return;
    }
    if (set_rev && !f->fit) {
        if (bex__log_first(&f->said, SAID_FRESH))
            bex__log(&f->s->log, BEX_LOG_INFO,
                     "ps shard %u: waiting for a primary (this replica has not copied from one "
                     "yet: it may not campaign)",
                     f->s->shard);
        return;
    }
    uint64_t epoch = 0;
    char holder[BEX_ADDR_STRLEN];
    if (bex__elect_campaign(f->el, f->key, me, f->set_key, set_rev, &epoch, holder,
                            sizeof holder) != 1)
        return;
    if (set_rev) { /* a set written: an earlier primary's term ended */
        pthread_mutex_lock(&f->s->mu);
        f->s->st.failovers++;
        pthread_mutex_unlock(&f->s->mu);
    }
    lead(f, epoch, set, set_rev == 0);
}

/* Another leads epoch from holder: follow it, copying from it first. */
static void follow(struct bex_ps_failover *f, uint64_t epoch, const char *holder, const char *set)
{
    bex_ps_shard *s = f->s;
    int i = index_of(f, holder);
    if (i < 0 || (uint32_t)i == f->self)
        return; /* an earlier life's key: it expires */
    bex__ps_repl_follow(s, epoch);
    maybe_join(f, epoch, i, set); /* before the copy: the primary's pause */
    pthread_mutex_lock(&s->mu);
    bool synced = s->rp.state == RP_BACKUP;
    pthread_mutex_unlock(&s->mu);
    if (synced)
        return;
    int rc = bex__ps_resync(s, f->ctx, &f->reps[i], f->resync_ms);
    if (rc == 0)
        f->fit = true;
    bex__log(&s->log, rc ? BEX_LOG_WARN : BEX_LOG_INFO,
             "ps shard %u: backup of %s (epoch %llu): %s%s", s->shard, holder,
             (unsigned long long)epoch, rc ? "copy failed, trying again: " : "copied, in step",
             rc ? bex_strerror(rc) : "");
}

static void step(struct bex_ps_failover *f)
{
    bex_ps_shard *s = f->s;
    if (f->el && !bex__elect_until_ns(f->el)) {
        bex__ps_repl_follow(s, 0);        /* the shard lets go of the lease first */
        bex__elect_destroy(f->el, false); /* expired: a new lease */
        f->el = NULL;
    }
    char err[256] = "";
    if (!f->el && bex__elect_create(f->url, f->ttl_ms, f->margin_ms, &f->el, err, sizeof err)) {
        if (bex__log_first(&f->said, SAID_ETCD))
            bex__log(&s->log, BEX_LOG_WARN, "ps shard %u: waiting for etcd at %s (%s)", s->shard,
                     f->url, err);
        return;
    }
    uint64_t epoch, set_rev;
    char holder[BEX_ADDR_STRLEN], set[SET_MAX];
    if (read_keys(f, &epoch, holder, sizeof holder, &set_rev, set, sizeof set))
        return;
    pthread_mutex_lock(&s->mu);
    bool primary = s->rp.role == BEX_PS_ROLE_PRIMARY;
    uint64_t mine = s->rp.epoch;
    pthread_mutex_unlock(&s->mu);
    bool bad = set_rev && set_check(f, set, sizeof set);
    if (primary && epoch == mine) {
        if (bad)
            set_heal(f, epoch, set, sizeof set);
        record_joined(f, epoch);
        removals(f, epoch, set);
        rejoins(f, epoch);
    } else if (primary) {
        bex__log(&s->log, BEX_LOG_WARN, "ps shard %u: epoch %llu ended: a backup now", s->shard,
                 (unsigned long long)mine);
        bex__ps_repl_follow(s, epoch);
    } else if (!epoch) {
        campaign(f, set_rev, set);
    } else {
        follow(f, epoch, holder, set_rev ? set : NULL);
    }
}

static void *agent_main(void *arg)
{
    struct bex_ps_failover *f = arg;
    pthread_mutex_lock(&f->mu);
    while (!f->stop) {
        if (!f->kicked) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)f->ttl_ms * 1000000ull / 4;
            ts.tv_sec += (time_t)(ns / 1000000000ull);
            ts.tv_nsec = (long)(ns % 1000000000ull);
            pthread_cond_timedwait(&f->cv, &f->mu, &ts);
        }
        f->kicked = false;
        if (f->stop)
            break;
        if (f->hold)
            continue;
        pthread_mutex_unlock(&f->mu);
        step(f);
        pthread_mutex_lock(&f->mu);
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

int bex_ps_failover_start(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_failover_config *cfg,
                          bex_ps_failover **out)
{
    bex_ps_failover_config local;
    BEX__CFG_TAKE(cfg, local);
    if (!s || !ctx || !cfg || !out || !cfg->etcd_url || !cfg->replicas || !cfg->n_replicas ||
        cfg->n_replicas > BEX_PS_REPLICAS_MAX || cfg->self >= cfg->n_replicas ||
        s->rp.role != BEX_PS_ROLE_BACKUP || s->rp.n_bk || !s->rp.ctx)
        return -EINVAL;
    struct bex_ps_failover *f = calloc(1, sizeof *f);
    if (!f || !(f->url = strdup(cfg->etcd_url))) {
        free(f);
        return -ENOMEM;
    }
    *f = (struct bex_ps_failover){
        .s = s, .ctx = ctx, .url = f->url, .n = cfg->n_replicas, .self = cfg->self};
    f->ttl_ms = cfg->lease_ttl_ms ? cfg->lease_ttl_ms : 2000;
    f->margin_ms = cfg->lease_margin_ms ? cfg->lease_margin_ms : 500;
    f->resync_ms = cfg->resync_timeout_ms ? cfg->resync_timeout_ms : 10000;
    const char *pre = cfg->prefix ? cfg->prefix : "/bex/",
               *svc = cfg->service ? cfg->service : "ps";
    snprintf(f->key, sizeof f->key, "%sps/%s/%u/primary", pre, svc, cfg->shard);
    snprintf(f->set_key, sizeof f->set_key, "%sps/%s/%u/set", pre, svc, cfg->shard);
    snprintf(f->joined_key, sizeof f->joined_key, "%sps/%s/%u/joined", pre, svc, cfg->shard);
    for (size_t i = 0; i < f->n; i++) {
        f->reps[i] = cfg->replicas[i];
        bex_addr_format(&f->reps[i].addr, true, f->names[i], sizeof f->names[i]);
    }
    pthread_mutex_init(&f->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&f->cv, &ca);
    pthread_condattr_destroy(&ca);
    f->kicked = true; /* a first step at once (before a forward can kick) */
    pthread_mutex_lock(&s->mu);
    s->rp.fenced = true;
    if (s->rp.state == RP_BACKUP) /* checked above: copies first */
        bex__ps_repl_move(s, RP_UNSYNCED);
    s->rp.kick = kick;
    s->rp.kick_arg = f;
    pthread_mutex_unlock(&s->mu);
    int rc = -pthread_create(&f->thr, NULL, agent_main, f);
    if (rc) {
        bex_ps_failover_stop(f, false);
        return rc;
    }
    *out = f;
    return 0;
}

void bex_ps_failover_stop(bex_ps_failover *f, bool revoke)
{
    if (!f)
        return;
    pthread_mutex_lock(&f->mu);
    bool started = !f->stop;
    f->stop = true;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    if (started && f->thr)
        pthread_join(f->thr, NULL);
    bex__ps_repl_follow(f->s, 0); /* no more acknowledgements */
    pthread_mutex_lock(&f->s->mu);
    f->s->rp.kick = NULL;
    pthread_mutex_unlock(&f->s->mu);
    bex__elect_destroy(f->el, revoke);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f->url);
    free(f);
}

void bex_ps_failover_hold(bex_ps_failover *f, bool hold)
{
    pthread_mutex_lock(&f->mu);
    f->hold = hold;
    pthread_mutex_unlock(&f->mu);
    if (f->el)
        bex__elect_hold(f->el, hold);
}
