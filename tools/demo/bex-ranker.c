/* SPDX-License-Identifier: Apache-2.0 */
/* bex-ranker: an inference load on a parameter server (paper §2.1).
 *
 * A user request evaluates --models k models; each model Fetches its keys
 * (a count log-uniform in [--keys-min, --keys-max], each key Zipf-popular),
 * which the PS client splits into concurrent sub-requests, one per shard
 * (fan-out); with --large-every N, every Nth model's Fetch has
 * --large-keys keys instead (MB-sized answers among the KB-sized ones).
 * --outstanding user requests are kept in flight for --duration
 * seconds. A user request fails when one of its Fetches failed, i.e. when a
 * shard had no replica that answered within the deadline (the client's
 * channels retry on another replica before that). Prints the JSON report
 * of load.h at the end (docs/configuration.md, "bex-ranker, bex-trainer"). */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "load.h"

enum { O_MODELS = 256, O_KEYS_MIN, O_KEYS_MAX, O_LARGE_EVERY, O_LARGE_KEYS, O_RATE };

struct ropts {
    uint32_t models, keys_min, keys_max;
    uint32_t large_every, large_keys; /* every Nth model Fetch this many keys (0: none) */
    double rate;                      /* user requests arriving per second (0: closed loop) */
};

static int extra(int opt, const char *arg, void *user)
{
    struct ropts *ro = user;
    char *end;
    if (opt == O_RATE) {
        errno = 0;
        double r = strtod(arg, &end);
        if (errno || end == arg || *end || !(r >= 0 && r <= 1e6))
            return -1;
        ro->rate = r;
        return 0;
    }
    unsigned long v = strtoul(arg, &end, 10);
    if (opt == O_LARGE_EVERY) { /* 0: off */
        if (end == arg || *end || v > 1000000)
            return -1;
        ro->large_every = (uint32_t)v;
        return 0;
    }
    if (end == arg || *end || v == 0 || v > BEX_PS_KEYS_MAX)
        return -1;
    if (opt == O_LARGE_KEYS)
        ro->large_keys = (uint32_t)v;
    else if (opt == O_MODELS)
        ro->models = (uint32_t)v;
    else if (opt == O_KEYS_MIN)
        ro->keys_min = (uint32_t)v;
    else
        ro->keys_max = (uint32_t)v;
    return 0;
}

static struct ld_run run;
static struct ld_zipf zipf;
static sem_t slots;

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* The Fetch answers' sizes (rows x dim x 4 bytes, all shards'): a
 * histogram in powers of 4 from 4 KiB (bucket i: up to 4 KiB x 4^i, the
 * last one unbounded), of every Fetch issued, failed ones too. */
#define SZ_BUCKETS 9
static struct {
    pthread_mutex_t mu;
    uint64_t hist[SZ_BUCKETS], min, max, sum, n;
    uint64_t mib;                 /* answers of 1 MiB or more */
    uint64_t large, large_failed; /* the --large-every ones */
    double large_lat_sum;         /* of the ok ones, microseconds */
} sz = {.mu = PTHREAD_MUTEX_INITIALIZER, .min = UINT64_MAX};

static uint64_t sz_bound(int i)
{
    return 4096ull << (2 * i);
}

struct ureq;
struct model {
    struct ureq *u;
    uint64_t start_us;
    uint64_t *keys;
    float *rows;
    size_t bytes;
    int large;
};

struct ureq {
    uint64_t start_us;
    _Atomic uint32_t left;
    _Atomic int failed;
    uint32_t n;
    struct model m[];
};

static void ureq_put(struct ureq *u)
{
    if (atomic_fetch_sub(&u->left, 1) != 1)
        return;
    ld_record(&run, LD_REQUEST, u->start_us, !atomic_load(&u->failed));
    for (uint32_t i = 0; i < u->n; i++) {
        free(u->m[i].keys);
        free(u->m[i].rows);
    }
    free(u);
    sem_post(&slots);
}

