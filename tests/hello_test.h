/* SPDX-License-Identifier: Apache-2.0 */
/* The hello (src/wire/hello.h) of the tests that encode, decode or
 * authenticate one (tests/rdma/test_hello.c, test_auth.c,
 * tests/fuzz/fuzz_hello.c). */
#ifndef BEX_TEST_HELLO_H
#define BEX_TEST_HELLO_H

#include <string.h>

#include "wire/hello.h"

/* An RDMA hello with every field set, each within its range. */
static inline struct bex__hello bex_test_hello_sample(void)
{
    return (struct bex__hello){
        .flags = 0,
        .qpn = 0x123456,
        .psn = 0xabcdef,
        .gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 99, 0, 1},
        .mtu = 3,
        .rd_atomic = 16,
        .recv_depth = 64,
        .sq_depth = 32,
        .max_msg = 8u << 20,
        .frag_size = 4096,
        .conn_id = 0x0123456789abcdefull,
        .eager_max = 8192,
        .ka_addr = 0x00007f0011223344ull,
        .ka_rkey = 0xdeadbeef,
        .max_rndv = 256,
        .ka_timeout_ms = 2000,
    };
}

/* Every field of a and b equal (a struct compare would see padding too). */
static inline int bex_test_hello_same(const struct bex__hello *a, const struct bex__hello *b)
{
    return a->flags == b->flags && a->qpn == b->qpn && a->psn == b->psn &&
           memcmp(a->gid, b->gid, 16) == 0 && a->mtu == b->mtu && a->rd_atomic == b->rd_atomic &&
           a->recv_depth == b->recv_depth && a->sq_depth == b->sq_depth &&
           a->max_msg == b->max_msg && a->frag_size == b->frag_size && a->conn_id == b->conn_id &&
           a->eager_max == b->eager_max && a->ka_addr == b->ka_addr && a->ka_rkey == b->ka_rkey &&
           a->max_rndv == b->max_rndv && a->ka_timeout_ms == b->ka_timeout_ms &&
           a->route == b->route && a->lid == b->lid;
}

#endif
