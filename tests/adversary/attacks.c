/* SPDX-License-Identifier: Apache-2.0 */
/* The attacks. Each runs in its own process (the attacker role) against
 * the listener at a->srv_addr:a->port and reports on a->wr (see adv.h):
 * "conn <port>" for every abusive connection, "closed <port> <ms>" when the
 * server closed it (<ms> after the abuse), "underway", "note ...", "done".
 *
 * TCP-level attacks speak raw bytes; protocol-level ones complete a valid
 * hello with their own QP (peer.c) and then misbehave. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "adv.h"
#include "peer.h"

static bex_addr srv_of(const struct adv_attack_ctx *a)
{
    return (bex_addr){
        .in4 = {.sin_family = AF_INET, .sin_port = htons(a->port), .sin_addr = a->srv_addr}};
}

static uint32_t rnd_state = 12345;
static uint32_t rnd(void)
{
    rnd_state ^= rnd_state << 13;
    rnd_state ^= rnd_state >> 17;
    rnd_state ^= rnd_state << 5;
    return rnd_state;
}

/* ---- raw TCP connections ---- */

struct tconn {
    int fd;
    uint16_t port;
    bool closed;
    uint64_t t0; /* when the abuse was complete */
};

static int tcp_open(const struct adv_attack_ctx *a, bool nonblock, struct tconn *c)
{
    memset(c, 0, sizeof *c);
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0), 0);
    if (c->fd < 0)
        return -errno;
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    bex_addr me = {.in4 = {.sin_family = AF_INET, .sin_addr = a->local}};
    bex_addr to = srv_of(a);
    if (bind(c->fd, (struct sockaddr *)&me, sizeof me) ||
        (connect(c->fd, (struct sockaddr *)&to, sizeof to) && errno != EINPROGRESS)) {
        int err = -errno;
        close(c->fd);
        c->fd = -1;
        return err;
    }
    bex_addr got;
    socklen_t sl = sizeof got;
    getsockname(c->fd, (struct sockaddr *)&got, &sl);
    c->port = ntohs(got.in4.sin_port);
    c->t0 = adv_now_ms();
    return 0;
}

/* Has the server closed c (EOF or reset)? Unread bytes from it are
 * swallowed (a server may answer before it closes). */
static bool tcp_gone(struct tconn *c)
{
    if (c->closed)
        return true;
    char b[512];
    for (;;) {
        ssize_t n = recv(c->fd, b, sizeof b, MSG_DONTWAIT);
        if (n > 0)
            continue;
        if (n == 0 ||
            (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ENOTCONN)) {
            c->closed = true;
            return true;
        }
        return false;
    }
}

/* Wait until every connection is closed by the server or wait_ms passes;
 * reports "closed" lines. Returns how many stay open. */
static int tcp_wait_all(struct adv_attack_ctx *a, struct tconn *c, int n, unsigned wait_ms)
{
    uint64_t end = adv_now_ms() + wait_ms;
    for (;;) {
        int open = 0;
        for (int i = 0; i < n; i++) {
            if (c[i].fd < 0 || c[i].closed)
                continue;
            if (tcp_gone(&c[i]))
                adv_say(a->wr, "closed %u %llu", c[i].port,
                        (unsigned long long)(adv_now_ms() - c[i].t0));
            else
                open++;
        }
        if (!open || adv_now_ms() >= end)
            return open;
        adv_sleep_ms(20);
    }
}

static void tcp_close_all(struct tconn *c, int n)
{
    for (int i = 0; i < n; i++)
        if (c[i].fd >= 0) {
            close(c[i].fd);
            c[i].fd = -1;
        }
}

/* The same with a reset (SO_LINGER 0): nothing of them is left to reach
 * the server later. A connection closed with FIN whose handshake the
 * server has not completed (its final ACK dropped while the accept queue
 * was full; with SYN cookies the server keeps no trace of it) retransmits
 * its FIN for seconds, and each retransmission can complete it into the
 * accept queue: hundreds of them after a flood, long after the attacker
 * has gone (test_adversary's settle wait timed out on them). */
static void tcp_reset_all(struct tconn *c, int n)
{
    struct linger lg = {1, 0};
    for (int i = 0; i < n; i++)
        if (c[i].fd >= 0)
            setsockopt(c[i].fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    tcp_close_all(c, n);
}

static void write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
        if (w <= 0)
            return;
        b += w;
        n -= (size_t)w;
    }
}

/* A hello that decodes, for a peer on a->local that has no QP. */
static void fake_hello(const struct adv_attack_ctx *a, struct bex__hello *h)
{
    memset(h, 0, sizeof *h);
    union ibv_gid gid;
    bex__rdma_gid_from_ipv4(a->local, &gid);
    h->qpn = 0x1234;
    h->psn = 1;
    memcpy(h->gid, gid.raw, 16);
    h->mtu = IBV_MTU_1024;
    h->rd_atomic = 16;
    h->recv_depth = 64;
    h->sq_depth = 32;
    h->max_msg = BEX__HELLO_MAX_MSG;
    h->frag_size = 65536;
    h->conn_id = ((uint64_t)rnd() << 32) | rnd() | 1;
    h->eager_max = 8192;
    h->ka_addr = 0x10000;
    h->ka_rkey = 0x1234;
    h->max_rndv = 256;
}

/* 12 connections each send 80..512 random bytes (some behind a valid magic
 * and version), then wait: the server must refuse every one at once. */
