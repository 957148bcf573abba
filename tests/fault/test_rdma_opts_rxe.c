/* SPDX-License-Identifier: Apache-2.0 */
/* The RDMA provider options of bex_ctx_config on rxe (issue 24 item 1). One
 * process: a server context on ADDR0 (rxe0, veth0), a client on ADDR1. The
 * program links bex_fault, whose verbs registrar reports the access flags of
 * every registration it makes (bex__fault_reg_hook): the recorder.
 *
 *   relaxed_default  every registration of both contexts (general pool for
 *                    the sends, receive pool, landing pool for a rendezvous
 *                    destination) carries IBV_ACCESS_RELAXED_ORDERING, and
 *                    rxe takes it: the messages arrive intact
 *   relaxed_off      relaxed_ordering OFF: none carries it
 *   qos_tos          the IP TOS byte of every RoCE v2 packet (UDP 4791) on
 *                    veth0, read with an AF_PACKET socket: the default 104
 *                    from the server, 184 (DSCP 46) from the client that set
 *                    it; the client's QP holds flow label 0x12345
 *   qos_zero         BEX_TRAFFIC_CLASS(0) on both: TOS 0 both ways
 *   td_auto          thread_domains AUTO (the default) on rxe, which has none:
 *                    the context tries, falls back (its INFO line), comes up,
 *                    its QPs work, stats say 0
 *   td_on            ON: bex_ctx_create fails with -EOPNOTSUPP and an ERROR
 *                    line naming thread_domains; nothing is left behind
 *   td_off           OFF: never tries (no fallback line), comes up, stats 0.
 *                    rxe cannot show the "with" side: no thread domains
 *   td_fake          the "with" side against a stand-in for a device that
 *                    has thread domains (bex__fault_td_set: recording ops):
 *                    ON comes up, one thread domain and one parent domain
 *                    over the device's PD per I/O thread, stats count them,
 *                    messages arrive; at teardown each parent domain goes
 *                    before its thread domain, each once. The stand-in's
 *                    parent domain is the device's PD itself (rxe's QPs can
 *                    use no other PD with bex's memory), so which PD a QP
 *                    sits on is not seen: unverified on hardware
 *   td_fake_fail     the stand-in's parent domain fails (ENOMEM): ON fails
 *                    the context with -ENOMEM, AUTO falls back and comes up;
 *                    the thread domain allocated is freed either way */
#include <errno.h>
#include <ifaddrs.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <netinet/ip.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "common/fault.h"
#include "sock/echo.h"
#include "transport/rdma/engine_internal.h"

static struct in_addr addr0, addr1;

static int setup_addrs(void)
{
    int rc = pair_addrs(&addr0, &addr1);
    if (rc)
        return rc;
    if (pair_tcp())
        return bex_test_skip("RDMA options are RDMA's");
    return 0;
}

/* ---- a server that counts intact messages, a client that sends ---- */

#define FILL 0x5a

struct srv {
    struct local_srv base; /* first: what the shared callbacks take */
    _Atomic long recvd, bad;
};

static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct srv *v = user;
    const uint8_t *p = buf;
    size_t i = 0;
    while (i < len && p[i] == FILL)
        i++;
    if (i != len)
        atomic_fetch_add(&v->bad, 1);
    bex_mem_free(buf);
    waiter_add(&v->base.w, &v->recvd, 1);
}

struct run {
    bex_ctx *sctx, *cctx;
    struct srv v;
    struct local_cli cl;
    bex_listener *l;
    bex_sock *s;
    long sent;
};

static void run_up(struct run *r, const bex_ctx_config *sc, const bex_ctx_config *cc)
{
    r->v = (struct srv){.base.w = WAITER_INIT};
    r->cl = (struct local_cli){.w = &r->v.base.w};
    r->sctx = local_ctx(sc, addr0);
    r->cctx = local_ctx(cc, addr1);
    bex_addr a;
    r->l = local_listen(r->sctx, addr0, &r->v.base, srv_recv, &a);
    bex_sock_ops ops = {.on_connect = local_cli_connect, .on_close = local_cli_closed};
    CHECK_OK(bex_sock_connect(r->cctx, &a, &ops, &r->cl, &r->s));
    /* (a starved VM took more than 10 s: a wait, not a deadline of bex's) */
    CHECK_OK(wait_count(&r->v.base.w, &r->cl.connected, 1, 30000));
    bex_sock_stats st;
    bex_ctx_stats(r->cctx, &st);
    CHECK_EQ(st.tcp_conns, 0); /* RDMA, not the TCP fallback */
    CHECK_EQ(st.engines, 1);
}

