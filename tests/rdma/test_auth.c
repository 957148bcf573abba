/* SPDX-License-Identifier: Apache-2.0 */
/* The authenticated setup: its message codec, the MACs over the transcript
 * (a replay with another nonce, a wrong secret, another connection's
 * endpoints are refused), the derived key, key files and the environment. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bex/sock.h"
#include "harness.h"
#include "hello_test.h"
#include "sock/secret.h"

static const char SECRET[] = "correct horse battery staple";
static const char OTHER[] = "correct horse battery stapler";

static void key_of(const char *secret, uint8_t key[BEX__AUTH_KEY_LEN])
{
    CHECK_OK(bex__auth_key(secret, strlen(secret), key));
}

/* A transcript as a listener at 10.99.0.1:7000 and a client at
 * 10.99.0.2:40000 would both see it. */
static void transcript(struct bex__auth_transcript *t)
{
    memset(t, 0, sizeof(*t));
    CHECK_OK(bex__auth_nonce(t->nonce_l));
    CHECK_OK(bex__auth_nonce(t->nonce_c));
    bex__auth_ends(t, htonl(0x0a630002), htons(40000), htonl(0x0a630001), htons(7000));
}

/* ---------------- codec ---------------- */

static int peek(void)
{
    uint8_t m[BEX__AUTH_HELLO_LEN] = {0}, body[32] = {1, 2, 3};
    size_t len = 0;

    bex__auth_encode(BEX__AUTH_OPEN, body, m);
    CHECK_EQ(bex__setup_peek(m, &len), BEX__SETUP_AUTH);
    CHECK_EQ(len, BEX__AUTH_SHORT_LEN);

    struct bex__hello h = bex_test_hello_sample();
    uint8_t raw[BEX__HELLO_LEN], mac[32] = {0};
    bex__hello_encode(&h, raw);
    CHECK_EQ(bex__setup_peek(raw, &len), BEX__SETUP_HELLO);
    CHECK_EQ(len, BEX__HELLO_LEN);
    bex__auth_encode_hello(raw, mac, m);
    CHECK_EQ(bex__setup_peek(m, &len), BEX__SETUP_AUTH);
    CHECK_EQ(len, BEX__AUTH_HELLO_LEN);

    const uint8_t notice[8] = {'B', 'E', 'X', 'R', 0, 0, 0, 13};
    CHECK_EQ(bex__setup_peek(notice, &len), BEX__SETUP_NOTICE);
    CHECK_EQ(len, BEX__READY_LEN);

    /* strangers, unknown versions, impossible lengths */
    len = 99;
    CHECK_EQ(bex__setup_peek((const uint8_t *)"GET / HT", &len), -EPROTO);
    /* 5: a future one; 3: a hello from before it carried the keepalive
     * timeout; 1: from before DATA went header-free */
    const uint8_t v5[8] = {'B', 'E', 'X', 'H', 0, 5, 0, 44};
    CHECK_EQ(bex__setup_peek(v5, &len), -EPROTO);
    const uint8_t v3[8] = {'B', 'E', 'X', 'H', 0, 3, 0, 80};
    CHECK_EQ(bex__setup_peek(v3, &len), -EPROTO);
    const uint8_t v1[8] = {'B', 'E', 'X', 'H', 0, 1, 0, 80};
    CHECK_EQ(bex__setup_peek(v1, &len), -EPROTO);
    const uint16_t lens[] = {0, 8, 12, 43, 45, 80, 123, 125, 0xffff};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        uint8_t p[8] = {'B', 'E', 'X', 'H', 0, 2, (uint8_t)(lens[i] >> 8), (uint8_t)lens[i]};
        CHECK_EQ(bex__setup_peek(p, &len), -EBADMSG);
    }
    CHECK_EQ(len, 99); /* untouched on error */
    /* every length a peek accepts fits the reader's buffer */
    CHECK(BEX__AUTH_HELLO_LEN <= BEX__SETUP_MAX_LEN && BEX__HELLO_LEN <= BEX__SETUP_MAX_LEN);
    return 0;
}

