/* SPDX-License-Identifier: Apache-2.0 */
/* conn: connections to peers. A connection is one TCP connection and, once
 * its setup is through, the engine that carries its sockets' traffic.
 *
 * - setup.c: the non-blocking setup state machine (hello, the authenticated
 *   setup with a shared secret, readiness notice) on the I/O thread;
 * - conn.c: the context's connection table (by engine id; client
 *   connections by the listener address), accepting, the setup table
 *   (setup_max), deadlines, and tearing a connection down;
 * - hello_io.c: blocking setup I/O for tests and tools.
 *
 * Everything here runs on the connection's I/O thread (struct bex__io,
 * conn/io.h): a connection belongs to one for its life. conn knows nothing
 * of sockets: its owner (sock) fills struct bex__conn_owner_ops and keeps
 * its streams in the connection's stream table. */
#ifndef BEX_CONN_H
#define BEX_CONN_H

#include <netinet/in.h>
#include <semaphore.h>
#include <stdbool.h>
#include <stdint.h>

#include "bex/sock.h"
#include "common/hash.h"
#include "conn/io.h"
#include "loop/loop.h"
#include "wire/hello.h"

struct bex__engine;
struct bex__stream;

/* A connection's state: its setup phase, then UP. Without a secret the
 * client goes CONNECTING -> WAIT_HELLO -> (WAIT_READY ->) UP and the
 * listener's side CONNECTING -> WAIT_HELLO -> ...; with a shared secret
 * the client goes CONNECTING -> WAIT_CHALLENGE -> WAIT_HELLO -> WAIT_READY
 * -> UP and the listener CONNECTING -> WAIT_OPEN -> WAIT_PROOF ->
 * WAIT_HELLO -> WAIT_READY -> UP. WAIT_READY is skipped when the hellos
 * chose TCP. Only bex__conn_set_phase (setup.c) changes it. Whether the
 * connection is finished is its life (below), orthogonal: a connection
 * dies in any phase, and the phase then says whether it ever came up. */
enum bex__conn_phase {
    P_CONNECTING,
    P_WAIT_HELLO,
    P_WAIT_READY,
    P_UP,
    P_WAIT_OPEN,
    P_WAIT_PROOF,
    P_WAIT_CHALLENGE
};

/* A connection's life: an accepted one starts in SETUP (counted in its
 * thread's setup table, setup_max), a client's LIVE; SETUP -> LIVE when
 * its setup is through (bex__conn_setup_end), SETUP or LIVE -> DEAD (its
 * transport failed or never was; its owner was told; the reaper frees it
 * once no socket refers to it). Only conn_move (conn.c) changes it:
 * dying twice is our own bug and asserts; what a peer does fails the
 * connection through bex__conn_fail, which does nothing to a dead one.
 * bex__conn_life_name names it for logs. */
enum bex__conn_life { CONN_LIVE, CONN_SETUP, CONN_DEAD };

/* c->said: what a connection logs once (bex__log_once). */
#define CONN_SAID_REFUSAL 1u /* the peer's OPENs beyond streams_max */

#define ENGINE_TABLE 4096

/* A closing listener's word to each I/O thread (CMD_UNLISTEN_FWD). */
struct listener_fwd {
    struct bex__cmd cmd;
    struct bex_listener *l;
};

/* A listener belongs to one I/O thread, which accepts and hands each new
 * connection to the next thread in round-robin order (CMD_ADOPT). */
struct bex_listener {
    struct ep_tag tag;
    struct bex__cmd cmd;
    bex_ctx *ctx;
    struct bex__io *io;
    struct listener_fwd *fwd; /* one per I/O thread */
    int fd;
    bex_listener_ops ops;
    void *user;
    bex_addr addr;
    sem_t done;
    struct bex__list link; /* on its thread's io->listeners */
    /* accept ran out of descriptors (EMFILE, ENFILE, ...): the listener is
     * out of epoll until paused_until, so its level-triggered readiness
     * does not spin the I/O thread */
    bool paused;
    struct bex__timer pause_tm; /* on io's timers while paused: back into epoll */
    uint32_t backoff_ms;
};

