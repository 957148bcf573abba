/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA engine's private header: its structures and the functions its
 * files share (engine.c, and the files split from it along its banners).
 * Nothing outside src/transport/rdma/ includes it; the contract is
 * engine.h. */
#ifndef BEX_TRANSPORT_RDMA_ENGINE_INTERNAL_H
#define BEX_TRANSPORT_RDMA_ENGINE_INTERNAL_H

#include <assert.h>
#include <errno.h>

#include "mem/lookup.h"
#include "transport/rdma/engine.h"
#include "transport/rdma/srq.h"
#include "transport/stream.h"

#define CTLQ_EXTRA  8
#define KA_PAGE     4096
#define SPARE_MAX   4          /* window mode: destinations bound ahead, per engine */
#define SPARE_BYTES (8u << 20) /* ... and their bytes at most */

/* wr_id low 32 bits: bit 31 receive, the rest a counter/index */
#define WR_RECV     (1u << 31)
#define WR_CNT_MASK ((1u << 30) - 1)

/* Send counters start this far below their wrap, so that every engine
 * crosses 2^32 within its first few hundred work requests and a slot
 * mapping that breaks there is caught by any test (cf. Linux' jiffies). */
#define SEND_CNT_START (0u - 256u)

/* How a message handed back ended (the contract is in bex/sock.h):
 * UNSENT: the peer never delivers it (no final work request was posted);
 * INDOUBT: its final work request was posted but never completed. */
#define ST_UNSENT  (-ECANCELED)
#define ST_INDOUBT (-EIO)

/* Engine states (docs/architecture.md): INIT -> CONNECTED
 * (bex__engine_connect) -> UP (bex__engine_start) -> DEAD (bex__engine_fail,
 * from any state; synchronous: the QP is destroyed and everything handed
 * back before on_fail returns). Only bex__engine_move changes it. */
enum bex__engine_state { E_INIT, E_CONNECTED, E_UP, E_DEAD };

struct sslot {
    struct ibv_send_wr wr;
    struct ibv_sge sge[BEX__SEG_MAX + 1]; /* a header and a gathered message's buffers */
    struct bex__msg *done;                /* message finished by this request */
    struct bex__stream *closed;           /* stream whose CLOSE this is */
    uint32_t bytes;                       /* payload bytes (send window) */
    uint32_t batch_bytes;                 /* adaptive window: post_us's batch's payload
                                             bytes (beside bytes: the slot is 256 bytes,
                                             sslot_at's index a shift) */
    uint8_t *hdr;                         /* this slot's header buffer */
    struct ibv_mw *free_mw;               /* window to deallocate once this LOCAL_INV is done */
    uint64_t post_us;                     /* adaptive window: the batch this slot ends was
                                             posted then (0: no sample) */
};

/* One buffer per receive (struct bex__rslot, srq.h): a DATA's payload lands
 * at its start (the header is in the immediate), a control message's header
 * fills its first bytes. In SRQ mode the slots are the shared queue's. */
_Static_assert(BEX__SRQ_WR_RECV == WR_RECV, "SRQ receives are receives");
#define NO_SLOT UINT32_MAX

struct rndv_in {
    void *buf; /* NULL while the request waits for room (deferred) */
    uint32_t len, stream;
    uint32_t req_id; /* the sender's id, echoed in the answer */
    uint16_t gen;
    bool used;
    bool granted; /* its RNDV_RESP was posted: the peer may complete it */
    /* when the tick first saw it granted, and for which use (gen | 0x8000;
     * any other value: not seen yet): grants_stalled */
    uint64_t granted_ms;
    uint16_t granted_gen;
    /* window mode: the window of this slot's current transfer (a fresh
     * one per transfer, deallocated on delivery) */
    struct ibv_mw *mw;
    uint32_t key; /* the key of its current binding */
    bool bound;   /* bound (bind posted or queued) and not invalidated */
};

/* Window mode: a bind or an invalidation waiting for a send slot. They go
 * out in order, ahead of control messages, so a window is bound before the
 * answer naming it leaves, and invalidated before the slot is reused. */
struct wop {
    struct ibv_mw *mw;
    void *addr;
    uint32_t rkey, len;
    bool inv;     /* LOCAL_INV of rkey; else BIND_MW to rkey */
    bool dealloc; /* after the invalidation, deallocate the window */
};

