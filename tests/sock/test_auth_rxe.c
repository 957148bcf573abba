/* SPDX-License-Identifier: Apache-2.0 */
/* Who may connect (issue 7 part 2), on real RDMA devices: a shared secret
 * admits its holders and refuses everybody else with a clear error while
 * good clients go on; nothing about a QP (hello, QPN, GID, keepalive key) is
 * sent to a peer before it proved the secret, in either direction; a hello
 * whose GID is not the TCP peer's address is refused by both sides. Some
 * cases speak the setup by hand over TCP (wire/hello.h has the codec). */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "echo.h"
#include "conn/hello_io.h"
#include "wire/hello.h"

static const char S1[] = "bex test cluster secret, one";
static const char S2[] = "bex test cluster secret, two";

static unsigned ms(unsigned v)
{
    return v * time_scale();
}

static void no_env_secret(void)
{
    unsetenv("BEX_SECRET");
    unsetenv("BEX_SECRET_FILE");
}

static bex_ctx_config with_secret(const char *s)
{
    bex_ctx_config c = {.secret = s, .secret_len = s ? strlen(s) : 0};
    return c;
}

static struct in_addr addr_env(const char *var)
{
    struct in_addr a;
    CHECK(inet_pton(AF_INET, getenv(var), &a) == 1);
    return a;
}

static void gid_of(struct in_addr a, uint8_t gid[16])
{
    memset(gid, 0, 16);
    gid[10] = gid[11] = 0xff;
    memcpy(gid + 12, &a.s_addr, 4);
}

/* ---------------- the server: echo, and count refusals in its log ---------------- */

static _Atomic long refusals, accepted;

static void srv_log(int level, const char *msg, void *arg)
{
    (void)arg;
    fprintf(stderr, "server log (%d): %s\n", level, msg);
    if (strstr(msg, "refused peer"))
        atomic_fetch_add(&refusals, 1);
}

static const bex_sock_ops echo_ops = {
    .on_recv = echo_srv_recv, .on_send_done = echo_srv_done, .on_error = echo_srv_error};

static void echo_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    atomic_fetch_add(&accepted, 1);
    bex_sock_set_user(s, &echo_ops, user);
}

/* What the server must have seen when the client is done. */
struct expect {
    long refusals; /* "refused peer" log lines: one per refused connection */
    long min_accepted;
};

static int echo_server(struct pair *p, void *arg)
{
    struct expect *e = arg;
    bex_listener_ops lops = {.on_accept = echo_accept};
    pair_listen(p, &lops, NULL);
    pair_wait_parent(p);
    pair_sleep_ms(200); /* a refusal the client saw is logged before it is sent */
    int rc = 0;
    if (atomic_load(&refusals) != e->refusals) {
        fprintf(stderr, "server: %ld refusals logged, expected %ld\n", atomic_load(&refusals),
                e->refusals);
        rc = 1;
    }
    if (atomic_load(&accepted) < e->min_accepted) {
        fprintf(stderr, "server: %ld sockets accepted, expected at least %ld\n",
                atomic_load(&accepted), e->min_accepted);
        rc = 1;
    }
    return rc;
}

static bex_ctx_config server_cfg(const char *secret)
{
    bex_ctx_config c = with_secret(secret);
    c.log_fn = srv_log;
    c.log_level = BEX_LOG_INFO;
    return c;
}

/* ---------------- a client socket that checks its echoes ---------------- */

struct tc {
    struct waiter w;
    _Atomic long connected, recvd, done, send_err, closed;
    int status;
    int bad;
    uint32_t next;
    bex_sock *s;
};

static const size_t LENS[] = {16, 1000, 8192, 8193, 100000, 1 << 20};
#define NLENS (sizeof LENS / sizeof LENS[0])

static void tc_connect(bex_sock *s, int status, void *user)
{
    struct tc *t = user;
    (void)s;
    t->status = status;
    atomic_fetch_add(&t->connected, 1);
    waiter_signal(&t->w);
}

