/* SPDX-License-Identifier: Apache-2.0 */
/* A fake transport for deterministic engine tests: two engines made by
 * bex__engine_create_nodev, joined back to back by a stand-in NIC that the
 * test drives one step at a time (issue 8 item 6).
 *
 * The NIC (fake.c) plays RC between the two stand-in QPs:
 *  - a posted send waits on the wire until the test executes it; requests
 *    of one QP execute in posting order;
 *  - executing a SEND consumes the peer's next posted receive (none posted
 *    is an RNR: a test failure, the credits should have prevented it) and
 *    scatters what it carries into it (a control message's header, or a
 *    header-free DATA's payload with its immediate in the completion); a
 *    WRITE copies into the peer's
 *    memory, which must be a destination the peer granted and has not
 *    seen completed, the peer's keepalive word or a buffer the test
 *    exposed; a WRITE_WITH_IMM also consumes a receive;
 *  - the peer's receive completion and the sender's send completion are
 *    queued apart and delivered when the test says: a send completion may
 *    come long after the peer has processed the message (a late ACK), and
 *    either side's completions may wait while the other side goes on.
 *    What RC fixes stays fixed: each queue completes in order, and a
 *    signaled completion retires every unsignaled request before it;
 *  - a failure: an error completion for a request (the QP goes to error),
 *    or the sock layer's bex__engine_fail. A destroyed QP (RESET) loses
 *    what it had not executed; a request towards a destroyed peer completes
 *    with RETRY_EXC_ERR.
 *
 * It also plays the sock layer (streams, OPEN/CLOSE answers, exposed
 * buffers) and the application (messages whose payload names them), and
 * checks, as the test goes, what the tests' properties rest on:
 *  - credits: a side never has more receive-consuming requests posted than
 *    the peer granted (its hello's recv_depth plus the credits in headers
 *    and immediates delivered to it), and ordinary ones leave the last
 *    credit free;
 *  - the send window: payload bytes posted and not completed never exceed
 *    cfg.send_window (when set);
 *  - every message handed back exactly once, with a status that agrees
 *    with what the NIC did to it (fk_check_final());
 *  - every delivered message whole, in its stream's order, exactly once.
 * A check that fails prints where and exits 1 (the test fails). */
#ifndef BEX_TESTS_FAKE_H
#define BEX_TESTS_FAKE_H

#include <stdbool.h>
#include <stdint.h>

#include "transport/rdma/engine.h"

enum {
    FK_QCAP = 512,      /* requests a queue of the stand-in NIC holds */
    FK_MAX_MSGS = 4096, /* messages of one test */
    FK_MAX_STREAMS = 32,
    FK_MAX_GRANTS = 512,
    FK_MAX_EXPOSED = 256,
    FK_MAX_HELD = 4096, /* received buffers the application holds */
};

/* A request on the wire, executed (awaiting completion) or not. */
struct fk_wr {
    struct ibv_send_wr wr;
    struct ibv_sge sge[2];
    uint32_t payload;   /* send-window bytes (the engine's accounting) */
    struct fk_msg *fin; /* the message this request is the last of */
    enum ibv_wc_status status;
};

struct fk_rwr {
    uint64_t wr_id;
    int num_sge;
    struct ibv_sge sge[2];
};

struct fk_wc {
    struct ibv_wc wc;
    uint16_t credits; /* RECV of a header: the credits it carries */
    bool release;     /* a granted destination given back unwritten */
};

/* One message of the application. */
struct fk_msg {
    struct bex__msg m; /* first: the engine hands this back */
    int from;          /* side 0 or 1 */
    uint32_t stream, seq, idx;
    int done;   /* on_send_done calls */
    int status; /* of the first */
    bool final_posted, final_acked, arrived;
    bool final_inline;        /* its last request went inline: its bytes copied at
                                 posting, so it is done once the peer's engine has
                                 it, before a signaled completion retires it */
    int delivered;            /* on_msg / on_direct calls at the peer */
    int exposed;              /* direct: index in the peer's exposed table, else -1 */
    uint64_t post_bytes_at;   /* its side's payload bytes posted when it was queued */
    uint64_t posted_bytes_at; /* ... and when its last request was posted (before it) */
};

