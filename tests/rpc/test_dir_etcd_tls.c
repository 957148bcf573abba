/* SPDX-License-Identifier: Apache-2.0 */
/* The directory over etcd with TLS and authentication (issue 27 item 7;
 * bex_etcd_configure). etcd_tls.sh makes a throwaway CA, server and client
 * certificates and starts etcd on https://127.0.0.1 requiring client
 * certificates (auth tokens living 1 s). Over https://localhost:
 *  - no settings: the server's certificate is refused (unknown CA);
 *  - the CA only: etcd refuses us (no client certificate);
 *  - CA and client certificate: a registration shows through a watch;
 *  - with etcd's authentication enabled: no user is refused ("user name is
 *    empty"), a bogus token too, user/password work, and still do after
 *    the token expired (it is fetched again).
 * Without etcd or openssl the case fails: it does not skip. */
#include <curl/curl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bex/dir.h"
#include "harness.h"
#include "port.h"

static pid_t etcd_pid;
static char dir[64], url[64], ca[96], cert[96], key[96];

static void stop(void)
{
    if (etcd_pid > 0) {
        kill(etcd_pid, SIGTERM);
        waitpid(etcd_pid, NULL, 0);
        etcd_pid = 0;
    }
    if (dir[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        CHECK(system(cmd) == 0);
    }
}

static void start(void)
{
    uint16_t cport = bex_test_port(), pport = bex_test_port();
    snprintf(dir, sizeof dir, "/tmp/bex-etcd-tls-XXXXXX");
    CHECK(mkdtemp(dir));
    atexit(stop);
    snprintf(url, sizeof url, "https://localhost:%u", cport);
    snprintf(ca, sizeof ca, "%s/ca.crt", dir);
    snprintf(cert, sizeof cert, "%s/client.crt", dir);
    snprintf(key, sizeof key, "%s/client.key", dir);
    char cp[8], pp[8];
    snprintf(cp, sizeof cp, "%u", cport);
    snprintf(pp, sizeof pp, "%u", pport);
    fflush(NULL);
    etcd_pid = fork();
    CHECK(etcd_pid >= 0);
    if (etcd_pid == 0) {
        execl("/bin/sh", "sh", BEX_ETCD_TLS_SH, dir, cp, pp, (char *)NULL);
        _exit(127);
    }
}

/* A directory watching etcd with the settings now; its error into err. */
static int watch(bex_dir **d, char *err, size_t cap)
{
    CHECK_OK(bex_dir_create(NULL, d));
    err[0] = 0;
    return bex_dir_watch_etcd(*d, url, NULL, err, cap);
}

static bex_dir_registration *register_self(uint16_t port)
{
    bex_dir_replica self = {.addr = bex_addr_loopback4(port)};
    bex_dir_registration *reg = NULL;
    char err[512];
    uint64_t end = bex_test_now_ms() + 20000 * bex_test_time_scale();
    int rc;
    while ((rc = bex_dir_register_etcd(url, NULL, "ps", 0, &self, 10, err, sizeof err, &reg)) &&
           bex_test_now_ms() < end)
        usleep(100 * 1000); /* etcd starting (and making its certificates) */
    if (rc)
        fprintf(stderr, "register: %s\n", err);
    CHECK_OK(rc);
    return reg;
}

/* POST body to etcd's path with the client certificate (the test's own
 * client: etcd's auth API); the HTTP status. */
static long post(const char *path, const char *body)
{
    char full[160];
    snprintf(full, sizeof full, "%s%s", url, path);
    CURL *e = curl_easy_init();
    CHECK(e);
    FILE *null = fopen("/dev/null", "w");
    curl_easy_setopt(e, CURLOPT_URL, full);
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(e, CURLOPT_CAINFO, ca);
    curl_easy_setopt(e, CURLOPT_SSLCERT, cert);
    curl_easy_setopt(e, CURLOPT_SSLKEY, key);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, null);
    long code = 0;
    CHECK(curl_easy_perform(e) == CURLE_OK);
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(e);
    fclose(null);
    return code;
}

static void expect_refused(const char *what, const char *text)
{
    bex_dir *d;
    char err[512];
    CHECK(watch(&d, err, sizeof err) != 0);
    fprintf(stderr, "%s: %s\n", what, err);
    CHECK(strstr(err, text));
    bex_dir_destroy(d);
}

static void expect_sees(size_t n)
{
    bex_dir *d;
    char err[512];
    int rc = watch(&d, err, sizeof err);
    if (rc)
        fprintf(stderr, "watch: %s\n", err);
    CHECK_OK(rc);
    bex_dir_replica r[4];
    CHECK_EQ(bex_dir_replicas(d, "ps", 0, r, 4), n);
    bex_dir_destroy(d);
}

static int tls(void)
{
    unsetenv("BEX_ETCD_CACERT"), unsetenv("BEX_ETCD_CERT"), unsetenv("BEX_ETCD_KEY");
    unsetenv("BEX_ETCD_USER"), unsetenv("BEX_ETCD_TOKEN");
    start();
    bex_etcd_config c = BEX_ETCD_CONFIG_INIT;
    c.ca_file = ca, c.cert_file = cert, c.key_file = key;
    CHECK_OK(bex_etcd_configure(&c));
    bex_dir_registration *reg = register_self(7001); /* waits for etcd */
    expect_sees(1);
    CHECK_OK(bex_dir_deregister(reg));
    /* fewer settings: refused */
    CHECK_OK(bex_etcd_configure(NULL));
    expect_refused("no CA", "SSL");
    bex_etcd_config ca_only = BEX_ETCD_CONFIG_INIT;
    ca_only.ca_file = ca;
    CHECK_OK(bex_etcd_configure(&ca_only));
    expect_refused("no client certificate", "etcd https://localhost");
    bex_etcd_config bad = c;
    bad.key_file = NULL;
    CHECK_EQ(bex_etcd_configure(&bad), -EINVAL);
    /* etcd's authentication on: root with password pw */
    CHECK_EQ(post("/v3/auth/role/add", "{\"name\":\"root\"}"), 200);
    CHECK_EQ(post("/v3/auth/user/add", "{\"name\":\"root\",\"password\":\"pw\"}"), 200);
    CHECK_EQ(post("/v3/auth/user/grant", "{\"user\":\"root\",\"role\":\"root\"}"), 200);
    CHECK_EQ(post("/v3/auth/enable", "{}"), 200);
    CHECK_OK(bex_etcd_configure(&c));
    expect_refused("no user", "user name is empty");
    bex_etcd_config tok = c;
    tok.token = "bogus";
    CHECK_OK(bex_etcd_configure(&tok));
    expect_refused("bogus token", "invalid auth token");
    c.user = "root", c.password = "pw";
    CHECK_OK(bex_etcd_configure(&c));
    reg = register_self(7002);
    expect_sees(1);
    usleep(2500 * 1000); /* the token (TTL 1 s) expires: fetched again */
    expect_sees(1);
    CHECK_OK(bex_dir_deregister(reg));
    return 0;
}

BEX_TEST_MAIN({"tls", tls})
