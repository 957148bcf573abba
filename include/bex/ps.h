/* SPDX-License-Identifier: Apache-2.0 */
/* bex parameter server (paper §2.1, §8): sharded embedding tables
 * served over bex RPC.
 *
 * A table is a map from uint64 keys to rows of dim float32 values; a key
 * belongs to shard bex_ps_key_shard(key, n_shards). A row is created on its
 * first touch (Fetch or Push) with bex_ps_init_value, a hash of (table,
 * key, column), so every replica of a shard creates the same row. Push
 * applies gradients with the table's optimizer (SGD or Adagrad).
 *
 * Server side: a shard (bex_ps_shard) holds one shard of every table;
 * bex_ps_shard_register puts its Fetch and Push on an RPC server (Push as
 * BEX_RPC_METHOD_WRITE: a retried Push is applied once, within the
 * server's dedup window). bex_ps_shard_snapshot writes it to a file;
 * bex_ps_shard_create loads that file when it exists. bex_ps_snapshot_all
 * takes a consistent cut of every shard (one point every client's Pushes
 * respect; incremental; restored with restore_cut), and bex_ps_shard_join
 * adds a backup to a running primary (docs/architecture.md, "Snapshots",
 * "Operations"). Wire and snapshot
 * formats: docs/protocol.md ("Parameter server").
 *
 * Client side: a bex_ps_client fetches and pushes over a directory (one RPC
 * channel per shard); a request's keys are split by shard and the
 * sub-requests go out in parallel; the request completes once, when every
 * sub-request has answered or failed (each within the request's deadline).
 *
 * Replicas: the directory may list several replicas of a shard (at
 * different locality labels). Two ways to keep them equal:
 * - client fan-out (BEX_PS_PUSH_ALL, the default, shards with
 *   BEX_PS_ROLE_ANY): described below. Concurrent Pushers reach the
 *   replicas in different orders, so Adagrad replicas diverge.
 * - primary-backup (BEX_PS_PUSH_PRIMARY, shards with BEX_PS_ROLE_PRIMARY
 *   and BEX_PS_ROLE_BACKUP): a Push goes to the shard's primary alone (the
 *   first replica the directory lists); the primary orders the Pushes
 *   (under its lock), applies each, forwards it with its id to every
 *   backup (BEX_PS_M_FORWARD, numbered), and answers the client only once
 *   every backup applied it; backups apply the forwards in the primary's
 *   order and refuse client Pushes (-EPERM). Replicas are equal bit for bit
 *   whatever the optimizer. A backup that fails a forward is marked down
 *   and the primary refuses Pushes (-EHOSTDOWN) until it rejoins (it holds
 *   every Push again: probed): with a static cluster file there is no
 *   failover and no acknowledgement without every backup
 *   (docs/architecture.md, "Replication").
 * With client fan-out: A Fetch goes to one of them, the nearest
 * healthy one the directory picks, and fails over to another when it fails
 * or does not answer. A Push goes to every replica the directory lists for
 * each of its shards, each on a channel of that replica alone: a retry
 * after a lost answer goes to the same server with the same sequence, and
 * its dedup window applies the Push once. A Push succeeds when every
 * replica acknowledged; bex_ps_push_report says which did not. A part a
 * replica failed (its connection, in doubt, -EAGAIN) while another
 * replica of the shard took it is kept and sent to that replica again
 * once it answers (bex_ps_client_config.push_resend_max), so that the
 * replicas converge. Each Push
 * also carries an id (the client's random id and 128-bit random token,
 * and a sequence) that every replica records, in its snapshot too: a
 * replica applies an id once, refuses one more than 1024 behind the
 * client's highest (-ESTALE), and a peer that does not hold the token
 * cannot touch the client's record (docs/security.md, "Dedup keys and Push ids").
 *
 * Threads: every function may be called from any thread. */
#ifndef BEX_PS_H
#define BEX_PS_H

#include <netinet/in.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/common.h"
#include "bex/dir.h"
#include "bex/rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

#pragma GCC visibility push(default)

/* RPC service and methods of a PS server. BEX_PS_M_COPY and
 * BEX_PS_M_FORWARD are reserved: a restarted replica's catch-up copy of its
 * peer (docs/protocol.md, "Catch-up") and a primary's forward of a Push to
 * its backups ("Forward"), not for applications. */
#define BEX_PS_SERVICE 0x5053u /* "PS" */
enum { BEX_PS_M_FETCH = 1, BEX_PS_M_PUSH = 2, BEX_PS_M_COPY = 3, BEX_PS_M_FORWARD = 4 };
/* An administrator's method: the two phases of a consistent cut of the
 * whole model (bex_ps_snapshot_all; docs/protocol.md, "Cut"). */
enum { BEX_PS_M_CUT = 5 };

/* Bounds of the wire format (a body past them is refused, -E2BIG). */
#define BEX_PS_DIM_MAX    4096u       /* floats in a row */
#define BEX_PS_KEYS_MAX   65536u      /* keys in one Fetch or Push */
#define BEX_PS_BODY_MAX   (64u << 20) /* bytes of one body */
#define BEX_PS_TABLES_MAX 64u

enum { BEX_PS_SGD = 1, BEX_PS_ADAGRAD = 2 };