static void tc_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct tc *t = user;
    (void)s;
    uint32_t seq = t->next;
    if (len != LENS[seq % NLENS] || memcmp(buf, &seq, 4) ||
        check_pattern((uint8_t *)buf + 4, len - 4, seq)) {
        fprintf(stderr, "bad echo %u: len %zu (sent %zu)\n", seq, len, LENS[seq % NLENS]);
        t->bad++;
    }
    t->next++;
    bex_mem_free(buf);
    atomic_fetch_add(&t->recvd, 1);
    waiter_signal(&t->w);
}

static void tc_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    struct tc *t = user;
    (void)s, (void)len, (void)mu;
    if (status)
        atomic_fetch_add(&t->send_err, 1);
    bex_mem_free(buf);
    atomic_fetch_add(&t->done, 1);
    waiter_signal(&t->w);
}

static void tc_error(bex_sock *s, int err, void *user)
{
    (void)s, (void)user;
    fprintf(stderr, "client socket error: %s\n", bex_strerror(err));
}

static void tc_closed(bex_sock *s, void *user)
{
    struct tc *t = user;
    (void)s;
    waiter_add(&t->w, &t->closed, 1);
}

static const bex_sock_ops tc_ops = {.on_connect = tc_connect,
                                    .on_recv = tc_recv,
                                    .on_send_done = tc_done,
                                    .on_error = tc_error,
                                    .on_close = tc_closed};

static struct tc *tc_start(bex_ctx *ctx, const bex_addr *srv)
{
    struct tc *t = calloc(1, sizeof(*t));
    CHECK(t);
    pthread_mutex_init(&t->w.mu, NULL);
    pthread_cond_init(&t->w.cv, NULL);
    CHECK_OK(bex_sock_connect(ctx, srv, &tc_ops, t, &t->s));
    return t;
}

/* Wait for on_connect; returns its status. */
static int tc_wait_connect(struct tc *t)
{
    CHECK_OK(wait_count(&t->w, &t->connected, 1, 15000));
    return t->status;
}

/* n messages of every size in LENS through the echo server, checked. */
static void tc_echo(bex_ctx *ctx, struct tc *t, uint32_t n)
{
    uint32_t first = t->next;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t seq = first + i;
        size_t len = LENS[seq % NLENS];
        uint8_t *b = bex_sock_alloc(ctx, len);
        CHECK(b);
        memcpy(b, &seq, 4);
        fill_pattern(b + 4, len - 4, seq);
        CHECK_OK(bex_sock_send(t->s, b, len, NULL));
    }
    CHECK_OK(wait_count(&t->w, &t->recvd, (long)(first + n), 60000));
    CHECK_OK(wait_count(&t->w, &t->done, (long)(first + n), 10000));
    CHECK_EQ(t->bad, 0);
    CHECK_EQ(atomic_load(&t->send_err), 0);
}

/* Close and wait for on_close: t is the socket's until then. */
static void tc_close(struct tc *t)
{
    bex_sock_close(t->s);
    CHECK_OK(wait_count(&t->w, &t->closed, 1, 15000));
    free(t);
}

/* ---------------- raw TCP: the setup by hand ---------------- */

static int raw_connect(const bex_addr *srv)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    bex_addr me = {.in4 = {.sin_family = AF_INET, .sin_addr = addr_env("BEX_TEST_ADDR1")}};
    CHECK(bind(fd, (struct sockaddr *)&me, sizeof me) == 0);
    CHECK(connect(fd, (const struct sockaddr *)srv, sizeof *srv) == 0);
    return fd;
}

static void raw_write(int fd, const void *p, size_t n)
{
    CHECK_OK(bex__hello_write_all(fd, p, n, bex__hello_now_ms() + ms(10000)));
}

static void raw_read(int fd, void *p, size_t n)
{
    CHECK_OK(bex__hello_read_all(fd, p, n, bex__hello_now_ms() + ms(10000)));
}

/* Everything the peer sends until it closes (a reset counts as a close);
 * fails if it neither closes nor stops within the deadline. */
static size_t raw_read_to_eof(int fd, uint8_t *buf, size_t cap)
{
    size_t got = 0;
    int64_t end = bex__hello_now_ms() + ms(10000);
    for (;;) {
        int64_t left = end - bex__hello_now_ms();
        CHECK(left > 0);
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, (int)left) <= 0)
            continue;
        ssize_t n = recv(fd, buf + got, cap - got, 0);
        if (n == 0 || (n < 0 && errno == ECONNRESET))
            return got;
        CHECK(n > 0);
        got += (size_t)n;
        CHECK(got < cap);
    }
}

