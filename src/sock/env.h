/* SPDX-License-Identifier: Apache-2.0 */
/* Environment overrides of a context's configuration: the one function
 * that reads them (docs/configuration.md, "Environment"). */
#ifndef BEX_SOCK_ENV_H
#define BEX_SOCK_ENV_H

#include <stddef.h>

#include "bex/sock.h"

/* Applies every BEX_* variable of the table in env.c that is set to *cfg
 * (a variable wins over the field). Returns 0, or -EINVAL when one holds a
 * bad value: then *cfg is unchanged and why (cap bytes) names the variable,
 * its value and what it may be. *applied (when not NULL) counts the
 * variables applied. */
int bex__ctx_env(bex_ctx_config *cfg, char *why, size_t cap, unsigned *applied);

#endif
