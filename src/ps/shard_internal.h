/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard's private header: its tables, the ids of applied Pushes,
 * held requests and catch-up copies, shared by the files of the shard
 * (shard.c, shard_hash.c, table.c, pushid.c, snapshot.c, request.c,
 * catchup_peer.c, catchup.c). */
#ifndef BEX_PS_SHARD_INTERNAL_H
#define BEX_PS_SHARD_INTERNAL_H

#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/ps.h"
#include "common/ihash.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"

/* rows of a table at most: its hash's slot count (2 x rows) fits in a u32 */
#define BEX__PS_ROWS_MAX (1u << 30)

/* A copy no CHUNK asked for this long is dropped (its puller is gone). */
#define COPY_IDLE_NS   (30ull * 1000000000ull)
#define COPY_CHUNK_MAX (16u << 20)

struct table {
    bex_ps_table_config cfg;
    uint32_t width; /* floats per row: dim, or 2 x dim with Adagrad */
    uint64_t *keys; /* row -> key */
    float *vals;    /* row -> width floats */
    uint32_t n_rows, cap_rows;
    uint64_t *dirty;       /* a bit per row: changed since the last cut (snapcut.c) */
    struct bex__ihash idx; /* key -> row (table.c) */
    /* served (under the shard's lock): requests, rows, and the time a
     * request took in the shard, from its decoding to its answer */
    uint64_t fetches, pushes, rows_fetched, rows_pushed;
    struct bex__rpc_hist lat[2]; /* Fetch, Push */
};

struct reg {
    struct bex_ps_shard *s;
    bex_ctx *ctx;
    uint32_t method;
};

/* The ids of the Pushes applied (BEX__PS_F_ID): per client (its id and
 * its token: docs/security.md, "Dedup keys and Push ids"), the highest sequence and a
 * bitmap of the IDS_WINDOW sequences up to it. At most lim clients; a new
 * one takes the place of the least recently seen only when that one was
 * last seen longer than the retry horizon ago, else it is refused. */
#define IDS_WINDOW   BEX__PS_IDS_WINDOW
#define IDS_CLIENTS  4096u
#define IDS_LOAD_MAX (1u << 20) /* clients a snapshot or copy may hold */
#define IDS_NIL      UINT32_MAX
struct idkey {
    uint64_t client, tok[2];
};
struct idc {
    struct idkey k;
    uint64_t max, touch_ns;
    uint32_t prev, next; /* least recently seen order (IDS_NIL ends) */
    uint64_t bits[IDS_WINDOW / 64];
};
struct idset {
    struct idc *c;
    uint32_t n, cap;
    struct bex__ihash idx; /* idkey -> index in c (pushid.c) */
    uint32_t head, tail;   /* most and least recently seen */
};
enum { ID_NEW, ID_SEEN, ID_OLD };

/* A Push's id (BEX__PS_F_ID) and where the Push comes from: served (a
 * request now: new clients rate-limited; req its RPC request, NULL when
 * called through bex_ps_shard_serve) or a held Push replayed. */
struct pushid {
    struct idkey k;
    uint64_t seq;
    bool served;
    const bex_rpc_req *req;
};

/* A Push held while catching up, checked and decoded. */
struct held {
    struct held *next;
    struct table *t;
    uint32_t n;
    bool has_id;
    struct pushid id; /* has_id */
    uint64_t *keys;
    float *g;
    size_t bytes;
};

/* A forward at a backup (BEX_PS_M_FORWARD), checked and decoded: held
 * until its turn (lsn), or applied at once. */
struct fwdh {
    struct fwdh *next; /* answers to send, after the lock */
    uint64_t lsn;
    struct table *t;
    uint32_t n;
    bool has_id;
    struct pushid id; /* has_id */
    uint64_t *keys;
    float *g;
    size_t bytes;
    bex_rpc_req *req;
    int status; /* its answer */
    /* a batch (repl_batch.c): the head holds the batch's req, its bytes
     * and cnt forwards (lsn .. lsn + cnt - 1) chained by more; 1 alone */
    struct fwdh *more;
    uint32_t cnt;
};