/* One table; zero in a float field means its default. */
/* clang-format off */
#define BEX_PS_TABLE_CONFIG_INIT {.size = sizeof(bex_ps_table_config)}
/* clang-format on */
typedef struct bex_ps_table_config {
    size_t size;        /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    uint32_t id;        /* any value, unique in the shard */
    uint32_t dim;       /* 1..BEX_PS_DIM_MAX */
    uint32_t optimizer; /* BEX_PS_SGD or BEX_PS_ADAGRAD */
    float lr;           /* learning rate (0.01) */
    float init_scale;   /* initial values uniform in [-s, s) (0.01) */
    float adagrad_init; /* Adagrad: accumulators start at this (0.1) */
    float adagrad_eps;  /* Adagrad: added to the root (1e-8) */
    uint32_t max_rows;  /* rows of this table in a shard (1 << 20,
                           at most 1 << 30); a request that would create more fails -ENOSPC */
} bex_ps_table_config;

/* The initial value of (table, key, column) for init_scale s: splitmix64
 * of the three, mapped to [-s, s) (docs/protocol.md has the formula). */
float bex_ps_init_value(uint32_t table, uint64_t key, uint32_t col, float s);

/* The shard of key among n_shards (>= 1): a hash of the key, so that
 * consecutive keys spread. */
uint32_t bex_ps_key_shard(uint64_t key, uint32_t n_shards);

/* ---- server ---- */

typedef struct bex_ps_shard bex_ps_shard;

/* clang-format off */
#define BEX_PS_SHARD_CONFIG_INIT {.size = sizeof(bex_ps_shard_config)}
/* clang-format on */
typedef struct bex_ps_shard_config {
    size_t size;              /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    uint32_t shard, n_shards; /* which shard this is (shard < n_shards) */
    const bex_ps_table_config *tables;
    size_t n_tables; /* 1..BEX_PS_TABLES_MAX */
    /* A snapshot to load when the file exists (NULL: none). Its shard,
     * shard count and tables must match; a corrupt file is an error, not
     * an empty start. */
    const char *snapshot_path;
    bex_log_fn log_fn; /* NULL: stderr */
    void *log_arg;
    uint32_t flags; /* BEX_PS_SHARD_* */
    /* BEX_PS_SHARD_CATCHUP: bytes of Pushes held until the catch-up ends
     * (256 MiB); a Push past it is answered -EAGAIN */
    uint64_t catchup_log_max;
    /* The ids of the Pushes applied (docs/security.md, "Dedup keys and Push ids"): clients
     * held (4096, at most 1 << 20); a client is forgotten only when the
     * table is full and it was last seen longer than retry_horizon_ms ago
     * (300000: longer than any client's retries); a new client past the
     * bounds below, or when the table is full of younger ones, is refused
     * -EAGAIN (retriable), never by evicting another. */
    uint32_t dedup_clients;
    uint32_t retry_horizon_ms;
    uint32_t new_clients_per_sec;  /* new client ids a second, this shard (1000) */
    uint32_t new_clients_per_conn; /* new client ids one RPC connection may bring (64) */
    /* Primary-backup replication (docs/architecture.md, "Replication"):
     * role BEX_PS_ROLE_* (0: ANY, client fan-out). A primary forwards each
     * Push to backups[0..n_backups) (at most BEX_PS_REPLICAS_MAX - 1;
     * copied) and answers once each applied it; a forward not applied
     * within forward_timeout_ms (5000, retries included) marks its backup
     * down. A backup holds forwards that arrive ahead of their turn, at
     * most forward_window of them (1024, at most 65536) and
     * forward_hold_max bytes (64 MiB); past either one is refused -EAGAIN
     * (the primary's channel retries it). A backup marked down is probed
     * at most every backup_retry_ms (1000) while Pushes come: it rejoins
     * when it holds every Push the primary applied (it never missed one,
     * or it caught up from a replica that has them). */
    uint32_t role;
    const bex_rpc_endpoint *backups;
    size_t n_backups;
    uint32_t forward_timeout_ms;
    uint32_t forward_window;
    uint64_t forward_hold_max;
    uint32_t backup_retry_ms;
    /* Consistent cuts (bex_ps_snapshot_all; docs/architecture.md,
     * "Snapshots"): cut_dir is where this shard writes its cut files
     * (shard<N>-cut<ID>.snap) and reads them back (NULL: a cut is refused
     * -ENOTSUP). restore_cut (not 0): at create, the shard loads that cut
     * (its full file and the incremental ones after it, from cut_dir)
     * instead of snapshot_path. cut_pause_ms: the longest the shard holds
     * Pushes for one cut (50, at most 60000): past it the cut is aborted
     * and the Pushes go on (held, never failed); cut_hold_max: bytes of
     * Pushes held (64 MiB), past which likewise. cut_full_every: every
     * Nth cut is written full, the others hold only the rows changed since
     * the cut before (8; 1: every one full). cut_min_interval_ms: a cut
     * asked sooner than this after the last one began is refused -EBUSY
     * (100): a peer cannot keep the Pushes held. */
    const char *cut_dir;
    uint64_t restore_cut;
    uint32_t cut_pause_ms, cut_full_every, cut_min_interval_ms;
    uint64_t cut_hold_max;
    /* A primary: the longest it holds Pushes while a new backup copies it
     * and joins (bex_ps_shard_join; 10000, at most 600000); past it the
     * join is refused and the Pushes go on. */
    uint32_t join_pause_ms;
    /* A primary keeps its last forwards in a log, at most
     * forward_log_entries of them (1024, at most 65536) and
     * forward_log_bytes of Push bodies (16 MiB; a backup restarted from
     * its snapshot takes the suffix after the snapshot's lsn from it
     * when it holds it, docs/protocol.md "Catch-up"): a backup marked down
     * that is behind by forwards still in the log gets them again and
     * rejoins; one behind the log stays down until it catches up by a
     * copy (docs/architecture.md, "Replication"). */
    uint32_t forward_log_entries;
    uint64_t forward_log_bytes;
    /* A primary sends the forwards queued for one backup together, as one
     * FORWARD batch (docs/protocol.md, "Forward"), in lsn order: at most
     * forward_batch_max Pushes (64, at most 65536) and forward_batch_bytes
     * of Push bodies (1 MiB, at most 64 MiB; a larger Push goes alone) a
     * batch, and at most forward_batches_inflight batches (8, at most 64)
     * out to one backup at once; while that many are out, its forwards
     * wait and go in the next batch. Each Push is still answered once
     * every backup of the set applied the batch holding it. */
    uint32_t forward_batch_max;
    uint64_t forward_batch_bytes;
    uint32_t forward_batches_inflight;
    /* A primary's connection to a backup may take this long to come up
     * (10000): until a forward to that backup was answered once, its
     * forwards' deadline is forward_timeout_ms plus this, so a backup
     * still connecting (RDMA setup on a loaded host can take seconds) is
     * waited for, not marked down by the first Push. */
    uint32_t backup_connect_timeout_ms;
} bex_ps_shard_config;

