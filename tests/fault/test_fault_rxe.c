/* SPDX-License-Identifier: Apache-2.0 */
/* Fault injection on real RDMA devices (rxe0 <-> rxe1, two processes;
 * tests/sock/pair.h), with the library built with its fault points
 * (src/common/fault.h; this program links bex_fault, not libbex). Each case
 * makes one fault that rxe never produces on demand, in the client
 * process, and checks the teardown that follows: every message and exposed
 * buffer reported exactly once, the error as sock.h says, on_close.
 *
 *   poll_cq_error      ibv_poll_cq fails (and loses the completions it had):
 *                      every engine of the CQ fails with -EIO, nothing hangs
 *   post_send_error    ibv_post_send returns -1 with errno ENOMEM: the socket
 *                      fails with -ENOMEM (it once got +1: -rc of -1)
 *   post_recv_error    ibv_post_recv returns -ENOBUFS: the socket fails with
 *                      -ENOBUFS (it once got +ENOBUFS)
 *   expose_race        the engine fails while bex_sock_expose is between its
 *                      checks and arming the slot: the buffer is refused
 *                      (-EPIPE) or comes back at once, exactly once
 *   expose_race_window the same in window mode (the exposure's window)
 *   repost_in_send     ibv_post_recv fails on the repost whose credits a send
 *                      from on_recv is to carry: nothing is reported inside
 *                      that bex_sock_send (the transport's send_now
 *                      contract), the message comes back once afterwards
 *                      (-ECANCELED), the socket fails with -ENOBUFS
 *
 * Each was shown to fail with its fix reverted (docs/testing.md). */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/fault.h"
#include "sock/echo.h"

/* ---------------- the server: echoes every message ---------------- */

static bex_ctx *g_srv_ctx; /* the server process's context */

static void echo_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)user;
    void *b = bex_sock_alloc(g_srv_ctx, len ? len : 1);
    CHECK(b);
    memcpy(b, buf, len);
    bex_mem_free(buf);
    if (bex_sock_send(s, b, len, NULL))
        bex_mem_free(b); /* the socket is failing: the client's test decides */
}

static const bex_sock_ops echo_ops = {
    .on_recv = echo_recv, .on_send_done = echo_srv_done, .on_error = echo_srv_error};

static void echo_accept(bex_listener *l, bex_sock *s, void *user)
{
    (void)l, (void)user;
    CHECK_OK(bex_sock_set_user(s, &echo_ops, NULL));
}

static int echo_main(struct pair *p, void *arg)
{
    (void)arg;
    g_srv_ctx = p->ctx;
    bex_listener_ops lops = {.on_accept = echo_accept};
    pair_listen(p, &lops, NULL);
    pair_wait_parent(p);
    return 0;
}

/* ---------------- the client: tracks every report ---------------- */

#define MAXMSG 1024
#define NSOCK  2

struct trk {
    struct waiter w;
    bex_sock *socks[NSOCK];
    _Atomic long connected, conn_err, errors, closed, done, n_ok, n_err, recvd, bad;
    _Atomic int err[NSOCK], errors_of[NSOCK];
    _Atomic long next_id;
    _Atomic int reports[MAXMSG], status[MAXMSG];
    /* the exposed buffer (msg_user XUSER) */
    _Atomic long x_reports;
    _Atomic int x_status;
    _Atomic long poll_logs; /* log lines about a failed ibv_poll_cq */
    /* repost_in_send: echoes still to answer from on_recv, the echo that
     * arms the fault, reports (on_send_done, on_error) made inside a
     * bex_sock_send, and the last message a callback's send accepted */
    struct pair *p;
    _Atomic long pongs, arm_at, inside, last_id;
};
#define XUSER ((void *)(uintptr_t)0x7e57)

static struct trk *g_trk; /* for the log hook and the fault hooks */

static int sock_index(struct trk *t, bex_sock *s)
{
    for (int i = 0; i < NSOCK; i++)
        if (t->socks[i] == s)
            return i;
    return 0;
}

static void c_connect(bex_sock *s, int status, void *user)
{
    struct trk *t = user;
    (void)s;
    if (status)
        atomic_fetch_add(&t->conn_err, 1);
    atomic_fetch_add(&t->connected, 1);
    waiter_signal(&t->w);
}

static _Thread_local bool g_in_send; /* inside a callback's bex_sock_send */
static int trk_send(struct pair *p, struct trk *t, int si, size_t len);

