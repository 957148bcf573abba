/* SPDX-License-Identifier: Apache-2.0 */
/* The service directory without I/O (unit): the cluster file's parser
 * (good files, and bad ones refused with an error naming what and where),
 * replica choice (locality order, load spread, quarantined replicas
 * skipped), quarantine (starts past the thresholds within the window and
 * not before, lifts after the period through one probe, a failed probe
 * quarantines again, never all replicas of a shard, each transition logged
 * once). Time is driven by the test through the internal calls' clock. */
#include <stdatomic.h>
#include <unistd.h>

#include "bex/sock.h"
#include "rpc/dir_test.h"

#define MS 1000000ull

/* log lines, by what they say */
static _Atomic int n_quarantined, n_lifted, n_probe_failed, n_refused, n_lines;

static bex_dir *cur_dir; /* the directory port_of and the log hook ask */

static void count_log(int level, const char *msg, void *arg)
{
    (void)level;
    (void)arg;
    /* a hook may call back into the directory: no lock of it is held */
    if (cur_dir)
        (void)bex_dir_generation(cur_dir);
    atomic_fetch_add(&n_lines, 1);
    if (strstr(msg, "quarantined for"))
        atomic_fetch_add(&n_quarantined, 1);
    if (strstr(msg, "quarantine lifted"))
        atomic_fetch_add(&n_lifted, 1);
    if (strstr(msg, "failed its probe"))
        atomic_fetch_add(&n_probe_failed, 1);
    if (strstr(msg, "not quarantined"))
        atomic_fetch_add(&n_refused, 1);
    fprintf(stderr, "log: %s\n", msg);
}

static bex_dir *mkdir_cfg(uint32_t m, uint32_t n, uint32_t window_ms, uint32_t q_ms)
{
    bex_dir_config c = {.conn_fail_max = m,
                        .req_fail_max = n,
                        .fail_window_ms = window_ms,
                        .quarantine_ms = q_ms,
                        .log_fn = count_log,
                        .log_level = BEX_LOG_INFO};
    bex_dir *d;
    CHECK_OK(bex_dir_create(&c, &d));
    cur_dir = d;
    return d;
}

static const char *GOOD =
    "{\"version\": 1, \"services\": {\n"
    "  \"ps\": {\"shards\": [\n"
    "    {\"replicas\": [{\"addr\": \"10.0.0.1:7000\", \"locality\": \"dc1/pod1\"},\n"
    "                    {\"addr\": \"10.0.0.2:7000\", \"locality\": \"dc1/pod2\",\n"
    "                     \"transport\": \"tcp\"},\n"
    "                    {\"addr\": \"10.0.1.1:7000\", \"locality\": \"dc2/pod1\",\n"
    "                     \"transport\": \"rdma\"}]},\n"
    "    {\"replicas\": [{\"addr\": \"10.0.0.1:7001\"}]}]},\n"
    "  \"ranker\": {\"shards\": [{\"replicas\": [{\"addr\": \"10.0.0.9:80\", \"locality\": "
    "\"dc1\"}]}]}}}\n";