enum {
    BEX_PS_ROLE_ANY = 0,     /* takes client Pushes, forwards nothing (client fan-out) */
    BEX_PS_ROLE_PRIMARY = 1, /* takes client Pushes, forwards them to its backups */
    BEX_PS_ROLE_BACKUP = 2,  /* refuses client Pushes (-EPERM), applies forwards in order */
};

/* The shard starts catching up: Pushes are checked, answered and held in
 * a log (not applied), Fetches are answered -EAGAIN (retryable: the
 * client fails over to another replica), and COPY is refused, until
 * bex_ps_shard_catchup returns. */
#define BEX_PS_SHARD_CATCHUP (1u << 0)
/* (A backup that catches up takes its copy's replication position, and its
 * primary lets it rejoin: docs/architecture.md, "Replication".) */

/* Returns 0, -EINVAL (config; a snapshot not matching it or corrupt),
 * -ENOMEM, or the snapshot's read error (-EACCES, -EIO, ...). */
int bex_ps_shard_create(const bex_ps_shard_config *cfg, bex_ps_shard **out);
/* Free it; its server must be destroyed first. */
void bex_ps_shard_destroy(bex_ps_shard *s);

/* Register Fetch, Push (WRITE), Copy and Forward for BEX_PS_SERVICE on
 * srv, whose context is ctx (answers are allocated from it; a primary's
 * channels to its backups are made on it here). Before
 * bex_rpc_server_listen. */
int bex_ps_shard_register(bex_ps_shard *s, bex_rpc_server *srv, bex_ctx *ctx);

/* Serve one request body of method BEX_PS_M_*: what the registered
 * handlers do, for applications that wrap them. On 0, *resp / *resp_len
 * get the answer (from bex_rpc_alloc(ctx)). Errors: -EINVAL (malformed
 * body, unknown table, wrong dim, a key of another shard, a gradient not
 * finite), -E2BIG (past a
 * bound), -ENOSPC (table full), -ENOMEM, -ENOSYS (method); a Push with an
 * id: -ESTALE (more than 1024 ids behind its client's highest: applied or
 * not, the shard cannot tell; counted stale_ids), -EAGAIN (a new client
 * refused: the dedup table is full of live clients or new ones come too
 * fast; retriable, counted clients_refused). A failed Push changes
 * nothing. Through this function no connection is known: only the
 * per-second bound on new clients applies, not the per-connection one.
 * A backup refuses Push (-EPERM); a primary's Push and a Forward need the
 * registered handlers (answered once the backups applied it, or in turn):
 * through this function they are refused -EOPNOTSUPP, as is a cut's
 * COMMIT or JOINED (BEX_PS_M_CUT). A Push served through this function is
 * not held by a cut: an application that wraps the handlers this way
 * gets no consistent cut. */
int bex_ps_shard_serve(bex_ps_shard *s, bex_ctx *ctx, uint32_t method, const void *body, size_t len,
                       void **resp, size_t *resp_len);

/* Write the shard to path (through path.tmp and a rename: a crash leaves
 * the old file). Returns 0 or a negative errno. */
int bex_ps_shard_snapshot(bex_ps_shard *s, const char *path);

/* ---- catch-up of a restarted replica (docs/architecture.md) ---- */

/* clang-format off */
#define BEX_PS_CATCHUP_CONFIG_INIT {.size = sizeof(bex_ps_catchup_config)}
/* clang-format on */
typedef struct bex_ps_catchup_config {
    size_t size; /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    const bex_rpc_endpoint *peers; /* replicas of this shard, tried in order, in rounds */
    size_t n_peers;
    uint32_t timeout_ms;  /* the whole catch-up's deadline, every peer (10000) */
    uint32_t chunk_bytes; /* bytes asked per COPY chunk (1 MiB, at most 16 MiB) */
    uint64_t max_bytes;   /* a copy longer than this is refused (1 GiB) */
} bex_ps_catchup_config;

