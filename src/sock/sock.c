/* Contexts, the I/O thread, connection setup and logical sockets. */
#include <arpa/inet.h>
#include <assert.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "sock/internal.h"
#include "sock/secret.h"

#define ENGINE_TABLE 4096
#define TICK_MS      10
#define WC_BATCH     64
#define ACCEPT_BATCH 16 /* connections accepted per listener event */

/* Setup phases; with a shared secret the client goes CONNECTING ->
 * WAIT_CHALLENGE -> WAIT_HELLO -> WAIT_READY -> UP and the listener
 * WAIT_OPEN -> WAIT_PROOF -> WAIT_HELLO -> WAIT_READY -> UP. */
enum {
    P_CONNECTING,
    P_WAIT_HELLO,
    P_WAIT_READY,
    P_UP,
    P_WAIT_OPEN,
    P_WAIT_PROOF,
    P_WAIT_CHALLENGE
};

static const struct bex__engine_ops engine_ops;
static void exposed_cancel(struct bex_sock *s);

/* The context whose I/O thread this is (NULL on other threads): the calls
 * that wait for the I/O thread must not wait for themselves. */
static _Thread_local bex_ctx *io_ctx;

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

/* ---------------- command queue ---------------- */

static void wake(bex_ctx *ctx)
{
    /* seq_cst on both sides: either the I/O thread sees our command before it
     * sleeps, or we see it sleeping and write the eventfd. */
    if (atomic_load(&ctx->sleeping)) {
        uint64_t one = 1;
        ssize_t r = write(ctx->evfd, &one, sizeof(one));
        (void)r;
    }
}

static void push_cmd(bex_ctx *ctx, struct bex__cmd *c, int type)
{
    c->type = type;
    struct bex__cmd *head = atomic_load_explicit(&ctx->cmds, memory_order_relaxed);
    do {
        c->next = head;
    } while (!atomic_compare_exchange_weak(&ctx->cmds, &head, c));
    wake(ctx);
}

/* ---------------- socket bookkeeping (I/O thread) ---------------- */

static void map_add(struct conn *c, struct bex_sock *s)
{
    struct bex_sock **b = &c->map[s->id % CONN_MAP];
    s->map_next = *b;
    *b = s;
    c->nsocks++;
}

static struct bex_sock *map_find(struct conn *c, uint32_t id)
{
    for (struct bex_sock *s = c->map[id % CONN_MAP]; s; s = s->map_next)
        if (s->id == id)
            return s;
    return NULL;
}

static void map_del(struct conn *c, struct bex_sock *s)
{
    for (struct bex_sock **p = &c->map[s->id % CONN_MAP]; *p; p = &(*p)->map_next) {
        if (*p == s) {
            *p = s->map_next;
            c->nsocks--;
            return;
        }
    }
}

/* Hand a buffer back to the application; without an on_send_done nobody
 * would ever free it, so bex does. */
static void report_done(struct bex_sock *s, void *buf, size_t len, void *msg_user, int status)
{
    if (s->ops.on_send_done)
        s->ops.on_send_done(s, buf, len, msg_user, status, s->user);
    else
        bex_mem_free(buf);
}

/* Free the socket once the application closed it, the engine let go of it
 * and every message was reported; exposed buffers not delivered come back
 * before on_close. */
static void maybe_finish(struct bex_sock *s)
{
    if (!s->app_closed || s->attached || s->pending || s->close_reported)
        return;
    s->close_reported = true;
    s->dead = true;
    exposed_cancel(s);
    if (s->conn)
        map_del(s->conn, s);
    s->conn = NULL;
    if (s->ops.on_close)
        s->ops.on_close(s, s->user);
    free(s);
}

/* The socket can carry no more traffic: tell the application once (unless
 * it closed the socket already). The engine has let go of the stream (on_fail)
 * or is closing it (the peer's CLOSE); either way the peer writes nothing
 * more into its exposed buffers, which come back now. */
static void sock_fail(struct bex_sock *s, int err, bool connecting)
{
    if (!s->dead) {
        s->dead = true;
        atomic_store(&s->state, S_FAILED);
        exposed_cancel(s);
    }
    if (!s->error_told && !s->app_closed) {
        s->error_told = true;
        if (connecting) {
            if (s->ops.on_connect)
                s->ops.on_connect(s, err, s->user);
        } else if (s->ops.on_error) {
            s->ops.on_error(s, err, s->user);
        }
    }
    maybe_finish(s);
}

/* ---------------- engines and connections ---------------- */

static struct conn *engine_conn(bex_ctx *ctx, uint32_t id)
{
    struct conn *c = ctx->engines[id % ENGINE_TABLE];
    return c && c->eng_id == id ? c : NULL;
}

/* An accepted connection leaves the setup table (bex_ctx_config.setup_max):
 * its hello finished, or it failed. */
static void setup_end(struct conn *c)
{
    if (c->in_setup) {
        c->in_setup = false;
        c->ctx->n_setup--;
    }
}

/* A connection holds nothing but its descriptor and this struct until its
 * engine is made (engine_make): CQ entries are reserved then. */
static int conn_new(bex_ctx *ctx, int fd, bool client, struct conn **out)
{
    struct conn *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    uint32_t id;
    do {
        id = ++ctx->next_engine_id;
    } while (id == 0 || ctx->engines[id % ENGINE_TABLE]);
    c->tag.kind = EV_CONN;
    c->ctx = ctx;
    c->fd = fd;
    c->client = client;
    c->eng_id = id;
    c->next_stream = 1;
    c->deadline = bex__now_ms() + ctx->cfg.connect_timeout_ms;
    ctx->engines[id % ENGINE_TABLE] = c;
    c->next = ctx->conns;
    ctx->conns = c;
    *out = c;
    return 0;
}

static void conn_free(struct conn *c)
{
    bex_ctx *ctx = c->ctx;
    for (struct conn **p = &ctx->conns; *p; p = &(*p)->next) {
        if (*p == c) {
            *p = c->next;
            break;
        }
    }
    ctx->engines[c->eng_id % ENGINE_TABLE] = NULL;
    ctx->cqe_used -= c->cqe_reserved;
    setup_end(c);
    if (c->fd >= 0) {
        epoll_ctl(ctx->epfd, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
    }
    if (c->eng) {
        bex__engine_destroy(c->eng);
        BEX__STAT_ADD(&ctx->stats, engines, (uint64_t)-1);
    }
    free(c);
}

/* The connection is finished: its engine is dead or never was. Every socket
 * on it learns the error; the engine already handed their messages back. */
static void conn_finish(struct conn *c, int err)
{
    if (c->dead)
        return;
    setup_end(c); /* its place in the setup table is free at once */
    c->dead = true;
    if (c->fd >= 0) {
        /* the TCP side has nothing more to say; level-triggered events of a
         * failed socket would otherwise come back every loop */
        epoll_ctl(c->ctx->epfd, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
        c->fd = -1;
    }
    bool connecting = c->phase != P_UP;
    for (int i = 0; i < CONN_MAP; i++) {
        struct bex_sock *s = c->map[i];
        while (s) {
            struct bex_sock *next = s->map_next;
            s->attached = false; /* the engine let go */
            sock_fail(s, err, connecting && atomic_load(&s->state) == S_CONNECTING);
            s = next;
        }
    }
}

/* Fail a connection. Engine failure is synchronous: its on_fail finishes
 * the connection before this returns. */
static void conn_fail(struct conn *c, int err)
{
    if (c->dead)
        return;
    if (c->eng && !bex__engine_is_dead(c->eng))
        bex__engine_fail(c->eng, err); /* on_fail -> conn_finish */
    else
        conn_finish(c, err);
}

static int conn_want(struct conn *c, uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.ptr = &c->tag};
    return epoll_ctl(c->ctx->epfd, EPOLL_CTL_MOD, c->fd, &ev) ? -errno : 0;
}

/* "a.b.c.d:port" of the peer, for log lines (buf: 32 bytes). */
static const char *conn_name(const struct conn *c, char *buf)
{
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &c->key.sin_addr, ip, sizeof ip);
    snprintf(buf, 32, "peer %s:%u", ip, ntohs(c->key.sin_port));
    return buf;
}

static int engine_make(struct conn *c)
{
    bex_ctx *ctx = c->ctx;
    /* every completion the engine can have outstanding must fit the shared CQ */
    uint32_t need = ctx->ecfg.sq_depth + ctx->ecfg.rq_depth + 2;
    if (ctx->cqe_used + need > ctx->cqe_cap) {
        bex__log(&ctx->log, BEX_LOG_WARN,
                 "no room for another engine: %u of %u completion queue entries in use",
                 ctx->cqe_used, ctx->cqe_cap);
        return -ENOSPC;
    }
    int err = bex__engine_create(&ctx->sh, &ctx->ecfg, &engine_ops, c->eng_id, c, &c->eng);
    if (!err) {
        char name[32];
        bex__engine_set_name(c->eng, conn_name(c, name));
        ctx->cqe_used += need;
        c->cqe_reserved = need;
        BEX__STAT_ADD(&ctx->stats, engines, 1);
    }
    return err;
}

