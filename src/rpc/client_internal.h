/* SPDX-License-Identifier: Apache-2.0 */
/* The RPC client's private header: a channel, its endpoints, links, calls
 * and attempts with a destination, shared by the files of the client
 * (client.c, call.c, ladder.c, xatt.c, client_io.c, client_timer.c). */
#ifndef BEX_RPC_CLIENT_INTERNAL_H
#define BEX_RPC_CLIENT_INTERNAL_H

#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "bex/rpc.h"
#include "common/hash.h"
#include "common/list.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"

/* A link's life: CONNECTING -> UP -> FAILED or CONNECTING -> FAILED;
 * FAILED is final (its socket is closing, the link goes at its on_close).
 * Changed only by bex__rpc_link_move. */
enum link_state { L_CONNECTING, L_UP, L_FAILED };

/* Freed calls a channel keeps for its next ones (a synchronous Fetch over
 * S shards has S out at once). */
#define BEX__RPC_CALL_SPARE 64

/* Lines a link logs once (l->said, bex__log_first). MALFORMED also means
 * the link was refused: what else it brings is dropped. */
enum { LINK_SAID_MALFORMED = 1u << 0 };

/* A call's life: LIVE (an attempt out, or being chosen) <-> WAITING (the
 * next attempt waits for the last one's destination to be retired), then
 * PARKED (completed; the completion waits for that retirement) or DONE
 * (completed; the completion queued or run), PARKED -> DONE. Changed only
 * by bex__rpc_call_move. */
enum call_state { CALL_LIVE, CALL_WAITING, CALL_PARKED, CALL_DONE };

/* An attempt's socket's life (struct xatt): PROBING (connecting, or up at
 * step 1 or 2 of the ladder and not answered over yet: counted in its
 * endpoint's xprobing) -> OPEN (answered over, or up at step OK) ->
 * CLOSING (bex__rpc_xatt_end closed its socket) -> CLOSED (its on_close:
 * freed right after); PROBING -> CLOSING too (failed, or ended before an
 * answer). Changed only by xatt_move (xatt.c). */
enum xatt_state { XA_PROBING, XA_OPEN, XA_CLOSING, XA_CLOSED };

/* One socket to an endpoint; lives until its bex__rpc_on_close. */
struct link {
    struct bex_rpc_channel *ch;
    struct endpoint *ep;
    bex_sock *s;
    enum link_state state;
    uint64_t t_start; /* connect started (ns) */
    uint32_t said;    /* LINK_SAID_* (under ch->mu) */
    /* recovery ladder */
    int rung;               /* the endpoint's step when this link was made */
    bool tcp;               /* made over TCP by the ladder (step 3) */
    bool proven;            /* an answer came over it */
    bool ping;              /* made by the ladder: a ping went first, to be answered within
                               probe_ns of the connection coming up (t_start then) */
    bool probe;             /* step 3's RDMA retry: carries the ping, no call, until proven */
    bool retiring;          /* replaced by a restored RDMA link: closed once no call is on it */
    uint64_t gen;           /* the endpoint's fail_gen when this link was made */
    struct bex__list lnode; /* the channel's links */
};

/* An endpoint of the channel's list. The list is its own abstraction so
 * that a directory (issue 9 item 2) and quarantine (item 6) can replace
 * (bex_rpc_channel_set_endpoints) or filter it. Referenced by the list and
 * by each of its links, so that one removed from the list lives until its
 * last link's bex__rpc_on_close. */
struct endpoint {
    bex_addr addr;
    char *locality;
    uint32_t transport;
    int refs;
    uint64_t attempts, answers, failures, conn_failures; /* bex_rpc_endpoint_stats */
    struct link *cur;           /* the live link, or NULL: made on first use */
    uint64_t down_until;        /* ns: avoided until then after a failure */
    bool suspect;               /* failed, and no connection came up since */
    struct bex__dir_node *node; /* directory mode: its node (outcomes go there) */
    struct endpoint *dnext;     /* directory mode: the channel's endpoints so far */
    /* recovery ladder: its step (BEX_RPC_LADDER_*), when step 3 tries
     * RDMA again, the probe doing it */
    int rung;
    uint64_t rdma_retry_at;
    struct link *probe;
    uint64_t tcp_answers;
    /* connection failures counted so far, and whether the last one took a
     * ladder step: a socket made before it (fail_gen then lower) was on
     * that connection, so its own report of the failure is not counted
     * again (bex__rpc_ep_conn_failed) */
    uint64_t fail_gen;
    bool fail_stepped;
    uint32_t xprobing; /* attempts with a destination probing it (an xatt PROBING) */
    uint64_t bit;      /* its bit in a call's refused set (ep_bit: given on first use) */
};

/* completion kinds, for the counters */
enum { K_OK, K_TIMEOUT, K_CONN, K_REMOTE, K_CANCEL };

