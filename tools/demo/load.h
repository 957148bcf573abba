/* SPDX-License-Identifier: Apache-2.0 */
/* What bex-ranker and bex-trainer share: options, the PS client over a
 * cluster file, Zipf key popularity, latency samples and the JSON report
 * (docs/configuration.md, "bex-ranker, bex-trainer"). */
#ifndef BEX_DEMO_LOAD_H
#define BEX_DEMO_LOAD_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/resource.h>

#include "bex/dir.h"
#include "bex/ps.h"
#include "bex/sock.h"

/* Operations a sample is of. */
enum { LD_FETCH = 0, LD_PUSH = 1, LD_REQUEST = 2, LD_ITER = 3, LD_OPS = 4 };

struct ld_opts {
    const char *cluster, *service, *locality, *json, *samples;
    const char *addr;     /* the context's local address */
    uint32_t transport;   /* BEX_TRANSPORT_* */
    double duration_s;    /* how long to run */
    uint32_t outstanding; /* user requests (ranker) or loops (trainer) at once */
    double zipf;          /* key popularity exponent (0: uniform) */
    uint32_t keys;        /* the key space: ranks 0..keys-1 */
    uint32_t table, dim;
    uint32_t timeout_ms; /* a request's deadline */
    uint64_t seed;
    int progress;       /* a "progress OK FAILED" line every second */
    int warm_push;      /* the warm-up Pushes too (trainers: every replica's channel) */
    uint32_t push_mode; /* the PS client's (BEX_PS_PUSH_ALL or BEX_PS_PUSH_PRIMARY) */
    int verbose;
};

/* Parse the common options into o (defaults first); returns the index of
 * the first option getopt_long did not know (-1: none), or exits with
 * usage on a bad one. extra: the caller's long options (NULL-terminated
 * getopt table, values >= 256), handled by its callback. */
struct option;
typedef int (*ld_extra_fn)(int opt, const char *arg, void *user);
void ld_parse(int argc, char **argv, struct ld_opts *o, const struct option *extra, ld_extra_fn fn,
              void *user, const char *usage_extra);

/* Zipf over ranks 0..n-1 with exponent s (inverse CDF table). */
struct ld_zipf {
    double *cdf;
    uint32_t n;
};
int ld_zipf_init(struct ld_zipf *z, uint32_t n, double s);
void ld_zipf_free(struct ld_zipf *z);
/* A rank for u uniform in [0, 1). */
uint32_t ld_zipf_rank(const struct ld_zipf *z, double u);
/* The key of a rank: a hash, so that the popular keys spread over the
 * shards (bex_ps_key_shard hashes again). */
uint64_t ld_rank_key(uint32_t rank);

/* xorshift-style per-thread generator. */
uint64_t ld_rand(uint64_t *s);
double ld_uniform(uint64_t *s);
double ld_normal(uint64_t *s);

/* Poisson arrivals (an open loop): exponential gaps of mean 1 / rate
 * seconds drawn from the caller's generator, on an absolute timeline that
 * starts at t_us (the first arrival). */
struct ld_poisson {
    double rate;    /* arrivals per second, > 0 */
    uint64_t t_us;  /* the current arrival */
    double frac_us; /* the timeline's part of a microsecond t_us leaves out (0 at first) */
};
/* Advance to the next arrival; returns its time (microseconds). */
uint64_t ld_poisson_advance(struct ld_poisson *p, uint64_t *rng);

/* The q-quantile (0..1) of n sorted values (0 for none): the value at
 * floor((n - 1) x q), so that a lower q never gives a higher value. */
uint32_t ld_quantile(const uint32_t *sorted, size_t n, double q);

/* Monotonic microseconds. */
uint64_t ld_now_us(void);

/* The run: a context and a PS client on it, the samples. */
struct ld_run {
    struct ld_opts *o;
    bex_ctx *ctx;
    bex_dir *dir;
    bex_ps_client *ps;
    uint64_t t0_us;  /* the run's start */
    uint64_t end_us; /* the measured window's end (0: none): ops completed in [t0, end) counted */
    struct rusage ru0;
    pthread_mutex_t mu;
    struct ld_sample {
        uint32_t t_ms; /* start, ms from t0 */
        uint32_t lat_us;
        uint8_t op, ok;
    } * s;
    size_t n, cap;
    uint64_t ok[LD_OPS], failed[LD_OPS];
    uint64_t in_window[LD_OPS]; /* ok ones that completed before end_us */
    FILE *progress_out;
};

/* Create the context and client (the directory from o->cluster). Returns
 * 0 or a negative errno (said on stderr); bad input (a bad BEX_* variable,
 * a cluster file that does not load, a bad --addr) exits with status 2
 * after one line naming it, before anything started. */
int ld_run_start(struct ld_run *r, struct ld_opts *o, const char *prog);
/* The directory's shards, and the most replicas one has (*max_reps). */
uint32_t ld_shards(struct ld_run *r, uint32_t *max_reps);
/* The place of addr among shard's replicas in the directory (the cluster
 * file's order), or -1. */
int ld_replica_index(struct ld_run *r, uint32_t shard, const bex_addr *addr);
/* Record one operation that started at start_us. Any thread. */
void ld_record(struct ld_run *r, int op, uint64_t start_us, int ok);
/* Print a progress line when a second passed since the last (main
 * thread), counting operations of op as the user-visible ones. */
void ld_progress(struct ld_run *r, int op, uint64_t *last_us);
/* Write the JSON report (o->json, "-" or NULL: stdout) and the samples
 * (o->samples, CSV "t_ms,op,lat_us,ok"); free everything. role: "ranker"
 * or "trainer"; extra_json: more members for the report's top level
 * ("" or ",\"k\":v..."). Returns 0 or -errno. */
int ld_run_finish(struct ld_run *r, const char *role, const char *extra_json);

extern const char *const ld_op_names[LD_OPS];

#endif
