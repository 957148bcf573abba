/* SPDX-License-Identifier: Apache-2.0 */
/* A server landing pool (rendezvous destinations, exposed buffers) whose
 * registrations beyond one 4 MiB chunk fail with -ENOMEM: the receiver
 * cannot take a large message. Set pair_server_landing = nomem_landing and
 * pair_server_pool_release = nomem_landing_release around pair_run. */
#ifndef BEX_TESTS_SOCK_NOMEM_H
#define BEX_TESTS_SOCK_NOMEM_H

#include "pair.h"
#include "rdma/rdma.h"

static int nomem_reg(void *ctx, bex_mem_region *mr)
{
    const bex_mem_registrar *inner = ctx;
    if (mr->length > (4u << 20))
        return -ENOMEM; /* a registration beyond one chunk: refused */
    return inner->reg(inner->ctx, mr);
}

static void nomem_dereg(void *ctx, bex_mem_region *mr)
{
    const bex_mem_registrar *inner = ctx;
    inner->dereg(inner->ctx, mr);
}

/* the context opens the same per-process device handle and PD */
static struct bex__rdma_dev *nomem_dev;

static void nomem_landing_release(void)
{
    CHECK_OK(bex__rdma_dev_close(nomem_dev));
}

static bex_mem_pool *nomem_landing(struct in_addr a)
{
    static struct bex__rdma_path path;
    static bex_mem_registrar inner;
    CHECK_OK(bex__rdma_dev_open_ipv4(a, &nomem_dev, &path));
    bex_mem_registrar_verbs(&inner, nomem_dev->pd,
                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    bex_mem_registrar reg = {.reg = nomem_reg, .dereg = nomem_dereg, .ctx = &inner};
    bex_mem_config mc = {.kind = BEX_MEM_POOL_LANDING};
    bex_mem_pool *pool;
    CHECK_OK(bex_mem_pool_create(&reg, &mc, &pool));
    return pool;
}

#endif
