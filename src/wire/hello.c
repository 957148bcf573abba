/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <string.h>

#include <sodium.h>

#include "bex/sock.h"
#include "wire/hello.h"

/* Byte offsets of the hello (version 4; 3 and 1 had the same layout with
 * bytes 42..43 and 78..79 reserved); docs/protocol.md has the same table. */
enum {
    OFF_MAGIC = 0,
    OFF_VERSION = 4,
    OFF_LENGTH = 6,
    OFF_FLAGS = 8,
    OFF_QPN = 12,
    OFF_PSN = 16,
    OFF_GID = 20,
    OFF_MTU = 36,
    OFF_RD_ATOMIC = 37,
    OFF_RECV_DEPTH = 38,
    OFF_SQ_DEPTH = 40,
    OFF_KA_TIMEOUT = 42,
    OFF_MAX_MSG = 44,
    OFF_FRAG_SIZE = 48,
    OFF_CONN_ID = 52,
    OFF_EAGER_MAX = 60,
    OFF_KA_ADDR = 64,
    OFF_KA_RKEY = 72,
    OFF_MAX_RNDV = 76,
    OFF_LID = 78, /* reserved (zero) before InfiniBand routes */
};
_Static_assert(OFF_LID + 2 == BEX__HELLO_LEN, "hello layout must fill BEX__HELLO_LEN");

/* Explicit shifts rather than htonl() + memcpy: the layout is then the same
 * on every host and no unaligned access is ever made. */
static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

static void put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static void put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)(v >> 32));
    put32(p + 4, (uint32_t)v);
}

static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)((unsigned)p[0] << 8 | p[1]);
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) << 32 | get32(p + 4);
}

static int all_zero(const uint8_t *p, size_t n)
{
    uint8_t acc = 0;
    for (size_t i = 0; i < n; i++)
        acc |= p[i];
    return acc == 0;
}

void bex__hello_encode(const struct bex__hello *h, uint8_t buf[BEX__HELLO_LEN])
{
    memset(buf, 0, BEX__HELLO_LEN);
    put32(buf + OFF_MAGIC, BEX__HELLO_MAGIC);
    put16(buf + OFF_VERSION, BEX__HELLO_VERSION);
    put16(buf + OFF_LENGTH, BEX__HELLO_LEN);
    uint32_t route = (uint32_t)(h->route & 3u) << BEX__HELLO_ROUTE_SHIFT;
    put32(buf + OFF_FLAGS, (h->flags & ~BEX__HELLO_ROUTE_MASK) | route);
    put32(buf + OFF_QPN, h->qpn);
    put32(buf + OFF_PSN, h->psn);
    memcpy(buf + OFF_GID, h->gid, 16);
    buf[OFF_MTU] = h->mtu;
    buf[OFF_RD_ATOMIC] = h->rd_atomic;
    put16(buf + OFF_RECV_DEPTH, h->recv_depth);
    put16(buf + OFF_SQ_DEPTH, h->sq_depth);
    put32(buf + OFF_MAX_MSG, h->max_msg);
    put32(buf + OFF_FRAG_SIZE, h->frag_size);
    put64(buf + OFF_CONN_ID, h->conn_id);
    put32(buf + OFF_EAGER_MAX, h->eager_max);
    put64(buf + OFF_KA_ADDR, h->ka_addr);
    put32(buf + OFF_KA_RKEY, h->ka_rkey);
    put16(buf + OFF_MAX_RNDV, h->max_rndv);
    put16(buf + OFF_KA_TIMEOUT, h->ka_timeout_ms);
    put16(buf + OFF_LID, h->lid);
}

/* The route and the LID: the LID is an InfiniBand port's unicast address
 * and nothing else (a RoCE or TCP-only sender has none). */
static int route_check(const struct bex__hello *h)
{
    if (h->route > BEX__HELLO_ROUTE_IB)
        return -EPROTONOSUPPORT;
    if ((h->flags & BEX__HELLO_F_NO_RDMA) && h->route != BEX__HELLO_ROUTE_ROCE_V2)
        return -EBADMSG;
    if (h->route == BEX__HELLO_ROUTE_IB)
        return h->lid >= 1 && h->lid <= BEX__HELLO_LID_MAX ? 0 : -EBADMSG;
    return h->lid == 0 ? 0 : -EBADMSG;
}

