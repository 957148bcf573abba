/* The echo server of the pair_run cases (pair.h): every message goes back
 * on its socket and is freed once sent (at once when the send fails); an
 * error closes the socket. A case with an on_recv or on_accept of its own
 * takes the other callbacks from here. */
#ifndef BEX_TEST_ECHO_H
#define BEX_TEST_ECHO_H

#include "pair.h"

static inline void echo_srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)user;
    if (bex_sock_send(s, buf, len, NULL) != 0)
        bex_mem_free(buf);
}

static inline void echo_srv_done(bex_sock *s, void *buf, size_t len, void *mu, int status,
                                 void *user)
{
    (void)s, (void)len, (void)mu, (void)status, (void)user;
    bex_mem_free(buf);
}

static inline void echo_srv_error(bex_sock *s, int err, void *user)
{
    (void)err, (void)user;
    bex_sock_close(s);
}

static inline void echo_srv_accept(bex_listener *l, bex_sock *s, void *user)
{
    static const bex_sock_ops ops = {
        .on_recv = echo_srv_recv, .on_send_done = echo_srv_done, .on_error = echo_srv_error};
    (void)l;
    bex_sock_set_user(s, &ops, user);
}

/* A pair_run server: echoes until the client is done. */
static inline int echo_srv_main(struct pair *p, void *arg)
{
    (void)arg;
    bex_listener_ops lops = {.on_accept = echo_srv_accept};
    pair_listen(p, &lops, NULL);
    pair_wait_parent(p);
    return 0;
}

#endif
