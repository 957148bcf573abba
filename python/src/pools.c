/* SPDX-License-Identifier: Apache-2.0 */
/* Every context the extension makes, tracked for the tests' leak checks
 * (bex._bex.pools): how many are alive, the bytes in use in their pools,
 * and how many were destroyed with buffers of their pools still live
 * (bex_ctx_destroy logs that at ERROR: counted here, the line still goes
 * to stderr). */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include <bex/mem.h>

#include "bexmod.h"

#define TRACK_MAX 1024

static pthread_mutex_t track_mu = PTHREAD_MUTEX_INITIALIZER;
static bex_ctx *tracked[TRACK_MAX];
static long n_live;
static _Atomic long leaked;

static void log_line(int level, const char *msg, void *arg)
{
    (void)arg;
    static const char *const names[] = {"?", "ERROR", "WARN", "INFO", "DEBUG"};
    if (level == BEX_LOG_ERROR && strstr(msg, "while buffers of its"))
        atomic_fetch_add(&leaked, 1);
    fprintf(stderr, "bex %s %s\n", level >= 1 && level <= 4 ? names[level] : "?", msg);
}

int bexmod_ctx_create(const bex_ctx_config *cfg, bex_ctx **out)
{
    bex_ctx_config cc = *cfg;
    if (!cc.log_fn)
        cc.log_fn = log_line;
    int rc = bex_ctx_create(&cc, out);
    if (rc)
        return rc;
    pthread_mutex_lock(&track_mu);
    n_live++;
    for (int i = 0; i < TRACK_MAX; i++)
        if (!tracked[i]) {
            tracked[i] = *out;
            break;
        }
    pthread_mutex_unlock(&track_mu);
    return 0;
}

void bexmod_ctx_destroy(bex_ctx *ctx)
{
    if (!ctx)
        return;
    pthread_mutex_lock(&track_mu);
    n_live--;
    for (int i = 0; i < TRACK_MAX; i++)
        if (tracked[i] == ctx)
            tracked[i] = NULL;
    pthread_mutex_unlock(&track_mu);
    bex_ctx_destroy(ctx);
}

static size_t in_use(bex_mem_pool *p)
{
    bex_mem_stats st;
    bex_mem_pool_collect(p);
    bex_mem_pool_stats(p, &st);
    return st.in_use_bytes;
}

static PyObject *pools(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    size_t pool = 0, recv = 0, landing = 0;
    long live;
    pthread_mutex_lock(&track_mu);
    live = n_live;
    for (int i = 0; i < TRACK_MAX; i++)
        if (tracked[i]) {
            pool += in_use(bex_ctx_pool(tracked[i]));
            recv += in_use(bex_ctx_recv_pool(tracked[i]));
            landing += in_use(bex_ctx_landing_pool(tracked[i]));
        }
    pthread_mutex_unlock(&track_mu);
    return Py_BuildValue("{slsnsnsnsl}", "contexts", live, "pool", (Py_ssize_t)pool, "recv_pool",
                         (Py_ssize_t)recv, "landing", (Py_ssize_t)landing, "leaked",
                         atomic_load(&leaked));
}

static PyMethodDef pools_functions[] = {
    {"pools", pools, METH_NOARGS,
     "pools(): {contexts, pool, recv_pool, landing, leaked}: the extension's live contexts, "
     "bytes in use in their pools, contexts destroyed with live buffers."},
    {NULL, NULL, 0, NULL},
};

int bexmod_pools_init(PyObject *m)
{
    return PyModule_AddFunctions(m, pools_functions);
}
