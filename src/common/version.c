/* SPDX-License-Identifier: Apache-2.0 */
/* bex_version(): the library's own version, from the generated header. */
#include "bex/common.h"

unsigned bex_version(void)
{
    return BEX_VERSION_HEX;
}

const char *bex_version_string(void)
{
    return BEX_VERSION_STRING;
}
