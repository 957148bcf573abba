/* SPDX-License-Identifier: Apache-2.0 */
/* conn without sockets: a thread's connections driven by hand, their
 * owner a fake that records what conn tells it (up, chosen, down, open
 * streams) and plays one stream per connection. */
#include <arpa/inet.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "conn/conn.h"
#include "harness.h"
#include "transport/tcp/tcp.h"
#include "transport/transport.h"
#include "wire/hello.h"

#define PAYLOAD "hello over conn"
static char payload[] = PAYLOAD;

struct fake_stream {
    struct bex__stream st;
    struct bex__msg m; /* client: the one message it sends */
};

/* What the fake owner saw, per side (client or listener). */
struct seen {
    int up, chosen, down, down_err, open_asked;
    bool down_connecting;
    int opens, msgs, done, done_status, closed;
    char got[64];
};

static struct seen cli, srv;
static struct fake_stream *srv_stream;

static struct seen *side(struct conn *c)
{
    return c->client ? &cli : &srv;
}

static void fake_up(struct conn *c, struct bex__xport *x)
{
    (void)x;
    side(c)->up++;
}

/* The client's stream waited for the transport: it attaches and sends. */
static void fake_chosen(struct conn *c)
{
    side(c)->chosen++;
    struct bex__stream *st = bex__conn_stream_find(c, 1);
    if (!st)
        return;
    struct fake_stream *f = bex__container_of(st, struct fake_stream, st);
    c->x->ops->attach(c->x, &f->st, 1, true);
    f->m = (struct bex__msg){.buf = payload, .len = sizeof payload};
    c->x->ops->send(c->x, &f->st, &f->m);
    bex__conn_ready(c);
}

static void fake_down(struct conn *c, int err, bool connecting)
{
    struct seen *s = side(c);
    s->down++;
    s->down_err = err;
    s->down_connecting = connecting;
    /* the streams go with the connection (as the socket layer's do) */
    struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
    uint64_t id;
    while (bex__hmap_next(&c->streams, &it, &id))
        bex__conn_stream_del(c, (uint32_t)id);
}

static uint32_t fake_open_streams(struct conn *c)
{
    side(c)->open_asked++;
    return bex__conn_nstreams(c);
}

static void fake_on_msg(struct bex__xport *x, uint32_t stream, void *buf, size_t len)
{
    struct conn *c = x->user;
    struct seen *s = side(c);
    s->msgs++;
    if (stream == 1 && len <= sizeof s->got)
        memcpy(s->got, buf, len);
    bex_mem_free(buf);
}

static void fake_on_open(struct bex__xport *x, uint32_t stream)
{
    struct conn *c = x->user;
    side(c)->opens++;
    if (!c->x)
        c->x = x;
    srv_stream = calloc(1, sizeof(*srv_stream));
    CHECK(srv_stream);
    CHECK_OK(bex__conn_stream_add(c, stream, &srv_stream->st));
    x->ops->attach(x, &srv_stream->st, stream, false);
}

static void fake_on_peer_close(struct bex__xport *x, uint32_t stream)
{
    (void)x;
    (void)stream;
}

static void fake_on_send_done(struct bex__xport *x, struct bex__msg *m, int status)
{
    (void)m;
    struct seen *s = side(x->user);
    s->done++;
    s->done_status = status;
}

static void fake_on_stream_closed(struct bex__xport *x, struct bex__stream *st)
{
    (void)st;
    side(x->user)->closed++;
}

static int fake_on_direct(struct bex__xport *x, uint32_t imm)
{
    (void)x;
    (void)imm;
    return -EPROTO;
}

static void *fake_direct_buf(struct bex__xport *x, uint32_t token, uint32_t *len)
{
    (void)x;
    (void)token;
    (void)len;
    return NULL;
}

static const struct bex__transport_upcalls fake_upcalls = {
    .on_msg = fake_on_msg,
    .on_open = fake_on_open,
    .on_peer_close = fake_on_peer_close,
    .on_send_done = fake_on_send_done,
    .on_stream_closed = fake_on_stream_closed,
    .on_direct = fake_on_direct,
    .direct_buf = fake_direct_buf,
};

static const struct bex__conn_owner_ops fake_ops = {
    .stream_upcalls = &fake_upcalls,
    .up = fake_up,
    .chosen = fake_chosen,
    .down = fake_down,
    .open_streams = fake_open_streams,
};

