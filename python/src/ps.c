/* SPDX-License-Identifier: Apache-2.0 */
/* bex._bex.PsClient: a bex_ps_client, its context and directory.
 *
 * Threads: any Python thread may call it; a call holds the client (busy)
 * while it waits with the GIL released, and close() waits, without the
 * GIL, for the calls in progress before it destroys the client.
 * Fork: the child of a fork has none of bex's threads, so a client made
 * before the fork refuses every call there (bex.ForkError) and is never
 * destroyed there (its memory is the parent's copy; the child opens its
 * own). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <bex/dir.h>
#include <bex/mem.h>
#include <bex/ps.h>
#include <bex/sock.h>

#include "psclient.h"

/* The client for one call, or an exception (closed, forked). */
int bexmod_ps_enter(PsClient *self)
{
    if (self->pid != bexmod_pid()) {
        PyErr_Format(bexmod_fork_error,
                     "this bex client belongs to process %d, and this process (%d) is a fork of "
                     "it: open a new bex.ps.Client in this process",
                     (int)self->pid, (int)bexmod_pid());
        return -1;
    }
    pthread_mutex_lock(&self->mu);
    int closed = self->closed || !self->pc;
    if (!closed)
        self->busy++;
    pthread_mutex_unlock(&self->mu);
    if (closed) {
        PyErr_SetString(PyExc_ValueError, "bex client is closed");
        return -1;
    }
    return 0;
}

void bexmod_ps_leave(PsClient *self)
{
    pthread_mutex_lock(&self->mu);
    if (--self->busy == 0)
        pthread_cond_broadcast(&self->idle);
    pthread_mutex_unlock(&self->mu);
}

static PyObject *ps_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args, (void)kw;
    PsClient *self = (PsClient *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->idle, NULL);
    self->pid = bexmod_pid();
    self->efd = -1;
    if (bexmod_async_init(self) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* Mark closed, wait for the calls in progress, destroy (GIL released). */
static void ps_close_now(PsClient *self)
{
    if (self->pid != bexmod_pid()) { /* a fork's copy: the parent owns it */
        self->closed = 1;
        return;
    }
    /* closed before the GIL goes: a completion drained meanwhile must not
     * read the directory being destroyed (fetch_where) */
    pthread_mutex_lock(&self->mu);
    self->closed = 1;
    pthread_mutex_unlock(&self->mu);
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&self->mu);
    while (self->busy)
        pthread_cond_wait(&self->idle, &self->mu);
    pthread_mutex_unlock(&self->mu);
    if (self->pc)
        bex_ps_client_destroy(self->pc);
    pthread_mutex_lock(&self->mu);
    bool keep = self->live_mem > 0; /* bex.empty arrays: the last one destroys it */
    if (keep)
        self->ctx_orphan = self->ctx;
    pthread_mutex_unlock(&self->mu);
    if (self->ctx && !keep)
        bexmod_ctx_destroy(self->ctx);
    if (self->dir)
        bex_dir_destroy(self->dir);
    Py_END_ALLOW_THREADS;
    self->pc = NULL, self->ctx = NULL, self->dir = NULL;
}

