/* SPDX-License-Identifier: Apache-2.0 */
/* The directory over etcd (tcp: natively, on loopback): a local etcd is
 * started (temporary data directory, free ports) and must answer; two
 * servers (child processes) register under leases and a watching
 * directory sees both with their localities; one is killed with -9 and
 * vanishes within the lease TTL (plus etcd's expiry check) while the other
 * stays (its keepalive works); a registration revoked by
 * bex_dir_deregister goes at once; a malformed key under the prefix is
 * ignored. etcd is stopped and its directory removed, also when a check
 * fails. Without etcd the case fails: it does not skip. */
#include <arpa/inet.h>
#include <curl/curl.h>
#include <fcntl.h>
#include <dirent.h>
#include <signal.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bex/dir.h"
#include "harness.h"
#include "port.h"

#define TTL_S 2

static pid_t etcd_pid, child_pid[2];
static char datadir[64];

static void reap(pid_t *pid, int sig)
{
    if (*pid <= 0)
        return;
    kill(*pid, sig);
    uint64_t end = bex_test_now_ms() + 10000;
    int st;
    while (waitpid(*pid, &st, WNOHANG) == 0) {
        if (bex_test_now_ms() > end) {
            kill(*pid, SIGKILL);
            waitpid(*pid, &st, 0);
            break;
        }
        bex_test_sleep_ms(20);
    }
    *pid = 0;
}

static void rm_rf(const char *path)
{
    DIR *dir = opendir(path);
    if (!dir) {
        unlink(path);
        return;
    }
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        rm_rf(p);
    }
    closedir(dir);
    rmdir(path);
}

/* atexit: whatever happened, nothing stays running or on disk */
static void cleanup(void)
{
    if (getpid() == 0)
        return;
    for (int i = 0; i < 2; i++)
        reap(&child_pid[i], SIGKILL);
    reap(&etcd_pid, SIGTERM);
    if (datadir[0]) {
        rm_rf(datadir);
        datadir[0] = 0;
    }
}

static pid_t main_pid;

static void cleanup_main(void)
{
    if (getpid() == main_pid)
        cleanup();
}

/* etcd in PATH (or BEX_ETCD), on free ports, data in a temporary
 * directory; its client URL into url. */
static uint16_t cport, pport;

/* (Re)start etcd on cport/pport with its data in datadir. */
static void exec_etcd(void)
{
    const char *bin = getenv("BEX_ETCD") ? getenv("BEX_ETCD") : "etcd";
    char curl_[64], purl[64], cluster[96], logp[128], dd[96];
    snprintf(curl_, sizeof curl_, "http://127.0.0.1:%u", cport);
    snprintf(purl, sizeof purl, "http://127.0.0.1:%u", pport);
    snprintf(cluster, sizeof cluster, "t=%s", purl);
    snprintf(logp, sizeof logp, "%s/log", datadir);
    snprintf(dd, sizeof dd, "%s/data", datadir);
    int pfd[2];
    CHECK(pipe(pfd) == 0);
    fflush(NULL);
    etcd_pid = fork();
    CHECK(etcd_pid >= 0);
    if (etcd_pid == 0) {
        close(pfd[0]);
        FILE *lf = freopen(logp, "a", stdout);
        (void)lf;
        dup2(STDOUT_FILENO, STDERR_FILENO);
        fcntl(pfd[1], F_SETFD, FD_CLOEXEC);
        execlp(bin, bin, "--name", "t", "--data-dir", dd, "--listen-client-urls", curl_,
               "--advertise-client-urls", curl_, "--listen-peer-urls", purl,
               "--initial-advertise-peer-urls", purl, "--initial-cluster", cluster, "--log-level",
               "warn", (char *)NULL);
        int e = errno;
        ssize_t w = write(pfd[1], &e, sizeof e);
        (void)w;
        _exit(127);
    }
    close(pfd[1]);
    int e = 0;
    ssize_t r = read(pfd[0], &e, sizeof e); /* 0: exec succeeded (CLOEXEC) */
    close(pfd[0]);
    if (r > 0) {
        fprintf(stderr, "FAIL: cannot run %s: %s (install etcd-server: scripts/deps)\n", bin,
                strerror(e));
        waitpid(etcd_pid, NULL, 0);
        etcd_pid = 0;
        exit(1);
    }
}

