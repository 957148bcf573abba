/* SPDX-License-Identifier: Apache-2.0 */
/* A server in a child process, for the tests whose client makes its own
 * context (tests/rpc/rpc_test.h, tests/ps/ps_test.h): the child listens on
 * ADDR0, reports its port, and serves until the parent tells it to go; the
 * parent reaps it with a deadline. pair_run (pair.h) is the same for one
 * server and a client function. */
#ifndef BEX_TEST_CHILD_H
#define BEX_TEST_CHILD_H

#include <errno.h>
#include <sys/socket.h>

#include "sock/pair.h"

struct srv_proc {
    pid_t pid;
    bex_addr addr; /* ADDR0 and the port the child reported */
    int to_child;
};

/* The child's function: write the port it listens on (network order, 2
 * bytes) to wfd, read rfd until the parent says to go (a byte, or EOF:
 * the parent is gone), tear down and exit(). */
typedef void (*srv_child_fn)(int wfd, int rfd, void *arg);

/* Fork child(arg); back when it reported its port (30 s, scaled). Call
 * before the client's context exists. */
static inline void srv_spawn(struct srv_proc *sp, srv_child_fn child, void *arg)
{
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    int up[2], down[2];
    signal(SIGPIPE, SIG_IGN);
    CHECK(pipe(up) == 0 && pipe(down) == 0);
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        child(up[1], down[0], arg);
    }
    close(up[1]);
    close(down[0]);
    uint16_t port = 0;
    struct pollfd pf = {.fd = up[0], .events = POLLIN};
    CHECK(poll(&pf, 1, (int)(30000 * time_scale())) == 1);
    CHECK(read(up[0], &port, sizeof port) == sizeof port);
    close(up[0]);
    *sp = (struct srv_proc){.pid = pid, .to_child = down[1]};
    sp->addr = (bex_addr){.in4 = {.sin_family = AF_INET, .sin_port = port, .sin_addr = a0}};
}

/* Kill a server with -9 and hold its port: bound (not listening) by the
 * caller, so that connections to it are refused until the caller closes
 * the descriptor returned. Without it another test running beside this
 * one may be given the port and answer in the dead server's place (seen
 * in CI: a killed replica "answered again"). -1 when the port could not
 * be had within 10 s (scaled). Reap the server with srv_stop(sp, true). */
static inline int srv_kill_hold(struct srv_proc *sp)
{
    if (kill(sp->pid, SIGKILL) != 0)
        return -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    /* bound as soon as the dead server's listener is closed */
    while (bind(fd, (const struct sockaddr *)&sp->addr, sizeof sp->addr) != 0) {
        if (errno != EADDRINUSE || pair_now_ms() >= end) {
            close(fd);
            return -1;
        }
        pair_sleep_ms(1);
    }
    return fd;
}

/* Tell a server to go and check it left cleanly (or reap a killed one:
 * expect_kill) within 30 s (scaled). Returns 0 or -1. */
static inline int srv_stop(struct srv_proc *sp, bool expect_kill)
{
    char q = 'q';
    if (write(sp->to_child, &q, 1) < 0) {
        /* gone already (killed on purpose): its status says how */
    }
    close(sp->to_child);
    int status = 0;
    uint64_t end = pair_now_ms() + 30000ull * time_scale();
    pid_t w;
    while ((w = waitpid(sp->pid, &status, WNOHANG)) == 0 && pair_now_ms() < end)
        pair_sleep_ms(10);
    if (w == 0) {
        fprintf(stderr, "server %d did not finish\n", (int)sp->pid);
        pair_dump_stacks(sp->pid);
        kill(sp->pid, SIGKILL);
        waitpid(sp->pid, &status, 0);
        return -1;
    }
    if (expect_kill)
        return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL ? 0 : -1;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "server %d failed (status 0x%x)\n", (int)sp->pid, status);
        return -1;
    }
    return 0;
}

#endif
