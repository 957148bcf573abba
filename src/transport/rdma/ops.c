/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA transport's ops table: the engine behind struct bex__xport. */
#include "transport/rdma/engine.h"

static void rdma_destroy(struct bex__xport *x)
{
    bex__engine_destroy(bex__engine_of(x));
}

static bool rdma_is_up(struct bex__xport *x)
{
    return bex__engine_is_up(bex__engine_of(x));
}

static bool rdma_is_dead(struct bex__xport *x)
{
    return bex__engine_is_dead(bex__engine_of(x));
}

static uint32_t rdma_peer_max_msg(struct bex__xport *x)
{
    return bex__engine_peer_max_msg(bex__engine_of(x));
}

static int rdma_refuse_stream(struct bex__xport *x, uint32_t id)
{
    return bex__engine_refuse_stream(bex__engine_of(x), id);
}

static void rdma_attach(struct bex__xport *x, struct bex__stream *st, uint32_t id, bool client)
{
    bex__engine_attach(bex__engine_of(x), st, id, client);
}

static void rdma_send(struct bex__xport *x, struct bex__stream *st, struct bex__msg *m)
{
    (void)x;
    bex__engine_send(st, m);
}

static void rdma_close_stream(struct bex__xport *x, struct bex__stream *st)
{
    (void)x;
    bex__engine_close_stream(st);
}

static void rdma_peer_closed(struct bex__xport *x, struct bex__stream *st)
{
    (void)x;
    bex__engine_peer_closed(st);
}

static unsigned rdma_tick(struct bex__xport *x, uint64_t now_ms)
{
    struct bex__engine *e = bex__engine_of(x);
    unsigned want = bex__engine_tick(e, now_ms) ? BEX__TICK_PROGRESS : 0;
    return want | (bex__engine_tick_soon(e) ? BEX__TICK_SOON : 0);
}

static void rdma_fail(struct bex__xport *x, int err)
{
    bex__engine_fail(bex__engine_of(x), err);
}

static void rdma_bind_window(struct bex__xport *x, struct ibv_mw *mw, uint32_t rkey, void *addr,
                             uint32_t len)
{
    bex__engine_bind_window(bex__engine_of(x), mw, rkey, addr, len);
}

static void rdma_retire_window(struct bex__xport *x, struct ibv_mw *mw, uint32_t rkey, bool bound)
{
    bex__engine_retire_window(bex__engine_of(x), mw, rkey, bound);
}

const struct bex__transport_ops bex__rdma_transport = {
    .name = "rdma",
    .destroy = rdma_destroy,
    .is_up = rdma_is_up,
    .is_dead = rdma_is_dead,
    .peer_max_msg = rdma_peer_max_msg,
    .refuse_stream = rdma_refuse_stream,
    .attach = rdma_attach,
    .send = rdma_send,
    .send_now = bex__engine_send_now,
    .close_stream = rdma_close_stream,
    .peer_closed = rdma_peer_closed,
    .progress = bex__engine_progress_xport,
    .tick = rdma_tick,
    .fail = rdma_fail,
    .bind_window = rdma_bind_window,
    .retire_window = rdma_retire_window,
};