static void start_etcd(char *url, size_t cap)
{
    cport = bex_test_port();
    pport = bex_test_port();
    while (pport == cport)
        pport = bex_test_port();
    snprintf(datadir, sizeof datadir, "/tmp/bex-etcd-XXXXXX");
    CHECK(mkdtemp(datadir));
    snprintf(url, cap, "http://127.0.0.1:%u", cport);
    exec_etcd();
}

/* A server process: registers (retrying while etcd starts), says so on
 * the pipe, then lives until killed. */
/* A registrant forked now (before the test's process has threads: a
 * child of a threaded process must not start any) that registers when
 * told: *go gets the parent's end of that pipe, and registered() waits
 * for the child's answer on *done. */
static pid_t fork_registrant(const char *url, uint16_t port, const char *loc, int *go, int *done)
{
    int pfd[2], gfd[2];
    CHECK(pipe(pfd) == 0 && pipe(gfd) == 0);
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(pfd[0]);
        close(gfd[1]);
        char g;
        if (read(gfd[0], &g, 1) != 1)
            _exit(1);
        bex_dir_replica self = {.addr = bex_addr_loopback4(port)};
        snprintf(self.locality, sizeof self.locality, "%s", loc);
        bex_dir_registration *reg = NULL;
        char err[256] = "";
        uint64_t end = bex_test_now_ms() + 30000ull * bex_test_time_scale();
        int rc;
        while (
            (rc = bex_dir_register_etcd(url, NULL, "ps", 0, &self, TTL_S, err, sizeof err, &reg)) &&
            bex_test_now_ms() < end)
            bex_test_sleep_ms(50);
        if (rc) {
            fprintf(stderr, "registrant: %s\n", err);
            _exit(1);
        }
        char c = 'r';
        ssize_t w = write(pfd[1], &c, 1);
        (void)w;
        for (;;)
            pause();
    }
    close(pfd[1]);
    close(gfd[0]);
    *go = gfd[1];
    *done = pfd[0];
    return pid;
}

/* Tell a registrant to register, and wait until it did. */
static void registered(int go, int done)
{
    char c = 'g';
    CHECK(write(go, &c, 1) == 1);
    close(go);
    struct timeval tv = {40 * (time_t)bex_test_time_scale(), 0};
    fd_set fs;
    FD_ZERO(&fs);
    FD_SET(done, &fs);
    CHECK(select(done + 1, &fs, NULL, NULL, &tv) == 1);
    CHECK(read(done, &c, 1) == 1 && c == 'r');
    close(done);
}

static pid_t spawn_registrant(const char *url, uint16_t port, const char *loc)
{
    int go, done;
    pid_t pid = fork_registrant(url, port, loc, &go, &done);
    registered(go, done);
    return pid;
}

/* Wait until (ps, 0) has n replicas; the time it took, or -1. */
static long wait_n(bex_dir *d, size_t n, unsigned ms)
{
    uint64_t t0 = bex_test_now_ms(), end = t0 + ms;
    while (bex_dir_replicas(d, "ps", 0, NULL, 0) != n) {
        if (bex_test_now_ms() > end)
            return -1;
        bex_test_sleep_ms(10);
    }
    return (long)(bex_test_now_ms() - t0);
}

static bool has_port(bex_dir *d, uint16_t port, const char *loc)
{
    bex_dir_replica r[8];
    size_t n = bex_dir_replicas(d, "ps", 0, r, 8);
    for (size_t i = 0; i < n && i < 8; i++)
        if (ntohs(r[i].addr.in4.sin_port) == port && (!loc || !strcmp(r[i].locality, loc)))
            return true;
    return false;
}

