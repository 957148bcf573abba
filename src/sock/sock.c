/* SPDX-License-Identifier: Apache-2.0 */
/* Contexts and the public socket API (include/bex/sock.h). */
#include <arpa/inet.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sodium.h>

#include "common/cfg.h"
#include "common/error.h"
#include "sock/ctx_access.h"
#include "sock/env.h"
#include "sock/internal.h"
#include "sock/secret.h"
#include "transport/tcp/tcp.h"
#include "mem/lookup.h"
#include "transport/rdma/srq.h"

#define DEF(field, v)                                                                              \
    do {                                                                                           \
        if (!c->field)                                                                             \
            c->field = (v);                                                                        \
    } while (0)

static int config_check(bex_ctx_config *c)
{
    if (bex_addr_is_any(&c->local_addr))
        return -EINVAL;
    DEF(sq_depth, 32);
    DEF(rq_depth, 64);
    DEF(eager_max, 8192);
    DEF(frag_size, 65536);
    DEF(rndv_ahead, 8);
    DEF(keepalive_ms, 100);
    DEF(keepalive_timeout_ms, 2000);
    DEF(connect_timeout_ms, 3000);
    DEF(poll_spin_us, 50);
    DEF(qp_timeout, 14);
    DEF(qp_retry_cnt, 7);
    DEF(qp_rnr_retry, 7);
    DEF(max_msg, 64u << 20);
    DEF(rndv_max, 256);
    DEF(rndv_bytes_max, (uint64_t)256 << 20);
    DEF(recv_bytes_max, (uint64_t)1 << 30);
    DEF(user_mem_max, (uint64_t)1 << 30);
    DEF(recv_share_min, (uint64_t)4 << 20);
    DEF(recv_min_rate, 1u << 20);
    DEF(recv_rate_ms, 5000);
    DEF(streams_max, 1024);
    DEF(setup_max, 64);
    DEF(rndv_timeout_ms, 30000);
    DEF(credit_timeout_ms, 30000);
    DEF(io_threads, 1);
    DEF(srq_drain_ms, BEX__SRQ_DRAIN_MS);
    /* sq_depth: a power of two, so that send slots map continuously when
     * the engine's 32-bit counters wrap */
    if (c->sq_depth < 2 || c->sq_depth > 4096 || (c->sq_depth & (c->sq_depth - 1)) ||
        c->rq_depth < BEX__ENGINE_MIN_DEPTH || c->rq_depth > 16384 || c->eager_max > (1u << 20) ||
        c->frag_size < 256 || c->rndv_ahead > 256 ||
        c->keepalive_timeout_ms < 2 * c->keepalive_ms || c->log_level < 0 ||
        c->log_level > BEX_LOG_DEBUG || c->max_msg > INT32_MAX || c->rndv_max > 32767 ||
        c->remote_access > BEX_REMOTE_ACCESS_WINDOW || c->transport > BEX_TRANSPORT_TCP ||
        c->io_threads > BEX__IO_THREADS_MAX || c->poll_mode > BEX_POLL_EVENT ||
        c->tcp_ack_delay_us > BEX__TCP_ACK_DELAY_MAX_US || c->log_window_ms > BEX__LOG_WINDOW_MAX ||
        (c->srq_depth && (c->srq_depth < c->rq_depth || c->srq_depth > BEX__SRQ_DEPTH_MAX)))
        return -EINVAL;
    if (bex__ctx_rdma_opts_check(c) || bex__ctx_window_check(c))
        return -EINVAL;
    /* peer-writable memory only in a landing pool, nothing else there */
    if ((c->pool && bex_mem_pool_kind(c->pool) != BEX_MEM_POOL_GENERAL) ||
        (c->landing_pool && bex_mem_pool_kind(c->landing_pool) != BEX_MEM_POOL_LANDING))
        return -EINVAL;
    return 0;
}

int bex_poll_mode_parse(const char *name, uint32_t *mode)
{
    static const char *const names[] = {
        [BEX_POLL_SPIN_SLEEP] = "spin-sleep", [BEX_POLL_BUSY] = "busy", [BEX_POLL_EVENT] = "event"};
    for (uint32_t m = 0; name && m < sizeof names / sizeof names[0]; m++) {
        if (strcmp(name, names[m]) == 0) {
            *mode = m;
            return 0;
        }
    }
    return -EINVAL;
}

/* Landing or window mode (docs/security.md). Automatic: windows where they
 * are trustworthy. Not on rxe: it checks a write against the MR's range,
 * not the window's, so a window there scopes nothing the landing layout
 * does not; and invalidating an unbound window panics its kernel, which a
 * peer can provoke (SEND_WITH_INV) once windows are in use. */
static int pick_remote_access(bex_ctx *ctx, uint32_t want)
{
    if (!ctx->dev) { /* TCP only: no peer writes our memory */
        ctx->sh.windows = false;
        return 0;
    }
    const struct ibv_device_attr *a = &ctx->dev->attr;
    bool rxe = strncmp(ctx->dev->name, "rxe", 3) == 0 || a->vendor_id == 0xffffff;
    bool mw2 =
        a->device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B);
    if (want == BEX_REMOTE_ACCESS_AUTO)
        want = mw2 && !rxe ? BEX_REMOTE_ACCESS_WINDOW : BEX_REMOTE_ACCESS_LANDING;
    ctx->sh.windows = want == BEX_REMOTE_ACCESS_WINDOW;
    if (ctx->sh.windows) {
        /* the device must really allocate type-2 windows on this PD */
        struct ibv_mw *mw = ibv_alloc_mw(ctx->dev->pd, IBV_MW_TYPE_2);
        if (!mw)
            return -EOPNOTSUPP;
        ibv_dealloc_mw(mw);
    }
    return 0;
}

int bex_ctx_remote_access(const bex_ctx *ctx)
{
    return ctx->sh.windows ? BEX_REMOTE_ACCESS_WINDOW : BEX_REMOTE_ACCESS_LANDING;
}

static void io_srq_fini(struct bex__io *io);

/* SRQ mode: the thread's shared receive queue on its PD (the parent domain
 * where there is one), with a CQ of its own for every receive completion
 * of the thread (srq_depth at most are posted). */
