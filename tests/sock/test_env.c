/* SPDX-License-Identifier: Apache-2.0 */
/* Environment overrides of a context's configuration (src/sock/env.c). */
#include <arpa/inet.h>
#include <stdlib.h>

#include "harness.h"
#include "sock/env.h"

static void clear(void)
{
    static const char *const names[] = {
        "BEX_LOG_LEVEL",          "BEX_TRANSPORT",    "BEX_IO_THREADS",
        "BEX_POLL_MODE",          "BEX_KEEPALIVE_MS", "BEX_KEEPALIVE_TIMEOUT_MS",
        "BEX_CONNECT_TIMEOUT_MS", "BEX_SRQ_DEPTH",    "BEX_LOG_WINDOW_MS",
        "BEX_RECV_MIN_RATE",      "BEX_RECV_RATE_MS"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        unsetenv(names[i]);
}

/* Each variable lands in its field, and wins over what the program set. */
static int applies(void)
{
    clear();
    bex_ctx_config cfg = {.io_threads = 2, .transport = BEX_TRANSPORT_RDMA};
    char why[256] = "";
    unsigned n = 99;
    CHECK_OK(bex__ctx_env(&cfg, why, sizeof why, &n));
    CHECK_EQ(n, 0);
    CHECK_EQ(cfg.io_threads, 2);
    setenv("BEX_LOG_LEVEL", "debug", 1);
    setenv("BEX_TRANSPORT", "tcp", 1);
    setenv("BEX_IO_THREADS", "4", 1);
    setenv("BEX_POLL_MODE", "event", 1);
    setenv("BEX_KEEPALIVE_MS", "250", 1);
    CHECK_OK(bex__ctx_env(&cfg, why, sizeof why, &n));
    CHECK_EQ(n, 5);
    CHECK_EQ(cfg.log_level, BEX_LOG_DEBUG);
    CHECK_EQ(cfg.transport, BEX_TRANSPORT_TCP);
    CHECK_EQ(cfg.io_threads, 4);
    CHECK_EQ(cfg.poll_mode, BEX_POLL_EVENT);
    CHECK_EQ(cfg.keepalive_ms, 250);
    setenv("BEX_LOG_LEVEL", "2", 1);
    CHECK_OK(bex__ctx_env(&cfg, why, sizeof why, NULL));
    CHECK_EQ(cfg.log_level, BEX_LOG_WARN);
    setenv("BEX_LOG_WINDOW_MS", "200", 1);
    CHECK_OK(bex__ctx_env(&cfg, why, sizeof why, NULL));
    CHECK_EQ(cfg.log_window_ms, 200);
    clear();
    return 0;
}

/* A bad value is an error that names the variable, and changes nothing,
 * not even the good variables read beside it. */
static int bad_values(void)
{
    static const struct {
        const char *name, *value;
    } bad[] = {
        {"BEX_IO_THREADS", "0"},         {"BEX_IO_THREADS", "65"},   {"BEX_IO_THREADS", "two"},
        {"BEX_IO_THREADS", "-1"},        {"BEX_IO_THREADS", "4x"},   {"BEX_TRANSPORT", "ib"},
        {"BEX_POLL_MODE", "sleepy"},     {"BEX_LOG_LEVEL", "9"},     {"BEX_LOG_LEVEL", ""},
        {"BEX_KEEPALIVE_MS", "1e3"},     {"BEX_SRQ_DEPTH", "99999"}, {"BEX_LOG_WINDOW_MS", "0"},
        {"BEX_LOG_WINDOW_MS", "3600001"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        clear();
        setenv("BEX_TRANSPORT", "tcp", 1); /* a good one beside */
        setenv(bad[i].name, bad[i].value, 1);
        if (strcmp(bad[i].name, "BEX_TRANSPORT") == 0)
            setenv("BEX_IO_THREADS", "3", 1);
        bex_ctx_config cfg = {.io_threads = 2}, before = cfg;
        char why[256] = "";
        CHECK_EQ(bex__ctx_env(&cfg, why, sizeof why, NULL), -EINVAL);
        CHECK(memcmp(&cfg, &before, sizeof cfg) == 0);
        CHECK(strstr(why, bad[i].name) != NULL);
        CHECK(strstr(why, bad[i].value) != NULL);
    }
    clear();
    return 0;
}

/* The receive-rate floor a peer must keep (recv_min_rate, recv_rate_ms)
 * can be lowered from outside: a bench or a deployment whose bottleneck
 * gives each sender less than 1 MiB/s must not have its honest, slow
 * senders failed as stalled ones. Zero is refused (zero is the default
 * in the struct, not a setting). */
static int recv_rate(void)
{
    clear();
    bex_ctx_config cfg = {.recv_min_rate = 1000};
    char why[256] = "";
    setenv("BEX_RECV_MIN_RATE", "4096", 1);
    setenv("BEX_RECV_RATE_MS", "60000", 1);
    unsigned n = 0;
    CHECK_OK(bex__ctx_env(&cfg, why, sizeof why, &n));
    CHECK_EQ(n, 2);
    CHECK_EQ(cfg.recv_min_rate, 4096);
    CHECK_EQ(cfg.recv_rate_ms, 60000);
    setenv("BEX_RECV_RATE_MS", "0", 1);
    CHECK_EQ(bex__ctx_env(&cfg, why, sizeof why, NULL), -EINVAL);
    CHECK(strstr(why, "BEX_RECV_RATE_MS") != NULL);
    setenv("BEX_RECV_RATE_MS", "60000", 1);
    setenv("BEX_RECV_MIN_RATE", "0", 1);
    CHECK_EQ(bex__ctx_env(&cfg, why, sizeof why, NULL), -EINVAL);
    CHECK(strstr(why, "BEX_RECV_MIN_RATE") != NULL);
    clear();
    return 0;
}

static char seen[4][256];
static int n_seen;
static void hook(int level, const char *msg, void *arg)
{
    (void)level;
    (void)arg;
    if (n_seen < 4)
        snprintf(seen[n_seen++], sizeof seen[0], "%s", msg);
}

/* bex_ctx_create reads the environment: a bad value fails it with a line
 * naming the variable; a good one is applied (BEX_LOG_LEVEL=info lets the
 * line that counts the overrides through). */
static int ctx_create(void)
{
    clear();
    bex_ctx_config cfg = {.transport = BEX_TRANSPORT_TCP, .log_fn = hook};
    bex_addr_parse("127.0.0.1", 0, &cfg.local_addr);
    setenv("BEX_IO_THREADS", "0", 1);
    bex_ctx *ctx = NULL;
    CHECK_EQ(bex_ctx_create(&cfg, &ctx), -EINVAL);
    CHECK(ctx == NULL);
    CHECK_EQ(n_seen, 1);
    CHECK(strstr(seen[0], "BEX_IO_THREADS='0'") != NULL);
    n_seen = 0;
    setenv("BEX_IO_THREADS", "2", 1);
    setenv("BEX_LOG_LEVEL", "info", 1);
    CHECK_OK(bex_ctx_create(&cfg, &ctx));
    int found = 0;
    for (int i = 0; i < n_seen; i++)
        found |= strstr(seen[i], "2 settings from the environment") != NULL;
    CHECK(found);
    CHECK_OK(bex_ctx_destroy(ctx));
    clear();
    /* a log window longer than an hour is refused, the longest taken */
    cfg.log_window_ms = 3600001;
    CHECK_EQ(bex_ctx_create(&cfg, &ctx), -EINVAL);
    cfg.log_window_ms = 3600000;
    CHECK_OK(bex_ctx_create(&cfg, &ctx));
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(applies), BEX_CASE(bad_values), BEX_CASE(ctx_create), BEX_CASE(recv_rate))
