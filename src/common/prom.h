/* SPDX-License-Identifier: Apache-2.0 */
/* Prometheus text exposition: a writer into the caller's buffer that
 * counts what it needed past the end (like snprintf), label escaping, and
 * families of counters read out of stats structs. Used by every layer that
 * renders metrics (the context's transport counters, the RPC dumps, the
 * parameter server's). */
#ifndef BEX_COMMON_PROM_H
#define BEX_COMMON_PROM_H

#include <stddef.h>
#include <stdint.h>

struct bex__prom {
    char *buf;
    size_t cap, n; /* n: what was needed so far (output cut past cap) */
};
__attribute__((format(printf, 2, 3))) void bex__prom_printf(struct bex__prom *o, const char *fmt,
                                                            ...);
/* A counter of a stats struct: its metric, help (without the final
 * period) and the offset of its uint64_t in the struct. */
struct bex__prom_ctr {
    const char *metric, *help;
    size_t off;
};
/* The next object whose counters are written (*cur: NULL at the start of
 * each family, then what the previous call left), or NULL at the end; its
 * labels (`name="value",...`, escaped) into labels. */
typedef const void *(*bex__prom_next_fn)(void *arg, const void **cur, char *labels, size_t cap);
/* Each counter of ctrs as a family: its HELP and TYPE lines, then one
 * sample per object that next returns, in that order. */
void bex__prom_counters(struct bex__prom *o, const struct bex__prom_ctr *ctrs, size_t n,
                        bex__prom_next_fn next, void *arg);
/* The objects of an array (bex__prom_next_fn's arg: base, count, stride),
 * labelled by label(). */
struct bex__prom_array {
    const void *base;
    size_t n, stride;
    void (*label)(const void *obj, const void *arg, char *labels, size_t cap);
    const void *arg;
};
const void *bex__prom_array_next(void *arg, const void **cur, char *labels, size_t cap);

/* A label value: backslash, quote and newline escaped, cut to fit cap. */
void bex__prom_escape(const char *in, char *out, size_t cap);

#endif
