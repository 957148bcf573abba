/* SPDX-License-Identifier: Apache-2.0 */
/* What layers above the socket API (src/rpc) may ask of a context beyond
 * include/bex/sock.h: its logger, and whether the calling thread is one of
 * its I/O threads (a wait for a callback there would wait for itself). */
#ifndef BEX_SOCK_CTX_ACCESS_H
#define BEX_SOCK_CTX_ACCESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/sock.h"

struct bex__log;

struct bex__log *bex__ctx_log(bex_ctx *ctx);
bool bex__ctx_on_io_thread(const bex_ctx *ctx);

/* Caller memory (the PS client's zero-copy arrays): len bytes of the
 * context's landing memory, counted against cfg.user_mem_max. NULL with
 * errno ENOBUFS past it, or the allocator's error. Freed with
 * bex__ctx_user_free (any thread); bex__ctx_user_bytes: what is counted. */
void *bex__ctx_user_alloc(bex_ctx *ctx, size_t len);
void bex__ctx_user_free(bex_ctx *ctx, void *p, size_t len);
uint64_t bex__ctx_user_bytes(bex_ctx *ctx);

#endif
