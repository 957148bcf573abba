/* SPDX-License-Identifier: Apache-2.0 */
/* The adaptive send window and the per-destination bound (issue 24 item 3;
 * docs/architecture.md, "Send window").
 *
 * bex__wnd is a delay-based controller, a pure function of the samples it
 * is fed: each sample is the time from posting a batch of work requests to
 * its completion, in the spirit of TIMELY and Swift. The smallest sample
 * seen is the base delay; what a sample exceeds it by is the queueing
 * delay. With a base ceiling the smallest sample is of the last one to
 * two epochs, not of all time: engines that started at different times
 * (one on an empty path, one behind a standing queue) then come to the
 * same base, and so to the same share; the ceiling bounds what a standing
 * queue can make the base. At or below the target the window grows additively (about
 * BEX__WND_AI bytes per window of bytes completed); above it the window is
 * cut multiplicatively, in proportion to how far above, at most once per
 * base-delay-plus-queueing interval (a cut must see its own effect first),
 * never by more than half. The window stays within [min, max].
 *
 * A delay above high_us is cut whatever the base (TIMELY's T_high), in
 * proportion to how far above. The engines set it to half the
 * transport's retransmission timeout: the base is a windowed minimum
 * capped at base_max_us, so under a standing queue it rises to the
 * ceiling, and the window then takes a delay of ceiling plus target for
 * no queueing; once that passes the NIC's timeout (Soft-RoCE's at
 * qp_timeout 14: 67 ms; a 40 ms ceiling and target allow 80) the NIC
 * resends what is still queued, and the copies fill the queue
 * (test_window.incast16).
 *
 * bex__wnd_dests is the aggregate bound: the engines of one context that
 * send to the same remote IPv4 address share one bex__wnd_dest, whose
 * bytes in flight stay within its bound. An engine with nothing in flight
 * may always post one fragment (so no engine waits for another's
 * completion, which would need a wake-up across I/O threads): the bound
 * holds up to max(bound, engines x fragment). The table is locked only to
 * find or drop an entry; admission and release are atomics.
 *
 * An engine that goes leaves its controller's state (window and base
 * delay: bex__wnd_memo) in its destination's entry, and the next engine to
 * that address starts from it instead of from the configured start: a
 * connection that fails and is made again (a keepalive, a peer's deadline)
 * resumes at the window its predecessor had learned, not with a burst of
 * send_window into the queue that made it fail. An entry with a memo stays
 * in the table when its last engine goes, as a memo-only entry (some 64
 * bytes); a memo older than BEX__WND_MEMO_MAX_US is not used. The table
 * holds at most BEX__WND_MEMOS_MAX memo-only entries: past that, the memos
 * older than BEX__WND_MEMO_MAX_US go, then the oldest, so a server that
 * many addresses connect to over time keeps a bounded table. */
#ifndef BEX_TRANSPORT_WINDOW_H
#define BEX_TRANSPORT_WINDOW_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/hash.h"

/* bex_ctx_config.send_window_mode's values live in bex/sock.h
 * (BEX_WINDOW_STATIC, BEX_WINDOW_ADAPTIVE). */

/* Additive increase: bytes a window grows by per window of completed bytes. */
#define BEX__WND_AI 1024u
/* Multiplicative decrease: the cut is BETA x (queueing - target) / queueing
 * of the window, in thousandths, at most MAX_CUT. */
#define BEX__WND_BETA_PERMILLE    800u
#define BEX__WND_MAX_CUT_PERMILLE 500u
/* ... and at least MIN_CUT: a cut of next to nothing (a queue just past
 * the target) would leave every window as it was, neither growing nor
 * shrinking, however unequal the shares (test_window.fair16). */
#ifndef BEX__WND_MIN_CUT_PERMILLE
#define BEX__WND_MIN_CUT_PERMILLE 50u
#endif

struct bex__wnd_params {
    uint32_t min, max;      /* bytes, 0 < min <= max */
    uint32_t init;          /* the first window (clamped to [min, max]) */
    uint32_t target_us;     /* queueing delay above which the window is cut */
    uint32_t base_max_us;   /* the base delay's ceiling (0: none) */
    uint64_t base_epoch_us; /* with a ceiling: the base is the smallest delay
                               of this epoch and the last (0: of all time) */
    uint32_t high_us;       /* a delay above it is cut whatever the base
                               (0: none) */
};

