/* SPDX-License-Identifier: Apache-2.0 */
/* conn: the I/O thread object. An I/O thread is the set of connections it
 * owns and what only they use: their loop (epoll, wake-up, command queue),
 * their CQs and completion channel, the engine table, the listeners it
 * accepts on, the setup table and the statistics. conn owns it because
 * every one of those is a connection's resource; the sock layer above
 * runs the thread's body (sock/io.c) and keeps its per-thread cache here.
 *
 * Nothing in it is shared with the context's other I/O threads: they meet
 * only in the command queues (any thread pushes) and in context-wide state
 * that is read-only once the context is up (struct bex__conn_env) or
 * atomic. */
#ifndef BEX_CONN_IO_H
#define BEX_CONN_IO_H

#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "bex/sock.h"
#include "common/list.h"
#include "common/util.h"
#include "common/timer.h"
#include "loop/loop.h"
#include "rdma/rdma.h"
#include "transport/rdma/engine.h"

struct conn;
struct bex__io;
struct bex_listener;
struct sock_msg;

/* Commands of the connection layer handed to an I/O thread
 * (bex__io_push); the owner's own commands start at BEX__CMD_OWNER. */
enum {
    CMD_STOP,
    CMD_LISTEN,
    CMD_UNLISTEN,
    CMD_UNLISTEN_FWD, /* a closing listener: forget it on this thread too */
    CMD_ADOPT,        /* an accepted connection handed to its I/O thread */
    BEX__CMD_OWNER
};

/* A connection accepted by a listener's thread for another (CMD_ADOPT). */
struct adopt_cmd {
    struct bex__cmd cmd;
    struct bex_listener *l;
    int fd;
    bex_addr peer;
};

/* The first CQ entries of an I/O thread; the CQ grows (ibv_resize_cq,
 * doubling up to the device's max_cqe) as engines are made, and once it
 * is at max_cqe the thread adds another CQ. */
#define BEX__CQ_INITIAL 1024
/* Tests only: when non-zero, the largest CQ made or grown (instead of the
 * device's max_cqe), so that a few connections need a second CQ. */
extern uint32_t bex__cq_max_test;

/* One of an I/O thread's CQs, and the entries its engines reserved. */
struct io_cq {
    struct ibv_cq *cq;
    uint32_t used, cap;
};

/* bex_ctx_config.io_threads at most. */
#define BEX__IO_THREADS_MAX 64

/* What the layer that owns the connections' streams (sock) does for them.
 * conn calls these and nothing of that layer's own: the owner keeps its
 * streams in the connection's stream table (bex__conn_stream_*). */
struct bex__conn_owner_ops {
    /* The upcalls every transport of a connection gets (x->user is the
     * struct conn); on_up and on_fail are conn's, which pass them on as up
     * and down below. */
    const struct bex__transport_upcalls *stream_upcalls;
    /* x, c's transport, is up (RDMA: the QP at RTS, the peer ready). c->x
     * may not be set yet: the peer's first frames can come over RDMA before
     * its readiness notice over TCP. */
    void (*up)(struct conn *c, struct bex__xport *x);
    /* c's transport is chosen (c->x is set): the streams waiting for it
     * attach. */
    void (*chosen)(struct conn *c);
    /* c is finished (its engine is dead or never was): every stream on it
     * learns err; connecting: c never came up. */
    void (*down)(struct conn *c, int err, bool connecting);
    /* How many of c's streams are open (for the lost-connection line). */
    uint32_t (*open_streams)(struct conn *c);
    /* The I/O thread's loop, on a turn when commands are queued
     * (bex__loop_cmds_queued): run the commands queued for the thread
     * (io->loop's queue, whose commands are the owner's); whether there
     * were any. */
    bool (*drain_cmds)(struct bex__io *io);
};

/* What every connection of a context reads and no connection writes:
 * filled once when the context is made (bex__conn_env_init), read-only
 * afterwards, so any I/O thread reads it without a lock. */
struct bex__conn_env {
    const bex_ctx_config *cfg;
    struct bex__rdma_dev *dev; /* NULL: no device, TCP only */
    const struct bex__engine_shared *sh;
    const struct bex__engine_config *ecfg;
    struct bex__log *log;
    bool has_secret;         /* setups are authenticated with auth_key */
    const uint8_t *auth_key; /* BEX__AUTH_KEY_LEN bytes */
    struct bex__io *io;      /* n_io of them */
    uint32_t n_io;
    _Atomic uint32_t next_io; /* round-robin (bex__io_next) */
    const struct bex__conn_owner_ops *ops;
    struct bex__transport_upcalls upcalls; /* ops' with conn's on_up, on_fail */
};

