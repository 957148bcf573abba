/* SPDX-License-Identifier: Apache-2.0 */
/* transport: what moves a connection's messages, behind one ops table.
 *
 * A connection (src/conn) owns one transport instance, struct bex__xport,
 * the first member of the transport's own object: the RDMA engine
 * (transport/rdma/) or a TCP connection (transport/tcp/). The sock layer
 * reaches it only through x->ops, and learns of arrivals, completions and
 * failure through the upcalls it registered at creation. Everything here
 * runs on the connection's I/O thread.
 *
 * Semantics every transport keeps (include/bex/sock.h has the contract):
 * the same framing (wire/hdr.h), messages of a stream in order, every
 * message handed back exactly once (on_send_done: 0, -ECANCELED, -EIO or
 * the peer's refusal), sockets opened and closed with OPEN/CLOSE, the same
 * limits (max_msg, streams_max, recv_bytes_max). */
#ifndef BEX_TRANSPORT_H
#define BEX_TRANSPORT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/count.h"
#include "common/list.h"

struct ibv_mw;
struct bex__engine;
struct bex__xport;

/* ---- messages and streams ---- */
enum bex__msg_state {
    BEX__M_QUEUED,    /* waiting in its stream's queue */
    BEX__M_RNDV_SENT, /* large: rendezvous request posted, no answer yet */
    BEX__M_READY,     /* large: destination known, fragments may go */
    BEX__M_POSTED,    /* every work request posted; waiting for completion */
};

struct bex__stream;

/* One buffer of a gathered message (bex_sock_sendv): its bytes and its
 * region's lkey. */
struct bex__seg {
    uint8_t *buf;
    uint32_t len;
    uint32_t lkey;
};

/* Buffers one gathered message has, at most (BEX_SOCK_IOV_MAX). */
#define BEX__SEG_MAX 4

/* The fields from off to nseg are the ones a fresh message has zero
 * (sock.c's sock_msg_fill clears them with one 16-byte and two 8-byte
 * stores where seven stores of four sizes were, issue 25 item 2): keep
 * them together. */
struct bex__msg {
    struct bex__msg *next;
    struct bex__stream *st;
    void *buf;
    size_t len;
    void *user;
    uint32_t lkey;              /* buf's, set by whoever queues m (RDMA): resolved once at submit */
    uint32_t ack_seq;           /* RDMA: the peer receive its last work request takes
                                   (engine's cons_sent): reported 0 once acknowledged */
    uint32_t last_wr;           /* send counter of its last posted fragment (off > 0) */
    int status;                 /* the error it ends with, when it failed before posting
                                   (rendezvous refused) or was abandoned in flight */
    const struct bex__seg *seg; /* read only while nseg is not 0 */
    size_t off;                 /* bytes of payload already in posted fragments */
    uint64_t raddr;             /* destination (large messages) */
    uint32_t rkey;
    uint32_t imm;
    uint32_t rndv_id; /* index in the engine's rendezvous table + 1, or 0 */
    bool direct;      /* destination given by the caller */
    bool rndv_asked;  /* request already prepared */
    bool peer_slot;   /* holds one of the peer's rendezvous slots (counted in
                         the engine's peer_rndv_used until written or released) */
    uint8_t nseg;     /* gathered: its bytes are seg[0..nseg) in order (buf and
                         lkey the first's, len their total); 0: buf alone */
    uint8_t state;
};

/* Where m's byte off lies: the address, the bytes from there to the end of
 * its buffer (*run) and that buffer's lkey. A fragment never crosses a
 * buffer's end, so each goes from one contiguous piece. */
static inline uint8_t *bex__msg_at(const struct bex__msg *m, size_t off, size_t *run,
                                   uint32_t *lkey)
{
    if (!m->nseg) {
        *run = m->len - off;
        *lkey = m->lkey;
        return (uint8_t *)m->buf + off;
    }
    uint32_t i = 0;
    while (i + 1 < m->nseg && off >= m->seg[i].len)
        off -= m->seg[i++].len;
    *run = m->seg[i].len - off;
    *lkey = m->seg[i].lkey;
    return m->seg[i].buf + off;
}

