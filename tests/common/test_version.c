/* SPDX-License-Identifier: Apache-2.0 */
/* bex_version() against the headers and the project's version. */
#include <stdio.h>

#include "bex/common.h"
#include "harness.h"

/* The library and the headers agree, and the text is the number. */
static int version_matches(void)
{
    CHECK_EQ(bex_version(), BEX_VERSION_HEX);
    CHECK(strcmp(bex_version_string(), BEX_VERSION_STRING) == 0);
    char want[32];
    snprintf(want, sizeof want, "%u.%u.%u", bex_version() >> 16, (bex_version() >> 8) & 0xff,
             bex_version() & 0xff);
    CHECK(strcmp(bex_version_string(), want) == 0);
    /* CMake's project() version, passed by tests/common/CMakeLists.txt */
    const char *project = getenv("BEX_PROJECT_VERSION");
    CHECK(project != NULL);
    CHECK(strcmp(bex_version_string(), project) == 0);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(version_matches))
