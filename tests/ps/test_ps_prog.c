/* SPDX-License-Identifier: Apache-2.0 */
/* The bex-ps program (tools/ps/bex-ps.c) as a process, over TCP on
 * loopback addresses: its Prometheus /metrics endpoint (fetched with
 * libcurl) counts what was served; a replica stopped with SIGTERM and
 * started again serves the rows it had (its snapshot), while the other
 * replica went on. */
#include <fcntl.h>
#include <sys/wait.h>

#include "ps_prog.h"

/* Each metric family's HELP and TYPE once, its samples right after them
 * (not spread: a scraper refuses a family seen twice). */
static void families_once(const char *text)
{
    char seen[256][96];
    int n = 0;
    char cur[96] = "";
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        char name[96];
        if (strncmp(p, "# TYPE ", 7) == 0) {
            CHECK(sscanf(p + 7, "%95s", name) == 1);
            for (int i = 0; i < n; i++)
                if (strcmp(seen[i], name) == 0) {
                    fprintf(stderr, "family %s twice\n", name);
                    CHECK(0);
                }
            CHECK(n < 256);
            snprintf(seen[n++], sizeof seen[0], "%s", name);
            snprintf(cur, sizeof cur, "%s", name);
        } else if (*p != '#' && *p != '\n') {
            /* a sample of the current family (a histogram's with a suffix) */
            CHECK(cur[0] && strncmp(p, cur, strlen(cur)) == 0);
        }
    }
    CHECK(n >= 10);
}

/* bex-ps --metrics-port 0: /metrics answers 200 with each family once;
 * after 3 Pushes and 2 Fetches through the client the per-table counters,
 * rows, the shard's and the RPC server's latency histograms moved by what
 * the test sent (counted per shard here); another path is 404. */
static int t_metrics(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-test-XXXXXX";
    char cluster[128], url[128];
    tmp_cluster(tmpl, cluster, sizeof cluster, 1, NULL);
    const char *args[] = {"--cluster",   cluster, "--shard",        "all", "--table", "1:8:sgd:0.1",
                          "--transport", "tcp",   "--metrics-port", "0",   NULL};
    pid_t pid = bex_ps_start(args, url, sizeof url);
    CHECK(strncmp(url, "http://127.0.0.1:", 17) == 0);
    char *text;
    CHECK_EQ(http_get(url, &text), 200);
    families_once(text);
    for (int s = 0; s < NSH; s++) {
        char k[160];
        snprintf(k, sizeof k, "bex_ps_pushes_total{shard=\"%d\",table=\"1\"}", s);
        CHECK(sample(text, k) == 0);
        snprintf(k, sizeof k, "bex_ps_rows{shard=\"%d\",table=\"1\"}", s);
        CHECK(sample(text, k) == 0);
    }
    free(text);

    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_file(cluster);
    bex_ps_client *pc = client_of(ctx, d);
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static struct ref r;
    ref_init(&r, &TC, keys);
    unsigned per[NSH] = {0};
    for (int i = 0; i < NK / 2; i++)
        per[bex_ps_key_shard(keys[i], NSH)]++;
    unsigned per_all[NSH] = {0};
    for (int i = 0; i < NK; i++)
        per_all[bex_ps_key_shard(keys[i], NSH)]++;
    /* 3 Pushes of all keys, 2 Fetches of the first half */
    for (int i = 0; i < 3; i++)
        push_ref(pc, &r, keys, all, NK, 60 + i);
    static float rows[NK * DMAX];
    for (int i = 0; i < 2; i++) {
        CHECK_OK(bex_ps_fetch_sync(pc, 1, 8, keys, NK / 2, rows));
        ref_check(&r, all, NK / 2, rows);
    }
    CHECK_EQ(http_get(url, &text), 200);
    families_once(text);
    for (int s = 0; s < NSH; s++) {
        char k[200];
        snprintf(k, sizeof k, "bex_ps_pushes_total{shard=\"%d\",table=\"1\"}", s);
        CHECK(sample(text, k) == 3);
        snprintf(k, sizeof k, "bex_ps_rows_pushed_total{shard=\"%d\",table=\"1\"}", s);
        CHECK(sample(text, k) == 3.0 * per_all[s]);
        snprintf(k, sizeof k, "bex_ps_fetches_total{shard=\"%d\",table=\"1\"}", s);
        CHECK(sample(text, k) == (per[s] ? 2 : 0));
        snprintf(k, sizeof k, "bex_ps_rows_fetched_total{shard=\"%d\",table=\"1\"}", s);
        CHECK(sample(text, k) == 2.0 * per[s]);
        snprintf(k, sizeof k, "bex_ps_rows{shard=\"%d\",table=\"1\"}", s);
        CHECK(sample(text, k) == per_all[s]);
        snprintf(k, sizeof k, "bex_ps_malformed_total{shard=\"%d\"}", s);
        CHECK(sample(text, k) == 0);
        /* the shard's histogram: every Push counted, +Inf is the count */
        snprintf(k, sizeof k,
                 "bex_ps_serve_seconds_count{shard=\"%d\",table=\"1\",method=\"push\"}", s);
        CHECK(sample(text, k) == 3);
        snprintf(
            k, sizeof k,
            "bex_ps_serve_seconds_bucket{shard=\"%d\",table=\"1\",method=\"push\",le=\"+Inf\"}", s);
        CHECK(sample(text, k) == 3);
        snprintf(k, sizeof k, "bex_ps_serve_seconds_sum{shard=\"%d\",table=\"1\",method=\"push\"}",
                 s);
        CHECK(sample(text, k) > 0);
        /* the RPC server's: Push is method 2 of service 0x5053 */
        snprintf(k, sizeof k,
                 "bex_rpc_server_method_answered_total{server=\"shard%d\",service=\"%u\","
                 "method=\"%u\"}",
                 s, BEX_PS_SERVICE, BEX_PS_M_PUSH);
        CHECK(sample(text, k) == 3);
        snprintf(k, sizeof k,
                 "bex_rpc_server_latency_seconds_count{server=\"shard%d\",service=\"%u\","
                 "method=\"%u\"}",
                 s, BEX_PS_SERVICE, BEX_PS_M_PUSH);
        CHECK(sample(text, k) == 3);
        snprintf(k, sizeof k,
                 "bex_rpc_server_latency_seconds_bucket{server=\"shard%d\",service=\"%u\","
                 "method=\"%u\",le=\"17.179869184\"}",
                 s, BEX_PS_SERVICE, BEX_PS_M_PUSH);
        CHECK(sample(text, k) == 3); /* none took 17 s */
        snprintf(k, sizeof k, "bex_rpc_server_requests_total{server=\"shard%d\"}", s);
        CHECK(sample(text, k) == 3 + (per[s] ? 2 : 0));
    }
    free(text);
    char other[160];
    snprintf(other, sizeof other, "%.*s/other", (int)(strlen(url) - strlen("/metrics")), url);
    CHECK_EQ(http_get(other, &text), 404);
    free(text);
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    term_bex_ps(pid);
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0);
    return 0;
}

