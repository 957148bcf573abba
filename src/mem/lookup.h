/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc's pointer-to-chunk lookup for the rest of the library: region
 * and pool of a buffer in one go (bex_mem_mr + bex_mem_pool_of each find
 * the chunk header again). */
#ifndef BEX_MEM_LOOKUP_H
#define BEX_MEM_LOOKUP_H

#include "bex/mem.h"

/* The registered region of the mapping holding ptr, and in *pool the pool
 * it belongs to; NULL (and *pool NULL) when no pool mapped memory at ptr
 * (malloc's, the stack, a freed huge mapping): any pointer may be asked. */
const bex_mem_region *bex__mem_lookup(const void *ptr, bex_mem_pool **pool);

#endif
