/* SPDX-License-Identifier: Apache-2.0 */
/* sock: contexts, the public socket API, the I/O thread's body, socket
 * lifecycle and exposed buffers. Connections (setup, table) are in conn/,
 * the loop's mechanics in loop/, the RDMA engine in transport/rdma/. */
#ifndef BEX_SOCK_INTERNAL_H
#define BEX_SOCK_INTERNAL_H

#include <assert.h>
#include <netinet/in.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "bex/sock.h"
#include "common/util.h"
#include "conn/conn.h"
#include "loop/loop.h"
#include "mem/lookup.h"
#include "rdma/rdma.h"
#include "transport/rdma/engine.h"

/* The socket layer's commands to an I/O thread (bex__io_push), after
 * the connection layer's (conn/io.h). */
enum {
    CMD_SEND = BEX__CMD_OWNER,
    CMD_CONNECT,
    CMD_CLOSE,
    CMD_SET_USER,
    CMD_BIND,
};

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
    bool gathered; /* the head of a struct sock_msgv (malloc'd, never cached) */
};

/* A gathered message's descriptor (bex_sock_sendv): its buffers beside it. */
struct sock_msgv {
    struct sock_msg w;
    struct bex__seg seg[BEX__SEG_MAX];
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

/* Window mode: bind an exposed slot's window (CMD_BIND). */
struct bind_cmd {
    struct bex__cmd cmd;
    uint32_t slot;
    uint16_t gen;
};

/* Socket states (docs/architecture.md): CONNECTING -> OPEN -> FAILED, or
 * CONNECTING -> FAILED (an accepted socket starts OPEN). The I/O thread
 * alone writes them, through bex__sock_set_state; other threads read them.
 * Whether the application closed the socket is a separate flag, written
 * once by bex_sock_close, so that neither can overwrite the other. */
enum bex__sock_state { S_CONNECTING, S_OPEN, S_FAILED };

/* A socket's life on its I/O thread, in one word (s->life) that only
 * bex__sock_move (sock/stream.c) changes; it was three loose booleans.
 * Three facts, each a bit, each set at most once except ATTACHED:
 *   ATTACHED  its stream is on the connection's transport, until the
 *             transport lets go (on_stream_closed, or the connection ends);
 *   DEAD      no more traffic: failed, closed by the peer, or closed;
 *   CLOSED    bex_sock_close was processed.
 * Every combination is a state with a name (bex__sock_life_name, in the
 * DEBUG line of each move). The moves are events: ATTACH (only a live
 * stream on no transport: IDLE or IDLE_CLOSED), LET_GO (only an attached
 * one), DIE (only a live one), CLOSE (only one not closed). Our own code
 * drives every move: an illegal one asserts. The upcalls a peer drives
 * (its CLOSE, the end of a stream it closed) reach a socket only through
 * the transport, which tracks the stream; should one still find its
 * socket in a state that refuses it, that connection fails (-EPROTO) and
 * nothing aborts (bex__sock_try_move). */
#define SK_BIT_ATTACHED 1u
#define SK_BIT_DEAD     2u
#define SK_BIT_CLOSED   4u
enum bex__sock_life {
    SK_IDLE = 0,                                                    /* live, on no transport yet */
    SK_ATTACHED = SK_BIT_ATTACHED,                                  /* live, on the transport */
    SK_DEAD = SK_BIT_DEAD,                                          /* dead, let go of */
    SK_DYING = SK_BIT_DEAD | SK_BIT_ATTACHED,                       /* dead, still held */
    SK_IDLE_CLOSED = SK_BIT_CLOSED,                                 /* closed, sends wait */
    SK_CLOSING = SK_BIT_CLOSED | SK_BIT_ATTACHED,                   /* closed, CLOSE goes out */
    SK_DONE = SK_BIT_CLOSED | SK_BIT_DEAD,                          /* freed once reported */
    SK_DYING_CLOSED = SK_BIT_CLOSED | SK_BIT_DEAD | SK_BIT_ATTACHED /* closed, dead, held */
};
enum bex__sock_event { SK_EV_ATTACH, SK_EV_LET_GO, SK_EV_DIE, SK_EV_CLOSE };

struct bex_sock {
    struct bex__cmd connect_cmd, close_cmd;
    bex_ctx *ctx;
    struct bex__io *io; /* its connection's I/O thread, fixed at creation */
    struct conn *conn;
    struct bex__stream st;
    bex_sock_ops ops;         /* I/O thread only (see bex_sock_set_user) */
    void *user;               /* I/O thread only */
    _Atomic(void *) user_pub; /* what bex_sock_user returns, any thread */
    bex_addr peer;
    uint32_t mode; /* client: BEX_TRANSPORT_* of its connection */
    _Atomic int state;
    _Atomic bool closing;     /* bex_sock_close was called */
    _Atomic uint32_t eng_id;  /* 0 until attached to an engine */
    _Atomic uint32_t max_msg; /* the peer's max_msg once its engine is up, else
                                 UINT32_MAX (bex__sock_peer_limit) */
    uint32_t id;
    uint32_t pending;         /* messages handed to bex, not yet reported */
    enum bex__sock_life life; /* I/O thread only: bex__sock_move */
    bool error_told;          /* on_error (or on_connect with an error) reported */
    bool close_reported;
    bool waiting; /* on a connection whose transport is not chosen yet:
                     sends wait in wq (linked by m.next) */
    struct sock_msg *wq_head, *wq_tail;
    _Atomic int last_err;         /* what on_error / on_connect reported (bex_sock_last_error) */
    _Atomic bool last_connecting; /* ... while it was connecting */
};

/* Which I/O thread a client connection to a peer belongs to: sockets to
 * the same listener (and transport choice) share one connection, so they
 * go to the thread that has it. Control path only (bex_sock_connect). */
struct peer_home {
    bex_addr addr;
    uint32_t mode, io;
};

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
    struct bex__conn_env env;        /* what its connections read (conn/io.h) */
    struct bex__io *io;              /* cfg.io_threads of them */
    uint32_t n_io;
    pthread_mutex_t homes_lock;
    struct bex__hmap homes; /* struct peer_home by home_key() */
    struct exp_slot exposed[EXPOSED_MAX];
    _Atomic uint64_t user_mem;   /* bytes of caller memory (bex__ctx_user_alloc) */
    struct bex__wnd_dests dests; /* per-destination send bounds (window.c) */
};