/* A request of ours. used with m == NULL: its message was handed back
 * (stream flushed) while the answer was on its way; the answer frees it. */
struct rndv_out {
    struct bex__msg *m;
    uint64_t sent_ms; /* when the request went out: its answer is due */
    uint16_t gen;
    bool used;
};

/* A destination the peer granted that we give back unwritten: a
 * zero-length WRITE_WITH_IMM naming it frees the peer's slot. */
struct rndv_rel {
    uint64_t addr;
    uint32_t rkey, imm;
};

struct bex__engine {
    struct bex__xport x; /* first: what the connection holds */
    struct bex__engine_shared *sh;
    struct bex__stats *stats; /* sh->stats, one load nearer (the counters, once a message) */
    struct bex__engine_config cfg;
    const struct bex__transport_upcalls *ops;
    uint32_t id;
    void *user;
    struct ibv_qp *qp;
    bool nodev; /* qp is a stand-in: bex__engine_create_nodev */
    uint32_t psn;
    enum bex__engine_state state;

    /* send chain: counters grow and wrap; slot = counter & (sq - 1), sq a
     * power of two, so the mapping stays continuous across the wrap */
    struct sslot *ss;
    uint32_t sq, head, post, tail;
    /* Selective signaling across chains (bex__engine_post_pending): a chain
     * of SENDs that read no memory of the caller's after posting (inline
     * payloads, the slots' own headers) goes unsignaled, retired by the
     * next signaled completion, as long as fewer than sq / 4 requests are
     * unretired. sig_end: tail after the last signaled chain (none
     * pending once head reaches it); sig_force: the tick found unretired
     * requests and nothing signaled pending (the next chain is signaled,
     * and a keepalive write goes at the next tick if none came);
     * dscan: the first posted slot not yet looked at for a message the
     * peer acknowledged before its request was retired (acks_in). */
    uint32_t sig_end, dscan;
    uint32_t quiet_max; /* sq / 4, or 0 when a send window, a destination's
                           bound or window mode needs every chain signaled */
    bool sig_force;
    bool chain_loud; /* a request prepared since the last post must be
                        signaled (post_pending): no SEND, or one that reads
                        the caller's memory after posting, or a CLOSE */
    uint32_t peer_credits, to_return;
    uint32_t peer_rq;           /* credits the peer granted in its hello */
    uint32_t inflight;          /* payload bytes posted, not completed */
    struct bex__wnd wnd;        /* adaptive send window (sendwnd.c) */
    struct bex__wnd_dest *dest; /* its destination's shared bound (NULL: none) */
    uint32_t peer_eager;        /* largest message the peer takes by SEND */
    uint32_t peer_max_msg;      /* largest message the peer accepts at all */
    uint32_t eager_lim;         /* the two's least: the largest a lone message sent
                                   at once may be (send.c, send_now) */
    uint32_t frag;              /* effective fragment size */
    uint64_t credit_wait;       /* since when sends wait for a credit (0: none wait) */
    uint64_t post_wait_ms;      /* the tick that first saw the oldest posted work
                                   request (post_mark) not completed (0: none seen) */
    uint32_t post_mark;         /* head at post_wait_ms */
    /* Delivery reports (include/bex/sock.h: 0 means the peer's engine holds
     * the message). Every SEND and WRITE_WITH_IMM takes one of the peer's
     * receives, in order, and the peer returns a credit only for a receive
     * its engine has handled and posted again: so once the credits returned
     * reach a message's last work request, the peer's engine has it. */
    uint32_t cons_sent;                   /* work requests posted that take a peer receive */
    uint32_t cons_acked;                  /* credits the peer returned, summed */
    struct bex__msg *ack_head, *ack_tail; /* completed by the NIC, not yet
                                             acknowledged, in order */
    uint64_t ack_wait_ms;                 /* the tick that first saw that queue wait with
                                             cons_acked at ack_mark (0: none seen) */
    uint32_t ack_mark;
    bool acks_owed;    /* we handled a peer's message whose credit it does
                          not have yet: it waits for it to report it */
    uint64_t ack_held; /* bex__now_us() when owed credits were first held
                          back for a message to carry them (0: not held) */