/* Fill env's upcalls from ops (the rest of env is the caller's). */
void bex__conn_env_init(struct bex__conn_env *env, const struct bex__conn_owner_ops *ops);

/* An I/O thread's life: NEW -> RUNNING (its thread made, bex_ctx_create)
 * -> STOPPING (its loop took CMD_STOP and ends) -> JOINED (the context
 * joined it). Only bex__io_move changes it, RUNNING and JOINED on the
 * context's thread, STOPPING on the I/O thread: hence atomic, each reads
 * the other's. Nothing a peer does moves it. */
enum bex__io_state { IO_NEW, IO_RUNNING, IO_STOPPING, IO_JOINED };

/* How the loop polls (bex__io.cq_way): no CQ (no device), one CQ and no
 * shared receive queue (the usual with a device), or every CQ and the
 * shared queue. */
enum bex__io_cq_way { IO_CQ_NONE, IO_CQ_ONE, IO_CQ_ALL };

/* One I/O thread of a context and everything only it touches. */
struct bex__io {
    bex_ctx *ctx; /* its owner's handle (opaque here) */
    struct bex__conn_env *env;
    uint32_t idx;
    struct bex__loop loop;
    struct bex__engine_shared sh; /* env->sh with this thread's CQ, stats and
                                     received-memory estimate */
    struct bex__stats stats;      /* this thread's; bex_ctx_stats sums them */
    struct ibv_comp_channel *ch;
    struct bex__rdma_td *td; /* thread + parent domain, where the device has them */
    struct ep_tag ch_tag;
    struct ep_tag async_tag; /* SRQ mode: the device's async event fd */
    pthread_t thread;
    _Atomic int state;      /* enum bex__io_state: bex__io_move */
    struct bex__list conns; /* struct conn.link, newest first */
    struct bex__list ready; /* connections with work (struct conn.ready_link: bex__conn_ready) */
    bool reap;              /* a connection died or lost a socket: bex__conn_reap looks */
    /* reap, or SRQ mode (bex__io_srq_timer's look): a turn's one test for
     * both (conn/thread.c turn_chores; set with reap: bex__io_reap_due) */
    bool chores;
    /* its timers (common/timer.h, in bex__now_us() time): connections'
     * setup deadlines, ticks (keepalive, stalls) and transports' due_us,
     * listeners' backoff, its own housekeeping; the loop sleeps until the
     * nearest (conn/timers.c) */
    struct bex__timers timers;
    uint64_t now_us; /* the clock of the timers running now */
    /* the nearest deadline at the last sleep that read the clock
     * (conn/thread.c sleep_timeout: the same one twice arms the loop's
     * timer) */
    uint64_t sleep_due;
    uint32_t tick_ms; /* a connection with work held back: its tick period */
    /* connections' ticks, one timer for each period's round: [0] idle
     * (keepalive period), [1] work held back (tick_ms) (conn/timers.c) */
    struct bex__tick_round {
        struct bex__timer tm;
        struct bex__list conns; /* struct conn.tick_link */
        uint64_t period_us;
        struct bex__io *io;
    } rounds[2];
    struct bex__timer house;       /* collecting heaps (several threads), at least once a second */
    struct bex__timer srq_tm;      /* SRQ mode: QPs draining (bex__srq_reap) */
    _Atomic uint64_t visits;       /* transport progress calls (single writer; tests read) */
    _Atomic uint64_t turns;        /* loop turns (the same) */
    _Atomic uint64_t tick_calls;   /* transport ticks (conn/timers.c; the same) */
    _Atomic uint64_t reap_visits;  /* connections the reaper looked at (the same) */
    _Atomic uint64_t direct_sends; /* sends taken at once on this thread: bex__io_send_direct's,
                                      from bex__io_send_now and the socket's own send (the same) */
    uint64_t poll_no;              /* poll turns with CQs (conn/thread.c) */
    bool draining;                 /* the owner is running commands it took */
    /* spinning (conn/thread.c spin_look): connections of this thread in
     * set-up (struct conn.coming) plus those over TCP (the count of both
     * is all the spinning asks: one load a turn, where it read the set-up's
     * and stats.tcp_conns), the coarse clock this turn read (run_timers)
     * and the one of the last look at the epoll set, and the turns since a
     * look */
    uint32_t n_watch;
    uint32_t spins;
    uint64_t turn_ms, looked_ms;
    /* turns that found the nearest deadline within the coarse clock's lag
     * (run_timers: the precise clock on every 16th of them) */
    uint32_t near_turns;
    struct bex__list listeners; /* struct bex_listener.link */
    struct conn **engines;      /* by engine id (bex__conn_by_engine) */
    uint32_t next_engine_seq;
    struct io_cq *cqs; /* with a device: at least one; sh.cq is cqs[0].cq */
    uint32_t n_cq;
    /* bex__io_cq_way_of(this), kept (bex__io_cq_way_sync) where n_cq or
     * the shared receive queue change after the thread starts, and at its
     * start: one load and test where the loop tested n_cq and the queue
     * (conn/thread.c, twice a round trip in event mode; issue 25 item 2) */
    uint8_t cq_way;
    /* every CQ (and the SRQ's) armed for an event since the last event was
     * read (thread.c; a CQ added or grown clears it), and whether the last
     * poll ran armed and took each CQ to empty: then sleeping needs no
     * further poll, a completion since wakes the thread */
    bool cq_armed, cq_quiet;
    /* completion events read and not yet acknowledged, all of ev_cq's:
     * acknowledged in batches (ibv_ack_cq_events takes a mutex and signals
     * a condition each call, some 95 instructions a round trip), and every
     * one before a CQ is destroyed (bex__io_ack_cq_events), which waits for
     * them */
    struct ibv_cq *ev_cq;
    uint32_t ev_unacked;
    uint32_t n_setup; /* accepted connections in setup here (setup_max) */
    uint64_t n_setup_evictions;
    uint64_t setup_evicted_ms; /* the last one: a flood is logged once */
    struct bex__cmd stop_cmd;
    /* the owner's (sock's) cache of send descriptors; conn never looks */
    struct sock_msg *msg_free;
    uint32_t n_msg_free;
};

