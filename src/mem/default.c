/* SPDX-License-Identifier: Apache-2.0 */
/* The process-wide default pool (the paper's RdmaMemoryPool). */
#include <errno.h>
#include <infiniband/verbs.h>
#include <pthread.h>

#include "mem/internal.h"
#include "rdma/rdma.h"

static pthread_mutex_t default_lock = PTHREAD_MUTEX_INITIALIZER;
/* Read without the lock by bex_mem_default_alloc(); init publishes with
 * release so a thread that sees the pool sees it initialized. */
static _Atomic(bex_mem_pool *) default_pool;
/* The device's process-wide handle (src/rdma/device.c): its one PD is the
 * one every context on the device uses too, so the default pool's memory
 * serves their connections and the process has one PD per device. */
static struct bex__rdma_dev *default_dev;

int bex_mem_default_init(struct ibv_context *ctx)
{
    int rc;
    bex_mem_registrar reg;
    struct bex__rdma_dev *dev = NULL;
    bex_mem_pool *pool;

    pthread_mutex_lock(&default_lock);
    if (atomic_load_explicit(&default_pool, memory_order_relaxed)) {
        rc = -EALREADY;
        goto out_unlock;
    }
    if (ctx) {
        rc = bex__rdma_dev_open(ibv_get_device_name(ctx->device), &dev);
        if (rc)
            goto out_unlock;
        bex_mem_registrar_verbs(&reg, dev->pd, BEX_MEM_ACCESS_DEFAULT);
    } else {
        bex_mem_registrar_noop(&reg);
    }
    rc = bex_mem_pool_create(&reg, NULL, &pool);
    if (rc != 0)
        goto err_close_dev;
    default_dev = dev;
    atomic_store_explicit(&default_pool, pool, memory_order_release);
    pthread_mutex_unlock(&default_lock);
    return 0;

err_close_dev:
    bex__rdma_dev_close(dev);
out_unlock:
    pthread_mutex_unlock(&default_lock);
    return rc;
}

struct ibv_pd *bex_mem_default_pd(void)
{
    pthread_mutex_lock(&default_lock);
    struct ibv_pd *pd = default_dev ? default_dev->pd : NULL;
    pthread_mutex_unlock(&default_lock);
    return pd;
}

bex_mem_pool *bex_mem_default_pool(void)
{
    return atomic_load_explicit(&default_pool, memory_order_acquire);
}

void *bex_mem_default_alloc(size_t size)
{
    bex_mem_pool *pool = atomic_load_explicit(&default_pool, memory_order_acquire);
    if (!pool) {
        errno = EINVAL;
        return NULL;
    }
    return bex_mem_alloc(pool, size);
}

int bex_mem_default_fini(void)
{
    pthread_mutex_lock(&default_lock);
    bex_mem_pool *pool = atomic_load_explicit(&default_pool, memory_order_relaxed);
    int rc = pool ? bex_mem_pool_destroy(pool) : -EINVAL;
    if (rc == 0) {
        atomic_store_explicit(&default_pool, NULL, memory_order_relaxed);
        /* the PD goes with the device's last reference */
        rc = bex__rdma_dev_close(default_dev);
        default_dev = NULL;
    }
    pthread_mutex_unlock(&default_lock);
    return rc;
}
