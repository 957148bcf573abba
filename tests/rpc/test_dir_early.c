/* SPDX-License-Identifier: Apache-2.0 */
/* Early probes of quarantined replicas (unit, no I/O; issue 9 item 6):
 * when the last replica of a shard outside quarantine fails, the shard's
 * quarantined replicas are probed at once rather than after their period
 * ("never all replicas of a shard at once" kept as that last one fails,
 * not only when a quarantine starts). Time is driven by the test through
 * the internal calls' clock. */
#include <stdatomic.h>

#include "bex/sock.h"
#include "rpc/dir_test.h"

#define MS 1000000ull

static _Atomic int n_early, n_early_failed, n_probing, n_lifted, n_lines;

static void count_log(int level, const char *msg, void *arg)
{
    (void)level;
    (void)arg;
    atomic_fetch_add(&n_lines, 1);
    if (strstr(msg, "probed before its quarantine ends"))
        atomic_fetch_add(&n_early, 1);
    if (strstr(msg, "failed its early probe"))
        atomic_fetch_add(&n_early_failed, 1);
    if (strstr(msg, "probing quarantined node"))
        atomic_fetch_add(&n_probing, 1);
    if (strstr(msg, "quarantine lifted"))
        atomic_fetch_add(&n_lifted, 1);
    fprintf(stderr, "log: %s\n", msg);
}

/* More than 2 failures of a kind within 10 s quarantine a node for 60 s. */
static bex_dir *mkdir_json(const char *json)
{
    atomic_store(&n_early, 0); /* each case from nothing, also when all run in one */
    atomic_store(&n_early_failed, 0);
    atomic_store(&n_probing, 0);
    atomic_store(&n_lifted, 0);
    bex_dir_config c = {.conn_fail_max = 2,
                        .req_fail_max = 2,
                        .fail_window_ms = 10000,
                        .quarantine_ms = 60000,
                        .log_fn = count_log,
                        .log_level = BEX_LOG_INFO};
    bex_dir *d;
    CHECK_OK(bex_dir_create(&c, &d));
    char err[256];
    CHECK_OK(bex_dir_load_json(d, json, err, sizeof err));
    return d;
}

static struct bex__dir_node *pick(bex_dir *d, uint32_t shard, uint64_t t)
{
    struct bex__dir_node *n;
    CHECK_OK(bex__dir_pick_node(d, "ps", shard, NULL, NULL, NULL, t, &n));
    return n;
}

static void fail(bex_dir *d, struct bex__dir_node *n, int outcome, int times, uint64_t t)
{
    for (int i = 0; i < times; i++)
        bex__dir_report_node(d, n, outcome, false, t);
}

/* p1 quarantined, p2 the last healthy replica. A request failure of p2 may
 * be the call's own: no early probe until p2 passes its threshold (its
 * quarantine refused); then p1 is probed at once; its failure quarantines
 * it again (logged once), p2's next failure releases another probe (not
 * logged again); its answer lifts the quarantine. After the lift a
 * connection failure of p2 releases nothing (p1 is healthy) and p2 may be
 * quarantined. */
