/* SPDX-License-Identifier: Apache-2.0 */
#include <endian.h>
#include <errno.h>
#include <stddef.h>
#include <string.h>

#include "wire/hdr.h"

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

/* On a little-endian host struct bex__hdr is the wire's layout, so a
 * header is copied whole (four moves, where the fields took some 25
 * instructions each way a frame: issue 25 item 2). */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define HDR_AS_WIRE 1
_Static_assert(sizeof(struct bex__hdr) == BEX__HDR_LEN && offsetof(struct bex__hdr, flags) == 1 &&
                   offsetof(struct bex__hdr, credits) == 2 &&
                   offsetof(struct bex__hdr, stream) == 4 && offsetof(struct bex__hdr, len) == 8 &&
                   offsetof(struct bex__hdr, id) == 12 && offsetof(struct bex__hdr, addr) == 16 &&
                   offsetof(struct bex__hdr, rkey) == 24 && offsetof(struct bex__hdr, status) == 28,
               "struct bex__hdr is laid out as docs/protocol.md's header");
#else
#define HDR_AS_WIRE 0
#endif

void bex__hdr_encode(const struct bex__hdr *h, uint8_t *out)
{
    if (HDR_AS_WIRE) {
        memcpy(out, h, BEX__HDR_LEN);
        return;
    }
    out[0] = h->type;
    out[1] = h->flags;
    put16(out + 2, h->credits);
    put32(out + 4, h->stream);
    put32(out + 8, h->len);
    put32(out + 12, h->id);
    put64(out + 16, h->addr);
    put32(out + 24, h->rkey);
    put32(out + 28, (uint32_t)h->status);
}

static void fields(const uint8_t *in, struct bex__hdr *h)
{
    if (HDR_AS_WIRE) {
        memcpy(h, in, BEX__HDR_LEN);
        return;
    }
    h->type = in[0];
    h->flags = in[1];
    h->credits = get16(in + 2);
    h->stream = get32(in + 4);
    h->len = get32(in + 8);
    h->id = get32(in + 12);
    h->addr = get64(in + 16);
    h->rkey = get32(in + 24);
    h->status = (int32_t)get32(in + 28);
}

int bex__hdr_decode(const uint8_t *in, size_t len, struct bex__hdr *h)
{
    if (len < BEX__HDR_LEN)
        return -EPROTO;
    fields(in, h);
    if (h->type < BEX__MSG_DATA || h->type > BEX__MSG_CLOSE || h->flags != 0)
        return -EPROTO;
    if (h->type == BEX__MSG_DATA &&
        (h->len != len - BEX__HDR_LEN || h->stream <= BEX__IMM_STREAM_MAX))
        return -EPROTO; /* a stream the immediate names goes header-free */
    if (h->type != BEX__MSG_DATA && len != BEX__HDR_LEN)
        return -EPROTO;
    if (h->type == BEX__MSG_RNDV_RESP && h->status > 0)
        return -EPROTO;
    return 0;
}

int bex__hdr_decode_frame(const uint8_t *in, struct bex__hdr *h)
{
    fields(in, h);
    /* no rendezvous over TCP: the payload follows its header */
    if (h->flags != 0 || h->type == BEX__MSG_RNDV_REQ || h->type == BEX__MSG_RNDV_RESP ||
        h->type < BEX__MSG_DATA || h->type > BEX__MSG_DIRECT)
        return -EPROTO;
    if (h->type != BEX__MSG_DATA && h->type != BEX__MSG_DIRECT && h->len != 0)
        return -EPROTO;
    return 0;
}
