/* SPDX-License-Identifier: Apache-2.0 */
/* bex._bex.Memory: an array of bex_ps_rows_alloc on a PS client's context,
 * exported through the buffer protocol (bex.empty views it with numpy).
 * It holds its client, so the context outlives it: a client closed while
 * arrays live destroys its context when the last of them goes. */
#include <errno.h>
#include <unistd.h>

#include <bex/ps.h>
#include <bex/sock.h>

#include "psclient.h"

typedef struct {
    PyObject ob_base;
    PsClient *owner;
    float *rows;
    Py_ssize_t bytes;
} Memory;

static int mem_init(Memory *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"client", "n", "dim", NULL};
    PyObject *client;
    Py_ssize_t n, dim;
    if (self->rows) {
        PyErr_SetString(PyExc_RuntimeError, "bex memory already allocated");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Onn", kwlist, &client, &n, &dim))
        return -1;
    if (!PyObject_TypeCheck(client, bexmod_ps_type)) {
        PyErr_SetString(PyExc_TypeError, "client must be a bex.ps.Client");
        return -1;
    }
    if (n < 1 || n > (Py_ssize_t)BEX_PS_KEYS_MAX || dim < 1 || dim > (Py_ssize_t)BEX_PS_DIM_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "bex memory of %zd rows of %zd floats: rows must be 1..%u, a row's "
                     "floats 1..%u",
                     n, dim, BEX_PS_KEYS_MAX, BEX_PS_DIM_MAX);
        return -1;
    }
    PsClient *pc = (PsClient *)client;
    if (bexmod_ps_enter(pc) < 0)
        return -1;
    float *rows;
    int err;
    Py_BEGIN_ALLOW_THREADS;
    rows = bex_ps_rows_alloc(pc->ctx, (uint32_t)n, (uint32_t)dim);
    err = errno;
    Py_END_ALLOW_THREADS;
    if (rows) {
        pthread_mutex_lock(&pc->mu);
        pc->live_mem++;
        pthread_mutex_unlock(&pc->mu);
    }
    bexmod_ps_leave(pc);
    if (!rows) {
        bexmod_raise(bexmod_error, -err,
                     "bex memory of %zd x %zd floats (the context's user_mem_max bounds it)", n,
                     dim);
        return -1;
    }
    self->owner = (PsClient *)Py_NewRef(client);
    self->rows = rows;
    self->bytes = n * dim * 4;
    return 0;
}

static void mem_dealloc(Memory *self)
{
    PsClient *pc = self->owner;
    if (pc && self->rows && pc->pid == bexmod_pid()) { /* a fork's copy: the parent's */
        bex_ctx *orphan = NULL;
        bex_ps_rows_free(self->rows);
        pthread_mutex_lock(&pc->mu);
        if (--pc->live_mem == 0 && pc->ctx_orphan) {
            orphan = pc->ctx_orphan;
            pc->ctx_orphan = NULL;
        }
        pthread_mutex_unlock(&pc->mu);
        if (orphan) {
            Py_BEGIN_ALLOW_THREADS;
            bexmod_ctx_destroy(orphan);
            Py_END_ALLOW_THREADS;
        }
    }
    Py_XDECREF(pc);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int mem_getbuffer(Memory *self, Py_buffer *view, int flags)
{
    if (!self->rows) {
        PyErr_SetString(PyExc_ValueError, "bex memory not allocated");
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->rows, self->bytes, 0, flags);
}

static PyBufferProcs mem_buffer = {.bf_getbuffer = (getbufferproc)mem_getbuffer};

static PyTypeObject mem_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bex._bex.Memory",
    .tp_basicsize = sizeof(Memory),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Memory(client, n, dim): n rows of dim floats of bex's registered memory "
              "(bex_ps_rows_alloc) on client's context; bex.empty views it.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mem_init,
    .tp_dealloc = (destructor)mem_dealloc,
    .tp_as_buffer = &mem_buffer,
};

int bexmod_mem_init(PyObject *m)
{
    PyTypeObject *types[] = {&mem_type};
    const char *names[] = {"Memory"};
    return bexmod_add_types(m, types, names, 1);
}
