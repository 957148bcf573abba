/* SPDX-License-Identifier: Apache-2.0 */
#include "harness.h"
#include "bex/common.h"

static int strerror_texts(void)
{
    CHECK(strcmp(bex_strerror(0), "success") == 0);
    CHECK(strstr(bex_strerror(-ENOMEM), "memory") != NULL);
    /* positive and negative codes name the same error */
    CHECK(strcmp(bex_strerror(ETIMEDOUT), bex_strerror(-ETIMEDOUT)) == 0);
    CHECK(bex_strerror(-99999) != NULL);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(strerror_texts))