static void c_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    struct trk *t = user;
    (void)s, (void)len;
    bex_mem_free(buf);
    long n = atomic_fetch_add(&t->recvd, 1) + 1;
    if (atomic_load(&t->pongs) > 0 && !atomic_load(&t->errors)) {
        atomic_fetch_sub(&t->pongs, 1);
        if (n == atomic_load(&t->arm_at))
            bex__fault_arm(BEX__FAULT_POST_RECV, 1, -ENOBUFS, 0, NULL, NULL);
        long id = atomic_load(&t->next_id);
        g_in_send = true;
        int rc = trk_send(t->p, t, 0, 64);
        g_in_send = false;
        if (rc == 0)
            atomic_store(&t->last_id, id);
    }
    waiter_signal(&t->w);
}

static void c_done(bex_sock *s, void *buf, size_t len, void *mu, int status, void *user)
{
    struct trk *t = user;
    (void)s, (void)len;
    if (g_in_send) {
        fprintf(stderr, "on_send_done inside bex_sock_send\n");
        atomic_fetch_add(&t->inside, 1);
    }
    if (mu == XUSER) {
        /* the exposed buffer comes back: it is ours again */
        atomic_store(&t->x_status, status);
        atomic_fetch_add(&t->x_reports, 1);
        bex_mem_free(buf);
        waiter_signal(&t->w);
        return;
    }
    bex_mem_free(buf);
    long id = (long)(uintptr_t)mu - 1;
    if (id < 0 || id >= MAXMSG) {
        fprintf(stderr, "on_send_done for a message never sent\n");
        atomic_fetch_add(&t->bad, 1);
        return;
    }
    if (atomic_fetch_add(&t->reports[id], 1) != 0) {
        fprintf(stderr, "message %ld reported twice\n", id);
        atomic_fetch_add(&t->bad, 1);
    }
    atomic_store(&t->status[id], status);
    atomic_fetch_add(status ? &t->n_err : &t->n_ok, 1);
    atomic_fetch_add(&t->done, 1);
    waiter_signal(&t->w);
}

static void c_error(bex_sock *s, int err, void *user)
{
    struct trk *t = user;
    if (g_in_send) {
        fprintf(stderr, "on_error inside bex_sock_send\n");
        atomic_fetch_add(&t->inside, 1);
    }
    int si = sock_index(t, s);
    atomic_store(&t->err[si], err);
    atomic_fetch_add(&t->errors_of[si], 1);
    atomic_fetch_add(&t->errors, 1);
    waiter_signal(&t->w);
}

static void c_close(bex_sock *s, void *user)
{
    struct trk *t = user;
    (void)s;
    waiter_add(&t->w, &t->closed, 1);
}

static const bex_sock_ops c_ops = {.on_connect = c_connect,
                                   .on_recv = c_recv,
                                   .on_send_done = c_done,
                                   .on_error = c_error,
                                   .on_close = c_close};

static void c_log(int level, const char *msg, void *arg)
{
    (void)arg;
    if (g_trk && strstr(msg, "ibv_poll_cq")) {
        atomic_fetch_add(&g_trk->poll_logs, 1);
        waiter_signal(&g_trk->w);
    }
    fprintf(stderr, "bex (client, level %d): %s\n", level, msg);
}

static struct trk *trk_new(void)
{
    struct trk *t = calloc(1, sizeof(*t));
    CHECK(t);
    pthread_mutex_init(&t->w.mu, NULL);
    pthread_cond_init(&t->w.cv, NULL);
    g_trk = t;
    return t;
}

static void trk_wait(struct trk *t, _Atomic long *what, long want, unsigned ms, int line)
{
    if (wait_count(&t->w, what, want, ms) == 0)
        return;
    fprintf(stderr,
            "line %d: timed out (%ld of %ld); done %ld ok %ld err %ld errors %ld closed %ld "
            "exposed reports %ld\n",
            line, atomic_load(what), want, atomic_load(&t->done), atomic_load(&t->n_ok),
            atomic_load(&t->n_err), atomic_load(&t->errors), atomic_load(&t->closed),
            atomic_load(&t->x_reports));
    exit(1);
}
#define TRK_WAIT(t, field, want, ms) trk_wait((t), &(t)->field, (want), (ms), __LINE__)