/* The peer answers with a refusal notice carrying err, and nothing else. */
static void expect_refusal(int fd, int err, int line)
{
    uint8_t buf[512];
    size_t n = raw_read_to_eof(fd, buf, sizeof buf);
    uint32_t magic = 0, st = 0;
    if (n >= 8) {
        memcpy(&magic, buf, 4);
        memcpy(&st, buf + 4, 4);
    }
    if (n != BEX__READY_LEN || ntohl(magic) != BEX__READY_MAGIC || ntohl(st) != (uint32_t)err) {
        fprintf(stderr, "line %d: expected only a refusal notice (%s), got %zu bytes:", line,
                bex_strerror(-err), n);
        for (size_t i = 0; i < n && i < 48; i++)
            fprintf(stderr, " %02x", buf[i]);
        fprintf(stderr, "\n");
        exit(1);
    }
    close(fd);
}
#define EXPECT_REFUSAL(fd, err) expect_refusal((fd), (err), __LINE__)

/* A plausible hello from addr (the GID that addr would have). */
static struct bex__hello raw_hello(struct in_addr gid_addr, uint64_t conn_id)
{
    struct bex__hello h = {
        .qpn = 0x4242,
        .psn = 0x1234,
        .mtu = 3,
        .recv_depth = 64,
        .sq_depth = 32,
        .max_msg = 1u << 31,
        .frag_size = 65536,
        .conn_id = conn_id,
        .eager_max = 8192,
        .ka_addr = 0x1000,
        .ka_rkey = 0x77,
        .max_rndv = 16,
    };
    gid_of(gid_addr, h.gid);
    return h;
}

static void key_of(const char *s, uint8_t key[BEX__AUTH_KEY_LEN])
{
    CHECK_OK(bex__auth_key(s, strlen(s), key));
}

/* Both ends of fd as the transcript names them: client first. */
static void raw_ends(int fd, bool client, struct bex__auth_transcript *t)
{
    bex_addr me, peer;
    socklen_t a = sizeof me, b = sizeof peer;
    CHECK(getsockname(fd, (struct sockaddr *)&me, &a) == 0);
    CHECK(getpeername(fd, (struct sockaddr *)&peer, &b) == 0);
    const bex_addr *c = client ? &me : &peer, *l = client ? &peer : &me;
    bex__auth_ends(t, c->in4.sin_addr.s_addr, c->in4.sin_port, l->in4.sin_addr.s_addr,
                   l->in4.sin_port);
}

/* Client side, up to and including the PROOF (made with key). */
static void raw_prove(int fd, struct bex__auth_transcript *t, const uint8_t key[32])
{
    uint8_t m[BEX__AUTH_SHORT_LEN], mac[32];
    bex__auth_encode(BEX__AUTH_OPEN, t->nonce_c, m);
    raw_write(fd, m, sizeof m);
    raw_read(fd, m, sizeof m);
    CHECK_OK(bex__auth_decode(m, sizeof m, BEX__AUTH_CHALLENGE, t->nonce_l));
    raw_ends(fd, true, t);
    bex__auth_mac(key, BEX__AUTH_MAC_PROOF_C, t, NULL, NULL, mac);
    bex__auth_encode(BEX__AUTH_PROOF, mac, m);
    raw_write(fd, m, sizeof m);
}

/* ---------------- cases ---------------- */

/* Same secret on both sides (the server's from its config, the client's
 * from a key file through BEX_SECRET_FILE): connects and exchanges; a key
 * file with another secret does not. */
