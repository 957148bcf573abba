/* SPDX-License-Identifier: Apache-2.0 */
/* The connection table: connections by engine id, client connections by
 * the listener address, accepting, the setup table, deadlines, teardown. */
#include <arpa/inet.h>
#include <assert.h>
#include <errno.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "conn/conn.h"
#include "transport/rdma/srq.h"
#include "transport/tcp/tcp.h"

#define ACCEPT_BATCH 16 /* connections accepted per listener event */

int bex__conn_stream_add(struct conn *c, uint32_t id, struct bex__stream *st)
{
    return bex__hmap_put(&c->streams, id, st);
}

const char *bex__conn_life_name(enum bex__conn_life life)
{
    static const char *const names[] = {
        [CONN_LIVE] = "LIVE", [CONN_SETUP] = "SETUP", [CONN_DEAD] = "DEAD"};
    return (unsigned)life < ARRAY_SIZE(names) ? names[life] : "?";
}

/* The one place c's life changes: SETUP -> LIVE, SETUP or LIVE -> DEAD
 * (the reaper frees a dead one once it has no socket left). Leaving SETUP
 * gives its place in the setup table back. */
static void conn_move(struct conn *c, enum bex__conn_life to)
{
    enum bex__conn_life from = c->life;
    assert(((from == CONN_SETUP && to == CONN_LIVE) || (from != CONN_DEAD && to == CONN_DEAD)) &&
           "a connection dies once");
    if (c->io->env->log->level >= BEX_LOG_DEBUG) {
        char name[32];
        bex__log(c->io->env->log, BEX_LOG_DEBUG, "%s (engine %u): %s -> %s in phase %s",
                 bex__conn_name(c, name), c->eng_id, bex__conn_life_name(from),
                 bex__conn_life_name(to), bex__conn_phase_name(c->phase));
    }
    if (from == CONN_SETUP)
        c->io->n_setup--;
    c->life = to;
    if (to == CONN_DEAD)
        bex__io_reap_due(c->io);
}

static void conn_die(struct conn *c)
{
    conn_move(c, CONN_DEAD);
}

void bex__conn_stream_del(struct conn *c, uint32_t id)
{
    if (c->last_id == id)
        c->last_st = NULL;
    if (bex__hmap_del(&c->streams, id))
        bex__io_reap_due(c->io); /* a dead connection may have lost its last */
}

void bex__io_lists_init(struct bex__io *io)
{
    bex__list_init(&io->conns);
    bex__list_init(&io->ready);
    bex__list_init(&io->listeners);
}

/* An accepted connection leaves the setup table (bex_ctx_config.setup_max):
 * its hello finished, or it failed. */
void bex__conn_setup_end(struct conn *c)
{
    if (c->life == CONN_SETUP)
        conn_move(c, CONN_LIVE);
}

/* A connection holds nothing but its descriptor and this struct until its
 * engine is made (bex__conn_engine_make): CQ entries are reserved then. */
static int conn_new(struct bex__io *io, int fd, bool client, struct conn **out)
{
    struct bex__conn_env *ctx = io->env;
    uint32_t id = 0;
    for (uint32_t tries = 0;; tries++) {
        if (tries == ENGINE_TABLE)
            return -ENOSPC; /* every slot of the table is taken */
        uint32_t seq = ++io->next_engine_seq;
        if (seq == 0 || seq > (UINT32_MAX - io->idx) / ctx->n_io) {
            io->next_engine_seq = 0; /* wrapped: ids start over (never 0) */
            continue;
        }
        id = seq * ctx->n_io + io->idx;
        if (!io->engines[bex__conn_engine_slot(io, id)])
            break;
    }
    struct conn *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->tag.cb = bex__conn_on_event;
    c->tag.cq_first = true;
    c->ctx = io->ctx;
    c->io = io;
    c->fd = fd;
    c->client = client;
    c->eng_id = id;
    c->mode = ctx->cfg->transport;
    c->rdma_ok = c->mode != BEX_TRANSPORT_TCP && ctx->dev;
    c->next_stream = 1;
    c->coming = true;
    io->n_watch++;
    bex__conn_timers_start(c);
    io->engines[bex__conn_engine_slot(io, id)] = c;
    bex__list_init(&c->ready_link);
    bex__list_push_head(&io->conns, &c->link);
    *out = c;
    return 0;
}