struct conn {
    struct ep_tag tag;
    bex_ctx *ctx;                /* its owner's handle (opaque here) */
    struct bex__io *io;          /* the I/O thread it belongs to */
    struct bex__list ready_link; /* on io->ready while ready */
    int fd;
    enum bex__conn_phase phase;
    bool client;
    bex_addr key;            /* the peer: the listener we connected to, or the
                                address accept4 gave (kept: a peer that reset
                                has no getpeername) */
    struct bex__xport *x;    /* its transport, once made */
    struct bex__engine *eng; /* RDMA: the engine behind x */
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
    struct bex__timer setup_tm;       /* the setup's deadline (connect_timeout_ms) */
    struct bex__list tick_link;       /* in a round of the thread's ticks (conn/timers.c) */
    uint64_t tick_due;                /* when its next tick is due (bex__now_us() time) */
    struct bex__timer due_tm;         /* the transport's due_us */
    uint32_t rounds;                  /* its ticks (the sweep: every TICK_SWEEP-th) */
    uint64_t waiting_since;           /* setup: since when the peer owes us its next
                                         message (setup_evict's order) */
    bool heard;                       /* setup: its first bytes wait to be read */
    bool coming;                      /* in set-up (not UP, not dead): counted in
                                         io->n_watch (bex__conn_came) */
    uint64_t conn_id;
    uint32_t mode;               /* BEX_TRANSPORT_* wanted for this connection */
    bool rdma_ok;                /* this side may use RDMA (mode, device) */
    bool fallback;               /* our QP did not come up: TCP after the notices */
    uint32_t peer_max_msg;       /* from the peer's hello */
    uint32_t peer_ka_timeout_ms; /* from the peer's hello: its keepalive timeout */
    enum bex__conn_life life;    /* conn_move; DEAD: destroy at the next safe point */
    uint32_t said;               /* lines logged once per connection (CONN_SAID_*) */
    uint32_t cqe_reserved;       /* CQ entries held for the engine ... */
    uint32_t cq_idx;             /* ... in this CQ of its thread (io->cqs) */
    struct bex_listener *l;
    /* the stream bex__conn_stream_find found last (NULL: none), its id */
    struct bex__stream *last_st;
    uint32_t last_id;
    struct bex__hmap streams; /* its owner's streams by stream id: what the
                                 transport's upcalls name (bex__conn_stream_*) */
    uint32_t next_stream;
    struct bex__list link; /* on io->conns */
    uint64_t recv_turn;    /* the last poll turn (io->poll_no) it had a receive in */
};

/* The connection of an io->conns node. */
#define bex__conn_of(node) bex__list_entry(node, struct conn, link)

/* ---- conn.c ---- */
static inline bool bex__conn_dead(const struct conn *c)
{
    return c->life == CONN_DEAD;
}
/* c's set-up is over (it came UP, or died, or is freed): its thread's
 * spinning need not look at its descriptor every few turns for it. */
static inline void bex__conn_came(struct conn *c)
{
    if (c->coming) {
        c->coming = false;
        c->io->n_watch--;
    }
}
const char *bex__conn_life_name(enum bex__conn_life life);
/* A zeroed thread's connection and listener lists, empty (before anything
 * else touches it, bex_ctx_destroy's walk included). */
void bex__io_lists_init(struct bex__io *io);
/* Engine ids are unique in the context (an exposed buffer names its
 * engine by id, whichever thread looks): thread i of n hands out
 * seq * n + i, and keeps them in its table by seq. Looked up twice per
 * message: with one thread, no division (a helper call under an emulating
 * VM). */
static inline uint32_t bex__conn_engine_slot(struct bex__io *io, uint32_t id)
{
    uint32_t n = io->env->n_io;
    return (n == 1 ? id : id / n) % ENGINE_TABLE;
}

/* The connection of engine id on this thread (NULL: none, or another
 * thread's: ids are unique in the context). Inline, as bex__conn_ready:
 * each completion calls both. */
static inline struct conn *bex__conn_by_engine(struct bex__io *io, uint32_t id)
{
    uint32_t n = io->env->n_io, seq = id; /* (bex__conn_engine_slot's, one test of n) */
    if (n > 1) {
        if (id % n != io->idx)
            return NULL;
        seq = id / n;
    }
    struct conn *c = io->engines[seq % ENGINE_TABLE];
    return c && c->eng_id == id ? c : NULL;
}

/* c has work: its transport's progress runs on the next turn of its
 * thread's loop (which visits only connections marked so). */
static inline void bex__conn_ready(struct conn *c)
{
    if (!bex__list_linked(&c->ready_link))
        bex__list_push_head(&c->io->ready, &c->ready_link);
}
/* A client connection to the listener at to, its engine made at once. */
int bex__conn_start_client(struct bex__io *io, const bex_addr *to, uint32_t mode,
                           struct conn **out);
/* "peer a.b.c.d:port" or "peer [v6]:port" of the connection, for log
 * lines (buf: BEX__CONN_NAME_LEN bytes). */
#define BEX__CONN_NAME_LEN 72
const char *bex__conn_name(const struct conn *c, char *buf);
/* Make the connection's engine, reserving its CQ entries. */
int bex__conn_engine_make(struct conn *c);
/* Destroy the engine made for the setup (the connection goes over TCP, or
 * is freed before its transport was chosen). */