static void trk_connect(struct pair *p, struct trk *t, int n)
{
    for (int i = 0; i < n; i++)
        CHECK_OK(bex_sock_connect(p->ctx, &p->srv, &c_ops, t, &t->socks[i]));
    TRK_WAIT(t, connected, n, 20000);
    CHECK_EQ(atomic_load(&t->conn_err), 0);
}

/* Send len bytes on socket si; returns 0, or -EPIPE (refused at once: not
 * tracked). */
static int trk_send(struct pair *p, struct trk *t, int si, size_t len)
{
    long id = atomic_fetch_add(&t->next_id, 1);
    CHECK(id < MAXMSG);
    uint8_t *b = bex_sock_alloc(p->ctx, len);
    CHECK(b);
    memset(b, (int)(id & 0xff), len);
    int rc = bex_sock_send(t->socks[si], b, len, (void *)(uintptr_t)(id + 1));
    if (rc) {
        CHECK_EQ(rc, -EPIPE);
        bex_mem_free(b);
        atomic_store(&t->reports[id], -1); /* never accepted */
    }
    return rc;
}

/* Every accepted message reported exactly once, and nothing else. */
static void trk_check_once(struct trk *t)
{
    long n = atomic_load(&t->next_id), accepted = 0;
    for (long id = 0; id < n; id++) {
        int r = atomic_load(&t->reports[id]);
        if (r == -1)
            continue;
        accepted++;
        if (r != 1) {
            fprintf(stderr, "message %ld reported %d times\n", id, r);
            exit(1);
        }
    }
    CHECK_EQ(atomic_load(&t->bad), 0);
    CHECK_EQ(atomic_load(&t->done), accepted);
}

/* Close every socket and wait for their on_close; then nothing more may
 * be reported. */
static void trk_close_all(struct trk *t, int n)
{
    long done = atomic_load(&t->done), x = atomic_load(&t->x_reports);
    for (int i = 0; i < n; i++)
        bex_sock_close(t->socks[i]);
    TRK_WAIT(t, closed, n, 10000);
    pair_sleep_ms(200);
    CHECK_EQ(atomic_load(&t->done), done);
    CHECK_EQ(atomic_load(&t->x_reports), x);
    CHECK_EQ(atomic_load(&t->closed), n);
}

static bex_ctx_config client_cfg(void)
{
    return (bex_ctx_config){.log_fn = c_log};
}

/* ---------------- ibv_poll_cq fails ---------------- */

/* The third poll that finds completions loses them and returns -1 (as a
 * provider does on a broken CQ), with 64 KiB messages (rendezvous) in
 * flight on two sockets. Every engine of the CQ must fail at once with
 * -EIO: the completions that are gone may have handed messages back,
 * returned credits or answered rendezvous requests, and nothing tells
 * which. Before the fix the loop took the -1 for "no completions" and went
 * on: no engine failed, no error was reported, and whatever the lost
 * completions carried was dropped silently (in the run that showed it
 * fail, all 48 sends came back 0 and neither socket ever saw an error). */
static int poll_client(struct pair *p, void *arg)
{
    (void)arg;
    struct trk *t = trk_new();
    trk_connect(p, t, NSOCK);
    bex__fault_arm(BEX__FAULT_POLL_CQ, 3, -1, EIO, NULL, NULL);
    enum { N = 48 };
    long accepted = 0;
    for (int i = 0; i < N; i++)
        if (trk_send(p, t, i % NSOCK, 64 * 1024) == 0)
            accepted++;
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    while (!bex__fault_fired(BEX__FAULT_POLL_CQ) && pair_now_ms() < end)
        pair_sleep_ms(1);
    CHECK(bex__fault_fired(BEX__FAULT_POLL_CQ));
    /* bounded well below the 30 s timeouts that would end it otherwise */
    TRK_WAIT(t, errors, NSOCK, 5000);
    TRK_WAIT(t, done, accepted, 5000);
    trk_check_once(t);
    for (int i = 0; i < NSOCK; i++) {
        CHECK_EQ(atomic_load(&t->err[i]), -EIO);
        CHECK_EQ(atomic_load(&t->errors_of[i]), 1);
    }
    CHECK(atomic_load(&t->n_err) > 0); /* some were in flight when it failed */
    /* logged once, not per poll (after the engines failed: wait for it) */
    TRK_WAIT(t, poll_logs, 1, 2000);
    trk_close_all(t, NSOCK);
    trk_check_once(t);
    CHECK_EQ(atomic_load(&t->poll_logs), 1);
    free(t);
    return 0;
}

