/* SPDX-License-Identifier: Apache-2.0 */
/* The send fast path (issue 8 item 5): caller-owned send requests
 * (bex_sock_send_req) and the I/O thread's descriptor cache. One process,
 * two contexts: a server on BEX_TEST_ADDR0 and a client on BEX_TEST_ADDR1;
 * over RDMA in the VM (label rxe), over TCP on loopback natively
 * (BEX_TEST_TRANSPORT=tcp, label tcp).
 *
 * - req_echo: the client keeps REQS messages in flight, each in a request
 *   of its own (a struct embedding bex_send_req, in static storage: bex
 *   must never free it), sending the next one from on_send_done in the
 *   request it just got back, after poisoning it (bex must not read it
 *   after the report). The server echoes; every echo arrives, in order per
 *   request slot, with its content, and every completion names its request.
 * - req_errors: a NULL request or a bad buffer is refused at once and the
 *   request is left as it was.
 * - cache: the server answers from on_recv on the socket's own I/O thread;
 *   from the second answer on, the descriptor comes from that thread's
 *   cache (its count drops by one across bex_sock_send), and the cache
 *   stays within BEX__MSG_CACHE_MAX.
 * - relay: a server with two I/O threads forwards what one socket receives
 *   to a socket of the other thread (a send from a callback on a thread
 *   that is not the socket's: no cache of either is touched by the wrong
 *   thread; run it under TSan), in both directions. */
#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sock/echo.h"

#define MSG_LEN 64
#define REQS    8
#define PER_REQ 250
#define CACHE_N 500
#define RELAY_N 300

static struct in_addr addr0, addr1;

static bex_ctx *ctx_new(struct in_addr a, uint32_t io_threads)
{
    return local_ctx(&(bex_ctx_config){.io_threads = io_threads}, a);
}

/* ---- server: echoes from on_recv (cache: and watches its thread's cache) ---- */

struct srv {
    struct local_srv base; /* first: what the shared callbacks take */
    /* atomics: written and read on different threads that meet only over
     * the network, which TSan does not see */
    _Atomic bool relay; /* forward to the other accepted socket instead of echoing */
    _Atomic long recvd, send_failed;
    /* cache case, I/O thread only until the end */
    long cache_hits, cache_seen_max;
    bool cache_bad;
};

static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct srv *v = user;
    bex_sock *to = s;
    bool relay = atomic_load(&v->relay);
    if (relay)
        to = atomic_load(&v->base.socks[0]) == s ? atomic_load(&v->base.socks[1])
                                                 : atomic_load(&v->base.socks[0]);
    struct bex__io *io = s->io;
    bool own = bex__io_self == io;
    uint32_t before = own ? io->n_msg_free : 0;
    if (bex_sock_send(to, buf, len, NULL)) {
        atomic_fetch_add(&v->send_failed, 1);
        bex_mem_free(buf);
    } else if (own && !relay) {
        uint32_t after = io->n_msg_free;
        if (before > 0 && after == before - 1)
            v->cache_hits++;
        else if (before > 0)
            v->cache_bad = true; /* there was one and the send did not take it */
        if ((long)before > v->cache_seen_max)
            v->cache_seen_max = before;
    }
    waiter_add(&v->base.w, &v->recvd, 1);
}

/* ---- client ---- */

struct creq {
    bex_send_req req; /* first: poisoned whole after each completion */
    int slot;
    uint32_t seq; /* of the message in flight */
};

struct cli {
    struct local_cli base; /* first: what the shared callbacks take */
    bex_ctx *ctx;
    struct creq *reqs;
    _Atomic long recvd, done, failed;
    uint32_t next_seq[REQS]; /* I/O thread only */
    uint32_t rx_seq[REQS];   /* I/O thread only */
    bool bad;                /* I/O thread only until the end */
};

/* message content: slot, sequence, then a pattern of both */
static void fill_msg(uint8_t *p, int slot, uint32_t seq)
{
    memcpy(p, &slot, sizeof slot);
    memcpy(p + 4, &seq, sizeof seq);
    fill_pattern(p + 8, MSG_LEN - 8, (uint32_t)slot * 100000u + seq);
}

static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct cli *c = user;
    int slot;
    uint32_t seq;
    memcpy(&slot, buf, sizeof slot);
    memcpy(&seq, (uint8_t *)buf + 4, sizeof seq);
    if (len != MSG_LEN || slot < 0 || slot >= REQS || seq != c->rx_seq[slot] ||
        check_pattern((uint8_t *)buf + 8, MSG_LEN - 8, (uint32_t)slot * 100000u + seq))
        c->bad = true;
    else
        c->rx_seq[slot]++;
    bex_mem_free(buf);
    waiter_add(c->base.w, &c->recvd, 1);
}