/* A primary's backup (docs/architecture.md, "Lifecycles"), under the
 * shard's lock: UP (forwarded to, in step); static mode: DOWN (a forward
 * failed: no Push acknowledged from then on) and PROBING (down, a probe
 * or a resend from the log out); etcd mode: OUT (removed from the
 * replica set, not forwarded to). Changed only by bex__ps_backup_move. */
enum bex__ps_backup_state { BK_UP, BK_DOWN, BK_PROBING, BK_OUT };

struct backup {
    bex_addr addr;
    uint32_t transport;
    bex_rpc_channel *ch; /* made at register */
    enum bex__ps_backup_state state;
    uint64_t probe_ns; /* down or out: no probe before then */
    /* forwards queued in lsn order (repl_batch.c), batches out; closed:
     * its channel is being destroyed, nothing more is sent */
    struct fcall *q_head, *q_tail;
    uint32_t b_out;
    bool closed;
    /* a forward to it was answered: its connection came up once, so a
     * forward's deadline no longer includes the connection's setup */
    bool reached;
};

/* A primary's log of its last forwards (repl_log.c): a ring of the Push
 * bodies of lsns first .. first + n - 1, always contiguous. */
struct rlog_ent {
    uint64_t lsn;
    uint8_t *body;
    size_t len;
};
struct rlog {
    struct rlog_ent *e;
    uint32_t cap, head, n; /* head: the oldest's index */
    uint64_t bytes, max_bytes;
};

struct fcall;
struct bex__elect;

/* A replica's replication state (docs/architecture.md, "Lifecycles"),
 * under the shard's lock: ANY (no replication), PRIMARY, PAUSED (a
 * primary whose client Pushes wait, -EAGAIN: etcd mode, a new term's set
 * or a backup rejoining), BACKUP (static mode; etcd mode: copied from its
 * primary of this epoch) and UNSYNCED (etcd mode: a backup that has not,
 * refusing that epoch's forwards). Changed only by bex__ps_repl_move. */
enum bex__ps_repl_state { RP_ANY, RP_PRIMARY, RP_PAUSED, RP_BACKUP, RP_UNSYNCED };

/* Primary-backup replication (repl.c), under the shard's lock. */
struct repl {
    enum bex__ps_repl_state state; /* bex__ps_repl_move */
    /* the state's role (enum bex_ps_role): read without mu (a request's
     * door), written only by bex__ps_repl_move */
    _Atomic uint32_t role;
    bex_ctx *ctx; /* register's */
    /* primary: its backups, its session and the last lsn numbered */
    struct backup *bk;
    size_t n_bk;
    uint32_t n_down, fwd_timeout_ms;
    uint32_t bk_connect_ms; /* a backup's connection setup (backup_connect_timeout_ms) */
    uint64_t retry_ns;      /* a down backup probed at most this often */
    uint64_t session, lsn;
    /* backup: the primary's session it follows, the next lsn to apply,
     * forwards held ahead of their turn (win[lsn % win_n]) */
    uint64_t in_session, next;
    struct fwdh **win;
    uint32_t win_n;
    uint64_t hold_bytes, hold_max;
    /* catch-up: the position of the last copy loaded (its maker's
     * session and lsn; 0: none), taken by a backup with the copy */
    uint64_t cut_session, cut_lsn;
    /* the position of the snapshot loaded at create (0: none, or a
     * snapshot older than version 4): a restarted backup asks its
     * primary for the forwards after it (catchup_suffix.c) */
    uint64_t snap_session, snap_lsn;
    /* etcd mode (failover.c, docs/architecture.md "Replication"): the
     * session is the epoch (term) from etcd. Primary: acknowledges only
     * before el's deadline; a forward failed at a backup of the set waits
     * on rm until the agent removed that backup from the set in etcd.
     * Backup: refuses forwards of an epoch below epoch, and of epoch until
     * it copied from its primary (UNSYNCED until then). fenced: etcd mode,
     * set once when the agent starts. */
    bool fenced;
    uint32_t inflight; /* primary: Pushes numbered, not answered yet */
    uint64_t epoch;
    struct bex__elect *el;
    struct fcall *rm;
    struct backup *old_bk; /* an earlier term's backups (freed at fini) */
    void (*kick)(void *arg);
    void *kick_arg;
    struct rlog log; /* primary: its last forwards */
    /* primary: a batch's bounds, batches out to one backup at most */
    uint32_t batch_max, batch_depth;
    uint64_t batch_bytes;
};

