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
};
struct fop {
    bex_ps_shard *s;
    bex_rpc_req *req;
    struct bex__ps_hdr h;  /* the answer's */
    uint64_t lsn;          /* its number (lag.c) */
    _Atomic uint32_t left; /* forwards out, + 1 while sending */
    _Atomic int status;
    struct fcall calls[];
};

#endif