/* The layout is a contract with peers running other builds: pin it. */
static int wire_layout(void)
{
    uint8_t body[32], m[BEX__AUTH_SHORT_LEN];
    for (int i = 0; i < 32; i++)
        body[i] = (uint8_t)(0xa0 + i);
    memset(m, 0x5a, sizeof m);
    bex__auth_encode(BEX__AUTH_PROOF, body, m);
    static const uint8_t head[12] = {'B', 'E', 'X', 'H', 0, 2, 0, 44, 3, 0, 0, 0};
    CHECK(memcmp(m, head, 12) == 0);
    CHECK(memcmp(m + 12, body, 32) == 0);

    struct bex__hello h = bex_test_hello_sample();
    uint8_t raw[BEX__HELLO_LEN], mac[32], hm[BEX__AUTH_HELLO_LEN];
    bex__hello_encode(&h, raw);
    memset(mac, 0xc3, sizeof mac);
    bex__auth_encode_hello(raw, mac, hm);
    static const uint8_t hhead[12] = {'B', 'E', 'X', 'H', 0, 2, 0, 124, 4, 0, 0, 0};
    CHECK(memcmp(hm, hhead, 12) == 0);
    CHECK(memcmp(hm + 12, raw, BEX__HELLO_LEN) == 0);
    CHECK(memcmp(hm + 92, mac, 32) == 0);
    return 0;
}

static int codec_roundtrip(void)
{
    const uint8_t types[] = {BEX__AUTH_OPEN, BEX__AUTH_CHALLENGE, BEX__AUTH_PROOF};
    for (size_t i = 0; i < sizeof types; i++) {
        uint8_t body[32], out[32], m[BEX__AUTH_SHORT_LEN];
        CHECK_OK(bex__auth_nonce(body));
        bex__auth_encode(types[i], body, m);
        CHECK_OK(bex__auth_decode(m, sizeof m, types[i], out));
        CHECK(memcmp(body, out, 32) == 0);
        /* the same message is not another type */
        for (size_t j = 0; j < sizeof types; j++)
            if (j != i)
                CHECK_EQ(bex__auth_decode(m, sizeof m, types[j], out), -EPROTO);
    }
    struct bex__hello h = bex_test_hello_sample(), got;
    uint8_t raw[BEX__HELLO_LEN], mac[32], mac2[32], m[BEX__AUTH_HELLO_LEN];
    bex__hello_encode(&h, raw);
    CHECK_OK(bex__auth_nonce(mac));
    bex__auth_encode_hello(raw, mac, m);
    CHECK_OK(bex__auth_decode_hello(m, sizeof m, &got, mac2));
    CHECK(memcmp(mac, mac2, 32) == 0);
    uint8_t again[BEX__HELLO_LEN];
    bex__hello_encode(&got, again);
    CHECK(memcmp(raw, again, sizeof raw) == 0);
    return 0;
}

static int codec_errors(void)
{
    uint8_t body[32] = {7}, out[32], m[BEX__AUTH_SHORT_LEN + 4] = {0}, bad[sizeof m];
    bex__auth_encode(BEX__AUTH_OPEN, body, m);
    memset(out, 0xee, sizeof out);

    /* lengths: the input's and the field's */
    CHECK_EQ(bex__auth_decode(m, BEX__AUTH_SHORT_LEN + 1, BEX__AUTH_OPEN, out), -EBADMSG);
    for (size_t len = 0; len < BEX__AUTH_SHORT_LEN; len++) {
        uint8_t *p = malloc(len ? len : 1); /* exact size: ASan sees overreads */
        CHECK(p);
        memcpy(p, m, len);
        CHECK_EQ(bex__auth_decode(p, len, BEX__AUTH_OPEN, out), -EBADMSG);
        free(p);
    }
    memcpy(bad, m, sizeof bad);
    bad[7] = 45;
    CHECK_EQ(bex__auth_decode(bad, BEX__AUTH_SHORT_LEN, BEX__AUTH_OPEN, out), -EBADMSG);
    /* reserved bytes */
    for (int off = 9; off < 12; off++) {
        memcpy(bad, m, sizeof bad);
        bad[off] = 1;
        CHECK_EQ(bex__auth_decode(bad, BEX__AUTH_SHORT_LEN, BEX__AUTH_OPEN, out), -EBADMSG);
    }
    /* not version 2, not ours */
    memcpy(bad, m, sizeof bad);
    bad[5] = 1;
    CHECK_EQ(bex__auth_decode(bad, BEX__AUTH_SHORT_LEN, BEX__AUTH_OPEN, out), -EPROTO);
    memcpy(bad, m, sizeof bad);
    bad[0] = 'X';
    CHECK_EQ(bex__auth_decode(bad, BEX__AUTH_SHORT_LEN, BEX__AUTH_OPEN, out), -EPROTO);
    /* unknown type */
    memcpy(bad, m, sizeof bad);
    bad[8] = 9;
    CHECK_EQ(bex__auth_decode(bad, BEX__AUTH_SHORT_LEN, BEX__AUTH_OPEN, out), -EPROTO);
    for (size_t i = 0; i < sizeof out; i++)
        CHECK_EQ(out[i], 0xee); /* untouched on every error */

    /* a HELLO whose embedded hello is malformed, or a short message that
     * claims to be a HELLO */
    struct bex__hello h = bex_test_hello_sample(), got;
    uint8_t raw[BEX__HELLO_LEN], mac[32] = {0}, hm[BEX__AUTH_HELLO_LEN];
    h.qpn = 1; /* a special QP: never valid */
    bex__hello_encode(&h, raw);
    bex__auth_encode_hello(raw, mac, hm);
    CHECK_EQ(bex__auth_decode_hello(hm, sizeof hm, &got, mac), -EBADMSG);
    CHECK_EQ(bex__auth_decode_hello(m, BEX__AUTH_SHORT_LEN, &got, mac), -EBADMSG);
    h = bex_test_hello_sample();
    bex__hello_encode(&h, raw);
    bex__auth_encode_hello(raw, mac, hm);
    hm[8] = BEX__AUTH_PROOF;
    CHECK_EQ(bex__auth_decode_hello(hm, sizeof hm, &got, mac), -EPROTO);
    return 0;
}

