/* SPDX-License-Identifier: Apache-2.0 */
/* fakenet: a fault-injecting transport for the RPC unit tests
 * (tests/rpc/test_rpc_fake.c).
 *
 * Installed (fn_install), it wraps every TCP transport the library makes
 * (the test-only hook bex__tcp_wrap_test, transport/tcp/tcp.h): the
 * wrapper forwards the transport ops to the real TCP transport underneath
 * and stands between it and the sock layer's upcalls. Bytes still move
 * over loopback TCP; what the wrapper adds is control at the exact points
 * of the transport contract (transport/transport.h), which real sockets do
 * not give a test:
 *  - rules, matched per connection and per RPC message (the RPC header of
 *    each message is decoded): drop a request or a response as it
 *    arrives, fail the connection before or after handing one up, fail it
 *    instead of sending a request (the request never leaves), garble a
 *    request's RPC header, or stop reading a connection altogether;
 *  - fn_fail_conns: fail connections on demand (on their I/O thread);
 *  - bookkeeping of the contract itself, on every wrapped connection of
 *    every test: each message handed to send must come back through
 *    on_send_done exactly once, before the transport is destroyed; a
 *    second hand-back, an unknown one, or one missing at destroy is a
 *    violation (fn_violations).
 * Rules and counters are shared by every wrapper (a mutex and atomics);
 * everything a wrapper does to its connection runs on that connection's
 * I/O thread. */
#ifndef BEX_TESTS_FAKENET_H
#define BEX_TESTS_FAKENET_H

#include <stdbool.h>
#include <stdint.h>

#include "bex/sock.h"

/* Which connections a rule applies to. */
enum {
    FN_CLIENT = 1, /* client side: connections whose peer is port */
    FN_SERVER = 2, /* server side: connections accepted on port */
};

/* What a rule does to a matching message (dir FN_RX: as it arrives;
 * FN_TX: as the sock layer hands it to the transport). */
enum {
    FN_RX = 1,
    FN_TX = 2,
};
enum {
    FN_DROP = 1,        /* RX: lose it (its buffer freed; the transport had
                           acknowledged it) */
    FN_FAIL_BEFORE = 2, /* RX: lose it and fail the connection at once;
                           TX: hold it and fail the connection on its thread's
                           next turn (it comes back -ECANCELED, never sent) */
    FN_FAIL_AFTER = 3,  /* RX: hand it up, then fail the connection (whatever
                           the handler answered at once is lost with it) */
    FN_GARBLE = 4,      /* TX: flip the RPC header's magic before it goes */
    FN_NO_READ = 5,     /* the connection is never read (dir, kind ignored);
                           the peer's writes stall once the socket buffers are
                           full; its close is still seen */
    FN_SMALL_BUF = 6,   /* connections made after it get 32 KiB socket send
                           and receive buffers (dir, kind, count ignored) */
    FN_IN_DOUBT = 7,    /* TX: sent as usual, but its hand-back is held until
                           the connection receives its next RPC message (the
                           answer: the peer surely handled it), which is
                           dropped; then it comes back -EIO (in doubt) and the
                           connection fails (one such message per connection) */
};

/* fn_rule.kind of the recovery ladder's probe (a request for
 * BEX_RPC_SERVICE_PING), which BEX__RPC_REQUEST does not match. */
enum { FN_PING = 100 };

struct fn_rule {
    int side;       /* FN_CLIENT or FN_SERVER */
    uint16_t port;  /* host order */
    const void *sh; /* only connections of this I/O thread (fn_sh); NULL: any */
    int dir;        /* FN_RX, FN_TX */
    int kind;       /* BEX__RPC_REQUEST, _RESPONSE, FN_PING; 0: any RPC message */
    int action;     /* FN_* above */
    int count;      /* times it applies (then it is spent); -1: always */
};

/* Install the hook (before the contexts are made); uninstall once every
 * context is destroyed. */
void fn_install(void);
void fn_uninstall(void);
/* Add a rule; returns its index for fn_hits. */
int fn_add(const struct fn_rule *r);
/* Remove every rule (connections already stopped from reading stay so). */
void fn_clear(void);
/* How many times rule i applied. */
int fn_hits(int i);
/* Fail every live connection of `side` on port (on its I/O thread, within
 * a tick): returns how many were marked. */
int fn_fail_conns(int side, uint16_t port);
/* The I/O thread identity of a context's first thread, for fn_rule.sh. */
const void *fn_sh(bex_ctx *ctx);

/* Counters over every wrapped connection. */
uint64_t fn_violations(void); /* contract breaches seen (each printed) */
uint64_t fn_sent(void);       /* messages handed to send */
uint64_t fn_returned(void);   /* ... and handed back */
int fn_live(void);            /* wrapped transports not destroyed yet */
/* Whether a message of at least 1 MiB was seen part-way through its
 * transfer (some of it framed and written, not all) on a client side
 * connection. */
bool fn_partial_seen(void);
/* Whether such a message was seen framed whole (every byte handed to the
 * socket or queued for it in frames) and not yet handed back. */
bool fn_framed_seen(void);

#endif