static void ps_dealloc(PsClient *self)
{
    ps_close_now(self);
    pthread_mutex_destroy(&self->mu);
    pthread_cond_destroy(&self->idle);
    bexmod_async_fini(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int parse_transport(const char *t, uint32_t *out)
{
    if (!strcmp(t, "tcp"))
        *out = BEX_TRANSPORT_TCP;
    else if (!strcmp(t, "rdma"))
        *out = BEX_TRANSPORT_RDMA;
    else if (!strcmp(t, "auto"))
        *out = BEX_TRANSPORT_AUTO;
    else {
        PyErr_Format(PyExc_ValueError, "transport must be 'tcp', 'rdma' or 'auto', not '%s'", t);
        return -1;
    }
    return 0;
}

/* The directory from a cluster file or an etcd URL (GIL released). */
static int open_dir(PsClient *self, const char *where, char *err, size_t errlen)
{
    int rc = bex_dir_create(NULL, &self->dir);
    if (rc)
        return rc;
    if (!strncmp(where, "http://", 7) || !strncmp(where, "https://", 8))
        return bex_dir_watch_etcd(self->dir, where, NULL, err, errlen);
    return bex_dir_load_file(self->dir, where, err, errlen);
}

static uint32_t count_shards(bex_dir *d, const char *service)
{
    uint32_t n = 0;
    while (n < 65536 && bex_dir_replicas(d, service, n, NULL, 0) > 0)
        n++;
    return n;
}

static int ps_open(PsClient *self, const char *where, bex_ctx_config *cc, bex_ps_client_config *pcc)
{
    char err[512] = "";
    int rc, step = 0;
    Py_BEGIN_ALLOW_THREADS;
    if ((rc = open_dir(self, where, err, sizeof err)) == 0 && ++step &&
        (rc = bexmod_ctx_create(cc, &self->ctx)) == 0 && ++step) {
        pcc->dir = self->dir;
        rc = bex_ps_client_create(self->ctx, pcc, &self->pc);
    }
    Py_END_ALLOW_THREADS;
    if (rc == 0) {
        self->n_shards = pcc->n_shards ? pcc->n_shards : count_shards(self->dir, self->service);
        return 0;
    }
    static const char *const what[] = {"directory", "context", "PS client"};
    bexmod_raise(bexmod_error, rc, "bex: %s: %s", what[step], err[0] ? err : where);
    ps_close_now(self);
    self->closed = 0; /* tp_init may be called again */
    return -1;
}

static int ps_init(PsClient *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"cluster",      "local_addr",         "transport",
                             "service",      "locality",           "timeout_ms",
                             "n_shards",     "connect_timeout_ms", "attempt_timeout_ms",
                             "max_attempts", "io_threads",         NULL};
    const char *where, *local = "127.0.0.1", *transport = "tcp", *service = "ps", *locality = NULL;
    bex_ctx_config cc = {0};
    bex_ps_client_config pcc = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw,
                                     "s|$sssz"
                                     "IIIIII",
                                     kwlist, &where, &local, &transport, &service, &locality,
                                     &pcc.timeout_ms, &pcc.n_shards, &pcc.connect_timeout_ms,
                                     &pcc.attempt_timeout_ms, &pcc.max_attempts, &cc.io_threads))
        return -1;
    if (self->pc || self->dir) {
        PyErr_SetString(PyExc_RuntimeError, "bex client already open");
        return -1;
    }
    if (bex_addr_resolve(local, 0, &cc.local_addr, NULL, 0) != 0) {
        PyErr_Format(PyExc_ValueError, "local_addr must be an IP address or host, not '%s'", local);
        return -1;
    }
    if (parse_transport(transport, &cc.transport) < 0)
        return -1;
    if (strlen(service) > BEX_DIR_NAME_MAX) {
        PyErr_SetString(PyExc_ValueError, "service name too long");
        return -1;
    }
    strcpy(self->service, service);
    pcc.service = self->service;
    pcc.locality = locality;
    return ps_open(self, where, &cc, &pcc);
}

int bexmod_check_table(unsigned long long table, Py_ssize_t dim)
{
    if (table > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "table must be a uint32, not %llu", table);
        return -1;
    }
    if (dim < 1 || dim > (Py_ssize_t)BEX_PS_DIM_MAX) {
        PyErr_Format(PyExc_ValueError, "dim must be 1..%u, not %zd", BEX_PS_DIM_MAX, dim);
        return -1;
    }
    return 0;
}

/* Where a failed Fetch went: "shard S (replicas)" or "shards S1, S2 of N";
 * *one gets the shard when the keys are all in one, else -1. */
static void fetch_where(PsClient *self, const uint64_t *keys, size_t n, char *buf, size_t cap,
                        long *one)
{
    uint32_t ns = self->n_shards ? self->n_shards : 1, first = UINT32_MAX, count = 0;
    uint8_t *seen = calloc(ns, 1);
    size_t len = 0;
    buf[0] = 0, *one = -1;
    for (size_t i = 0; seen && i < n; i++) {
        uint32_t s = bex_ps_key_shard(keys[i], ns);
        if (seen[s]++)
            continue;
        first = count++ ? first : s;
        if (len + 16 < cap)
            len += (size_t)snprintf(buf + len, cap - len, "%s%u", count > 1 ? ", " : "", s);
    }
    free(seen);
    if (count == 1) {
        bex_dir_replica r[4];
        size_t nr = self->closed ? 0 : bex_dir_replicas(self->dir, self->service, first, r, 4);
        snprintf(buf, cap, "shard %u%s", first,
                 nr == 0   ? ""
                 : nr == 1 ? " (replica"
                           : " (replicas");
        for (size_t i = 0; i < nr && i < 4; i++) {
            len = strlen(buf);
            char ip[BEX_ADDR_STRLEN];
            snprintf(buf + len, cap - len, "%s%s", i ? ", " : " ",
                     bex_addr_format(&r[i].addr, true, ip, sizeof ip));
        }
        if (nr)
            strncat(buf, ")", cap - strlen(buf) - 1);
        *one = first;
    } else if (count > 1) {
        char tmp[512];
        snprintf(tmp, sizeof tmp, "shards %s of %u", buf, ns);
        snprintf(buf, cap, "%s", tmp);
    }
}