/* Two bex-ps processes, replica 0 and replica 1 of both shards: Pushes
 * reach both; replica 1 is stopped with SIGTERM (its snapshots written)
 * while replica 0 goes on serving Fetches and Pushes (their reports name
 * replica 1 as failed); replica 1 started again serves the rows it had
 * at SIGTERM, bit for bit (not the Push it missed: without catch-up a
 * replica is not brought up to date by its peers, and the client that
 * kept the Push for it is gone). */
static int t_replica_restart(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-test-XXXXXX";
    char cluster[128];
    tmp_cluster(tmpl, cluster, sizeof cluster, 2, NULL);
    pid_t pid[2];
    for (int rp = 0; rp < 2; rp++) {
        const char *args[] = {
            "--cluster",      cluster,   "--shard",      "all",         "--replica",
            rp ? "1" : "0",   "--table", "1:8:sgd:0.1",  "--transport", "tcp",
            "--snapshot-dir", tmpl,      "--no-catchup", NULL};
        /* replica 0 first, alone: no catch-up (it would wait its deadline
         * for replica 1, each shard); replica 1 catches up with it */
        if (rp)
            args[12] = NULL;
        pid[rp] = bex_ps_start(args, NULL, 0);
    }
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_file(cluster);
    bex_ps_client *pc = client_short(ctx, d, 0);
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static struct ref r;
    ref_init(&r, &TC, keys);
    for (int i = 0; i < 2; i++)
        push_ref(pc, &r, keys, all, NK, 70 + i);
    /* the rows at SIGTERM, as replica 1 holds them */
    static float had[NK * DMAX], now[NK * DMAX];
    CHECK_OK(bex_ps_fetch_sync(pc, 1, 8, keys, NK, had));
    ref_check(&r, all, NK, had);
    term_bex_ps(pid[1]);
    for (int s = 0; s < NSH; s++) {
        char p[192];
        snap_path(p, sizeof p, tmpl, s, 1);
        CHECK(access(p, R_OK) == 0);
    }
    /* replica 0 alone: Fetches served, a Push's report names replica 1 */
    fetch_check(pc, &r, keys, all, NK);
    uint64_t k[NK];
    static float g[NK * DMAX];
    memcpy(k, keys, sizeof k);
    grads_of(g, NK, 8, 80);
    bex_ps_replica_result res[8];
    size_t nres = 0;
    int rc = bex_ps_push_report_sync(pc, 1, 8, k, NK, g, res, 8, &nres);
    CHECK(rc != 0);
    CHECK_EQ(nres, 4);
    bex_dir_replica reps[2];
    for (size_t i = 0; i < nres; i++) {
        CHECK_EQ(bex_dir_replicas(d, "ps", res[i].shard, reps, 2), 2);
        int is_r1 = res[i].addr.in4.sin_port == reps[1].addr.in4.sin_port;
        CHECK_EQ(is_r1, (int)(i % 2));
        CHECK(is_r1 ? res[i].status != 0 : res[i].status == 0);
    }
    /* the failed parts are kept for replica 1, one a shard (client_keep.c),
     * to send again once it answers: the client goes first, so that they
     * are not (a client destroyed with Pushes kept drops them) */
    bex_ps_client_stats cs;
    bex_ps_client_stats_get(pc, &cs);
    CHECK_EQ(cs.push_kept, NSH);
    bex_ps_client_destroy(pc);
    /* replica 1 back without catch-up: the rows it had (not replica 0's,
     * which moved on; test_ps_catchup has the default) */
    const char *args[] = {"--cluster",    cluster, "--shard",        "all",
                          "--replica",    "1",     "--table",        "1:8:sgd:0.1",
                          "--transport",  "tcp",   "--snapshot-dir", tmpl,
                          "--no-catchup", NULL};
    pid[1] = bex_ps_start(args, NULL, 0);
    {
        bex_dir_replica r0[2], r1[2];
        CHECK_EQ(bex_dir_replicas(d, "ps", 0, r0, 2), 2);
        CHECK_EQ(bex_dir_replicas(d, "ps", 1, r1, 2), 2);
        bex_dir *d1 = dir_of_ports(ntohs(r0[1].addr.in4.sin_port), ntohs(r1[1].addr.in4.sin_port));
        bex_ps_client *p1 = client_of(ctx, d1);
        CHECK_OK(bex_ps_fetch_sync(p1, 1, 8, keys, NK, now));
        CHECK(memcmp(had, now, sizeof had) == 0);
        bex_ps_client_destroy(p1);
        bex_dir_destroy(d1);
    }
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    for (int rp = 0; rp < 2; rp++)
        term_bex_ps(pid[rp]);
    for (int rp = 0; rp < 2; rp++)
        for (int s = 0; s < NSH; s++) {
            char p[192];
            snap_path(p, sizeof p, tmpl, s, rp);
            CHECK(unlink(p) == 0);
        }
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0); /* nothing else left behind (no .tmp) */
    return 0;
}