struct bex__engine;

/* A stream's lifecycle (stream.c has the moves). A client stream starts
 * OPENING, a stream the peer opened OPEN. Each side's CLOSE goes once: ours
 * after the queue (we closed, or we answer the peer's), the peer's when it
 * arrives; the stream ends once both are through. */
enum bex__stream_state {
    BEX__S_OPENING,         /* client: our OPEN still to send */
    BEX__S_OPENING_CLOSE,   /* client: OPEN, then (closed before it went) CLOSE to send */
    BEX__S_OPEN,            /* open both ways */
    BEX__S_CLOSING,         /* we closed: the queue, then our CLOSE, to send */
    BEX__S_PEER_CLOSED,     /* the peer's CLOSE arrived: ours, answering it, to send */
    BEX__S_CLOSE_SENT,      /* our CLOSE posted; the peer's not arrived */
    BEX__S_CLOSE_SENT_PEER, /* our CLOSE posted; the peer's arrived */
    BEX__S_CLOSE_DONE,      /* our CLOSE completed; the peer's not arrived */
    BEX__S_CLOSED_BOTH,     /* both CLOSEs through: the stream is to end */
    BEX__S_ENDED,           /* ended: unlinked, on_stream_closed reported */
    BEX__S_FAILED,          /* its transport failed */
};

/* The transport-side half of a socket. Embedded in the sock layer's
 * socket; the fields below eng are every transport's. */
struct bex__stream {
    struct bex__engine *eng; /* RDMA */
    uint32_t id;
    struct bex__msg *q_head, *q_tail; /* not fully posted, in order */
    uint32_t q_len;
    struct bex__list ring_node; /* scheduler ring (stream.h) */
    struct bex__list all_node;  /* every stream of the transport */
    uint8_t state;              /* enum bex__stream_state: changed by bex__stream_move only */
};

/* The receive budget's fair share (docs/protocol.md): what one peer may
 * hold of the context's max bytes while `others` other peers hold some:
 * with none, anything; else a share that leaves room for one more holder,
 * never below floor. Both transports size their peers' holdings by it. */
static inline uint64_t bex__recv_share(uint64_t max, int32_t others, uint64_t floor)
{
    if (!max || others <= 0)
        return UINT64_MAX;
    uint64_t s = max / ((uint64_t)others + 2);
    return s > floor ? s : floor;
}

/* Upcalls from a transport to the sock layer, on the I/O thread. */
struct bex__transport_upcalls {
    /* the transport is up (RDMA: QP at RTS, peer ready) */
    void (*on_up)(struct bex__xport *x);
    /* a message for stream id arrived; buf is the application's */
    void (*on_msg)(struct bex__xport *x, uint32_t stream, void *buf, size_t len);
    /* the peer opened (server side) or closed a stream */
    void (*on_open)(struct bex__xport *x, uint32_t stream);
    /* the peer's CLOSE of a stream arrived; the sock layer answers with
     * the transport's peer_closed if it knows the stream */
    void (*on_peer_close)(struct bex__xport *x, uint32_t stream);
    /* a message is done, and the transport no longer touches its buffer: status 0
     * (the peer's transport holds it), -ECANCELED (the peer never delivers
     * it), -EIO (in doubt: it was handed to the wire, the transport
     * failed before the peer acknowledged it), or the peer's refusal (-ENOMEM, ...) */
    void (*on_send_done)(struct bex__xport *x, struct bex__msg *m, int status);
    /* both sides' CLOSE of a stream are through (ours posted and completed,
     * the peer's arrived): nothing of the stream is in flight either way;
     * the engine has let go of it */
    void (*on_stream_closed)(struct bex__xport *x, struct bex__stream *st);
    /* data for an exposed buffer arrived (RDMA: a WRITE_WITH_IMM; TCP: a
     * DIRECT frame, written into the buffer), token has BEX__IMM_DIRECT:
     * deliver it; return -EPROTO if the token names nothing */
    int (*on_direct)(struct bex__xport *x, uint32_t imm);
    /* TCP: where a DIRECT frame's payload goes: the exposed buffer the
     * token names on this connection (its length in *len), or NULL when it
     * names nothing armed here */
    void *(*direct_buf)(struct bex__xport *x, uint32_t token, uint32_t *len);
    /* the transport failed; it touches no buffer any more (RDMA: its QP is
     * gone), every stream is unlinked and every message has been handed
     * back. It may be destroyed after the call. */
    void (*on_fail)(struct bex__xport *x, int err);
};

