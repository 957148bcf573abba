/* SPDX-License-Identifier: Apache-2.0 */
/* What bex-ranker and bex-trainer share (load.h). */
#include "load.h"

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *const ld_op_names[LD_OPS] = {"fetch", "push", "request", "iteration"};

enum {
    O_CLUSTER = 1,
    O_SERVICE,
    O_LOCALITY,
    O_JSON,
    O_SAMPLES,
    O_ADDR,
    O_TRANSPORT,
    O_DURATION,
    O_OUTSTANDING,
    O_ZIPF,
    O_KEYS,
    O_TABLE,
    O_DIM,
    O_TIMEOUT,
    O_ATTEMPT_TIMEOUT,
    O_CONNECT_TIMEOUT,
    O_KEEPALIVE_TIMEOUT,
    O_SEND_WINDOW,
    O_EAGER_MAX,
    O_POLL,
    O_SEED,
    O_PROGRESS,
    O_VERBOSE,
    O_HELP,
    O_VERSION,
};

static const struct option common_opts[] = {
    {"cluster", required_argument, 0, O_CLUSTER},
    {"service", required_argument, 0, O_SERVICE},
    {"locality", required_argument, 0, O_LOCALITY},
    {"json", required_argument, 0, O_JSON},
    {"samples", required_argument, 0, O_SAMPLES},
    {"addr", required_argument, 0, O_ADDR},
    {"transport", required_argument, 0, O_TRANSPORT},
    {"duration", required_argument, 0, O_DURATION},
    {"outstanding", required_argument, 0, O_OUTSTANDING},
    {"zipf", required_argument, 0, O_ZIPF},
    {"keys", required_argument, 0, O_KEYS},
    {"table", required_argument, 0, O_TABLE},
    {"dim", required_argument, 0, O_DIM},
    {"timeout-ms", required_argument, 0, O_TIMEOUT},
    {"attempt-timeout-ms", required_argument, 0, O_ATTEMPT_TIMEOUT},
    {"connect-timeout-ms", required_argument, 0, O_CONNECT_TIMEOUT},
    {"keepalive-timeout-ms", required_argument, 0, O_KEEPALIVE_TIMEOUT},
    {"send-window", required_argument, 0, O_SEND_WINDOW},
    {"eager-max", required_argument, 0, O_EAGER_MAX},
    {"poll", required_argument, 0, O_POLL},
    {"seed", required_argument, 0, O_SEED},
    {"progress", no_argument, 0, O_PROGRESS},
    {"verbose", no_argument, 0, O_VERBOSE},
    {"help", no_argument, 0, O_HELP},
    {"version", no_argument, 0, O_VERSION},
};
#define N_COMMON (sizeof common_opts / sizeof common_opts[0])

static uint32_t attempt_timeout_ms;
/* A dead replica's connection is refused at once, so a long Tc costs the
 * fault nothing, and an RDMA connection to a loaded server (or in the
 * emulated VM) can take more than a second to come up. */
static uint32_t connect_timeout_ms = 3000;
static uint32_t keepalive_timeout_ms; /* the context's (0: its default) */
static uint32_t send_window;          /* the context's (0: none) */
static uint32_t eager_max;            /* the context's (0: its default) */
static uint32_t poll_mode;            /* the context's BEX_POLL_* (0: spin-sleep) */