/* bex-ps --snapshot-every 100: after Pushes, the snapshots are written
 * again by themselves (each removed twice and back twice: the second was
 * begun after the Pushes); killed with -9 (no snapshot at exit) and
 * started again, it serves the rows it had, bit for bit. */
static int t_snapshot_every(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-test-XXXXXX";
    char cluster[128];
    tmp_cluster(tmpl, cluster, sizeof cluster, 1, NULL);
    const char *args[] = {
        "--cluster",   cluster, "--shard",        "all", "--table",          "1:8:sgd:0.1",
        "--transport", "tcp",   "--snapshot-dir", tmpl,  "--snapshot-every", "100",
        NULL};
    pid_t pid = bex_ps_start(args, NULL, 0);
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_file(cluster);
    bex_ps_client *pc = client_of(ctx, d);
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static struct ref r;
    ref_init(&r, &TC, keys);
    for (int i = 0; i < 3; i++)
        push_ref(pc, &r, keys, all, NK, 90 + i);
    static float had[NK * DMAX], now[NK * DMAX];
    CHECK_OK(bex_ps_fetch_sync(pc, 1, 8, keys, NK, had));
    ref_check(&r, all, NK, had);
    char snap[NSH][192];
    for (int round = 0; round < 2; round++)
        for (int s = 0; s < NSH; s++) {
            snap_path(snap[s], sizeof snap[s], tmpl, s, 0);
            wait_file(snap[s]);
            CHECK(unlink(snap[s]) == 0);
            wait_file(snap[s]);
        }
    bex_ps_client_destroy(pc);
    kill9(pid);
    const char *args2[] = {"--cluster",      cluster,       "--shard",     "all",
                           "--table",        "1:8:sgd:0.1", "--transport", "tcp",
                           "--snapshot-dir", tmpl,          NULL};
    pid = bex_ps_start(args2, NULL, 0);
    pc = client_of(ctx, d);
    CHECK_OK(bex_ps_fetch_sync(pc, 1, 8, keys, NK, now));
    CHECK(memcmp(had, now, sizeof had) == 0);
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    term_bex_ps(pid);
    for (int s = 0; s < NSH; s++)
        CHECK(unlink(snap[s]) == 0);
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0); /* nothing else left behind (no .tmp) */
    return 0;
}