void bex__conn_free(struct conn *c)
{
    struct bex__io *io = c->io;
    bex__list_remove(&c->link);
    bex__list_remove(&c->ready_link);
    io->engines[bex__conn_engine_slot(io, c->eng_id)] = NULL;
    bex__conn_timers_stop(c);
    bex__conn_setup_end(c);
    bex__conn_came(c);
    if (c->fd >= 0) {
        bex__loop_unwatch(&io->loop, c->fd);
        close(c->fd);
    }
    if (c->x) {
        uint32_t qpn = c->eng ? bex__engine_qpn(c->eng) : 0;
        c->x->ops->destroy(c->x);
        if (c->eng) { /* the engine was the transport */
            c->eng = NULL;
            /* a QP draining on the shared receive queue may still flush
             * sends into the CQ: its room goes back when the QP goes */
            if (!io->sh.srq || !bex__srq_hold_cq(io->sh.srq, qpn, c->cq_idx, c->cqe_reserved))
                io->cqs[c->cq_idx].used -= c->cqe_reserved;
        } else {
            BEX__STAT_ADD(&io->stats, tcp_conns, (uint64_t)-1);
            io->n_watch--; /* (setup.c go_tcp counted it) */
        }
        BEX__STAT_ADD(&io->stats, engines, (uint64_t)-1);
    }
    bex__conn_engine_drop(c); /* made for a setup that never chose */
    bex__hmap_free(&c->streams);
    free(c);
}

/* The connection is finished: its engine is dead or never was. Every socket
 * on it learns the error; the engine already handed their messages back. */
void bex__conn_finish(struct conn *c, int err)
{
    if (bex__conn_dead(c))
        return;
    conn_die(c); /* from SETUP too: its place in the setup table is free at once */
    bex__conn_came(c);
    if (c->fd >= 0) {
        /* the TCP side has nothing more to say; level-triggered events of a
         * failed socket would otherwise come back every loop */
        bex__loop_unwatch(&c->io->loop, c->fd);
        close(c->fd);
        c->fd = -1;
    }
    c->io->env->ops->down(c, err, c->phase != P_UP);
}

/* Fail a connection. Engine failure is synchronous: its on_fail finishes
 * the connection before this returns. */
void bex__conn_fail(struct conn *c, int err)
{
    if (bex__conn_dead(c))
        return;
    if (c->x && !c->x->ops->is_dead(c->x))
        c->x->ops->fail(c->x, err); /* on_fail -> bex__conn_finish */
    else
        bex__conn_finish(c, err);
}

/* "peer a.b.c.d:port", for log lines (buf: 32 bytes). */
const char *bex__conn_name(const struct conn *c, char *buf)
{
    char a[BEX_ADDR_STRLEN];
    snprintf(buf, BEX__CONN_NAME_LEN, "peer %s", bex_addr_format(&c->key, true, a, sizeof a));
    return buf;
}

uint32_t bex__cq_max_test;

/* The send bound's key of a peer (transport/window.h): its IPv4 address,
 * or for IPv6 a 32-bit FNV-1a hash of its address (two that collide share
 * one bound: tighter, never looser). */
static uint32_t dest_key(const bex_addr *a)
{
    if (a->sa.sa_family != AF_INET6)
        return a->in4.sin_addr.s_addr;
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < 16; i++)
        h = (h ^ a->in6.sin6_addr.s6_addr[i]) * 16777619u;
    return h;
}

/* A CQ of the thread with room for need more entries (its index in
 * io->cqs): one that has it, else one grown to have it (doubling, with
 * ibv_resize_cq, up to the device's max_cqe), else a new one. So the
 * number of connections is capped by neither the first CQ's size nor the
 * largest CQ the device makes. */