/* The context whose I/O thread this is (NULL on other threads), and which
 * of its threads: the calls that wait for an I/O thread must not wait for
 * themselves, and a callback may act at once on its own thread's sockets. */

/* io.c: the I/O thread's commands (bex__sock_conn_ops.drain_cmds) */
bool bex__sock_drain_cmds(struct bex__io *io);
void bex__io_listen(struct bex__io *io, struct bex_listener *l);

/* stream.c: socket lifecycle and the transports' upcalls */
extern const struct bex__conn_owner_ops bex__sock_conn_ops;
/* The socket of a stream of the connection's stream table. */
static inline struct bex_sock *bex__sock_of(struct bex__stream *st)
{
    return st ? bex__container_of(st, struct bex_sock, st) : NULL;
}
/* Hand a buffer back to the application (bex frees it without an
 * on_send_done). */
void bex__sock_report_done(struct bex_sock *s, void *buf, size_t len, void *msg_user, int status);
void bex__sock_maybe_finish(struct bex_sock *s);
/* The one place a socket's state changes: logs the move by name (DEBUG)
 * and asserts it is one of the moves above (each is our code's choice). */
void bex__sock_set_state(struct bex_sock *s, enum bex__sock_state to);
/* The one place s->life changes: the move ev makes, logged (DEBUG) by
 * name; an illegal one asserts (our own code's). bex__sock_try_move is
 * for moves a peer drives: false, and nothing changed, if illegal. */
