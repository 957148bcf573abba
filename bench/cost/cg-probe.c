/* SPDX-License-Identifier: Apache-2.0 */
/* cg-probe: a known answer for bench/cost/cg-counts, run under callgrind
 * --dump-instr=yes by tests/bench/test_cost.sh. It calls probe_poll, a
 * stand-in for a provider's poll_cq (a lock-free ring, up to 16 entries a
 * call), POLLS times, one entry queued every tenth call, so that
 * POLLS / 10 calls return an entry and the rest find the ring empty; then
 * it sorts 1000 numbers with qsort, as a benchmark sorts its latency
 * samples. cg-counts must find POLLS calls, POLLS / 10 completions, and
 * the sort's inclusive instructions. Before all that it calibrates a clock
 * as perftest does (probe_calibrate: 400 gettimeofday calls, their
 * regression), and main reads gettimeofday once itself: cg-counts must
 * find probe_calibrate's inclusive instructions as the calibration, and
 * not main's.   usage: cg-probe POLLS
 * With three arguments (cg-probe MESSAGES WAIT_A WAIT_B) it waits as
 * ib_send_lat's busy ping-pong does, in two loops of different cost
 * around the same poll function: each message is a receive, waited for
 * in loop B (its own instructions about four times loop A's) until it
 * comes after WAIT_B empty polls, some work, and a send whose completion
 * is waited for in loop A, after WAIT_A empty polls. A message's true
 * cost is that of a run with no empty polls (WAIT_A = WAIT_B = 0); a
 * method that subtracts a run's empty polls at one cost for both loops
 * gets it wrong when the runs wait in different loops
 * (tests/bench/test_cost.sh). */
#include <stdlib.h>
#include <sys/time.h>

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

/* perftest's sample_get_cpu_mhz in small: gettimeofday read CALIBRATIONS
 * times against a counter, a least-squares slope of the two */
#define CALIBRATIONS 400
static __attribute__((noinline)) double probe_calibrate(void)
{
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    struct timeval t0, t;
    gettimeofday(&t0, NULL);
    for (int i = 1; i < CALIBRATIONS; i++) {
        gettimeofday(&t, NULL);
        double x = (double)i,
               y = (double)(t.tv_sec - t0.tv_sec) * 1e6 + (double)(t.tv_usec - t0.tv_usec);
        sx += x, sy += y, sxx += x * x, sxy += x * y;
    }
    double n = CALIBRATIONS - 1;
    return (n * sxy - sx * sy) / (n * sxx - sx * sx);
}

/* two queues, a receive's and a send's (a receive CQ and a send CQ),
 * polled by the same function from two call sites */
struct probe_q {
    volatile int ring[64];
    volatile unsigned head, tail;
};
static struct probe_q recv_q, send_q;
static volatile long sink; /* the work's and loop B's stores */

static __attribute__((noinline)) int probe_poll_q(struct probe_q *q, int ne, int *out)
{
    int n = 0;
    while (n < ne && q->head != q->tail) {
        out[n++] = q->ring[q->head & 63];
        q->head++;
    }
    return n;
}

static __attribute__((noinline)) int probe_loops(long messages, long wait_a, long wait_b)
{
    int out[16];
    long done = 0;
    for (long m = 0; m < messages; m++) {
        /* loop B: the receive, after wait_b empty polls; its own work
         * (the stores) makes an iteration dearer than loop A's */
        for (long k = 0;; k++) {
            if (k == wait_b) {
                recv_q.ring[recv_q.tail & 63] = (int)m;
                recv_q.tail++;
            }
            int n = probe_poll_q(&recv_q, batch, out);
            if (n) {
                done += n;
                break;
            }
            sink += k;
            sink ^= k >> 3;
            sink += sink >> 7;
        }
        for (int i = 0; i < 8; i++) /* the message's work */
            sink += out[0] + i;
        /* loop A: the send's completion, after wait_a empty polls */
        for (long k = 0;; k++) {
            if (k == wait_a) {
                send_q.ring[send_q.tail & 63] = (int)m;
                send_q.tail++;
            }
            if (probe_poll_q(&send_q, batch, out))
                break;
        }
    }
    return done == messages ? 0 : 1;
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc == 4)
        return probe_loops(atol(argv[1]), atol(argv[2]), atol(argv[3]));
    if (argc != 2)
        return 2;
    long polls = atol(argv[1]), done = 0;
    struct timeval start;
    gettimeofday(&start, NULL);
    if (probe_calibrate() < 0) /* (time runs forward: never) */
        return 1;
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