    /* receive side: rq credits granted, rslots = rq + spare receives of
     * our own (spare: bex__engine_rq_spare; 0 in SRQ mode). The spare
     * ones let a consumed receive's credit go back before it is posted
     * again, so that reposts go in chains rather than one ibv_post_recv a
     * message (bex__engine_repost_recvs): slack, the receives posted
     * beyond the credits the peer holds or will be sent, pays for them,
     * and n_credited of the unposted slots (their first ones) have had
     * their credit returned so. */
    struct bex__rslot *rs;
    uint32_t rq, k, rslots, slack, n_credited;
    uint32_t rbuf_len;    /* receive buffer bytes: eager_max, at least a header */
    uint32_t recv_max;    /* the largest DATA a SEND may bring: eager_max and max_msg's least */
    uint32_t rbuf_usable; /* their usable size (one size class: the same for
                             all), known after the first (0: not yet) */
    /* the I/O thread's bin of their class in the receive pool, where a
     * consumed receive's fresh buffer comes from (bex__mem_bin_none: not
     * taken yet, or the pool has none; bex_mem_alloc then): never NULL, so
     * that the refill's one test is the bin's own emptiness */
    struct bex__mem_bin *rbin;
    uint32_t *unposted; /* consumed receive slots awaiting repost */
    uint32_t n_unposted;
    /* a repost that failed inside a direct send (bex__engine_send_now),
     * which must not fail the engine (transport.h's send_now): the error,
     * with which the next bex__engine_progress (the send marked the
     * connection for it) or repost fails it (0: none) */
    int repost_err;
    /* nonzero while any of the conditions that keep a message from going
     * alone holds (bex__engine_alone_sync): the engine not up, window
     * operations queued or posted, a keepalive due, control messages or
     * releases queued, a failed repost, every chain signaled (quiet_max
     * 0: a send window, a destination's bound or window mode). One word
     * for send.c's lone tests (the direct send's and the progress
     * call's), where the eight were loaded and tested in each (issue 25
     * item 2). */
    uint32_t not_alone;
    uint32_t *starved; /* consumed slots whose buffer went up, not yet replaced
                          (the context's received bytes are at their limit) */
    uint32_t n_starved;
    /* SRQ mode (sh->srq): rs is NULL, unposted and starved name slots of
     * the shared queue that the peer consumed (charged to it until
     * reposted), rq is its share of the queue */
    bool srq_in;       /* holds a share (granted, not yet released) */
    uint64_t srq_wait; /* the shared queue's flush its reposts wait for
                          (bex__srq_post): flushed before the next send */
    uint32_t qpn;      /* its QP's number, the key of the queue's map */
    uint32_t srq_cur;  /* the slot whose completion is being handled, until
                          it is held (NO_SLOT otherwise) */
    uint8_t *hdr_area; /* sq headers, general pool (no remote access) */
    uint32_t hdr_lkey;
    uint32_t max_inline; /* the QP's inline bytes: smaller DATA payloads go inline */
    uint32_t max_sge;    /* the QP's send SGEs (<= BEX__SEG_MAX + 1, the device's max_sge) */

    /* control messages waiting for a slot (RNDV_RESP, refusing CLOSE) */
    struct bex__hdr *ctlq;
    uint32_t ctl_cap, ctl_head, ctl_n;
    uint32_t ctl_errs;     /* of which: RNDV_RESP with an error (no slot held) */
    uint32_t ctl_refusals; /* of which: CLOSE refusing an OPEN */

    /* window operations waiting for a slot (window mode) */
    struct wop *wq;
    uint32_t wq_cap, wq_head, wq_n;
    bool wop_busy; /* a chain of window operations is posted, not completed */
    /* exposed buffers' windows bound here: the engine deallocates them if
     * it fails, before its QP goes (see release_windows) */
    struct ibv_mw **xw;
    uint32_t xw_n, xw_cap;
    /* destinations bound ahead, while the send queue was idle, for the
     * next rendezvous requests of spare_want bytes (see spare_fill) */
    struct spare {
        void *buf;
        struct ibv_mw *mw;
        uint32_t key, len;
    } spare[SPARE_MAX];
    uint32_t spare_n;
    uint32_t spare_want;  /* the last rendezvous length asked of us */
    uint64_t spare_bytes; /* their buffers' lengths, summed */