struct bex__stream;

/* What a transport's tick asks of the I/O thread (bits). */
enum { BEX__TICK_PROGRESS = 1u, BEX__TICK_SOON = 2u };

/* The operations a connection's transport offers. Optional ones may be
 * NULL (bind_window, retire_window: RDMA window mode only). */
struct bex__transport_ops {
    const char *name; /* "rdma", "tcp": for logs */
    /* Only once on_fail has been reported, or before the transport went up. */
    void (*destroy)(struct bex__xport *x);
    bool (*is_up)(struct bex__xport *x);
    bool (*is_dead)(struct bex__xport *x);
    /* The largest message the peer accepts (0 before the peer is known). */
    uint32_t (*peer_max_msg)(struct bex__xport *x);
    /* Answer a peer's OPEN with a CLOSE, creating nothing: 0, or -EPROTO
     * when the peer opens faster than refusals go out (fail x then). */
    int (*refuse_stream)(struct bex__xport *x, uint32_t id);
    void (*attach)(struct bex__xport *x, struct bex__stream *st, uint32_t id, bool client);
    /* Queue a message (owned by the transport until on_send_done). */
    void (*send)(struct bex__xport *x, struct bex__stream *st, struct bex__msg *m);
    /* send(st, m) when that would queue m, not hand it back at once: NULL.
     * Otherwise (stream failed or closing, transport dead, too large for
     * the peer) m, untouched. A send straight from bex_sock_send
     * (bex__io_send_now) must not report on_send_done inside that call: its
     * caller queues a refused m as a command instead. One call where a
     * check (takes) and the send were two (issue 25 item 2); the refused m
     * is returned so that the caller keeps nothing across the call. x
     * last: the RDMA engine's entry, which does not read it, is the ops
     * table's own, its arguments where they came (no wrapper). */
    struct bex__msg *(*send_now)(struct bex__stream *st, struct bex__msg *m, struct bex__xport *x);
    /* Send the queue, then CLOSE; on_stream_closed once the peer's CLOSE
     * has arrived too. Works before the transport is up. */
    void (*close_stream)(struct bex__xport *x, struct bex__stream *st);
    /* The peer's CLOSE arrived: hand the queue back (-ECANCELED), answer. */
    void (*peer_closed)(struct bex__xport *x, struct bex__stream *st);
    /* Move what can move; true when it may have more to move at once (the
     * I/O loop calls it again on its next turn: TCP writes a few rounds a
     * call); false when what is left waits for an event, a completion, a
     * command or a tick, which make the connection ready again. */
    bool (*progress)(struct bex__xport *x);
    /* Timers (keepalive, stalls, ...); now in ms (a clock at or ahead of
     * bex__now_ms). BEX__TICK_* bits: PROGRESS when the connection wants a
     * progress call (work queued); SOON when something is held back that
     * no event announces (received memory freed by the application), so
     * the next tick should come within the I/O thread's tick period
     * rather than at the next keepalive round (conn/timers.c). An idle
     * one asks for neither (the loop still gives every connection a
     * progress call now and then). */
    unsigned (*tick)(struct bex__xport *x, uint64_t now_ms);
    /* Fail synchronously: every message handed back, streams unlinked,
     * on_fail reported, before it returns. No-op when dead. */
    void (*fail)(struct bex__xport *x, int err);
    /* Window mode (RDMA): see bex__engine_bind_window / retire_window. */
    void (*bind_window)(struct bex__xport *x, struct ibv_mw *mw, uint32_t rkey, void *addr,
                        uint32_t len);
    void (*retire_window)(struct bex__xport *x, struct ibv_mw *mw, uint32_t rkey, bool bound);
    /* Tests only: a transport a test put in front of another (tcp.h,
     * bex__tcp_wrap_test) returns the one it wraps; NULL for the real ones. */
    struct bex__xport *(*inner)(struct bex__xport *x);
};

