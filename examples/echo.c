/* SPDX-License-Identifier: Apache-2.0 */
/* echo: the smallest bex program. A server sends every message back; a
 * client sends one message and prints the answer. It shows the socket
 * layer (include/bex/sock.h): a context, a listener, a connection, and
 * zero-copy buffers that belong to bex while a send is out.
 *
 *   ./echo server 127.0.0.1:0             # prints "listening on 127.0.0.1:PORT"
 *   ./echo client 127.0.0.1:PORT hello    # prints "echo: hello"
 *
 * The client binds its connection to LOCAL_IP (a 4th argument, default
 * 127.0.0.1): give this host's address when the server is another host.
 * Both run over TCP (BEX_TRANSPORT_TCP), so this works on any machine; on
 * hosts with an RDMA NIC, use the NIC's IP and BEX_TRANSPORT_AUTO: the same
 * code then runs over RDMA. Exit status 0, or 1 with the reason on stderr. */
#include <arpa/inet.h>
#include <semaphore.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "example_args.h"
#include <bex/sock.h>

/* "host:port" into *a (a.b.c.d, [v6] or a name); 0 or an error. */
static int parse_addr(const char *s, bex_addr *a)
{
    return strchr(s, ':') ? bex_addr_resolve(s, 0, a, NULL, 0) : -EINVAL;
}

/* ---- server: callbacks run on bex's I/O thread and must not block ---- */

/* A received buffer is ours, and may be sent as it is (no copy). With no
 * on_send_done callback, bex frees it once the send is done. */
static void echo_back(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)user;
    if (bex_sock_send(s, buf, len, NULL) != 0)
        bex_mem_free(buf);
}

static void peer_gone(bex_sock *s, int err, void *user)
{
    (void)err, (void)user;
    bex_sock_close(s);
}

static void on_accept(bex_listener *l, bex_sock *s, void *user)
{
    static const bex_sock_ops echo_ops = {.on_recv = echo_back, .on_error = peer_gone};
    (void)l, (void)user;
    bex_sock_set_user(s, &echo_ops, NULL);
}

/* ---- client: the callbacks hand the outcome to main() through semaphores ---- */

static sem_t answered, closed;
static int status; /* 0, or why there is no answer */

/* on_connect (err 0: connected, else refused, timed out, ...) and on_error
 * (the connection failed) take the same arguments: one function serves. */
static void on_failure(bex_sock *s, int err, void *user)
{
    (void)s, (void)user;
    if (err) {
        status = err;
        sem_post(&answered);
    }
}

static void on_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s, (void)user;
    printf("echo: %.*s\n", (int)len, (const char *)buf);
    bex_mem_free(buf); /* received buffers are the application's to free */
    sem_post(&answered);
}

static void on_close(bex_sock *s, void *user)
{
    (void)s, (void)user;
    sem_post(&closed);
}

static int client(bex_ctx *ctx, const bex_addr *to, const char *msg)
{
    static const bex_sock_ops ops = {
        .on_connect = on_failure, .on_recv = on_recv, .on_error = on_failure, .on_close = on_close};
    bex_sock *s;
    int rc = bex_sock_connect(ctx, to, &ops, NULL, &s); /* asynchronous: on_connect tells */
    if (rc)
        return rc;
    /* Sends take buffers from bex's memory (registered with the NIC once):
     * the message is copied in here, and bex frees it after the send. */
    size_t len = strlen(msg);
    char *buf = bex_sock_alloc(ctx, len + 1);
    if (!buf)
        rc = -ENOMEM;
    else if ((rc = bex_sock_send(s, memcpy(buf, msg, len), len, NULL)) != 0)
        bex_mem_free(buf);
    else if (sem_wait(&answered) == 0)
        rc = status;
    bex_sock_close(s); /* then on_close, once the peer answered the close */
    sem_wait(&closed);
    return rc;
}

int main(int argc, char **argv)
{
    example_args(argc, argv, "echo", "server IP:PORT | echo client IP:PORT MESSAGE [LOCAL_IP]");
    bex_addr addr;
    int server = argc == 3 && strcmp(argv[1], "server") == 0;
    if ((!server && !((argc == 4 || argc == 5) && strcmp(argv[1], "client") == 0)) ||
        parse_addr(argv[2], &addr) != 0) {
        fprintf(stderr, "usage: echo server IP:PORT | echo client IP:PORT MESSAGE [LOCAL_IP]\n");
        return 2;
    }
    /* A context: the local IP (it picks the RDMA NIC), memory, an I/O
     * thread. Zero in any other field means its default. */
    bex_ctx_config cfg = {
        .size = sizeof(bex_ctx_config), .local_addr = addr, .transport = BEX_TRANSPORT_TCP};
    if (!server &&
        bex_addr_resolve(argc == 5 ? argv[4] : "127.0.0.1", 0, &cfg.local_addr, NULL, 0) != 0) {
        fprintf(stderr, "echo: %s: not an address\n", argv[4]);
        return 1;
    }
    bex_ctx *ctx;
    int rc = bex_ctx_create(&cfg, &ctx);
    if (rc) {
        fprintf(stderr, "echo: context: %s\n", bex_strerror(rc));
        return 1;
    }
    if (server) {
        static const bex_listener_ops lops = {.on_accept = on_accept};
        bex_listener *l;
        if ((rc = bex_listen(ctx, &addr, &lops, NULL, &l)) != 0) {
            fprintf(stderr, "echo: listen on %s: %s\n", argv[2], bex_strerror(rc));
            return 1;
        }
        bex_listener_addr(l, &addr); /* the port bex picked, for port 0 */
        char text[BEX_ADDR_STRLEN];
        printf("listening on %s\n", bex_addr_format(&addr, true, text, sizeof text));
        fflush(stdout);
        for (;;)
            pause(); /* serve until killed */
    }
    sem_init(&answered, 0, 0);
    sem_init(&closed, 0, 0);
    if ((rc = client(ctx, &addr, argv[3])) != 0)
        fprintf(stderr, "echo: %s: %s\n", argv[2], bex_strerror(rc));
    bex_ctx_destroy(ctx);
    return rc ? 1 : 0;
}