/* One I/O thread's worth of state, without a thread: the test drives it. */
struct world {
    bex_ctx_config cfg;
    struct bex__engine_config ecfg;
    struct bex__engine_shared sh;
    struct bex__log log;
    struct bex__conn_env env;
    struct bex__io io;
    struct bex_listener l;
};

static void world_init(struct world *w)
{
    memset(w, 0, sizeof(*w));
    w->cfg = (bex_ctx_config){
        .transport = BEX_TRANSPORT_TCP,
        .local_addr = bex_addr_ipv4(htonl(INADDR_LOOPBACK), 0),
        .frag_size = 65536,
        .keepalive_ms = 100,
        .keepalive_timeout_ms = 2000,
        .connect_timeout_ms = 3000,
        .max_msg = 1u << 20,
        .recv_share_min = 4u << 20,
        .recv_min_rate = 1u << 20,
        .recv_rate_ms = 5000,
        .streams_max = 16,
        .setup_max = 64,
        .credit_timeout_ms = 30000,
        .io_threads = 1,
    };
    bex__log_init(&w->log, NULL, NULL, BEX_LOG_WARN);
    bex_mem_registrar reg;
    bex_mem_registrar_noop(&reg);
    CHECK_OK(bex_mem_pool_create(&reg, NULL, &w->sh.pool));
    CHECK_OK(bex_mem_pool_create(&reg, NULL, &w->sh.recv_pool));
    w->sh.log = &w->log;
    w->env = (struct bex__conn_env){
        .cfg = &w->cfg, .sh = &w->sh, .ecfg = &w->ecfg, .log = &w->log, .io = &w->io, .n_io = 1};
    bex__conn_env_init(&w->env, &fake_ops);
    bex__io_lists_init(&w->io);
    w->io.env = &w->env;
    w->io.sh = w->sh;
    w->io.sh.stats = &w->io.stats;
    w->io.engines = calloc(ENGINE_TABLE, sizeof(*w->io.engines));
    CHECK(w->io.engines);
    CHECK_OK(bex__loop_init(&w->io.loop));
    bex__io_timers_init(&w->io);
    memset(&cli, 0, sizeof cli);
    memset(&srv, 0, sizeof srv);
    srv_stream = NULL;
}

/* A listener on loopback, watched by the thread (port 0: the kernel picks). */
static void world_listen(struct world *w)
{
    struct bex_listener *l = &w->l;
    l->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    CHECK(l->fd >= 0);
    bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)}};
    socklen_t sl = sizeof a;
    CHECK_OK(bind(l->fd, (struct sockaddr *)&a, sizeof a));
    CHECK_OK(listen(l->fd, 16));
    CHECK_OK(getsockname(l->fd, (struct sockaddr *)&l->addr, &sl));
    l->tag.cb = bex__listener_on_event;
    l->io = &w->io;
    bex__list_push_head(&w->io.listeners, &l->link);
    CHECK_OK(bex__loop_watch(&w->io.loop, l->fd, EPOLLIN, &l->tag));
}

/* One turn of the thread: events to their watchers, then progress for the
 * connections that have work (what sock/io.c's loop does, minus CQs). */
static void world_turn(struct world *w)
{
    struct epoll_event ev[16];
    int n = bex__loop_wait(&w->io.loop, ev, 16, 5);
    for (int i = 0; i < n; i++) {
        struct ep_tag *t = ev[i].data.ptr;
        t->cb(t, ev[i].events);
    }
    struct bex__list list, *r;
    bex__list_init(&list);
    bex__list_take_all(&w->io.ready, &list);
    while ((r = bex__list_first(&list))) {
        struct conn *c = bex__list_entry(r, struct conn, ready_link);
        bex__list_remove(r);
        if (c->x && !bex__conn_dead(c) && c->x->ops->progress(c->x))
            bex__conn_ready(c);
        bex__conn_due_sync(c);
    }
    bex__io_timers_run(&w->io, bex__now_us());
    bex__conn_reap(&w->io);
}

#define TURN_UNTIL(w, cond)                                                                        \
    do {                                                                                           \
        uint64_t end_ = bex_test_now_ms() + 10000 * bex_test_time_scale();                         \
        while (!(cond)) {                                                                          \
            CHECK(bex_test_now_ms() < end_);                                                       \
            world_turn(w);                                                                         \
        }                                                                                          \
    } while (0)

