/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: a primary's Pushes out to its backups (repl.c), shared
 * with the batching of forwards (repl_batch.c). */
#ifndef BEX_PS_REPL_BATCH_H
#define BEX_PS_REPL_BATCH_H

#include <stdatomic.h>
#include <stdint.h>

#include "ps/ps_internal.h"
#include "ps/shard_internal.h"

/* A client's Push out to the backups: answered when the last is back. */
struct fop;
struct fcall {
    struct fop *op;
    uint32_t b;          /* the backup */
    uint64_t epoch;      /* etcd mode: the term it was sent in */
    struct fcall *rm_nx; /* waiting for b's removal (repl.rm) */
    struct fcall *q_nx;  /* queued for b, or in the same batch */
};
struct fop {
    bex_ps_shard *s;
    bex_rpc_req *req;
    struct bex__ps_hdr h;  /* the answer's */
    uint64_t lsn;          /* its number (lag.c) */
    _Atomic uint32_t left; /* forwards out, + 1 while sending */
    _Atomic int status;
    uint8_t *body; /* the client's Push body, len bytes (forwarded) */
    size_t len;
    struct fcall calls[];
};

/* repl.c: a forward of fc's Push to its backup done (status 0: applied). */
void bex__ps_fwd_done(int status, struct fcall *fc);
/* repl.c: a client's Push body (len bytes) of forward lsn decoded. */
int bex__ps_fwd_decode(bex_ps_shard *s, const uint8_t *push, size_t len, uint64_t lsn,
                       struct fwdh **out);
void bex__ps_fwdh_free(struct fwdh *f);
/* repl.c: the deadline of a forward to b (under s->mu): forward_timeout_ms,
 * plus backup_connect_timeout_ms until a forward to b was answered once. */
uint32_t bex__ps_fwd_timeout(const struct repl *rp, const struct backup *b);

/* repl_batch.c. The bounds from cfg (-EINVAL past their maxima). */
int bex__ps_batch_init(struct repl *rp, const bex_ps_shard_config *cfg);
/* op's Push (numbered) queued on every backup of the set, in lsn order
 * (under s->mu); op->left set. */
void bex__ps_batch_queue_locked(bex_ps_shard *s, struct fop *op);
/* Send what is queued, as far as the batches out allow (not under s->mu). */
void bex__ps_batch_pump(bex_ps_shard *s);
/* Backup b's channel is about to be destroyed: nothing more sent (under
 * s->mu); after it was, its queued forwards done with status. */
void bex__ps_batch_close_locked(struct backup *b);
void bex__ps_batch_drain(struct backup *b, int status);
/* A batch's entries (p, len bytes after the forward header; first: the
 * header's lsn) checked and decoded whole into a chain (*out), or the
 * error that refuses it (logged; nothing of it applied). */
int bex__ps_batch_decode(bex_ps_shard *s, uint64_t first, const uint8_t *p, size_t len,
                         struct fwdh **out);

#endif
