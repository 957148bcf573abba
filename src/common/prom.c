/* SPDX-License-Identifier: Apache-2.0 */
/* Prometheus text exposition (common/prom.h). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/prom.h"

void bex__prom_printf(struct bex__prom *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k =
        vsnprintf(o->n < o->cap ? o->buf + o->n : NULL, o->n < o->cap ? o->cap - o->n : 0, fmt, ap);
    va_end(ap);
    if (k > 0)
        o->n += (size_t)k;
}

void bex__prom_escape(const char *in, char *out, size_t cap)
{
    size_t o = 0;
    for (; *in && o + 3 < cap; in++) {
        if (*in == '\\' || *in == '"') {
            out[o++] = '\\';
            out[o++] = *in;
        } else if (*in == '\n') {
            out[o++] = '\\';
            out[o++] = 'n';
        } else {
            out[o++] = *in;
        }
    }
    out[o] = 0;
}

void bex__prom_counters(struct bex__prom *o, const struct bex__prom_ctr *ctrs, size_t n,
                        bex__prom_next_fn next, void *arg)
{
    char labels[512];
    for (size_t i = 0; i < n; i++) {
        bex__prom_printf(o, "# HELP %s %s.\n# TYPE %s counter\n", ctrs[i].metric, ctrs[i].help,
                         ctrs[i].metric);
        const void *cur = NULL;
        for (const void *p; (p = next(arg, &cur, labels, sizeof labels));) {
            uint64_t v;
            memcpy(&v, (const char *)p + ctrs[i].off, sizeof v);
            bex__prom_printf(o, "%s{%s} %llu\n", ctrs[i].metric, labels, (unsigned long long)v);
        }
    }
}

const void *bex__prom_array_next(void *arg, const void **cur, char *labels, size_t cap)
{
    const struct bex__prom_array *a = arg;
    const char *p = *cur ? (const char *)*cur + a->stride : a->base;
    if (!a->n || p >= (const char *)a->base + a->n * a->stride)
        return NULL;
    *cur = p;
    a->label(p, a->arg, labels, cap);
    return p;
}
