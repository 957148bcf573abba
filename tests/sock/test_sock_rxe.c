/* SPDX-License-Identifier: Apache-2.0 */
/* Socket and engine tests on real RDMA devices (rxe0 <-> rxe1, two
 * processes). See pair.h for the scaffolding. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "nomem.h"
#include "port.h"
#include "echo.h"
#include "rdma/rdma.h"

/* ---------------- an echo server ---------------- */

struct echo_srv {
    _Atomic long recvd, bytes;
    long expect; /* >0: exit only after this many messages (no echo) */
    unsigned delay_us;
    bool no_echo;
};

static void echo_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct echo_srv *e = user;
    atomic_fetch_add(&e->recvd, 1);
    atomic_fetch_add(&e->bytes, (long)len);
    if (e->delay_us)
        usleep(e->delay_us);
    if (e->no_echo || bex_sock_send(s, buf, len, NULL) != 0)
        bex_mem_free(buf);
}

static const bex_sock_ops echo_ops = {
    .on_recv = echo_recv, .on_send_done = echo_srv_done, .on_error = echo_srv_error};

static void echo_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    bex_sock_set_user(s, &echo_ops, user);
}

static int echo_server(struct pair *p, void *arg)
{
    static struct echo_srv plain;
    struct echo_srv *e = arg ? arg : &plain;
    bex_listener_ops lops = {.on_accept = echo_accept};
    pair_listen(p, &lops, e);
    if (e->expect) {
        uint64_t end = pair_now_ms() + 120000ull * time_scale();
        while (atomic_load(&e->recvd) < e->expect && pair_now_ms() < end)
            pair_sleep_ms(5);
        if (atomic_load(&e->recvd) != e->expect) {
            fprintf(stderr, "server: got %ld of %ld messages\n", atomic_load(&e->recvd), e->expect);
            return 1;
        }
    }
    pair_wait_parent(p);
    return 0;
}

/* ---------------- a client that checks echoes ---------------- */

#define MAXS   64
#define MAXSEQ 1024
#define NO_LEN UINT32_MAX

struct cli {
    struct waiter w;
    _Atomic long connected, recvd, done, send_err, errors, closed;
    int conn_status, err;
    int bad;
    _Atomic int first_send_err; /* status of the first send that failed */
    _Atomic long first_err_seq; /* its sequence number (-1: none, or < 8 bytes) */
    /* per socket: next expected sequence number */
    uint32_t next_seq[MAXS];
    bex_sock *socks[MAXS];
    /* per socket and sequence number: the length sent (NO_LEN: none) */
    uint32_t sent_len[MAXS][MAXSEQ];
    /* socket 0's sequence numbers reported delivered (status 0) */
    _Atomic bool ok0[MAXSEQ];
    _Atomic long send_err_other; /* failed sends neither -EIO nor -ECANCELED */
    _Atomic long einval;         /* on_error calls with -EINVAL (rxe_refused) */
};

/* message layout: [0..3] socket index, [4..7] seq, rest pattern(seed) */
static uint32_t seed_of(uint32_t si, uint32_t seq)
{
    return si * 100003u + seq;
}

static void *make_msg(bex_ctx *ctx, uint32_t si, uint32_t seq, size_t len)
{
    uint8_t *b = bex_sock_alloc(ctx, len ? len : 1);
    CHECK(b);
    if (len >= 8) {
        memcpy(b, &si, 4);
        memcpy(b + 4, &seq, 4);
        fill_pattern(b + 8, len - 8, seed_of(si, seq));
    } else {
        fill_pattern(b, len, seed_of(si, seq));
    }
    return b;
}

/* A message of socket si with sequence number seq, whose length the echo
 * check will expect. */
static void *cli_msg(struct pair *p, struct cli *c, uint32_t si, uint32_t seq, size_t len)
{
    CHECK(si < MAXS && seq < MAXSEQ && len < NO_LEN);
    c->sent_len[si][seq] = (uint32_t)len;
    return make_msg(p->ctx, si, seq, len);
}

static int sock_index(struct cli *c, bex_sock *s)
{
    for (int i = 0; i < MAXS; i++)
        if (c->socks[i] == s)
            return i;
    return -1;
}

/* An echo must be the next message of its socket, with the length sent and
 * every byte intact; messages under 8 bytes carry no header but are checked
 * all the same (pattern of the expected sequence number). */
static void cli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct cli *c = user;
    int si = sock_index(c, s);
    uint32_t seq = si >= 0 ? c->next_seq[si] : 0;
    uint32_t want = si >= 0 && seq < MAXSEQ ? c->sent_len[si][seq] : NO_LEN;
    uint32_t hsi = (uint32_t)si, hseq = seq;
    if (len >= 8) {
        memcpy(&hsi, buf, 4);
        memcpy(&hseq, (uint8_t *)buf + 4, 4);
    }
    const uint8_t *body = len >= 8 ? (uint8_t *)buf + 8 : buf;
    size_t blen = len >= 8 ? len - 8 : len;
    if (si < 0 || want == NO_LEN || len != want || hsi != (uint32_t)si || hseq != seq ||
        check_pattern(body, blen, seed_of((uint32_t)si, seq))) {
        fprintf(stderr,
                "bad echo on socket %d: len %zu (sent %lld), header socket %u seq %u, expected "
                "seq %u\n",
                si, len, want == NO_LEN ? -1LL : (long long)want, hsi, hseq, seq);
        c->bad++;
    } else {
        c->next_seq[si]++;
    }
    bex_mem_free(buf);
    atomic_fetch_add(&c->recvd, 1);
    waiter_signal(&c->w);
}

