/* SPDX-License-Identifier: Apache-2.0 */
/* Connection setup: a non-blocking state machine per TCP connection on the
 * I/O thread (docs/protocol.md, "Connection setup"). */
#include <arpa/inet.h>
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "conn/conn.h"
#include "transport/tcp/tcp.h"

/* Our hello: with an engine, what its QP needs; without, a NO_RDMA hello
 * (the connection stays on TCP). */
/* Our keepalive timeout as the hello carries it: a longer one than the
 * field holds is sent as its largest (the peer then writes more often
 * than needed, never less). */
static uint16_t hello_ka_timeout(uint32_t ms)
{
    return ms > UINT16_MAX ? UINT16_MAX : (uint16_t)(ms ? ms : 1);
}

static void hello_fill(struct conn *c, struct bex__hello *h, uint64_t conn_id)
{
    struct bex__conn_env *ctx = c->io->env;
    if (!c->eng) {
        memset(h, 0, sizeof(*h));
        h->flags = BEX__HELLO_F_NO_RDMA;
        h->max_msg = ctx->cfg->max_msg;
        h->conn_id = conn_id;
        h->ka_timeout_ms = hello_ka_timeout(ctx->cfg->keepalive_timeout_ms);
        return;
    }
    struct bex__engine_local l;
    bex__engine_local(c->eng, &l);
    memset(h, 0, sizeof(*h));
    h->qpn = l.qpn;
    h->psn = l.psn;
    memcpy(h->gid, ctx->sh->path.gid.raw, 16);
    h->mtu = (uint8_t)ctx->sh->path.active_mtu;
    h->rd_atomic = bex__rdma_dest_rd_atomic(ctx->dev, &ctx->sh->conn);
    h->recv_depth = (uint16_t)l.rq_depth;
    h->sq_depth = (uint16_t)ctx->ecfg->sq_depth;
    h->max_msg = l.max_msg;
    h->frag_size = ctx->ecfg->frag_size;
    h->conn_id = conn_id;
    h->eager_max = l.eager_max;
    h->max_rndv = (uint16_t)l.max_rndv;
    h->ka_addr = l.ka_addr;
    h->ka_rkey = l.ka_rkey;
    h->ka_timeout_ms = hello_ka_timeout(ctx->cfg->keepalive_timeout_ms);
    h->route = ctx->sh->path.route;
    h->lid = ctx->sh->path.lid;
}

static int peer_of_hello(const struct bex__hello *h, struct bex__engine_peer *p)
{
    if (h->flags & BEX__HELLO_F_NO_RDMA)
        return -EPROTONOSUPPORT;
    *p = (struct bex__engine_peer){
        .rq_depth = h->recv_depth,
        .max_rndv = h->max_rndv,
        .eager_max = h->eager_max,
        .max_msg = h->max_msg,
        .ka_addr = h->ka_addr,
        .ka_rkey = h->ka_rkey,
    };
    bex__rdma_peer_of_hello(h, &p->rdma);
    return bex__engine_check_peer(p);
}