/* Put a raw key (base64 key and value) into etcd, as a foreign writer. */
static void raw_put(const char *url, const char *k64, const char *v64)
{
    char u[128], body[256];
    snprintf(u, sizeof u, "%s/v3/kv/put", url);
    snprintf(body, sizeof body, "{\"key\":\"%s\",\"value\":\"%s\"}", k64, v64);
    CURL *e = curl_easy_init();
    CHECK(e);
    curl_easy_setopt(e, CURLOPT_URL, u);
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
    FILE *devnull = fopen("/dev/null", "w");
    curl_easy_setopt(e, CURLOPT_WRITEDATA, devnull);
    CHECK(curl_easy_perform(e) == CURLE_OK);
    long code = 0;
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code);
    CHECK_EQ(code, 200);
    curl_easy_cleanup(e);
    fclose(devnull);
}

static _Atomic int bad_key_logs;

static void dlog(int level, const char *msg, void *arg)
{
    (void)arg;
    if (strstr(msg, "ignored"))
        atomic_fetch_add(&bad_key_logs, 1);
    fprintf(stderr, "dir log (level %d): %s\n", level, msg);
}

static int t_watch(void)
{
    main_pid = getpid();
    atexit(cleanup_main);
    unsigned scale = bex_test_time_scale();
    char url[64];
    start_etcd(url, sizeof url);
    child_pid[0] = spawn_registrant(url, 7001, "dc1/pod1");
    child_pid[1] = spawn_registrant(url, 7002, "dc1/pod2");
    bex_dir_config dc = {.log_fn = dlog};
    bex_dir *d;
    CHECK_OK(bex_dir_create(&dc, &d));
    char err[256] = "";
    CHECK_OK(bex_dir_watch_etcd(d, url, NULL, err, sizeof err));
    CHECK_EQ(bex_dir_watch_etcd(d, url, NULL, err, sizeof err), -EBUSY);
    CHECK(wait_n(d, 2, 5000 * scale) >= 0);
    CHECK(has_port(d, 7001, "dc1/pod1") && has_port(d, 7002, "dc1/pod2"));
    CHECK_EQ(bex_dir_load_json(d, "{\"services\":{}}", err, sizeof err), -EBUSY);
    /* foreign keys: one not an address, one with a value not JSON: both
     * ignored (and logged), the contents unchanged */
    uint64_t g = bex_dir_generation(d);
    /* a key under the prefix but outside services/ (the failover's
     * <prefix>ps/...) is not the directory's: ignored without a word */
    raw_put(url, "L2JleC9wcy9wcy8wL3ByaW1hcnk=", "MTI3LjAuMC4xOjcwMDE=");
    raw_put(url, "L2JleC9zZXJ2aWNlcy9wcy8wL2JhZA==", "ew==");
    raw_put(url, "L2JleC9zZXJ2aWNlcy9wcy8wLzEyNy4wLjAuMTo3MDA5", "ew==");
    /* (etcd may deliver both events in one message: one new generation) */
    for (uint64_t end = bex_test_now_ms() + 3000 * scale;
         atomic_load(&bad_key_logs) < 2 && bex_test_now_ms() < end;)
        bex_test_sleep_ms(10);
    CHECK(atomic_load(&bad_key_logs) >= 2);
    bex_test_sleep_ms(300); /* the events came in order: the foreign key's was first */
    CHECK_EQ(atomic_load(&bad_key_logs), 2);
    CHECK(bex_dir_generation(d) >= g + 1);
    CHECK_EQ(bex_dir_replicas(d, "ps", 0, NULL, 0), 2);
    /* a registration made now shows through the watch (not the first
     * read), and a revoked one goes at once */
    bex_dir_replica self = {
        .addr = bex_addr_loopback4(7003), .locality = "dc2/pod1", .transport = 2};
    bex_dir_registration *reg;
    CHECK_OK(bex_dir_register_etcd(url, NULL, "ps", 0, &self, 30, err, sizeof err, &reg));
    CHECK(wait_n(d, 3, 3000 * scale) >= 0);
    bex_dir_replica r[4];
    CHECK_EQ(bex_dir_replicas(d, "ps", 0, r, 4), 3);
    CHECK(has_port(d, 7003, "dc2/pod1"));
    CHECK_OK(bex_dir_deregister(reg));
    long gone = wait_n(d, 2, 3000 * scale);
    fprintf(stderr, "revoked registration gone after %ld ms\n", gone);
    CHECK(gone >= 0 && gone < 1000 * (long)scale);
    CHECK(!has_port(d, 7003, NULL));
    /* kill one server: its key goes within the TTL (+ etcd's lease check,
     * every 500 ms); the other stays */
    uint64_t t_kill = bex_test_now_ms();
    reap(&child_pid[0], SIGKILL);
    long vanished = wait_n(d, 1, (TTL_S * 1000 + 3000) * scale);
    fprintf(stderr, "killed server gone after %ld ms (TTL %d s)\n",
            vanished >= 0 ? (long)(bex_test_now_ms() - t_kill) : -1L, TTL_S);
    CHECK(vanished >= 0);
    CHECK(bex_test_now_ms() - t_kill <= (TTL_S * 1000 + 1500) * scale);
    CHECK(!has_port(d, 7001, NULL) && has_port(d, 7002, "dc1/pod2"));
    /* the survivor's keepalive holds it past several TTLs */
    bex_test_sleep_ms(2 * TTL_S * 1000 + 500);
    CHECK(has_port(d, 7002, "dc1/pod2"));
    /* the directory's choice follows etcd: only the survivor is picked */
    for (int i = 0; i < 10; i++) {
        CHECK_OK(bex_dir_pick(d, "ps", 0, "dc1/pod1", NULL, &r[0]));
        CHECK_EQ(ntohs(r[0].addr.in4.sin_port), 7002);
        bex_dir_report(d, &r[0].addr, BEX_DIR_OK, 1);
    }
    /* the other server dies too: the shard empties */
    reap(&child_pid[1], SIGKILL);
    CHECK(wait_n(d, 0, (TTL_S * 1000 + 3000) * scale) >= 0);
    CHECK_EQ(bex_dir_pick(d, "ps", 0, NULL, NULL, &r[0]), -ENOENT);
    bex_dir_destroy(d);
    /* a directory that cannot reach etcd says so */
    CHECK_OK(bex_dir_create(NULL, &d));
    cleanup();
    CHECK_EQ(bex_dir_watch_etcd(d, url, NULL, err, sizeof err), -ECONNREFUSED);
    fprintf(stderr, "etcd gone: %s\n", err);
    CHECK(strstr(err, url));
    bex_dir_destroy(d);
    return 0;
}

