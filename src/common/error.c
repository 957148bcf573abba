/* SPDX-License-Identifier: Apache-2.0 */
#include <string.h>

#include "bex/common.h"

const char *bex_strerror(int err)
{
    if (err == 0)
        return "success";
    if (err > 0)
        err = -err;
    /* strerrordesc_np is thread-safe and returns static text. */
    const char *s = strerrordesc_np(-err);
    return s ? s : "unknown error";
}