static int poll_cq_error(void)
{
    bex_ctx_config c = client_cfg();
    return pair_run(NULL, echo_main, NULL, &c, poll_client, NULL, 60);
}

/* ---------------- a post returns a negative code ---------------- */

/* Messages go (and come back: the server echoes) until the armed post
 * fails; then the socket must fail with exactly the error the provider
 * meant, as a negative errno. */
struct post_case {
    enum bex__fault_kind kind;
    int ret, err; /* what the post returns, and errno */
    int want;     /* the socket's error */
};

static int post_client(struct pair *p, void *arg)
{
    const struct post_case *pc = arg;
    struct trk *t = trk_new();
    trk_connect(p, t, 1);
    /* traffic both ways first: the engine is in its steady state */
    for (int i = 0; i < 8; i++)
        CHECK_OK(trk_send(p, t, 0, 512));
    TRK_WAIT(t, done, 8, 10000);
    TRK_WAIT(t, recvd, 8, 10000);
    CHECK_EQ(atomic_load(&t->n_ok), 8);
    bex__fault_arm(pc->kind, 1, pc->ret, pc->err, NULL, NULL);
    /* enough echoes that receives are reposted (every rq_depth / 2) */
    long accepted = 8;
    for (int i = 0; i < 200 && !atomic_load(&t->errors); i++) {
        if (trk_send(p, t, 0, 512) == 0)
            accepted++;
        if (i % 16 == 15)
            pair_sleep_ms(5);
    }
    TRK_WAIT(t, errors, 1, 10000);
    CHECK(bex__fault_fired(pc->kind));
    TRK_WAIT(t, done, accepted, 5000);
    trk_check_once(t);
    if (atomic_load(&t->err[0]) != pc->want)
        fprintf(stderr, "the socket failed with %d, not %d\n", atomic_load(&t->err[0]), pc->want);
    CHECK_EQ(atomic_load(&t->err[0]), pc->want);
    CHECK_EQ(atomic_load(&t->errors_of[0]), 1);
    trk_close_all(t, 1);
    free(t);
    return 0;
}

static int post_send_error(void)
{
    /* the "-1 and errno" convention some providers use */
    static const struct post_case pc = {BEX__FAULT_POST_SEND, -1, ENOMEM, -ENOMEM};
    bex_ctx_config c = client_cfg();
    return pair_run(NULL, echo_main, NULL, &c, post_client, (void *)&pc, 60);
}

static int post_recv_error(void)
{
    /* a negative errno, as others return it */
    static const struct post_case pc = {BEX__FAULT_POST_RECV, -ENOBUFS, 0, -ENOBUFS};
    bex_ctx_config c = client_cfg();
    return pair_run(NULL, echo_main, NULL, &c, post_client, (void *)&pc, 60);
}

/* ---------------- a repost fails inside a callback's send ---------------- */

/* A ping-pong answered from on_recv: each of the client's sends is the
 * direct one (its I/O thread, nothing queued), which before prepared the
 * message at once and, when the credits it carries needed the receives
 * posted again, posted them inside bex_sock_send: a failed post failed
 * the engine there and handed the message back (on_send_done) and the
 * socket's error (on_error) inside the application's call. */
static int repost_client(struct pair *p, void *arg)
{
    (void)arg;
    struct trk *t = trk_new();
    t->p = p;
    atomic_store(&t->last_id, -1);
    trk_connect(p, t, 1);
    /* armed from the 8th echo's on_recv: its receives were reposted
     * before, so that the next repost comes from a callback's send */
    atomic_store(&t->arm_at, 8);
    atomic_store(&t->pongs, 400);
    CHECK_OK(trk_send(p, t, 0, 64));
    TRK_WAIT(t, errors, 1, 20000);
    CHECK(bex__fault_fired(BEX__FAULT_POST_RECV));
    long accepted = 0, n = atomic_load(&t->next_id);
    for (long id = 0; id < n; id++)
        accepted += atomic_load(&t->reports[id]) != -1;
    TRK_WAIT(t, done, accepted, 5000);
    trk_check_once(t);
    CHECK_EQ(atomic_load(&t->inside), 0);
    CHECK_EQ(atomic_load(&t->err[0]), -ENOBUFS);
    CHECK_EQ(atomic_load(&t->errors_of[0]), 1);
    /* the send the repost was for: taken, never posted */
    long last = atomic_load(&t->last_id);
    CHECK(last >= 0);
    CHECK_EQ(atomic_load(&t->status[last]), -ECANCELED);
    trk_close_all(t, 1);
    free(t);
    return 0;
}

