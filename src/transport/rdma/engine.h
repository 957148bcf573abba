/* SPDX-License-Identifier: Apache-2.0 */
/* engine: one RC queue pair and everything needed to move messages on it.
 *
 * An engine belongs to exactly one I/O thread; every function here is
 * called on that thread only. The sock layer above hands it streams (the
 * engine-side half of a logical socket) and messages, and learns about
 * arrivals, completions and failure through bex__transport_upcalls. It is
 * the RDMA transport (bex__rdma_transport, transport/rdma/ops.c).
 *
 * Send side: a circular work-request chain of sq_depth slots split into
 * in-flight [head, post), pending [post, tail) and free [tail, head)
 * segments. A scheduler fills pending slots round-robin over the streams,
 * one fragment (or one small message) per stream per turn, then posts every
 * pending slot with one ibv_post_send; only the last of a batch is signaled.
 * SQ slots, peer receive credits and the send window are three separate
 * budgets.
 *
 * Receive side: rq_depth receives, each one buffer of max(eager_max, 32)
 * bytes from bemalloc's general pool, which no peer can reach by RDMA: DATA
 * comes header-free (SEND_WITH_IMM, stream and credits in the immediate),
 * so its payload lands at the buffer's start; a control message's header
 * lands there too. Rendezvous destinations come from the landing pool (see
 * bex/mem.h); the keepalive word is a registered region of its own. A SEND's payload buffer goes to
 * the application as it is and a fresh one takes its place. A few receives are posted beyond the
 * credits granted (bex__engine_rq_spare), so a consumed receive's credit goes back before it is
 * posted again, and receives are reposted in chains, one ibv_post_recv for up to spare + 1 (or
 * k = rq_depth/2) of them; the credits go back to the peer with the next SEND (the
 * immediate or the header), or in an explicit CREDIT message. In SRQ mode
 * (sh->srq) the receives are the I/O thread's shared queue's, and the
 * engine's peer holds a share of them as its credits (srq.h). */
#ifndef BEX_TRANSPORT_RDMA_ENGINE_H
#define BEX_TRANSPORT_RDMA_ENGINE_H

#include <infiniband/verbs.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "bex/mem.h"
#include "bex/sock.h"
#include "common/log.h"
#include "loop/loop.h"
#include "rdma/rdma.h"
#include "transport/thread.h"
#include "transport/transport.h"
#include "transport/window.h"
#include "wire/hdr.h"

struct bex__engine_config {
    uint32_t sq_depth, rq_depth, eager_max, frag_size, send_window, rndv_ahead;
    uint32_t keepalive_ms, keepalive_timeout_ms;
    /* limits (bex_ctx_config has their meaning and defaults) */
    uint32_t max_msg;           /* largest message we accept (advertised) */
    uint32_t rndv_max;          /* rendezvous a peer may have in flight (advertised) */
    uint64_t rndv_bytes_max;    /* destination bytes allocated for one peer at once */
    uint32_t rndv_timeout_ms;   /* a rendezvous request of ours unanswered this long */
    uint32_t credit_timeout_ms; /* sends waiting for credit this long, none coming */
    uint32_t ack_delay_us;      /* owed credits wait this long for a message to
                                   carry them (0: BEX__ENGINE_ACK_DELAY_US) */
    /* The receive budget against rendezvous grants (recv_share_min,
     * recv_min_rate, recv_rate_ms; 0: no share floor, no deadline): a
     * request is answered only while the engine's destinations stay within
     * max(recv_max / (other holders + 2), share_min), or no other engine or
     * connection of the context holds any; a granted destination not
     * written rate_window_ms + len / min_rate after its grant or the last
     * delivery, whichever is later, fails the engine. */
    uint64_t share_min;
    uint32_t min_rate, rate_window_ms;
    /* The send window (transport/window.h): BEX_WINDOW_STATIC (send_window
     * as is) or BEX_WINDOW_ADAPTIVE (wnd's controller); dests, the
     * per-destination bounds the engines share (NULL: none), which
     * bex__engine_set_dest picks the engine's from. */
    uint32_t wnd_mode;
    struct bex__wnd_params wnd;
    struct bex__wnd_dests *dests;
};

/* The smallest recv_depth a peer may grant: ordinary SENDs keep the last
 * credit for a CREDIT message, and credit messages cannot answer each other
 * forever only when k = depth / 2 >= 2 (docs/protocol.md). */
#define BEX__ENGINE_MIN_DEPTH 4

/* Credits the peer waits for to report its messages delivered go back
 * with our next message; with none to carry them, alone after this long.
 * Longer than the TCP transport's 200 us: a request's next one or an
 * answer (from another thread, through the command queue) takes a few
 * hundred us in the emulated VM, and each CREDIT alone costs both sides a
 * work request and a progress call (test_iothreads.echo_visits). */
#define BEX__ENGINE_ACK_DELAY_US 1000

