/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the libFuzzer targets (tests/fuzz/fuzz_*.c) and their replay
 * runner (replay.c): each target defines LLVMFuzzerTestOneInput; built with
 * clang -fsanitize=fuzzer it is a libFuzzer binary, built with replay.c
 * (any compiler) it replays a corpus directory under CTest. */
#ifndef BEX_TESTS_FUZZ_H
#define BEX_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* An invariant of the code under test. abort() (not exit) so that libFuzzer
 * keeps the input as a crash, and so that it fires in NDEBUG builds too. */
#define FZ_CHECK(cond)                                                                             \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__, __LINE__, #cond);      \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#endif
