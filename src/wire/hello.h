/* SPDX-License-Identifier: Apache-2.0 */
/* The connection-setup messages (hello, authenticated setup, readiness
 * notice): codecs and MACs, no I/O (src/conn/hello_io.h carries them).
 *
 * Wire format and sequence: docs/protocol.md, "Connection setup (hello)".
 * The hello is encoded field by field in network byte order; the struct
 * below is the decoded, host-order form. Nothing here touches verbs, so a
 * side without an RDMA device speaks it too (flag BEX__HELLO_F_NO_RDMA).
 *
 * Threads: all functions are reentrant. */
#ifndef BEX_WIRE_HELLO_H
#define BEX_WIRE_HELLO_H

#include <stddef.h>
#include <stdint.h>

#include "bex/addr.h"

#define BEX__HELLO_MAGIC 0x42455848u /* "BEXH" */
/* 4: the hello carries the sender's keepalive timeout (ka_timeout_ms);
 * 3: DATA goes header-free (docs/protocol.md); 1 had a header on every
 * SEND; 2 is the authenticated-setup envelope, not a hello */
#define BEX__HELLO_VERSION 4
#define BEX__HELLO_LEN     80

/* flags */
#define BEX__HELLO_F_NO_RDMA 0x1u /* sender has no usable device: stay on TCP */
#define BEX__HELLO_F_SRQ                                                                           \
    0x2u /* sender's receives come from a shared RQ:                                               \
            recv_depth is a hint, not a credit grant */
#define BEX__HELLO_F_ALL 0x3u
/* Bits 2..3 of the flags word carry the sender's route (decoded into
 * bex__hello.route, never left in .flags): how a peer reaches its port.
 * They and the LID (bytes 78..79) sit where a version-4 decoder of before
 * requires zeros, so a RoCE v2 hello is unchanged byte for byte and an
 * older peer refuses the others as malformed instead of misreading them. */
#define BEX__HELLO_ROUTE_SHIFT 2
#define BEX__HELLO_ROUTE_MASK  0xcu
enum {
    BEX__HELLO_ROUTE_ROCE_V2 = 0, /* Ethernet, RoCE v2 GID (UDP/IP) */
    BEX__HELLO_ROUTE_ROCE_V1 = 1, /* Ethernet, RoCE v1 GID (Ethertype) */
    BEX__HELLO_ROUTE_IB = 2,      /* InfiniBand: LID, GRH when routed */
    /* 3 is refused: a GID type this version does not know */
};
/* Unicast LIDs; 0 is unassigned, 0xc000..0xfffe multicast, 0xffff the
 * permissive LID: none addresses one port. */
#define BEX__HELLO_LID_MAX 0xbfffu

/* limits a decoder enforces */
#define BEX__HELLO_MAX_MSG  (1u << 31) /* RC's largest message */
#define BEX__HELLO_MIN_FRAG 256u       /* smallest IB MTU */

struct bex__hello {
    uint32_t flags;      /* BEX__HELLO_F_* */
    uint32_t qpn;        /* sender's QP number, 24-bit, >= 2 */
    uint32_t psn;        /* first PSN the sender will send, 24-bit */
    uint8_t gid[16];     /* sender's GID (RoCEv2: ::ffff:a.b.c.d) */
    uint8_t mtu;         /* sender's active MTU, IB enum 1..5 (256..4096) */
    uint8_t rd_atomic;   /* RDMA READs the sender serves at once (its
                            max_dest_rd_atomic); 0 = none */
    uint16_t recv_depth; /* receives the sender has posted = the peer's
                            initial credits, 1..65535 */
    uint16_t sq_depth;   /* sender's send-queue depth, 1..65535 */
    uint32_t max_msg;    /* largest message the sender accepts, bytes,
                            1..2^31 */
    uint32_t frag_size;  /* WRITE fragment size the sender uses, bytes,
                            256..2^31 */
    uint64_t conn_id;    /* non-zero; chosen at random by the client,
                            echoed by the server */
    /* the engine's part */
    uint32_t eager_max; /* largest message the sender takes by SEND (its
                           receive buffers' size), 0..BEX__HELLO_MAX_EAGER */
    uint64_t ka_addr;   /* where the peer WRITEs its keepalive sequence
                           (8 bytes), non-zero */
    uint32_t ka_rkey;   /* rkey of that word */
    uint16_t max_rndv;  /* rendezvous the sender holds open at once, >= 1 */
    /* either transport: the sender's keepalive_timeout_ms, 1..65535 (a
       longer one is sent as 65535; 0: not given): over TCP the peer need
       not write keepalives more often than a quarter of it */
    uint16_t ka_timeout_ms;
    /* the sender's route, BEX__HELLO_ROUTE_* (flags bits 2..3); and its
       port's LID: InfiniBand 1..BEX__HELLO_LID_MAX, 0 on RoCE and with
       NO_RDMA (which also has route 0) */
    uint8_t route;
    uint16_t lid;
};
#define BEX__HELLO_MAX_EAGER (1u << 20)