PyObject *bexmod_raise_fetch(PsClient *self, int rc, uint32_t table, const uint64_t *keys, size_t n)
{
    char where[512];
    long one;
    fetch_where(self, keys, n, where, sizeof where, &one);
    bexmod_raise(bexmod_error, rc, "fetch of table %u, %zu keys, %s", table, n, where);
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *shard = one >= 0 ? PyLong_FromLong(one) : Py_NewRef(Py_None);
    if (v && shard)
        PyObject_SetAttrString(v, "shard", shard);
    Py_XDECREF(shard);
    PyErr_Restore(t, v, tb);
    return NULL;
}

/* A refusal of a call on caller memory before anything was sent: the
 * array is another context's or in use, or the keys are not grouped by
 * shard; the copying call does it. */
static bool zero_refused(int rc)
{
    return rc == -EINVAL || rc == -ENOBUFS || rc == -EBUSY;
}

/* Fetch into out: without a copy when out is an array of bex.empty. */
static int fetch_sync(PsClient *self, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                      float *out)
{
    bex_ps_client *pc = self->pc;
    if (n && bex_ps_rows_busy(out) == 0) {
        uint64_t z0 = bex_ps_rows_zero(out);
        int rc = bex_ps_fetch_into_sync(pc, table, dim, keys, n, out);
        if (!zero_refused(rc)) {
            self->zero_copy += bex_ps_rows_zero(out) != z0;
            return rc;
        }
    }
    return bex_ps_fetch_sync(pc, table, dim, keys, n, out);
}

static int push_sync(PsClient *self, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                     const float *grads, bex_ps_replica_result *res, size_t cap, size_t *n_res)
{
    bex_ps_client *pc = self->pc;
    float *g = (float *)grads; /* push_from writes only the array's header room */
    if (n && bex_ps_rows_busy(g) == 0) {
        uint64_t z0 = bex_ps_rows_zero(g);
        int rc = bex_ps_push_from_sync(pc, table, dim, keys, n, g, res, cap, n_res);
        if (!zero_refused(rc)) {
            self->zero_copy += bex_ps_rows_zero(g) != z0;
            return rc;
        }
    }
    return bex_ps_push_report_sync(pc, table, dim, keys, n, grads, res, cap, n_res);
}

static PyObject *ps_fetch_into(PsClient *self, PyObject *args)
{
    unsigned long long table;
    Py_ssize_t dim;
    PyObject *keys_o, *out_o, *ret = NULL;
    Py_buffer kv, ov;
    if (!PyArg_ParseTuple(args, "KnOO:fetch_into", &table, &dim, &keys_o, &out_o) ||
        bexmod_check_table(table, dim) < 0 || bexmod_get_keys(keys_o, &kv) < 0)
        return NULL;
    size_t n = (size_t)kv.len / 8;
    if (bexmod_get_rows(out_o, &ov, "out", (Py_ssize_t)n, dim, 1) < 0)
        goto err_keys;
    if (bexmod_ps_enter(self) < 0)
        goto err_out;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = fetch_sync(self, (uint32_t)table, (uint32_t)dim, kv.buf, n, ov.buf);
    Py_END_ALLOW_THREADS;
    bexmod_ps_leave(self);
    ret = rc ? bexmod_raise_fetch(self, rc, (uint32_t)table, kv.buf, n) : Py_NewRef(Py_None);
err_out:
    PyBuffer_Release(&ov);
err_keys:
    PyBuffer_Release(&kv);
    return ret;
}

/* The parts of a Push as a list of (shard, replica, errno) and the failed
 * ones' description. */