void bex__conn_engine_drop(struct conn *c);
/* An accepted connection leaves the setup table (SETUP -> LIVE; nothing
 * in any other life). */
void bex__conn_setup_end(struct conn *c);
/* Fail a connection (its engine too, synchronously). */
void bex__conn_fail(struct conn *c, int err);
/* The engine is dead or never was: fail every socket on the connection. */
void bex__conn_finish(struct conn *c, int err);
void bex__conn_free(struct conn *c);
/* The connection's stream table (by stream id): 0 or -ENOMEM (-EEXIST:
 * the id is taken). A connection is freed only once its table is empty. */
int bex__conn_stream_add(struct conn *c, uint32_t id, struct bex__stream *st);
static inline struct bex__stream *bex__conn_stream_find(struct conn *c, uint32_t id)
{
    /* the last one found first: a connection's messages come mostly on one
     * stream (issue 25 item 5: the table's lookup was some 23 instructions
     * a message); bex__conn_stream_del forgets it */
    if (c->last_st && c->last_id == id)
        return c->last_st;
    struct bex__stream *st = bex__hmap_get(&c->streams, id);
    c->last_id = id;
    c->last_st = st;
    return st;
}
void bex__conn_stream_del(struct conn *c, uint32_t id);
static inline uint32_t bex__conn_nstreams(const struct conn *c)
{
    return bex__hmap_len(&c->streams);
}
/* The listener is readable: accept what is there, handing each new
 * connection to its I/O thread. */
void bex__listener_accept(struct bex__io *io, struct bex_listener *l);
/* A listener's epoll watcher (tag.cb): bex__listener_accept. */
void bex__listener_on_event(struct ep_tag *t, uint32_t events);
/* On the connection's thread: take an accepted descriptor into the setup. */
void bex__conn_adopt(struct bex__io *io, struct bex_listener *l, int fd, const bex_addr *peer);
/* Free dead connections no socket refers to. */
void bex__conn_reap(struct bex__io *io);
/* A connection died or lost a socket: the loop's next turn reaps. */
static inline void bex__io_reap_due(struct bex__io *io)
{
    io->reap = true;
    io->chores = true;
}

/* Timers (conn/timers.c), all on the connection's I/O thread's heap. */
/* The thread's timers and housekeeping, before its loop starts. */
void bex__io_timers_init(struct bex__io *io);
/* Fire what is due (now_us: bex__now_us()). */
void bex__io_timers_run(struct bex__io *io, uint64_t now_us);
/* SRQ mode: QPs draining want bex__srq_reap: its timer runs. */
void bex__io_srq_timer(struct bex__io *io);
/* A new connection's: its setup deadline and its tick. */
void bex__conn_timers_start(struct conn *c);
/* A freed connection's: every one stopped. */
void bex__conn_timers_stop(struct conn *c);
/* After a progress call: the transport's due_us on the heap. The common
 * case (no due_us, no timer: once per message) inline, no call (issue 25
 * item 2); bex__conn_due_set the rest. */
void bex__conn_due_set(struct conn *c, uint64_t due);
static inline void bex__conn_due_sync(struct conn *c)
{
    uint64_t due = c->x ? c->x->due_us : 0;
    if (due || c->due_tm.active)
        bex__conn_due_set(c, due);
}
/* A listener out of epoll (accept's backoff) comes back in ms. */
void bex__listener_pause_timer(struct bex_listener *l, uint32_t ms);
void bex__listener_pause_stop(struct bex_listener *l);
void bex__listener_resume(struct bex_listener *l);

/* ---- setup.c ---- */
/* The one place c's phase changes: logs the move by name (DEBUG) and
 * asserts it is a legal one (our code chooses every move after checking
 * the peer's message, so an illegal one is our bug). */
void bex__conn_set_phase(struct conn *c, enum bex__conn_phase to);
const char *bex__conn_phase_name(enum bex__conn_phase p);
/* Read the next setup message in the given phase. */
void bex__conn_expect(struct conn *c, enum bex__conn_phase phase);
/* A refusal's one log line, naming the peer (setup.c). */
void bex__conn_log_refusal(struct conn *c, int err, const char *why);
/* Its TCP connection ended while up: logged by name when sockets the peer
 * never closed are open (over RDMA the setup's descriptor tells, over TCP
 * the transport's on_fail). */
void bex__conn_lost(struct conn *c, int err);
/* Advance the setup state machine on events; any error fails c. Whether
 * its transport wants a progress call (an up TCP one ran its own). */
bool bex__conn_step(struct conn *c, uint32_t events);
/* A connection's epoll watcher (tag.cb): bex__conn_step, then its
 * transport has work when the step says so (its deadline synced). */
void bex__conn_on_event(struct ep_tag *t, uint32_t events);

#endif