/* etcd killed and started again (same ports and data): the watch is
 * re-established by itself; a server registered after the restart shows,
 * and one killed after it vanishes; the survivor's registration is kept
 * (its lease renewed, or granted and put again). */
static int t_restart(void)
{
    main_pid = getpid();
    atexit(cleanup_main);
    unsigned scale = bex_test_time_scale();
    char url[64];
    start_etcd(url, sizeof url);
    child_pid[0] = spawn_registrant(url, 7001, "dc1/pod1");
    int go, done; /* the second registers after the restart */
    child_pid[1] = fork_registrant(url, 7002, "dc1/pod2", &go, &done);
    bex_dir_config dc = {.log_fn = dlog};
    bex_dir *d;
    CHECK_OK(bex_dir_create(&dc, &d));
    char err[256] = "";
    CHECK_OK(bex_dir_watch_etcd(d, url, NULL, err, sizeof err));
    CHECK(wait_n(d, 1, 5000 * scale) >= 0);
    reap(&etcd_pid, SIGKILL);
    bex_test_sleep_ms(1500);              /* the watch sees the stream end and retries meanwhile */
    CHECK(has_port(d, 7001, "dc1/pod1")); /* the last view is kept while etcd is away */
    exec_etcd();
    registered(go, done);
    long seen = wait_n(d, 2, 15000 * scale);
    fprintf(stderr, "registration after the restart seen after %ld ms\n", seen);
    CHECK(seen >= 0);
    CHECK(has_port(d, 7001, "dc1/pod1") && has_port(d, 7002, "dc1/pod2"));
    reap(&child_pid[1], SIGKILL);
    CHECK(wait_n(d, 1, (TTL_S * 1000 + 3000) * scale) >= 0);
    CHECK(has_port(d, 7001, "dc1/pod1"));
    bex_dir_destroy(d);
    cleanup();
    return 0;
}

BEX_TEST_MAIN({"watch", t_watch}, {"restart", t_restart})