static void hello_fill(struct conn *c, struct bex__hello *h, uint64_t conn_id)
{
    bex_ctx *ctx = c->ctx;
    struct bex__engine_local l;
    bex__engine_local(c->eng, &l);
    memset(h, 0, sizeof(*h));
    h->qpn = l.qpn;
    h->psn = l.psn;
    memcpy(h->gid, ctx->sh.path.gid.raw, 16);
    h->mtu = (uint8_t)ctx->sh.path.active_mtu;
    h->rd_atomic = bex__rdma_dest_rd_atomic(ctx->dev, &ctx->sh.conn);
    h->recv_depth = (uint16_t)l.rq_depth;
    h->sq_depth = (uint16_t)ctx->ecfg.sq_depth;
    h->max_msg = l.max_msg;
    h->frag_size = ctx->ecfg.frag_size;
    h->conn_id = conn_id;
    h->eager_max = l.eager_max;
    h->max_rndv = (uint16_t)l.max_rndv;
    h->ka_addr = l.ka_addr;
    h->ka_rkey = l.ka_rkey;
}

static int peer_of_hello(const struct bex__hello *h, struct bex__engine_peer *p)
{
    if (h->flags & BEX__HELLO_F_NO_RDMA)
        return -EPROTONOSUPPORT;
    *p = (struct bex__engine_peer){
        .rdma = {.qpn = h->qpn, .psn = h->psn, .active_mtu = h->mtu, .rd_atomic = h->rd_atomic},
        .rq_depth = h->recv_depth,
        .max_rndv = h->max_rndv,
        .eager_max = h->eager_max,
        .max_msg = h->max_msg,
        .ka_addr = h->ka_addr,
        .ka_rkey = h->ka_rkey,
    };
    memcpy(p->rdma.gid.raw, h->gid, 16);
    return bex__engine_check_peer(p);
}

static void put_ready(uint8_t *p, uint32_t status)
{
    uint32_t v = htonl(BEX__READY_MAGIC);
    memcpy(p, &v, 4);
    v = htonl(status);
    memcpy(p + 4, &v, 4);
}

/* Write what is left in wbuf; returns 0 when all is out, 1 when waiting. */
static int conn_flush(struct conn *c)
{
    while (c->woff < c->wlen) {
        ssize_t n = send(c->fd, c->wbuf + c->woff, c->wlen - c->woff, MSG_NOSIGNAL);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return conn_want(c, EPOLLIN | EPOLLOUT | EPOLLRDHUP) ? -EIO : 1;
        if (n <= 0)
            return n < 0 ? -errno : -ECONNRESET;
        c->woff += (size_t)n;
    }
    return 0;
}

static int conn_queue(struct conn *c, const uint8_t *p, size_t n)
{
    if (c->woff == c->wlen)
        c->woff = c->wlen = 0;
    if (n > sizeof(c->wbuf) - c->wlen)
        return -ENOBUFS; /* cannot happen: wbuf holds all a side ever writes */
    memcpy(c->wbuf + c->wlen, p, n);
    c->wlen += n;
    return 0;
}

/* Queue and push out one or more setup messages: 0 or an error. */
static int conn_send(struct conn *c, const uint8_t *p, size_t n)
{
    int err = conn_queue(c, p, n);
    if (!err)
        err = conn_flush(c);
    return err < 0 ? err : 0;
}

/* Read the next setup message: its preamble first, which tells its kind and
 * length, so a peer of the other kind is recognised from 8 bytes. */
static void conn_expect(struct conn *c, int phase)
{
    c->phase = phase;
    c->rlen = 0;
    c->rwant = BEX__SETUP_PRE_LEN;
    c->framed = false;
    c->waiting_since = bex__now_ms();
}

static void conn_peer_addr(struct conn *c, struct sockaddr_in *a)
{
    socklen_t sl = sizeof(*a);
    if (c->key.sin_family == AF_INET)
        *a = c->key; /* kept from connect/accept4: a peer that reset has no getpeername */
    else if (c->fd < 0 || getpeername(c->fd, (struct sockaddr *)a, &sl) || a->sin_family != AF_INET)
        memset(a, 0, sizeof(*a));
}

/* A refusal's one log line, naming the peer. */
static void conn_log_refusal(struct conn *c, int err, const char *why)
{
    struct sockaddr_in a;
    conn_peer_addr(c, &a);
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
    if (c->client)
        bex__log(&c->ctx->log, BEX_LOG_WARN, "connection to %s:%u refused: %s (%s)", ip,
                 ntohs(a.sin_port), why, bex_strerror(err));
    else
        bex__log(&c->ctx->log, BEX_LOG_WARN, "refused peer %s:%u: %s (%s)", ip, ntohs(a.sin_port),
                 why, bex_strerror(err));
}

/* Refuse the peer: log once, tell it why when nothing else is on its way
 * (best effort: a notice with the errno, so its on_connect reports that and
 * not a bare reset), and close. */
static void conn_refuse(struct conn *c, int err, const char *why)
{
    conn_log_refusal(c, err, why);
    if (c->fd >= 0 && c->woff == c->wlen) {
        uint8_t n[BEX__READY_LEN];
        put_ready(n, (uint32_t)-err);
        ssize_t r = send(c->fd, n, sizeof n, MSG_NOSIGNAL | MSG_DONTWAIT);
        /* read what the peer already sent, so that close sends a FIN, not a
         * reset that could overtake the notice */
        uint8_t junk[256];
        for (int i = 0; i < 4 && recv(c->fd, junk, sizeof junk, MSG_DONTWAIT) > 0; i++)
            ;
        (void)r;
    }
    conn_fail(c, err);
}

/* The TCP endpoints as both sides name them: client first, then listener. */
static int conn_ends(struct conn *c)
{
    struct sockaddr_in me, peer;
    socklen_t sl = sizeof(me), pl = sizeof(peer);
    if (getsockname(c->fd, (struct sockaddr *)&me, &sl) ||
        getpeername(c->fd, (struct sockaddr *)&peer, &pl))
        return -errno;
    const struct sockaddr_in *cl = c->client ? &me : &peer, *li = c->client ? &peer : &me;
    bex__auth_ends(&c->auth, cl->sin_addr.s_addr, cl->sin_port, li->sin_addr.s_addr, li->sin_port);
    return 0;
}

/* RoCEv2: a peer at a.b.c.d has the GID ::ffff:a.b.c.d. A hello naming any
 * other GID would point our QP at someone else's, or at a host that merely
 * relays the setup. */
