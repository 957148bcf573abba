/* SPDX-License-Identifier: Apache-2.0 */
/* Registrars: how a pool turns a fresh chunk into a memory region. */
#include <errno.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdlib.h>

#include "common/fault.h"
#include "mem/internal.h"

/* Local only: a general pool keeps its allocator metadata inside its
 * chunks, so no peer may ever reach them (see mem.h, landing pools). */
#define DEFAULT_ACCESS IBV_ACCESS_LOCAL_WRITE

static int verbs_reg_access(struct ibv_pd *pd, int access, bex_mem_region *mr)
{
    BEX__FAULT_REG(access);
    errno = 0;
    /* Optional flags (IBV_ACCESS_RELAXED_ORDERING) make libibverbs take
     * ibv_reg_mr_iova2, which drops them where the kernel lacks them; the
     * kernel drops them for a provider without them. */
    struct ibv_mr *m = ibv_reg_mr(pd, mr->addr, mr->length, access);
    if (!m)
        return errno ? -errno : -ENOMEM; /* verbs reports through errno */
    mr->lkey = m->lkey;
    mr->rkey = m->rkey;
    mr->handle = m;
    return 0;
}

static void verbs_dereg(void *ctx, bex_mem_region *mr)
{
    (void)ctx;
    if (mr->handle)
        ibv_dereg_mr(mr->handle);
    mr->handle = NULL;
}

/* Default access: the context is the PD itself, nothing to allocate. */
static int verbs_reg_default(void *ctx, bex_mem_region *mr)
{
    return verbs_reg_access(ctx, DEFAULT_ACCESS, mr);
}

/* Other access flags need a (pd, access) pair behind ctx. The registrar is a
 * plain struct the caller copies, with no destroy call to free such a pair,
 * so pairs are interned: one per distinct (pd, access) ever asked for. */
struct verbs_pair {
    struct ibv_pd *pd;
    int access;
    struct verbs_pair *next;
};
static pthread_mutex_t pairs_lock = PTHREAD_MUTEX_INITIALIZER;
static struct verbs_pair *pairs;

static int verbs_reg_pair(void *ctx, bex_mem_region *mr)
{
    struct verbs_pair *p = ctx;
    return verbs_reg_access(p->pd, p->access, mr);
}

static int reg_nomem(void *ctx, bex_mem_region *mr)
{
    (void)ctx;
    (void)mr;
    return -ENOMEM;
}

static void dereg_nothing(void *ctx, bex_mem_region *mr)
{
    (void)ctx;
    (void)mr;
}

void bex_mem_registrar_verbs(bex_mem_registrar *out, struct ibv_pd *pd, int access)
{
    out->dereg = verbs_dereg;
    if (access == 0 || access == DEFAULT_ACCESS) {
        out->reg = verbs_reg_default;
        out->ctx = pd;
        return;
    }
    pthread_mutex_lock(&pairs_lock);
    struct verbs_pair *p = pairs;
    while (p && !(p->pd == pd && p->access == access))
        p = p->next;
    if (!p && (p = malloc(sizeof(*p))) != NULL) {
        p->pd = pd;
        p->access = access;
        p->next = pairs;
        pairs = p;
    }
    pthread_mutex_unlock(&pairs_lock);
    if (p) {
        out->reg = verbs_reg_pair;
        out->ctx = p;
    } else {
        /* No error return here: allocations through it fail with ENOMEM. */
        out->reg = reg_nomem;
        out->dereg = dereg_nothing;
        out->ctx = NULL;
    }
}

static int noop_reg(void *ctx, bex_mem_region *mr)
{
    (void)ctx;
    mr->lkey = 0;
    mr->rkey = 0;
    mr->handle = NULL;
    return 0;
}

void bex_mem_registrar_noop(bex_mem_registrar *out)
{
    out->reg = noop_reg;
    out->dereg = dereg_nothing;
    out->ctx = NULL;
}
