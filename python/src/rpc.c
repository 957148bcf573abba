/* SPDX-License-Identifier: Apache-2.0 */
/* bex._bex.RpcChannel and RpcServer (issue 28 item 4).
 *
 * Channel: call() waits with the GIL released (the completion signals a
 * condition variable, no GIL); call_async's completions go, as the PS
 * client's do, through a queue and an eventfd to a dispatcher thread
 * (bex/_dispatch.py).
 * Server: bex's handler (on the I/O thread) only queues the request, in a
 * bounded queue (queue_max; a request past it is answered -EAGAIN at once,
 * which the caller's channel may retry), so a slow Python handler cannot
 * stall bex; worker threads of Python's take requests from it (_next,
 * waiting with the GIL released) and answer through a Request object. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <bex/rpc.h>

#include "bexmod.h"

/* ---- the calling side ---- */

struct rpc_op {
    struct rpc_op *next;
    PyObject *channel, *future; /* references, dropped when drained */
    uint32_t service, method;
    int status;
    void *body;
    size_t len;
    PyObject *data; /* the body as bytes, once its context is gone */
};

typedef struct {
    PyObject ob_base;
    bex_ctx *ctx;
    bex_rpc_channel *ch;
    struct bexmod_guard g;
    int efd;
    pthread_mutex_t qmu;
    struct rpc_op *qhead, *qtail;
} Channel;

static PyObject *ch_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args, (void)kw;
    Channel *self = (Channel *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    bexmod_guard_init(&self->g);
    pthread_mutex_init(&self->qmu, NULL);
    if ((self->efd = eventfd(0, EFD_CLOEXEC)) < 0) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void ch_close_now(Channel *self)
{
    if (bexmod_guard_close(&self->g) < 0)
        return; /* a fork's copy */
    Py_BEGIN_ALLOW_THREADS;
    bexmod_guard_wait_idle(&self->g);
    if (self->ch)
        bex_rpc_channel_destroy(self->ch); /* outstanding calls: -ECANCELED */
    Py_END_ALLOW_THREADS;
    self->ch = NULL;
    /* answers not drained yet hold bodies of the context: copy them out
     * first (a drain holds the GIL throughout, so it is not halfway) */
    pthread_mutex_lock(&self->qmu);
    for (struct rpc_op *op = self->qhead; op; op = op->next)
        if (op->body) {
            op->data = PyBytes_FromStringAndSize(op->body, (Py_ssize_t)op->len);
            bex_rpc_free(op->body);
            op->body = NULL;
        }
    pthread_mutex_unlock(&self->qmu);
    Py_BEGIN_ALLOW_THREADS;
    if (self->ctx)
        bexmod_ctx_destroy(self->ctx);
    Py_END_ALLOW_THREADS;
    self->ctx = NULL;
}

static void ch_dealloc(Channel *self)
{
    ch_close_now(self);
    if (self->efd >= 0)
        close(self->efd);
    pthread_mutex_destroy(&self->qmu);
    bexmod_guard_fini(&self->g);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int parse_endpoints(PyObject *list, bex_rpc_endpoint **out, size_t *n)
{
    PyObject *seq = PySequence_Fast(list, "endpoints must be a list of 'ip:port' strings");
    if (!seq)
        return -1;
    *n = (size_t)PySequence_Fast_GET_SIZE(seq);
    *out = *n ? PyMem_Calloc(*n, sizeof **out) : NULL;
    int rc = *n ? 0 : -1;
    if (!*n)
        PyErr_SetString(PyExc_ValueError, "endpoints: at least one");
    for (size_t i = 0; rc == 0 && i < *n; i++) {
        const char *s = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, (Py_ssize_t)i));
        if (!s || bexmod_parse_addr(s, &(*out)[i].addr) < 0)
            rc = -1;
    }
    Py_DECREF(seq);
    if (rc < 0) {
        PyMem_Free(*out);
        *out = NULL;
    }
    return rc;
}