int bex__hello_decode(const uint8_t *buf, size_t len, struct bex__hello *out)
{
    /* Magic and version first, so a stranger (an HTTP client, a future
     * version) is told "wrong protocol" rather than "malformed". */
    if (len < 6)
        return -EBADMSG;
    if (get32(buf + OFF_MAGIC) != BEX__HELLO_MAGIC)
        return -EPROTO;
    if (get16(buf + OFF_VERSION) != BEX__HELLO_VERSION)
        return -EPROTO;
    if (len != BEX__HELLO_LEN || get16(buf + OFF_LENGTH) != BEX__HELLO_LEN)
        return -EBADMSG;

    struct bex__hello h;
    h.flags = get32(buf + OFF_FLAGS);
    h.route = (uint8_t)((h.flags & BEX__HELLO_ROUTE_MASK) >> BEX__HELLO_ROUTE_SHIFT);
    h.flags &= ~BEX__HELLO_ROUTE_MASK;
    h.lid = get16(buf + OFF_LID);
    h.qpn = get32(buf + OFF_QPN);
    h.psn = get32(buf + OFF_PSN);
    memcpy(h.gid, buf + OFF_GID, 16);
    h.mtu = buf[OFF_MTU];
    h.rd_atomic = buf[OFF_RD_ATOMIC];
    h.recv_depth = get16(buf + OFF_RECV_DEPTH);
    h.sq_depth = get16(buf + OFF_SQ_DEPTH);
    h.max_msg = get32(buf + OFF_MAX_MSG);
    h.frag_size = get32(buf + OFF_FRAG_SIZE);
    h.conn_id = get64(buf + OFF_CONN_ID);
    h.eager_max = get32(buf + OFF_EAGER_MAX);
    h.ka_addr = get64(buf + OFF_KA_ADDR);
    h.ka_rkey = get32(buf + OFF_KA_RKEY);
    h.max_rndv = get16(buf + OFF_MAX_RNDV);
    h.ka_timeout_ms = get16(buf + OFF_KA_TIMEOUT);

    if (h.flags & ~BEX__HELLO_F_ALL)
        return -EBADMSG;
    int err = route_check(&h);
    if (err)
        return err;
    if (h.conn_id == 0)
        return -EBADMSG;
    if (h.max_msg == 0 || h.max_msg > BEX__HELLO_MAX_MSG)
        return -EBADMSG;

    if (h.flags & BEX__HELLO_F_NO_RDMA) {
        /* A side without RDMA must not look like it has a QP: the peer would
         * otherwise be tempted to connect to garbage. */
        if (h.qpn | h.psn | h.mtu | h.rd_atomic | h.recv_depth | h.sq_depth | h.frag_size |
            h.eager_max | h.ka_rkey | h.max_rndv | h.ka_addr)
            return -EBADMSG;
        if (!all_zero(h.gid, 16) || (h.flags & BEX__HELLO_F_SRQ))
            return -EBADMSG;
    } else {
        /* QPN 0 and 1 are the special QPs (SMI, GSI), never an RC QP. */
        if (h.qpn < 2 || h.qpn > 0xffffffu)
            return -EBADMSG;
        if (h.psn > 0xffffffu)
            return -EBADMSG;
        if (all_zero(h.gid, 16))
            return -EBADMSG;
        if (h.mtu < 1 || h.mtu > 5) /* IBV_MTU_256 .. IBV_MTU_4096 */
            return -EBADMSG;
        if (h.recv_depth == 0 || h.sq_depth == 0)
            return -EBADMSG;
        if (h.frag_size < BEX__HELLO_MIN_FRAG || h.frag_size > BEX__HELLO_MAX_MSG)
            return -EBADMSG;
        if (h.eager_max > BEX__HELLO_MAX_EAGER || h.ka_addr == 0 || h.max_rndv == 0)
            return -EBADMSG;
    }
    *out = h;
    return 0;
}

/* ---- authenticated setup -------------------------------------------- */

enum { OFF_AUTH_TYPE = 8, OFF_AUTH_RSVD = 9 /* 3 bytes */ };

