/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport: a connection's messages over the TCP connection its
 * setup ran on (docs/protocol.md, "Data path over TCP").
 *
 * Frames are the 32-byte header of wire/hdr.h followed by payload. A
 * message goes as one or more DATA (or DIRECT) frames of at most frag_size
 * payload bytes, one frame per stream per scheduler turn, so a large
 * message delays the small messages of other sockets by at most one
 * fragment each, as over RDMA. Sends are written with sendmsg straight from
 * the application's bemalloc buffers (no staging copy); receives are read
 * straight into recv_pool buffers, which go to the application as they are.
 * Every header carries in its credits field the number of the peer's
 * messages received whole since the last header (with nothing else to
 * send, a CREDIT frame carries them, held back briefly for a frame that
 * may follow: ack_due in tcp.c): a message is reported
 * sent (0) when the peer acknowledged it, in doubt (-EIO) when the
 * connection failed after its last byte was written, and -ECANCELED when
 * it was never written whole.
 *
 * Everything here runs on the connection's I/O thread. */
#ifndef BEX_TRANSPORT_TCP_H
#define BEX_TRANSPORT_TCP_H

#include <stdatomic.h>
#include <stdint.h>

#include "loop/loop.h"
#include "transport/thread.h"
#include "transport/transport.h"

/* How long acknowledgements may wait for a frame to carry them: an answer
 * or a next message from another thread comes within tens of microseconds;
 * the sender of a one-way stream sees its messages reported this much
 * later at most (ACK_MAX in tcp.c bounds the count held). */
#define BEX__TCP_ACK_DELAY_US 200
/* bex_ctx_config.tcp_ack_delay_us's ceiling: an idle connection's
 * keepalive carries owed acknowledgements anyway */
#define BEX__TCP_ACK_DELAY_MAX_US 1000000

struct bex__tcp_config {
    uint32_t max_msg;      /* the largest message we accept */
    uint32_t peer_max_msg; /* the largest the peer accepts (its hello) */
    uint32_t frag_size;    /* payload bytes per frame at most */
    uint32_t keepalive_ms, keepalive_timeout_ms;
    uint32_t peer_ka_timeout_ms; /* the peer's keepalive timeout (its hello; 0:
                                    not known): we write keepalives every
                                    bex__keepalive_send_ms */
    uint32_t ack_delay_us;       /* acknowledgements wait this long at most for a
                                    frame to carry them (0: BEX__TCP_ACK_DELAY_US) */
    uint32_t stall_ms;           /* our messages written whole that wait this long for
                                    the peer's acknowledgement, or reading paused this
                                    long for room while partly received messages are
                                    held (only reading on finishes them), fail the
                                    connection (0: never) */
    uint32_t parts_max;          /* the peer's messages partly received at once at most */
    /* The receive budget's fair share (recv_bytes_max): a DATA message
     * starts only while the connection's partly received messages stay
     * within max(recv_max / (other connections holding some + 2),
     * share_min), or with no other connection holding any; and a connection
     * holding some must receive min_rate bytes a second of them over each
     * rate_window_ms while we read (0: no check), else it fails. */
    uint64_t share_min;
    uint32_t min_rate, rate_window_ms;
    char name[48]; /* how log lines name the connection: "peer a.b.c.d:port (engine N)" */
};

/* A TCP transport on fd (non-blocking, connected, setup done), which the
 * caller keeps owning (it closes it after on_fail or destroy) and watches
 * in loop with tag: it hands the fd's events to bex__tcp_events. sh gives
 * the pools, statistics, log and received-memory accounting (its RDMA
 * fields are not used). */
int bex__tcp_create(struct bex__engine_shared *sh, const struct bex__tcp_config *cfg,
                    const struct bex__transport_upcalls *up, void *user, int fd,
                    struct bex__loop *loop, struct ep_tag *tag, struct bex__xport **out);
/* Bytes of the setup not yet written: they go out ahead of every frame. */
int bex__tcp_prefix(struct bex__xport *x, const void *p, size_t n);
/* The connection is up: on_up, then traffic. */
void bex__tcp_start(struct bex__xport *x);
/* The fd's epoll events: read, write, then progress. Whether progress has
 * more to move at once (its return): the caller visits it again only then. */
bool bex__tcp_events(struct bex__xport *x, uint32_t events);
extern const struct bex__transport_ops bex__tcp_transport;
bool bex__xport_is_tcp_wrapped(const struct bex__xport *x);
/* Is x the TCP transport (or a test's wrapper of it)? Inline: an up
 * connection's every event asks (issue 25 item 5). */
static inline bool bex__xport_is_tcp(const struct bex__xport *x)
{
    return (x && x->ops == &bex__tcp_transport) || bex__xport_is_tcp_wrapped(x);
}
/* It failed because its TCP connection did (EOF, reset, a write error):
 * nothing was logged, the connection says whether that was a loss
 * (bex__conn_lost). */
bool bex__tcp_link_lost(const struct bex__xport *x);

/* Tests only (tests/rpc/fakenet.h): while set, every TCP transport
 * bex__tcp_create makes may be wrapped by a transport of the test's, which
 * forwards the ops to it and stands between it and the upcalls, so that a
 * test can fail a connection, drop, hold or garble messages at exact points
 * of the transport contract. The wrapper's ops table has `inner`; the
 * functions above take the wrapper as well. Never set by the library. */
struct bex__tcp_wrap {
    /* For a TCP transport about to be made with (up, user): the wrapper's
     * transport (its ops, user = user), with *iup and *iuser set to what
     * the TCP transport reports to instead; NULL: this one is not wrapped. */
    struct bex__xport *(*wrap)(void *arg, struct bex__engine_shared *sh,
                               const struct bex__tcp_config *cfg, int fd, struct bex__loop *loop,
                               struct ep_tag *tag, const struct bex__transport_upcalls *up,
                               void *user, const struct bex__transport_upcalls **iup, void **iuser);
    /* The TCP transport inside outer was made (inner), or not (NULL: the
     * wrapper frees itself). */
    void (*made)(struct bex__xport *outer, struct bex__xport *inner);
    void *arg;
};
extern _Atomic(const struct bex__tcp_wrap *) bex__tcp_wrap_test;

#endif
