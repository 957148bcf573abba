/* SPDX-License-Identifier: Apache-2.0 */
/* Fault injection for tests: see fault.h. Empty unless BEX_FAULT_INJECT. */
#include "common/fault.h"

#ifdef BEX_FAULT_INJECT
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>

struct point {
    _Atomic uint64_t calls; /* since the last arm */
    _Atomic uint64_t nth;   /* the call that fails; 0: none */
    _Atomic int fired;
    int ret, err;
    void (*hook)(void *arg);
    void *arg;
};

static struct point points[BEX__FAULT_KINDS];

int bex__fault_hit(enum bex__fault_kind k)
{
    struct point *p = &points[k];
    /* acquire: ret, err and hook were written before nth */
    uint64_t nth = atomic_load_explicit(&p->nth, memory_order_acquire);
    if (!nth)
        return 0;
    if (atomic_fetch_add(&p->calls, 1) + 1 != nth)
        return 0;
    atomic_store(&p->nth, 0); /* once */
    if (p->hook)
        p->hook(p->arg);
    atomic_store(&p->fired, 1);
    errno = p->err;
    return p->ret;
}

void bex__fault_arm(enum bex__fault_kind k, uint64_t nth, int ret, int err, void (*hook)(void *arg),
                    void *arg)
{
    struct point *p = &points[k];
    atomic_store(&p->nth, 0);
    p->ret = ret;
    p->err = err;
    p->hook = hook;
    p->arg = arg;
    atomic_store(&p->fired, 0);
    atomic_store(&p->calls, 0);
    atomic_store_explicit(&p->nth, nth, memory_order_release);
}

int bex__fault_fired(enum bex__fault_kind k)
{
    return atomic_load(&points[k].fired);
}

static void (*_Atomic reg_fn)(void *arg, int access);
static void *_Atomic reg_arg;

void bex__fault_reg_hook(void (*fn)(void *arg, int access), void *arg)
{
    atomic_store(&reg_fn, NULL);
    atomic_store(&reg_arg, arg);
    atomic_store(&reg_fn, fn);
}

void bex__fault_reg_seen(int access)
{
    void (*fn)(void *, int) = atomic_load(&reg_fn);
    if (fn)
        fn(atomic_load(&reg_arg), access);
}

static const struct bex__fault_td_ops *_Atomic td_ops;

void bex__fault_td_set(const struct bex__fault_td_ops *ops)
{
    atomic_store(&td_ops, ops);
}

const struct bex__fault_td_ops *bex__fault_td(void)
{
    return atomic_load(&td_ops);
}
#else
/* ISO C wants a declaration in every translation unit */
typedef int bex__fault_none;
#endif
