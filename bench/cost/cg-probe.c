/* SPDX-License-Identifier: Apache-2.0 */
/* cg-probe: a known answer for bench/cost/cg-counts, run under callgrind
 * --dump-instr=yes by tests/bench/test_cost.sh. It calls probe_poll, a
 * stand-in for a provider's poll_cq (a lock-free ring, up to 16 entries a
 * call), POLLS times, one entry queued every tenth call, so that
 * POLLS / 10 calls return an entry and the rest find the ring empty; then
 * it sorts 1000 numbers with qsort, as a benchmark sorts its latency
 * samples. cg-counts must find POLLS calls, POLLS / 10 completions, and
 * the sort's inclusive instructions.   usage: cg-probe POLLS */
#include <stdlib.h>

static volatile int ring[64];
static volatile unsigned head, tail;
static volatile int batch = 16; /* (not a constant: no clone of probe_poll) */

static __attribute__((noinline)) int probe_poll(int ne, int *out)
{
    int n = 0;
    while (n < ne && head != tail) {
        out[n++] = ring[head & 63];
        head++;
    }
    return n;
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    long polls = atol(argv[1]), done = 0;
    int out[16], *s = malloc(sizeof(int) * 1000);
    if (!s)
        return 1;
    for (long i = 0; i < polls; i++) {
        if (i % 10 == 0) {
            ring[tail & 63] = (int)i;
            tail++;
        }
        done += probe_poll(batch, out);
    }
    for (int i = 0; i < 1000; i++)
        s[i] = (i * 7919) % 1000;
    qsort(s, 1000, sizeof(int), cmp_int);
    free(s);
    return done == (polls + 9) / 10 ? 0 : 1;
}
