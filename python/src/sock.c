/* SPDX-License-Identifier: Apache-2.0 */
/* bex._bex.SockContext, Socket and Listener (issue 28 item 4: the socket
 * API's send and recv of bytes).
 *
 * bex's callbacks (I/O thread) only touch a C state of the socket under
 * its mutex and signal its condition variable: never the GIL. A Python
 * call waits on that condition with the GIL released. A socket's state
 * lives until bex reports on_close, after the Python object may be gone.
 * A context is destroyed only when no socket or listener of it is open
 * (they hold references to it). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <bex/mem.h>
#include <bex/sock.h>

#include "bexmod.h"

typedef struct {
    PyObject ob_base;
    bex_ctx *ctx;
    struct bexmod_guard g;
} SockContext;

struct msg {
    struct msg *next;
    void *buf;
    size_t len;
};

struct sstate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bex_sock *s;
    int connected; /* 1 once on_connect said 0 */
    int err;       /* on_connect's or on_error's error */
    int gone;      /* on_close came */
    struct msg *head, *tail;
};

typedef struct {
    PyObject ob_base;
    SockContext *ctx; /* a reference */
    struct sstate *st;
    int closed;
} Socket;

static void st_signal(struct sstate *st)
{
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
}

static void on_connect(bex_sock *s, int status, void *user)
{
    struct sstate *st = user;
    (void)s;
    pthread_mutex_lock(&st->mu);
    if (status)
        st->err = status;
    else
        st->connected = 1;
    st_signal(st);
}

static void on_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct sstate *st = user;
    struct msg *m = malloc(sizeof *m);
    (void)s;
    if (!m) { /* cannot hold it: the stream is broken for the reader */
        bex_mem_free(buf);
        pthread_mutex_lock(&st->mu);
        st->err = -ENOMEM;
        st_signal(st);
        return;
    }
    *m = (struct msg){.buf = buf, .len = len};
    pthread_mutex_lock(&st->mu);
    if (st->tail)
        st->tail->next = m;
    else
        st->head = m;
    st->tail = m;
    st_signal(st);
}

static void on_error(bex_sock *s, int err, void *user)
{
    struct sstate *st = user;
    (void)s;
    pthread_mutex_lock(&st->mu);
    st->err = err ? err : -ECONNRESET;
    st_signal(st);
}

static void on_close(bex_sock *s, void *user)
{
    struct sstate *st = user;
    (void)s;
    pthread_mutex_lock(&st->mu);
    st->gone = 1;
    st_signal(st);
}

static const bex_sock_ops sock_ops = {
    .on_connect = on_connect, .on_recv = on_recv, .on_error = on_error, .on_close = on_close};

static struct sstate *st_new(void)
{
    struct sstate *st = calloc(1, sizeof *st);
    if (st) {
        pthread_mutex_init(&st->mu, NULL);
        pthread_cond_init(&st->cv, NULL);
    }
    return st;
}

/* After on_close: nothing of bex refers to it any more. */
static void st_free(struct sstate *st)
{
    while (st->head) {
        struct msg *m = st->head;
        st->head = m->next;
        bex_mem_free(m->buf);
        free(m);
    }
    pthread_mutex_destroy(&st->mu);
    pthread_cond_destroy(&st->cv);
    free(st);
}

/* Wait until pred holds or timeout_s passes (< 0: forever), with st->mu
 * held and the GIL released by the caller. Returns 0 or -ETIMEDOUT. */
static int st_wait(struct sstate *st, double timeout_s, int (*pred)(struct sstate *))
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    if (timeout_s >= 0) {
        long long ns = dl.tv_nsec + (long long)(timeout_s * 1e9);
        dl.tv_sec += (time_t)(ns / 1000000000);
        dl.tv_nsec = (long)(ns % 1000000000);
    }
    while (!pred(st))
        if (timeout_s < 0)
            pthread_cond_wait(&st->cv, &st->mu);
        else if (pthread_cond_timedwait(&st->cv, &st->mu, &dl) == ETIMEDOUT)
            return pred(st) ? 0 : -ETIMEDOUT;
    return 0;
}

