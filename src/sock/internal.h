/* sock: contexts, the I/O thread, connection setup, the connection table and
 * logical sockets over engines. */
#ifndef BEX_SOCK_INTERNAL_H
#define BEX_SOCK_INTERNAL_H

#include <netinet/in.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "bex/sock.h"
#include "engine/internal.h"
#include "rdma/rdma.h"

/* A command handed from any thread to the I/O thread (lock-free stack,
 * reversed into FIFO order by the I/O thread). */
enum {
    CMD_SEND,
    CMD_CONNECT,
    CMD_CLOSE,
    CMD_LISTEN,
    CMD_UNLISTEN,
    CMD_STOP,
    CMD_SET_USER,
    CMD_BIND
};

/* What an epoll event belongs to. */
enum { EV_CHANNEL = 1, EV_EVENTFD, EV_LISTENER, EV_CONN };
struct ep_tag {
    int kind;
};

struct bex__cmd {
    struct bex__cmd *next;
    int type;
};

struct conn;

/* A message on its way: the command, the engine's descriptor, its socket. */
struct sock_msg {
    struct bex__cmd cmd;
    struct bex__msg m;
    struct bex_sock *s;
};

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

/* Socket states (docs/architecture.md); the I/O thread alone writes them.
 * Whether the application closed the socket is a separate flag, written
 * once by bex_sock_close, so that neither can overwrite the other. */
enum { S_CONNECTING, S_OPEN, S_FAILED };

struct bex_sock {
    struct bex__cmd connect_cmd, close_cmd;
    bex_ctx *ctx;
    struct conn *conn;
    struct bex__stream st;
    bex_sock_ops ops;         /* I/O thread only (see bex_sock_set_user) */
    void *user;               /* I/O thread only */
    _Atomic(void *) user_pub; /* what bex_sock_user returns, any thread */
    struct sockaddr_in peer;
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
    struct bex_sock *map_next; /* conn's stream table */
};

struct bex_listener {
    struct ep_tag tag;
    struct bex__cmd cmd;
    bex_ctx *ctx;
    int fd;
    bex_listener_ops ops;
    void *user;
    struct sockaddr_in addr;
    sem_t done;
    struct bex_listener *next;
    /* accept ran out of descriptors (EMFILE, ENFILE, ...): the listener is
     * out of epoll until paused_until, so its level-triggered readiness
     * does not spin the I/O thread */
    bool paused;
    uint64_t paused_until;
    uint32_t backoff_ms;
};

#define CONN_MAP 64

struct conn {
    struct ep_tag tag;
    bex_ctx *ctx;
    int fd;
    int phase;
    bool client;
    struct sockaddr_in key; /* the peer: the listener we connected to, or the
                               address accept4 gave (kept: a peer that reset
                               has no getpeername) */
    struct bex__engine *eng;
    uint32_t eng_id;
    uint8_t rbuf[BEX__SETUP_MAX_LEN]; /* one setup message at a time */
    size_t rlen, rwant;
    int rkind;        /* BEX__SETUP_* of the message in rbuf, once framed */
    bool framed;      /* rbuf's preamble is read: rwant is the message's length */
    bool hello_first; /* our hello went out before the peer's: it must echo conn_id */
    uint8_t wbuf[BEX__SETUP_OUT_MAX];
    size_t wlen, woff;
    struct bex__auth_transcript auth; /* with a secret */
    uint8_t hello_l[BEX__HELLO_LEN];  /* listener with a secret: the hello it MACed */
    uint64_t deadline;
    uint64_t waiting_since; /* setup: since when the peer owes us its next
                               message (setup_evict's order) */
    bool heard;             /* setup: its first bytes wait to be read */
    uint64_t conn_id;
    bool dead;             /* failed: destroy at the next safe point */
    bool in_setup;         /* accepted, setup not finished: counted in ctx->n_setup */
    bool refusal_logged;   /* the peer's OPENs beyond streams_max were logged */
    uint32_t cqe_reserved; /* CQ entries held for the engine */
    struct bex_listener *l;
    struct bex_sock *map[CONN_MAP];
    uint32_t nsocks;
    uint32_t next_stream;
    struct conn *next;
};

struct bex_ctx {
    bex_ctx_config cfg;
    struct bex__rdma_dev *dev;
    struct bex__engine_shared sh;
    struct bex__engine_config ecfg;
    struct bex__stats stats;
    struct bex__log log;
    bool has_secret; /* setups are authenticated with auth_key */
    uint8_t auth_key[BEX__AUTH_KEY_LEN];
    bool own_pool, own_landing;
    struct ibv_comp_channel *ch;
    int epfd, evfd;
    struct ep_tag ch_tag, ev_tag;
    pthread_t thread;
    _Atomic(struct bex__cmd *) cmds;
    _Atomic int sleeping;
    struct conn *conns;
    struct bex_listener *listeners;
    struct conn **engines; /* by engine id % ENGINE_TABLE */
    uint32_t next_engine_id;
    uint32_t cqe_used, cqe_cap;
    uint32_t n_setup; /* accepted connections in setup (setup_max) */
    uint64_t n_setup_evictions;
    uint64_t setup_evicted_ms; /* the last one: a flood is logged once */
    bool own_recv_pool;
    bool stopping;
    struct bex__cmd stop_cmd;
    struct exp_slot exposed[EXPOSED_MAX];
};

#endif