static int ch_init(Channel *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {
        "endpoints",    "local_addr",         "transport",          "timeout_ms",
        "max_attempts", "connect_timeout_ms", "attempt_timeout_ms", NULL};
    PyObject *eps_o;
    const char *local = "127.0.0.1", *transport = "tcp";
    bex_ctx_config cc = {0};
    bex_rpc_channel_config chc = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$ssIIII", kwlist, &eps_o, &local, &transport,
                                     &chc.request_timeout_ms, &chc.max_attempts,
                                     &chc.connect_timeout_ms, &chc.attempt_timeout_ms))
        return -1;
    if (self->ch) {
        PyErr_SetString(PyExc_RuntimeError, "bex channel already open");
        return -1;
    }
    bex_rpc_endpoint *eps;
    if (bexmod_ctx_config(&cc, local, transport) < 0 ||
        parse_endpoints(eps_o, &eps, &chc.n_endpoints) < 0)
        return -1;
    chc.endpoints = eps;
    int rc, step = 0;
    Py_BEGIN_ALLOW_THREADS;
    if ((rc = bexmod_ctx_create(&cc, &self->ctx)) == 0 && ++step)
        rc = bex_rpc_channel_create(self->ctx, &chc, &self->ch);
    Py_END_ALLOW_THREADS;
    PyMem_Free(eps);
    if (rc == 0)
        return 0;
    bexmod_raise(bexmod_error, rc, "bex: %s", step ? "RPC channel" : "context");
    ch_close_now(self);
    self->g.closed = 0;
    return -1;
}

struct call_wait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, status;
    void *body;
    size_t len;
};

static void wait_done(int status, void *body, size_t len, void *user)
{
    struct call_wait *w = user;
    pthread_mutex_lock(&w->mu);
    w->status = status, w->body = body, w->len = len, w->done = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* A body for bex from a bytes-like object (copied: bex takes it over). */
static void *body_from(Channel *self, Py_buffer *v)
{
    void *b = v->len ? bex_rpc_alloc(self->ctx, (size_t)v->len) : NULL;
    if (v->len && !b) {
        PyErr_NoMemory();
        return NULL;
    }
    if (b)
        memcpy(b, v->buf, (size_t)v->len);
    return b;
}

/* The outcome of a call: bytes, or a bex.Error with service, method and
 * the server's error body (bytes or None); frees body. */
static PyObject *call_outcome(uint32_t service, uint32_t method, int status, void *body, size_t len,
                              PyObject *copied)
{
    PyObject *data = copied            ? Py_NewRef(copied)
                     : body || !status ? PyBytes_FromStringAndSize(body, (Py_ssize_t)len)
                                       : NULL;
    bex_rpc_free(body);
    if (status == 0 || (!data && PyErr_Occurred()))
        return data;
    bexmod_raise(bexmod_error, status, "rpc call of service %u method %u", service, method);
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v) {
        PyObject_SetAttrString(v, "body", data ? data : Py_None);
        bexmod_set_attr_steal(v, "service", PyLong_FromUnsignedLong(service));
        bexmod_set_attr_steal(v, "method", PyLong_FromUnsignedLong(method));
    }
    Py_XDECREF(data);
    PyErr_Restore(t, v, tb);
    return NULL;
}

static PyObject *ch_call(Channel *self, PyObject *args)
{
    unsigned service, method, timeout_ms = 0;
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "IIy*|I:call", &service, &method, &v, &timeout_ms))
        return NULL;
    struct call_wait w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    bex_rpc_call_opts opts = {.timeout_ms = timeout_ms};
    if (bexmod_guard_enter(&self->g, "channel") < 0)
        goto err_release;
    void *body = body_from(self, &v);
    if (!body && v.len) {
        bexmod_guard_leave(&self->g);
        goto err_release;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = bex_rpc_call(self->ch, service, method, body, (size_t)v.len, &opts, wait_done, &w, NULL);
    pthread_mutex_lock(&w.mu);
    while (rc == 0 && !w.done)
        pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    Py_END_ALLOW_THREADS;
    bexmod_guard_leave(&self->g);
    PyBuffer_Release(&v);
    if (rc) {
        bex_rpc_free(body);
        return call_outcome(service, method, rc, NULL, 0, NULL);
    }
    return call_outcome(service, method, w.status, w.body, w.len, NULL);
err_release:
    PyBuffer_Release(&v);
    return NULL;
}