static void cli_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    struct cli *c = user;
    (void)mu;
    if (!status && len >= 8 && sock_index(c, s) == 0) {
        uint32_t seq;
        memcpy(&seq, (uint8_t *)buf + 4, 4);
        if (seq < MAXSEQ)
            atomic_store(&c->ok0[seq], true);
    }
    if (status) {
        int none = 0;
        if (atomic_compare_exchange_strong(&c->first_send_err, &none, status) && len >= 8) {
            uint32_t seq;
            memcpy(&seq, (uint8_t *)buf + 4, 4);
            atomic_store(&c->first_err_seq, (long)seq);
        }
        atomic_fetch_add(&c->send_err, 1);
        if (status != -EIO && status != -ECANCELED)
            atomic_fetch_add(&c->send_err_other, 1);
    }
    bex_mem_free(buf);
    atomic_fetch_add(&c->done, 1);
    waiter_signal(&c->w);
}

static void cli_connect(bex_sock *s, int status, void *user)
{
    struct cli *c = user;
    (void)s;
    if (status)
        c->conn_status = status;
    atomic_fetch_add(&c->connected, 1);
    waiter_signal(&c->w);
}

static void cli_error(bex_sock *s, int err, void *user)
{
    struct cli *c = user;
    (void)s;
    c->err = err;
    if (err == -EINVAL)
        atomic_fetch_add(&c->einval, 1);
    atomic_fetch_add(&c->errors, 1);
    waiter_signal(&c->w);
}

static void cli_close(bex_sock *s, void *user)
{
    struct cli *c = user;
    (void)s;
    waiter_add(&c->w, &c->closed, 1);
}

static const bex_sock_ops cli_ops = {.on_connect = cli_connect,
                                     .on_recv = cli_recv,
                                     .on_send_done = cli_done,
                                     .on_error = cli_error,
                                     .on_close = cli_close};

/* Wait for a counter of c; on timeout say what the client saw. */
static void cli_wait(struct cli *c, _Atomic long *what, long want, unsigned ms, int line)
{
    if (wait_count(&c->w, what, want, ms) == 0)
        return;
    fprintf(stderr,
            "line %d: timed out waiting (%ld of %ld); recvd %ld done %ld send_err %ld "
            "errors %ld (last %s)\n",
            line, atomic_load(what), want, atomic_load(&c->recvd), atomic_load(&c->done),
            atomic_load(&c->send_err), atomic_load(&c->errors), bex_strerror(c->err));
    exit(1);
}
#define CLI_WAIT(c, field, want, ms) cli_wait((c), &(c)->field, (want), (ms), __LINE__)

static struct cli *cli_new(void)
{
    struct cli *c = calloc(1, sizeof(*c));
    CHECK(c);
    pthread_mutex_init(&c->w.mu, NULL);
    pthread_cond_init(&c->w.cv, NULL);
    atomic_init(&c->first_err_seq, -1);
    memset(c->sent_len, 0xff, sizeof c->sent_len); /* NO_LEN */
    return c;
}

static void cli_connect_n(struct pair *p, struct cli *c, int n)
{
    for (int i = 0; i < n; i++)
        CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &cli_ops, c, &c->socks[i]));
    CLI_WAIT(c, connected, n, 20000);
    CHECK_EQ(c->conn_status, 0);
}

static void cli_close_all(struct cli *c, int n)
{
    long before = atomic_load(&c->closed);
    for (int i = 0; i < n; i++)
        bex_sock_close(c->socks[i]);
    CLI_WAIT(c, closed, before + n, 20000);
}

/* Wait for n echoes in all, or until a socket fails (its engine's
 * failure ends every echo still to come: nothing to wait for), or ms
 * (scaled) pass: whether they came. */
static bool cli_wait_echoes(struct cli *c, long n, unsigned ms)
{
    uint64_t end = pair_now_ms() + (uint64_t)ms * time_scale();
    while (atomic_load(&c->recvd) < n && !atomic_load(&c->errors) && pair_now_ms() < end)
        wait_count(&c->w, &c->recvd, n, 50);
    return atomic_load(&c->recvd) >= n;
}

/* Under load rxe (kernel 6.1) refuses a retransmitted multi-packet WRITE
 * now and then ("remote invalid request", IBV_WC_REM_INV_REQ_ERR;
 * perftest's own ib_write_bw fails the same way in the VM,
 * docs/testing.md). A case that streams rendezvous fragments both ways
 * meets it in any round, and the client cannot always name it: -EINVAL
 * when the server's rxe refused a WRITE of the client's, else its QP's
 * flush or the peer's reset once the server's engine failed (seen in the
 * VM under ASan: -EINVAL, -ECANCELED, -ECONNRESET). What it needs is a
 * retransmission: a round whose engine failed while rxe retransmitted
 * (its counters of retries and duplicate or out-of-sequence requests grew,
 * both devices) says nothing of bex. Its client returns RXE_FAULT and the
 * case runs it again, RXE_FAULTS_MAX times at most (each said in the log),
 * so that a fault every round still fails it (test_teardown_rxe.c's
 * kill_rounds does the same); a failure with no retransmission fails at
 * once, as before. */
#define RXE_FAULT      3
#define RXE_FAULTS_MAX 3

/* rxe's retransmissions so far, both devices (-1 without them). */
static long long rxe_retries(void)
{
    long long a = rxe_counter("completer_retry_err"), b = rxe_counter("duplicate_request");
    long long c = rxe_counter("out_of_seq_request");
    return a < 0 || b < 0 || c < 0 ? -1 : a + b + c;
}

/* Whether a round that began with rxe_retries() at r0 ended by a socket's
 * failure while rxe retransmitted (said in the log). */
