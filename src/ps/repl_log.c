/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: a primary's log of its last forwards (docs/architecture.md,
 * "Replication"; wire: docs/protocol.md, "Forward").
 *
 * A backup that missed forwards (its connection lost past the forward
 * deadline) but kept its rows is marked down; the primary's probe finds
 * it behind and learns the last lsn it applied. When the log still holds
 * every forward after that one, the primary sends them again, in lsn
 * order, and the backup rejoins once it applied them all; else it stays
 * down (it catches up by a copy when restarted). With a static cluster
 * file the primary numbers nothing while a backup is down, so the
 * forwards resent end at the lsn the backup must reach. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "bex/ps.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "ps/shard_internal.h"
#include "rpc/internal.h"

#define LOG_ENTRIES     1024u
#define LOG_ENTRIES_MAX 65536u
#define LOG_BYTES       (16ull << 20)

int bex__ps_rlog_init(struct rlog *l, const bex_ps_shard_config *cfg)
{
    if (cfg->forward_log_entries > LOG_ENTRIES_MAX)
        return -EINVAL;
    *l = (struct rlog){.cap = cfg->forward_log_entries ? cfg->forward_log_entries : LOG_ENTRIES,
                       .max_bytes = cfg->forward_log_bytes ? cfg->forward_log_bytes : LOG_BYTES};
    if (cfg->role == BEX_PS_ROLE_PRIMARY && !(l->e = calloc(l->cap, sizeof *l->e)))
        return -ENOMEM;
    return 0;
}

static void drop_oldest(struct rlog *l)
{
    struct rlog_ent *e = &l->e[l->head];
    l->bytes -= e->len;
    free(e->body);
    *e = (struct rlog_ent){0};
    l->head = (l->head + 1) % l->cap;
    l->n--;
}

void bex__ps_rlog_clear(struct rlog *l)
{
    while (l->n)
        drop_oldest(l);
}

void bex__ps_rlog_add_locked(struct rlog *l, uint64_t lsn, const void *body, size_t len)
{
    if (!l->e)
        return;
    uint8_t *copy = len <= l->max_bytes ? malloc(len ? len : 1) : NULL;
    if (!copy) {
        /* a hole would let a backup skip this one: none kept before it */
        bex__ps_rlog_clear(l);
        return;
    }
    memcpy(copy, body, len);
    if (l->n && l->e[(l->head + l->n - 1) % l->cap].lsn + 1 != lsn)
        bex__ps_rlog_clear(l); /* not the next one (a new session): start again */
    while (l->n && (l->n == l->cap || l->bytes + len > l->max_bytes))
        drop_oldest(l);
    l->e[(l->head + l->n) % l->cap] = (struct rlog_ent){lsn, copy, len};
    l->n++;
    l->bytes += len;
}

/* The forwards resent to one backup: it rejoins when every one is back. */
struct resend {
    bex_ps_shard *s;
    uint32_t b;
    uint64_t last;
    _Atomic uint32_t left;
    _Atomic int status;
};

static void resend_end(struct resend *r)
{
    bex_ps_shard *s = r->s;
    struct backup *b = &s->rp.bk[r->b];
    int st = atomic_load(&r->status);
    pthread_mutex_lock(&s->mu);
    bool back = st == 0 && b->state == BK_PROBING;
    if (b->state == BK_PROBING)
        bex__ps_backup_move(s, r->b, back ? BK_UP : BK_DOWN);
    if (back) {
        s->rp.n_down--;
        s->st.rejoins++;
        s->st.log_rejoins++;
    }
    pthread_mutex_unlock(&s->mu);
    if (back) {
        bex__ps_lag_acked(s, r->b, r->last);
        bex__log(&s->log, BEX_LOG_INFO,
                 "ps shard %u: backup %u applied the forwards it missed, up to lsn %llu: it "
                 "rejoins",
                 s->shard, r->b, (unsigned long long)r->last);
    } else {
        bex__log(&s->log, BEX_LOG_WARN,
                 "ps shard %u: backup %u did not apply the forwards sent again (%s): still down",
                 s->shard, r->b, bex_strerror(st));
    }
    free(r);
}

static void resend_done(int status, void *body, size_t len, void *user)
{
    (void)len;
    struct resend *r = user;
    bex_rpc_free(body);
    int zero = 0;
    if (status)
        atomic_compare_exchange_strong(&r->status, &zero, status);
    if (atomic_fetch_sub(&r->left, 1) == 1)
        resend_end(r);
}

/* The forward bodies of pos + 1 .. rp->lsn from the log into out[] (under
 * s->mu): how many, 0 when the log does not hold them all (*rc -ERANGE)
 * or on no memory (*rc -ENOMEM; none kept). */
