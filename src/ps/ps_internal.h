/* SPDX-License-Identifier: Apache-2.0 */
/* The PS wire format's header and codecs (docs/protocol.md, "Parameter
 * server"), shared by the shard, the client and the tests. Every integer
 * and float on the wire and in snapshots is little-endian. */
#ifndef BEX_PS_INTERNAL_H
#define BEX_PS_INTERNAL_H

#include <endian.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bex/ps.h"
#include "common/list.h"

#define BEX__PS_VERSION 1
#define BEX__PS_HDR_LEN 16

/* u16 version, u16 flags, u32 table, u32 n (keys or rows), u32 dim; with
 * BEX__PS_F_ID (Push only) the Push's id follows: u64 client, u64 seq,
 * then the client's 128-bit token as 2 x u64 (the same at every replica of
 * every shard the Push goes to, so that a restarted replica can tell which
 * Pushes its peer applied: catch-up). A client's dedup record is keyed by
 * (client, token): docs/security.md, "Dedup keys and Push ids". */
#define BEX__PS_F_ID   1u
#define BEX__PS_ID_LEN 32
/* A shard's record of a client's Push ids spans the 1024 sequences up to
 * the highest it applied: one older is refused (-ESTALE). */
#define BEX__PS_IDS_WINDOW 1024u
/* BEX__PS_F_EPOCH (a Push with an id, etcd mode): u64 epoch after the id,
 * the term of the primary the client means; a primary of another term
 * refuses it -ESTALE (docs/protocol.md, "Push"). */
#define BEX__PS_F_EPOCH   2u
#define BEX__PS_EPOCH_LEN 8
struct bex__ps_hdr {
    uint32_t table, n, dim;
    uint32_t flags;
    uint64_t id_client, id_seq; /* BEX__PS_F_ID */
    uint64_t id_tok[2];         /* BEX__PS_F_ID */
    uint64_t epoch;             /* BEX__PS_F_EPOCH */
};

/* Bytes from a request body's start to its keys. */
static inline size_t bex__ps_keys_off(const struct bex__ps_hdr *h)
{
    return BEX__PS_HDR_LEN + ((h->flags & BEX__PS_F_ID) ? BEX__PS_ID_LEN : 0) +
           ((h->flags & BEX__PS_F_EPOCH) ? BEX__PS_EPOCH_LEN : 0);
}

static inline void bex__ps_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t bex__ps_get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static inline void bex__ps_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t bex__ps_get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}
static inline void bex__ps_putf(uint8_t *p, float f)
{
    uint32_t v;
    memcpy(&v, &f, 4);
    bex__ps_put32(p, v);
}
static inline float bex__ps_getf(const uint8_t *p)
{
    uint32_t v = bex__ps_get32(p);
    float f;
    memcpy(&f, &v, 4);
    return f;
}

/* The header's u32 fields as one load or store each (memcpy and the byte
 * order macros, as src/wire/hdr.c): a request's fixed cost, paid once per
 * sub-request of a Fetch spread over shards (issue 25 item 5; the byte
 * loops above were some 45 instructions a header at the server). The keys'
 * and rows' loops keep the helpers above: cheaper there, every Fetch would
 * gain alike at any shard count (docs/benchmarks.md, "Fan-out"). */
static inline uint32_t bex__ps_hdr_get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return le32toh(v);
}
static inline void bex__ps_hdr_put32(uint8_t *p, uint32_t v)
{
    v = htole32(v);
    memcpy(p, &v, 4);
}

static inline void bex__ps_hdr_put(uint8_t *p, const struct bex__ps_hdr *h)
{
    p[0] = BEX__PS_VERSION;
    p[1] = 0;
    p[2] = (uint8_t)(h->flags & (BEX__PS_F_ID | BEX__PS_F_EPOCH));
    p[3] = 0;
    bex__ps_hdr_put32(p + 4, h->table);
    bex__ps_hdr_put32(p + 8, h->n);
    bex__ps_hdr_put32(p + 12, h->dim);
    if (h->flags & BEX__PS_F_ID) {
        bex__ps_put64(p + BEX__PS_HDR_LEN, h->id_client);
        bex__ps_put64(p + BEX__PS_HDR_LEN + 8, h->id_seq);
        bex__ps_put64(p + BEX__PS_HDR_LEN + 16, h->id_tok[0]);
        bex__ps_put64(p + BEX__PS_HDR_LEN + 24, h->id_tok[1]);
    }
    if (h->flags & BEX__PS_F_EPOCH) /* after the id; a Push answer's right after the header */
        bex__ps_put64(p + BEX__PS_HDR_LEN + ((h->flags & BEX__PS_F_ID) ? BEX__PS_ID_LEN : 0),
                      h->epoch);
}

