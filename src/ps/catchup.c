/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: the catch-up of a restarted replica (its side: copying
 * from a peer, then taking the held requests). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "common/cfg.h"
#include "bex/ps.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"
#include "ps/shard_internal.h"

/* ---- catch-up: the restarted replica's side ---- */

static uint32_t ms_left(uint64_t deadline_ns)
{
    uint64_t now = bex__rpc_now_ns();
    if (now >= deadline_ns)
        return 0;
    uint64_t ms = (deadline_ns - now + 999999) / 1000000;
    return ms > UINT32_MAX ? UINT32_MAX : (uint32_t)ms;
}

/* One COPY call; its answer's header checked against (op, session,
 * offset). On 0, *body / *len: the answer (free with bex_rpc_free). */
int bex__ps_copy_call(bex_rpc_channel *ch, bex_ctx *ctx, const struct bex__ps_copy_hdr *q,
                      uint64_t deadline, struct bex__ps_copy_hdr *a, void **body, size_t *len)
{
    uint32_t left = ms_left(deadline);
    if (!left)
        return -ETIMEDOUT;
    uint8_t *b = bex_rpc_alloc(ctx, BEX__PS_COPY_HDR_LEN);
    if (!b)
        return -ENOMEM;
    bex__ps_copy_put(b, q);
    bex_rpc_call_opts o = {.timeout_ms = left};
    /* not bex_rpc_call_sync: its caller cannot tell a refused call (b still
     * ours) from one that failed */
    struct bex__rpc_wait w = BEX__RPC_WAIT_INIT;
    int rc = bex_rpc_call(ch, BEX_PS_SERVICE, BEX_PS_M_COPY, b, BEX__PS_COPY_HDR_LEN, &o,
                          bex__rpc_wait_done, &w, NULL);
    if (rc) {
        bex_rpc_free(b); /* not sent: still ours */
        return rc;
    }
    rc = bex__rpc_wait(&w, body, len);
    if (rc == 0 && (bex__ps_copy_get(*body, *len, a) || a->op != q->op ||
                    (q->op != BEX__PS_COPY_OPEN && a->session != q->session) ||
                    (q->op == BEX__PS_COPY_CHUNK && a->offset != q->offset)))
        rc = -EBADMSG;
    if (rc) {
        bex_rpc_free(*body);
        *body = NULL;
    }
    return rc;
}

/* Pull a peer's copy into *buf / *len (malloc'd), by the deadline. */
/* The peer may drop its copy now (best effort, briefly). */
static void copy_close(bex_rpc_channel *ch, bex_ctx *ctx, struct bex__ps_copy_hdr *q,
                       uint64_t deadline)
{
    struct bex__ps_copy_hdr a;
    void *body;
    size_t blen;
    uint64_t d2 = bex__rpc_now_ns() + 500000000ull;
    q->op = BEX__PS_COPY_CLOSE;
    q->offset = 0;
    if (bex__ps_copy_call(ch, ctx, q, d2 < deadline ? d2 : deadline, &a, &body, &blen) == 0)
        bex_rpc_free(body);
}

