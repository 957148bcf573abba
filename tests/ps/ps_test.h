/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the parameter server's tests (test_ps.c, test_ps_repl.c): a
 * shard server in a child process (its modes: normal, a Push's answer
 * lost, Fetches held), the client side, and the reference rows computed in
 * the test. */
#ifndef BEX_TEST_PS_H
#define BEX_TEST_PS_H

#include <arpa/inet.h>
#include <math.h>
#include <sys/prctl.h>

#include "bex/dir.h"
#include "bex/ps.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"
#include "port.h"
#include "sock/child.h"

enum { SVC_T = 0x7e57, M_STATS = 1 };
#define NSH 2

static const bex_ps_table_config TABLES[] = {
    {.id = 1, .dim = 8, .optimizer = BEX_PS_SGD, .lr = 0.1f, .init_scale = 0.5f},
    {.id = 2,
     .dim = 5,
     .optimizer = BEX_PS_ADAGRAD,
     .lr = 0.2f,
     .init_scale = 0.5f,
     .adagrad_init = 0.1f,
     .adagrad_eps = 1e-6f},
};

struct srv_stats {
    bex_ps_shard_stats ps;
    bex_rpc_server_stats rpc;
};

/* ---- directories ---- */

/* A directory loaded from the JSON text j (the case fails on an error). */
static inline bex_dir *dir_from_json(const char *j)
{
    char err[256];
    bex_dir *d;
    CHECK_OK(bex_dir_create(NULL, &d));
    int rc = bex_dir_load_json(d, j, err, sizeof err);
    if (rc)
        fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    return d;
}

/* A directory of service "ps" with n shards, shard i on a[i] alone
 * (locality dc1/pod<i+1> when loc). */
static inline bex_dir *dir_of_shards(const bex_addr *a, int n, bool loc)
{
    char j[2048];
    size_t o = (size_t)snprintf(j, sizeof j, "{\"services\":{\"ps\":{\"shards\":[");
    for (int i = 0; i < n; i++) {
        char ip[INET_ADDRSTRLEN], l[48] = "";
        inet_ntop(AF_INET, &a[i].in4.sin_addr, ip, sizeof ip);
        if (loc)
            snprintf(l, sizeof l, ",\"locality\":\"dc1/pod%d\"", i + 1);
        o += (size_t)snprintf(j + o, sizeof j - o, "%s{\"replicas\":[{\"addr\":\"%s:%u\"%s}]}",
                              i ? "," : "", ip, ntohs(a[i].in4.sin_port), l);
        CHECK(o < sizeof j);
    }
    o += (size_t)snprintf(j + o, sizeof j - o, "]}}}");
    CHECK(o < sizeof j);
    return dir_from_json(j);
}

/* ---- the server child ---- */

enum {
    MODE_NORMAL, /* bex_ps_shard_register */
    MODE_DROP,   /* the first Push's answer lost (its connection closed) */
    MODE_HOLD,   /* Fetches never answered (until teardown: -ECANCELED) */
};

static struct {
    bex_ctx *ctx;
    bex_rpc_server *srv;
    bex_ps_shard *ps;
    _Atomic int pushes_seen;
    int mode;
    bex_rpc_req *held[64]; /* MODE_HOLD: Fetches never answered until teardown */
    _Atomic int n_held;
} sv;

static inline void h_wrapped(bex_rpc_req *req, void *body, size_t len, void *user)
{
    uint32_t method = (uint32_t)(uintptr_t)user;
    if (sv.mode == MODE_HOLD && method == BEX_PS_M_FETCH) {
        int i = atomic_fetch_add(&sv.n_held, 1);
        CHECK(i < 64);
        bex_rpc_free(body);
        sv.held[i] = req;
        return;
    }
    void *resp = NULL;
    size_t rlen = 0;
    int rc = bex_ps_shard_serve(sv.ps, sv.ctx, method, body, len, &resp, &rlen);
    bex_rpc_free(body);
    if (sv.mode == MODE_DROP && method == BEX_PS_M_PUSH &&
        atomic_fetch_add(&sv.pushes_seen, 1) == 0)
        bex__rpc_req_close_conn(req); /* applied, its answer lost: the client retries */
    bex_rpc_reply(req, rc, resp, rlen);
}

static inline void h_stats(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    (void)len;
    bex_rpc_free(body);
    struct srv_stats *t = bex_rpc_alloc(sv.ctx, sizeof *t);
    CHECK(t);
    bex_ps_shard_stats_get(sv.ps, &t->ps);
    bex_rpc_server_stats_get(sv.srv, &t->rpc);
    bex_rpc_reply(req, 0, t, sizeof *t);
}

