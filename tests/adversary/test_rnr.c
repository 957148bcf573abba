/* SPDX-License-Identifier: Apache-2.0 */
/* A peer that lies about its credits (label `adversary`, on rxe): a raw
 * verbs listener (tests/sock/rawpeer.h) that completes the hello granting
 * 64 receive credits, keeps its keepalive going, and posts no receive. A
 * bex client that sends to it meets RNR NAKs on its first SEND:
 *
 *   rnr_short:   qp_rnr_retry 1: the NIC gives up at once; the message
 *                comes back -ECANCELED or -EIO (never success), the socket
 *                fails with -ENOBUFS and an error naming the peer,
 *                bex_transport_rnr_errors_total (bex_ctx_prometheus) moves
 *                to 1, and the liar sees its connection closed;
 *   rnr_forever: qp_rnr_retry 7 (the default; RNR retried forever on the
 *                wire) and the liar's keepalive arriving: the send that
 *                never completes fails the engine after credit_timeout_ms
 *                (-ETIMEDOUT; the message in doubt, -EIO), no hang; no RNR
 *                error is counted. Before that deadline it hung for good.
 *
 * Both end with the socket closed and the context destroyed (the ASan
 * tier's leak check covers them). The liar is a forked process that opens
 * its device after the fork, so no verbs state crosses it. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sock/pair.h"
#include "sock/rawpeer.h"

#define MSG_LEN  512 /* under the liar's eager_max: one SEND */
#define LOG_CAP  (16 << 10)
#define TEXT_CAP (64 << 10)

/* ---- the liar (child process) ---- */

static int liar_listen(struct in_addr a, uint16_t *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    bex_addr me = {.in4 = {.sin_family = AF_INET, .sin_addr = a}};
    socklen_t sl = sizeof me;
    CHECK(bind(fd, (struct sockaddr *)&me, sizeof me) == 0 && listen(fd, 1) == 0);
    CHECK(getsockname(fd, (struct sockaddr *)&me, &sl) == 0);
    *port = ntohs(me.in4.sin_port);
    return fd;
}

/* Accept one bex client, lie, and tell the parent (on wr) the port first,
 * then whether bex closed the connection. Exit status 0 when it did. */
static int liar_main(int wr, struct in_addr a)
{
    struct rawpeer rp;
    struct rp_opts o = {
        .recv_depth = 64, .max_rndv = 16, .max_msg = 1u << 20, .eager_max = 1024, .no_recvs = true};
    rp_init(&rp, a, &o);
    uint16_t port = 0;
    int lfd = liar_listen(a, &port);
    CHECK(lfd >= 0);
    CHECK(write(wr, &port, sizeof port) == (ssize_t)sizeof port);
    rp_accept(&rp, lfd, &o);
    bool closed = rp_wait_closed(&rp, 30000 * time_scale());
    uint8_t said = closed;
    CHECK(write(wr, &said, 1) == 1);
    rp_fini(&rp);
    close(lfd);
    return closed ? 0 : 1;
}

/* ---- the bex client (parent) ---- */

static struct {
    pthread_mutex_t mu;
    char text[LOG_CAP];
    size_t n;
} logs = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void log_keep(int level, const char *msg, void *arg)
{
    (void)arg;
    fprintf(stderr, "bex: %s\n", msg);
    if (level > BEX_LOG_ERROR)
        return;
    pthread_mutex_lock(&logs.mu);
    int n = snprintf(logs.text + logs.n, sizeof logs.text - logs.n, "%s\n", msg);
    if (n > 0 && logs.n + (size_t)n < sizeof logs.text)
        logs.n += (size_t)n;
    pthread_mutex_unlock(&logs.mu);
}

