/* SPDX-License-Identifier: Apache-2.0 */
/* rdma module internals shared by its .c files and its tests. */
#ifndef BEX_RDMA_INTERNAL_H
#define BEX_RDMA_INTERNAL_H

#include <infiniband/verbs.h>

/* How bex__rdma_find_ipv4 reads GID tables, for tests of the fallbacks:
 * 0 (default) ibv_query_gid_table, falling back per entry when it fails;
 * 1 per entry with ibv_query_gid_ex (kernels without the table query);
 * 2 per entry with ibv_query_gid + the sysfs type file (no extended query).
 * Not thread-safe: set it before any lookup. */
extern int bex__rdma_gid_query_mode;

/* The verbs calls that change a QP's state, behind a table so a test can
 * record the attributes of a route rxe cannot run (InfiniBand, RoCE v1)
 * against a fake device, the way rdma-core's providers fill
 * verbs_context_ops. libbex never writes it; a test sets it before any
 * QP is used. */
struct bex__rdma_verbs_ops {
    int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
};
extern struct bex__rdma_verbs_ops bex__rdma_ops;

#endif
