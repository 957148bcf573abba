/* SPDX-License-Identifier: Apache-2.0 */
/* bex-allocbench: bemalloc against general-purpose allocators, the paper's
 * Figure 4 (operation rate and peak memory vs threads, large and small
 * allocations, ~10 % cross-thread frees).
 *
 * Every (allocator, workload, threads) cell runs in a fresh child process,
 * one driver executable per allocator (bex-allocbench-<name>, next to this
 * program), so no allocator interposes on another and peak RSS is the
 * child's own. The child reports operations and its CPU time over the
 * measured phase; peak RSS is the child's ru_maxrss from wait4().
 *
 * Each cell does a fixed amount of work (operations), the same for every
 * allocator, so peak RSS compares like with like; --scale multiplies it.
 * --repeat runs every cell several times (interleaved with the others) and
 * keeps the best rate and the largest peak RSS.
 *
 * usage: bex-allocbench [--json] [--allocators=a,b] [--workloads=large,small]
 *                       [--threads=1,2,4,8] [--scale=F] [--repeat=N]
 * --json prints one JSON object per cell on stdout (the table then goes to
 * stderr). */
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_LIST 16

static const char *all_allocators[] = {"bemalloc", "bemalloc-mlock", "glibc",
                                       "jemalloc", "tcmalloc",       "mimalloc"};
static const char *all_workloads[] = {"large", "small"};
static const int all_threads[] = {1, 2, 4, 8};

/* Operations per cell at --scale=1: enough for a second or more of CPU
 * for the fast allocators, a few seconds for the slowest. */
#define OPS_LARGE 6e6
#define OPS_SMALL 40e6

struct result {
    const char *alloc, *workload;
    int threads;
    int ok;
    double ops_per_cpu; /* best over repeats */
    long long peak_rss; /* largest over repeats */
};

static char dir[PATH_MAX];

static int split(char *s, const char **out)
{
    int n = 0;
    for (char *tok = strtok(s, ","); tok && n < MAX_LIST; tok = strtok(NULL, ","))
        out[n++] = tok;
    return n;
}

