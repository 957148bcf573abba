/* SPDX-License-Identifier: Apache-2.0 */
/* rdma module internals shared by its .c files and its tests. */
#ifndef BEX_RDMA_INTERNAL_H
#define BEX_RDMA_INTERNAL_H

/* How bex__rdma_find_ipv4 reads GID tables, for tests of the fallbacks:
 * 0 (default) ibv_query_gid_table, falling back per entry when it fails;
 * 1 per entry with ibv_query_gid_ex (kernels without the table query);
 * 2 per entry with ibv_query_gid + the sysfs type file (no extended query).
 * Not thread-safe: set it before any lookup. */
extern int bex__rdma_gid_query_mode;

#endif
