/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the directory's unit tests without I/O (test_dir.c,
 * test_dir_early.c): nodes named by their "ip:port". */
#ifndef BEX_TEST_DIR_H
#define BEX_TEST_DIR_H

#include <arpa/inet.h>

#include "bex/dir.h"
#include "harness.h"
#include "rpc/dir_internal.h"

static inline bex_addr A(const char *s)
{
    bex_addr a;
    CHECK(bex__dir_parse_addr(s, &a, NULL, 0) == 0);
    return a;
}

/* The directory's node at addr (it must be there). */
static inline struct bex__dir_node *node(bex_dir *d, const char *addr)
{
    bex_addr a = A(addr);
    struct bex__dir_node *n = bex__dir_node_find(d, &a);
    CHECK(n);
    return n;
}

static inline bex_dir_node_stats stats(bex_dir *d, const char *addr)
{
    bex_addr a = A(addr);
    bex_dir_node_stats s;
    CHECK_OK(bex_dir_node_stats_get(d, &a, &s));
    return s;
}

#endif
