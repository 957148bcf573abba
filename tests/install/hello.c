/* SPDX-License-Identifier: Apache-2.0 */
/* An outside program built against an installed bex (tests/install). */
#include <stdio.h>

#include <bex/common.h>
#include <bex/mem.h>

int main(void)
{
    if (bex_version() != BEX_VERSION_HEX) {
        fprintf(stderr, "library %s, headers %s\n", bex_version_string(), BEX_VERSION_STRING);
        return 1;
    }
    printf("bex %s\n", bex_version_string());
    return 0;
}
