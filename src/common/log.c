/* SPDX-License-Identifier: Apache-2.0 */
/* The library's log hook, rate-limited per call site. See log.h. */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* Guards every call site's window (logging is rare: one lock will do). */
static pthread_mutex_t sites_lock = PTHREAD_MUTEX_INITIALIZER;

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
    lg->name[0] = 0;
    lg->window_ms = BEX__LOG_WINDOW_MS;
}

void bex__log_set_window(struct bex__log *lg, uint32_t ms)
{
    lg->window_ms = ms ? ms : BEX__LOG_WINDOW_MS;
}

void bex__log_fini(struct bex__log *lg)
{
    (void)lg;
}

void bex__log_set_name(struct bex__log *lg, const char *name)
{
    snprintf(lg->name, sizeof lg->name, "%s", name ? name : "");
}

static const char *level_name(int level)
{
    switch (level) {
    case BEX_LOG_ERROR:
        return "ERROR";
    case BEX_LOG_WARN:
        return "WARN";
    case BEX_LOG_INFO:
        return "INFO";
    default:
        return "DEBUG";
    }
}

char *bex__log_format(char *buf, size_t cap, const struct bex__log *lg, int level, const char *msg)
{
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    char when[32];
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    const char *name = lg && lg->name[0] ? lg->name : NULL;
    snprintf(buf, cap, "%s.%03ldZ bex %s %s%s%s%s", when, ts.tv_nsec / 1000000, level_name(level),
             name ? "[" : "", name ? name : "", name ? "] " : "", msg);
    return buf;
}

static void emit(struct bex__log *lg, int level, const char *msg)
{
    if (lg && lg->fn) {
        lg->fn(level, msg, lg->arg);
        return;
    }
    char line[640];
    fprintf(stderr, "%s\n", bex__log_format(line, sizeof line, lg, level, msg));
}

/* Whether the site may log now; *dropped: the lines it suppressed before. */
static int site_pass(struct bex__log_site *site, uint32_t window, uint32_t *dropped)
{
    uint64_t now = mono_ms();
    int pass = 0;
    pthread_mutex_lock(&sites_lock);
    if (now - site->window_ms >= window) {
        site->window_ms = now;
        site->in_window = 0;
    }
    if (site->in_window >= BEX__LOG_BURST) {
        site->dropped++;
    } else {
        site->in_window++;
        *dropped = site->dropped;
        site->dropped = 0;
        pass = 1;
    }
    pthread_mutex_unlock(&sites_lock);
    return pass;
}

void bex__log_at(struct bex__log_site *site, struct bex__log *lg, int level, const char *fmt, ...)
{
    if (lg && level > lg->level)
        return;
    uint32_t dropped = 0;
    /* a logger never initialised (zeroed) keeps the default window */
    uint32_t window = lg && lg->window_ms ? lg->window_ms : BEX__LOG_WINDOW_MS;
    if (!site_pass(site, window, &dropped))
        return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (dropped) {
        char note[96];
        snprintf(note, sizeof(note), "%u log lines like the next suppressed (rate limit)", dropped);
        emit(lg, level, note);
    }
    emit(lg, level, line);
}
