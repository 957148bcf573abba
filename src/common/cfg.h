/* SPDX-License-Identifier: Apache-2.0 */
/* Public config structs carry their size (their first member, size_t
 * size; include/bex/common.h): the library copies a caller's struct into
 * its own layout before reading it. */
#ifndef BEX_COMMON_CFG_H
#define BEX_COMMON_CFG_H

#include <stddef.h>

/* Copy the caller's config at src (its first member its size in bytes)
 * into dst (cap bytes, this library's layout): a smaller struct (an older
 * caller's) leaves the fields it lacks zero, their defaults; a larger one
 * (a newer caller's) is taken when every byte past cap is zero, -EINVAL
 * when it sets a field this library does not know. Size 0 is the
 * caller's claim to this library's layout (a struct zero-initialised
 * without BEX_*_CONFIG_INIT): dst gets cap bytes. A size below
 * sizeof(size_t) is -EINVAL. dst's size member is set to cap. */
int bex__cfg_get(void *dst, size_t cap, const void *src);

/* At the top of a public function taking `const T *cfg`: cfg, when not
 * NULL, is copied into local (a T) and points there from here on; a bad
 * size returns -EINVAL from the function. */
#define BEX__CFG_TAKE(cfg, local)                                                                  \
    do {                                                                                           \
        if (cfg) {                                                                                 \
            int bex__rc = bex__cfg_get(&(local), sizeof(local), (cfg));                            \
            if (bex__rc)                                                                           \
                return bex__rc;                                                                    \
            (cfg) = &(local);                                                                      \
        }                                                                                          \
    } while (0)

#endif
