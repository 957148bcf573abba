/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: forwards in batches (docs/architecture.md, "Replication";
 * wire: docs/protocol.md, "Forward").
 *
 * Primary: a Push numbered is queued, under the shard's lock and so in lsn
 * order, on each backup of the set. A backup's queue goes out as batches
 * of consecutive lsns, at most batch_max Pushes and batch_bytes of bodies
 * each (one Push at least), with at most batch_depth batches out to it at
 * once: while that many are out its queue grows, and the next batch takes
 * what queued meanwhile. A batch answered 0 acknowledges each Push in it;
 * one failed fails each, and every forward still queued for that backup
 * with it (so they do not wait out the deadline one batch after another).
 *
 * Backup: a batch is checked whole before anything in it is applied (its
 * count, each entry's lsn and length, each Push): one that lies is refused
 * (-EINVAL, logged, counted), nothing of it applied. A batch is one unit
 * of the backup's order (repl.c): applied when its first lsn comes (the
 * entries applied already skipped), held while ahead. */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "bex/ps.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "ps/repl_batch.h"
#include "ps/shard_internal.h"
#include "rpc/internal.h"

#define BATCH_MAX       64u
#define BATCH_MAX_MAX   65536u
#define BATCH_BYTES     (1ull << 20)
#define BATCH_BYTES_MAX (64ull << 20)
#define DEPTH           8u
#define DEPTH_MAX       64u
#define BATCH_HDR       (BEX__PS_FWD_HDR_LEN + BEX__PS_FWD_BATCH_HDR)

int bex__ps_batch_init(struct repl *rp, const bex_ps_shard_config *cfg)
{
    if (cfg->forward_batch_max > BATCH_MAX_MAX || cfg->forward_batch_bytes > BATCH_BYTES_MAX ||
        cfg->forward_batches_inflight > DEPTH_MAX)
        return -EINVAL;
    rp->batch_max = cfg->forward_batch_max ? cfg->forward_batch_max : BATCH_MAX;
    rp->batch_bytes = cfg->forward_batch_bytes ? cfg->forward_batch_bytes : BATCH_BYTES;
    rp->batch_depth = cfg->forward_batches_inflight ? cfg->forward_batches_inflight : DEPTH;
    return 0;
}

/* ---- primary ---- */

void bex__ps_batch_queue_locked(bex_ps_shard *s, struct fop *op)
{
    struct repl *rp = &s->rp;
    uint32_t n = 0;
    for (uint32_t i = 0; i < rp->n_bk; i++) {
        struct backup *b = &rp->bk[i];
        struct fcall *fc = &op->calls[i];
        *fc = (struct fcall){.op = op, .b = i, .epoch = rp->epoch};
        if (b->state == BK_OUT)
            continue; /* out of the set: not waited for */
        if (b->q_tail)
            b->q_tail->q_nx = fc;
        else
            b->q_head = fc;
        b->q_tail = fc;
        n++;
    }
    atomic_store(&op->left, n + 1); /* + 1: the sending guard */
}

/* A batch out to one backup. */
struct fbatch {
    bex_ps_shard *s;
    struct backup *bk;
    struct fcall *list;  /* chained by q_nx, lsn order */
    uint32_t timeout_ms; /* the forward's deadline (bex__ps_fwd_timeout) */
};

/* The next batch off b's queue (under s->mu): n forwards, bytes on the
 * wire. */
static struct fcall *take_locked(const struct repl *rp, struct backup *b, uint32_t *n,
                                 size_t *bytes)
{
    struct fcall *head = b->q_head, *last = NULL, *f = head;
    size_t body = 0;
    *n = 0;
    while (f && *n < rp->batch_max && (!*n || body + f->op->len <= rp->batch_bytes)) {
        body += f->op->len;
        *bytes += BEX__PS_FWD_ENT_HDR + f->op->len;
        ++*n;
        last = f;
        f = f->q_nx;
    }
    b->q_head = f;
    if (!f)
        b->q_tail = NULL;
    last->q_nx = NULL;
    return head;
}

/* Every forward queued on b, taken (under s->mu). */
static struct fcall *take_all_locked(struct backup *b)
{
    struct fcall *all = b->q_head;
    b->q_head = b->q_tail = NULL;
    return all;
}

static void calls_done(struct fcall *list, int status)
{
    while (list) {
        struct fcall *nx = list->q_nx;
        bex__ps_fwd_done(status, list);
        list = nx;
    }
}

static bool pump_one(bex_ps_shard *s, struct backup *bk, size_t idx);

static void batch_done(int status, void *body, size_t len, void *user)
{
    (void)len;
    struct fbatch *bt = user;
    bex_ps_shard *s = bt->s;
    struct backup *bk = bt->bk;
    struct fcall *rest = NULL;
    bex_rpc_free(body);
    pthread_mutex_lock(&s->mu);
    bk->b_out--;
    bk->reached |= status == 0;
    if (status)
        rest = take_all_locked(bk); /* they would fail the same way, later */
    pthread_mutex_unlock(&s->mu);
    calls_done(bt->list, status);
    calls_done(rest, status);
    free(bt);
    if (!status)
        pump_one(s, bk, 0);
}