static int io_srq_init(bex_ctx *ctx, struct bex__io *io)
{
    const struct ibv_device_attr *a = &ctx->dev->attr;
    uint32_t depth = ctx->cfg.srq_depth;
    if (depth > (uint32_t)a->max_srq_wr || depth > (uint32_t)a->max_cqe) {
        bex__log(&ctx->log, BEX_LOG_ERROR,
                 "srq_depth %u: %s takes at most %d receives in a shared queue and %d in a CQ",
                 depth, ctx->dev->name, a->max_srq_wr, a->max_cqe);
        return -EINVAL;
    }
    struct ibv_cq *cq;
    int err = bex__rdma_cq_create(ctx->dev, (int)depth, io->ch, &cq);
    if (err)
        return err;
    uint32_t rbuf = ctx->ecfg.eager_max > BEX__HDR_LEN ? ctx->ecfg.eager_max : BEX__HDR_LEN;
    if ((err = bex__srq_create(&io->sh, depth, rbuf, cq, &io->sh.srq))) {
        bex__log(&ctx->log, BEX_LOG_ERROR, "%s: ibv_create_srq (%u receives): %s", ctx->dev->name,
                 depth, bex_strerror(err));
        bex__rdma_cq_destroy(cq);
        return err;
    }
    io->sh.srq->drain_ms = ctx->cfg.srq_drain_ms;
    /* the device's async events (IBV_EVENT_QP_LAST_WQE_REACHED of a QP
     * draining, bex__srq_retire): every SRQ thread of the process watches
     * the one fd, whoever reads an event hands it to its QP's queue */
    if ((err = bex__rdma_async_nonblock(ctx->dev)) ||
        (err = bex__loop_watch(&io->loop, ctx->dev->ctx->async_fd, EPOLLIN, &io->async_tag))) {
        io_srq_fini(io);
        return err;
    }
    return 0;
}

static void io_srq_fini(struct bex__io *io)
{
    if (!io->sh.srq)
        return;
    struct ibv_cq *cq = io->sh.srq->cq;
    bex__srq_destroy(io->sh.srq);
    bex__rdma_cq_destroy(cq);
    io->sh.srq = NULL;
}

/* One I/O thread's resources: its loop, and with a device its completion
 * channel and CQ (BEX__CQ_INITIAL entries, grown as engines come), and in
 * SRQ mode its shared receive queue. */
static int io_init(bex_ctx *ctx, struct bex__io *io, uint32_t idx)
{
    int err;
    io->ctx = ctx;
    io->env = &ctx->env;
    io->idx = idx;
    bex__io_tags_init(io);
    io->sh = ctx->sh;
    io->sh.stats = &io->stats;
    io->sh.recv_acct = &ctx->recv_acct;
    io->engines = calloc(ENGINE_TABLE, sizeof(*io->engines));
    if (!io->engines)
        return -ENOMEM;
    if ((err = bex__loop_init(&io->loop)))
        goto err_engines;
    if (ctx->dev) {
        if ((err = bex__rdma_channel_create(ctx->dev, &io->ch)))
            goto err_loop;
        int cqe =
            ctx->dev->attr.max_cqe < BEX__CQ_INITIAL ? ctx->dev->attr.max_cqe : BEX__CQ_INITIAL;
        io->cqs = calloc(1, sizeof(*io->cqs));
        if (!io->cqs) {
            err = -ENOMEM;
            goto err_channel;
        }
        if ((err = bex__rdma_cq_create(ctx->dev, cqe, io->ch, &io->sh.cq)))
            goto err_cqs;
        io->cqs[0] = (struct io_cq){.cq = io->sh.cq, .cap = (uint32_t)cqe};
        io->n_cq = 1;
        if ((err = bex__loop_watch(&io->loop, io->ch->fd, EPOLLIN, &io->ch_tag)))
            goto err_cq;
        if ((err = bex__io_td_pick(ctx, io)))
            goto err_td;
        if (ctx->cfg.srq_depth && (err = io_srq_init(ctx, io)))
            goto err_td;
    }
    return 0;
err_td:
    bex__rdma_td_free(io->td);
    io->td = NULL;
    bex__loop_unwatch(&io->loop, io->ch->fd);
err_cq:
    bex__rdma_cq_destroy(io->sh.cq);
    io->sh.cq = NULL;
    io->n_cq = 0;
err_cqs:
    free(io->cqs);
    io->cqs = NULL;
err_channel:
    bex__rdma_channel_destroy(io->ch);
    io->ch = NULL;
err_loop:
    bex__loop_fini(&io->loop);
err_engines:
    free(io->engines);
    io->engines = NULL;
    return err;
}

/* Undo io_init (of a thread that is stopped or never ran); one that
 * io_init never reached or undid itself has no engine table. */
static void io_fini(struct bex__io *io)
{
    while (io->msg_free) {
        struct sock_msg *w = io->msg_free;
        io->msg_free = w->free_next;
        free(w);
    }
    io->n_msg_free = 0;
    if (!io->engines)
        return;
    bex__loop_fini(&io->loop);
    bex__io_ack_cq_events(io); /* (ibv_destroy_cq waits for them) */
    io_srq_fini(io);           /* every QP on it is gone (the connections were freed) */
    bex__rdma_td_free(io->td);
    for (uint32_t i = 0; i < io->n_cq; i++)
        bex__rdma_cq_destroy(io->cqs[i].cq);
    free(io->cqs);
    bex__rdma_channel_destroy(io->ch);
    free(io->engines);
    io->engines = NULL;
}

/* Stop and join every started I/O thread. */
static void io_stop(bex_ctx *ctx)
{
    for (uint32_t i = 0; i < ctx->n_io; i++)
        if (bex__io_state(&ctx->io[i]) == IO_RUNNING)
            bex__io_push(&ctx->io[i], &ctx->io[i].stop_cmd, CMD_STOP);
    for (uint32_t i = 0; i < ctx->n_io; i++) {
        enum bex__io_state st = bex__io_state(&ctx->io[i]);
        if (st == IO_RUNNING || st == IO_STOPPING) {
            pthread_join(ctx->io[i].thread, NULL);
            bex__io_move(&ctx->io[i], IO_JOINED);
        }
    }
    /* A listener's thread may have handed a connection to a thread that
     * had stopped already: its descriptor would leak. */
    for (uint32_t i = 0; i < ctx->n_io; i++) {
        if (!ctx->io[i].engines)
            continue; /* io_init never made its loop */
        for (struct bex__cmd *c = bex__loop_take(&ctx->io[i].loop), *n; c; c = n) {
            n = c->next;
            if (c->type == CMD_ADOPT) {
                struct adopt_cmd *a = bex__container_of(c, struct adopt_cmd, cmd);
                close(a->fd);
                free(a);
            }
        }
    }
}