/* Random bytes and single-byte mutations: decoders never crash, and what
 * they accept re-encodes to the same bytes. */
static int codec_fuzz(void)
{
    uint32_t x = 12345;
    uint8_t m[BEX__AUTH_HELLO_LEN], again[BEX__AUTH_HELLO_LEN], body[32], mac[32];
    struct bex__hello h = bex_test_hello_sample(), got;
    uint8_t raw[BEX__HELLO_LEN];
    bex__hello_encode(&h, raw);
    for (int it = 0; it < 200000; it++) {
        x = x * 1103515245u + 12345u;
        bool hello = x & 0x10000;
        if (hello)
            bex__auth_encode_hello(raw, raw, m);
        else
            bex__auth_encode((uint8_t)(1 + (x >> 20) % 3), raw, m);
        size_t len = hello ? BEX__AUTH_HELLO_LEN : BEX__AUTH_SHORT_LEN;
        for (int k = 0; k < 1 + (int)((x >> 8) & 3); k++) {
            x = x * 1103515245u + 12345u;
            m[(x >> 8) % len] ^= (uint8_t)(1u << ((x >> 4) & 7));
        }
        size_t plen;
        (void)bex__setup_peek(m, &plen);
        if (hello) {
            if (bex__auth_decode_hello(m, len, &got, mac) == 0) {
                uint8_t r2[BEX__HELLO_LEN];
                bex__hello_encode(&got, r2);
                bex__auth_encode_hello(r2, mac, again);
                CHECK(memcmp(m, again, len) == 0);
            }
        } else {
            for (uint8_t t = 1; t <= 3; t++) {
                if (bex__auth_decode(m, len, t, body) == 0) {
                    bex__auth_encode(t, body, again);
                    CHECK(memcmp(m, again, len) == 0);
                }
            }
        }
    }
    return 0;
}

/* ---------------- MACs and the transcript ---------------- */

static int key_derivation(void)
{
    uint8_t a[32], b[32], c[32];
    key_of(SECRET, a);
    key_of(SECRET, b);
    key_of(OTHER, c);
    CHECK(memcmp(a, b, 32) == 0);
    CHECK(memcmp(a, c, 32) != 0);
    /* the secret itself is not the key */
    CHECK(memcmp(a, SECRET, 28) != 0);
    uint8_t big[BEX_SECRET_MAX + 1];
    memset(big, 'k', sizeof big);
    CHECK_OK(bex__auth_key(big, BEX_SECRET_MIN, a));
    CHECK_OK(bex__auth_key(big, BEX_SECRET_MAX, a));
    CHECK_EQ(bex__auth_key(big, BEX_SECRET_MIN - 1, a), -EINVAL);
    CHECK_EQ(bex__auth_key(big, BEX_SECRET_MAX + 1, a), -EINVAL);
    CHECK_EQ(bex__auth_key(NULL, 32, a), -EINVAL);
    /* nonces differ */
    uint8_t n1[32], n2[32];
    CHECK_OK(bex__auth_nonce(n1));
    CHECK_OK(bex__auth_nonce(n2));
    CHECK(memcmp(n1, n2, 32) != 0);
    return 0;
}