static bool rxe_refused(struct cli *c, long long r0)
{
    if (pair_tcp() || !atomic_load(&c->errors))
        return false;
    long long r = rxe_retries();
    fprintf(stderr,
            "a socket failed (%ld with -EINVAL); rxe retransmitted %lld times in the round\n",
            atomic_load(&c->einval), r - r0);
    return r0 >= 0 && r > r0;
}

/* bex_sock_send of message m: true when taken. False when the socket had
 * failed (-EPIPE) in a round that rxe's fault ended (m freed); any other
 * failure fails the case. */
static bool cli_send(struct cli *c, bex_sock *s, void *m, size_t len, long long r0)
{
    int rc = bex_sock_send(s, m, len, NULL);
    if (rc == 0)
        return true;
    bex_mem_free(m);
    if (rc == -EPIPE) { /* its on_error may be on its way */
        wait_count(&c->w, &c->errors, 1, 5000);
        if (rxe_refused(c, r0))
            return false;
    }
    fprintf(stderr, "bex_sock_send: %s\n", bex_strerror(rc));
    exit(1);
}

/* pair_run, again for a round that rxe's fault ended (RXE_FAULTS_MAX). */
static int pair_run_rxe(const bex_ctx_config *scfg, pair_fn server_fn, void *sarg,
                        const bex_ctx_config *ccfg, pair_fn client_fn, void *carg,
                        unsigned timeout_s)
{
    int rc, faults = 0;
    while ((rc = pair_run(scfg, server_fn, sarg, ccfg, client_fn, carg, timeout_s)) == RXE_FAULT &&
           ++faults <= RXE_FAULTS_MAX)
        fprintf(stderr,
                "the round hit rxe's refusal of a retransmitted WRITE (remote invalid "
                "request, docs/testing.md): not bex's, it runs again (%d)\n",
                faults);
    return rc == RXE_FAULT ? 1 : rc;
}

/* ---------------- cases ---------------- */

static int sizes_client(struct pair *p, void *arg)
{
    (void)arg;
    const size_t K = 1024, M = 1024 * 1024;
    /* around eager_max (8 KiB), the fragment (64 KiB), the chunk (4 MiB),
     * rxe's message limit (8 MiB) and up to 64 MiB */
    size_t sizes[] = {0,         1,         7,          8,         100,        8 * K - 1,
                      8 * K,     8 * K + 1, 64 * K - 1, 64 * K,    64 * K + 1, 1 * M,
                      4 * M - 1, 4 * M,     4 * M + 1,  8 * M + 1, 64 * M};
    struct cli *c = cli_new();
    long long r0 = rxe_retries();
    cli_connect_n(p, c, 1);
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        void *b = cli_msg(p, c, 0, (uint32_t)i, sizes[i]);
        if (!cli_send(c, c->socks[0], b, sizes[i], r0) ||
            (!cli_wait_echoes(c, (long)i + 1, 60000) && rxe_refused(c, r0))) {
            cli_close_all(c, 1);
            free(c);
            return RXE_FAULT;
        }
        CLI_WAIT(c, recvd, (long)i + 1, 0); /* (or say what the client saw) */
        CHECK_EQ(c->bad, 0);
    }
    CHECK_EQ(c->next_seq[0], sizeof sizes / sizeof sizes[0]);
    CLI_WAIT(c, done, sizeof sizes / sizeof sizes[0], 10000);
    CHECK_EQ(atomic_load(&c->send_err), 0);
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int sizes(void)
{
    /* 64 MiB buffers are allocated, registered and checked on the I/O
     * threads of an emulated VM: give keepalive room for such stalls */
    bex_ctx_config cfg = {.keepalive_timeout_ms = 30000};
    return pair_run_rxe(&cfg, echo_server, NULL, &cfg, sizes_client, NULL, 120);
}

/* 16 sockets to one address share one engine; interleaved traffic keeps
 * per-socket order. */
/* Credits for every message in flight at once, both ways (multiplex: at
 * most 16 OPENs + 384 messages + 192 rendezvous requests one way, 576
 * echo work requests + 192 answers the other): a send that waits for a
 * credit there waits for one that did not come back in time, so the cases
 * that use it assert no credit stall (no slow success hides a lost one).
 * Connections may take as long as cli_connect_n waits for them (20 s,
 * scaled): at bex's 3 s default, multiplex's failed -ETIMEDOUT in the VM
 * beside demo_cluster.rxe.fault (ninth session, 1 of 2 runs). */
static const bex_ctx_config roomy = {.rq_depth = 1024, .connect_timeout_ms = 20000};

/* No credit or window stall (see roomy), over RDMA; over TCP the counters
 * stay 0 (no credits) and the check holds trivially. */
static void check_no_stalls(const bex_sock_stats *st)
{
    CHECK_EQ(st->credit_stalls, 0);
    CHECK_EQ(st->window_stalls, 0);
}