static int send_slot(bex_sock *s, struct cli *c, struct creq *r, void *buf)
{
    r->seq = c->next_seq[r->slot]++;
    fill_msg(buf, r->slot, r->seq);
    return bex_sock_send_req(s, &r->req, buf, MSG_LEN, r);
}

static void cli_sent(bex_sock *s, void *buf, size_t len, void *msg_user, int status, void *user)
{
    struct cli *c = user;
    struct creq *r = msg_user;
    if (!c->reqs) { /* plain sends: nothing to follow */
        if (status)
            atomic_fetch_add(&c->failed, 1);
        bex_mem_free(buf);
        waiter_add(c->base.w, &c->done, 1);
        return;
    }
    if (status || len != MSG_LEN || r < c->reqs || r >= c->reqs + REQS) {
        atomic_fetch_add(&c->failed, 1);
        bex_mem_free(buf);
        waiter_add(c->base.w, &c->done, 1);
        return;
    }
    /* the request is ours again: poison it; bex reads none of it now */
    int slot = r->slot;
    memset(&r->req, 0xa5, sizeof r->req);
    if (c->next_seq[slot] < PER_REQ) {
        if (send_slot(s, c, r, buf)) {
            atomic_fetch_add(&c->failed, 1);
            bex_mem_free(buf);
        }
    } else {
        bex_mem_free(buf);
    }
    waiter_add(c->base.w, &c->done, 1);
}

struct rig {
    struct srv v;
    struct cli c;
    bex_ctx *sctx, *cctx;
    bex_listener *l;
    bex_addr at;
    bex_sock *s;
};

static bex_sock *cli_open(struct rig *r, bex_ctx *ctx, struct cli *c)
{
    *c = (struct cli){.base.w = &r->v.base.w, .ctx = ctx};
    bex_sock_ops ops = {.on_connect = local_cli_connect,
                        .on_recv = cli_recv,
                        .on_send_done = cli_sent,
                        .on_close = local_cli_closed};
    bex_sock *s;
    CHECK_OK(bex_sock_connect(ctx, &r->at, &ops, c, &s));
    CHECK_OK(wait_count(&r->v.base.w, &c->base.connected, 1, 5000));
    return s;
}

static int rig_up(struct rig *r, uint32_t srv_threads)
{
    int rc = pair_addrs(&addr0, &addr1);
    if (rc)
        return rc;
    r->v = (struct srv){.base.w = WAITER_INIT};
    r->sctx = ctx_new(addr0, srv_threads);
    r->cctx = ctx_new(addr1, 1);
    r->l = local_listen(r->sctx, addr0, &r->v.base, srv_recv, &r->at);
    r->s = cli_open(r, r->cctx, &r->c);
    CHECK_OK(wait_count(&r->v.base.w, &r->v.base.accepted, 1, 5000));
    return 0;
}

static void rig_down(struct rig *r)
{
    bex_sock_close(r->s);
    CHECK_OK(wait_count(&r->v.base.w, &r->c.base.closed, 1, 5000));
    CHECK_OK(wait_count(&r->v.base.w, &r->v.base.closed, atomic_load(&r->v.base.accepted), 5000));
    CHECK_OK(bex_listener_close(r->l));
    CHECK_OK(bex_ctx_destroy(r->cctx));
    CHECK_OK(bex_ctx_destroy(r->sctx));
}

/* ---- cases ---- */

static struct creq reqs[REQS]; /* static: a free() of one would crash */

static int req_echo(void)
{
    struct rig r;
    int rc = rig_up(&r, 1);
    if (rc)
        return rc;
    r.c.reqs = reqs;
    for (int i = 0; i < REQS; i++) {
        reqs[i].slot = i;
        void *b = bex_sock_alloc(r.cctx, MSG_LEN);
        CHECK(b);
        /* the first of each slot from this thread; the I/O thread's sends
         * of the slot follow only after its completion */
        CHECK_OK(send_slot(r.s, &r.c, &reqs[i], b));
    }
    CHECK_OK(wait_count(&r.v.base.w, &r.c.recvd, REQS * PER_REQ, 30000));
    CHECK_OK(wait_count(&r.v.base.w, &r.c.done, REQS * PER_REQ, 10000));
    CHECK_EQ(atomic_load(&r.c.failed), 0);
    CHECK_EQ(atomic_load(&r.v.send_failed), 0);
    rig_down(&r); /* the I/O threads are gone: their fields may be read */
    CHECK(!r.c.bad);
    for (int i = 0; i < REQS; i++)
        CHECK_EQ(r.c.rx_seq[i], PER_REQ);
    return 0;
}

