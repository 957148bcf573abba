/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the tests that run the bex-ps program (test_ps_prog.c,
 * test_ps_catchup.c): its /metrics over HTTP (libcurl), cluster files and
 * directories on loopback ports, a local etcd, and waiting for files and
 * processes. Needs BEX_PS_BIN (ps_test.h's bex_ps_start). */
#ifndef BEX_TEST_PS_PROG_H
#define BEX_TEST_PS_PROG_H

#include <curl/curl.h>

#include "ps_test.h"

/* The table every case's bex-ps serves ("--table 1:8:sgd:0.1"). */
static const bex_ps_table_config TC = {.id = 1,
                                       .dim = 8,
                                       .optimizer = BEX_PS_SGD,
                                       .lr = 0.1f,
                                       .init_scale = 0.01f}; /* bex-ps's default scale */

/* ---- HTTP ---- */

struct body {
    char *p;
    size_t n;
};

static inline size_t on_data(char *p, size_t sz, size_t nm, void *user)
{
    struct body *b = user;
    size_t n = sz * nm;
    char *q = realloc(b->p, b->n + n + 1);
    CHECK(q);
    memcpy(q + b->n, p, n);
    b->p = q;
    b->n += n;
    b->p[b->n] = 0;
    return n;
}

/* GET url: the HTTP status, the body into *out (malloc'd, NUL-terminated). */
static inline long http_get(const char *url, char **out)
{
    CURL *c = curl_easy_init();
    CHECK(c);
    struct body b = {calloc(1, 1), 0};
    CHECK(b.p);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(10000 * time_scale()));
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    CURLcode rc = curl_easy_perform(c);
    if (rc != CURLE_OK)
        fprintf(stderr, "GET %s: %s\n", url, curl_easy_strerror(rc));
    CHECK(rc == CURLE_OK);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(c);
    *out = b.p;
    return code;
}

/* The value of the sample `series` (name and labels exactly as printed)
 * in a Prometheus text; fails the case when it is not there once. */
static inline double sample(const char *text, const char *series)
{
    size_t l = strlen(series);
    double v = 0;
    int found = 0;
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, series, l) == 0 && p[l] == ' ') {
            char *end;
            v = strtod(p + l + 1, &end);
            CHECK(end != p + l + 1 && (*end == '\n' || *end == 0));
            found++;
        }
    if (found != 1)
        fprintf(stderr, "%s: %d samples\n", series, found);
    CHECK_EQ(found, 1);
    return v;
}

/* ---- cluster files and directories ---- */

/* NSH shards x `replicas` on free loopback ports; the ports into
 * ports[s][r] (may be NULL). */
static inline void cluster_file(const char *path, int replicas, uint16_t (*ports)[2])
{
    char j[1024];
    uint16_t all[NSH * 2];
    CHECK(replicas >= 1 && replicas <= 2);
    free_ports(NSH * replicas, all);
    size_t o = (size_t)snprintf(j, sizeof j, "{\"version\":1,\"services\":{\"ps\":{\"shards\":[");
    for (int s = 0; s < NSH; s++) {
        o += (size_t)snprintf(j + o, sizeof j - o, "%s{\"replicas\":[", s ? "," : "");
        for (int r = 0; r < replicas; r++) {
            uint16_t port = all[s * replicas + r];
            if (ports)
                ports[s][r] = port;
            o += (size_t)snprintf(
                j + o, sizeof j - o,
                "%s{\"addr\":\"127.0.0.1:%u\",\"transport\":\"tcp\",\"locality\":\"dc1/pod%d\"}",
                r ? "," : "", port, r + 1);
        }
        o += (size_t)snprintf(j + o, sizeof j - o, "]}");
    }
    o += (size_t)snprintf(j + o, sizeof j - o, "]}}}\n");
    CHECK(o < sizeof j);
    write_file(path, j, o);
}

/* mkdtemp(tmpl), and in it cluster.json (its path into cluster, cap bytes)
 * as cluster_file writes it. */
static inline void tmp_cluster(char *tmpl, char *cluster, size_t cap, int replicas,
                               uint16_t (*ports)[2])
{
    CHECK(mkdtemp(tmpl));
    snprintf(cluster, cap, "%s/cluster.json", tmpl);
    cluster_file(cluster, replicas, ports);
}

/* A directory loaded from the cluster file at path. */
static inline bex_dir *dir_of_file(const char *path)
{
    bex_dir *d;
    char err[256];
    CHECK_OK(bex_dir_create(NULL, &d));
    CHECK_OK(bex_dir_load_file(d, path, err, sizeof err));
    return d;
}

/* A directory of one replica per shard: shard 0 at port p0, shard 1 at p1
 * (host order). */
static inline bex_dir *dir_of_ports(uint16_t p0, uint16_t p1)
{
    char j[512], err[256];
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":["
             "{\"replicas\":[{\"addr\":\"127.0.0.1:%u\",\"transport\":\"tcp\"}]},"
             "{\"replicas\":[{\"addr\":\"127.0.0.1:%u\",\"transport\":\"tcp\"}]}]}}}",
             p0, p1);
    bex_dir *d;
    CHECK_OK(bex_dir_create(NULL, &d));
    CHECK_OK(bex_dir_load_json(d, j, err, sizeof err));
    return d;
}

