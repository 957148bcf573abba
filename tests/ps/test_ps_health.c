/* SPDX-License-Identifier: Apache-2.0 */
/* bex-ps's health endpoints and the metrics beside the PS counters (issue
 * 27 item 6), over TCP on loopback addresses (label tcp):
 *  - serving: /healthz and /ready answer 200 once bex-ps is ready; its
 *    /metrics carries the context's families (bex_transport_*,
 *    bex_pool_*) beside the shards'; under the stated load, PUSHES Pushes
 *    of every key from a client, its transport's received messages and
 *    bytes move by at least that much and engines counts the client's
 *    connections; the client's own renderer (bex_ps_client_prometheus)
 *    counts the sub-requests it sent and their successes.
 *  - catching_up: replica 1 of a cluster whose replica 0 accepts
 *    connections but never answers (a listener nobody serves): while
 *    bex-ps catches up with it, /healthz is 200 and /ready 503 "not ready:
 *    catching up"; once the catch-up gave up and bex-ps said "ready", 200.
 *  - drain: SIGTERM with a client connected: bex-ps prints "draining",
 *    "drained" (bex_rpc_server_drain: no new connection, what it received
 *    answered), "stopped", and leaves with status 0. */
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "ps_prog.h"

#define PUSHES 3

static int t_serving(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-health-XXXXXX";
    char cluster[128], url[128], base[128];
    tmp_cluster(tmpl, cluster, sizeof cluster, 1, NULL);
    const char *args[] = {"--cluster",   cluster, "--shard",        "all", "--table", "1:8:sgd:0.1",
                          "--transport", "tcp",   "--metrics-port", "0",   NULL};
    pid_t pid = bex_ps_start(args, url, sizeof url);
    snprintf(base, sizeof base, "%.*s", (int)(strlen(url) - strlen("/metrics")), url);
    char path[160], *text;
    snprintf(path, sizeof path, "%s/healthz", base);
    CHECK_EQ(http_get(path, &text), 200);
    CHECK(strcmp(text, "ok\n") == 0);
    free(text);
    snprintf(path, sizeof path, "%s/ready", base);
    CHECK_EQ(http_get(path, &text), 200);
    CHECK(strcmp(text, "ready\n") == 0);
    free(text);
    CHECK_EQ(http_get(url, &text), 200);
    CHECK(sample(text, "bex_transport_engines") == 0);
    double msgs0 = sample(text, "bex_transport_messages_received_total");
    double bytes0 = sample(text, "bex_transport_received_bytes_total");
    CHECK(sample(text, "bex_pool_registered_bytes{pool=\"main\"}") >= 0);
    CHECK(sample(text, "bex_transport_tcp_fallbacks_total") == 0);
    CHECK(strstr(text, "# TYPE bex_ps_pushes_total counter"));
    free(text);

    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_file(cluster);
    bex_ps_client *pc = client_of(ctx, d);
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static struct ref r;
    ref_init(&r, &TC, keys);
    for (int i = 0; i < PUSHES; i++)
        push_ref(pc, &r, keys, all, NK, 60 + i);
    CHECK_EQ(http_get(url, &text), 200);
    /* one connection per shard's server, all in this one context */
    CHECK(sample(text, "bex_transport_engines") >= 1);
    CHECK(sample(text, "bex_transport_tcp_connections") >= 1);
    CHECK(sample(text, "bex_transport_messages_received_total") >= msgs0 + PUSHES);
    CHECK(sample(text, "bex_transport_received_bytes_total") >=
          bytes0 + (double)PUSHES * NK * 8 * sizeof(float));
    /* the answers' buffers came from the main pool: chunks were registered */
    CHECK(sample(text, "bex_pool_registered_bytes{pool=\"main\"}") > 0);
    free(text);

    char buf[4096];
    int n = bex_ps_client_prometheus(pc, "test", buf, sizeof buf);
    CHECK(n > 0 && (size_t)n < sizeof buf);
    fprintf(stderr, "%s", buf);
    CHECK(sample(buf, "bex_ps_client_calls_total{client=\"test\"}") >= PUSHES);
    CHECK(sample(buf, "bex_ps_client_ok_total{client=\"test\"}") >= PUSHES);
    CHECK(sample(buf, "bex_ps_client_failed_total{client=\"test\"}") == 0);
    CHECK(strstr(buf, "# TYPE bex_ps_client_retries_total counter"));
    /* no replica failed a Push: none kept */
    CHECK(sample(buf, "bex_ps_client_push_kept_total{client=\"test\"}") == 0);
    CHECK(sample(buf, "bex_ps_client_push_held{client=\"test\"}") == 0);
    CHECK(strstr(buf, "# TYPE bex_ps_client_push_held gauge"));
    /* two shards of one replica each (cluster_file): two Push channels */
    CHECK(sample(buf, "bex_ps_client_push_channels{client=\"test\"}") == 2);
    /* 13 samples (11 counters, 2 gauges), each labelled "ps" instead of "test" */
    CHECK_EQ(bex_ps_client_prometheus(pc, NULL, NULL, 0), n - 13 * 2);
    CHECK_EQ(bex_ps_client_prometheus(NULL, NULL, buf, sizeof buf), -EINVAL);

    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    term_bex_ps(pid);
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0);
    return 0;
}

/* A listener on 127.0.0.1:port that nobody accepts from: a peer that
 * connects (the kernel completes the handshake) and is never answered. */