int bex__setup_peek(const uint8_t pre[BEX__SETUP_PRE_LEN], size_t *len)
{
    uint32_t magic = get32(pre);
    if (magic == BEX__READY_MAGIC) {
        *len = BEX__READY_LEN;
        return BEX__SETUP_NOTICE;
    }
    if (magic != BEX__HELLO_MAGIC)
        return -EPROTO;
    uint16_t version = get16(pre + OFF_VERSION);
    if (version == BEX__HELLO_VERSION) {
        /* the hello's own length field is judged by its decoder */
        *len = BEX__HELLO_LEN;
        return BEX__SETUP_HELLO;
    }
    if (version != BEX__AUTH_VERSION)
        return -EPROTO;
    uint16_t n = get16(pre + OFF_LENGTH);
    if (n != BEX__AUTH_SHORT_LEN && n != BEX__AUTH_HELLO_LEN)
        return -EBADMSG;
    *len = n;
    return BEX__SETUP_AUTH;
}

static void auth_header(uint8_t *buf, uint8_t type, uint16_t len)
{
    memset(buf, 0, BEX__AUTH_HDR_LEN);
    put32(buf + OFF_MAGIC, BEX__HELLO_MAGIC);
    put16(buf + OFF_VERSION, BEX__AUTH_VERSION);
    put16(buf + OFF_LENGTH, len);
    buf[OFF_AUTH_TYPE] = type;
}

/* Header checks shared by every version-2 message. */
static int auth_check(const uint8_t *buf, size_t len, uint8_t type, size_t want)
{
    if (len < 6)
        return -EBADMSG;
    if (get32(buf + OFF_MAGIC) != BEX__HELLO_MAGIC || get16(buf + OFF_VERSION) != BEX__AUTH_VERSION)
        return -EPROTO;
    if (len != want || len < BEX__AUTH_HDR_LEN || get16(buf + OFF_LENGTH) != want)
        return -EBADMSG;
    if (!all_zero(buf + OFF_AUTH_RSVD, 3))
        return -EBADMSG;
    if (buf[OFF_AUTH_TYPE] != type)
        return -EPROTO; /* a well-formed message, but not the one due now */
    return 0;
}

void bex__auth_encode(uint8_t type, const uint8_t body[32], uint8_t buf[BEX__AUTH_SHORT_LEN])
{
    auth_header(buf, type, BEX__AUTH_SHORT_LEN);
    memcpy(buf + BEX__AUTH_HDR_LEN, body, 32);
}

int bex__auth_decode(const uint8_t *buf, size_t len, uint8_t type, uint8_t body[32])
{
    if (type == BEX__AUTH_HELLO)
        return -EINVAL; /* has its own decoder */
    int err = auth_check(buf, len, type, BEX__AUTH_SHORT_LEN);
    if (err)
        return err;
    memcpy(body, buf + BEX__AUTH_HDR_LEN, 32);
    return 0;
}

void bex__auth_encode_hello(const uint8_t hello[BEX__HELLO_LEN],
                            const uint8_t mac[BEX__AUTH_MAC_LEN], uint8_t buf[BEX__AUTH_HELLO_LEN])
{
    auth_header(buf, BEX__AUTH_HELLO, BEX__AUTH_HELLO_LEN);
    memcpy(buf + BEX__AUTH_HDR_LEN, hello, BEX__HELLO_LEN);
    memcpy(buf + BEX__AUTH_HDR_LEN + BEX__HELLO_LEN, mac, BEX__AUTH_MAC_LEN);
}

int bex__auth_decode_hello(const uint8_t *buf, size_t len, struct bex__hello *h,
                           uint8_t mac[BEX__AUTH_MAC_LEN])
{
    int err = auth_check(buf, len, BEX__AUTH_HELLO, BEX__AUTH_HELLO_LEN);
    if (err)
        return err;
    struct bex__hello tmp;
    if ((err = bex__hello_decode(buf + BEX__AUTH_HDR_LEN, BEX__HELLO_LEN, &tmp)))
        return err;
    *h = tmp;
    memcpy(mac, buf + BEX__AUTH_HDR_LEN + BEX__HELLO_LEN, BEX__AUTH_MAC_LEN);
    return 0;
}

void bex__auth_ends(struct bex__auth_transcript *t, uint32_t client_ip, uint16_t client_port,
                    uint32_t listener_ip, uint16_t listener_port)
{
    /* already in network order: copy the bytes as they are */
    memcpy(t->ends, &client_ip, 4);
    memcpy(t->ends + 4, &client_port, 2);
    memcpy(t->ends + 6, &listener_ip, 4);
    memcpy(t->ends + 10, &listener_port, 2);
    t->ends_len = 12;
}

