/* SPDX-License-Identifier: Apache-2.0 */
/* The context's shared secret: from the config, the environment or a key
 * file, turned into the key the setup MACs use (wire/hello.h). */
#ifndef BEX_SOCK_SECRET_H
#define BEX_SOCK_SECRET_H

#include <stddef.h>
#include <stdint.h>

#include "wire/hello.h"

/* Find the secret: secret/len when secret is non-NULL, else the environment
 * variable BEX_SECRET (its bytes, when set and non-empty), else the file
 * named by BEX_SECRET_FILE (when set and non-empty; bex_secret_load).
 * Returns 1 and fills key, 0 when there is no secret anywhere, or a negative
 * errno: -EINVAL (len non-zero with a NULL secret, or a secret of the wrong
 * size) or bex_secret_load's errors. A secret that is set but unusable is an
 * error, never a silent fall back to no authentication. */
int bex__secret_resolve(const void *secret, size_t len, uint8_t key[BEX__AUTH_KEY_LEN]);

#endif