/* An ERROR line that names peer and says want. */
static bool logged(const char *peer, const char *want)
{
    pthread_mutex_lock(&logs.mu);
    bool found = false;
    for (const char *l = logs.text; *l && !found;) {
        const char *end = strchr(l, '\n');
        size_t len = end ? (size_t)(end - l) : strlen(l);
        char line[1024];
        snprintf(line, sizeof line, "%.*s", (int)len, l);
        found = strstr(line, peer) && strstr(line, want);
        l += len + (end != NULL);
    }
    pthread_mutex_unlock(&logs.mu);
    return found;
}

static long long metric(bex_ctx *ctx, const char *name)
{
    static char text[TEXT_CAP];
    int n = bex_ctx_prometheus(ctx, text, sizeof text);
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *at = n > 0 && (size_t)n < sizeof text ? strstr(text, key) : NULL;
    return at ? strtoll(at + strlen(key), NULL, 10) : -1;
}

struct cli {
    struct waiter w;
    _Atomic long connected, errors, closed, done, done_err;
    _Atomic int err, conn_status, send_status;
};

static void cli_connected(bex_sock *s, int status, void *user)
{
    (void)s;
    struct cli *c = user;
    atomic_store(&c->conn_status, status);
    waiter_add(&c->w, &c->connected, 1);
}

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s, (void)len, (void)user;
    bex_mem_free(buf); /* the liar never sends */
}

static void cli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu;
    struct cli *c = user;
    bex_mem_free(buf);
    atomic_store(&c->send_status, status);
    if (status)
        atomic_fetch_add(&c->done_err, 1);
    waiter_add(&c->w, &c->done, 1);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    (void)s;
    struct cli *c = user;
    atomic_store(&c->err, err);
    waiter_add(&c->w, &c->errors, 1);
}

static void cli_closed(bex_sock *s, void *user)
{
    (void)s;
    waiter_add(&((struct cli *)user)->w, &((struct cli *)user)->closed, 1);
}

static const bex_sock_ops cli_ops = {.on_connect = cli_connected,
                                     .on_recv = cli_recv,
                                     .on_send_done = cli_done,
                                     .on_error = cli_error,
                                     .on_close = cli_closed};

struct want {
    uint8_t rnr_retry;    /* qp_rnr_retry (0: the default, 7) */
    int err;              /* the socket's error (on_error, bex_sock_last_error) */
    long long rnr_errors; /* bex_transport_rnr_errors_total after it */
    const char *log;      /* an ERROR line naming the peer says this */
};

/* One message to the liar. Its OPEN, sent at connect, meets the RNR first:
 * with few retries the socket may fail before (on_connect's error) or
 * while the message is handed over (-EPIPE). Either way the send reports
 * an error, never success. */
static int send_one(bex_ctx *ctx, bex_sock *s, struct cli *c, const struct want *w)
{
    int cs = atomic_load(&c->conn_status);
    if (cs) {
        CHECK_EQ(cs, w->err);
        return 0;
    }
    void *buf = bex_sock_alloc(ctx, MSG_LEN);
    CHECK(buf);
    memset(buf, 0x5a, MSG_LEN);
    int rc = bex_sock_send(s, buf, MSG_LEN, NULL);
    if (rc) {
        bex_mem_free(buf);
        CHECK_EQ(rc, -EPIPE);
    }
    /* the RNR retries take milliseconds, credit_timeout_ms 150 ms */
    CHECK_OK(wait_count(&c->w, &c->errors, 1, 10000));
    CHECK_EQ(atomic_load(&c->err), w->err);
    if (!rc) {
        CHECK_OK(wait_count(&c->w, &c->done, 1, 10000));
        CHECK_EQ(atomic_load(&c->done_err), 1);
        /* undelivered (-ECANCELED: refused or never posted) or in doubt
         * (-EIO: posted behind the refused OPEN, or never completed) */
        int st = atomic_load(&c->send_status);
        CHECK(st == -ECANCELED || st == -EIO);
    }
    return 0;
}