static int cq_room(struct bex__io *io, uint32_t need, uint32_t *idx)
{
    struct bex__conn_env *ctx = io->env;
    uint32_t max = (uint32_t)ctx->dev->attr.max_cqe;
    if (bex__cq_max_test && bex__cq_max_test < max)
        max = bex__cq_max_test;
    for (uint32_t i = 0; i < io->n_cq; i++) {
        struct io_cq *q = &io->cqs[i];
        if (q->used + need <= q->cap) {
            *idx = i;
            return 0;
        }
    }
    for (uint32_t i = 0; i < io->n_cq; i++) {
        struct io_cq *q = &io->cqs[i];
        if (q->used + need > max || q->cap >= max)
            continue;
        uint32_t want = q->cap;
        while (want < q->used + need)
            want = want > max / 2 ? max : want * 2;
        int err = bex__rdma_cq_resize(q->cq, (int)want);
        if (err) {
            bex__log(ctx->log, BEX_LOG_WARN,
                     "I/O thread %u: ibv_resize_cq from %u to %u entries: %s; adding a CQ", io->idx,
                     q->cap, want, bex_strerror(err));
            break;
        }
        bex__log(ctx->log, BEX_LOG_DEBUG, "I/O thread %u: CQ %u grown from %u to %u entries",
                 io->idx, i, q->cap, want);
        q->cap = want;
        io->cq_armed = false; /* armed again before the thread sleeps */
        *idx = i;
        return 0;
    }
    /* every CQ is at its largest: one more, polled beside the others */
    if (need > max)
        return -ENOSPC;
    uint32_t cqe = BEX__CQ_INITIAL < max ? BEX__CQ_INITIAL : max;
    if (cqe < need)
        cqe = need;
    struct io_cq *cqs = realloc(io->cqs, (io->n_cq + 1) * sizeof(*cqs));
    if (!cqs)
        return -ENOMEM;
    io->cqs = cqs;
    struct ibv_cq *cq;
    int err = bex__rdma_cq_create(ctx->dev, (int)cqe, io->ch, &cq);
    if (err) {
        bex__log(ctx->log, BEX_LOG_WARN,
                 "no room for another engine: I/O thread %u has %u full CQs, another: %s", io->idx,
                 io->n_cq, bex_strerror(err));
        return err;
    }
    bex__log(ctx->log, BEX_LOG_DEBUG, "I/O thread %u: CQ %u added (%u entries)", io->idx, io->n_cq,
             cqe);
    io->cqs[io->n_cq] = (struct io_cq){.cq = cq, .cap = cqe};
    io->cq_armed = false; /* armed before the thread sleeps */
    *idx = io->n_cq++;
    bex__io_cq_way_sync(io);
    return 0;
}

int bex__conn_engine_make(struct conn *c)
{
    struct bex__conn_env *ctx = c->io->env;
    struct bex__io *io = c->io;
    /* every completion the engine can have outstanding must fit its CQ
     * (in SRQ mode its receives complete on the shared queue's CQ) */
    uint32_t rq = ctx->ecfg->rq_depth;
    uint32_t need = ctx->ecfg->sq_depth +
                    (io->sh.srq ? 0 : rq + bex__engine_rq_spare(&io->sh, rq)) + 2,
             idx;
    int err = cq_room(io, need, &idx);
    if (err)
        return err;
    /* the engine takes its CQ from sh when it creates its QP, and only then */
    io->sh.cq = io->cqs[idx].cq;
    err = bex__engine_create(&io->sh, ctx->ecfg, &io->env->upcalls, c->eng_id, c, &c->eng);
    io->sh.cq = io->cqs[0].cq;
    if (!err) { /* c->x once the setup chose RDMA (the owner's chosen) */
        char name[BEX__CONN_NAME_LEN];
        bex__engine_set_name(c->eng, bex__conn_name(c, name));
        bex__engine_set_dest(c->eng, dest_key(&c->key));
        io->cqs[idx].used += need;
        c->cqe_reserved = need;
        c->cq_idx = idx;
        BEX__STAT_ADD(&io->stats, engines, 1);
    }
    return err;
}

void bex__conn_engine_drop(struct conn *c)
{
    if (!c->eng || (c->x && !bex__xport_is_tcp(c->x)))
        return; /* none, or it is the transport (destroyed with it) */
    bex__engine_destroy(c->eng);
    c->eng = NULL;
    c->io->cqs[c->cq_idx].used -= c->cqe_reserved;
    c->cqe_reserved = 0;
    BEX__STAT_ADD(&c->io->stats, engines, (uint64_t)-1);
}