struct fk_stream {
    struct bex__stream st;
    int side;
    uint32_t id;
    bool used, attached, opened, peer_closed, closed_cb, close_asked;
    uint32_t tx_seq, rx_seq; /* next sequence number to send, to receive */
};

struct fk_grant {
    uint64_t addr;
    uint32_t len, imm;
    bool used;
};

struct fk_exposed {
    uint64_t addr;
    uint32_t len, imm;
    struct fk_msg *msg; /* the message meant for it */
    bool used;
};

struct fk_pair;

struct fk_side {
    struct fk_pair *pair;
    int idx;
    struct ibv_context ctx;
    struct ibv_qp qp;
    struct bex__log log;
    struct bex__stats stats;
    struct bex__engine_shared sh;
    struct bex__engine_config cfg;
    struct bex__engine *e;
    bex_mem_pool *pool, *recv_pool, *landing;
    uint64_t ka_addr; /* its keepalive word */

    /* the stand-in NIC: wire [not executed], done [executed, completion
     * not delivered], posted receives, receive completions not delivered */
    struct fk_wr wire[FK_QCAP];
    uint32_t wire_head, wire_n;
    struct fk_wr done[FK_QCAP];
    uint32_t done_head, done_n;
    struct fk_rwr rq[FK_QCAP];
    uint32_t rq_head, rq_n;
    struct fk_wc rcq[FK_QCAP];
    uint32_t rcq_head, rcq_n;
    bool hold_writes;   /* the test keeps RDMA WRITEs of this side on the wire */
    bool fail_next;     /* the next request executed fails (REM_ACCESS_ERR) */
    bool fail_recv;     /* ibv_post_recv fails (ENOBUFS), as long as it is set */
    uint32_t recv_take; /* ... after taking this many of the chain (bad: the next) */
    bool in_send_now;   /* inside bex__engine_send_now (fk_send_now): nothing may
                           be handed back, nor the engine fail */

    /* accounting checked at every post */
    uint64_t consumers_posted; /* SEND + WRITE_WITH_IMM */
    uint64_t credits_granted;  /* peer's recv_depth + credits delivered here */
    uint64_t inflight;         /* payload bytes posted, not completed */
    uint64_t max_inflight;
    uint64_t payload_posted;   /* every payload byte posted (fairness) */
    uint32_t min_credits_left; /* lowest granted - posted seen after a post */
    uint32_t ka_writes;        /* keepalive WRITEs posted (to the peer's word) */
    uint64_t post_calls;       /* ibv_post_send calls (fk_progress's answer) */

    /* the sock layer's side */
    struct fk_stream streams[FK_MAX_STREAMS];
    uint32_t n_streams;
    struct fk_grant grants[FK_MAX_GRANTS]; /* destinations this side granted */
    uint32_t n_grants;
    struct fk_exposed exposed[FK_MAX_EXPOSED]; /* buffers this side exposed */
    uint32_t n_exposed;
    void *held[FK_MAX_HELD]; /* received buffers the application keeps */
    uint32_t n_held;
    bool hold_recv; /* keep received buffers (else free them at once) */
    int fails, fail_err;
    uint32_t delivered, violations;
    uint32_t pending_req_len[FK_MAX_GRANTS]; /* the peer's RNDV_REQ lens by slot */
    uint32_t pending_req_id[FK_MAX_GRANTS];
    uint32_t n_pending_req;
    uint32_t last_req_id; /* id of the last RNDV_REQ this side posted */
    bool x_release;       /* the completion being delivered is a release */
    uint32_t releases;
};