int adv_attack_random_bytes(struct adv_attack_ctx *a)
{
    enum { N = 12 };
    struct tconn c[N];
    rnd_state = 0xc0ffee;
    for (int i = 0; i < N; i++) {
        if (tcp_open(a, false, &c[i])) {
            adv_say(a->wr, "fail connect %d: %s", i, strerror(errno));
            return 1;
        }
        adv_say(a->wr, "conn %u", c[i].port);
        uint8_t b[512];
        size_t n = 80 + rnd() % (sizeof b - 80);
        for (size_t k = 0; k < n; k++)
            b[k] = (uint8_t)rnd();
        if (i % 3 == 0) { /* "BEXH", version 1: a bex peer gone mad */
            const uint8_t head[6] = {0x42, 0x45, 0x58, 0x48, 0, 1};
            memcpy(b, head, sizeof head);
        }
        write_all(c[i].fd, b, n);
        c[i].t0 = adv_now_ms();
    }
    adv_say(a->wr, "underway");
    int open = tcp_wait_all(a, c, N, 10000 * adv_scale());
    adv_say(a->wr, "note %d of %d random-byte connections still open", open, N);
    tcp_close_all(c, N);
    adv_say(a->wr, "done");
    return 0;
}

/* Valid hellos cut short: 12 that stay silent after the cut (the setup
 * deadline must end them), 4 that close after it. */
int adv_attack_truncated_hello(struct adv_attack_ctx *a)
{
    enum { N = 12, M = 4 };
    static const size_t cut[N] = {1, 4, 6, 8, 12, 20, 36, 40, 52, 64, 76, 79};
    struct tconn c[N], d[M];
    struct bex__hello h;
    uint8_t b[BEX__HELLO_LEN];
    rnd_state = 0xbadcafe;
    for (int i = 0; i < N + M; i++) {
        struct tconn *t = i < N ? &c[i] : &d[i - N];
        if (tcp_open(a, false, t)) {
            adv_say(a->wr, "fail connect %d: %s", i, strerror(errno));
            return 1;
        }
        fake_hello(a, &h);
        bex__hello_encode(&h, b);
        write_all(t->fd, b, i < N ? cut[i] : 30);
        t->t0 = adv_now_ms();
        if (i < N)
            adv_say(a->wr, "conn %u", t->port);
        else
            shutdown(t->fd, SHUT_WR);
    }
    adv_say(a->wr, "underway");
    int open = tcp_wait_all(a, c, N, 15000 * adv_scale());
    adv_say(a->wr, "note %d of %d truncated hellos still open", open, N);
    tcp_close_all(c, N);
    tcp_close_all(d, M);
    adv_say(a->wr, "done");
    return 0;
}

/* Hellos with absurd fields. The first ones the decoder must refuse; the
 * last ones decode (a peer without a QP, a foreign GID, every field at its
 * maximum, a QP number nobody has): after the server's answer they send
 * the ready notice, and the server must still end each of them. */
int adv_attack_absurd_hello(struct adv_attack_ctx *a)
{
    enum { N = 22, DECODABLE = 4 };
    struct tconn c[N];
    rnd_state = 0xabcd;
    for (int i = 0; i < N; i++) {
        struct bex__hello h;
        fake_hello(a, &h);
        uint8_t b[BEX__HELLO_LEN];
        const char *what = "";
        switch (i) {
        case 0:
            what = "qpn 1";
            h.qpn = 1;
            break;
        case 1:
            what = "qpn over 24 bits";
            h.qpn = 0x1000000;
            break;
        case 2:
            what = "psn over 24 bits";
            h.psn = 0x1000000;
            break;
        case 3:
            what = "mtu 9";
            h.mtu = 9;
            break;
        case 4:
            what = "recv_depth 0";
            h.recv_depth = 0;
            break;
        case 5:
            what = "sq_depth 0";
            h.sq_depth = 0;
            break;
        case 6:
            what = "max_msg 0";
            h.max_msg = 0;
            break;
        case 7:
            what = "max_msg 2^31+1";
            h.max_msg = BEX__HELLO_MAX_MSG + 1;
            break;
        case 8:
            what = "frag_size 1";
            h.frag_size = 1;
            break;
        case 9:
            what = "eager_max 2 MiB";
            h.eager_max = 2u << 20;
            break;
        case 10:
            what = "ka_addr 0";
            h.ka_addr = 0;
            break;
        case 11:
            what = "max_rndv 0";
            h.max_rndv = 0;
            break;
        case 12:
            what = "zero gid";
            memset(h.gid, 0, 16);
            break;
        case 13:
            what = "conn_id 0";
            h.conn_id = 0;
            break;
        case 14:
            what = "unknown flag";
            h.flags = 0x80;
            break;
        case 15:
            what = "no-RDMA flag with RDMA fields";
            h.flags = BEX__HELLO_F_NO_RDMA;
            break;
        case 16:
            what = "bad magic";
            break;
        case 17:
            what = "version 2";
            break;
        case 18:
            what = "no-RDMA peer";
            break;
        case 19:
            what = "foreign gid";
            break;
        case 20:
            what = "every field at its maximum";
            break;
        case 21:
            what = "a QP number nobody has";
            break;
        }
        if (i == 18) {
            memset(&h, 0, sizeof h);
            h.flags = BEX__HELLO_F_NO_RDMA;
            h.max_msg = 1;
            h.conn_id = 7;
        } else if (i == 19) {
            struct in_addr other;
            inet_pton(AF_INET, "192.0.2.1", &other);
            union ibv_gid gid;
            bex__rdma_gid_from_ipv4(other, &gid);
            memcpy(h.gid, gid.raw, 16);
        } else if (i == 20) {
            h.mtu = IBV_MTU_4096;
            h.rd_atomic = 255;
            h.recv_depth = 65535;
            h.sq_depth = 65535;
            h.max_msg = BEX__HELLO_MAX_MSG;
            h.frag_size = BEX__HELLO_MAX_MSG;
            h.eager_max = BEX__HELLO_MAX_EAGER;
            h.max_rndv = 65535;
            h.ka_addr = ~0ull;
            h.ka_rkey = ~0u;
        } else if (i == 21) {
            h.qpn = 0xfffffe;
        }
        bex__hello_encode(&h, b);
        if (i == 16)
            b[0] ^= 0xff;
        if (i == 17)
            b[5] = 2;
        if (tcp_open(a, false, &c[i])) {
            adv_say(a->wr, "fail connect %d: %s", i, strerror(errno));
            return 1;
        }
        adv_say(a->wr, "conn %u", c[i].port);
        adv_say(a->wr, "note conn %u: %s", c[i].port, what);
        write_all(c[i].fd, b, sizeof b);
        c[i].t0 = adv_now_ms();
        adv_sleep_ms(100); /* 10 refusals a second: under the log's rate limit */
    }
    /* the decodable ones: read the server's hello and ready, answer ready */
    for (int i = N - DECODABLE; i < N; i++) {
        uint8_t in[BEX__HELLO_LEN + BEX__READY_LEN];
        int rc = bex__hello_read_all(c[i].fd, in, sizeof in,
                                     bex__hello_now_ms() + 5000 * (int64_t)adv_scale());
        if (rc == 0) {
            adv_say(a->wr, "note conn %u: the server accepted the hello", c[i].port);
            bex__hello_ready_send(c[i].fd, 0, bex__hello_now_ms() + 2000);
            c[i].t0 = adv_now_ms();
        }
    }
    adv_say(a->wr, "underway");
    int open = tcp_wait_all(a, c, N, 20000 * adv_scale());
    adv_say(a->wr, "note %d of %d absurd hellos still open", open, N);
    tcp_close_all(c, N);
    adv_say(a->wr, "done");
    return 0;
}

