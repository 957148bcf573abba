/* SPDX-License-Identifier: Apache-2.0 */
/* Primary-backup replication with bex-ps processes (issue 29, item 1):
 * 2 shards x 2 replicas from a static cluster file, bex-ps
 * --primary-backup (replica 0 the primary of each shard). Three Pushers at
 * once on an Adagrad table through BEX_PS_PUSH_PRIMARY clients; then each
 * replica's rows, fetched from it alone, are equal bit for bit, /metrics
 * says each one's role and the same lsn, and a fan-out client's Push is
 * refused by the backups (-EPERM). */
#include <pthread.h>

#include "ps_prog.h"

#define NPUSHER 3
#define NPUSH   100

struct pusher {
    bex_ps_client *c;
    int id;
};

static void *pusher_main(void *arg)
{
    struct pusher *u = arg;
    for (int i = 0; i < NPUSH; i++) {
        uint64_t keys[6];
        float g[6 * 5];
        for (int k = 0; k < 6; k++)
            keys[k] = key_of((u->id * 5 + i * 7 + k * 3) % NK);
        for (int j = 0; j < 6 * 5; j++)
            g[j] = 0.29f * (float)((u->id + 2) * (j + 1)) / (float)(i + 5) - 0.13f;
        CHECK_OK(bex_ps_push_sync(u->c, 2, 5, keys, 6, g));
    }
    return NULL;
}

static bex_ps_client *client_mode(bex_ctx *ctx, bex_dir *d, uint32_t mode)
{
    bex_ps_client_config cc = {.dir = d,
                               .service = "ps",
                               .timeout_ms = 20000 * time_scale(),
                               .connect_timeout_ms = 15000 * time_scale(),
                               .push_mode = mode};
    bex_ps_client *pc;
    CHECK_OK(bex_ps_client_create(ctx, &cc, &pc));
    return pc;
}

static double metric_of(const char *url, const char *series)
{
    char *text;
    CHECK_EQ(http_get(url, &text), 200);
    double v = sample(text, series);
    free(text);
    return v;
}

static void push_concurrently(bex_ctx *ctx, bex_dir *d)
{
    struct pusher u[NPUSHER];
    pthread_t th[NPUSHER];
    for (int i = 0; i < NPUSHER; i++) {
        u[i] = (struct pusher){client_mode(ctx, d, BEX_PS_PUSH_PRIMARY), i};
        CHECK(pthread_create(&th[i], NULL, pusher_main, &u[i]) == 0);
    }
    for (int i = 0; i < NPUSHER; i++) {
        CHECK(pthread_join(th[i], NULL) == 0);
        bex_ps_client_destroy(u[i].c);
    }
}

static int t_adagrad(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-test-XXXXXX";
    char cluster[128], url[2][128];
    uint16_t ports[NSH][2];
    tmp_cluster(tmpl, cluster, sizeof cluster, 2, ports);
    pid_t pid[2];
    for (int r = 1; r >= 0; r--) {
        const char *args[] = {"--cluster",
                              cluster,
                              "--shard",
                              "all",
                              "--replica",
                              r ? "1" : "0",
                              "--table",
                              "2:5:adagrad:0.2",
                              "--transport",
                              "tcp",
                              "--metrics-port",
                              "0",
                              "--no-catchup",
                              "--primary-backup",
                              NULL};
        pid[r] = bex_ps_start(args, url[r], sizeof url[r]);
    }
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_file(cluster);
    push_concurrently(ctx, d);
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static float rows[2][NK * 5];
    for (int r = 0; r < 2; r++) {
        bex_dir *one = dir_of_ports(ports[0][r], ports[1][r]);
        bex_ps_client *pc = client_mode(ctx, one, BEX_PS_PUSH_ALL);
        CHECK_OK(bex_ps_fetch_sync(pc, 2, 5, keys, NK, rows[r]));
        bex_ps_client_destroy(pc);
        bex_dir_destroy(one);
    }
    CHECK(memcmp(rows[0], rows[1], sizeof rows[0]) == 0);
    for (int s = 0; s < NSH; s++) {
        char k[64];
        snprintf(k, sizeof k, "bex_ps_role{shard=\"%d\"}", s);
        CHECK(metric_of(url[0], k) == BEX_PS_ROLE_PRIMARY);
        CHECK(metric_of(url[1], k) == BEX_PS_ROLE_BACKUP);
        snprintf(k, sizeof k, "bex_ps_repl_lsn{shard=\"%d\"}", s);
        double lsn = metric_of(url[0], k);
        CHECK(lsn > 0);
        CHECK(metric_of(url[1], k) == lsn);
    }
    /* a fan-out client: the backups refuse its Pushes */
    bex_ps_client *fan = client_mode(ctx, d, BEX_PS_PUSH_ALL);
    uint64_t k1 = keys[0];
    float g[5] = {1, 1, 1, 1, 1};
    bex_ps_replica_result res[2];
    size_t nres = 0;
    CHECK(bex_ps_push_report_sync(fan, 2, 5, &k1, 1, g, res, 2, &nres) != 0);
    CHECK_EQ(nres, 2);
    CHECK_EQ(res[0].status, 0);
    CHECK_EQ(res[1].status, -EPERM);
    bex_ps_client_destroy(fan);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    for (int r = 0; r < 2; r++)
        term_bex_ps(pid[r]);
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0);
    return 0;
}

BEX_TEST_MAIN({"adagrad", t_adagrad})
