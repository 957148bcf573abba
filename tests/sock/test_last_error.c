/* SPDX-License-Identifier: Apache-2.0 */
/* bex_sock_last_error (issue 27 item 8): a socket's failure as text, over
 * RDMA (label rxe) and TCP (BEX_TEST_TRANSPORT=tcp, label tcp).
 *  - refused: a connect to a port nobody listens on: before the report
 *    "no error" and 0; after on_connect's error, that error and "peer
 *    IP:PORT: connecting: Connection refused".
 *  - frozen: the server (a child process) frozen with SIGSTOP: after
 *    on_error, -ETIMEDOUT and "peer IP:PORT: Connection timed out (bex:
 *    ..."; a NULL buffer still returns the code. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "echo.h"
#include "port.h"

struct cli {
    struct waiter w;
    _Atomic long connected, errors, closed;
    _Atomic int status;
};

static void cli_connected(bex_sock *s, int status, void *user)
{
    (void)s;
    struct cli *c = user;
    atomic_store(&c->status, status);
    waiter_add(&c->w, &c->connected, 1);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    (void)s, (void)err;
    waiter_add(&((struct cli *)user)->w, &((struct cli *)user)->errors, 1);
}

static void cli_closed(bex_sock *s, void *user)
{
    (void)s;
    waiter_add(&((struct cli *)user)->w, &((struct cli *)user)->closed, 1);
}

static const bex_sock_ops cli_ops = {
    .on_connect = cli_connected, .on_error = cli_error, .on_close = cli_closed};

/* "peer IP:PORT: " for a */
static void peer_prefix(const bex_addr *a, char *out, size_t cap)
{
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &a->in4.sin_addr, ip, sizeof ip);
    snprintf(out, cap, "peer %s:%u: ", ip, ntohs(a->in4.sin_port));
}

static int refused(void)
{
    struct in_addr a0, a1;
    PAIR_NEED(pair_addrs(&a0, &a1));
    bex_ctx *ctx = local_ctx(NULL, a1);
    bex_addr to = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    to.in4.sin_port = htons(bex_test_port_at(a0)); /* reserved, nobody listens */
    struct cli c = {.w = WAITER_INIT};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(ctx, &to, &cli_ops, &c, &s));
    CHECK_OK(wait_count(&c.w, &c.connected, 1, 10000));
    CHECK_EQ(atomic_load(&c.status), -ECONNREFUSED);
    char text[256], want[256];
    CHECK_EQ(bex_sock_last_error(s, text, sizeof text), -ECONNREFUSED);
    fprintf(stderr, "%s\n", text);
    peer_prefix(&to, want, sizeof want);
    strcat(want, "connecting: ");
    strcat(want, bex_strerror(-ECONNREFUSED));
    CHECK(strcmp(text, want) == 0);
    char small[8];
    CHECK_EQ(bex_sock_last_error(s, small, sizeof small), -ECONNREFUSED);
    CHECK_EQ(strlen(small), sizeof small - 1);
    bex_sock_close(s);
    CHECK_OK(wait_count(&c.w, &c.closed, 1, 10000));
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

static int frozen_client(struct pair *p, void *arg)
{
    (void)arg;
    struct cli c = {.w = WAITER_INIT};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &cli_ops, &c, &s));
    CHECK_OK(wait_count(&c.w, &c.connected, 1, 10000));
    CHECK_EQ(atomic_load(&c.status), 0);
    char text[256], want[256];
    CHECK_EQ(bex_sock_last_error(s, text, sizeof text), 0);
    CHECK(strcmp(text, "no error") == 0);
    kill(p->child, SIGSTOP);
    CHECK_OK(wait_count(&c.w, &c.errors, 1, 10000));
    CHECK_EQ(bex_sock_last_error(s, text, sizeof text), -ETIMEDOUT);
    fprintf(stderr, "%s\n", text);
    peer_prefix(&p->srv, want, sizeof want);
    strcat(want, bex_strerror(-ETIMEDOUT));
    CHECK(strcmp(text, want) == 0);
    CHECK_EQ(bex_sock_last_error(s, NULL, 0), -ETIMEDOUT);
    bex_sock_close(s);
    CHECK_OK(wait_count(&c.w, &c.closed, 1, 10000));
    kill(p->child, SIGKILL);
    waitpid(p->child, NULL, 0);
    p->child = 0;
    return 0;
}

static int frozen(void)
{
    bex_ctx_config cfg = {.keepalive_ms = 100, .keepalive_timeout_ms = 1500};
    return pair_run(&cfg, echo_srv_main, NULL, &cfg, frozen_client, NULL, 60);
}

BEX_TEST_MAIN(BEX_CASE(refused), BEX_CASE(frozen))