/* Catch a shard created with BEX_PS_SHARD_CATCHUP (and serving: its RPC
 * server listens) up with a live peer replica, then let it serve. Pulls
 * the peer's rows and the ids of the Pushes it applied, as one consistent
 * cut, in chunks; takes them instead of its own rows; applies the held
 * Pushes the cut does not contain, each once; serves from then on. The
 * peers are tried in rounds until the deadline: one not reachable yet is
 * asked again, one whose copy is bad or behind, or that catches up itself,
 * is not. When no
 * peer gives a copy by the deadline (dead, itself catching up, hostile),
 * it logs why and falls back to its own rows (its snapshot) plus every
 * held Push, and returns the error (-ETIMEDOUT, -ECONNREFUSED, -EAGAIN,
 * -EBADMSG, -E2BIG, ...); the shard serves either way, except a
 * BEX_PS_ROLE_PRIMARY given peers: its peers may hold Pushes it lacks, so
 * it stays catching up (Pushes and Fetches refused -EAGAIN) and this
 * function may be called again until one succeeds. Blocks: never from
 * a callback of ctx. -EINVAL (and a WARN naming the shard's state) when
 * the shard awaits no catch-up: not catching up, or one already running.
 * A BEX_PS_ROLE_BACKUP (static mode) loaded from a snapshot that records
 * its position asks each peer first for its primary's forward-log suffix
 * after that position and, when one gives it, applies those forwards
 * instead of copying the rows (stats catchup_suffix); else the copy. */
int bex_ps_shard_catchup(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_catchup_config *cfg);

/* Backups of a primary, at most. */
#define BEX_PS_BACKUPS_MAX 15u

typedef struct bex_ps_shard_stats {
    uint64_t fetches, pushes, rows_fetched, rows_pushed;
    uint64_t malformed; /* bodies refused */
    uint64_t rows;      /* rows held, every table */
    /* catch-up: rows copied from the peer, held Pushes applied (replayed)
     * and left out (the peer's cut had them), catch-ups that fell back to
     * the snapshot; Pushes held; copies served to a restarted peer; Pushes
     * whose id was applied already (answered, not applied again) */
    uint64_t catchup_rows, catchup_replayed, catchup_skipped, catchup_failed;
    uint64_t held, copies_served, dup_ids;
    /* Pushes refused -ESTALE (an id more than 1024 behind its client's
     * highest); new clients refused -EAGAIN (dedup_clients, rates) */
    uint64_t stale_ids, clients_refused;
    /* primary-backup: forwards sent (one per Push and backup) and failed
     * (their backup marked down), Pushes refused because a backup is down;
     * at a backup: forwards applied, held out of turn, refused, and client
     * Pushes refused (-EPERM); lsn: the last forward numbered (primary) or
     * applied (backup) */
    uint64_t fwd_sent, fwd_failed, backup_down_refused;
    uint64_t fwd_applied, fwd_held, fwd_refused, not_primary;
    uint64_t rejoins; /* a primary's backups back after being marked down */
    uint64_t lsn;
    uint32_t role, backups_down;
    /* operations (docs/architecture.md, "Snapshots" and "Replication"):
     * failovers: times this replica became primary by a failover (the
     * failover code counts them); at a primary, per backup b <
     * n_backups: lag_pushes[b], the Pushes numbered that b has not
     * acknowledged, and lag_ns[b], how long ago the oldest of them was
     * numbered (0: in step); at a backup, fwd_age_ns: how long ago it
     * applied its last forward (0: none yet). The last cut or snapshot
     * written: snap_id (its cut id; 0 for bex_ps_shard_snapshot),
     * snap_unix_ns (when it was taken, CLOCK_REALTIME; 0: none),
     * snap_write_ns (how long writing its file took), snap_pause_ns (how
     * long Pushes were held for it); snaps written, snap_failures (cuts
     * aborted or not written), snap_rows (rows in the last file). */
    uint64_t failovers;
    uint32_t n_backups;
    uint64_t lag_pushes[BEX_PS_BACKUPS_MAX], lag_ns[BEX_PS_BACKUPS_MAX];
    uint64_t fwd_age_ns;
    uint64_t snap_id, snap_unix_ns, snap_write_ns, snap_pause_ns, snaps, snap_failures, snap_rows;
    /* a primary: forwards sent again from its log to a backup found
     * behind, and backups that rejoined by them (counted in rejoins too) */
    uint64_t fwd_resent, log_rejoins;
    /* a restarted backup's catch-ups by its primary's log suffix (the
     * forwards after its snapshot's position, instead of a full copy;
     * catchup_rows counts the full copies' rows), and the forwards they
     * applied; at a primary, the suffix answers it served */
    uint64_t catchup_suffix, suffix_applied, suffixes_served;
    /* a primary: forward batches sent (fwd_sent / fwd_batches: the mean
     * Pushes a batch); a backup: forward batches refused whole (a count,
     * a length or an lsn that does not add up; counted in fwd_refused too) */
    uint64_t fwd_batches, fwd_batches_bad;
    /* catch-ups that installed a full copy of a peer's rows (the other
     * path to catchup_suffix) */
    uint64_t catchup_full;
} bex_ps_shard_stats;
void bex_ps_shard_stats_get(bex_ps_shard *s, bex_ps_shard_stats *out);

/* For shards[0..n), per table (labels shard and table): Fetches served,
 * Pushes applied, rows fetched and pushed, rows held, and a histogram of
 * the time a request took in the shard (bex_ps_serve_seconds, label
 * method "fetch" or "push"); per shard the bodies refused; in Prometheus
 * text exposition format (metric names bex_ps_*, each family once),
 * NUL-terminated, into buf (cap bytes). Returns the length it needed
 * (without the NUL), like snprintf: output is cut when that is >= cap;
 * -EINVAL, -ENOMEM. The RPC servers' side (requests, dedup, latency from
 * dispatch to answer): bex_rpc_server_prometheus. */