/* Connect to the liar at to, send one message, see it fail as w says. */
static int send_to_liar(bex_ctx *ctx, const bex_addr *to, const struct want *w)
{
    char peer[BEX_ADDR_STRLEN], why[256];
    bex_addr_format(to, true, peer, sizeof peer);
    struct cli c = {.w = WAITER_INIT};
    bex_sock *s;
    CHECK_EQ(metric(ctx, "bex_transport_rnr_errors_total"), 0);
    CHECK_OK(bex_sock_connect(ctx, to, &cli_ops, &c, &s));
    CHECK_OK(wait_count(&c.w, &c.connected, 1, 10000));
    int rc = send_one(ctx, s, &c, w);
    int last = bex_sock_last_error(s, why, sizeof why);
    fprintf(stderr,
            "send to the liar: connect %d, on_error %d, send done %ld (%d), last error %d "
            "\"%s\"\n",
            atomic_load(&c.conn_status), atomic_load(&c.err), atomic_load(&c.done),
            atomic_load(&c.send_status), last, why);
    CHECK_OK(rc);
    CHECK_EQ(last, w->err);
    CHECK(strstr(why, peer) != NULL);
    CHECK_EQ(metric(ctx, "bex_transport_rnr_errors_total"), w->rnr_errors);
    CHECK(logged(peer, w->log));
    bex_sock_close(s);
    CHECK_OK(wait_count(&c.w, &c.closed, 1, 10000));
    return 0;
}

static int client_side(struct in_addr a1, const bex_addr *to, const struct want *w)
{
    bex_ctx_config cfg = BEX_CTX_CONFIG_INIT;
    cfg.local_addr.in4 = (struct sockaddr_in){.sin_family = AF_INET, .sin_addr = a1};
    cfg.transport = BEX_TRANSPORT_RDMA;
    cfg.qp_rnr_retry = w->rnr_retry;
    cfg.credit_timeout_ms = 150 * time_scale();
    cfg.log_fn = log_keep;
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&cfg, &ctx));
    int rc = send_to_liar(ctx, to, w);
    CHECK_OK(bex_ctx_destroy(ctx));
    return rc;
}

static int read_full(int fd, void *p, size_t n, unsigned ms)
{
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    for (size_t got = 0; got < n;) {
        if (poll(&pf, 1, (int)ms) != 1)
            return -ETIMEDOUT;
        ssize_t k = read(fd, (char *)p + got, n - got);
        if (k <= 0)
            return -EPIPE;
        got += (size_t)k;
    }
    return 0;
}

static int run_liar(const struct want *w)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    int up[2];
    CHECK(pipe(up) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a failed CHECK of the parent exits */
        close(up[0]);
        _exit(liar_main(up[1], a0));
    }
    close(up[1]);
    uint16_t port = 0;
    int rc = read_full(up[0], &port, sizeof port, 10000 * time_scale());
    bex_addr to = {.in4 = {.sin_family = AF_INET, .sin_addr = a0, .sin_port = htons(port)}};
    if (!rc)
        rc = client_side(a1, &to, w);
    uint8_t closed = 0;
    if (!rc && read_full(up[0], &closed, 1, 10000 * time_scale()))
        fprintf(stderr, "the liar did not say whether bex closed it\n");
    if (rc)
        kill(pid, SIGKILL);
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid);
    close(up[0]);
    CHECK_OK(rc);
    CHECK(closed == 1);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    return 0;
}

static int rnr_short(void)
{
    struct want w = {
        .rnr_retry = 1, .err = -ENOBUFS, .rnr_errors = 1, .log = "RNR retry counter exceeded"};
    return run_liar(&w);
}

static int rnr_forever(void)
{
    struct want w = {
        .rnr_retry = 0, .err = -ETIMEDOUT, .rnr_errors = 0, .log = "has not completed"};
    return run_liar(&w);
}

BEX_TEST_MAIN(BEX_CASE(rnr_short), BEX_CASE(rnr_forever))
