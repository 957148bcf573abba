/* SPDX-License-Identifier: Apache-2.0 */
/* The hello wire format and its decoder: round trips, a pinned byte layout,
 * every validation rule, truncation, fuzzing, and the deadline-bounded fd
 * helpers that carry it. */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"
#include "conn/hello_io.h"
#include "hello_test.h"
#include "transport/transport.h"

static struct bex__hello no_rdma(void)
{
    struct bex__hello h = {.flags = BEX__HELLO_F_NO_RDMA, .max_msg = 1u << 20, .conn_id = 42};
    return h;
}

/* Decode h after encoding it; the decoder's verdict. */
static int verdict(const struct bex__hello *h)
{
    uint8_t buf[BEX__HELLO_LEN];
    struct bex__hello out;
    bex__hello_encode(h, buf);
    return bex__hello_decode(buf, sizeof buf, &out);
}

static int roundtrip(void)
{
    struct bex__hello h = bex_test_hello_sample(), out;
    uint8_t buf[BEX__HELLO_LEN];
    bex__hello_encode(&h, buf);
    CHECK_OK(bex__hello_decode(buf, sizeof buf, &out));
    CHECK(bex_test_hello_same(&h, &out));

    h.flags = BEX__HELLO_F_SRQ;
    h.qpn = 0xffffff;
    h.psn = 0;
    h.mtu = 5;
    h.rd_atomic = 0;
    h.recv_depth = 65535;
    h.sq_depth = 1;
    h.max_msg = BEX__HELLO_MAX_MSG;
    h.frag_size = BEX__HELLO_MAX_MSG;
    h.conn_id = UINT64_MAX;
    bex__hello_encode(&h, buf);
    CHECK_OK(bex__hello_decode(buf, sizeof buf, &out));
    CHECK(bex_test_hello_same(&h, &out));

    h = no_rdma();
    bex__hello_encode(&h, buf);
    CHECK_OK(bex__hello_decode(buf, sizeof buf, &out));
    CHECK(bex_test_hello_same(&h, &out));
    return 0;
}

/* The layout is a contract with peers running other builds: pin it. */
static int wire_layout(void)
{
    static const uint8_t want[BEX__HELLO_LEN] = {
        'B',  'E',  'X',  'H',  0,    4,    0,    80,   /* magic, version, length */
        0,    0,    0,    0,                            /* flags */
        0,    0x12, 0x34, 0x56,                         /* qpn */
        0,    0xab, 0xcd, 0xef,                         /* psn */
        0,    0,    0,    0,    0,    0,    0,    0,    /* gid */
        0,    0,    0xff, 0xff, 10,   99,   0,    1,    /* */
        3,    16,   0,    64,   0,    32,   0x07, 0xd0, /* mtu, rd_atomic, depths, ka_timeout */
        0,    0x80, 0,    0,                            /* max_msg 8 MiB */
        0,    0,    0x10, 0,                            /* frag 4096 */
        0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, /* conn_id */
        0,    0,    0x20, 0,                            /* eager_max 8192 */
        0,    0,    0x7f, 0,    0x11, 0x22, 0x33, 0x44, /* ka_addr */
        0xde, 0xad, 0xbe, 0xef,                         /* ka_rkey */
        1,    0,                                        /* max_rndv 256 */
        0,    0,                                        /* reserved */
    };
    struct bex__hello h = bex_test_hello_sample();
    uint8_t buf[BEX__HELLO_LEN];
    memset(buf, 0xa5, sizeof buf);
    bex__hello_encode(&h, buf);
    CHECK(memcmp(buf, want, sizeof want) == 0);
    return 0;
}

static int bad_magic_version(void)
{
    struct bex__hello h = bex_test_hello_sample(), out;
    uint8_t buf[BEX__HELLO_LEN], bad[BEX__HELLO_LEN];
    bex__hello_encode(&h, buf);

    for (int i = 0; i < 4; i++) {
        memcpy(bad, buf, sizeof bad);
        bad[i] ^= 0x20;
        CHECK_EQ(bex__hello_decode(bad, sizeof bad, &out), -EPROTO);
    }
    /* 1: a peer from before DATA went header-free; 2: the authenticated
     * envelope's, never a hello's; 3: from before the keepalive timeout */
    const uint16_t versions[] = {0, 1, 2, 3, 5, 0x0100, 0xffff};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
        memcpy(bad, buf, sizeof bad);
        bad[4] = (uint8_t)(versions[i] >> 8);
        bad[5] = (uint8_t)versions[i];
        CHECK_EQ(bex__hello_decode(bad, sizeof bad, &out), -EPROTO);
    }
    /* an HTTP request is not a hello */
    const char *http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n..................................";
    CHECK_EQ(bex__hello_decode((const uint8_t *)http, BEX__HELLO_LEN, &out), -EPROTO);
    return 0;
}

