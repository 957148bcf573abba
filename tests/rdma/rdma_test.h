/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the rxe tests of the rdma module: the "is there an RDMA device
 * and a test address pair" check, and small payload helpers. */
#ifndef BEX_TESTS_RDMA_TEST_H
#define BEX_TESTS_RDMA_TEST_H

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "harness.h"

/* The two local addresses the tests use (rxe0's and rxe1's in the VM). */
struct test_addrs {
    struct in_addr a0, a1;
    char s0[INET_ADDRSTRLEN], s1[INET_ADDRSTRLEN];
};

/* 0 when a device and BEX_TEST_ADDR0/1 exist; the harness's skip (77, or a
 * failure under BEX_REQUIRE_RDMA=1) otherwise. A set but unparsable address
 * is a broken setup, not a missing one: that fails. */
static inline int test_need_rdma(struct test_addrs *out)
{
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (list)
        ibv_free_device_list(list);
    if (!list || n == 0)
        return bex_test_skip("no RDMA device");
    const char *s0 = getenv("BEX_TEST_ADDR0"), *s1 = getenv("BEX_TEST_ADDR1");
    if (!s0 || !*s0 || !s1 || !*s1)
        return bex_test_skip("BEX_TEST_ADDR0/BEX_TEST_ADDR1 not set");
    if (inet_pton(AF_INET, s0, &out->a0) != 1 || inet_pton(AF_INET, s1, &out->a1) != 1) {
        fprintf(stderr, "FAIL: BEX_TEST_ADDR0=%s / BEX_TEST_ADDR1=%s are not IPv4 addresses\n", s0,
                s1);
        exit(1);
    }
    snprintf(out->s0, sizeof out->s0, "%s", s0);
    snprintf(out->s1, sizeof out->s1, "%s", s1);
    return 0;
}

/* FNV-1a, 64 bit: the checksum sent along with every payload. */
static inline uint64_t test_fnv1a(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* Deterministic payload bytes from a seed, so the receiver can regenerate
 * what the sender wrote and compare byte by byte, not only the checksum. */
static inline void test_fill(void *p, size_t n, uint64_t seed)
{
    uint8_t *b = p;
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b[i] = (uint8_t)(x >> 24);
    }
}

#endif