/* Encode h into exactly BEX__HELLO_LEN bytes (magic, version and length are
 * added; reserved bytes are zero). h is not validated: encode what you mean
 * to send, the peer's decoder judges it. */
void bex__hello_encode(const struct bex__hello *h, uint8_t buf[BEX__HELLO_LEN]);

/* Decode and validate len bytes from a peer. Returns 0 and fills *out, or
 *   -EPROTO  wrong magic or an unsupported version (not a peer of this version),
 *   -EBADMSG anything else: len or the length field differ from
 *            BEX__HELLO_LEN, unknown flags, non-zero reserved bytes, a field
 *            out of range (see the struct), or, with BEX__HELLO_F_NO_RDMA,
 *            a non-zero RDMA field (qpn, psn, gid, mtu, rd_atomic, depths,
 *            frag_size), an InfiniBand route whose LID is not unicast (0,
 *            multicast, permissive), a RoCE route or NO_RDMA hello with a
 *            LID, NO_RDMA with a route,
 *   -EPROTONOSUPPORT  a route of 3 (a GID type this version does not know).
 * *out is written only on success. Never reads beyond buf[len-1]. */
int bex__hello_decode(const uint8_t *buf, size_t len, struct bex__hello *out);

/* Readiness notice, sent by each side after its QP reached RTS with its
 * receives posted (status 0), or to tell the peer that setup failed on this
 * side and the connection stays on TCP (status = positive errno, for logs). */
#define BEX__READY_MAGIC 0x42455852u /* "BEXR" */
#define BEX__READY_LEN   8
/* status of a notice from a side whose QP could not come up although both
 * hellos offered RDMA: both sides go on over TCP after the notices */
#define BEX__READY_FALLBACK 0x10000u

/* ---- authenticated setup (a shared secret; docs/protocol.md) ---------- */

/* Every setup message starts with 8 bytes that say what it is: "BEXH" +
 * version 3 (a plain hello, BEX__HELLO_LEN bytes), "BEXH" + version 2 (an
 * authenticated-setup message, its length in bytes 6..7) or "BEXR" (a
 * notice, BEX__READY_LEN bytes: readiness, or a refusal with an errno). A
 * reader takes these 8 bytes first, so a peer of the other kind (with or
 * without a secret) is told apart at once instead of leaving the reader
 * waiting for bytes that never come. */
#define BEX__SETUP_PRE_LEN 8
enum { BEX__SETUP_HELLO = 1, BEX__SETUP_AUTH = 2, BEX__SETUP_NOTICE = 3 };

/* Classify a preamble: returns BEX__SETUP_* and sets *len to the whole
 * message's length (8 for a notice, 80 for a plain hello, 44 or 124 for an
 * authenticated-setup message), or -EPROTO (not a bex setup message, or an
 * unknown version) or -EBADMSG (version 2 with an impossible length). */
int bex__setup_peek(const uint8_t pre[BEX__SETUP_PRE_LEN], size_t *len);

#define BEX__AUTH_VERSION   2
#define BEX__AUTH_KEY_LEN   32 /* derived key: HMAC-SHA-256 key size */
#define BEX__AUTH_NONCE_LEN 32
#define BEX__AUTH_MAC_LEN   32                       /* HMAC-SHA-256 */
#define BEX__AUTH_HDR_LEN   12                       /* preamble, type, 3 reserved bytes */
#define BEX__AUTH_SHORT_LEN (BEX__AUTH_HDR_LEN + 32) /* OPEN, CHALLENGE, PROOF */
#define BEX__AUTH_HELLO_LEN (BEX__AUTH_HDR_LEN + BEX__HELLO_LEN + BEX__AUTH_MAC_LEN)
#define BEX__SETUP_MAX_LEN  BEX__AUTH_HELLO_LEN /* the longest setup message */
/* The most one side ever writes during setup (client with a secret: OPEN,
 * PROOF, HELLO, ready), so an output buffer of this size cannot overflow
 * however the peer times its messages. */
#define BEX__SETUP_OUT_MAX (2 * BEX__AUTH_SHORT_LEN + BEX__AUTH_HELLO_LEN + BEX__READY_LEN)

/* Message types (byte 8). Body: OPEN and CHALLENGE a nonce, PROOF a MAC,
 * HELLO a plain hello (BEX__HELLO_LEN bytes, as bex__hello_encode writes it)
 * followed by a MAC. */
enum { BEX__AUTH_OPEN = 1, BEX__AUTH_CHALLENGE = 2, BEX__AUTH_PROOF = 3, BEX__AUTH_HELLO = 4 };