/* A peer's key in the homes table: an IPv4 address, port and transport
 * choice fit in 64 bits, so the key is the whole identity; an IPv6 one is
 * hashed (FNV-1a), and two peers that collide merely share a thread. */
static uint64_t home_key(const bex_addr *addr, uint32_t mode)
{
    uint64_t host = ntohl(addr->in4.sin_addr.s_addr);
    if (addr->sa.sa_family == AF_INET6) {
        uint64_t h = 14695981039346656037ull;
        for (int i = 0; i < 16; i++)
            h = (h ^ addr->in6.sin6_addr.s6_addr[i]) * 1099511628211ull;
        host = h ^ h >> 32;
    }
    return (host & 0xffffffffu) << 32 | (uint64_t)bex_addr_port(addr) << 16 | (mode & 0xffffu);
}

/* The thread of the connection to addr with this transport choice: the one
 * that has (or had) it, else the next in round-robin order. */
static int peer_home(bex_ctx *ctx, const bex_addr *addr, uint32_t mode, struct bex__io **out)
{
    if (ctx->n_io == 1) {
        *out = &ctx->io[0];
        return 0;
    }
    uint64_t key = home_key(addr, mode);
    int err = 0;
    pthread_mutex_lock(&ctx->homes_lock);
    struct peer_home *h = bex__hmap_get(&ctx->homes, key);
    if (!h) {
        h = malloc(sizeof(*h));
        if (h) {
            *h =
                (struct peer_home){.addr = *addr, .mode = mode, .io = bex__io_next(&ctx->env)->idx};
            if ((err = bex__hmap_put(&ctx->homes, key, h))) {
                free(h);
                h = NULL;
            }
        } else {
            err = -ENOMEM;
        }
    }
    if (h)
        *out = &ctx->io[h->io];
    pthread_mutex_unlock(&ctx->homes_lock);
    return err;
}

/* ---- bex_ctx_create's steps, each undone by its own ---- */

/* The engines' configuration, from the context's. */
static void ctx_ecfg_fill(bex_ctx *ctx)
{
    const bex_ctx_config *c = &ctx->cfg;
    ctx->ecfg = (struct bex__engine_config){
        .sq_depth = c->sq_depth,
        .rq_depth = c->rq_depth,
        .eager_max = c->eager_max,
        .frag_size = c->frag_size,
        .send_window = c->send_window,
        .rndv_ahead = c->rndv_ahead,
        .keepalive_ms = c->keepalive_ms,
        .keepalive_timeout_ms = c->keepalive_timeout_ms,
        .max_msg = c->max_msg,
        .rndv_max = c->rndv_max,
        .rndv_bytes_max = c->rndv_bytes_max,
        .rndv_timeout_ms = c->rndv_timeout_ms,
        .credit_timeout_ms = c->credit_timeout_ms,
        .share_min = c->recv_share_min,
        .min_rate = c->recv_min_rate,
        .rate_window_ms = c->recv_rate_ms,
    };
}

/* The device local_addr names (none with BEX_TRANSPORT_TCP; AUTO goes on
 * without one), and what every engine shares of it. */
static int ctx_dev_open(bex_ctx *ctx)
{
    const bex_ctx_config *c = &ctx->cfg;
    if (c->transport != BEX_TRANSPORT_TCP) {
        int err = bex__rdma_dev_open_addr(&c->local_addr, &ctx->dev, &ctx->sh.path);
        if (!err && ctx->sh.path.active_mtu == 0) {
            bex__rdma_dev_close(ctx->dev);
            ctx->dev = NULL;
            err = -ENETDOWN;
        }
        if (err && c->transport == BEX_TRANSPORT_RDMA)
            return err;
        if (err) { /* AUTO: a context without a device works over TCP, and says why */
            char why[512];
            bex__rdma_why_none_addr(&c->local_addr, err, why, sizeof why);
            bex__log(&ctx->log, BEX_LOG_WARN, "%s: TCP only", why);
        }
    }
    ctx->sh.dev = ctx->dev;
    ctx->sh.pd = ctx->dev ? ctx->dev->pd : NULL;
    ctx->sh.log = &ctx->log;
    ctx->sh.conn = (struct bex__rdma_conn_config){
        .timeout = c->qp_timeout, .retry_cnt = c->qp_retry_cnt, .rnr_retry = c->qp_rnr_retry};
    bex__ctx_qos(c, &ctx->sh.conn);
    return 0;
}

/* The pools: the general one (the caller's or our own), the received
 * buffers' and the landing pool (the caller's or our own). */