static PyObject *push_parts(const bex_ps_replica_result *res, size_t n, char *desc, size_t cap,
                            size_t *n_failed)
{
    PyObject *list = PyList_New((Py_ssize_t)n);
    size_t len = 0;
    desc[0] = 0, *n_failed = 0;
    for (size_t i = 0; list && i < n; i++) {
        PyObject *addr = bexmod_addr_str(&res[i].addr);
        int e = res[i].status < 0 ? -res[i].status : res[i].status;
        PyObject *t = addr ? Py_BuildValue("(INi)", res[i].shard, addr, e) : NULL;
        if (!t) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
        if (!res[i].status || len + 80 >= cap)
            continue;
        (*n_failed)++;
        len +=
            (size_t)snprintf(desc + len, cap - len, "%sshard %u replica %s (%s)", len ? ", " : "",
                             res[i].shard, PyUnicode_AsUTF8(addr), bexmod_errname(res[i].status));
    }
    return list;
}

static void set_attr_steal(PyObject *o, const char *name, PyObject *v)
{
    if (v)
        PyObject_SetAttrString(o, name, v);
    Py_XDECREF(v);
}

PyObject *bexmod_raise_push(int rc, uint32_t table, const bex_ps_replica_result *res, size_t n_res)
{
    char desc[768];
    size_t n_failed, first = 0;
    PyObject *parts = push_parts(res, n_res, desc, sizeof desc, &n_failed);
    if (!parts)
        return NULL;
    if (n_res == 0)
        bexmod_raise(bexmod_error, rc, "push to table %u", table);
    else
        bexmod_raise(bexmod_push_error, rc,
                     "push to table %u: %zu of %zu replica part(s) did not acknowledge: %s", table,
                     n_failed, n_res, desc);
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    while (first < n_res && !res[first].status)
        first++;
    if (v && first < n_res) {
        set_attr_steal(v, "shard", PyLong_FromUnsignedLong(res[first].shard));
        set_attr_steal(v, "replica", bexmod_addr_str(&res[first].addr));
    }
    if (v) {
        PyObject *failed = PyList_New(0);
        for (size_t i = 0; failed && i < n_res; i++)
            if (res[i].status)
                PyList_Append(failed, PyList_GET_ITEM(parts, (Py_ssize_t)i));
        set_attr_steal(v, "failed", failed);
        PyObject_SetAttrString(v, "replicas", parts);
    }
    Py_DECREF(parts);
    PyErr_Restore(t, v, tb);
    return NULL;
}

static PyObject *ps_push(PsClient *self, PyObject *args)
{
    unsigned long long table;
    Py_ssize_t dim;
    PyObject *keys_o, *grads_o, *ret = NULL;
    Py_buffer kv, gv;
    if (!PyArg_ParseTuple(args, "KnOO:push", &table, &dim, &keys_o, &grads_o) ||
        bexmod_check_table(table, dim) < 0 || bexmod_get_keys(keys_o, &kv) < 0)
        return NULL;
    size_t n = (size_t)kv.len / 8, n_res = 0;
    size_t cap = (size_t)(self->n_shards ? self->n_shards : 1) * BEX_PS_REPLICAS_MAX;
    bex_ps_replica_result *res = NULL;
    if (bexmod_get_rows(grads_o, &gv, "grads", (Py_ssize_t)n, dim, 0) < 0)
        goto err_keys;
    if (!(res = PyMem_Calloc(cap, sizeof *res))) {
        PyErr_NoMemory();
        goto err_grads;
    }
    if (bexmod_ps_enter(self) < 0)
        goto err_grads;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = push_sync(self, (uint32_t)table, (uint32_t)dim, kv.buf, n, gv.buf, res, cap, &n_res);
    Py_END_ALLOW_THREADS;
    bexmod_ps_leave(self);
    ret = rc ? bexmod_raise_push(rc, (uint32_t)table, res, n_res < cap ? n_res : cap)
             : Py_NewRef(Py_None);
err_grads:
    PyMem_Free(res);
    PyBuffer_Release(&gv);
err_keys:
    PyBuffer_Release(&kv);
    return ret;
}

static PyObject *ps_close(PsClient *self, PyObject *unused)
{
    (void)unused;
    ps_close_now(self);
    Py_RETURN_NONE;
}

