/* SPDX-License-Identifier: Apache-2.0 */
/* SRQ mode (bex_ctx_config.srq_depth): one shared receive queue per I/O
 * thread, which every QP of the thread draws on.
 *
 * Credits stay per peer, so that one peer cannot take the receives another
 * peer was promised: an engine arriving on the thread is granted its share
 * (rq_depth credits, its hello's recv_depth) from the thread's pool of
 * srq_depth receives, and gives it back when it goes. The queue always holds
 * at least as many posted receives as the credits its peers hold: the
 * thread posts receives (buffers of the received pool, local access only)
 * as shares are granted, and a receive a peer consumed is charged to that
 * peer (held by its engine) until its engine reposts it and returns the
 * credit, exactly as with a receive queue of its own. A peer whose held
 * receives reach its share has no credit left; a SEND beyond it is a
 * protocol violation and fails its engine. docs/architecture.md has the
 * accounting.
 *
 * Every function is called on the owning I/O thread only, but
 * bex__srq_async (any thread). */
#ifndef BEX_TRANSPORT_RDMA_SRQ_H
#define BEX_TRANSPORT_RDMA_SRQ_H

#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

struct bex__engine;
struct bex__engine_shared;

/* One receive: a buffer of rbuf_len bytes, one SGE. */
struct bex__rslot {
    struct ibv_recv_wr wr;
    struct ibv_sge sge;
    void *buf;
    /* to 64 bytes: a completion's slot is then its index shifted, not
     * multiplied (issue 25 item 2) */
    void *pad_;
};
_Static_assert(sizeof(struct bex__rslot) == 64, "a receive slot is 64 bytes");

/* wr_id of an SRQ receive: engine id 0 (no engine has it: the receive is
 * nobody's until a QP consumes it; wc->qp_num says whose), receive bit,
 * slot index. */
#define BEX__SRQ_WR_RECV  (1u << 31)
#define BEX__SRQ_WR_ID(i) ((uint64_t)(BEX__SRQ_WR_RECV | (i)))

/* Posted receives beyond the credits granted, where the queue has room.
 * A receive a QP took for a multi-packet SEND it never finished is no
 * longer lost (bex__srq_retire); the spare covers a device that neither
 * flushes it nor raises IBV_EVENT_QP_LAST_WQE_REACHED, and QPs destroyed
 * at once when more than srq_depth are draining. */
#define BEX__SRQ_SPARE 32

/* bex_ctx_config.srq_drain_ms's default. */
#define BEX__SRQ_DRAIN_MS 500

/* bex_ctx_config.srq_depth at most (rxe: 32767 CQ entries). */
#define BEX__SRQ_DEPTH_MAX 32768

struct bex__srq_ent {
    uint32_t qpn; /* 0: empty */
    struct bex__engine *e;
};

/* A QP in the error state, waiting for its last receive (bex__srq_retire). */
struct bex__srq_dying {
    struct ibv_qp *qp;
    uint32_t qpn;
    uint64_t until_ms;    /* destroyed then at the latest */
    uint32_t cq_idx, cqe; /* CQ room its engine held (bex__srq_hold_cq) */
};

struct bex__srq {
    struct ibv_srq *srq;
    struct ibv_cq *cq; /* receive CQ of every QP on the queue (the thread's) */
    struct bex__engine_shared *sh;
    uint32_t cap;      /* srq_depth: slots, and the most credits granted at once */
    uint32_t rbuf_len; /* receive buffer bytes, the engines' */
    uint32_t made;     /* slots [0, made) exist */
    struct bex__rslot *slots;
    uint32_t *pool; /* slots neither posted nor held by an engine */
    uint32_t n_pool;
    uint32_t posted; /* receives posted whose completion was not polled (with
                        those staged for the next flush: pend) */
    /* receives engines gave back (bex__srq_post), posted together at the
     * next bex__srq_flush: one ibv_post_srq_recv per poll turn of the
     * thread, not one per engine (cap entries: each slot at most once) */
    uint32_t *pend;
    uint32_t n_pend;
    uint64_t flushes; /* flushes that posted (or failed to post) a chain */
    uint32_t held;    /* consumed receives engines hold (credits not returned) */
    uint32_t granted; /* credits granted to the engines on the queue */
    uint32_t peers;   /* engines on the queue */
    uint32_t said;    /* lines logged once (bex__log_once): SRQ_SAID_FULL */
    /* QP number -> engine, open addressing: a receive completion names
     * the QP, not the engine */
    struct bex__srq_ent *map;
    uint32_t map_cap;
    /* receive completions polled from cq, not yet handed out
     * (bex__srq_next): a ring of cap entries, as many as can be posted */
    struct ibv_wc *wcs;
    uint32_t wc_head, wc_n;
    int cq_err;    /* a poll made by bex__srq_release failed (negative) */
    bool stand_in; /* srq is a stand-in (tests): nothing to destroy */
    /* QPs draining (bex__srq_retire), at most cap */
    struct bex__srq_dying *dying;
    uint32_t n_dying;
    uint32_t drain_ms; /* bex_ctx_config.srq_drain_ms */
    /* QP numbers whose IBV_EVENT_QP_LAST_WQE_REACHED any thread read
     * (bex__srq_async): the one field other threads touch, under last_mu */
    pthread_mutex_t last_mu;
    uint32_t *last_wqe;
    uint32_t n_last;
};

/* Tests only: when non-zero, SRQ mode without per-peer accounting, the
 * design the shares exist to avoid: every peer is granted the whole queue
 * (its hello's recv_depth is srq_depth) and no share is refused
 * (tests/srq/test_srq.c, starve_unshared). */
