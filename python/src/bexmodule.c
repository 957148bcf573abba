/* SPDX-License-Identifier: Apache-2.0 */
/* bex._bex: the CPython extension behind the bex package (python/README.md
 * says why the C API and not cffi or Cython).
 *
 * Each call takes its arguments as buffers (the buffer protocol: numpy
 * arrays, memoryviews; the Python layer in bex/ps.py turns torch tensors
 * into such views without a copy), checks their type, shape and layout,
 * and calls libbex with the GIL released while it waits: the I/O threads
 * of bex never take the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include <bex/common.h>
#include <bex/ps.h>

#include "bexmod.h"

PyObject *bexmod_error;      /* bex.Error(OSError) */
PyObject *bexmod_push_error; /* bex.PushError(bex.Error) */
PyObject *bexmod_fork_error; /* bex.ForkError(RuntimeError) */

const char *bexmod_errname(int rc)
{
    const char *n = rc < 0 ? strerrorname_np(-rc) : NULL;
    return n ? n : "E?";
}

PyObject *bexmod_raise(PyObject *type, int rc, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int len = PyOS_vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (len >= 0 && (size_t)len < sizeof msg)
        PyOS_snprintf(msg + len, sizeof msg - (size_t)len, ": %s (bex -%s)", bex_strerror(rc),
                      bexmod_errname(rc));
    PyObject *e = PyObject_CallFunction(type, "is", rc < 0 ? -rc : rc, msg);
    if (!e)
        return NULL;
    PyObject *name = PyUnicode_FromString(bexmod_errname(rc));
    if (name && PyObject_SetAttrString(e, "bex_error", name) == 0)
        PyErr_SetObject(type, e);
    Py_XDECREF(name);
    Py_DECREF(e);
    return NULL;
}

PyObject *bexmod_addr_str(const bex_addr *a)
{
    char ip[BEX_ADDR_STRLEN];
    return PyUnicode_FromString(bex_addr_format(a, true, ip, sizeof ip));
}

int bexmod_add_types(PyObject *m, PyTypeObject *const *types, const char *const *names, int n)
{
    for (int i = 0; i < n; i++) {
        if (PyType_Ready(types[i]) < 0)
            return -1;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            return -1;
        }
    }
    return 0;
}

int bexmod_efd_wait(int efd)
{
    uint64_t v;
    ssize_t r;
    Py_BEGIN_ALLOW_THREADS;
    do
        r = read(efd, &v, sizeof v);
    while (r < 0 && errno == EINTR);
    Py_END_ALLOW_THREADS;
    if (r < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *version(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    return PyUnicode_FromString(bex_version_string());
}

static PyObject *py_strerror(PyObject *self, PyObject *arg)
{
    (void)self;
    long rc = PyLong_AsLong(arg);
    if (rc == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(bex_strerror((int)rc));
}

static PyMethodDef methods[] = {
    {"version", version, METH_NOARGS, "The version of libbex that runs (bex_version_string())."},
    {"strerror", py_strerror, METH_O, "bex_strerror(code): the text of a bex return code."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "bex._bex",
    "libbex, for the bex package.",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

static int add_errors(PyObject *m)
{
    bexmod_error = PyErr_NewExceptionWithDoc(
        "bex.Error",
        "A bex call failed. errno: the errno; bex_error: its name (ECONNREFUSED, ...); "
        "shard, replica: where, when one is known.",
        PyExc_OSError, NULL);
    bexmod_push_error = PyErr_NewExceptionWithDoc(
        "bex.PushError",
        "A Push was not acknowledged by every replica; replicas lists each (shard, "
        "replica, errno) part, failed the ones that did not acknowledge.",
        bexmod_error, NULL);
    bexmod_fork_error = PyErr_NewExceptionWithDoc(
        "bex.ForkError",
        "An object of bex was used in a process forked from the one that made it: "
        "the child must open its own.",
        PyExc_RuntimeError, NULL);
    if (!bexmod_error || !bexmod_push_error || !bexmod_fork_error)
        return -1;
    Py_INCREF(bexmod_error), Py_INCREF(bexmod_push_error), Py_INCREF(bexmod_fork_error);
    if (PyModule_AddObject(m, "Error", bexmod_error) < 0 ||
        PyModule_AddObject(m, "PushError", bexmod_push_error) < 0 ||
        PyModule_AddObject(m, "ForkError", bexmod_fork_error) < 0)
        return -1;
    return 0;
}

PyMODINIT_FUNC PyInit__bex(void)
{
    if (bexmod_pid_init() < 0) {
        PyErr_SetString(PyExc_OSError, "bex: pthread_atfork failed");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (add_errors(m) < 0 || bexmod_ps_init(m) < 0 || bexmod_rpc_init(m) < 0 ||
        bexmod_sock_init(m) < 0 || bexmod_mem_init(m) < 0 || bexmod_pools_init(m) < 0 ||
        PyModule_AddIntConstant(m, "PS_KEYS_MAX", BEX_PS_KEYS_MAX) < 0 ||
        PyModule_AddIntConstant(m, "PS_DIM_MAX", BEX_PS_DIM_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