/* 1000 idle TCP connections held open; any the server closes is opened
 * again (at most 200 a second), for 8 s. Meanwhile the parent starts a
 * fresh good client, which must get in. */
int adv_attack_idle_conns(struct adv_attack_ctx *a)
{
    enum { N = 1000 };
    long lim = adv_raise_nofile(N + 64);
    if (lim < N + 16) {
        adv_say(a->wr, "fail RLIMIT_NOFILE is %ld, need %d", lim, N + 16);
        return 1;
    }
    static struct tconn c[N];
    int opened = 0, failed = 0, refills = 0, closed_by_server = 0;
    for (int i = 0; i < N; i++) {
        if (tcp_open(a, true, &c[i])) {
            failed++;
            continue;
        }
        opened++;
        adv_say(a->wr, "conn %u", c[i].port);
    }
    adv_say(a->wr, "underway");
    static struct pollfd pf[N];
    uint64_t end = adv_now_ms() + 8000, tick = adv_now_ms();
    int budget = 0;
    while (adv_now_ms() < end) {
        if (adv_now_ms() >= tick + 100) {
            tick = adv_now_ms();
            budget = 20; /* refills per 100 ms */
        }
        /* poll(), not a recv() per connection per turn: the attacker must
         * not eat the VM's CPU, only the server's resources */
        for (int i = 0; i < N; i++)
            pf[i] = (struct pollfd){.fd = c[i].fd, .events = POLLIN | POLLRDHUP};
        if (poll(pf, N, 50) > 0) {
            for (int i = 0; i < N; i++) {
                if (c[i].fd < 0 || !pf[i].revents || !tcp_gone(&c[i]))
                    continue;
                closed_by_server++;
                adv_say(a->wr, "closed %u %llu", c[i].port,
                        (unsigned long long)(adv_now_ms() - c[i].t0));
                close(c[i].fd);
                c[i].fd = -1;
            }
        }
        for (int i = 0; i < N && budget > 0; i++) {
            if (c[i].fd >= 0)
                continue;
            budget--;
            if (tcp_open(a, true, &c[i]) == 0) {
                refills++;
                adv_say(a->wr, "conn %u", c[i].port);
            }
        }
    }
    adv_say(a->wr, "note opened %d (%d failed), closed by the server %d, refilled %d", opened,
            failed, closed_by_server, refills);
    tcp_reset_all(c, N);
    adv_say(a->wr, "done");
    return 0;
}

/* 500 connect/close cycles: half close with FIN, half with RST, some after
 * a few bytes. */