/* Both sides of one exchange, written out: each MAC one side makes the
 * other verifies. */
static int exchange(void)
{
    uint8_t kl[32], kc[32];
    key_of(SECRET, kl);
    key_of(SECRET, kc);
    struct bex__auth_transcript t;
    transcript(&t);
    struct bex__auth_transcript tc = t; /* the client's own copy */

    uint8_t proof[32], mac_l[32], mac_c[32];
    bex__auth_mac(kc, BEX__AUTH_MAC_PROOF_C, &tc, NULL, NULL, proof);
    CHECK_OK(bex__auth_verify(kl, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, proof));

    struct bex__hello hl = bex_test_hello_sample(), hc = bex_test_hello_sample();
    hc.qpn = 0x777;
    uint8_t rl[BEX__HELLO_LEN], rc[BEX__HELLO_LEN];
    bex__hello_encode(&hl, rl);
    bex__hello_encode(&hc, rc);
    bex__auth_mac(kl, BEX__AUTH_MAC_HELLO_L, &t, rl, NULL, mac_l);
    CHECK_OK(bex__auth_verify(kc, BEX__AUTH_MAC_HELLO_L, &tc, rl, NULL, mac_l));
    bex__auth_mac(kc, BEX__AUTH_MAC_HELLO_C, &tc, rl, rc, mac_c);
    CHECK_OK(bex__auth_verify(kl, BEX__AUTH_MAC_HELLO_C, &t, rl, rc, mac_c));

    /* no MAC stands for another (labels), and none verifies after a change
     * of any byte of what it covers */
    CHECK_EQ(bex__auth_verify(kl, BEX__AUTH_MAC_HELLO_L, &t, rl, NULL, proof), -EACCES);
    CHECK_EQ(bex__auth_verify(kl, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, mac_l), -EACCES);
    CHECK_EQ(bex__auth_verify(kl, BEX__AUTH_MAC_HELLO_C, &t, rl, rc, mac_l), -EACCES);
    for (size_t i = 0; i < BEX__HELLO_LEN; i++) {
        rc[i] ^= 1;
        CHECK_EQ(bex__auth_verify(kl, BEX__AUTH_MAC_HELLO_C, &t, rl, rc, mac_c), -EACCES);
        rc[i] ^= 1;
        rl[i] ^= 0x80;
        CHECK_EQ(bex__auth_verify(kc, BEX__AUTH_MAC_HELLO_L, &tc, rl, NULL, mac_l), -EACCES);
        CHECK_EQ(bex__auth_verify(kl, BEX__AUTH_MAC_HELLO_C, &t, rl, rc, mac_c), -EACCES);
        rl[i] ^= 0x80;
    }
    uint8_t *fields[] = {t.nonce_l, t.nonce_c, t.ends};
    size_t sizes[] = {32, 32, 12};
    for (int f = 0; f < 3; f++) {
        for (size_t i = 0; i < sizes[f]; i++) {
            fields[f][i] ^= 4;
            CHECK_EQ(bex__auth_verify(kl, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, proof), -EACCES);
            fields[f][i] ^= 4;
        }
    }
    for (int i = 0; i < 32; i++) {
        proof[i] ^= 2;
        CHECK_EQ(bex__auth_verify(kl, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, proof), -EACCES);
        proof[i] ^= 2;
    }
    CHECK_OK(bex__auth_verify(kl, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, proof));
    return 0;
}

static int wrong_secret(void)
{
    uint8_t kl[32], kc[32];
    key_of(SECRET, kl);
    key_of(OTHER, kc);
    struct bex__auth_transcript t;
    transcript(&t);
    uint8_t proof[32], mac_l[32];
    bex__auth_mac(kc, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, proof);
    CHECK_EQ(bex__auth_verify(kl, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, proof), -EACCES);
    /* and the other way round: a listener with another secret cannot make
     * a hello MAC the client accepts */
    struct bex__hello h = bex_test_hello_sample();
    uint8_t raw[BEX__HELLO_LEN];
    bex__hello_encode(&h, raw);
    bex__auth_mac(kl, BEX__AUTH_MAC_HELLO_L, &t, raw, NULL, mac_l);
    CHECK_EQ(bex__auth_verify(kc, BEX__AUTH_MAC_HELLO_L, &t, raw, NULL, mac_l), -EACCES);
    return 0;
}

