/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport's private header: its structures and the functions
 * its files share (tcp.c, and the files split from it along its banners).
 * Nothing outside src/transport/tcp/ includes it; the contract is tcp.h. */
#ifndef BEX_TRANSPORT_TCP_INTERNAL_H
#define BEX_TRANSPORT_TCP_INTERNAL_H

#include <stdlib.h>

#include "common/hash.h"
#include "common/log.h"
#include "common/util.h"
#include "transport/stream.h"
#include "transport/tcp/tcp.h"
#include "wire/hdr.h"

#define OUT_MAX   64  /* frames in the write batch */
#define IOV_BATCH 128 /* sendmsg gathers at most this many pieces */
/* Acknowledgements owed for this many of the peer's messages go at once,
 * in a CREDIT frame if nothing else carries them: a full read batch
 * (RX_MSGS), so a one-way stream gets them no later than before. */
#define ACK_MAX 16
/* Bytes a read takes beyond the frame being received: the next headers
 * and small payloads, so that one readv per wake-up takes a small message
 * whole (its payload copied from here once) and a short read says the
 * socket is drained. */
#define RX_STAGE 1024

/* A TCP connection's state (docs/architecture.md): NEW (made by
 * bex__tcp_create, the setup's last bytes may be queued) -> UP
 * (bex__tcp_start) -> DEAD (bex__tcp_fail, from either; synchronous: every
 * message and stream handed back before on_fail returns). Only
 * bex__tcp_move changes it. */
enum bex__tcp_state { T_NEW, T_UP, T_DEAD };

/* One frame of the write batch: its header, and the payload slice it sends
 * straight from the message's buffer. */
struct out_frame {
    uint8_t hdr[BEX__HDR_LEN];
    struct bex__msg *m;     /* DATA/DIRECT: its message, else NULL */
    const uint8_t *p;       /* payload */
    uint32_t plen;          /* payload bytes */
    bool last;              /* m's last frame: m is reported from here */
    bool cut;               /* m was cut off (the peer closed its stream) */
    bool raw;               /* no header: the setup's last bytes (bex__tcp_prefix) */
    struct bex__stream *st; /* CLOSE of one of ours: close_done when written */
};

/* A control frame waiting for room in the batch. */
struct ctl {
    uint8_t type;
    uint32_t stream;
    struct bex__stream *st; /* our CLOSE: the stream */
};

/* A message of the peer's arriving in fragments. */
struct part {
    uint32_t stream;
    bool direct;
    uint32_t token; /* direct */
    uint8_t *buf;
    uint32_t len, off;
    bool held; /* counted in part_bytes (a DATA message not staged whole) */
};

struct bex__tcp {
    struct bex__xport x; /* first */
    const struct bex__transport_upcalls *up;
    struct bex__engine_shared *sh;
    struct bex__tcp_config cfg;
    int fd;
    struct bex__loop *loop;
    struct ep_tag *tag;
    uint32_t events;           /* what we watch now */
    enum bex__tcp_state state; /* changed only by bex__tcp_move */
    bool rx_paused;            /* recv_bytes_max: not reading until there is room */
    bool pause_own;            /* paused by the connection's own share (recv_share) */
    uint64_t paused_ms;        /* bex__now_ms() when reading paused */
    /* streams: every one, and those with something to send (a ring) */
    struct bex__stream_set streams;
    /* write side */
    struct out_frame out[OUT_MAX];
    uint32_t out_head, out_n;
    size_t out_off; /* bytes of out[out_head] already written */
    struct ctl *ctlq;
    uint32_t ctl_head, ctl_n, ctl_cap;
    struct bex__msg *ack_head, *ack_tail; /* written whole, not yet acknowledged */
    uint32_t ack_n;
    uint64_t ack_wait_ms; /* since when the head of that queue waits (the queue
                             filled, or the peer's last acknowledgement) */
    uint32_t acks_owed;   /* the peer's messages received whole, not yet acknowledged */
    uint64_t ack_held;    /* bex__now_us() when they were first held back for a
                             frame to carry them (0: not held); x.due_us is
                             ack_held + ack_delay_us */
    bool ack_now;         /* held acknowledgements found no frame in time: the
                             peer's messages get no answer now, acknowledge at
                             once until one does (see ack_due) */
    uint64_t msg_in_us;   /* ack_now: when the peer's last message arrived */
    /* read side */
    uint8_t rhdr[BEX__HDR_LEN];
    uint32_t rhdr_len;
    uint8_t stage[RX_STAGE]; /* read ahead: stage[stage_off..stage_end) not taken yet */
    uint32_t stage_off, stage_end;
    struct part one; /* a message arriving in one frame: no allocation, no map entry */
    bool one_busy;
    bool in_payload; /* reading the payload of hdr */
    bool need_buf;   /* hdr read; its message waits for room to be received */
    struct bex__hdr hdr;
    struct part *cur;       /* where the payload goes (NULL: discarded) */
    uint32_t cur_left;      /* payload bytes of the frame still to read */
    struct bex__hmap parts; /* stream id -> its partly received message */
    uint32_t parts_n;
    uint64_t part_bytes; /* DATA messages partly received: their lengths */
    bool holding;        /* counted in the context's holders (part_bytes > 0) */
    uint64_t part_rx;    /* payload bytes read into partly received messages */
    uint64_t rate_ms;    /* holding: start of the rate window (bex__now_ms) */
    uint64_t rate_rx;    /* part_rx then */
    uint64_t last_rx, last_tx;
    uint64_t ka_period; /* the keepalive grid's period of the last tick (timers.c) */
    uint64_t rx_ms;     /* bex__now_ms() when the running bex__tcp_rx began */
    /* rx_ms while bex__tcp_events runs after a read, else 0: its writes'
     * time (bex__tcp_flush), one clock read a message fewer (issue 25) */
    uint64_t ev_ms;
    uint64_t msgs_in; /* the peer's messages received whole */
    uint32_t said;    /* lines logged once (bex__log_once): BEX__SAID_VIOLATION */
    bool link_lost;   /* failed because the TCP connection did (EOF, reset, write error) */
    uint8_t *prefix;
};

