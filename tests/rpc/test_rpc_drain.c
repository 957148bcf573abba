/* SPDX-License-Identifier: Apache-2.0 */
/* bex_rpc_server_drain (issue 27 item 2: bex-ps drains on SIGTERM), one
 * process over TCP on loopback:
 *  - answered: a request whose handler answers 300 ms later, from another
 *    thread, is in flight when the drain starts: the drain returns 0 only
 *    after the answer went, and the client gets it (status 0, its body),
 *    not a failed connection; the server is destroyed after.
 *  - timeout: a handler that has not answered by the drain's deadline:
 *    -ETIMEDOUT; answered afterwards, destroy goes on.
 *  - no_new: after a drain a new connection is refused (the listener is
 *    closed) while the old channel's connection still gets answers. */
#include <arpa/inet.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "bex/rpc.h"
#include "bex/sock.h"

#define SVC 77

static _Atomic(bex_rpc_req *) parked;
static _Atomic int answer_after_ms;
static _Atomic int replying; /* set before bex_rpc_reply: a drain cannot end before */

static void h_park(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user, (void)len;
    bex_rpc_free(body);
    atomic_store(&parked, req);
}

static void h_echo(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    bex_rpc_reply(req, 0, body, len);
}

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* Answers the parked request after answer_after_ms with "late". */
static void *answerer(void *arg)
{
    bex_ctx *ctx = arg;
    bex_rpc_req *req;
    while (!(req = atomic_load(&parked)))
        sleep_ms(5);
    sleep_ms(atomic_load(&answer_after_ms));
    void *b = bex_rpc_alloc(ctx, 4);
    memcpy(b, "late", 4);
    atomic_store(&replying, 1);
    bex_rpc_reply(req, 0, b, 4);
    return NULL;
}

struct call {
    _Atomic int done;
    int status;
    char body[8];
    size_t len;
};

static void call_done(int status, void *body, size_t len, void *user)
{
    struct call *c = user;
    c->status = status;
    c->len = len;
    if (body && len <= sizeof c->body)
        memcpy(c->body, body, len);
    bex_rpc_free(body);
    atomic_store(&c->done, 1);
}

struct rig {
    bex_ctx *sctx, *cctx;
    bex_rpc_server *srv;
    bex_rpc_channel *ch;
    bex_addr at;
};

static bex_rpc_channel *channel(struct rig *r)
{
    bex_rpc_endpoint ep = {.addr = r->at};
    bex_rpc_channel_config cc = {.size = sizeof cc,
                                 .endpoints = &ep,
                                 .n_endpoints = 1,
                                 .request_timeout_ms = 10000,
                                 .connect_timeout_ms = 2000,
                                 .max_attempts = 1};
    bex_rpc_channel *ch = NULL;
    CHECK(bex_rpc_channel_create(r->cctx, &cc, &ch) == 0);
    return ch;
}

static int rig_up(struct rig *r)
{
    bex_ctx_config c = {.size = sizeof c, .transport = BEX_TRANSPORT_TCP};
    bex_addr_parse("127.0.0.1", 0, &c.local_addr);
    CHECK_OK(bex_ctx_create(&c, &r->sctx));
    bex_addr_parse("127.0.0.2", 0, &c.local_addr);
    CHECK_OK(bex_ctx_create(&c, &r->cctx));
    CHECK_OK(bex_rpc_server_create(r->sctx, NULL, &r->srv));
    CHECK_OK(bex_rpc_server_register(r->srv, SVC, 1, 0, h_park, NULL));
    CHECK_OK(bex_rpc_server_register(r->srv, SVC, 2, 0, h_echo, NULL));
    r->at = (bex_addr){.in4 = {.sin_family = AF_INET}};
    inet_pton(AF_INET, "127.0.0.1", &r->at.in4.sin_addr);
    CHECK_OK(bex_rpc_server_listen(r->srv, &r->at));
    bex_rpc_server_addr(r->srv, &r->at);
    r->ch = channel(r);
    atomic_store(&parked, NULL);
    return 0;
}

static int rig_down(struct rig *r)
{
    bex_rpc_channel_destroy(r->ch);
    CHECK_OK(bex_rpc_server_destroy(r->srv));
    CHECK_OK(bex_ctx_destroy(r->cctx));
    CHECK_OK(bex_ctx_destroy(r->sctx));
    return 0;
}

/* A call to the parking method, and the answerer behind it. */
static int park_one(struct rig *r, struct call *c, pthread_t *th, int after_ms)
{
    atomic_store(&answer_after_ms, after_ms);
    atomic_store(&replying, 0);
    CHECK(pthread_create(th, NULL, answerer, r->sctx) == 0);
    CHECK_OK(bex_rpc_call(r->ch, SVC, 1, NULL, 0, NULL, call_done, c, NULL));
    while (!atomic_load(&parked))
        sleep_ms(5);
    return 0;
}

static int answered(void)
{
    static struct rig r;
    CHECK_OK(rig_up(&r));
    struct call c = {0};
    pthread_t th;
    CHECK_OK(park_one(&r, &c, &th, 300));
    CHECK_EQ(atomic_load(&c.done), 0);
    CHECK_OK(bex_rpc_server_drain(r.srv, 10000));
    CHECK_EQ(atomic_load(&replying), 1); /* it waited for the answer */
    pthread_join(th, NULL);
    for (int i = 0; i < 1000 && !atomic_load(&c.done); i++)
        sleep_ms(5);
    CHECK_EQ(atomic_load(&c.done), 1);
    CHECK_EQ(c.status, 0);
    CHECK(c.len == 4 && memcmp(c.body, "late", 4) == 0);
    return rig_down(&r);
}

static int timeout(void)
{
    static struct rig r;
    CHECK_OK(rig_up(&r));
    struct call c = {0};
    pthread_t th;
    CHECK_OK(park_one(&r, &c, &th, 1000));
    CHECK_EQ(bex_rpc_server_drain(r.srv, 100), -ETIMEDOUT);
    CHECK_EQ(atomic_load(&replying), 0);
    pthread_join(th, NULL);
    CHECK_OK(bex_rpc_server_drain(r.srv, 10000));
    return rig_down(&r);
}

static int no_new(void)
{
    static struct rig r;
    CHECK_OK(rig_up(&r));
    void *resp = NULL;
    size_t len = 0;
    CHECK_OK(bex_rpc_call_sync(r.ch, SVC, 2, NULL, 0, NULL, &resp, &len));
    CHECK_OK(bex_rpc_server_drain(r.srv, 10000));
    bex_rpc_channel *late = channel(&r);
    CHECK(bex_rpc_call_sync(late, SVC, 2, NULL, 0, NULL, &resp, &len) != 0);
    bex_rpc_channel_destroy(late);
    /* the connection made before the drain still answers */
    CHECK_OK(bex_rpc_call_sync(r.ch, SVC, 2, NULL, 0, NULL, &resp, &len));
    bex_rpc_free(resp);
    CHECK_EQ(bex_rpc_server_drain(NULL, 0), -EINVAL);
    return rig_down(&r);
}

BEX_TEST_MAIN(BEX_CASE(answered), BEX_CASE(timeout), BEX_CASE(no_new))
