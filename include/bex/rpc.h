/* SPDX-License-Identifier: Apache-2.0 */
/* bex RPC: request/response over bex sockets (paper §7: the RPC layer,
 * which knows the service, owns timeouts, retries and replica choice; the
 * transport only reports failures).
 *
 * A server (bex_rpc_server) listens on a context and dispatches requests to
 * handlers registered by (service id, method id). A handler may answer at
 * once or later, from any thread, through the request handle it was given.
 * A client opens a channel (bex_rpc_channel) over a list of endpoints
 * (addresses with locality labels) and calls asynchronously: every call has
 * a deadline and completes exactly once, through its completion callback,
 * with the response or an error. Many calls may be outstanding on a
 * channel; a call id in the wire header matches responses to calls.
 *
 * Bodies are zero-copy: a request or response body is a buffer from
 * bex_rpc_alloc() (bemalloc memory of the context with room for the RPC
 * header in front of it), or a body the RPC layer delivered (a request a
 * handler got, a response a completion got), which has that room too. Large
 * bodies travel by the socket layer's rendezvous (WRITE fragments straight
 * into a buffer the receiver allocated). Free bodies with bex_rpc_free().
 *
 * Failures: a failed or timed out attempt is retried with a configurable
 * probability, within a retry budget (retries bounded as a share of recent
 * calls, like gRPC's retry throttling), on another endpoint when the
 * channel has one; the call's deadline is never exceeded. An attempt
 * refused before its request was sent (a connection refused) costs no
 * attempt the first time its endpoint refuses the call; a timed out
 * attempt stays out beside the retry, and the call ends with the first
 * answer: it fails only when no attempt out may still be answered.
 * Methods a server
 * registers as state-changing (BEX_RPC_METHOD_WRITE) are applied at most
 * once per (client id, sequence) within the server's dedup window; a retry
 * of an applied call gets the first result. docs/protocol.md ("RPC") has
 * the wire header and the window's rules.
 *
 * Threads: every function may be called from any thread, callbacks
 * included, unless its comment says otherwise. Callbacks (handlers,
 * completions) must not block for long: they run on the context's I/O
 * thread or on the channel's timer thread. */
#ifndef BEX_RPC_H
#define BEX_RPC_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/common.h"
#include "bex/sock.h"

