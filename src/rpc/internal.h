/* SPDX-License-Identifier: Apache-2.0 */
/* RPC internals: the wire header codec, the latency histogram, and what
 * the client and server share. The RPC layer uses the public socket API
 * only (include/bex/sock.h), never an engine. */
#ifndef BEX_RPC_INTERNAL_H
#define BEX_RPC_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/rpc.h"
#include "common/prom.h"

/* ---- wire header (docs/protocol.md, "RPC"): 64 bytes, little-endian ---- */

#define BEX__RPC_MAGIC   0xB5C1u
#define BEX__RPC_VERSION 1u
/* Version 2 adds the destination of bex_rpc_call_into (docs/protocol.md,
 * "Caller's destination"): kind DEST and the request flag DEST. Only the
 * messages using them say version 2, so that a version-1 peer still
 * understands everything else (and refuses those, by its strict rules). */
#define BEX__RPC_VERSION_DEST 2u

enum { BEX__RPC_REQUEST = 1, BEX__RPC_RESPONSE = 2, BEX__RPC_ERROR = 3, BEX__RPC_DEST = 4 };

/* flags. DEST (version 2, requests): the answer's body goes to the
 * destination the DEST message before it on the same socket named. */
#define BEX__RPC_F_DEST      0x1u
#define BEX__RPC_FLAGS_KNOWN BEX__RPC_F_DEST

/* The body of a DEST message: where the answer to its call goes. token 0:
 * no exposed buffer (TCP): the answer comes as a message, its body at
 * most cap bytes; else the exposed buffer (addr, rkey, token) of
 * BEX_RPC_HDR_LEN + cap bytes takes the whole answer, header first. */
#define BEX__RPC_DEST_LEN 24
struct bex__rpc_dest {
    uint64_t addr;
    uint32_t rkey, token, cap;
};
void bex__rpc_dest_encode(const struct bex__rpc_dest *d, uint8_t *out);
/* Returns 0 or -EBADMSG (reserved bytes set, a token without the
 * address or key, a cap above INT32_MAX - BEX_RPC_HDR_LEN). */
int bex__rpc_dest_decode(const uint8_t *in, struct bex__rpc_dest *d);
/* The body length an answer's header at msg says (unchecked), to decode
 * an answer written into a destination longer than it. */
uint32_t bex__rpc_hdr_body_len(const uint8_t *msg);

#define BEX__RPC_TOK_LEN 12
struct bex__rpc_hdr {
    uint8_t kind;
    uint32_t flags;
    uint32_t service, method;
    uint64_t call_id, client_id, seq;
    /* the client's random token (bytes 52..63): with client_id the key of
     * its dedup record (docs/security.md, "Dedup keys and Push ids") */
    uint8_t tok[BEX__RPC_TOK_LEN];
    int32_t status;
    uint32_t body_len;
    uint32_t timeout_ms; /* requests: what was left of the call's deadline */
};

/* Write h into out[0..63]. */
void bex__rpc_hdr_encode(const struct bex__rpc_hdr *h, uint8_t *out);
/* Write into out[0..63] the header of the answer (kind RESPONSE or ERROR)
 * to request rq: rq's service, method, call id, client id, sequence and
 * token, no flags, no timeout; the bytes bex__rpc_hdr_encode writes for that
 * header, without a copy of rq made first (issue 25 item 5: the server
 * answers every request). */
void bex__rpc_answer_encode(const struct bex__rpc_hdr *rq, uint8_t kind, int32_t status,
                            uint32_t body_len, uint8_t *out);
/* Decode a message of len bytes; strict: wrong magic or version, unknown
 * kind or flags, non-zero reserved bytes, a body length that disagrees
 * with len, a request with a status, or a status that is not 0 or a
 * negative errno all fail. Returns 0, or -EBADMSG with *why set. */
int bex__rpc_hdr_decode(const uint8_t *msg, size_t len, struct bex__rpc_hdr *h, const char **why);

/* ---- latency histogram: log-linear buckets of nanoseconds ---- */

#define BEX__RPC_HIST_SUB     16 /* sub-buckets per power of two */
#define BEX__RPC_HIST_BUCKETS (64 * BEX__RPC_HIST_SUB)

struct bex__rpc_hist {
    uint64_t count, sum_ns;
    uint64_t b[BEX__RPC_HIST_BUCKETS];
};

void bex__rpc_hist_add(struct bex__rpc_hist *h, uint64_t ns);
/* The value (ns) below which a share q (0..1) of the samples lie: the
 * midpoint of the bucket holding that rank; 0 with no samples. */
double bex__rpc_hist_quantile(const struct bex__rpc_hist *h, double q);

/* The RPC layer's clock, ns: CLOCK_MONOTONIC, or the test hook's. */
/* Count one new client id (of a handler's own dedup table, e.g. the PS's
 * Push ids) against req's connection: true when the connection brought
 * fewer than max so far (then counted), false when it has max already.
 * Any thread, while req is not answered. */
bool bex__rpc_req_conn_admit(const bex_rpc_req *req, uint32_t max);
/* When req was handed to its handler (bex__rpc_now_ns time): a handler
 * timing its own work starts there rather than reading the clock again. */