int bex__conn_start_client(struct bex__io *io, const bex_addr *to, uint32_t mode, struct conn **out)
{
    struct bex__conn_env *ctx = io->env;
    int fd = socket(to->sa.sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    bex_addr me = ctx->cfg->local_addr;
    bex_addr_set_port(&me, 0);
    int err = 0;
    /* from local_addr when it is of the peer's family (a context of one
     * family may still reach a peer of the other over TCP) */
    if (me.sa.sa_family == to->sa.sa_family && bind(fd, &me.sa, bex_addr_len(&me))) {
        err = -errno;
        close(fd);
        return err;
    }
    struct conn *c;
    if ((err = conn_new(io, fd, true, &c))) {
        close(fd);
        return err;
    }
    c->key = *to; /* phase: P_CONNECTING, as made */
    c->mode = mode;
    c->rdma_ok = mode != BEX_TRANSPORT_TCP && ctx->dev;
    /* the engine exists before the hello, which names its QP; sockets
     * wait for the transport's choice (the owner's chosen); and it is
     * made before connect, so that our first setup message follows the
     * handshake at once: a listener under a flood closes first the
     * connections that have said nothing (setup_max) */
    if (c->rdma_ok && (err = bex__conn_engine_make(c))) {
        if (mode == BEX_TRANSPORT_RDMA) {
            conn_die(c);
            return err;
        }
        c->rdma_ok = false; /* no QP for it: a NO_RDMA hello, TCP */
    }
    if (connect(fd, (const struct sockaddr *)to, sizeof(*to)) && errno != EINPROGRESS) {
        err = -errno;
        conn_die(c);
        return err;
    }
    if ((err = bex__loop_watch(&io->loop, fd, EPOLLOUT | EPOLLIN | EPOLLRDHUP, &c->tag))) {
        conn_die(c);
        return err;
    }
    *out = c;
    return 0;
}

/* Close an accepted connection in setup to make room: the oldest that has
 * said nothing yet (no byte read, none waiting: idle, or closed with its EOF
 * not yet read), else the one whose next message is overdue the most (since
 * our last answer to it). A legitimate client sends its first message at
 * once and answers each of ours at once: a burst of connections that say
 * nothing or close at once cannot push it out, and ones that stop half way
 * give way before it (docs/configuration.md, setup_max). One recv(MSG_PEEK)
 * per eviction, plus one per quiet-looking connection found talking (once:
 * it is marked). Returns whether there was one. */
static bool setup_evict_oldest(struct bex__io *io)
{
    enum bex__conn_phase first = io->env->has_secret ? P_WAIT_OPEN : P_WAIT_HELLO;
    for (;;) {
        struct conn *old = NULL;
        bool old_quiet = false;
        struct bex__list *n;
        bex__list_foreach(n, &io->conns)
        { /* newest first */
            struct conn *c = bex__conn_of(n);
            if (c->life != CONN_SETUP || c->fd < 0)
                continue;
            bool quiet = c->phase == first && !c->rlen && !c->heard;
            if (!old || (quiet && !old_quiet) ||
                (quiet == old_quiet && c->waiting_since <= old->waiting_since)) {
                old = c;
                old_quiet = quiet;
            }
        }
        if (!old)
            return false;
        char b;
        if (old_quiet && recv(old->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) > 0) {
            old->heard = true; /* its first bytes wait to be read: under way */
            continue;
        }
        bex__conn_fail(old, -ECONNABORTED);
        return true;
    }
}

/* accept4 failed for want of descriptors or memory: the backlog stays
 * readable, and a level-triggered listener would wake the I/O thread at
 * once, forever. Leave epoll for a while (doubling up to 500 ms); a timer
 * brings the listener back (bex__listener_pause_timer). */
static void listener_pause(struct bex__io *io, struct bex_listener *l, int err)
{
    if (!l->backoff_ms)
        bex__log(io->env->log, BEX_LOG_WARN,
                 "listener on port %u: accept: %s; retrying with backoff", bex_addr_port(&l->addr),
                 strerror(err));
    l->backoff_ms = l->backoff_ms ? (l->backoff_ms * 2 > 500 ? 500 : l->backoff_ms * 2) : 20;
    bex__loop_unwatch(&io->loop, l->fd);
    l->paused = true;
    bex__listener_pause_timer(l, l->backoff_ms);
}

/* The backoff is over: the listener goes back into epoll. */
void bex__listener_resume(struct bex_listener *l)
{
    l->paused = false;
    int err = bex__loop_watch(&l->io->loop, l->fd, EPOLLIN, &l->tag);
    if (err)
        listener_pause(l->io, l, -err);
}

void bex__listener_accept(struct bex__io *io, struct bex_listener *l)
{
    bool evicted = false;
    /* a bounded batch: a flood that refills the backlog as fast as we
     * accept must not keep the I/O thread from its engines (keepalive,
     * completions); the level-triggered listener brings us back */
    for (int k = 0; k < ACCEPT_BATCH; k++) {
        bex_addr peer = {0};
        socklen_t pl = sizeof(peer);
        int fd = accept4(l->fd, &peer.sa, &pl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            int err = errno;
            if (err != EMFILE && err != ENFILE && err != ENOBUFS && err != ENOMEM)
                return; /* EAGAIN: the backlog is empty; or an aborted connection */
            /* a descriptor held by a connection that never finished its
             * hello is the one to give up first (this thread's: the others'
             * are theirs to touch) */
            if (!evicted && setup_evict_oldest(io)) {
                evicted = true;
                continue;
            }
            listener_pause(io, l, err);
            return;
        }
        l->backoff_ms = 0;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        struct bex__io *to = bex__io_next(io->env);
        if (to == io) {
            bex__conn_adopt(io, l, fd, &peer);
            continue;
        }
        struct adopt_cmd *a = malloc(sizeof(*a));
        if (!a) {
            close(fd);
            continue;
        }
        *a = (struct adopt_cmd){.l = l, .fd = fd, .peer = peer};
        bex__io_push(to, &a->cmd, CMD_ADOPT);
    }
}

/* The setup table is per thread: each holds at most its share of
 * setup_max (rounded up), and a newcomer makes room among its thread's. */
void bex__conn_adopt(struct bex__io *io, struct bex_listener *l, int fd, const bex_addr *peer)
{
    struct bex__conn_env *ctx = io->env;
    /* Setup costs no CQ entries or QP, but it is bounded: an idle or
     * slow connection gives its place to the newcomer, so connections
     * held open without a hello cannot lock out the ones that talk. */
    uint32_t max = (ctx->cfg->setup_max + ctx->n_io - 1) / ctx->n_io;
    if (io->n_setup >= max) {
        /* once per flood: the first eviction after 10 s without one */
        uint64_t now = bex__now_ms();
        if (io->n_setup_evictions++ == 0 || now - io->setup_evicted_ms > 10000)
            bex__log(ctx->log, BEX_LOG_WARN,
                     "%u connections in setup (setup_max): closing the oldest silent one "
                     "for each new one (logged once per flood)",
                     io->n_setup * ctx->n_io);
        io->setup_evicted_ms = now;
        setup_evict_oldest(io);
    }
    struct conn *c;
    if (conn_new(io, fd, false, &c)) {
        close(fd);
        return;
    }
    c->life = CONN_SETUP; /* an accepted connection's first life: counted from here */
    io->n_setup++;
    c->l = l;
    if (bex_addr_valid(peer))
        c->key = *peer;
    bex__conn_expect(c, ctx->has_secret ? P_WAIT_OPEN : P_WAIT_HELLO);
    if (bex__loop_watch(&io->loop, fd, EPOLLIN | EPOLLRDHUP, &c->tag))
        conn_die(c);
}

/* Free the dead connections without sockets, and fail the accepted ones
 * whose listener closed once they have none (a peer's next socket to that
 * address then makes a new connection). Only when one may have
 * become so (io->reap): a walk over every connection on every loop turn
 * cost a busy thread with many idle connections more than its work. */
void bex__conn_reap(struct bex__io *io)
{
    if (!io->reap)
        return;
    io->reap = false;
    struct bex__list *n, *tmp;
    bex__list_foreach_safe(n, tmp, &io->conns)
    {
        struct conn *c = bex__conn_of(n);
        BEX__STAT_ADD(io, reap_visits, 1);
        if (bex__conn_dead(c) && bex__conn_nstreams(c) == 0)
            bex__conn_free(c);
        else if (!bex__conn_dead(c) && !c->client && !c->l && bex__conn_nstreams(c) == 0)
            bex__conn_fail(c, -ECONNABORTED); /* its listener closed, its last socket gone */
    }
}

void bex__listener_on_event(struct ep_tag *t, uint32_t events)
{
    (void)events;
    struct bex_listener *l = bex__container_of(t, struct bex_listener, tag);
    bex__listener_accept(l->io, l);
}

void bex__conn_on_event(struct ep_tag *t, uint32_t events)
{
    struct conn *c = bex__container_of(t, struct conn, tag);
    if (bex__conn_step(c, events)) {
        bex__conn_ready(c);
        return;
    }
    /* The TCP transport's events ended in a progress call with nothing
     * more to move: a mark the sends of its callbacks left (an answer
     * sent from on_recv) is spent, not a second call a message. That call
     * may have held acknowledgements until x->due_us. */
    bex__list_remove(&c->ready_link);
    bex__conn_due_sync(c);
}

struct bex__io *bex__io_next(struct bex__conn_env *env)
{
    uint32_t i = atomic_fetch_add_explicit(&env->next_io, 1, memory_order_relaxed);
    return &env->io[i % env->n_io];
}

static void conn_on_up(struct bex__xport *x)
{
    struct conn *c = x->user;
    c->io->env->ops->up(c, x);
}

static void conn_on_fail(struct bex__xport *x, int err)
{
    struct conn *c = x->user;
    if (bex__tcp_link_lost(x)) /* over RDMA the setup's descriptor tells (bex__conn_step) */
        bex__conn_lost(c, err);
    bex__conn_finish(c, err);
}

void bex__conn_env_init(struct bex__conn_env *env, const struct bex__conn_owner_ops *ops)
{
    env->ops = ops;
    env->upcalls = *ops->stream_upcalls;
    env->upcalls.on_up = conn_on_up;
    env->upcalls.on_fail = conn_on_fail;
}