static int bad_length(void)
{
    struct bex__hello h = bex_test_hello_sample(), out;
    uint8_t buf[BEX__HELLO_LEN + 8] = {0};
    bex__hello_encode(&h, buf);

    /* longer input than a v1 hello */
    CHECK_EQ(bex__hello_decode(buf, BEX__HELLO_LEN + 1, &out), -EBADMSG);
    CHECK_EQ(bex__hello_decode(buf, BEX__HELLO_LEN + 8, &out), -EBADMSG);
    /* length field disagreeing */
    const uint16_t lens[] = {0, 64, 79, 81, 128, 0xffff};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        bex__hello_encode(&h, buf);
        buf[6] = (uint8_t)(lens[i] >> 8);
        buf[7] = (uint8_t)lens[i];
        CHECK_EQ(bex__hello_decode(buf, BEX__HELLO_LEN, &out), -EBADMSG);
    }
    return 0;
}

static int truncated(void)
{
    struct bex__hello h = bex_test_hello_sample(), out;
    uint8_t buf[BEX__HELLO_LEN];
    bex__hello_encode(&h, buf);
    for (size_t len = 0; len < BEX__HELLO_LEN; len++) {
        /* An exact-size heap copy, so ASan catches a read past the end. */
        uint8_t *p = malloc(len ? len : 1);
        CHECK(p);
        memcpy(p, buf, len);
        int rc = bex__hello_decode(p, len, &out);
        CHECK(rc == -EBADMSG);
        free(p);
    }
    return 0;
}

static int reserved_bytes(void)
{
    struct bex__hello h = bex_test_hello_sample(), out;
    uint8_t buf[BEX__HELLO_LEN], bad[BEX__HELLO_LEN];
    bex__hello_encode(&h, buf);
    const int offs[] = {78, 79}; /* 42..43 are ka_timeout_ms since version 4 */
    for (size_t i = 0; i < sizeof offs / sizeof offs[0]; i++) {
        for (int bit = 0; bit < 8; bit++) {
            memcpy(bad, buf, sizeof bad);
            bad[offs[i]] = (uint8_t)(1u << bit);
            CHECK_EQ(bex__hello_decode(bad, sizeof bad, &out), -EBADMSG);
        }
    }
    return 0;
}

/* The sender's keepalive timeout (version 4, bytes 42..43): any value
 * round trips, 0 is "not given"; whatever a peer claims, we never write
 * keepalives more often than our keepalive_ms (a tiny timeout costs us
 * nothing) nor less often than a quarter of what it claims (at most 65535
 * ms: the field's width bounds it). */
static int ka_timeout(void)
{
    const uint16_t vals[] = {0, 1, 2000, UINT16_MAX};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        struct bex__hello h = bex_test_hello_sample(), out;
        uint8_t buf[BEX__HELLO_LEN];
        h.ka_timeout_ms = vals[i];
        bex__hello_encode(&h, buf);
        CHECK_EQ(buf[42], (uint8_t)(vals[i] >> 8));
        CHECK_EQ(buf[43], (uint8_t)vals[i]);
        CHECK_OK(bex__hello_decode(buf, sizeof buf, &out));
        CHECK_EQ(out.ka_timeout_ms, vals[i]);
        h = no_rdma();
        h.ka_timeout_ms = vals[i];
        CHECK_EQ(verdict(&h), 0); /* not an RDMA field: a side without RDMA sends it too */
    }
    CHECK_EQ(bex__keepalive_send_ms(100, 0), 100);    /* not given: as before */
    CHECK_EQ(bex__keepalive_send_ms(100, 1), 100);    /* hostile: not more often */
    CHECK_EQ(bex__keepalive_send_ms(100, 399), 100);  /* a quarter is below ours */
    CHECK_EQ(bex__keepalive_send_ms(100, 2000), 500); /* a quarter of the peer's */
    CHECK_EQ(bex__keepalive_send_ms(100, UINT16_MAX), UINT16_MAX / 4);
    return 0;
}