static int same_client(struct pair *p, void *arg)
{
    (void)arg;
    struct tc *t = tc_start(p->ctx, &p->srv);
    CHECK_EQ(tc_wait_connect(t), 0);
    tc_echo(p->ctx, t, 3 * NLENS);
    tc_close(t);

    char path[256];
    const char *dir = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/bex-auth-other.key", dir && dir[0] ? dir : "/tmp");
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0);
    CHECK(write(fd, S2, strlen(S2)) == (ssize_t)strlen(S2));
    close(fd);
    setenv("BEX_SECRET_FILE", path, 1);
    bex_ctx_config c = {.local_addr = bex_addr_ipv4((addr_env("BEX_TEST_ADDR1")).s_addr, 0)};
    bex_ctx *other;
    CHECK_OK(bex_ctx_create(&c, &other));
    unlink(path);
    struct tc *u = tc_start(other, &p->srv);
    CHECK_EQ(tc_wait_connect(u), -EACCES);
    tc_close(u);
    pair_sleep_ms(100);
    bex_ctx_destroy(other);
    return 0;
}

static int same_secret(void)
{
    no_env_secret();
    char path[256];
    const char *dir = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/bex-auth-%d.key", dir && dir[0] ? dir : "/tmp", (int)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0);
    CHECK(write(fd, S1, strlen(S1)) == (ssize_t)strlen(S1));
    CHECK(write(fd, "\n", 1) == 1);
    close(fd);
    bex_ctx_config scfg = server_cfg(S1);
    struct expect e = {.refusals = 1, .min_accepted = 1};
    /* the server's config secret wins over the environment it inherits */
    setenv("BEX_SECRET_FILE", path, 1);
    int rc = pair_run(&scfg, echo_server, &e, NULL, same_client, NULL, 60);
    unlink(path);
    return rc;
}

/* A listener with a secret: a client with another secret and one with none
 * are refused with -EACCES, logged once each, while a client with the
 * secret connects at the same time and after them. */
static int refused_client(struct pair *p, void *arg)
{
    (void)arg;
    struct in_addr a1 = addr_env("BEX_TEST_ADDR1");
    bex_ctx_config cb = with_secret(S2), cn = {0};
    cb.local_addr = cn.local_addr = bex_addr_ipv4(a1.s_addr, 0);
    bex_ctx *bad, *none;
    CHECK_OK(bex_ctx_create(&cb, &bad));
    CHECK_OK(bex_ctx_create(&cn, &none));
    struct tc *tb = tc_start(bad, &p->srv);
    struct tc *tn = tc_start(none, &p->srv);
    struct tc *tg = tc_start(p->ctx, &p->srv);
    CHECK_EQ(tc_wait_connect(tg), 0);
    tc_echo(p->ctx, tg, NLENS);
    CHECK_EQ(tc_wait_connect(tb), -EACCES);
    CHECK_EQ(tc_wait_connect(tn), -EACCES);
    /* a refused socket is dead: sends are refused at once */
    void *b = bex_sock_alloc(bad, 16);
    CHECK_EQ(bex_sock_send(tb->s, b, 16, NULL), -EPIPE);
    bex_mem_free(b);
    tc_close(tb);
    tc_close(tn);
    /* the listener goes on serving: the good socket and a new one */
    tc_echo(p->ctx, tg, NLENS);
    struct tc *t2 = tc_start(p->ctx, &p->srv);
    CHECK_EQ(tc_wait_connect(t2), 0);
    tc_echo(p->ctx, t2, NLENS);
    tc_close(t2);
    tc_close(tg);
    pair_sleep_ms(100);
    bex_ctx_destroy(bad);
    bex_ctx_destroy(none);
    return 0;
}

static int refused(void)
{
    no_env_secret();
    bex_ctx_config scfg = server_cfg(S1), ccfg = with_secret(S1);
    struct expect e = {.refusals = 2, .min_accepted = 2};
    return pair_run(&scfg, echo_server, &e, &ccfg, refused_client, NULL, 60);
}

/* A listener without a secret refuses a client that has one (-EACCES for
 * the client: the listener cannot prove it), and serves a client without
 * one at the same time. */