static int repost_in_send(void)
{
    bex_ctx_config c = client_cfg();
    return pair_run(NULL, echo_main, NULL, &c, repost_client, NULL, 60);
}

/* ---------------- bex_sock_expose racing an engine failure ---------------- */

/* Inside bex_sock_expose, after its checks found the socket open and
 * before it arms the slot, the engine fails (a post returns EIO, as a
 * provider's positive errno) and the I/O thread fails the socket, which
 * cancels the exposed buffers armed at that moment: not this one yet. The
 * contract (sock.h): the buffer is refused (-EPIPE, not taken) or comes
 * back (-ECANCELED) because the socket failed, exactly once, without
 * waiting for a close. Before the fix it was armed on the dead socket and
 * came back only when the application closed it. */
struct race {
    struct pair *p;
    struct trk *t;
    _Atomic int hook_ok;
};

static void expose_hook(void *arg)
{
    struct race *r = arg;
    bex__fault_arm(BEX__FAULT_POST_SEND, 1, EIO, 0, NULL, NULL);
    if (trk_send(r->p, r->t, 0, 64))
        return; /* refused: the socket was not open; hook_ok stays 0 */
    if (wait_count(&r->t->w, &r->t->errors, 1, 10000) == 0)
        atomic_store(&r->hook_ok, 1);
}

static int expose_client(struct pair *p, void *arg)
{
    (void)arg;
    struct trk *t = trk_new();
    trk_connect(p, t, 1);
    CHECK_OK(trk_send(p, t, 0, 512));
    TRK_WAIT(t, done, 1, 10000);
    enum { XLEN = 65536 };
    void *b = bex_sock_alloc_exposable(p->ctx, XLEN);
    CHECK(b);
    struct race r = {.p = p, .t = t};
    bex__fault_arm(BEX__FAULT_EXPOSE_ARM, 1, 0, 0, expose_hook, &r);
    bex_remote_buf rb;
    int rc = bex_sock_expose(t->socks[0], b, XLEN, XUSER, &rb);
    CHECK(bex__fault_fired(BEX__FAULT_EXPOSE_ARM));
    CHECK(atomic_load(&r.hook_ok)); /* the socket failed inside the call */
    CHECK_EQ(atomic_load(&t->err[0]), -EIO);
    if (rc == 0) {
        /* taken: it must come back now, the socket being dead */
        if (wait_count(&t->w, &t->x_reports, 1, 2000)) {
            fprintf(stderr, "bex_sock_expose returned 0 on a failed socket and the buffer "
                            "did not come back\n");
            exit(1);
        }
        CHECK_EQ(atomic_load(&t->x_status), -ECANCELED);
    } else {
        CHECK_EQ(rc, -EPIPE);
        pair_sleep_ms(200);
        CHECK_EQ(atomic_load(&t->x_reports), 0); /* not taken, so never reported */
        bex_mem_free(b);
    }
    TRK_WAIT(t, done, atomic_load(&t->next_id), 5000);
    trk_close_all(t, 1);
    CHECK_EQ(atomic_load(&t->x_reports), rc == 0 ? 1 : 0);
    trk_check_once(t);
    free(t);
    return 0;
}

static int expose_race(void)
{
    bex_ctx_config c = client_cfg();
    c.remote_access = BEX_REMOTE_ACCESS_LANDING;
    return pair_run(NULL, echo_main, NULL, &c, expose_client, NULL, 60);
}

static int expose_race_window(void)
{
    bex_ctx_config c = client_cfg();
    c.remote_access = BEX_REMOTE_ACCESS_WINDOW;
    return pair_run(NULL, echo_main, NULL, &c, expose_client, NULL, 60);
}

BEX_TEST_MAIN(BEX_CASE(poll_cq_error), BEX_CASE(post_send_error), BEX_CASE(post_recv_error),
              BEX_CASE(expose_race), BEX_CASE(expose_race_window), BEX_CASE(repost_in_send))
