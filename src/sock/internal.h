/* sock: contexts, the public socket API, the I/O thread's body, socket
 * lifecycle and exposed buffers. Connections (setup, table) are in conn/,
 * the loop's mechanics in loop/, the RDMA engine in transport/rdma/. */
#ifndef BEX_SOCK_INTERNAL_H
#define BEX_SOCK_INTERNAL_H

#include <netinet/in.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "bex/sock.h"
#include "common/util.h"
#include "conn/conn.h"
#include "loop/loop.h"
#include "rdma/rdma.h"
#include "transport/rdma/engine.h"

/* Commands handed from any thread to the I/O thread (bex__loop_push). */
enum {
    CMD_SEND,
    CMD_CONNECT,
    CMD_CLOSE,
    CMD_LISTEN,
    CMD_UNLISTEN,
    CMD_STOP,
    CMD_SET_USER,
    CMD_BIND,
    CMD_ADOPT,       /* an accepted connection handed to its I/O thread */
    CMD_UNLISTEN_FWD /* a closing listener: forget it on this thread too */
};

/* What an epoll event of the I/O thread belongs to (struct ep_tag). */
enum { EV_CHANNEL = 1, EV_LISTENER, EV_CONN, EV_ASYNC };

/* A message on its way: the command, the engine's descriptor, its socket.
 * It lives in a caller's bex_send_req (caller_owned), or comes from malloc
 * or its I/O thread's cache (struct bex__io's msg_free) and goes back there
 * when done (bex__sock_msg_put). */
struct sock_msg {
    struct bex__cmd cmd;
    struct bex__msg m;
    struct bex_sock *s;
    struct sock_msg *free_next; /* in the cache */
    bool caller_owned;
};
/* Descriptors an I/O thread keeps for reuse, at most. */
#define BEX__MSG_CACHE_MAX 256

/* bex_sock_set_user from a thread other than the I/O thread: applied there,
 * in order with that thread's other commands. */
struct set_user_cmd {
    struct bex__cmd cmd;
    struct bex_sock *s;
    bex_sock_ops ops;
    bool has_ops;
    void *user;
};

/* Buffers exposed for direct writes, context-wide so that any thread can
 * claim one: state goes FREE -> CLAIMED (the claiming thread fills it) ->
 * ARMED (release; the I/O thread may deliver it) -> FREE. The state word
 * also holds the slot's generation (bits 16-30), bumped at each claim: the
 * compare-and-swap that takes an ARMED slot back to FREE (delivery or
 * cancel, whichever thread does it) then cannot take a later arming. */
enum { X_FREE, X_CLAIMED, X_ARMED };
#define X_KIND(v)    ((v)&0xffffu)
#define X_GEN(v)     ((v) >> 16)
#define X_WORD(g, k) (((uint32_t)(g) << 16) | (k))
#define EXPOSED_MAX  1024
struct exp_slot {
    _Atomic uint32_t state;
    uint32_t eng_id;
    uint32_t len;
    void *buf, *user;
    struct bex_sock *s; /* NULL once the socket is gone */
    /* window mode: a window of its own per exposure (set by the claiming
     * thread), bound by the I/O thread on the engine's QP */
    struct ibv_mw *mw;
    uint32_t key;
    bool bound; /* I/O thread only */
};

/* A connection accepted by a listener's thread for another (CMD_ADOPT). */
struct adopt_cmd {
    struct bex__cmd cmd;
    struct bex_listener *l;
    int fd;
    struct sockaddr_in peer;
};

/* Window mode: bind an exposed slot's window (CMD_BIND). */
struct bind_cmd {
    struct bex__cmd cmd;
    uint32_t slot;
    uint16_t gen;
};

/* Socket states (docs/architecture.md); the I/O thread alone writes them.
 * Whether the application closed the socket is a separate flag, written
 * once by bex_sock_close, so that neither can overwrite the other. */
enum { S_CONNECTING, S_OPEN, S_FAILED };