static int conn_want(struct conn *c, uint32_t events)
{
    return bex__loop_modify(&c->io->loop, c->fd, events, &c->tag);
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

const char *bex__conn_phase_name(enum bex__conn_phase p)
{
    static const char *const names[] = {
        [P_CONNECTING] = "CONNECTING",         [P_WAIT_HELLO] = "WAIT_HELLO",
        [P_WAIT_READY] = "WAIT_READY",         [P_UP] = "UP",
        [P_WAIT_OPEN] = "WAIT_OPEN",           [P_WAIT_PROOF] = "WAIT_PROOF",
        [P_WAIT_CHALLENGE] = "WAIT_CHALLENGE",
    };
    return (unsigned)p < ARRAY_SIZE(names) && names[p] ? names[p] : "?";
}

/* Whether from -> to is a move of the setup (the comment at the enum). */
static inline bool phase_move_ok(enum bex__conn_phase from, enum bex__conn_phase to)
{
    switch (from) {
    case P_CONNECTING:
        return to == P_WAIT_HELLO || to == P_WAIT_CHALLENGE || to == P_WAIT_OPEN;
    case P_WAIT_OPEN:
        return to == P_WAIT_PROOF;
    case P_WAIT_PROOF:
    case P_WAIT_CHALLENGE:
        return to == P_WAIT_HELLO;
    case P_WAIT_HELLO:
        return to == P_WAIT_READY || to == P_UP;
    case P_WAIT_READY:
        return to == P_UP;
    case P_UP:
        return false;
    }
    return false;
}

void bex__conn_set_phase(struct conn *c, enum bex__conn_phase to)
{
    if (c->phase == to)
        return;
    assert(phase_move_ok(c->phase, to));
    char name[BEX__CONN_NAME_LEN];
    if (c->io->env->log->level >= BEX_LOG_DEBUG) /* (the name costs a format) */
        bex__log(c->io->env->log, BEX_LOG_DEBUG, "%s (engine %u): %s -> %s",
                 bex__conn_name(c, name), c->eng_id, bex__conn_phase_name(c->phase),
                 bex__conn_phase_name(to));
    c->phase = to;
    if (to == P_UP) { /* the setup's deadline is met */
        bex__timer_stop(&c->io->timers, &c->setup_tm);
        bex__conn_came(c);
    }
}

/* Read the next setup message: its preamble first, which tells its kind and
 * length, so a peer of the other kind is recognised from 8 bytes. */
void bex__conn_expect(struct conn *c, enum bex__conn_phase phase)
{
    bex__conn_set_phase(c, phase);
    c->rlen = 0;
    c->rwant = BEX__SETUP_PRE_LEN;
    c->framed = false;
    c->waiting_since = bex__now_ms();
}

static void conn_peer_addr(struct conn *c, bex_addr *a)
{
    socklen_t sl = sizeof(*a);
    if (bex_addr_valid(&c->key))
        *a = c->key; /* kept from connect/accept4: a peer that reset has no getpeername */
    else if (c->fd < 0 || getpeername(c->fd, &a->sa, &sl) || !bex_addr_valid(a))
        memset(a, 0, sizeof(*a));
}

/* A refusal's one log line, naming the peer. */
void bex__conn_log_refusal(struct conn *c, int err, const char *why)
{
    bex_addr a;
    conn_peer_addr(c, &a);
    char ip[BEX_ADDR_STRLEN];
    bex_addr_format(&a, true, ip, sizeof ip);
    if (c->client)
        bex__log(c->io->env->log, BEX_LOG_WARN, "connection to %s refused: %s (%s)", ip, why,
                 bex_strerror(err));
    else
        bex__log(c->io->env->log, BEX_LOG_WARN, "refused peer %s: %s (%s)", ip, why,
                 bex_strerror(err));
}

/* Refuse the peer: log once, tell it why when nothing else is on its way
 * (best effort: a notice with the errno, so its on_connect reports that and
 * not a bare reset), and close. */
static void conn_refuse(struct conn *c, int err, const char *why)
{
    bex__conn_log_refusal(c, err, why);
    if (c->fd >= 0 && c->woff == c->wlen) {
        uint8_t n[BEX__READY_LEN];
        bex__ready_encode((uint32_t)-err, n);
        ssize_t r = send(c->fd, n, sizeof n, MSG_NOSIGNAL | MSG_DONTWAIT);
        /* read what the peer already sent, so that close sends a FIN, not a
         * reset that could overtake the notice */
        uint8_t junk[256];
        for (int i = 0; i < 4 && recv(c->fd, junk, sizeof junk, MSG_DONTWAIT) > 0; i++)
            ;
        (void)r;
    }
    bex__conn_fail(c, err);
}

/* The TCP endpoints as both sides name them: client first, then listener. */
static int conn_ends(struct conn *c)
{
    bex_addr me, peer;
    socklen_t sl = sizeof(me), pl = sizeof(peer);
    if (getsockname(c->fd, &me.sa, &sl) || getpeername(c->fd, &peer.sa, &pl))
        return -errno;
    const bex_addr *cl = c->client ? &me : &peer, *li = c->client ? &peer : &me;
    return bex__auth_ends_addr(&c->auth, cl, li);
}

/* RoCE: a peer at a.b.c.d has the GID ::ffff:a.b.c.d. A hello naming any
 * other GID would point our QP at someone else's, or at a host that merely
 * relays the setup. An InfiniBand GID is the port's, not the address's:
 * nothing here binds it to the peer (docs/security.md; a secret does). */
static bool gid_is_peer(struct conn *c, const struct bex__hello *h)
{
    const uint8_t *gid = h->gid;
    if (h->route == BEX__HELLO_ROUTE_IB)
        return true;
    bex_addr a;
    socklen_t sl = sizeof(a);
    union ibv_gid want;
    if (getpeername(c->fd, &a.sa, &sl) || bex__rdma_gid_from_addr(&a, &want))
        return false;
    return memcmp(want.raw, gid, 16) == 0;
}

/* The client's first message: a plain hello, or with a secret an OPEN that
 * carries nothing but a nonce. */
static int setup_client_start(struct conn *c)
{
    if (c->io->env->has_secret) {
        uint8_t m[BEX__AUTH_SHORT_LEN];
        int err = bex__auth_nonce(c->auth.nonce_c);
        if (err)
            return err;
        bex__auth_encode(BEX__AUTH_OPEN, c->auth.nonce_c, m);
        bex__conn_expect(c, P_WAIT_CHALLENGE);
        return conn_queue(c, m, sizeof m);
    }
    struct bex__hello h;
    uint8_t buf[BEX__HELLO_LEN];
    c->conn_id = bex__rdma_random_u64();
    hello_fill(c, &h, c->conn_id);
    bex__hello_encode(&h, buf);
    c->hello_first = true;
    bex__conn_expect(c, P_WAIT_HELLO);
    return conn_queue(c, buf, sizeof buf);
}

/* The connection goes on over TCP: the engine goes (if any), a TCP
 * transport takes the descriptor, the sockets waiting for a transport
 * attach to it, and it is up. */
static int go_tcp(struct conn *c)
{
    struct bex__conn_env *ctx = c->io->env;
    bex__conn_engine_drop(c);
    struct bex__tcp_config tc = {
        .max_msg = ctx->cfg->max_msg,
        .peer_max_msg = c->peer_max_msg,
        .frag_size = ctx->cfg->frag_size,
        .keepalive_ms = ctx->cfg->keepalive_ms,
        .ack_delay_us = ctx->cfg->tcp_ack_delay_us,
        .keepalive_timeout_ms = ctx->cfg->keepalive_timeout_ms,
        .peer_ka_timeout_ms = c->peer_ka_timeout_ms,
        .stall_ms = ctx->cfg->credit_timeout_ms,
        .share_min = ctx->cfg->recv_share_min,
        .min_rate = ctx->cfg->recv_min_rate,
        .rate_window_ms = ctx->cfg->recv_rate_ms,
        /* one per stream: the peer's (streams_max) and ours */
        .parts_max = ctx->cfg->streams_max < (UINT32_MAX - 64) / 2 ? 2 * ctx->cfg->streams_max + 64
                                                                   : UINT32_MAX,
    };
    char name[BEX__CONN_NAME_LEN];
    snprintf(tc.name, sizeof tc.name, "%s (engine %u)", bex__conn_name(c, name), c->eng_id);
    int err = bex__tcp_create(&c->io->sh, &tc, &c->io->env->upcalls, c, c->fd, &c->io->loop,
                              &c->tag, &c->x);
    if (err)
        return err;
    BEX__STAT_ADD(&c->io->stats, engines, 1); /* counts transports of either kind */
    BEX__STAT_ADD(&c->io->stats, tcp_conns, 1);
    c->io->n_watch++; /* the spinning looks at its descriptor (bex__conn_free's) */
    if (c->mode == BEX_TRANSPORT_AUTO)
        BEX__STAT_ADD(&c->io->stats, tcp_fallbacks, 1); /* RDMA would have done */
    bex__conn_set_phase(c, P_UP);
    bex__conn_setup_end(c);
    c->rwant = c->rlen = 0;  /* the setup reads nothing more: frames are the transport's */
    if (c->woff < c->wlen) { /* setup bytes not yet out go ahead of any frame */
        if ((err = bex__tcp_prefix(c->x, c->wbuf + c->woff, c->wlen - c->woff)))
            return err;
        c->woff = c->wlen = 0;
    }
    if ((err = conn_want(c, EPOLLIN | EPOLLRDHUP)))
        return err;
    c->io->env->ops->chosen(c);
    bex__tcp_start(c->x);
    return 0;
}

/* Our hello answering the peer's (echoing its conn_id), into out. */
static size_t answer_hello(struct conn *c, uint64_t conn_id, uint8_t *out)
{
    struct bex__conn_env *ctx = c->io->env;
    struct bex__hello mine;
    uint8_t raw[BEX__HELLO_LEN];
    hello_fill(c, &mine, conn_id);
    bex__hello_encode(&mine, raw);
    if (ctx->has_secret) {
        uint8_t mac[BEX__AUTH_MAC_LEN];
        bex__auth_mac(ctx->auth_key, BEX__AUTH_MAC_HELLO_C, &c->auth, c->rbuf + BEX__AUTH_HDR_LEN,
                      raw, mac);
        bex__auth_encode_hello(raw, mac, out);
        return BEX__AUTH_HELLO_LEN;
    }
    memcpy(out, raw, BEX__HELLO_LEN);
    return BEX__HELLO_LEN;
}

/* The peer's hello out of rbuf into h: plain, or inside an authenticated
 * HELLO whose MAC this checks. */
static int hello_read(struct conn *c, struct bex__hello *h, const char **why)
{
    struct bex__conn_env *ctx = c->io->env;
    int err;
    if (ctx->has_secret) {
        uint8_t mac[BEX__AUTH_MAC_LEN];
        if ((err = bex__auth_decode_hello(c->rbuf, c->rlen, h, mac))) {
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
        if ((err = bex__hello_decode(c->rbuf, c->rlen, h))) {
            *why = err == -EPROTONOSUPPORT ? "the hello names a route (GID type) we do not support"
                                           : "malformed hello";
            return err;
        }
    }
    return 0;
}

/* The peer's hello (plain, or inside an authenticated HELLO whose MAC this
 * checks): check it fits this connection, choose the transport (RDMA when
 * both sides can, else TCP unless this side wants RDMA only), answer. */
/* Bring our QP up to the peer of hello h: 0 or why not. RoCE v1 and v2
 * frames do not interoperate, nor RoCE and InfiniBand: a peer on another
 * route cannot reach our QP (-EPROTONOSUPPORT; the caller goes over TCP). */
static int qp_up(struct conn *c, const struct bex__hello *h, const struct bex__engine_peer *peer)
{
    if (h->route != c->io->env->sh->path.route)
        return -EPROTONOSUPPORT;
    int err = BEX__FAULT(BEX__FAULT_QP_UP); /* tests: the QP does not come up */
    return err ? err : bex__engine_connect(c->eng, peer);
}

static int setup_hello(struct conn *c, const char **why)
{
    struct bex__conn_env *ctx = c->io->env;
    struct bex__hello h;
    int err;
    if ((err = hello_read(c, &h, why)))
        return err;
    if (c->hello_first && h.conn_id != c->conn_id) {
        *why = "the hello does not answer ours (conn_id)";
        return -EPROTO;
    }
    c->peer_max_msg = h.max_msg;
    c->peer_ka_timeout_ms = h.ka_timeout_ms;
    bool peer_rdma = !(h.flags & BEX__HELLO_F_NO_RDMA);
    if (!peer_rdma && c->mode == BEX_TRANSPORT_RDMA) {
        *why = "the peer has no RDMA device";
        return -EPROTONOSUPPORT;
    }
    uint8_t out[BEX__AUTH_HELLO_LEN + BEX__READY_LEN];
    size_t n = 0;
    if (!peer_rdma || !c->rdma_ok) {
        /* TCP: the hellos were all; no readiness notices follow */
        bex__conn_engine_drop(c);
        if (!c->hello_first && (err = conn_send(c, out, answer_hello(c, h.conn_id, out)))) {
            *why = NULL;
            return err;
        }
        *why = NULL;
        return go_tcp(c);
    }
    if (!gid_is_peer(c, &h)) {
        *why = "the hello's GID is not the TCP peer's address";
        return -EPROTO;
    }
    struct bex__engine_peer peer; /* a hello we cannot work with costs no engine */
    if ((err = peer_of_hello(&h, &peer))) {
        *why = "the hello grants too few receive credits to work";
        return err;
    }
    *why = "local setup failed";
    if (!c->eng && (err = bex__conn_engine_make(c))) {
        if (c->mode == BEX_TRANSPORT_RDMA || c->hello_first)
            return err;
        c->rdma_ok = false; /* answer with a NO_RDMA hello: TCP */
        *why = NULL;
        if ((err = conn_send(c, out, answer_hello(c, h.conn_id, out))))
            return err;
        return go_tcp(c);
    }
    if ((err = qp_up(c, &h, &peer))) {
        if (c->mode == BEX_TRANSPORT_RDMA)
            return err;
        /* the QP cannot come up: over TCP instead. Answering, a NO_RDMA
         * hello says so; having sent an RDMA hello, a FALLBACK notice does,
         * and the peer's notice comes before the first frame. */
        char name[BEX__CONN_NAME_LEN];
        bex__log(ctx->log, BEX_LOG_INFO, "%s (engine %u): the QP did not come up (%s): over TCP",
                 bex__conn_name(c, name), c->eng_id, bex_strerror(err));
        bex__conn_engine_drop(c);
        c->rdma_ok = false;
        *why = NULL;
        if (!c->hello_first) {
            if ((err = conn_send(c, out, answer_hello(c, h.conn_id, out))))
                return err;
            return go_tcp(c);
        }
        c->fallback = true;
        bex__ready_encode(BEX__READY_FALLBACK, out);
        bex__conn_expect(c, P_WAIT_READY);
        return conn_send(c, out, BEX__READY_LEN);
    }
    if (!c->hello_first)
        n = answer_hello(c, h.conn_id, out);
    /* our receives are posted and the QP is at RTS: the peer may send */
    bex__ready_encode(0, out + n);
    *why = NULL; /* from here on an error is the connection's, not the peer's fault */
    bex__conn_expect(c, P_WAIT_READY);
    return conn_send(c, out, n + BEX__READY_LEN);
}

/* A notice (readiness, fallback, or the peer's refusal) is in rbuf. */
static int setup_notice(struct conn *c, const char **why)
{
    struct bex__conn_env *ctx = c->io->env;
    int err;
    uint32_t st;
    memcpy(&st, c->rbuf + 4, 4);
    st = ntohl(st);
    if (c->phase == P_WAIT_READY && (c->fallback || st == BEX__READY_FALLBACK)) {
        if (c->x) { /* its frames came over RDMA already (on_peer_open) */
            *why = "a fallback notice after frames over RDMA";
            return -EPROTO;
        }
        /* either QP could not come up: both sides go on over TCP */
        if (c->mode == BEX_TRANSPORT_RDMA) {
            *why = "the peer's QP did not come up";
            return -EPROTONOSUPPORT;
        }
        if (st != 0 && st != BEX__READY_FALLBACK)
            goto refused;
        return go_tcp(c);
    }
    if (st == 0 && c->phase == P_WAIT_READY) {
        bex__conn_set_phase(c, P_UP);
        bex__conn_setup_end(c);
        c->rwant = 1; /* from now on the TCP connection only tells EOF */
        c->rlen = 0;
        c->x = bex__engine_xport(c->eng);
        c->io->env->ops->chosen(c);
        bex__engine_start(c->eng);
        return 0;
    }
    if (st == 0) {
        *why = "a readiness notice before the hellos";
        return -EPROTO;
    }
refused:
    /* the peer refused us or failed: say so once, it is closing anyway */
    err = st < 4096 ? -(int)st : -EPROTO;
    bex_addr a;
    conn_peer_addr(c, &a);
    char ip[BEX_ADDR_STRLEN];
    bex__log(ctx->log, BEX_LOG_INFO, "peer %s ended the setup: %s",
             bex_addr_format(&a, true, ip, sizeof ip), bex_strerror(err));
    return err;
}

/* One whole setup message is in rbuf: act on it. Returns 0 or an error;
 * *why is set when the error refuses the peer (logged, peer told). */
static int setup_msg(struct conn *c, const char **why)
{
    struct bex__conn_env *ctx = c->io->env;
    int err;
    if (c->rkind == BEX__SETUP_NOTICE)
        return setup_notice(c, why);
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
        bex__conn_expect(c, P_WAIT_PROOF);
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
        bex__conn_expect(c, P_WAIT_HELLO);
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
        /* only now does the peer cost us a QP (none if it will be TCP) */
        if (c->rdma_ok && (err = bex__conn_engine_make(c))) {
            if (c->mode == BEX_TRANSPORT_RDMA) {
                *why = "local setup failed";
                return err;
            }
            c->rdma_ok = false; /* a NO_RDMA hello: TCP */
        }
        struct bex__hello mine;
        c->conn_id = bex__rdma_random_u64();
        hello_fill(c, &mine, c->conn_id);
        bex__hello_encode(&mine, c->hello_l);
        bex__auth_mac(ctx->auth_key, BEX__AUTH_MAC_HELLO_L, &c->auth, c->hello_l, NULL, mac);
        bex__auth_encode_hello(c->hello_l, mac, m);
        c->hello_first = true;
        bex__conn_expect(c, P_WAIT_HELLO);
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
void bex__conn_lost(struct conn *c, int err)
{
    uint32_t open = c->io->env->ops->open_streams(c);
    if (!open)
        return;
    char name[BEX__CONN_NAME_LEN];
    bex__log(c->io->env->log, BEX_LOG_WARN,
             "%s (engine %u): connection lost with %u socket%s open (%s)", bex__conn_name(c, name),
             c->eng_id, open, open == 1 ? "" : "s", bex_strerror(err));
}

/* A connect to a local port in the ephemeral range where nobody listens
 * may be given that very port as its own: TCP's simultaneous open then
 * joins the socket to itself, and the setup would go on with ourselves as
 * the peer (our hello answered by our own) while the port stays taken from
 * the listener meant to come back there. Such a connection is refused,
 * which the owner's reconnection handles as any refusal, and its port
 * given back at once. */
static int not_self(int fd)
{
    bex_addr me, peer;
    socklen_t sl = sizeof(me), pl = sizeof(peer);
    if (getsockname(fd, &me.sa, &sl) || getpeername(fd, &peer.sa, &pl))
        return -errno;
    if (!bex_addr_equal(&me, &peer))
        return 0;
    /* closed with a reset: a TIME_WAIT would keep the port from a
     * listener for a minute (SO_REUSEADDR does not pass a TIME_WAIT whose
     * socket did not set it) */
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    return -ECONNREFUSED;
}

/* Advance the setup state machine; any error fails the connection.
 * Whether the connection's transport wants a progress call: an up TCP
 * one made its own (bex__tcp_events) and wants one only when it has more
 * to move at once. */
bool bex__conn_step(struct conn *c, uint32_t events)
{
    int err = 0;
    const char *why = NULL;
    if (bex__conn_dead(c) || c->fd < 0)
        return true;
    if (c->phase == P_UP && bex__xport_is_tcp(c->x))
        return bex__tcp_events(c->x, events);
    if (c->phase == P_CONNECTING) {
        if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP)))
            return true;
        socklen_t sl = sizeof(err);
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &sl) || err) {
            err = err ? -err : -errno;
            goto fail;
        }
        if ((err = not_self(c->fd)))
            goto fail;
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
            return true;
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
    return true;
fail:
    if (why)
        conn_refuse(c, err, why);
    else {
        if (c->phase == P_UP)
            bex__conn_lost(c, err);
        bex__conn_fail(c, err);
    }
    return true;
}