int bex_ps_shard_prometheus(bex_ps_shard *const *shards, size_t n, char *buf, size_t cap);

/* ---- adding a backup to a running shard (docs/architecture.md,
 * "Replication") ---- */

/* clang-format off */
#define BEX_PS_JOIN_CONFIG_INIT {.size = sizeof(bex_ps_join_config)}
/* clang-format on */
typedef struct bex_ps_join_config {
    size_t size;              /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    bex_rpc_endpoint primary; /* the shard's primary */
    bex_rpc_endpoint self;    /* where the primary forwards to this backup (it listens there) */
    uint32_t timeout_ms;      /* the whole join's deadline (10000) */
    uint32_t chunk_bytes;     /* the copy's (bex_ps_catchup_config) */
    uint64_t max_bytes;
} bex_ps_join_config;

/* Add the shard s (created BEX_PS_ROLE_BACKUP with BEX_PS_SHARD_CATCHUP,
 * its server listening at cfg->self) to the replica set of its running
 * primary: the primary holds new Pushes (held, never failed; at most its
 * join_pause_ms), s copies the primary (bex_ps_shard_catchup: its rows,
 * the ids of the Pushes applied and its position), the primary adds s to
 * its backups and releases the Pushes, each then forwarded to s too. From
 * then on s is a backup like the others: a Push is acknowledged once it
 * applied it. Returns 0, or the error that ended it (the primary's
 * refusal: -EPERM not a primary, -EEXIST already a backup, -ENOSPC
 * BEX_PS_BACKUPS_MAX backups, -EBUSY a cut or join under way; the copy's;
 * -ETIMEDOUT the primary's pause ran out): s is then not in the set.
 * When JOIN itself failed s is still catching up (nothing copied); after
 * a copy it serves what it copied, but no forward reaches it: it is stale
 * from then on (bex-ps --join exits 1). Blocks: never from a callback of
 * ctx. */
int bex_ps_shard_join(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_join_config *cfg);

/* ---- consistent cuts of the whole model (docs/architecture.md,
 * "Snapshots") ---- */

/* clang-format off */
#define BEX_PS_SNAPSHOT_CONFIG_INIT {.size = sizeof(bex_ps_snapshot_config)}
/* clang-format on */
typedef struct bex_ps_snapshot_config {
    size_t size;         /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    bex_dir *dir;        /* where the shards are (their primaries: listed first) */
    const char *service; /* the directory's service name ("ps") */
    uint32_t n_shards;   /* 0: as many as the directory lists now */
    uint64_t cut_id;     /* 0: the realtime clock in microseconds */
    uint32_t flags;      /* BEX_PS_SNAPSHOT_FULL */
    uint32_t timeout_ms; /* each phase's deadline, the files' writing included (10000) */
} bex_ps_snapshot_config;

/* Every shard writes a full file, whatever its cut_full_every. */
#define BEX_PS_SNAPSHOT_FULL (1u << 0)

typedef struct bex_ps_snapshot_result {
    uint64_t cut_id;
    uint64_t pause_ns_max; /* the longest a shard held Pushes for it */
    uint64_t held;         /* Pushes held, every shard */
    uint64_t rows;         /* rows written, every shard */
    uint32_t shards, full; /* shards cut; of them, those whose file is full */
} bex_ps_snapshot_result;

/* Take a consistent cut of every shard of the service, in two phases
 * over RPC (method BEX_PS_M_CUT) to the first replica the directory lists
 * of each shard (its primary): PREPARE, at which each shard holds new
 * Pushes (at most its cut_pause_ms) and copies its rows changed since its
 * last cut (optimizer state included) and the ids of the Pushes applied;
 * once every shard is prepared, COMMIT, at which each releases the Pushes
 * held and writes its file in the background (answering COMMIT when it is
 * written). What is in it: every Push acknowledged before PREPARE reached
 * its shard; of a client that waits for each Push's acknowledgement
 * before sending the next, a prefix of its Pushes (one multi-shard Push
 * may be in on one shard and not on another: a cut is not atomic across
 * the shards of one Push). Restore: bex_ps_shard_config.restore_cut.
 * Returns 0 and *out (may be NULL) when every shard wrote its file; else
 * the first error (every shard was told to abort: no file of this cut is
 * then to be restored): -EINVAL, -ENOMEM, -EHOSTUNREACH (a shard with no
 * replica), a shard's refusal (-EBUSY: a cut under way or too soon,
 * -ENOTSUP: no cut_dir, -EAGAIN: catching up), -ETIMEDOUT (a shard's pause
 * ran out before COMMIT: it aborted), a write error. Blocks: never from a
 * callback of ctx. Any thread. */
int bex_ps_snapshot_all(bex_ctx *ctx, const bex_ps_snapshot_config *cfg,
                        bex_ps_snapshot_result *out);

/* ---- client ---- */

typedef struct bex_ps_client bex_ps_client;