struct srv_args {
    uint32_t shard;
    const char *snap;
    int mode;
};

static inline void srv_child(int wfd, int rfd, void *arg)
{
    const struct srv_args *sa = arg;
    uint32_t shard = sa->shard;
    const char *snap = sa->snap;
    int mode = sa->mode;
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    sv.mode = mode;
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config c = scaled(&base, a0);
    CHECK_OK(bex_ctx_create(&c, &sv.ctx));
    CHECK_OK(bex_rpc_server_create(sv.ctx, NULL, &sv.srv));
    bex_ps_shard_config pc = {
        .shard = shard, .n_shards = NSH, .tables = TABLES, .n_tables = 2, .snapshot_path = snap};
    CHECK_OK(bex_ps_shard_create(&pc, &sv.ps));
    if (mode != MODE_NORMAL) {
        /* the library's handlers, wrapped, with the library's flags */
        for (uint32_t m = BEX_PS_M_FETCH; m <= BEX_PS_M_PUSH; m++)
            CHECK_OK(bex_rpc_server_register(sv.srv, BEX_PS_SERVICE, m, bex__ps_method_flags(m),
                                             h_wrapped, (void *)(uintptr_t)m));
    } else {
        CHECK_OK(bex_ps_shard_register(sv.ps, sv.srv, sv.ctx));
    }
    CHECK_OK(bex_rpc_server_register(sv.srv, SVC_T, M_STATS, 0, h_stats, NULL));
    bex_addr la = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    CHECK_OK(bex_rpc_server_listen(sv.srv, &la));
    bex_addr got;
    bex_rpc_server_addr(sv.srv, &got);
    CHECK(write(wfd, &got.in4.sin_port, sizeof got.in4.sin_port) == sizeof got.in4.sin_port);
    char q;
    ssize_t r = read(rfd, &q, 1); /* until the parent says so, or is gone */
    (void)r;
    /* as bex-ps does: the server first, so nothing is applied after the
     * snapshot */
    for (int i = 0; i < atomic_load(&sv.n_held); i++)
        bex_rpc_reply(sv.held[i], -ECANCELED, NULL, 0);
    CHECK_OK(bex_rpc_server_destroy(sv.srv));
    if (snap)
        CHECK_OK(bex_ps_shard_snapshot(sv.ps, snap));
    bex_ps_shard_destroy(sv.ps);
    CHECK_OK(bex_ctx_destroy(sv.ctx));
    exit(0);
}

static inline void spawn(struct srv_proc *sp, uint32_t shard, const char *snap, int mode)
{
    struct srv_args sa = {.shard = shard, .snap = snap, .mode = mode};
    srv_spawn(sp, srv_child, &sa);
}

/* Tell a server to go; 0 when it left cleanly. */
static inline int stop(struct srv_proc *sp)
{
    return srv_stop(sp, false);
}

/* ---- the client side ---- */