static int ctx_pools_create(bex_ctx *ctx)
{
    const bex_ctx_config *c = &ctx->cfg;
    int err;
    if (c->pool) {
        ctx->sh.pool = c->pool;
    } else {
        bex_mem_registrar reg;
        if (ctx->dev)
            bex_mem_registrar_verbs(&reg, ctx->dev->pd,
                                    bex__ctx_reg_access(c, IBV_ACCESS_LOCAL_WRITE));
        else
            bex_mem_registrar_noop(&reg); /* TCP only: nothing to register */
        if ((err = bex_mem_pool_create(&reg, NULL, &ctx->sh.pool)))
            return err;
        ctx->own_pool = true;
    }
    /* Received buffers have a pool of their own, registered like the main
     * one: only the I/O thread allocates from it, so its in-use count is what
     * the context holds of received data (recv_bytes_max). */
    bex_mem_registrar rreg;
    bex_mem_pool_registrar(ctx->sh.pool, &rreg);
    if ((err = bex_mem_pool_create(&rreg, NULL, &ctx->sh.recv_pool)))
        goto err_pool;
    ctx->sh.recv_max = c->recv_bytes_max;
    if ((err = pick_remote_access(ctx, c->remote_access)))
        goto err_recv_pool;
    if (c->landing_pool) {
        ctx->sh.landing = c->landing_pool;
    } else {
        /* Rendezvous destinations and exposed buffers: the only memory a
         * peer may write, payload pages with no allocator state in reach.
         * In window mode only windows bound on it grant remote access. */
        bex_mem_registrar reg;
        if (ctx->dev)
            bex_mem_registrar_verbs(
                &reg, ctx->dev->pd,
                bex__ctx_reg_access(
                    c, IBV_ACCESS_LOCAL_WRITE |
                           (ctx->sh.windows ? IBV_ACCESS_MW_BIND : IBV_ACCESS_REMOTE_WRITE)));
        else
            bex_mem_registrar_noop(&reg);
        bex_mem_config mc = {.kind = BEX_MEM_POOL_LANDING};
        if ((err = bex_mem_pool_create(&reg, &mc, &ctx->sh.landing)))
            goto err_recv_pool;
        ctx->own_landing = true;
    }
    return 0;
err_recv_pool:
    bex_mem_pool_destroy(ctx->sh.recv_pool);
err_pool:
    if (ctx->own_pool)
        bex_mem_pool_destroy(ctx->sh.pool);
    return err;
}

/* Undo ctx_pools_create (the context failed to come up). */
static void ctx_pools_destroy(bex_ctx *ctx)
{
    if (ctx->own_landing)
        bex_mem_pool_destroy(ctx->sh.landing);
    bex_mem_pool_destroy(ctx->sh.recv_pool);
    if (ctx->own_pool)
        bex_mem_pool_destroy(ctx->sh.pool);
}

/* The I/O threads: their resources, what their connections read
 * (ctx->env), then the threads themselves. */
static int ctx_io_start(bex_ctx *ctx)
{
    int err;
    ctx->n_io = ctx->cfg.io_threads;
    ctx->io = calloc(ctx->n_io, sizeof(*ctx->io));
    if (!ctx->io)
        return -ENOMEM;
    for (uint32_t i = 0; i < ctx->n_io; i++)
        bex__io_lists_init(&ctx->io[i]);
    ctx->env = (struct bex__conn_env){
        .cfg = &ctx->cfg,
        .dev = ctx->dev,
        .sh = &ctx->sh,
        .ecfg = &ctx->ecfg,
        .log = &ctx->log,
        .has_secret = ctx->has_secret,
        .auth_key = ctx->auth_key,
        .io = ctx->io,
        .n_io = ctx->n_io,
    };
    /* round-robin from the second thread: the first runs the listeners */
    atomic_init(&ctx->env.next_io, ctx->n_io > 1 ? 1 : 0);
    bex__conn_env_init(&ctx->env, &bex__sock_conn_ops);
    for (uint32_t i = 0; i < ctx->n_io; i++) {
        if ((err = io_init(ctx, &ctx->io[i], i)))
            goto err_io;
    }
    for (uint32_t i = 0; i < ctx->n_io; i++) {
        if ((err = -pthread_create(&ctx->io[i].thread, NULL, bex__io_main, &ctx->io[i])))
            goto err_io;
        bex__io_move(&ctx->io[i], IO_RUNNING);
    }
    return 0;
err_io:
    io_stop(ctx);
    for (uint32_t i = 0; i < ctx->n_io; i++)
        io_fini(&ctx->io[i]);
    free(ctx->io);
    return err;
}

/* The environment's overrides (sock/env.c) on the context's copy of its
 * configuration, then the logger's level and name: "ctxN a.b.c.d", N
 * counting the process's contexts. A bad variable fails the context. */
static int ctx_env_apply(bex_ctx *ctx)
{
    static _Atomic unsigned ctx_seq;
    char why[256];
    unsigned n = 0;
    int err = bex__ctx_env(&ctx->cfg, why, sizeof why, &n);
    if (err) {
        bex__log(&ctx->log, BEX_LOG_ERROR, "bex_ctx_create: %s", why);
        return err;
    }
    ctx->log.level = ctx->cfg.log_level ? ctx->cfg.log_level : BEX_LOG_WARN;
    bex__log_set_window(&ctx->log, ctx->cfg.log_window_ms);
    char addr[BEX_ADDR_STRLEN], name[BEX_ADDR_STRLEN + 16];
    bex_addr_format(&ctx->cfg.local_addr, false, addr, sizeof addr);
    snprintf(name, sizeof name, "ctx%u %s", atomic_fetch_add(&ctx_seq, 1) + 1, addr);
    bex__log_set_name(&ctx->log, name);
    if (n)
        bex__log(&ctx->log, BEX_LOG_INFO, "%u settings from the environment (BEX_*)", n);
    return 0;
}

int bex_ctx_create(const bex_ctx_config *cfg, bex_ctx **out)
{
    bex_ctx_config c;
    BEX__CFG_TAKE(cfg, c);
    if (!cfg || !out)
        return -EINVAL;
    bex_ctx *ctx = calloc(1, sizeof(*ctx));
    if (!ctx)
        return -ENOMEM;
    ctx->cfg = *cfg;
    bex__log_init(&ctx->log, ctx->cfg.log_fn, ctx->cfg.log_arg, ctx->cfg.log_level);
    int err = ctx_env_apply(ctx);
    if (!err)
        err = config_check(&ctx->cfg);
    if (err) {
        free(ctx);
        return err;
    }
    /* keep the derived key only: the caller's buffer may go away */
    int have = bex__secret_resolve(cfg->secret, cfg->secret_len, ctx->auth_key);
    ctx->cfg.secret = NULL;
    ctx->cfg.secret_len = 0;
    if (have < 0) {
        free(ctx);
        return have;
    }
    ctx->has_secret = have > 0;
    ctx_ecfg_fill(ctx);
    bex__ctx_window_init(ctx);
    if ((err = ctx_dev_open(ctx)))
        goto err_free;
    if ((err = ctx_pools_create(ctx)))
        goto err_close_dev;
    pthread_mutex_init(&ctx->homes_lock, NULL);
    if ((err = ctx_io_start(ctx)))
        goto err_pools;
    *out = ctx;
    return 0;

err_pools:
    pthread_mutex_destroy(&ctx->homes_lock);
    ctx_pools_destroy(ctx);
err_close_dev:
    bex__rdma_dev_close(ctx->dev);
err_free:
    bex__ctx_window_fini(ctx);
    bex__log_fini(&ctx->log);
    sodium_memzero(ctx->auth_key, sizeof ctx->auth_key);
    free(ctx);
    return err;
}

