/* SPDX-License-Identifier: Apache-2.0 */
/* bex-ps's consistent cuts as an operator runs them (issue 29 item 3;
 * docs/configuration.md, "bex-ps"), natively over TCP on loopback:
 *
 * program: a bex-ps serving two shards with --cut-dir; Pushes; `bex-ps
 *   snapshot` prints a full cut; more Pushes; a second, incremental; the
 *   process stopped, started again with --restore-cut of the second: every
 *   row Fetched equals what it was before the stop; /metrics counts the
 *   cuts and shows their age. A cut of a cluster whose bex-ps has no
 *   --cut-dir fails (exit 1).
 * join: two replicas of two shards (--primary-backup) in use; a third
 *   started with --join from a cluster file that lists it joins each
 *   shard's primary; after more Pushes all three applied the same lsn and
 *   the primary counts no lag for it. */
#include <sys/stat.h>
#include <sys/wait.h>

#include "ps_prog.h"

/* `bex-ps snapshot --cluster cluster`: its exit status, its line in out. */
static int snapshot_cmd(const char *cluster, char *out, size_t cap)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s snapshot --cluster %s 2>&1", BEX_PS_BIN, cluster);
    FILE *f = popen(cmd, "r");
    CHECK(f);
    out[0] = 0;
    if (!fgets(out, (int)cap, f))
        out[0] = 0;
    fprintf(stderr, "%s", out);
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static pid_t start_url(const char *cluster, const char *dir, const char *restore, char *url)
{
    const char *args[] = {"--cluster",
                          cluster,
                          "--shard",
                          "all",
                          "--transport",
                          "tcp",
                          "--table",
                          "1:8:sgd:0.1",
                          "--metrics-port",
                          "0",
                          "--cut-dir",
                          dir,
                          restore ? "--restore-cut" : NULL,
                          restore,
                          NULL};
    return bex_ps_start(args, url, 128);
}

static pid_t start(const char *cluster, const char *dir, const char *restore)
{
    const char *args[] = {"--cluster",
                          cluster,
                          "--shard",
                          "all",
                          "--transport",
                          "tcp",
                          "--table",
                          "1:8:sgd:0.1",
                          dir ? "--cut-dir" : NULL,
                          dir,
                          restore ? "--restore-cut" : NULL,
                          restore,
                          NULL};
    return bex_ps_start(args, NULL, 0);
}

static void fetch_all(bex_dir *d, float *rows, const uint64_t *keys, size_t n)
{
    bex_ctx *ctx = client_ctx();
    bex_ps_client *c = client_of(ctx, d);
    CHECK_OK(bex_ps_fetch_sync(c, TC.id, TC.dim, keys, n, rows));
    bex_ps_client_destroy(c);
    CHECK_OK(bex_ctx_destroy(ctx));
}

static void push_all(bex_dir *d, const uint64_t *keys, size_t n, float g)
{
    bex_ctx *ctx = client_ctx();
    bex_ps_client *c = client_of(ctx, d);
    float gr[32 * 8];
    for (size_t i = 0; i < n * 8; i++)
        gr[i] = g;
    CHECK_OK(bex_ps_push_sync(c, TC.id, TC.dim, keys, n, gr));
    bex_ps_client_destroy(c);
    CHECK_OK(bex_ctx_destroy(ctx));
}

static int t_program(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-snap-XXXXXX";
    char cluster[128], cuts[160], line[256];
    uint16_t ports[NSH][2];
    tmp_cluster(tmpl, cluster, sizeof cluster, 1, ports);
    snprintf(cuts, sizeof cuts, "%s/cuts", tmpl);
    CHECK(mkdir(cuts, 0700) == 0);
    bex_dir *d = dir_of_file(cluster);
    uint64_t keys[24];
    for (int i = 0; i < 24; i++)
        keys[i] = 500 + (uint64_t)i;
    /* no --cut-dir: refused */
    pid_t pid = start(cluster, NULL, NULL);
    CHECK_EQ(snapshot_cmd(cluster, line, sizeof line), 1);
    CHECK(strstr(line, "not supported") || strstr(line, "Operation not supported"));
    term_bex_ps(pid);
    char url[128], *text;
    pid = start_url(cluster, cuts, NULL, url);
    push_all(d, keys, 24, 2.0f);
    CHECK_EQ(snapshot_cmd(cluster, line, sizeof line), 0);
    CHECK(strstr(line, "2 shards (2 full)"));
    push_all(d, keys, 5, 1.0f);
    pair_sleep_ms(150); /* cut_min_interval_ms: 100 */
    CHECK_EQ(snapshot_cmd(cluster, line, sizeof line), 0);
    CHECK(strstr(line, "2 shards (0 full), 5 rows"));
    unsigned long long id = 0;
    CHECK(sscanf(line, "cut %llu:", &id) == 1 && id);
    CHECK_EQ(http_get(url, &text), 200);
    CHECK_EQ(sample(text, "bex_ps_snapshots_total{shard=\"1\"}"), 2);
    double age = sample(text, "bex_ps_snapshot_age_seconds{shard=\"1\"}");
    CHECK(age >= 0 && age < 60);
    sample(text, "bex_ps_snapshot_duration_seconds{shard=\"0\"}");
    sample(text, "bex_ps_failovers_total{shard=\"0\"}");
    free(text);
    float before[24 * 8], after[24 * 8];
    fetch_all(d, before, keys, 24);
    term_bex_ps(pid);
    char ids[32];
    snprintf(ids, sizeof ids, "%llu", id);
    pid = start(cluster, cuts, ids);
    fetch_all(d, after, keys, 24);
    CHECK(memcmp(before, after, sizeof before) == 0);
    term_bex_ps(pid);
    bex_dir_destroy(d);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpl);
    CHECK(system(cmd) == 0);
    return 0;
}