/* Send bt's forwards (n, bytes on the wire) on ch in session. */
static void batch_send(struct fbatch *bt, bex_rpc_channel *ch, uint64_t session, uint32_t n,
                       size_t bytes)
{
    struct repl *rp = &bt->s->rp;
    uint8_t *p = bex_rpc_alloc(rp->ctx, bytes);
    if (!p) {
        batch_done(-ENOMEM, NULL, 0, bt);
        return;
    }
    bex__ps_fwd_put(p, &(struct bex__ps_fwd_hdr){.session = session,
                                                 .lsn = bt->list->op->lsn,
                                                 .flags = BEX__PS_FWD_BATCH});
    bex__ps_put32(p + BEX__PS_FWD_HDR_LEN, n);
    bex__ps_put32(p + BEX__PS_FWD_HDR_LEN + 4, 0);
    size_t off = BATCH_HDR;
    for (const struct fcall *f = bt->list; f; f = f->q_nx) {
        bex__ps_put64(p + off, f->op->lsn);
        bex__ps_put32(p + off + 8, (uint32_t)f->op->len);
        bex__ps_put32(p + off + 12, 0);
        memcpy(p + off + BEX__PS_FWD_ENT_HDR, f->op->body, f->op->len);
        off += BEX__PS_FWD_ENT_HDR + f->op->len;
    }
    bex_rpc_call_opts o = {.timeout_ms = bt->timeout_ms};
    int rc = bex_rpc_call(ch, BEX_PS_SERVICE, BEX_PS_M_FORWARD, p, bytes, &o, batch_done, bt, NULL);
    if (rc) {
        bex_rpc_free(p);
        batch_done(rc, NULL, 0, bt);
    }
}

/* Send bk's queue (NULL: backup idx's, found under the lock: a new term
 * may replace the array) as far as its batches out allow; false when
 * there is no such backup. */
static bool pump_one(bex_ps_shard *s, struct backup *fixed, size_t idx)
{
    struct repl *rp = &s->rp;
    for (;;) {
        struct backup *bk = fixed;
        struct fbatch *bt = malloc(sizeof *bt);
        struct fcall *fail = NULL;
        uint32_t n = 0;
        size_t bytes = BATCH_HDR;
        pthread_mutex_lock(&s->mu);
        if (!bk && idx < rp->n_bk)
            bk = &rp->bk[idx];
        bool go = bk && !bk->closed && bk->q_head && bk->b_out < rp->batch_depth;
        if (go && !bt)
            fail = take_all_locked(bk);
        else if (go) {
            *bt = (struct fbatch){s, bk, take_locked(rp, bk, &n, &bytes),
                                  bex__ps_fwd_timeout(rp, bk)};
            bk->b_out++;
            s->st.fwd_batches++;
        }
        bex_rpc_channel *ch = go ? bk->ch : NULL;
        uint64_t session = rp->session;
        pthread_mutex_unlock(&s->mu);
        if (!go || !bt) {
            free(bt);
            calls_done(fail, -ENOMEM);
            return bk != NULL;
        }
        batch_send(bt, ch, session, n, bytes);
    }
}

void bex__ps_batch_pump(bex_ps_shard *s)
{
    for (size_t i = 0; pump_one(s, NULL, i); i++)
        ;
}

void bex__ps_batch_close_locked(struct backup *b)
{
    b->closed = true;
}

void bex__ps_batch_drain(struct backup *b, int status)
{
    /* the channel is gone: nothing else touches b's queue now */
    calls_done(take_all_locked(b), status);
}

/* ---- backup ---- */

static int bad(bex_ps_shard *s, uint64_t first, const char *why)
{
    bex__log(&s->log, BEX_LOG_WARN, "ps shard %u: a forward batch at lsn %llu refused whole: %s",
             s->shard, (unsigned long long)first, why);
    pthread_mutex_lock(&s->mu);
    s->st.fwd_batches_bad++;
    pthread_mutex_unlock(&s->mu);
    return -EINVAL;
}

/* Entry i of a batch at p + *off (len bytes in all) decoded onto *tail. */
static int entry_decode(bex_ps_shard *s, uint64_t first, uint32_t i, const uint8_t *p, size_t len,
                        size_t *off, struct fwdh **tail)
{
    if (len - *off < BEX__PS_FWD_ENT_HDR)
        return bad(s, first, "its count is more than its entries");
    uint64_t lsn = bex__ps_get64(p + *off);
    uint32_t el = bex__ps_get32(p + *off + 8);
    if (bex__ps_get32(p + *off + 12) || el > len - *off - BEX__PS_FWD_ENT_HDR)
        return bad(s, first, "an entry's length runs past the batch");
    if (lsn != first + i)
        return bad(s, first, "its lsns are not consecutive");
    int rc = bex__ps_fwd_decode(s, p + *off + BEX__PS_FWD_ENT_HDR, el, lsn, tail);
    if (rc)
        return bad(s, first, "an entry is not a valid Push");
    *off += BEX__PS_FWD_ENT_HDR + el;
    return 0;
}

int bex__ps_batch_decode(bex_ps_shard *s, uint64_t first, const uint8_t *p, size_t len,
                         struct fwdh **out)
{
    if (len < BEX__PS_FWD_BATCH_HDR || bex__ps_get32(p + 4))
        return bad(s, first, "a malformed batch header");
    uint32_t n = bex__ps_get32(p);
    size_t room = (len - BEX__PS_FWD_BATCH_HDR) / (BEX__PS_FWD_ENT_HDR + BEX__PS_HDR_LEN);
    if (!n || n > BATCH_MAX_MAX || n > room || first > UINT64_MAX - n)
        return bad(s, first, "a count that does not fit its length");
    struct fwdh *head = NULL, **tail = &head;
    size_t off = BEX__PS_FWD_BATCH_HDR;
    int rc = 0;
    for (uint32_t i = 0; i < n && !rc; i++)
        if (!(rc = entry_decode(s, first, i, p, len, &off, tail)))
            tail = &(*tail)->more;
    if (!rc && off != len)
        rc = bad(s, first, "bytes after its last entry");
    if (rc) {
        bex__ps_fwdh_free(head);
        return rc;
    }
    head->cnt = n;
    for (const struct fwdh *e = head->more; e; e = e->more)
        head->bytes += e->bytes;
    *out = head;
    return 0;
}