int bex_ctx_destroy(bex_ctx *ctx)
{
    if (!ctx)
        return 0;
    if (bex__io_ctx == ctx)
        return -EDEADLK; /* it would join the thread it runs on */
    io_stop(ctx);
    for (uint32_t k = 0; k < ctx->n_io; k++) {
        struct bex__io *io = &ctx->io[k];
        for (struct bex__list *n; (n = bex__list_first(&io->conns));) {
            struct conn *cn = bex__conn_of(n);
            struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
            uint64_t id;
            for (struct bex__stream *st; (st = bex__hmap_next(&cn->streams, &it, &id));) {
                bex__hmap_del(&cn->streams, id);
                free(bex__sock_of(st)); /* the application did not close it: reclaim anyway */
            }
            bex__conn_free(cn);
        }
    }
    /* A slot that is free had its window disposed of by whoever freed it
     * (its mw is stale then): only armed ones still own theirs. */
    for (uint32_t i = 0; i < EXPOSED_MAX; i++)
        if (X_KIND(atomic_load(&ctx->exposed[i].state)) == X_ARMED && ctx->exposed[i].mw &&
            !ctx->exposed[i].bound)
            ibv_dealloc_mw(ctx->exposed[i].mw); /* exposed, never bound */
    for (uint32_t k = 0; k < ctx->n_io; k++)
        io_fini(&ctx->io[k]);
    free(ctx->io);
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    for (struct peer_home *h; (h = bex__hmap_next(&ctx->homes, &it, NULL));)
        free(h);
    bex__hmap_free(&ctx->homes);
    pthread_mutex_destroy(&ctx->homes_lock);
    bex__ctx_window_fini(ctx);
    if (ctx->own_pool && bex_mem_pool_destroy(ctx->sh.pool))
        bex__log(&ctx->log, BEX_LOG_ERROR, "context destroyed while buffers of its pool are live");
    if (bex_mem_pool_destroy(ctx->sh.recv_pool))
        bex__log(&ctx->log, BEX_LOG_ERROR, "context destroyed while received buffers are live");
    if (ctx->own_landing && bex_mem_pool_destroy(ctx->sh.landing))
        bex__log(&ctx->log, BEX_LOG_ERROR,
                 "context destroyed while buffers of its landing pool are live");
    bex__rdma_dev_close(ctx->dev);
    bex__log_fini(&ctx->log);
    sodium_memzero(ctx->auth_key, sizeof ctx->auth_key);
    free(ctx);
    return 0;
}

bex_mem_pool *bex_ctx_pool(bex_ctx *ctx)
{
    return ctx->sh.pool;
}

struct bex__log *bex__ctx_log(bex_ctx *ctx)
{
    return &ctx->log;
}

bool bex__ctx_on_io_thread(const bex_ctx *ctx)
{
    return bex__io_ctx == ctx;
}

bex_mem_pool *bex_ctx_recv_pool(bex_ctx *ctx)
{
    return ctx->sh.recv_pool;
}

bex_mem_pool *bex_ctx_landing_pool(bex_ctx *ctx)
{
    return ctx->sh.landing;
}

struct ibv_pd *bex_ctx_pd(bex_ctx *ctx)
{
    return ctx->dev ? ctx->dev->pd : NULL;
}

void *bex_sock_alloc(bex_ctx *ctx, size_t size)
{
    return bex_mem_alloc(ctx->sh.pool, size);
}

void *bex_sock_alloc_exposable(bex_ctx *ctx, size_t size)
{
    return bex_mem_alloc(ctx->sh.landing, size);
}

/* Each I/O thread counts its own; the sums (the maximum for
 * max_inflight_bytes) are what the context did. */
void bex_ctx_stats(bex_ctx *ctx, bex_sock_stats *o)
{
    memset(o, 0, sizeof(*o));
    for (uint32_t i = 0; i < ctx->n_io; i++) {
        struct bex__stats *s = &ctx->io[i].stats;
        uint64_t m = atomic_load_explicit(&s->max_inflight_bytes, memory_order_relaxed);
        if (m > o->max_inflight_bytes)
            o->max_inflight_bytes = m;
#define LD(f) o->f += atomic_load_explicit(&s->f, memory_order_relaxed)
        LD(msgs_sent);
        LD(msgs_recv);
        LD(bytes_sent);
        LD(bytes_recv);
        LD(sends_posted);
        LD(writes_posted);
        LD(post_send_calls);
        LD(post_recv_calls);
        LD(signaled);
        LD(credit_stalls);
        LD(window_stalls);
        LD(credit_msgs);
        LD(engines);
        LD(recv_paused);
        LD(tcp_conns);
        LD(srq_credits);
        LD(srq_posted);
        LD(srq_refused);
        LD(rndv_prebound);
        LD(srq_draining);
        LD(rnr_errors);
        LD(retry_errors);
        LD(keepalive_fails);
        LD(keepalive_writes);
        LD(poll_recvs);
        LD(poll_recv_conns);
        LD(cq_polls);
        LD(cq_polls_empty);
        LD(cq_arms);
        LD(cq_events);
        LD(empty_turns);
        LD(tcp_fallbacks);
        LD(window_bytes);
        LD(window_cuts);
        LD(dest_bound_hits);
#undef LD
#define LL(f, g) o->f += atomic_load_explicit(&ctx->io[i].loop.g, memory_order_relaxed)
        LL(loop_waits, waits);
        LL(loop_sleeps, sleeps);
        LL(loop_wake_reads, wake_reads);
        LL(loop_wakes, wakes);
#undef LL
        bex__ctx_window_stats(s, o);
        o->thread_domains += ctx->io[i].td != NULL;
    }
}

