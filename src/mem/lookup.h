/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc's pointer-to-chunk lookup for the rest of the library: region
 * and pool of a buffer in one go (bex_mem_mr + bex_mem_pool_of each find
 * the chunk header again). */
#ifndef BEX_MEM_LOOKUP_H
#define BEX_MEM_LOOKUP_H

#include "bex/mem.h"

/* The registered region covering ptr (non-NULL, inside a live allocation),
 * and in *pool the pool it belongs to. */
const bex_mem_region *bex__mem_lookup(const void *ptr, bex_mem_pool **pool);

#endif