static bool gid_is_peer(struct conn *c, const uint8_t gid[16])
{
    struct sockaddr_in a;
    socklen_t sl = sizeof(a);
    if (getpeername(c->fd, (struct sockaddr *)&a, &sl) || a.sin_family != AF_INET)
        return false;
    uint8_t want[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    memcpy(want + 12, &a.sin_addr.s_addr, 4);
    return memcmp(want, gid, 16) == 0;
}

/* The client's first message: a plain hello, or with a secret an OPEN that
 * carries nothing but a nonce. */
static int setup_client_start(struct conn *c)
{
    if (c->ctx->has_secret) {
        uint8_t m[BEX__AUTH_SHORT_LEN];
        int err = bex__auth_nonce(c->auth.nonce_c);
        if (err)
            return err;
        bex__auth_encode(BEX__AUTH_OPEN, c->auth.nonce_c, m);
        conn_expect(c, P_WAIT_CHALLENGE);
        return conn_queue(c, m, sizeof m);
    }
    struct bex__hello h;
    uint8_t buf[BEX__HELLO_LEN];
    c->conn_id = bex__rdma_random_u64();
    hello_fill(c, &h, c->conn_id);
    bex__hello_encode(&h, buf);
    c->hello_first = true;
    conn_expect(c, P_WAIT_HELLO);
    return conn_queue(c, buf, sizeof buf);
}

/* The peer's hello (plain, or inside an authenticated HELLO whose MAC this
 * checks): check it fits this connection, bring the QP up, answer. */
static int setup_hello(struct conn *c, const char **why)
{
    bex_ctx *ctx = c->ctx;
    struct bex__hello h;
    int err;
    if (ctx->has_secret) {
        uint8_t mac[BEX__AUTH_MAC_LEN];
        if ((err = bex__auth_decode_hello(c->rbuf, c->rlen, &h, mac))) {
            *why = "malformed authenticated hello";
            return err;
        }
        const uint8_t *raw = c->rbuf + BEX__AUTH_HDR_LEN;
        if (c->client)
            err = bex__auth_verify(ctx->auth_key, BEX__AUTH_MAC_HELLO_L, &c->auth, raw, NULL, mac);
        else
            err = bex__auth_verify(ctx->auth_key, BEX__AUTH_MAC_HELLO_C, &c->auth, c->hello_l, raw,
                                   mac);
        if (err) {
            *why = c->client ? "the listener did not prove the shared secret"
                             : "the hello's MAC is wrong";
            return err;
        }
    } else {
        if (c->rkind == BEX__SETUP_AUTH) {
            *why = "the peer uses a shared secret; this side has none";
            return -EACCES;
        }
        if ((err = bex__hello_decode(c->rbuf, c->rlen, &h))) {
            *why = "malformed hello";
            return err;
        }
    }
    if (c->hello_first && h.conn_id != c->conn_id) {
        *why = "the hello does not answer ours (conn_id)";
        return -EPROTO;
    }
    if (!(h.flags & BEX__HELLO_F_NO_RDMA) && !gid_is_peer(c, h.gid)) {
        *why = "the hello's GID is not the TCP peer's address";
        return -EPROTO;
    }
    struct bex__engine_peer peer; /* a hello we cannot work with costs no engine */
    if ((err = peer_of_hello(&h, &peer))) {
        *why = err == -EPROTONOSUPPORT ? "the peer has no RDMA device"
                                       : "the hello grants too few receive credits to work";
        return err;
    }
    *why = "local setup failed";
    if (!c->eng && (err = engine_make(c)))
        return err;
    if ((err = bex__engine_connect(c->eng, &peer)))
        return err;
    uint8_t out[BEX__AUTH_HELLO_LEN + BEX__READY_LEN];
    size_t n = 0;
    if (!c->hello_first) {
        /* our hello answers the peer's: echo its conn_id */
        struct bex__hello mine;
        uint8_t raw[BEX__HELLO_LEN];
        hello_fill(c, &mine, h.conn_id);
        bex__hello_encode(&mine, raw);
        if (ctx->has_secret) {
            uint8_t mac[BEX__AUTH_MAC_LEN];
            bex__auth_mac(ctx->auth_key, BEX__AUTH_MAC_HELLO_C, &c->auth,
                          c->rbuf + BEX__AUTH_HDR_LEN, raw, mac);
            bex__auth_encode_hello(raw, mac, out);
            n = BEX__AUTH_HELLO_LEN;
        } else {
            memcpy(out, raw, BEX__HELLO_LEN);
            n = BEX__HELLO_LEN;
        }
    }
    /* our receives are posted and the QP is at RTS: the peer may send */
    put_ready(out + n, 0);
    *why = NULL; /* from here on an error is the connection's, not the peer's fault */
    conn_expect(c, P_WAIT_READY);
    return conn_send(c, out, n + BEX__READY_LEN);
}

/* One whole setup message is in rbuf: act on it. Returns 0 or an error;
 * *why is set when the error refuses the peer (logged, peer told). */
static int setup_msg(struct conn *c, const char **why)
{
    bex_ctx *ctx = c->ctx;
    int err;
    if (c->rkind == BEX__SETUP_NOTICE) {
        uint32_t st;
        memcpy(&st, c->rbuf + 4, 4);
        st = ntohl(st);
        if (st == 0 && c->phase == P_WAIT_READY) {
            c->phase = P_UP;
            setup_end(c);
            c->rwant = 1; /* from now on the TCP connection only tells EOF */
            c->rlen = 0;
            bex__engine_start(c->eng);
            return 0;
        }
        if (st == 0) {
            *why = "a readiness notice before the hellos";
            return -EPROTO;
        }
        /* the peer refused us or failed: say so once, it is closing anyway */
        err = st < 4096 ? -(int)st : -EPROTO;
        struct sockaddr_in a;
        conn_peer_addr(c, &a);
        char ip[INET_ADDRSTRLEN] = "?";
        inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
        bex__log(&ctx->log, BEX_LOG_INFO, "peer %s:%u ended the setup: %s", ip, ntohs(a.sin_port),
                 bex_strerror(err));
        return err;
    }
    switch (c->phase) {
    case P_WAIT_OPEN: { /* listener with a secret: the client's nonce */
        if (c->rkind == BEX__SETUP_HELLO) {
            *why = "the peer has no shared secret (plain hello)";
            return -EACCES;
        }
        if ((err = bex__auth_decode(c->rbuf, c->rlen, BEX__AUTH_OPEN, c->auth.nonce_c))) {
            *why = "expected OPEN";
            return err;
        }
        uint8_t m[BEX__AUTH_SHORT_LEN];
        if ((err = bex__auth_nonce(c->auth.nonce_l)) || (err = conn_ends(c)))
            return err;
        bex__auth_encode(BEX__AUTH_CHALLENGE, c->auth.nonce_l, m);
        conn_expect(c, P_WAIT_PROOF);
        return conn_send(c, m, sizeof m);
    }
    case P_WAIT_CHALLENGE: { /* client with a secret: prove it */
        if ((err = bex__auth_decode(c->rbuf, c->rlen, BEX__AUTH_CHALLENGE, c->auth.nonce_l))) {
            *why = "expected CHALLENGE";
            return err;
        }
        if ((err = conn_ends(c)))
            return err;
        uint8_t mac[BEX__AUTH_MAC_LEN], m[BEX__AUTH_SHORT_LEN];
        bex__auth_mac(ctx->auth_key, BEX__AUTH_MAC_PROOF_C, &c->auth, NULL, NULL, mac);
        bex__auth_encode(BEX__AUTH_PROOF, mac, m);
        conn_expect(c, P_WAIT_HELLO);
        return conn_send(c, m, sizeof m);
    }
    case P_WAIT_PROOF: { /* listener: the client proved the secret, or goes */
        uint8_t mac[BEX__AUTH_MAC_LEN], m[BEX__AUTH_HELLO_LEN];
        if ((err = bex__auth_decode(c->rbuf, c->rlen, BEX__AUTH_PROOF, mac))) {
            *why = "expected PROOF";
            return err;
        }
        if ((err = bex__auth_verify(ctx->auth_key, BEX__AUTH_MAC_PROOF_C, &c->auth, NULL, NULL,
                                    mac))) {
            *why = "wrong shared secret";
            return err;
        }
        /* only now does the peer cost us a QP */
        if ((err = engine_make(c))) {
            *why = "local setup failed";
            return err;
        }
        struct bex__hello mine;
        c->conn_id = bex__rdma_random_u64();
        hello_fill(c, &mine, c->conn_id);
        bex__hello_encode(&mine, c->hello_l);
        bex__auth_mac(ctx->auth_key, BEX__AUTH_MAC_HELLO_L, &c->auth, c->hello_l, NULL, mac);
        bex__auth_encode_hello(c->hello_l, mac, m);
        c->hello_first = true;
        conn_expect(c, P_WAIT_HELLO);
        return conn_send(c, m, sizeof m);
    }
    case P_WAIT_HELLO:
        return setup_hello(c, why);
    default:
        *why = "unexpected setup message";
        return -EPROTO;
    }
}

/* The TCP connection of a connection that is up ended. After an orderly
 * close (every socket closed by both sides) that is normal; with sockets
 * the peer never closed, it vanished (killed, rebooted, unplugged): say so
 * once, by name, before its sockets learn it. */
static void conn_lost(struct conn *c, int err)
{
    uint32_t open = 0;
    for (int i = 0; i < CONN_MAP; i++)
        for (struct bex_sock *s = c->map[i]; s; s = s->map_next)
            open += !s->dead;
    if (!open)
        return;
    char name[32];
    bex__log(&c->ctx->log, BEX_LOG_WARN,
             "%s (engine %u): connection lost with %u socket%s open (%s)", conn_name(c, name),
             c->eng_id, open, open == 1 ? "" : "s", bex_strerror(err));
}

/* Advance the setup state machine; any error fails the connection. */
static void conn_step(struct conn *c, uint32_t events)
{
    int err = 0;
    const char *why = NULL;
    if (c->dead || c->fd < 0)
        return;
    if (c->phase == P_CONNECTING) {
        if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP)))
            return;
        socklen_t sl = sizeof(err);
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &sl) || err) {
            err = err ? -err : -errno;
            goto fail;
        }
        if ((err = setup_client_start(c)))
            goto fail;
        if ((err = conn_want(c, EPOLLIN | EPOLLRDHUP)))
            goto fail;
    }
    if (events & EPOLLOUT || c->woff < c->wlen) {
        err = conn_flush(c);
        if (err < 0)
            goto fail;
        if (err == 0 && (err = conn_want(c, EPOLLIN | EPOLLRDHUP)))
            goto fail;
    }
    while (c->rlen < c->rwant) {
        ssize_t n = recv(c->fd, c->rbuf + c->rlen, c->rwant - c->rlen, 0);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        if (n <= 0) {
            err = n < 0 ? -errno : -ECONNRESET;
            goto fail;
        }
        c->rlen += (size_t)n;
        if (c->rlen < c->rwant)
            continue;
        if (c->phase == P_UP) {
            err = -EPROTO; /* nothing may follow the ready notice */
            goto fail;
        }
        if (!c->framed) {
            size_t len = 0;
            int kind = bex__setup_peek(c->rbuf, &len);
            if (kind < 0) {
                err = kind;
                why = "not a bex setup message";
                goto fail;
            }
            c->rkind = kind;
            c->framed = true;
            if (len > c->rlen) {
                c->rwant = len; /* <= BEX__SETUP_MAX_LEN, the peek's promise */
                continue;
            }
        }
        if ((err = setup_msg(c, &why)))
            goto fail;
    }
    return;
fail:
    if (why)
        conn_refuse(c, err, why);
    else {
        if (c->phase == P_UP)
            conn_lost(c, err);
        conn_fail(c, err);
    }
}

/* ---------------- engine upcalls (I/O thread) ---------------- */

static void eng_on_up(struct bex__engine *e)
{
    struct conn *c = bex__engine_user(e);
    for (int i = 0; i < CONN_MAP; i++) {
        for (struct bex_sock *s = c->map[i]; s; s = s->map_next) {
            atomic_store(&s->max_msg, bex__engine_peer_max_msg(e));
            int st = S_CONNECTING;
            if (atomic_compare_exchange_strong(&s->state, &st, S_OPEN) && !s->app_closed &&
                s->ops.on_connect)
                s->ops.on_connect(s, 0, s->user);
        }
    }
}

static void eng_on_msg(struct bex__engine *e, uint32_t stream, void *buf, size_t len)
{
    struct conn *c = bex__engine_user(e);
    struct bex_sock *s = map_find(c, stream);
    if (!s || s->dead || s->app_closed || !s->ops.on_recv) {
        bex_mem_free(buf); /* the socket is gone: nobody to give it to */
        return;
    }
    s->ops.on_recv(s, buf, len, s->user);
}