uint64_t bex__rpc_req_start_ns(const bex_rpc_req *req);
/* bex_rpc_reply, the method's latency sample ending at now_ns (a
 * bex__rpc_now_ns time the handler read as it finished: no second clock
 * read, issue 25 item 5), or at the clock's time when now_ns is 0. */
int bex__rpc_reply_at(bex_rpc_req *req, int status, void *body, size_t len, uint64_t now_ns);

uint64_t bex__rpc_now_ns(void);
/* Tests: the RPC layer (channels, servers, directories) reads its time
 * from fn from now on (NULL: CLOCK_MONOTONIC again), so that a case steps
 * deadlines, attempt timeouts and quarantine periods instead of sleeping
 * through them. fn must be monotonic. Set it before the objects it is to
 * drive exist, clear it after they are gone. */
void bex__rpc_clock_hook(uint64_t (*fn)(void));
/* The CLOCK_MONOTONIC time (ns) until which a timer due at next (the RPC
 * clock's time) may sleep: next itself, or with the test hook 1 ms from
 * now (the hook's time moves when the test moves it, not by sleeping). */
uint64_t bex__rpc_clock_sleep_until(uint64_t next);
/* Tests: fn runs on the caller's thread, under the channel's lock, just
 * before a call's request is handed to its connection's socket s (the
 * channel's link; not an attempt with a destination), so that a case can
 * have that connection fail there: its failure callbacks then wait for the
 * lock, and the send finds the socket failed (tests/rpc/test_dir_quar.c,
 * send_fails). NULL: nothing (the default). */
void bex__rpc_send_hook(void (*fn)(bex_sock *s));

/* ---- one call waited for (bex_rpc_call_sync, the ps catch-up's copy) ---- */

/* Set up as BEX__RPC_WAIT_INIT. One futex word: the completion wakes the
 * waiter only when it sleeps, once, and touches no lock (a mutex and
 * condition variable cost the two threads 3-5 futex calls a call). */
struct bex__rpc_wait {
    _Atomic uint32_t state; /* 0 waiting, 1 the waiter sleeps, 2 done */
    int status;
    void *body;
    size_t len;
};
#define BEX__RPC_WAIT_INIT                                                                         \
    {                                                                                              \
        .state = 0                                                                                 \
    }
/* The bex_rpc_done_fn to pass with user = a struct bex__rpc_wait. */
void bex__rpc_wait_done(int status, void *body, size_t len, void *user);
/* Block until bex__rpc_wait_done ran on w; returns the call's status, its
 * body (the caller's to free, may be NULL) in *body and *len. Never on a
 * thread the completion needs (the channel's I/O or timer thread). */
int bex__rpc_wait(struct bex__rpc_wait *w, void **body, size_t *len);

/* ---- Prometheus text exposition (the writer and counter families are
 * common/prom.h's): the latency histogram ---- */

/* h (nanoseconds) as the samples of a Prometheus histogram in seconds:
 * metric_bucket{labels,le=...} at 2^10, 2^12, ... 2^34 ns (bucket edges of
 * h, so the counts are exact) and +Inf, metric_sum, metric_count. labels
 * is "" or `name="value",...` (escaped). HELP and TYPE are the caller's. */
void bex__prom_hist(struct bex__prom *o, const char *metric, const char *labels,
                    const struct bex__rpc_hist *h);

/* The header in front of a body, and back. */
static inline uint8_t *bex__rpc_hdr_of(void *body)
{
    return (uint8_t *)body - BEX_RPC_HDR_LEN;
}

/* A body the caller keeps (bex__rpc_call_ext): instead of freeing it, the
 * call runs release(arg) once no transport reads it any more (after the
 * completion or before it), under the channel's lock: release may only
 * mark the body free, never call into the channel. */
struct bex__rpc_borrow {
    void (*release)(void *arg);
    void *arg;
    /* tail set: the request is the body's len bytes, then tail_len bytes
     * at tail (the caller's registered memory), sent gathered
     * (bex_sock_sendv) without a copy; then the body is the call's (freed
     * as bex_rpc_call's) and release is about the tail. No dst. */
    void *tail;
    size_t tail_len;
};
/* bex_rpc_call_into whose dst may lie inside a landing allocation (the
 * caller checked that the header room and cap bytes are in it), and whose
 * body, with bw (may be NULL), stays the caller's (for the PS client's
 * calls on caller memory, src/ps/client_mem.c). dst NULL: bex_rpc_call. */
int bex__rpc_call_ext(bex_rpc_channel *ch, uint32_t service, uint32_t method, void *body,
                      size_t len, void *dst, size_t cap, const bex_rpc_call_opts *opts,
                      bex_rpc_done_fn done, void *user, const struct bex__rpc_borrow *bw);

/* Tests: close the connection a request came on (its answer will find it
 * closing and be dropped, though a WRITE's is kept for a retry), to lose
 * a response after the request was applied. */
void bex__rpc_req_close_conn(bex_rpc_req *req);
#endif