static inline bex_ctx *client_ctx(void)
{
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config c = scaled(&base, a1);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

static inline bex_ps_client *client_tmo(bex_ctx *ctx, bex_dir *d, unsigned timeout_ms)
{
    bex_ps_client_config cc = {.dir = d,
                               .service = "ps",
                               .locality = "dc1/pod1",
                               .timeout_ms = timeout_ms,
                               .connect_timeout_ms = 15000 * time_scale()};
    bex_ps_client *c;
    CHECK_OK(bex_ps_client_create(ctx, &cc, &c));
    return c;
}

static inline bex_ps_client *client_of(bex_ctx *ctx, bex_dir *d)
{
    return client_tmo(ctx, d, 20000 * time_scale());
}

/* A channel straight to the server at a: its counters, raw bodies. */
static inline bex_rpc_channel *raw_chan_at(bex_ctx *ctx, bex_addr a)
{
    bex_rpc_endpoint ep = {.addr = a};
    bex_rpc_channel_config cc = {.endpoints = &ep,
                                 .n_endpoints = 1,
                                 .name = "raw",
                                 .request_timeout_ms = 20000 * time_scale(),
                                 .connect_timeout_ms = 15000 * time_scale(),
                                 .max_attempts = 1};
    bex_rpc_channel *ch;
    CHECK_OK(bex_rpc_channel_create(ctx, &cc, &ch));
    return ch;
}

/* The same to one spawned server. */
static inline bex_rpc_channel *raw_chan(bex_ctx *ctx, const struct srv_proc *sp)
{
    return raw_chan_at(ctx, sp->addr);
}

/* A thread of concurrent Pushes (ps_pusher_main): npush Pushes of 4 of
 * the keys 1000 .. 1000 + nkey - 1 to table t (dim 5, TABLES[1]), each
 * thread (id) with its own keys and gradients, so that replicas applying
 * them in different orders would differ (Adagrad). */
struct ps_pusher {
    bex_ps_client *c;
    int id;
    const bex_ps_table_config *t;
    int npush, nkey;
};

static inline void *ps_pusher_main(void *arg)
{
    struct ps_pusher *u = arg;
    CHECK(u->t->dim == 5);
    for (int i = 0; i < u->npush; i++) {
        uint64_t keys[4];
        float g[4 * 5];
        for (int k = 0; k < 4; k++)
            keys[k] = 1000 + (uint64_t)((u->id * 7 + i * 3 + k * 5) % u->nkey);
        for (int j = 0; j < 4 * 5; j++)
            g[j] = 0.37f * (float)((u->id + 1) * (j + 1)) / (float)(i + 3) - 0.21f;
        CHECK_OK(bex_ps_push_sync(u->c, u->t->id, u->t->dim, keys, 4, g));
    }
    return NULL;
}

static inline struct srv_stats stats_of(bex_rpc_channel *ch)
{
    void *resp = NULL;
    size_t len = 0;
    CHECK_OK(bex_rpc_call_sync(ch, SVC_T, M_STATS, NULL, 0, NULL, &resp, &len));
    CHECK_EQ(len, sizeof(struct srv_stats));
    struct srv_stats t;
    memcpy(&t, resp, sizeof t);
    bex_rpc_free(resp);
    return t;
}

/* The client's connections went over the transport under test (RDMA in
 * the VM: none fell back to TCP). */
static inline void transport_check(bex_ctx *ctx)
{
    bex_sock_stats st;
    bex_ctx_stats(ctx, &st);
    CHECK(st.engines > 0);
    CHECK_EQ(st.tcp_conns, pair_tcp() ? st.engines : 0);
}

/* ---- the reference ---- */

#define NK   48
#define DMAX 8

/* What a table holds per key, computed here. */
struct ref {
    const bex_ps_table_config *t;
    float w[NK][DMAX], acc[NK][DMAX];
};

static inline uint64_t key_of(int i)
{
    return 1000 + (uint64_t)i * 7919u;
}

static inline void ref_init(struct ref *r, const bex_ps_table_config *t, const uint64_t *keys)
{
    r->t = t;
    for (int i = 0; i < NK; i++)
        for (uint32_t c = 0; c < t->dim; c++) {
            r->w[i][c] = bex_ps_init_value(t->id, keys[i], c, t->init_scale);
            r->acc[i][c] = t->adagrad_init;
        }
}

/* Apply grads g (rows of dim, for key indexes idx[0..n)) in order. */
static inline void ref_push(struct ref *r, const int *idx, int n, const float *g)
{
    const bex_ps_table_config *t = r->t;
    for (int k = 0; k < n; k++)
        for (uint32_t c = 0; c < t->dim; c++) {
            float gv = g[k * t->dim + c];
            float *w = &r->w[idx[k]][c], *a = &r->acc[idx[k]][c];
            if (t->optimizer == BEX_PS_SGD) {
                *w -= t->lr * gv;
            } else {
                *a += gv * gv;
                *w -= t->lr * gv / (sqrtf(*a) + t->adagrad_eps);
            }
        }
}

/* rows (n rows of dim, for key indexes idx) match the reference. */
static inline void ref_check(const struct ref *r, const int *idx, int n, const float *rows)
{
    uint32_t d = r->t->dim;
    for (int k = 0; k < n; k++)
        for (uint32_t c = 0; c < d; c++) {
            float want = r->w[idx[k]][c], got = rows[k * d + c];
            if (!(fabsf(want - got) <= 1e-5f)) {
                fprintf(stderr, "table %u key %d col %u: %.9g, want %.9g\n", r->t->id, idx[k], c,
                        (double)got, (double)want);
                CHECK(0);
            }
        }
}

static inline void grads_of(float *g, int n, uint32_t dim, int salt)
{
    for (int k = 0; k < n; k++)
        for (uint32_t c = 0; c < dim; c++)
            g[k * dim + c] = sinf(0.37f * (float)(k * 13 + salt) + (float)c) * 0.9f;
}

/* Fetch the keys of idx[0..n) from table r->t and check them. */
static inline void fetch_check(bex_ps_client *pc, const struct ref *r, const uint64_t *keys,
                               const int *idx, int n)
{
    uint64_t k[NK * 2];
    float rows[NK * 2 * DMAX];
    for (int i = 0; i < n; i++)
        k[i] = keys[idx[i]];
    CHECK_OK(bex_ps_fetch_sync(pc, r->t->id, r->t->dim, k, (size_t)n, rows));
    ref_check(r, idx, n, rows);
}

static inline void push_ref(bex_ps_client *pc, struct ref *r, const uint64_t *keys, const int *idx,
                            int n, int salt)
{
    uint64_t k[NK * 2];
    float g[NK * 2 * DMAX];
    for (int i = 0; i < n; i++)
        k[i] = keys[idx[i]];
    grads_of(g, n, r->t->dim, salt);
    CHECK_OK(bex_ps_push_sync(pc, r->t->id, r->t->dim, k, (size_t)n, g));
    ref_push(r, idx, n, g);
}

static inline void keys_init(uint64_t *keys, int *all)
{
    int per[NSH] = {0};
    for (int i = 0; i < NK; i++) {
        keys[i] = key_of(i);
        all[i] = i;
        per[bex_ps_key_shard(keys[i], NSH)]++;
    }
    for (int s = 0; s < NSH; s++)
        CHECK(per[s] >= NK / 4); /* the requests do span both shards */
}

/* ---- files and the bex-ps program ---- */

static inline void write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f);
    CHECK(fwrite(p, 1, n, f) == n);
    CHECK(fclose(f) == 0);
}