/* clang-format off */
#define BEX_PS_CLIENT_CONFIG_INIT {.size = sizeof(bex_ps_client_config)}
/* clang-format on */
typedef struct bex_ps_client_config {
    size_t size;                 /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    bex_dir *dir;                /* where the shards are; outlives the client */
    const char *service;         /* the directory's service name ("ps") */
    uint32_t n_shards;           /* 0: as many as the directory lists now */
    const char *locality;        /* this client's (NULL: none) */
    uint32_t timeout_ms;         /* a request's deadline (1000) */
    uint32_t attempt_timeout_ms; /* channel's (0: only failures retried) */
    uint32_t connect_timeout_ms; /* channel's (1000) */
    /* The channels' retry policy (bex_rpc_channel_config; 0: its
     * default): attempts per sub-request, the first included (3), and the
     * retry budget's burst (10) and per-call earning (100 per mille). A
     * client that must ride out a replica's death with many sub-requests
     * out on it needs a burst about as large as that number. */
    uint32_t max_attempts;
    uint32_t retry_budget_burst;
    uint32_t retry_budget_permille;
    /* BEX_PS_PUSH_ALL (0): a Push goes to every replica of its shards
     * (client fan-out); BEX_PS_PUSH_PRIMARY: to the primary alone, the
     * first replica the directory lists (primary-backup shards) */
    uint32_t push_mode;
    /* BEX_PS_PUSH_PRIMARY: a Push refused by a replica that is not the
     * primary (-EPERM, -ESTALE: a failover), refused for now (-EAGAIN),
     * in doubt (-EIO) or lost with its connection is sent again, with the same id (applied
     * once), primary_retry_ms later (50) to the next replica the directory
     * lists (re-read then; the same one after -EAGAIN), until the
     * request's deadline (timeout_ms); its status is the last attempt's.
     * The same pause spaces a Fetch's part issued again (bex_ps_fetch),
     * in every mode. */
    uint32_t primary_retry_ms;
    /* BEX_PS_PUSH_ALL: a Push whose part at a replica failed for its
     * connection, came back in doubt (-EIO) or refused for now (-EAGAIN)
     * while another replica of its shard took it is kept for that replica
     * and sent to it again, with its id (applied once), once it answers:
     * oldest first, one at a time, the first primary_retry_ms after the
     * failure, then a pause doubling to 1 s while it fails, at once after
     * a Push it took. Its report and status still tell the failed attempt.
     * Kept per replica: at most push_resend_max Pushes (1024, also the
     * most: a replica's id window) and push_resend_bytes bytes (16 MiB);
     * past either the oldest is dropped, and so is one whose sequence fell
     * 1024 behind this client's newest (the replica would refuse it:
     * -ESTALE). Dropped ones are logged and counted (push_dropped): that
     * replica misses them. */
    uint32_t push_resend_max;
    uint64_t push_resend_bytes;
} bex_ps_client_config;

enum { BEX_PS_PUSH_ALL = 0, BEX_PS_PUSH_PRIMARY = 1 };

/* Returns 0, -EINVAL (no shard), -ENOMEM, -EIO (no randomness for the
 * client's Push token: getrandom failed). */
int bex_ps_client_create(bex_ctx *ctx, const bex_ps_client_config *cfg, bex_ps_client **out);
/* Outstanding requests complete with -ECANCELED first. Never from a
 * completion. */
void bex_ps_client_destroy(bex_ps_client *c);

/* The client's channels' counters summed (the Fetch channel of every shard
 * and the Push channel of every replica): sub-requests (RPC calls), how
 * they ended, and the retries behind them (bex_rpc_channel_stats has the
 * meaning of each). */
typedef struct bex_ps_client_stats {
    uint64_t calls, ok, failed;
    uint64_t attempts, retries, retry_throttled, failovers;
    uint64_t conn_failures;
    /* Pushes kept for a replica that failed them while another replica
     * took them (bex_ps_client_config.push_resend_max), sent to it again
     * and taken, dropped unsent (past the bound, out of the replicas' id
     * window, refused, their replica gone from the directory), and kept
     * now */
    uint64_t push_kept, push_resent, push_dropped, push_held;
    /* The Push channels the client has now: one per replica the directory
     * lists, and those of replicas it no longer lists not retired yet
     * (docs/configuration.md, "PS client") */
    uint64_t push_channels;
} bex_ps_client_stats;
void bex_ps_client_stats_get(bex_ps_client *c, bex_ps_client_stats *out);

/* A request completed: 0, or the first error of its sub-requests. */
typedef void (*bex_ps_done_fn)(int status, void *user);

/* Fetch the rows of keys[0..n) of table (dim floats each) into
 * rows[i * dim ...]; keys are copied, rows must stay until done runs. On 0
 * done runs exactly once (maybe before this returns: n == 0, or every
 * sub-request failed at once); on error (-EINVAL, -E2BIG: a shard's part
 * past the wire's bounds, -ENOMEM) it does not. A Fetch is a read: a
 * shard's part (of a shard with several replicas) whose call failed for
 * its connection, came back in doubt (-EIO) or refused for now (-EAGAIN)
 * after its channel's attempts is issued again primary_retry_ms later
 * (50; the shard's channel picks the replica afresh) while its deadline
 * (timeout_ms) leaves more than that pause. So done's status is 0, a
 * shard's answer (-EINVAL, -ENOMEM, ...), -ETIMEDOUT, or one of those
 * errors (-EIO, a connection error, -EAGAIN, -EHOSTUNREACH) only when no
 * replica answered before the last pause would have passed the deadline;
 * -ECANCELED when the client is destroyed. A part is not issued again
 * with max_attempts 1 (no retries), nor when its shard has a single
 * replica listed: the error then comes at once (its channel's recovery
 * ladder reconnected already). */