/* A good file: every service, shard and replica with its fields. */
static int t_parse_good(void)
{
    bex_dir *d = mkdir_cfg(0, 0, 0, 0);
    char err[256] = "";
    char path[] = "/tmp/bex-dir-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    CHECK(write(fd, GOOD, strlen(GOOD)) == (ssize_t)strlen(GOOD));
    close(fd);
    int rc = bex_dir_load_file(d, path, err, sizeof err);
    unlink(path);
    if (rc)
        fprintf(stderr, "load: %s\n", err);
    CHECK_OK(rc);
    bex_dir_replica r[4];
    CHECK_EQ(bex_dir_replicas(d, "ps", 0, r, 4), 3);
    /* listed order */
    CHECK(r[0].addr.in4.sin_addr.s_addr == A("10.0.0.1:1").in4.sin_addr.s_addr);
    CHECK_EQ(ntohs(r[0].addr.in4.sin_port), 7000);
    CHECK(!strcmp(r[0].locality, "dc1/pod1") && r[0].transport == BEX_TRANSPORT_AUTO);
    CHECK(!strcmp(r[1].locality, "dc1/pod2") && r[1].transport == BEX_TRANSPORT_TCP);
    CHECK(!strcmp(r[2].locality, "dc2/pod1") && r[2].transport == BEX_TRANSPORT_RDMA);
    CHECK_EQ(bex_dir_replicas(d, "ps", 1, r, 4), 1);
    CHECK(ntohs(r[0].addr.in4.sin_port) == 7001 && r[0].locality[0] == 0);
    CHECK_EQ(bex_dir_replicas(d, "ps", 2, r, 4), 0);
    CHECK_EQ(bex_dir_replicas(d, "ranker", 0, r, 4), 1);
    CHECK(!strcmp(r[0].locality, "dc1"));
    CHECK_EQ(bex_dir_replicas(d, "nope", 0, r, 4), 0);
    /* a reload replaces: ranker gone, ps shard 0 down to one */
    uint64_t g = bex_dir_generation(d);
    CHECK_OK(bex_dir_load_json(
        d, "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":[{\"addr\":\"10.0.0.2:7000\"}]}]}}}",
        err, sizeof err));
    CHECK(bex_dir_generation(d) > g);
    CHECK_EQ(bex_dir_replicas(d, "ps", 0, r, 4), 1);
    CHECK_EQ(bex_dir_replicas(d, "ranker", 0, r, 4), 0);
    bex_dir_destroy(d);
    return 0;
}

/* Bad files: refused with -EINVAL (or the file's errno), an error naming
 * the place, and the contents left as they were. */
static int t_parse_bad(void)
{
    static const struct {
        const char *json, *want;
    } bad[] = {
        {"{\"services\": {", "line 1"},
        {"[]", "top level"},
        {"{\"servics\": {}}", "top level"},
        {"{\"services\": {}, \"extra\": 1}", "unknown key \"extra\""},
        {"{\"version\": 2, \"services\": {}}", "version"},
        {"{\"services\": {\"ps\": {\"shards\": []}}}", "services.ps"},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": []}]}}}", "services.ps.shards[0]"},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"addr\": \"10.0.0.1\"}]}]}}}",
         "services.ps.shards[0].replicas[0].addr"},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"addr\": \"10.0.0.1:0\"}]}]}}}",
         "replicas[0].addr"},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"addr\": "
         "\"10.0.0.1:70000\"}]}]}}}",
         "replicas[0].addr"},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"addr\": \"host:7\"}]}]}}}",
         "replicas[0].addr"},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"locality\": \"dc1\"}]}]}}}",
         "no \"addr\""},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"addr\": \"10.0.0.1:7\", "
         "\"locality\": \"dc1//pod2\"}]}]}}}",
         "replicas[0].locality"},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"addr\": \"10.0.0.1:7\", "
         "\"transport\": \"udp\"}]}]}}}",
         "replicas[0].transport"},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"addr\": \"10.0.0.1:7\", "
         "\"port\": 7}]}]}}}",
         "unknown key \"port\""},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"addr\": \"10.0.0.1:7\"}, "
         "{\"addr\": \"10.0.0.1:7\"}]}]}}}",
         "replicas[1].addr: listed twice"},
        {"{\"services\": {\"ps\": {\"shards\": [{\"replicas\": [{\"addr\": \"10.0.0.1:7\", "
         "\"addr\": \"10.0.0.2:7\"}]}]}}}",
         "duplicate"},
        {"{\"services\": {\"a/b\": {\"shards\": [{\"replicas\": [{\"addr\": \"10.0.0.1:7\"}]}]}}}",
         "without '/'"},
    };
    bex_dir *d = mkdir_cfg(0, 0, 0, 0);
    char err[256];
    CHECK_OK(bex_dir_load_json(d, GOOD, err, sizeof err));
    uint64_t g = bex_dir_generation(d);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        int rc = bex_dir_load_json(d, bad[i].json, err, sizeof err);
        fprintf(stderr, "bad %zu: %d %s\n", i, rc, err);
        CHECK_EQ(rc, -EINVAL);
        CHECK(strstr(err, bad[i].want));
    }
    CHECK_EQ(bex_dir_generation(d), g);
    CHECK_EQ(bex_dir_replicas(d, "ps", 0, NULL, 0), 3);
    err[0] = 0;
    CHECK_EQ(bex_dir_load_file(d, "/nonexistent/cluster.json", err, sizeof err), -ENOENT);
    CHECK(strstr(err, "/nonexistent/cluster.json"));
    bex_dir_destroy(d);
    return 0;
}