    /* rendezvous */
    uint32_t max_rndv;       /* our table sizes */
    uint32_t peer_max_rndv;  /* the peer's incoming table */
    uint32_t peer_rndv_used; /* peer slots we hold: asked, granted, not yet
                                written or released */
    struct rndv_in *rin;
    struct rndv_out *rout;
    uint32_t rout_used;
    struct rndv_rel *relq; /* releases waiting for a slot and a credit */
    uint32_t rel_head, rel_n;
    uint32_t rin_used;  /* slots held: answered or deferred */
    uint64_t rin_bytes; /* destination bytes allocated, not yet delivered */
    uint32_t *rin_wait; /* deferred requests' slots, oldest first (a ring) */
    uint32_t wait_head, wait_n;
    uint32_t rin_done; /* destinations written (delivered) */
    uint32_t rin_done_seen;
    uint64_t rin_done_ms; /* the tick that first saw rin_done at its value */
    bool holding;         /* counted in the context's holders (rin_bytes > 0) */

    /* streams */
    struct bex__stream_set streams; /* every stream, and the scheduler ring */

    /* keepalive */
    volatile uint64_t *ka_local; /* the peer writes its sequence here: a page of
                                    its own, the only bytes ka_mr covers */
    struct ibv_mr *ka_mr;
    uint64_t ka_seen, ka_seq, ka_last_ms, ka_next_ms;
    bool ka_due;     /* a keepalive write waits for a slot */
    bool peer_heard; /* a receive completed since the last tick */
    bool peer_hears; /* we posted a SEND or WRITE_WITH_IMM since the last tick: the
                        peer hears from us (a receive of its completes), so no
                        keepalive write is due for keepalive_ms */
    uint64_t peer_ka_addr;
    uint32_t peer_ka_rkey;
    uint32_t said;    /* lines logged once (bex__log_once): BEX__SAID_VIOLATION */
    int stream_fault; /* a peer's CLOSE a stream's state does not take (-EPROTO) */
    char name[48];    /* how log lines name the connection (bex__engine_set_name) */
};

/* The one place e's state changes: names the move in the debug log and
 * asserts it is one our code may make (INIT -> CONNECTED -> UP, any but
 * DEAD -> DEAD); what a peer does out of turn is checked before (a
 * violation, which fails the engine). */
void bex__engine_move(struct bex__engine *e, enum bex__engine_state to);
const char *bex__engine_state_name(enum bex__engine_state s);

static inline uint64_t wrid(const struct bex__engine *e, uint32_t low)
{
    return ((uint64_t)e->id << 32) | low;
}

static inline struct sslot *sslot_at(const struct bex__engine *e, uint32_t c)
{
    return &e->ss[c & (e->sq - 1)];
}

/* ---- functions shared by the module's files ---- */
void bex__engine_recv_free(struct bex__engine *e, void *b);
void bex__engine_srq_leave(struct bex__engine *e);
int bex__engine_nodev_to(struct bex__engine *e, enum ibv_qp_state s);
void bex__engine_release_windows(struct bex__engine *e);
void bex__engine_post_pending(struct bex__engine *e);
void bex__engine_repost_recvs(struct bex__engine *e);
void bex__engine_prep_keepalive(struct bex__engine *e);
bool bex__engine_wops_hold(struct bex__engine *e);
void bex__engine_hold_sync(struct bex__engine *e);
int bex__engine_rndv_resume(struct bex__engine *e);
void bex__engine_refill_starved(struct bex__engine *e);
__attribute__((format(printf, 2, 3))) int bex__engine_violation(struct bex__engine *e,
                                                                const char *fmt, ...);
bool bex__engine_busy(const struct bex__engine *e);
bool bex__engine_work(const struct bex__engine *e);
/* The posted send request of counter cnt (masked by WR_CNT_MASK), for a
 * log line: its operation, length and place in the queue. */
