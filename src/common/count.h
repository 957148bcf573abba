/* SPDX-License-Identifier: Apache-2.0 */
/* A statistics counter of one writer thread that other threads read
 * (relaxed atomic loads): the writer adds with a plain load and store,
 * no locked instruction. On x86-64 the add is one instruction on the
 * counter in memory (add to a memory operand) rather than a load, an add
 * and a store: an aligned 8-byte write, so a reader sees the value before
 * or after it, as with the store (issue 25 item 2: a round trip's
 * counters in the I/O loop and the engine, some 20-30 of them, were
 * three instructions each). Sanitizer builds keep the C11 atomics, which
 * ThreadSanitizer sees (it does not see an asm's access). */
#ifndef BEX_COMMON_COUNT_H
#define BEX_COMMON_COUNT_H

#include <stdatomic.h>
#include <stdint.h>

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define BEX__COUNT_C11 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define BEX__COUNT_C11 1
#endif
#endif

static inline void bex__count_add(_Atomic uint64_t *c, uint64_t n)
{
#if !defined(BEX__COUNT_C11) && defined(__x86_64__)
    __asm__("addq %1, %0" : "+m"(*(uint64_t *)c) : "er"(n));
#else
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + n,
                          memory_order_relaxed);
#endif
}

#endif