void bex__sock_move(struct bex_sock *s, enum bex__sock_event ev);
bool bex__sock_try_move(struct bex_sock *s, enum bex__sock_event ev);
const char *bex__sock_life_name(enum bex__sock_life life);
static inline bool bex__sock_attached(const struct bex_sock *s)
{
    return s->life & SK_BIT_ATTACHED;
}
static inline bool bex__sock_dead(const struct bex_sock *s)
{
    return s->life & SK_BIT_DEAD;
}
static inline bool bex__sock_app_closed(const struct bex_sock *s)
{
    return s->life & SK_BIT_CLOSED;
}

/* What s->max_msg holds for a peer's max_msg: it, or while it is not known
 * (0) no limit, so that a send compares its length alone (issue 25 item 2). */
static inline uint32_t bex__sock_peer_limit(uint32_t peer_max_msg)
{
    return peer_max_msg ? peer_max_msg : UINT32_MAX;
}

/* Whether pool is one of s's context's (its send, receive or landing pool). */
static inline bool bex__sock_pool_ours(const bex_sock *s, const bex_mem_pool *pool)
{
    return pool == s->ctx->sh.pool || pool == s->ctx->sh.recv_pool || pool == s->ctx->sh.landing;
}
/* sock.c: bex__sock_check_buf's refusal of buf/len (the error, logged). */
int bex__sock_buf_refused(bex_sock *s, void *buf, size_t len);
/* Whether buf/len is a whole piece of this context's registered memory;
 * its region's lkey in *lkey (if lkey) when it is. Inline: every send
 * checks its buffer. */
static inline bool bex__sock_buf_ok(bex_sock *s, void *buf, size_t len, uint32_t *lkey)
{
    bex_mem_pool *pool;
    const bex_mem_region *r = buf && len <= INT32_MAX ? bex__mem_lookup(buf, &pool) : NULL;
    if (!r || !bex__sock_pool_ours(s, pool) || (uintptr_t)buf < (uintptr_t)r->addr ||
        (uintptr_t)buf + len > (uintptr_t)r->addr + r->length)
        return false;
    if (lkey)
        *lkey = r->lkey;
    return true;
}
/* 0, or bex__sock_buf_refused's -EINVAL / -EMSGSIZE (logged) when buf/len
 * is not a whole piece of this context's registered memory; its region's
 * lkey in *lkey (if lkey). */
static inline int bex__sock_check_buf(bex_sock *s, void *buf, size_t len, uint32_t *lkey)
{
    return bex__sock_buf_ok(s, buf, len, lkey) ? 0 : bex__sock_buf_refused(s, buf, len);
}
/* sock.c: bex__sock_msg_put's other cases: a gathered message's
 * descriptor, or the cache full. */
void bex__sock_msg_put_slow(struct sock_msg *w);
/* A send is done with its descriptor: back to its socket's I/O thread's
 * cache (or free; a caller's is left alone). On that thread, or once it
 * has stopped. Read what the report needs first. Inline: every send's
 * descriptor goes back here. */
static inline void bex__sock_msg_put(struct sock_msg *w)
{
    if (w->caller_owned)
        return;
    struct bex__io *io = w->s->io;
    if (w->gathered || io->n_msg_free >= BEX__MSG_CACHE_MAX) {
        bex__sock_msg_put_slow(w);
        return;
    }
    w->free_next = io->msg_free;
    io->msg_free = w;
    io->n_msg_free++;
}

/* Hand w to its attached socket's transport; the connection has work.
 * The connection is marked first, so that the send is a tail call: no
 * transport's send touches the ready list (issue 25 item 2). */
static inline void bex__sock_to_transport(struct bex_sock *s, struct sock_msg *w)
{
    s->pending++;
    bex__conn_ready(s->conn);
    s->conn->x->ops->send(s->conn->x, &s->st, &w->m);
}

/* A send on the socket's own I/O thread (from a callback) may go straight
 * to its transport instead of through the command queue when nothing can
 * be ahead of it: no command waits in the queue or is being run (an
 * earlier send, close or bind of this thread, or one another thread issued
 * before it), and the socket's stream is attached. The transport's
 * send_now then takes the message, or hands it back untouched (it would
 * report on_send_done at once, inside bex_sock_send): queue it then as any
 * other thread would. Inline: a callback's send pays no call.
 *
 * Only for a send that found s neither closing nor failed, on s's thread,
 * which alone moves s->life: then an attached socket is live (DEAD comes
 * with FAILED, or with a close) and waits for no transport (sends wait
 * only before the transport is chosen, which attaches them), so attached
 * is the one fact of s left to test (issue 25 item 2: the states were
 * tested twice). */
