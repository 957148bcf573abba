/* SPDX-License-Identifier: Apache-2.0 */
/* bex._bex.PsClient's state, shared by ps.c (the client, its waiting calls)
 * and ps_async.c (the calls that return a Future). */
#ifndef BEXMOD_PSCLIENT_H
#define BEXMOD_PSCLIENT_H

#include <pthread.h>
#include <sys/types.h>

#include <bex/dir.h>
#include <bex/ps.h>

#include "bexmod.h"

struct bexmod_op;

typedef struct {
    PyObject ob_base;
    bex_dir *dir;
    bex_ctx *ctx;
    bex_ps_client *pc;
    pid_t pid; /* the process that made it */
    char service[BEX_DIR_NAME_MAX + 1];
    uint32_t n_shards;
    pthread_mutex_t mu;
    pthread_cond_t idle;
    int busy, closed;
    /* arrays of bex_ps_rows_alloc on ctx (bex.empty, mem.c) still alive;
     * a client closed meanwhile leaves its context here for the last of
     * them to destroy */
    long live_mem;
    bex_ctx *ctx_orphan;
    _Atomic long zero_copy; /* waiting calls that went without a copy */
    /* completions of the asynchronous calls: bex's I/O thread appends
     * under qmu and writes efd; the dispatcher drains (ps_async.c) */
    int efd;
    pthread_mutex_t qmu;
    struct bexmod_op *qhead, *qtail;
} PsClient;

extern PyTypeObject *bexmod_ps_type;

/* The client for one call (busy until leave), or an exception (closed, a
 * fork's copy). */
int bexmod_ps_enter(PsClient *self);
void bexmod_ps_leave(PsClient *self);
/* table a uint32, dim 1..BEX_PS_DIM_MAX, or a ValueError. */
int bexmod_check_table(unsigned long long table, Py_ssize_t dim);
/* Raise the bex.Error of a failed Fetch or Push (NULL). */
PyObject *bexmod_raise_fetch(PsClient *self, int rc, uint32_t table, const uint64_t *keys,
                             size_t n);
PyObject *bexmod_raise_push(int rc, uint32_t table, const bex_ps_replica_result *res, size_t n_res);

/* ps_async.c */
int bexmod_async_init(PsClient *self);
void bexmod_async_fini(PsClient *self);
PyObject *bexmod_ps_fetch_async(PsClient *self, PyObject *args);
PyObject *bexmod_ps_push_async(PsClient *self, PyObject *args);
PyObject *bexmod_ps_drain(PsClient *self, PyObject *unused);

#endif