struct call {
    uint64_t id;
    uint32_t service, method, flags;
    uint8_t *msg; /* header + body, one bemalloc buffer */
    size_t len;
    bex_rpc_done_fn done;
    void *user;
    uint64_t t_start, deadline, attempt_deadline; /* ns; attempt_deadline 0: none */
    uint32_t attempts;
    uint32_t moves; /* attempts the recovery ladder made (not counted
                       against max_attempts nor the budget) */
    /* Attempts refused before their request was sent (provably not
     * executed): their endpoints' bits (the set, ep_bit; two endpoints may
     * share one, which only counts an attempt more), and the retries that
     * followed an endpoint's first refusal, not counted against
     * max_attempts nor the budget. refused_new: the attempt that just
     * failed was such a first refusal (set by bex__rpc_start_attempt and
     * bex__rpc_link_fail_ex, read and cleared by
     * bex__rpc_attempt_failed_ex, which each of them calls next). */
    uint64_t refused;
    uint32_t unsent;
    bool refused_new;
    struct link *link; /* the current attempt's */
    /* an earlier attempt still out beside the current one (a link's that
     * passed attempt_timeout_ms and was retried on another link): when
     * the later attempts come to nothing, the call waits for its answer
     * instead of failing (NULL: none; cleared when its link fails,
     * answers the call or fails a send of it) */
    struct link *held;
    struct endpoint *ep;      /* the current attempt's */
    struct endpoint *counted; /* directory mode: outstanding on this one's node */
    int refs;                 /* 1 while live or its completion runs, + 1 per send out */
    enum call_state state;
    bool in_doubt; /* an attempt's send came back -EIO: it may have been handled */
    int status;
    void *resp;
    size_t resp_len;
    /* bex_rpc_call_into: the caller's destination (a body pointer, header
     * room in front, landing memory), its attempt's socket, and what waits
     * for the destination's retirement (the transport no longer writing
     * it): the completion (PARKED) or the next attempt (WAITING) */
    uint8_t *dst;
    size_t cap;
    struct xatt *xa;
    struct bex__rpc_borrow borrow; /* release set: the body is the caller's */
    struct bex__list lnode;        /* the channel's live calls */
    struct call *dnext;            /* completions to run; the channel's spares */
    /* the first attempt's send descriptor (bex_sock_send_req), so that a
     * call allocates none; a retry's send, which may start while this one
     * is out, takes one of bex's */
    bool sreq_used;
    bex_send_req sreq;
};

/* An attempt of a call with a destination (bex_rpc_call_into): a socket
 * of its own on the endpoint's connection, so that ending the attempt
 * (closing it) retires the destination's exposure without touching the
 * channel's other calls: the socket layer hands an exposed buffer back
 * only once the peer can write it no more. Holds a reference to its call
 * until its bex__rpc_on_close. */
struct xatt {
    struct bex_rpc_channel *ch;
    struct call *c;
    struct endpoint *ep;
    bex_sock *s;
    enum xatt_state state;
    /* the destination is exposed on s: not retired. Beside the state, not
     * part of it: set while PROBING or OPEN, an exposure outlives them into
     * CLOSING and is back (false) before CLOSED */
    bool armed;
    char dest_tag; /* msg_user of the DEST message */
    /* as a link's: the endpoint's step when made, over the ladder's TCP
     * fallback or not, the endpoint's fail_gen then */
    int rung;
    bool tcp;
    uint64_t gen;
};

/* xa's socket is not closing: its attempt may still be answered over it. */
static inline bool bex__rpc_xatt_live(const struct xatt *xa)
{
    return xa->state == XA_PROBING || xa->state == XA_OPEN;
}

struct bex_rpc_channel {
    bex_ctx *ctx;
    struct bex__log *log;
    char *name;
    uint64_t tr_ns, tc_ns, attempt_ns, holddown_ns, rdma_retry_ns, probe_ns;
    uint32_t max_attempts, retry_permille, budget_permille, budget_burst;
    struct endpoint **eps;
    size_t n_eps, rr;
    uint32_t next_bit; /* the next endpoint's bit (ep_bit), mod 64 */
    /* directory mode (eps NULL): replicas of (service, shard) in dir,
     * chosen per attempt (src/rpc/dir.c); an endpoint is made for each
     * node the first time it is chosen */
    bex_dir *dir;
    char *service, *locality;
    uint32_t shard;
    struct endpoint *deps;
    uint64_t dir_gen; /* the directory's generation bex__rpc_dir_prune last saw */
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* timer wake-ups and destroy's waits */
    struct bex__hmap calls; /* live calls by id */
    struct bex__list live;  /* live calls, newest first */
    uint64_t next_id, next_seq, client_id, next_ping;
    /* random: with client_id, the key of this channel's dedup records at
     * servers (docs/security.md, "Dedup keys and Push ids") */
    uint8_t tok[BEX__RPC_TOK_LEN];
    int64_t tokens; /* retry budget, thousandths of a retry */
    struct bex__list links;
    size_t n_calls; /* not yet freed */
    /* freed calls kept for the next (up to BEX__RPC_CALL_SPARE), linked by
     * dnext: a call costs no malloc once the channel has run a while */
    struct call *spare;
    size_t n_spare;
    pthread_t timer;
    bool stop, destroying;
    uint64_t timer_next;
    uint64_t rng;
    bex_rpc_channel_stats st;
    struct bex__rpc_hist hist;
};

