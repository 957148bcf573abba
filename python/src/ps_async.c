/* SPDX-License-Identifier: Apache-2.0 */
/* The PS client's calls that return at once (issue 28 item 2): each is an
 * op that holds its buffers, its Future and its result until it completes.
 * bex's I/O thread completes it without the GIL: it appends the op to the
 * client's queue under a mutex and writes the eventfd (op_done). A
 * dispatcher thread of Python's (bex/ps.py) waits on the eventfd with the
 * GIL released (bexmod_ps_drain), then, with the GIL, turns the ops into
 * results and exceptions for their Futures. */
#include <errno.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "psclient.h"

enum { OP_FETCH = 1, OP_PUSH = 2 };

struct bexmod_op {
    struct bexmod_op *next;
    PsClient *client; /* a reference, dropped when drained */
    int kind, status;
    uint32_t table;
    size_t n, n_res, cap;
    Py_buffer keys, rows;
    PyObject *future, *result;
    bex_ps_replica_result *res; /* Push: every replica's outcome */
};

int bexmod_async_init(PsClient *self)
{
    self->efd = eventfd(0, EFD_CLOEXEC);
    if (self->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_mutex_init(&self->qmu, NULL);
    return 0;
}

/* No op is left: each holds a reference to the client. */
void bexmod_async_fini(PsClient *self)
{
    if (self->efd >= 0)
        close(self->efd);
    self->efd = -1;
    pthread_mutex_destroy(&self->qmu);
}

/* On bex's I/O thread (or in bex_ps_fetch/push when it completes at once):
 * never the GIL, never Python. */
static void op_done(int status, void *user)
{
    struct bexmod_op *op = user;
    PsClient *c = op->client;
    uint64_t one = 1;
    op->status = status;
    op->next = NULL;
    pthread_mutex_lock(&c->qmu);
    if (c->qtail)
        c->qtail->next = op;
    else
        c->qhead = op;
    c->qtail = op;
    pthread_mutex_unlock(&c->qmu);
    while (write(c->efd, &one, sizeof one) < 0 && errno == EINTR)
        ;
}

static void op_free(struct bexmod_op *op)
{
    if (op->keys.obj)
        PyBuffer_Release(&op->keys);
    if (op->rows.obj)
        PyBuffer_Release(&op->rows);
    Py_XDECREF(op->future);
    Py_XDECREF(op->result);
    Py_XDECREF((PyObject *)op->client);
    PyMem_Free(op->res);
    PyMem_Free(op);
}

/* An op for (table, dim, keys, rows, result, future); NULL with an
 * exception when an argument is wrong. */
static struct bexmod_op *op_new(PsClient *self, int kind, PyObject *args)
{
    unsigned long long table;
    Py_ssize_t dim;
    PyObject *keys_o, *rows_o, *result, *future;
    if (!PyArg_ParseTuple(args, "KnOOOO", &table, &dim, &keys_o, &rows_o, &result, &future) ||
        bexmod_check_table(table, dim) < 0)
        return NULL;
    struct bexmod_op *op = PyMem_Calloc(1, sizeof *op);
    if (!op)
        return (struct bexmod_op *)PyErr_NoMemory();
    op->kind = kind, op->table = (uint32_t)table;
    op->client = (PsClient *)Py_NewRef((PyObject *)self);
    op->future = Py_NewRef(future), op->result = Py_NewRef(result);
    if (bexmod_get_keys(keys_o, &op->keys) < 0)
        goto err_free;
    op->n = (size_t)op->keys.len / 8;
    if (bexmod_get_rows(rows_o, &op->rows, kind == OP_FETCH ? "out" : "grads", (Py_ssize_t)op->n,
                        dim, kind == OP_FETCH) < 0)
        goto err_free;
    if (kind == OP_PUSH) {
        op->cap = (size_t)(self->n_shards ? self->n_shards : 1) * BEX_PS_REPLICAS_MAX;
        if (!(op->res = PyMem_Calloc(op->cap, sizeof *op->res))) {
            PyErr_NoMemory();
            goto err_free;
        }
    }
    return op;
err_free:
    op_free(op);
    return NULL;
}

/* Start op; on an error at once, raise it and free op. */
static PyObject *op_start(PsClient *self, struct bexmod_op *op, Py_ssize_t dim)
{
    int rc;
    if (bexmod_ps_enter(self) < 0) {
        op_free(op);
        return NULL;
    }
    if (op->kind == OP_FETCH)
        rc = bex_ps_fetch(self->pc, op->table, (uint32_t)dim, op->keys.buf, op->n, op->rows.buf,
                          op_done, op);
    else
        rc = bex_ps_push_report(self->pc, op->table, (uint32_t)dim, op->keys.buf, op->n,
                                op->rows.buf, op->res, op->cap, &op->n_res, op_done, op);
    bexmod_ps_leave(self);
    /* on 0, op is the dispatcher's (it may be queued already) */
    if (rc == 0)
        Py_RETURN_NONE;
    if (op->kind == OP_FETCH)
        bexmod_raise_fetch(self, rc, op->table, op->keys.buf, op->n);
    else
        bexmod_raise_push(rc, op->table, NULL, 0);
    op_free(op);
    return NULL;
}

static PyObject *submit(PsClient *self, PyObject *args, int kind)
{
    struct bexmod_op *op = op_new(self, kind, args);
    if (!op)
        return NULL;
    Py_ssize_t dim = op->rows.shape[1];
    return op_start(self, op, dim);
}

PyObject *bexmod_ps_fetch_async(PsClient *self, PyObject *args)
{
    return submit(self, args, OP_FETCH);
}

PyObject *bexmod_ps_push_async(PsClient *self, PyObject *args)
{
    return submit(self, args, OP_PUSH);
}

/* (future, result, exception) of a completed op. */
static PyObject *op_outcome(struct bexmod_op *op)
{
    if (op->status == 0)
        return Py_BuildValue("(OOO)", op->future, op->kind == OP_FETCH ? op->result : Py_None,
                             Py_None);
    if (op->kind == OP_FETCH)
        bexmod_raise_fetch(op->client, op->status, op->table, op->keys.buf, op->n);
    else
        bexmod_raise_push(op->status, op->table, op->res,
                          op->n_res < op->cap ? op->n_res : op->cap);
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v && tb)
        PyException_SetTraceback(v, tb);
    PyObject *r = v ? Py_BuildValue("(OOO)", op->future, Py_None, v) : NULL;
    Py_XDECREF(t), Py_XDECREF(v), Py_XDECREF(tb);
    return r;
}

/* Wait (GIL released) until the eventfd says something completed, then
 * return the completed ops as a list of (future, result, exception). */
PyObject *bexmod_ps_drain(PsClient *self, PyObject *unused)
{
    (void)unused;
    if (bexmod_efd_wait(self->efd) < 0)
        return NULL;
    pthread_mutex_lock(&self->qmu);
    struct bexmod_op *op = self->qhead;
    self->qhead = self->qtail = NULL;
    pthread_mutex_unlock(&self->qmu);
    PyObject *list = PyList_New(0);
    while (op) {
        struct bexmod_op *next = op->next;
        PyObject *o = list ? op_outcome(op) : NULL;
        if (!o || PyList_Append(list, o) < 0)
            Py_CLEAR(list); /* the rest are still freed */
        Py_XDECREF(o);
        op_free(op);
        op = next;
    }
    return list;
}
