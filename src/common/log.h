/* The library's log: a hook per context, rate-limited.
 *
 * Nothing in the library writes to stderr itself; it calls bex__log() with
 * the context's logger, which hands a formatted line to the application's
 * hook (bex_ctx_config.log_fn) or, without one, writes "bex: <line>" to
 * stderr. A peer can make us log (every refusal of bad input does), so the
 * logger lets through at most BEX__LOG_BURST lines per second and counts the
 * rest; the next line that passes says how many were dropped.
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

#define BEX__LOG_BURST 20 /* lines per second before suppression */

struct bex__log {
    bex_log_fn fn; /* NULL: stderr */
    void *arg;
    int level; /* highest level passed on (BEX_LOG_*) */
    pthread_mutex_t lock;
    uint64_t window_ms; /* start of the current one-second window */
    uint32_t in_window; /* lines passed in it */
    uint32_t dropped;   /* lines suppressed since the last one passed */
};

/* Set up a logger; fn NULL means stderr, level 0 means BEX_LOG_WARN. */
void bex__log_init(struct bex__log *lg, bex_log_fn fn, void *arg, int level);
void bex__log_fini(struct bex__log *lg);

/* Log one line (no trailing newline needed). lg NULL: stderr, no limit. */
void bex__log(struct bex__log *lg, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

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
