/* SPDX-License-Identifier: Apache-2.0 */
/* Fuzz target: the hello decoder (bex__hello_decode), which reads the first
 * bytes any host that connects to a listener sends.
 *
 * Checks: the result is 0, -EPROTO or -EBADMSG; a refused input leaves *out
 * untouched; an accepted one has every field in the range hello.h
 * documents, and encoding it gives back exactly the input (the layout has
 * no slack: reserved bytes are zero, the length is fixed). */
#include <errno.h>
#include <string.h>

#include "fuzz.h"
#include "hello_test.h"

static int gid_zero(const uint8_t *g)
{
    for (int i = 0; i < 16; i++)
        if (g[i])
            return 0;
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct bex__hello h, sentinel;
    memset(&sentinel, 0xa5, sizeof sentinel);
    h = sentinel;
    int rc = bex__hello_decode(data, size, &h);
    FZ_CHECK(rc == 0 || rc == -EPROTO || rc == -EBADMSG || rc == -EPROTONOSUPPORT);
    if (rc) {
        FZ_CHECK(bex_test_hello_same(&h, &sentinel));
        return 0;
    }
    FZ_CHECK(size == BEX__HELLO_LEN);
    FZ_CHECK((h.flags & ~BEX__HELLO_F_ALL) == 0);
    FZ_CHECK(h.route <= BEX__HELLO_ROUTE_IB);
    FZ_CHECK(h.route == BEX__HELLO_ROUTE_IB ? h.lid >= 1 && h.lid <= BEX__HELLO_LID_MAX
                                            : h.lid == 0);
    FZ_CHECK(h.conn_id != 0);
    FZ_CHECK(h.max_msg >= 1 && h.max_msg <= BEX__HELLO_MAX_MSG);
    if (h.flags & BEX__HELLO_F_NO_RDMA) {
        FZ_CHECK(h.qpn == 0 && h.psn == 0 && gid_zero(h.gid) && h.mtu == 0 && h.rd_atomic == 0);
        FZ_CHECK(h.recv_depth == 0 && h.sq_depth == 0 && h.frag_size == 0 && h.eager_max == 0);
        FZ_CHECK(h.ka_addr == 0 && h.ka_rkey == 0 && h.max_rndv == 0);
        FZ_CHECK((h.flags & BEX__HELLO_F_SRQ) == 0);
    } else {
        FZ_CHECK(h.qpn >= 2 && h.qpn <= 0xffffffu && h.psn <= 0xffffffu);
        FZ_CHECK(!gid_zero(h.gid) && h.mtu >= 1 && h.mtu <= 5);
        FZ_CHECK(h.recv_depth >= 1 && h.sq_depth >= 1);
        FZ_CHECK(h.frag_size >= BEX__HELLO_MIN_FRAG && h.frag_size <= BEX__HELLO_MAX_MSG);
        FZ_CHECK(h.eager_max <= BEX__HELLO_MAX_EAGER && h.ka_addr != 0 && h.max_rndv >= 1);
    }
    uint8_t again[BEX__HELLO_LEN];
    bex__hello_encode(&h, again);
    FZ_CHECK(memcmp(again, data, BEX__HELLO_LEN) == 0);
    struct bex__hello h2;
    FZ_CHECK(bex__hello_decode(again, sizeof again, &h2) == 0 && bex_test_hello_same(&h, &h2));
    return 0;
}