int bex_sock_connect(bex_ctx *ctx, const bex_addr *addr, const bex_sock_ops *ops, void *user,
                     bex_sock **out)
{
    return bex_sock_connect_opts(ctx, addr, ops, user, NULL, out);
}

int bex_sock_connect_opts(bex_ctx *ctx, const bex_addr *addr, const bex_sock_ops *ops, void *user,
                          const bex_connect_opts *opts, bex_sock **out)
{
    if (!ctx || !addr || !out || !bex_addr_valid(addr) || bex_addr_port(addr) == 0)
        return -EINVAL;
    uint32_t mode = ctx->cfg.transport;
    if (opts) {
        if (opts->flags & ~(uint32_t)BEX_CONNECT_TRANSPORT)
            return -EINVAL;
        if (opts->flags & BEX_CONNECT_TRANSPORT) {
            if (opts->transport > BEX_TRANSPORT_TCP)
                return -EINVAL;
            mode = opts->transport;
        }
    }
    if (mode == BEX_TRANSPORT_RDMA && !ctx->dev)
        return -ENODEV;
    struct bex__io *io;
    int err = peer_home(ctx, addr, mode, &io);
    if (err)
        return err;
    struct bex_sock *s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->ctx = ctx;
    s->io = io;
    if (ops)
        s->ops = *ops;
    s->user = user;
    atomic_init(&s->user_pub, user);
    s->peer = *addr;
    s->mode = mode;
    atomic_init(&s->state, S_CONNECTING);
    atomic_init(&s->closing, false);
    atomic_init(&s->max_msg, bex__sock_peer_limit(0));
    *out = s;
    bex__io_push(io, &s->connect_cmd, CMD_CONNECT);
    return 0;
}

int bex__sock_buf_refused(bex_sock *s, void *buf, size_t len)
{
    if (len > INT32_MAX)
        return -EMSGSIZE;
    if (!buf)
        return bex__refuse(-EINVAL, "buffer NULL (%zu bytes)", len);
    bex_mem_pool *pool;
    const bex_mem_region *r = bex__mem_lookup(buf, &pool);
    if (!r)
        return bex__refuse(-EINVAL,
                           "buffer %p (%zu bytes): not memory bex allocated (bex_sock_alloc, "
                           "bex_sock_alloc_exposable or a received buffer)",
                           buf, len);
    if (!bex__sock_pool_ours(s, pool))
        return bex__refuse(-EINVAL,
                           "buffer %p (%zu bytes): bex memory, but not of this socket's "
                           "context (another context's, or a pool of the application's)",
                           buf, len);
    return bex__refuse(-EINVAL,
                       "buffer %p (%zu bytes): runs outside its allocation's registered "
                       "region",
                       buf, len);
}

/* A send the transport refused to take at once: through the command
 * queue, which hands it back outside bex_sock_send. */
static __attribute__((noinline, cold)) int submit_refused(struct bex__msg *m)
{
    struct sock_msg *w = bex__io_direct_refused(m);
    bex__io_push(w->s->io, &w->cmd, CMD_SEND);
    return 0;
}

/* A filled descriptor on its way from s's own I/O thread: at once to the
 * transport from a callback (bex__io_send_direct), else through the
 * command queue. The transport's send_now hands a refused message back,
 * so that nothing is kept across it and the frame saves no registers (one
 * call where the check, takes, and the send were two, issue 25 item 2).
 * Inline in bex_sock_send's copy of submit (one frame from the caller to
 * the transport: the socket's fields loaded once); submit_go_own for the
 * others. 0. */
static inline __attribute__((always_inline)) int go_own(bex_sock *s, struct sock_msg *w)
{
    if (__builtin_expect(!bex__io_direct_ok(s), 0)) {
        bex__io_push(s->io, &w->cmd, CMD_SEND);
        return 0;
    }
    struct bex__msg *back = bex__io_send_direct(s, w);
    if (__builtin_expect(back != NULL, 0))
        return submit_refused(back); /* (a tail call) */
    return 0;
}

static __attribute__((noinline)) int submit_go_own(bex_sock *s, struct sock_msg *w)
{
    return go_own(s, w);
}

/* submit_go_own from any thread: another one's send is a command. 0. */
static __attribute__((noinline)) int submit_go(bex_sock *s, struct sock_msg *w)
{
    if (bex__io_self != s->io) {
        bex__io_push(s->io, &w->cmd, CMD_SEND);
        return 0;
    }
    return submit_go_own(s, w); /* (a tail call) */
}

void bex__sock_msg_put_slow(struct sock_msg *w)
{
    if (w->gathered) {
        /* without on_send_done bex frees the buffers: the first one goes
         * with the report (bex__sock_report_done), the others here */
        for (uint8_t i = 1; !w->s->ops.on_send_done && i < w->m.nseg; i++)
            bex_mem_free(w->m.seg[i].buf);
        free(w); /* its struct sock_msgv */
        return;
    }
    free(w); /* the cache is full */
}

/* w as a fresh descriptor of buf: of its message the fields a transport
 * reads before it sets them, one by one, and of the rest those the path
 * reads (the command's are set by bex__io_push, free_next by the cache).
 * Not *w = (struct sock_msg){...}: that clears all 18 words with a
 * `rep stos` (some 28 instructions a send, issue 25 item 2) before the
 * fields are written again. Left to the transports (both set them
 * whichever way m goes, taken or queued, before anything reads them; the
 * socket's queue while no transport is chosen links by next itself,
 * io.c): next, st, state and status (TCP's tcp_msg_init, RDMA's
 * lone_send, send_queue_way and the refusal in bex__engine_send); the
 * RDMA engine's ack_seq (set with the slot's done, and at each post) and
 * last_wr (read only once off is past 0, which its post sets with it).
 * The rest (off, the rendezvous' fields, the destination's, nseg) are
 * read by the RDMA engine's lone way, which does not set them, or by a
 * message's abandonment in flight (issue 25 item 2: six stores a send
 * less); they lie together in struct bex__msg, cleared by one 16-byte
 * and two 8-byte stores (bex_sock_send's code, GCC 12) where seven of
 * four sizes were. seg is read only while nseg is
 * not 0 (a gathered message's, bex_sock_sendv's own): not set. */