static struct conn *world_server_conn(struct world *w)
{
    struct bex__list *n;
    bex__list_foreach(n, &w->io.conns)
    {
        struct conn *c = bex__conn_of(n);
        if (!c->client)
            return c;
    }
    return NULL;
}

static void world_fini(struct world *w)
{
    for (struct bex__list *n; (n = bex__list_first(&w->io.conns));) {
        struct conn *c = bex__conn_of(n);
        struct bex__hmap_iter it = BEX__HMAP_ITER_INIT;
        uint64_t id;
        while (bex__hmap_next(&c->streams, &it, &id))
            bex__hmap_del(&c->streams, id);
        bex__conn_free(c);
    }
    if (w->l.fd > 0)
        close(w->l.fd);
    bex__loop_fini(&w->io.loop);
    free(w->io.engines);
    free(srv_stream);
    CHECK_OK(bex_mem_pool_destroy(w->sh.recv_pool));
    CHECK_OK(bex_mem_pool_destroy(w->sh.pool));
    bex__log_fini(&w->log);
}

/* A client connection and the one the listener accepted, up over TCP, with
 * one stream the client opened before the transport was chosen. */
static struct conn *world_connect(struct world *w, struct fake_stream *f)
{
    world_listen(w);
    struct conn *c;
    CHECK_OK(bex__conn_start_client(&w->io, &w->l.addr, BEX_TRANSPORT_TCP, &c));
    CHECK_OK(bex__conn_stream_add(c, c->next_stream++, &f->st));
    CHECK_EQ(bex__conn_nstreams(c), 1);
    TURN_UNTIL(w, srv.msgs == 1 && cli.done == 1);
    return c;
}

/* Setup over loopback: the owner hears chosen once on each side (no up:
 * over TCP the transport is up when chosen), the client's stream attaches
 * then and its message arrives on the stream the listener's side opened. */
static int tcp_setup(void)
{
    struct world w;
    struct fake_stream f = {0};
    world_init(&w);
    struct conn *c = world_connect(&w, &f);
    CHECK_EQ(cli.chosen, 1);
    CHECK_EQ(srv.chosen, 1);
    CHECK(c->x && bex__xport_is_tcp(c->x));
    CHECK_EQ(c->phase, P_UP);
    CHECK_EQ(srv.opens, 1);
    CHECK_EQ(cli.done_status, 0);
    CHECK(strcmp(srv.got, PAYLOAD) == 0);
    struct conn *s = world_server_conn(&w);
    CHECK(s && s->phase == P_UP);
    CHECK_EQ(bex__conn_nstreams(s), 1);
    CHECK(bex__conn_stream_find(s, 1) == &srv_stream->st);
    CHECK_EQ(cli.down + srv.down, 0);
    world_fini(&w);
    return 0;
}

/* The listener's side fails its connection: its owner hears down (not
 * connecting); the client's transport sees the TCP connection end, conn
 * asks its owner how many streams were open (to name the loss) and tells
 * it down too. The dead connections are freed once their streams left. */
static int down(void)
{
    struct world w;
    struct fake_stream f = {0};
    world_init(&w);
    world_connect(&w, &f);
    struct conn *s = world_server_conn(&w);
    bex__conn_fail(s, -ECONNABORTED);
    CHECK_EQ(srv.down, 1);
    CHECK_EQ(srv.down_err, -ECONNABORTED);
    CHECK(!srv.down_connecting);
    TURN_UNTIL(&w, cli.down == 1);
    CHECK(!cli.down_connecting);
    CHECK(cli.down_err < 0);
    CHECK_EQ(cli.open_asked, 1);
    TURN_UNTIL(&w, bex__list_empty(&w.io.conns));
    world_fini(&w);
    return 0;
}

/* Nobody listens: the client's owner hears down while connecting, once,
 * and its waiting stream never saw a transport. */