static int secret_vs_none_client(struct pair *p, void *arg)
{
    (void)arg;
    bex_ctx_config cs = with_secret(S1);
    cs.local_addr = bex_addr_ipv4((addr_env("BEX_TEST_ADDR1")).s_addr, 0);
    bex_ctx *sec;
    CHECK_OK(bex_ctx_create(&cs, &sec));
    struct tc *ts = tc_start(sec, &p->srv);
    struct tc *tg = tc_start(p->ctx, &p->srv);
    CHECK_EQ(tc_wait_connect(tg), 0);
    CHECK_EQ(tc_wait_connect(ts), -EACCES);
    tc_echo(p->ctx, tg, NLENS);
    tc_close(ts);
    tc_close(tg);
    pair_sleep_ms(100);
    bex_ctx_destroy(sec);
    return 0;
}

static int secret_vs_none(void)
{
    no_env_secret();
    bex_ctx_config scfg = server_cfg(NULL);
    struct expect e = {.refusals = 1, .min_accepted = 1};
    return pair_run(&scfg, echo_server, &e, NULL, secret_vs_none_client, NULL, 60);
}

/* By hand, against a listener with a secret: whatever an unauthenticated
 * peer sends, all it ever receives is one refusal notice: never a hello,
 * QPN, GID or keepalive key. */
static int raw_auth_client(struct pair *p, void *arg)
{
    (void)arg;
    struct in_addr a0 = addr_env("BEX_TEST_ADDR0"), a1 = addr_env("BEX_TEST_ADDR1");
    uint8_t k1[32], k2[32], mac[32];
    key_of(S1, k1);
    key_of(S2, k2);
    uint8_t raw[BEX__HELLO_LEN], m[BEX__AUTH_HELLO_LEN + BEX__READY_LEN];

    /* a plain (v1) hello, well-formed, with our own GID */
    int fd = raw_connect(&p->srv);
    struct bex__hello h = raw_hello(a1, 0x1111);
    bex__hello_encode(&h, raw);
    raw_write(fd, raw, sizeof raw);
    EXPECT_REFUSAL(fd, EACCES);

    /* not bex at all */
    fd = raw_connect(&p->srv);
    raw_write(fd, "GET / HTTP/1.1\r\n\r\n", 18);
    EXPECT_REFUSAL(fd, EPROTO);

    /* the right exchange with the wrong secret */
    struct bex__auth_transcript t = {0};
    fd = raw_connect(&p->srv);
    CHECK_OK(bex__auth_nonce(t.nonce_c));
    raw_prove(fd, &t, k2);
    EXPECT_REFUSAL(fd, EACCES);

    /* a good proof, recorded; the listener's hello follows it (and proves
     * the listener holds the secret). Then the proof is replayed on a new
     * connection with the same client nonce: the listener's new nonce makes
     * it worthless. */
    struct bex__auth_transcript first = {0};
    fd = raw_connect(&p->srv);
    CHECK_OK(bex__auth_nonce(first.nonce_c));
    raw_prove(fd, &first, k1);
    struct bex__hello hl;
    raw_read(fd, m, BEX__AUTH_HELLO_LEN);
    CHECK_OK(bex__auth_decode_hello(m, BEX__AUTH_HELLO_LEN, &hl, mac));
    CHECK_OK(bex__auth_verify(k1, BEX__AUTH_MAC_HELLO_L, &first, m + BEX__AUTH_HDR_LEN, NULL, mac));
    uint8_t g0[16];
    gid_of(a0, g0);
    CHECK(memcmp(hl.gid, g0, 16) == 0);
    uint8_t recorded[32];
    bex__auth_mac(k1, BEX__AUTH_MAC_PROOF_C, &first, NULL, NULL, recorded);
    close(fd);

    struct bex__auth_transcript second = {0};
    memcpy(second.nonce_c, first.nonce_c, 32);
    fd = raw_connect(&p->srv);
    bex__auth_encode(BEX__AUTH_OPEN, second.nonce_c, m);
    raw_write(fd, m, BEX__AUTH_SHORT_LEN);
    raw_read(fd, m, BEX__AUTH_SHORT_LEN);
    CHECK_OK(bex__auth_decode(m, BEX__AUTH_SHORT_LEN, BEX__AUTH_CHALLENGE, second.nonce_l));
    CHECK(memcmp(second.nonce_l, first.nonce_l, 32) != 0);
    bex__auth_encode(BEX__AUTH_PROOF, recorded, m);
    raw_write(fd, m, BEX__AUTH_SHORT_LEN);
    EXPECT_REFUSAL(fd, EACCES);

    /* authenticated, but our hello names a GID that is not our address */
    for (int variant = 0; variant < 2; variant++) {
        struct bex__auth_transcript tt = {0};
        fd = raw_connect(&p->srv);
        CHECK_OK(bex__auth_nonce(tt.nonce_c));
        raw_prove(fd, &tt, k1);
        uint8_t lraw[BEX__HELLO_LEN];
        raw_read(fd, m, BEX__AUTH_HELLO_LEN);
        CHECK_OK(bex__auth_decode_hello(m, BEX__AUTH_HELLO_LEN, &hl, mac));
        memcpy(lraw, m + BEX__AUTH_HDR_LEN, sizeof lraw);
        struct in_addr other = {.s_addr = htonl(ntohl(a1.s_addr) + 1)};
        h = raw_hello(variant == 0 ? other : a1, hl.conn_id);
        bex__hello_encode(&h, raw);
        bex__auth_mac(k1, BEX__AUTH_MAC_HELLO_C, &tt, lraw, raw, mac);
        if (variant == 1)
            mac[0] ^= 1; /* our GID, but a hello the MAC does not cover */
        bex__auth_encode_hello(raw, mac, m);
        memcpy(m + BEX__AUTH_HELLO_LEN, "BEXR\0\0\0\0", 8);
        raw_write(fd, m, BEX__AUTH_HELLO_LEN + BEX__READY_LEN);
        EXPECT_REFUSAL(fd, variant == 0 ? EPROTO : EACCES);
    }

    /* and a real client with the secret still gets through */
    struct tc *tg = tc_start(p->ctx, &p->srv);
    CHECK_EQ(tc_wait_connect(tg), 0);
    tc_echo(p->ctx, tg, NLENS);
    tc_close(tg);
    pair_sleep_ms(100);
    return 0;
}