/* A handler's answer will be sent later (bex_rpc_reply), not now. */
#define BEX__PS_LATER 1

/* The copy a restarted peer pulls (BEX_PS_M_COPY): one at a time. */
struct copy {
    uint64_t session, used_ns;
    char *buf;
    size_t len;
};

/* A shard's life (docs/architecture.md, "Lifecycles"), under s->mu:
 * SERVING, or catching up (requests answered -EAGAIN, Pushes held): WAIT
 * for bex_ps_shard_catchup (created with BEX_PS_SHARD_CATCHUP, or a
 * primary's catch-up that failed), CATCHUP while it runs; RESYNC_WAIT and
 * RESYNC the same for a resync from a new primary (etcd mode: its copy
 * is taken even if behind ours). Changed only by bex__ps_shard_move. */
enum bex__ps_shard_state { SH_SERVING, SH_WAIT, SH_CATCHUP, SH_RESYNC_WAIT, SH_RESYNC };

struct bex_ps_shard {
    uint32_t shard, n_shards;
    struct reg regs[5]; /* the handlers' user pointers */
    struct table *tables;
    size_t n_tables;
    pthread_mutex_t mu;
    struct bex__log log;
    bex_ps_shard_stats st;
    struct idset ids;
    /* new clients: at most ids_max held, one forgotten only after
     * horizon_ns unseen; new_rate a second per shard (new_tat: the token
     * bucket's theoretical arrival time), new_per_conn per connection */
    uint32_t ids_max, new_rate, new_per_conn;
    uint64_t horizon_ns, new_tat;
    enum bex__ps_shard_state state; /* bex__ps_shard_move */
    struct held *held, **held_tail;
    uint64_t held_bytes, held_max;
    struct copy cp;
    struct repl rp;
    struct cut *cut; /* consistent cuts (snapcut.c) */
    struct lag *lag; /* replica lag (lag.c) */
};

/* shard.c: the one place s->state changes (under s->mu): logs the move by
 * name (DEBUG) and asserts it is one of the table's; bex__ps_shard_catching:
 * not SERVING. */
const char *bex__ps_shard_state_name(unsigned st);
void bex__ps_shard_move(bex_ps_shard *s, enum bex__ps_shard_state to);
static inline bool bex__ps_shard_catching(const bex_ps_shard *s)
{
    return s->state != SH_SERVING;
}
/* bex_ps_shard_catchup's start (0, or -EINVAL and a WARN naming the
 * state: no catch-up awaited, or one running) and end (under s->mu;
 * again: a primary's that failed, it may be called again). */
int bex__ps_shard_catchup_start(bex_ps_shard *s);
void bex__ps_shard_catchup_end_locked(bex_ps_shard *s, bool again);
/* repl.c: the one place a backup's state changes (under s->mu; b is
 * backup i of the primary): logs it by name (DEBUG), asserts the move is
 * one of the table's. */
const char *bex__ps_backup_state_name(unsigned st);
void bex__ps_backup_move(bex_ps_shard *s, uint32_t i, enum bex__ps_backup_state to);
/* repl.c: the one place s->rp.state (and the role beside it) changes
 * (under s->mu): logs it by name (DEBUG), asserts the move is one of the
 * table's. */
const char *bex__ps_repl_state_name(unsigned st);
void bex__ps_repl_move(bex_ps_shard *s, enum bex__ps_repl_state to);

int bex__ps_ids_has(const struct idset *d, const struct idkey *key, uint64_t seq);
void bex__ps_ids_free(struct idset *d);
int bex__ps_push_apply_locked(bex_ps_shard *s, struct table *t, uint32_t n, const uint64_t *keys,
                              const float *g, const struct pushid *id, bool *applied);
