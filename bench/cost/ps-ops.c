/* SPDX-License-Identifier: Apache-2.0 */
/* ps-ops: N synchronous Fetches or Pushes of a parameter-server client,
 * one after another from the calling thread, for bench/cost/ps-futex (what
 * a synchronous operation costs in thread hand-offs, issue 25 item 3).
 *   ps-ops CLUSTER_FILE N fetch|push|fetch_into|push_from [KEYS (16)] [DIM (8)] [TABLE (1)]
 * (fetch_into, push_from: on an array of bex_ps_rows_alloc, issue 28 item 2)
 * The context polls in event mode over TCP from 127.0.0.1 (PS_OPS_LOCAL:
 * another address; BEX_* environment overrides apply); exits 1 on the
 * first failed operation. With PS_OPS_SHARDS=S it prints to stdout how
 * many of S shards each operation's keys touch (its sub-requests), for
 * bench/cost/ps-fanout. With PS_OPS_METRICS=FILE it writes the context's
 * counters (bex_ctx_prometheus) to FILE after the last operation, while
 * the connections are still up (ps-fanout's counters: frames,
 * acknowledgement-only frames and loop waits without a tool that slows
 * the process). */
#include <arpa/inet.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bex/dir.h"
#include "bex/ps.h"
#include "bex/sock.h"

static int fail(const char *what, int rc)
{
    fprintf(stderr, "ps-ops: %s: %s\n", what, bex_strerror(rc));
    return 1;
}

/* PS_OPS_SHARDS=S: the shards of S the keys touch, one line on stdout */
static void print_touched(const uint64_t *k, uint32_t keys)
{
    const char *e = getenv("PS_OPS_SHARDS");
    uint32_t ns = e ? (uint32_t)atoi(e) : 0, touched = 0;
    if (!ns || ns > 1024)
        return;
    unsigned char seen[1024] = {0};
    for (uint32_t i = 0; i < keys; i++) {
        uint32_t s = bex_ps_key_shard(k[i], ns);
        touched += !seen[s];
        seen[s] = 1;
    }
    printf("shards touched %u of %u\n", touched, ns);
}

enum op { OP_FETCH, OP_PUSH, OP_FETCH_INTO, OP_PUSH_FROM };
static const char *const op_names[] = {"fetch", "push", "fetch_into", "push_from"};

static int op_of(const char *s)
{
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, op_names[i]))
            return i;
    return -1;
}

static int one(bex_ps_client *c, int op, uint32_t table, uint32_t dim, const uint64_t *k,
               uint32_t keys, float *rows)
{
    switch (op) {
    case OP_PUSH:
        return bex_ps_push_sync(c, table, dim, k, keys, rows);
    case OP_FETCH_INTO:
        return bex_ps_fetch_into_sync(c, table, dim, k, keys, rows);
    case OP_PUSH_FROM:
        return bex_ps_push_from_sync(c, table, dim, k, keys, rows, NULL, 0, NULL);
    default:
        return bex_ps_fetch_sync(c, table, dim, k, keys, rows);
    }
}

static int run(bex_ctx *ctx, bex_ps_client *c, long n, int op, uint32_t keys, uint32_t dim,
               uint32_t table)
{
    bool mem = op == OP_FETCH_INTO || op == OP_PUSH_FROM;
    uint64_t *k = calloc(keys, sizeof(*k));
    float *rows = mem ? bex_ps_rows_alloc(ctx, keys, dim) : calloc((size_t)keys * dim, 4);
    if (!k || !rows)
        return fail("alloc", -12);
    for (uint32_t i = 0; i < keys; i++)
        k[i] = i * 7919u + 1;
    print_touched(k, keys);
    for (size_t i = 0; i < (size_t)keys * dim; i++)
        rows[i] = 0.001f;
    for (long i = 0; i < n; i++) {
        int rc = one(c, op, table, dim, k, keys, rows);
        if (rc)
            return fail(op_names[op], rc);
    }
    free(k);
    if (mem)
        bex_ps_rows_free(rows);
    else
        free(rows);
    return 0;
}

/* The context's Prometheus text into path; 0, or 1 after a message. */
static int write_metrics(bex_ctx *ctx, const char *path)
{
    static char text[1 << 16];
    int n = bex_ctx_prometheus(ctx, text, sizeof text);
    FILE *f = fopen(path, "w");
    if (n < 0 || (size_t)n >= sizeof text || !f || fputs(text, f) < 0 || fclose(f)) {
        fprintf(stderr, "ps-ops: PS_OPS_METRICS %s: cannot write\n", path);
        return 1;
    }
    return 0;
}

#define PS_OPS_USAGE                                                                               \
    "usage: bex-ps-ops CLUSTER_FILE N fetch|push|fetch_into|push_from [KEYS] [DIM] [TABLE]\n"

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--help"))
        return printf(PS_OPS_USAGE), 0;
    if (argc == 2 && !strcmp(argv[1], "--version"))
        return printf("bex-ps-ops %s\n", bex_version_string()), 0;
    if (argc < 4 || op_of(argv[3]) < 0) {
        fprintf(stderr, PS_OPS_USAGE);
        return 2;
    }
    long n = atol(argv[2]);
    uint32_t keys = argc > 4 ? (uint32_t)atoi(argv[4]) : 16;
    uint32_t dim = argc > 5 ? (uint32_t)atoi(argv[5]) : 8;
    uint32_t table = argc > 6 ? (uint32_t)atoi(argv[6]) : 1;
    bex_ctx_config cc = BEX_CTX_CONFIG_INIT;
    cc.transport = BEX_TRANSPORT_TCP;
    cc.poll_mode = BEX_POLL_EVENT;
    if (bex_addr_parse(getenv("PS_OPS_LOCAL") ? getenv("PS_OPS_LOCAL") : "127.0.0.1", 0,
                       &cc.local_addr)) {
        fprintf(stderr, "ps-ops: PS_OPS_LOCAL: not an IP address\n");
        return 2;
    }
    bex_ctx *ctx;
    int rc = bex_ctx_create(&cc, &ctx);
    if (rc)
        return fail("context", rc);
    bex_dir *dir;
    char err[256] = "";
    if ((rc = bex_dir_create(NULL, &dir)) ||
        (rc = bex_dir_load_file(dir, argv[1], err, sizeof err)))
        return fail(err[0] ? err : "directory", rc);
    bex_ps_client_config pc = BEX_PS_CLIENT_CONFIG_INIT;
    pc.dir = dir;
    /* under valgrind a first call waits for a slow start: room for it */
    pc.timeout_ms = 30000;
    pc.connect_timeout_ms = 30000;
    bex_ps_client *c;
    if ((rc = bex_ps_client_create(ctx, &pc, &c)))
        return fail("client", rc);
    int ret = run(ctx, c, n, op_of(argv[3]), keys, dim, table);
    if (!ret && getenv("PS_OPS_METRICS"))
        ret = write_metrics(ctx, getenv("PS_OPS_METRICS"));
    bex_ps_client_destroy(c);
    bex_dir_destroy(dir);
    bex_ctx_destroy(ctx);
    return ret;
}