static int copy_pull(bex_ctx *ctx, const bex_rpc_endpoint *ep, const bex_ps_catchup_config *cfg,
                     uint64_t deadline, uint8_t **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    uint32_t left = ms_left(deadline);
    if (!left)
        return -ETIMEDOUT;
    bex_rpc_channel_config cc = {.endpoints = ep,
                                 .n_endpoints = 1,
                                 .name = "ps-catchup",
                                 .request_timeout_ms = left,
                                 .connect_timeout_ms = left,
                                 /* a connection lost mid-copy (seen in the
                                  * emulated VM) is retried, within the
                                  * deadline: CHUNK only reads, and a second
                                  * OPEN replaces the first copy */
                                 .max_attempts = 3};
    bex_rpc_channel *ch;
    int rc = bex_rpc_channel_create(ctx, &cc, &ch);
    if (rc)
        return rc;
    uint32_t chunk = cfg->chunk_bytes ? cfg->chunk_bytes : 1u << 20;
    if (chunk > COPY_CHUNK_MAX)
        chunk = COPY_CHUNK_MAX;
    uint64_t max = cfg->max_bytes ? cfg->max_bytes : 1ull << 30;
    struct bex__ps_copy_hdr q = {.op = BEX__PS_COPY_OPEN}, a;
    void *body;
    size_t blen;
    uint8_t *out = NULL;
    uint64_t total = 0, got = 0;
    if ((rc = bex__ps_copy_call(ch, ctx, &q, deadline, &a, &body, &blen)))
        goto done;
    bex_rpc_free(body);
    total = a.offset;
    if (total > max || total > SIZE_MAX / 2) {
        rc = -E2BIG;
        goto done;
    }
    q = (struct bex__ps_copy_hdr){.op = BEX__PS_COPY_CHUNK, .session = a.session, .max_len = chunk};
    while (got < total) {
        q.offset = got;
        if ((rc = bex__ps_copy_call(ch, ctx, &q, deadline, &a, &body, &blen)))
            break;
        size_t n = blen - BEX__PS_COPY_HDR_LEN;
        if (n == 0 || n > chunk || n > total - got) {
            bex_rpc_free(body);
            rc = -EBADMSG;
            break;
        }
        /* grown as bytes come: a peer claiming much and sending little
         * costs only what it sent */
        uint8_t *nb = realloc(out, (size_t)got + n);
        if (!nb) {
            bex_rpc_free(body);
            rc = -ENOMEM;
            break;
        }
        out = nb;
        memcpy(out + got, (uint8_t *)body + BEX__PS_COPY_HDR_LEN, n);
        got += n;
        bex_rpc_free(body);
    }
    if (rc == 0)
        copy_close(ch, ctx, &q, deadline);
done:
    bex_rpc_channel_destroy(ch);
    if (rc) {
        free(out);
        return rc;
    }
    *buf = out;
    *len = (size_t)total;
    return 0;
}

/* Pause between two catch-up rounds (ms). */
#define CATCHUP_PAUSE_MS 150

/* Whether a peer's failure is its answer rather than a passing state, so
 * that asking it again before the deadline would not help: a copy that is
 * bad, too long or behind us, a call it refuses, our own memory; and a
 * peer catching up itself (-EAGAIN): two replicas started together would
 * otherwise wait for each other until the deadline. */
static bool copy_final(int rc)
{
    return rc == -EBADMSG || rc == -E2BIG || rc == -ESTALE || rc == -EAGAIN || rc == -ENOMEM ||
           rc == -EINVAL || rc == -ENOSYS || rc == -EPERM || rc == -EACCES;
}

/* Peer i's copy into *cut and cut_ids, checked against what we applied
 * already; 0, or its failure (nothing kept), logged when final. */
static int try_peer(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_catchup_config *cfg, size_t i,
                    uint64_t deadline, struct table **cutp, struct idset *cut_ids)
{
    char a[BEX_ADDR_STRLEN];
    bex_addr_format(&cfg->peers[i].addr, false, a, sizeof a);
    struct table *cut = NULL;
    uint8_t *buf;
    size_t len;
    int rc = copy_pull(ctx, &cfg->peers[i], cfg, deadline, &buf, &len);
    if (rc == 0) {
        if (!(cut = bex__ps_tables_like(s)))
            rc = -ENOMEM;
        else if ((rc = bex__ps_copy_load(s, buf, len, cut, cut_ids)) == -EINVAL)
            rc = -EBADMSG; /* the peer's copy, not our call */
        free(buf);
        if (rc == 0) {
            pthread_mutex_lock(&s->mu);
            /* a new primary's copy is taken even behind ours (a re-sync) */
            if (s->state != SH_RESYNC && bex__ps_ids_behind(&s->ids, cut_ids))
                rc = -ESTALE;
            pthread_mutex_unlock(&s->mu);
        }
    }
    if (rc == 0) {
        bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: copy of %zu bytes from %s:%u", s->shard, len,
                 a, bex_addr_port(&cfg->peers[i].addr));
        *cutp = cut;
        return 0;
    }
    if (cut)
        bex__ps_tables_free(cut, s->n_tables);
    bex__ps_ids_free(cut_ids);
    if (copy_final(rc)) /* its answer: logged once, not asked again */
        bex__log(&s->log, BEX_LOG_WARN, "ps shard %u: catch-up from %s:%u failed: %s", s->shard, a,
                 bex_addr_port(&cfg->peers[i].addr), bex_strerror(rc));
    return rc;
}