void bex__engine_describe_send(struct bex__engine *e, uint32_t cnt, char *out, size_t n);
void bex__engine_fail_now(struct bex__engine *e, int err);
void *bex__engine_recv_alloc(struct bex__engine *e, bex_mem_pool *pool, size_t len);
void bex__engine_slot_set_buf(struct bex__engine *e, struct bex__rslot *r, void *buf);
void bex__engine_hold_starved(struct bex__engine *e, uint32_t idx);
void bex__engine_queue_release(struct bex__engine *e, uint64_t addr, uint32_t rkey, uint32_t imm);
void bex__engine_finish_stream(struct bex__engine *e, struct bex__stream *st);
void bex__engine_rin_unbind(struct bex__engine *e, struct rndv_in *in);
int bex__engine_rndv_request(struct bex__engine *e, const struct bex__hdr *h);
int bex__engine_queue_ctl(struct bex__engine *e, const struct bex__hdr *h);
_Atomic int32_t *bex__engine_holders(struct bex__engine *e);
bex_mem_pool *bex__engine_rndv_pool(struct bex__engine_shared *sh);
int bex__engine_wop_push(struct bex__engine *e, const struct wop *w);
void bex__engine_spare_drop(struct bex__engine *e);
bool bex__engine_spare_has(struct bex__engine *e, uint32_t len);
bool bex__engine_spare_take(struct bex__engine *e, uint32_t len, struct spare *out);
void bex__engine_prep_wops(struct bex__engine *e);
bool bex__engine_spare_fill(struct bex__engine *e);
struct sslot *bex__engine_slot_take(struct bex__engine *e);
void *bex__engine_slot_take_buf(struct bex__engine *e, struct bex__rslot *r);
/* sendwnd.c: the send window (static or adaptive) and the destination's
 * bound: take (false: wait; counted as window_stalls or dest_bound_hits),
 * give back, and the adaptive controller's samples. */
void bex__engine_wnd_init(struct bex__engine *e);
void bex__engine_wnd_fini(struct bex__engine *e);
uint32_t bex__engine_window(const struct bex__engine *e);
bool bex__engine_window_take(struct bex__engine *e, uint32_t bytes);
void bex__engine_wnd_posted(struct bex__engine *e, struct sslot *s, uint32_t bytes);
void bex__engine_wnd_completed(struct bex__engine *e, struct sslot *s);

/* ---- the per-message path's one-liners, inline (issue 25: each was a
 * call between the module's files, some ten of them a message) ---- */

static inline uint32_t bex__engine_free_slots(const struct bex__engine *e)
{
    return e->sq - (e->tail - e->head);
}

/* Credits: ordinary SENDs leave one credit for a CREDIT message, so that two
 * peers that have used up each other's receives can always tell each other
 * about reposted ones. */
static inline bool bex__engine_have_credit(const struct bex__engine *e, bool credit_msg)
{
    return e->peer_credits > (credit_msg ? 0u : 1u);
}

static inline bool bex__engine_recv_room(struct bex__engine *e, uint64_t want)
{
    return bex__recv_room(e->sh, want);
}

/* The usable bytes of buf, a receive buffer (rbuf_len bytes from the
 * receive pool): looked up once, the same for every one. */
static inline int64_t bex__engine_rbuf_usable(struct bex__engine *e, const void *buf)
{
    if (!e->rbuf_usable)
        e->rbuf_usable = (uint32_t)bex_mem_usable_size(buf);
    assert(bex_mem_usable_size(buf) == e->rbuf_usable);
    return e->rbuf_usable;
}

/* Slot r takes buf (a block's start, bex_mem_alloc's: its region inline)
 * in place of old, the buffer whose key r's SGE holds (NULL: none); its
 * SGE's length is rbuf_len already (bex__engine_slot_set_buf's, the shared
 * queue's bex__srq_create's, which is the same: engine.c), so a refill
 * stores none (issue 25 item 2). That
 * key is buf's too when both lie in one 4 MiB slot of the address space
 * (one mapping's: its header, region and key are found from the slot's
 * start, mem/lookup.h), as a refill's blocks of one class mostly do: it is
 * looked up only when they differ. NULL differs from every block (a
 * mapping's header starts its slot, and no mapping starts at address 0). */
