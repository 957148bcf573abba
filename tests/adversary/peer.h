/* SPDX-License-Identifier: Apache-2.0 */
/* A protocol-speaking attacker: a raw peer of a bex engine, built from the
 * library's own codecs and verbs helpers (rdma/rdma.h, wire/hello.h,
 * bex__hdr_encode), with its own RC QP. It completes a valid hello and then
 * sends whatever headers it likes, returns credits or not, answers the
 * server's rendezvous requests or not, and writes anywhere with any rkey.
 *
 * One thread per peer; nothing here is thread-safe. */
#ifndef BEX_TESTS_ADV_PEER_H
#define BEX_TESTS_ADV_PEER_H

#include <stdbool.h>
#include <stdint.h>

#include "transport/rdma/engine.h"
#include "rdma/rdma.h"
#include "conn/hello_io.h"

#define PEER_RECV_MAX  64
#define PEER_SEND_MAX  128 /* send WRs outstanding */
#define PEER_EAGER     8192
#define PEER_LAND      4 /* landing slots for the server's rendezvous */
#define PEER_LAND_SIZE (1u << 20)
#define PEER_SRC_SIZE  (1u << 20)
#define PEER_RESP_MAX  1024
#define PEER_ATTACK    0xee /* what the attacker writes: easy to spot */

struct adv_peer_opts {
    uint16_t recv_depth; /* advertised in the hello (32) */
    uint16_t posted;     /* receives really posted (recv_depth, at most 64) */
    uint16_t max_rndv;   /* advertised (4) */
    uint32_t eager_max;  /* advertised (8192) */
    bool hold_credits;   /* never repost a receive, never return a credit */
    bool ignore_rndv;    /* never answer the server's rendezvous requests */
    bool no_ready;       /* stop after the hellos: never send the ready notice */
    const char *secret;  /* authenticate with this (when the server wants it) */
};

/* A rendezvous answer the server sent us. */
struct adv_resp {
    uint32_t id; /* our request id */
    int32_t status;
    uint64_t addr;
    uint32_t rkey;
    uint32_t slot; /* the immediate value that names the destination */
};

struct adv_peer {
    struct adv_peer_opts o;
    struct bex__rdma_dev *dev;
    struct bex__rdma_path path;
    struct bex__rdma_conn_config conn;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *mr;
    uint8_t *mem;
    size_t memlen;
    uint8_t *rhdr, *rbuf, *shdr, *spay, *src, *land;
    volatile uint64_t *ka_in; /* the server writes its keepalive here */
    uint64_t *ka_out;         /* our keepalive sequence, written to the server */
    int fd;
    uint16_t lport; /* our TCP port: the server's log should name it */
    struct bex__hello mine, theirs;
    bool up;
    /* credits */
    uint32_t credits;   /* SENDs we may still post (the server's receives) */
    uint32_t to_return; /* receives we reposted and have not told about */
    uint32_t held;      /* receives consumed and not reposted */
    /* send queue */
    uint32_t sq_out;
    uint64_t wr_seq;
    uint8_t wc_status[1024]; /* by wr_seq % 1024: 0xff pending, else ibv_wc_status */
    /* what happened */
    bool closed;        /* the server closed the TCP connection */
    uint64_t closed_ms; /* when we saw it */
    int qp_err;         /* first failed completion's status (ibv_wc_status), 0 */
    uint64_t ka_next, ka_seq;
    struct adv_resp resp[PEER_RESP_MAX];
    uint32_t nresp;
    uint32_t data_recv, credit_recv, close_recv, req_recv, imm_recv, sends;
    /* the server's rendezvous requests waiting for our answer */
    struct bex__hdr req_q[64];
    uint32_t nreq_q;
    bool land_busy[PEER_LAND];
};

/* Connect to the listener at srv from local: TCP, hello, QP to RTS, ready.
 * 0, or a negative errno (the server refused us or the setup failed: then
 * p->closed tells whether the server closed the TCP connection). On failure
 * the peer is still to be destroyed. */
int adv_peer_open(struct adv_peer *p, struct in_addr local, const bex_addr *srv,
                  const struct adv_peer_opts *o);
void adv_peer_destroy(struct adv_peer *p);

/* Process completions, TCP EOF, keepalive and our pending answers for about
 * ms milliseconds (0: one pass). */
void adv_peer_poll(struct adv_peer *p, unsigned ms);

/* Post one SEND with header h (credits filled in) and len payload bytes
 * (from the peer's payload area). Waits up to wait_ms for a credit and a
 * send slot. 0, -EAGAIN (no credit in time), -EPIPE (closed or QP error). */
int adv_peer_send(struct adv_peer *p, struct bex__hdr *h, uint32_t len, unsigned wait_ms);
/* The same without looking at credits (the protocol forbids it). */
int adv_peer_send_nocredit(struct adv_peer *p, struct bex__hdr *h, uint32_t len);

/* Fill our source area (what WRITEs send) with byte b: a legitimate
 * transfer's content, then PEER_ATTACK for the abuse, so that an abusive
 * write that lands changes what it hits. */
void adv_peer_fill(struct adv_peer *p, uint8_t b);

/* RDMA WRITE len bytes of our source area (PEER_ATTACK unless filled, at most
 * PEER_SRC_SIZE) to raddr with rkey; with imm >= 0, WRITE_WITH_IMM.
 * Waits for its completion up to wait_ms: returns IBV_WC_SUCCESS (0), the
 * failed completion's ibv_wc_status (> 0), -ETIMEDOUT, or -EPIPE. */
int adv_peer_write(struct adv_peer *p, uint64_t raddr, uint32_t rkey, uint32_t len, int64_t imm,
                   unsigned wait_ms);
/* The same, not waiting: returns 0 once posted. */
int adv_peer_write_post(struct adv_peer *p, uint64_t raddr, uint32_t rkey, uint32_t len,
                        int64_t imm);

/* The answer to our request id, waiting up to wait_ms; NULL if none. */
const struct adv_resp *adv_peer_wait_resp(struct adv_peer *p, uint32_t id, unsigned wait_ms);

/* Wait until the server closes us (TCP EOF) or our QP fails: 0 when it
 * did within wait_ms, -ETIMEDOUT when not. */
int adv_peer_wait_closed(struct adv_peer *p, unsigned wait_ms);

#endif