static PyObject *ps_stats(PsClient *self, PyObject *unused)
{
    (void)unused;
    if (bexmod_ps_enter(self) < 0)
        return NULL;
    bex_ps_client_stats s;
    bex_ps_client_stats_get(self->pc, &s);
    bexmod_ps_leave(self);
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsl}", "calls", s.calls, "ok", s.ok, "failed",
                         s.failed, "attempts", s.attempts, "retries", s.retries, "retry_throttled",
                         s.retry_throttled, "failovers", s.failovers, "conn_failures",
                         s.conn_failures, "push_kept", s.push_kept, "push_resent", s.push_resent,
                         "push_dropped", s.push_dropped, "push_held", s.push_held, "push_channels",
                         s.push_channels, "zero_copy", (long)atomic_load(&self->zero_copy));
}

/* Bytes in use in the context's pools (send and receive), for leak checks. */
static PyObject *ps_pool_in_use(PsClient *self, PyObject *unused)
{
    (void)unused;
    if (bexmod_ps_enter(self) < 0)
        return NULL;
    bex_mem_stats send, recv;
    bex_mem_pool_collect(bex_ctx_pool(self->ctx));
    bex_mem_pool_stats(bex_ctx_pool(self->ctx), &send);
    bex_mem_pool_stats(bex_ctx_recv_pool(self->ctx), &recv);
    bexmod_ps_leave(self);
    return Py_BuildValue("{snsn}", "pool", (Py_ssize_t)send.in_use_bytes, "recv_pool",
                         (Py_ssize_t)recv.in_use_bytes);
}

static PyObject *ps_get_closed(PsClient *self, void *unused)
{
    (void)unused;
    return PyBool_FromLong(self->closed || !self->pc);
}

static PyObject *ps_get_n_shards(PsClient *self, void *unused)
{
    (void)unused;
    return PyLong_FromUnsignedLong(self->n_shards);
}

static PyMethodDef ps_methods[] = {
    {"fetch_into", (PyCFunction)ps_fetch_into, METH_VARARGS,
     "fetch_into(table, dim, keys, out): Fetch rows of keys into out, waiting."},
    {"push", (PyCFunction)ps_push, METH_VARARGS,
     "push(table, dim, keys, grads): Push grads for keys to every replica, waiting."},
    {"fetch_async_into", (PyCFunction)bexmod_ps_fetch_async, METH_VARARGS,
     "fetch_async_into(table, dim, keys, out, result, future): start a Fetch; the dispatcher "
     "completes future."},
    {"push_async", (PyCFunction)bexmod_ps_push_async, METH_VARARGS,
     "push_async(table, dim, keys, grads, None, future): start a Push."},
    {"_drain", (PyCFunction)bexmod_ps_drain, METH_NOARGS,
     "Wait for completions; [(future, result, exception)]."},
    {"close", (PyCFunction)ps_close, METH_NOARGS, "Wait for calls in progress, then free."},
    {"stats", (PyCFunction)ps_stats, METH_NOARGS, "The client's channel counters."},
    {"pool_in_use", (PyCFunction)ps_pool_in_use, METH_NOARGS, "Bytes in use in bex's pools."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ps_getset[] = {
    {"closed", (getter)ps_get_closed, NULL, "True once closed.", NULL},
    {"n_shards", (getter)ps_get_n_shards, NULL, "Shards the client spreads keys over.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *key_shard(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long key;
    unsigned n;
    if (!PyArg_ParseTuple(args, "KI:key_shard", &key, &n))
        return NULL;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "n_shards must be >= 1");
        return NULL;
    }
    return PyLong_FromUnsignedLong(bex_ps_key_shard(key, n));
}

static PyMethodDef ps_functions[] = {
    {"ps_key_shard", key_shard, METH_VARARGS, "ps_key_shard(key, n_shards): bex_ps_key_shard."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ps_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "bex._bex.PsClient",
    .tp_basicsize = sizeof(PsClient),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A bex parameter-server client (bex.ps.Client wraps it).",
    .tp_new = ps_new,
    .tp_init = (initproc)ps_init,
    .tp_dealloc = (destructor)ps_dealloc,
    .tp_methods = ps_methods,
    .tp_getset = ps_getset,
};

PyTypeObject *bexmod_ps_type = &ps_type;

int bexmod_ps_init(PyObject *m)
{
    if (PyType_Ready(&ps_type) < 0)
        return -1;
    if (PyModule_AddFunctions(m, ps_functions) < 0)
        return -1;
    Py_INCREF(&ps_type);
    if (PyModule_AddObject(m, "PsClient", (PyObject *)&ps_type) < 0) {
        Py_DECREF(&ps_type);
        return -1;
    }
    return 0;
}