/* A connection's transport instance: the first member of the transport's
 * object. */
struct bex__xport {
    const struct bex__transport_ops *ops;
    void *user; /* the connection */
    /* When progress must run again though no event, command or completion
     * may come (TCP: acknowledgements held back for a frame to carry them),
     * in bex__now_us() time; 0: never. Set by the transport in progress;
     * the I/O thread marks the connection ready once it has passed. */
    uint64_t due_us;
};

/* Counters written by the I/O thread only, read by anyone: relaxed atomics,
 * updated without a locked instruction (single writer). */
struct bex__stats {
    _Atomic uint64_t msgs_sent, msgs_recv, bytes_sent, bytes_recv, sends_posted, writes_posted,
        post_send_calls, post_recv_calls, signaled, credit_stalls, window_stalls,
        max_inflight_bytes, credit_msgs, engines, rnr_naks, recv_paused, tcp_conns, srq_credits,
        srq_posted, srq_refused, rndv_prebound;
    _Atomic uint64_t srq_draining;
    /* failures, for bex_ctx_prometheus */
    _Atomic uint64_t rnr_errors, retry_errors, keepalive_fails, tcp_fallbacks;
    /* the send window (bex_sock_stats; window_bytes changes by deltas) */
    _Atomic uint64_t window_bytes, window_base_us, window_delay_us, window_cuts, dest_bound_hits,
        dest_max_inflight;
    _Atomic uint64_t keepalive_writes;
    /* receive completions a poll turn dispatched, and the connections that
     * had any in a turn, once per turn (conn/thread.c) */
    _Atomic uint64_t poll_recvs, poll_recv_conns;
    /* ibv_poll_cq calls and those that found nothing (bex__stat_poll),
     * CQ armings and completion events read (conn/thread.c) */
    _Atomic uint64_t cq_polls, cq_polls_empty, cq_arms, cq_events;
    /* loop turns that found nothing to do (conn/thread.c) */
    _Atomic uint64_t empty_turns;
};
#define BEX__STAT_ADD(st, field, n) bex__count_add(&(st)->field, (n))

/* One ibv_poll_cq call that gave n (bex_sock_stats.cq_polls and
 * cq_polls_empty). */
static inline void bex__stat_poll(struct bex__stats *st, int n)
{
    BEX__STAT_ADD(st, cq_polls, 1);
    if (n == 0)
        BEX__STAT_ADD(st, cq_polls_empty, 1);
}

/* How often an idle connection writes its keepalive: every keepalive_ms,
 * or less often when the peer's timeout (its hello's ka_timeout_ms; 0:
 * not known) allows: a quarter of it, so three keepalives may be late or
 * lost before the peer gives up. Never more often than keepalive_ms, so a
 * peer's tiny timeout costs us nothing more than before. */
static inline uint32_t bex__keepalive_send_ms(uint32_t keepalive_ms, uint32_t peer_timeout_ms)
{
    uint32_t quarter = peer_timeout_ms / 4;
    return quarter > keepalive_ms ? quarter : keepalive_ms;
}

#endif