_Static_assert(sizeof(struct bex__msg) == 104,
               "sock_msg_fill sets or leaves to the transports every field of struct bex__msg: "
               "place a new one");
_Static_assert(offsetof(struct bex__msg, nseg) + 1 - offsetof(struct bex__msg, off) == 32 &&
                   (offsetof(struct sock_msg, m) + offsetof(struct bex__msg, off)) % 16 == 0,
               "a fresh message's zero fields: 32 bytes together, 16-aligned in a descriptor");
static inline void sock_msg_fill(struct sock_msg *w, bex_sock *s, void *buf, size_t len,
                                 void *msg_user, uint32_t lkey, bool caller_owned)
{
    w->m.buf = buf;
    w->m.len = len;
    w->m.user = msg_user;
    w->m.lkey = lkey;
    w->m.off = 0;
    w->m.raddr = 0;
    w->m.rkey = 0;
    w->m.imm = 0;
    w->m.rndv_id = 0;
    w->m.direct = false;
    w->m.rndv_asked = false;
    w->m.peer_slot = false;
    w->m.nseg = 0;
    w->s = s;
    w->caller_owned = caller_owned;
    w->gathered = false;
}

/* w (from the cache, malloc or the caller) filled and on its way; own:
 * the caller is on s's I/O thread (the cache's descriptor: submit looked),
 * so submit_go_own, which does not look again (issue 25 item 2). */
static inline __attribute__((always_inline)) int
submit_fill(bex_sock *s, struct sock_msg *w, void *buf, size_t len, void *msg_user, uint32_t lkey,
            const bex_remote_buf *rb, bool caller_owned, bool own)
{
    sock_msg_fill(w, s, buf, len, msg_user, len ? lkey : 0, caller_owned);
    if (rb) {
        w->m.direct = true;
        w->m.raddr = rb->addr;
        w->m.rkey = rb->rkey;
        w->m.imm = rb->token;
    }
    if (own)
        return go_own(s, w);
    return submit_go(s, w);
}

/* submit's descriptor when its thread's cache has none (another thread
 * than the socket's, or the cache empty): malloc'd. */
static __attribute__((noinline)) int submit_new(bex_sock *s, void *buf, size_t len, void *msg_user,
                                                uint32_t lkey, const bex_remote_buf *rb)
{
    /* malloc, not calloc (nor malloc + memset, which compilers turn into
     * calloc): glibc's calloc skips the per-thread cache and takes the
     * arena lock, some 300 instructions more per message */
    struct sock_msg *w = malloc(sizeof(struct sock_msg));
    if (!w)
        return -ENOMEM;
    return submit_fill(s, w, buf, len, msg_user, lkey, rb, false, false);
}

/* Inline in each entry point: bex_sock_send's copy, the one callbacks
 * use, loses the branches of rb and req and the call. Every call it makes
 * is a tail call (the refusal, submit_new, submit_go), so that its common
 * path saves no registers (issue 25 item 2). The descriptor: the caller's
 * (req), or on the socket's own I/O thread (a callback sending) from that
 * thread's cache, which only it touches (descriptors come back there,
 * bex__sock_msg_put, on the same thread), else submit_new's. */
static inline __attribute__((always_inline)) int submit(bex_sock *s, void *buf, size_t len,
                                                        void *msg_user, const bex_remote_buf *rb,
                                                        bex_send_req *req)
{
    if (atomic_load(&s->closing) || atomic_load(&s->state) == S_FAILED)
        return -EPIPE;
    /* the one MR lookup of the send: its lkey goes with the message */
    uint32_t lkey = 0; /* (set when the check passes) */
    if (!bex__sock_buf_ok(s, buf, len, &lkey))
        return bex__sock_buf_refused(s, buf, len);
    if (rb && (rb->len != len || !(rb->token & BEX__IMM_DIRECT) || len == 0))
        return -EINVAL;
    /* the peer's limit, once known (sends queued before are checked by the
     * engine); a direct write goes to a buffer the peer sized itself */
    uint32_t peer_max = atomic_load_explicit(&s->max_msg, memory_order_relaxed);
    if (!rb && len > peer_max)
        return -EMSGSIZE;
    if (req)
        return submit_fill(s, (struct sock_msg *)(void *)req, buf, len, msg_user, lkey, rb, true,
                           false);
    /* the thread first: the cache is the I/O thread's alone (another
     * thread's read of msg_free races with its pushes) */
    struct bex__io *io = s->io;
    if (__builtin_expect(bex__io_self != io, 0))
        return submit_new(s, buf, len, msg_user, lkey, rb);
    struct sock_msg *w = io->msg_free;
    if (__builtin_expect(w == NULL, 0))
        return submit_new(s, buf, len, msg_user, lkey, rb);
    io->msg_free = w->free_next;
    io->n_msg_free--;
    return submit_fill(s, w, buf, len, msg_user, lkey, rb, false, true);
}

/* iov's buffers as seg[] (each checked as bex_sock_send checks its one),
 * their total in *total: 0, or bex_sock_sendv's errors. */
static int gather_check(bex_sock *s, const struct iovec *iov, unsigned iovcnt, struct bex__seg *seg,
                        size_t *total)
{
    if (!iov || iovcnt == 0)
        return -EINVAL;
    if (iovcnt > BEX_SOCK_IOV_MAX)
        return -E2BIG;
    *total = 0;
    for (unsigned i = 0; i < iovcnt; i++) {
        if (iov[i].iov_len == 0)
            return -EINVAL;
        int err = bex__sock_check_buf(s, iov[i].iov_base, iov[i].iov_len, &seg[i].lkey);
        if (err)
            return err;
        seg[i].buf = iov[i].iov_base;
        seg[i].len = (uint32_t)iov[i].iov_len;
        *total += iov[i].iov_len;
    }
    uint32_t peer_max = atomic_load_explicit(&s->max_msg, memory_order_relaxed);
    if (*total > INT32_MAX || *total > peer_max)
        return -EMSGSIZE;
    return 0;
}

_Static_assert(BEX_SOCK_IOV_MAX == BEX__SEG_MAX, "a gathered message's buffers");