/* Two bex-ps started with --etcd (shard 0 and shard 1, ports picked,
 * lease TTL 30 s) register; a client's directory watching etcd finds both
 * (address and locality), and Pushes and Fetches through it match the
 * reference; shard 1's bex-ps stopped with SIGTERM deregisters: its entry
 * goes within 5 s (well before the lease's 30 s), shard 0's stays. */
static int t_etcd(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char url[96];
    etcd_start(url, sizeof url);
    pid_t pid[NSH];
    for (int s = 0; s < NSH; s++) {
        const char *args[] = {"--etcd", url,       "--listen",    "127.0.0.1",   "--n-shards",
                              "2",      "--shard", s ? "1" : "0", "--locality",  "dc1/pod7",
                              "--ttl",  "30",      "--table",     "1:8:sgd:0.1", "--transport",
                              "tcp",    NULL};
        pid[s] = bex_ps_start(args, NULL, 0);
    }
    bex_dir *d;
    char err[256] = "";
    CHECK_OK(bex_dir_create(NULL, &d));
    int rc = bex_dir_watch_etcd(d, url, NULL, err, sizeof err);
    if (rc)
        fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    for (uint32_t s = 0; s < NSH; s++) {
        wait_replicas(d, s, 1);
        bex_dir_replica rp;
        CHECK_EQ(bex_dir_replicas(d, "ps", s, &rp, 1), 1);
        CHECK(strcmp(rp.locality, "dc1/pod7") == 0);
        CHECK(rp.addr.in4.sin_addr.s_addr == htonl(INADDR_LOOPBACK) && rp.addr.in4.sin_port != 0);
    }
    bex_ctx *ctx = client_ctx();
    bex_ps_client_config cc = {.dir = d,
                               .service = "ps",
                               .n_shards = NSH,
                               .timeout_ms = 20000 * time_scale(),
                               .connect_timeout_ms = 15000 * time_scale()};
    bex_ps_client *pc;
    CHECK_OK(bex_ps_client_create(ctx, &cc, &pc));
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static struct ref r;
    ref_init(&r, &TC, keys);
    for (int i = 0; i < 2; i++)
        push_ref(pc, &r, keys, all, NK, 100 + i);
    fetch_check(pc, &r, keys, all, NK);
    bex_ps_client_destroy(pc);
    CHECK_OK(bex_ctx_destroy(ctx));
    uint64_t t0 = pair_now_ms();
    term_bex_ps(pid[1]);
    wait_replicas(d, 1, 0);
    CHECK(pair_now_ms() - t0 < 5000ull * time_scale());
    CHECK_EQ(bex_dir_replicas(d, "ps", 0, NULL, 0), 1);
    bex_dir_destroy(d);
    term_bex_ps(pid[0]);
    etcd_cleanup();
    return 0;
}

/* bex__prom_hist's buckets are exact at their bounds (2^k ns): samples
 * just under and at a bound land below and above it; +Inf, sum and count;
 * an empty histogram prints zeros. */