static uint32_t bodies_locked(struct repl *rp, uint64_t pos, uint8_t **out, size_t *lens, int *rc)
{
    const struct rlog *l = &rp->log;
    uint64_t first = l->n ? l->e[l->head].lsn : 0;
    *rc = -ERANGE;
    if (!l->n || pos >= rp->lsn || pos + 1 < first || rp->lsn - pos > l->n)
        return 0;
    uint32_t n = (uint32_t)(rp->lsn - pos);
    *rc = 0;
    for (uint32_t i = 0; i < n; i++) {
        const struct rlog_ent *e = &l->e[(l->head + (pos + 1 - first) + i) % l->cap];
        lens[i] = BEX__PS_FWD_HDR_LEN + e->len;
        if (!(out[i] = bex_rpc_alloc(rp->ctx, lens[i]))) {
            while (i)
                bex_rpc_free(out[--i]);
            *rc = -ENOMEM;
            return 0;
        }
        bex__ps_fwd_put(out[i], &(struct bex__ps_fwd_hdr){.session = rp->session, .lsn = e->lsn});
        memcpy(out[i] + BEX__PS_FWD_HDR_LEN, e->body, e->len);
    }
    return n;
}

int bex__ps_rlog_resend(bex_ps_shard *s, uint32_t b, uint64_t pos)
{
    struct repl *rp = &s->rp;
    uint32_t cap = rp->log.cap;
    uint8_t **bodies = calloc(cap, sizeof *bodies);
    size_t *lens = calloc(cap, sizeof *lens);
    struct resend *r = malloc(sizeof *r);
    int rc = bodies && lens && r ? 0 : -ENOMEM;
    uint32_t n = 0;
    if (!rc) {
        pthread_mutex_lock(&s->mu);
        n = bodies_locked(rp, pos, bodies, lens, &rc);
        *r = (struct resend){.s = s, .b = b, .last = rp->lsn};
        s->st.fwd_resent += n;
        pthread_mutex_unlock(&s->mu);
    }
    if (rc) {
        free(r);
        r = NULL;
    } else {
        atomic_store(&r->left, n + 1); /* + 1 while sending */
        bex__log(&s->log, BEX_LOG_INFO,
                 "ps shard %u: backup %u is behind (at lsn %llu): sending it %u forwards again",
                 s->shard, b, (unsigned long long)pos, n);
    }
    bex_rpc_call_opts o = {.timeout_ms = rp->fwd_timeout_ms};
    for (uint32_t i = 0; i < n; i++) {
        int crc = bex_rpc_call(rp->bk[b].ch, BEX_PS_SERVICE, BEX_PS_M_FORWARD, bodies[i], lens[i],
                               &o, resend_done, r, NULL);
        if (crc) {
            bex_rpc_free(bodies[i]);
            resend_done(crc, NULL, 0, r);
        }
    }
    if (r)
        resend_done(0, NULL, 0, r); /* the sending guard */
    free(bodies);
    free(lens);
    return rc;
}

/* ---- a restarted backup's catch-up by log suffix (catchup_suffix.c) ---- */

/* The entries of pos + 1 .. rp->lsn that fit in max bytes (at least
 * one), each u64 lsn, u32 length, that many bytes of the Push body, into
 * an RPC buffer after room for a copy header (under s->mu). 0 with *out,
 * *len (the whole answer) and *last (the primary's lsn); -ENOENT not a
 * primary with a log, -ESTALE another session, -ERANGE a position the
 * log does not hold (behind it, past the primary's lsn), -ENOMEM. */
int bex__ps_rlog_suffix_locked(const struct repl *rp, uint64_t session, uint64_t pos, uint32_t max,
                               uint8_t **out, size_t *len, uint64_t *last)
{
    const struct rlog *l = &rp->log;
    if (rp->role != BEX_PS_ROLE_PRIMARY || rp->fenced || !l->e)
        return -ENOENT; /* etcd mode: a backup copies from its term's primary */
    if (session != rp->session)
        return -ESTALE;
    uint64_t first = l->n ? l->e[l->head].lsn : rp->lsn + 1;
    bool whole = !l->n || l->e[(l->head + l->n - 1) % l->cap].lsn == rp->lsn;
    if (pos > rp->lsn || (pos < rp->lsn && (pos + 1 < first || !whole)))
        return -ERANGE;
    uint64_t n = rp->lsn - pos, size = BEX__PS_COPY_HDR_LEN;
    uint32_t k = 0, at = (uint32_t)((l->head + (pos + 1 - first)) % l->cap);
    for (; k < n; k++) {
        size_t e = l->e[(at + k) % l->cap].len + 12;
        if (k && size + e > max)
            break;
        size += e;
    }
    uint8_t *b = bex_rpc_alloc(rp->ctx, (size_t)size);
    if (!b)
        return -ENOMEM;
    size_t o = BEX__PS_COPY_HDR_LEN;
    for (uint32_t i = 0; i < k; i++) {
        const struct rlog_ent *e = &l->e[(at + i) % l->cap];
        bex__ps_put64(b + o, e->lsn);
        bex__ps_put32(b + o + 8, (uint32_t)e->len);
        memcpy(b + o + 12, e->body, e->len);
        o += 12 + e->len;
    }
    *out = b;
    *len = (size_t)size;
    *last = rp->lsn;
    return 0;
}
