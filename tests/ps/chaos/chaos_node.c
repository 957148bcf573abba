/* SPDX-License-Identifier: Apache-2.0 */
/* The chaos test's client side (issue 29 item 6; tests/ps/chaos/chaos.py
 * runs it): a trainer that Pushes with explicit Push ids, and the check.
 *
 *   bex_chaos_node zero|push|check --cluster FILE [--etcd URL --prefix P]
 *       [--addr IP] [--transport tcp|rdma] [--id N] [--seconds S]
 *       [--seed X] [--sums FILE] [--ack-bound-ms MS] [--replicas R]
 *
 * Tables (as chaos.py starts bex-ps): 1 SGD of dim 4, lr 1; 2 Adagrad of
 * dim 4. Keys KEY0 .. KEY0 + NKEYS - 1.
 *
 * zero: Pushes each SGD row's initial value (bex_ps_init_value) as its
 *   gradient, so every SGD row is exactly 0 (x - 1 * x); from there
 *   integer gradients keep it exact whatever the order.
 * push: Pushes for --seconds, each Push one table and 1-3 keys of one
 *   shard, integer gradients (SGD 1..4: a row never comes back to 0), to
 *   the shard's primary (the first replica the directory lists, looked up
 *   again before each attempt: with a directory that fails over, the new
 *   primary). Each Push is sent again with the same id (client, seq,
 *   token) until it is acknowledged, at most --ack-bound-ms: none stays in
 *   doubt. Writes the acknowledged SGD gradients summed per (key, column)
 *   to --sums, and a line of counts to stdout.
 * check: reads every row of both tables from each replica of each shard
 *   alone (a Fetch at its address) and compares: the replicas of a shard
 *   bit for bit, and each SGD row with 0 less the sums of every --sums
 *   file. Prints each difference; exit status 1 when there is one. */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "bex/dir.h"
#include "bex/ps.h"
#include "bex/rpc.h"
#include "bex/sock.h"
#include "ps/ps_internal.h"

#define NKEYS   48
#define KEY0    1000u
#define DIM     4
#define T_SGD   1u
#define T_ADA   2u
#define MAXREP  8
#define MAXSUMS 16

struct opts {
    const char *mode, *cluster, *etcd, *prefix, *addr, *sums_out;
    const char *sums_in[MAXSUMS];
    int n_sums;
    uint32_t transport;
    unsigned id, replicas;
    double seconds;
    unsigned long long seed;
    unsigned ack_bound_ms;
};

struct node {
    struct opts o;
    bex_ctx *ctx;
    bex_dir *dir;
    uint32_t n_shards;
    bex_rpc_channel *ch[2];
    bex_addr ch_addr[2];
    uint32_t turn[2]; /* the replica tried next: advanced after a failed attempt */
    uint64_t client, tok[2], seq;
    long long sums[NKEYS][DIM];
    unsigned long pushes, attempts, max_wait_ms;
};

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void sleep_ms(unsigned ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static uint64_t rnd(uint64_t *s) /* splitmix64 */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__attribute__((noreturn)) static void die(const char *what, int rc)
{
    fprintf(stderr, "bex_chaos_node: %s: %s\n", what, rc ? bex_strerror(rc) : "failed");
    exit(2);
}

/* ---- setup ---- */

static void usage(void)
{
    fprintf(stderr, "usage: bex_chaos_node zero|push|check --cluster FILE|--etcd URL ...\n");
    exit(2);
}

static void parse(int argc, char **argv, struct opts *o)
{
    static const struct option lo[] = {
        {"cluster", 1, 0, 'c'},      {"etcd", 1, 0, 'e'},      {"prefix", 1, 0, 'p'},
        {"addr", 1, 0, 'a'},         {"transport", 1, 0, 't'}, {"id", 1, 0, 'i'},
        {"seconds", 1, 0, 's'},      {"seed", 1, 0, 'S'},      {"sums", 1, 0, 'u'},
        {"ack-bound-ms", 1, 0, 'b'}, {"replicas", 1, 0, 'r'},  {0, 0, 0, 0}};
    *o = (struct opts){.prefix = "/bex", .ack_bound_ms = 60000, .replicas = 3, .seconds = 10};
    if (argc < 2)
        usage();
    o->mode = argv[1];
    int c;
    optind = 2;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'c':
            o->cluster = optarg;
            break;
        case 'e':
            o->etcd = optarg;
            break;
        case 'p':
            o->prefix = optarg;
            break;
        case 'a':
            o->addr = optarg;
            break;
        case 't':
            o->transport = strcmp(optarg, "rdma") == 0 ? BEX_TRANSPORT_RDMA : BEX_TRANSPORT_TCP;
            break;
        case 'i':
            o->id = (unsigned)strtoul(optarg, NULL, 0);
            break;
        case 's':
            o->seconds = strtod(optarg, NULL);
            break;
        case 'S':
            o->seed = strtoull(optarg, NULL, 0);
            break;
        case 'b':
            o->ack_bound_ms = (unsigned)strtoul(optarg, NULL, 0);
            break;
        case 'r':
            o->replicas = (unsigned)strtoul(optarg, NULL, 0);
            break;
        case 'u':
            if (strcmp(o->mode, "check") == 0 && o->n_sums < MAXSUMS)
                o->sums_in[o->n_sums++] = optarg;
            else
                o->sums_out = optarg;
            break;
        default:
            usage();
        }
    }
    if ((!o->cluster && !o->etcd) || o->replicas < 1 || o->replicas > MAXREP)
        usage();
}

