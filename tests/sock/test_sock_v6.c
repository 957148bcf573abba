/* SPDX-License-Identifier: Apache-2.0 */
/* Sockets over IPv6 (issue 27 item 5: the address API takes bex_addr).
 * Each case: two contexts in this process with a shared secret (so the
 * authenticated setup binds the IPv6 endpoints), a listener, one socket
 * and a round trip of three messages echoed back.
 *  - tcp_loopback6 (label tcp): both on ::1 over TCP.
 *  - tcp_dual_stack (label tcp): the listener on [::] (dual stack), the
 *    client on 127.0.0.1: the listener sees an IPv4-mapped peer, the client
 *    an IPv4 one, and the authenticated setup must still agree.
 *  - rxe_v6 (label rxe): RDMA only, server on BEX_TEST_ADDR6_0 (fd99::1 in
 *    the VM: scripts/rxe-vm), client on BEX_TEST_ADDR6_1: RoCE v2 over IPv6
 *    GIDs, and the device chosen for fd99::1 carries the GID fd99::1. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "echo.h"
#include "rdma/rdma.h"

static const char secret[] = "a test secret of 32 bytes, fixed";

struct v6cli {
    struct local_cli base;
    _Atomic long got;
    _Atomic size_t bytes;
    _Atomic int transport; /* bex_sock_transport at on_connect */
};

static void v6_connect(bex_sock *s, int err, void *user)
{
    struct v6cli *c = user;
    atomic_store(&c->transport, bex_sock_transport(s));
    local_cli_connect(s, err, &c->base);
}

static void v6_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct v6cli *c = user;
    atomic_fetch_add(&c->bytes, len);
    bex_mem_free(buf);
    waiter_add(c->base.w, &c->got, 1);
}

static bex_ctx *v6_ctx(const char *local, uint32_t transport)
{
    bex_ctx_config c = BEX_CTX_CONFIG_INIT;
    CHECK_OK(bex_addr_parse(local, 0, &c.local_addr));
    c.transport = transport;
    c.secret = secret;
    c.secret_len = sizeof secret - 1;
    c.connect_timeout_ms = 5000 * bex_test_time_scale();
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

/* Listen on listen_at (port 0) in sctx, connect from cctx to connect_to
 * (the listener's port), echo three messages; want_transport: what the
 * client's socket must ride on. */
static int round_trip(bex_ctx *sctx, bex_ctx *cctx, const char *listen_at, const char *connect_to,
                      int want_transport)
{
    struct local_srv v = {.w = WAITER_INIT};
    bex_addr at, got, to;
    CHECK_OK(bex_addr_parse(listen_at, 0, &at));
    bex_listener_ops lops = {.on_accept = local_srv_accept};
    v.on_recv = echo_srv_recv;
    bex_listener *l;
    CHECK_OK(bex_listen(sctx, &at, &lops, &v, &l));
    bex_listener_addr(l, &got);
    CHECK_EQ(got.sa.sa_family, at.sa.sa_family);
    CHECK(bex_addr_port(&got) != 0);
    CHECK_OK(bex_addr_parse(connect_to, bex_addr_port(&got), &to));
    struct v6cli c = {.base = {.w = &v.w}};
    bex_sock_ops ops = {.on_connect = v6_connect, .on_recv = v6_recv, .on_close = local_cli_closed};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(cctx, &to, &ops, &c, &s));
    CHECK_OK(wait_count(&v.w, &c.base.connected, 1, 10000));
    for (int i = 0; i < 3; i++)
        local_send(cctx, s, 1000 + (size_t)i);
    CHECK_OK(wait_count(&v.w, &c.got, 3, 10000));
    CHECK_EQ(atomic_load(&c.bytes), 3003);
    CHECK_EQ(atomic_load(&v.accepted), 1);
    CHECK_EQ(atomic_load(&c.transport), want_transport);
    bex_sock_close(s);
    CHECK_OK(wait_count(&v.w, &c.base.closed, 1, 10000));
    CHECK_OK(bex_listener_close(l));
    return 0;
}

static int tcp_loopback6(void)
{
    bex_ctx *sctx = v6_ctx("::1", BEX_TRANSPORT_TCP), *cctx = v6_ctx("::1", BEX_TRANSPORT_TCP);
    int rc = round_trip(sctx, cctx, "[::1]:0", "::1", BEX_TRANSPORT_TCP);
    CHECK_OK(bex_ctx_destroy(cctx));
    CHECK_OK(bex_ctx_destroy(sctx));
    return rc;
}

static int tcp_dual_stack(void)
{
    bex_ctx *sctx = v6_ctx("::1", BEX_TRANSPORT_TCP),
            *cctx = v6_ctx("127.0.0.1", BEX_TRANSPORT_TCP);
    int rc = round_trip(sctx, cctx, "[::]:0", "127.0.0.1", BEX_TRANSPORT_TCP);
    CHECK_OK(bex_ctx_destroy(cctx));
    CHECK_OK(bex_ctx_destroy(sctx));
    return rc;
}

static int rxe_v6(void)
{
    const char *a0 = getenv("BEX_TEST_ADDR6_0"), *a1 = getenv("BEX_TEST_ADDR6_1");
    if (!a0 || !a1)
        return bex_test_skip("BEX_TEST_ADDR6_0/1 unset (scripts/rxe-vm sets them)");
    bex_addr s0;
    CHECK_OK(bex_addr_parse(a0, 0, &s0));
    struct bex__rdma_path p;
    int rc = bex__rdma_find_addr(&s0, &p);
    if (rc == -ENODEV)
        return bex_test_skip("no RDMA device has the IPv6 address");
    CHECK_OK(rc);
    CHECK(!memcmp(p.gid.raw, &s0.in6.sin6_addr, 16));
    fprintf(stderr, "%s: %s port %u GID index %u\n", a0, p.dev_name, p.port, p.gid_index);
    bex_ctx *sctx = v6_ctx(a0, BEX_TRANSPORT_RDMA), *cctx = v6_ctx(a1, BEX_TRANSPORT_RDMA);
    char at[64];
    snprintf(at, sizeof at, "[%s]:0", a0);
    rc = round_trip(sctx, cctx, at, a0, BEX_TRANSPORT_RDMA);
    CHECK_OK(bex_ctx_destroy(cctx));
    CHECK_OK(bex_ctx_destroy(sctx));
    return rc;
}

BEX_TEST_MAIN({"tcp_loopback6", tcp_loopback6}, {"tcp_dual_stack", tcp_dual_stack},
              {"rxe_v6", rxe_v6})