static inline void bex__engine_slot_put(struct bex__engine *e, struct bex__rslot *r, void *buf,
                                        const void *old)
{
    r->buf = buf;
    r->sge.addr = (uintptr_t)buf;
    assert(r->sge.length == e->rbuf_len);
    (void)e; /* (the assert's) */
    if (((uintptr_t)buf ^ (uintptr_t)old) >> BEX__MEM_LOOKUP_SHIFT)
        r->sge.lkey = bex__mem_block_mr(buf)->lkey;
    assert(r->sge.lkey == bex__mem_block_mr(buf)->lkey);
}

/* Receive slot idx: the engine's own, or in SRQ mode the shared queue's. */
static inline struct bex__rslot *bex__engine_rslot_at(struct bex__engine *e, uint32_t idx)
{
    return e->sh->srq ? &e->sh->srq->slots[idx] : &e->rs[idx];
}

/* A consumed receive is kept for reposting (with its buffer) or starved
 * (without): in SRQ mode the slot is the engine's charge from now on. Its
 * completion's (srq_cur is idx then, or NO_SLOT with the engine's own
 * slots): a store where a test was (issue 25 item 2). */
static inline void bex__engine_hold_unposted(struct bex__engine *e, uint32_t idx)
{
    assert(idx == e->srq_cur || e->srq_cur == NO_SLOT);
    e->unposted[e->n_unposted++] = idx;
    e->srq_cur = NO_SLOT;
}

/* Receives consumed and handled whose credits are not yet returned go
 * back at once while the spare receives cover them (slack) and fewer than
 * k wait to be posted: true when they did (bex__engine_repost_recvs). */
static inline bool bex__engine_credit_from_slack(struct bex__engine *e)
{
    uint32_t fresh = e->n_unposted - e->n_credited; /* credits not yet returned */
    if (fresh > e->slack || e->n_unposted >= e->k)
        return false;
    e->slack -= fresh;
    e->n_credited = e->n_unposted;
    e->to_return += fresh;
    return true;
}

/* e->not_alone again from the conditions it stands for: called by every
 * line that changes one of them (state, wq_n, wop_busy, ka_due, ctl_n,
 * rel_n, repost_err, quiet_max; after a loop that counts one down, once),
 * so that it is never zero while one holds. Those lines are on the
 * general ways only (the ping-pong's messages change none of them).
 * Window mode (sh->windows, the context's from its creation on) sets
 * quiet_max 0 for the engine's life (engine.c's engine_init), so the word
 * covers it too. */
static inline uint32_t bex__engine_alone_word(const struct bex__engine *e)
{
    return (uint32_t)(e->state != E_UP) | e->wq_n | (uint32_t)e->wop_busy | (uint32_t)e->ka_due |
           e->ctl_n | e->rel_n | (uint32_t)e->repost_err | (uint32_t)(e->quiet_max == 0);
}
static inline void bex__engine_alone_sync(struct bex__engine *e)
{
    e->not_alone = bex__engine_alone_word(e);
}

/* Whether the peer waits for credits we have not returned: of receives
 * we handled (acks_owed) and hold unposted, not yet credited from the
 * slack. Whatever we send next must carry them. */
static inline bool bex__engine_credit_owed(const struct bex__engine *e)
{
    return e->acks_owed && e->n_unposted != e->n_credited;
}

/* The peer waits for the credits of receives we handled (acks_owed) to
 * report its messages: those not yet returned go back now (credited from
 * the slack, or the receives posted again), so that whatever we send next
 * carries them. False: the repost failed the engine. */
static inline bool bex__engine_return_owed(struct bex__engine *e)
{
    if (!bex__engine_credit_owed(e))
        return true;
    /* bex__engine_repost_recvs's first case, without the call */
    if (bex__engine_credit_from_slack(e))
        return true;
    bex__engine_repost_recvs(e);
    return e->state == E_UP;
}

/* m is handed back with status (0: delivered; the contract is in
 * bex/sock.h): inline, once a message. */
static inline void bex__engine_msg_done(struct bex__engine *e, struct bex__msg *m, int status)
{
    e->ops->on_send_done(&e->x, m, status);
}

/* Bytes the engine no longer has in flight (completed or abandoned). */
static inline void bex__engine_window_give(struct bex__engine *e, uint32_t bytes)
{
    if (e->dest && bytes)
        bex__wnd_dest_give(e->dest, bytes);
}

#endif