static int multiplex_client(struct pair *p, void *arg)
{
    (void)arg;
    enum { NS = 16, PER = 24 };
    const size_t lens[] = {100, 5000, 20000, 300000};
    struct cli *c = cli_new();
    long long r0 = rxe_retries();
    cli_connect_n(p, c, NS);
    bex_sock_stats st;
    bex_ctx_stats(p->ctx, &st);
    CHECK_EQ(st.engines, 1);
    bool fault = false;
    for (uint32_t seq = 0; seq < PER && !fault; seq++)
        for (uint32_t si = 0; si < NS && !fault; si++) {
            size_t len = lens[(seq + si) % 4];
            fault = !cli_send(c, c->socks[si], cli_msg(p, c, si, seq, len), len, r0);
        }
    if (fault || (!cli_wait_echoes(c, NS * PER, 60000) && rxe_refused(c, r0))) {
        cli_close_all(c, NS);
        free(c);
        return RXE_FAULT;
    }
    CLI_WAIT(c, recvd, NS * PER, 0); /* (or say what the client saw) */
    CHECK_EQ(c->bad, 0);
    for (int si = 0; si < NS; si++)
        CHECK_EQ(c->next_seq[si], PER);
    CLI_WAIT(c, done, NS * PER, 10000);
    CHECK_EQ(atomic_load(&c->send_err), 0);
    pair_quiet_stats(p->ctx, &st);
    CHECK_EQ(st.engines, 1);
    fprintf(stderr,
            "%llu SENDs + %llu WRITEs in %llu ibv_post_send calls, %llu signaled; "
            "credit stalls %llu, credit messages %llu\n",
            (unsigned long long)st.sends_posted, (unsigned long long)st.writes_posted,
            (unsigned long long)st.post_send_calls, (unsigned long long)st.signaled,
            (unsigned long long)st.credit_stalls, (unsigned long long)st.credit_msgs);
    check_no_stalls(&st);
    /* doorbell batching: fewer ibv_post_send calls than work requests;
     * selective signaling: at most one signaled request per call (its last,
     * which retires the whole chain and the unsignaled chains before it; a
     * chain of inline SENDs alone may go unsignaled: send.c, chain_quiet),
     * so fewer signaled than posted */
    CHECK(st.post_send_calls < st.sends_posted + st.writes_posted);
    if (!pair_tcp()) { /* over TCP: frames gathered into one sendmsg */
        CHECK(st.signaled >= 1 && st.signaled <= st.post_send_calls);
        CHECK(st.signaled < st.sends_posted + st.writes_posted);
    }
    cli_close_all(c, NS);
    free(c);
    return 0;
}

static int multiplex(void)
{
    return pair_run_rxe(&roomy, echo_server, NULL, &roomy, multiplex_client, NULL, 120);
}

/* A receiver with 4 receives that handles each message slowly: the sender
 * is paced by credits and no RNR ever happens. */
