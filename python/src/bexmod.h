/* SPDX-License-Identifier: Apache-2.0 */
/* bex._bex's parts: the module (bexmodule.c), buffers (buffers.c), the PS
 * client (ps.c). */
#ifndef BEXMOD_H
#define BEXMOD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include <bex/sock.h>

extern PyObject *bexmod_error, *bexmod_push_error, *bexmod_fork_error;

/* errno's name of a negative errno ("ECONNREFUSED"). */
const char *bexmod_errname(int rc);
/* Raise type (bex.Error or a subclass) for the bex code rc (negative
 * errno), the message fmt followed by bex_strerror(rc) and its name; sets
 * the exception's errno and bex_error. Returns NULL. */
PyObject *bexmod_raise(PyObject *type, int rc, const char *fmt, ...);
/* "a.b.c.d:port" */
PyObject *bexmod_addr_str(const bex_addr *a);

/* The keys of a call: uint64 (or int64 with no negative value), 1-D,
 * C-contiguous. On 0 *view holds the buffer (PyBuffer_Release it). */
int bexmod_get_keys(PyObject *o, Py_buffer *view);
/* Rows of float32, shape (n, dim) (dim 0: any), C-contiguous, writable if
 * asked; what names the argument in errors. */
int bexmod_get_rows(PyObject *o, Py_buffer *view, const char *what, Py_ssize_t n, Py_ssize_t dim,
                    int writable);

/* Ready the n types and add each to module m under its name: 0, or -1
 * with the exception set. */
int bexmod_add_types(PyObject *m, PyTypeObject *const *types, const char *const *names, int n);
/* Wait, the GIL released, until the eventfd efd counts something, and
 * consume its count: 0, or -1 with an OSError set. */
int bexmod_efd_wait(int efd);

/* The process id without a system call (a fork's child sees its own):
 * bexmod_pid_init once, at the module's import (0, or -1). */
int bexmod_pid_init(void);
pid_t bexmod_pid(void);

int bexmod_ps_init(PyObject *m);
int bexmod_rpc_init(PyObject *m);
int bexmod_sock_init(PyObject *m);
int bexmod_mem_init(PyObject *m);
int bexmod_pools_init(PyObject *m);

/* bex_ctx_create and _destroy, the context tracked (pools.c: bex._bex.pools
 * for the tests' leak checks; its log lines to stderr, counted). */
int bexmod_ctx_create(const bex_ctx_config *cfg, bex_ctx **out);
void bexmod_ctx_destroy(bex_ctx *ctx);

/* An object's calls in progress, its closed state and its process: a call
 * enters (ValueError when closed, bex.ForkError in a fork's child: what
 * names the object), close waits (GIL released) until none is in. */
struct bexmod_guard {
    pthread_mutex_t mu;
    pthread_cond_t idle;
    int busy, closed;
    pid_t pid;
};
void bexmod_guard_init(struct bexmod_guard *g);
void bexmod_guard_fini(struct bexmod_guard *g);
int bexmod_guard_enter(struct bexmod_guard *g, const char *what);
void bexmod_guard_leave(struct bexmod_guard *g);
/* Mark closed; -1 in a fork's child (which must not free the parent's). */
int bexmod_guard_close(struct bexmod_guard *g);
void bexmod_guard_wait_idle(struct bexmod_guard *g);

/* "a.b.c.d:port", or a ValueError. */
int bexmod_parse_addr(const char *s, bex_addr *out);
/* local_addr and transport ("tcp", "rdma", "auto") into cc, or a ValueError. */
int bexmod_ctx_config(bex_ctx_config *cc, const char *local, const char *transport);
/* setattr(o, name, v) and drop v (NULL: nothing). */
void bexmod_set_attr_steal(PyObject *o, const char *name, PyObject *v);

#endif