static int is_gone(struct sstate *st)
{
    return st->gone;
}
static int is_up(struct sstate *st)
{
    return st->connected || st->err;
}
static int has_msg(struct sstate *st)
{
    return st->head || st->err;
}

static PyTypeObject sock_type, listener_type;

/* ---- Socket ---- */

static Socket *sock_wrap(SockContext *ctx, struct sstate *st)
{
    Socket *so = PyObject_New(Socket, &sock_type);
    if (!so)
        return NULL;
    so->ctx = (SockContext *)Py_NewRef((PyObject *)ctx);
    so->st = st, so->closed = 0;
    pthread_mutex_lock(&ctx->g.mu);
    ctx->g.busy++; /* an open socket: the context stays */
    pthread_mutex_unlock(&ctx->g.mu);
    return so;
}

/* Close st's socket and wait for on_close (GIL released), then free st. */
static void st_close(struct sstate *st)
{
    bex_sock_close(st->s);
    pthread_mutex_lock(&st->mu);
    st_wait(st, -1, is_gone);
    pthread_mutex_unlock(&st->mu);
    st_free(st);
}

static void sock_close_now(Socket *so)
{
    if (so->closed)
        return;
    so->closed = 1;
    if (so->ctx->g.pid != bexmod_pid())
        return; /* a fork's copy: the parent's */
    struct sstate *st = so->st;
    Py_BEGIN_ALLOW_THREADS;
    st_close(st);
    Py_END_ALLOW_THREADS;
    so->st = NULL;
    bexmod_guard_leave(&so->ctx->g);
}

static void sock_dealloc(Socket *so)
{
    sock_close_now(so);
    Py_XDECREF((PyObject *)so->ctx);
    PyObject_Free(so);
}

static int sock_check(Socket *so)
{
    if (so->ctx->g.pid != bexmod_pid()) {
        PyErr_SetString(bexmod_fork_error, "this bex socket belongs to the parent process");
        return -1;
    }
    if (so->closed) {
        PyErr_SetString(PyExc_ValueError, "bex socket is closed");
        return -1;
    }
    return 0;
}

static PyObject *sock_send(Socket *so, PyObject *args)
{
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*:send", &v))
        return NULL;
    if (sock_check(so) < 0) {
        PyBuffer_Release(&v);
        return NULL;
    }
    /* copied once into bex's memory, which bex sends and then frees */
    void *buf = bex_sock_alloc(so->ctx->ctx, v.len ? (size_t)v.len : 1);
    int rc = buf ? 0 : -ENOMEM;
    if (buf) {
        memcpy(buf, v.buf, (size_t)v.len);
        if ((rc = bex_sock_send(so->st->s, buf, (size_t)v.len, NULL)) != 0)
            bex_mem_free(buf);
    }
    PyBuffer_Release(&v);
    if (rc)
        return bexmod_raise(bexmod_error, rc, "send of %zd bytes", v.len);
    Py_RETURN_NONE;
}

static PyObject *sock_recv(Socket *so, PyObject *args)
{
    double timeout = -1;
    if (!PyArg_ParseTuple(args, "|d:recv", &timeout) || sock_check(so) < 0)
        return NULL;
    struct sstate *st = so->st;
    struct msg *m = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&st->mu);
    rc = st_wait(st, timeout, has_msg);
    if (rc == 0 && (m = st->head) != NULL) { /* messages before an error */
        st->head = m->next;
        if (!st->head)
            st->tail = NULL;
    } else if (rc == 0) {
        rc = st->err;
    }
    pthread_mutex_unlock(&st->mu);
    Py_END_ALLOW_THREADS;
    if (!m)
        return bexmod_raise(bexmod_error, rc, "recv");
    PyObject *b = PyBytes_FromStringAndSize(m->buf, (Py_ssize_t)m->len);
    bex_mem_free(m->buf);
    free(m);
    return b;
}

static PyObject *sock_close(Socket *so, PyObject *unused)
{
    (void)unused;
    sock_close_now(so);
    Py_RETURN_NONE;
}