struct table *bex__ps_tables_like(const bex_ps_shard *s);
int bex__ps_copy_load(bex_ps_shard *s, const uint8_t *buf, size_t size, struct table *dst,
                      struct idset *ids);
bool bex__ps_ids_behind(const struct idset *mine, const struct idset *cut);
void bex__ps_held_free(struct held *h);
void bex__ps_tables_free(struct table *ts, size_t n);

struct table *bex__ps_find_table(bex_ps_shard *s, uint32_t id);
int bex__ps_copy_make(bex_ps_shard *s, char **buf, size_t *len);
/* A Fetch served from p (its keys): the answer in *resp, and the time since
 * t0 (bex__rpc_now_ns) in its table's latency histogram, under the lock the
 * rows take anyway; *t1 the time read for it (left alone on an error). */
int bex__ps_serve_fetch(bex_ps_shard *s, bex_ctx *ctx, const struct bex__ps_hdr *h,
                        const uint8_t *p, uint64_t t0, uint64_t *t1, void **resp, size_t *resp_len);
int bex__ps_serve_push(bex_ps_shard *s, bex_ctx *ctx, const struct bex__ps_hdr *h, const uint8_t *p,
                       const bex_rpc_req *req, void **resp, size_t *resp_len);

int bex__ps_push_read(bex_ps_shard *s, const struct bex__ps_hdr *h, const uint8_t *p,
                      struct table **t, uint64_t **keys, float **g);
int bex__ps_repl_init(bex_ps_shard *s, const bex_ps_shard_config *cfg);
int bex__ps_repl_register(bex_ps_shard *s, bex_ctx *ctx);
void bex__ps_repl_fini(bex_ps_shard *s);
void bex__ps_repl_position(const bex_ps_shard *s, uint64_t *session, uint64_t *lsn);
void bex__ps_repl_take_cut(bex_ps_shard *s);
int bex__ps_primary_push(bex_ps_shard *s, const struct bex__ps_hdr *h, const void *body, size_t len,
                         bex_rpc_req *req);
int bex__ps_backup_forward(bex_ps_shard *s, const void *body, size_t len, bex_rpc_req *req);
/* etcd mode (failover.c): lead with epoch (lease el) and backups[0..n)
 * (out[i]: not in the replica set);
 * follow (a backup of a primary of epoch, not synced yet); the backups
 * the removals wait for (their indexes into out, at most cap), and the
 * outcome of removing backup b (0: removed, the forwards waiting go on
 * without it; else they fail). */
int bex__ps_repl_lead(bex_ps_shard *s, uint64_t epoch, struct bex__elect *el,
                      const bex_rpc_endpoint *backups, const bool *out, size_t n);
void bex__ps_repl_follow(bex_ps_shard *s, uint64_t epoch);
size_t bex__ps_repl_removals(bex_ps_shard *s, uint32_t *out, size_t cap);
void bex__ps_repl_removed(bex_ps_shard *s, uint32_t b, int status);
/* Primary, etcd mode, not under the lock: pause client Pushes and wait
 * (at most wait_ms) until none is in flight (0, else -ETIMEDOUT); probe
 * backup b at the last lsn (its answer: 0 when in step); resume. */
int bex__ps_repl_pause(bex_ps_shard *s, uint32_t wait_ms);
int bex__ps_repl_probe(bex_ps_shard *s, uint32_t b);
void bex__ps_repl_resume(bex_ps_shard *s);
int bex__ps_resync(bex_ps_shard *s, bex_ctx *ctx, const bex_rpc_endpoint *primary,
                   uint32_t timeout_ms);
/* failover_repl.c (under s->mu): the primary's lease held now; a client's
 * Push admitted (0, -EPERM, -ESTALE); a forward of epoch taken (0) or
 * refused (-ESTALE: stale; -EAGAIN: not synced to it yet). */
bool bex__ps_lease_held(const struct repl *rp);
int bex__ps_fenced_admit(bex_ps_shard *s, const struct bex__ps_hdr *h);
int bex__ps_fenced_forward(bex_ps_shard *s, uint64_t epoch);

