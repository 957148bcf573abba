/* SPDX-License-Identifier: Apache-2.0 */
#include "common/cfg.h"

#include <errno.h>
#include <string.h>

int bex__cfg_get(void *dst, size_t cap, const void *src)
{
    size_t size;
    memcpy(&size, src, sizeof size);
    if (size == 0)
        size = cap;
    if (size < sizeof size)
        return -EINVAL;
    if (size > cap) {
        /* a newer caller's: what we do not know must be left zero */
        const unsigned char *extra = (const unsigned char *)src + cap;
        for (size_t i = 0; i < size - cap; i++)
            if (extra[i])
                return -EINVAL;
    }
    memset(dst, 0, cap);
    memcpy(dst, src, size < cap ? size : cap);
    memcpy(dst, &cap, sizeof cap);
    return 0;
}