static int t_request_path(void)
{
    bex_dir *d = mkdir_json("{\"services\":{\"ps\":{\"shards\":[{\"replicas\":["
                            "{\"addr\":\"10.0.0.1:1\"},{\"addr\":\"10.0.0.1:2\"}]}]}}}");
    struct bex__dir_node *p1 = node(d, "10.0.0.1:1"), *p2 = node(d, "10.0.0.1:2");
    uint64_t t = 1000 * MS;
    fail(d, p1, BEX_DIR_REQ_FAIL, 3, t);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_QUARANTINED);
    /* p2's request failures up to its threshold: p1 stays out */
    fail(d, p2, BEX_DIR_REQ_FAIL, 2, t + 10 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_QUARANTINED);
    CHECK_EQ(stats(d, "10.0.0.1:1").early_probes, 0);
    for (int i = 0; i < 5; i++) {
        struct bex__dir_node *n = pick(d, 0, t + 20 * MS);
        CHECK(n == p2);
        bex__dir_report_node(d, n, BEX_DIR_DONE, true, t + 20 * MS);
    }
    /* past it: refused, and p1 released for a probe, logged once */
    fail(d, p2, BEX_DIR_REQ_FAIL, 1, t + 30 * MS);
    bex_dir_node_stats s1 = stats(d, "10.0.0.1:1"), s2 = stats(d, "10.0.0.1:2");
    CHECK_EQ(s2.state, BEX_DIR_HEALTHY);
    CHECK_EQ(s2.quarantine_refused, 1);
    CHECK_EQ(s1.state, BEX_DIR_PROBING);
    CHECK_EQ(s1.early_probes, 1);
    CHECK_EQ(atomic_load(&n_early), 1);
    /* the next pick, 59 s before the period ends, is p1's probe; with it
     * out, p2 takes the others */
    struct bex__dir_node *probe = pick(d, 0, t + 40 * MS);
    CHECK(probe == p1);
    CHECK_EQ(stats(d, "10.0.0.1:1").probes, 1);
    CHECK_EQ(atomic_load(&n_probing), 0); /* logged as an early probe already */
    for (int i = 0; i < 5; i++) {
        struct bex__dir_node *n = pick(d, 0, t + 41 * MS);
        CHECK(n == p2);
        bex__dir_report_node(d, n, BEX_DIR_DONE, true, t + 41 * MS);
    }
    /* the probe fails: quarantined again for a full period, logged once */
    bex__dir_report_node(d, probe, BEX_DIR_CONN_FAIL, true, t + 50 * MS);
    s1 = stats(d, "10.0.0.1:1");
    CHECK_EQ(s1.state, BEX_DIR_QUARANTINED);
    CHECK(s1.quarantines == 2 && s1.probe_failures == 1);
    CHECK_EQ(atomic_load(&n_early_failed), 1);
    CHECK(pick(d, 0, t + 60 * MS) == p2);
    bex__dir_report_node(d, p2, BEX_DIR_DONE, true, t + 60 * MS);
    /* p2 fails again (a connection failure now): another early probe,
     * counted, not logged again; it fails again, not logged again */
    int lines = atomic_load(&n_lines);
    fail(d, p2, BEX_DIR_CONN_FAIL, 1, t + 70 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:1").early_probes, 2);
    probe = pick(d, 0, t + 80 * MS);
    CHECK(probe == p1);
    bex__dir_report_node(d, probe, BEX_DIR_REQ_FAIL, true, t + 90 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:1").probe_failures, 2);
    CHECK_EQ(atomic_load(&n_lines), lines);
    /* and once more: this probe answers, lifting the quarantine (logged) */
    fail(d, p2, BEX_DIR_REQ_FAIL, 1, t + 100 * MS);
    probe = pick(d, 0, t + 110 * MS);
    CHECK(probe == p1);
    bex__dir_report_node(d, probe, BEX_DIR_OK, true, t + 120 * MS);
    s1 = stats(d, "10.0.0.1:1");
    CHECK_EQ(s1.state, BEX_DIR_HEALTHY);
    CHECK(s1.lifts == 1 && s1.early_probes == 3 && s1.probes == 3);
    CHECK_EQ(atomic_load(&n_lifted), 1);
    CHECK_EQ(atomic_load(&n_early), 1);
    /* both healthy: p2's failures release nothing, and quarantine it */
    fail(d, p2, BEX_DIR_CONN_FAIL, 3, t + 130 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:2").state, BEX_DIR_QUARANTINED);
    CHECK_EQ(stats(d, "10.0.0.1:1").early_probes, 3);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_HEALTHY);
    /* p1 is the last healthy one now: its connection failure releases p2,
     * logged (p2 was never released before) */
    fail(d, p1, BEX_DIR_CONN_FAIL, 1, t + 140 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:2").state, BEX_DIR_PROBING);
    CHECK_EQ(stats(d, "10.0.0.1:2").early_probes, 1);
    CHECK_EQ(atomic_load(&n_early), 2);
    /* the Prometheus dump has the counter */
    char buf[8192];
    int need = bex_dir_prometheus(d, buf, sizeof buf);
    CHECK(need > 0 && need < (int)sizeof buf);
    CHECK(strstr(buf, "# TYPE bex_dir_node_early_probes_total counter\n"));
    CHECK(strstr(buf, "bex_dir_node_early_probes_total{node=\"10.0.0.1:1\"} 3\n"));
    CHECK(strstr(buf, "bex_dir_node_early_probes_total{node=\"10.0.0.1:2\"} 1\n"));
    bex_dir_destroy(d);
    return 0;
}

/* Only the shards where the failing node is the last one outside
 * quarantine release theirs: p3 serves shards 0 (with p1 quarantined) and
 * 1 (with p2 healthy, p4 quarantined); p3's connection failure releases p1
 * alone (shard 1 keeps p2). A quarantine whose period is over is probed
 * as before, not counted as early. */
static int t_shards(void)
{
    bex_dir *d = mkdir_json("{\"services\":{\"ps\":{\"shards\":["
                            "{\"replicas\":[{\"addr\":\"10.0.0.1:1\"},{\"addr\":\"10.0.0.1:3\"}]},"
                            "{\"replicas\":[{\"addr\":\"10.0.0.1:2\"},{\"addr\":\"10.0.0.1:3\"},"
                            "{\"addr\":\"10.0.0.1:4\"}]}]}}}");
    struct bex__dir_node *p1 = node(d, "10.0.0.1:1"), *p3 = node(d, "10.0.0.1:3"),
                         *p4 = node(d, "10.0.0.1:4");
    uint64_t t = 1000 * MS;
    fail(d, p1, BEX_DIR_CONN_FAIL, 3, t);
    fail(d, p4, BEX_DIR_CONN_FAIL, 3, t);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_QUARANTINED);
    CHECK_EQ(stats(d, "10.0.0.1:4").state, BEX_DIR_QUARANTINED);
    fail(d, p3, BEX_DIR_CONN_FAIL, 1, t + 10 * MS);
    CHECK_EQ(stats(d, "10.0.0.1:1").state, BEX_DIR_PROBING);
    CHECK_EQ(stats(d, "10.0.0.1:1").early_probes, 1);
    CHECK_EQ(stats(d, "10.0.0.1:4").state, BEX_DIR_QUARANTINED);
    CHECK_EQ(stats(d, "10.0.0.1:4").early_probes, 0);
    CHECK(pick(d, 0, t + 20 * MS) == p1);
    struct bex__dir_node *n = pick(d, 1, t + 20 * MS);
    CHECK(n != p4);
    bex__dir_report_node(d, n, BEX_DIR_DONE, true, t + 20 * MS);
    /* p4's period over (60 s): an ordinary probe */
    CHECK(pick(d, 1, t + 60001 * MS) == p4);
    bex_dir_node_stats s4 = stats(d, "10.0.0.1:4");
    CHECK(s4.probes == 1 && s4.early_probes == 0);
    CHECK_EQ(atomic_load(&n_probing), 1);
    bex_dir_destroy(d);
    return 0;
}

BEX_TEST_MAIN({"request_path", t_request_path}, {"shards", t_shards})