/* Rounds over the peers until one gives a copy (into *cut and cut_ids) or
 * the deadline passes: a peer that cannot be reached now (not listening
 * yet, a connection not made in time on a loaded host) may be reachable in
 * a moment, and giving up at once would serve the snapshot without every
 * Push the peer applied meanwhile. Returns 0 or the last failure. */
static int pull_rounds(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_catchup_config *cfg,
                       uint64_t deadline, struct table **cut, struct idset *cut_ids)
{
    int rc = -EHOSTUNREACH; /* no peer */
    bool *out = cfg->n_peers ? calloc(cfg->n_peers, sizeof *out) : NULL;
    if (cfg->n_peers && !out)
        rc = -ENOMEM;
    for (unsigned round = 1; out; round++) {
        size_t again = 0, last = 0; /* peers worth another round; the last */
        int last_rc = 0;
        for (size_t i = 0; i < cfg->n_peers && !*cut; i++) {
            if (out[i])
                continue;
            rc = try_peer(s, ctx, cfg, i, deadline, cut, cut_ids);
            if (rc == 0)
                break;
            if (copy_final(rc)) {
                out[i] = true;
            } else {
                again++;
                last = i;
                last_rc = rc;
            }
        }
        uint32_t left = ms_left(deadline);
        if (*cut || !again || left <= CATCHUP_PAUSE_MS)
            break;
        char a[BEX_ADDR_STRLEN];
        bex_addr_format(&cfg->peers[last].addr, false, a, sizeof a);
        bex__log(&s->log, BEX_LOG_WARN,
                 "ps shard %u: catch-up round %u failed (%zu peers unreachable, %s:%u: %s): "
                 "trying again, %u ms left",
                 s->shard, round, again, a, bex_addr_port(&cfg->peers[last].addr),
                 bex_strerror(last_rc), left);
        struct timespec ts = {0, CATCHUP_PAUSE_MS * 1000000l};
        while (nanosleep(&ts, &ts) && errno == EINTR)
            ;
    }
    free(out);
    return rc;
}

/* The peer's rows and ids instead of ours (the counters stay); returns the
 * rows. Under s->mu. */
static uint64_t install_cut(bex_ps_shard *s, struct table *cut, struct idset *cut_ids)
{
    uint64_t rows = 0;
    for (size_t i = 0; i < s->n_tables; i++) {
        struct table *t = &s->tables[i], *c = &cut[i];
        free(t->keys);
        free(t->vals);
        free(t->dirty);
        bex__ihash_free(&t->idx);
        t->keys = c->keys;
        t->vals = c->vals;
        t->dirty = c->dirty;
        c->dirty = NULL;
        t->idx = c->idx;
        t->n_rows = c->n_rows;
        t->cap_rows = c->cap_rows;
        c->keys = NULL;
        c->vals = NULL;
        c->idx = (struct bex__ihash){0};
        rows += t->n_rows;
    }
    bex__ps_ids_free(&s->ids);
    s->ids = *cut_ids;
    bex__ps_cut_forget_locked(s);
    return rows;
}

/* The held Pushes, in the order they came: those the cut has are left out
 * (an id older than the peer's window too: the peer had it long before),
 * every other one applied once; then none is held. Under s->mu. */
static void replay_held(bex_ps_shard *s, bool cut, uint64_t *replayed, uint64_t *skipped,
                        uint64_t *failed)
{
    for (struct held *h = s->held; h; h = h->next) {
        int has = h->has_id ? bex__ps_ids_has(&s->ids, &h->id.k, h->id.seq) : ID_NEW;
        if (cut && has != ID_NEW) {
            (*skipped)++;
            continue;
        }
        bool applied;
        int e = bex__ps_push_apply_locked(s, h->t, h->n, h->keys, h->g, h->has_id ? &h->id : NULL,
                                          &applied);
        if (e)
            (*failed)++;
        else if (applied)
            (*replayed)++;
        else
            (*skipped)++;
    }
    bex__ps_held_free(s->held);
    s->held = NULL;
    s->held_tail = &s->held;
    s->held_bytes = 0;
}