/* A client of the replicated cases: locality dc1/pod1 (replica 0 first),
 * short deadlines (a replica down fails its part soon); n_shards 0: the
 * directory's. */
static inline bex_ps_client *client_short(bex_ctx *ctx, bex_dir *d, uint32_t n_shards)
{
    bex_ps_client_config cc = {.dir = d,
                               .service = "ps",
                               .n_shards = n_shards,
                               .locality = "dc1/pod1",
                               .timeout_ms = 5000 * time_scale(),
                               .connect_timeout_ms = 2000 * time_scale()};
    bex_ps_client *pc;
    CHECK_OK(bex_ps_client_create(ctx, &cc, &pc));
    return pc;
}

/* Wait until d lists want replicas of shard (10 s, scaled). */
static inline void wait_replicas(bex_dir *d, uint32_t shard, size_t want)
{
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    while (bex_dir_replicas(d, "ps", shard, NULL, 0) != want && pair_now_ms() < end)
        pair_sleep_ms(10);
    CHECK_EQ(bex_dir_replicas(d, "ps", shard, NULL, 0), want);
}

/* ---- files and processes ---- */

static inline void snap_path(char *p, size_t cap, const char *dir, int shard, int r)
{
    snprintf(p, cap, "%s/ps-shard%d-replica%d.snap", dir, shard, r);
}

/* Wait until path exists (10 s, scaled). */
static inline void wait_file(const char *path)
{
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    while (access(path, R_OK) != 0 && pair_now_ms() < end)
        pair_sleep_ms(5);
    CHECK(access(path, R_OK) == 0);
}

static inline void kill9(pid_t pid)
{
    CHECK(kill(pid, SIGKILL) == 0);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
}

/* ---- etcd ---- */

static char etcd_dir[64];
static pid_t etcd_pid;

static inline void etcd_rm(void)
{
    if (!etcd_dir[0])
        return;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", etcd_dir);
    int rc = system(cmd);
    (void)rc;
    etcd_dir[0] = 0;
}

/* atexit, in the test's process: etcd stopped and its files gone, also
 * after a failed check (bex-ps children go by PR_SET_PDEATHSIG) */
static pid_t etcd_main_pid;
static inline void etcd_cleanup(void)
{
    if (getpid() != etcd_main_pid)
        return;
    if (etcd_pid > 0) {
        kill(etcd_pid, SIGTERM);
        waitpid(etcd_pid, NULL, 0);
        etcd_pid = 0;
    }
    etcd_rm();
}

/* A local etcd (BEX_ETCD or etcd in PATH; scripts/deps has etcd-server) on
 * free loopback ports, data in a temporary directory, answering /health
 * before this returns; its client URL into url. */
static inline void etcd_start(char *url, size_t cap)
{
    etcd_main_pid = getpid();
    atexit(etcd_cleanup);
    snprintf(etcd_dir, sizeof etcd_dir, "/tmp/bex-ps-etcd-XXXXXX");
    CHECK(mkdtemp(etcd_dir));
    uint16_t cp = free_port(), pp = free_port();
    while (pp == cp)
        pp = free_port();
    char cu[64], peer_url[64], cl[96], dd[96], lg[96];
    snprintf(cu, sizeof cu, "http://127.0.0.1:%u", cp);
    snprintf(peer_url, sizeof peer_url, "http://127.0.0.1:%u", pp);
    snprintf(cl, sizeof cl, "t=%s", peer_url);
    snprintf(dd, sizeof dd, "%s/data", etcd_dir);
    snprintf(lg, sizeof lg, "%s/log", etcd_dir);
    const char *bin = getenv("BEX_ETCD") ? getenv("BEX_ETCD") : "etcd";
    fflush(NULL);
    etcd_pid = fork();
    CHECK(etcd_pid >= 0);
    if (etcd_pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (!freopen(lg, "a", stdout))
            _exit(126);
        dup2(STDOUT_FILENO, STDERR_FILENO);
        execlp(bin, bin, "--name", "t", "--data-dir", dd, "--listen-client-urls", cu,
               "--advertise-client-urls", cu, "--listen-peer-urls", peer_url,
               "--initial-advertise-peer-urls", peer_url, "--initial-cluster", cl, "--log-level",
               "warn", (char *)NULL);
        _exit(127);
    }
    snprintf(url, cap, "%s", cu);
    char health[96];
    snprintf(health, sizeof health, "%s/health", cu);
    uint64_t end = pair_now_ms() + 30000ull * time_scale();
    for (;;) {
        int st;
        if (waitpid(etcd_pid, &st, WNOHANG) == etcd_pid) {
            etcd_pid = 0;
            fprintf(stderr, "FAIL: %s did not start (install etcd-server: scripts/deps)\n", bin);
            CHECK(0);
        }
        CURL *c = curl_easy_init();
        CHECK(c);
        curl_easy_setopt(c, CURLOPT_URL, health);
        curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
        curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 1000L);
        curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
        struct body b = {NULL, 0};
        curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
        long code = 0;
        if (curl_easy_perform(c) == CURLE_OK)
            curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
        curl_easy_cleanup(c);
        free(b.p);
        if (code == 200)
            break;
        CHECK(pair_now_ms() < end);
        pair_sleep_ms(50);
    }
}

#endif