/* Receives an engine posts beyond the rq_depth credits it grants (none in
 * SRQ mode; sh->dev's max_qp_wr bounds them): a consumed receive's credit
 * goes back at once while these cover it, and the receives are posted
 * again in chains of up to spare + 1. Every receive of the engine's QP
 * (rq_depth + spare) may complete on its CQ. */
uint32_t bex__engine_rq_spare(const struct bex__engine_shared *sh, uint32_t rq_depth);

/* Inline bytes asked of the QP: a DATA payload up to what the device
 * grants goes inside its work request (none where the device has none). */
#define BEX__ENGINE_INLINE 256

/* What an engine tells its peer in the hello (the rest the rdma module
 * fills). */
struct bex__engine_local {
    uint32_t qpn, psn, rq_depth, max_rndv, eager_max, max_msg;
    uint64_t ka_addr;
    uint32_t ka_rkey;
};
struct bex__engine_peer {
    struct bex__rdma_peer rdma; /* QPN, PSN, GID, MTU, READ depth */
    uint32_t rq_depth, max_rndv, eager_max, max_msg;
    uint64_t ka_addr;
    uint32_t ka_rkey;
};

int bex__engine_create(struct bex__engine_shared *sh, const struct bex__engine_config *cfg,
                       const struct bex__transport_upcalls *ops, uint32_t id, void *user,
                       struct bex__engine **out);
/* Only once on_fail has been reported, or before the engine went up. */
void bex__engine_destroy(struct bex__engine *e);
void *bex__engine_user(struct bex__engine *e);
/* The RDMA transport's ops table (struct bex__xport of every engine). */
extern const struct bex__transport_ops bex__rdma_transport;
struct bex__xport *bex__engine_xport(struct bex__engine *e);
/* The engine whose xport x is: its first member (engine.c asserts it), so
 * no call a message on the ops table's way in. */
static inline struct bex__engine *bex__engine_of(struct bex__xport *x)
{
    return (struct bex__engine *)(void *)x;
}
uint32_t bex__engine_id(struct bex__engine *e);
/* The number its QP had (also once the QP is gone, or draining in SRQ
 * mode: bex__srq_hold_cq). */
uint32_t bex__engine_qpn(struct bex__engine *e);
/* Name the connection in the engine's log lines ("<name> (engine <id>):"),
 * e.g. the peer's "a.b.c.d:port": an operator must see who failed. */
void bex__engine_set_name(struct bex__engine *e, const char *name);
/* The remote IPv4 address (network order) the engine sends to: its share
 * of cfg.dests' bound for that address (none without dests). Once, before
 * traffic. */
void bex__engine_set_dest(struct bex__engine *e, uint32_t ip);
void bex__engine_local(struct bex__engine *e, struct bex__engine_local *out);
/* Bring the QP to RTS with the peer's hello. */
int bex__engine_connect(struct bex__engine *e, const struct bex__engine_peer *peer);
/* The peer is ready: traffic may start (CONNECTED -> UP). A dead engine
 * stays dead; in any other state the notice is out of turn, the peer's
 * fault: the engine fails with -EPROTO. */
void bex__engine_start(struct bex__engine *e);
bool bex__engine_is_up(struct bex__engine *e);
bool bex__engine_is_dead(struct bex__engine *e);
/* Whether a peer's hello describes an engine we can work with (a
 * recv_depth that leaves credit for data): 0 or -EPROTO. */
int bex__engine_check_peer(const struct bex__engine_peer *peer);
/* The largest message the peer accepts (its hello's max_msg; 0 before
 * bex__engine_connect). */
uint32_t bex__engine_peer_max_msg(struct bex__engine *e);
/* Answer a peer's OPEN of stream id with a CLOSE, creating nothing (the
 * socket limit of the connection is reached). Returns 0, or -EPROTO when the
 * peer opens faster than the refusals can go out (then fail the engine). */
int bex__engine_refuse_stream(struct bex__engine *e, uint32_t id);

void bex__engine_attach(struct bex__engine *e, struct bex__stream *st, uint32_t id, bool client);
/* Queue a message (ownership passes to the engine until on_send_done).
 * m->lkey is the caller's: buf's region's lkey (bex_mem_mr), looked up once
 * when the message was accepted, not again here. */
void bex__engine_send(struct bex__stream *st, struct bex__msg *m);
/* bex__engine_send(st, m) when that would send or queue m, not hand it
 * back at once: NULL; else m, handed back without a report (only its st
 * and status may be set): the transport's send_now, the ops table's entry
 * itself (x, the transport's, last and not read: st names its engine; a
 * wrapper that dropped it was 3 instructions a send, issue 25 item 2). */
struct bex__msg *bex__engine_send_now(struct bex__stream *st, struct bex__msg *m,
                                      struct bex__xport *x);
/* Whether bex__engine_send(st, m) would queue m (not hand it back at once). */
bool bex__engine_takes(const struct bex__stream *st);
/* Close a stream: its queue is sent, then CLOSE; on_stream_closed once the
 * peer's CLOSE has arrived too. Works before the engine is up. */