static inline bool bex__io_direct_ok(const struct bex_sock *s)
{
    const struct bex__io *io = s->io;
    assert(!(s->life & SK_BIT_ATTACHED) || (!(s->life & SK_BIT_DEAD) && !s->waiting));
    return !io->draining && !atomic_load_explicit(&io->loop.cmds, memory_order_relaxed) &&
           (s->life & SK_BIT_ATTACHED);
}
/* w to its socket's transport by send_now, counted as bex__sock_to_transport
 * counts a send (the connection marked first, harmless should the send be
 * refused) and in direct_sends: NULL, or w's message, refused, with those
 * counts taken back (bex__io_direct_refused). */
static inline struct bex__msg *bex__io_send_direct(struct bex_sock *s, struct sock_msg *w)
{
    s->pending++;
    BEX__STAT_ADD(s->io, direct_sends, 1);
    bex__conn_ready(s->conn);
    struct bex__xport *x = s->conn->x;
    return x->ops->send_now(&s->st, &w->m, x);
}
/* bex__io_send_direct's refusal of m: its counts taken back. */
static inline struct sock_msg *bex__io_direct_refused(struct bex__msg *m)
{
    struct sock_msg *w = bex__container_of(m, struct sock_msg, m);
    w->s->pending--;
    BEX__STAT_ADD(w->s->io, direct_sends, (uint64_t)-1);
    return w;
}
static inline bool bex__io_send_now(struct sock_msg *w)
{
    if (!bex__io_direct_ok(w->s))
        return false;
    struct bex__msg *back = bex__io_send_direct(w->s, w);
    if (back)
        bex__io_direct_refused(back);
    return !back;
}

const char *bex__sock_state_name(int st);
void bex__sock_fail(struct bex_sock *s, int err, bool connecting);
/* c failed before its transport was chosen: s's queued sends come back. */
void bex__sock_drop_waiting(struct bex_sock *s);

/* exposed.c: the exposed-buffer table */
int bex__exposed_deliver(struct bex__xport *x, uint32_t imm);
void *bex__exposed_buf(struct bex__xport *x, uint32_t token, uint32_t *len);
void bex__exposed_cancel(struct bex_sock *s);
void bex__exposed_bind(struct bex__io *io, struct bind_cmd *bc);

/* window.c: the send window's settings: defaults and checks (0 or
 * -EINVAL), the engines' share of them and the per-destination table
 * (init after the engines' configuration is filled, fini once no engine
 * is left). */
int bex__ctx_window_check(bex_ctx_config *c);
/* The adaptive window's parameters of a checked config c; high_us is half
 * the QP's retransmission timeout (4.096 us << qp_timeout; none with 0). */
void bex__ctx_window_params(const bex_ctx_config *c, struct bex__wnd_params *p);
void bex__ctx_window_init(bex_ctx *ctx);
void bex__ctx_window_fini(bex_ctx *ctx);
void bex__ctx_window_stats(struct bex__stats *s, bex_sock_stats *o);

/* rdma_opts.c: the RDMA provider options of bex_ctx_config.
 * 0 or -EINVAL for a value out of range. */
int bex__ctx_rdma_opts_check(const bex_ctx_config *c);
/* traffic_class (its default resolved), sl and flow_label of every QP. */
void bex__ctx_qos(const bex_ctx_config *c, struct bex__rdma_conn_config *out);
/* access as the context registers its pools: with relaxed ordering unless
 * it is OFF. */
int bex__ctx_reg_access(const bex_ctx_config *c, int access);
/* io's thread domain as cfg.thread_domains asks (io->td, io->sh.pd): 0, or
 * with ON the error of a device without them (logged). */
int bex__io_td_pick(bex_ctx *ctx, struct bex__io *io);

#endif
