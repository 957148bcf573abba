/* SPDX-License-Identifier: Apache-2.0 */
/* rpc_client: call rpc_server's "upper" method once and print the answer.
 * It shows the client half of include/bex/rpc.h: a channel to a server, a
 * request body in bex's memory, and a synchronous call with a deadline.
 *
 *   ./rpc_server 127.0.0.1:0                   # prints "listening on 127.0.0.1:PORT"
 *   ./rpc_client 127.0.0.1:PORT "hello bex"    # prints "HELLO BEX"
 *
 * LOCAL_IP (a 3rd argument, default 127.0.0.1) is this host's address, the
 * one bex binds its connections to. Exit status 0, or 1 with the reason
 * (bex_strerror) on stderr. */
#include <arpa/inet.h>
#include <stdio.h>
#include <string.h>

#include "example_args.h"
#include <bex/rpc.h>

#define EXAMPLE_SERVICE 7 /* the ids rpc_server registered */
#define EXAMPLE_UPPER   1

static int call_upper(bex_ctx *ctx, const bex_addr *server, const char *text)
{
    /* A channel: calls to a list of endpoints (replicas), with deadlines
     * and retries. The defaults suit a data center (a 40 ms deadline, a
     * 10 ms connect); a first program on a busy laptop gets more room. */
    bex_rpc_endpoint ep = {.addr = *server};
    bex_rpc_channel_config cc = {.size = sizeof(bex_rpc_channel_config),
                                 .endpoints = &ep,
                                 .n_endpoints = 1,
                                 .request_timeout_ms = 5000,
                                 .connect_timeout_ms = 2000};
    bex_rpc_channel *ch;
    int rc = bex_rpc_channel_create(ctx, &cc, &ch);
    if (rc)
        return rc;
    /* The request body comes from bex's memory (with room for the RPC
     * header in front): bex owns it once the call is made. */
    size_t len = strlen(text);
    char *body = bex_rpc_alloc(ctx, len);
    if (!body) {
        bex_rpc_channel_destroy(ch);
        return -ENOMEM;
    }
    memcpy(body, text, len);
    void *resp = NULL;
    size_t resp_len = 0;
    rc = bex_rpc_call_sync(ch, EXAMPLE_SERVICE, EXAMPLE_UPPER, body, len, NULL, &resp, &resp_len);
    if (rc == 0)
        printf("%.*s\n", (int)resp_len, (const char *)resp);
    bex_rpc_free(resp); /* the answer is ours to free (NULL is fine) */
    bex_rpc_channel_destroy(ch);
    return rc;
}

int main(int argc, char **argv)
{
    example_args(argc, argv, "rpc_client", "IP:PORT TEXT [LOCAL_IP]");
    bex_addr server;
    bex_ctx_config cfg = {.size = sizeof(bex_ctx_config),
                          .transport = BEX_TRANSPORT_TCP}; /* TCP: runs anywhere */
    /* host:port: a.b.c.d, [v6] or a name (resolved) */
    if ((argc != 3 && argc != 4) || bex_addr_resolve(argv[1], 0, &server, NULL, 0) != 0 ||
        bex_addr_port(&server) == 0 ||
        bex_addr_resolve(argc == 4 ? argv[3] : "127.0.0.1", 0, &cfg.local_addr, NULL, 0) != 0) {
        fprintf(stderr, "usage: rpc_client HOST:PORT TEXT [LOCAL_IP]\n");
        return 2;
    }
    bex_ctx *ctx;
    int rc = bex_ctx_create(&cfg, &ctx);
    if (rc) {
        fprintf(stderr, "rpc_client: context: %s\n", bex_strerror(rc));
        return 1;
    }
    if ((rc = call_upper(ctx, &server, argv[2])) != 0)
        fprintf(stderr, "rpc_client: %s: %s\n", argv[1], bex_strerror(rc));
    bex_ctx_destroy(ctx);
    return rc ? 1 : 0;
}
