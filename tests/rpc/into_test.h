/* SPDX-License-Identifier: Apache-2.0 */
/* Test scaffolding of the calls with a destination (bex_rpc_call_into),
 * shared by tests/rpc/test_rpc_exposed.c and test_rpc_into_recovery.c:
 * a completion record that notes how many exposures of its destination
 * were still armed when done ran (none may be: done comes only once the
 * destination is retired), and pattern bodies. */
#ifndef BEX_TEST_INTO_H
#define BEX_TEST_INTO_H

#include "rpc/rpc_test.h"
#include "sock/internal.h"

/* Deadline of the calls whose deadline is not what a case is about
 * (scaled): the RDMA connection's setup in a loaded VM took over 2 s. */
#define LONG_MS 10000

struct dres {
    _Atomic long calls;
    int status;
    void *body;
    size_t len;
    long armed_at_done; /* exposures of the destination still armed when done ran */
    bex_ctx *ctx;
    void *dst;
    struct waiter w;
};

/* Exposures of the destination dst (its header room) still armed. */
static long armed_of(bex_ctx *ctx, void *dst)
{
    long n = 0;
    for (uint32_t i = 0; i < EXPOSED_MAX; i++) {
        struct exp_slot *x = &ctx->exposed[i];
        if (X_KIND(atomic_load(&x->state)) == X_ARMED && x->buf == bex__rpc_hdr_of(dst))
            n++;
    }
    return n;
}

static void d_done(int status, void *body, size_t len, void *user)
{
    struct dres *d = user;
    d->status = status;
    d->body = body;
    d->len = len;
    d->armed_at_done = armed_of(d->ctx, d->dst);
    waiter_add(&d->w, &d->calls, 1);
}

static void dres_init(struct dres *d, bex_ctx *ctx, void *dst)
{
    memset(d, 0, sizeof *d);
    d->ctx = ctx;
    d->dst = dst;
    pthread_mutex_init(&d->w.mu, NULL);
    pthread_cond_init(&d->w.cv, NULL);
}

static bool all_bytes(const void *p, size_t n, uint8_t v)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != v)
            return false;
    return true;
}
#endif
