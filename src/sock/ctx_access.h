/* SPDX-License-Identifier: Apache-2.0 */
/* What layers above the socket API (src/rpc) may ask of a context beyond
 * include/bex/sock.h: its logger, and whether the calling thread is one of
 * its I/O threads (a wait for a callback there would wait for itself). */
#ifndef BEX_SOCK_CTX_ACCESS_H
#define BEX_SOCK_CTX_ACCESS_H

#include <stdbool.h>

#include "bex/sock.h"

struct bex__log;

struct bex__log *bex__ctx_log(bex_ctx *ctx);
bool bex__ctx_on_io_thread(const bex_ctx *ctx);

#endif