/* three replicas of ps/0 at localities l0..l2, ports 1..3 */
static bex_dir *three(bex_dir *d, const char *l0, const char *l1, const char *l2)
{
    char j[1024], err[256];
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":["
             "{\"addr\":\"10.0.0.1:1\",\"locality\":\"%s\"},"
             "{\"addr\":\"10.0.0.1:2\",\"locality\":\"%s\"},"
             "{\"addr\":\"10.0.0.1:3\",\"locality\":\"%s\"}]}]}}}",
             l0, l1, l2);
    int rc = bex_dir_load_json(d, j, err, sizeof err);
    if (rc)
        fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    return d;
}

static int port_of(struct bex__dir_node *n)
{
    bex_dir_replica r;
    bex__dir_node_info(cur_dir, n, &r);
    return ntohs(r.addr.in4.sin_port);
}

/* pick and end the call at once; the port picked */
static int pick1(bex_dir *d, const char *loc, uint64_t now)
{
    struct bex__dir_node *n;
    CHECK_OK(bex__dir_pick_node(d, "ps", 0, loc, NULL, NULL, now, &n));
    bex__dir_report_node(d, n, BEX_DIR_OK, true, now);
    return port_of(n);
}

static bool avoid_one(void *arg, const struct bex__dir_node *n)
{
    return n == arg;
}

static bool avoid_all(void *arg, const struct bex__dir_node *n)
{
    (void)arg;
    (void)n;
    return true;
}

/* Same pod, then same data center, then any; an unknown or missing
 * locality spreads over all; an avoided replica is used only when nothing
 * else is. */
static int t_choice_locality(void)
{
    CHECK_EQ(bex__dir_closeness("dc1/pod2", "dc1/pod2"), 2);
    CHECK_EQ(bex__dir_closeness("dc1/pod2", "dc1/pod3"), 1);
    CHECK_EQ(bex__dir_closeness("dc1/pod2", "dc2/pod2"), 0);
    CHECK_EQ(bex__dir_closeness("dc1/pod2", "dc10/pod2"), 0);
    CHECK_EQ(bex__dir_closeness(NULL, "dc1"), 0);
    bex_dir *d = three(mkdir_cfg(0, 0, 0, 0), "dc2/pod1", "dc1/pod1", "dc1/pod2");
    uint64_t t = 1000 * MS;
    int dc[4] = {0};
    for (int i = 0; i < 100; i++) {
        CHECK_EQ(pick1(d, "dc1/pod2", t), 3); /* same pod */
        dc[pick1(d, "dc1/pod7", t)]++;        /* same dc: either */
        CHECK_EQ(pick1(d, "dc2/pod9", t), 1); /* the only one in dc2 */
    }
    fprintf(stderr, "same dc: %d %d %d\n", dc[1], dc[2], dc[3]);
    CHECK(dc[1] == 0 && dc[2] >= 30 && dc[3] >= 30);
    int seen[4] = {0};
    for (int i = 0; i < 1500; i++)
        seen[pick1(d, "dc3/pod1", t)]++; /* nothing near: all equal */
    fprintf(stderr, "none near: %d %d %d\n", seen[1], seen[2], seen[3]);
    for (int p = 1; p <= 3; p++)
        CHECK(seen[p] >= 400 && seen[p] <= 600);
    /* avoided: the next nearest; all avoided: the nearest anyway */
    struct bex__dir_node *n, *p3 = node(d, "10.0.0.1:3");
    CHECK_OK(bex__dir_pick_node(d, "ps", 0, "dc1/pod2", avoid_one, p3, t, &n));
    CHECK_EQ(port_of(n), 2);
    bex__dir_report_node(d, n, BEX_DIR_DONE, true, t);
    CHECK_OK(bex__dir_pick_node(d, "ps", 0, "dc1/pod2", avoid_all, NULL, t, &n));
    CHECK(n == p3);
    bex__dir_report_node(d, n, BEX_DIR_DONE, true, t);
    CHECK_EQ(bex__dir_pick_node(d, "ps", 1, "dc1/pod2", NULL, NULL, t, &n), -ENOENT);
    CHECK_EQ(bex__dir_pick_node(d, "nope", 0, "dc1/pod2", NULL, NULL, t, &n), -ENOENT);
    /* the public pick with an address to avoid */
    bex_dir_replica r;
    bex_addr a3 = A("10.0.0.1:3");
    CHECK_OK(bex_dir_pick(d, "ps", 0, "dc1/pod2", &a3, &r));
    CHECK_EQ(ntohs(r.addr.in4.sin_port), 2); /* same dc next */
    bex_dir_report(d, &r.addr, BEX_DIR_DONE, 1);
    CHECK_OK(bex_dir_pick(d, "ps", 0, "dc1/pod2", NULL, &r));
    CHECK_EQ(ntohs(r.addr.in4.sin_port), 3);
    bex_dir_report(d, &r.addr, BEX_DIR_DONE, 1);
    CHECK_EQ(stats(d, "10.0.0.1:2").outstanding, 0);
    bex_dir_destroy(d);
    return 0;
}