struct fk_pair {
    struct fk_side s[2];
    struct fk_msg *msgs; /* FK_MAX_MSGS */
    uint32_t n_msgs;
    uint64_t clock; /* virtual ms added to the real clock for ticks */
    /* set by a test whose timing is all virtual (keepalive deadlines): its
     * ticks are at clock_base + clock, clock_base the real clock at its
     * first tick, so that time lost to a loaded host does not count
     * against a deadline between two ticks */
    bool virt_clock;
    uint64_t clock_base;
    uint64_t rng;
    bool verbose;
    /* hook: called at every post of a payload-carrying request */
    void (*on_post)(struct fk_pair *p, int side, const struct fk_wr *w, struct fk_msg *m);
    /* hook: called in the upcall of every message delivered (not direct),
     * after it was checked: an answer sent from it is a callback's send */
    void (*on_msg)(struct fk_pair *p, int side, uint32_t stream);
    void *user;
};

/* The failing check's location and text, then exit(1). */
#define FK_CHECK(cond)                                                                             \
    do {                                                                                           \
        if (!(cond))                                                                               \
            fk_fatal(__FILE__, __LINE__, #cond);                                                   \
    } while (0)
void fk_fatal(const char *file, int line, const char *what) __attribute__((noreturn));

/* Default configurations: side 0 is the client (it opens streams). */
void fk_default_config(struct bex__engine_config *cfg);
/* Create both engines with their configurations and connect them (each
 * knows the other's hello), neither started: up to the test. */
void fk_pair_connect(struct fk_pair *p, const struct bex__engine_config *c0,
                     const struct bex__engine_config *c1, uint64_t seed);
/* Create both engines with their configurations, connect and start them. */
void fk_pair_init(struct fk_pair *p, const struct bex__engine_config *c0,
                  const struct bex__engine_config *c1, uint64_t seed);
/* Fail what is still alive, drain, check every message, destroy, check
 * that every pool has its bytes back. */
void fk_pair_fini(struct fk_pair *p);

/* Side 0 opens a stream (the peer attaches its half when OPEN arrives). */
struct fk_stream *fk_open(struct fk_pair *p);
/* The stream of `side` with this id (NULL if none). */
struct fk_stream *fk_stream(struct fk_pair *p, int side, uint32_t id);
/* Queue a message of len bytes (>= 16) on a stream of side st->side.
 * direct: into a buffer the peer exposes for it (no rendezvous). */
struct fk_msg *fk_send(struct fk_pair *p, struct fk_stream *st, uint32_t len, bool direct);
/* The same message (not direct) by bex__engine_send_now, as a socket's send
 * from a callback (bex_sock_send on its I/O thread): it checks that nothing
 * is handed back and the engine does not fail inside that call; a message
 * it refuses goes by bex__engine_send after it, as the sock layer's
 * command would carry it. */
struct fk_msg *fk_send_now(struct fk_pair *p, struct fk_stream *st, uint32_t len);

/* ---- the NIC, one step at a time (each returns whether it did anything) */
/* the I/O thread's progress call (bex__engine_progress_xport): true when
 * it posted anything (what bex__engine_progress answers) */
bool fk_progress(struct fk_pair *p, int side);
bool fk_exec(struct fk_pair *p, int side);     /* execute the head of its wire */
bool fk_send_cqe(struct fk_pair *p, int side); /* deliver its next send completion */
bool fk_recv_cqe(struct fk_pair *p, int side); /* deliver its next receive completion */
void fk_tick(struct fk_pair *p, int side, uint64_t advance_ms);
/* Everything promptly, until nothing moves. */
void fk_quiesce(struct fk_pair *p);
/* n random steps; weights favour progress; completions may lag. */
void fk_random_steps(struct fk_pair *p, uint32_t n);
uint32_t fk_rand(struct fk_pair *p, uint32_t below);

/* ---- as the peer, bypassing its engine (protocol-violation tests) ---- */
/* A WRITE_WITH_IMM with this immediate arrives at `side` (no data). */
void fk_inject_write_imm(struct fk_pair *p, int side, uint32_t imm);
/* A SEND of this header arrives at `side`. */
void fk_inject_hdr(struct fk_pair *p, int side, const struct bex__hdr *h);

/* The application frees what side holds of received buffers. */
void fk_release_held(struct fk_pair *p, int side);
/* Check every message's end against what the NIC did (fk_pair_fini calls
 * it; a test may call it once everything is handed back). */
void fk_check_final(struct fk_pair *p);
bool fk_dead(struct fk_pair *p, int side);

#endif
