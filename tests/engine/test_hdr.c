/* SPDX-License-Identifier: Apache-2.0 */
/* The 32-byte SEND header: round trips, the pinned layout, every rule the
 * decoder enforces, and random bytes (a peer may send anything). */
#include <stdint.h>

#include "transport/rdma/engine.h"
#include "harness.h"

static struct bex__hdr sample(void)
{
    return (struct bex__hdr){.type = BEX__MSG_RNDV_RESP,
                             .credits = 0x1234,
                             .stream = 0xa1b2c3d4,
                             .len = 0,
                             .id = 0x00050007,
                             .addr = 0x00007f0011223344ull,
                             .rkey = 0xdeadbeef,
                             .status = -12};
}

static int same(const struct bex__hdr *a, const struct bex__hdr *b)
{
    return a->type == b->type && a->flags == b->flags && a->credits == b->credits &&
           a->stream == b->stream && a->len == b->len && a->id == b->id && a->addr == b->addr &&
           a->rkey == b->rkey && a->status == b->status;
}

static int roundtrip(void)
{
    uint8_t buf[BEX__HDR_LEN + 100];
    struct bex__hdr h = sample(), out;
    bex__hdr_encode(&h, buf);
    CHECK_OK(bex__hdr_decode(buf, BEX__HDR_LEN, &out));
    CHECK(same(&h, &out));
    /* DATA (only on a stream the immediate cannot name): len must equal
     * the payload that followed the header */
    h = (struct bex__hdr){
        .type = BEX__MSG_DATA, .stream = BEX__IMM_STREAM_MAX + 1, .len = 100, .credits = 7};
    bex__hdr_encode(&h, buf);
    CHECK_OK(bex__hdr_decode(buf, BEX__HDR_LEN + 100, &out));
    CHECK(same(&h, &out));
    for (int t = BEX__MSG_RNDV_REQ; t <= BEX__MSG_CLOSE; t++) {
        h = (struct bex__hdr){.type = (uint8_t)t, .stream = 9, .len = t == 2 ? 1u << 20 : 0};
        bex__hdr_encode(&h, buf);
        CHECK_OK(bex__hdr_decode(buf, BEX__HDR_LEN, &out));
        CHECK(same(&h, &out));
    }
    return 0;
}

static int wire_layout(void)
{
    static const uint8_t want[BEX__HDR_LEN] = {
        3,    0,    0x34, 0x12, 0xd4, 0xc3, 0xb2, 0xa1, /* type flags credits stream */
        0,    0,    0,    0,    7,    0,    5,    0,    /* len id */
        0x44, 0x33, 0x22, 0x11, 0,    0x7f, 0,    0,    /* addr */
        0xef, 0xbe, 0xad, 0xde, 0xf4, 0xff, 0xff, 0xff, /* rkey status (-12) */
    };
    uint8_t buf[BEX__HDR_LEN];
    struct bex__hdr h = sample();
    bex__hdr_encode(&h, buf);
    CHECK(memcmp(buf, want, sizeof want) == 0);
    return 0;
}

static int rejects(void)
{
    uint8_t buf[BEX__HDR_LEN + 8];
    struct bex__hdr h, out;
    /* too short */
    h = sample();
    bex__hdr_encode(&h, buf);
    for (size_t n = 0; n < BEX__HDR_LEN; n++)
        CHECK_EQ(bex__hdr_decode(buf, n, &out), -EPROTO);
    /* unknown types, flags */
    const uint8_t types[] = {0, 7, 8, 0x80, 0xff};
    for (size_t i = 0; i < sizeof types; i++) {
        bex__hdr_encode(&h, buf);
        buf[0] = types[i];
        CHECK_EQ(bex__hdr_decode(buf, BEX__HDR_LEN, &out), -EPROTO);
    }
    for (int bit = 0; bit < 8; bit++) {
        bex__hdr_encode(&h, buf);
        buf[1] = (uint8_t)(1u << bit);
        CHECK_EQ(bex__hdr_decode(buf, BEX__HDR_LEN, &out), -EPROTO);
    }
    /* DATA whose length disagrees with what arrived */
    h = (struct bex__hdr){.type = BEX__MSG_DATA, .stream = BEX__IMM_STREAM_MAX + 1, .len = 8};
    bex__hdr_encode(&h, buf);
    CHECK_EQ(bex__hdr_decode(buf, BEX__HDR_LEN + 7, &out), -EPROTO);
    CHECK_EQ(bex__hdr_decode(buf, BEX__HDR_LEN, &out), -EPROTO);
    /* DATA with a header on a stream the immediate names (it has one
     * encoding: header-free) */
    const uint32_t small[] = {0, 1, BEX__IMM_STREAM_MAX};
    for (size_t i = 0; i < sizeof small / sizeof small[0]; i++) {
        h = (struct bex__hdr){.type = BEX__MSG_DATA, .stream = small[i], .len = 8};
        bex__hdr_encode(&h, buf);
        CHECK_EQ(bex__hdr_decode(buf, BEX__HDR_LEN + 8, &out), -EPROTO);
    }
    /* a control message with a payload */
    h = (struct bex__hdr){.type = BEX__MSG_CREDIT};
    bex__hdr_encode(&h, buf);
    CHECK_EQ(bex__hdr_decode(buf, BEX__HDR_LEN + 1, &out), -EPROTO);
    /* a rendezvous answer with a positive status */
    h = sample();
    h.status = 5;
    bex__hdr_encode(&h, buf);
    CHECK_EQ(bex__hdr_decode(buf, BEX__HDR_LEN, &out), -EPROTO);
    return 0;
}

/* Random bytes and mutations of valid headers: decode never crashes, and
 * whatever decodes re-encodes to the same bytes. */
static int fuzz(void)
{
    uint64_t x = 0x243f6a8885a308d3ull;
    uint8_t buf[BEX__HDR_LEN + 64], again[BEX__HDR_LEN];
    size_t ok = 0;
    for (int i = 0; i < 200000; i++) {
        for (size_t j = 0; j < sizeof buf; j++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            buf[j] = (uint8_t)x;
        }
        if (i & 1) { /* keep it near valid: a real type, no flags */
            buf[0] = (uint8_t)(1 + (x >> 8) % 6);
            buf[1] = 0;
        }
        size_t len = (size_t)((x >> 20) % sizeof buf);
        struct bex__hdr h;
        if (bex__hdr_decode(buf, len, &h) == 0) {
            ok++;
            bex__hdr_encode(&h, again);
            CHECK(memcmp(again, buf, BEX__HDR_LEN) == 0);
        }
    }
    CHECK(ok > 0); /* the mutations did reach the accepting paths */
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(roundtrip), BEX_CASE(wire_layout), BEX_CASE(rejects), BEX_CASE(fuzz))
