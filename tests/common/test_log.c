/* The log hook: level filter, rate limit, the "suppressed" note. */
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
    bex__log_init(&lg, hook, &s, 0);
    /* a peer that makes us log 1000 times within a second gets a burst */
    for (int i = 0; i < 1000; i++)
        bex__log(&lg, BEX_LOG_WARN, "refused %d", i);
    CHECK_EQ(s.n, BEX__LOG_BURST);
    CHECK_EQ(lg.dropped, 1000 - BEX__LOG_BURST);
    /* the next window says how many were dropped, then the line itself */
    lg.window_ms -= 1000;
    bex__log(&lg, BEX_LOG_WARN, "after");
    CHECK_EQ(s.notes, 1);
    CHECK_EQ(s.n, BEX__LOG_BURST + 2);
    CHECK(strcmp(s.last, "after") == 0);
    CHECK_EQ(lg.dropped, 0);
    bex__log_fini(&lg);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(levels), BEX_CASE(rate_limit))