static int refused(void)
{
    struct world w;
    struct fake_stream f = {0};
    world_init(&w);
    world_listen(&w);
    bex_addr to = w.l.addr;
    bex__loop_unwatch(&w.io.loop, w.l.fd);
    close(w.l.fd);
    w.l.fd = -1;
    bex__list_remove(&w.l.link);
    struct conn *c;
    CHECK_OK(bex__conn_start_client(&w.io, &to, BEX_TRANSPORT_TCP, &c));
    CHECK_OK(bex__conn_stream_add(c, c->next_stream++, &f.st));
    TURN_UNTIL(&w, cli.down == 1);
    CHECK(cli.down_connecting);
    CHECK_EQ(cli.down_err, -ECONNREFUSED);
    CHECK_EQ(cli.chosen, 0);
    TURN_UNTIL(&w, bex__list_empty(&w.io.conns));
    world_fini(&w);
    return 0;
}

/* In a network namespace of its own (root: CI runs as root), whose
 * loopback is up and whose ephemeral ports are one, SELF_PORT: a connect
 * to 127.0.0.1:SELF_PORT, where nobody listens, gets that port as its own,
 * and TCP's simultaneous open joins the socket to itself. Outside a test it
 * happens by chance to a client that reconnects to a dead local peer whose
 * port is in the ephemeral range (a replica restarted on its port found it
 * taken: EADDRINUSE). */
#define SELF_PORT 40000
static int self_netns(void)
{
    if (unshare(CLONE_NEWNET)) {
        fprintf(stderr, "self_connect: unshare(CLONE_NEWNET): %s (needs root)\n", strerror(errno));
        return -1;
    }
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    struct ifreq ifr = {0};
    strcpy(ifr.ifr_name, "lo");
    ifr.ifr_flags = IFF_UP | IFF_LOOPBACK | IFF_RUNNING;
    int rc = s < 0 ? -1 : ioctl(s, SIOCSIFFLAGS, &ifr);
    if (s >= 0)
        close(s);
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "w");
    if (rc || !f || fprintf(f, "%d %d\n", SELF_PORT, SELF_PORT) < 0 || fclose(f)) {
        fprintf(stderr, "self_connect: the namespace's loopback or port range: %s\n",
                strerror(errno));
        return -1;
    }
    return 0;
}

/* A connection that TCP joined to itself is no peer: the owner hears down
 * while connecting with ECONNREFUSED, as from a refused connect, and the
 * port is given back at once. Before, the setup went on with itself as the
 * peer: its hello answered by its own, its streams' OPENs by its own. */
