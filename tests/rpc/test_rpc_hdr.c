/* SPDX-License-Identifier: Apache-2.0 */
/* The RPC wire header: a round trip through the codec, every malformed
 * header refused, and the latency histogram's quantiles. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "harness.h"
#include "rpc/internal.h"

static int t_codec(void)
{
    uint8_t m[BEX_RPC_HDR_LEN + 5];
    struct bex__rpc_hdr h = {.kind = BEX__RPC_RESPONSE,
                             .service = 0xA1B2C3D4u,
                             .method = 7,
                             .call_id = 0x1122334455667788ull,
                             .client_id = 0x99AABBCCDDEEFF00ull,
                             .seq = 42,
                             .status = -ESTALE,
                             .body_len = 5,
                             .tok = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}};
    bex__rpc_hdr_encode(&h, m);
    CHECK(m[52] == 1 && m[63] == 12); /* the token: bytes 52..63 */
    /* little-endian on the wire, whatever the host */
    CHECK_EQ(m[0], 0xC1);
    CHECK_EQ(m[1], 0xB5);
    CHECK_EQ(m[2], 1);
    CHECK_EQ(m[16], 0x88);
    struct bex__rpc_hdr g;
    const char *why;
    CHECK_OK(bex__rpc_hdr_decode(m, sizeof m, &g, &why));
    CHECK_EQ(g.kind, h.kind);
    CHECK_EQ(g.service, h.service);
    CHECK_EQ(g.method, h.method);
    CHECK(g.call_id == h.call_id && g.client_id == h.client_id && g.seq == h.seq);
    CHECK_EQ(g.status, -ESTALE);
    CHECK_EQ(g.body_len, 5);
    CHECK(memcmp(g.tok, h.tok, sizeof g.tok) == 0);
    return 0;
}

/* An answer's header written from its request's (bex__rpc_answer_encode)
 * is byte for byte what the generic encoder writes for that answer. */
static int t_answer(void)
{
    struct bex__rpc_hdr rq = {.kind = BEX__RPC_REQUEST,
                              .flags = BEX__RPC_F_DEST,
                              .service = 0xA1B2C3D4u,
                              .method = 7,
                              .call_id = 0x1122334455667788ull,
                              .client_id = 0x99AABBCCDDEEFF00ull,
                              .seq = 42,
                              .body_len = 9,
                              .timeout_ms = 1500,
                              .tok = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}};
    const struct {
        uint8_t kind;
        int32_t status;
        uint32_t len;
    } c[] = {
        {BEX__RPC_RESPONSE, 0, 5}, {BEX__RPC_RESPONSE, -EAGAIN, 0}, {BEX__RPC_ERROR, -ENOSYS, 0}};
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        uint8_t want[BEX_RPC_HDR_LEN], got[BEX_RPC_HDR_LEN];
        struct bex__rpc_hdr a = rq;
        a.kind = c[i].kind;
        a.flags = 0;
        a.status = c[i].status;
        a.body_len = c[i].len;
        a.timeout_ms = 0;
        bex__rpc_hdr_encode(&a, want);
        memset(got, 0xEE, sizeof got); /* every byte must be written */
        bex__rpc_answer_encode(&rq, c[i].kind, c[i].status, c[i].len, got);
        CHECK(memcmp(got, want, sizeof got) == 0);
        struct bex__rpc_hdr g;
        const char *why;
        uint8_t m[BEX_RPC_HDR_LEN + 5] = {0};
        memcpy(m, got, sizeof got);
        CHECK_OK(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN + c[i].len, &g, &why));
        CHECK_EQ(g.kind, c[i].kind);
        CHECK(g.call_id == rq.call_id && g.seq == rq.seq && g.status == c[i].status);
    }
    return 0;
}

/* Each corruption alone is refused, with a reason (bytes 52..63 are the
 * client's token: any value). */