/* n loopback TCP ports, all different, reserved for the process's life
 * (tests/port.h: a port chosen and let go can be taken before its
 * listener binds it). */
static inline void free_ports(int n, uint16_t *out)
{
    for (int i = 0; i < n; i++)
        out[i] = bex_test_port();
}

/* A loopback TCP port, reserved (tests/port.h). */
static inline uint16_t free_port(void)
{
    return bex_test_port();
}

#ifdef BEX_PS_BIN
/* Run bex-ps with argv (argv[0] included, NULL-terminated), its stdout
 * into *out; it dies with the test (no process left when a check fails). */
static inline pid_t bex_ps_spawn_piped(const char *const *argv, FILE **out)
{
    int p[2];
    CHECK(pipe(p) == 0);
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        dup2(p[1], 1);
        close(p[0]);
        close(p[1]);
        execv(BEX_PS_BIN, (char *const *)argv);
        _exit(127);
    }
    close(p[1]);
    CHECK((*out = fdopen(p[0], "r")));
    return pid;
}

/* Start bex-ps with args (after the program's name, NULL-terminated) and
 * wait for its "ready" line; the metrics URL it printed before, if any,
 * goes to url (url_cap bytes; "" when none). */
static inline pid_t bex_ps_start(const char *const *args, char *url, size_t url_cap)
{
    const char *argv[32] = {"bex-ps"};
    size_t n = 1;
    for (; args[n - 1]; n++) {
        CHECK(n < 31);
        argv[n] = args[n - 1];
    }
    argv[n] = NULL;
    if (url_cap)
        url[0] = 0;
    FILE *f;
    pid_t pid = bex_ps_spawn_piped(argv, &f);
    char line[256];
    bool ready = false;
    static const char at[] = "bex-ps: metrics at ";
    while (!ready && fgets(line, sizeof line, f)) {
        fprintf(stderr, "%s", line);
        ready = strcmp(line, "bex-ps: ready\n") == 0;
        if (url_cap && strncmp(line, at, sizeof at - 1) == 0)
            snprintf(url, url_cap, "%.*s", (int)strcspn(line + sizeof at - 1, "\n"),
                     line + sizeof at - 1);
    }
    CHECK(ready);
    fclose(f);
    return pid;
}

/* SIGTERM: bex-ps leaves with status 0 in time. */
static inline void term_bex_ps(pid_t pid)
{
    CHECK(kill(pid, SIGTERM) == 0);
    int status = 0;
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    pid_t w;
    while ((w = waitpid(pid, &status, WNOHANG)) == 0 && pair_now_ms() < end)
        pair_sleep_ms(10);
    if (w == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        CHECK(!"bex-ps did not stop on SIGTERM");
    }
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}
#endif

/* ---- a client on shard servers: the set-up the end-to-end cases share ---- */

struct ps_rig {
    struct srv_proc sp[NSH];
    int n; /* servers: shards 0..n - 1 */
    bex_ctx *ctx;
    bex_dir *d;
    bex_ps_client *pc;
};

