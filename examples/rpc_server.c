/* SPDX-License-Identifier: Apache-2.0 */
/* rpc_server: an RPC service with one method, "upper", that answers its
 * request in capitals. It shows the server half of include/bex/rpc.h: a
 * handler registered by (service, method), answering with the request's
 * own buffer (no copy), and a clean shutdown. rpc_client.c calls it.
 *
 *   ./rpc_server 127.0.0.1:0     # prints "listening on 127.0.0.1:PORT"
 *   ./rpc_client 127.0.0.1:PORT "hello bex"    # prints "HELLO BEX"
 *
 * It serves until SIGINT or SIGTERM, then stops and exits 0. TCP here
 * (BEX_TRANSPORT_TCP) so that it runs anywhere; on a host with an RDMA NIC,
 * listen on the NIC's IP with BEX_TRANSPORT_AUTO. */
#include <arpa/inet.h>
#include <ctype.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "example_args.h"
#include <bex/rpc.h>

/* The service and method ids the client calls (any numbers both agree on). */
#define EXAMPLE_SERVICE 7
#define EXAMPLE_UPPER   1

/* A request arrived. It runs on bex's I/O thread: answer now or later
 * (from any thread), exactly once. body belongs to us; giving it back as
 * the answer hands it to bex, which frees it once sent. */
static void upper(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    char *text = body;
    for (size_t i = 0; i < len; i++)
        text[i] = (char)toupper((unsigned char)text[i]);
    bex_rpc_reply(req, 0, body, len); /* fails only when the caller is gone */
}

static int serve(bex_ctx *ctx, bex_addr *addr)
{
    bex_rpc_server *srv;
    int rc = bex_rpc_server_create(ctx, NULL, &srv); /* NULL: default config */
    if (rc)
        return rc;
    if ((rc = bex_rpc_server_register(srv, EXAMPLE_SERVICE, EXAMPLE_UPPER, 0, upper, NULL)) ||
        (rc = bex_rpc_server_listen(srv, addr))) {
        bex_rpc_server_destroy(srv);
        return rc;
    }
    bex_rpc_server_addr(srv, addr); /* the port bex picked, for port 0 */
    char text[BEX_ADDR_STRLEN];
    printf("listening on %s\n", bex_addr_format(addr, true, text, sizeof text));
    fflush(stdout);
    /* Wait for SIGINT/SIGTERM (blocked in main before bex started its threads). */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    int sig;
    sigwait(&sigs, &sig);
    return bex_rpc_server_destroy(srv); /* closes connections, waits for them */
}

int main(int argc, char **argv)
{
    example_args(argc, argv, "rpc_server", "IP:PORT (port 0: any free one)");
    bex_addr addr; /* host:port: a.b.c.d, [v6] or a name (resolved) */
    if (argc != 2 || !strchr(argv[1], ':') || bex_addr_resolve(argv[1], 0, &addr, NULL, 0) != 0) {
        fprintf(stderr, "usage: rpc_server HOST:PORT (port 0: any free one)\n");
        return 2;
    }
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL); /* before any thread: serve() takes them */

    bex_ctx_config cfg = {
        .size = sizeof(bex_ctx_config), .local_addr = addr, .transport = BEX_TRANSPORT_TCP};
    bex_ctx *ctx;
    int rc = bex_ctx_create(&cfg, &ctx);
    if (rc) {
        fprintf(stderr, "rpc_server: context: %s\n", bex_strerror(rc));
        return 1;
    }
    if ((rc = serve(ctx, &addr)) != 0)
        fprintf(stderr, "rpc_server: %s: %s\n", argv[1], bex_strerror(rc));
    bex_ctx_destroy(ctx);
    return rc ? 1 : 0;
}