static int t_strict(void)
{
    struct bex__rpc_hdr good = {.kind = BEX__RPC_REQUEST,
                                .service = 1,
                                .method = 2,
                                .call_id = 3,
                                .client_id = 4,
                                .seq = 5,
                                .body_len = 0,
                                .timeout_ms = 40};
    uint8_t m[BEX_RPC_HDR_LEN + 8];
    struct bex__rpc_hdr g;
    const char *why;
    bex__rpc_hdr_encode(&good, m);
    CHECK_OK(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN, &g, &why));
    struct {
        int off;
        uint8_t val;
    } flips[] = {{0, 0},
                 {1, 0},
                 {2, 2},
                 {3, 0},
                 {3, 4},
                 {4, 1},
                 {44, 1},
                 /* a request with a status */ {40, 0xff}};
    for (size_t i = 0; i < sizeof flips / sizeof flips[0]; i++) {
        bex__rpc_hdr_encode(&good, m);
        m[flips[i].off] = flips[i].val;
        CHECK_EQ(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN, &g, &why), -EBADMSG);
        CHECK(why != NULL);
    }
    /* length: shorter than a header, or a body the header does not announce */
    bex__rpc_hdr_encode(&good, m);
    CHECK_EQ(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN - 1, &g, &why), -EBADMSG);
    CHECK_EQ(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN + 8, &g, &why), -EBADMSG);
    /* a request without a call id */
    struct bex__rpc_hdr h = good;
    h.call_id = 0;
    bex__rpc_hdr_encode(&h, m);
    CHECK_EQ(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN, &g, &why), -EBADMSG);
    /* answers: a positive status, an error without one, a timeout */
    h = good;
    h.kind = BEX__RPC_RESPONSE;
    h.timeout_ms = 0;
    h.status = 5;
    bex__rpc_hdr_encode(&h, m);
    CHECK_EQ(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN, &g, &why), -EBADMSG);
    h.status = 0;
    h.kind = BEX__RPC_ERROR;
    bex__rpc_hdr_encode(&h, m);
    CHECK_EQ(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN, &g, &why), -EBADMSG);
    h.kind = BEX__RPC_RESPONSE;
    h.timeout_ms = 1;
    bex__rpc_hdr_encode(&h, m);
    CHECK_EQ(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN, &g, &why), -EBADMSG);
    h.timeout_ms = 0;
    bex__rpc_hdr_encode(&h, m);
    CHECK_OK(bex__rpc_hdr_decode(m, BEX_RPC_HDR_LEN, &g, &why));
    return 0;
}

/* Quantiles within a bucket's width (1/16 of a power of two) of the truth. */
static int t_histogram(void)
{
    static struct bex__rpc_hist h;
    CHECK(bex__rpc_hist_quantile(&h, 0.5) == 0);
    for (uint64_t us = 1; us <= 10000; us++)
        bex__rpc_hist_add(&h, us * 1000);
    CHECK_EQ(h.count, 10000);
    const struct {
        double q, want;
    } c[] = {{0.5, 5000e3}, {0.99, 9900e3}, {0.999, 9990e3}, {0.0001, 1e3}};
    for (size_t i = 0; i < 4; i++) {
        double got = bex__rpc_hist_quantile(&h, c[i].q);
        double err = got > c[i].want ? got - c[i].want : c[i].want - got;
        if (err > c[i].want / 16) {
            fprintf(stderr, "q %.4f: %.0f, want %.0f\n", c[i].q, got, c[i].want);
            return 1;
        }
    }
    /* small values are exact */
    static struct bex__rpc_hist s;
    for (int i = 0; i < 10; i++)
        bex__rpc_hist_add(&s, 3);
    CHECK(bex__rpc_hist_quantile(&s, 0.5) == 3.5);
    return 0;
}

BEX_TEST_MAIN({"codec", t_codec}, {"answer", t_answer}, {"strict", t_strict},
              {"histogram", t_histogram})