static void log_outcome(bex_ps_shard *s, int rc, uint64_t rows, uint64_t replayed, uint64_t skipped,
                        uint64_t failed)
{
    if (failed)
        bex__log(&s->log, BEX_LOG_ERROR,
                 "ps shard %u: %llu held Pushes not applied after catch-up (table full or no "
                 "memory): this replica misses them",
                 s->shard, (unsigned long long)failed);
    if (rc)
        bex__log(&s->log, BEX_LOG_ERROR,
                 "ps shard %u: catch-up failed (%s): serving its snapshot and the %llu Pushes "
                 "held, without those the peer applied meanwhile",
                 s->shard, bex_strerror(rc), (unsigned long long)(replayed + skipped));
    else
        bex__log(&s->log, BEX_LOG_INFO,
                 "ps shard %u: caught up: %llu rows copied, %llu held Pushes applied, %llu the "
                 "peer had",
                 s->shard, (unsigned long long)rows, (unsigned long long)replayed,
                 (unsigned long long)skipped);
}

int bex_ps_shard_catchup(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_catchup_config *cfg)
{
    bex_ps_catchup_config c;
    BEX__CFG_TAKE(cfg, c);
    if (!s || !ctx || !cfg || (cfg->n_peers && !cfg->peers))
        return -EINVAL;
    int src = bex__ps_shard_catchup_start(s); /* once: WAIT -> CATCHUP */
    if (src)
        return src;
    uint64_t deadline =
        bex__rpc_now_ns() + (uint64_t)(cfg->timeout_ms ? cfg->timeout_ms : 10000) * 1000000ull;
    struct table *cut = NULL;
    struct idset cut_ids = {.head = IDS_NIL, .tail = IDS_NIL};
    /* a backup whose snapshot its primary's log covers takes the forwards
     * after it alone (catchup_suffix.c); else the full copy */
    bool suffix = bex__ps_catchup_suffix(s, ctx, cfg, deadline) == 0;
    int rc = suffix ? 0 : pull_rounds(s, ctx, cfg, deadline, &cut, &cut_ids);
    pthread_mutex_lock(&s->mu);
    if (suffix)
        s->st.catchup_suffix++;
    if (!cut && !suffix && cfg->n_peers && s->rp.role == BEX_PS_ROLE_PRIMARY) {
        /* its peers may hold Pushes it lacks: as primary it would number
         * Pushes on old rows and its backups would take them */
        bex__ps_shard_catchup_end_locked(s, true); /* it may be called again */
        s->st.catchup_failed++;
        pthread_mutex_unlock(&s->mu);
        bex__log(&s->log, BEX_LOG_ERROR,
                 "ps shard %u: the primary's catch-up failed (%s): not serving its snapshot as "
                 "primary (Pushes and Fetches refused -EAGAIN) until a catch-up succeeds",
                 s->shard, bex_strerror(rc));
        return rc;
    }
    uint64_t rows = cut ? install_cut(s, cut, &cut_ids) : 0;
    if (cut)
        bex__ps_repl_take_cut(s);
    uint64_t replayed = 0, skipped = 0, failed = 0;
    replay_held(s, cut || suffix, &replayed, &skipped, &failed);
    bex__ps_shard_catchup_end_locked(s, false);
    s->st.catchup_rows += rows;
    s->st.catchup_full += cut != NULL;
    s->st.catchup_replayed += replayed;
    s->st.catchup_skipped += skipped;
    if (!cut && !suffix)
        s->st.catchup_failed++;
    pthread_mutex_unlock(&s->mu);
    if (cut)
        bex__ps_tables_free(cut, s->n_tables);
    log_outcome(s, rc, rows, replayed, skipped, failed);
    return rc;
}