void *bex__rpc_timer_main(void *arg);
void bex__rpc_dir_report(struct bex_rpc_channel *ch, struct endpoint *ep, int outcome);
void bex__rpc_complete(struct bex_rpc_channel *ch, struct call *c, int status, void *resp,
                       size_t resp_len, int kind, struct call **done);
void bex__rpc_run_done(struct bex_rpc_channel *ch, struct call *done);
void bex__rpc_attempt_failed_ex(struct bex_rpc_channel *ch, struct call *c, int err, bool remote,
                                bool moved, struct call **done);
bool bex__rpc_link_fail(struct bex_rpc_channel *ch, struct link *l, int err, struct call **done);
bool bex__rpc_link_fail_ex(struct bex_rpc_channel *ch, struct link *l, int err, bool unsent,
                           struct call **done);
int bex__rpc_start_attempt(struct bex_rpc_channel *ch, struct call *c,
                           const struct endpoint *exclude, const struct link *keep, bool *step,
                           struct call **done);
bool bex__rpc_may_retry(struct bex_rpc_channel *ch, struct call *c, int err, bool remote);
void bex__rpc_dir_prune(struct bex_rpc_channel *ch, struct call **done);
bool bex__rpc_link_has_calls(struct bex_rpc_channel *ch, const struct link *l);
uint64_t bex__rpc_ladder_tick(struct bex_rpc_channel *ch, struct endpoint *ep, uint64_t now,
                              struct call **done);

void bex__rpc_ep_reachable(struct bex_rpc_channel *ch, struct endpoint *ep);
void bex__rpc_on_connect(bex_sock *s, int status, void *user);
void bex__rpc_on_error(bex_sock *s, int err, void *user);
void bex__rpc_on_close(bex_sock *s, void *user);
void bex__rpc_on_send_done(bex_sock *s, void *buf, size_t len, void *msg_user, int status,
                           void *user);
void bex__rpc_on_recv(bex_sock *s, void *buf, size_t len, void *user);
struct call *bex__rpc_call_find(struct bex_rpc_channel *ch, uint64_t id);
void bex__rpc_call_put(struct bex_rpc_channel *ch, struct call *c);
void bex__rpc_ep_put(struct endpoint *ep);
__attribute__((format(printf, 4, 5))) void bex__rpc_ladder_log(struct bex_rpc_channel *ch,
                                                               const struct endpoint *ep, int level,
                                                               const char *fmt, ...);
void bex__rpc_ep_answered(struct bex_rpc_channel *ch, struct endpoint *ep, bool tcp, int status,
                          bool live);
void bex__rpc_link_proven(struct bex_rpc_channel *ch, struct link *l);
int bex__rpc_send_ping(struct bex_rpc_channel *ch, struct link *l);
bool bex__rpc_retryable(int err, bool remote);
void bex__rpc_attempt_failed(struct bex_rpc_channel *ch, struct call *c, int err, bool remote,
                             struct call **done);
void bex__rpc_xatt_fail_ep(struct bex_rpc_channel *ch, const struct endpoint *ep, int err,
                           struct call **done);
extern const bex_sock_ops bex__rpc_link_ops;

int bex__rpc_xatt_open(struct bex_rpc_channel *ch, struct call *c, struct endpoint *ep);
void bex__rpc_xatt_end(struct xatt *xa);
bool bex__rpc_ep_conn_failed(struct bex_rpc_channel *ch, struct endpoint *ep, int rung,
                             uint64_t gen, int err);
bool bex__rpc_ladder_proven(struct bex_rpc_channel *ch, struct endpoint *ep, int rung);
bex_connect_opts bex__rpc_ladder_connect(struct bex_rpc_channel *ch, struct endpoint *ep, int *rung,
                                         bool *tcp, uint64_t *gen);

uint64_t bex__rpc_rnd(struct bex_rpc_channel *ch);
void bex__rpc_dir_release(struct bex_rpc_channel *ch, struct call *c);

/* The one place a link's or a call's state changes: the move is named in
 * the debug log, and one that our own code must never make asserts. */
void bex__rpc_link_move(struct bex_rpc_channel *ch, struct link *l, enum link_state to);
void bex__rpc_call_move(struct bex_rpc_channel *ch, struct call *c, enum call_state to);
/* Not completed yet (LIVE or WAITING). */
static inline bool bex__rpc_call_live(const struct call *c)
{
    return c->state == CALL_LIVE || c->state == CALL_WAITING;
}

#endif