static int raw_auth(void)
{
    no_env_secret();
    bex_ctx_config scfg = server_cfg(S1), ccfg = with_secret(S1);
    /* v1 hello, HTTP, wrong secret, replay, bad GID, bad hello MAC */
    struct expect e = {.refusals = 6, .min_accepted = 1};
    return pair_run(&scfg, echo_server, &e, &ccfg, raw_auth_client, NULL, 60);
}

/* By hand, against a listener without a secret: a hello whose GID is not
 * the sender's address is refused before the listener says anything about
 * its QP; the same hello with the right GID is answered. */
static int raw_gid_client(struct pair *p, void *arg)
{
    (void)arg;
    struct in_addr a0 = addr_env("BEX_TEST_ADDR0"), a1 = addr_env("BEX_TEST_ADDR1");
    struct in_addr other = {.s_addr = htonl(ntohl(a1.s_addr) + 1)};
    uint8_t raw[BEX__HELLO_LEN];

    int fd = raw_connect(&p->srv);
    struct bex__hello h = raw_hello(other, 0x2222);
    bex__hello_encode(&h, raw);
    raw_write(fd, raw, sizeof raw);
    EXPECT_REFUSAL(fd, EPROTO);

    /* the listener's own address is not ours either */
    fd = raw_connect(&p->srv);
    h = raw_hello(a0, 0x2223);
    bex__hello_encode(&h, raw);
    raw_write(fd, raw, sizeof raw);
    EXPECT_REFUSAL(fd, EPROTO);

    /* the control: our own GID is answered with the listener's hello */
    fd = raw_connect(&p->srv);
    h = raw_hello(a1, 0x2224);
    bex__hello_encode(&h, raw);
    raw_write(fd, raw, sizeof raw);
    struct bex__hello hl;
    CHECK_OK(bex__hello_recv(fd, &hl, bex__hello_now_ms() + ms(10000)));
    CHECK_EQ(hl.conn_id, 0x2224);
    uint8_t g0[16];
    gid_of(a0, g0);
    CHECK(memcmp(hl.gid, g0, 16) == 0);
    close(fd);

    /* an authenticated OPEN: this listener has no secret to answer it */
    fd = raw_connect(&p->srv);
    uint8_t nonce[32], m[BEX__AUTH_SHORT_LEN];
    CHECK_OK(bex__auth_nonce(nonce));
    bex__auth_encode(BEX__AUTH_OPEN, nonce, m);
    raw_write(fd, m, sizeof m);
    EXPECT_REFUSAL(fd, EACCES);

    struct tc *tg = tc_start(p->ctx, &p->srv);
    CHECK_EQ(tc_wait_connect(tg), 0);
    tc_echo(p->ctx, tg, NLENS);
    tc_close(tg);
    pair_sleep_ms(100);
    return 0;
}

