/* SPDX-License-Identifier: Apache-2.0 */
/* A context of transport auto without a usable RDMA device for its address
 * falls back to TCP with a WARN that says why (issue 27 item 5): on
 * 127.0.0.1, which no RDMA device has (natively: no device at all; in the
 * VM: rxe0/rxe1 have other addresses), exactly one WARN line, "no usable
 * RDMA device for 127.0.0.1", then the reason (the host has no device, or
 * what each port has instead), ending ": TCP only". Before, the line was
 * INFO, below the default level, and gave only an errno's text. */
#include <arpa/inet.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "bex/sock.h"

static struct {
    int warns, others;
    char line[1024];
} lg;

static void keep(int level, const char *msg, void *arg)
{
    (void)arg;
    fprintf(stderr, "bex[%d]: %s\n", level, msg);
    if (level == BEX_LOG_WARN && strstr(msg, "RDMA device")) {
        lg.warns++;
        snprintf(lg.line, sizeof lg.line, "%s", msg);
    } else if (level <= BEX_LOG_WARN) {
        lg.others++;
    }
}

static int warn(void)
{
    bex_ctx_config c = {.transport = BEX_TRANSPORT_AUTO, .log_fn = keep};
    bex_addr_parse("127.0.0.1", 0, &c.local_addr);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    CHECK(bex_ctx_pd(ctx) == NULL);
    CHECK_EQ(lg.warns, 1);
    CHECK_EQ(lg.others, 0);
    CHECK(strncmp(lg.line, "no usable RDMA device for 127.0.0.1", 35) == 0);
    CHECK(strstr(lg.line, "this host has no RDMA device") || strstr(lg.line, " port "));
    size_t n = strlen(lg.line);
    CHECK(n > 10 && strcmp(lg.line + n - 10, ": TCP only") == 0);
    CHECK_OK(bex_ctx_destroy(ctx));
    /* transport rdma: refused, as before (no fallback to announce) */
    c.transport = BEX_TRANSPORT_RDMA;
    CHECK_EQ(bex_ctx_create(&c, &ctx), -ENODEV);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(warn))