static inline struct bex__tcp *tcp_of(struct bex__xport *x)
{
    return bex__container_of(x, struct bex__tcp, x);
}

/* ---- functions shared by the module's files ---- */
/* The one place t's state changes: names the move in the debug log and
 * asserts it is NEW -> UP or a live state -> DEAD (our code makes every
 * move; a peer only fails the connection, which a dead one ignores). */
void bex__tcp_move(struct bex__tcp *t, enum bex__tcp_state to);
const char *bex__tcp_state_name(enum bex__tcp_state s);
void bex__tcp_fail(struct bex__xport *x, int err);
bool bex__tcp_ctl_push(struct bex__tcp *t, uint8_t type, uint32_t stream, struct bex__stream *st);
bool bex__tcp_progress(struct bex__xport *x);
void bex__tcp_rx(struct bex__tcp *t);
/* A keepalive is due at this tick (now, ms; timers.c; also ka_period's
 * update: call once per tick). */
bool bex__tcp_keepalive_due(struct bex__tcp *t, uint64_t now);
unsigned bex__tcp_tick(struct bex__xport *x, uint64_t now);
struct bex__xport *bex__tcp_unwrap(struct bex__xport *x);
/* The events t watches made ev (unless t is dead). */
void bex__tcp_want_change(struct bex__tcp *t, uint32_t ev);
/* Watch what t waits for now. Inline: every progress call asks, and the
 * answer is nearly always "as before" (a call and its frame were some 10
 * instructions a message, issue 25 item 5). */
static inline void bex__tcp_want(struct bex__tcp *t)
{
    /* Paused, neither: the peer's EOF waits behind the bytes not read, and
     * EPOLLRDHUP, level-triggered, would wake the loop on every turn. */
    uint32_t ev = 0;
    if (!t->rx_paused)
        ev |= EPOLLIN | EPOLLRDHUP;
    if (t->out_n || t->ctl_n)
        ev |= EPOLLOUT;
    if (ev != t->events)
        bex__tcp_want_change(t, ev);
}
uint64_t bex__tcp_recv_share(struct bex__tcp *t);
void bex__tcp_hold_note(struct bex__tcp *t);
void bex__tcp_part_unhold(struct bex__tcp *t, const struct part *p);
void bex__tcp_done(struct bex__tcp *t, struct bex__msg *m, int status);
void bex__tcp_part_free(struct bex__tcp *t, struct part *p);
void bex__tcp_violation(struct bex__tcp *t, const char *what);
void bex__tcp_stream_maybe_end(struct bex__tcp *t, struct bex__stream *st);

/* p's memory back: the connection's one part marked free, any other
 * freed. Inline: a message completed in the one part pays no call (issue
 * 25 item 2). */
static inline void bex__tcp_part_release(struct bex__tcp *t, struct part *p)
{
    if (p == &t->one)
        t->one_busy = false;
    else
        free(p);
}
int bex__tcp_flush(struct bex__tcp *t);
void bex__tcp_ring_add(struct bex__tcp *t, struct bex__stream *st);
void bex__tcp_attach(struct bex__xport *x, struct bex__stream *st, uint32_t id, bool client);
struct bex__msg *bex__tcp_send_now(struct bex__stream *st, struct bex__msg *m,
                                   struct bex__xport *x);
void bex__tcp_send(struct bex__xport *x, struct bex__stream *st, struct bex__msg *m);
void bex__tcp_close_stream(struct bex__xport *x, struct bex__stream *st);
void bex__tcp_peer_closed(struct bex__xport *x, struct bex__stream *st);
int bex__tcp_refuse_stream(struct bex__xport *x, uint32_t id);

#endif