static int raw_gid(void)
{
    no_env_secret();
    bex_ctx_config scfg = server_cfg(NULL);
    struct expect e = {.refusals = 3, .min_accepted = 1};
    return pair_run(&scfg, echo_server, &e, NULL, raw_gid_client, NULL, 60);
}

/* By hand, against a RoCE v2 listener without a secret (issue 27: routes
 * in the hello): a route this version does not know (3) is refused with
 * -EPROTONOSUPPORT; a RoCE v1 and an InfiniBand hello (valid, with our
 * address's GID) are answered with a NO_RDMA hello: another route cannot
 * reach the listener's QP, so the connection goes over TCP. */
static int raw_route_client(struct pair *p, void *arg)
{
    (void)arg;
    struct in_addr a1 = addr_env("BEX_TEST_ADDR1");
    uint8_t raw[BEX__HELLO_LEN];

    int fd = raw_connect(&p->srv);
    struct bex__hello h = raw_hello(a1, 0x3331);
    h.route = 3;
    bex__hello_encode(&h, raw);
    raw_write(fd, raw, sizeof raw);
    EXPECT_REFUSAL(fd, EPROTONOSUPPORT);

    const uint8_t routes[] = {BEX__HELLO_ROUTE_ROCE_V1, BEX__HELLO_ROUTE_IB};
    for (size_t i = 0; i < sizeof routes; i++) {
        fd = raw_connect(&p->srv);
        h = raw_hello(a1, 0x3332 + i);
        h.route = routes[i];
        h.lid = routes[i] == BEX__HELLO_ROUTE_IB ? 5 : 0;
        bex__hello_encode(&h, raw);
        raw_write(fd, raw, sizeof raw);
        struct bex__hello hl;
        CHECK_OK(bex__hello_recv(fd, &hl, bex__hello_now_ms() + ms(10000)));
        CHECK_EQ(hl.conn_id, 0x3332 + i);
        CHECK(hl.flags & BEX__HELLO_F_NO_RDMA);
        close(fd);
    }

    struct tc *tg = tc_start(p->ctx, &p->srv);
    CHECK_EQ(tc_wait_connect(tg), 0);
    tc_echo(p->ctx, tg, NLENS);
    tc_close(tg);
    pair_sleep_ms(100);
    return 0;
}

static int raw_route(void)
{
    no_env_secret();
    bex_ctx_config scfg = server_cfg(NULL);
    struct expect e = {.refusals = 1, .min_accepted = 1};
    return pair_run(&scfg, echo_server, &e, NULL, raw_route_client, NULL, 60);
}

/* The connector's side, against a fake listener (by hand, in the server
 * process): (1) without a secret, a listener hello whose GID is not the
 * listener's address is refused (-EPROTO); (2) with a secret, a listener
 * that cannot prove it gets the client's OPEN and PROOF and nothing else:
 * no hello, no QPN, no GID, no keepalive key; the client reports -EACCES. */