/* a, with an IPv4-mapped IPv6 address made IPv4 */
static bex_addr ends_unmap(const bex_addr *a)
{
    if (a->sa.sa_family != AF_INET6 || !IN6_IS_ADDR_V4MAPPED(&a->in6.sin6_addr))
        return *a;
    bex_addr v4 = {.in4 = {.sin_family = AF_INET, .sin_port = a->in6.sin6_port}};
    memcpy(&v4.in4.sin_addr, &a->in6.sin6_addr.s6_addr[12], 4);
    return v4;
}

int bex__auth_ends_addr(struct bex__auth_transcript *t, const bex_addr *client,
                        const bex_addr *listener)
{
    bex_addr c = ends_unmap(client), l = ends_unmap(listener);
    if (c.sa.sa_family == AF_INET && l.sa.sa_family == AF_INET) {
        bex__auth_ends(t, c.in4.sin_addr.s_addr, c.in4.sin_port, l.in4.sin_addr.s_addr,
                       l.in4.sin_port);
        return 0;
    }
    if (c.sa.sa_family != AF_INET6 || l.sa.sa_family != AF_INET6)
        return -EAFNOSUPPORT;
    memcpy(t->ends, &c.in6.sin6_addr, 16);
    memcpy(t->ends + 16, &c.in6.sin6_port, 2);
    memcpy(t->ends + 18, &l.in6.sin6_addr, 16);
    memcpy(t->ends + 34, &l.in6.sin6_port, 2);
    t->ends_len = 36;
    return 0;
}

/* Equal lengths, so label || fields is unambiguous without separators. */
static const char *const mac_label[] = {"bex2 proof c", "bex2 hello l", "bex2 hello c"};

void bex__auth_mac(const uint8_t key[BEX__AUTH_KEY_LEN], int which,
                   const struct bex__auth_transcript *t, const uint8_t *hello_l,
                   const uint8_t *hello_c, uint8_t mac[BEX__AUTH_MAC_LEN])
{
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, key, BEX__AUTH_KEY_LEN);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)mac_label[which], 12);
    crypto_auth_hmacsha256_update(&st, t->nonce_l, sizeof t->nonce_l);
    crypto_auth_hmacsha256_update(&st, t->nonce_c, sizeof t->nonce_c);
    crypto_auth_hmacsha256_update(&st, t->ends, t->ends_len);
    if (which != BEX__AUTH_MAC_PROOF_C)
        crypto_auth_hmacsha256_update(&st, hello_l, BEX__HELLO_LEN);
    if (which == BEX__AUTH_MAC_HELLO_C)
        crypto_auth_hmacsha256_update(&st, hello_c, BEX__HELLO_LEN);
    crypto_auth_hmacsha256_final(&st, mac);
    sodium_memzero(&st, sizeof st);
}

int bex__auth_verify(const uint8_t key[BEX__AUTH_KEY_LEN], int which,
                     const struct bex__auth_transcript *t, const uint8_t *hello_l,
                     const uint8_t *hello_c, const uint8_t mac[BEX__AUTH_MAC_LEN])
{
    uint8_t want[BEX__AUTH_MAC_LEN];
    bex__auth_mac(key, which, t, hello_l, hello_c, want);
    int bad = sodium_memcmp(want, mac, BEX__AUTH_MAC_LEN);
    sodium_memzero(want, sizeof want);
    return bad ? -EACCES : 0;
}

int bex__auth_key(const void *secret, size_t len, uint8_t key[BEX__AUTH_KEY_LEN])
{
    static const char label[] = "bex setup key v2";
    if (!secret || len < BEX_SECRET_MIN || len > BEX_SECRET_MAX)
        return -EINVAL;
    if (sodium_init() < 0)
        return -EIO;
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, secret, len);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, sizeof label - 1);
    crypto_auth_hmacsha256_final(&st, key);
    sodium_memzero(&st, sizeof st);
    return 0;
}

int bex__auth_nonce(uint8_t nonce[BEX__AUTH_NONCE_LEN])
{
    /* idempotent and cheap once done; nonces are made once per setup */
    if (sodium_init() < 0)
        return -EIO;
    randombytes_buf(nonce, BEX__AUTH_NONCE_LEN);
    return 0;
}

void bex__ready_encode(uint32_t status, uint8_t buf[BEX__READY_LEN])
{
    put32(buf, BEX__READY_MAGIC);
    put32(buf + 4, status);
}

int bex__ready_decode(const uint8_t buf[BEX__READY_LEN], uint32_t *status)
{
    if (get32(buf) != BEX__READY_MAGIC)
        return -EBADMSG;
    *status = get32(buf + 4);
    return 0;
}
