/* SPDX-License-Identifier: Apache-2.0 */
/* The library's log: a hook per context, rate-limited per call site.
 *
 * Nothing in the library writes to stderr itself; it calls bex__log() with
 * the context's logger, which hands a formatted line to the application's
 * hook (bex_ctx_config.log_fn) or, without one, writes it to stderr as
 * "<UTC time> bex <LEVEL> [<context>] <line>" (bex__log_format).
 *
 * A peer can make us log (every refusal of bad input does), so each call
 * site of bex__log lets through at most BEX__LOG_BURST lines per window
 * (one second unless the logger's window is set: bex__log_set_window)
 * and counts the rest; the next line that passes there says how many were
 * dropped. The limit is per call site, not per logger, so a flood of one
 * kind of line (a peer's WARN) never drops another (an ERROR of ours); a
 * site's budget is the process's, shared by its contexts.
 *
 * Threads: bex__log() may be called from any thread; the rate limit is kept
 * under a mutex (logging is rare by construction, never on a hot path). */
#ifndef BEX_COMMON_LOG_H
#define BEX_COMMON_LOG_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "bex/common.h"

#define BEX__LOG_BURST      20      /* lines per window before suppression */
#define BEX__LOG_WINDOW_MS  1000    /* a call site's window, by default */
#define BEX__LOG_WINDOW_MAX 3600000 /* the longest window one may set, ms */

struct bex__log {
    bex_log_fn fn; /* NULL: stderr */
    void *arg;
    int level;          /* highest level passed on (BEX_LOG_*) */
    char name[48];      /* the context, in stderr lines ("" until named) */
    uint32_t window_ms; /* a call site's window when this logger logs there
                           (BEX__LOG_WINDOW_MS; bex_ctx_config.log_window_ms) */
};

/* The rate limit of one call site (a static in the bex__log macro). */
struct bex__log_site {
    uint64_t window_ms; /* start of the current window */
    uint32_t in_window; /* lines passed in it */
    uint32_t dropped;   /* lines suppressed since the last one passed */
};

/* Set up a logger; fn NULL means stderr, level 0 means BEX_LOG_WARN. */
void bex__log_init(struct bex__log *lg, bex_log_fn fn, void *arg, int level);
void bex__log_fini(struct bex__log *lg);
/* The rate window of the call sites this logger logs at, ms (0: the
 * default, BEX__LOG_WINDOW_MS): a site lets BEX__LOG_BURST lines through
 * per window. Tests that provoke one kind of line case after case set it
 * short instead of waiting out a second. */
void bex__log_set_window(struct bex__log *lg, uint32_t ms);
/* Name the context in stderr lines (copied, truncated to fit). */
void bex__log_set_name(struct bex__log *lg, const char *name);

/* Log one line (no trailing newline needed), limited by its call site.
 * lg NULL: stderr, no context name. */
#define bex__log(lg, level, ...)                                                                   \
    do {                                                                                           \
        static struct bex__log_site bex__log_site_;                                                \
        bex__log_at(&bex__log_site_, (lg), (level), __VA_ARGS__);                                  \
    } while (0)

/* bex__log with the call site's limit given (tests; the macro's body). */
void bex__log_at(struct bex__log_site *site, struct bex__log *lg, int level, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The stderr form of a line into buf: "2026-12-05T00:12:03.123Z bex WARN
 * [name] msg" (no brackets without a name). Returns buf. */
char *bex__log_format(char *buf, size_t cap, const struct bex__log *lg, int level, const char *msg);

/* Lines said once per object (a connection's flood of refusals, ...):
 * each object keeps a word of "said" bits, one per kind of line, and
 * bex__log_once logs only the first time a bit is set. The word belongs
 * to the object's thread (no atomics); bex__log_once_atomic is for a word
 * any thread may reach (process-wide notes). */
static inline bool bex__log_first(uint32_t *said, uint32_t bit)
{
    if (*said & bit)
        return false;
    *said |= bit;
    return true;
}

static inline bool bex__log_first_atomic(_Atomic uint32_t *said, uint32_t bit)
{
    return !(atomic_fetch_or_explicit(said, bit, memory_order_relaxed) & bit);
}

#define bex__log_once(lg, said, bit, level, ...)                                                   \
    do {                                                                                           \
        if (bex__log_first(said, bit))                                                             \
            bex__log(lg, level, __VA_ARGS__);                                                      \
    } while (0)

#define bex__log_once_atomic(lg, said, bit, level, ...)                                            \
    do {                                                                                           \
        if (bex__log_first_atomic(said, bit))                                                      \
            bex__log(lg, level, __VA_ARGS__);                                                      \
    } while (0)

#endif