/* On bex's threads: queue the op and wake the dispatcher; no GIL. */
static void op_done(int status, void *body, size_t len, void *user)
{
    struct rpc_op *op = user;
    Channel *c = (Channel *)op->channel;
    uint64_t one = 1;
    op->status = status, op->body = body, op->len = len, op->next = NULL;
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

static PyObject *ch_call_async(Channel *self, PyObject *args)
{
    unsigned service, method, timeout_ms = 0;
    PyObject *future;
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "IIy*OI:call_async", &service, &method, &v, &future, &timeout_ms))
        return NULL;
    bex_rpc_call_opts opts = {.timeout_ms = timeout_ms};
    struct rpc_op *op = PyMem_Calloc(1, sizeof *op);
    void *body = NULL;
    int rc;
    if (!op) {
        PyErr_NoMemory();
        goto err_release;
    }
    if (bexmod_guard_enter(&self->g, "channel") < 0)
        goto err_free;
    if (!(body = body_from(self, &v)) && v.len) {
        bexmod_guard_leave(&self->g);
        goto err_free;
    }
    op->channel = Py_NewRef((PyObject *)self), op->future = Py_NewRef(future);
    op->service = service, op->method = method;
    rc = bex_rpc_call(self->ch, service, method, body, (size_t)v.len, &opts, op_done, op, NULL);
    bexmod_guard_leave(&self->g);
    PyBuffer_Release(&v);
    if (rc == 0)
        Py_RETURN_NONE; /* the op is the dispatcher's */
    bex_rpc_free(body);
    Py_DECREF(op->channel), Py_DECREF(op->future);
    PyMem_Free(op);
    return call_outcome(service, method, rc, NULL, 0, NULL);
err_free:
    PyMem_Free(op);
err_release:
    PyBuffer_Release(&v);
    return NULL;
}

/* Wait (GIL released) for the eventfd, then [(future, result, exception)]. */
static PyObject *ch_drain(Channel *self, PyObject *unused)
{
    (void)unused;
    if (bexmod_efd_wait(self->efd) < 0)
        return NULL;
    pthread_mutex_lock(&self->qmu);
    struct rpc_op *op = self->qhead;
    self->qhead = self->qtail = NULL;
    pthread_mutex_unlock(&self->qmu);
    PyObject *list = PyList_New(0);
    while (op) {
        struct rpc_op *next = op->next;
        PyObject *res =
                     call_outcome(op->service, op->method, op->status, op->body, op->len, op->data),
                 *o;
        if (res) {
            o = Py_BuildValue("(OOO)", op->future, res, Py_None);
        } else {
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_NormalizeException(&t, &v, &tb);
            o = v ? Py_BuildValue("(OOO)", op->future, Py_None, v) : NULL;
            Py_XDECREF(t), Py_XDECREF(v), Py_XDECREF(tb);
        }
        Py_XDECREF(res);
        if (!list || !o || PyList_Append(list, o) < 0)
            Py_CLEAR(list);
        Py_XDECREF(o);
        Py_DECREF(op->channel), Py_DECREF(op->future), Py_XDECREF(op->data);
        PyMem_Free(op);
        op = next;
    }
    return list;
}

static PyObject *ch_close(Channel *self, PyObject *unused)
{
    (void)unused;
    ch_close_now(self);
    Py_RETURN_NONE;
}

static PyObject *ch_get_closed(Channel *self, void *unused)
{
    (void)unused;
    return PyBool_FromLong(self->g.closed || !self->ch);
}