static int self_connect(void)
{
    CHECK_OK(self_netns());
    struct world w;
    struct fake_stream f = {0};
    world_init(&w);
    bex_addr to = {0};
    to.in4.sin_family = AF_INET;
    to.in4.sin_port = htons(SELF_PORT);
    to.in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct conn *c;
    CHECK_OK(bex__conn_start_client(&w.io, &to, BEX_TRANSPORT_TCP, &c));
    CHECK_OK(bex__conn_stream_add(c, c->next_stream++, &f.st));
    TURN_UNTIL(&w, cli.down == 1 || cli.chosen);
    CHECK_EQ(cli.chosen, 0);
    CHECK(cli.down_connecting);
    CHECK_EQ(cli.down_err, -ECONNREFUSED);
    TURN_UNTIL(&w, bex__list_empty(&w.io.conns));
    /* the port is free at once: a listener takes it (no TIME_WAIT left) */
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    CHECK(l >= 0);
    CHECK(setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
    if (bind(l, &to.sa, sizeof to.in4)) {
        fprintf(stderr, "self_connect: bind to the port after: %s\n", strerror(errno));
        CHECK(0);
    }
    close(l);
    world_fini(&w);
    return 0;
}

/* Whether the peer closed fd (EOF or reset); the bytes it wrote first are
 * dropped. */
static bool peer_gone(int fd)
{
    char b[256];
    ssize_t n = recv(fd, b, sizeof b, MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* A raw peer's readiness notice before any hello: a move of the setup that
 * the accepted connection's phase (WAIT_HELLO) does not take, driven by the
 * peer. The listener's side fails that connection and closes it, its place
 * in the setup table comes back at once (SETUP -> DEAD), it is freed, and
 * the thread goes on: the next client sets up and its message arrives. */
static int ready_first(void)
{
    struct world w;
    struct fake_stream f = {0};
    world_init(&w);
    world_listen(&w);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    CHECK_OK(connect(fd, (struct sockaddr *)&w.l.addr, sizeof(struct sockaddr_in)));
    uint8_t b[BEX__READY_LEN];
    bex__ready_encode(0, b);
    CHECK(write(fd, b, sizeof b) == (ssize_t)sizeof b);
    TURN_UNTIL(&w, peer_gone(fd));
    close(fd);
    CHECK_EQ(w.io.n_setup, 0);
    TURN_UNTIL(&w, bex__list_empty(&w.io.conns));
    CHECK_EQ(srv.opens + srv.chosen, 0);
    struct conn *c;
    CHECK_OK(bex__conn_start_client(&w.io, &w.l.addr, BEX_TRANSPORT_TCP, &c));
    CHECK_OK(bex__conn_stream_add(c, c->next_stream++, &f.st));
    TURN_UNTIL(&w, srv.msgs == 1 && cli.done == 1);
    CHECK(strcmp(srv.got, PAYLOAD) == 0);
    CHECK_EQ(w.io.n_setup, 0);
    world_fini(&w);
    return 0;
}

/* ---- the I/O loop itself (bex__io_main), on a thread of its own ---- */

/* An owner whose every turn has work: its command drain queues the command
 * again (so the next turn drains one too) and says it did something; on
 * the I/O thread, the first drain starts a timer that runs every
 * TIMER_MS. work_stop ends the loop (the drain moves it to STOPPING, as
 * CMD_STOP does). */
#define TIMER_MS 20
static struct bex__cmd work_cmd;
static struct bex__timer work_tm;
static _Atomic int work_stop;
static _Atomic uint64_t work_fires;

static void work_fire(struct bex__timer *t)
{
    atomic_fetch_add(&work_fires, 1);
    bex__timer_start(&bex__io_self->timers, t, bex__now_us() + TIMER_MS * 1000);
}

static bool work_drain(struct bex__io *io)
{
    (void)bex__loop_take(&io->loop);
    if (atomic_load(&work_stop)) {
        bex__io_move(io, IO_STOPPING);
        return true;
    }
    if (!work_tm.active) {
        bex__timer_init(&work_tm, work_fire);
        bex__timer_start(&io->timers, &work_tm, bex__now_us() + TIMER_MS * 1000);
    }
    bex__loop_push(&io->loop, &work_cmd, BEX__CMD_OWNER);
    return true;
}

/* Issue 25 item 2: a polling thread looks at its timers on the turns that
 * find nothing to do, and on every 16th of those that find work (the
 * coarse clock's read saved on the others). A busy thread whose every turn
 * has work (here: a command on every turn) still runs its timers: a timer
 * every TIMER_MS fires about as often in 300 ms (at least 3 times asked),
 * though the thread never had an idle turn. A gate that skipped every
 * turn with work (the 16th too) fails it: no fire at all. */
static int timers_under_work(void)
{
    struct world w;
    world_init(&w);
    w.cfg.poll_mode = BEX_POLL_BUSY;
    struct bex__conn_owner_ops ops = fake_ops;
    ops.drain_cmds = work_drain;
    w.env.ops = &ops;
    bex__loop_push(&w.io.loop, &work_cmd, BEX__CMD_OWNER); /* (the first turn's work) */
    bex__io_move(&w.io, IO_RUNNING);
    pthread_t th;
    CHECK_OK(pthread_create(&th, NULL, bex__io_main, &w.io));
    uint64_t end = bex_test_now_ms() + 300;
    while (bex_test_now_ms() < end)
        bex_test_sleep_ms(10);
    uint64_t fires = atomic_load(&work_fires);
    atomic_store(&work_stop, 1);
    CHECK_OK(pthread_join(th, NULL));
    bex__io_move(&w.io, IO_JOINED);
    uint64_t turns = atomic_load(&w.io.turns);
    uint64_t empty = atomic_load(&w.io.stats.empty_turns);
    fprintf(stderr, "%llu turns (%llu of them idle), the timer fired %llu times in 300 ms\n",
            (unsigned long long)turns, (unsigned long long)empty, (unsigned long long)fires);
    CHECK_EQ(empty, 0); /* every turn had work */
    CHECK(turns >= 16 * 3);
    CHECK(fires >= 3);
    world_fini(&w);
    return 0;
}

BEX_TEST_MAIN({"tcp_setup", tcp_setup}, {"down", down}, {"refused", refused},
              {"self_connect", self_connect}, {"ready_first", ready_first},
              {"timers_under_work", timers_under_work})