static void eng_on_open(struct bex__engine *e, uint32_t stream)
{
    struct conn *c = bex__engine_user(e);
    struct bex_sock *s = map_find(c, stream);
    if (s || c->client) {
        char name[32];
        bex__log(&c->ctx->log, BEX_LOG_ERROR, "%s (engine %u): unexpected OPEN of stream %u",
                 conn_name(c, name), c->eng_id, stream);
        conn_fail(c, -EPROTO);
        return;
    }
    if (c->nsocks >= c->ctx->cfg.streams_max) {
        /* the peer's socket fails; nothing is allocated for it here */
        /* INFO: refusing a stream is flow control; should the peer go on
         * regardless, the engine fails with the one WARN/ERROR line that
         * names it */
        char name[32];
        if (!c->refusal_logged)
            bex__log(&c->ctx->log, BEX_LOG_INFO,
                     "%s (engine %u): opens more than %u streams on one connection; "
                     "refusing them (logged once per connection)",
                     conn_name(c, name), c->eng_id, c->ctx->cfg.streams_max);
        c->refusal_logged = true;
        if (bex__engine_refuse_stream(e, stream))
            conn_fail(c, -EPROTO);
        return;
    }
    s = calloc(1, sizeof(*s));
    if (!s) {
        conn_fail(c, -ENOMEM);
        return;
    }
    s->ctx = c->ctx;
    s->conn = c;
    s->id = stream;
    atomic_init(&s->state, S_OPEN);
    atomic_init(&s->closing, false);
    atomic_init(&s->user_pub, NULL);
    atomic_init(&s->max_msg, bex__engine_peer_max_msg(e));
    bex__engine_attach(e, &s->st, stream, false);
    s->attached = true;
    atomic_init(&s->eng_id, c->eng_id);
    map_add(c, s);
    struct bex_listener *l = c->l;
    if (l && l->ops.on_accept)
        l->ops.on_accept(l, s, l->user);
    else
        bex_sock_close(s);
}

static void eng_on_peer_close(struct bex__engine *e, uint32_t stream)
{
    struct conn *c = bex__engine_user(e);
    struct bex_sock *s = map_find(c, stream);
    if (!s)
        return;
    /* the engine hands back what it held first (on_error says so); the
     * extra count keeps s alive should the stream finish meanwhile */
    s->pending++;
    if (s->attached)
        bex__engine_peer_closed(&s->st);
    s->pending--;
    sock_fail(s, -ECONNRESET, false);
}

static void eng_on_send_done(struct bex__engine *e, struct bex__msg *m, int status)
{
    (void)e;
    struct sock_msg *w = (struct sock_msg *)((char *)m - offsetof(struct sock_msg, m));
    struct bex_sock *s = w->s;
    s->pending--;
    report_done(s, m->buf, m->len, m->user, status);
    free(w);
    maybe_finish(s);
}

static void eng_on_stream_closed(struct bex__engine *e, struct bex__stream *st)
{
    (void)e;
    struct bex_sock *s = (struct bex_sock *)((char *)st - offsetof(struct bex_sock, st));
    s->attached = false;
    s->dead = true;
    maybe_finish(s);
}

/* Take an armed exposed slot back (delivery or cancel); false if another
 * thread took it first or it is no longer that arming. */
/* Window mode: an exposed slot's window, read before the slot is taken
 * (once it is free, another thread may claim it and set a new one). */
struct exposed_win {
    struct ibv_mw *mw;
    uint32_t key, eng_id;
    bool bound;
};

static struct exposed_win exposed_win_of(const struct exp_slot *x)
{
    return (struct exposed_win){x->mw, x->key, x->eng_id, x->bound};
}

/* The slot was taken by the I/O thread: its window goes. Bound on a live
 * engine: revoked there first; bound on a dead one: released with its QP
 * already; never bound: deallocated here. */
static void exposed_win_drop(bex_ctx *ctx, const struct exposed_win *w)
{
    if (!w->mw)
        return;
    struct conn *c = w->bound ? engine_conn(ctx, w->eng_id) : NULL;
    if (c && c->eng)
        bex__engine_retire_window(c->eng, w->mw, w->key, true);
    else if (!w->bound)
        ibv_dealloc_mw(w->mw);
}

static bool exposed_take(struct exp_slot *x, uint32_t gen)
{
    uint32_t want = X_WORD(gen, X_ARMED);
    return atomic_compare_exchange_strong(&x->state, &want, X_WORD(gen, X_FREE));
}

static int eng_on_direct(struct bex__engine *e, uint32_t imm)
{
    struct conn *c = bex__engine_user(e);
    uint32_t i = imm & 0xffff, gen = (imm >> 16) & 0x7fff;
    if (i >= EXPOSED_MAX)
        return -EPROTO;
    struct exp_slot *x = &c->ctx->exposed[i];
    if (atomic_load_explicit(&x->state, memory_order_acquire) != X_WORD(gen, X_ARMED) ||
        x->eng_id != c->eng_id)
        return -EPROTO;
    struct bex_sock *s = x->s;
    void *buf = x->buf, *user = x->user;
    uint32_t len = x->len;
    struct ibv_mw *mw = x->mw; /* read before the take: then the slot may be reused */
    uint32_t key = x->key;
    bool bound = x->bound;
    if (!exposed_take(x, gen))
        return 0; /* bex_sock_expose took it back in a race with a failure */
    if (mw)       /* revoked before anything else goes out on this QP */
        bex__engine_retire_window(e, mw, key, bound);
    BEX__STAT_ADD(&c->ctx->stats, bytes_recv, len);
    /* an exposed buffer is the application's until it is reported, never
     * freed by bex behind its back */
    if (!s->dead && !s->app_closed && s->ops.on_recv)
        s->ops.on_recv(s, buf, len, s->user);
    else
        report_done(s, buf, len, user, -ECANCELED);
    return 0;
}

/* Hand back the exposed buffers of a socket that can take no more (the
 * engine is dead, or the peer closed the stream: it writes nothing more). */
static void exposed_cancel(struct bex_sock *s)
{
    for (uint32_t i = 0; i < EXPOSED_MAX; i++) {
        struct exp_slot *x = &s->ctx->exposed[i];
        uint32_t v = atomic_load(&x->state);
        if (X_KIND(v) != X_ARMED || x->s != s)
            continue;
        void *buf = x->buf, *user = x->user;
        uint32_t len = x->len;
        struct exposed_win w = exposed_win_of(x);
        if (exposed_take(x, X_GEN(v))) {
            exposed_win_drop(s->ctx, &w);
            report_done(s, buf, len, user, -ECANCELED);
        }
    }
}

static void eng_on_fail(struct bex__engine *e, int err)
{
    struct conn *c = bex__engine_user(e);
    conn_finish(c, err);
}

static const struct bex__engine_ops engine_ops = {
    .on_up = eng_on_up,
    .on_msg = eng_on_msg,
    .on_open = eng_on_open,
    .on_peer_close = eng_on_peer_close,
    .on_send_done = eng_on_send_done,
    .on_stream_closed = eng_on_stream_closed,
    .on_direct = eng_on_direct,
    .on_fail = eng_on_fail,
};

/* ---------------- commands (I/O thread) ---------------- */

static int conn_start_client(bex_ctx *ctx, const struct sockaddr_in *to, struct conn **out)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_addr = ctx->cfg.local_addr};
    int err = 0;
    if (bind(fd, (struct sockaddr *)&me, sizeof(me))) {
        err = -errno;
        close(fd);
        return err;
    }
    struct conn *c;
    if ((err = conn_new(ctx, fd, true, &c))) {
        close(fd);
        return err;
    }
    c->key = *to;
    c->phase = P_CONNECTING;
    /* the engine exists from the start, so sockets can queue sends at once;
     * and it is made before connect, so that our first setup message follows
     * the handshake at once: a listener under a flood closes first the
     * connections that have said nothing (setup_max) */
    if ((err = engine_make(c))) {
        c->dead = true;
        return err;
    }
    if (connect(fd, (const struct sockaddr *)to, sizeof(*to)) && errno != EINPROGRESS) {
        err = -errno;
        c->dead = true;
        return err;
    }
    struct epoll_event ev = {.events = EPOLLOUT | EPOLLIN | EPOLLRDHUP, .data.ptr = &c->tag};
    if (epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, fd, &ev)) {
        err = -errno;
        c->dead = true;
        return err;
    }
    *out = c;
    return 0;
}

static void do_connect(bex_ctx *ctx, struct bex_sock *s)
{
    struct conn *c = NULL;
    for (struct conn *p = ctx->conns; p; p = p->next) {
        if (p->client && !p->dead && (!p->eng || !bex__engine_is_dead(p->eng)) &&
            p->key.sin_addr.s_addr == s->peer.sin_addr.s_addr &&
            p->key.sin_port == s->peer.sin_port) {
            c = p;
            break;
        }
    }
    if (!c) {
        int err = conn_start_client(ctx, &s->peer, &c);
        if (err) {
            sock_fail(s, err, true);
            return;
        }
    }
    s->conn = c;
    s->id = c->next_stream++;
    map_add(c, s);
    bex__engine_attach(c->eng, &s->st, s->id, true);
    s->attached = true;
    atomic_store(&s->eng_id, c->eng_id);
    if (bex__engine_is_up(c->eng)) {
        atomic_store(&s->max_msg, bex__engine_peer_max_msg(c->eng));
        atomic_store(&s->state, S_OPEN);
        if (s->ops.on_connect && !s->app_closed)
            s->ops.on_connect(s, 0, s->user);
    }
}