static void node_init(struct node *n)
{
    bex_ctx_config cc = {.transport = n->o.transport ? n->o.transport : BEX_TRANSPORT_TCP,
                         .keepalive_timeout_ms = 3000,
                         .connect_timeout_ms = 3000};
    if (n->o.addr && bex_addr_parse(n->o.addr, 0, &cc.local_addr) != 0)
        die("--addr", -EINVAL);
    int rc = bex_ctx_create(&cc, &n->ctx);
    if (rc)
        die("context", rc);
    char err[256] = "";
    if ((rc = bex_dir_create(NULL, &n->dir)))
        die("directory", rc);
    rc = n->o.etcd ? bex_dir_watch_etcd(n->dir, n->o.etcd, n->o.prefix, err, sizeof err)
                   : bex_dir_load_file(n->dir, n->o.cluster, err, sizeof err);
    if (rc) {
        fprintf(stderr, "bex_chaos_node: directory: %s\n", err);
        die("directory", rc);
    }
    n->n_shards = 2;
    if (getrandom(&n->client, sizeof n->client, 0) != sizeof n->client ||
        getrandom(n->tok, sizeof n->tok, 0) != sizeof n->tok)
        die("getrandom", -EIO);
}

/* ---- one call to one address ---- */

static bex_rpc_channel *chan(struct node *n, const bex_dir_replica *r)
{
    bex_rpc_endpoint ep = {.addr = r->addr, .transport = r->transport};
    bex_rpc_channel_config cc = {.endpoints = &ep,
                                 .n_endpoints = 1,
                                 .name = "chaos",
                                 .request_timeout_ms = 3000,
                                 .connect_timeout_ms = 2000,
                                 .max_attempts = 1};
    bex_rpc_channel *ch;
    int rc = bex_rpc_channel_create(n->ctx, &cc, &ch);
    if (rc)
        die("channel", rc);
    return ch;
}

static int call(struct node *n, bex_rpc_channel *ch, uint32_t m, const void *b, size_t len,
                void **resp, size_t *rlen)
{
    void *body = bex_rpc_alloc(n->ctx, len);
    if (!body)
        die("bex_rpc_alloc", -ENOMEM);
    memcpy(body, b, len);
    *resp = NULL;
    return bex_rpc_call_sync(ch, BEX_PS_SERVICE, m, body, len, NULL, resp, rlen);
}

/* The channel to the replica of shard s the trainer tries now: the first
 * the directory lists (a static cluster file's primary) until an attempt
 * fails, then the next (etcd mode: the primary is elected, any of them);
 * NULL while it lists none. */
static bex_rpc_channel *primary(struct node *n, uint32_t s)
{
    bex_dir_replica r[8];
    size_t nr = bex_dir_replicas(n->dir, "ps", s, r, 8);
    if (nr < 1)
        return NULL;
    const bex_dir_replica *one = &r[n->turn[s] % (nr < 8 ? nr : 8)];
    if (n->ch[s] && !bex_addr_equal(&n->ch_addr[s], &one->addr)) {
        bex_rpc_channel_destroy(n->ch[s]);
        n->ch[s] = NULL;
    }
    if (!n->ch[s]) {
        n->ch[s] = chan(n, one);
        n->ch_addr[s] = one->addr;
    }
    return n->ch[s];
}

/* ---- Pushes ---- */

/* Push keys[0..k) of table t (grads g) to shard s with the next id, the
 * same id on every attempt, until acknowledged or the bound: 0, or exits. */
static void push_acked(struct node *n, uint32_t s, uint32_t t, const uint64_t *keys, uint32_t k,
                       const float *g)
{
    struct bex__ps_hdr h = {.table = t,
                            .n = k,
                            .dim = DIM,
                            .flags = BEX__PS_F_ID,
                            .id_client = n->client,
                            .id_seq = ++n->seq,
                            .id_tok = {n->tok[0], n->tok[1]}};
    uint8_t b[BEX__PS_HDR_LEN + BEX__PS_ID_LEN + 4 * (8 + 4 * DIM)];
    bex__ps_hdr_put(b, &h);
    uint8_t *q = b + bex__ps_keys_off(&h);
    for (uint32_t i = 0; i < k; i++)
        bex__ps_put64(q + 8 * i, keys[i]);
    q += 8 * k;
    for (uint32_t i = 0; i < k * DIM; i++)
        bex__ps_putf(q + 4 * i, g[i]);
    size_t len = (size_t)(q + 4 * k * DIM - b);
    double t0 = now_ms();
    int rc = -EHOSTUNREACH, last = 0;
    while (rc) {
        bex_rpc_channel *ch = primary(n, s);
        void *resp = NULL;
        size_t rl = 0;
        n->attempts++;
        rc = ch ? call(n, ch, BEX_PS_M_PUSH, b, len, &resp, &rl) : -EHOSTUNREACH;
        bex_rpc_free(resp);
        if (rc && rc != last)
            fprintf(stderr, "chaos trainer %u: Push %llu to shard %u: %s, retrying\n", n->o.id,
                    (unsigned long long)h.id_seq, s, bex_strerror(rc));
        last = rc;
        if (rc && now_ms() - t0 > n->o.ack_bound_ms) {
            fprintf(stderr, "chaos trainer %u: Push %llu not acknowledged in %u ms\n", n->o.id,
                    (unsigned long long)h.id_seq, n->o.ack_bound_ms);
            exit(3);
        }
        if (rc) {
            n->turn[s]++;
            sleep_ms(50);
        }
    }
    unsigned long w = (unsigned long)(now_ms() - t0);
    if (w > n->max_wait_ms)
        n->max_wait_ms = w;
    n->pushes++;
    if (t == T_SGD)
        for (uint32_t i = 0; i < k; i++)
            for (uint32_t d = 0; d < DIM; d++)
                n->sums[keys[i] - KEY0][d] += (long long)g[i * DIM + d];
}

/* The keys of shard s: into out, their number returned. */
static uint32_t shard_keys(const struct node *n, uint32_t s, uint64_t *out)
{
    uint32_t k = 0;
    for (uint64_t key = KEY0; key < KEY0 + NKEYS; key++)
        if (bex_ps_key_shard(key, n->n_shards) == s)
            out[k++] = key;
    return k;
}

static void run_zero(struct node *n)
{
    for (uint32_t s = 0; s < n->n_shards; s++) {
        uint64_t keys[NKEYS];
        uint32_t nk = shard_keys(n, s, keys);
        for (uint32_t i = 0; i < nk; i++) {
            float g[DIM];
            for (uint32_t d = 0; d < DIM; d++)
                g[d] = bex_ps_init_value(T_SGD, keys[i], d, 0.01f);
            push_acked(n, s, T_SGD, &keys[i], 1, g);
        }
    }
    printf("zeroed %d SGD rows\n", NKEYS);
}

static void write_sums(const struct node *n)
{
    FILE *f = fopen(n->o.sums_out, "w");
    if (!f)
        die(n->o.sums_out, -errno);
    for (int i = 0; i < NKEYS; i++)
        for (int d = 0; d < DIM; d++)
            fprintf(f, "%u %d %lld\n", KEY0 + (unsigned)i, d, n->sums[i][d]);
    if (fclose(f))
        die(n->o.sums_out, -EIO);
}

static void run_push(struct node *n)
{
    uint64_t st = n->o.seed * 1000003u + n->o.id;
    double end = now_ms() + n->o.seconds * 1e3;
    uint64_t keys[2][NKEYS];
    uint32_t nk[2];
    for (uint32_t s = 0; s < 2; s++)
        nk[s] = shard_keys(n, s, keys[s]);
    while (now_ms() < end) {
        uint32_t s = (uint32_t)(rnd(&st) % 2), t = rnd(&st) % 2 ? T_SGD : T_ADA;
        uint32_t k = 1 + (uint32_t)(rnd(&st) % 3), first = (uint32_t)(rnd(&st) % nk[s]);
        uint64_t ks[3];
        float g[3 * DIM];
        for (uint32_t i = 0; i < k; i++)
            ks[i] = keys[s][(first + i) % nk[s]]; /* distinct: nk[s] > 3 */
        for (uint32_t i = 0; i < k * DIM; i++)
            g[i] = t == T_SGD ? (float)(1 + rnd(&st) % 4) : (float)((int)(rnd(&st) % 7) - 3);
        push_acked(n, s, t, ks, k, g);
    }
    write_sums(n);
    printf("trainer %u: %lu Pushes acknowledged, %lu attempts, longest wait %lu ms\n", n->o.id,
           n->pushes, n->attempts, n->max_wait_ms);
}

/* ---- check ---- */

static void read_sums(const char *path, long long (*sums)[DIM])
{
    FILE *f = fopen(path, "r");
    if (!f)
        die(path, -errno);
    unsigned key;
    int d;
    long long v;
    while (fscanf(f, "%u %d %lld", &key, &d, &v) == 3)
        if (key >= KEY0 && key < KEY0 + NKEYS && d >= 0 && d < DIM)
            sums[key - KEY0][d] += v;
    fclose(f);
}

/* Rows of keys[0..k) of table t at replica r of shard s into rows: 0 or
 * the error. */
static int fetch_at(struct node *n, const bex_dir_replica *r, uint32_t t, const uint64_t *keys,
                    uint32_t k, float *rows)
{
    uint8_t b[BEX__PS_HDR_LEN + 8 * NKEYS];
    bex__ps_hdr_put(b, &(struct bex__ps_hdr){.table = t, .n = k, .dim = DIM});
    for (uint32_t i = 0; i < k; i++)
        bex__ps_put64(b + BEX__PS_HDR_LEN + 8 * i, keys[i]);
    bex_rpc_channel *ch = chan(n, r);
    void *resp = NULL;
    size_t rl = 0;
    int rc = call(n, ch, BEX_PS_M_FETCH, b, BEX__PS_HDR_LEN + 8 * (size_t)k, &resp, &rl);
    if (!rc && rl != BEX__PS_HDR_LEN + 4 * (size_t)k * DIM)
        rc = -EBADMSG;
    for (size_t i = 0; !rc && i < (size_t)k * DIM; i++)
        rows[i] = bex__ps_getf((const uint8_t *)resp + BEX__PS_HDR_LEN + 4 * i);
    bex_rpc_free(resp);
    bex_rpc_channel_destroy(ch);
    return rc;
}

static unsigned bits(float f)
{
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}

/* Shard s, table t: each replica's rows against replica 0's, and SGD rows
 * against 0 less the sums. The differences found. */
static int check_table(struct node *n, uint32_t s, uint32_t t, long long (*sums)[DIM])
{
    bex_dir_replica reps[MAXREP];
    size_t nr = bex_dir_replicas(n->dir, "ps", s, reps, MAXREP);
    uint64_t keys[NKEYS];
    uint32_t k = shard_keys(n, s, keys);
    static float rows[MAXREP][NKEYS * DIM];
    int bad = 0;
    if (nr != n->o.replicas) {
        printf("shard %u: %zu replicas listed, %u expected\n", s, nr, n->o.replicas);
        return 1;
    }
    for (size_t r = 0; r < nr; r++) {
        int rc = fetch_at(n, &reps[r], t, keys, k, rows[r]);
        if (rc) {
            printf("shard %u replica %zu: Fetch: %s\n", s, r, bex_strerror(rc));
            return 1;
        }
    }
    for (uint32_t i = 0; i < k * DIM; i++) {
        uint64_t key = keys[i / DIM];
        long long sum = sums[key - KEY0][i % DIM]; /* a row no Push touched: +0 */
        float want = t != T_SGD ? rows[0][i] : sum ? -(float)sum : 0.0f;
        for (size_t r = 0; r < nr; r++)
            if (bits(rows[r][i]) != bits(want) && bad++ < 20)
                printf("shard %u replica %zu table %u key %llu col %u: %.9g (0x%08x), %s %.9g "
                       "(0x%08x)\n",
                       s, r, t, (unsigned long long)key, i % DIM, rows[r][i], bits(rows[r][i]),
                       t == T_SGD ? "acknowledged sum says" : "replica 0 has", want, bits(want));
    }
    return bad;
}

static int run_check(struct node *n)
{
    static long long sums[NKEYS][DIM];
    for (int i = 0; i < n->o.n_sums; i++)
        read_sums(n->o.sums_in[i], sums);
    int bad = 0;
    for (uint32_t s = 0; s < n->n_shards; s++)
        for (uint32_t t = T_SGD; t <= T_ADA; t++)
            bad += check_table(n, s, t, sums);
    printf("check: %s (%d SGD and %d Adagrad rows per replica, %u replicas a shard)\n",
           bad ? "FAILED" : "every row as expected", NKEYS, NKEYS, n->o.replicas);
    return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
    static struct node n;
    parse(argc, argv, &n.o);
    node_init(&n);
    int rc = 0;
    if (strcmp(n.o.mode, "zero") == 0)
        run_zero(&n);
    else if (strcmp(n.o.mode, "push") == 0 && n.o.sums_out)
        run_push(&n);
    else if (strcmp(n.o.mode, "check") == 0)
        rc = run_check(&n);
    else
        usage();
    fflush(stdout);
    for (int s = 0; s < 2; s++)
        if (n.ch[s])
            bex_rpc_channel_destroy(n.ch[s]);
    bex_dir_destroy(n.dir);
    bex_ctx_destroy(n.ctx);
    return rc;
}