static int req_errors(void)
{
    struct rig r;
    int rc = rig_up(&r, 1);
    if (rc)
        return rc;
    void *b = bex_sock_alloc(r.cctx, MSG_LEN);
    CHECK(b);
    CHECK_EQ(bex_sock_send_req(r.s, NULL, b, MSG_LEN, NULL), -EINVAL);
    bex_send_req q, orig;
    memset(&q, 0x3c, sizeof q);
    orig = q;
    CHECK_EQ(bex_sock_send_req(NULL, &q, b, MSG_LEN, NULL), -EINVAL);
    void *other = bex_sock_alloc(r.sctx, MSG_LEN); /* another context's pool */
    CHECK(other);
    CHECK_EQ(bex_sock_send_req(r.s, &q, other, MSG_LEN, NULL), -EINVAL);
    bex_mem_free(other);
    CHECK_EQ(bex_sock_send_req(r.s, &q, b, (size_t)1 << 40, NULL), -EMSGSIZE);
    CHECK(memcmp(&q, &orig, sizeof q) == 0);
    bex_mem_free(b);
    rig_down(&r);
    return 0;
}

/* ordinary sends of this thread (not the I/O thread: no cache) */
static void send_plain(bex_ctx *ctx, bex_sock *s, int slot, uint32_t seq)
{
    void *b = bex_sock_alloc(ctx, MSG_LEN);
    CHECK(b);
    fill_msg(b, slot, seq);
    CHECK_OK(bex_sock_send(s, b, MSG_LEN, NULL));
}

static int cache(void)
{
    struct rig r;
    int rc = rig_up(&r, 1);
    if (rc)
        return rc;
    /* the client's completions free the buffers (no request: NULL) */
    r.c.reqs = NULL;
    for (uint32_t i = 0; i < CACHE_N; i++) {
        send_plain(r.cctx, r.s, 0, i);
        CHECK_OK(wait_count(&r.v.base.w, &r.c.recvd, i + 1, 5000));
    }
    rig_down(&r);
    fprintf(stderr, "%d answers from on_recv: %ld took a cached descriptor, at most %ld cached\n",
            CACHE_N, r.v.cache_hits, r.v.cache_seen_max);
    CHECK(!r.c.bad);
    CHECK(!r.v.cache_bad);
    /* the first answer finds the cache empty; once an answer is done its
     * descriptor waits there for the next */
    CHECK(r.v.cache_hits >= CACHE_N / 2);
    CHECK(r.v.cache_seen_max >= 1);
    CHECK(r.v.cache_seen_max <= BEX__MSG_CACHE_MAX);
    return 0;
}

static int relay(void)
{
    struct rig r;
    int rc = rig_up(&r, 2);
    if (rc)
        return rc;
    atomic_store(&r.v.relay, true);
    struct cli c2;
    bex_ctx *cctx2 = ctx_new(addr1, 1);
    bex_sock *s2 = cli_open(&r, cctx2, &c2);
    CHECK_OK(wait_count(&r.v.base.w, &r.v.base.accepted, 2, 5000));
    /* round-robin: two threads */
    CHECK(atomic_load(&r.v.base.socks[0])->io != atomic_load(&r.v.base.socks[1])->io);
    r.c.reqs = NULL;
    c2.reqs = NULL;
    /* client 1 -> server -> client 2 on slot 0; the other way on slot 1 */
    for (uint32_t i = 0; i < RELAY_N; i++) {
        send_plain(r.cctx, r.s, 0, i);
        send_plain(cctx2, s2, 1, i);
    }
    CHECK_OK(wait_count(&r.v.base.w, &c2.recvd, RELAY_N, 20000));
    CHECK_OK(wait_count(&r.v.base.w, &r.c.recvd, RELAY_N, 20000));
    CHECK_EQ(atomic_load(&r.v.send_failed), 0);
    bex_sock_close(s2);
    CHECK_OK(wait_count(&r.v.base.w, &c2.base.closed, 1, 5000));
    rig_down(&r);
    CHECK_OK(bex_ctx_destroy(cctx2));
    CHECK(!r.c.bad && !c2.bad);
    CHECK_EQ(c2.rx_seq[0], RELAY_N);
    CHECK_EQ(r.c.rx_seq[1], RELAY_N);
    return 0;
}

BEX_TEST_MAIN({"req_echo", req_echo}, {"req_errors", req_errors}, {"cache", cache},
              {"relay", relay})
