/* SPDX-License-Identifier: Apache-2.0 */
/* alloccount: an LD_PRELOAD library that counts a process's heap
 * allocations (malloc, calloc, realloc), for bench/cost/ps-fanout's
 * "allocs" tool where valgrind memcheck would take a minute to start a
 * few servers on a loaded host. At exit it appends one line to
 * $BEX_ALLOCCOUNT_OUT:
 *   pid allocations
 * It counts the calls that reach glibc's allocator through the dynamic
 * linker, as memcheck does (bex's own pools are not among them). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t n);

static _Atomic uint64_t n_allocs;

void *malloc(size_t n)
{
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    return __libc_malloc(n);
}

void *calloc(size_t n, size_t size)
{
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    return __libc_calloc(n, size);
}

void *realloc(void *p, size_t n)
{
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    return __libc_realloc(p, n);
}

/* the count taken before the line is written (dprintf allocates nothing
 * we count twice: the count is read first) */
__attribute__((destructor)) static void alloccount_out(void)
{
    const char *path = getenv("BEX_ALLOCCOUNT_OUT");
    if (!path)
        return;
    uint64_t n = atomic_load(&n_allocs);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    dprintf(fd, "%ld %llu\n", (long)getpid(), (unsigned long long)n);
    close(fd);
}
