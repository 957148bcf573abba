/* Fuzz target: the decoder of the 32-byte header that starts every SEND a
 * peer's engine makes (bex__hdr_decode); the bytes are the received SEND,
 * header and payload.
 *
 * Checks: the result is 0 or -EPROTO; an accepted header has a known type,
 * no flags, a length that matches what arrived (DATA: the payload; the
 * others: nothing after the header), no positive RNDV_RESP status, and
 * encodes back to exactly its 32 bytes. */
#include <errno.h>
#include <string.h>

#include "engine/internal.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct bex__hdr h;
    int rc = bex__hdr_decode(data, size, &h);
    FZ_CHECK(rc == 0 || rc == -EPROTO);
    if (rc)
        return 0;
    FZ_CHECK(size >= BEX__HDR_LEN);
    FZ_CHECK(h.type >= BEX__MSG_DATA && h.type <= BEX__MSG_CLOSE && h.flags == 0);
    if (h.type == BEX__MSG_DATA)
        FZ_CHECK(h.len == size - BEX__HDR_LEN);
    else
        FZ_CHECK(size == BEX__HDR_LEN);
    if (h.type == BEX__MSG_RNDV_RESP)
        FZ_CHECK(h.status <= 0);
    uint8_t again[BEX__HDR_LEN];
    bex__hdr_encode(&h, again);
    FZ_CHECK(memcmp(again, data, BEX__HDR_LEN) == 0);
    return 0;
}
