/* SPDX-License-Identifier: Apache-2.0 */
/* bex._bex's parts: the module (bexmodule.c), buffers (buffers.c), the PS
 * client (ps.c). */
#ifndef BEXMOD_H
#define BEXMOD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <netinet/in.h>
#include <stdint.h>

extern PyObject *bexmod_error, *bexmod_push_error, *bexmod_fork_error;

/* errno's name of a negative errno ("ECONNREFUSED"). */
const char *bexmod_errname(int rc);
/* Raise type (bex.Error or a subclass) for the bex code rc (negative
 * errno), the message fmt followed by bex_strerror(rc) and its name; sets
 * the exception's errno and bex_error. Returns NULL. */
PyObject *bexmod_raise(PyObject *type, int rc, const char *fmt, ...);
/* "a.b.c.d:port" */
PyObject *bexmod_addr_str(const struct sockaddr_in *a);

/* The keys of a call: uint64 (or int64 with no negative value), 1-D,
 * C-contiguous. On 0 *view holds the buffer (PyBuffer_Release it). */
int bexmod_get_keys(PyObject *o, Py_buffer *view);
/* Rows of float32, shape (n, dim) (dim 0: any), C-contiguous, writable if
 * asked; what names the argument in errors. */
int bexmod_get_rows(PyObject *o, Py_buffer *view, const char *what, Py_ssize_t n, Py_ssize_t dim,
                    int writable);

int bexmod_ps_init(PyObject *m);

#endif