/* n servers (1..NSH) spawned in mode, shard i on the i-th, and a client
 * over a directory of those n (locality "dc1/pod1"): 0, or pair_addrs's
 * error (nothing started). */
static inline int rig_up(struct ps_rig *g, int n, int mode)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    CHECK(n >= 1 && n <= NSH);
    bex_addr a[NSH];
    g->n = n;
    for (int s = 0; s < n; s++) {
        spawn(&g->sp[s], (uint32_t)s, NULL, mode);
        a[s] = g->sp[s].addr;
    }
    g->ctx = client_ctx();
    g->d = dir_of_shards(a, n, true);
    g->pc = client_of(g->ctx, g->d);
    return 0;
}

/* The client, its directory and context gone, then the servers told to
 * go: rc, 1 when a server did not leave cleanly. */
static inline int rig_down(struct ps_rig *g, int rc)
{
    bex_ps_client_destroy(g->pc);
    bex_dir_destroy(g->d);
    CHECK_OK(bex_ctx_destroy(g->ctx));
    for (int s = 0; s < g->n; s++)
        rc |= stop(&g->sp[s]);
    return rc ? 1 : 0;
}

/* ---- the primary-backup rig (test_ps_primary.c, test_ps_repl_batch.c):
 * one shard, PB_NREP replicas in this process, each behind its own RPC
 * server and context; replica 0 the primary, listed first ---- */
#define PB_NREP 3

struct pb {
    bex_ctx *sctx, *cctx;
    bex_ctx *bctx[PB_NREP]; /* the backups' (as processes of their own); [0] unused */
    bex_ps_shard *s[PB_NREP];
    bex_rpc_server *srv[PB_NREP];
    bex_addr addr[PB_NREP];
    bex_dir *dir;
};

static inline bex_ctx *pb_ctx_at(struct in_addr a0)
{
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config sc = scaled(&base, a0);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&sc, &ctx));
    return ctx;
}

/* Replica r's server listening at a0 (port 0: any) or, restarted, at
 * p->addr[r]. */
static inline void pb_listen(struct pb *p, int r, struct in_addr a0)
{
    if (!p->addr[r].in4.sin_port)
        p->addr[r] = (bex_addr){.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    CHECK_OK(bex_rpc_server_listen(p->srv[r], &p->addr[r]));
    bex_rpc_server_addr(p->srv[r], &p->addr[r]);
}

/* Replica r (pc) on its context (the primary's sctx, a backup's its own). */
static inline void pb_replica_start(struct pb *p, int r, struct in_addr a0,
                                    const bex_ps_shard_config *pc)
{
    bex_ctx *ctx = r ? (p->bctx[r] = pb_ctx_at(a0)) : p->sctx;
    CHECK_OK(bex_ps_shard_create(pc, &p->s[r]));
    CHECK_OK(bex_rpc_server_create(ctx, NULL, &p->srv[r]));
    CHECK_OK(bex_ps_shard_register(p->s[r], p->srv[r], ctx));
    pb_listen(p, r, a0);
}

/* The directory: the shard's replicas, the primary first. */
static inline bex_dir *pb_dir(const struct pb *p)
{
    char j[1024];
    size_t o = (size_t)snprintf(j, sizeof j, "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":[");
    for (int r = 0; r < PB_NREP; r++) {
        char ip[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &p->addr[r].in4.sin_addr, ip, sizeof ip);
        o += (size_t)snprintf(j + o, sizeof j - o, "%s{\"addr\":\"%s:%u\"}", r ? "," : "", ip,
                              ntohs(p->addr[r].in4.sin_port));
    }
    o += (size_t)snprintf(j + o, sizeof j - o, "]}]}}}");
    CHECK(o < sizeof j);
    return dir_from_json(j);
}

static inline void pb_stop(struct pb *p)
{
    for (int r = 0; r < PB_NREP; r++)
        if (p->srv[r])
            CHECK_OK(bex_rpc_server_destroy(p->srv[r]));
    for (int r = 0; r < PB_NREP; r++)
        bex_ps_shard_destroy(p->s[r]);
    bex_dir_destroy(p->dir);
    for (int r = 1; r < PB_NREP; r++)
        if (p->bctx[r])
            CHECK_OK(bex_ctx_destroy(p->bctx[r]));
    CHECK_OK(bex_ctx_destroy(p->cctx));
    CHECK_OK(bex_ctx_destroy(p->sctx));
}

static inline bex_ps_shard_stats pb_stats(bex_ps_shard *s)
{
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(s, &st);
    return st;
}

#endif
