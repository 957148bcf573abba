/* SPDX-License-Identifier: Apache-2.0 */
/* Fuzz target: the decoder of the 32-byte header that starts every SEND a
 * peer's engine makes (bex__hdr_decode); the bytes are the received SEND,
 * header and payload.
 *
 * Checks: the result is 0 or -EPROTO; an accepted header has a known type,
 * no flags, a length that matches what arrived (DATA: the payload; the
 * others: nothing after the header), no positive RNDV_RESP status, and
 * encodes back to exactly its 32 bytes; a DATA header names a stream the
 * immediate cannot. The first 4 bytes (little-endian) are also tried as the
 * immediate of a header-free DATA of the remaining bytes: accepted only as
 * kind DATA, and then it encodes back to the same 32 bits. */
#include <errno.h>
#include <string.h>

#include "transport/rdma/engine.h"
#include "fuzz.h"

static void try_imm(const uint8_t *data, size_t size)
{
    if (size < 4)
        return;
    uint32_t imm = (uint32_t)data[0] | (uint32_t)data[1] << 8 | (uint32_t)data[2] << 16 |
                   (uint32_t)data[3] << 24;
    struct bex__hdr h;
    int rc = bex__imm_decode(imm, (uint32_t)(size - 4), &h);
    FZ_CHECK(rc == 0 || rc == -EPROTO);
    FZ_CHECK((rc == 0) == (imm >> BEX__IMM_KIND_SHIFT == BEX__IMM_KIND_DATA));
    if (rc)
        return;
    FZ_CHECK(h.type == BEX__MSG_DATA && h.len == size - 4 && h.flags == 0);
    FZ_CHECK(h.stream <= BEX__IMM_STREAM_MAX && h.credits <= BEX__IMM_CREDITS_MAX);
    FZ_CHECK(bex__imm_encode(h.stream, h.credits) == imm);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    try_imm(data, size);
    struct bex__hdr h;
    int rc = bex__hdr_decode(data, size, &h);
    FZ_CHECK(rc == 0 || rc == -EPROTO);
    if (rc)
        return 0;
    FZ_CHECK(size >= BEX__HDR_LEN);
    FZ_CHECK(h.type >= BEX__MSG_DATA && h.type <= BEX__MSG_CLOSE && h.flags == 0);
    if (h.type == BEX__MSG_DATA)
        FZ_CHECK(h.len == size - BEX__HDR_LEN && h.stream > BEX__IMM_STREAM_MAX);
    else
        FZ_CHECK(size == BEX__HDR_LEN);
    if (h.type == BEX__MSG_RNDV_RESP)
        FZ_CHECK(h.status <= 0);
    uint8_t again[BEX__HDR_LEN];
    bex__hdr_encode(&h, again);
    FZ_CHECK(memcmp(again, data, BEX__HDR_LEN) == 0);
    return 0;
}