static void do_send(bex_ctx *ctx, struct sock_msg *w)
{
    (void)ctx;
    struct bex_sock *s = w->s;
    if (!s->attached || s->dead) {
        /* accepted by bex_sock_send, but the socket died meanwhile */
        report_done(s, w->m.buf, w->m.len, w->m.user, -ECANCELED);
        free(w);
        maybe_finish(s);
        return;
    }
    s->pending++;
    bex__engine_send(&s->st, &w->m);
}

static void do_close(struct bex_sock *s)
{
    if (s->app_closed)
        return;
    s->app_closed = true;
    /* Connecting or up alike, the queue is sent, then CLOSE; the engine
     * lets go by on_stream_closed (or on_fail). A stream the peer closed
     * is closing already. */
    if (s->attached && !s->dead)
        bex__engine_close_stream(&s->st);
    if (!s->attached)
        s->dead = true;
    maybe_finish(s);
}

/* Window mode: bind an exposed buffer's window on its engine's QP. */
static void do_bind(bex_ctx *ctx, struct bind_cmd *bc)
{
    struct exp_slot *x = &ctx->exposed[bc->slot];
    if (atomic_load(&x->state) == X_WORD(bc->gen, X_ARMED) && x->mw && !x->bound) {
        struct conn *c = engine_conn(ctx, x->eng_id);
        if (c && c->eng && !bex__engine_is_dead(c->eng)) {
            bex__engine_bind_window(c->eng, x->mw, x->key, x->buf, x->len);
            x->bound = true;
        }
    }
    free(bc);
}

static void do_listen(bex_ctx *ctx, struct bex_listener *l)
{
    l->next = ctx->listeners;
    ctx->listeners = l;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &l->tag};
    epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, l->fd, &ev);
}

static bool drain_cmds(bex_ctx *ctx)
{
    /* a plain look first: the spinning loop must not take the line that
     * other threads push to (a locked exchange) on every empty turn; the
     * sleep path checks again with seq_cst */
    if (!atomic_load_explicit(&ctx->cmds, memory_order_relaxed))
        return false;
    struct bex__cmd *list = atomic_exchange(&ctx->cmds, NULL);
    if (!list)
        return false;
    struct bex__cmd *fifo = NULL;
    while (list) { /* the stack is newest first */
        struct bex__cmd *n = list->next;
        list->next = fifo;
        fifo = list;
        list = n;
    }
    while (fifo) {
        struct bex__cmd *c = fifo;
        fifo = c->next;
        switch (c->type) {
        case CMD_SEND:
            do_send(ctx, (struct sock_msg *)c);
            break;
        case CMD_CONNECT:
            do_connect(ctx,
                       (struct bex_sock *)((char *)c - offsetof(struct bex_sock, connect_cmd)));
            break;
        case CMD_CLOSE:
            do_close((struct bex_sock *)((char *)c - offsetof(struct bex_sock, close_cmd)));
            break;
        case CMD_LISTEN: {
            struct bex_listener *l =
                (struct bex_listener *)((char *)c - offsetof(struct bex_listener, cmd));
            do_listen(ctx, l);
            sem_post(&l->done);
            break;
        }
        case CMD_SET_USER: {
            struct set_user_cmd *u = (struct set_user_cmd *)c;
            if (u->has_ops)
                u->s->ops = u->ops;
            u->s->user = u->user;
            free(u);
            break;
        }
        case CMD_UNLISTEN: {
            struct bex_listener *l =
                (struct bex_listener *)((char *)c - offsetof(struct bex_listener, cmd));
            for (struct bex_listener **p = &ctx->listeners; *p; p = &(*p)->next)
                if (*p == l) {
                    *p = l->next;
                    break;
                }
            epoll_ctl(ctx->epfd, EPOLL_CTL_DEL, l->fd, NULL);
            for (struct conn *cn = ctx->conns; cn; cn = cn->next)
                if (cn->l == l)
                    cn->l = NULL;
            sem_post(&l->done);
            break;
        }
        case CMD_STOP:
            ctx->stopping = true;
            break;
        case CMD_BIND:
            do_bind(ctx, (struct bind_cmd *)c);
            break;
        }
    }
    return true;
}

/* Close an accepted connection in setup to make room: the oldest that has
 * said nothing yet (no byte read, none waiting: idle, or closed with its EOF
 * not yet read), else the one whose next message is overdue the most (since
 * our last answer to it). A legitimate client sends its first message at
 * once and answers each of ours at once: a burst of connections that say
 * nothing or close at once cannot push it out, and ones that stop half way
 * give way before it (docs/configuration.md, setup_max). One recv(MSG_PEEK)
 * per eviction, plus one per quiet-looking connection found talking (once:
 * it is marked). Returns whether there was one. */
static bool setup_evict_oldest(bex_ctx *ctx)
{
    int first = ctx->has_secret ? P_WAIT_OPEN : P_WAIT_HELLO;
    for (;;) {
        struct conn *old = NULL;
        bool old_quiet = false;
        for (struct conn *c = ctx->conns; c; c = c->next) { /* newest first */
            if (!c->in_setup || c->fd < 0)
                continue;
            bool quiet = c->phase == first && !c->rlen && !c->heard;
            if (!old || (quiet && !old_quiet) ||
                (quiet == old_quiet && c->waiting_since <= old->waiting_since)) {
                old = c;
                old_quiet = quiet;
            }
        }
        if (!old)
            return false;
        char b;
        if (old_quiet && recv(old->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) > 0) {
            old->heard = true; /* its first bytes wait to be read: under way */
            continue;
        }
        conn_fail(old, -ECONNABORTED);
        return true;
    }
}

/* accept4 failed for want of descriptors or memory: the backlog stays
 * readable, and a level-triggered listener would wake the I/O thread at
 * once, forever. Leave epoll for a while (doubling up to 500 ms); tick()
 * brings the listener back. */
static void listener_pause(bex_ctx *ctx, struct bex_listener *l, int err)
{
    if (!l->backoff_ms)
        bex__log(&ctx->log, BEX_LOG_WARN, "listener on port %u: accept: %s; retrying with backoff",
                 ntohs(l->addr.sin_port), strerror(err));
    l->backoff_ms = l->backoff_ms ? (l->backoff_ms * 2 > 500 ? 500 : l->backoff_ms * 2) : 20;
    epoll_ctl(ctx->epfd, EPOLL_CTL_DEL, l->fd, NULL);
    l->paused = true;
    l->paused_until = bex__now_ms() + l->backoff_ms;
}

static void do_accept(bex_ctx *ctx, struct bex_listener *l)
{
    bool evicted = false;
    /* a bounded batch: a flood that refills the backlog as fast as we
     * accept must not keep the I/O thread from its engines (keepalive,
     * completions); the level-triggered listener brings us back */
    for (int k = 0; k < ACCEPT_BATCH; k++) {
        struct sockaddr_in peer = {0};
        socklen_t pl = sizeof(peer);
        int fd = accept4(l->fd, (struct sockaddr *)&peer, &pl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            int err = errno;
            if (err != EMFILE && err != ENFILE && err != ENOBUFS && err != ENOMEM)
                return; /* EAGAIN: the backlog is empty; or an aborted connection */
            /* a descriptor held by a connection that never finished its
             * hello is the one to give up first */
            if (!evicted && setup_evict_oldest(ctx)) {
                evicted = true;
                continue;
            }
            listener_pause(ctx, l, err);
            return;
        }
        l->backoff_ms = 0;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        /* Setup costs no CQ entries or QP, but it is bounded: an idle or
         * slow connection gives its place to the newcomer, so connections
         * held open without a hello cannot lock out the ones that talk. */
        if (ctx->n_setup >= ctx->cfg.setup_max) {
            /* once per flood: the first eviction after 10 s without one */
            uint64_t now = bex__now_ms();
            if (ctx->n_setup_evictions++ == 0 || now - ctx->setup_evicted_ms > 10000)
                bex__log(&ctx->log, BEX_LOG_WARN,
                         "%u connections in setup (setup_max): closing the oldest silent one "
                         "for each new one (logged once per flood)",
                         ctx->n_setup);
            ctx->setup_evicted_ms = now;
            setup_evict_oldest(ctx);
        }
        struct conn *c;
        if (conn_new(ctx, fd, false, &c)) {
            close(fd);
            continue;
        }
        c->in_setup = true;
        ctx->n_setup++;
        c->l = l;
        if (peer.sin_family == AF_INET)
            c->key = peer;
        conn_expect(c, ctx->has_secret ? P_WAIT_OPEN : P_WAIT_HELLO);
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = &c->tag};
        if (epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, fd, &ev))
            c->dead = true;
    }
}

/* ---------------- the I/O thread ---------------- */

static void reap(bex_ctx *ctx)
{
    struct conn *c = ctx->conns;
    while (c) {
        struct conn *next = c->next;
        if (c->dead && c->nsocks == 0)
            conn_free(c);
        c = next;
    }
}

static void tick(bex_ctx *ctx, uint64_t now)
{
    for (struct bex_listener *l = ctx->listeners; l; l = l->next) {
        if (l->paused && now >= l->paused_until) {
            struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &l->tag};
            l->paused = false;
            if (epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, l->fd, &ev))
                listener_pause(ctx, l, errno);
        }
    }
    for (struct conn *c = ctx->conns; c; c = c->next) {
        if (c->dead)
            continue;
        if (c->phase != P_UP && now > c->deadline) {
            if (c->client)
                conn_fail(c, -ETIMEDOUT); /* on_connect says so */
            else {                        /* a peer that never finishes its setup is refused, by
                                           * name; closed without a notice, as before */
                conn_log_refusal(c, -ETIMEDOUT, "setup not finished in time");
                conn_fail(c, -ETIMEDOUT);
            }
            continue;
        }
        if (c->eng)
            bex__engine_tick(c->eng, now);
    }
}