int bex_sock_sendv(bex_sock *s, const struct iovec *iov, unsigned iovcnt, void *msg_user)
{
    if (!s)
        return -EINVAL;
    if (atomic_load(&s->closing) || atomic_load(&s->state) == S_FAILED)
        return -EPIPE;
    struct bex__seg seg[BEX__SEG_MAX];
    size_t total;
    int err = gather_check(s, iov, iovcnt, seg, &total);
    if (err)
        return err;
    struct sock_msgv *v = malloc(sizeof *v);
    if (!v)
        return -ENOMEM;
    memcpy(v->seg, seg, iovcnt * sizeof seg[0]);
    v->w = (struct sock_msg){.s = s,
                             .m = {.buf = seg[0].buf,
                                   .len = total,
                                   .user = msg_user,
                                   .lkey = seg[0].lkey,
                                   .nseg = (uint8_t)iovcnt,
                                   .seg = v->seg},
                             .gathered = true};
    if (bex__io_self != s->io || !bex__io_send_now(&v->w))
        bex__io_push(s->io, &v->w.cmd, CMD_SEND);
    return 0;
}

int bex_sock_send(bex_sock *s, void *buf, size_t len, void *msg_user)
{
    if (!s)
        return -EINVAL;
    return submit(s, buf, len, msg_user, NULL, NULL);
}

_Static_assert(sizeof(struct sock_msg) <= sizeof(bex_send_req) &&
                   _Alignof(struct sock_msg) <= _Alignof(bex_send_req),
               "bex_send_req holds a send descriptor");

int bex_sock_send_req(bex_sock *s, bex_send_req *req, void *buf, size_t len, void *msg_user)
{
    if (!s || !req)
        return -EINVAL;
    return submit(s, buf, len, msg_user, NULL, req);
}

int bex_sock_send_direct(bex_sock *s, void *buf, size_t len, const bex_remote_buf *rb,
                         void *msg_user)
{
    if (!s || !rb)
        return -EINVAL;
    return submit(s, buf, len, msg_user, rb, NULL);
}

void bex_sock_close(bex_sock *s)
{
    if (!s)
        return;
    /* the first call only: a second push of close_cmd while it is still
     * queued would loop the command stack */
    if (atomic_exchange(&s->closing, true))
        return;
    bex__io_push(s->io, &s->close_cmd, CMD_CLOSE);
}

int bex_sock_transport(const bex_sock *s)
{
    const struct conn *c = s ? s->conn : NULL;
    if (!c || !c->x || bex__conn_dead(c))
        return 0;
    /* not c->eng: after a fallback to TCP the engine may linger; not the
     * ops' name: a test's wrapper around the TCP transport (fakenet) has
     * its own, and TCP must not pass for RDMA under it */
    return bex__xport_is_tcp(c->x) ? BEX_TRANSPORT_TCP : BEX_TRANSPORT_RDMA;
}

void *bex_sock_user(const bex_sock *s)
{
    return atomic_load_explicit(&((bex_sock *)s)->user_pub, memory_order_acquire);
}

int bex_sock_set_user(bex_sock *s, const bex_sock_ops *ops, void *user)
{
    if (!s)
        return -EINVAL;
    if (bex__io_self == s->io) {
        /* a callback (on_accept, say) on the socket's thread: at once */
        if (ops)
            s->ops = *ops;
        s->user = user;
        atomic_store_explicit(&s->user_pub, user, memory_order_release);
        return 0;
    }
    struct set_user_cmd *u = malloc(sizeof(*u));
    if (!u)
        return -ENOMEM;
    *u = (struct set_user_cmd){.s = s, .has_ops = ops != NULL, .user = user};
    if (ops)
        u->ops = *ops;
    atomic_store_explicit(&s->user_pub, user, memory_order_release);
    bex__io_push(s->io, &u->cmd, CMD_SET_USER);
    return 0;
}

int bex_listen(bex_ctx *ctx, const bex_addr *addr, const bex_listener_ops *ops, void *user,
               bex_listener **out)
{
    if (!ctx || !addr || !out || !bex_addr_valid(addr))
        return -EINVAL;
    struct bex_listener *l = calloc(1, sizeof(*l));
    if (!l)
        return -ENOMEM;
    bex__list_init(&l->link);
    int err;
    l->fd = socket(addr->sa.sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (l->fd < 0) {
        err = -errno;
        goto err_free;
    }
    int one = 1;
    setsockopt(l->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    socklen_t sl = sizeof(l->addr);
    if (bind(l->fd, &addr->sa, bex_addr_len(addr)) || listen(l->fd, 128) ||
        getsockname(l->fd, &l->addr.sa, &sl)) {
        err = -errno;
        goto err_close;
    }
    l->tag.cb = bex__listener_on_event;
    l->ctx = ctx;
    if (ops)
        l->ops = *ops;
    l->user = user;
    l->fwd = calloc(ctx->n_io, sizeof(*l->fwd));
    if (!l->fwd) {
        err = -ENOMEM;
        goto err_close;
    }
    sem_init(&l->done, 0, 0);
    l->io = bex__io_ctx == ctx ? bex__io_self : &ctx->io[0];
    if (bex__io_ctx == ctx) {
        /* from a callback: waiting for ourselves would hang; the listener
         * is this thread's */
        bex__io_listen(bex__io_self, l);
    } else {
        bex__io_push(&ctx->io[0], &l->cmd, CMD_LISTEN);
        while (sem_wait(&l->done) && errno == EINTR)
            ;
    }
    *out = l;
    return 0;
err_close:
    close(l->fd);
err_free:
    free(l);
    return err;
}

void bex_listener_addr(const bex_listener *l, bex_addr *out)
{
    *out = l->addr;
}

int bex_listener_close(bex_listener *l)
{
    if (!l)
        return 0;
    if (bex__io_ctx == l->ctx)
        return -EDEADLK; /* it waits for the I/O thread */
    /* its thread lets go, then every other thread (do_unlisten) */
    bex__io_push(l->io, &l->cmd, CMD_UNLISTEN);
    for (uint32_t i = 0; i < l->ctx->n_io; i++)
        while (sem_wait(&l->done) && errno == EINTR)
            ;
    close(l->fd);
    sem_destroy(&l->done);
    free(l->fwd);
    free(l);
    return 0;
}