static int bad_fields(void)
{
    struct bex__hello h;

#define EXPECT_BAD(field, value)                                                                   \
    do {                                                                                           \
        h = bex_test_hello_sample();                                                               \
        h.field = (value);                                                                         \
        if (verdict(&h) != -EBADMSG) {                                                             \
            fprintf(stderr, "accepted %s = %lld\n", #field, (long long)(value));                   \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)
#define EXPECT_GOOD(field, value)                                                                  \
    do {                                                                                           \
        h = bex_test_hello_sample();                                                               \
        h.field = (value);                                                                         \
        if (verdict(&h) != 0) {                                                                    \
            fprintf(stderr, "rejected %s = %lld\n", #field, (long long)(value));                   \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

    for (uint32_t bit = 4; bit < 32; bit++) /* bits 2..3: the route (route_lid) */
        EXPECT_BAD(flags, 1u << bit);
    EXPECT_BAD(qpn, 0);
    EXPECT_BAD(qpn, 1);
    EXPECT_BAD(qpn, 0x1000000);
    EXPECT_BAD(qpn, UINT32_MAX);
    EXPECT_GOOD(qpn, 2);
    EXPECT_GOOD(qpn, 0xffffff);
    EXPECT_BAD(psn, 0x1000000);
    EXPECT_BAD(psn, UINT32_MAX);
    EXPECT_GOOD(psn, 0);
    EXPECT_GOOD(psn, 0xffffff);
    EXPECT_BAD(mtu, 0);
    EXPECT_BAD(mtu, 6);
    EXPECT_BAD(mtu, 255);
    for (uint8_t m = 1; m <= 5; m++)
        EXPECT_GOOD(mtu, m);
    EXPECT_BAD(recv_depth, 0);
    EXPECT_BAD(sq_depth, 0);
    EXPECT_GOOD(recv_depth, 1);
    EXPECT_GOOD(sq_depth, 65535);
    EXPECT_BAD(max_msg, 0);
    EXPECT_BAD(max_msg, BEX__HELLO_MAX_MSG + 1);
    EXPECT_BAD(max_msg, UINT32_MAX);
    EXPECT_GOOD(max_msg, 1);
    EXPECT_BAD(frag_size, 0);
    EXPECT_BAD(frag_size, BEX__HELLO_MIN_FRAG - 1);
    EXPECT_BAD(frag_size, BEX__HELLO_MAX_MSG + 1);
    EXPECT_GOOD(frag_size, BEX__HELLO_MIN_FRAG);
    EXPECT_BAD(conn_id, 0);
    EXPECT_GOOD(rd_atomic, 255);
    EXPECT_BAD(eager_max, BEX__HELLO_MAX_EAGER + 1);
    EXPECT_GOOD(eager_max, 0);
    EXPECT_GOOD(eager_max, BEX__HELLO_MAX_EAGER);
    EXPECT_BAD(ka_addr, 0);
    EXPECT_BAD(max_rndv, 0);
    EXPECT_GOOD(max_rndv, 65535);

    h = bex_test_hello_sample();
    memset(h.gid, 0, sizeof h.gid);
    CHECK_EQ(verdict(&h), -EBADMSG);

    /* a side without RDMA must not advertise a QP */
    struct bex__hello n;
#define EXPECT_BAD_NO_RDMA(field, value)                                                           \
    do {                                                                                           \
        n = no_rdma();                                                                             \
        n.field = (value);                                                                         \
        if (verdict(&n) != -EBADMSG) {                                                             \
            fprintf(stderr, "accepted NO_RDMA with %s = %lld\n", #field, (long long)(value));      \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)
    EXPECT_BAD_NO_RDMA(qpn, 2);
    EXPECT_BAD_NO_RDMA(psn, 1);
    EXPECT_BAD_NO_RDMA(mtu, 3);
    EXPECT_BAD_NO_RDMA(rd_atomic, 1);
    EXPECT_BAD_NO_RDMA(recv_depth, 1);
    EXPECT_BAD_NO_RDMA(sq_depth, 1);
    EXPECT_BAD_NO_RDMA(frag_size, 4096);
    EXPECT_BAD_NO_RDMA(eager_max, 1);
    EXPECT_BAD_NO_RDMA(ka_addr, 1);
    EXPECT_BAD_NO_RDMA(ka_rkey, 1);
    EXPECT_BAD_NO_RDMA(max_rndv, 1);
    EXPECT_BAD_NO_RDMA(flags, BEX__HELLO_F_NO_RDMA | BEX__HELLO_F_SRQ);
    EXPECT_BAD_NO_RDMA(max_msg, 0);
    EXPECT_BAD_NO_RDMA(conn_id, 0);
    n = no_rdma();
    n.gid[15] = 1;
    CHECK_EQ(verdict(&n), -EBADMSG);
    return 0;
}

/* The route and LID (flags bits 2..3, bytes 78..79) of RoCE v1 and
 * InfiniBand senders: pinned on the wire, round trips, and every hostile
 * value refused: route 3 (a GID type we do not know: -EPROTONOSUPPORT), an InfiniBand LID
 * that is not unicast, a LID on a RoCE route or a NO_RDMA hello. */
static int route_wire(void)
{
    struct bex__hello h = bex_test_hello_sample(), out;
    uint8_t buf[BEX__HELLO_LEN];
    h.route = BEX__HELLO_ROUTE_IB;
    h.lid = 0x1234;
    h.flags = BEX__HELLO_F_SRQ;
    bex__hello_encode(&h, buf);
    CHECK_EQ(buf[11], 0x08 | BEX__HELLO_F_SRQ);
    CHECK_EQ(buf[78], 0x12);
    CHECK_EQ(buf[79], 0x34);
    CHECK_OK(bex__hello_decode(buf, sizeof buf, &out));
    CHECK(bex_test_hello_same(&h, &out));
    CHECK_EQ(out.flags, BEX__HELLO_F_SRQ); /* the route is not left in the flags */
    h = bex_test_hello_sample();
    h.route = BEX__HELLO_ROUTE_ROCE_V1;
    bex__hello_encode(&h, buf);
    CHECK_EQ(buf[11], 0x04);
    CHECK_OK(bex__hello_decode(buf, sizeof buf, &out));
    CHECK(bex_test_hello_same(&h, &out));
    buf[11] = 0x0c; /* route 3 */
    CHECK_EQ(bex__hello_decode(buf, sizeof buf, &out), -EPROTONOSUPPORT);
    return 0;
}

static int route_lid(void)
{
    const struct {
        uint8_t route;
        uint16_t lid;
        int want;
    } cases[] = {
        {BEX__HELLO_ROUTE_IB, 1, 0},
        {BEX__HELLO_ROUTE_IB, BEX__HELLO_LID_MAX, 0},
        {BEX__HELLO_ROUTE_IB, 0, -EBADMSG},      /* unassigned: no SM yet */
        {BEX__HELLO_ROUTE_IB, 0xc000, -EBADMSG}, /* multicast */
        {BEX__HELLO_ROUTE_IB, 0xfffe, -EBADMSG},
        {BEX__HELLO_ROUTE_IB, 0xffff, -EBADMSG}, /* permissive */
        {BEX__HELLO_ROUTE_ROCE_V2, 1, -EBADMSG}, /* RoCE has no LID */
        {BEX__HELLO_ROUTE_ROCE_V1, 7, -EBADMSG},
        {BEX__HELLO_ROUTE_ROCE_V1, 0, 0},
        {3, 0, -EPROTONOSUPPORT},
        {3, 1, -EPROTONOSUPPORT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct bex__hello h = bex_test_hello_sample();
        h.route = cases[i].route;
        h.lid = cases[i].lid;
        if (verdict(&h) != cases[i].want) {
            fprintf(stderr, "route %u lid %#x: %d\n", h.route, h.lid, verdict(&h));
            return 1;
        }
    }
    struct bex__hello n = no_rdma();
    n.route = BEX__HELLO_ROUTE_IB;
    n.lid = 5;
    CHECK_EQ(verdict(&n), -EBADMSG);
    n = no_rdma();
    n.route = BEX__HELLO_ROUTE_ROCE_V1;
    CHECK_EQ(verdict(&n), -EBADMSG);
    n = no_rdma();
    n.lid = 5;
    CHECK_EQ(verdict(&n), -EBADMSG);
    return 0;
}

static int out_untouched_on_error(void)
{
    struct bex__hello h = bex_test_hello_sample(), out;
    uint8_t buf[BEX__HELLO_LEN];
    h.qpn = 0;
    bex__hello_encode(&h, buf);
    memset(&out, 0x5a, sizeof out);
    struct bex__hello before = out;
    CHECK_EQ(bex__hello_decode(buf, sizeof buf, &out), -EBADMSG);
    CHECK(memcmp(&out, &before, sizeof out) == 0);
    return 0;
}

/* xorshift64*: reproducible from the printed seed. */
static uint64_t rng_state;
static uint64_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}

/* Property: decode either fails with -EPROTO/-EBADMSG, or succeeds and the
 * input is exactly the canonical encoding of what it returned. Random bytes
 * almost never get past the magic, so most inputs are mutations of a valid
 * hello (bit flips, byte overwrites, length changes). */
static int fuzz(void)
{
    const char *s = getenv("BEX_FUZZ_SEED");
    uint64_t seed = s ? strtoull(s, NULL, 0) : 0x9e3779b97f4a7c15ull;
    rng_state = seed ? seed : 1;
    fprintf(stderr, "seed 0x%llx\n", (unsigned long long)seed);

    struct bex__hello base = bex_test_hello_sample();
    uint8_t valid[BEX__HELLO_LEN];
    bex__hello_encode(&base, valid);
    long ok = 0, proto = 0, badmsg = 0, route = 0;
    for (int iter = 0; iter < 100000; iter++) {
        uint8_t buf[BEX__HELLO_LEN + 4];
        size_t len = BEX__HELLO_LEN;
        uint64_t kind = rnd() % 8;
        if (kind == 0) {
            for (size_t i = 0; i < sizeof buf; i++)
                buf[i] = (uint8_t)rnd();
            len = rnd() % (sizeof buf + 1);
        } else {
            memcpy(buf, valid, BEX__HELLO_LEN);
            int nmut = 1 + (int)(rnd() % 4);
            for (int m = 0; m < nmut; m++) {
                size_t at = rnd() % BEX__HELLO_LEN;
                if (kind < 5)
                    buf[at] ^= (uint8_t)(1u << (rnd() % 8));
                else
                    buf[at] = (uint8_t)rnd();
            }
            if (kind == 7)
                len = rnd() % (sizeof buf + 1);
        }
        /* exact-size heap copy so ASan sees any overread */
        uint8_t *p = malloc(len ? len : 1);
        CHECK(p);
        memcpy(p, buf, len);
        struct bex__hello out;
        int rc = bex__hello_decode(p, len, &out);
        if (rc == 0) {
            uint8_t again[BEX__HELLO_LEN];
            bex__hello_encode(&out, again);
            CHECK_EQ(len, BEX__HELLO_LEN);
            CHECK(memcmp(again, p, BEX__HELLO_LEN) == 0);
            CHECK_EQ(verdict(&out), 0);
            ok++;
        } else if (rc == -EPROTO) {
            proto++;
        } else if (rc == -EBADMSG) {
            badmsg++;
        } else if (rc == -EPROTONOSUPPORT) {
            route++; /* route 3: flags bits 2..3 both set */
        } else {
            fprintf(stderr, "unexpected rc %d at iteration %d\n", rc, iter);
            return 1;
        }
        free(p);
    }
    fprintf(stderr, "decoded %ld, -EPROTO %ld, -EBADMSG %ld, -EPROTONOSUPPORT %ld\n", ok, proto,
            badmsg, route);
    /* the mix must exercise all three outcomes, or the fuzzer is blind */
    CHECK(ok > 0 && proto > 0 && badmsg > 0);
    return 0;
}

/* ---- fd helpers ------------------------------------------------------ */

static void pair(int sv[2])
{
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
}

static int fd_roundtrip(void)
{
    int sv[2];
    pair(sv);
    int64_t dl = bex__hello_now_ms() + 2000;
    struct bex__hello h = bex_test_hello_sample(), got;
    CHECK_OK(bex__hello_send(sv[0], &h, dl));
    CHECK_OK(bex__hello_recv(sv[1], &got, dl));
    CHECK(bex_test_hello_same(&h, &got));

    uint32_t st = 7;
    CHECK_OK(bex__hello_ready_send(sv[1], 0, dl));
    CHECK_OK(bex__hello_ready_recv(sv[0], &st, dl));
    CHECK_EQ(st, 0);
    CHECK_OK(bex__hello_ready_send(sv[1], ENODEV, dl));
    CHECK_OK(bex__hello_ready_recv(sv[0], &st, dl));
    CHECK_EQ(st, ENODEV);

    /* a hello where a ready notice is expected */
    CHECK_OK(bex__hello_send(sv[0], &h, dl));
    CHECK_EQ(bex__hello_ready_recv(sv[1], &st, dl), -EBADMSG);

    /* garbage where a hello is expected: the decoder's verdict comes back */
    uint8_t junk[BEX__HELLO_LEN];
    memset(junk, 'x', sizeof junk);
    CHECK_OK(bex__hello_write_all(sv[1], junk, sizeof junk, dl));
    CHECK_EQ(bex__hello_recv(sv[0], &got, dl), -EPROTO);
    close(sv[0]);
    close(sv[1]);
    return 0;
}

/* A peer that connects and says nothing costs the deadline, not forever. */
static int fd_silent_peer(void)
{
    int sv[2];
    pair(sv);
    struct bex__hello got;
    int64_t t0 = bex__hello_now_ms();
    CHECK_EQ(bex__hello_recv(sv[0], &got, t0 + 100), -ETIMEDOUT);
    int64_t took = bex__hello_now_ms() - t0;
    CHECK(took >= 100 && took < 2000);

    /* half a hello, then silence */
    uint8_t half[BEX__HELLO_LEN / 2] = {'B', 'E', 'X', 'H'};
    CHECK_OK(bex__hello_write_all(sv[1], half, sizeof half, t0 + 1000));
    CHECK_EQ(bex__hello_recv(sv[0], &got, bex__hello_now_ms() + 50), -ETIMEDOUT);

    /* a deadline already past fails at once */
    CHECK_EQ(bex__hello_read_all(sv[0], half, 1, t0), -ETIMEDOUT);
    close(sv[0]);
    close(sv[1]);
    return 0;
}

/* A peer that never reads: the writer stops at the deadline even on a
 * blocking socket with a full buffer. */
static int fd_write_deadline(void)
{
    int sv[2];
    pair(sv);
    size_t big = 16u << 20;
    char *p = calloc(1, big);
    CHECK(p);
    int64_t t0 = bex__hello_now_ms();
    CHECK_EQ(bex__hello_write_all(sv[0], p, big, t0 + 100), -ETIMEDOUT);
    CHECK(bex__hello_now_ms() - t0 < 2000);
    free(p);
    close(sv[0]);
    close(sv[1]);
    return 0;
}

static int fd_peer_closed(void)
{
    int sv[2];
    pair(sv);
    uint8_t b[8] = {0};
    int64_t dl = bex__hello_now_ms() + 1000;
    CHECK_OK(bex__hello_write_all(sv[1], b, 3, dl));
    close(sv[1]);
    /* EOF in the middle of a message */
    CHECK_EQ(bex__hello_read_all(sv[0], b, sizeof b, dl), -ECONNRESET);

    /* writing to a closed peer is an error code, not SIGPIPE; the default
     * disposition would kill this process */
    signal(SIGPIPE, SIG_DFL);
    CHECK_EQ(bex__hello_write_all(sv[0], b, sizeof b, dl), -EPIPE);
    close(sv[0]);

    /* non-sockets take the read/write path */
    int pp[2];
    CHECK(pipe(pp) == 0);
    CHECK_OK(bex__hello_write_all(pp[1], "abc", 3, dl));
    CHECK_OK(bex__hello_read_all(pp[0], b, 3, dl));
    CHECK(memcmp(b, "abc", 3) == 0);
    close(pp[1]);
    CHECK_EQ(bex__hello_read_all(pp[0], b, 1, dl), -ECONNRESET);
    close(pp[0]);
    CHECK_EQ(bex__hello_read_all(pp[0], b, 1, dl), -EBADF);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(roundtrip), BEX_CASE(wire_layout), BEX_CASE(bad_magic_version),
              BEX_CASE(bad_length), BEX_CASE(truncated), BEX_CASE(reserved_bytes),
              BEX_CASE(ka_timeout), BEX_CASE(bad_fields), BEX_CASE(route_wire), BEX_CASE(route_lid),
              BEX_CASE(out_untouched_on_error), BEX_CASE(fuzz), BEX_CASE(fd_roundtrip),
              BEX_CASE(fd_silent_peer), BEX_CASE(fd_write_deadline), BEX_CASE(fd_peer_closed))