static void handle_events(bex_ctx *ctx, struct epoll_event *ev, int n)
{
    for (int i = 0; i < n; i++) {
        struct ep_tag *t = ev[i].data.ptr;
        switch (t->kind) {
        case EV_CHANNEL: {
            struct ibv_cq *cq;
            void *cq_ctx;
            while (ibv_get_cq_event(ctx->ch, &cq, &cq_ctx) == 0)
                ibv_ack_cq_events(cq, 1);
            break;
        }
        case EV_EVENTFD: {
            uint64_t v;
            ssize_t r = read(ctx->evfd, &v, sizeof(v));
            (void)r;
            break;
        }
        case EV_LISTENER:
            do_accept(ctx, (struct bex_listener *)t);
            break;
        case EV_CONN:
            conn_step((struct conn *)t, ev[i].events);
            break;
        }
    }
}

/* Hand each completion to its engine, found by the id in its wr_id. */
static void dispatch(bex_ctx *ctx, const struct ibv_wc *wc, int n)
{
    for (int i = 0; i < n; i++) {
        struct conn *c = engine_conn(ctx, bex__wr_engine(wc[i].wr_id));
        if (c && c->eng) /* else a stale completion of a destroyed engine */
            bex__engine_complete(c->eng, &wc[i]);
    }
}

/* ibv_poll_cq failed: completions may be lost, and with them the hand-back
 * of messages; no engine of this CQ can be trusted to finish. */
static void cq_failed(bex_ctx *ctx, int n)
{
    bool any = false;
    for (struct conn *c = ctx->conns; c; c = c->next) {
        if (c->eng && !c->dead) {
            any = true;
            conn_fail(c, -EIO);
        }
    }
    if (any) /* once per failure, not per poll */
        bex__log(&ctx->log, BEX_LOG_ERROR, "ibv_poll_cq: %d; every engine failed", n);
}

static void *io_main(void *arg)
{
    bex_ctx *ctx = arg;
    io_ctx = ctx;
    struct ibv_wc wc[WC_BATCH];
    struct epoll_event ev[16];
    uint64_t next_tick = 0, idle_since = 0;
    uint32_t spins = 0, idle_polls = 0;
    bool spun_out = false;
    while (!ctx->stopping) {
        bool did = false;
        int n = bex__rdma_poll_cq(ctx->sh.cq, WC_BATCH, wc);
        if (n < 0)
            cq_failed(ctx, n);
        dispatch(ctx, wc, n);
        did |= n > 0;
        did |= drain_cmds(ctx);
        for (struct conn *c = ctx->conns; c; c = c->next)
            if (c->eng && !c->dead)
                did |= bex__engine_progress(c->eng);
        reap(ctx);
        uint64_t now = bex__now_ms();
        if (now >= next_tick) {
            tick(ctx, now);
            next_tick = now + TICK_MS;
        }
        if (did) {
            idle_since = 0;
            idle_polls = 0;
            spun_out = false;
            if (++spins % 64 == 0) {
                int m = epoll_wait(ctx->epfd, ev, 16, 0);
                handle_events(ctx, ev, m);
            }
            continue;
        }
        /* The precise clock may be a system call (see bex__now_ms): while
         * spinning, look at it on every 16th idle poll only. */
        if (idle_polls++ % 16 == 0) {
            uint64_t t = now_us();
            if (!idle_since)
                idle_since = t;
            spun_out = t - idle_since >= ctx->cfg.poll_spin_us;
        }
        if (!spun_out) {
            if (++spins % 64 == 0) {
                int m = epoll_wait(ctx->epfd, ev, 16, 0);
                handle_events(ctx, ev, m);
            }
            continue;
        }
        /* Sleep: arm the CQ, then look once more so nothing slips between. */
        ibv_req_notify_cq(ctx->sh.cq, 0);
        atomic_store(&ctx->sleeping, 1);
        n = bex__rdma_poll_cq(ctx->sh.cq, WC_BATCH, wc);
        if (n < 0)
            cq_failed(ctx, n);
        if (n > 0 || atomic_load(&ctx->cmds)) {
            atomic_store(&ctx->sleeping, 0);
            dispatch(ctx, wc, n);
            idle_since = 0;
            idle_polls = 0;
            spun_out = false;
            continue;
        }
        now = bex__now_ms();
        int timeout = next_tick > now ? (int)(next_tick - now) : 0;
        int m = epoll_wait(ctx->epfd, ev, 16, timeout);
        atomic_store(&ctx->sleeping, 0);
        if (m > 0)
            handle_events(ctx, ev, m);
        idle_since = 0;
        idle_polls = 0;
        spun_out = false;
    }
    return NULL;
}

/* ---------------- public API ---------------- */

#define DEF(field, v)                                                                              \
    do {                                                                                           \
        if (!c->field)                                                                             \
            c->field = (v);                                                                        \
    } while (0)

static int config_check(bex_ctx_config *c)
{
    if (c->local_addr.s_addr == htonl(INADDR_ANY))
        return -EINVAL;
    DEF(sq_depth, 32);
    DEF(rq_depth, 64);
    DEF(eager_max, 8192);
    DEF(frag_size, 65536);
    DEF(rndv_ahead, 8);
    DEF(keepalive_ms, 100);
    DEF(keepalive_timeout_ms, 2000);
    DEF(connect_timeout_ms, 3000);
    DEF(poll_spin_us, 50);
    DEF(qp_timeout, 14);
    DEF(qp_retry_cnt, 7);
    DEF(qp_rnr_retry, 7);
    DEF(max_msg, 64u << 20);
    DEF(rndv_max, 256);
    DEF(rndv_bytes_max, (uint64_t)256 << 20);
    DEF(recv_bytes_max, (uint64_t)1 << 30);
    DEF(streams_max, 1024);
    DEF(setup_max, 64);
    DEF(rndv_timeout_ms, 30000);
    DEF(credit_timeout_ms, 30000);
    /* sq_depth: a power of two, so that send slots map continuously when
     * the engine's 32-bit counters wrap */
    if (c->sq_depth < 2 || c->sq_depth > 4096 || (c->sq_depth & (c->sq_depth - 1)) ||
        c->rq_depth < BEX__ENGINE_MIN_DEPTH || c->rq_depth > 16384 || c->eager_max > (1u << 20) ||
        c->frag_size < 256 || c->rndv_ahead > 256 ||
        c->keepalive_timeout_ms < 2 * c->keepalive_ms || c->log_level < 0 ||
        c->log_level > BEX_LOG_DEBUG || c->max_msg > INT32_MAX || c->rndv_max > 32767 ||
        c->remote_access > BEX_REMOTE_ACCESS_WINDOW)
        return -EINVAL;
    /* peer-writable memory only in a landing pool, nothing else there */
    if ((c->pool && bex_mem_pool_kind(c->pool) != BEX_MEM_POOL_GENERAL) ||
        (c->landing_pool && bex_mem_pool_kind(c->landing_pool) != BEX_MEM_POOL_LANDING))
        return -EINVAL;
    return 0;
}

/* Landing or window mode (docs/security.md). Automatic: windows where they
 * are trustworthy. Not on rxe: it checks a write against the MR's range,
 * not the window's, so a window there scopes nothing the landing layout
 * does not; and invalidating an unbound window panics its kernel, which a
 * peer can provoke (SEND_WITH_INV) once windows are in use. */
static int pick_remote_access(bex_ctx *ctx, uint32_t want)
{
    const struct ibv_device_attr *a = &ctx->dev->attr;
    bool rxe = strncmp(ctx->dev->name, "rxe", 3) == 0 || a->vendor_id == 0xffffff;
    bool mw2 =
        a->device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B);
    if (want == BEX_REMOTE_ACCESS_AUTO)
        want = mw2 && !rxe ? BEX_REMOTE_ACCESS_WINDOW : BEX_REMOTE_ACCESS_LANDING;
    ctx->sh.windows = want == BEX_REMOTE_ACCESS_WINDOW;
    if (ctx->sh.windows) {
        /* the device must really allocate type-2 windows on this PD */
        struct ibv_mw *mw = ibv_alloc_mw(ctx->dev->pd, IBV_MW_TYPE_2);
        if (!mw)
            return -EOPNOTSUPP;
        ibv_dealloc_mw(mw);
    }
    return 0;
}

int bex_ctx_remote_access(const bex_ctx *ctx)
{
    return ctx->sh.windows ? BEX_REMOTE_ACCESS_WINDOW : BEX_REMOTE_ACCESS_LANDING;
}