#define SLOW_N 400
static int slow_client(struct pair *p, void *arg)
{
    (void)arg;
    long long rnr0 = rxe_counter("rcvd_rnr_err"), rnr1 = rxe_counter("send_rnr_err");
    CHECK(pair_tcp() || (rnr0 >= 0 && rnr1 >= 0));
    struct cli *c = cli_new();
    cli_connect_n(p, c, 1);
    for (uint32_t i = 0; i < SLOW_N; i++)
        CHECK_OK(bex_sock_send(c->socks[0], make_msg(p->ctx, 0, i, 1024), 1024, NULL));
    CLI_WAIT(c, done, SLOW_N, 60000);
    CHECK_EQ(atomic_load(&c->send_err), 0);
    bex_sock_stats st;
    bex_ctx_stats(p->ctx, &st);
    fprintf(stderr, "credit stalls %llu, rnr %lld/%lld -> %lld/%lld\n",
            (unsigned long long)st.credit_stalls, rnr0, rnr1, rxe_counter("rcvd_rnr_err"),
            rxe_counter("send_rnr_err"));
    if (!pair_tcp()) { /* over TCP the kernel's flow control paces the sender */
        CHECK(st.credit_stalls > 0);
        CHECK_EQ(rxe_counter("rcvd_rnr_err"), rnr0);
        CHECK_EQ(rxe_counter("send_rnr_err"), rnr1);
    }
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int slow_receiver(void)
{
    bex_ctx_config scfg = {.rq_depth = 4};
    struct echo_srv e = {.expect = SLOW_N, .delay_us = 2000, .no_echo = true};
    return pair_run(&scfg, echo_server, &e, NULL, slow_client, NULL, 120);
}

/* The send window bounds the bytes in flight of an engine. */
static int window_client(struct pair *p, void *arg)
{
    (void)arg;
    enum { NS = 4, PER = 6 };
    struct cli *c = cli_new();
    cli_connect_n(p, c, NS);
    for (uint32_t seq = 0; seq < PER; seq++)
        for (uint32_t si = 0; si < NS; si++)
            CHECK_OK(
                bex_sock_send(c->socks[si], cli_msg(p, c, si, seq, 256 * 1024), 256 * 1024, NULL));
    CLI_WAIT(c, recvd, NS * PER, 60000);
    CHECK_EQ(c->bad, 0);
    bex_sock_stats st;
    bex_ctx_stats(p->ctx, &st);
    fprintf(stderr, "max in flight %llu bytes, window stalls %llu\n",
            (unsigned long long)st.max_inflight_bytes, (unsigned long long)st.window_stalls);
    *(uint64_t *)arg = st.max_inflight_bytes;
    cli_close_all(c, NS);
    free(c);
    return 0;
}

static int send_window(void)
{
    uint64_t with = 0, without = 0;
    bex_ctx_config on = {.send_window = 16384, .frag_size = 4096};
    bex_ctx_config off = {.frag_size = 4096};
    int rc = pair_run(NULL, echo_server, NULL, &on, window_client, &with, 120);
    if (rc)
        return rc;
    rc = pair_run(NULL, echo_server, NULL, &off, window_client, &without, 120);
    if (rc)
        return rc;
    CHECK(with > 0);
    CHECK(with <= 16384);
    CHECK(without > 16384); /* the bound is the window's doing */
    return 0;
}

/* An echo server whose count of received messages the client reads after
 * killing it: shared memory, mapped before the fork. */
static struct echo_srv *shared_srv(void)
{
    void *m = mmap(NULL, sizeof(struct echo_srv), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED);
    return m;
}

/* Socket 0's sends reported delivered (0) that the peer's application never
 * received. One socket's messages arrive in order, so the peer received
 * exactly sequences 0 .. recvd-1. */
static long reported_not_received(struct cli *c, const struct echo_srv *srv, long sent)
{
    long lost = 0, recvd = atomic_load(&srv->recvd);
    for (long i = recvd; i < sent && i < MAXSEQ; i++)
        if (atomic_load(&c->ok0[i])) {
            if (!lost)
                fprintf(stderr, "seq %ld reported delivered, the peer received %ld\n", i, recvd);
            lost++;
        }
    return lost;
}

struct kill_arg {
    int sig;
    struct echo_srv *srv; /* the server's, shared */
};

/* kill -9 of the peer: the error event comes within the keepalive timeout,
 * every message given to bex is handed back, and none that the peer's
 * application did not receive is reported delivered. */
static int kill_client(struct pair *p, void *arg)
{
    struct kill_arg *ka = arg;
    int sig = ka->sig;
    struct cli *c = cli_new();
    cli_connect_n(p, c, 1);
    long sent = 0;
    /* keep 16 messages of 64 KiB in flight for a while */
    while (atomic_load(&c->done) < 200) {
        while (sent - atomic_load(&c->done) < 16) {
            CHECK_OK(
                bex_sock_send(c->socks[0], cli_msg(p, c, 0, (uint32_t)sent, 65536), 65536, NULL));
            sent++;
        }
        pair_sleep_ms(1);
    }
    while (sent - atomic_load(&c->done) < 16) {
        CHECK_OK(bex_sock_send(c->socks[0], cli_msg(p, c, 0, (uint32_t)sent, 65536), 65536, NULL));
        sent++;
    }
    if (sig == SIGKILL) {
        /* stopped first, for sure, and one more message handed to bex
         * while it is: the peer's application never takes it, so it must
         * come back with an error. The kill alone left that to timing:
         * the peer may take and acknowledge all those in flight before the
         * kill lands, and this thread see the error before sending again
         * (all 216 of io2.tcp's sends came back 0 once, under load) */
        CHECK_OK(kill(p->child, SIGSTOP));
        int wst = 0;
        CHECK_EQ(waitpid(p->child, &wst, WUNTRACED), p->child);
        CHECK(WIFSTOPPED(wst));
        CHECK_OK(bex_sock_send(c->socks[0], cli_msg(p, c, 0, (uint32_t)sent, 65536), 65536, NULL));
        sent++;
    }
    uint64_t t0 = pair_now_ms();
    kill(p->child, sig);
    /* keep 16 in flight until the error: over TCP, messages the frozen or
     * dead peer never acknowledges must come back in doubt */
    while (!atomic_load(&c->errors) && pair_now_ms() - t0 < 5000ull * time_scale()) {
        /* the record of sequences is MAXSEQ long: past it, wait (CI's
         * TSan tier once ran out of it here; the error must still come
         * within the bound below) */
        if (sent - atomic_load(&c->done) < 16 && sent < MAXSEQ - 1) {
            void *m = cli_msg(p, c, 0, (uint32_t)sent, 65536);
            int rc = bex_sock_send(c->socks[0], m, 65536, NULL);
            if (rc == -EPIPE) { /* failed meanwhile: that buffer is ours again */
                bex_mem_free(m);
                break;
            }
            CHECK_OK(rc);
            sent++;
        }
        pair_sleep_ms(1);
    }
    /* keepalive timeout 1500 ms: allow scheduling slack in the VM */
    CLI_WAIT(c, errors, 1, 5000);
    uint64_t dt = pair_now_ms() - t0;
    fprintf(stderr, "error %d (%s) after %llu ms; %ld sent, %ld done, %ld failed\n", c->err,
            bex_strerror(c->err), (unsigned long long)dt, sent, atomic_load(&c->done),
            atomic_load(&c->send_err));
    CHECK(dt <= 3500 * time_scale());
    if (sig == SIGSTOP)
        CHECK_EQ(c->err, -ETIMEDOUT); /* only keepalive can tell */
    /* every message handed to bex comes back, some with an error (those
     * still in the hand-off queue right after the error event) */
    CLI_WAIT(c, done, sent, 1000);
    CHECK_EQ(atomic_load(&c->done), sent);
    CHECK(atomic_load(&c->send_err) > 0);
    CHECK_EQ(c->bad, 0); /* the echoes that came back before were intact */
    /* sending on a failed socket is refused at once */
    void *b = bex_sock_alloc(p->ctx, 16);
    CHECK_EQ(bex_sock_send(c->socks[0], b, 16, NULL), -EPIPE);
    bex_mem_free(b);
    cli_close_all(c, 1);
    kill(p->child, SIGKILL);
    waitpid(p->child, NULL, 0);
    p->child = 0;
    fprintf(stderr, "the peer's application received %ld of %ld\n", atomic_load(&ka->srv->recvd),
            sent);
    CHECK_EQ(reported_not_received(c, ka->srv, sent), 0);
    free(c);
    return 0;
}

static int peer_killed(void)
{
    struct kill_arg ka = {.sig = SIGKILL, .srv = shared_srv()};
    bex_ctx_config cfg = {.keepalive_ms = 100, .keepalive_timeout_ms = 1500};
    return pair_run(&cfg, echo_server, ka.srv, &cfg, kill_client, &ka, 60);
}

static int peer_frozen(void)
{
    struct kill_arg ka = {.sig = SIGSTOP, .srv = shared_srv()};
    bex_ctx_config cfg = {.keepalive_ms = 100, .keepalive_timeout_ms = 1500};
    return pair_run(&cfg, echo_server, ka.srv, &cfg, kill_client, &ka, 60);
}

/* The receiving process stops (SIGSTOP) with receives posted: what its
 * NIC or kernel takes meanwhile is not delivered, so no send is reported 0
 * before it resumes; killed instead, every send comes back in doubt (-EIO)
 * or unsent (-ECANCELED). 64 x 1 KiB (SEND) and 4 x 128 KiB (rendezvous). */
static pid_t paused_pid;

/* A CHECK that fails exits: the stopped peer must not outlive us. */
static void kill_paused(void)
{
    if (paused_pid > 0)
        kill(paused_pid, SIGKILL);
}

static int paused_client(struct pair *p, void *arg)
{
    struct echo_srv *srv = arg;
    struct cli *c = cli_new();
    cli_connect_n(p, c, 1);
    /* one round trip first: the connection is up and the peer idle */
    CHECK_OK(bex_sock_send(c->socks[0], cli_msg(p, c, 0, 0, 1024), 1024, NULL));
    CLI_WAIT(c, done, 1, 10000);
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    while (atomic_load(&srv->recvd) < 1 && pair_now_ms() < end)
        pair_sleep_ms(5);
    CHECK_EQ(atomic_load(&srv->recvd), 1);
    CHECK(atomic_load(&c->ok0[0]));
    /* stopped for sure before the first send: a signal lands when the
     * process next enters the kernel */
    paused_pid = p->child;
    atexit(kill_paused);
    CHECK_OK(kill(p->child, SIGSTOP));
    int wst = 0;
    CHECK_EQ(waitpid(p->child, &wst, WUNTRACED), p->child);
    CHECK(WIFSTOPPED(wst));
    long sent = 1;
    for (; sent <= 64; sent++)
        CHECK_OK(bex_sock_send(c->socks[0], cli_msg(p, c, 0, (uint32_t)sent, 1024), 1024, NULL));
    for (; sent <= 68; sent++)
        CHECK_OK(
            bex_sock_send(c->socks[0], cli_msg(p, c, 0, (uint32_t)sent, 131072), 131072, NULL));
    pair_sleep_ms(1500 * time_scale()); /* far longer than a delivery takes */
    long early = 0;
    for (long i = 1; i < sent; i++)
        early += atomic_load(&c->ok0[i]);
    fprintf(stderr, "paused peer: %ld of %ld reported delivered, %ld handed back\n", early,
            sent - 1, atomic_load(&c->done) - 1);
    CHECK_EQ(early, 0);
    CHECK_EQ(atomic_load(&srv->recvd), 1);
    CHECK_OK(kill(p->child, SIGKILL));
    waitpid(p->child, NULL, 0);
    p->child = paused_pid = 0;
    CLI_WAIT(c, done, sent, 20000);
    CHECK_EQ(atomic_load(&c->send_err), sent - 1);
    CHECK_EQ(atomic_load(&c->send_err_other), 0);
    CHECK_EQ(reported_not_received(c, srv, sent), 0);
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int peer_paused(void)
{
    struct echo_srv *srv = shared_srv();
    srv->no_echo = true;
    /* keepalive far beyond the pause: only the kill ends the connection */
    bex_ctx_config cfg = {.keepalive_ms = 100, .keepalive_timeout_ms = 3000};
    return pair_run(&cfg, echo_server, srv, &cfg, paused_client, srv, 60);
}

/* 1 % packet loss on the wire: every message still arrives intact. */
static int loss_client(struct pair *p, void *arg)
{
    (void)arg;
    enum { NS = 4, PER = 15 };
    const size_t lens[] = {1000, 30000, 200000};
    struct cli *c = cli_new();
    cli_connect_n(p, c, NS);
    for (uint32_t seq = 0; seq < PER; seq++)
        for (uint32_t si = 0; si < NS; si++) {
            size_t len = lens[(seq + si) % 3];
            CHECK_OK(bex_sock_send(c->socks[si], cli_msg(p, c, si, seq, len), len, NULL));
        }
    CLI_WAIT(c, recvd, NS * PER, 120000);
    CHECK_EQ(c->bad, 0);
    CHECK_EQ(atomic_load(&c->errors), 0);
    /* every send reported delivered: the acknowledgements survive the loss */
    CLI_WAIT(c, done, NS * PER, 20000);
    CHECK_EQ(atomic_load(&c->send_err), 0);
    bex_sock_stats st;
    bex_ctx_stats(p->ctx, &st);
    fprintf(stderr, "credit stalls %llu, credit messages %llu\n",
            (unsigned long long)st.credit_stalls, (unsigned long long)st.credit_msgs);
    check_no_stalls(&st);
    cli_close_all(c, NS);
    free(c);
    return 0;
}

static int netem(const char *op)
{
    char cmd[256];
    int rc = 0;
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "tc qdisc %s dev veth%d root netem loss 1%% 2>&1", op, i);
        rc |= system(cmd);
    }
    return rc;
}

/* The loss must not outlive this case, however it ends: at exit (a failed
 * CHECK exits too) of this process, not of the forked server; a kill is
 * left to the CTest fixture netem_cleanup (tests/sock/CMakeLists.txt). */
static pid_t netem_owner;

static void netem_off(void)
{
    if (getpid() == netem_owner && netem_owner) {
        netem_owner = 0;
        if (netem("del"))
            fprintf(stderr, "could not remove the netem qdiscs\n");
    }
}

static int packet_loss(void)
{
    struct in_addr a0, a1;
    int rc = pair_addrs(&a0, &a1);
    if (rc)
        return rc;
    long long retries0 = rxe_counter("completer_retry_err") + rxe_counter("duplicate_request");
    netem_owner = getpid();
    CHECK(atexit(netem_off) == 0);
    CHECK(netem("add") == 0);
    /* rxe's retransmission at bex's ACK timeout (67 ms), not the tests'
     * (pair.h's scaled: about 1 s a lost tail packet) */
    bex_ctx_config lossy = roomy;
    lossy.qp_timeout = 14;
    rc = pair_run(&lossy, echo_server, NULL, &lossy, loss_client, NULL, 180);
    netem_off();
    long long retries = rxe_counter("completer_retry_err") + rxe_counter("duplicate_request");
    fprintf(stderr, "retransmission counters: %lld -> %lld\n", retries0, retries);
    CHECK(retries > retries0); /* the loss really happened */
    return rc;
}

/* A direct write into a buffer the peer exposed, without rendezvous. */
#define DIRECT_LEN  100000
#define DIRECT_SEED 77

struct dsrv {
    bex_ctx *ctx;
    void *exposed;
};

static void dsrv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct dsrv *d = user;
    /* the exposed buffer itself comes back, filled */
    int ok = buf == d->exposed && len == DIRECT_LEN && check_pattern(buf, len, DIRECT_SEED) == 0;
    bex_mem_free(buf);
    char *r = bex_sock_alloc(d->ctx, 4);
    memcpy(r, ok ? "GOOD" : "BAD!", 4);
    if (bex_sock_send(s, r, 4, NULL))
        bex_mem_free(r);
}

static const bex_sock_ops dsrv_ops = {
    .on_recv = dsrv_recv, .on_send_done = echo_srv_done, .on_error = echo_srv_error};

static void dsrv_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l;
    struct dsrv *d = user;
    bex_sock_set_user(s, &dsrv_ops, d);
    /* only landing memory may be exposed */
    void *plain = bex_sock_alloc(d->ctx, DIRECT_LEN);
    CHECK(plain);
    bex_remote_buf *rb = bex_sock_alloc(d->ctx, sizeof(*rb));
    CHECK_EQ(bex_sock_expose(s, plain, DIRECT_LEN, NULL, rb), -EINVAL);
    bex_mem_free(plain);
    d->exposed = bex_sock_alloc_exposable(d->ctx, DIRECT_LEN);
    CHECK(d->exposed);
    CHECK_OK(bex_sock_expose(s, d->exposed, DIRECT_LEN, NULL, rb));
    CHECK_OK(bex_sock_send(s, rb, sizeof(*rb), NULL));
}

static int direct_server(struct pair *p, void *arg)
{
    (void)arg;
    struct dsrv d = {.ctx = p->ctx};
    bex_listener_ops lops = {.on_accept = dsrv_accept};
    pair_listen(p, &lops, &d);
    pair_wait_parent(p);
    return 0;
}

struct dcli {
    struct cli c;
    bex_remote_buf rb;
    char reply[4];
};

static void dcli_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct dcli *d = user;
    (void)s;
    if (atomic_load(&d->c.recvd) == 0 && len == sizeof(d->rb))
        memcpy(&d->rb, buf, sizeof(d->rb));
    else if (len == 4)
        memcpy(d->reply, buf, 4);
    else
        d->c.bad++;
    bex_mem_free(buf);
    atomic_fetch_add(&d->c.recvd, 1);
    waiter_signal(&d->c.w);
}

static int direct_client(struct pair *p, void *arg)
{
    (void)arg;
    struct dcli *d = calloc(1, sizeof(*d));
    CHECK(d);
    pthread_mutex_init(&d->c.w.mu, NULL);
    pthread_cond_init(&d->c.w.cv, NULL);
    bex_sock_ops ops = cli_ops;
    ops.on_recv = dcli_recv;
    CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &ops, d, &d->c.socks[0]));
    CHECK(wait_count(&d->c.w, &d->c.recvd, 1, 20000) == 0);
    CHECK_EQ(d->c.bad, 0);
    CHECK_EQ(d->rb.len, DIRECT_LEN);
    uint8_t *b = bex_sock_alloc(p->ctx, DIRECT_LEN);
    fill_pattern(b, DIRECT_LEN, DIRECT_SEED);
    /* a length other than the exposed one is refused */
    CHECK_EQ(bex_sock_send_direct(d->c.socks[0], b, DIRECT_LEN - 1, &d->rb, NULL), -EINVAL);
    bex_sock_stats before, after;
    bex_ctx_stats(p->ctx, &before);
    CHECK_OK(bex_sock_send_direct(d->c.socks[0], b, DIRECT_LEN, &d->rb, NULL));
    CHECK(wait_count(&d->c.w, &d->c.recvd, 2, 20000) == 0);
    CHECK(memcmp(d->reply, "GOOD", 4) == 0);
    CHECK(wait_count(&d->c.w, &d->c.done, 1, 5000) == 0);
    CHECK_EQ(atomic_load(&d->c.send_err), 0);
    bex_ctx_stats(p->ctx, &after);
    /* no rendezvous: the only SENDs are credit returns, never a request */
    CHECK(after.writes_posted - before.writes_posted >= 2);
    bex_sock_close(d->c.socks[0]);
    CHECK(wait_count(&d->c.w, &d->c.closed, 1, 20000) == 0);
    free(d);
    return 0;
}

static int direct_write(void)
{
    bex_ctx_config cfg = {.frag_size = 16384};
    return pair_run(&cfg, direct_server, NULL, &cfg, direct_client, NULL, 60);
}

/* The receiver cannot register a rendezvous buffer (tests/sock/nomem.h):
 * that message comes back to its sender with -ENOMEM, and the socket goes on
 * working. */
static int nomem_client(struct pair *p, void *arg)
{
    (void)arg;
    struct cli *c = cli_new();
    cli_connect_n(p, c, 1);
    const size_t lens[] = {6u << 20, 100, 2u << 20};
    c->next_seq[0] = 1; /* seq 0 never comes back: the echoes of 1, 2 do, in order */
    for (uint32_t i = 0; i < 3; i++)
        CHECK_OK(bex_sock_send(c->socks[0], cli_msg(p, c, 0, i, lens[i]), lens[i], NULL));
    CLI_WAIT(c, recvd, 2, 30000);
    CHECK_EQ(c->bad, 0);
    CLI_WAIT(c, done, 3, 10000);
    CHECK_EQ(atomic_load(&c->send_err), 1);
    CHECK_EQ(atomic_load(&c->first_send_err), -ENOMEM); /* that error, not any */
    CHECK_EQ(atomic_load(&c->first_err_seq), 0);        /* of the 6 MiB message */
    CHECK_EQ(atomic_load(&c->errors), 0);
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int rndv_nomem(void)
{
    pair_server_landing = nomem_landing;
    pair_server_pool_release = nomem_landing_release;
    int rc = pair_run(NULL, echo_server, NULL, NULL, nomem_client, NULL, 60);
    pair_server_landing = NULL;
    pair_server_pool_release = NULL;
    return rc;
}

static int connect_refused_client(struct pair *p, void *arg)
{
    (void)arg;
    struct cli *c = cli_new();
    bex_addr to = p->srv;
    /* a port bound here and never listened on (tests/port.h): refused;
     * port 1 was assumed free, and a program on the host listened there */
    to.in4.sin_port = htons(bex_test_port_at(to.in4.sin_addr));
    CHECK_OK(bex_sock_connect(p->ctx, &to, &cli_ops, c, &c->socks[0]));
    CLI_WAIT(c, connected, 1, 10000);
    CHECK_EQ(c->conn_status, -ECONNREFUSED);
    void *b = bex_sock_alloc(p->ctx, 16);
    CHECK_EQ(bex_sock_send(c->socks[0], b, 16, NULL), -EPIPE);
    bex_mem_free(b);
    cli_close_all(c, 1);
    /* bad arguments are refused at once */
    bex_sock *s;
    bex_addr zero = {.in4 = {.sin_family = AF_INET}};
    CHECK_EQ(bex_sock_connect(p->ctx, &zero, &cli_ops, c, &s), -EINVAL);
    free(c);
    return 0;
}

static int connect_refused(void)
{
    return pair_run(NULL, echo_server, NULL, NULL, connect_refused_client, NULL, 30);
}

/* Window mode binds destinations ahead while the send queue is idle
 * (engine.c, spare_fill): the echoes of one size are answered with those,
 * every byte arrives intact, a new size gets spares of its own, mixed
 * sizes and many outstanding still come through, and nothing is left
 * allocated (the server's teardown checks its pools). The client counts
 * what it received by a destination bound ahead. */
static uint64_t prebound(bex_ctx *ctx)
{
    bex_sock_stats st;
    bex_ctx_stats(ctx, &st);
    return st.rndv_prebound;
}

static int prebound_client(struct pair *p, void *arg)
{
    (void)arg;
    const size_t big = 200 * 1024, small = 100 * 1024, ONE = 24;
    struct cli *c = cli_new();
    cli_connect_n(p, c, 1);
    uint32_t seq = 0;
    /* one at a time: after the first echo a spare waits for each next one */
    for (size_t i = 0; i < ONE; i++, seq++) {
        CHECK_OK(bex_sock_send(c->socks[0], cli_msg(p, c, 0, seq, big), big, NULL));
        CLI_WAIT(c, recvd, (long)seq + 1, 30000);
    }
    uint64_t a = prebound(p->ctx);
    /* another size: the spares of the first go, new ones are bound */
    for (size_t i = 0; i < ONE; i++, seq++) {
        CHECK_OK(bex_sock_send(c->socks[0], cli_msg(p, c, 0, seq, small), small, NULL));
        CLI_WAIT(c, recvd, (long)seq + 1, 30000);
    }
    uint64_t b = prebound(p->ctx);
    /* 16 outstanding, sizes mixed: correctness only */
    uint32_t from = seq;
    for (size_t i = 0; i < 16; i++, seq++) {
        size_t len = i % 3 == 0 ? small : big;
        CHECK_OK(bex_sock_send(c->socks[0], cli_msg(p, c, 0, seq, len), len, NULL));
    }
    CLI_WAIT(c, recvd, (long)seq, 60000);
    CHECK(seq > from);
    CHECK_EQ(c->bad, 0);
    CHECK_EQ(c->next_seq[0], seq);
    CLI_WAIT(c, done, seq, 10000);
    CHECK_EQ(atomic_load(&c->send_err), 0);
    fprintf(stderr, "prebound: %llu of %zu echoes of one size, %llu of %zu of another\n",
            (unsigned long long)a, ONE, (unsigned long long)(b - a), ONE);
    /* all but the first of each size, with room for a spare still being
     * bound when an echo's request arrived (a slow emulated VM) */
    CHECK(a >= ONE / 2);
    CHECK(b - a >= ONE / 2);
    cli_close_all(c, 1);
    free(c);
    return 0;
}

static int window_prebound(void)
{
    bex_ctx_config cfg = {.remote_access = BEX_REMOTE_ACCESS_WINDOW};
    return pair_run(&cfg, echo_server, NULL, &cfg, prebound_client, NULL, 120);
}

BEX_TEST_MAIN(BEX_CASE(sizes), BEX_CASE(multiplex), BEX_CASE(slow_receiver), BEX_CASE(send_window),
              BEX_CASE(peer_killed), BEX_CASE(peer_frozen), BEX_CASE(peer_paused),
              BEX_CASE(packet_loss), BEX_CASE(direct_write), BEX_CASE(rndv_nomem),
              BEX_CASE(connect_refused), BEX_CASE(window_prebound))
