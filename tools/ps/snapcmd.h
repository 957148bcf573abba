/* SPDX-License-Identifier: Apache-2.0 */
/* bex-ps's operations commands: `bex-ps snapshot` (a consistent cut of
 * the whole model) and --join (a new backup joins its primary). */
#ifndef BEX_TOOLS_PS_SNAPCMD_H
#define BEX_TOOLS_PS_SNAPCMD_H

#include "bex/ps.h"

/* `bex-ps snapshot ARGS` (argv[0] is "snapshot"): the exit status. */
int bex_ps_tool_snapshot(int argc, char **argv);

/* bex_ps_shard_join of s to primary, self its address (logged). */
int bex_ps_tool_join(bex_ps_shard *s, bex_ctx *ctx, const bex_rpc_endpoint *primary,
                     const bex_dir_replica *self, uint32_t timeout_ms);

#endif