/* A recorded client transcript (its OPEN nonce, PROOF and hello MAC)
 * played back against a listener that picks a fresh nonce is refused; so
 * is one played on another TCP connection with the same nonces. */
static int replay(void)
{
    uint8_t k[32];
    key_of(SECRET, k);
    struct bex__auth_transcript first;
    transcript(&first);
    struct bex__hello hl = bex_test_hello_sample(), hc = bex_test_hello_sample();
    uint8_t rl[BEX__HELLO_LEN], rc[BEX__HELLO_LEN];
    bex__hello_encode(&hl, rl);
    bex__hello_encode(&hc, rc);
    uint8_t proof[32], mac_c[32];
    bex__auth_mac(k, BEX__AUTH_MAC_PROOF_C, &first, NULL, NULL, proof);
    bex__auth_mac(k, BEX__AUTH_MAC_HELLO_C, &first, rl, rc, mac_c);
    CHECK_OK(bex__auth_verify(k, BEX__AUTH_MAC_PROOF_C, &first, NULL, NULL, proof));

    /* the replay: same client nonce and bytes, the listener's new nonce */
    struct bex__auth_transcript second = first;
    CHECK_OK(bex__auth_nonce(second.nonce_l));
    CHECK(memcmp(second.nonce_l, first.nonce_l, 32) != 0);
    CHECK_EQ(bex__auth_verify(k, BEX__AUTH_MAC_PROOF_C, &second, NULL, NULL, proof), -EACCES);
    CHECK_EQ(bex__auth_verify(k, BEX__AUTH_MAC_HELLO_C, &second, rl, rc, mac_c), -EACCES);

    /* a relay: the same nonces, seen on another TCP connection */
    struct bex__auth_transcript relayed = first;
    bex__auth_ends(&relayed, htonl(0x0a630003), htons(40000), htonl(0x0a630001), htons(7000));
    CHECK_EQ(bex__auth_verify(k, BEX__AUTH_MAC_PROOF_C, &relayed, NULL, NULL, proof), -EACCES);
    bex__auth_ends(&relayed, htonl(0x0a630002), htons(40001), htonl(0x0a630001), htons(7000));
    CHECK_EQ(bex__auth_verify(k, BEX__AUTH_MAC_PROOF_C, &relayed, NULL, NULL, proof), -EACCES);
    return 0;
}

/* ---------------- key files and the environment ---------------- */

static char tmpdir[64];

static void make_tmpdir(void)
{
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/bex-auth-XXXXXX", t && t[0] ? t : "/tmp");
    CHECK(mkdtemp(tmpdir));
}

static void remove_tmpdir(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    CHECK(system(cmd) == 0);
}

static const char *write_file(const char *name, const void *data, size_t len, mode_t mode)
{
    static char path[256];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    unlink(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0);
    CHECK(write(fd, data, len) == (ssize_t)len);
    CHECK(fchmod(fd, mode) == 0);
    close(fd);
    return path;
}

static int secret_file(void)
{
    make_tmpdir();
    uint8_t buf[BEX_SECRET_MAX];
    size_t n = 0;
    const char *p = write_file("k1", "0123456789abcdef0123\n", 21, 0600);
    CHECK_OK(bex_secret_load(p, buf, sizeof buf, &n));
    CHECK_EQ(n, 20);
    CHECK(memcmp(buf, "0123456789abcdef0123", 20) == 0);
    p = write_file("k2", "0123456789abcdef0123\r\n", 22, 0400);
    CHECK_OK(bex_secret_load(p, buf, sizeof buf, &n));
    CHECK_EQ(n, 20);
    uint8_t bin[32];
    for (int i = 0; i < 32; i++)
        bin[i] = (uint8_t)(i * 37);
    p = write_file("k3", bin, sizeof bin, 0600);
    CHECK_OK(bex_secret_load(p, buf, sizeof buf, &n));
    CHECK_EQ(n, 32);
    CHECK(memcmp(buf, bin, 32) == 0);
    /* refused: readable or writable by others, short, long, not a file */
    CHECK_EQ(bex_secret_load(write_file("k4", bin, 32, 0640), buf, sizeof buf, &n), -EPERM);
    CHECK_EQ(bex_secret_load(write_file("k5", bin, 32, 0604), buf, sizeof buf, &n), -EPERM);
    CHECK_EQ(bex_secret_load(write_file("k6", bin, 32, 0620), buf, sizeof buf, &n), -EPERM);
    CHECK_EQ(bex_secret_load(write_file("k7", bin, 15, 0600), buf, sizeof buf, &n), -EINVAL);
    CHECK_EQ(bex_secret_load(write_file("k8", "0123456789abcde\n", 16, 0600), buf, sizeof buf, &n),
             -EINVAL);
    static uint8_t big[BEX_SECRET_MAX + 10];
    memset(big, 'x', sizeof big);
    CHECK_EQ(bex_secret_load(write_file("k9", big, sizeof big, 0600), buf, sizeof buf, &n), -EFBIG);
    p = write_file("k10", big, BEX_SECRET_MAX, 0600);
    CHECK_OK(bex_secret_load(p, buf, sizeof buf, &n));
    CHECK_EQ(n, BEX_SECRET_MAX);
    CHECK_EQ(bex_secret_load(p, buf, 64, &n), -EFBIG); /* more than the caller's buffer */
    char missing[300];
    snprintf(missing, sizeof missing, "%s/none", tmpdir);
    CHECK_EQ(bex_secret_load(missing, buf, sizeof buf, &n), -ENOENT);
    CHECK_EQ(bex_secret_load(tmpdir, buf, sizeof buf, &n), -EINVAL);
    remove_tmpdir();
    return 0;
}

static int secret_env(void)
{
    make_tmpdir();
    uint8_t key[32], want[32], other[32];
    unsetenv("BEX_SECRET");
    unsetenv("BEX_SECRET_FILE");
    memset(key, 0, sizeof key);
    CHECK_EQ(bex__secret_resolve(NULL, 0, key), 0);
    CHECK_EQ(bex__secret_resolve(NULL, 16, key), -EINVAL);

    /* the config's secret */
    key_of(SECRET, want);
    CHECK_EQ(bex__secret_resolve(SECRET, strlen(SECRET), key), 1);
    CHECK(memcmp(key, want, 32) == 0);
    CHECK_EQ(bex__secret_resolve("short", 5, key), -EINVAL);

    /* BEX_SECRET when the config has none; the config wins over it */
    setenv("BEX_SECRET", OTHER, 1);
    key_of(OTHER, other);
    CHECK_EQ(bex__secret_resolve(NULL, 0, key), 1);
    CHECK(memcmp(key, other, 32) == 0);
    CHECK_EQ(bex__secret_resolve(SECRET, strlen(SECRET), key), 1);
    CHECK(memcmp(key, want, 32) == 0);
    /* set but unusable: an error, not "no secret" */
    setenv("BEX_SECRET", "too short", 1);
    CHECK_EQ(bex__secret_resolve(NULL, 0, key), -EINVAL);
    setenv("BEX_SECRET", "", 1);
    CHECK_EQ(bex__secret_resolve(NULL, 0, key), 0); /* empty = unset */

    /* BEX_SECRET_FILE after BEX_SECRET */
    const char *p = write_file("key", SECRET, strlen(SECRET), 0600);
    setenv("BEX_SECRET_FILE", p, 1);
    CHECK_EQ(bex__secret_resolve(NULL, 0, key), 1);
    CHECK(memcmp(key, want, 32) == 0);
    setenv("BEX_SECRET", OTHER, 1);
    CHECK_EQ(bex__secret_resolve(NULL, 0, key), 1);
    CHECK(memcmp(key, other, 32) == 0);
    unsetenv("BEX_SECRET");
    chmod(p, 0644);
    CHECK_EQ(bex__secret_resolve(NULL, 0, key), -EPERM);
    setenv("BEX_SECRET_FILE", "/nonexistent/bex.key", 1);
    CHECK_EQ(bex__secret_resolve(NULL, 0, key), -ENOENT);
    unsetenv("BEX_SECRET_FILE");
    remove_tmpdir();
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(peek), BEX_CASE(wire_layout), BEX_CASE(codec_roundtrip),
              BEX_CASE(codec_errors), BEX_CASE(codec_fuzz), BEX_CASE(key_derivation),
              BEX_CASE(exchange), BEX_CASE(wrong_secret), BEX_CASE(replay), BEX_CASE(secret_file),
              BEX_CASE(secret_env))
