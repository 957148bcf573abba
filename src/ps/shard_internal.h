/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard's private header: its tables, the ids of applied Pushes,
 * held requests and catch-up copies, shared by the files of the shard
 * (shard.c, shard_hash.c, table.c, pushid.c, snapshot.c, request.c,
 * catchup_peer.c, catchup.c). */
#ifndef BEX_PS_SHARD_INTERNAL_H
#define BEX_PS_SHARD_INTERNAL_H

#include <pthread.h>
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
#define IDS_WINDOW   1024u
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
};

/* A primary's backup. */
struct backup {
    bex_addr addr;
    uint32_t transport;
    bex_rpc_channel *ch; /* made at register */
    bool down;           /* a forward failed: no Push acknowledged from then on */
    bool probing;        /* down: a probe is out */
    uint64_t probe_ns;   /* down: no probe before then */
};

/* Primary-backup replication (repl.c), under the shard's lock. */
struct repl {
    uint32_t role;
    bex_ctx *ctx; /* register's */
    /* primary: its backups, its session and the last lsn numbered */
    struct backup *bk;
    size_t n_bk;
    uint32_t n_down, fwd_timeout_ms;
    uint64_t retry_ns; /* a down backup probed at most this often */
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
};

/* A handler's answer will be sent later (bex_rpc_reply), not now. */
#define BEX__PS_LATER 1

/* The copy a restarted peer pulls (BEX_PS_M_COPY): one at a time. */
struct copy {
    uint64_t session, used_ns;
    char *buf;
    size_t len;
};

struct bex_ps_shard {
    uint32_t shard, n_shards;
    struct reg regs[4]; /* the handlers' user pointers */
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
    bool catching;     /* BEX_PS_SHARD_CATCHUP until bex_ps_shard_catchup ends */
    bool catchup_busy; /* bex_ps_shard_catchup called (once) */
    struct held *held, **held_tail;
    uint64_t held_bytes, held_max;
    struct copy cp;
    struct repl rp;
};

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
int bex__ps_serve_fetch(bex_ps_shard *s, bex_ctx *ctx, const struct bex__ps_hdr *h,
                        const uint8_t *p, void **resp, size_t *resp_len);
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

#endif
