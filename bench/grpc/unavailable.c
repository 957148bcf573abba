/* SPDX-License-Identifier: Apache-2.0 */
/* bex-grpc-bench's stand-in when CMake did not find gRPC C++ (see
 * bench/grpc/CMakeLists.txt): it says so and fails, so that whoever runs the
 * comparison learns why instead of getting a table without gRPC. --help and
 * --version answer as every program's do. */
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--version") == 0) {
        printf("bex-grpc-bench %s\n", BEX_GRPC_BENCH_VERSION);
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "--help") == 0) {
        printf("usage: bex-grpc-bench (not built: gRPC C++ was missing at configure time: %s)\n",
               BEX_GRPC_MISSING);
        return 0;
    }
    fprintf(stderr,
            "bex-grpc-bench: cannot run: built without gRPC C++ (missing at configure time: %s)."
            " Run scripts/deps, then configure and build again.\n",
            BEX_GRPC_MISSING);
    return 2;
}