int bex__ps_table_reserve(struct table *t, uint32_t extra);
float *bex__ps_row_get(struct table *t, uint64_t key);
uint32_t bex__ps_missing_rows(const struct table *t, const uint64_t *keys, uint32_t n);

int bex__ps_snapshot_load(bex_ps_shard *s, const char *path);
uint32_t bex__ps_row_find(const struct table *t, uint64_t key);
struct idc *bex__ps_ids_find(const struct idset *d, const struct idkey *key);
int bex__ps_ids_new(struct idset *d, const struct idkey *key, uint64_t now, uint32_t lim,
                    uint64_t horizon, struct idc **out);

void bex__ps_apply(const struct table *t, float *v, const float *g);

void bex__ps_table_defaults(bex_ps_table_config *c);

/* ---- consistent cuts (snapcut.c, snapshot_cut.c) and lag (lag.c) ---- */

/* A snapshot file being written or read (snapshot.c): written through f
 * and hashed; read from p, left bytes. */
struct bex__ps_wr {
    FILE *f;
    crypto_generichash_state h;
    int err;
};
struct bex__ps_rd {
    const uint8_t *p;
    size_t left;
};
void bex__ps_wr_bytes(struct bex__ps_wr *w, const void *p, size_t n);
void bex__ps_wr32(struct bex__ps_wr *w, uint32_t v);
void bex__ps_wr64(struct bex__ps_wr *w, uint64_t v);
void bex__ps_wr_ids(struct bex__ps_wr *w, bex_ps_shard *s);
/* The trailer of a file written to an open_memstream (*buf, *len): the
 * hash of what w wrote, then fclose; on any error *buf freed and NULL.
 * 0 or -ENOMEM. */
int bex__ps_wr_finish(struct bex__ps_wr *w, char **buf, size_t *len);
int bex__ps_rd32(struct bex__ps_rd *r, uint32_t *v);
int bex__ps_rd64(struct bex__ps_rd *r, uint64_t *v);
int bex__ps_load_ids(struct bex__ps_rd *r, struct idset *ids, bool tok);
int bex__ps_check_sum(bex_ps_shard *s, const uint8_t *buf, size_t size, const char *magic,
                      uint32_t lo, uint32_t hi, const char *what, uint32_t *version,
                      struct bex__ps_rd *r);
int bex__ps_read_file(const char *path, uint8_t **buf, size_t *size);

int bex__ps_cut_init(bex_ps_shard *s, const bex_ps_shard_config *cfg);
/* The shard is going (the first half of bex__ps_cut_fini, which then waits
 * for the cut under way to end and frees): a cut under way ends now (its
 * Pushes released, its COMMIT answered -ETIMEDOUT), none starts again
 * (PREPARE -ECANCELED). Does not wait. */
void bex__ps_cut_stop(bex_ps_shard *s);
/* A cut's state by name (snapcut.c, for logs). */
const char *bex__ps_cut_state_name(unsigned st);
void bex__ps_cut_fini(bex_ps_shard *s);
/* A Push arriving at the registered handler: true when it is held for a
 * cut (req, body taken; served when the cut releases it), else it is
 * served now and bex__ps_cut_done follows. */
bool bex__ps_cut_hold(bex_ps_shard *s, struct reg *r, bex_rpc_req *req, void *body, size_t len);
void bex__ps_cut_done(bex_ps_shard *s);
int bex__ps_cut_serve(bex_ps_shard *s, bex_ctx *ctx, const void *body, size_t len, bex_rpc_req *req,
                      void **resp, size_t *resp_len);
/* The rows were replaced whole (catch-up): the next cut is full. */
void bex__ps_cut_forget_locked(bex_ps_shard *s);
void bex__ps_cut_stats_locked(const bex_ps_shard *s, bex_ps_shard_stats *out);
void bex__ps_snap_written_locked(bex_ps_shard *s, uint64_t id, uint64_t t0_unix, uint64_t write_ns,
                                 uint64_t pause_ns, uint64_t rows, int rc);
