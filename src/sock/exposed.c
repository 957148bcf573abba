/* SPDX-License-Identifier: Apache-2.0 */
/* Exposed buffers: a context-wide table of slots claimed with a
 * compare-and-swap, so that any thread can expose a buffer and get its token
 * at once; delivery and cancel take a slot back exactly once. */
#include <errno.h>
#include <stdlib.h>

#include "common/error.h"
#include "sock/ctx_access.h"
#include "sock/internal.h"

/* Window mode: an exposed slot's window, read before the slot is taken
 * (once it is free, another thread may claim it and set a new one). */
struct exposed_win {
    struct ibv_mw *mw;
    uint32_t key, eng_id;
    bool bound;
};

static struct exposed_win exposed_win_of(const struct exp_slot *x)
{
    return (struct exposed_win){x->mw, x->key, x->eng_id, x->bound};
}

/* The slot was taken by the I/O thread: its window goes. Bound on a live
 * engine: revoked there first; bound on a dead one: released with its QP
 * already; never bound: deallocated here. */
static void exposed_win_drop(struct bex__io *io, const struct exposed_win *w)
{
    if (!w->mw)
        return;
    /* bound: on the engine's thread, which is this one (a socket's exposed
     * buffers are cancelled on its thread, its engine's) */
    struct conn *c = w->bound ? bex__conn_by_engine(io, w->eng_id) : NULL;
    if (c && c->x && c->x->ops->retire_window)
        c->x->ops->retire_window(c->x, w->mw, w->key, true);
    else if (!w->bound)
        ibv_dealloc_mw(w->mw);
}

/* Take an armed exposed slot back (delivery or cancel); false if another
 * thread took it first or it is no longer that arming. */
static bool exposed_take(struct exp_slot *x, uint32_t gen)
{
    uint32_t want = X_WORD(gen, X_ARMED);
    return atomic_compare_exchange_strong(&x->state, &want, X_WORD(gen, X_FREE));
}

int bex__exposed_deliver(struct bex__xport *xp, uint32_t imm)
{
    struct conn *c = xp->user;
    uint32_t i = imm & 0xffff, gen = (imm >> 16) & 0x7fff;
    if (i >= EXPOSED_MAX)
        return -EPROTO;
    struct exp_slot *x = &c->ctx->exposed[i];
    if (atomic_load_explicit(&x->state, memory_order_acquire) != X_WORD(gen, X_ARMED) ||
        x->eng_id != c->eng_id)
        return -EPROTO;
    struct bex_sock *s = x->s;
    void *buf = x->buf, *user = x->user;
    uint32_t len = x->len;
    struct ibv_mw *mw = x->mw; /* read before the take: then the slot may be reused */
    uint32_t key = x->key;
    bool bound = x->bound;
    if (!exposed_take(x, gen))
        return 0;                     /* bex_sock_expose took it back in a race with a failure */
    if (mw && xp->ops->retire_window) /* revoked before anything else goes out on this QP */
        xp->ops->retire_window(xp, mw, key, bound);
    else if (mw && !bound)
        ibv_dealloc_mw(mw); /* TCP: never bound */
    BEX__STAT_ADD(&c->io->stats, bytes_recv, len);
    /* an exposed buffer is the application's until it is reported, never
     * freed by bex behind its back */
    if (!bex__sock_dead(s) && !bex__sock_app_closed(s) && s->ops.on_recv)
        s->ops.on_recv(s, buf, len, s->user);
    else
        bex__sock_report_done(s, buf, len, user, -ECANCELED);
    return 0;
}

void *bex__exposed_buf(struct bex__xport *xp, uint32_t token, uint32_t *len)
{
    struct conn *c = xp->user;
    uint32_t i = token & 0xffff, gen = (token >> 16) & 0x7fff;
    if (!(token & BEX__IMM_DIRECT) || i >= EXPOSED_MAX)
        return NULL;
    struct exp_slot *x = &c->ctx->exposed[i];
    if (atomic_load_explicit(&x->state, memory_order_acquire) != X_WORD(gen, X_ARMED) ||
        x->eng_id != c->eng_id)
        return NULL;
    *len = x->len;
    return x->buf;
}

/* Hand back the exposed buffers of a socket that can take no more (the
 * engine is dead, or the peer closed the stream: it writes nothing more). */
void bex__exposed_cancel(struct bex_sock *s)
{
    for (uint32_t i = 0; i < EXPOSED_MAX; i++) {
        struct exp_slot *x = &s->ctx->exposed[i];
        uint32_t v = atomic_load(&x->state);
        if (X_KIND(v) != X_ARMED || x->s != s)
            continue;
        void *buf = x->buf, *user = x->user;
        uint32_t len = x->len;
        struct exposed_win w = exposed_win_of(x);
        if (exposed_take(x, X_GEN(v))) {
            exposed_win_drop(s->io, &w);
            bex__sock_report_done(s, buf, len, user, -ECANCELED);
        }
    }
}