__attribute__((noreturn)) static void usage_status(const char *prog, const char *extra, int status)
{
    FILE *f = status ? stderr : stdout;
    fprintf(f, "usage: %s --cluster FILE [OPTION]...\n", prog);
    fputs("  --cluster FILE             the cluster file of the PS service\n"
          "  --service NAME             the service's name (ps)\n"
          "  --addr IP                  this client's address (127.0.0.1)\n"
          "  --locality L               read from replicas of this locality first (none)\n"
          "  --transport auto|rdma|tcp  the transport (auto)\n"
          "  --duration S               how long the load runs, seconds (10)\n"
          "  --outstanding N            requests or loops in flight (8)\n"
          "  --zipf S                   the keys' Zipf exponent (0.99)\n"
          "  --keys N                   how many keys there are (100000)\n"
          "  --table ID                 the table (1)\n"
          "  --dim D                    its row length (16)\n"
          "  --timeout-ms MS            a request's deadline (1000)\n"
          "  --attempt-timeout-ms MS    one attempt's deadline (library default)\n"
          "  --connect-timeout-ms MS    a connection's setup at most (3000)\n"
          "  --keepalive-timeout-ms MS  a peer silent this long is dead (library default)\n"
          "  --send-window B            bytes in flight per connection (0: none)\n"
          "  --eager-max B              the largest message sent eagerly (library default)\n"
          "  --poll spin-sleep|busy|event  how the I/O threads wait (spin-sleep)\n"
          "  --seed N                   the random seed (1)\n"
          "  --json FILE                the JSON report there (-: stdout, the default)\n"
          "  --samples FILE             each request's latency there (CSV)\n"
          "  --progress                 a progress line every second\n"
          "  --verbose                  log at INFO\n"
          "  --help                     this text\n"
          "  --version                  the version\n",
          f);
    fputs(extra ? extra : "", f);
    exit(status);
}

__attribute__((noreturn)) static void usage(const char *prog, const char *extra)
{
    usage_status(prog, extra, 2);
}

/* The option being parsed (its long name), for bad_value. */
static const char *cur_opt = "";

/* The current option's value is bad: one line naming the option, its
 * value and what it may be, exit status 2 (not the usage text). */
__attribute__((noreturn)) static void bad_value(const char *prog, const char *want)
{
    const char *slash = strrchr(prog, '/');
    fprintf(stderr, "%s: --%s '%s': %s\n", slash ? slash + 1 : prog, cur_opt, optarg ? optarg : "",
            want);
    exit(2);
}

static double num(const char *prog, const char *extra, const char *s, double lo, double hi)
{
    (void)extra;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        char want[96];
        snprintf(want, sizeof want, "not a number from %g to %g", lo, hi);
        bad_value(prog, want);
    }
    return v;
}

/* A common option that is a name or a choice: 1 if c is one, else 0. */
static int opt_text(struct ld_opts *o, int c, const char *prog)
{
    switch (c) {
    case O_CLUSTER:
        o->cluster = optarg;
        return 1;
    case O_SERVICE:
        o->service = optarg;
        return 1;
    case O_LOCALITY:
        o->locality = optarg;
        return 1;
    case O_JSON:
        o->json = optarg;
        return 1;
    case O_SAMPLES:
        o->samples = optarg;
        return 1;
    case O_ADDR:
        o->addr = optarg;
        return 1;
    case O_TRANSPORT:
        if (strcmp(optarg, "rdma") == 0)
            o->transport = BEX_TRANSPORT_RDMA;
        else if (strcmp(optarg, "tcp") == 0)
            o->transport = BEX_TRANSPORT_TCP;
        else if (strcmp(optarg, "auto") == 0)
            o->transport = BEX_TRANSPORT_AUTO;
        else
            bad_value(prog, "not auto, rdma or tcp");
        return 1;
    case O_POLL:
        if (bex_poll_mode_parse(optarg, &poll_mode))
            bad_value(prog, "not spin-sleep, busy or event");
        return 1;
    case O_PROGRESS:
        o->progress = 1;
        return 1;
    case O_VERBOSE:
        o->verbose = 1;
        return 1;
    }
    return 0;
}

/* A common option that is a number within its bounds: 1 if c is one,
 * else 0; usage() for a value out of bounds. */