static PyMethodDef ch_methods[] = {
    {"call", (PyCFunction)ch_call, METH_VARARGS,
     "call(service, method, body, timeout_ms=0): the answer's bytes, waiting."},
    {"_call_async", (PyCFunction)ch_call_async, METH_VARARGS,
     "_call_async(service, method, body, future, timeout_ms)"},
    {"_drain", (PyCFunction)ch_drain, METH_NOARGS, "Wait for completions."},
    {"close", (PyCFunction)ch_close, METH_NOARGS, "Fail outstanding calls (ECANCELED), free."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ch_getset[] = {
    {"closed", (getter)ch_get_closed, NULL, "True once closed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ch_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bex._bex.RpcChannel",
    .tp_basicsize = sizeof(Channel),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A bex RPC channel (bex.rpc.Channel wraps it).",
    .tp_new = ch_new,
    .tp_init = (initproc)ch_init,
    .tp_dealloc = (destructor)ch_dealloc,
    .tp_methods = ch_methods,
    .tp_getset = ch_getset,
};

/* ---- the serving side ---- */

struct reg {
    struct reg *next;
    struct Server *srv;
    uint32_t service, method;
};

struct item {
    struct item *next;
    bex_rpc_req *req;
    void *body;
    size_t len;
    struct reg *reg;
};

typedef struct Server {
    PyObject ob_base;
    bex_ctx *ctx;
    bex_rpc_server *srv;
    struct bexmod_guard g;
    pthread_cond_t more;                /* the queue got a request, or stopping */
    struct item *head, *tail;           /* under g.mu */
    size_t queued, queue_max, inflight; /* inflight: taken, not answered */
    uint64_t refused;
    int stopping, listening;
    struct reg *regs;
} Server;

typedef struct {
    PyObject ob_base;
    Server *server;   /* a reference */
    bex_rpc_req *req; /* NULL once answered */
} Request;

static PyTypeObject req_type;

/* bex's handler, on the I/O thread: queue or refuse, never the GIL. */
static void on_request(bex_rpc_req *req, void *body, size_t len, void *user)
{
    struct reg *r = user;
    Server *s = r->srv;
    struct item *it = malloc(sizeof *it);
    pthread_mutex_lock(&s->g.mu);
    int take = it && !s->stopping && s->queued < s->queue_max;
    if (take) {
        *it = (struct item){.req = req, .body = body, .len = len, .reg = r};
        if (s->tail)
            s->tail->next = it;
        else
            s->head = it;
        s->tail = it;
        s->queued++;
        pthread_cond_signal(&s->more);
    } else {
        s->refused++;
    }
    pthread_mutex_unlock(&s->g.mu);
    if (!take) {
        free(it);
        bex_rpc_free(body);
        bex_rpc_reply(req, -EAGAIN, NULL, 0); /* full: the caller may retry */
    }
}

static PyObject *srv_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args, (void)kw;
    Server *self = (Server *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    bexmod_guard_init(&self->g);
    pthread_cond_init(&self->more, NULL);
    return (PyObject *)self;
}

static int srv_init(Server *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"local_addr", "transport", "queue_max", NULL};
    const char *local = "127.0.0.1", *transport = "tcp";
    unsigned queue_max = 1024;
    bex_ctx_config cc = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$ssI", kwlist, &local, &transport, &queue_max))
        return -1;
    if (self->ctx || queue_max == 0) {
        PyErr_SetString(self->ctx ? PyExc_RuntimeError : PyExc_ValueError,
                        self->ctx ? "bex server already made" : "queue_max must be >= 1");
        return -1;
    }
    if (bexmod_ctx_config(&cc, local, transport) < 0)
        return -1;
    self->queue_max = queue_max;
    int rc, step = 0;
    Py_BEGIN_ALLOW_THREADS;
    if ((rc = bexmod_ctx_create(&cc, &self->ctx)) == 0 && ++step)
        rc = bex_rpc_server_create(self->ctx, NULL, &self->srv);
    Py_END_ALLOW_THREADS;
    if (rc == 0)
        return 0;
    if (self->ctx)
        bexmod_ctx_destroy(self->ctx);
    self->ctx = NULL;
    bexmod_raise(bexmod_error, rc, "bex: %s", step ? "RPC server" : "context");
    return -1;
}

static PyObject *srv_register(Server *self, PyObject *args)
{
    unsigned service, method;
    int write = 0;
    if (!PyArg_ParseTuple(args, "II|p:register", &service, &method, &write))
        return NULL;
    if (!self->srv || self->listening) {
        PyErr_SetString(PyExc_ValueError, "register before start(), on an open server");
        return NULL;
    }
    struct reg *r = calloc(1, sizeof *r);
    if (!r)
        return PyErr_NoMemory();
    *r = (struct reg){.next = self->regs, .srv = self, .service = service, .method = method};
    int rc = bex_rpc_server_register(self->srv, service, method, write ? BEX_RPC_METHOD_WRITE : 0,
                                     on_request, r);
    if (rc) {
        free(r);
        return bexmod_raise(bexmod_error, rc, "register service %u method %u", service, method);
    }
    self->regs = r;
    Py_RETURN_NONE;
}

static PyObject *srv_listen(Server *self, PyObject *args)
{
    const char *addr = "127.0.0.1:0";
    bex_addr sa;
    if (!PyArg_ParseTuple(args, "|s:listen", &addr) || bexmod_parse_addr(addr, &sa) < 0)
        return NULL;
    if (!self->srv || self->listening) {
        PyErr_SetString(PyExc_ValueError, "listen once, on an open server");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = bex_rpc_server_listen(self->srv, &sa);
    Py_END_ALLOW_THREADS;
    if (rc)
        return bexmod_raise(bexmod_error, rc, "listen on %s", addr);
    self->listening = 1;
    bex_rpc_server_addr(self->srv, &sa);
    return bexmod_addr_str(&sa);
}

/* The next request as (Request, service, method, body bytes), waiting with
 * the GIL released; None once the server stops. */
static PyObject *srv_next(Server *self, PyObject *unused)
{
    (void)unused;
    struct item *it;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&self->g.mu);
    while (!self->head && !self->stopping)
        pthread_cond_wait(&self->more, &self->g.mu);
    if ((it = self->head) != NULL) {
        self->head = it->next;
        if (!self->head)
            self->tail = NULL;
        self->queued--, self->inflight++;
    }
    pthread_mutex_unlock(&self->g.mu);
    Py_END_ALLOW_THREADS;
    if (!it)
        Py_RETURN_NONE;
    PyObject *body = PyBytes_FromStringAndSize(it->body, (Py_ssize_t)it->len);
    Request *rq = body ? PyObject_New(Request, &req_type) : NULL;
    bex_rpc_free(it->body);
    if (!rq) { /* answer it: nobody else will */
        Py_XDECREF(body);
        bex_rpc_reply(it->req, -ENOMEM, NULL, 0);
        pthread_mutex_lock(&self->g.mu);
        self->inflight--;
        pthread_cond_broadcast(&self->g.idle);
        pthread_mutex_unlock(&self->g.mu);
        free(it);
        return NULL;
    }
    rq->server = (Server *)Py_NewRef((PyObject *)self), rq->req = it->req;
    PyObject *t = Py_BuildValue("(NIIN)", rq, it->reg->service, it->reg->method, body);
    free(it);
    return t;
}

static void req_answer(Request *rq, int status, void *body, size_t len)
{
    Server *s = rq->server;
    bex_rpc_req *req = rq->req;
    rq->req = NULL;
    Py_BEGIN_ALLOW_THREADS;
    bex_rpc_reply(req, status, body, len);
    pthread_mutex_lock(&s->g.mu);
    if (--s->inflight == 0)
        pthread_cond_broadcast(&s->g.idle);
    pthread_mutex_unlock(&s->g.mu);
    Py_END_ALLOW_THREADS;
}

static PyObject *req_reply(Request *rq, PyObject *args)
{
    int status = 0;
    Py_buffer v = {0};
    if (!PyArg_ParseTuple(args, "|iy*:reply", &status, &v))
        return NULL;
    if (!rq->req) {
        PyBuffer_Release(&v);
        PyErr_SetString(PyExc_ValueError, "request already answered");
        return NULL;
    }
    if (status > 0)
        status = -status; /* an errno either way */
    void *body = v.len ? bex_rpc_alloc(rq->server->ctx, (size_t)v.len) : NULL;
    if (v.len && body)
        memcpy(body, v.buf, (size_t)v.len);
    if (v.len && !body)
        status = -ENOMEM;
    req_answer(rq, status, body, body ? (size_t)v.len : 0);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

static void req_dealloc(Request *rq)
{
    if (rq->req) /* dropped unanswered: the caller is told */
        req_answer(rq, -ECANCELED, NULL, 0);
    Py_XDECREF((PyObject *)rq->server);
    PyObject_Free(rq);
}

static PyMethodDef req_methods[] = {
    {"reply", (PyCFunction)req_reply, METH_VARARGS,
     "reply(status=0, body=b''): answer, once; status an errno (0: ok)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject req_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bex._bex.RpcRequest",
    .tp_basicsize = sizeof(Request),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A request a bex.rpc.Server handler answers.",
    .tp_dealloc = (destructor)req_dealloc,
    .tp_methods = req_methods,
};

static void srv_close_now(Server *self)
{
    if (bexmod_guard_close(&self->g) < 0 || !self->ctx)
        return;
    pthread_mutex_lock(&self->g.mu);
    self->stopping = 1; /* the handler refuses, workers end */
    pthread_cond_broadcast(&self->more);
    pthread_mutex_unlock(&self->g.mu);
    Py_BEGIN_ALLOW_THREADS;
    if (self->srv)
        bex_rpc_server_destroy(self->srv); /* no handler runs after this */
    pthread_mutex_lock(&self->g.mu);
    struct item *it = self->head;
    self->head = self->tail = NULL, self->queued = 0;
    pthread_mutex_unlock(&self->g.mu);
    while (it) {
        struct item *next = it->next;
        bex_rpc_free(it->body);
        bex_rpc_reply(it->req, -ECANCELED, NULL, 0);
        free(it);
        it = next;
    }
    pthread_mutex_lock(&self->g.mu);
    while (self->inflight) /* the workers' answers, before the context goes */
        pthread_cond_wait(&self->g.idle, &self->g.mu);
    pthread_mutex_unlock(&self->g.mu);
    bexmod_ctx_destroy(self->ctx);
    Py_END_ALLOW_THREADS;
    self->srv = NULL, self->ctx = NULL;
}

static void srv_dealloc(Server *self)
{
    srv_close_now(self);
    while (self->regs) {
        struct reg *next = self->regs->next;
        free(self->regs);
        self->regs = next;
    }
    pthread_cond_destroy(&self->more);
    bexmod_guard_fini(&self->g);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *srv_close(Server *self, PyObject *unused)
{
    (void)unused;
    srv_close_now(self);
    Py_RETURN_NONE;
}

static PyObject *srv_stats(Server *self, PyObject *unused)
{
    (void)unused;
    pthread_mutex_lock(&self->g.mu);
    unsigned long long refused = self->refused, queued = self->queued;
    pthread_mutex_unlock(&self->g.mu);
    return Py_BuildValue("{sKsK}", "refused", refused, "queued", queued);
}

static PyMethodDef srv_methods[] = {
    {"register", (PyCFunction)srv_register, METH_VARARGS,
     "register(service, method, write=False): queue its requests."},
    {"listen", (PyCFunction)srv_listen, METH_VARARGS, "listen('ip:port'): the address bound."},
    {"_next", (PyCFunction)srv_next, METH_NOARGS, "The next request, waiting; None: stopped."},
    {"close", (PyCFunction)srv_close, METH_NOARGS,
     "Stop: refuse new requests, answer queued ones ECANCELED, wait for the workers' answers."},
    {"stats", (PyCFunction)srv_stats, METH_NOARGS, "refused (queue full) and queued requests."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject srv_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bex._bex.RpcServer",
    .tp_basicsize = sizeof(Server),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A bex RPC server (bex.rpc.Server wraps it).",
    .tp_new = srv_new,
    .tp_init = (initproc)srv_init,
    .tp_dealloc = (destructor)srv_dealloc,
    .tp_methods = srv_methods,
};

int bexmod_rpc_init(PyObject *m)
{
    PyTypeObject *const types[] = {&ch_type, &srv_type, &req_type};
    const char *const names[] = {"RpcChannel", "RpcServer", "RpcRequest"};
    return bexmod_add_types(m, types, names, 3);
}
