/* SPDX-License-Identifier: Apache-2.0 */
/* Fuzz target: the authenticated setup's decoders (src/rdma/hello.c), which
 * read what any host that connects sends before it has proved anything:
 * bex__setup_peek (the 8-byte preamble), bex__auth_decode (OPEN, CHALLENGE,
 * PROOF), bex__auth_decode_hello (a HELLO with its MAC) and
 * bex__auth_verify on what was decoded.
 *
 * Checks: results are only the documented ones; outputs are untouched on
 * refusal; what the peek says (type, length) agrees with what the decoders
 * accept; an accepted message encodes back to exactly the input; a MAC
 * verifies only if it equals the one computed for the transcript (the
 * input's MAC against a fixed key is refused unless it is that MAC). */
#include <errno.h>
#include <string.h>

#include "fuzz.h"
#include "wire/hello.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t want = 0;
    int kind = size >= BEX__SETUP_PRE_LEN ? bex__setup_peek(data, &want) : -EBADMSG;
    FZ_CHECK(kind == BEX__SETUP_HELLO || kind == BEX__SETUP_AUTH || kind == BEX__SETUP_NOTICE ||
             kind == -EPROTO || kind == -EBADMSG);
    if (kind == BEX__SETUP_NOTICE)
        FZ_CHECK(want == BEX__READY_LEN);
    if (kind == BEX__SETUP_HELLO)
        FZ_CHECK(want == BEX__HELLO_LEN);
    if (kind == BEX__SETUP_AUTH)
        FZ_CHECK(want == BEX__AUTH_SHORT_LEN || want == BEX__AUTH_HELLO_LEN);

    /* the short messages */
    for (uint8_t type = BEX__AUTH_OPEN; type <= BEX__AUTH_PROOF; type++) {
        uint8_t body[32], sentinel[32];
        memset(body, 0xa5, sizeof body);
        memcpy(sentinel, body, sizeof body);
        int rc = bex__auth_decode(data, size, type, body);
        FZ_CHECK(rc == 0 || rc == -EPROTO || rc == -EBADMSG);
        if (rc) {
            FZ_CHECK(memcmp(body, sentinel, sizeof body) == 0);
            continue;
        }
        FZ_CHECK(kind == BEX__SETUP_AUTH && want == size && size == BEX__AUTH_SHORT_LEN);
        uint8_t again[BEX__AUTH_SHORT_LEN];
        bex__auth_encode(type, body, again);
        FZ_CHECK(memcmp(again, data, sizeof again) == 0);
    }

    /* the HELLO */
    struct bex__hello h;
    uint8_t mac[BEX__AUTH_MAC_LEN], mac_sentinel[BEX__AUTH_MAC_LEN];
    memset(mac, 0x5a, sizeof mac);
    memcpy(mac_sentinel, mac, sizeof mac);
    int rc = bex__auth_decode_hello(data, size, &h, mac);
    /* -EPROTONOSUPPORT: the embedded hello names a route we do not support */
    FZ_CHECK(rc == 0 || rc == -EPROTO || rc == -EBADMSG || rc == -EPROTONOSUPPORT);
    if (rc) {
        FZ_CHECK(memcmp(mac, mac_sentinel, sizeof mac) == 0);
        return 0;
    }
    FZ_CHECK(kind == BEX__SETUP_AUTH && want == size && size == BEX__AUTH_HELLO_LEN);
    /* the embedded hello is a valid plain hello, and the whole encodes back */
    struct bex__hello plain;
    FZ_CHECK(bex__hello_decode(data + BEX__AUTH_HDR_LEN, BEX__HELLO_LEN, &plain) == 0);
    uint8_t hello[BEX__HELLO_LEN], again[BEX__AUTH_HELLO_LEN];
    bex__hello_encode(&h, hello);
    FZ_CHECK(memcmp(hello, data + BEX__AUTH_HDR_LEN, BEX__HELLO_LEN) == 0);
    bex__auth_encode_hello(hello, mac, again);
    FZ_CHECK(memcmp(again, data, sizeof again) == 0);

    /* its MAC, against a fixed key over a transcript made of the input */
    static const char secret[] = "fuzz-secret-of-enough-length-32b";
    uint8_t key[BEX__AUTH_KEY_LEN];
    FZ_CHECK(bex__auth_key(secret, sizeof secret - 1, key) == 0);
    struct bex__auth_transcript t;
    memset(&t, 0, sizeof t);
    memcpy(t.nonce_l, mac, sizeof t.nonce_l);
    bex__auth_ends(&t, 0x0100000a, 0x3412, 0x0200000a, 0x7856);
    uint8_t good[BEX__AUTH_MAC_LEN];
    bex__auth_mac(key, BEX__AUTH_MAC_HELLO_L, &t, hello, NULL, good);
    FZ_CHECK(bex__auth_verify(key, BEX__AUTH_MAC_HELLO_L, &t, hello, NULL, good) == 0);
    int v = bex__auth_verify(key, BEX__AUTH_MAC_HELLO_L, &t, hello, NULL, mac);
    FZ_CHECK(v == (memcmp(good, mac, sizeof mac) == 0 ? 0 : -EACCES));
    /* one bit off anywhere in the hello and the good MAC fails */
    hello[data[size - 1] % BEX__HELLO_LEN] ^= 1;
    FZ_CHECK(bex__auth_verify(key, BEX__AUTH_MAC_HELLO_L, &t, hello, NULL, good) == -EACCES);
    return 0;
}
