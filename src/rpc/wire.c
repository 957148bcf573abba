/* SPDX-License-Identifier: Apache-2.0 */
/* The RPC wire header, its histogram and small shared helpers. */
#include <endian.h>
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "rpc/internal.h"

/* memcpy and the byte-order macros compile to one load or store each
 * (the byte loops they replace cost some 600 instructions a header
 * encoded and decoded: bench/cost/ps-fanout's profile) */
static void put16(uint8_t *p, uint16_t v)
{
    v = htole16(v);
    memcpy(p, &v, 2);
}
static void put32(uint8_t *p, uint32_t v)
{
    v = htole32(v);
    memcpy(p, &v, 4);
}
static void put64(uint8_t *p, uint64_t v)
{
    v = htole64(v);
    memcpy(p, &v, 8);
}
static uint16_t get16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return le16toh(v);
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return le32toh(v);
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return le64toh(v);
}

void bex__rpc_hdr_encode(const struct bex__rpc_hdr *h, uint8_t *out)
{
    memset(out, 0, BEX_RPC_HDR_LEN);
    put16(out + 0, BEX__RPC_MAGIC);
    out[2] = h->kind == BEX__RPC_DEST || (h->flags & BEX__RPC_F_DEST) ? BEX__RPC_VERSION_DEST
                                                                      : BEX__RPC_VERSION;
    out[3] = h->kind;
    put32(out + 4, h->flags);
    put32(out + 8, h->service);
    put32(out + 12, h->method);
    put64(out + 16, h->call_id);
    put64(out + 24, h->client_id);
    put64(out + 32, h->seq);
    put32(out + 40, (uint32_t)h->status);
    put32(out + 44, h->body_len);
    put32(out + 48, h->timeout_ms);
    memcpy(out + 52, h->tok, BEX__RPC_TOK_LEN);
}

void bex__rpc_answer_encode(const struct bex__rpc_hdr *rq, uint8_t kind, int32_t status,
                            uint32_t body_len, uint8_t *out)
{
    /* every byte written: no memset; an answer has no flags, so version 1 */
    put16(out + 0, BEX__RPC_MAGIC);
    out[2] = BEX__RPC_VERSION;
    out[3] = kind;
    put32(out + 4, 0);
    put32(out + 8, rq->service);
    put32(out + 12, rq->method);
    put64(out + 16, rq->call_id);
    put64(out + 24, rq->client_id);
    put64(out + 32, rq->seq);
    put32(out + 40, (uint32_t)status);
    put32(out + 44, body_len);
    put32(out + 48, 0);
    memcpy(out + 52, rq->tok, BEX__RPC_TOK_LEN);
}

int bex__rpc_hdr_decode(const uint8_t *msg, size_t len, struct bex__rpc_hdr *h, const char **why)
{
    *why = NULL;
    if (len < BEX_RPC_HDR_LEN)
        *why = "shorter than the header";
    else if (get16(msg) != BEX__RPC_MAGIC)
        *why = "bad magic";
    else if (msg[2] != BEX__RPC_VERSION && msg[2] != BEX__RPC_VERSION_DEST)
        *why = "unknown version";
    if (*why)
        return -EBADMSG;
    *h = (struct bex__rpc_hdr){
        .kind = msg[3],
        .flags = get32(msg + 4),
        .service = get32(msg + 8),
        .method = get32(msg + 12),
        .call_id = get64(msg + 16),
        .client_id = get64(msg + 24),
        .seq = get64(msg + 32),
        .status = (int32_t)get32(msg + 40),
        .body_len = get32(msg + 44),
        .timeout_ms = get32(msg + 48),
    };
    memcpy(h->tok, msg + 52, BEX__RPC_TOK_LEN);
    bool v2 = h->kind == BEX__RPC_DEST || (h->flags & BEX__RPC_F_DEST);
    if (h->kind < BEX__RPC_REQUEST || h->kind > BEX__RPC_DEST)
        *why = "unknown kind";
    else if (h->flags & ~BEX__RPC_FLAGS_KNOWN)
        *why = "unknown flags";
    else if (msg[2] != (v2 ? BEX__RPC_VERSION_DEST : BEX__RPC_VERSION))
        *why = "version does not fit the kind and flags";
    else if ((h->flags & BEX__RPC_F_DEST) && h->kind != BEX__RPC_REQUEST)
        *why = "destination flag on an answer";
    else if (h->kind == BEX__RPC_DEST &&
             (h->body_len != BEX__RPC_DEST_LEN || h->call_id == 0 || h->status != 0))
        *why = "malformed destination";
    else if ((uint64_t)h->body_len != len - BEX_RPC_HDR_LEN)
        *why = "body length disagrees with the message";
    else if (h->kind == BEX__RPC_REQUEST && (h->status != 0 || h->call_id == 0))
        *why = "request with a status or without a call id";
    else if (h->kind != BEX__RPC_REQUEST && h->kind != BEX__RPC_DEST && h->timeout_ms != 0)
        *why = "answer with a timeout";
    else if (h->status > 0 || h->status < -4095)
        *why = "status is not 0 or a negative errno";
    else if (h->kind == BEX__RPC_ERROR && h->status == 0)
        *why = "error without a status";
    return *why ? -EBADMSG : 0;
}

void bex__rpc_dest_encode(const struct bex__rpc_dest *d, uint8_t *out)
{
    put64(out, d->addr);
    put32(out + 8, d->rkey);
    put32(out + 12, d->token);
    put32(out + 16, d->cap);
    put32(out + 20, 0);
}

int bex__rpc_dest_decode(const uint8_t *in, struct bex__rpc_dest *d)
{
    *d = (struct bex__rpc_dest){get64(in), get32(in + 8), get32(in + 12), get32(in + 16)};
    if (get32(in + 20) != 0 || (d->token && !d->addr) ||
        d->cap > (uint32_t)INT32_MAX - BEX_RPC_HDR_LEN || (!d->token && (d->addr || d->rkey)))
        return -EBADMSG;
    return 0;
}

uint32_t bex__rpc_hdr_body_len(const uint8_t *msg)
{
    return get32(msg + 44);
}

static unsigned bucket_of(uint64_t v)
{
    if (v < BEX__RPC_HIST_SUB)
        return (unsigned)v;
    unsigned msb = 63u - (unsigned)__builtin_clzll(v); /* >= 4 */
    unsigned sub = (unsigned)(v >> (msb - 4)) & (BEX__RPC_HIST_SUB - 1);
    return (msb - 3) * BEX__RPC_HIST_SUB + sub;
}

/* [lo, hi) of bucket i */
static void bucket_range(unsigned i, double *lo, double *hi)
{
    if (i < BEX__RPC_HIST_SUB) {
        *lo = i;
        *hi = i + 1;
        return;
    }
    unsigned msb = i / BEX__RPC_HIST_SUB + 3, sub = i % BEX__RPC_HIST_SUB;
    double w = (double)(1ull << (msb - 4));
    *lo = (double)(1ull << msb) + sub * w;
    *hi = *lo + w;
}

void bex__rpc_hist_add(struct bex__rpc_hist *h, uint64_t ns)
{
    h->count++;
    h->sum_ns += ns;
    h->b[bucket_of(ns)]++;
}

double bex__rpc_hist_quantile(const struct bex__rpc_hist *h, double q)
{
    if (!h->count)
        return 0;
    /* the sample of rank ceil(q * count), 1-based */
    uint64_t rank = (uint64_t)(q * (double)h->count);
    if ((double)rank < q * (double)h->count)
        rank++;
    if (rank < 1)
        rank = 1;
    uint64_t seen = 0;
    for (unsigned i = 0; i < BEX__RPC_HIST_BUCKETS; i++) {
        seen += h->b[i];
        if (seen >= rank) {
            double lo, hi;
            bucket_range(i, &lo, &hi);
            return (lo + hi) / 2;
        }
    }
    return 0;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static _Atomic(uint64_t (*)(void)) clock_fn;

void bex__rpc_clock_hook(uint64_t (*fn)(void))
{
    atomic_store_explicit(&clock_fn, fn, memory_order_release);
}

uint64_t bex__rpc_now_ns(void)
{
    uint64_t (*fn)(void) = atomic_load_explicit(&clock_fn, memory_order_acquire);
    return fn ? fn() : mono_ns();
}

uint64_t bex__rpc_clock_sleep_until(uint64_t next)
{
    if (!atomic_load_explicit(&clock_fn, memory_order_acquire))
        return next;
    return mono_ns() + 1000000ull;
}

void bex__prom_hist(struct bex__prom *o, const char *metric, const char *labels,
                    const struct bex__rpc_hist *h)
{
    const char *sep = labels[0] ? "," : "";
    /* 2^k ns is where bucket (k - 3) * SUB starts: the buckets below it
     * are exactly the samples under 2^k ns */
    uint64_t seen = 0;
    unsigned i = 0;
    for (unsigned k = 10; k <= 34; k += 2) {
        for (; i < (k - 3) * BEX__RPC_HIST_SUB; i++)
            seen += h->b[i];
        bex__prom_printf(o, "%s_bucket{%s%sle=\"%.12g\"} %llu\n", metric, labels, sep,
                         (double)(1ull << k) / 1e9, (unsigned long long)seen);
    }
    bex__prom_printf(o, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", metric, labels, sep,
                     (unsigned long long)h->count);
    bex__prom_printf(o, "%s_sum{%s} %.9g\n%s_count{%s} %llu\n", metric, labels,
                     (double)h->sum_ns / 1e9, metric, labels, (unsigned long long)h->count);
}