extern uint32_t bex__srq_unshared_test;

/* The queue of an I/O thread (sh its shared resources: PD, pools, log),
 * depth receives at most, completions on cq. Nothing is posted until a
 * share is granted. */
int bex__srq_create(struct bex__engine_shared *sh, uint32_t depth, uint32_t rbuf_len,
                    struct ibv_cq *cq, struct bex__srq **out);
/* Tests: the same over a stand-in SRQ (its context's post_srq_recv is
 * called) and a stand-in CQ (poll_cq), as bex__engine_create_nodev. */
int bex__srq_create_nodev(struct bex__engine_shared *sh, uint32_t depth, uint32_t rbuf_len,
                          struct ibv_cq *cq, struct ibv_srq *stand_in, struct bex__srq **out);
/* After every QP on it is gone. */
void bex__srq_destroy(struct bex__srq *q);
/* The next receive completion of the queue, into *wc: 1, 0 when there is
 * none, or ibv_poll_cq's negative count (the CQ failed, here or in
 * bex__srq_release). Completions are polled a batch at a time and handed
 * out one at a time: one handed out belongs to a QP on the queue, or to
 * none where ibv_destroy_qp failed (bex__srq_arrived), never to a QP
 * destroyed since it was polled. */
int bex__srq_next(struct bex__srq *q, struct ibv_wc *wc);
/* Grant engine e (QP qpn) a share of credits: enough receives are posted
 * first. -ENOSPC when the pool has fewer than share left, -ENOMEM. */
int bex__srq_grant(struct bex__srq *q, struct bex__engine *e, uint32_t qpn, uint32_t share);
/* The engine of QP qpn left (its QP is destroyed): its share goes back to
 * the pool, and with it the receives it held (slots a[0..na) and b[0..nb):
 * the unposted with their buffers, the starved without) and those whose
 * completions are still to be handed out: the CQ is polled empty first,
 * so that none of them can be taken for a new QP given its number (the
 * others' completions wait for bex__srq_next, in order). Here and below,
 * a receive back in the pool is posted again while fewer are posted than
 * the other peers' credits (and the spare): a peer that sent past its
 * credits took receives that back theirs. */
void bex__srq_release(struct bex__srq *q, uint32_t qpn, uint32_t share, const uint32_t *a,
                      uint32_t na, const uint32_t *b, uint32_t nb);
/* A receive of slot idx completed on QP qpn: its engine, which now holds
 * it (NULL: the QP is gone, and the slot went back to the pool). */
struct bex__engine *bex__srq_arrived(struct bex__srq *q, uint32_t idx, uint32_t qpn);
/* Receives an engine held go back to the queue (their credits to its
 * peer): staged for the thread's next bex__srq_flush, so that the reposts
 * of every engine served in one poll turn take one ibv_post_srq_recv.
 * They count as posted from now on. Returns the flush count they wait for
 * (bex__srq_flushed: a credit must not leave before its receive is
 * posted, so an engine flushes before its next send if it is not there
 * yet). */
uint64_t bex__srq_post(struct bex__srq *q, const uint32_t *idx, uint32_t n);
/* Post the staged receives in one chain. Where the post fails they go back
 * to the pool and the queue fails as a CQ does (bex__srq_next returns the
 * error: the I/O thread fails every engine on it, whose peers may hold
 * credits those receives were to back). */
void bex__srq_flush(struct bex__srq *q);
/* Whether the receives staged at flush count want are posted (or failed). */
static inline bool bex__srq_flushed(const struct bex__srq *q, uint64_t want)
{
    return q->flushes >= want;
}
/* A held receive goes back to the pool unposted (its engine failed on it). */
void bex__srq_return(struct bex__srq *q, uint32_t idx);

/* The QP of an engine that fails or goes (before bex__srq_release): the
 * queue takes it over. A QP destroyed at once loses the receive it took
 * for a SEND half received: it never completes, and the queue stays one
 * short for good (tests/srq/test_srq_dying.c). So the QP goes to the error
 * state, which flushes that receive (its completion finds no engine and
 * the receive goes back to the pool, posted again), and is destroyed once
 * the device says its last receive is done (IBV_EVENT_QP_LAST_WQE_REACHED,
 * bex__srq_async) or drain_ms later (rxe on Linux 6.1 flushes, but raises
 * no event: docs/architecture.md); its completions are then taken out of
 * the CQ as in bex__srq_release. At most cap QPs drain at once; beyond
 * that, and where the error state cannot be set, it is destroyed at once. */
void bex__srq_retire(struct bex__srq *q, struct ibv_qp *qp);
/* The connection of draining QP qpn is freed: the room its engine held in
 * the I/O thread's CQ cq_idx (cqe entries) stays held until the QP is
 * destroyed, for the sends the error state flushes there. false: qpn is
 * not draining (the caller gives the room back). */
bool bex__srq_hold_cq(struct bex__srq *q, uint32_t qpn, uint32_t cq_idx, uint32_t cqe);
/* Destroy the draining QPs whose time has come (all: at_exit), handing
 * the CQ room they held to cq_back (may be NULL); whether any still
 * drains. */
bool bex__srq_reap(struct bex__srq *q, uint64_t now_ms, bool at_exit,
                   void (*cq_back)(void *arg, uint32_t cq_idx, uint32_t cqe), void *arg);
/* An async event of the device, read by any thread: a LAST_WQE_REACHED of
 * a draining QP is handed to the queue that owns it (qp_context). The
 * event is not acknowledged here. */
void bex__srq_async(const struct ibv_async_event *ev);

#endif