/* Load spread among equals: calls ended at once spread evenly (each
 * within 10 % of the mean over 30000 picks); calls held outstanding go to the
 * least loaded, so a replica slowed down (its calls held) gets fewer. */
static int t_choice_spread(void)
{
    bex_dir *d = three(mkdir_cfg(0, 0, 0, 0), "dc1/pod1", "dc1/pod1", "dc1/pod1");
    uint64_t t = 1000 * MS;
    int seen[4] = {0};
    enum { N = 30000 };
    for (int i = 0; i < N; i++)
        seen[pick1(d, "dc1/pod1", t)]++;
    for (int p = 1; p <= 3; p++) {
        fprintf(stderr, "port %d: %d picks\n", p, seen[p]);
        CHECK(seen[p] >= N / 3 * 9 / 10 && seen[p] <= N / 3 * 11 / 10);
    }
    /* held: 3000 outstanding picks spread 1000 each */
    static struct bex__dir_node *held[3000];
    int cnt[4] = {0};
    for (int i = 0; i < 3000; i++) {
        CHECK_OK(bex__dir_pick_node(d, "ps", 0, "dc1/pod1", NULL, NULL, t, &held[i]));
        cnt[port_of(held[i])]++;
    }
    CHECK(cnt[1] == 1000 && cnt[2] == 1000 && cnt[3] == 1000);
    CHECK_EQ(stats(d, "10.0.0.1:1").outstanding, 1000);
    /* replica 1 slow: its calls stay out while the others' end */
    memset(cnt, 0, sizeof cnt);
    for (int i = 0; i < 3000; i++)
        if (port_of(held[i]) != 1)
            bex__dir_report_node(d, held[i], BEX_DIR_OK, true, t);
    for (int i = 0; i < 3000; i++) {
        struct bex__dir_node *n;
        CHECK_OK(bex__dir_pick_node(d, "ps", 0, "dc1/pod1", NULL, NULL, t, &n));
        cnt[port_of(n)]++;
        if (port_of(n) != 1 || i % 2)
            bex__dir_report_node(d, n, BEX_DIR_OK, true, t);
    }
    fprintf(stderr, "slow replica: %d %d %d\n", cnt[1], cnt[2], cnt[3]);
    CHECK(cnt[1] < cnt[2] / 4 && cnt[1] < cnt[3] / 4);
    bex_dir_destroy(d);
    return 0;
}

