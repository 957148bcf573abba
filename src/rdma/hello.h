/* The connection-setup message (hello) and the TCP helpers that carry it.
 *
 * Wire format and sequence: docs/protocol.md, "Connection setup (hello)".
 * The hello is encoded field by field in network byte order; the struct
 * below is the decoded, host-order form. Nothing here touches verbs, so a
 * side without an RDMA device speaks it too (flag BEX__HELLO_F_NO_RDMA).
 *
 * Threads: all functions are reentrant; the fd helpers act on a caller-owned
 * fd that no other thread reads or writes meanwhile. */
#ifndef BEX_RDMA_HELLO_H
#define BEX_RDMA_HELLO_H

#include <stddef.h>
#include <stdint.h>

#define BEX__HELLO_MAGIC   0x42455848u /* "BEXH" */
#define BEX__HELLO_VERSION 1
#define BEX__HELLO_LEN     80

/* flags */
#define BEX__HELLO_F_NO_RDMA 0x1u /* sender has no usable device: stay on TCP */
#define BEX__HELLO_F_SRQ                                                                           \
    0x2u /* sender's receives come from a shared RQ:                                               \
            recv_depth is a hint, not a credit grant */
#define BEX__HELLO_F_ALL 0x3u

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
};
#define BEX__HELLO_MAX_EAGER (1u << 20)

/* Encode h into exactly BEX__HELLO_LEN bytes (magic, version and length are
 * added; reserved bytes are zero). h is not validated: encode what you mean
 * to send, the peer's decoder judges it. */
void bex__hello_encode(const struct bex__hello *h, uint8_t buf[BEX__HELLO_LEN]);

/* Decode and validate len bytes from a peer. Returns 0 and fills *out, or
 *   -EPROTO  wrong magic or an unsupported version (not a bex v1 peer),
 *   -EBADMSG anything else: len or the length field differ from
 *            BEX__HELLO_LEN, unknown flags, non-zero reserved bytes, a field
 *            out of range (see the struct), or, with BEX__HELLO_F_NO_RDMA,
 *            a non-zero RDMA field (qpn, psn, gid, mtu, rd_atomic, depths,
 *            frag_size).
 * *out is written only on success. Never reads beyond buf[len-1]. */
int bex__hello_decode(const uint8_t *buf, size_t len, struct bex__hello *out);

/* Readiness notice, sent by each side after its QP reached RTS with its
 * receives posted (status 0), or to tell the peer that setup failed on this
 * side and the connection stays on TCP (status = positive errno, for logs). */
#define BEX__READY_MAGIC 0x42455852u /* "BEXR" */
#define BEX__READY_LEN   8

/* ---- blocking I/O with a deadline ------------------------------------ */

/* CLOCK_MONOTONIC now, in milliseconds. */
int64_t bex__hello_now_ms(void);

/* Write / read exactly len bytes on fd before the absolute monotonic time
 * deadline_ms (from bex__hello_now_ms() + timeout). Works on blocking and
 * non-blocking fds; never raises SIGPIPE on sockets. Returns 0, -ETIMEDOUT,
 * -ECONNRESET when the peer closed (EOF) before len bytes, or the errno of
 * poll/recv/send. A silent peer therefore costs at most the deadline. */
int bex__hello_write_all(int fd, const void *buf, size_t len, int64_t deadline_ms);
int bex__hello_read_all(int fd, void *buf, size_t len, int64_t deadline_ms);

/* Encode + write, and read + decode, one hello. recv returns the decoder's
 * errors as well as the I/O errors. */
int bex__hello_send(int fd, const struct bex__hello *h, int64_t deadline_ms);
int bex__hello_recv(int fd, struct bex__hello *out, int64_t deadline_ms);

/* Send our readiness status (0 or a positive errno); receive the peer's.
 * ready_recv returns 0 and sets *status (0 = peer ready), -EBADMSG for a
 * malformed notice, or an I/O error. */
int bex__hello_ready_send(int fd, uint32_t status, int64_t deadline_ms);
int bex__hello_ready_recv(int fd, uint32_t *status, int64_t deadline_ms);

#endif
