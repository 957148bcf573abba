/* SPDX-License-Identifier: Apache-2.0 */
/* bex-grpc-bench's stand-in when CMake did not find gRPC C++ (see
 * bench/grpc/CMakeLists.txt): it says so and fails, so that whoever runs the
 * comparison learns why instead of getting a table without gRPC. */
#include <stdio.h>

int main(void)
{
    fprintf(stderr,
            "bex-grpc-bench: cannot run: built without gRPC C++ (missing at configure time: %s)."
            " Run scripts/deps, then configure and build again.\n",
            BEX_GRPC_MISSING);
    return 2;
}