struct bex__wnd {
    struct bex__wnd_params p;
    uint32_t cwnd;        /* bytes */
    uint32_t base_us;     /* smallest delay seen (0: no sample yet) */
    uint32_t cur_min_us;  /* smallest delay of the current epoch (0: none) */
    uint32_t prev_min_us; /* of the epoch before (0: none) */
    uint64_t epoch_end_us;
    uint32_t last_us;     /* the last sample */
    uint64_t next_cut_us; /* no cut before this time */
    uint64_t cuts;        /* multiplicative decreases */
    uint64_t acc;         /* bytes completed toward the next increase */
};

void bex__wnd_init(struct bex__wnd *w, const struct bex__wnd_params *p);

/* A controller's state handed from an engine that goes to the next one to
 * the same address. */
struct bex__wnd_memo {
    uint32_t cwnd;    /* bytes */
    uint32_t base_us; /* 0: no memo (the engine had no sample) */
    uint64_t at_us;   /* when it was left */
};
/* A memo older than this is of another path's state: not used. */
#define BEX__WND_MEMO_MAX_US (60ull * 1000 * 1000)
/* Memo-only entries (no engine holds them) a table keeps at most. */
#define BEX__WND_MEMOS_MAX 1024u
/* w's state into m (m->base_us 0 when w had no sample). */
void bex__wnd_save(const struct bex__wnd *w, uint64_t now_us, struct bex__wnd_memo *m);
/* Start w (fresh from bex__wnd_init) at m's window and base delay instead
 * of p.init and none; with a base epoch the base is taken as the last
 * epoch's smallest delay, so it ages out as w's own would. False (w as it
 * was) without a memo or with one older than BEX__WND_MEMO_MAX_US. */
bool bex__wnd_resume(struct bex__wnd *w, const struct bex__wnd_memo *m, uint64_t now_us);
/* One sample: a batch of bytes posted delay_us ago completed at now_us.
 * Returns the window's change in bytes (negative: a cut). */
int64_t bex__wnd_sample(struct bex__wnd *w, uint32_t delay_us, uint32_t bytes, uint64_t now_us);

struct bex__wnd_dest {
    uint32_t ip;   /* network order */
    uint32_t refs; /* engines holding it (under the table's lock) */
    uint64_t bound;
    _Atomic uint64_t inflight;
    struct bex__wnd_memo memo; /* the last engine's that went (under the lock) */
};

struct bex__wnd_dests {
    pthread_mutex_t lock;
    struct bex__hmap map; /* ip -> struct bex__wnd_dest */
    uint64_t bound;       /* 0: no aggregate bound (no entries made) */
    uint32_t memos;       /* memo-only entries (refs 0), <= BEX__WND_MEMOS_MAX */
};

int bex__wnd_dests_init(struct bex__wnd_dests *d, uint64_t bound);
void bex__wnd_dests_free(struct bex__wnd_dests *d);
/* The entry of ip (network order), made on first use, one reference more;
 * NULL with no bound (d NULL or bound 0) or no memory (then unbounded).
 * memo (may be NULL): the entry's memo (zeroed: none). */
struct bex__wnd_dest *bex__wnd_dest_get(struct bex__wnd_dests *d, uint32_t ip,
                                        struct bex__wnd_memo *memo);
/* One reference less; memo (may be NULL; base_us 0: none) is left in the
 * entry for the next engine. The entry goes with its last reference unless
 * it holds a memo; past BEX__WND_MEMOS_MAX memo-only entries the stale,
 * then the oldest, go (the one just left may be it). */
void bex__wnd_dest_put(struct bex__wnd_dests *d, struct bex__wnd_dest *x,
                       const struct bex__wnd_memo *memo);
/* Take bytes of x's bound: always when alone (the engine has nothing in
 * flight), else only when they fit. Returns whether taken; *now the bytes
 * in flight to x after taking them. */
bool bex__wnd_dest_take(struct bex__wnd_dest *x, uint64_t bytes, bool alone, uint64_t *now);
void bex__wnd_dest_give(struct bex__wnd_dest *x, uint64_t bytes);

#endif