/* Encode an OPEN, CHALLENGE or PROOF with its 32-byte body. */
void bex__auth_encode(uint8_t type, const uint8_t body[32], uint8_t buf[BEX__AUTH_SHORT_LEN]);
/* Decode one of the above, expecting type. Returns 0 and fills body, or
 *   -EPROTO  not a version-2 message, or another type than expected,
 *   -EBADMSG wrong length (len or the length field) or non-zero reserved
 *            bytes.
 * body is written only on success. Never reads beyond buf[len-1]. */
int bex__auth_decode(const uint8_t *buf, size_t len, uint8_t type, uint8_t body[32]);

/* Encode a HELLO: hello is the plain hello's encoding, mac its MAC. */
void bex__auth_encode_hello(const uint8_t hello[BEX__HELLO_LEN],
                            const uint8_t mac[BEX__AUTH_MAC_LEN], uint8_t buf[BEX__AUTH_HELLO_LEN]);
/* Decode a HELLO: errors as bex__auth_decode, plus bex__hello_decode's for
 * the embedded hello. On success *h is the decoded hello, mac its MAC; the
 * raw hello (for the MAC) is buf + BEX__AUTH_HDR_LEN. */
int bex__auth_decode_hello(const uint8_t *buf, size_t len, struct bex__hello *h,
                           uint8_t mac[BEX__AUTH_MAC_LEN]);

/* What both sides MAC: the two nonces and the TCP connection's endpoints as
 * each side sees them (so a proof made for one connection, e.g. relayed by
 * a host in the middle, is worthless on another). */
struct bex__auth_transcript {
    uint8_t nonce_l[BEX__AUTH_NONCE_LEN]; /* the listener's (CHALLENGE) */
    uint8_t nonce_c[BEX__AUTH_NONCE_LEN]; /* the connector's (OPEN) */
    /* client address, port, listener address, port; network order: 12
     * bytes over IPv4, 36 over IPv6 (IPv4-mapped IPv6 addresses count as
     * IPv4, so a dual-stack listener and an IPv4 client agree) */
    uint8_t ends[36];
    uint8_t ends_len;
};

/* Fill t->ends from the two endpoints (sin_addr, sin_port as in a
 * sockaddr_in, network order). */
void bex__auth_ends(struct bex__auth_transcript *t, uint32_t client_ip, uint16_t client_port,
                    uint32_t listener_ip, uint16_t listener_port);
/* The same from the two socket addresses (IPv4 or IPv6; both of one family
 * once IPv4-mapped ones are taken as IPv4). 0, or -EAFNOSUPPORT. */
int bex__auth_ends_addr(struct bex__auth_transcript *t, const bex_addr *client,
                        const bex_addr *listener);

/* The three MACs, each with its own label so none can stand for another:
 *   PROOF_C  the connector's proof:  label || nonce_l || nonce_c || ends
 *   HELLO_L  the listener's hello:   ... || hello_l
 *   HELLO_C  the connector's hello:  ... || hello_l || hello_c
 * hello_l / hello_c are the plain hellos' encodings (BEX__HELLO_LEN bytes);
 * pass NULL where the MAC does not cover them. */
enum { BEX__AUTH_MAC_PROOF_C, BEX__AUTH_MAC_HELLO_L, BEX__AUTH_MAC_HELLO_C };
void bex__auth_mac(const uint8_t key[BEX__AUTH_KEY_LEN], int which,
                   const struct bex__auth_transcript *t, const uint8_t *hello_l,
                   const uint8_t *hello_c, uint8_t mac[BEX__AUTH_MAC_LEN]);
/* Recompute and compare in constant time: 0 or -EACCES. */
int bex__auth_verify(const uint8_t key[BEX__AUTH_KEY_LEN], int which,
                     const struct bex__auth_transcript *t, const uint8_t *hello_l,
                     const uint8_t *hello_c, const uint8_t mac[BEX__AUTH_MAC_LEN]);

/* The key both sides MAC with: HMAC-SHA-256 keyed by the secret over a fixed
 * label, so the secret itself never keys anything that reaches the wire.
 * Returns 0, -EINVAL (len outside BEX_SECRET_MIN..BEX_SECRET_MAX) or -EIO
 * (libsodium could not initialise). */
int bex__auth_key(const void *secret, size_t len, uint8_t key[BEX__AUTH_KEY_LEN]);

/* A fresh random nonce (libsodium's randombytes): 0, or -EIO when libsodium
 * cannot initialise. */
int bex__auth_nonce(uint8_t nonce[BEX__AUTH_NONCE_LEN]);

/* The readiness notice: encode status (0 = ready, else a positive errno);
 * decode returns 0 and sets *status, or -EBADMSG without the magic. */
void bex__ready_encode(uint32_t status, uint8_t buf[BEX__READY_LEN]);
int bex__ready_decode(const uint8_t buf[BEX__READY_LEN], uint32_t *status);

#endif
