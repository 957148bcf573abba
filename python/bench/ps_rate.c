/* SPDX-License-Identifier: Apache-2.0 */
/* ps_rate: calls a second of one C client's waiting Fetch or Push
 * (bex_ps_fetch_sync / bex_ps_push_sync) of ROWS rows of DIM floats, for
 * python/bench/run, which runs bex.ps.Client's the same way
 * (ps_rate.py) to compare. fetch0 and push0: on caller memory, without a
 * copy (bex_ps_rows_alloc, bex_ps_fetch_into_sync / bex_ps_push_from_sync).
 *   ps_rate CLUSTER fetch|push|fetch0|push0 ROWS DIM SECONDS
 * prints "calls_per_sec N cpu_us_per_call U user_us V sys_us W" (U: the
 * process's CPU time, its bex I/O thread's included, per call; V and W its
 * user and system parts, by getrusage over the same window). BEX_RATE_CALLS=N: exactly N
 * calls instead of SECONDS (python/bench/counts). */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include <bex/dir.h>
#include <bex/ps.h>
#include <bex/sock.h>

static double clock_s(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double now(void)
{
    return clock_s(CLOCK_MONOTONIC);
}

/* The process's user and system CPU seconds (getrusage: every thread). */
static void cpu_s(double *user, double *sys)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    *user = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6;
    *sys = (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

static int call(bex_ps_client *pc, int push, int zero, const uint64_t *keys, size_t n, uint32_t dim,
                float *rows)
{
    if (zero)
        return push ? bex_ps_push_from_sync(pc, 1, dim, keys, n, rows, NULL, 0, NULL)
                    : bex_ps_fetch_into_sync(pc, 1, dim, keys, n, rows);
    return push ? bex_ps_push_sync(pc, 1, dim, keys, n, rows)
                : bex_ps_fetch_sync(pc, 1, dim, keys, n, rows);
}

static int run(bex_ctx *ctx, bex_ps_client *pc, const char *op, size_t n, uint32_t dim, double secs)
{
    int push = !strncmp(op, "push", 4), zero = op[strlen(op) - 1] == '0';
    uint64_t *keys = malloc(n * sizeof *keys);
    float *rows = zero ? bex_ps_rows_alloc(ctx, (uint32_t)n, dim) : calloc(n * dim, sizeof *rows);
    int rc = keys && rows ? 0 : -ENOMEM;
    for (size_t i = 0; i < n; i++)
        keys[i] = i * 7919u;
    for (size_t i = 0; rc == 0 && i < n * dim; i++)
        rows[i] = 1e-6f;
    long calls = 0, max = getenv("BEX_RATE_CALLS") ? atol(getenv("BEX_RATE_CALLS")) : -1;
    double u0, s0, u1, s1;
    cpu_s(&u0, &s0);
    double t0 = now(), t = t0, cpu0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
    while (rc == 0 && (max >= 0 ? calls < max : t - t0 < secs)) {
        rc = call(pc, push, zero, keys, n, dim, rows);
        calls++;
        if ((calls & 15) == 0)
            t = now();
    }
    t = now();
    double cpu1 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
    cpu_s(&u1, &s1);
    if (rc == 0)
        printf("calls_per_sec %.1f cpu_us_per_call %.2f user_us %.2f sys_us %.2f\n",
               (double)calls / (t - t0), (cpu1 - cpu0) * 1e6 / (double)calls,
               (u1 - u0) * 1e6 / (double)calls, (s1 - s0) * 1e6 / (double)calls);
    free(keys);
    if (zero)
        bex_ps_rows_free(rows);
    else
        free(rows);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: ps_rate CLUSTER fetch|push|fetch0|push0 ROWS DIM SECONDS\n");
        return 2;
    }
    bex_ctx_config cfg = {.transport = BEX_TRANSPORT_TCP};
    cfg.local_addr = bex_addr_loopback4(0);
    bex_dir *dir = NULL;
    bex_ctx *ctx = NULL;
    bex_ps_client *pc = NULL;
    char err[256] = "";
    bex_ps_client_config pcc = {.service = "ps", .timeout_ms = 10000};
    int rc = bex_dir_create(NULL, &dir);
    if (rc == 0 && (rc = bex_dir_load_file(dir, argv[1], err, sizeof err)) == 0 &&
        (rc = bex_ctx_create(&cfg, &ctx)) == 0) {
        pcc.dir = dir;
        if ((rc = bex_ps_client_create(ctx, &pcc, &pc)) == 0)
            rc = run(ctx, pc, argv[2], strtoul(argv[3], NULL, 10),
                     (uint32_t)strtoul(argv[4], NULL, 10), atof(argv[5]));
    }
    if (rc)
        fprintf(stderr, "ps_rate: %s %s\n", bex_strerror(rc), err);
    if (pc)
        bex_ps_client_destroy(pc);
    if (ctx)
        bex_ctx_destroy(ctx);
    bex_dir_destroy(dir);
    return rc ? 1 : 0;
}