/* The registered handler's body (catchup_peer.c): serve req and answer it. */
void bex__ps_handle(struct reg *r, bex_rpc_req *req, void *body, size_t len);
/* row v of t changed (a Push): marked for the next incremental cut */
void bex__ps_row_dirty(struct table *t, const float *v);
/* The cut file of this shard's cut id: made (under s->mu; rows changed
 * since prev, or every row when prev is 0; the dirty marks cleared), and
 * the chain ending at id loaded into s (at create). */
int bex__ps_cut_make(bex_ps_shard *s, uint64_t id, uint64_t prev, char **buf, size_t *len,
                     uint64_t *rows);
int bex__ps_cut_restore(bex_ps_shard *s, const char *dir, uint64_t id, uint32_t *chain);
int bex__ps_cut_path(char *out, size_t cap, const char *dir, uint32_t shard, uint64_t id);

/* join.c: a JOIN's backup checked (a primary, room, not there yet),
 * added (its channel made; in step at the primary's lsn), decoded. */
int bex__ps_join_check_locked(const bex_ps_shard *s, const bex_rpc_endpoint *ep);
int bex__ps_join_add_locked(bex_ps_shard *s, const bex_rpc_endpoint *ep);
void bex__ps_join_endpoint(const uint8_t *p, size_t len, bex_rpc_endpoint *ep);
size_t bex__ps_join_put(uint8_t *p, const bex_rpc_endpoint *ep);
/* etcd mode: a JOIN of term epoch at this shard (*fenced: etcd mode;
 * false: the static JOIN's hold is for the caller): 0 (added out of the
 * replica set, the agent kicked), -EPERM not a primary, -ESTALE another
 * term or no lease, -EEXIST known already, -ENOSPC, -EINVAL; and the
 * new replica's call of it (not under the lock). */
int bex__ps_join_fenced(bex_ps_shard *s, uint64_t epoch, const bex_rpc_endpoint *ep, bool *fenced);
int bex__ps_join_fenced_call(bex_ps_shard *s, bex_ctx *ctx, const bex_rpc_endpoint *primary,
                             const bex_rpc_endpoint *self, uint64_t epoch, uint32_t timeout_ms);

/* repl_log.c: the primary's log of forwards (bounds from cfg); a
 * forward numbered (under s->mu; on no memory the log is emptied, never
 * left with a hole); emptied (a new session); the log's forwards after
 * pos sent again to backup b, which rejoins when it applied them all
 * (0), or -ERANGE when the log does not reach back to pos + 1. */
int bex__ps_rlog_init(struct rlog *l, const bex_ps_shard_config *cfg);
void bex__ps_rlog_add_locked(struct rlog *l, uint64_t lsn, const void *body, size_t len);
void bex__ps_rlog_clear(struct rlog *l);
int bex__ps_rlog_resend(bex_ps_shard *s, uint32_t b, uint64_t pos);

int bex__ps_lag_init(bex_ps_shard *s);
void bex__ps_lag_fini(bex_ps_shard *s);
void bex__ps_lag_numbered_locked(bex_ps_shard *s, uint64_t lsn);
void bex__ps_lag_acked(bex_ps_shard *s, uint32_t b, uint64_t lsn);
void bex__ps_lag_applied_locked(bex_ps_shard *s);
void bex__ps_lag_stats_locked(const bex_ps_shard *s, bex_ps_shard_stats *out);
struct bex__prom;
void bex__ps_ops_prom(struct bex__prom *o, bex_ps_shard *const *shards,
                      const bex_ps_shard_stats *sst, size_t n);

/* repl_log.c, catchup_suffix.c: a restarted backup's catch-up by the
 * primary's log suffix (COPY op SUFFIX; docs/protocol.md, "Catch-up") */
int bex__ps_rlog_suffix_locked(const struct repl *rp, uint64_t session, uint64_t pos, uint32_t max,
                               uint8_t **out, size_t *len, uint64_t *last);
struct bex__ps_copy_hdr;
int bex__ps_copy_call(bex_rpc_channel *ch, bex_ctx *ctx, const struct bex__ps_copy_hdr *q,
                      uint64_t deadline, struct bex__ps_copy_hdr *a, void **body, size_t *len);
int bex__ps_catchup_suffix(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_catchup_config *cfg,
                           uint64_t deadline);

#endif
