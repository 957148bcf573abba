/* SPDX-License-Identifier: Apache-2.0 */
/* Fuzz target: the decoder of the 64-byte RPC header (bex__rpc_hdr_decode)
 * that starts every RPC message a peer sends; the bytes are the received
 * message, header and body.
 *
 * Checks: the result is 0 or -EBADMSG (with a reason exactly when
 * refused); an accepted header has a known kind, only known flags (the
 * destination flag on requests alone; a DEST message of its fixed size),
 * a body length
 * that is what arrived after it, a status 0 or a negative errno (0 in a
 * request, non-zero in an ERROR), a call id in a request, no timeout in an
 * answer, and encodes back to exactly its 64 bytes. */
#include <errno.h>
#include <string.h>

#include "fuzz.h"
#include "rpc/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct bex__rpc_hdr h;
    const char *why = NULL;
    int rc = bex__rpc_hdr_decode(data, size, &h, &why);
    FZ_CHECK(rc == 0 || rc == -EBADMSG);
    FZ_CHECK((rc != 0) == (why != NULL));
    if (rc)
        return 0;
    FZ_CHECK(size >= BEX_RPC_HDR_LEN);
    FZ_CHECK(h.kind >= BEX__RPC_REQUEST && h.kind <= BEX__RPC_DEST);
    FZ_CHECK((h.flags & ~BEX__RPC_FLAGS_KNOWN) == 0);
    FZ_CHECK(!(h.flags & BEX__RPC_F_DEST) || h.kind == BEX__RPC_REQUEST);
    if (h.kind == BEX__RPC_DEST) /* version 2: where a call's answer goes */
        FZ_CHECK(h.body_len == BEX__RPC_DEST_LEN && h.call_id != 0 && h.status == 0);
    FZ_CHECK(h.body_len == size - BEX_RPC_HDR_LEN);
    FZ_CHECK(h.status <= 0 && h.status >= -4095);
    if (h.kind == BEX__RPC_REQUEST)
        FZ_CHECK(h.status == 0 && h.call_id != 0);
    else if (h.kind != BEX__RPC_DEST)
        FZ_CHECK(h.timeout_ms == 0);
    if (h.kind == BEX__RPC_ERROR)
        FZ_CHECK(h.status != 0);
    uint8_t again[BEX_RPC_HDR_LEN];
    bex__rpc_hdr_encode(&h, again);
    FZ_CHECK(memcmp(again, data, BEX_RPC_HDR_LEN) == 0);
    return 0;
}
