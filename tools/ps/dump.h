/* SPDX-License-Identifier: Apache-2.0 */
/* bex-ps dump (dump.c): a snapshot's tables as .npy files. */
#ifndef BEX_PS_DUMP_H
#define BEX_PS_DUMP_H

#include <stdbool.h>

/* argv: "dump", SNAPSHOT, DIR. The process's exit status. */
int bex_ps_dump_main(int argc, char **argv);

#endif