static int opt_number(struct ld_opts *o, int c, const char *prog, const char *usage_extra)
{
    switch (c) {
    case O_DURATION:
        o->duration_s = num(prog, usage_extra, optarg, 0.01, 86400);
        return 1;
    case O_OUTSTANDING:
        o->outstanding = (uint32_t)num(prog, usage_extra, optarg, 1, 4096);
        return 1;
    case O_ZIPF:
        o->zipf = num(prog, usage_extra, optarg, 0, 10);
        return 1;
    case O_KEYS:
        o->keys = (uint32_t)num(prog, usage_extra, optarg, 1, 1 << 26);
        return 1;
    case O_TABLE:
        o->table = (uint32_t)num(prog, usage_extra, optarg, 0, UINT32_MAX);
        return 1;
    case O_DIM:
        o->dim = (uint32_t)num(prog, usage_extra, optarg, 1, BEX_PS_DIM_MAX);
        return 1;
    case O_TIMEOUT:
        o->timeout_ms = (uint32_t)num(prog, usage_extra, optarg, 1, 3600000);
        return 1;
    case O_ATTEMPT_TIMEOUT:
        attempt_timeout_ms = (uint32_t)num(prog, usage_extra, optarg, 0, 3600000);
        return 1;
    case O_CONNECT_TIMEOUT:
        connect_timeout_ms = (uint32_t)num(prog, usage_extra, optarg, 1, 3600000);
        return 1;
    case O_KEEPALIVE_TIMEOUT:
        keepalive_timeout_ms = (uint32_t)num(prog, usage_extra, optarg, 1, 3600000);
        return 1;
    case O_SEND_WINDOW:
        send_window = (uint32_t)num(prog, usage_extra, optarg, 0, UINT32_MAX);
        return 1;
    case O_EAGER_MAX:
        eager_max = (uint32_t)num(prog, usage_extra, optarg, 0, UINT32_MAX);
        return 1;
    case O_SEED:
        o->seed = (uint64_t)num(prog, usage_extra, optarg, 0, 1e15);
        return 1;
    }
    return 0;
}

void ld_parse(int argc, char **argv, struct ld_opts *o, const struct option *extra, ld_extra_fn fn,
              void *user, const char *usage_extra)
{
    const char *prog = argv[0];
    *o = (struct ld_opts){.service = "ps",
                          .addr = "127.0.0.1",
                          .duration_s = 10,
                          .outstanding = 8,
                          .zipf = 0.99,
                          .keys = 100000,
                          .table = 1,
                          .dim = 16,
                          .timeout_ms = 1000,
                          .seed = 1};
    size_t n_extra = 0;
    while (extra && extra[n_extra].name)
        n_extra++;
    struct option *lo = calloc(N_COMMON + n_extra + 1, sizeof *lo);
    if (!lo)
        exit(1);
    memcpy(lo, common_opts, sizeof common_opts);
    if (n_extra)
        memcpy(lo + N_COMMON, extra, n_extra * sizeof *lo);
    int idx = -1;
    for (int c; (c = getopt_long(argc, argv, "", lo, &idx)) != -1; idx = -1) {
        cur_opt = idx >= 0 ? lo[idx].name : "";
        if (opt_text(o, c, prog) || opt_number(o, c, prog, usage_extra))
            continue;
        switch (c) {
        case O_HELP:
            usage_status(prog, usage_extra, 0);
            break;
        case O_VERSION: {
            const char *slash = strrchr(prog, '/');
            printf("%s %s\n", slash ? slash + 1 : prog, bex_version_string());
            exit(0);
        }
        default:
            if (c >= 256 && fn && fn(c, optarg, user) == 0)
                break;
            if (c >= 256 && optarg)
                bad_value(prog, "not a value it takes (see --help)");
            usage(prog, usage_extra);
        }
    }
    free(lo);
    if (!o->cluster || optind != argc)
        usage(prog, usage_extra);
}

int ld_zipf_init(struct ld_zipf *z, uint32_t n, double s)
{
    z->n = n;
    z->cdf = malloc((size_t)n * sizeof *z->cdf);
    if (!z->cdf)
        return -ENOMEM;
    double sum = 0;
    for (uint32_t i = 0; i < n; i++)
        z->cdf[i] = (sum += pow((double)i + 1, -s));
    for (uint32_t i = 0; i < n; i++)
        z->cdf[i] /= sum;
    return 0;
}

void ld_zipf_free(struct ld_zipf *z)
{
    free(z->cdf);
    z->cdf = NULL;
}