static void model_done(int status, void *user)
{
    struct model *m = user;
    ld_record(&run, LD_FETCH, m->start_us, status == 0);
    int b = 0;
    while (b < SZ_BUCKETS - 1 && m->bytes > sz_bound(b))
        b++;
    pthread_mutex_lock(&sz.mu);
    sz.hist[b]++;
    sz.n++;
    sz.sum += m->bytes;
    sz.min = m->bytes < sz.min ? m->bytes : sz.min;
    sz.max = m->bytes > sz.max ? m->bytes : sz.max;
    sz.mib += m->bytes >= (1u << 20);
    if (m->large) {
        sz.large++;
        if (status)
            sz.large_failed++;
        else
            sz.large_lat_sum += (double)(ld_now_us() - m->start_us);
    }
    pthread_mutex_unlock(&sz.mu);
    if (status) {
        /* the first few failures named, so a test that counts a failed
         * user request shows why (its log lines are what it prints) */
        static _Atomic unsigned named;
        if (atomic_fetch_add(&named, 1) < 8)
            fprintf(stderr, "bex-ranker: a model Fetch failed %.1f ms after it was issued: %s\n",
                    (double)(ld_now_us() - m->start_us) / 1000.0, bex_strerror(status));
        atomic_store(&m->u->failed, 1);
    }
    ureq_put(m->u);
}

/* Issue one user request that arrived at arrival_us: its models' Fetches
 * all at once (each Fetch's latency counts from now, the request's from
 * its arrival). */
static void issue(const struct ropts *ro, uint64_t *rng, uint64_t arrival_us)
{
    static uint64_t fetches; /* model Fetches issued: every large_every-th is large */
    const struct ld_opts *o = run.o;
    struct ureq *u = calloc(1, sizeof *u + ro->models * sizeof(struct model));
    if (!u) {
        ld_record(&run, LD_REQUEST, arrival_us, 0);
        sem_post(&slots);
        return;
    }
    u->n = ro->models;
    u->start_us = arrival_us;
    atomic_store(&u->left, u->n + 1);
    double lmin = log((double)ro->keys_min), lmax = log((double)ro->keys_max + 1);
    for (uint32_t i = 0; i < u->n; i++) {
        struct model *m = &u->m[i];
        m->u = u;
        size_t n = (size_t)exp(lmin + (lmax - lmin) * ld_uniform(rng));
        if (n < ro->keys_min)
            n = ro->keys_min;
        if (n > ro->keys_max)
            n = ro->keys_max;
        m->large = ro->large_every && ++fetches % ro->large_every == 0;
        if (m->large)
            n = ro->large_keys;
        m->bytes = n * o->dim * sizeof(float);
        m->keys = malloc(n * sizeof *m->keys);
        m->rows = malloc(n * o->dim * sizeof *m->rows);
        int rc = -ENOMEM;
        m->start_us = ld_now_us();
        if (m->keys && m->rows) {
            for (size_t k = 0; k < n; k++)
                m->keys[k] = ld_rank_key(ld_zipf_rank(&zipf, ld_uniform(rng)));
            rc = bex_ps_fetch(run.ps, o->table, o->dim, m->keys, n, m->rows, model_done, m);
        }
        if (rc)
            model_done(rc, m);
    }
    ureq_put(u); /* the issuing guard */
}

/* Take a slot, waiting at most 100 ms: 0, or -1 when none came free. */
static int slot_take(uint64_t *waited_once, int *counted)
{
    if (sem_trywait(&slots) == 0)
        return 0;
    if (waited_once && !*counted)
        ++*waited_once;
    *counted = 1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 100 * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    return sem_timedwait(&slots, &ts) == 0 ? 0 : -1;
}

/* Closed loop (no --rate): the next request starts when one completes,
 * so the load is whatever the machine sustains, until the end. */
static void closed_loop(const struct ropts *ro, uint64_t *rng)
{
    uint64_t last = run.t0_us;
    int counted = 0;
    while (ld_now_us() < run.end_us) {
        ld_progress(&run, LD_REQUEST, &last);
        if (slot_take(NULL, &counted) == 0)
            issue(ro, rng, ld_now_us());
    }
}

struct loop_stats {
    uint64_t arrivals, waited, dropped;
    uint32_t *lag; /* microseconds from an arrival to its issue (open_loop) */
    size_t lag_n, lag_cap;
};

static void lag_add(struct loop_stats *ls, uint64_t lag_us)
{
    if (ls->lag_n == ls->lag_cap) {
        size_t cap = ls->lag_cap ? 2 * ls->lag_cap : 4096;
        uint32_t *p = realloc(ls->lag, cap * sizeof *p);
        if (!p)
            return; /* the sample is lost, nothing else */
        ls->lag = p;
        ls->lag_cap = cap;
    }
    ls->lag[ls->lag_n++] = lag_us > UINT32_MAX ? UINT32_MAX : (uint32_t)lag_us;
}

/* Open loop (--rate): user requests arrive as a Poisson process on an
 * absolute timeline from the start, as they do at a ranker serving users,
 * whatever the PS's speed; at most --outstanding are in flight, and one
 * arriving when all are taken waits for a slot, its wait counted in its
 * latency (from its arrival). Every arrival before the end is issued,
 * late ones too (at overload, the backlog left at the end), until the end
 * plus the request deadline (--timeout-ms): those still waiting then fail
 * unissued (arrivals_dropped). The generator's own share of the latency
 * is sampled (issue_lag_us): an arrival the thread slept for and that
 * found a slot free, issued how long after it was due (the wake-up's
 * lateness; a backlog's arrivals and those that waited are not in it). */
static void open_loop(const struct ropts *ro, uint64_t *rng, struct loop_stats *ls)
{
    /* the sleeps until an arrival end at it, not up to 50 us later */
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    struct ld_poisson arr = {.rate = ro->rate, .t_us = run.t0_us};
    uint64_t last = run.t0_us, give_up = run.end_us + (uint64_t)run.o->timeout_ms * 1000;
    uint64_t last_issue = 0;
    int counted = 0; /* the next arrival's wait for a slot is counted */
    while (arr.t_us < run.end_us) {
        ld_progress(&run, LD_REQUEST, &last);
        uint64_t now = ld_now_us();
        if (now >= give_up) {
            ld_record(&run, LD_REQUEST, arr.t_us, 0);
            ls->arrivals++;
            ls->dropped++;
            ld_poisson_advance(&arr, rng);
            continue;
        }
        if (now < arr.t_us) {
            uint64_t d = arr.t_us - now < 100000 ? arr.t_us - now : 100000;
            struct timespec ts = {.tv_nsec = (long)d * 1000};
            nanosleep(&ts, NULL);
            continue;
        }
        /* the thread slept for this arrival: its lateness is the wake-up's */
        int slept = arr.t_us > last_issue;
        if (slot_take(&ls->waited, &counted) != 0)
            continue;
        now = ld_now_us();
        if (slept && !counted)
            lag_add(ls, now - arr.t_us);
        counted = 0;
        issue(ro, rng, arr.t_us);
        last_issue = now;
        ls->arrivals++;
        ld_poisson_advance(&arr, rng);
    }
}

int main(int argc, char **argv)
{
    struct ld_opts o;
    struct ropts ro = {.models = 4, .keys_min = 16, .keys_max = 2048, .large_keys = 16384};
    static const struct option lo[] = {{"models", required_argument, 0, O_MODELS},
                                       {"keys-min", required_argument, 0, O_KEYS_MIN},
                                       {"keys-max", required_argument, 0, O_KEYS_MAX},
                                       {"large-every", required_argument, 0, O_LARGE_EVERY},
                                       {"large-keys", required_argument, 0, O_LARGE_KEYS},
                                       {"rate", required_argument, 0, O_RATE},
                                       {0, 0, 0, 0}};
    ld_parse(argc, argv, &o, lo, extra, &ro,
             "  --models K                 models a user request evaluates (4)\n"
             "  --keys-min N               a model's fewest keys (16)\n"
             "  --keys-max N               a model's most keys (2048)\n"
             "  --large-every N            every Nth model Fetches --large-keys keys (0: none)\n"
             "  --large-keys N             the keys of such a Fetch (16384)\n"
             "  --rate R                   user requests a second, open loop (0: closed loop)\n");
    if (ro.keys_min > ro.keys_max) {
        fprintf(stderr, "bex-ranker: --keys-min is above --keys-max\n");
        return 2;
    }
    if (ld_zipf_init(&zipf, o.keys, o.zipf) || sem_init(&slots, 0, o.outstanding)) {
        fprintf(stderr, "bex-ranker: out of memory\n");
        return 1;
    }
    if (ld_run_start(&run, &o, "bex-ranker"))
        return 1;
    uint64_t rng = o.seed * 0x2545f4914f6cdd1dull + 1;
    run.end_us = run.t0_us + (uint64_t)(o.duration_s * 1e6);
    struct loop_stats ls = {0};
    if (ro.rate > 0)
        open_loop(&ro, &rng, &ls);
    else
        closed_loop(&ro, &rng);
    /* every request completes by its deadline */
    for (uint32_t i = 0; i < o.outstanding; i++)
        while (sem_wait(&slots) != 0)
            ;
    uint32_t lag50 = 0, lag99 = 0, lagmax = 0;
    if (ls.lag_n) {
        qsort(ls.lag, ls.lag_n, sizeof *ls.lag, cmp_u32);
        lag50 = ld_quantile(ls.lag, ls.lag_n, 0.5);
        lag99 = ld_quantile(ls.lag, ls.lag_n, 0.99);
        lagmax = ld_quantile(ls.lag, ls.lag_n, 1);
    }
    free(ls.lag);
    char extra_json[1024];
    int k = snprintf(
        extra_json, sizeof extra_json,
        ",\"models\":%u,\"keys_min\":%u,\"keys_max\":%u,\"large_every\":%u,"
        "\"large_keys\":%u,\"rate\":%g,\"arrivals\":%llu,\"arrivals_waited\":%llu,"
        "\"arrivals_dropped\":%llu,\"issue_lag_us\":{\"p50\":%u,\"p99\":%u,\"max\":%u},"
        "\"fetch_bytes\":{\"count\":%llu,\"min\":%llu,"
        "\"max\":%llu,\"mean\":%.1f,\"mib_or_more\":%llu,\"large\":%llu,\"large_failed\":%llu,"
        "\"large_mean_us\":%.1f,\"hist\":[",
        ro.models, ro.keys_min, ro.keys_max, ro.large_every, ro.large_keys, ro.rate,
        (unsigned long long)ls.arrivals, (unsigned long long)ls.waited,
        (unsigned long long)ls.dropped, lag50, lag99, lagmax, (unsigned long long)sz.n,
        (unsigned long long)(sz.n ? sz.min : 0), (unsigned long long)sz.max,
        sz.n ? (double)sz.sum / (double)sz.n : 0.0, (unsigned long long)sz.mib,
        (unsigned long long)sz.large, (unsigned long long)sz.large_failed,
        sz.large > sz.large_failed ? sz.large_lat_sum / (double)(sz.large - sz.large_failed) : 0.0);
    /* [le, count]: le the bucket's bound in bytes (0: unbounded, the last) */
    for (int b = 0; b < SZ_BUCKETS; b++)
        k += snprintf(extra_json + k, sizeof extra_json - (size_t)k, "%s[%llu,%llu]", b ? "," : "",
                      (unsigned long long)(b < SZ_BUCKETS - 1 ? sz_bound(b) : 0),
                      (unsigned long long)sz.hist[b]);
    snprintf(extra_json + k, sizeof extra_json - (size_t)k, "]}");
    int rc = ld_run_finish(&run, "ranker", extra_json);
    ld_zipf_free(&zipf);
    return rc ? 1 : 0;
}