static PyObject *sock_enter(Socket *so, PyObject *unused)
{
    (void)unused;
    return Py_NewRef((PyObject *)so);
}

static PyObject *sock_exit(Socket *so, PyObject *args)
{
    (void)args;
    sock_close_now(so);
    Py_RETURN_NONE;
}

static PyObject *sock_get_closed(Socket *so, void *unused)
{
    (void)unused;
    return PyBool_FromLong(so->closed);
}

static PyMethodDef sock_methods[] = {
    {"send", (PyCFunction)sock_send, METH_VARARGS,
     "send(data): send a message (bytes-like, copied into bex's memory)."},
    {"recv", (PyCFunction)sock_recv, METH_VARARGS,
     "recv(timeout=-1): the next message as bytes; bex.Error when the socket failed "
     "(ETIMEDOUT when the timeout, in seconds, passed)."},
    {"close", (PyCFunction)sock_close, METH_NOARGS, "Close, waiting until bex let it go."},
    {"__enter__", (PyCFunction)sock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)sock_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef sock_getset[] = {
    {"closed", (getter)sock_get_closed, NULL, "True once closed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject sock_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bex._bex.Socket",
    .tp_basicsize = sizeof(Socket),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A bex socket: messages, not a byte stream.",
    .tp_dealloc = (destructor)sock_dealloc,
    .tp_methods = sock_methods,
    .tp_getset = sock_getset,
};

/* ---- Listener ---- */

struct acc {
    struct acc *next;
    struct sstate *st;
};

typedef struct {
    PyObject ob_base;
    SockContext *ctx;
    bex_listener *l;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct acc *head, *tail;
    size_t n, max;
    int closed;
} Listener;

static const bex_sock_ops refuse_ops = {0};

/* On the I/O thread: queue the new socket for accept(), or close it when
 * accept_max are waiting already. */
static void on_accept(bex_listener *bl, bex_sock *s, void *user)
{
    Listener *l = user;
    struct sstate *st = st_new();
    struct acc *a = st ? malloc(sizeof *a) : NULL;
    (void)bl;
    pthread_mutex_lock(&l->mu);
    int take = a && !l->closed && l->n < l->max;
    if (take) {
        st->s = s, st->connected = 1;
        *a = (struct acc){.st = st};
        if (l->tail)
            l->tail->next = a;
        else
            l->head = a;
        l->tail = a, l->n++;
        bex_sock_set_user(s, &sock_ops, st);
        pthread_cond_broadcast(&l->cv);
    }
    pthread_mutex_unlock(&l->mu);
    if (!take) {
        free(a);
        if (st)
            st_free(st);
        bex_sock_set_user(s, &refuse_ops, NULL);
        bex_sock_close(s);
    }
}

static void listener_close_now(Listener *l)
{
    if (!l->l)
        return;
    if (l->ctx->g.pid != bexmod_pid()) {
        l->l = NULL;
        return;
    }
    Py_BEGIN_ALLOW_THREADS;
    bex_listener_close(l->l); /* no on_accept runs after this */
    pthread_mutex_lock(&l->mu);
    l->closed = 1;
    struct acc *a = l->head;
    l->head = l->tail = NULL, l->n = 0;
    pthread_cond_broadcast(&l->cv); /* accept() in other threads: closed */
    pthread_mutex_unlock(&l->mu);
    while (a) { /* accepted, never taken */
        struct acc *next = a->next;
        st_close(a->st);
        free(a);
        a = next;
    }
    Py_END_ALLOW_THREADS;
    l->l = NULL;
    bexmod_guard_leave(&l->ctx->g);
}

static void listener_dealloc(Listener *l)
{
    listener_close_now(l);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    Py_XDECREF((PyObject *)l->ctx);
    PyObject_Free(l);
}

static PyObject *listener_accept(Listener *l, PyObject *args)
{
    double timeout = -1;
    if (!PyArg_ParseTuple(args, "|d:accept", &timeout))
        return NULL;
    if (!l->l || l->ctx->g.pid != bexmod_pid()) {
        PyErr_SetString(l->l ? bexmod_fork_error : PyExc_ValueError,
                        l->l ? "this bex listener belongs to the parent process"
                             : "bex listener is closed");
        return NULL;
    }
    struct acc *a = NULL;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS;
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    long long ns = dl.tv_nsec + (long long)((timeout < 0 ? 0 : timeout) * 1e9);
    dl.tv_sec += (time_t)(ns / 1000000000), dl.tv_nsec = (long)(ns % 1000000000);
    pthread_mutex_lock(&l->mu);
    while (!l->head && !l->closed && rc == 0)
        if (timeout < 0)
            pthread_cond_wait(&l->cv, &l->mu);
        else if (pthread_cond_timedwait(&l->cv, &l->mu, &dl) == ETIMEDOUT)
            rc = -ETIMEDOUT;
    if ((a = l->head) != NULL) {
        l->head = a->next, l->n--;
        if (!l->head)
            l->tail = NULL;
    }
    pthread_mutex_unlock(&l->mu);
    Py_END_ALLOW_THREADS;
    if (!a)
        return rc ? bexmod_raise(bexmod_error, rc, "accept")
                  : (PyErr_SetString(PyExc_ValueError, "bex listener is closed"), NULL);
    Socket *so = sock_wrap(l->ctx, a->st);
    if (!so) {
        Py_BEGIN_ALLOW_THREADS;
        st_close(a->st);
        Py_END_ALLOW_THREADS;
    }
    free(a);
    return (PyObject *)so;
}

static PyObject *listener_close(Listener *l, PyObject *unused)
{
    (void)unused;
    listener_close_now(l);
    Py_RETURN_NONE;
}

static PyMethodDef listener_methods[] = {
    {"accept", (PyCFunction)listener_accept, METH_VARARGS,
     "accept(timeout=-1): the next socket a peer opened."},
    {"close", (PyCFunction)listener_close, METH_NOARGS,
     "Stop listening; sockets accepted but not taken are closed."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject listener_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bex._bex.Listener",
    .tp_basicsize = sizeof(Listener),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A bex listener.",
    .tp_dealloc = (destructor)listener_dealloc,
    .tp_methods = listener_methods,
};

/* ---- the context ---- */

static PyObject *ctx_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args, (void)kw;
    SockContext *self = (SockContext *)type->tp_alloc(type, 0);
    if (self)
        bexmod_guard_init(&self->g);
    return (PyObject *)self;
}

static int ctx_init(SockContext *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"local_addr", "transport", NULL};
    const char *local = "127.0.0.1", *transport = "tcp";
    bex_ctx_config cc = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ss", kwlist, &local, &transport) ||
        bexmod_ctx_config(&cc, local, transport) < 0)
        return -1;
    if (self->ctx) {
        PyErr_SetString(PyExc_RuntimeError, "bex context already made");
        return -1;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = bexmod_ctx_create(&cc, &self->ctx);
    Py_END_ALLOW_THREADS;
    if (rc) {
        bexmod_raise(bexmod_error, rc, "bex: context on %s", local);
        return -1;
    }
    return 0;
}

static PyObject *ctx_close(SockContext *self, PyObject *unused)
{
    (void)unused;
    if (!self->ctx)
        Py_RETURN_NONE;
    pthread_mutex_lock(&self->g.mu);
    int open = self->g.busy;
    pthread_mutex_unlock(&self->g.mu);
    if (open) {
        PyErr_Format(PyExc_ValueError, "close the context's %d sockets and listeners first", open);
        return NULL;
    }
    if (bexmod_guard_close(&self->g) == 0) {
        Py_BEGIN_ALLOW_THREADS;
        bexmod_ctx_destroy(self->ctx);
        Py_END_ALLOW_THREADS;
    }
    self->ctx = NULL;
    Py_RETURN_NONE;
}

static void ctx_dealloc(SockContext *self)
{
    PyObject *r = ctx_close(self, NULL); /* nothing is open: each holds a reference */
    if (!r)
        PyErr_WriteUnraisable((PyObject *)self);
    Py_XDECREF(r);
    bexmod_guard_fini(&self->g);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ctx_usable(SockContext *self)
{
    if (!self->ctx) {
        PyErr_SetString(PyExc_ValueError, "bex context is closed");
        return -1;
    }
    if (self->g.pid != bexmod_pid()) {
        PyErr_SetString(bexmod_fork_error, "this bex context belongs to the parent process");
        return -1;
    }
    return 0;
}

static PyObject *ctx_connect(SockContext *self, PyObject *args)
{
    const char *addr;
    double timeout = 10;
    bex_addr sa;
    if (!PyArg_ParseTuple(args, "s|d:connect", &addr, &timeout) ||
        bexmod_parse_addr(addr, &sa) < 0 || ctx_usable(self) < 0)
        return NULL;
    struct sstate *st = st_new();
    if (!st)
        return PyErr_NoMemory();
    int rc = bex_sock_connect(self->ctx, &sa, &sock_ops, st, &st->s);
    if (rc) {
        st_free(st);
        return bexmod_raise(bexmod_error, rc, "connect to %s", addr);
    }
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&st->mu);
    rc = st_wait(st, timeout, is_up);
    if (rc == 0 && !st->connected)
        rc = st->err;
    pthread_mutex_unlock(&st->mu);
    if (rc)
        st_close(st);
    Py_END_ALLOW_THREADS;
    if (rc)
        return bexmod_raise(bexmod_error, rc, "connect to %s", addr);
    Socket *so = sock_wrap(self, st);
    if (!so) {
        Py_BEGIN_ALLOW_THREADS;
        st_close(st);
        Py_END_ALLOW_THREADS;
    }
    return (PyObject *)so;
}

static PyObject *ctx_listen(SockContext *self, PyObject *args)
{
    const char *addr = "127.0.0.1:0";
    unsigned accept_max = 128;
    bex_addr sa;
    if (!PyArg_ParseTuple(args, "|sI:listen", &addr, &accept_max) ||
        bexmod_parse_addr(addr, &sa) < 0 || ctx_usable(self) < 0)
        return NULL;
    Listener *l = PyObject_New(Listener, &listener_type);
    if (!l)
        return NULL;
    l->ctx = (SockContext *)Py_NewRef((PyObject *)self);
    l->l = NULL, l->head = l->tail = NULL, l->n = 0, l->closed = 0;
    l->max = accept_max ? accept_max : 1;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    static const bex_listener_ops lops = {.on_accept = on_accept};
    int rc = bex_listen(self->ctx, &sa, &lops, l, &l->l);
    if (rc) {
        l->l = NULL;
        Py_DECREF(l);
        return bexmod_raise(bexmod_error, rc, "listen on %s", addr);
    }
    pthread_mutex_lock(&self->g.mu);
    self->g.busy++;
    pthread_mutex_unlock(&self->g.mu);
    bex_listener_addr(l->l, &sa);
    PyObject *bound = bexmod_addr_str(&sa);
    PyObject *t = bound ? Py_BuildValue("(NN)", l, bound) : NULL;
    if (!t)
        Py_DECREF(l);
    return t;
}

static PyMethodDef ctx_methods[] = {
    {"connect", (PyCFunction)ctx_connect, METH_VARARGS,
     "connect('ip:port', timeout=10): a connected Socket."},
    {"_listen", (PyCFunction)ctx_listen, METH_VARARGS,
     "_listen('ip:port', accept_max=128): (Listener, 'ip:port' bound)."},
    {"close", (PyCFunction)ctx_close, METH_NOARGS, "Free (its sockets and listeners closed)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ctx_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bex._bex.SockContext",
    .tp_basicsize = sizeof(SockContext),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A bex context for sockets (bex.sock.Context wraps it).",
    .tp_new = ctx_new,
    .tp_init = (initproc)ctx_init,
    .tp_dealloc = (destructor)ctx_dealloc,
    .tp_methods = ctx_methods,
};

int bexmod_sock_init(PyObject *m)
{
    PyTypeObject *const types[] = {&ctx_type, &sock_type, &listener_type};
    const char *const names[] = {"SockContext", "Socket", "Listener"};
    return bexmod_add_types(m, types, names, 3);
}