static int t_hist(void)
{
    static struct bex__rpc_hist h;
    const uint64_t ns[] = {0, 1023, 1024, 4095, 4096, 16383, 1u << 20, 1ull << 34, 1ull << 40};
    uint64_t sum = 0;
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        bex__rpc_hist_add(&h, ns[i]);
        sum += ns[i];
    }
    static char buf[8192];
    struct bex__prom o = {buf, sizeof buf, 0};
    bex__prom_hist(&o, "m", "a=\"b\"", &h);
    CHECK(o.n < sizeof buf);
    CHECK(sample(buf, "m_bucket{a=\"b\",le=\"1.024e-06\"}") == 2);   /* 0, 1023 */
    CHECK(sample(buf, "m_bucket{a=\"b\",le=\"4.096e-06\"}") == 4);   /* 1024, 4095 */
    CHECK(sample(buf, "m_bucket{a=\"b\",le=\"1.6384e-05\"}") == 6);  /* 4096, 16383 */
    CHECK(sample(buf, "m_bucket{a=\"b\",le=\"0.001048576\"}") == 6); /* 2^20: not below */
    CHECK(sample(buf, "m_bucket{a=\"b\",le=\"0.004194304\"}") == 7);
    CHECK(sample(buf, "m_bucket{a=\"b\",le=\"17.179869184\"}") == 7); /* 2^34: not below */
    CHECK(sample(buf, "m_bucket{a=\"b\",le=\"+Inf\"}") == 9);
    CHECK(sample(buf, "m_count{a=\"b\"}") == 9);
    CHECK(fabs(sample(buf, "m_sum{a=\"b\"}") - (double)sum / 1e9) <= 1e-8 * (double)sum / 1e9);
    /* no labels, no samples */
    static struct bex__rpc_hist z;
    o = (struct bex__prom){buf, sizeof buf, 0};
    bex__prom_hist(&o, "z", "", &z);
    CHECK(sample(buf, "z_bucket{le=\"+Inf\"}") == 0);
    CHECK(sample(buf, "z_count{}") == 0);
    /* cut output: the length needed is still counted */
    char small[16];
    struct bex__prom c = {small, sizeof small, 0};
    bex__prom_hist(&c, "m", "a=\"b\"", &h);
    CHECK(c.n == strlen(buf) || c.n > sizeof small);
    return 0;
}

/* bex-ps's numeric options: out of range or not a whole number is refused
 * with one line naming the option (exit 2) before anything starts; in range
 * passes the parse, and the missing cluster file is refused after it (exit
 * 2 too, one line naming the file). Returns 2 for the option's line, 1 for
 * the file's, -1 for anything else. */
static int run_ps(const char *opt, const char *val)
{
    FILE *err = tmpfile();
    CHECK(err != NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        dup2(fileno(err), 2);
        execl(BEX_PS_BIN, BEX_PS_BIN, "--cluster", "/nonexistent/bex-ps-cluster", "--shard", "0",
              opt, val, (char *)NULL);
        _exit(127);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st));
    char first[512] = "";
    rewind(err);
    if (!fgets(first, sizeof first, err))
        first[0] = 0;
    fclose(err);
    if (WEXITSTATUS(st) != 2)
        return -1;
    char named[128];
    snprintf(named, sizeof named, "bex-ps: %s '%s': ", opt, val);
    if (strncmp(first, named, strlen(named)) == 0)
        return 2;
    return strstr(first, "/nonexistent/bex-ps-cluster") ? 1 : -1;
}

static int t_options(void)
{
    static const struct {
        const char *opt, *val;
        int rc;
    } c[] = {
        {"--replica", "x", 2},
        {"--replica", "1x", 2},
        {"--replica", "-1", 2},
        {"--replica", "99999999999", 2},
        {"--eager-max", "-1", 2},
        {"--eager-max", "4294967296", 2},
        {"--send-window", "", 2},
        {"--send-window", "65536k", 2},
        {"--metrics-port", "65536", 2},
        {"--catchup-timeout-ms", "0", 2},
        {"--snapshot-every", "0", 2},
        {"--keepalive-timeout-ms", "3600001", 2},
        {"--ttl", "0", 2},
        {"--ttl", "4097", 2},
        {"--replica", "1", 1},
        {"--eager-max", "65600", 1},
        {"--send-window", "0", 1},
        {"--metrics-port", "0", 1},
        {"--catchup-timeout-ms", "1", 1},
        {"--keepalive-timeout-ms", "3600000", 1},
        {"--ttl", "4096", 1},
        {"--io-threads", "0", 2},
        {"--io-threads", "65", 2},
        {"--io-threads", "2", 1},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        int rc = run_ps(c[i].opt, c[i].val);
        if (rc != c[i].rc)
            fprintf(stderr, "bex-ps %s '%s': exit %d, want %d\n", c[i].opt, c[i].val, rc, c[i].rc);
        CHECK_EQ(rc, c[i].rc);
    }
    return 0;
}

BEX_TEST_MAIN({"metrics", t_metrics}, {"replica_restart", t_replica_restart},
              {"snapshot_every", t_snapshot_every}, {"etcd", t_etcd}, {"hist", t_hist},
              {"options", t_options})
