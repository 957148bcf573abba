/* The library's log hook with a rate limit. See log.h. */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

void bex__log_init(struct bex__log *lg, bex_log_fn fn, void *arg, int level)
{
    lg->fn = fn;
    lg->arg = arg;
    lg->level = level ? level : BEX_LOG_WARN;
    pthread_mutex_init(&lg->lock, NULL);
    lg->window_ms = 0;
    lg->in_window = 0;
    lg->dropped = 0;
}

void bex__log_fini(struct bex__log *lg)
{
    pthread_mutex_destroy(&lg->lock);
}

static void emit(struct bex__log *lg, int level, const char *msg)
{
    if (lg && lg->fn)
        lg->fn(level, msg, lg->arg);
    else
        fprintf(stderr, "bex: %s\n", msg);
}

void bex__log(struct bex__log *lg, int level, const char *fmt, ...)
{
    if (lg && level > lg->level)
        return;
    uint32_t dropped = 0;
    if (lg) {
        uint64_t now = mono_ms();
        pthread_mutex_lock(&lg->lock);
        if (now - lg->window_ms >= 1000) {
            lg->window_ms = now;
            lg->in_window = 0;
        }
        if (lg->in_window >= BEX__LOG_BURST) {
            lg->dropped++;
            pthread_mutex_unlock(&lg->lock);
            return;
        }
        lg->in_window++;
        dropped = lg->dropped;
        lg->dropped = 0;
        pthread_mutex_unlock(&lg->lock);
    }
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (dropped) {
        char note[64];
        snprintf(note, sizeof(note), "%u log lines suppressed (rate limit)", dropped);
        emit(lg, BEX_LOG_WARN, note);
    }
    emit(lg, level, line);
}
