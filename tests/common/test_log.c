/* SPDX-License-Identifier: Apache-2.0 */
/* The log hook: level filter, rate limit, the "suppressed" note. */
#include <unistd.h>

#include "harness.h"
#include "common/log.h"

struct seen {
    int n, last_level;
    char last[512];
    int notes;
};

static void hook(int level, const char *msg, void *arg)
{
    struct seen *s = arg;
    s->n++;
    s->last_level = level;
    snprintf(s->last, sizeof(s->last), "%s", msg);
    if (strstr(msg, "suppressed"))
        s->notes++;
}

static int levels(void)
{
    struct seen s = {0};
    struct bex__log lg;
    bex__log_init(&lg, hook, &s, 0); /* default: WARN */
    bex__log(&lg, BEX_LOG_INFO, "not shown %d", 1);
    CHECK_EQ(s.n, 0);
    bex__log(&lg, BEX_LOG_ERROR, "engine %u: %s", 7u, "gone");
    CHECK_EQ(s.n, 1);
    CHECK_EQ(s.last_level, BEX_LOG_ERROR);
    CHECK(strcmp(s.last, "engine 7: gone") == 0);
    bex__log_fini(&lg);
    bex__log_init(&lg, hook, &s, BEX_LOG_DEBUG);
    bex__log(&lg, BEX_LOG_DEBUG, "shown");
    CHECK_EQ(s.n, 2);
    bex__log_fini(&lg);
    return 0;
}

static int rate_limit(void)
{
    struct seen s = {0};
    struct bex__log lg;
    struct bex__log_site site = {0};
    bex__log_init(&lg, hook, &s, 0);
    /* a peer that makes us log 1000 times within a second gets a burst */
    for (int i = 0; i < 1000; i++)
        bex__log_at(&site, &lg, BEX_LOG_WARN, "refused %d", i);
    CHECK_EQ(s.n, BEX__LOG_BURST);
    CHECK_EQ(site.dropped, 1000 - BEX__LOG_BURST);
    /* the next window says how many were dropped, then the line itself */
    site.window_ms -= 1000;
    bex__log_at(&site, &lg, BEX_LOG_WARN, "after");
    CHECK_EQ(s.notes, 1);
    CHECK_EQ(s.n, BEX__LOG_BURST + 2);
    CHECK(strcmp(s.last, "after") == 0);
    CHECK_EQ(site.dropped, 0);
    bex__log_fini(&lg);
    return 0;
}

/* A logger's window (bex_ctx_config.log_window_ms) replaces the second:
 * a site that used up its burst passes lines again once that window has
 * passed, long before a second has. 0 restores the default. */
static int window(void)
{
    struct seen s = {0};
    struct bex__log lg;
    struct bex__log_site site = {0};
    bex__log_init(&lg, hook, &s, 0);
    CHECK_EQ(lg.window_ms, BEX__LOG_WINDOW_MS);
    bex__log_set_window(&lg, 50);
    CHECK_EQ(lg.window_ms, 50);
    for (int i = 0; i < 1000; i++)
        bex__log_at(&site, &lg, BEX_LOG_WARN, "refused %d", i);
    CHECK(s.n < 1000);  /* some were suppressed */
    usleep(150 * 1000); /* three windows, far less than the default's second */
    int before = s.n;
    bex__log_at(&site, &lg, BEX_LOG_WARN, "after");
    CHECK(s.n > before);
    CHECK(strcmp(s.last, "after") == 0);
    bex__log_set_window(&lg, 0);
    CHECK_EQ(lg.window_ms, BEX__LOG_WINDOW_MS);
    bex__log_fini(&lg);
    return 0;
}

/* A flood from one call site drops nothing of another: the limit is per
 * site (the bex__log macro gives each its own). */
static int per_site(void)
{
    struct seen s = {0};
    struct bex__log lg;
    bex__log_init(&lg, hook, &s, 0);
    for (int i = 0; i < 1000; i++)
        bex__log(&lg, BEX_LOG_WARN, "flood %d", i); /* one site */
    CHECK_EQ(s.n, BEX__LOG_BURST);
    bex__log(&lg, BEX_LOG_ERROR, "our own fault"); /* another site, same second */
    CHECK_EQ(s.n, BEX__LOG_BURST + 1);
    CHECK_EQ(s.last_level, BEX_LOG_ERROR);
    CHECK(strcmp(s.last, "our own fault") == 0);
    bex__log_fini(&lg);
    return 0;
}

/* Lines to stderr carry a UTC timestamp, the level and the context. */
static int stderr_format(void)
{
    struct bex__log lg;
    bex__log_init(&lg, NULL, NULL, 0);
    char buf[256];
    bex__log_format(buf, sizeof buf, &lg, BEX_LOG_WARN, "hello");
    /* 2026-12-05T00:12:03.123Z bex WARN hello */
    CHECK(strlen(buf) == 24 + strlen(" bex WARN hello"));
    CHECK(buf[4] == '-' && buf[10] == 'T' && buf[19] == '.' && buf[23] == 'Z');
    CHECK(strcmp(buf + 24, " bex WARN hello") == 0);
    bex__log_set_name(&lg, "ctx 10.0.0.1");
    bex__log_format(buf, sizeof buf, &lg, BEX_LOG_ERROR, "gone");
    CHECK(strcmp(buf + 24, " bex ERROR [ctx 10.0.0.1] gone") == 0);
    /* and that is what reaches stderr */
    FILE *tmp = tmpfile();
    CHECK(tmp != NULL);
    fflush(stderr);
    int saved = dup(2);
    dup2(fileno(tmp), 2);
    bex__log(&lg, BEX_LOG_WARN, "to stderr %d", 3);
    fflush(stderr);
    dup2(saved, 2);
    rewind(tmp);
    char got[256] = {0};
    CHECK(fgets(got, sizeof got, tmp) != NULL);
    CHECK(strcmp(got + 24, " bex WARN [ctx 10.0.0.1] to stderr 3\n") == 0);
    fclose(tmp);
    bex__log_fini(&lg);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(levels), BEX_CASE(rate_limit), BEX_CASE(per_site), BEX_CASE(window),
              BEX_CASE(stderr_format))
