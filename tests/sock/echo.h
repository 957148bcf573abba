/* SPDX-License-Identifier: Apache-2.0 */
/* The echo server of the pair_run cases (pair.h): every message goes back
 * on its socket and is freed once sent (at once when the send fails); an
 * error closes the socket. A case with an on_recv or on_accept of its own
 * takes the other callbacks from here.
 *
 * Below them, the scaffolding of the one-process cases (server and client
 * contexts in the test's own process): local_ctx, local_srv, local_cli. */
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

/* ---- one-process cases ---- */

/* A context on a, configured as scaled() makes it (in: NULL for the
 * defaults); a failure fails the case. */
static inline bex_ctx *local_ctx(const bex_ctx_config *in, struct in_addr a)
{
    bex_ctx_config c = scaled(in, a);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&c, &ctx));
    return ctx;
}

#define LOCAL_SOCKS 64

/* A one-process case's server: the waiter its case waits on, the sockets
 * it accepted (the first LOCAL_SOCKS, in order) and the counts. A case's
 * own server state is one or starts with one (member base), so that these
 * callbacks take it as their user pointer and its on_recv the whole. */
struct local_srv {
    struct waiter w;
    void (*on_recv)(bex_sock *s, void *buf, size_t len, void *user); /* the case's */
    /* atomics: a case's on_recv may read them on another I/O thread */
    _Atomic(bex_sock *) socks[LOCAL_SOCKS];
    _Atomic long accepted, closed;
};

static inline void local_srv_close(bex_sock *s, void *user)
{
    (void)s;
    struct local_srv *v = user;
    waiter_add(&v->w, &v->closed, 1);
}

static inline void local_srv_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    struct local_srv *v = user;
    bex_sock_ops ops = {
        .on_recv = v->on_recv, .on_error = echo_srv_error, .on_close = local_srv_close};
    bex_sock_set_user(s, &ops, v);
    /* on_accept runs on several server threads at once: the slot is taken
     * under the waiter's lock */
    pthread_mutex_lock(&v->w.mu);
    long i = atomic_load(&v->accepted);
    if (i < LOCAL_SOCKS)
        atomic_store(&v->socks[i], s);
    atomic_fetch_add(&v->accepted, 1);
    pthread_cond_broadcast(&v->w.cv);
    pthread_mutex_unlock(&v->w.mu);
}

/* Listen on a (an ephemeral port) for v, whose accepted sockets get
 * on_recv; *out: the address to connect to. A local_srv may serve several
 * listeners, all with the same on_recv: it is set by the first only, since
 * the server's threads read it (local_srv_accept) while the case opens
 * its next listener (TSan saw the rewrite of the same value race). */
static inline bex_listener *local_listen(bex_ctx *ctx, struct in_addr a, struct local_srv *v,
                                         void (*on_recv)(bex_sock *, void *, size_t, void *),
                                         bex_addr *out)
{
    if (v->on_recv != on_recv) {
        CHECK(!v->on_recv); /* one on_recv per local_srv */
        v->on_recv = on_recv;
    }
    bex_addr at = {.in4 = {.sin_family = AF_INET, .sin_addr = a}};
    bex_listener_ops lops = {.on_accept = local_srv_accept};
    bex_listener *l;
    CHECK_OK(bex_listen(ctx, &at, &lops, v, &l));
    bex_listener_addr(l, out);
    return l;
}

/* A one-process case's client socket: the waiter its case waits on (the
 * server's) and the counts. A case's own client state starts with one
 * (member base), as the server's does. */
struct local_cli {
    struct waiter *w;
    _Atomic long connected, closed;
};

/* For a case whose every connect must succeed */
static inline void local_cli_connect(bex_sock *s, int err, void *user)
{
    (void)s;
    struct local_cli *c = user;
    CHECK_EQ(err, 0);
    waiter_add(c->w, &c->connected, 1);
}

static inline void local_cli_closed(bex_sock *s, void *user)
{
    (void)s;
    struct local_cli *c = user;
    waiter_add(c->w, &c->closed, 1);
}

/* Send len bytes of 7s on s from ctx's pool; the send must be taken. */
static inline void local_send(bex_ctx *ctx, bex_sock *s, size_t len)
{
    void *b = bex_sock_alloc(ctx, len);
    CHECK(b);
    memset(b, 7, len);
    CHECK_OK(bex_sock_send(s, b, len, NULL));
}

#endif
