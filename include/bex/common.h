/* SPDX-License-Identifier: Apache-2.0 */
/* bex: shared definitions for every module.
 *
 * Errors are values: functions return 0 on success or a negative errno
 * (-ENOMEM, -ETIMEDOUT, ...). Constructors hand objects back through an
 * out-parameter. */
#ifndef BEX_COMMON_H
#define BEX_COMMON_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "bex/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with -fvisibility=hidden: what is declared here is
 * its interface, everything else stays inside. */
#pragma GCC visibility push(default)

/* The version of the library that runs (BEX_VERSION_HEX of the headers it
 * was built with: 0x00MMmmpp), so a program can check it against the
 * headers it was compiled with (BEX_VERSION_HEX). Any thread. */
unsigned bex_version(void);
/* The same as text, "MAJOR.MINOR.PATCH" (static). Any thread. */
const char *bex_version_string(void);

/* Config structs (bex_ctx_config, bex_mem_config, bex_dir_config,
 * bex_rpc_server_config, bex_rpc_channel_config, bex_ps_table_config,
 * bex_ps_shard_config, bex_ps_catchup_config, bex_ps_client_config,
 * bex_ps_join_config, bex_ps_snapshot_config, bex_ps_failover_config,
 * bex_etcd_config) start
 * with their size: start from their BEX_*_CONFIG_INIT ({.size =
 * sizeof(T)}, the other fields zero: their defaults). A program built
 * against older headers passes its smaller struct, and the library takes
 * the fields it lacks as zero; a program built against newer headers is
 * refused (-EINVAL) only when it sets a field this library does not know.
 * Size 0 (a struct zero-initialised without the macro) claims this
 * library's own layout: right for a program built against these headers,
 * wrong once it runs on a library whose struct has grown, so use the
 * macro. The option structs bex_connect_opts and bex_rpc_call_opts grow
 * by their flags instead: a field is read only when its flag is set.
 * docs/versions.md has the policy. */

/* Text for a bex return code (a negative errno, or 0). Never NULL; the string
 * is static and may be used from any thread. */
const char *bex_strerror(int err);

/* Why the calling thread's last call that refused a caller's buffer did so,
 * as one line naming the buffer (its address and length) and what is wrong
 * with it, e.g. "buffer 0x5581c2a0 (64 bytes): not memory bex allocated
 * ...". Set by the calls whose comment says so, when they return -EINVAL
 * for a buffer (bex_sock_send and its variants, bex_sock_expose); "" while
 * none has. Thread-local: valid until the thread's next such refusal. */
const char *bex_last_error(void);

/* Log levels of the library's log hook (bex_ctx_config.log_fn). */
enum { BEX_LOG_ERROR = 1, BEX_LOG_WARN = 2, BEX_LOG_INFO = 3, BEX_LOG_DEBUG = 4 };

/* A log hook: one line (no newline) at a level. Called from bex's threads
 * (any of them), never with a bex lock held that the hook could need; it must
 * not block for long. Each place in the library that logs passes at most
 * 20 lines a second (shared by the process's contexts); the rest are
 * dropped and counted, and the next line that passes there is preceded by
 * one that says how many. */
typedef void (*bex_log_fn)(int level, const char *msg, void *arg);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif
