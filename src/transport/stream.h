/* SPDX-License-Identifier: Apache-2.0 */
/* The stream core both transports specialise (libuv's habit: one stream
 * base, src/unix/stream.c, that TCP, pipes and TTYs share).
 *
 * What is the same over RDMA and TCP is written once here: a transport
 * instance's set of streams (every one, and a scheduler ring of those with
 * something to send), attach, unlink, a message queued on its stream,
 * the round-robin turn, lookup by id, the hold-back of owed
 * acknowledgements and the handling of a peer's protocol violation. What
 * differs stays in the transport: what a turn sends (work requests, socket
 * frames), how a stream closes on the wire, how a failure hands messages
 * back. Everything here runs on the transport's I/O thread. */
#ifndef BEX_TRANSPORT_STREAM_H
#define BEX_TRANSPORT_STREAM_H

#include <stdbool.h>
#include <stdint.h>

#include "common/list.h"
#include "transport/transport.h"

struct bex__log;

/* A transport instance's streams. The ring holds the streams with
 * something to send in turn order: its first is served next, a stream
 * added goes last (served last in this round). Every operation is O(1)
 * but bex__stream_find. */
struct bex__stream_set {
    struct bex__list all;  /* every attached stream (all_node) */
    struct bex__list ring; /* streams with work (ring_node) */
    uint32_t ring_n;       /* streams in the ring */
};

void bex__stream_set_init(struct bex__stream_set *s);
/* Attach st (its previous contents are forgotten) as stream id; a client
 * stream has an OPEN to send and joins the ring. */
void bex__stream_attach(struct bex__stream_set *s, struct bex__stream *st, uint32_t id,
                        bool client);
/* Take st off the ring and out of the set (idempotent). */
void bex__stream_unlink(struct bex__stream_set *s, struct bex__stream *st);
/* The ring: add at its end (nothing if st is in it), remove, and the
 * stream served next (NULL: the ring is empty). */
void bex__stream_ring_add(struct bex__stream_set *s, struct bex__stream *st);
void bex__stream_ring_remove(struct bex__stream_set *s, struct bex__stream *st);
static inline bool bex__stream_in_ring(const struct bex__stream *st)
{
    return bex__list_linked(&st->ring_node);
}
static inline struct bex__stream *bex__stream_ring_first(const struct bex__stream_set *s)
{
    struct bex__list *n = bex__list_first(&s->ring);
    return n ? bex__list_entry(n, struct bex__stream, ring_node) : NULL;
}
/* The first stream's turn: it moves to the ring's end and is returned. */
struct bex__stream *bex__stream_ring_turn(struct bex__stream_set *s);
/* The first attached stream (the most recently attached), or NULL. */
static inline struct bex__stream *bex__stream_first(const struct bex__stream_set *s)
{
    struct bex__list *n = bex__list_first(&s->all);
    return n ? bex__list_entry(n, struct bex__stream, all_node) : NULL;
}
/* The attached stream id, or NULL. O(streams). */
struct bex__stream *bex__stream_find(const struct bex__stream_set *s, uint32_t id);
/* Append m to st's queue (m->next is cleared). */
void bex__stream_enqueue(struct bex__stream *st, struct bex__msg *m);
/* Empty st's queue: its messages, in order, linked by next. */
struct bex__msg *bex__stream_take_queue(struct bex__stream *st);
/* Walk every attached stream; the body may unlink st. */
#define bex__stream_foreach(st, set, tmp)                                                          \
    for (struct bex__list *tmp##_n = (set)->all.next, *tmp = tmp##_n->next;                        \
         tmp##_n != &(set)->all &&                                                                 \
         ((st) = bex__list_entry(tmp##_n, struct bex__stream, all_node), 1);                       \
         tmp##_n = tmp, tmp = tmp##_n->next)

/* What moves a stream (bex__stream_move). */
enum bex__stream_event {
    BEX__SE_OPEN_SENT,  /* our OPEN went */
    BEX__SE_CLOSE,      /* we close (a no-op once closing) */
    BEX__SE_CLOSE_SENT, /* our CLOSE is posted */
    BEX__SE_CLOSE_DONE, /* ... and completed */
    BEX__SE_PEER_CLOSE, /* the peer's CLOSE arrived: the peer's move */
    BEX__SE_END,        /* both CLOSEs through: the transport lets go */
    BEX__SE_FAIL,       /* the transport failed */
};
/* The one transition function of a stream: 1 when ev moved it, 0 when ev
 * changes nothing there (a second close, or anything on a failed stream),
 * -EPROTO when the peer's CLOSE is illegal in its state (one for a stream
 * whose OPEN it never got, or a second one): the caller fails the
 * transport, nothing aborts. An illegal move of our own asserts. */
int bex__stream_move(struct bex__stream *st, enum bex__stream_event ev);
/* The state's name, for logs. */
const char *bex__stream_state_name(unsigned state);
/* Our OPEN is still to send. */
static inline bool bex__stream_owes_open(const struct bex__stream *st)
{
    return st->state == BEX__S_OPENING || st->state == BEX__S_OPENING_CLOSE;
}
/* Our CLOSE is asked (by us, or answering the peer's) and still to send. */
static inline bool bex__stream_owes_close(const struct bex__stream *st)
{
    return st->state == BEX__S_OPENING_CLOSE || st->state == BEX__S_CLOSING ||
           st->state == BEX__S_PEER_CLOSED;
}
/* A close was asked, of either side (the stream takes no more messages). */
static inline bool bex__stream_closing(const struct bex__stream *st)
{
    return st->state != BEX__S_OPENING && st->state != BEX__S_OPEN && st->state != BEX__S_FAILED;
}
/* It takes messages: open, or opening. */
static inline bool bex__stream_open(const struct bex__stream *st)
{
    return st->state == BEX__S_OPENING || st->state == BEX__S_OPEN;
}
/* Failed or ended: never scheduled again. */
static inline bool bex__stream_gone(const struct bex__stream *st)
{
    return st->state == BEX__S_FAILED || st->state == BEX__S_ENDED;
}

/* Owed acknowledgements wait up to delay_us for a message to carry them:
 * the first call holds them (*held: when, in bex__now_us() time; x->due_us
 * set so that the I/O thread calls progress then), later ones tell whether
 * that time has passed. */
bool bex__ack_hold_due(struct bex__xport *x, uint64_t *held, uint32_t delay_us);

/* The bit of a connection's "said" word (bex__log_once) its violation
 * line takes: the peer's fault is logged once per connection. */
#define BEX__SAID_VIOLATION 1u

/* The peer broke the protocol (what says how): one WARN naming the
 * connection (name) and its transport, once per connection (the
 * BEX__SAID_VIOLATION bit of *said), the log's rate limit over all;
 * returns -EPROTO, with which the caller fails the connection. A peer's
 * fault is never an ERROR: that level is for our own. */
int bex__stream_violation(struct bex__log *log, const char *name, const char *transport,
                          uint32_t *said, const char *what);

#endif
