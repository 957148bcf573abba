/* SPDX-License-Identifier: Apache-2.0 */
/* Arguments as buffers: each wrong type, shape or layout is a clear
 * TypeError or ValueError naming the argument, never a silent copy. */
#include <string.h>

#include "bexmod.h"

/* The format's type letter without a native/little-endian prefix (x86 and
 * arm64 Linux are little-endian); 0 for anything else. */
static char fmt_letter(const char *f)
{
    if (!f)
        return 'B';
    if (f[0] == '@' || f[0] == '=' || f[0] == '<')
        f++;
    return f[0] && !f[1] ? f[0] : 0;
}

static int contiguous(Py_buffer *v, const char *what)
{
    if (PyBuffer_IsContiguous(v, 'C'))
        return 0;
    PyErr_Format(PyExc_ValueError,
                 "%s must be C-contiguous (numpy.ascontiguousarray or tensor.contiguous())", what);
    return -1;
}

static int no_negative(Py_buffer *v)
{
    const int64_t *k = v->buf;
    for (Py_ssize_t i = 0; i < v->len / 8; i++)
        if (k[i] < 0) {
            PyErr_Format(PyExc_ValueError, "keys[%zd] is negative (%lld): keys are uint64", i,
                         (long long)k[i]);
            return -1;
        }
    return 0;
}

int bexmod_get_keys(PyObject *o, Py_buffer *v)
{
    if (PyObject_GetBuffer(o, v, PyBUF_RECORDS_RO) < 0) {
        PyErr_Format(PyExc_TypeError,
                     "keys must be an array of uint64 (numpy.uint64, or int64 without negative "
                     "values), not %.100s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    char t = fmt_letter(v->format);
    int is_unsigned = (t == 'Q' || t == 'L') && v->itemsize == 8;
    int is_signed = (t == 'q' || t == 'l') && v->itemsize == 8;
    if (!is_unsigned && !is_signed) {
        PyErr_Format(PyExc_TypeError,
                     "keys must be uint64 (or int64 without negative values), not format '%s' "
                     "of %zd bytes",
                     v->format ? v->format : "B", v->itemsize);
        goto err_release;
    }
    if (v->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "keys must be 1-D, not %d-D", v->ndim);
        goto err_release;
    }
    if (contiguous(v, "keys") < 0 || (is_signed && no_negative(v) < 0))
        goto err_release;
    return 0;
err_release:
    PyBuffer_Release(v);
    return -1;
}

static int check_shape(Py_buffer *v, const char *what, Py_ssize_t n, Py_ssize_t dim)
{
    if (v->ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s must be 2-D (n, dim) = (%zd, %zd), not %d-D", what, n,
                     dim, v->ndim);
        return -1;
    }
    if (v->shape[0] != n || (dim && v->shape[1] != dim)) {
        PyErr_Format(PyExc_ValueError, "%s has shape (%zd, %zd), expected (%zd, %zd)", what,
                     v->shape[0], v->shape[1], n, dim ? dim : v->shape[1]);
        return -1;
    }
    return 0;
}

int bexmod_get_rows(PyObject *o, Py_buffer *v, const char *what, Py_ssize_t n, Py_ssize_t dim,
                    int writable)
{
    int flags = writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO;
    if (PyObject_GetBuffer(o, v, flags) < 0) {
        if (writable && PyObject_CheckBuffer(o)) {
            PyErr_Format(PyExc_ValueError, "%s must be writable", what);
            return -1;
        }
        PyErr_Format(PyExc_TypeError, "%s must be an array of float32, not %.100s", what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    if (fmt_letter(v->format) != 'f' || v->itemsize != 4) {
        PyErr_Format(PyExc_TypeError, "%s must be float32, not format '%s' of %zd bytes", what,
                     v->format ? v->format : "B", v->itemsize);
        goto err_release;
    }
    if (check_shape(v, what, n, dim) < 0 || contiguous(v, what) < 0)
        goto err_release;
    return 0;
err_release:
    PyBuffer_Release(v);
    return -1;
}