/* ---- join ---- */

/* NSH shards x n replicas at ports[s][0..n) (127.0.0.1, tcp). */
static void cluster_n(const char *path, int n, uint16_t (*ports)[3])
{
    char j[2048];
    size_t o = (size_t)snprintf(j, sizeof j, "{\"services\":{\"ps\":{\"shards\":[");
    for (int sh = 0; sh < NSH; sh++) {
        o += (size_t)snprintf(j + o, sizeof j - o, "%s{\"replicas\":[", sh ? "," : "");
        for (int r = 0; r < n; r++)
            o += (size_t)snprintf(j + o, sizeof j - o,
                                  "%s{\"addr\":\"127.0.0.1:%u\",\"transport\":\"tcp\"}",
                                  r ? "," : "", ports[sh][r]);
        o += (size_t)snprintf(j + o, sizeof j - o, "]}");
    }
    o += (size_t)snprintf(j + o, sizeof j - o, "]}}}\n");
    CHECK(o < sizeof j);
    write_file(path, j, o);
}

static pid_t start_pb(const char *cluster, const char *replica, bool join, char *url)
{
    const char *args[] = {"--cluster",
                          cluster,
                          "--shard",
                          "all",
                          "--replica",
                          replica,
                          "--transport",
                          "tcp",
                          "--table",
                          "1:8:sgd:0.1",
                          "--metrics-port",
                          "0",
                          "--primary-backup",
                          join ? "--join" : "--no-catchup",
                          NULL};
    return bex_ps_start(args, url, 128);
}

static void push_primary(bex_dir *d, int n)
{
    bex_ctx *ctx = client_ctx();
    bex_ps_client_config cc = {.dir = d,
                               .timeout_ms = 20000 * time_scale(),
                               .connect_timeout_ms = 15000 * time_scale(),
                               .push_mode = BEX_PS_PUSH_PRIMARY};
    bex_ps_client *c;
    CHECK_OK(bex_ps_client_create(ctx, &cc, &c));
    for (int i = 0; i < n; i++) {
        uint64_t keys[4] = {(uint64_t)i, (uint64_t)i + 100, 7, 8};
        float g[4 * 8];
        for (int k = 0; k < 32; k++)
            g[k] = (float)(k % 5) - 2.0f;
        CHECK_OK(bex_ps_push_sync(c, TC.id, TC.dim, keys, 4, g));
    }
    bex_ps_client_destroy(c);
    CHECK_OK(bex_ctx_destroy(ctx));
}

/* A third replica joins a running primary-backup bex-ps (--join) while it
 * is in use: afterwards every replica has applied the same lsn of each
 * shard, and the primary counts no lag for it. */
static int t_join(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-join-XXXXXX", c2[128], c3[128], url[3][128], *text;
    CHECK(mkdtemp(tmpl));
    snprintf(c2, sizeof c2, "%s/two.json", tmpl);
    snprintf(c3, sizeof c3, "%s/three.json", tmpl);
    uint16_t ports[NSH][3], all[NSH * 3];
    free_ports(NSH * 3, all);
    for (int i = 0; i < NSH * 3; i++)
        ports[i / 3][i % 3] = all[i];
    cluster_n(c2, 2, ports);
    cluster_n(c3, 3, ports);
    pid_t pid[3];
    pid[1] = start_pb(c2, "1", false, url[1]);
    pid[0] = start_pb(c2, "0", false, url[0]);
    bex_dir *d = dir_of_file(c2);
    push_primary(d, 20);
    pid[2] = start_pb(c3, "2", true, url[2]); /* ready: it joined */
    push_primary(d, 20);
    for (int sh = 0; sh < NSH; sh++) {
        char series[64];
        snprintf(series, sizeof series, "bex_ps_repl_lsn{shard=\"%d\"}", sh);
        double lsn[3];
        for (int r = 0; r < 3; r++) {
            CHECK_EQ(http_get(url[r], &text), 200);
            lsn[r] = sample(text, series);
            if (r == 0) {
                char lag[96];
                snprintf(lag, sizeof lag, "bex_ps_replica_lag_pushes{shard=\"%d\",backup=\"1\"}",
                         sh);
                CHECK_EQ(sample(text, lag), 0);
            }
            free(text);
        }
        printf("shard %d: lsn %g, %g, %g\n", sh, lsn[0], lsn[1], lsn[2]);
        CHECK(lsn[0] > 0 && lsn[0] == lsn[1] && lsn[0] == lsn[2]);
    }
    for (int r = 2; r >= 0; r--)
        term_bex_ps(pid[r]);
    bex_dir_destroy(d);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpl);
    CHECK(system(cmd) == 0);
    return 0;
}

BEX_TEST_MAIN({"program", t_program}, {"join", t_join})