/* Quarantined replicas are skipped, nearest or not. */
static int t_choice_skips_quarantined(void)
{
    bex_dir *d = three(mkdir_cfg(3, 3, 1000, 5000), "dc1/pod1", "dc1/pod2", "dc1/pod2");
    uint64_t t = 1000 * MS;
    struct bex__dir_node *p1 = node(d, "10.0.0.1:1");
    for (int i = 0; i < 4; i++)
        bex__dir_report_node(d, p1, BEX_DIR_CONN_FAIL, false, t + (uint64_t)i * MS);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_QUARANTINED);
    int seen[4] = {0};
    for (int i = 0; i < 1000; i++)
        seen[pick1(d, "dc1/pod1", t + 10 * MS)]++;
    CHECK(seen[1] == 0 && seen[2] >= 400 && seen[3] >= 400);
    bex_dir_destroy(d);
    return 0;
}

/* M connection failures within the window do not quarantine, M + 1 do;
 * M + 1 spread wider than the window do not; N for requests likewise;
 * the defaults are M = 30, N = 50 within 5 minutes. */
static int t_quarantine_start(void)
{
    atomic_store(&n_quarantined, 0);
    bex_dir *d = three(mkdir_cfg(0, 0, 0, 0), "dc1/pod1", "dc1/pod2", "dc1/pod3");
    uint64_t t = 1000 * MS;
    struct bex__dir_node *p1 = node(d, "10.0.0.1:1"), *p2 = node(d, "10.0.0.1:2"),
                         *p3 = node(d, "10.0.0.1:3");
    /* 30 within 290 s: still healthy; the 31st at 299 s: quarantined */
    for (int i = 0; i < 30; i++)
        bex__dir_report_node(d, p1, BEX_DIR_CONN_FAIL, false, t + (uint64_t)i * 10000 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_HEALTHY);
    CHECK_EQ(stats(d, "10.0.0.1:1").conn_failures, 30);
    bex__dir_report_node(d, p1, BEX_DIR_CONN_FAIL, false, t + 299000 * MS);
    bex_dir_node_stats s = stats(d, "10.0.0.1:1");
    CHECK_EQ(s.state, BEX_DIR_QUARANTINED);
    CHECK_EQ(s.quarantines, 1);
    CHECK_EQ(atomic_load(&n_quarantined), 1);
    /* more failures while quarantined: no second transition, no log */
    for (int i = 0; i < 100; i++)
        bex__dir_report_node(d, p1, BEX_DIR_CONN_FAIL, false, t + 299500 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:1").quarantines, 1);
    CHECK_EQ(atomic_load(&n_quarantined), 1);
    /* 31 over 310 s (one every 10 s + a bit): never more than 30 in 300 s */
    for (int i = 0; i < 62; i++)
        bex__dir_report_node(d, p2, BEX_DIR_CONN_FAIL, false, t + (uint64_t)i * 10001 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:2").state, BEX_DIR_HEALTHY);
    /* requests: 50 then the 51st */
    for (int i = 0; i < 50; i++)
        bex__dir_report_node(d, p3, BEX_DIR_REQ_FAIL, false, t + (uint64_t)i * MS);
    CHECK_EQ(stats(d, "10.0.0.1:3").state, BEX_DIR_HEALTHY);
    /* connection failures do not add to the request count */
    for (int i = 0; i < 10; i++)
        bex__dir_report_node(d, p3, BEX_DIR_CONN_FAIL, false, t + 60 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:3").state, BEX_DIR_HEALTHY);
    bex__dir_report_node(d, p3, BEX_DIR_REQ_FAIL, false, t + 61 * MS);
    s = stats(d, "10.0.0.1:3");
    CHECK_EQ(s.state, BEX_DIR_QUARANTINED);
    CHECK_EQ(s.req_failures, 51);
    CHECK_EQ(atomic_load(&n_quarantined), 2);
    bex_dir_destroy(d);
    return 0;
}

/* After the period one call probes the node (no other call goes there
 * meanwhile); an answer lifts the quarantine, a failure starts another
 * period; a probe never reported lets another call probe. */
static int t_quarantine_lift(void)
{
    atomic_store(&n_lifted, 0);
    atomic_store(&n_probe_failed, 0);
    bex_dir_config c = {.conn_fail_max = 2,
                        .req_fail_max = 2,
                        .fail_window_ms = 1000,
                        .quarantine_ms = 500,
                        .probe_timeout_ms = 200,
                        .log_fn = count_log,
                        .log_level = BEX_LOG_INFO};
    bex_dir *d;
    CHECK_OK(bex_dir_create(&c, &d));
    cur_dir = d;
    three(d, "dc1/pod1", "dc1/pod2", "dc1/pod2");
    uint64_t t = 1000 * MS;
    struct bex__dir_node *p1 = node(d, "10.0.0.1:1");
    for (int i = 0; i < 3; i++)
        bex__dir_report_node(d, p1, BEX_DIR_REQ_FAIL, false, t);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_QUARANTINED);
    /* within the period: never picked */
    for (int i = 0; i < 10; i++)
        CHECK(pick1(d, "dc1/pod1", t + 499 * MS) != 1);
    /* period over: the next pick probes it, the others do not use it */
    struct bex__dir_node *n;
    CHECK_OK(bex__dir_pick_node(d, "ps", 0, "dc2/x", NULL, NULL, t + 500 * MS, &n));
    CHECK(n == p1);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_PROBING);
    CHECK_EQ(stats(d, "10.0.0.1:1").probes, 1);
    for (int i = 0; i < 10; i++)
        CHECK(pick1(d, "dc1/pod1", t + 510 * MS) != 1);
    /* the probe fails: quarantined again, logged */
    bex__dir_report_node(d, n, BEX_DIR_CONN_FAIL, true, t + 520 * MS);
    bex_dir_node_stats s = stats(d, "10.0.0.1:1");
    CHECK_EQ(s.state, BEX_DIR_QUARANTINED);
    CHECK(s.probe_failures == 1 && s.quarantines == 2);
    CHECK_EQ(atomic_load(&n_probe_failed), 1);
    for (int i = 0; i < 10; i++)
        CHECK(pick1(d, "dc1/pod1", t + 1000 * MS) != 1);
    /* next period over: a probe that is never reported expires (200 ms),
     * then another call probes */
    CHECK_OK(bex__dir_pick_node(d, "ps", 0, "dc1/pod1", NULL, NULL, t + 1020 * MS, &n));
    CHECK(n == p1);
    CHECK(pick1(d, "dc1/pod1", t + 1100 * MS) != 1);
    CHECK_OK(bex__dir_pick_node(d, "ps", 0, "dc1/pod1", NULL, NULL, t + 1221 * MS, &n));
    CHECK(n == p1);
    CHECK_EQ(stats(d, "10.0.0.1:1").probes, 3);
    /* the probe answers: lifted, used again as the nearest */
    bex__dir_report_node(d, n, BEX_DIR_OK, true, t + 1230 * MS);
    s = stats(d, "10.0.0.1:1");
    CHECK_EQ(s.state, BEX_DIR_HEALTHY);
    CHECK_EQ(s.lifts, 1);
    CHECK_EQ(atomic_load(&n_lifted), 1);
    for (int i = 0; i < 10; i++)
        CHECK_EQ(pick1(d, "dc1/pod1", t + 1240 * MS), 1);
    /* the count starts afresh: 2 failures do not quarantine it again */
    bex__dir_report_node(d, p1, BEX_DIR_REQ_FAIL, false, t + 1250 * MS);
    bex__dir_report_node(d, p1, BEX_DIR_REQ_FAIL, false, t + 1250 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_HEALTHY);
    bex_dir_destroy(d);
    return 0;
}

/* Never all replicas of a shard: with one of two quarantined, the other
 * stays in use however it fails (refusal counted, logged once); a shard of
 * one replica never loses it; a node serving two shards counts both. */
static int t_quarantine_never_all(void)
{
    atomic_store(&n_refused, 0);
    bex_dir *d = mkdir_cfg(2, 2, 1000, 500);
    char err[256];
    CHECK_OK(
        bex_dir_load_json(d,
                          "{\"services\":{\"ps\":{\"shards\":["
                          "{\"replicas\":[{\"addr\":\"10.0.0.1:1\"},{\"addr\":\"10.0.0.1:2\"}]},"
                          "{\"replicas\":[{\"addr\":\"10.0.0.1:3\"}]},"
                          "{\"replicas\":[{\"addr\":\"10.0.0.1:3\"},{\"addr\":\"10.0.0.1:4\"}]}"
                          "]}}}",
                          err, sizeof err));
    uint64_t t = 1000 * MS;
    struct bex__dir_node *p1 = node(d, "10.0.0.1:1"), *p2 = node(d, "10.0.0.1:2"),
                         *p3 = node(d, "10.0.0.1:3"), *p4 = node(d, "10.0.0.1:4");
    for (int i = 0; i < 3; i++)
        bex__dir_report_node(d, p1, BEX_DIR_CONN_FAIL, false, t);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_QUARANTINED);
    for (int i = 0; i < 30; i++)
        bex__dir_report_node(d, p2, BEX_DIR_CONN_FAIL, false, t + (uint64_t)i * MS);
    bex_dir_node_stats s = stats(d, "10.0.0.1:2");
    CHECK_EQ(s.state, BEX_DIR_HEALTHY);
    CHECK(s.quarantine_refused >= 1 && s.quarantines == 0);
    CHECK_EQ(atomic_load(&n_refused), 1);
    /* p2 failing, p1 quarantined: p1 is probed at once, not after its
     * period (once: the probe is out, never reported here) */
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_PROBING);
    CHECK(stats(d, "10.0.0.1:1").early_probes >= 1);
    struct bex__dir_node *probe;
    CHECK_OK(bex__dir_pick_node(d, "ps", 0, NULL, NULL, NULL, t + 100 * MS, &probe));
    CHECK(probe == p1);
    CHECK_EQ(stats(d, "10.0.0.1:1").probes, 1);
    bex__dir_report_node(d, probe, BEX_DIR_DONE, true, t + 100 * MS);
    for (int i = 0; i < 10; i++) {
        struct bex__dir_node *n;
        CHECK_OK(bex__dir_pick_node(d, "ps", 0, NULL, NULL, NULL, t + 100 * MS, &n));
        CHECK(n == p2);
        bex__dir_report_node(d, n, BEX_DIR_DONE, true, t + 100 * MS);
    }
    /* p3 is shard 1's only replica (and one of shard 2's two): kept */
    for (int i = 0; i < 10; i++)
        bex__dir_report_node(d, p3, BEX_DIR_REQ_FAIL, false, t);
    CHECK_EQ(stats(d, "10.0.0.1:3").state, BEX_DIR_HEALTHY);
    /* p4 may go: shard 2 keeps p3 */
    for (int i = 0; i < 3; i++)
        bex__dir_report_node(d, p4, BEX_DIR_REQ_FAIL, false, t);
    CHECK_EQ(stats(d, "10.0.0.1:4").state, BEX_DIR_QUARANTINED);
    /* and every one of the 3 shards has a replica outside quarantine */
    for (uint32_t sh = 0; sh < 3; sh++) {
        struct bex__dir_node *n;
        CHECK_OK(bex__dir_pick_node(d, "ps", sh, NULL, NULL, NULL, t + 100 * MS, &n));
        bex_dir_node_stats ns;
        bex_dir_replica r;
        bex__dir_node_info(d, n, &r);
        CHECK_OK(bex_dir_node_stats_get(d, &r.addr, &ns));
        CHECK_EQ(ns.state, BEX_DIR_HEALTHY);
        bex__dir_report_node(d, n, BEX_DIR_DONE, true, t + 100 * MS);
    }
    /* the Prometheus dump agrees; a short buffer is cut, the need told */
    char small[32];
    int need = bex_dir_prometheus(d, small, sizeof small);
    CHECK(need > (int)sizeof small && strlen(small) == sizeof small - 1);
    char *buf = malloc((size_t)need + 1);
    CHECK(buf);
    CHECK_EQ(bex_dir_prometheus(d, buf, (size_t)need + 1), need);
    fprintf(stderr, "%s", buf);
    CHECK(strstr(buf, "# TYPE bex_dir_node_quarantines_total counter\n"));
    CHECK(strstr(buf, "bex_dir_node_quarantines_total{node=\"10.0.0.1:1\"} 1\n"));
    CHECK(strstr(buf, "bex_dir_node_quarantines_total{node=\"10.0.0.1:2\"} 0\n"));
    CHECK(strstr(buf, "bex_dir_node_conn_failures_total{node=\"10.0.0.1:2\"} 30\n"));
    CHECK(strstr(buf, "bex_dir_node_state{node=\"10.0.0.1:4\"} 1\n"));
    CHECK(strstr(buf, "bex_dir_node_state{node=\"10.0.0.1:3\"} 0\n"));
    CHECK(strstr(buf, "bex_dir_node_outstanding{node=\"10.0.0.1:2\"} 0\n"));
    free(buf);
    bex_addr unknown = A("10.9.9.9:9");
    bex_dir_node_stats ns;
    CHECK_EQ(bex_dir_node_stats_get(d, &unknown, &ns), -ENOENT);
    bex_dir_destroy(d);
    return 0;
}

