/* SPDX-License-Identifier: Apache-2.0 */
/* A peer's first RDMA message may come before its readiness notice over TCP
 * (docs/protocol.md, "Connection setup"): the client sends its notice and,
 * once it has the listener's, its first frames at once; on the listener the
 * two race. The accepted socket must work from its first message: the
 * server answering it at once (an echo from on_recv) crashed when the
 * connection had no transport yet (UBSan: "member access within null
 * pointer of type 'struct bex__xport'" in do_send; test_adversary.setup
 * under ASan in the VM).
 *
 * The race is made likely: one socket keeps the listener's I/O thread busy
 * (while busy it looks at its TCP sockets on every 64th turn only, at the
 * CQ on every turn), and new connections, from a context each, send at
 * once and wait for their echo, ROUNDS times. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "echo.h"

#define ROUNDS        24
#define BUSY_LEN      (64 * 1024)
#define BUSY_INFLIGHT 8

/* ---------------- clients ---------------- */

struct cli {
    struct waiter w;
    _Atomic long recvd, done, errors, closed;
    _Atomic long send_failed;
    bex_sock *s;
    bool busy; /* resend each echo: keep the server busy */
};

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct cli *c = user;
    if (c->busy && !atomic_load(&c->errors) && bex_sock_send(s, buf, len, NULL) == 0)
        buf = NULL;
    if (buf)
        bex_mem_free(buf);
    waiter_add(&c->w, &c->recvd, 1);
}

static void cli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    (void)s, (void)len, (void)mu;
    struct cli *c = user;
    if (status)
        atomic_fetch_add(&c->send_failed, 1);
    bex_mem_free(buf);
    waiter_add(&c->w, &c->done, 1);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    (void)s;
    struct cli *c = user;
    fprintf(stderr, "client socket error: %s\n", bex_strerror(err));
    waiter_add(&c->w, &c->errors, 1);
}

static void cli_closed(bex_sock *s, void *user)
{
    (void)s;
    struct cli *c = user;
    waiter_add(&c->w, &c->closed, 1);
}

static const bex_sock_ops cli_ops = {
    .on_recv = cli_recv, .on_send_done = cli_done, .on_error = cli_error, .on_close = cli_closed};

static int send_pattern(bex_ctx *ctx, bex_sock *s, size_t len, uint8_t v)
{
    uint8_t *m = bex_sock_alloc(ctx, len);
    CHECK(m);
    memset(m, v, len);
    int err = bex_sock_send(s, m, len, NULL);
    if (err)
        bex_mem_free(m);
    return err;
}

static int early_client(struct pair *p, void *arg)
{
    (void)arg;
    struct cli busy = {.w = WAITER_INIT, .busy = true};
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &cli_ops, &busy, &busy.s));
    for (int i = 0; i < BUSY_INFLIGHT; i++)
        CHECK_OK(send_pattern(p->ctx, busy.s, BUSY_LEN, (uint8_t)i));
    CHECK_OK(wait_count(&busy.w, &busy.recvd, 2 * BUSY_INFLIGHT, 20000));

    struct in_addr a0, a1;
    CHECK_OK(pair_addrs(&a0, &a1));
    bex_ctx_config cfg = scaled(NULL, a1);
    for (int r = 0; r < ROUNDS; r++) {
        bex_ctx *ctx;
        CHECK_OK(bex_ctx_create(&cfg, &ctx));
        struct cli c = {.w = WAITER_INIT};
        CHECK_OK(bex_sock_connect(ctx, &p->srv, &cli_ops, &c, &c.s));
        /* sent before the connection is up: it goes with the first frames */
        CHECK_OK(send_pattern(ctx, c.s, 32, (uint8_t)r));
        if (wait_count(&c.w, &c.recvd, 1, 10000)) {
            fprintf(stderr, "round %d: no echo (%ld errors)\n", r, atomic_load(&c.errors));
            return 1;
        }
        CHECK_EQ(atomic_load(&c.errors), 0);
        bex_sock_close(c.s);
        CHECK_OK(wait_count(&c.w, &c.closed, 1, 10000));
        CHECK_EQ(atomic_load(&c.send_failed), 0);
        CHECK_OK(bex_ctx_destroy(ctx));
    }
    /* the busy socket went on all along */
    CHECK_EQ(atomic_load(&busy.errors), 0);
    long before = atomic_load(&busy.recvd);
    CHECK_OK(wait_count(&busy.w, &busy.recvd, before + BUSY_INFLIGHT, 20000));
    bex_sock_close(busy.s);
    CHECK_OK(wait_count(&busy.w, &busy.closed, 1, 20000));
    return 0;
}

static int first_message(void)
{
    return pair_run(NULL, echo_srv_main, NULL, NULL, early_client, NULL, 120);
}

BEX_TEST_MAIN(BEX_CASE(first_message))
