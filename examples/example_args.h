/* SPDX-License-Identifier: Apache-2.0 */
/* --help and --version, as every bex program takes them: the examples call
 * example_args() first. A bad command line is exit status 2. */
#ifndef BEX_EXAMPLE_ARGS_H
#define BEX_EXAMPLE_ARGS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <bex/common.h>

/* usage: the arguments after the program's name. */
static inline void example_args(int argc, char **argv, const char *name, const char *usage)
{
    if (argc == 2 && strcmp(argv[1], "--help") == 0) {
        printf("usage: %s %s\n", name, usage);
        exit(0);
    }
    if (argc == 2 && strcmp(argv[1], "--version") == 0) {
        printf("%s %s\n", name, bex_version_string());
        exit(0);
    }
    if (argc >= 2 && strncmp(argv[1], "--", 2) == 0) {
        fprintf(stderr, "%s: unknown option %s\nusage: %s %s\n", name, argv[1], name, usage);
        exit(2);
    }
}

#endif