void bex__engine_close_stream(struct bex__stream *st);
/* The peer closed the stream (its CLOSE arrived): queued messages are handed
 * back (-ECANCELED), our CLOSE answers; on_stream_closed follows. */
void bex__engine_peer_closed(struct bex__stream *st);
/* Forget a stream without sending anything; queued messages come back with
 * -ECANCELED (those with fragments in flight once these complete). */
void bex__engine_detach(struct bex__stream *st);

/* Window mode, for exposed buffers: bind mw to [addr, addr + len) of its
 * landing region with key rkey (ibv_inc_rkey of the window's current key)
 * on this engine's QP, ahead of anything posted later. The engine owns mw
 * from then on: it deallocates it if it fails (before its QP goes; the
 * sock layer must then forget it), or when it is retired. */
void bex__engine_bind_window(struct bex__engine *e, struct ibv_mw *mw, uint32_t rkey, void *addr,
                             uint32_t len);
/* Give a window back: invalidated first if bound (never otherwise: rxe
 * panics on an unbound invalidate), then deallocated. Also on a dead
 * engine (then deallocated at once: its QP is gone). */
void bex__engine_retire_window(struct bex__engine *e, struct ibv_mw *mw, uint32_t rkey, bool bound);

/* Completion of one of this engine's work requests. Returns whether the
 * engine wants a progress call now: always after a receive or a failure,
 * after a send completion only if it has work (a send completion of an
 * idle engine, the answer of a ping-pong say, frees nothing anyone waits
 * for). */
bool bex__engine_complete(struct bex__engine *e, const struct ibv_wc *wc);
/* bex__engine_complete for a completion the caller knows to be a
 * receive's success (wc's status IBV_WC_SUCCESS, and a receive request's:
 * its opcode has IBV_WC_RECV set), which it then need not test again
 * (issue 25 item 2); true, as bex__engine_complete's answer for a receive,
 * so that the caller's return may be a tail call. */
bool bex__engine_complete_recv(struct bex__engine *e, const struct ibv_wc *wc);
/* SRQ mode: a receive completion of the thread's shared queue (engine id 0
 * in its wr_id), handed to the engine of its QP. Returns that engine's
 * user (its connection), or NULL when the QP is gone. */
void *bex__engine_srq_complete(struct bex__srq *q, const struct ibv_wc *wc);
/* Receives of e's peer not yet credited back to it: held (unposted,
 * starved) or posted again with the credit not yet sent (tests). */
uint32_t bex__engine_charged(const struct bex__engine *e);
/* Schedule and post what can go. Returns true if anything was posted. */
bool bex__engine_progress(struct bex__engine *e);
/* The transport's progress (ops.c): the same, returning false. The engine
 * moves all it can in one call: what it leaves waits for a send
 * completion, a receive, a command or a tick, each of which asks for
 * another call (bex__engine_complete, bex__engine_tick). So no call on the
 * next turn for nothing: that was a second call per message. */
bool bex__engine_progress_xport(struct bex__xport *x);
/* Timer tick: keepalive. now in ms (CLOCK_MONOTONIC). */
bool bex__engine_tick(struct bex__engine *e, uint64_t now_ms);
/* Whether its next tick should come soon (the I/O thread's tick period)
 * rather than at the next keepalive round: work held back that no event
 * announces (receives starved of memory, rendezvous answers waiting for
 * room), or a transfer under way whose progress the tick times. */
bool bex__engine_tick_soon(const struct bex__engine *e);
/* Fail the engine, synchronously: destroy the QP, hand every message back,
 * unlink every stream, report on_fail. No-op on a dead engine. */
void bex__engine_fail(struct bex__engine *e, int err);

/* wr_id layout shared with the I/O loop: engine id in the high 32 bits. */
static inline uint32_t bex__wr_engine(uint64_t wr_id)
{
    return (uint32_t)(wr_id >> 32);
}

/* ---- without a device: for the fuzz targets (tests/fuzz) only ----
 * An engine over a stand-in QP that the caller owns: the engine posts to it
 * as to a real one (ibv_post_send/ibv_post_recv are inline calls through
 * qp->context->ops, where the caller records the work requests), and
 * skips the QP state changes that need the verbs library (create, INIT,
 * RTR, RTS, error, destroy) and the keepalive word's registration (its key
 * is 0). Everything else runs as in production; the caller plays the NIC:
 * it completes what was posted through bex__engine_complete. sh->dev and
 * cq may be NULL; the pools should use bex_mem_registrar_noop. In window
 * mode (sh->windows) sh->pd must be a stand-in too whose context->ops have
 * alloc_mw and dealloc_mw (ibv_alloc_mw/ibv_dealloc_mw are inline calls
 * through them), and the caller completes BIND_MW and LOCAL_INV requests. */
int bex__engine_create_nodev(struct bex__engine_shared *sh, const struct bex__engine_config *cfg,
                             const struct bex__transport_upcalls *ops, uint32_t id, void *user,
                             struct ibv_qp *stand_in, struct bex__engine **out);

#endif