int bex_ctx_create(const bex_ctx_config *cfg, bex_ctx **out)
{
    if (!cfg || !out)
        return -EINVAL;
    bex_ctx *ctx = calloc(1, sizeof(*ctx));
    if (!ctx)
        return -ENOMEM;
    ctx->cfg = *cfg;
    int err = config_check(&ctx->cfg);
    if (err) {
        free(ctx);
        return err;
    }
    /* keep the derived key only: the caller's buffer may go away */
    int have = bex__secret_resolve(cfg->secret, cfg->secret_len, ctx->auth_key);
    ctx->cfg.secret = NULL;
    ctx->cfg.secret_len = 0;
    if (have < 0) {
        free(ctx);
        return have;
    }
    ctx->has_secret = have > 0;
    bex__log_init(&ctx->log, ctx->cfg.log_fn, ctx->cfg.log_arg, ctx->cfg.log_level);
    const bex_ctx_config *c = &ctx->cfg;
    ctx->ecfg = (struct bex__engine_config){
        .sq_depth = c->sq_depth,
        .rq_depth = c->rq_depth,
        .eager_max = c->eager_max,
        .frag_size = c->frag_size,
        .send_window = c->send_window,
        .rndv_ahead = c->rndv_ahead,
        .keepalive_ms = c->keepalive_ms,
        .keepalive_timeout_ms = c->keepalive_timeout_ms,
        .max_msg = c->max_msg,
        .rndv_max = c->rndv_max,
        .rndv_bytes_max = c->rndv_bytes_max,
        .rndv_timeout_ms = c->rndv_timeout_ms,
        .credit_timeout_ms = c->credit_timeout_ms,
    };
    ctx->engines = calloc(ENGINE_TABLE, sizeof(*ctx->engines));
    if (!ctx->engines) {
        err = -ENOMEM;
        goto err_free;
    }
    err = bex__rdma_dev_open_ipv4(c->local_addr, &ctx->dev, &ctx->sh.path);
    if (err)
        goto err_free;
    if (ctx->sh.path.active_mtu == 0) {
        err = -ENETDOWN;
        goto err_close_dev;
    }
    ctx->sh.dev = ctx->dev;
    ctx->sh.pd = ctx->dev->pd;
    ctx->sh.stats = &ctx->stats;
    ctx->sh.log = &ctx->log;
    ctx->sh.conn = (struct bex__rdma_conn_config){
        .timeout = c->qp_timeout, .retry_cnt = c->qp_retry_cnt, .rnr_retry = c->qp_rnr_retry};
    if (c->pool) {
        ctx->sh.pool = c->pool;
    } else {
        bex_mem_registrar reg;
        bex_mem_registrar_verbs(&reg, ctx->dev->pd, 0);
        if ((err = bex_mem_pool_create(&reg, NULL, &ctx->sh.pool)))
            goto err_close_dev;
        ctx->own_pool = true;
    }
    /* Received buffers have a pool of their own, registered like the main
     * one: only the I/O thread allocates from it, so its in-use count is what
     * the context holds of received data (recv_bytes_max). */
    bex_mem_registrar rreg;
    bex_mem_pool_registrar(ctx->sh.pool, &rreg);
    if ((err = bex_mem_pool_create(&rreg, NULL, &ctx->sh.recv_pool)))
        goto err_pool;
    ctx->sh.recv_max = c->recv_bytes_max;
    if ((err = pick_remote_access(ctx, c->remote_access)))
        goto err_recv_pool;
    if (c->landing_pool) {
        ctx->sh.landing = c->landing_pool;
    } else {
        /* Rendezvous destinations and exposed buffers: the only memory a
         * peer may write, payload pages with no allocator state in reach.
         * In window mode only windows bound on it grant remote access. */
        bex_mem_registrar reg;
        bex_mem_registrar_verbs(
            &reg, ctx->dev->pd,
            IBV_ACCESS_LOCAL_WRITE |
                (ctx->sh.windows ? IBV_ACCESS_MW_BIND : IBV_ACCESS_REMOTE_WRITE));
        bex_mem_config mc = {.kind = BEX_MEM_POOL_LANDING};
        if ((err = bex_mem_pool_create(&reg, &mc, &ctx->sh.landing)))
            goto err_recv_pool;
        ctx->own_landing = true;
    }
    if ((err = bex__rdma_channel_create(ctx->dev, &ctx->ch)))
        goto err_landing;
    int cqe = ctx->dev->attr.max_cqe < 16384 ? ctx->dev->attr.max_cqe : 16384;
    if ((err = bex__rdma_cq_create(ctx->dev, cqe, ctx->ch, &ctx->sh.cq)))
        goto err_channel;
    ctx->cqe_cap = (uint32_t)cqe;
    ctx->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (ctx->epfd < 0) {
        err = -errno;
        goto err_cq;
    }
    ctx->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (ctx->evfd < 0) {
        err = -errno;
        goto err_epoll;
    }
    ctx->ch_tag.kind = EV_CHANNEL;
    ctx->ev_tag.kind = EV_EVENTFD;
    struct epoll_event e1 = {.events = EPOLLIN, .data.ptr = &ctx->ch_tag};
    struct epoll_event e2 = {.events = EPOLLIN, .data.ptr = &ctx->ev_tag};
    if (epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, ctx->ch->fd, &e1) ||
        epoll_ctl(ctx->epfd, EPOLL_CTL_ADD, ctx->evfd, &e2)) {
        err = -errno;
        goto err_evfd;
    }
    if ((err = -pthread_create(&ctx->thread, NULL, io_main, ctx)))
        goto err_evfd;
    *out = ctx;
    return 0;

err_evfd:
    close(ctx->evfd);
err_epoll:
    close(ctx->epfd);
err_cq:
    bex__rdma_cq_destroy(ctx->sh.cq);
err_channel:
    bex__rdma_channel_destroy(ctx->ch);
err_landing:
    if (ctx->own_landing)
        bex_mem_pool_destroy(ctx->sh.landing);
err_recv_pool:
    bex_mem_pool_destroy(ctx->sh.recv_pool);
err_pool:
    if (ctx->own_pool)
        bex_mem_pool_destroy(ctx->sh.pool);
err_close_dev:
    bex__rdma_dev_close(ctx->dev);
err_free:
    bex__log_fini(&ctx->log);
    free(ctx->engines);
    sodium_memzero(ctx->auth_key, sizeof ctx->auth_key);
    free(ctx);
    return err;
}

int bex_ctx_destroy(bex_ctx *ctx)
{
    if (!ctx)
        return 0;
    if (io_ctx == ctx)
        return -EDEADLK; /* it would join the thread it runs on */
    push_cmd(ctx, &ctx->stop_cmd, CMD_STOP);
    pthread_join(ctx->thread, NULL);
    while (ctx->conns) {
        struct conn *cn = ctx->conns;
        for (int i = 0; i < CONN_MAP; i++) {
            while (cn->map[i]) {
                struct bex_sock *s = cn->map[i];
                cn->map[i] = s->map_next;
                free(s); /* the application did not close it: reclaim anyway */
            }
        }
        cn->nsocks = 0;
        conn_free(cn);
    }
    /* A slot that is free had its window disposed of by whoever freed it
     * (its mw is stale then): only armed ones still own theirs. */
    for (uint32_t i = 0; i < EXPOSED_MAX; i++)
        if (X_KIND(atomic_load(&ctx->exposed[i].state)) == X_ARMED && ctx->exposed[i].mw &&
            !ctx->exposed[i].bound)
            ibv_dealloc_mw(ctx->exposed[i].mw); /* exposed, never bound */
    close(ctx->evfd);
    close(ctx->epfd);
    bex__rdma_cq_destroy(ctx->sh.cq);
    bex__rdma_channel_destroy(ctx->ch);
    if (ctx->own_pool && bex_mem_pool_destroy(ctx->sh.pool))
        bex__log(&ctx->log, BEX_LOG_ERROR, "context destroyed while buffers of its pool are live");
    if (bex_mem_pool_destroy(ctx->sh.recv_pool))
        bex__log(&ctx->log, BEX_LOG_ERROR, "context destroyed while received buffers are live");
    if (ctx->own_landing && bex_mem_pool_destroy(ctx->sh.landing))
        bex__log(&ctx->log, BEX_LOG_ERROR,
                 "context destroyed while buffers of its landing pool are live");
    bex__rdma_dev_close(ctx->dev);
    bex__log_fini(&ctx->log);
    free(ctx->engines);
    sodium_memzero(ctx->auth_key, sizeof ctx->auth_key);
    free(ctx);
    return 0;
}

bex_mem_pool *bex_ctx_pool(bex_ctx *ctx)
{
    return ctx->sh.pool;
}

bex_mem_pool *bex_ctx_recv_pool(bex_ctx *ctx)
{
    return ctx->sh.recv_pool;
}

bex_mem_pool *bex_ctx_landing_pool(bex_ctx *ctx)
{
    return ctx->sh.landing;
}

struct ibv_pd *bex_ctx_pd(bex_ctx *ctx)
{
    return ctx->dev->pd;
}

void *bex_sock_alloc(bex_ctx *ctx, size_t size)
{
    return bex_mem_alloc(ctx->sh.pool, size);
}

void *bex_sock_alloc_exposable(bex_ctx *ctx, size_t size)
{
    return bex_mem_alloc(ctx->sh.landing, size);
}

void bex_ctx_stats(bex_ctx *ctx, bex_sock_stats *o)
{
    struct bex__stats *s = &ctx->stats;
#define LD(f) o->f = atomic_load_explicit(&s->f, memory_order_relaxed)
    LD(msgs_sent);
    LD(msgs_recv);
    LD(bytes_sent);
    LD(bytes_recv);
    LD(sends_posted);
    LD(writes_posted);
    LD(post_send_calls);
    LD(post_recv_calls);
    LD(signaled);
    LD(credit_stalls);
    LD(window_stalls);
    LD(max_inflight_bytes);
    LD(credit_msgs);
    LD(engines);
    LD(recv_paused);
#undef LD
}

int bex_sock_connect(bex_ctx *ctx, const struct sockaddr_in *addr, const bex_sock_ops *ops,
                     void *user, bex_sock **out)
{
    if (!ctx || !addr || !out || addr->sin_family != AF_INET || addr->sin_port == 0)
        return -EINVAL;
    struct bex_sock *s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->ctx = ctx;
    if (ops)
        s->ops = *ops;
    s->user = user;
    atomic_init(&s->user_pub, user);
    s->peer = *addr;
    atomic_init(&s->state, S_CONNECTING);
    atomic_init(&s->closing, false);
    *out = s;
    push_cmd(ctx, &s->connect_cmd, CMD_CONNECT);
    return 0;
}

static int check_buf(bex_sock *s, void *buf, size_t len)
{
    if (len > INT32_MAX)
        return -EMSGSIZE;
    if (!buf)
        return -EINVAL;
    const bex_mem_region *r = bex_mem_mr(buf);
    bex_mem_pool *pool = bex_mem_pool_of(buf);
    if (!r ||
        (pool != s->ctx->sh.pool && pool != s->ctx->sh.recv_pool && pool != s->ctx->sh.landing) ||
        (uintptr_t)buf < (uintptr_t)r->addr ||
        (uintptr_t)buf + len > (uintptr_t)r->addr + r->length)
        return -EINVAL;
    return 0;
}

static int submit(bex_sock *s, void *buf, size_t len, void *msg_user, const bex_remote_buf *rb)
{
    if (atomic_load(&s->closing) || atomic_load(&s->state) == S_FAILED)
        return -EPIPE;
    int err = check_buf(s, buf, len);
    if (err)
        return err;
    if (rb && (rb->len != len || !(rb->token & BEX__IMM_DIRECT) || len == 0))
        return -EINVAL;
    /* the peer's limit, once known (sends queued before are checked by the
     * engine); a direct write goes to a buffer the peer sized itself */
    uint32_t peer_max = atomic_load_explicit(&s->max_msg, memory_order_relaxed);
    if (!rb && peer_max && len > peer_max)
        return -EMSGSIZE;
    /* malloc, not calloc (nor malloc + memset, which compilers turn into
     * calloc): glibc's calloc skips the per-thread cache and takes the
     * arena lock, some 300 instructions more per message */
    struct sock_msg *w = malloc(sizeof(*w));
    if (!w)
        return -ENOMEM;
    *w = (struct sock_msg){.s = s, .m = {.buf = buf, .len = len, .user = msg_user}};
    if (rb) {
        w->m.direct = true;
        w->m.raddr = rb->addr;
        w->m.rkey = rb->rkey;
        w->m.imm = rb->token;
    }
    push_cmd(s->ctx, &w->cmd, CMD_SEND);
    return 0;
}

int bex_sock_send(bex_sock *s, void *buf, size_t len, void *msg_user)
{
    if (!s)
        return -EINVAL;
    return submit(s, buf, len, msg_user, NULL);
}

int bex_sock_send_direct(bex_sock *s, void *buf, size_t len, const bex_remote_buf *rb,
                         void *msg_user)
{
    if (!s || !rb)
        return -EINVAL;
    return submit(s, buf, len, msg_user, rb);
}

int bex_sock_expose(bex_sock *s, void *buf, uint32_t len, void *msg_user, bex_remote_buf *out)
{
    if (!s || !out || len == 0)
        return -EINVAL;
    if (atomic_load(&s->closing) || atomic_load(&s->state) == S_FAILED)
        return -EPIPE;
    uint32_t eng = atomic_load(&s->eng_id);
    if (!eng)
        return -ENOTCONN;
    int err = check_buf(s, buf, len);
    if (err)
        return err;
    bex_ctx *ctx = s->ctx;
    if (bex_mem_pool_of(buf) != ctx->sh.landing)
        return -EINVAL; /* only landing memory may be peer-writable */
    /* Window mode: a window for this exposure alone; the I/O thread binds
     * it on the engine's QP ahead of anything sent after this call. */
    struct ibv_mw *mw = NULL;
    struct bind_cmd *bc = NULL;
    if (ctx->sh.windows) {
        errno = 0;
        mw = ibv_alloc_mw(ctx->dev->pd, IBV_MW_TYPE_2);
        if (!mw)
            return errno ? -errno : -ENOMEM;
        bc = malloc(sizeof(*bc));
        if (!bc) {
            ibv_dealloc_mw(mw);
            return -ENOMEM;
        }
    }
    for (uint32_t i = 0; i < EXPOSED_MAX; i++) {
        struct exp_slot *x = &ctx->exposed[i];
        uint32_t v = atomic_load_explicit(&x->state, memory_order_relaxed);
        if (X_KIND(v) != X_FREE)
            continue;
        uint32_t gen = (X_GEN(v) + 1) & 0x7fff;
        if (!atomic_compare_exchange_strong(&x->state, &v, X_WORD(gen, X_CLAIMED)))
            continue;
        x->eng_id = eng;
        x->buf = buf;
        x->len = len;
        x->user = msg_user;
        x->s = s;
        x->mw = mw;
        x->key = mw ? ibv_inc_rkey(mw->rkey) : 0;
        x->bound = false;
        out->addr = (uintptr_t)buf;
        out->rkey = mw ? x->key : bex_mem_mr(buf)->rkey;
        out->len = len;
        out->token = BEX__IMM_DIRECT | (gen << 16) | i;
        (void)BEX__FAULT(BEX__FAULT_EXPOSE_ARM); /* tests: a failure lands here */
        atomic_store(&x->state, X_WORD(gen, X_ARMED));
        /* The I/O thread marks a socket failed, then cancels its armed
         * slots (both seq_cst): either it saw this slot armed, or we see
         * the failure here and take the slot back ourselves. */
        if (atomic_load(&s->closing) || atomic_load(&s->state) == S_FAILED) {
            uint32_t want = X_WORD(gen, X_ARMED);
            if (atomic_compare_exchange_strong(&x->state, &want, X_WORD(gen, X_FREE))) {
                free(bc); /* never bound: the window is still ours */
                if (mw)
                    ibv_dealloc_mw(mw);
                return -EPIPE;
            }
            /* the I/O thread took it: it is (or will be) reported */
            free(bc);
            return 0;
        }
        if (bc) {
            bc->slot = i;
            bc->gen = (uint16_t)gen;
            push_cmd(ctx, &bc->cmd, CMD_BIND);
        }
        return 0;
    }
    free(bc);
    if (mw)
        ibv_dealloc_mw(mw);
    return -ENOSPC;
}

void bex_sock_close(bex_sock *s)
{
    if (!s)
        return;
    /* the first call only: a second push of close_cmd while it is still
     * queued would loop the command stack */
    if (atomic_exchange(&s->closing, true))
        return;
    push_cmd(s->ctx, &s->close_cmd, CMD_CLOSE);
}

void *bex_sock_user(const bex_sock *s)
{
    return atomic_load_explicit(&((bex_sock *)s)->user_pub, memory_order_acquire);
}

int bex_sock_set_user(bex_sock *s, const bex_sock_ops *ops, void *user)
{
    if (!s)
        return -EINVAL;
    if (io_ctx == s->ctx) {
        /* a callback (on_accept, say): callbacks run here, so at once */
        if (ops)
            s->ops = *ops;
        s->user = user;
        atomic_store_explicit(&s->user_pub, user, memory_order_release);
        return 0;
    }
    struct set_user_cmd *u = malloc(sizeof(*u));
    if (!u)
        return -ENOMEM;
    *u = (struct set_user_cmd){.s = s, .has_ops = ops != NULL, .user = user};
    if (ops)
        u->ops = *ops;
    atomic_store_explicit(&s->user_pub, user, memory_order_release);
    push_cmd(s->ctx, &u->cmd, CMD_SET_USER);
    return 0;
}

int bex_listen(bex_ctx *ctx, const struct sockaddr_in *addr, const bex_listener_ops *ops,
               void *user, bex_listener **out)
{
    if (!ctx || !addr || !out || addr->sin_family != AF_INET)
        return -EINVAL;
    struct bex_listener *l = calloc(1, sizeof(*l));
    if (!l)
        return -ENOMEM;
    int err;
    l->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (l->fd < 0) {
        err = -errno;
        goto err_free;
    }
    int one = 1;
    setsockopt(l->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    socklen_t sl = sizeof(l->addr);
    if (bind(l->fd, (const struct sockaddr *)addr, sizeof(*addr)) || listen(l->fd, 128) ||
        getsockname(l->fd, (struct sockaddr *)&l->addr, &sl)) {
        err = -errno;
        goto err_close;
    }
    l->tag.kind = EV_LISTENER;
    l->ctx = ctx;
    if (ops)
        l->ops = *ops;
    l->user = user;
    sem_init(&l->done, 0, 0);
    if (io_ctx == ctx) {
        do_listen(ctx, l); /* from a callback: waiting for ourselves would hang */
    } else {
        push_cmd(ctx, &l->cmd, CMD_LISTEN);
        while (sem_wait(&l->done) && errno == EINTR)
            ;
    }
    *out = l;
    return 0;
err_close:
    close(l->fd);
err_free:
    free(l);
    return err;
}

void bex_listener_addr(const bex_listener *l, struct sockaddr_in *out)
{
    *out = l->addr;
}

int bex_listener_close(bex_listener *l)
{
    if (!l)
        return 0;
    if (io_ctx == l->ctx)
        return -EDEADLK; /* it waits for the I/O thread */
    push_cmd(l->ctx, &l->cmd, CMD_UNLISTEN);
    while (sem_wait(&l->done) && errno == EINTR)
        ;
    close(l->fd);
    sem_destroy(&l->done);
    free(l);
    return 0;
}