static int mute_listener(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    int one = 1;
    CHECK(setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
    bex_addr a = {.in4 = {.sin_family = AF_INET,
                          .sin_port = htons(port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)}};
    CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
    CHECK(listen(fd, 16) == 0);
    return fd;
}

/* The next line of f that is want (others echoed); 0 or -1 at EOF. */
static int expect_line(FILE *f, const char *want)
{
    char line[256];
    while (fgets(line, sizeof line, f)) {
        fprintf(stderr, "%s", line);
        if (strcmp(line, want) == 0)
            return 0;
    }
    fprintf(stderr, "no line \"%s\"\n", want);
    return -1;
}

static int t_catching_up(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-health-XXXXXX";
    char cluster[128];
    uint16_t ports[NSH][2];
    tmp_cluster(tmpl, cluster, sizeof cluster, 2, ports);
    int mute[NSH];
    for (int s = 0; s < NSH; s++)
        mute[s] = mute_listener(ports[s][0]);
    const char *argv[] = {"bex-ps",  "--cluster",
                          cluster,   "--shard",
                          "all",     "--replica",
                          "1",       "--table",
                          "1:8:sgd", "--transport",
                          "tcp",     "--metrics-port",
                          "0",       "--catchup-timeout-ms",
                          "3000",    NULL};
    FILE *f;
    pid_t pid = bex_ps_spawn_piped(argv, &f);
    char line[256], base[128] = "", path[160], *text;
    static const char at[] = "bex-ps: metrics at ";
    while (!base[0] && fgets(line, sizeof line, f)) {
        fprintf(stderr, "%s", line);
        if (strncmp(line, at, sizeof at - 1) == 0)
            snprintf(base, sizeof base, "%.*s",
                     (int)(strcspn(line + sizeof at - 1, "\n") - strlen("/metrics")),
                     line + sizeof at - 1);
    }
    CHECK(base[0]);
    snprintf(path, sizeof path, "%s/ready", base);
    CHECK_EQ(http_get(path, &text), 503);
    fprintf(stderr, "/ready: %s", text);
    CHECK(strcmp(text, "not ready: catching up\n") == 0);
    free(text);
    snprintf(path, sizeof path, "%s/healthz", base);
    CHECK_EQ(http_get(path, &text), 200);
    free(text);
    bool ready = false;
    while (!ready && fgets(line, sizeof line, f)) {
        fprintf(stderr, "%s", line);
        ready = strcmp(line, "bex-ps: ready\n") == 0;
    }
    CHECK(ready);
    fclose(f);
    snprintf(path, sizeof path, "%s/ready", base);
    CHECK_EQ(http_get(path, &text), 200);
    free(text);
    term_bex_ps(pid);
    for (int s = 0; s < NSH; s++)
        close(mute[s]);
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0);
    return 0;
}

/* SIGTERM drains: "draining", "drained", "stopped" in that order, after a
 * client's Pushes on an open connection, and status 0. */
static int t_drain(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-health-XXXXXX";
    char cluster[128];
    tmp_cluster(tmpl, cluster, sizeof cluster, 1, NULL);
    const char *argv[] = {"bex-ps",  "--cluster",   cluster,       "--shard", "all",
                          "--table", "1:8:sgd:0.1", "--transport", "tcp",     "--drain-timeout-ms",
                          "5000",    NULL};
    FILE *f;
    pid_t pid = bex_ps_spawn_piped(argv, &f);
    CHECK_OK(expect_line(f, "bex-ps: ready\n"));
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_file(cluster);
    bex_ps_client *pc = client_of(ctx, d);
    uint64_t keys[NK];
    int all[NK];
    keys_init(keys, all);
    static struct ref r;
    ref_init(&r, &TC, keys);
    push_ref(pc, &r, keys, all, NK, 60);
    CHECK(kill(pid, SIGTERM) == 0);
    CHECK_OK(expect_line(f, "bex-ps: draining\n"));
    CHECK_OK(expect_line(f, "bex-ps: drained\n"));
    CHECK_OK(expect_line(f, "bex-ps: stopped\n"));
    fclose(f);
    int status;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0);
    return 0;
}

/* --primary-backup: /ready names each shard's role (issue 27 item 6):
 * replica 0 "shard0: primary" (and shard1), replica 1 "shard0: backup". */
static int t_roles(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-health-XXXXXX";
    char cluster[128], url[2][128];
    tmp_cluster(tmpl, cluster, sizeof cluster, 2, NULL);
    pid_t pid[2];
    for (int r = 0; r < 2; r++) {
        const char *args[] = {"--cluster",
                              cluster,
                              "--shard",
                              "all",
                              "--replica",
                              r ? "1" : "0",
                              "--table",
                              "1:8:sgd:0.1",
                              "--transport",
                              "tcp",
                              "--metrics-port",
                              "0",
                              "--no-catchup",
                              "--primary-backup",
                              NULL};
        pid[r] = bex_ps_start(args, url[r], sizeof url[r]);
    }
    for (int r = 0; r < 2; r++) {
        char path[160], *text;
        snprintf(path, sizeof path, "%.*s/ready", (int)(strlen(url[r]) - strlen("/metrics")),
                 url[r]);
        CHECK_EQ(http_get(path, &text), 200);
        fprintf(stderr, "replica %d /ready: %s", r, text);
        CHECK(strcmp(text, r ? "ready\nshard0: backup\nshard1: backup\n"
                             : "ready\nshard0: primary\nshard1: primary\n") == 0);
        free(text);
    }
    for (int r = 0; r < 2; r++)
        term_bex_ps(pid[r]);
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0);
    return 0;
}

BEX_TEST_MAIN({"serving", t_serving}, {"catching_up", t_catching_up}, {"drain", t_drain},
              {"roles", t_roles})