/* Addresses by name and IPv6 (issue 27 item 7): "localhost" (in every
 * /etc/hosts) resolves, "[::1]:p" is IPv6, an IPv6 address shows as
 * "[v6]:port" in the metrics' node label, and an unknown name fails the
 * load naming it, the contents unchanged. */
static int t_parse_names(void)
{
    bex_dir *d = mkdir_cfg(0, 0, 0, 0);
    char err[256] = "";
    int rc = bex_dir_load_json(d,
                               "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":["
                               "{\"addr\":\"localhost:7000\"},{\"addr\":\"[::1]:7001\"}]}]}}}",
                               err, sizeof err);
    if (rc)
        fprintf(stderr, "load: %s\n", err);
    CHECK_OK(rc);
    bex_dir_replica r[4];
    CHECK_EQ(bex_dir_replicas(d, "ps", 0, r, 4), 2);
    CHECK(bex_addr_valid(&r[0].addr) && bex_addr_port(&r[0].addr) == 7000);
    CHECK_EQ(r[1].addr.sa.sa_family, AF_INET6);
    CHECK(IN6_IS_ADDR_LOOPBACK(&r[1].addr.in6.sin6_addr) && bex_addr_port(&r[1].addr) == 7001);
    bex_dir_replica got;
    CHECK_OK(bex_dir_pick(d, "ps", 0, NULL, &r[0].addr, &got));
    CHECK(bex_addr_equal(&got.addr, &r[1].addr)); /* the other one: r[0] avoided */
    bex_dir_report(d, &got.addr, BEX_DIR_OK, 1);
    char text[8192];
    CHECK(bex_dir_prometheus(d, text, sizeof text) < (int)sizeof text);
    CHECK(strstr(text, "node=\"[::1]:7001\""));
    CHECK_EQ(bex_dir_load_json(d,
                               "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":["
                               "{\"addr\":\"bex-none.invalid:7000\"}]}]}}}",
                               err, sizeof err),
             -EINVAL);
    fprintf(stderr, "unknown name: %s\n", err);
    CHECK(strstr(err, "bex-none.invalid") && strstr(err, "replicas[0].addr"));
    CHECK_EQ(bex_dir_replicas(d, "ps", 0, r, 4), 2); /* unchanged */
    bex_dir_destroy(d);
    return 0;
}

BEX_TEST_MAIN({"parse_good", t_parse_good}, {"parse_bad", t_parse_bad},
              {"parse_names", t_parse_names}, {"choice_locality", t_choice_locality},
              {"choice_spread", t_choice_spread},
              {"choice_skips_quarantined", t_choice_skips_quarantined},
              {"quarantine_start", t_quarantine_start}, {"quarantine_lift", t_quarantine_lift},
              {"quarantine_never_all", t_quarantine_never_all})