int bex_ps_fetch(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                 float *rows, bex_ps_done_fn done, void *user);
/* Push grads[i * dim ...] for keys[i]; keys and grads are copied. */
int bex_ps_push(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                const float *grads, bex_ps_done_fn done, void *user);
/* A Push's outcome at one replica of one shard. */
typedef struct bex_ps_replica_result {
    uint32_t shard;
    bex_addr addr; /* the replica (AF_UNSPEC when the shard had none) */
    int status;    /* 0: it applied the Push; else the error that ended its part
                      (its answer, -ETIMEDOUT, -ECONNREFUSED, ...; -EHOSTUNREACH:
                      the shard had no replica): not known to have applied it */
} bex_ps_replica_result;

/* Replicas of one shard a Push goes to, at most (more are left out). */
#define BEX_PS_REPLICAS_MAX 16u

/* bex_ps_push, reporting every replica's outcome (BEX_PS_PUSH_PRIMARY:
 * each shard's primary's, whose 0 means every backup applied it too): on
 * 0, *n_res (may be NULL) gets the number of (shard, replica) parts the
 * Push went out as,
 * shards in order, a shard's replicas in the directory's order, and the
 * first cap of them are written to res[] (shard and addr at once, status
 * before done runs). done's status is 0 when every part succeeded, else
 * the first error. res must stay until done runs. */
int bex_ps_push_report(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                       size_t n, const float *grads, bex_ps_replica_result *res, size_t cap,
                       size_t *n_res, bex_ps_done_fn done, void *user);

/* The same, waiting. Never from a completion of the client's context. */
int bex_ps_fetch_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                      size_t n, float *rows);
int bex_ps_push_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                     const float *grads);
int bex_ps_push_report_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                            size_t n, const float *grads, bex_ps_replica_result *res, size_t cap,
                            size_t *n_res);

/* The client's counters (bex_ps_client_stats) in Prometheus text exposition
 * format (metric names bex_ps_client_*_total, label client="name", NULL:
 * "ps"), NUL-terminated, into buf (cap bytes). Returns the length it needed
 * (without the NUL), like snprintf: output is cut when that is >= cap;
 * -EINVAL. Any thread. */
int bex_ps_client_prometheus(bex_ps_client *c, const char *name, char *buf, size_t cap);

/* ---- primary-backup with failover through etcd (docs/architecture.md,
 * "Replication", etcd mode) ---- */

/* A shard's replicas in etcd mode: every replica lists the same replicas
 * (self included, at index self). Keys (no lease but the primary's):
 * <prefix>ps/<service>/<shard>/primary ("a.b.c.d:port", under the
 * primary's lease; its create_revision is the term, the epoch) and
 * .../set (the replica set: addresses, comma separated, written by the
 * primary only while its term runs). lease_ttl_ms (2000; etcd may grant
 * more) and lease_margin_ms (500): a primary acknowledges a Push only
 * before (time it sent its last keep-alive + TTL - margin).
 * forward_timeout_ms of the shard bounds how long a Push waits for a
 * backup that stopped answering before it leaves the set. */
typedef struct bex_ps_failover_config {
    size_t size;          /* sizeof(this struct): its _CONFIG_INIT sets it (bex/common.h) */
    const char *etcd_url; /* required */
    const char *prefix;   /* NULL: "/bex/" */
    const char *service;  /* NULL: "ps" */
    uint32_t shard;
    const bex_rpc_endpoint *replicas;
    size_t n_replicas; /* 1 .. BEX_PS_REPLICAS_MAX */
    uint32_t self;
    uint32_t lease_ttl_ms, lease_margin_ms;
    uint32_t resync_timeout_ms; /* a copy from a new primary (10000) */
} bex_ps_failover_config;
/* clang-format off */
#define BEX_PS_FAILOVER_CONFIG_INIT {.size = sizeof(bex_ps_failover_config)}
/* clang-format on */

typedef struct bex_ps_failover bex_ps_failover;

/* Run shard s (created BEX_PS_ROLE_BACKUP without backups, registered on
 * ctx's server) in etcd mode: a thread waits for etcd (logging what it
 * waits for), campaigns while no replica is primary (only a member of the
 * set that holds every acknowledged Push: bootstrap, or synced from a
 * primary once), leads (forwards, acknowledges only within its lease,
 * removes from the set a backup that stops answering before it goes on
 * without it) or follows (copies from each new primary before taking its
 * forwards). 0 and *out, -EINVAL, -ENOMEM. */
int bex_ps_failover_start(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_failover_config *cfg,
                          bex_ps_failover **out);
/* Stop: revoke (the term ends at once) or not (as if the process died:
 * the lease expires). Call before destroying the shard. */
void bex_ps_failover_stop(bex_ps_failover *f, bool revoke);
/* Tests: hold the lease's keep-alives (a stopped process). */
void bex_ps_failover_hold(bex_ps_failover *f, bool hold);

/* A Push sent again with its id, until acknowledged.
 * bex_ps_push_next_seq reserves the next sequence of the client's Push ids
 * (0 only for c NULL); bex_ps_push_seq is bex_ps_push_report with that
 * sequence instead of a new one (-EINVAL for seq 0). A Push that failed
 * (in doubt: its answer lost, a replica or the primary down) sent again
 * with the same seq, to the same shards, is applied once at each replica
 * whether or not it was applied there before (the id record, replicated
 * with the data under primary-backup, in snapshots and catch-up copies),
 * while the seq is within the replicas' window (1024 behind the client's
 * highest). Reuse a seq only for the same keys and gradients. */
