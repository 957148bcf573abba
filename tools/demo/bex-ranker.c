/* bex-ranker: an inference load on a parameter server (paper §2.1).
 *
 * A user request evaluates --models k models; each model Fetches its keys
 * (a count log-uniform in [--keys-min, --keys-max], each key Zipf-popular),
 * which the PS client splits into concurrent sub-requests, one per shard
 * (fan-out). --outstanding user requests are kept in flight for --duration
 * seconds. A user request fails when one of its Fetches failed, i.e. when a
 * shard had no replica that answered within the deadline (the client's
 * channels retry on another replica before that). Prints the JSON report
 * of load.h at the end (docs/configuration.md, "bex-ranker, bex-trainer"). */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "load.h"

enum { O_MODELS = 256, O_KEYS_MIN, O_KEYS_MAX };

struct ropts {
    uint32_t models, keys_min, keys_max;
};

static int extra(int opt, const char *arg, void *user)
{
    struct ropts *ro = user;
    char *end;
    unsigned long v = strtoul(arg, &end, 10);
    if (end == arg || *end || v == 0 || v > BEX_PS_KEYS_MAX)
        return -1;
    if (opt == O_MODELS)
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

struct ureq;
struct model {
    struct ureq *u;
    uint64_t start_us;
    uint64_t *keys;
    float *rows;
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
    if (status)
        atomic_store(&m->u->failed, 1);
    ureq_put(m->u);
}

/* Issue one user request: its models' Fetches all at once. */
static void issue(const struct ropts *ro, uint64_t *rng)
{
    const struct ld_opts *o = run.o;
    struct ureq *u = calloc(1, sizeof *u + ro->models * sizeof(struct model));
    if (!u) {
        ld_record(&run, LD_REQUEST, ld_now_us(), 0);
        sem_post(&slots);
        return;
    }
    u->n = ro->models;
    u->start_us = ld_now_us();
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

int main(int argc, char **argv)
{
    struct ld_opts o;
    struct ropts ro = {.models = 4, .keys_min = 16, .keys_max = 2048};
    static const struct option lo[] = {{"models", required_argument, 0, O_MODELS},
                                       {"keys-min", required_argument, 0, O_KEYS_MIN},
                                       {"keys-max", required_argument, 0, O_KEYS_MAX},
                                       {0, 0, 0, 0}};
    ld_parse(argc, argv, &o, lo, extra, &ro, "       [--models K] [--keys-min N] [--keys-max N]\n");
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
    uint64_t rng = o.seed * 0x2545f4914f6cdd1dull + 1, last = run.t0_us;
    uint64_t end = run.t0_us + (uint64_t)(o.duration_s * 1e6);
    while (ld_now_us() < end) {
        /* wait for a free slot, but not past the end (progress meanwhile) */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        ld_progress(&run, LD_REQUEST, &last);
        if (sem_timedwait(&slots, &ts) != 0)
            continue;
        issue(&ro, &rng);
    }
    /* every request completes by its deadline */
    for (uint32_t i = 0; i < o.outstanding; i++)
        while (sem_wait(&slots) != 0)
            ;
    char extra_json[128];
    snprintf(extra_json, sizeof extra_json, ",\"models\":%u,\"keys_min\":%u,\"keys_max\":%u",
             ro.models, ro.keys_min, ro.keys_max);
    int rc = ld_run_finish(&run, "ranker", extra_json);
    ld_zipf_free(&zipf);
    return rc ? 1 : 0;
}