/* Bytes of a request body of method for n keys of dim floats (a Push's
 * id not counted: + BEX__PS_ID_LEN with BEX__PS_F_ID). */
size_t bex__ps_req_len(uint32_t method, uint32_t n, uint32_t dim);

/* Check a request body of method strictly: header, bounds, exact length.
 * Returns 0 and *h, or -EINVAL (malformed), -E2BIG (past a bound). */
int bex__ps_decode(uint32_t method, const void *body, size_t len, struct bex__ps_hdr *h);

/* Check an answer to a request of method for (table, n, dim). 0 or
 * -EBADMSG. A Push answer may carry EPOCH (an etcd-mode primary's term,
 * u64 after the header: bex__ps_resp_epoch). */
int bex__ps_check_resp(uint32_t method, const void *body, size_t len, uint32_t table, uint32_t n,
                       uint32_t dim);

/* The keys' hash (splitmix64's finalizer): shards, rows, initial values;
 * bex__ps_mix is it out of line. */
uint64_t bex__ps_mix(uint64_t x);
static inline uint64_t bex__ps_mix_inline(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
/* bex_ps_key_shard for n_shards > 1, inline: a Fetch or Push checks each
 * of its keys with it (issue 25 item 5: the call and the mix out of line
 * were some 23 instructions a key). */
static inline uint32_t bex__ps_key_shard_n(uint64_t key, uint32_t n_shards)
{
    return (uint32_t)(bex__ps_mix_inline(key) % n_shards);
}

/* The epoch a checked Push answer carries, 0 when none. */
static inline uint64_t bex__ps_resp_epoch(const void *body, size_t len)
{
    const uint8_t *p = body;
    return len == BEX__PS_HDR_LEN + BEX__PS_EPOCH_LEN && (p[2] & BEX__PS_F_EPOCH)
               ? bex__ps_get64(p + BEX__PS_HDR_LEN)
               : 0;
}

/* ---- catch-up (BEX_PS_M_COPY; docs/protocol.md, "Catch-up") ---- */

/* u8 version, u8 op, u16 0, u32 max_len, u64 session, u64 offset: a
 * request; an answer has the same 24 bytes (max_len 0; OPEN: offset is
 * the copy's total length), CHUNK's followed by the bytes at offset. */
#define BEX__PS_COPY_HDR_LEN 24
enum {
    BEX__PS_COPY_OPEN = 1,
    BEX__PS_COPY_CHUNK = 2,
    BEX__PS_COPY_CLOSE = 3,
    /* a restarted backup at (session, offset: the last lsn it applied)
     * asks its primary for the forwards after it: the answer's offset is
     * the primary's lsn, then entries u64 lsn, u32 length, the Push body,
     * in lsn order from offset + 1, at most max_len bytes (at least one) */
    BEX__PS_COPY_SUFFIX = 4
};
struct bex__ps_copy_hdr {
    uint8_t op;
    uint32_t max_len;
    uint64_t session, offset;
};
static inline void bex__ps_copy_put(uint8_t *p, const struct bex__ps_copy_hdr *h)
{
    p[0] = BEX__PS_VERSION;
    p[1] = h->op;
    p[2] = p[3] = 0;
    bex__ps_put32(p + 4, h->max_len);
    bex__ps_put64(p + 8, h->session);
    bex__ps_put64(p + 16, h->offset);
}
/* 0, or -EINVAL when p (len bytes) is not a copy header. */
static inline int bex__ps_copy_get(const void *body, size_t len, struct bex__ps_copy_hdr *h)
{
    const uint8_t *p = body;
    if (!p || len < BEX__PS_COPY_HDR_LEN || p[0] != BEX__PS_VERSION || p[2] || p[3] ||
        p[1] < BEX__PS_COPY_OPEN || p[1] > BEX__PS_COPY_SUFFIX)
        return -EINVAL;
    h->op = p[1];
    h->max_len = bex__ps_get32(p + 4);
    h->session = bex__ps_get64(p + 8);
    h->offset = bex__ps_get64(p + 16);
    return 0;
}

/* ---- primary-backup (BEX_PS_M_FORWARD; docs/protocol.md, "Forward") ---- */

/* u8 version, u8 flags, u16 0, u32 0, u64 session (the primary's, random
 * at its start), u64 lsn (the forward's number in that session, from 1);
 * then the client's Push body whole (its id included). The answer is
 * empty. With BEX__PS_FWD_PROBE the Push is not applied: the backup
 * answers 0 when it follows session and applied lsn, else -ESTALE. */
#define BEX__PS_FWD_HDR_LEN 24
/* A probe's -ESTALE answer from a backup behind in the session it
 * follows: the last lsn it applied (u64, little-endian). */
#define BEX__PS_POS_LEN   8
#define BEX__PS_FWD_PROBE 1u
/* A batch (repl_batch.c): lsn is the first's; then u32 count (1..65536),
 * u32 0, and count entries: u64 lsn (the first's + i), u32 len, u32 0,
 * len bytes of a client's Push body. Answered once every one is applied. */
#define BEX__PS_FWD_BATCH     2u
#define BEX__PS_FWD_BATCH_HDR 8u
#define BEX__PS_FWD_ENT_HDR   16u
struct bex__ps_fwd_hdr {
    uint64_t session, lsn;
    uint32_t flags;
};
static inline void bex__ps_fwd_put(uint8_t *p, const struct bex__ps_fwd_hdr *h)
{
    p[0] = BEX__PS_VERSION;
    p[1] = (uint8_t)(h->flags & (BEX__PS_FWD_PROBE | BEX__PS_FWD_BATCH));
    p[2] = p[3] = 0;
    bex__ps_put32(p + 4, 0);
    bex__ps_put64(p + 8, h->session);
    bex__ps_put64(p + 16, h->lsn);
}
/* 0, or -EINVAL when body (len bytes) does not start with a forward
 * header (session not 0, lsn not 0 but in a probe: lsn 0 asks "do you
 * follow session from its start"). */
static inline int bex__ps_fwd_get(const void *body, size_t len, struct bex__ps_fwd_hdr *h)
{
    const uint8_t *p = body;
    if (!p || len < BEX__PS_FWD_HDR_LEN || p[0] != BEX__PS_VERSION ||
        (p[1] & ~(BEX__PS_FWD_PROBE | BEX__PS_FWD_BATCH)) ||
        p[1] == (BEX__PS_FWD_PROBE | BEX__PS_FWD_BATCH) || p[2] || p[3] || bex__ps_get32(p + 4))
        return -EINVAL;
    h->flags = p[1];
    h->session = bex__ps_get64(p + 8);
    h->lsn = bex__ps_get64(p + 16);
    return h->session && (h->lsn || (h->flags & BEX__PS_FWD_PROBE)) ? 0 : -EINVAL;
}

/* ---- consistent cuts (BEX_PS_M_CUT; docs/protocol.md, "Cut") ---- */

/* u8 version, u8 op, u8 flags, u8 0, u32 0, u64 cut id (not 0): a request;
 * the answer repeats it, COMMIT's followed by u64 pause_ns, u64 Pushes
 * held, u64 rows written, u32 full (1) or incremental (0), u32 0. */
#define BEX__PS_CUT_HDR_LEN 16
#define BEX__PS_CUT_ANS_LEN (BEX__PS_CUT_HDR_LEN + 32)
enum {
    BEX__PS_CUT_PREPARE = 1,
    BEX__PS_CUT_COMMIT = 2,
    BEX__PS_CUT_ABORT = 3,
    /* a new backup's join: JOIN (the header, then u32 IPv4 address and
     * u16 port in network order, u16 transport; or, BEX__PS_JOIN6_LEN,
     * 16 bytes of IPv6 address, u16 port, u16 transport, u32 scope id
     * little-endian) holds the Pushes; JOINED adds it and releases them;
     * ABORT lets them go */
    BEX__PS_CUT_JOIN = 4,
    BEX__PS_CUT_JOINED = 5,
};
#define BEX__PS_JOIN_LEN   (BEX__PS_CUT_HDR_LEN + 8)
#define BEX__PS_JOIN6_LEN  (BEX__PS_CUT_HDR_LEN + 24)
#define BEX__PS_CUT_F_FULL 1u
struct bex__ps_cut_hdr {
    uint8_t op, flags;
    uint64_t id;
};
static inline void bex__ps_cut_put(uint8_t *p, const struct bex__ps_cut_hdr *h)
{
    p[0] = BEX__PS_VERSION;
    p[1] = h->op;
    p[2] = (uint8_t)(h->flags & BEX__PS_CUT_F_FULL);
    p[3] = 0;
    bex__ps_put32(p + 4, 0);
    bex__ps_put64(p + 8, h->id);
}
/* 0, or -EINVAL when body (len bytes) does not start with a cut header. */
static inline int bex__ps_cut_get(const void *body, size_t len, struct bex__ps_cut_hdr *h)
{
    const uint8_t *p = body;
    if (!p || len < BEX__PS_CUT_HDR_LEN || p[0] != BEX__PS_VERSION || p[1] < BEX__PS_CUT_PREPARE ||
        p[1] > BEX__PS_CUT_JOINED || (p[2] & ~BEX__PS_CUT_F_FULL) || p[3] || bex__ps_get32(p + 4))
        return -EINVAL;
    h->op = p[1];
    h->flags = p[2];
    h->id = bex__ps_get64(p + 8);
    return h->id ? 0 : -EINVAL;
}

/* The RPC registration flags of a method: Push changes state, so a retried
 * Push is answered from the dedup window, not applied again. (Tests that
 * wrap the handlers register with these too.) */
static inline uint32_t bex__ps_method_flags(uint32_t method)
{
    return method == BEX_PS_M_PUSH ? BEX_RPC_METHOD_WRITE : 0;
}

/* ---- the client, for its calls on caller memory (client_mem.c) ---- */

bex_ctx *bex__ps_client_ctx(const bex_ps_client *c);
uint32_t bex__ps_client_shards(const bex_ps_client *c);
uint32_t bex__ps_client_timeout(const bex_ps_client *c);
bex_rpc_channel *bex__ps_client_fetch_ch(const bex_ps_client *c, uint32_t shard);
/* Whether a Fetch's part may be issued again at all (max_attempts is not
 * 1): a part that may keeps its keys. */
bool bex__ps_client_fetch_retries(const bex_ps_client *c);

/* A part of a request queued on the client's retry thread to be sent
 * again (a Fetch's part, of bex_ps_fetch or bex_ps_fetch_into, or a Push's
 * under BEX_PS_PUSH_PRIMARY). fn sends it again (status 0) or ends it with
 * status (-ECANCELED: the client is being destroyed); from the retry
 * thread. end_ns: its request's deadline (set when it is first sent). */
struct bex__ps_retry {
    struct bex__list rl;
    uint64_t at_ns, end_ns;
    void (*fn)(bex_ps_client *c, struct bex__ps_retry *rt, int status);
};
/* A Fetch's part of shard that failed with status: queued on the retry
 * thread (true: rt->fn runs later) when bex_ps_fetch's contract issues it
 * again (a retryable status, a shard of several replicas, max_attempts not
 * 1, its deadline leaving more than the pause), else false (the caller
 * ends it with status). */
bool bex__ps_fetch_retry(bex_ps_client *c, struct bex__ps_retry *rt, uint32_t shard, int status);
/* The time rt's deadline leaves at now (ns), in ms rounded up: a resend's
 * timeout. */
static inline uint32_t bex__ps_retry_left_ms(const struct bex__ps_retry *rt, uint64_t now)
{
    return (uint32_t)((rt->end_ns > now ? rt->end_ns - now : 0) / 1000000 + 1);
}
/* The one Push channel of shard (and its replica's address) with a new
 * Push id in h, held (*hold) until bex__ps_client_push_put: a channel of a
 * replica gone from the directory is retired once no one holds it;
 * -ENOENT when the shard's Push goes to more than one replica (or none),
 * -ENOMEM. */
int bex__ps_client_push_one(bex_ps_client *c, uint32_t shard, bex_rpc_channel **ch, bex_addr *addr,
                            struct bex__ps_hdr *h, void **hold);
/* A hold of bex__ps_client_push_one let go (its call ended, or was never
 * made); NULL: none. */
void bex__ps_client_push_put(void *hold);

/* ---- a Push body shared (client_keep.c) ----
 *
 * A Push's body for a shard of several replicas (client fan-out), from
 * bex_rpc_alloc with a count of its holders behind its len bytes (8-byte
 * aligned): the Push's part holds it until the Push ends, the RPC call
 * that sends it until no transport reads it (a borrow: bex__ps_pbody_call),
 * a kept Push (below) while it is kept; the last holder frees it. So a
 * Push a replica failed is kept without a copy: the body it was sent from
 * is taken over. A holder that sends it writes the RPC header in front of
 * it: only one holder alone may (bex__ps_pbody_alone). */
struct bex__ps_pbody {
    _Atomic uint32_t refs;
    void *body;
};
/* A body of len bytes, one holder (the caller); NULL: -ENOMEM. */
void *bex__ps_pbody_alloc(bex_ctx *ctx, size_t len);
/* A holder more of body (len bytes), or one less (the last frees it). */
void bex__ps_pbody_get(void *body, size_t len);
void bex__ps_pbody_put(void *body, size_t len);
/* No other holder of body than the caller's. */
bool bex__ps_pbody_alone(void *body, size_t len);
/* bex_rpc_call of (BEX_PS_SERVICE, method) with body (len bytes), the
 * call a holder of it until no transport reads it; the caller's hold
 * stays. Errors as bex_rpc_call's (done does not run). */
int bex__ps_pbody_call(bex_rpc_channel *ch, uint32_t method, void *body, size_t len,
                       const bex_rpc_call_opts *opts, bex_rpc_done_fn done, void *user);

/* ---- Pushes kept for a replica that failed them (client_keep.c) ----
 *
 * A Push (client fan-out) whose attempt at a replica failed for its
 * connection, in doubt or refused for now while another replica of its
 * shard took it is kept for that replica and sent to it again, with its
 * id, once it answers: the replicas would differ for good otherwise (a
 * restarted replica's catch-up copies its peer at a cut; a Push the peer
 * applied after it reaches the restarted one only so). The replica's id
 * record applies it once. Per replica, oldest first, one out at a time (in
 * order); a failed resend waits a pause that doubles from pause_ms up to
 * 1 s; a Push the replica took kicks the next at once. Bounded per
 * replica (max Pushes, max_bytes): past it the oldest is dropped; a Push
 * whose sequence fell BEX__PS_IDS_WINDOW behind the client's newest is
 * dropped too (the replica could not tell it from one applied: -ESTALE).
 * Dropped ones are counted and logged: that replica misses them. */
struct bex__ps_krep;
struct bex__ps_keep {
    bex_ctx *ctx;
    const _Atomic uint64_t *seq; /* the client's newest Push sequence */
    uint32_t max;
    uint64_t max_bytes, pause_ns;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thr;
    bool on, stop;
    struct bex__list reps; /* every replica's krep.l (under mu) */
    uint64_t held;         /* Pushes kept now (under mu) */
    _Atomic uint64_t kept, resent, dropped;
};
/* max 0: 1024 (at most BEX__PS_IDS_WINDOW), max_bytes 0: 16 MiB,
 * pause_ms 0: 50. */
void bex__ps_keep_init(struct bex__ps_keep *k, bex_ctx *ctx, const _Atomic uint64_t *seq,
                       uint32_t max, uint64_t max_bytes, uint32_t pause_ms);
/* Its thread stopped (no resend starts after): before the channels go. */
void bex__ps_keep_stop(struct bex__ps_keep *k);
/* Everything freed: after the channels (their resends ended). */
void bex__ps_keep_free(struct bex__ps_keep *k);
/* The record of the replica whose Push channel is ch (NULL: -ENOMEM). */
struct bex__ps_krep *bex__ps_keep_rep(struct bex__ps_keep *k, bex_rpc_channel *ch,
                                      const bex_addr *addr);
/* A sub-request's status that keeps its Push for the replica. */
bool bex__ps_keepable(int status);
/* Push seq (body, len bytes: a shared body, bex__ps_pbody_alloc) failed at
 * r while another replica took it: kept, body held (no copy). */
void bex__ps_keep_add(struct bex__ps_keep *k, struct bex__ps_krep *r, uint64_t seq, void *body,
                      size_t len);
/* A Push of this client reached r: its kept ones are sent now. */
void bex__ps_keep_ok(struct bex__ps_keep *k, struct bex__ps_krep *r);
/* How many Pushes r keeps now. */
uint32_t bex__ps_keep_count(struct bex__ps_krep *r);
/* r (its replica gone from the directory) freed, true, unless a resend of
 * it is out, or it keeps Pushes and not force: false. With force its kept
 * Pushes are dropped (counted, logged): that replica misses them. */
bool bex__ps_keep_retire(struct bex__ps_keep *k, struct bex__ps_krep *r, bool force);
/* The counters, and how many are kept now. */
void bex__ps_keep_stats(struct bex__ps_keep *k, bex_ps_client_stats *out);

#endif