uint64_t bex_ps_push_next_seq(bex_ps_client *c);
int bex_ps_push_seq(bex_ps_client *c, uint64_t seq, uint32_t table, uint32_t dim,
                    const uint64_t *keys, size_t n, const float *grads, bex_ps_replica_result *res,
                    size_t cap, size_t *n_res, bex_ps_done_fn done, void *user);
int bex_ps_push_seq_sync(bex_ps_client *c, uint64_t seq, uint32_t table, uint32_t dim,
                         const uint64_t *keys, size_t n, const float *grads,
                         bex_ps_replica_result *res, size_t cap, size_t *n_res);

/* ---- calls on caller memory: zero copy ---- */

/* An array of n rows of dim floats (n 1..BEX_PS_KEYS_MAX, dim
 * 1..BEX_PS_DIM_MAX) in memory ctx registered (its landing pool: the only
 * memory a peer may write), with room in front for n keys and the wire's
 * headers: what bex_ps_fetch_into and bex_ps_push_from use without a copy.
 * Counted against bex_ctx_config.user_mem_max (NULL, errno ENOBUFS past
 * it; EINVAL; ENOMEM or the registration's error). Any thread. */
float *bex_ps_rows_alloc(bex_ctx *ctx, uint32_t n, uint32_t dim);
/* Free rows from bex_ps_rows_alloc (a call still using them: once it no
 * longer does). 0 or -EINVAL (not such an array). */
int bex_ps_rows_free(float *rows);
/* The n key slots in front of rows (NULL: not such an array): keys written
 * there are sent by bex_ps_push_from without even the keys' copy. A Fetch
 * into the array writes the answer's headers (80 bytes) over the last
 * slots: write the keys again before a Push from them. */
uint64_t *bex_ps_rows_keys(float *rows);
/* 1 while a call uses rows (another call on them fails -EBUSY), 0 when
 * none does, -EINVAL (not such an array). After a Push's done with an
 * error (a deadline) the transport may still read its rows for a while. */
int bex_ps_rows_busy(float *rows);

/* bex_ps_fetch into rows from bex_ps_rows_alloc of c's context. The keys
 * must come grouped by shard (each shard's keys one run, in any order of
 * shards; -EINVAL otherwise, nothing sent): each shard's part then lands in
 * its slice of the array, rows at their keys' positions, straight from the
 * wire (a context with an RDMA device: bex_rpc_call_into, the server
 * WRITEs it into the exposed slice; a TCP-only context: it is received
 * into the transport's buffer and its rows copied there once, in order,
 * not decoded). Grouped, not permuted, because a permutation would need a
 * copy to put the rows in the caller's order. Over RDMA a part's headers
 * (80 bytes) land in front of its slice, over the last rows of the run
 * before: those few rows (80 / (4 * dim) rounded up per run) come by one
 * copying call and are put in place at the end. An answer longer than the
 * rows asked is refused (-EBADMSG or -EMSGSIZE), nothing written past
 * them; on an error rows are undefined. done runs once the array is no
 * longer written. A shard's part is issued again as bex_ps_fetch's is
 * (the same retry thread and conditions: in doubt, its connection lost or
 * -EAGAIN after its channel's attempts, primary_retry_ms later, within
 * the deadline, a shard of several replicas, max_attempts not 1: the keys
 * are then copied, 8 bytes a key), into the same slice. Errors as
 * bex_ps_fetch, and -EINVAL (rows not from bex_ps_rows_alloc of this
 * context; keys not grouped), -ENOBUFS (n * dim past the array), -EBUSY
 * (a call uses it). */
int bex_ps_fetch_into(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                      size_t n, float *rows, bex_ps_done_fn done, void *user);
/* bex_ps_push_report from grads, an array of bex_ps_rows_alloc, keys
 * grouped by shard as for bex_ps_fetch_into (-EINVAL otherwise). Each run
 * (one shard's keys) whose shard takes its Push at one replica (a single
 * replica, or BEX_PS_PUSH_PRIMARY) is sent without a copy of its
 * gradients: the first run's request from the array itself (headers and
 * its keys written in the room in front of the rows, the keys not copied
 * when keys are the array's bex_ps_rows_keys and the run covers every row
 * the array has), every other run's gathered (bex_sock_sendv: its headers
 * and keys, 8 bytes a key, in a buffer of their own, then its rows
 * straight from the array). A run whose shard has several replicas, or
 * whose part is past the wire's bounds, goes by a copying
 * bex_ps_push_report of its slice. Results in run order: res[] holds each
 * zero-copy run's entry and each copied run's replicas' entries, *n_res
 * their count. Otherwise as bex_ps_push_report. The array must not change
 * until bex_ps_rows_busy says 0 (after done on success, or a little
 * later). Errors as bex_ps_fetch_into. */
int bex_ps_push_from(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys, size_t n,
                     float *grads, bex_ps_replica_result *res, size_t cap, size_t *n_res,
                     bex_ps_done_fn done, void *user);
/* The same, waiting (push_from: until its array is free again too). */
int bex_ps_fetch_into_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                           size_t n, float *rows);
int bex_ps_push_from_sync(bex_ps_client *c, uint32_t table, uint32_t dim, const uint64_t *keys,
                          size_t n, float *grads, bex_ps_replica_result *res, size_t cap,
                          size_t *n_res);
/* How many sub-requests (one per shard) of calls on rows went without a
 * copy since bex_ps_rows_alloc (a Fetch's landed in the array, a Push's
 * was sent from it): what tells a caller, and the tests, that a call took
 * the zero-copy way. 0 also when rows is not such an array. Any thread. */
uint64_t bex_ps_rows_zero(float *rows);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif
