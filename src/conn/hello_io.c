/* SPDX-License-Identifier: Apache-2.0 */
/* Blocking setup I/O with a deadline: the hello carried over a TCP socket
 * by tests and tools that set up a connection step by step (the I/O thread
 * uses its non-blocking state machine, src/conn/setup.c, instead). */
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "conn/hello_io.h"

int64_t bex__hello_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait until fd is ready for events or the deadline passes. */
static int wait_fd(int fd, short events, int64_t deadline_ms)
{
    for (;;) {
        int64_t left = deadline_ms - bex__hello_now_ms();
        if (left <= 0)
            return -ETIMEDOUT;
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, left > 60000 ? 60000 : (int)left);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n > 0) {
            if (p.revents & POLLNVAL)
                return -EBADF;
            /* POLLERR/POLLHUP: let the next recv/send report the error or
             * EOF, which is more precise than anything said here. */
            return 0;
        }
    }
}

/* MSG_DONTWAIT keeps a blocking socket from sleeping past the deadline;
 * MSG_NOSIGNAL turns a closed peer into EPIPE instead of SIGPIPE. Pipes and
 * other non-sockets (tests) fall back to read/write. */
static ssize_t send_some(int fd, const uint8_t *p, size_t n)
{
    ssize_t r = send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r < 0 && errno == ENOTSOCK)
        r = write(fd, p, n);
    return r;
}

static ssize_t recv_some(int fd, uint8_t *p, size_t n)
{
    ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
    if (r < 0 && errno == ENOTSOCK)
        r = read(fd, p, n);
    return r;
}

int bex__hello_write_all(int fd, const void *buf, size_t len, int64_t deadline_ms)
{
    const uint8_t *p = buf;
    while (len > 0) {
        int rc = wait_fd(fd, POLLOUT, deadline_ms);
        if (rc < 0)
            return rc;
        ssize_t n = send_some(fd, p, len);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return -errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int bex__hello_read_all(int fd, void *buf, size_t len, int64_t deadline_ms)
{
    uint8_t *p = buf;
    while (len > 0) {
        int rc = wait_fd(fd, POLLIN, deadline_ms);
        if (rc < 0)
            return rc;
        ssize_t n = recv_some(fd, p, len);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return -errno;
        }
        if (n == 0)
            return -ECONNRESET;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int bex__hello_send(int fd, const struct bex__hello *h, int64_t deadline_ms)
{
    uint8_t buf[BEX__HELLO_LEN];
    bex__hello_encode(h, buf);
    return bex__hello_write_all(fd, buf, sizeof buf, deadline_ms);
}

int bex__hello_recv(int fd, struct bex__hello *out, int64_t deadline_ms)
{
    uint8_t buf[BEX__HELLO_LEN];
    int rc = bex__hello_read_all(fd, buf, sizeof buf, deadline_ms);
    if (rc < 0)
        return rc;
    return bex__hello_decode(buf, sizeof buf, out);
}

int bex__hello_ready_send(int fd, uint32_t status, int64_t deadline_ms)
{
    uint8_t buf[BEX__READY_LEN];
    bex__ready_encode(status, buf);
    return bex__hello_write_all(fd, buf, sizeof buf, deadline_ms);
}

int bex__hello_ready_recv(int fd, uint32_t *status, int64_t deadline_ms)
{
    uint8_t buf[BEX__READY_LEN];
    int rc = bex__hello_read_all(fd, buf, sizeof buf, deadline_ms);
    if (rc < 0)
        return rc;
    return bex__ready_decode(buf, status);
}
