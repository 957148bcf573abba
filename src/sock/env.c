/* SPDX-License-Identifier: Apache-2.0 */
/* Environment overrides of a context's configuration (env.h). One table:
 * the variable, the field, how its value is read. */
#include "sock/env.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/util.h"

struct env_var {
    const char *name;
    size_t off; /* of a uint32_t or int field of bex_ctx_config */
    int (*parse)(const struct env_var *v, const char *s, uint32_t *out);
    uint32_t min, max; /* numbers */
    const char *what;  /* what the value may be, for the error */
};

static int parse_num(const struct env_var *v, const char *s, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long n = strtoul(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || n < v->min || n > v->max)
        return -EINVAL;
    *out = (uint32_t)n;
    return 0;
}

static int parse_level(const struct env_var *v, const char *s, uint32_t *out)
{
    static const char *const names[] = {"error", "warn", "info", "debug"};
    for (size_t i = 0; i < ARRAY_SIZE(names); i++)
        if (strcasecmp(s, names[i]) == 0) {
            *out = (uint32_t)(BEX_LOG_ERROR + i);
            return 0;
        }
    return parse_num(v, s, out);
}

static int parse_transport(const struct env_var *v, const char *s, uint32_t *out)
{
    (void)v;
    static const struct {
        const char *name;
        uint32_t t;
    } names[] = {
        {"auto", BEX_TRANSPORT_AUTO}, {"rdma", BEX_TRANSPORT_RDMA}, {"tcp", BEX_TRANSPORT_TCP}};
    for (size_t i = 0; i < ARRAY_SIZE(names); i++)
        if (strcasecmp(s, names[i].name) == 0) {
            *out = names[i].t;
            return 0;
        }
    return -EINVAL;
}

static int parse_wmode(const struct env_var *v, const char *s, uint32_t *out)
{
    (void)v;
    if (strcasecmp(s, "static") == 0 || strcasecmp(s, "adaptive") == 0) {
        *out = strcasecmp(s, "static") == 0 ? BEX_WINDOW_STATIC : BEX_WINDOW_ADAPTIVE;
        return 0;
    }
    return -EINVAL;
}

static int parse_poll(const struct env_var *v, const char *s, uint32_t *out)
{
    (void)v;
    return bex_poll_mode_parse(s, out);
}

#define FIELD(f) offsetof(bex_ctx_config, f)
static const struct env_var vars[] = {
    {"BEX_LOG_LEVEL", FIELD(log_level), parse_level, 1, 4, "error, warn, info, debug or 1-4"},
    {"BEX_TRANSPORT", FIELD(transport), parse_transport, 0, 0, "auto, rdma or tcp"},
    {"BEX_IO_THREADS", FIELD(io_threads), parse_num, 1, 64, "1-64"},
    {"BEX_POLL_MODE", FIELD(poll_mode), parse_poll, 0, 0, "spin-sleep, busy or event"},
    {"BEX_KEEPALIVE_MS", FIELD(keepalive_ms), parse_num, 1, 3600000, "1-3600000"},
    {"BEX_KEEPALIVE_TIMEOUT_MS", FIELD(keepalive_timeout_ms), parse_num, 1, 86400000, "1-86400000"},
    {"BEX_CONNECT_TIMEOUT_MS", FIELD(connect_timeout_ms), parse_num, 1, 86400000, "1-86400000"},
    {"BEX_SRQ_DEPTH", FIELD(srq_depth), parse_num, 0, 32768, "0 (off) or rq_depth-32768"},
    {"BEX_SEND_WINDOW_MODE", FIELD(send_window_mode), parse_wmode, 0, 0, "static or adaptive"},
    {"BEX_SEND_WINDOW_MIN", FIELD(send_window_min), parse_num, 256, UINT32_MAX, "256 or more"},
    {"BEX_SEND_WINDOW_MAX", FIELD(send_window_max), parse_num, 256, UINT32_MAX, "256 or more"},
    {"BEX_SEND_WINDOW_TARGET_US", FIELD(send_window_target_us), parse_num, 1, 10000000,
     "1-10000000"},
    {"BEX_SEND_WINDOW_BASE_MAX_US", FIELD(send_window_base_max_us), parse_num, 1, 10000000,
     "1-10000000"},
    {"BEX_SEND_WINDOW_BASE_EPOCH_MS", FIELD(send_window_base_epoch_ms), parse_num, 1, 3600000,
     "1-3600000"},
    {"BEX_SEND_WINDOW_DEST", FIELD(send_window_dest), parse_num, 1, UINT32_MAX,
     "bytes (4294967295: none)"},
    {"BEX_TCP_ACK_DELAY_US", FIELD(tcp_ack_delay_us), parse_num, 1, 1000000, "1-1000000"},
    {"BEX_LOG_WINDOW_MS", FIELD(log_window_ms), parse_num, 1, 3600000, "1-3600000"},
    {"BEX_RECV_MIN_RATE", FIELD(recv_min_rate), parse_num, 1, UINT32_MAX,
     "bytes a second, 1 or more"},
    {"BEX_RECV_RATE_MS", FIELD(recv_rate_ms), parse_num, 1, 86400000, "1-86400000"},
};
#undef FIELD

int bex__ctx_env(bex_ctx_config *cfg, char *why, size_t cap, unsigned *applied)
{
    uint32_t val[ARRAY_SIZE(vars)];
    bool set[ARRAY_SIZE(vars)];
    unsigned n = 0;
    for (size_t i = 0; i < ARRAY_SIZE(vars); i++) { /* all read before any applies */
        const char *s = getenv(vars[i].name);
        set[i] = s != NULL;
        if (!s)
            continue;
        if (vars[i].parse(&vars[i], s, &val[i]) != 0) {
            snprintf(why, cap, "environment variable %s='%s': not %s", vars[i].name, s,
                     vars[i].what);
            return -EINVAL;
        }
        n++;
    }
    for (size_t i = 0; i < ARRAY_SIZE(vars); i++) {
        if (!set[i])
            continue;
        void *field = (char *)cfg + vars[i].off;
        if (vars[i].off == offsetof(bex_ctx_config, log_level))
            *(int *)field = (int)val[i];
        else
            *(uint32_t *)field = val[i];
    }
    if (applied)
        *applied = n;
    return 0;
}

int bex_env_check(char *why, size_t cap)
{
    bex_ctx_config scratch = {0};
    char buf[256];
    int rc = bex__ctx_env(&scratch, buf, sizeof buf, NULL);
    if (why && cap)
        snprintf(why, cap, "%s", rc ? buf : "");
    return rc;
}