/* Window mode: bind an exposed buffer's window on its engine's QP. */
void bex__exposed_bind(struct bex__io *io, struct bind_cmd *bc)
{
    struct exp_slot *x = &io->ctx->exposed[bc->slot];
    if (atomic_load(&x->state) == X_WORD(bc->gen, X_ARMED) && x->mw && !x->bound) {
        struct conn *c = bex__conn_by_engine(io, x->eng_id);
        if (c && c->x && c->x->ops->bind_window && !c->x->ops->is_dead(c->x)) {
            c->x->ops->bind_window(c->x, x->mw, x->key, x->buf, x->len);
            x->bound = true;
            bex__conn_ready(c);
        }
    }
    free(bc);
}

int bex_sock_expose(bex_sock *s, void *buf, uint32_t len, void *msg_user, bex_remote_buf *out)
{
    if (!s || !out || len == 0)
        return -EINVAL;
    if (atomic_load(&s->closing) || atomic_load(&s->state) == S_FAILED)
        return -EPIPE;
    uint32_t eng = atomic_load(&s->eng_id);
    if (!eng)
        return -ENOTCONN;
    int err = bex__sock_check_buf(s, buf, len, NULL);
    if (err)
        return err;
    bex_ctx *ctx = s->ctx;
    if (bex_mem_pool_of(buf) != ctx->sh.landing) /* only landing memory is peer-writable */
        return bex__refuse(-EINVAL, "buffer %p: not from bex_sock_alloc_exposable", buf);
    /* Window mode: a window for this exposure alone; the I/O thread binds
     * it on the engine's QP ahead of anything sent after this call. */
    struct ibv_mw *mw = NULL;
    struct bind_cmd *bc = NULL;
    if (ctx->sh.windows) {
        errno = 0;
        mw = ibv_alloc_mw(ctx->dev->pd, IBV_MW_TYPE_2);
        if (!mw)
            return errno ? -errno : -ENOMEM;
        bc = malloc(sizeof(*bc));
        if (!bc) {
            ibv_dealloc_mw(mw);
            return -ENOMEM;
        }
    }
    for (uint32_t i = 0; i < EXPOSED_MAX; i++) {
        struct exp_slot *x = &ctx->exposed[i];
        uint32_t v = atomic_load_explicit(&x->state, memory_order_relaxed);
        if (X_KIND(v) != X_FREE)
            continue;
        uint32_t gen = (X_GEN(v) + 1) & 0x7fff;
        if (!atomic_compare_exchange_strong(&x->state, &v, X_WORD(gen, X_CLAIMED)))
            continue;
        x->eng_id = eng;
        x->buf = buf;
        x->len = len;
        x->user = msg_user;
        x->s = s;
        x->mw = mw;
        x->key = mw ? ibv_inc_rkey(mw->rkey) : 0;
        x->bound = false;
        out->addr = (uintptr_t)buf;
        out->rkey = mw ? x->key : bex_mem_mr(buf)->rkey;
        out->len = len;
        out->token = BEX__IMM_DIRECT | (gen << 16) | i;
        (void)BEX__FAULT(BEX__FAULT_EXPOSE_ARM); /* tests: a failure lands here */
        atomic_store(&x->state, X_WORD(gen, X_ARMED));
        /* The I/O thread marks a socket failed, then cancels its armed
         * slots (both seq_cst): either it saw this slot armed, or we see
         * the failure here and take the slot back ourselves. */
        if (atomic_load(&s->closing) || atomic_load(&s->state) == S_FAILED) {
            uint32_t want = X_WORD(gen, X_ARMED);
            if (atomic_compare_exchange_strong(&x->state, &want, X_WORD(gen, X_FREE))) {
                free(bc); /* never bound: the window is still ours */
                if (mw)
                    ibv_dealloc_mw(mw);
                return -EPIPE;
            }
            /* the I/O thread took it: it is (or will be) reported */
            free(bc);
            return 0;
        }
        if (bc) {
            bc->slot = i;
            bc->gen = (uint16_t)gen;
            bex__io_push(s->io, &bc->cmd, CMD_BIND);
        }
        return 0;
    }
    free(bc);
    if (mw)
        ibv_dealloc_mw(mw);
    return -ENOSPC;
}

/* ---- caller memory (ctx_access.h) ---- */

void *bex__ctx_user_alloc(bex_ctx *ctx, size_t len)
{
    uint64_t max = ctx->cfg.user_mem_max;
    uint64_t was = atomic_fetch_add(&ctx->user_mem, len);
    if (was + len > max || was + len < was) {
        atomic_fetch_sub(&ctx->user_mem, len);
        errno = ENOBUFS;
        return NULL;
    }
    /* landing memory: the only memory a peer may write (an exposed
     * destination), registered once per chunk as the pool grows */
    void *p = bex_sock_alloc_exposable(ctx, len);
    if (!p)
        atomic_fetch_sub(&ctx->user_mem, len);
    return p;
}

void bex__ctx_user_free(bex_ctx *ctx, void *p, size_t len)
{
    if (!p)
        return;
    bex_mem_free(p);
    atomic_fetch_sub(&ctx->user_mem, len);
}

uint64_t bex__ctx_user_bytes(bex_ctx *ctx)
{
    return atomic_load(&ctx->user_mem);
}