/* Run one cell; 0 on success. */
static int run_cell(struct result *r, double scale)
{
    char exe[PATH_MAX + 64], th[16], ops[32];
    const char *drv = strncmp(r->alloc, "bemalloc", 8) == 0 ? "bemalloc" : r->alloc;
    snprintf(exe, sizeof exe, "%s/bex-allocbench-%s", dir, drv);
    if (access(exe, X_OK) != 0) {
        fprintf(stderr, "%s: no driver %s (not built?)\n", r->alloc, exe);
        return -1;
    }
    snprintf(th, sizeof th, "%d", r->threads);
    snprintf(ops, sizeof ops, "%.0f",
             scale * (strcmp(r->workload, "large") == 0 ? OPS_LARGE : OPS_SMALL));
    int fd[2];
    if (pipe(fd) != 0)
        return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        dup2(fd[1], STDOUT_FILENO);
        close(fd[0]);
        close(fd[1]);
        execl(exe, exe, r->alloc, r->workload, th, ops, (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    char buf[1024];
    size_t len = 0;
    ssize_t k;
    while (len < sizeof buf - 1 && (k = read(fd[0], buf + len, sizeof buf - 1 - len)) != 0) {
        if (k < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        len += (size_t)k;
    }
    buf[len] = 0;
    close(fd[0]);
    int status;
    struct rusage ru;
    while (wait4(pid, &status, 0, &ru) < 0 && errno == EINTR)
        ;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "%s %s %d: driver failed (status %d)\n", r->alloc, r->workload, r->threads,
                status);
        return -1;
    }
    unsigned long long nops;
    double cpu, wall;
    char served[512];
    if (sscanf(buf, "ops=%llu cpu=%lf wall=%lf served_by=%511s", &nops, &cpu, &wall, served) != 4 ||
        cpu <= 0) {
        fprintf(stderr, "%s: unparsable driver output: %s\n", r->alloc, buf);
        return -1;
    }
    double rate = (double)nops / cpu;
    long long rss = (long long)ru.ru_maxrss * 1024;
    if (rate > r->ops_per_cpu)
        r->ops_per_cpu = rate;
    if (rss > r->peak_rss)
        r->peak_rss = rss;
    r->ok = 1;
    fprintf(
        stderr,
        "  %-15s %-6s %d thr: %6.2f M ops/CPU-s (%.2f CPU-s), peak RSS %7.1f MiB (malloc: %s)\n",
        r->alloc, r->workload, r->threads, rate / 1e6, cpu, (double)rss / 1048576.0, served);
    return 0;
}

static void usage(FILE *f, const char *argv0)
{
    fprintf(f,
            "usage: %s [--json] [--allocators=LIST] [--workloads=LIST] [--threads=LIST]\n"
            "          [--scale=F] [--repeat=N]\n"
            "  allocators: bemalloc,bemalloc-mlock,glibc,jemalloc,tcmalloc,mimalloc\n"
            "  workloads:  large (64 KB-1 MB exponential), small (16 B-16 KB uniform)\n"
            "  --scale:    work per cell, x %.0fM ops (large) / %.0fM ops (small)\n"
            "  defaults:   all allocators and workloads, threads 1,2,4,8, scale 1, repeat 3\n",
            argv0, OPS_LARGE / 1e6, OPS_SMALL / 1e6);
}

int main(int argc, char **argv)
{
    int json = 0, repeat = 3;
    double scale = 1.0;
    const char *allocs[MAX_LIST], *workloads[MAX_LIST];
    int threads[MAX_LIST];
    int na = 6, nw = 2, nt = 4;
    memcpy(allocs, all_allocators, sizeof all_allocators);
    memcpy(workloads, all_workloads, sizeof all_workloads);
    memcpy(threads, all_threads, sizeof all_threads);

    for (int i = 1; i < argc; i++) {
        char *a = argv[i];
        if (strcmp(a, "--json") == 0) {
            json = 1;
        } else if (strncmp(a, "--allocators=", 13) == 0) {
            na = split(a + 13, allocs);
        } else if (strncmp(a, "--workloads=", 12) == 0) {
            nw = split(a + 12, workloads);
        } else if (strncmp(a, "--threads=", 10) == 0) {
            const char *t[MAX_LIST];
            nt = split(a + 10, t);
            for (int k = 0; k < nt; k++)
                threads[k] = atoi(t[k]);
        } else if (strncmp(a, "--scale=", 8) == 0) {
            scale = atof(a + 8);
        } else if (strncmp(a, "--repeat=", 9) == 0) {
            repeat = atoi(a + 9);
        } else if (strcmp(a, "--version") == 0) {
            printf("bex-allocbench %s\n", BEX_ALLOCBENCH_VERSION);
            return 0;
        } else if (strcmp(a, "--help") == 0) {
            usage(stdout, argv[0]);
            return 0;
        } else {
            fprintf(stderr, "bex-allocbench: unknown option %s\n", a);
            usage(stderr, argv[0]);
            return 2;
        }
    }
    if (na == 0 || nw == 0 || nt == 0 || scale <= 0 || repeat < 1) {
        usage(stderr, argv[0]);
        return 2;
    }
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return 2;
    self[n] = 0;
    snprintf(dir, sizeof dir, "%s", dirname(self));

    struct result *res = calloc((size_t)(na * nw * nt), sizeof(*res));
    int failed = 0, k = 0;
    for (int w = 0; w < nw; w++)
        for (int t = 0; t < nt; t++)
            for (int a = 0; a < na; a++, k++)
                res[k] = (struct result){allocs[a], workloads[w], threads[t], 0, 0, 0};
    /* Allocators innermost and repeats outermost: drift of the machine
     * hits them all alike. */
    for (int rep = 0; rep < repeat; rep++) {
        fprintf(stderr, "round %d of %d\n", rep + 1, repeat);
        for (int i = 0; i < k; i++)
            if (run_cell(&res[i], scale) != 0)
                failed++;
    }
    if (json) {
        for (int i = 0; i < k; i++) {
            const struct result *r = &res[i];
            if (r->ok)
                printf("{\"allocator\":\"%s\",\"workload\":\"%s\",\"threads\":%d,"
                       "\"ops_per_cpu_sec\":%.0f,\"peak_rss_bytes\":%lld}\n",
                       r->alloc, r->workload, r->threads, r->ops_per_cpu, r->peak_rss);
        }
        fflush(stdout);
    }

    FILE *out = json ? stderr : stdout;
    fprintf(out, "\n%-16s %-6s %7s %16s %14s\n", "allocator", "load", "threads", "M ops/CPU-s",
            "peak RSS MiB");
    for (int i = 0; i < k; i++)
        if (res[i].ok)
            fprintf(out, "%-16s %-6s %7d %16.2f %14.1f\n", res[i].alloc, res[i].workload,
                    res[i].threads, res[i].ops_per_cpu / 1e6, (double)res[i].peak_rss / 1048576.0);
    /* bemalloc against the best of the general-purpose allocators. */
    fprintf(out, "\n%-6s %7s %22s %22s\n", "load", "threads", "bemalloc/best ops",
            "bemalloc/lowest RSS");
    for (int w = 0; w < nw; w++) {
        for (int t = 0; t < nt; t++) {
            const struct result *be = NULL;
            double best = 0, low = 0;
            for (int i = 0; i < k; i++) {
                const struct result *r = &res[i];
                if (!r->ok || r->workload != workloads[w] || r->threads != threads[t])
                    continue;
                if (strcmp(r->alloc, "bemalloc") == 0) {
                    be = r;
                } else if (strncmp(r->alloc, "bemalloc", 8) != 0) {
                    if (r->ops_per_cpu > best)
                        best = r->ops_per_cpu;
                    if (low == 0 || (double)r->peak_rss < low)
                        low = (double)r->peak_rss;
                }
            }
            if (be && best > 0)
                fprintf(out, "%-6s %7d %22.2f %22.2f\n", workloads[w], threads[t],
                        be->ops_per_cpu / best, (double)be->peak_rss / low);
        }
    }
    free(res);
    return failed ? 1 : 0;
}