/* Eager messages and one rendezvous (a landing-pool destination), all to
 * arrive intact. */
static void run_send(struct run *r)
{
    static const size_t sizes[] = {64, 4096, 512 << 10, 100};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        void *b = bex_sock_alloc(r->cctx, sizes[i]);
        CHECK(b);
        memset(b, FILL, sizes[i]);
        CHECK_OK(bex_sock_send(r->s, b, sizes[i], NULL));
        r->sent++;
    }
    CHECK_OK(wait_count(&r->v.base.w, &r->v.recvd, r->sent, 20000));
    CHECK_EQ(atomic_load(&r->v.bad), 0);
}

static void run_down(struct run *r)
{
    bex_sock_close(r->s);
    CHECK_OK(wait_count(&r->v.base.w, &r->cl.closed, 1, 10000));
    CHECK_OK(wait_count(&r->v.base.w, &r->v.base.closed, 1, 10000));
    CHECK_OK(bex_listener_close(r->l));
    CHECK_OK(bex_ctx_destroy(r->cctx));
    CHECK_OK(bex_ctx_destroy(r->sctx));
}

/* ---- relaxed ordering: the recorder ---- */

struct rec {
    pthread_mutex_t mu;
    long regs, relaxed, remote_write;
};

static void rec_reg(void *arg, int access)
{
    struct rec *rc = arg;
    pthread_mutex_lock(&rc->mu);
    rc->regs++;
    rc->relaxed += (access & IBV_ACCESS_RELAXED_ORDERING) != 0;
    rc->remote_write += (access & IBV_ACCESS_REMOTE_WRITE) != 0;
    pthread_mutex_unlock(&rc->mu);
}

/* Traffic between two contexts configured with relaxed_ordering = ro; the
 * recorder's counts of what they registered. */
static void relaxed_run(uint32_t ro, struct rec *out)
{
    *out = (struct rec){.mu = PTHREAD_MUTEX_INITIALIZER};
    bex__fault_reg_hook(rec_reg, out);
    bex_ctx_config c = {.relaxed_ordering = ro};
    struct run r = {0};
    run_up(&r, &c, &c);
    run_send(&r);
    run_down(&r);
    bex__fault_reg_hook(NULL, NULL);
    fprintf(stderr, "relaxed_ordering %u: %ld registrations, %ld relaxed, %ld remote-write\n", ro,
            out->regs, out->relaxed, out->remote_write);
    /* at least the client's general pool, the server's receive pool and the
     * server's landing pool (the rendezvous destination) */
    CHECK(out->regs >= 3);
    CHECK(out->remote_write >= 1);
}

static int relaxed_default(void)
{
    PAIR_NEED(setup_addrs());
    struct rec rc;
    relaxed_run(BEX_SWITCH_AUTO, &rc);
    CHECK_EQ(rc.relaxed, rc.regs);
    relaxed_run(BEX_SWITCH_ON, &rc);
    CHECK_EQ(rc.relaxed, rc.regs);
    return 0;
}

static int relaxed_off(void)
{
    PAIR_NEED(setup_addrs());
    struct rec rc;
    relaxed_run(BEX_SWITCH_OFF, &rc);
    CHECK_EQ(rc.relaxed, 0);
    return 0;
}

/* ---- traffic class: the TOS byte on the wire ---- */

/* The name of the interface that holds a (veth0 in the VM). */
static void ifname_of(struct in_addr a, char *name, size_t cap)
{
    struct ifaddrs *all, *i;
    CHECK_OK(getifaddrs(&all));
    name[0] = 0;
    for (i = all; i; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET &&
            ((bex_addr *)i->ifa_addr)->in4.sin_addr.s_addr == a.s_addr)
            snprintf(name, cap, "%s", i->ifa_name);
    freeifaddrs(all);
    CHECK(name[0]);
}