#ifdef __cplusplus
extern "C" {
#endif

#pragma GCC visibility push(default)

typedef struct bex_rpc_server bex_rpc_server;
typedef struct bex_rpc_req bex_rpc_req;
typedef struct bex_rpc_channel bex_rpc_channel;

/* Bytes of header room bex_rpc_alloc() keeps in front of every body. */
#define BEX_RPC_HDR_LEN 64

/* ---- bodies ---- */

/* A body of len bytes (bemalloc memory of ctx, header room in front).
 * NULL on failure. Free with bex_rpc_free() unless passed to bex_rpc_call
 * or bex_rpc_reply, which take it over. */
void *bex_rpc_alloc(bex_ctx *ctx, size_t len);
/* Free a body from bex_rpc_alloc() or one the RPC layer delivered; any
 * thread; NULL is ignored. */
void bex_rpc_free(void *body);

/* ---- server ---- */

/* Registration flags. WRITE: the method changes state; a request of it is
 * applied at most once per (client id, token, sequence) and a retry gets
 * the first answer (docs/protocol.md, "Dedup window"; the token is the
 * channel's random one, so a peer that knows a client id alone cannot
 * touch that client's record: docs/security.md, "Dedup keys and Push ids"). */
enum { BEX_RPC_METHOD_WRITE = 1u << 0 };

/* A handler: a request for (service, method) arrived. body (len bytes,
 * NULL when len is 0) belongs to the handler: free it with bex_rpc_free()
 * or send it back as the response. The handler must answer req exactly
 * once with bex_rpc_reply(), now or later, from any thread. Runs on the
 * I/O thread. */
typedef void (*bex_rpc_handler)(bex_rpc_req *req, void *body, size_t len, void *user);

/* clang-format off */
#define BEX_RPC_SERVER_CONFIG_INIT {.size = sizeof(bex_rpc_server_config)}
/* clang-format on */
typedef struct bex_rpc_server_config {
    size_t size;                 /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    uint32_t dedup_window;       /* sequences remembered per client (256) */
    uint32_t dedup_clients;      /* clients remembered (1024); the least recently
                                    seen one is forgotten beyond it only when
                                    nothing of it is pending and it was unseen
                                    for dedup_horizon_ms; else a new client is
                                    refused -EAGAIN (retriable) */
    uint32_t dedup_resp_max;     /* largest response kept for a retry, bytes
                                    (65536); a retry of a call whose answer was
                                    larger gets -ESTALE */
    uint32_t dedup_horizon_ms;   /* the retry horizon (300000): longer than
                                    any client's call deadline */
    uint32_t dedup_new_per_sec;  /* new client ids a second (1000) */
    uint32_t dedup_new_per_conn; /* new client ids one connection may bring (64) */
} bex_rpc_server_config;

/* Create a server on ctx (cfg may be NULL). Returns 0, -EINVAL, -ENOMEM. */
int bex_rpc_server_create(bex_ctx *ctx, const bex_rpc_server_config *cfg, bex_rpc_server **out);

/* The RPC layer's own service id: a request for (BEX_RPC_SERVICE_PING, 0)
 * is answered by the server itself, status 0 and no body (the recovery
 * ladder's probe of a connection). Not for applications. */
#define BEX_RPC_SERVICE_PING 0xFFFFFFFFu

/* Register fn for (service, method) with BEX_RPC_METHOD_* flags. Only
 * before bex_rpc_server_listen. Returns 0, -EEXIST, -EINVAL (flags,
 * BEX_RPC_SERVICE_PING, or after listen), -ENOMEM. */
int bex_rpc_server_register(bex_rpc_server *srv, uint32_t service, uint32_t method, uint32_t flags,
                            bex_rpc_handler fn, void *user);

/* Listen on addr (port 0 picks one); bex_rpc_server_addr tells which.
 * Once. Returns 0 or bex_listen's error. */
int bex_rpc_server_listen(bex_rpc_server *srv, const bex_addr *addr);
void bex_rpc_server_addr(const bex_rpc_server *srv, bex_addr *out);

/* Answer req: status 0 or a negative errno for the caller's completion,
 * and body (len bytes; from bex_rpc_alloc of the server's context or a
 * delivered body; NULL for none), which bex owns from here on, whatever
 * the return. Exactly once per request, from any thread. Returns 0, or
 * -EPIPE when the request's connection is gone (the answer is dropped;
 * for a WRITE method it is still kept for a retry), -ENOMEM. */
int bex_rpc_reply(bex_rpc_req *req, int status, void *body, size_t len);

/* The (client id, sequence) a request carries, e.g. for a handler's own
 * records. */
void bex_rpc_req_ids(const bex_rpc_req *req, uint64_t *client_id, uint64_t *seq);

typedef struct bex_rpc_server_stats {
    uint64_t requests;        /* requests dispatched to handlers */
    uint64_t replies;         /* answers sent */
    uint64_t no_method;       /* requests for an unregistered method (-ENOSYS) */
    uint64_t bad_header;      /* connections closed for a malformed header */
    uint64_t dup_replayed;    /* WRITE retries answered with the first answer */
    uint64_t dup_pending;     /* WRITE retries while the first was not answered yet: not
                                 applied; the first answer goes to the latest of them too */
    uint64_t stale;           /* WRITE retries past the window (-ESTALE) */
    uint64_t clients_refused; /* WRITEs of a new client refused (-EAGAIN): table full
                                 of live clients, or past dedup_new_per_sec / _per_conn */
    uint64_t conns;           /* connections accepted */
    uint64_t pings;           /* probes (BEX_RPC_SERVICE_PING) answered */
} bex_rpc_server_stats;
void bex_rpc_server_stats_get(bex_rpc_server *srv, bex_rpc_server_stats *out);

/* The counters of servers srvs[0..n) and, per registered method (labels
 * service and method, as numbers), the requests its handler answered,
 * those with an error status, and a histogram of the time from dispatch
 * to the answer (bex_rpc_server_latency_seconds, buckets at 2^10, 2^12,
 * ... 2^34 ns), in Prometheus text exposition format (metric names
 * bex_rpc_server_*, label server="<names[i]>"; names or an entry NULL:
 * "default"; each family once, every server's samples in it),
 * NUL-terminated, into buf (cap bytes). Returns the length it needed
 * (without the NUL), like snprintf: output is cut when that is >= cap;
 * -EINVAL, -ENOMEM. */
int bex_rpc_server_prometheus(bex_rpc_server *const *srvs, const char *const *names, size_t n,
                              char *buf, size_t cap);

/* Stop listening, close every connection and wait for them to go. Requests
 * not answered yet may still be answered (their answers are dropped);
 * the server's memory goes with the last of them. Answer every request
 * before destroying the context. Returns 0, or -EDEADLK (nothing done)
 * from a callback of the context. */
int bex_rpc_server_destroy(bex_rpc_server *srv);

/* Drain before bex_rpc_server_destroy (a graceful stop): stop listening (no
 * new connection is accepted), then wait until every request received so
 * far has been answered, or timeout_ms passed. Requests arriving meanwhile
 * on connections already open are served as usual (and waited for): take
 * the server out of the directory first, so that clients stop sending.
 * Returns 0 when nothing is unanswered, -ETIMEDOUT when something still
 * was at the deadline, -EINVAL, -EDEADLK (nothing done) from a callback of
 * the context. Not concurrently with destroy. */
int bex_rpc_server_drain(bex_rpc_server *srv, uint32_t timeout_ms);

/* ---- client ---- */

/* One endpoint of a channel: a server's address and where it is. */
typedef struct bex_rpc_endpoint {
    bex_addr addr;
    const char *locality; /* e.g. "dc1/pod3" (copied; NULL: none) */
    uint32_t transport;   /* BEX_TRANSPORT_* for this endpoint (0: the context's) */
} bex_rpc_endpoint;

/* Channel configuration; zero in any field means its default. */
/* clang-format off */
#define BEX_RPC_CHANNEL_CONFIG_INIT {.size = sizeof(bex_rpc_channel_config)}
/* clang-format on */
typedef struct bex_rpc_channel_config {
    size_t size; /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    const bex_rpc_endpoint *endpoints; /* the endpoint list (copied) */
    size_t n_endpoints;                /* >= 1 */
    const char *name;                  /* label in the Prometheus dump ("default") */
    uint32_t request_timeout_ms;       /* Tr: a call's deadline, all attempts (40) */
    uint32_t connect_timeout_ms;       /* Tc: an endpoint's connection not up by
                                          then fails its attempts (10) */
    uint32_t attempt_timeout_ms;       /* an attempt unanswered this long is
                                          retried (0: only failures are) */
    uint32_t max_attempts;             /* attempts per call, the first included (3;
                                          1: no retries) */
    uint32_t retry_permille;           /* chance a retryable failure is retried,
                                          per mille (1000) */
    uint32_t retry_budget_permille;    /* retry tokens each call earns, per mille
                                          of a retry (100: retries <= 10 % of calls
                                          plus the burst) */
    uint32_t retry_budget_burst;       /* tokens at start and at most (10) */
    uint32_t holddown_ms;              /* after a connection failure an endpoint
                                          is avoided this long when another one
                                          is there (100) */
    uint64_t client_id;                /* (0: random) */
    /* Directory mode (include/bex/dir.h): endpoints NULL, n_endpoints 0;
     * each attempt goes to the replica of (service, shard) the directory
     * picks for locality (nearest healthy, least outstanding, quarantine
     * respected), and the outcomes are reported to it; connections to
     * replicas the directory stops listing are closed within about a
     * second (their calls retried). dir must outlive the channel. */
    struct bex_dir *dir;
    const char *service; /* the directory's service name (copied) */
    uint32_t shard;
    const char *locality; /* this client's, e.g. "dc1/pod2" (copied; NULL:
                             none, every replica equally near) */
    /* Recovery ladder (docs/architecture.md, "Recovery ladder"): an
     * endpoint whose RDMA connection fails is reconnected (a new QP), then
     * avoided for the other replicas, then reached over TCP; from TCP,
     * RDMA is tried again every rdma_retry_ms (30000) by a probe that
     * carries no call. */
    uint32_t rdma_retry_ms;
    /* A connection the ladder makes (step 1's reconnection, an RDMA retry)
     * must answer a ping this soon after it is up, or it failed (0:
     * connect_timeout_ms). */
    uint32_t probe_timeout_ms;
} bex_rpc_channel_config;

/* Create a channel on ctx. Connections are made on first use. Returns 0,
 * -EINVAL, -ENOMEM, -EIO (no randomness for its dedup token: getrandom
 * failed). In directory mode, a call made while its shard has no
 * replica fails with -EHOSTUNREACH. */
int bex_rpc_channel_create(bex_ctx *ctx, const bex_rpc_channel_config *cfg, bex_rpc_channel **out);

/* Replace the channel's endpoint list (eps copied; n >= 1), e.g. from a
 * service directory. Endpoints in both lists (same address and transport)
 * keep their connection and state; the connections of removed ones are
 * closed and the calls out on them are retried on the new list like after
 * a connection failure (within their attempts, deadline and the budget;
 * else they complete with -ECONNABORTED). Returns 0, -EINVAL (also for a
 * channel in directory mode), -ENOMEM (nothing changed), -EPIPE (the
 * channel is being destroyed). */
int bex_rpc_channel_set_endpoints(bex_rpc_channel *ch, const bex_rpc_endpoint *eps, size_t n);

/* Fail every outstanding call with -ECANCELED (each completes once), close
 * the connections and wait for them and for the transport to give every
 * buffer back; then free. Returns 0, or -EDEADLK (nothing done) from a
 * callback (completion or socket callback of this context). */
int bex_rpc_channel_destroy(bex_rpc_channel *ch);

/* A call completed: status 0 and the response body, or the server's
 * status (a negative errno from the handler or the server: -ENOSYS no such
 * method, -ESTALE a retry past the dedup window, ...) with its body if it
 * sent one, or a local error with body NULL: -ETIMEDOUT (deadline),
 * -ECANCELED (bex_rpc_cancel, channel destroyed), -EIO (in doubt: an
 * attempt's request may have reached the server, its send came back in
 * doubt, and no attempt got an answer: it may or may not have been
 * applied; every attempt carried the same sequence, so a WRITE was applied
 * at most once), -ECONNRESET, -ECONNREFUSED, ... (the last attempt's
 * connection failure, no attempt in doubt). body
 * belongs to the callee: free it with bex_rpc_free(). Runs once per call,
 * on the I/O thread, the channel's timer thread, or the thread calling
 * bex_rpc_cancel, bex_rpc_channel_set_endpoints or bex_rpc_channel_destroy
 * (or bex_rpc_call itself, when every attempt failed at once), never with
 * a lock of the channel held: it may call again. */
typedef void (*bex_rpc_done_fn)(int status, void *body, size_t len, void *user);

enum { BEX_RPC_CALL_NO_RETRY = 1u << 0 };
typedef struct bex_rpc_call_opts {
    uint32_t timeout_ms; /* this call's deadline (0: request_timeout_ms) */
    uint32_t flags;      /* BEX_RPC_CALL_* */
} bex_rpc_call_opts;

/* Call (service, method) with body (len bytes, from bex_rpc_alloc of the
 * channel's context or a delivered body; NULL when len is 0). On 0, bex
 * owns body (it frees it once the transport no longer reads it) and done
 * will run exactly once; *call_id (may be NULL) names the call for
 * bex_rpc_cancel. On error nothing was sent, done will not run and body is
 * the caller's: -EINVAL, -ENOMEM, -EPIPE (channel being destroyed). */
int bex_rpc_call(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body, size_t len,
                 const bex_rpc_call_opts *opts, bex_rpc_done_fn done, void *user,
                 uint64_t *call_id);

/* ---- answers into the caller's buffer ---- */

/* A destination for bex_rpc_call_into: cap bytes of the context's landing
 * memory (the only memory a peer may write, see bex_sock_alloc_exposable)
 * with header room in front. NULL on failure. Free with bex_rpc_free(). */
void *bex_rpc_alloc_dest(bex_ctx *ctx, size_t cap);

/* bex_rpc_call whose answer's body goes straight into dst (cap bytes, from
 * bex_rpc_alloc_dest of the channel's context), which stays the caller's
 * (bex never frees it). Each attempt opens a socket of its own on the
 * endpoint's connection and, over RDMA, exposes dst (with its header room)
 * on it for that attempt alone: the token goes to the server in the
 * request, and the server's RDMA WRITE puts the answer, header first, into
 * it (no rendezvous, no copy). Over TCP, where an exposed buffer must be
 * written whole, the answer comes as a message and is copied into dst,
 * with the same semantics.
 *
 * done gets body == dst (always, whatever the status) and len the answer's
 * body length (0 for a local error). It runs only once dst is retired: no
 * transport writes it any more, also after a deadline, bex_rpc_cancel or a
 * failure while the server was writing (the attempt's socket is closed and
 * done waits for the exposure to come back, so done may come after the
 * deadline by the time the peer takes to answer the close, or until the
 * connection fails). Until then dst must not be freed nor reused.
 * An answer longer than cap is refused by the server, nothing written:
 * status -EMSGSIZE (a server that writes one anyway is refused like a
 * malformed answer, never copied). A retry (to another replica or not)
 * exposes dst afresh with a new token, after the previous attempt's
 * exposure was retired; a write with another call's token (a hostile
 * server: tokens are per connection) is refused like a malformed answer
 * (counted in bad_header; the attempt fails with -EPROTO). An attempt
 * unanswered for attempt_timeout_ms is abandoned rather than left out
 * beside the next one (both would write dst): its socket is closed, and
 * the retry (within max_attempts, the budget and the deadline, as for
 * bex_rpc_call) exposes dst afresh once that exposure is retired; its
 * answer, should it still come, is dropped. With no retry left the
 * attempt stays out until the deadline. Attempts take the recovery
 * ladder's steps, count per endpoint and report to the directory as
 * bex_rpc_call's do. Needs a server of this version
 * (docs/protocol.md, "Caller's destination"). Returns as bex_rpc_call,
 * and -EINVAL for a dst not from bex_rpc_alloc_dest of this context. In
 * landing mode (BEX_REMOTE_ACCESS_LANDING) a hostile server can write any
 * landing memory anyway (docs/security.md); window mode bounds it to the
 * exposed dst. */
int bex_rpc_call_into(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body,
                      size_t len, void *dst, size_t cap, const bex_rpc_call_opts *opts,
                      bex_rpc_done_fn done, void *user, uint64_t *call_id);

/* Complete call_id now with -ECANCELED (its buffers are released once the
 * transport is done with them; a late answer is dropped and counted).
 * Returns 0, or -ENOENT (already completed). */
int bex_rpc_cancel(bex_rpc_channel *ch, uint64_t call_id);

/* The synchronous wrapper: call and wait for the completion. Returns its
 * status; *resp / *resp_len (may be NULL: the body is freed) get the body.
 * Never from a callback of the channel's context (it would wait for
 * itself). */
int bex_rpc_call_sync(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body,
                      size_t len, const bex_rpc_call_opts *opts, void **resp, size_t *resp_len);

/* Per-channel counters (a snapshot). */
typedef struct bex_rpc_channel_stats {
    uint64_t calls;           /* calls accepted by bex_rpc_call */
    uint64_t ok;              /* completed with status 0 */
    uint64_t failed;          /* completed otherwise; by kind below */
    uint64_t fail_timeout;    /* -ETIMEDOUT: the deadline passed */
    uint64_t fail_conn;       /* the last attempt's connection failed */
    uint64_t fail_remote;     /* the server answered with a non-zero status */
    uint64_t fail_cancel;     /* cancelled, or the channel destroyed */
    uint64_t attempts;        /* requests sent, retries included */
    uint64_t retries;         /* attempts after the first */
    uint64_t retry_throttled; /* retries refused by the budget */
    uint64_t late_responses;  /* answers to calls already completed: dropped */
    uint64_t bad_header;      /* connections closed for a malformed answer */
    uint64_t conn_failures;   /* connections that failed or timed out (Tc) */
    uint64_t failovers;       /* retries sent to another endpoint than the
                                 failed or slow attempt's */
    uint64_t endpoints_down;  /* endpoints that went from reachable to failed
                                 (each logged once, and once when it is
                                 reachable again) */
    /* latency of completed calls, microseconds, from the histogram */
    double lat_mean_us, lat_p50_us, lat_p99_us, lat_p999_us;
    /* The recovery ladder (each step logged once when an endpoint takes it) */
    uint64_t ladder_reconnects; /* step 1: a connection failed, reconnect */
    uint64_t ladder_replicas;   /* step 2: the reconnection failed too, calls
                                   go to other replicas */
    uint64_t ladder_tcp;        /* step 3: an RDMA endpoint reached over TCP */
    uint64_t ladder_recovered;  /* reconnections (step 1) that worked */
    uint64_t ladder_moves;      /* calls a step moved off a failed connection
                                   (counted in retries too, but not against the
                                   retry budget nor max_attempts) */
    uint64_t rdma_retries;      /* probes of RDMA from TCP (rdma_retry_ms) */
    uint64_t rdma_restored;     /* of them, the ones that worked: the endpoint
                                   is back on RDMA */
} bex_rpc_channel_stats;
void bex_rpc_channel_stats_get(bex_rpc_channel *ch, bex_rpc_channel_stats *out);

/* Per-endpoint counters (the "per node" view, for replica choice and
 * quarantine to come). Counters follow an endpoint while it stays in the
 * list (bex_rpc_channel_set_endpoints); a removed one's are gone. */
typedef struct bex_rpc_endpoint_stats {
    bex_addr addr;
    char locality[64];      /* its label (cut to fit) */
    uint64_t attempts;      /* requests sent to it */
    uint64_t answers;       /* answers from it (late ones included) */
    uint64_t failures;      /* attempts to it that failed or passed attempt_timeout_ms */
    uint64_t conn_failures; /* its connections that failed or timed out (Tc) */
    uint32_t ladder;        /* BEX_RPC_LADDER_*: its step on the recovery ladder */
    uint64_t tcp_answers;   /* answers over the ladder's TCP fallback */
} bex_rpc_endpoint_stats;
/* Steps of the recovery ladder, as bex_rpc_endpoint_stats.ladder. */
enum {
    BEX_RPC_LADDER_OK = 0,        /* as configured (RDMA when it can) */
    BEX_RPC_LADDER_RECONNECT = 1, /* its connection failed: reconnecting */
    BEX_RPC_LADDER_REPLICA = 2,   /* the reconnection failed: other replicas first */
    BEX_RPC_LADDER_TCP = 3,       /* reached over TCP; RDMA probed every rdma_retry_ms */
};
/* Fill out[0..cap) with the endpoints' counters in list order (directory
 * mode: the replicas chosen so far, newest first); returns the number of
 * endpoints (which may exceed cap). */
size_t bex_rpc_channel_endpoint_stats(bex_rpc_channel *ch, bex_rpc_endpoint_stats *out, size_t cap);

/* The counters and latency quantiles in Prometheus text exposition format
 * (metric names bex_rpc_*, label channel="<name>"; the endpoints' counters
 * as bex_rpc_endpoint_* with labels endpoint="<ip>:<port>" and locality,
 * for the first 64 endpoints), NUL-terminated, into
 * buf (cap bytes). Returns the length it needed (without the NUL), like
 * snprintf: output is cut when that is >= cap. */
int bex_rpc_channel_prometheus(bex_rpc_channel *ch, char *buf, size_t cap);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif
