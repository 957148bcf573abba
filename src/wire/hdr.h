/* SPDX-License-Identifier: Apache-2.0 */
/* The 32-byte header of every message a transport sends (RDMA: every SEND;
 * TCP: every frame). Layout and meaning: docs/protocol.md. Codec only. */
#ifndef BEX_WIRE_HDR_H
#define BEX_WIRE_HDR_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* little-endian */
enum {
    BEX__MSG_DATA = 1,      /* small message; payload follows the header */
    BEX__MSG_RNDV_REQ = 2,  /* sender asks for a destination buffer */
    BEX__MSG_RNDV_RESP = 3, /* receiver answers with address, rkey, slot */
    BEX__MSG_CREDIT = 4,    /* credits only */
    BEX__MSG_OPEN = 5,      /* a logical socket opens */
    BEX__MSG_CLOSE = 6,     /* a logical socket closes */
    BEX__MSG_DIRECT = 7,    /* TCP only: payload for an exposed buffer */
};
#define BEX__HDR_LEN    32
#define BEX__IMM_DIRECT 0x80000000u

/* ---- immediate of a header-free DATA (SEND_WITH_IMM; docs/protocol.md) ----
 * A DATA message is a SEND_WITH_IMM of its payload alone; the immediate
 * (host order here, network order on the wire) says the rest:
 *   bits 31..30  kind: 1 = DATA (0, 2, 3 reserved: a protocol violation)
 *   bits 29..10  stream: 0 .. BEX__IMM_STREAM_MAX
 *   bits  9..0   credits returned: 0 .. BEX__IMM_CREDITS_MAX
 * A stream above BEX__IMM_STREAM_MAX sends DATA as a plain SEND with the
 * header in front (the receiver moves the payload to the buffer's start);
 * credits beyond BEX__IMM_CREDITS_MAX wait for the next message. Immediates
 * of WRITE_WITH_IMM (rendezvous slots, exposed-buffer tokens) are another
 * space: the completion's opcode tells which one a value belongs to. */
#define BEX__IMM_KIND_SHIFT   30
#define BEX__IMM_KIND_DATA    1u
#define BEX__IMM_STREAM_SHIFT 10
#define BEX__IMM_STREAM_MAX   ((1u << 20) - 1)
#define BEX__IMM_CREDITS_MAX  ((1u << 10) - 1)

struct bex__hdr {
    uint8_t type;
    uint8_t flags;
    uint16_t credits; /* receives the sender has reposted for us */
    uint32_t stream;
    uint32_t len;   /* DATA: payload bytes; RNDV_REQ: message bytes */
    uint32_t id;    /* RNDV_REQ/RESP: sender's rendezvous id */
    uint64_t addr;  /* RNDV_RESP: destination */
    uint32_t rkey;  /* RNDV_RESP */
    int32_t status; /* RNDV_RESP: 0 or negative errno; with slot below */
};
/* RNDV_RESP carries the receiver's slot in 'stream' (the immediate value). */

void bex__hdr_encode(const struct bex__hdr *h, uint8_t *out);
/* An RDMA SEND of len bytes: returns 0 or -EPROTO for a header no valid
 * peer sends (a DATA header is valid only for a stream the immediate cannot
 * name). */
int bex__hdr_decode(const uint8_t *in, size_t len, struct bex__hdr *h);
/* The immediate (host order) of a DATA on stream (<= BEX__IMM_STREAM_MAX)
 * returning credits (<= BEX__IMM_CREDITS_MAX). Inline: once a message. */
static inline uint32_t bex__imm_encode(uint32_t stream, uint32_t credits)
{
    return BEX__IMM_KIND_DATA << BEX__IMM_KIND_SHIFT | stream << BEX__IMM_STREAM_SHIFT | credits;
}
/* A received immediate's (host order) fields, each on its own: the
 * receive path reads them straight into its variables. */
static inline bool bex__imm_is_data(uint32_t imm)
{
    return imm >> BEX__IMM_KIND_SHIFT == BEX__IMM_KIND_DATA;
}
static inline uint32_t bex__imm_stream(uint32_t imm)
{
    return (imm >> BEX__IMM_STREAM_SHIFT) & BEX__IMM_STREAM_MAX;
}
static inline uint16_t bex__imm_credits(uint32_t imm)
{
    return (uint16_t)(imm & BEX__IMM_CREDITS_MAX);
}
/* A received SEND_WITH_IMM of len bytes with immediate imm (host order) as
 * the header it stands for (type DATA, stream, credits, len; the rest 0).
 * Returns 0 or -EPROTO (a kind no valid peer sends). Inline: once a
 * message. */
static inline int bex__imm_decode(uint32_t imm, uint32_t len, struct bex__hdr *h)
{
    *h = (struct bex__hdr){
        .type = BEX__MSG_DATA,
        .credits = bex__imm_credits(imm),
        .stream = bex__imm_stream(imm),
        .len = len,
    };
    return bex__imm_is_data(imm) ? 0 : -EPROTO;
}
/* A TCP frame's header (BEX__HDR_LEN bytes; its payload follows, h->len
 * bytes for DATA and DIRECT, none otherwise): 0 or -EPROTO. */
int bex__hdr_decode_frame(const uint8_t *in, struct bex__hdr *h);

#endif