struct cap {
    int fd;
    _Atomic bool stop;
    pthread_t th;
    /* RoCE v2 packets seen from addr0 / addr1, and those of them whose TOS
     * was not the one expected */
    long from0, from1, bad0, bad1;
    uint8_t want0, want1, seen_bad;
};

/* One IPv4 packet (no link header: SOCK_DGRAM) into the counts. */
static void cap_packet(struct cap *c, const uint8_t *p, size_t n)
{
    if (n < sizeof(struct iphdr))
        return;
    const struct iphdr *ip = (const void *)p;
    size_t hl = (size_t)ip->ihl * 4;
    if (ip->version != 4 || ip->protocol != IPPROTO_UDP || n < hl + 4)
        return;
    uint16_t dport = (uint16_t)(p[hl + 2] << 8 | p[hl + 3]);
    if (dport != 4791)
        return;
    if (ip->saddr == addr0.s_addr) {
        c->from0++;
        if (ip->tos != c->want0)
            c->bad0++, c->seen_bad = ip->tos;
    } else if (ip->saddr == addr1.s_addr) {
        c->from1++;
        if (ip->tos != c->want1)
            c->bad1++, c->seen_bad = ip->tos;
    }
}

static void *cap_main(void *arg)
{
    struct cap *c = arg;
    uint8_t buf[2048];
    while (!atomic_load(&c->stop)) {
        struct pollfd pf = {.fd = c->fd, .events = POLLIN};
        if (poll(&pf, 1, 50) <= 0)
            continue;
        struct sockaddr_ll from;
        socklen_t fl = sizeof from;
        ssize_t n = recvfrom(c->fd, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&from, &fl);
        if (n > 0 && from.sll_protocol == htons(ETH_P_IP))
            cap_packet(c, buf, (size_t)n);
    }
    return NULL;
}

/* Capture IPv4 on ADDR0's interface, both directions: ETH_P_ALL, since a
 * packet socket of one protocol sees only what comes in. Needs CAP_NET_RAW
 * (the VM runs tests as root). */
static void cap_start(struct cap *c, uint8_t want0, uint8_t want1)
{
    *c = (struct cap){.want0 = want0, .want1 = want1};
    char ifn[IF_NAMESIZE];
    ifname_of(addr0, ifn, sizeof ifn);
    c->fd = socket(AF_PACKET, SOCK_DGRAM, htons(ETH_P_ALL));
    if (c->fd < 0)
        fprintf(stderr, "AF_PACKET socket: %s (root?)\n", strerror(errno));
    CHECK(c->fd >= 0);
    struct sockaddr_ll ll = {.sll_family = AF_PACKET,
                             .sll_protocol = htons(ETH_P_ALL),
                             .sll_ifindex = (int)if_nametoindex(ifn)};
    CHECK(ll.sll_ifindex > 0);
    CHECK_OK(bind(c->fd, (struct sockaddr *)&ll, sizeof ll));
    CHECK_OK(pthread_create(&c->th, NULL, cap_main, c));
}

static void cap_stop(struct cap *c)
{
    pair_sleep_ms(100); /* the last ACKs */
    atomic_store(&c->stop, true);
    pthread_join(c->th, NULL);
    close(c->fd);
    fprintf(stderr,
            "RoCE v2 packets: %ld from ADDR0 (%ld not TOS %u), %ld from ADDR1 (%ld not TOS %u)"
            " (last wrong TOS %u)\n",
            c->from0, c->bad0, c->want0, c->from1, c->bad1, c->want1, c->seen_bad);
}

/* The address vector of the client's one QP, as the device reports it. */
static void client_qp_av(struct run *r, struct ibv_qp_attr *a)
{
    struct bex__io *io = &r->cctx->io[0];
    struct conn *cn = bex__list_empty(&io->conns) ? NULL : bex__conn_of(io->conns.next);
    CHECK(cn && cn->eng && cn->eng->qp);
    struct ibv_qp_init_attr ia;
    CHECK_OK(ibv_query_qp(cn->eng->qp, a, IBV_QP_AV, &ia));
}

static void tos_run(const bex_ctx_config *sc, const bex_ctx_config *cc, uint8_t want0,
                    uint8_t want1, struct ibv_qp_attr *client_av)
{
    struct cap c;
    cap_start(&c, want0, want1);
    struct run r = {0};
    run_up(&r, sc, cc);
    run_send(&r);
    client_qp_av(&r, client_av);
    run_down(&r);
    cap_stop(&c);
    /* the 512 KiB message alone is hundreds of packets one way, as many
     * ACKs the other */
    CHECK(c.from0 >= 10);
    CHECK(c.from1 >= 100);
    CHECK_EQ(c.bad0, 0);
    CHECK_EQ(c.bad1, 0);
}

static int qos_tos(void)
{
    PAIR_NEED(setup_addrs());
    bex_ctx_config cc = {.traffic_class = 46 << 2, .service_level = 5, .flow_label = 0x12345};
    struct ibv_qp_attr av;
    tos_run(NULL, &cc, 104, 46 << 2, &av);
    CHECK_EQ(av.ah_attr.grh.traffic_class, 46 << 2);
    CHECK_EQ(av.ah_attr.grh.flow_label, 0x12345);
    /* rxe keeps no SL (its address vector has none): shown, not checked */
    fprintf(stderr, "client QP: traffic_class %u flow_label %#x sl %u\n",
            av.ah_attr.grh.traffic_class, av.ah_attr.grh.flow_label, av.ah_attr.sl);
    return 0;
}

static int qos_zero(void)
{
    PAIR_NEED(setup_addrs());
    bex_ctx_config c = {.traffic_class = BEX_TRAFFIC_CLASS(0)};
    struct ibv_qp_attr av;
    tos_run(&c, &c, 0, 0, &av);
    CHECK_EQ(av.ah_attr.grh.traffic_class, 0);
    return 0;
}

/* ---- thread domains ---- */

struct logs {
    pthread_mutex_t mu;
    long errors, naming, fallback;
};

static void log_rec(int level, const char *msg, void *arg)
{
    struct logs *lg = arg;
    if (level <= BEX_LOG_WARN || strstr(msg, "thread domains"))
        fprintf(stderr, "log %d: %s\n", level, msg);
    pthread_mutex_lock(&lg->mu);
    if (level == BEX_LOG_ERROR) {
        lg->errors++;
        lg->naming += strstr(msg, "thread_domains") != NULL;
    }
    lg->fallback += strstr(msg, "no thread domains") != NULL;
    pthread_mutex_unlock(&lg->mu);
}

/* A context with thread_domains = td and two I/O threads carries
 * traffic; stats say no thread uses a thread domain (rxe has none). AUTO
 * tried and fell back (its INFO line, once per process: each case is a
 * process of its own), OFF never tried. */
static void td_works(uint32_t td)
{
    struct logs lg = {.mu = PTHREAD_MUTEX_INITIALIZER};
    /* generous deadlines: a starved VM (ctest -j4 beside a busy loop) took
     * more than the 3 s default to connect; nothing here waits them out */
    bex_ctx_config c = {.thread_domains = td,
                        .io_threads = 2,
                        .connect_timeout_ms = 20000,
                        .keepalive_timeout_ms = 20000,
                        .log_fn = log_rec,
                        .log_arg = &lg,
                        .log_level = BEX_LOG_INFO};
    struct run r = {0};
    run_up(&r, &c, &c);
    run_send(&r);
    bex_sock_stats st;
    bex_ctx_stats(r.sctx, &st);
    CHECK_EQ(st.thread_domains, 0);
    bex_ctx_stats(r.cctx, &st);
    CHECK_EQ(st.thread_domains, 0);
    CHECK_EQ(st.tcp_conns, 0);
    run_down(&r);
    CHECK_EQ(lg.fallback, td == BEX_SWITCH_OFF ? 0 : 1);
    CHECK_EQ(lg.errors, 0);
}

