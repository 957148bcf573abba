/* SPDX-License-Identifier: Apache-2.0 */
/* tcp-echo: the floor bench/cost sets bex's TCP transport beside, a
 * ping-pong of SIZE-byte messages over one blocking kernel TCP socket
 * (TCP_NODELAY), one write and one read per message and side when the
 * message fits a segment.
 *   tcp-echo -s PORT SIZE           serve one connection: echo until EOF
 *   tcp-echo -c HOST PORT SIZE N    N round trips, then close */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int die(const char *what)
{
    fprintf(stderr, "tcp-echo: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* Exactly n bytes, or 0 at EOF before the first. */
static int read_full(int fd, char *p, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, p + got, n - got);
        if (r == 0 && got == 0)
            return 0;
        if (r <= 0)
            die("read");
        got += (size_t)r;
    }
    return 1;
}

static void write_full(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w <= 0)
            die("write");
        p += w;
        n -= (size_t)w;
    }
}

static int serve(int port, size_t size, char *buf)
{
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1))
        die("listen");
    int fd = accept(ls, NULL, NULL);
    if (fd < 0)
        die("accept");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    while (read_full(fd, buf, size))
        write_full(fd, buf, size);
    return 0;
}

static int ping(const char *host, int port, size_t size, long n, char *buf)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
        fprintf(stderr, "tcp-echo: bad address %s\n", host);
        return 2;
    }
    if (connect(fd, (struct sockaddr *)&a, sizeof a))
        die("connect");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    memset(buf, 0x5a, size);
    for (long i = 0; i < n; i++) {
        write_full(fd, buf, size);
        if (!read_full(fd, buf, size)) {
            fprintf(stderr, "tcp-echo: server closed after %ld\n", i);
            return 1;
        }
    }
    return 0;
}

#define TCP_ECHO_USAGE "usage: bex-tcp-echo -s PORT SIZE | -c HOST PORT SIZE N\n"

int main(int argc, char **argv)
{
    static char buf[1 << 20];
    if (argc == 2 && !strcmp(argv[1], "--help"))
        return printf(TCP_ECHO_USAGE), 0;
    if (argc == 2 && !strcmp(argv[1], "--version"))
        return printf("bex-tcp-echo %s\n", BEX_TCP_ECHO_VERSION), 0;
    if (argc == 4 && !strcmp(argv[1], "-s")) {
        size_t size = strtoul(argv[3], NULL, 0);
        if (size == 0 || size > sizeof buf)
            return fprintf(stderr, "tcp-echo: SIZE 1..%zu\n", sizeof buf), 2;
        return serve(atoi(argv[2]), size, buf);
    }
    if (argc == 6 && !strcmp(argv[1], "-c")) {
        size_t size = strtoul(argv[4], NULL, 0);
        if (size == 0 || size > sizeof buf)
            return fprintf(stderr, "tcp-echo: SIZE 1..%zu\n", sizeof buf), 2;
        return ping(argv[2], atoi(argv[3]), size, atol(argv[5]), buf);
    }
    fprintf(stderr, TCP_ECHO_USAGE);
    return 2;
}