static inline void bex__io_push(struct bex__io *io, struct bex__cmd *c, int type)
{
    bex__loop_push(&io->loop, c, type);
}

/* The I/O thread running on this thread, and its owner's context (NULL on
 * any other thread). initial-exec, as the allocator's (src/mem/heap.c): a
 * global-dynamic access from libbex.so costs a __tls_get_addr call, some
 * 20 instructions of a sub-request's on the send path (issue 25 item 5). */
#define BEX__IO_TLS _Thread_local __attribute__((tls_model("initial-exec")))
extern BEX__IO_TLS bex_ctx *bex__io_ctx;
extern BEX__IO_TLS struct bex__io *bex__io_self;

/* The I/O thread's body (pthread_create's start routine; arg is the struct
 * bex__io): its loop until CMD_STOP moves it to STOPPING. */
void *bex__io_main(void *arg);
/* The one place io's state changes: names the move in the debug log and
 * asserts it is NEW -> RUNNING -> STOPPING -> JOINED (every move is our
 * own code's). */
void bex__io_move(struct bex__io *io, enum bex__io_state to);
const char *bex__io_state_name(int s);
static inline enum bex__io_cq_way bex__io_cq_way_of(const struct bex__io *io)
{
    if (io->n_cq == 1 && !io->sh.srq)
        return IO_CQ_ONE;
    return io->n_cq ? IO_CQ_ALL : IO_CQ_NONE;
}
static inline void bex__io_cq_way_sync(struct bex__io *io)
{
    io->cq_way = (uint8_t)bex__io_cq_way_of(io);
}
static inline enum bex__io_state bex__io_state(struct bex__io *io)
{
    return (enum bex__io_state)atomic_load_explicit(&io->state, memory_order_acquire);
}
/* Set the watchers of the thread's own descriptors (completion channel,
 * async events). */
void bex__io_tags_init(struct bex__io *io);
/* Acknowledge the completion events read and not yet acknowledged: before
 * any of the thread's CQs is destroyed (ibv_destroy_cq waits for them). */
void bex__io_ack_cq_events(struct bex__io *io);

/* The next I/O thread in round-robin order. */
struct bex__io *bex__io_next(struct bex__conn_env *env);

#endif
