/* SPDX-License-Identifier: Apache-2.0 */
/* The shard's table array, in the caller's struct size (common/cfg.h). */
#ifndef BEX_PS_CFG_H
#define BEX_PS_CFG_H

#include "bex/ps.h"

/* Copy c->tables[0..c->n_tables) into tabs (BEX_PS_TABLES_MAX of this
 * library's layout), stepping by the first table's size (the caller's
 * sizeof; 0: ours), and point c->tables there. Nothing to do (0) when
 * tables is NULL or n_tables is out of range: the caller's checks refuse
 * those. -EINVAL for a table whose size is bad. */
int bex__ps_tables_take(bex_ps_shard_config *c, bex_ps_table_config *tabs);

#endif
