/* SPDX-License-Identifier: Apache-2.0 */
/* bex-trainer: a training load on a parameter server (paper §2.1, §6.3).
 *
 * --outstanding loops, each in its own thread: pick keys (Zipf-popular,
 * distinct within an iteration, as a trainer sums a batch's gradients per
 * key), Fetch their rows, compute for --compute-us (a sleep: the CPU
 * reported is the communication's), Push a gradient for each, for
 * --duration seconds. The number of keys makes the Push body's size
 * log-normal with mean --mean-bytes and P99 --p99-bytes (20 KB and 50 KB,
 * the paper's training workload).
 *
 * Every gradient value is --grad, so a row's value tells how many Pushes
 * were applied to it (SGD: each subtracts lr * grad). A Push goes to every
 * replica of its shards (bex_ps_push_report says which acknowledged it);
 * --counts writes, per key and replica, the Pushes that replica
 * acknowledged and the ones whose part there failed (which may or may not
 * have been applied), for bex-cluster's check that none was applied twice
 * and none acknowledged was lost. With --push-primary a Push goes to each
 * shard's primary alone (primary-backup: its acknowledgement is every
 * replica's); with --push-retry-ms a failed Push is sent again with its id
 * (bex_ps_push_seq) until acknowledged or that long, so none stays in
 * doubt and none is applied twice. Prints the JSON report of load.h at the
 * end. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "load.h"

enum { O_COMPUTE = 256, O_MEAN_BYTES, O_P99_BYTES, O_COUNTS, O_GRAD, O_PRIMARY, O_RETRY };

struct topts {
    double compute_us, mean_bytes, p99_bytes, grad;
    double retry_ms; /* --push-retry-ms: a failed Push sent again with its id this long */
    int primary;     /* --push-primary: Pushes to each shard's primary (primary-backup) */
    const char *counts;
};

static int extra(int opt, const char *arg, void *user)
{
    struct topts *to = user;
    if (opt == O_COUNTS) {
        to->counts = arg;
        return 0;
    }
    if (opt == O_PRIMARY) {
        to->primary = 1;
        return 0;
    }
    char *end;
    double v = strtod(arg, &end);
    if (end == arg || *end || !(v >= 0 && v <= 1e9))
        return -1;
    if (opt == O_COMPUTE)
        to->compute_us = v;
    else if (opt == O_MEAN_BYTES)
        to->mean_bytes = v;
    else if (opt == O_P99_BYTES)
        to->p99_bytes = v;
    else if (opt == O_RETRY)
        to->retry_ms = v;
    else
        to->grad = v;
    return 0;
}

static struct ld_run run;
static struct ld_zipf zipf;
static struct topts to = {
    .compute_us = 2000, .mean_bytes = 20480, .p99_bytes = 51200, .grad = 0x1p-10};
static double ln_mu, ln_sigma; /* of the Push body's size */
static uint64_t end_us;
#define REPS_MAX 4u
/* per replica and rank: Pushes acknowledged, and failed there */
static _Atomic uint32_t *applied[REPS_MAX], *unsure[REPS_MAX];
static uint32_t n_shards, n_reps;

/* The send window's state after each Push (issue 24: the adaptive
 * controller beside the latencies it shapes): the context's window bytes,
 * its last delay sample (posting to completion: base plus queueing) and
 * its cuts so far. The first WND_SAMPLES_MAX Pushes. */
#define WND_SAMPLES_MAX 1024u
struct wnd_sample {
    uint32_t t_ms, bytes, delay_us, cuts, stalls;
};
static struct wnd_sample wnd_samples[WND_SAMPLES_MAX];
static _Atomic uint32_t n_wnd;

static void wnd_record(void)
{
    uint32_t i = atomic_fetch_add(&n_wnd, 1);
    if (i >= WND_SAMPLES_MAX)
        return;
    bex_sock_stats st;
    bex_ctx_stats(run.ctx, &st);
    wnd_samples[i] = (struct wnd_sample){.t_ms = (uint32_t)((ld_now_us() - run.t0_us) / 1000),
                                         .bytes = (uint32_t)st.window_bytes,
                                         .delay_us = (uint32_t)st.window_delay_us,
                                         .cuts = (uint32_t)st.window_cuts,
                                         .stalls = (uint32_t)st.window_stalls};
}
static _Atomic uint64_t push_partial; /* Pushes some replicas acknowledged, not all */
static _Atomic uint64_t push_resent;  /* --push-retry-ms: Pushes sent again with their id */
#define SIZES_MAX (1u << 20)
static uint32_t sizes[SIZES_MAX]; /* the Push bodies' sizes */
static _Atomic size_t n_sizes;

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* A Push, reported per replica; with --push-retry-ms sent again with the
 * same id (bex_ps_push_seq) every 20 ms until acknowledged or that long. */
static int push_retried(const struct ld_opts *o, const uint64_t *keys, size_t n, const float *grads,
                        bex_ps_replica_result *res, size_t cap, size_t *n_res)
{
    uint64_t seq = bex_ps_push_next_seq(run.ps), end = ld_now_us() + (uint64_t)(to.retry_ms * 1e3);
    int rc;
    while ((rc = bex_ps_push_seq_sync(run.ps, seq, o->table, o->dim, keys, n, grads, res, cap,
                                      n_res)) &&
           ld_now_us() < end) {
        atomic_fetch_add(&push_resent, 1);
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
    }
    return rc;
}

static void *loop(void *arg)
{
    const struct ld_opts *o = run.o;
    uint64_t rng = (uintptr_t)arg * 0x9e3779b97f4a7c15ull + o->seed * 7919 + 1;
    size_t row = 8 + 4 * (size_t)o->dim; /* a key's share of a Push body */
    size_t cap = BEX_PS_KEYS_MAX < o->keys ? BEX_PS_KEYS_MAX : o->keys;
    uint32_t *ranks = malloc(cap * sizeof *ranks);
    uint64_t *keys = malloc(cap * sizeof *keys);
    float *rows = malloc(cap * o->dim * sizeof *rows);
    float *grads = malloc(cap * o->dim * sizeof *grads);
    size_t res_cap = (size_t)n_shards * BEX_PS_REPLICAS_MAX;
    bex_ps_replica_result *res = malloc(res_cap * sizeof *res);
    uint8_t *rep_ok = malloc((size_t)n_shards * REPS_MAX); /* 1 acked, 2 failed, per shard */
    if (!ranks || !keys || !rows || !grads || !res || !rep_ok) {
        fprintf(stderr, "bex-trainer: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < cap * o->dim; i++)
        grads[i] = (float)to.grad;
    while (ld_now_us() < end_us) {
        double bytes = exp(ln_mu + ln_sigma * ld_normal(&rng));
        size_t n = (size_t)(bytes / (double)row + 0.5);
        if (n < 1)
            n = 1;
        if (n > cap)
            n = cap;
        /* n distinct keys: draw, drop repeats, draw again for the gap
         * (a few rounds: the popular keys repeat) */
        size_t d = 0;
        for (int round = 0; round < 8 && d < n; round++) {
            for (size_t i = d; i < n; i++)
                ranks[i] = ld_zipf_rank(&zipf, ld_uniform(&rng));
            qsort(ranks, n, sizeof *ranks, cmp_u32);
            d = 0;
            for (size_t i = 0; i < n; i++)
                if (d == 0 || ranks[i] != ranks[d - 1])
                    ranks[d++] = ranks[i];
        }
        n = d;
        size_t at = atomic_fetch_add(&n_sizes, 1);
        if (at < SIZES_MAX)
            sizes[at] = (uint32_t)(n * row);
        for (size_t i = 0; i < n; i++)
            keys[i] = ld_rank_key(ranks[i]);
        uint64_t t_iter = ld_now_us();
        int rc = bex_ps_fetch_sync(run.ps, o->table, o->dim, keys, n, rows);
        ld_record(&run, LD_FETCH, t_iter, rc == 0);
        if (to.compute_us > 0) {
            struct timespec ts = {.tv_sec = (time_t)(to.compute_us / 1e6),
                                  .tv_nsec = (long)(fmod(to.compute_us, 1e6) * 1000)};
            nanosleep(&ts, NULL);
        }
        uint64_t t_push = ld_now_us();
        size_t n_res = 0;
        int prc = push_retried(o, keys, n, grads, res, res_cap, &n_res);
        ld_record(&run, LD_PUSH, t_push, prc == 0);
        wnd_record();
        ld_record(&run, LD_ITER, t_iter, rc == 0 && prc == 0);
        /* which replica of each shard acknowledged: parts come per shard in
         * the directory's order of its replicas */
        memset(rep_ok, 2, (size_t)n_shards * REPS_MAX);
        int some_ok = 0;
        for (size_t i = 0; i < n_res && i < res_cap; i++) {
            int ri = ld_replica_index(&run, res[i].shard, &res[i].addr);
            if (to.primary && res[i].shard < n_shards) /* the primary's answer: every replica's */
                memset(rep_ok + res[i].shard * REPS_MAX, res[i].status == 0 ? 1 : 2, REPS_MAX);
            else if (ri >= 0 && ri < (int)REPS_MAX && res[i].shard < n_shards)
                rep_ok[res[i].shard * REPS_MAX + (uint32_t)ri] = res[i].status == 0 ? 1 : 2;
            some_ok |= res[i].status == 0;
        }
        if (prc && some_ok)
            atomic_fetch_add(&push_partial, 1);
        for (size_t i = 0; i < n; i++) {
            uint32_t sh = bex_ps_key_shard(keys[i], n_shards);
            for (uint32_t r = 0; r < n_reps; r++)
                atomic_fetch_add_explicit(rep_ok[sh * REPS_MAX + r] == 1 ? &applied[r][ranks[i]]
                                                                         : &unsure[r][ranks[i]],
                                          1, memory_order_relaxed);
        }
    }
    free(ranks);
    free(keys);
    free(rows);
    free(grads);
    free(res);
    free(rep_ok);
    return NULL;
}

/* The per-key counts file (--counts): rank key replicas, then per
 * replica acknowledged and failed. 0, or 1 when it cannot be written. */
static int write_counts(const struct ld_opts *o)
{
    int rc = 0;
    if (to.counts) {
        FILE *f = fopen(to.counts, "w");
        if (!f) {
            fprintf(stderr, "bex-trainer: %s: %s\n", to.counts, strerror(errno));
            rc = 1;
        } else {
            /* rank key replicas, then per replica: acknowledged failed */
            for (uint32_t i = 0; i < o->keys; i++) {
                uint32_t any = 0;
                for (uint32_t r = 0; r < n_reps; r++)
                    any |= applied[r][i] | unsure[r][i];
                if (!any)
                    continue;
                fprintf(f, "%u %llu %u", i, (unsigned long long)ld_rank_key(i), n_reps);
                for (uint32_t r = 0; r < n_reps; r++)
                    fprintf(f, " %u %u", applied[r][i], unsure[r][i]);
                fputc('\n', f);
            }
            if (fclose(f))
                rc = 1;
        }
    }
    return rc;
}

/* The send window's state at the end and after each Push, as JSON members
 * (a leading comma) into buf: the length written. */
static size_t window_json(char *buf, size_t cap)
{
    bex_sock_stats st;
    bex_ctx_stats(run.ctx, &st);
    int n = snprintf(buf, cap,
                     ",\"window\":{\"bytes\":%llu,\"base_us\":%llu,\"delay_us\":%llu,"
                     "\"cuts\":%llu,\"stalls\":%llu,\"dest_bound_hits\":%llu,"
                     "\"dest_max_inflight\":%llu,\"max_inflight\":%llu,\"retry_errors\":%llu,"
                     "\"rnr_errors\":%llu,\"series\":[",
                     (unsigned long long)st.window_bytes, (unsigned long long)st.window_base_us,
                     (unsigned long long)st.window_delay_us, (unsigned long long)st.window_cuts,
                     (unsigned long long)st.window_stalls, (unsigned long long)st.dest_bound_hits,
                     (unsigned long long)st.dest_max_inflight,
                     (unsigned long long)st.max_inflight_bytes, (unsigned long long)st.retry_errors,
                     (unsigned long long)st.rnr_errors);
    size_t at = n > 0 && (size_t)n < cap ? (size_t)n : 0;
    uint32_t k = atomic_load(&n_wnd) < WND_SAMPLES_MAX ? atomic_load(&n_wnd) : WND_SAMPLES_MAX;
    /* [ms since start, window bytes, last delay us, cuts, stalls] per Push */
    for (uint32_t i = 0; i < k && at + 64 < cap; i++) {
        const struct wnd_sample *w = &wnd_samples[i];
        at += (size_t)snprintf(buf + at, cap - at, "%s[%u,%u,%u,%u,%u]", i ? "," : "", w->t_ms,
                               w->bytes, w->delay_us, w->cuts, w->stalls);
    }
    if (at + 3 < cap)
        at += (size_t)snprintf(buf + at, cap - at, "]}");
    return at;
}

/* The run's closing JSON line, with the sizes the Pushes had. 0 or 1. */
static int finish_run(void)
{
    /* the sizes the Pushes had (keys, gradients; the header left out) */
    size_t ns = atomic_load(&n_sizes) < SIZES_MAX ? atomic_load(&n_sizes) : SIZES_MAX;
    double sum = 0;
    for (size_t i = 0; i < ns; i++)
        sum += sizes[i];
    if (ns)
        qsort(sizes, ns, sizeof *sizes, cmp_u32);
    size_t cap = 1024 + (size_t)WND_SAMPLES_MAX * 64, at = 0;
    char *extra_json = malloc(cap);
    if (!extra_json)
        return 1;
    at += (size_t)snprintf(
        extra_json, cap,
        ",\"compute_us\":%.0f,\"mean_bytes\":%.0f,\"p99_bytes\":%.0f,\"grad\":%.9g,"
        "\"push_bytes\":{\"mean\":%.0f,\"p99\":%u},\"push_partial\":%llu,"
        "\"push_resent\":%llu",
        to.compute_us, to.mean_bytes, to.p99_bytes, to.grad, ns ? sum / (double)ns : 0.0,
        ns ? sizes[(size_t)((double)(ns - 1) * 0.99)] : 0,
        (unsigned long long)atomic_load(&push_partial),
        (unsigned long long)atomic_load(&push_resent));
    at += window_json(extra_json + at, cap - at);
    int rc = ld_run_finish(&run, "trainer", extra_json) ? 1 : 0;
    free(extra_json);
    return rc;
}

int main(int argc, char **argv)
{
    struct ld_opts o;
    static const struct option lo[] = {{"compute-us", required_argument, 0, O_COMPUTE},
                                       {"mean-bytes", required_argument, 0, O_MEAN_BYTES},
                                       {"p99-bytes", required_argument, 0, O_P99_BYTES},
                                       {"counts", required_argument, 0, O_COUNTS},
                                       {"grad", required_argument, 0, O_GRAD},
                                       {"push-primary", no_argument, 0, O_PRIMARY},
                                       {"push-retry-ms", required_argument, 0, O_RETRY},
                                       {0, 0, 0, 0}};
    ld_parse(argc, argv, &o, lo, extra, &to,
             "  --compute-us US            compute time between Fetch and Push (2000)\n"
             "  --mean-bytes B             the Push body's mean size (20480)\n"
             "  --p99-bytes B              its P99 size (51200)\n"
             "  --grad G                   every gradient value (0x1p-10)\n"
             "  --counts FILE              per key and replica, the Pushes acknowledged there\n"
             "  --push-primary             Push to each shard's primary alone (primary-backup)\n"
             "  --push-retry-ms MS         send a failed Push again with its id this long\n");
    o.push_mode = to.primary ? BEX_PS_PUSH_PRIMARY : BEX_PS_PUSH_ALL;
    /* log-normal: mean = exp(mu + s^2/2), P99 = exp(mu + 2.326 s), so
     * s^2/2 - 2.326 s + ln(P99/mean) = 0 */
    double q = log(to.p99_bytes / to.mean_bytes), z = 2.3263478740;
    if (!(to.mean_bytes > 0) || !(q > 0) || z * z < 2 * q) {
        fprintf(stderr, "bex-trainer: need 0 < --mean-bytes < --p99-bytes < %.1f x mean\n",
                exp(z * z / 2));
        return 2;
    }
    ln_sigma = z - sqrt(z * z - 2 * q);
    ln_mu = log(to.mean_bytes) - ln_sigma * ln_sigma / 2;
    o.warm_push = 1;
    if (ld_zipf_init(&zipf, o.keys, o.zipf)) {
        fprintf(stderr, "bex-trainer: out of memory\n");
        return 1;
    }
    if (ld_run_start(&run, &o, "bex-trainer"))
        return 1;
    n_shards = ld_shards(&run, &n_reps);
    if (n_reps > REPS_MAX)
        n_reps = REPS_MAX;
    for (uint32_t r = 0; r < n_reps; r++)
        if (!(applied[r] = calloc(o.keys, sizeof *applied[r])) ||
            !(unsure[r] = calloc(o.keys, sizeof *unsure[r]))) {
            fprintf(stderr, "bex-trainer: out of memory\n");
            return 1;
        }
    end_us = run.t0_us + (uint64_t)(o.duration_s * 1e6);
    pthread_t *th = calloc(o.outstanding, sizeof *th);
    uint32_t started = 0;
    while (th && started < o.outstanding &&
           pthread_create(&th[started], NULL, loop, (void *)(uintptr_t)started) == 0)
        started++;
    if (started == 0) {
        fprintf(stderr, "bex-trainer: no thread\n");
        return 1;
    }
    uint64_t last = run.t0_us;
    while (ld_now_us() < end_us) {
        struct timespec ts = {0, 100 * 1000000};
        nanosleep(&ts, NULL);
        ld_progress(&run, LD_ITER, &last);
    }
    for (uint32_t i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    free(th);
    int rc = write_counts(&o);
    if (finish_run())
        rc = 1;
    ld_zipf_free(&zipf);
    for (uint32_t r = 0; r < n_reps; r++) {
        free(applied[r]);
        free(unsure[r]);
    }
    return rc;
}