struct bex_sock {
    struct bex__cmd connect_cmd, close_cmd;
    bex_ctx *ctx;
    struct bex__io *io; /* its connection's I/O thread, fixed at creation */
    struct conn *conn;
    struct bex__stream st;
    bex_sock_ops ops;         /* I/O thread only (see bex_sock_set_user) */
    void *user;               /* I/O thread only */
    _Atomic(void *) user_pub; /* what bex_sock_user returns, any thread */
    struct sockaddr_in peer;
    uint32_t mode; /* client: BEX_TRANSPORT_* of its connection */
    _Atomic int state;
    _Atomic bool closing;     /* bex_sock_close was called */
    _Atomic uint32_t eng_id;  /* 0 until attached to an engine */
    _Atomic uint32_t max_msg; /* the peer's max_msg once its engine is up, else 0 */
    uint32_t id;
    uint32_t pending; /* messages handed to bex, not yet reported */
    bool attached;    /* st is on an engine (the engine lets go by
                         on_stream_closed or on_fail) */
    bool app_closed;  /* bex_sock_close was processed */
    bool dead;        /* no more traffic: failed, peer-closed or closed */
    bool error_told;  /* on_error (or on_connect with an error) reported */
    bool close_reported;
    bool waiting; /* on a connection whose transport is not chosen yet:
                     sends wait in wq (linked by m.next) */
    struct sock_msg *wq_head, *wq_tail;
    struct bex_sock *map_next; /* conn's stream table */
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

/* One I/O thread of a context and everything only it touches: its loop
 * (epoll, wake-up, command queue), its CQ and completion channel, the
 * connections it owns, their engine table, its listeners and statistics.
 * Nothing here is shared with the context's other I/O threads: they meet
 * only in the command queues (any thread pushes) and in context-wide state
 * that is read-only once the context is up or atomic (the exposed table). */
struct bex__io {
    bex_ctx *ctx;
    uint32_t idx;
    struct bex__loop loop;
    struct bex__engine_shared sh; /* ctx->sh with this thread's CQ, stats and
                                     received-memory estimate */
    struct bex__stats stats;      /* this thread's; bex_ctx_stats sums them */
    struct ibv_comp_channel *ch;
    struct bex__rdma_td *td; /* thread + parent domain, where the device has them */
    struct ep_tag ch_tag;
    struct ep_tag async_tag; /* SRQ mode: the device's async event fd */
    pthread_t thread;
    bool started;
    struct conn *conns;
    struct conn *ready;            /* connections with work (bex__conn_ready) */
    bool reap;                     /* a connection died or lost a socket: bex__conn_reap looks */
    uint64_t ticks;                /* bex__conn_tick calls */
    uint64_t due_us;               /* the earliest due_us of its transports seen (0: none) */
    _Atomic uint64_t visits;       /* transport progress calls (single writer; tests read) */
    _Atomic uint64_t turns;        /* loop turns (the same) */
    _Atomic uint64_t reap_visits;  /* connections the reaper looked at (the same) */
    _Atomic uint64_t direct_sends; /* sends taken by bex__io_send_now (the same) */
    bool draining;                 /* drain_cmds is running commands it took */
    struct bex_listener *listeners;
    struct conn **engines; /* by engine id (bex__conn_by_engine) */
    uint32_t next_engine_seq;
    struct io_cq *cqs; /* with a device: at least one; sh.cq is cqs[0].cq */
    uint32_t n_cq;
    uint32_t n_setup; /* accepted connections in setup here (setup_max) */
    uint64_t n_setup_evictions;
    uint64_t setup_evicted_ms; /* the last one: a flood is logged once */
    bool stopping;
    struct bex__cmd stop_cmd;
    struct sock_msg *msg_free; /* descriptors for reuse (bex__sock_msg_put) */
    uint32_t n_msg_free;
};

/* Which I/O thread a client connection to a peer belongs to: sockets to
 * the same listener (and transport choice) share one connection, so they
 * go to the thread that has it. Control path only (bex_sock_connect). */
struct peer_home {
    struct peer_home *next;
    struct sockaddr_in addr;
    uint32_t mode, io;
};
#define PEER_HOME_BUCKETS 256

struct bex_ctx {
    bex_ctx_config cfg;
    struct bex__rdma_dev *dev;
    struct bex__engine_shared sh; /* what every I/O thread's sh starts from */
    struct bex__engine_config ecfg;
    struct bex__log log;
    bool has_secret; /* setups are authenticated with auth_key */
    uint8_t auth_key[BEX__AUTH_KEY_LEN];
    bool own_pool, own_landing;
    struct bex__recv_acct recv_acct; /* received memory, every thread's */
    struct bex__io *io;              /* cfg.io_threads of them */
    uint32_t n_io;
    _Atomic uint32_t next_io; /* round-robin */
    pthread_mutex_t homes_lock;
    struct peer_home *homes[PEER_HOME_BUCKETS];
    struct exp_slot exposed[EXPOSED_MAX];
};

/* The context whose I/O thread this is (NULL on other threads), and which
 * of its threads: the calls that wait for an I/O thread must not wait for
 * themselves, and a callback may act at once on its own thread's sockets. */
extern _Thread_local bex_ctx *bex__io_ctx;
extern _Thread_local struct bex__io *bex__io_self;

static inline void bex__io_push(struct bex__io *io, struct bex__cmd *c, int type)
{
    bex__loop_push(&io->loop, c, type);
}

/* io.c: a send issued on its socket's own I/O thread, handed straight to
 * the transport when nothing can be ahead of it; false: queue it. */
bool bex__io_send_now(struct sock_msg *w);

/* The next I/O thread in round-robin order. */
struct bex__io *bex__io_next(bex_ctx *ctx);

/* sock.c: 0, or -EINVAL / -EMSGSIZE when buf/len is not a whole piece of
 * this context's registered memory; its region's lkey in *lkey (if lkey). */
int bex__sock_check_buf(bex_sock *s, void *buf, size_t len, uint32_t *lkey);
/* A send is done with its descriptor: back to its socket's I/O thread's
 * cache (or free; a caller's is left alone). On that thread, or once it
 * has stopped. Read what the report needs first. */
void bex__sock_msg_put(struct sock_msg *w);

/* io.c: the I/O thread */
void *bex__io_main(void *arg);
void bex__io_listen(struct bex__io *io, struct bex_listener *l);

/* stream.c: socket lifecycle and the transports' upcalls */
extern const struct bex__transport_upcalls bex__sock_upcalls;
/* Hand a buffer back to the application (bex frees it without an
 * on_send_done). */
void bex__sock_report_done(struct bex_sock *s, void *buf, size_t len, void *msg_user, int status);
void bex__sock_maybe_finish(struct bex_sock *s);
void bex__sock_fail(struct bex_sock *s, int err, bool connecting);
/* c's transport is chosen: the sockets that waited for it attach, their
 * queued sends and closes go to it. */
void bex__sock_attach_waiting(struct conn *c);
/* c failed before its transport was chosen: s's queued sends come back. */
void bex__sock_drop_waiting(struct bex_sock *s);

/* exposed.c: the exposed-buffer table */
int bex__exposed_deliver(struct bex__xport *x, uint32_t imm);
void *bex__exposed_buf(struct bex__xport *x, uint32_t token, uint32_t *len);
void bex__exposed_cancel(struct bex_sock *s);
void bex__exposed_bind(struct bex__io *io, struct bind_cmd *bc);

#endif