static int fake_listener(struct pair *p, void *arg)
{
    (void)arg;
    struct in_addr a0 = addr_env("BEX_TEST_ADDR0"), a1 = addr_env("BEX_TEST_ADDR1");
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(l >= 0);
    bex_addr me = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    socklen_t sl = sizeof me;
    CHECK(bind(l, (struct sockaddr *)&me, sizeof me) == 0 && listen(l, 4) == 0);
    CHECK(getsockname(l, (struct sockaddr *)&me, &sl) == 0);
    CHECK(write(p->to_parent, &me.in4.sin_port, sizeof me.in4.sin_port) == sizeof me.in4.sin_port);

    /* (1) a client without a secret */
    int fd = accept(l, NULL, NULL);
    CHECK(fd >= 0);
    struct bex__hello hc;
    CHECK_OK(bex__hello_recv(fd, &hc, bex__hello_now_ms() + ms(10000)));
    uint8_t g1[16];
    gid_of(a1, g1);
    CHECK(memcmp(hc.gid, g1, 16) == 0); /* the client's own hello is right */
    struct in_addr other = {.s_addr = htonl(ntohl(a0.s_addr) + 7)};
    struct bex__hello h = raw_hello(other, hc.conn_id);
    uint8_t m[BEX__AUTH_HELLO_LEN + BEX__READY_LEN];
    bex__hello_encode(&h, m);
    memcpy(m + BEX__HELLO_LEN, "BEXR\0\0\0\0", 8);
    raw_write(fd, m, BEX__HELLO_LEN + BEX__READY_LEN);
    EXPECT_REFUSAL(fd, EPROTO);

    /* (2) a client with a secret; we do not know it */
    fd = accept(l, NULL, NULL);
    CHECK(fd >= 0);
    uint8_t pre[BEX__SETUP_PRE_LEN];
    size_t len = 0;
    raw_read(fd, pre, sizeof pre);
    CHECK_EQ(bex__setup_peek(pre, &len), BEX__SETUP_AUTH); /* not a hello */
    CHECK_EQ(len, BEX__AUTH_SHORT_LEN);
    memcpy(m, pre, sizeof pre);
    raw_read(fd, m + sizeof pre, len - sizeof pre);
    struct bex__auth_transcript t = {0};
    CHECK_OK(bex__auth_decode(m, len, BEX__AUTH_OPEN, t.nonce_c));
    CHECK_OK(bex__auth_nonce(t.nonce_l));
    bex__auth_encode(BEX__AUTH_CHALLENGE, t.nonce_l, m);
    raw_write(fd, m, BEX__AUTH_SHORT_LEN);
    uint8_t proof[32];
    raw_read(fd, m, BEX__AUTH_SHORT_LEN);
    CHECK_OK(bex__auth_decode(m, BEX__AUTH_SHORT_LEN, BEX__AUTH_PROOF, proof));
    /* the proof is sound (checked with the secret the fake does not use) */
    uint8_t k1[32], k2[32], mac[32], raw[BEX__HELLO_LEN];
    key_of(S1, k1);
    key_of(S2, k2);
    raw_ends(fd, false, &t);
    CHECK_OK(bex__auth_verify(k1, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, proof));
    /* a hello with our true GID, MACed with a key that is not the secret */
    h = raw_hello(a0, 0x3333);
    bex__hello_encode(&h, raw);
    bex__auth_mac(k2, BEX__AUTH_MAC_HELLO_L, &t, raw, NULL, mac);
    bex__auth_encode_hello(raw, mac, m);
    raw_write(fd, m, BEX__AUTH_HELLO_LEN);
    EXPECT_REFUSAL(fd, EACCES);
    close(l);
    pair_wait_parent(p);
    return 0;
}

static int fake_listener_client(struct pair *p, void *arg)
{
    (void)arg;
    struct tc *t = tc_start(p->ctx, &p->srv);
    CHECK_EQ(tc_wait_connect(t), -EPROTO);
    tc_close(t);

    bex_ctx_config cs = with_secret(S1);
    cs.local_addr = bex_addr_ipv4((addr_env("BEX_TEST_ADDR1")).s_addr, 0);
    bex_ctx *sec;
    CHECK_OK(bex_ctx_create(&cs, &sec));
    struct tc *u = tc_start(sec, &p->srv);
    CHECK_EQ(tc_wait_connect(u), -EACCES);
    tc_close(u);
    pair_sleep_ms(100);
    bex_ctx_destroy(sec);
    return 0;
}

static int client_checks(void)
{
    no_env_secret();
    return pair_run(NULL, fake_listener, NULL, NULL, fake_listener_client, NULL, 60);
}

BEX_TEST_MAIN(BEX_CASE(same_secret), BEX_CASE(refused), BEX_CASE(secret_vs_none),
              BEX_CASE(raw_auth), BEX_CASE(raw_gid), BEX_CASE(raw_route), BEX_CASE(client_checks))