static int td_auto(void)
{
    PAIR_NEED(setup_addrs());
    td_works(BEX_SWITCH_AUTO);
    return 0;
}

static int td_off(void)
{
    PAIR_NEED(setup_addrs());
    td_works(BEX_SWITCH_OFF);
    return 0;
}

static int td_on(void)
{
    PAIR_NEED(setup_addrs());
    struct logs lg = {.mu = PTHREAD_MUTEX_INITIALIZER};
    bex_ctx_config c = {.thread_domains = BEX_SWITCH_ON, .log_fn = log_rec, .log_arg = &lg};
    bex_ctx_config sc = scaled(&c, addr0);
    bex_ctx *ctx = NULL;
    CHECK_EQ(bex_ctx_create(&sc, &ctx), -EOPNOTSUPP);
    CHECK(ctx == NULL);
    CHECK_EQ(lg.naming, 1);
    /* the device was closed again: a context with AUTO opens it afresh */
    c.thread_domains = BEX_SWITCH_AUTO;
    sc = scaled(&c, addr0);
    CHECK_OK(bex_ctx_create(&sc, &ctx));
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

/* ---- thread domains against a stand-in device that has them ---- */

#define FAKE_TDS 16

struct fake_td {
    pthread_mutex_t mu;
    bool parent_fails;
    struct ibv_td tds[FAKE_TDS];
    int n_td, n_parent, parent_bad, pd_freed, td_freed, order_bad, free_bad;
    bool pd_gone[FAKE_TDS], td_gone[FAKE_TDS];
    struct ibv_pd *pds[FAKE_TDS];
    struct ibv_td *parent_td[FAKE_TDS];
};

static struct ibv_td *fake_alloc_td(void *arg, struct ibv_context *ctx)
{
    struct fake_td *f = arg;
    pthread_mutex_lock(&f->mu);
    struct ibv_td *t = f->n_td < FAKE_TDS ? &f->tds[f->n_td++] : NULL;
    if (t)
        t->context = ctx;
    pthread_mutex_unlock(&f->mu);
    if (!t)
        errno = ENOMEM;
    return t;
}

/* The parent domain is the device's PD itself (see td_fake). */
static struct ibv_pd *fake_alloc_parent(void *arg, struct ibv_context *ctx, struct ibv_pd *pd,
                                        struct ibv_td *td)
{
    struct fake_td *f = arg;
    pthread_mutex_lock(&f->mu);
    int i = f->n_parent;
    bool ok = !f->parent_fails && i < FAKE_TDS;
    if (ok) {
        f->parent_bad += !pd || pd->context != ctx || !td || td->context != ctx;
        f->pds[i] = pd;
        f->parent_td[i] = td;
        f->n_parent++;
    }
    pthread_mutex_unlock(&f->mu);
    if (!ok)
        errno = ENOMEM;
    return ok ? pd : NULL;
}

/* Parent domains all share the device's PD: the one not yet freed whose
 * pointer matches. */
static int fake_dealloc_pd(void *arg, struct ibv_pd *parent)
{
    struct fake_td *f = arg;
    pthread_mutex_lock(&f->mu);
    int i = 0;
    while (i < f->n_parent && (f->pds[i] != parent || f->pd_gone[i]))
        i++;
    if (i == f->n_parent)
        f->free_bad++;
    else
        f->pd_gone[i] = true;
    f->pd_freed++;
    pthread_mutex_unlock(&f->mu);
    return 0;
}

static int fake_dealloc_td(void *arg, struct ibv_td *td)
{
    struct fake_td *f = arg;
    pthread_mutex_lock(&f->mu);
    long i = td - f->tds;
    if (i < 0 || i >= f->n_td || f->td_gone[i]) {
        f->free_bad++;
    } else {
        f->td_gone[i] = true;
        /* its parent domain, if it had one, must be gone already */
        for (int k = 0; k < f->n_parent; k++)
            f->order_bad += f->parent_td[k] == td && !f->pd_gone[k];
    }
    f->td_freed++;
    pthread_mutex_unlock(&f->mu);
    return 0;
}

static void fake_td_on(struct fake_td *f, struct bex__fault_td_ops *ops)
{
    *ops = (struct bex__fault_td_ops){.alloc_td = fake_alloc_td,
                                      .alloc_parent = fake_alloc_parent,
                                      .dealloc_pd = fake_dealloc_pd,
                                      .dealloc_td = fake_dealloc_td,
                                      .arg = f};
    bex__fault_td_set(ops);
}

static int td_fake(void)
{
    PAIR_NEED(setup_addrs());
    struct fake_td f = {.mu = PTHREAD_MUTEX_INITIALIZER};
    struct bex__fault_td_ops ops;
    fake_td_on(&f, &ops);
    struct logs lg = {.mu = PTHREAD_MUTEX_INITIALIZER};
    /* generous deadlines: a starved VM (ctest -j4 beside a busy loop) took
     * more than the 3 s default to connect; nothing here waits them out */
    bex_ctx_config c = {.thread_domains = BEX_SWITCH_ON,
                        .io_threads = 2,
                        .connect_timeout_ms = 20000,
                        .keepalive_timeout_ms = 20000,
                        .log_fn = log_rec,
                        .log_arg = &lg,
                        .log_level = BEX_LOG_INFO};
    struct run r = {0};
    run_up(&r, &c, &c);
    run_send(&r);
    bex_sock_stats st;
    bex_ctx_stats(r.sctx, &st);
    CHECK_EQ(st.thread_domains, 2);
    bex_ctx_stats(r.cctx, &st);
    CHECK_EQ(st.thread_domains, 2);
    CHECK_EQ(f.n_td, 4); /* two I/O threads a context, two contexts */
    CHECK_EQ(f.n_parent, 4);
    CHECK_EQ(f.parent_bad, 0);
    for (int i = 0; i < 4; i++)
        CHECK(f.parent_td[i] >= f.tds && f.parent_td[i] < f.tds + f.n_td);
    run_down(&r);
    bex__fault_td_set(NULL);
    CHECK_EQ(f.pd_freed, 4);
    CHECK_EQ(f.td_freed, 4);
    CHECK_EQ(f.free_bad, 0);
    CHECK_EQ(f.order_bad, 0);
    CHECK_EQ(lg.fallback, 0);
    CHECK_EQ(lg.errors, 0);
    return 0;
}

static int td_fake_fail(void)
{
    PAIR_NEED(setup_addrs());
    struct fake_td f = {.mu = PTHREAD_MUTEX_INITIALIZER, .parent_fails = true};
    struct bex__fault_td_ops ops;
    fake_td_on(&f, &ops);
    struct logs lg = {.mu = PTHREAD_MUTEX_INITIALIZER};
    bex_ctx_config c = {.thread_domains = BEX_SWITCH_ON,
                        .log_fn = log_rec,
                        .log_arg = &lg,
                        .log_level = BEX_LOG_INFO};
    bex_ctx_config sc = scaled(&c, addr0);
    bex_ctx *ctx = NULL;
    CHECK_EQ(bex_ctx_create(&sc, &ctx), -ENOMEM);
    CHECK(ctx == NULL);
    CHECK_EQ(lg.naming, 1);
    CHECK_EQ(f.n_td, 1);
    CHECK_EQ(f.td_freed, 1);
    c.thread_domains = BEX_SWITCH_AUTO;
    sc = scaled(&c, addr0);
    CHECK_OK(bex_ctx_create(&sc, &ctx));
    bex_sock_stats st;
    bex_ctx_stats(ctx, &st);
    CHECK_EQ(st.thread_domains, 0);
    CHECK_OK(bex_ctx_destroy(ctx));
    bex__fault_td_set(NULL);
    CHECK_EQ(f.td_freed, f.n_td);
    CHECK_EQ(f.free_bad, 0);
    CHECK_EQ(f.pd_freed, 0);
    CHECK_EQ(lg.fallback, 1);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(relaxed_default), BEX_CASE(relaxed_off), BEX_CASE(qos_tos),
              BEX_CASE(qos_zero), BEX_CASE(td_auto), BEX_CASE(td_on), BEX_CASE(td_off),
              BEX_CASE(td_fake), BEX_CASE(td_fake_fail))