uint32_t ld_zipf_rank(const struct ld_zipf *z, double u)
{
    uint32_t lo = 0, hi = z->n - 1; /* the first rank whose cdf > u */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (z->cdf[mid] > u)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

uint64_t ld_rank_key(uint32_t rank)
{
    uint64_t x = (uint64_t)rank + 0x9e3779b97f4a7c15ull; /* splitmix64 */
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

uint64_t ld_rand(uint64_t *s)
{
    uint64_t x = (*s += 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

double ld_uniform(uint64_t *s)
{
    return (double)(ld_rand(s) >> 11) * 0x1.0p-53;
}

double ld_normal(uint64_t *s)
{
    double u1 = ld_uniform(s), u2 = ld_uniform(s);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2 * log(u1)) * cos(2 * M_PI * u2);
}

uint64_t ld_poisson_advance(struct ld_poisson *p, uint64_t *rng)
{
    /* exponential gaps, -ln(1 - U) / rate seconds: Poisson arrivals. The
     * fractions of a microsecond are carried, not dropped: dropped, every
     * gap was 0.5 us short on average, and the rate 1 + 0.5e-6 x rate
     * times the one asked for (2.5 % high at 50 000/s) */
    double t = p->frac_us - log(1 - ld_uniform(rng)) / p->rate * 1e6;
    uint64_t whole = (uint64_t)t;
    p->frac_us = t - (double)whole;
    p->t_us += whole;
    return p->t_us;
}

uint32_t ld_quantile(const uint32_t *sorted, size_t n, double q)
{
    return n ? sorted[(size_t)((double)(n - 1) * q)] : 0;
}

uint64_t ld_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Connect before the load starts, as a ranker or trainer is connected
 * before it takes traffic: one Fetch with a key of every shard, and one
 * Push of zero gradients (SGD leaves the rows as they are) to every
 * replica, again until they succeed (an RDMA connection to a loaded
 * server, or in the emulated VM, can take longer than a request's
 * deadline). */
static int warm_up(struct ld_run *r, const char *prog)
{
    uint32_t ns = 0;
    while (ns < 4096 && bex_dir_replicas(r->dir, r->o->service, ns, NULL, 0) > 0)
        ns++;
    uint64_t *keys = calloc(ns ? ns : 1, sizeof *keys);
    float *rows = calloc((size_t)(ns ? ns : 1) * r->o->dim, sizeof *rows);
    float *zeros = calloc((size_t)(ns ? ns : 1) * r->o->dim, sizeof *zeros);
    char *have = calloc(ns ? ns : 1, 1);
    int rc = -ENOMEM;
    if (!keys || !rows || !zeros || !have)
        goto out;
    uint32_t n = 0;
    for (uint32_t rank = 0; n < ns && rank < (1u << 24); rank++) {
        uint64_t k = ld_rank_key(rank);
        uint32_t s = bex_ps_key_shard(k, ns);
        if (!have[s]) {
            have[s] = 1;
            keys[n++] = k;
        }
    }
    uint64_t end = ld_now_us() + 60 * 1000000ull;
    while (((rc = bex_ps_fetch_sync(r->ps, r->o->table, r->o->dim, keys, n, rows)) ||
            (r->o->warm_push &&
             (rc = bex_ps_push_sync(r->ps, r->o->table, r->o->dim, keys, n, zeros)))) &&
           ld_now_us() < end) {
        struct timespec ts = {0, 100 * 1000000};
        nanosleep(&ts, NULL);
    }
    if (rc)
        fprintf(stderr, "%s: not every shard answered within 60 s: %s\n", prog, bex_strerror(rc));
out:
    free(keys);
    free(rows);
    free(zeros);
    free(have);
    return rc;
}

int ld_run_start(struct ld_run *r, struct ld_opts *o, const char *prog)
{
    *r = (struct ld_run){.o = o};
    pthread_mutex_init(&r->mu, NULL);
    char err[256] = "";
    /* bad input (a BEX_* variable, the cluster file, --addr): one line
     * naming it, exit 2, nothing started */
    if (bex_env_check(err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", prog, err);
        exit(2);
    }
    int rc = bex_dir_create(NULL, &r->dir);
    if (rc == 0 && (rc = bex_dir_load_file(r->dir, o->cluster, err, sizeof err))) {
        fprintf(stderr, "%s: %s\n", prog, err[0] ? err : bex_strerror(rc));
        bex_dir_destroy(r->dir);
        exit(2);
    }
    if (rc)
        goto err_msg;
    /* --connect-timeout-ms is the context's setup deadline too (issue 24
     * item 3): with the channel's alone, setups slowed by a bottleneck
     * failed at the library's 3 s and the ladder moved the load to TCP */
    bex_ctx_config cc = {.transport = o->transport,
                         .connect_timeout_ms = connect_timeout_ms,
                         .keepalive_timeout_ms = keepalive_timeout_ms,
                         .send_window = send_window,
                         .eager_max = eager_max,
                         .poll_mode = poll_mode,
                         .log_level = o->verbose ? BEX_LOG_INFO : BEX_LOG_WARN};
    if (bex_addr_parse(o->addr, 0, &cc.local_addr) != 0) {
        fprintf(stderr, "%s: --addr %s: not an IP address\n", prog, o->addr);
        bex_dir_destroy(r->dir);
        exit(2);
    }
    if ((rc = bex_ctx_create(&cc, &r->ctx))) {
        fprintf(stderr, "%s: context on %s: %s\n", prog, o->addr, bex_strerror(rc));
        goto err_dir;
    }
    /* A replica's death leaves every sub-request out on it to retry at
     * once: the budget's burst covers that many, the earning keeps retries
     * a fifth of the calls beyond it. */
    bex_ps_client_config pc = {.dir = r->dir,
                               .service = o->service,
                               .locality = o->locality,
                               .timeout_ms = o->timeout_ms,
                               .attempt_timeout_ms = attempt_timeout_ms,
                               .connect_timeout_ms = connect_timeout_ms,
                               .max_attempts = 4,
                               .retry_budget_burst = 1000,
                               .retry_budget_permille = 200,
                               .push_mode = o->push_mode};
    if ((rc = bex_ps_client_create(r->ctx, &pc, &r->ps))) {
        fprintf(stderr, "%s: PS client: %s\n", prog, bex_strerror(rc));
        goto err_ctx;
    }
    if ((rc = warm_up(r, prog)))
        goto err_ps;
    r->cap = 1 << 16;
    if (!(r->s = malloc(r->cap * sizeof *r->s))) {
        rc = -ENOMEM;
        goto err_ps;
    }
    getrusage(RUSAGE_SELF, &r->ru0);
    r->t0_us = ld_now_us();
    return 0;

err_ps:
    bex_ps_client_destroy(r->ps);
err_ctx:
    bex_ctx_destroy(r->ctx);
err_dir:
    bex_dir_destroy(r->dir);
    return rc;
err_msg:
    fprintf(stderr, "%s: %s\n", prog, bex_strerror(rc));
    return rc;
}

uint32_t ld_shards(struct ld_run *r, uint32_t *max_reps)
{
    uint32_t n = 0;
    size_t k;
    *max_reps = 0;
    while (n < 4096 && (k = bex_dir_replicas(r->dir, r->o->service, n, NULL, 0)) > 0) {
        if (k > *max_reps)
            *max_reps = (uint32_t)k;
        n++;
    }
    return n;
}

int ld_replica_index(struct ld_run *r, uint32_t shard, const bex_addr *addr)
{
    bex_dir_replica reps[BEX_PS_REPLICAS_MAX];
    size_t n = bex_dir_replicas(r->dir, r->o->service, shard, reps, BEX_PS_REPLICAS_MAX);
    for (size_t i = 0; i < n && i < BEX_PS_REPLICAS_MAX; i++)
        if (bex_addr_equal(&reps[i].addr, addr)) /* IPv4 or IPv6 */
            return (int)i;
    return -1;
}

void ld_record(struct ld_run *r, int op, uint64_t start_us, int ok)
{
    uint64_t now = ld_now_us();
    pthread_mutex_lock(&r->mu);
    if (ok) {
        r->ok[op]++;
        r->in_window[op] += now < r->end_us;
    } else
        r->failed[op]++;
    if (r->n == r->cap) {
        void *p = realloc(r->s, 2 * r->cap * sizeof *r->s);
        if (!p) { /* the counters stay right; only the sample is lost */
            pthread_mutex_unlock(&r->mu);
            return;
        }
        r->s = p;
        r->cap *= 2;
    }
    r->s[r->n++] = (struct ld_sample){.t_ms = (uint32_t)((start_us - r->t0_us) / 1000),
                                      .lat_us = (uint32_t)(now - start_us),
                                      .op = (uint8_t)op,
                                      .ok = (uint8_t)ok};
    pthread_mutex_unlock(&r->mu);
}

/* With BEX_MEM_SAMPLES=FILE in the environment: every 200 ms a line
 * "t_ms pool registered_bytes in_use_bytes" per pool of the context
 * (bench/ps/mem-timeline, the paper's Figure 5). */
static void mem_sample(struct ld_run *r, uint64_t now)
{
    static FILE *f;
    static int tried;
    static uint64_t next;
    if (!tried) {
        tried = 1;
        const char *path = getenv("BEX_MEM_SAMPLES");
        f = path ? fopen(path, "w") : NULL;
    }
    if (!f || now < next)
        return;
    next = now + 200000;
    bex_mem_pool *pools[] = {bex_ctx_pool(r->ctx), bex_ctx_recv_pool(r->ctx),
                             bex_ctx_landing_pool(r->ctx)};
    static const char *const names[] = {"main", "recv", "landing"};
    for (int i = 0; i < 3; i++) {
        bex_mem_stats ms;
        bex_mem_pool_stats(pools[i], &ms);
        fprintf(f, "%llu %s %zu %zu\n", (unsigned long long)((now - r->t0_us) / 1000), names[i],
                ms.registered_bytes, ms.in_use_bytes);
    }
    fflush(f);
}

void ld_progress(struct ld_run *r, int op, uint64_t *last_us)
{
    uint64_t now = ld_now_us();
    mem_sample(r, now);
    if (!r->o->progress || now - *last_us < 1000000)
        return;
    *last_us = now;
    pthread_mutex_lock(&r->mu);
    uint64_t ok = r->ok[op], failed = r->failed[op];
    pthread_mutex_unlock(&r->mu);
    printf("progress %llu %llu\n", (unsigned long long)ok, (unsigned long long)failed);
    fflush(stdout);
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static double tv_s(struct timeval a, struct timeval b)
{
    return (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_usec - a.tv_usec) / 1e6;
}

int ld_run_finish(struct ld_run *r, const char *role, const char *extra_json)
{
    struct rusage ru1;
    getrusage(RUSAGE_SELF, &ru1);
    double elapsed = (double)(ld_now_us() - r->t0_us) / 1e6;
    bex_ps_client_stats cs;
    bex_ps_client_stats_get(r->ps, &cs);
    bex_ps_client_destroy(r->ps);
    int rc = bex_ctx_destroy(r->ctx);
    bex_dir_destroy(r->dir);

    FILE *f = stdout;
    if (r->o->json && strcmp(r->o->json, "-") != 0 && !(f = fopen(r->o->json, "w"))) {
        rc = -errno;
        fprintf(stderr, "bex-%s: %s: %s\n", role, r->o->json, strerror(errno));
        goto out;
    }
    static const char *const tnames[] = {"auto", "rdma", "tcp"};
    static const char *const pnames[] = {"spin-sleep", "busy", "event"};
    fprintf(f,
            "{\"role\":\"%s\",\"transport\":\"%s\",\"poll\":\"%s\",\"outstanding\":%u,"
            "\"zipf\":%g,\"keys\":%u,\"dim\":%u,\"duration_s\":%.3f,\"elapsed_s\":%.3f,"
            "\"t0_mono_s\":%.6f,\"ops\":{",
            role, tnames[r->o->transport % 3], pnames[poll_mode % 3], r->o->outstanding, r->o->zipf,
            r->o->keys, r->o->dim, r->o->duration_s, elapsed, (double)r->t0_us / 1e6);
    uint32_t *lat = malloc((r->n ? r->n : 1) * sizeof *lat);
    uint64_t net_ops = 0;
    int first = 1;
    for (int op = 0; op < LD_OPS; op++) {
        uint64_t cnt = r->ok[op] + r->failed[op];
        if (!cnt)
            continue;
        if (op == LD_FETCH || op == LD_PUSH)
            net_ops += cnt;
        size_t k = 0;
        double sum = 0;
        for (size_t i = 0; lat && i < r->n; i++)
            if (r->s[i].op == op && r->s[i].ok) {
                lat[k++] = r->s[i].lat_us;
                sum += r->s[i].lat_us;
            }
        if (k)
            qsort(lat, k, sizeof *lat, cmp_u32);
        fprintf(f,
                "%s\"%s\":{\"count\":%llu,\"ok\":%llu,\"failed\":%llu,\"per_s\":%.1f,"
                "\"mean_us\":%.1f,\"p50_us\":%u,\"p99_us\":%u,\"max_us\":%u",
                first ? "" : ",", ld_op_names[op], (unsigned long long)cnt,
                (unsigned long long)r->ok[op], (unsigned long long)r->failed[op],
                (double)r->ok[op] / elapsed, k ? sum / (double)k : 0.0, k ? lat[k / 2] : 0,
                k ? lat[(size_t)((double)(k - 1) * 0.99)] : 0, k ? lat[k - 1] : 0);
        /* the window's throughput: completed in it, over its length */
        if (r->end_us > r->t0_us)
            fprintf(f, ",\"in_window\":%llu,\"window_per_s\":%.1f",
                    (unsigned long long)r->in_window[op],
                    (double)r->in_window[op] * 1e6 / (double)(r->end_us - r->t0_us));
        fputc('}', f);
        first = 0;
    }
    free(lat);
    double us = tv_s(r->ru0.ru_utime, ru1.ru_utime), sy = tv_s(r->ru0.ru_stime, ru1.ru_stime);
    fprintf(f,
            "},\"sub_requests\":%llu,\"sub_failed\":%llu,\"attempts\":%llu,\"retries\":%llu,"
            "\"retry_throttled\":%llu,\"failovers\":%llu,\"conn_failures\":%llu,"
            "\"cpu\":{\"user_s\":%.3f,\"sys_s\":%.3f,\"ops\":%llu,\"user_us_per_op\":%.1f,"
            "\"sys_us_per_op\":%.1f}%s}\n",
            (unsigned long long)cs.calls, (unsigned long long)cs.failed,
            (unsigned long long)cs.attempts, (unsigned long long)cs.retries,
            (unsigned long long)cs.retry_throttled, (unsigned long long)cs.failovers,
            (unsigned long long)cs.conn_failures, us, sy, (unsigned long long)net_ops,
            net_ops ? us * 1e6 / (double)net_ops : 0.0, net_ops ? sy * 1e6 / (double)net_ops : 0.0,
            extra_json ? extra_json : "");
    if (f != stdout && fclose(f) && !rc)
        rc = -errno;
    else if (f == stdout)
        fflush(f);
    if (r->o->samples) {
        FILE *sf = fopen(r->o->samples, "w");
        if (!sf) {
            rc = -errno;
            fprintf(stderr, "bex-%s: %s: %s\n", role, r->o->samples, strerror(errno));
            goto out;
        }
        fprintf(sf, "t_ms,op,lat_us,ok\n");
        for (size_t i = 0; i < r->n; i++)
            fprintf(sf, "%u,%s,%u,%u\n", r->s[i].t_ms, ld_op_names[r->s[i].op], r->s[i].lat_us,
                    r->s[i].ok);
        if (fclose(sf) && !rc)
            rc = -errno;
    }
out:
    free(r->s);
    pthread_mutex_destroy(&r->mu);
    return rc;
}
