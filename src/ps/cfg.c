/* SPDX-License-Identifier: Apache-2.0 */
#include "ps/cfg.h"

#include <errno.h>
#include <string.h>

#include "common/cfg.h"

int bex__ps_tables_take(bex_ps_shard_config *c, bex_ps_table_config *tabs)
{
    if (!c->tables || c->n_tables == 0 || c->n_tables > BEX_PS_TABLES_MAX)
        return 0;
    size_t stride;
    memcpy(&stride, c->tables, sizeof stride);
    if (stride == 0)
        stride = sizeof *tabs;
    if (stride < sizeof stride)
        return -EINVAL;
    const unsigned char *p = (const unsigned char *)c->tables;
    for (size_t i = 0; i < c->n_tables; i++) {
        int rc = bex__cfg_get(&tabs[i], sizeof tabs[i], p + i * stride);
        if (rc)
            return rc;
    }
    c->tables = tabs;
    return 0;
}