int adv_attack_connect_close(struct adv_attack_ctx *a)
{
    enum { N = 500 };
    rnd_state = 0x5eed;
    int failed = 0;
    for (int i = 0; i < N; i++) {
        struct tconn c;
        if (tcp_open(a, false, &c)) {
            failed++;
            continue;
        }
        adv_say(a->wr, "conn %u", c.port);
        if (i % 5 == 0) {
            uint8_t b[10];
            for (size_t k = 0; k < sizeof b; k++)
                b[k] = (uint8_t)rnd();
            write_all(c.fd, b, sizeof b);
        }
        if (i % 2) {
            struct linger lg = {1, 0};
            setsockopt(c.fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        }
        close(c.fd);
        if (i == 100)
            adv_say(a->wr, "underway");
    }
    adv_say(a->wr, "note %d of %d connects failed", failed, N);
    adv_say(a->wr, "done");
    return failed ? 1 : 0;
}

/* ---- protocol-level attacks ---- */

/* Bring an abusive peer up. A server that refuses it at setup has
 * answered the attack: "underway" is said in any case, so that the late
 * good client still comes. */
static int peer_up(struct adv_attack_ctx *a, struct adv_peer *p, const struct adv_peer_opts *o)
{
    bex_addr srv = srv_of(a);
    struct adv_peer_opts oo = o ? *o : (struct adv_peer_opts){0};
    oo.secret = a->secret;
    int rc = adv_peer_open(p, a->local, &srv, &oo);
    if (p->lport)
        adv_say(a->wr, "conn %u", p->lport);
    if (rc) {
        if (p->closed && p->lport)
            adv_say(a->wr, "closed %u 0", p->lport);
        adv_say(a->wr, "note setup ended: %s", strerror(-rc));
        adv_say(a->wr, "underway");
    }
    return rc;
}

/* Ask the parent to hold the good clients' traffic (nothing in flight)
 * until good_resume. */
static void good_pause(struct adv_attack_ctx *a)
{
    adv_say(a->wr, "pause");
    if (adv_get_cmd(a->rd, 60000 * (int)adv_scale()) != 'c')
        adv_say(a->wr, "fail the good clients did not pause");
}

static void good_resume(struct adv_attack_ctx *a)
{
    adv_say(a->wr, "resume");
}

/* Wait for the server to close p; report it. */
static void peer_wait(struct adv_attack_ctx *a, struct adv_peer *p, uint64_t t0, unsigned wait_ms)
{
    if (adv_peer_wait_closed(p, wait_ms) == 0)
        adv_say(a->wr, "closed %u %llu", p->lport, (unsigned long long)(p->closed_ms - t0));
    else
        adv_say(a->wr, "note conn %u still open after %u ms (qp status %d)", p->lport, wait_ms,
                p->qp_err);
}

/* The end of an attack on one peer: the peer let go, the parent told. */
static int peer_done(struct adv_attack_ctx *a, struct adv_peer *p)
{
    adv_peer_destroy(p);
    adv_say(a->wr, "done");
    return 0;
}

/* peer_wait, then peer_done. */
static int peer_end(struct adv_attack_ctx *a, struct adv_peer *p, uint64_t t0, unsigned wait_ms)
{
    peer_wait(a, p, t0, wait_ms);
    return peer_done(a, p);
}

static int open_stream(struct adv_peer *p, uint32_t id)
{
    struct bex__hdr h = {.type = BEX__MSG_OPEN, .stream = id};
    return adv_peer_send(p, &h, 0, 2000);
}

/* A rendezvous request larger than the largest message the server agreed
 * to, then (if still connected) huge ones within it, without end. */
int adv_attack_rndv_huge(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    if (peer_up(a, &p, NULL))
        return peer_done(a, &p);
    open_stream(&p, 1);
    uint64_t t0 = adv_now_ms();
    uint32_t max = p.theirs.max_msg;
    uint32_t id = 1;
    if (max < UINT32_MAX) {
        struct bex__hdr h = {.type = BEX__MSG_RNDV_REQ, .stream = 1, .len = max + 1, .id = id++};
        adv_peer_send(&p, &h, 0, 2000);
        adv_say(a->wr, "note asked for %u bytes (max_msg %u)", max + 1, max);
    }
    adv_say(a->wr, "underway");
    adv_peer_poll(&p, 1000);
    uint32_t huge = max < (256u << 20) ? max : (256u << 20);
    uint64_t end = adv_now_ms() + 20000;
    int n = 0;
    while (!p.closed && !p.qp_err && adv_now_ms() < end && n < 64) {
        struct bex__hdr h = {.type = BEX__MSG_RNDV_REQ, .stream = 1, .len = huge, .id = id++};
        if (adv_peer_send(&p, &h, 0, 500) == 0) {
            n++;
            adv_peer_poll(&p, 200);
        }
    }
    uint32_t granted = 0;
    for (uint32_t i = 0; i < p.nresp; i++)
        granted += p.resp[i].status == 0;
    adv_say(a->wr, "note %d requests of %u bytes sent; %u answers, %u granted", n, huge, p.nresp,
            granted);
    return peer_end(a, &p, t0, 10000 * adv_scale());
}

/* 1 MiB rendezvous requests as fast as credits allow, never followed by
 * data, past the max_rndv the server announced. */
int adv_attack_rndv_endless(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    if (peer_up(a, &p, NULL))
        return peer_done(a, &p);
    open_stream(&p, 1);
    adv_say(a->wr, "underway");
    uint64_t t0 = adv_now_ms(), end = t0 + 15000;
    uint32_t n = 0;
    while (!p.closed && !p.qp_err && adv_now_ms() < end && n < 5000) {
        struct bex__hdr h = {
            .type = BEX__MSG_RNDV_REQ, .stream = 1 + n % 4, .len = 1u << 20, .id = n + 1};
        if (adv_peer_send(&p, &h, 0, 200) == 0)
            n++;
    }
    uint32_t granted = 0;
    for (uint32_t i = 0; i < p.nresp; i++)
        granted += p.resp[i].status == 0;
    adv_say(a->wr, "note %u requests sent (server announced max_rndv %u); %u answers, %u granted",
            n, p.theirs.max_rndv, p.nresp, granted);
    return peer_end(a, &p, t0, 10000 * adv_scale());
}

/* OPEN after OPEN, without end, and no receive ever given back: the
 * server's refusals (a CLOSE per OPEN past streams_max) cannot go out, so
 * it must end the connection rather than queue them without bound. (A
 * peer that lets the refusals out is refused stream by stream and may stay:
 * test_limits_rxe.open_flood.) Holding the receives makes this the same
 * attack in every build: a TSan build's attacker is too slow to outrun the
 * refusals otherwise. */
int adv_attack_streams(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    struct adv_peer_opts o = {.recv_depth = 16, .hold_credits = true};
    if (peer_up(a, &p, &o))
        return peer_done(a, &p);
    adv_say(a->wr, "underway");
    uint64_t t0 = adv_now_ms(), end = t0 + 10000;
    uint32_t n = 0;
    while (!p.closed && !p.qp_err && adv_now_ms() < end && n < 200000) {
        struct bex__hdr h = {.type = BEX__MSG_OPEN, .stream = n + 1};
        if (adv_peer_send(&p, &h, 0, 200) == 0)
            n++;
    }
    adv_say(a->wr, "note %u streams opened", n);
    return peer_end(a, &p, t0, 10000 * adv_scale());
}

/* Ask for echoes and never give a receive back: the server's replies can
 * never leave. */
int adv_attack_no_credits(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    struct adv_peer_opts o = {.recv_depth = 16, .hold_credits = true};
    if (peer_up(a, &p, &o))
        return peer_done(a, &p);
    open_stream(&p, 1);
    adv_say(a->wr, "underway");
    uint64_t t0 = adv_now_ms();
    uint32_t n = 0;
    for (;;) {
        struct bex__hdr h = {.type = BEX__MSG_DATA, .stream = 1, .len = 4096};
        if (adv_peer_send(&p, &h, 4096, 300))
            break;
        n++;
    }
    /* plus requests the server can only answer with credits we never give */
    for (uint32_t i = 0; i < 8; i++) {
        struct bex__hdr h = {.type = BEX__MSG_RNDV_REQ, .stream = 1, .len = 65536, .id = i + 1};
        adv_peer_send_nocredit(&p, &h, 0);
    }
    adv_say(a->wr, "note %u messages sent, %u echoes taken, %u receives held", n, p.data_recv,
            p.held);
    return peer_end(a, &p, t0, 15000 * adv_scale());
}

/* Credits back for receives the server never used: a few echoes asked
 * (the server sends to us), then a CREDIT that returns 64 more than it
 * sent. Believed, they would report as delivered messages our NIC never
 * had and let the server send into receives we never posted: the server
 * must refuse the connection before taking them, and its good clients go
 * on. */
int adv_attack_overack(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    struct adv_peer_opts o = {.recv_depth = 16};
    if (peer_up(a, &p, &o))
        return peer_done(a, &p);
    open_stream(&p, 1);
    adv_say(a->wr, "underway");
    uint64_t t0 = adv_now_ms();
    for (uint32_t i = 0; i < 4; i++) {
        struct bex__hdr h = {.type = BEX__MSG_DATA, .stream = 1, .len = 512};
        if (adv_peer_send(&p, &h, 512, 2000))
            break;
    }
    adv_peer_poll(&p, 200);
    uint32_t owed = p.to_return;
    p.to_return += 64;
    struct bex__hdr c = {.type = BEX__MSG_CREDIT};
    int rc = adv_peer_send_nocredit(&p, &c, 0);
    adv_say(a->wr, "note %u echoes taken, %u credits returned where %u were owed (send %d)",
            p.data_recv, owed + 64, owed, rc);
    return peer_end(a, &p, t0, 10000 * adv_scale());
}

/* SRQ mode (the srq group): SENDs far past the credits the server granted,
 * while holding our receives so that the server can return only a few
 * credits (in at most recv_depth messages). On a shared receive queue each
 * of them takes a receive that may back another peer's credit: the server
 * must refuse the connection, and the good clients on the same queue go
 * on. The SENDs are CREDIT headers: they take a receive and ask for
 * nothing. */
int adv_attack_srq_overcredit(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    struct adv_peer_opts o = {.recv_depth = 8, .hold_credits = true};
    if (peer_up(a, &p, &o))
        return peer_done(a, &p);
    uint32_t granted = p.credits; /* the server's share for us */
    adv_say(a->wr, "underway");
    uint64_t t0 = adv_now_ms(), end = t0 + 20000 * adv_scale();
    /* past the granted credits and every credit the server can return in
     * recv_depth messages (each returns at most what it consumed by then,
     * and it consumes at most 64 per poll before it can send one) */
    uint32_t want = granted + (o.recv_depth + 2) * 64 + 512, n = 0;
    while (n < want && !p.closed && !p.qp_err && adv_now_ms() < end) {
        if (p.sq_out >= PEER_SEND_MAX - 2) {
            adv_peer_poll(&p, 0);
            continue;
        }
        struct bex__hdr h = {.type = BEX__MSG_CREDIT};
        if (adv_peer_send_nocredit(&p, &h, 0) == 0)
            n++;
    }
    adv_say(a->wr, "note %u SENDs posted against %u credits granted, %u credit updates taken", n,
            granted, p.credit_recv);
    return peer_end(a, &p, t0, 15000 * adv_scale());
}

/* A hello that grants one receive: with one credit nothing can ever be
 * answered (one credit is kept back for credit updates). */
int adv_attack_recv_depth_1(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    struct adv_peer_opts o = {.recv_depth = 1, .posted = 16};
    uint64_t t0 = adv_now_ms();
    if (peer_up(a, &p, &o))
        return peer_done(a, &p);
    adv_say(a->wr, "note the server accepted recv_depth 1");
    open_stream(&p, 1);
    for (uint32_t i = 0; i < 16; i++) {
        struct bex__hdr h = {.type = BEX__MSG_DATA, .stream = 1, .len = 512};
        if (adv_peer_send(&p, &h, 512, 300))
            break;
    }
    adv_say(a->wr, "underway");
    peer_wait(a, &p, t0, 15000 * adv_scale());
    adv_say(a->wr, "note %u echoes arrived", p.data_recv);
    return peer_done(a, &p);
}

static const char *wc_str(int st)
{
    return st >= 0 ? ibv_wc_status_str((enum ibv_wc_status)st) : strerror(-st);
}

/* WRITEs with keys the server never gave out, each on a fresh connection:
 * the key of the keepalive word with bits flipped, a random key at a random
 * address, key 0. */
int adv_attack_rkey_forged(struct adv_attack_ctx *a)
{
    rnd_state = 0xf00d;
    adv_say(a->wr, "underway");
    for (int k = 0; k < 3; k++) {
        struct adv_peer p;
        if (peer_up(a, &p, NULL)) {
            adv_peer_destroy(&p);
            continue;
        }
        uint64_t addr = p.theirs.ka_addr;
        uint32_t rkey = p.theirs.ka_rkey ^ 0x00a5a500u;
        if (k == 1) {
            addr = ((uint64_t)rnd() << 32 | rnd()) & ~7ull;
            rkey = rnd();
        } else if (k == 2) {
            rkey = 0;
        }
        uint64_t t0 = adv_now_ms();
        int st = adv_peer_write(&p, addr, rkey, 64, -1, 5000);
        adv_say(a->wr, "note conn %u: WRITE with forged key 0x%x at 0x%llx: %s", p.lport, rkey,
                (unsigned long long)addr, wc_str(st));
        if (st == IBV_WC_SUCCESS)
            adv_say(a->wr, "note conn %u: a forged key was accepted", p.lport);
        peer_wait(a, &p, t0, 10000 * adv_scale());
        adv_peer_destroy(&p);
    }
    adv_say(a->wr, "done");
    return 0;
}

/* A finished rendezvous: its destination is delivered (and the server's
 * echo came back), then the same key is used again. The server holds the
 * delivered buffer (server.c): a write that lands there is seen. */
int adv_attack_rkey_stale(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    if (peer_up(a, &p, NULL))
        return peer_done(a, &p);
    open_stream(&p, 1);
    struct bex__hdr h = {.type = BEX__MSG_RNDV_REQ, .stream = 1, .len = 65536, .id = 1};
    const struct adv_resp *r = NULL;
    if (adv_peer_send(&p, &h, 0, 2000) == 0)
        r = adv_peer_wait_resp(&p, 1, 5000 * adv_scale());
    if (!r || r->status) {
        adv_say(a->wr, "fail no rendezvous destination (%s)",
                r ? strerror(-r->status) : "no answer");
        adv_peer_destroy(&p);
        return 1;
    }
    struct adv_resp d = *r;
    adv_peer_fill(&p, 0x11);
    int st = adv_peer_write(&p, d.addr, d.rkey, 65536, d.slot, 5000 * adv_scale());
    adv_peer_fill(&p, PEER_ATTACK);
    if (st != IBV_WC_SUCCESS) {
        adv_say(a->wr, "fail the rendezvous itself failed: %s", wc_str(st));
        adv_peer_destroy(&p);
        return 1;
    }
    /* wait for the echo: then the message was surely delivered */
    uint64_t end = adv_now_ms() + 10000ull * adv_scale();
    while (p.imm_recv + p.data_recv == 0 && !p.closed && adv_now_ms() < end)
        adv_peer_poll(&p, 10);
    adv_say(a->wr, "note echo %s", p.imm_recv + p.data_recv ? "arrived" : "did not arrive");
    adv_say(a->wr, "underway");
    uint64_t t0 = adv_now_ms();
    st = adv_peer_write(&p, d.addr, d.rkey, 65536, -1, 5000 * adv_scale());
    adv_say(a->wr, "note conn %u: WRITE with the finished transfer's key: %s", p.lport, wc_str(st));
    if (st == IBV_WC_SUCCESS) {
        adv_say(a->wr, "accepted %u", p.lport);
        adv_peer_poll(&p, 500);
    } else {
        peer_wait(a, &p, t0, 10000 * adv_scale());
    }
    return peer_done(a, &p);
}

/* WRITEs outside the range a key was given for, each on a fresh
 * connection while the server refuses them: around the keepalive word,
 * around a rendezvous destination, the start of the 4 MiB chunk (allocator
 * metadata) and, last, a sweep over the whole chunk. */
int adv_attack_rkey_range(struct adv_attack_ctx *a)
{
    enum { CHUNK = 4u << 20 };
    struct adv_peer p;
    bool have = false;
    uint64_t t0 = 0;
    /* the rendezvous targets first: the keepalive ones land in the
     * server's header area of this very connection on a server that lets
     * them. A rendezvous key reaches its whole landing chunk on rxe, where
     * other peers' payloads in flight may be (docs/security.md allows
     * that): the good clients hold their traffic meanwhile, and the late
     * one comes after */
    good_pause(a);
    static const int order[] = {2, 3, 4, 0, 1, 5, 6};
    for (int oi = 0; oi < 7; oi++) {
        int k = order[oi];
        if (oi == 3) {
            good_resume(a);
            adv_say(a->wr, "underway");
        }
        if (!have) {
            if (peer_up(a, &p, NULL)) {
                adv_peer_destroy(&p);
                continue;
            }
            have = true;
        }
        uint64_t ka = p.theirs.ka_addr, base = ka & ~(uint64_t)(CHUNK - 1);
        uint32_t key = p.theirs.ka_rkey, len = 64;
        uint64_t addr = 0;
        const char *what = "";
        if (k <= 1 || k == 5) {
            switch (k) {
            case 0:
                what = "keepalive key, 4 KiB past the word";
                addr = ka + 4096;
                break;
            case 1:
                what = "keepalive key, 64 B before the word";
                addr = ka - 64;
                break;
            case 5:
                what = "keepalive key, start of its chunk (allocator metadata)";
                addr = base;
                break;
            }
        } else if (k == 6) {
            what = "keepalive key, sweep over the whole chunk";
        } else {
            open_stream(&p, (uint32_t)k);
            struct bex__hdr h = {
                .type = BEX__MSG_RNDV_REQ, .stream = (uint32_t)k, .len = 65536, .id = (uint32_t)k};
            const struct adv_resp *r = NULL;
            if (adv_peer_send(&p, &h, 0, 2000) == 0)
                r = adv_peer_wait_resp(&p, (uint32_t)k, 5000 * adv_scale());
            if (!r || r->status) {
                adv_say(a->wr, "note no rendezvous destination for target %d", k);
                continue;
            }
            key = r->rkey;
            switch (k) {
            case 2:
                what = "rendezvous key, right after the destination";
                addr = r->addr + 65536;
                break;
            case 3:
                what = "rendezvous key, 4 KiB before the destination";
                addr = r->addr - 4096;
                break;
            case 4:
                what = "rendezvous key, start of its chunk";
                addr = r->addr & ~(uint64_t)(CHUNK - 1);
                break;
            }
        }
        t0 = adv_now_ms();
        int st;
        if (k == 6) {
            /* the chunk of the keepalive word, but for its first 64 KiB */
            st = IBV_WC_SUCCESS;
            uint32_t done = 0;
            for (uint64_t off = 65536; off < CHUNK && st == IBV_WC_SUCCESS; off += 65536) {
                if (base + off <= ka && ka < base + off + 65536)
                    continue; /* spare our own keepalive word: stay connected */
                st = adv_peer_write(&p, base + off, key, 65536, -1, 5000 * adv_scale());
                done += st == IBV_WC_SUCCESS;
            }
            adv_say(a->wr, "note conn %u: %s: %u of 63 pieces written", p.lport, what, done);
        } else {
            st = adv_peer_write(&p, addr, key, len, -1, 5000 * adv_scale());
        }
        adv_say(a->wr, "note conn %u: %s (0x%llx, key 0x%x): %s", p.lport, what,
                (unsigned long long)addr, key, wc_str(st));
        if (st == IBV_WC_SUCCESS)
            continue; /* the same connection goes on */
        peer_wait(a, &p, t0, 10000 * adv_scale());
        adv_peer_destroy(&p);
        have = false;
    }
    if (have) {
        /* every abuse on this connection was accepted */
        adv_say(a->wr, "accepted %u", p.lport);
        adv_peer_poll(&p, 500);
        adv_peer_destroy(&p);
    }
    adv_say(a->wr, "done");
    return 0;
}

/* Mid-rendezvous, the attacker kills itself with -9: a quarter of a 1 MiB
 * message written, no WRITE_WITH_IMM. */
int adv_attack_kill9_rndv(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    if (peer_up(a, &p, NULL))
        return peer_done(a, &p);
    open_stream(&p, 1);
    struct bex__hdr h = {.type = BEX__MSG_RNDV_REQ, .stream = 1, .len = 1u << 20, .id = 1};
    const struct adv_resp *r = NULL;
    if (adv_peer_send(&p, &h, 0, 2000) == 0)
        r = adv_peer_wait_resp(&p, 1, 5000 * adv_scale());
    if (!r || r->status) {
        adv_say(a->wr, "fail no rendezvous destination");
        return 1;
    }
    adv_peer_fill(&p, 0x11);
    int st = adv_peer_write(&p, r->addr, r->rkey, 256u << 10, -1, 5000 * adv_scale());
    adv_say(a->wr, "note a quarter written: %s", wc_str(st));
    adv_say(a->wr, "underway");
    adv_say(a->wr, "killed %u", p.lport);
    kill(getpid(), SIGKILL);
    return 1;
}

/* Read what the server sends until it closes (or wait_ms); "leak" if any
 * of it is a hello (plain, or an authenticated HELLO): an unauthenticated
 * peer must learn no QPN, GID or rkey. */
static void unauth_drain(struct adv_attack_ctx *a, struct tconn *c, unsigned wait_ms)
{
    uint8_t buf[4096];
    size_t n = 0;
    uint64_t end = adv_now_ms() + wait_ms;
    while (adv_now_ms() < end && n < sizeof buf) {
        struct pollfd pf = {.fd = c->fd, .events = POLLIN};
        if (poll(&pf, 1, 50) <= 0)
            continue;
        ssize_t r = recv(c->fd, buf + n, sizeof buf - n, 0);
        if (r <= 0) {
            c->closed = true;
            break;
        }
        n += (size_t)r;
    }
    if (c->closed)
        adv_say(a->wr, "closed %u %llu", c->port, (unsigned long long)(adv_now_ms() - c->t0));
    for (size_t off = 0; off + BEX__SETUP_PRE_LEN <= n;) {
        size_t len = 0;
        int kind = bex__setup_peek(buf + off, &len);
        if (kind == BEX__SETUP_HELLO ||
            (kind == BEX__SETUP_AUTH && off + 8 < n && buf[off + 8] == BEX__AUTH_HELLO)) {
            adv_say(a->wr, "leak %u", c->port);
            break;
        }
        if (kind < 0 || len == 0)
            break;
        off += len;
    }
}

/* The server has a secret; these peers do not: a plain hello, a proof made
 * with another secret, an OPEN and then silence, an OPEN followed at once by
 * a HELLO (no proof), and a malformed authenticated-setup message. None may
 * get a hello out of the server; each must be refused and logged. */
int adv_attack_unauthenticated(struct adv_attack_ctx *a)
{
    enum { N = 5 };
    static const char *what[N] = {"a plain hello", "a proof made with another secret",
                                  "OPEN, then silence", "OPEN, then a HELLO without a proof",
                                  "a malformed authenticated-setup message"};
    struct tconn c[N];
    uint8_t key[BEX__AUTH_KEY_LEN];
    const char other[] = "not-the-cluster-secret-at-all-0123456789";
    bex__auth_key(other, sizeof other - 1, key);
    adv_say(a->wr, "underway");
    for (int i = 0; i < N; i++) {
        if (tcp_open(a, false, &c[i])) {
            adv_say(a->wr, "fail connect %d: %s", i, strerror(errno));
            return 1;
        }
        adv_say(a->wr, "conn %u", c[i].port);
        adv_say(a->wr, "note conn %u: %s", c[i].port, what[i]);
        uint8_t m[BEX__SETUP_MAX_LEN + BEX__READY_LEN];
        struct bex__auth_transcript t;
        bex__auth_nonce(t.nonce_c);
        if (i == 0) {
            struct bex__hello h;
            fake_hello(a, &h);
            bex__hello_encode(&h, m);
            write_all(c[i].fd, m, BEX__HELLO_LEN);
        } else if (i == 4) {
            bex__auth_encode(BEX__AUTH_PROOF, t.nonce_c, m);
            m[7] = 45; /* a length no message has */
            write_all(c[i].fd, m, BEX__AUTH_SHORT_LEN);
        } else {
            bex__auth_encode(BEX__AUTH_OPEN, t.nonce_c, m);
            write_all(c[i].fd, m, BEX__AUTH_SHORT_LEN);
        }
        if (i == 1) {
            /* the challenge, then a proof under the wrong key */
            int64_t dl = bex__hello_now_ms() + 5000 * (int64_t)adv_scale();
            if (bex__hello_read_all(c[i].fd, m, BEX__AUTH_SHORT_LEN, dl) == 0 &&
                bex__auth_decode(m, BEX__AUTH_SHORT_LEN, BEX__AUTH_CHALLENGE, t.nonce_l) == 0) {
                bex_addr me, them;
                socklen_t sl = sizeof me;
                getsockname(c[i].fd, (struct sockaddr *)&me, &sl);
                sl = sizeof them;
                getpeername(c[i].fd, (struct sockaddr *)&them, &sl);
                bex__auth_ends(&t, me.in4.sin_addr.s_addr, me.in4.sin_port,
                               them.in4.sin_addr.s_addr, them.in4.sin_port);
                uint8_t mac[BEX__AUTH_MAC_LEN];
                bex__auth_mac(key, BEX__AUTH_MAC_PROOF_C, &t, NULL, NULL, mac);
                bex__auth_encode(BEX__AUTH_PROOF, mac, m);
                write_all(c[i].fd, m, BEX__AUTH_SHORT_LEN);
            } else {
                adv_say(a->wr, "note conn %u: no challenge came", c[i].port);
            }
        } else if (i == 3) {
            struct bex__hello h;
            fake_hello(a, &h);
            uint8_t raw[BEX__HELLO_LEN], mac[BEX__AUTH_MAC_LEN] = {0};
            bex__hello_encode(&h, raw);
            bex__auth_encode_hello(raw, mac, m);
            write_all(c[i].fd, m, BEX__AUTH_HELLO_LEN);
        }
        c[i].t0 = adv_now_ms();
    }
    for (int i = 0; i < N; i++)
        unauth_drain(a, &c[i], 15000 * adv_scale());
    tcp_close_all(c, N);
    adv_say(a->wr, "done");
    return 0;
}

/* The readiness notice held back, an OPEN over RDMA (the server then takes
 * the QP as the connection's transport: a peer's first frames may overtake
 * its notice), then a FALLBACK notice over TCP. The server must refuse it
 * and close the connection, not move a connection that already has frames
 * over RDMA to TCP. */
int adv_attack_fallback_after_frames(struct adv_attack_ctx *a)
{
    struct adv_peer p;
    struct adv_peer_opts o = {.no_ready = true};
    if (peer_up(a, &p, &o))
        return peer_done(a, &p);
    uint64_t t0 = adv_now_ms();
    if (open_stream(&p, 1))
        adv_say(a->wr, "fail the OPEN over RDMA did not go");
    adv_peer_poll(&p, 300); /* the server takes the OPEN first */
    adv_say(a->wr, "underway");
    int64_t dl = bex__hello_now_ms() + 5000 * (int64_t)adv_scale();
    int rc = bex__hello_ready_send(p.fd, BEX__READY_FALLBACK, dl);
    adv_say(a->wr, "note FALLBACK notice after an OPEN over RDMA: %s", rc ? strerror(-rc) : "sent");
    return peer_end(a, &p, t0, 10000 * adv_scale());
}
