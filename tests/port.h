/* SPDX-License-Identifier: Apache-2.0 */
/* Ports a test names before anything listens on them (a cluster file, a
 * process started later, an etcd URL), reserved race-free.
 *
 * Choosing a port by binding port 0 and closing the socket is racy: until
 * the test's listener binds it, the kernel may hand the same port to
 * another test's outgoing connection or bind (ctest -j runs tests side by
 * side), and the listener then fails with EADDRINUSE. Here the choosing
 * socket stays bound, with SO_REUSEADDR and without listening, for the
 * rest of the process's life: the kernel never picks a bound port for
 * another socket (port 0 or a connect), while a listener that sets
 * SO_REUSEADDR itself (bex's, etcd's) may bind and listen on it. The
 * socket is close-on-exec: processes the test starts do not hold it.
 * Linux semantics; every bex test runs on Linux. */
#ifndef BEX_TEST_PORT_H
#define BEX_TEST_PORT_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"

/* A TCP port on a, free now and reserved for this process's life. */
static inline uint16_t bex_test_port_at(struct in_addr a)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    int one = 1;
    CHECK(setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr = a};
    socklen_t l = sizeof sa;
    CHECK(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    CHECK(getsockname(fd, (struct sockaddr *)&sa, &l) == 0);
    return ntohs(sa.sin_port); /* fd stays open: the reservation */
}

/* The same on 127.0.0.1. */
static inline uint16_t bex_test_port(void)
{
    return bex_test_port_at((struct in_addr){.s_addr = htonl(INADDR_LOOPBACK)});
}

/* Reserve port on a if nothing else holds it (the bind has no
 * SO_REUSEADDR, so another test's reservation refuses it), then let a
 * listener that sets SO_REUSEADDR take it, as above: 0 or -1. */
static inline int bex_test_port_take(struct in_addr a, uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr = a};
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return -1;
    }
    int one = 1;
    CHECK(setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
    return 0; /* fd stays open: the reservation */
}

/* n consecutive ports on 127.0.0.1, first returned, each reserved as
 * above (bex-ps --etcd --listen IP:PORT serves shard i at PORT + i). */
static inline uint16_t bex_test_port_run(int n)
{
    struct in_addr lo = {.s_addr = htonl(INADDR_LOOPBACK)};
    for (int tries = 0; tries < 1000; tries++) {
        uint16_t p = bex_test_port_at(lo);
        int i = 1;
        while (i < n && p + i <= 65535 && bex_test_port_take(lo, (uint16_t)(p + i)) == 0)
            i++;
        if (i == n)
            return p;
    }
    CHECK(!"no run of free ports");
    return 0;
}

#endif
