/* SPDX-License-Identifier: Apache-2.0 */
/* The I/O threads' system calls per message (a TCP read and send, the
 * loop's wait) made through syscall(2) rather than libc's wrappers: those
 * are cancellation points, and each wraps the call in two atomic updates
 * of the thread's cancellation state (__pthread_enable_asynccancel and
 * __pthread_disable_asynccancel, some 30 instructions a call: 90 of a
 * sub-request's, issue 25 item 5). bex never cancels a thread and
 * supports no pthread_cancel of its callers' threads in these calls (they
 * run on bex's own I/O threads). Same results and errno as the wrappers. */
#ifndef BEX_COMMON_SYS_H
#define BEX_COMMON_SYS_H

#include <stddef.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* Sanitizer builds keep libc's calls: ThreadSanitizer takes a send and
 * the read of it, or an epoll_ctl and the wait that reports it, as
 * synchronization, and AddressSanitizer checks the buffers, only through
 * its interceptors of the libc functions. */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define BEX__SYS_LIBC 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define BEX__SYS_LIBC 1
#endif
#endif

/* On x86-64 Linux the system call instruction itself, inline: syscall(2)
 * is a libc function of its own (its call, its argument shuffle and its
 * errno test, some 12 instructions a call; issue 25 item 2). The
 * kernel's convention: the number and the result in rax, the arguments in
 * rdi, rsi, rdx, r10; rcx and r11 clobbered; -errno returned as
 * -4095..-1. */
#if !defined(BEX__SYS_LIBC) && defined(__x86_64__) && defined(__linux__)
#include <errno.h>
#define BEX__SYS_ASM 1
static inline long bex__sys4(long nr, long a, long b, long c, long d)
{
    long r;
    register long r10 __asm__("r10") = d;
    __asm__ volatile("syscall"
                     : "=a"(r)
                     : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10)
                     : "rcx", "r11", "memory");
    if (__builtin_expect((unsigned long)r > -4096UL, 0)) {
        errno = (int)-r;
        return -1;
    }
    return r;
}
#endif

static inline ssize_t bex__sys_readv(int fd, const struct iovec *iov, int n)
{
#if defined(BEX__SYS_LIBC)
    return readv(fd, iov, n);
#elif defined(BEX__SYS_ASM)
    return bex__sys4(SYS_readv, fd, (long)iov, n, 0);
#else
    return syscall(SYS_readv, fd, iov, n);
#endif
}

static inline ssize_t bex__sys_sendmsg(int fd, const struct msghdr *mh, int flags)
{
#if defined(BEX__SYS_LIBC)
    return sendmsg(fd, mh, flags);
#elif defined(BEX__SYS_ASM)
    return bex__sys4(SYS_sendmsg, fd, (long)mh, flags, 0);
#else
    return syscall(SYS_sendmsg, fd, mh, flags);
#endif
}

static inline int bex__sys_epoll_wait(int epfd, struct epoll_event *ev, int max, int timeout_ms)
{
#if defined(BEX__SYS_LIBC)
    return epoll_wait(epfd, ev, max, timeout_ms);
#elif defined(BEX__SYS_ASM)
    return (int)bex__sys4(SYS_epoll_wait, epfd, (long)ev, max, timeout_ms);
#elif defined(SYS_epoll_wait)
    return (int)syscall(SYS_epoll_wait, epfd, ev, max, timeout_ms);
#else
    /* (architectures without epoll_wait: what libc's wrapper calls) */
    return (int)syscall(SYS_epoll_pwait, epfd, ev, max, timeout_ms, NULL, (size_t)8);
#endif
}

#endif
