/* SPDX-License-Identifier: Apache-2.0 */
/* Primary-backup with failover through etcd (issue 29, items 2 and 4;
 * include/bex/ps.h, bex_ps_failover_start): one shard, three replicas in
 * this process, each on its own context, server and failover agent, and a
 * local etcd (started by the case; without etcd the case fails). Lease
 * TTL 2 s (etcd's least), margin 500 ms. Pushes are raw Push bodies of one
 * SGD row, grads all 1, each with its id, sent to the replicas in turn
 * until one acknowledges it (as a client that re-reads the primary and
 * retries with the same id), so none stays in doubt.
 *
 * kill9: the primary "dies" (its agent stops without revoking: its lease
 *   expires; its server goes): a backup is primary within TTL + margin +
 *   slack, every Push acknowledged, each row exactly the initial value
 *   less lr times its acknowledged Pushes (none lost, none twice), and
 *   the two survivors equal bit for bit; the new epoch is above the old.
 *   A Push naming another epoch (EPOCH flag) is refused -ESTALE; one
 *   naming 0 is applied and its answer carries the primary's epoch. The
 *   other survivor follows the new term by a full copy (catchup_full),
 *   not a log suffix.
 * sigstop: the primary's agent and keep-alives held (a stopped process)
 *   past its lease: it acknowledges nothing from its lease's deadline on
 *   (a Push sent to it is refused -ESTALE), a backup takes over, and when
 *   the old primary resumes it follows the new one (copies from it): all
 *   three equal, rows exact; a forward of the old epoch is refused
 *   -ESTALE by a backup of the new one.
 * backup_down: a backup "dies": it is removed from the replica set in
 *   etcd and Pushes keep being acknowledged; restarted empty on its
 *   address, it copies from the primary and is back in the set; rows
 *   exact, replicas equal.
 * out_at_election: a backup killed (out of the set), then the primary:
 *   the third replica leads alone; the backup restarted copies from it
 *   and is back in its set; rows exact.
 * any_order: a client (bex_ps_client, BEX_PS_PUSH_PRIMARY, a directory
 *   of the three addresses) starts Pushing first, the replicas come
 *   next (their agents wait for etcd), etcd last: every Push of the
 *   client is acknowledged within its deadline (it retries with the same
 *   id at the next replica), rows exact, replicas equal.
 * proc: three bex-ps processes (--etcd --primary-backup --replicas) and a
 *   bex_ps_client: the primary killed with SIGKILL, then the next one
 *   stopped with SIGSTOP past its lease (the last replica takes over),
 *   continued, and the killed one restarted empty; every Push the client
 *   made is acknowledged, and all three replicas end with exactly the
 *   initial rows less lr x the acknowledged Pushes.
 * refusals: a client Pushing to a backup 40 times, 20 a second (as one
 *   retrying): each refused -EPERM and counted, the WARN logged at the
 *   1st, 2nd, 4th, ... refusal only (a few lines, not one per Push); a
 *   client Push naming a future epoch at the primary: refused -ESTALE,
 *   counted, nothing applied, the epoch kept; a Forward naming a future
 *   (forged) or past epoch at a backup: refused, counted, the backup's
 *   epoch and step kept, so it stays in the set.
 * bad_set: the replica set in etcd overwritten (as by anyone who can
 *   write there) with a malformed value, then with one naming an unknown
 *   replica: the primary says so once each time and writes its own set
 *   back (every replica); Pushes go on, and a failover afterwards works
 *   (with the bad set left, no replica would ever campaign). */
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ps/shard_internal.h"
#include "ps_test.h"
#include "rpc/elect.h"

#define NREP   3
#define MAXREP (NREP + 1) /* join: a fourth one added */
#define NKEY   8
#define TTL    2000u

static const bex_ps_table_config *const TS = &TABLES[0]; /* SGD */
static pid_t etcd_pid;
static char datadir[64], url[64];

static void rm_rf(const char *path)
{
    DIR *dir = opendir(path);
    if (!dir) {
        unlink(path);
        return;
    }
    struct dirent *e;
    while ((e = readdir(dir)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            char p[512];
            snprintf(p, sizeof p, "%s/%s", path, e->d_name);
            rm_rf(p);
        }
    closedir(dir);
    rmdir(path);
}

static pid_t main_pid, ps_pid[NREP];
static void cleanup(void)
{
    if (getpid() != main_pid)
        return;
    /* bex-ps children too, a stopped one included (SIGTERM would wait for
     * its SIGCONT and keep the test's output open) */
    for (int r = 0; r < NREP; r++)
        if (ps_pid[r] > 0 && kill(ps_pid[r], SIGKILL) == 0)
            waitpid(ps_pid[r], NULL, 0);
    if (etcd_pid > 0) {
        kill(etcd_pid, SIGKILL);
        waitpid(etcd_pid, NULL, 0);
    }
    if (datadir[0])
        rm_rf(datadir);
}

/* etcd (PATH or BEX_ETCD) on free ports, data in a temporary directory. */
static void start_etcd(void)
{
    main_pid = getpid();
    atexit(cleanup);
    /* the client port: url's when set already (any_order) */
    uint16_t cp = url[0] ? (uint16_t)atoi(strrchr(url, ':') + 1) : free_port(), pp = free_port();
    snprintf(datadir, sizeof datadir, "/tmp/bex-etcd-XXXXXX");
    CHECK(mkdtemp(datadir));
    snprintf(url, sizeof url, "http://127.0.0.1:%u", cp);
    const char *bin = getenv("BEX_ETCD") ? getenv("BEX_ETCD") : "etcd";
    char purl[64], cluster[96], logp[128], dd[96];
    snprintf(purl, sizeof purl, "http://127.0.0.1:%u", pp);
    snprintf(cluster, sizeof cluster, "t=%s", purl);
    snprintf(logp, sizeof logp, "%s/log", datadir);
    snprintf(dd, sizeof dd, "%s/data", datadir);
    fflush(NULL);
    etcd_pid = fork();
    CHECK(etcd_pid >= 0);
    if (etcd_pid == 0) {
        FILE *lf = freopen(logp, "a", stdout);
        (void)lf;
        dup2(STDOUT_FILENO, STDERR_FILENO);
        execlp(bin, bin, "--name", "t", "--data-dir", dd, "--listen-client-urls", url,
               "--advertise-client-urls", url, "--listen-peer-urls", purl,
               "--initial-advertise-peer-urls", purl, "--initial-cluster", cluster, "--log-level",
               "warn", (char *)NULL);
        _exit(127);
    }
}

struct fo {
    bex_ctx *ctx[MAXREP], *cctx;
    bex_ps_shard *s[MAXREP];
    bex_rpc_server *srv[MAXREP];
    bex_ps_failover *f[MAXREP];
    bex_rpc_endpoint ep[MAXREP];
    bex_rpc_channel *ch[MAXREP];
    uint32_t acked[NKEY];
    uint64_t seq;
};

/* The shards' log (to stderr), counting per replica (arg) the refusals of
 * a client's Push at a backup. */
static _Atomic int backup_lines[MAXREP], bad_set_lines[MAXREP];
static void count_log(int level, const char *msg, void *arg)
{
    (void)level;
    if (strstr(msg, "this replica is a backup"))
        atomic_fetch_add(&backup_lines[(intptr_t)arg], 1);
    if (strstr(msg, "the replica set in etcd"))
        atomic_fetch_add(&bad_set_lines[(intptr_t)arg], 1);
    fprintf(stderr, "replica %d: %s\n", (int)(intptr_t)arg, msg);
}

/* Replica r's context, shard, server (on a0, at p->ep[r]'s port when
 * set) and the test's channel to it; no agent yet. */
static void fo_one(struct fo *p, int r, struct in_addr a0)
{
    bex_ps_shard_config pc = {.shard = 0,
                              .n_shards = 1,
                              .tables = TABLES,
                              .n_tables = 2,
                              .role = BEX_PS_ROLE_BACKUP,
                              .forward_timeout_ms = 1000 * time_scale(),
                              .log_fn = count_log};
    {
        pc.log_arg = (void *)(intptr_t)r;
        bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
        bex_ctx_config sc = scaled(&base, a0);
        CHECK_OK(bex_ctx_create(&sc, &p->ctx[r]));
        CHECK_OK(bex_ps_shard_create(&pc, &p->s[r]));
        CHECK_OK(bex_rpc_server_create(p->ctx[r], NULL, &p->srv[r]));
        CHECK_OK(bex_ps_shard_register(p->s[r], p->srv[r], p->ctx[r]));
        bex_addr a = {
            .in4 = {.sin_family = AF_INET, .sin_addr = a0, .sin_port = p->ep[r].addr.in4.sin_port}};
        CHECK_OK(bex_rpc_server_listen(p->srv[r], &a));
        bex_rpc_server_addr(p->srv[r], &p->ep[r].addr);
        bex_rpc_channel_config cc = {.endpoints = &p->ep[r],
                                     .n_endpoints = 1,
                                     .name = "raw",
                                     .request_timeout_ms = 1000 * time_scale(),
                                     .connect_timeout_ms = 500 * time_scale(),
                                     .max_attempts = 1};
        CHECK_OK(bex_rpc_channel_create(p->cctx, &cc, &p->ch[r]));
    }
}

/* Three replicas with their agents (at p->ep's ports when set). */
static void fo_start(struct fo *p)
{
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    p->cctx = client_ctx();
    for (int r = 0; r < NREP; r++)
        fo_one(p, r, a0);
    for (int r = 0; r < NREP; r++) {
        bex_ps_failover_config fc = {.etcd_url = url,
                                     .replicas = p->ep,
                                     .n_replicas = NREP,
                                     .self = (uint32_t)r,
                                     .lease_ttl_ms = TTL,
                                     .lease_margin_ms = 500};
        CHECK_OK(bex_ps_failover_start(p->s[r], p->ctx[r], &fc, &p->f[r]));
    }
}

/* Replica r "dies": its agent stops (the lease is left to expire), its
 * server goes. */
static void fo_kill(struct fo *p, int r)
{
    bex_ps_failover_stop(p->f[r], false);
    p->f[r] = NULL;
    CHECK_OK(bex_rpc_server_destroy(p->srv[r]));
    p->srv[r] = NULL;
}

static void fo_stop(struct fo *p)
{
    for (int r = 0; r < MAXREP; r++)
        bex_ps_failover_stop(p->f[r], true);
    for (int r = 0; r < MAXREP; r++)
        if (p->srv[r])
            CHECK_OK(bex_rpc_server_destroy(p->srv[r]));
    for (int r = 0; r < MAXREP; r++) {
        if (!p->ctx[r])
            continue; /* no fourth replica */
        bex_rpc_channel_destroy(p->ch[r]);
        bex_ps_shard_destroy(p->s[r]);
        CHECK_OK(bex_ctx_destroy(p->ctx[r]));
    }
    CHECK_OK(bex_ctx_destroy(p->cctx));
}

static bex_ps_shard_stats stats(bex_ps_shard *s)
{
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(s, &st);
    return st;
}

/* The primary now (the replica whose role says so), or -1. */
static int primary_of(struct fo *p, int not )
{
    for (int r = 0; r < MAXREP; r++)
        if (r != not &&p->srv[r] && stats(p->s[r]).role == BEX_PS_ROLE_PRIMARY)
            return r;
    return -1;
}

/* The replica that is primary now, other than `not`, waiting up to ms.
 * A Push acknowledged after a kill does not mean a primary at the next
 * instant: the survivors may still contest the term (CI saw epochs 3 to
 * 7 after one kill, the replica that took the Push losing its term to
 * another that was still copying), so a wait after one is given time, not
 * one look. */
static int wait_primary(struct fo *p, int not, unsigned ms)
{
    for (uint64_t end = bex_test_now_ms() + ms * time_scale(); bex_test_now_ms() < end;
         bex_test_sleep_ms(20)) {
        int r = primary_of(p, not );
        if (r >= 0)
            return r;
    }
    return -1;
}

static int call_method(bex_rpc_channel *ch, bex_ctx *ctx, uint32_t method, const void *body,
                       size_t len)
{
    void *b = bex_rpc_alloc(ctx, len);
    CHECK(b);
    memcpy(b, body, len);
    void *resp = NULL;
    int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, method, b, len, NULL, &resp, NULL);
    bex_rpc_free(resp);
    return rc;
}

static int call_raw(bex_rpc_channel *ch, bex_ctx *ctx, const void *body, size_t len)
{
    return call_method(ch, ctx, BEX_PS_M_PUSH, body, len);
}

/* A Push of one row of key, grads 1, id seq, naming epoch when with. */
static size_t push_body_ep(uint8_t *b, uint64_t key, uint64_t seq, bool with, uint64_t epoch)
{
    struct bex__ps_hdr h = {.table = TS->id,
                            .n = 1,
                            .dim = TS->dim,
                            .flags = BEX__PS_F_ID | (with ? BEX__PS_F_EPOCH : 0),
                            .id_client = 99,
                            .id_seq = seq,
                            .id_tok = {0x3333, 0x4444},
                            .epoch = epoch};
    bex__ps_hdr_put(b, &h);
    uint8_t *q = b + bex__ps_keys_off(&h);
    bex__ps_put64(q, key);
    for (uint32_t d = 0; d < TS->dim; d++)
        bex__ps_putf(q + 8 + 4 * d, 1.0f);
    return bex__ps_keys_off(&h) + 8 + 4 * TS->dim;
}

static size_t push_body(uint8_t *b, uint64_t key, uint64_t seq)
{
    return push_body_ep(b, key, seq, false, 0);
}

/* A Push's answer's epoch (0: none), or the call's failure (< 0). */
static int64_t call_epoch(bex_rpc_channel *ch, bex_ctx *ctx, const void *body, size_t len)
{
    void *b = bex_rpc_alloc(ctx, len), *resp = NULL;
    CHECK(b);
    memcpy(b, body, len);
    size_t rl = 0;
    int rc = bex_rpc_call_sync(ch, BEX_PS_SERVICE, BEX_PS_M_PUSH, b, len, NULL, &resp, &rl);
    int64_t e = rc ? rc : (int64_t)bex__ps_resp_epoch(resp, rl);
    if (!rc)
        CHECK_OK(bex__ps_check_resp(BEX_PS_M_PUSH, resp, rl, TS->id, 1, TS->dim));
    bex_rpc_free(resp);
    return e;
}

/* One Push (a new id), retried with its id at each live replica in turn
 * until acknowledged (20 s at most). */
static void push_one(struct fo *p)
{
    uint64_t seq = ++p->seq, key = 1000 + seq % NKEY;
    uint8_t b[256];
    size_t len = push_body(b, key, seq);
    int rc = -1;
    static int at;
    for (uint64_t end = bex_test_now_ms() + 20000 * time_scale(); rc && bex_test_now_ms() < end;) {
        for (int k = 0; k < MAXREP && rc; k++, at = (at + 1) % MAXREP)
            if (p->srv[at])
                rc = call_raw(p->ch[at], p->cctx, b, len);
        if (rc)
            bex_test_sleep_ms(50);
    }
    CHECK_OK(rc);
    p->acked[seq % NKEY]++;
}

/* Every live replica's rows: each exactly init - lr x acked, all equal. */
static void rows_check(struct fo *p)
{
    for (int k = 0; k < NKEY; k++) {
        uint64_t key = 1000 + (uint64_t)k;
        uint8_t body[BEX__PS_HDR_LEN + 8];
        bex__ps_hdr_put(body, &(struct bex__ps_hdr){.table = TS->id, .n = 1, .dim = TS->dim});
        bex__ps_put64(body + BEX__PS_HDR_LEN, key);
        for (int r = 0; r < MAXREP; r++) {
            if (!p->srv[r])
                continue;
            void *resp = NULL;
            size_t len = 0;
            CHECK_OK(bex_ps_shard_serve(p->s[r], p->ctx[r], BEX_PS_M_FETCH, body, sizeof body,
                                        &resp, &len));
            for (uint32_t d = 0; d < TS->dim; d++) {
                float w = bex_ps_init_value(TS->id, key, d, TS->init_scale);
                for (uint32_t i = 0; i < p->acked[k]; i++)
                    w -= TS->lr * 1.0f;
                float got = bex__ps_getf((const uint8_t *)resp + BEX__PS_HDR_LEN + 4 * d);
                if (memcmp(&got, &w, 4))
                    fprintf(stderr, "replica %d key %d col %u: %.9g, want %.9g (%u acked)\n", r, k,
                            d, (double)got, (double)w, p->acked[k]);
                CHECK(!memcmp(&got, &w, 4));
            }
            bex_rpc_free(resp);
        }
    }
}

/* Replica r in step (copied from primary prim now) and in its set. */
static void wait_one(struct fo *p, int prim, int r)
{
    uint64_t end = bex_test_now_ms() + 10000 * time_scale();
    for (;;) {
        pthread_mutex_lock(&p->s[r]->mu);
        bool ok = p->s[r]->rp.state == RP_BACKUP && p->s[r]->rp.epoch == p->s[prim]->rp.epoch;
        pthread_mutex_unlock(&p->s[r]->mu);
        bool listed = false;
        pthread_mutex_lock(&p->s[prim]->mu);
        for (size_t b = 0; b < p->s[prim]->rp.n_bk; b++)
            if (p->s[prim]->rp.bk[b].addr.in4.sin_port == p->ep[r].addr.in4.sin_port)
                listed = p->s[prim]->rp.bk[b].state != BK_OUT; /* in the set: forwarded to */
        pthread_mutex_unlock(&p->s[prim]->mu);
        ok &= listed;
        if (ok)
            return;
        CHECK(bex_test_now_ms() < end);
        bex_test_sleep_ms(20);
    }
}

/* Every live backup so. */
static void wait_synced(struct fo *p, int prim)
{
    for (int r = 0; r < MAXREP; r++)
        if (r != prim && p->srv[r])
            wait_one(p, prim, r);
}

/* etcd and the three replicas started, the first primary elected (etcd
 * starting, then the first election) and every backup in step with it:
 * returns the primary. */
static int fo_up(struct fo *p)
{
    start_etcd();
    fo_start(p);
    int prim = wait_primary(p, -1, 15000);
    CHECK(prim >= 0);
    wait_synced(p, prim);
    return prim;
}

static int t_kill9(void)
{
    struct fo p = {0};
    int prim = fo_up(&p);
    uint64_t e1 = p.s[prim]->rp.epoch;
    CHECK_EQ(stats(p.s[prim]).failovers, 0); /* the first election is no failover */
    for (int i = 0; i < 40; i++)
        push_one(&p);
    /* a Push naming another term is refused; one naming none (0) is
     * applied and its answer names the term */
    uint8_t b[256];
    size_t len = push_body_ep(b, 1000 + (p.seq + 1) % NKEY, p.seq + 1, true, e1 + 1);
    CHECK_EQ(call_epoch(p.ch[prim], p.cctx, b, len), -ESTALE);
    len = push_body_ep(b, 1000 + (p.seq + 1) % NKEY, p.seq + 1, true, 0);
    CHECK_EQ(call_epoch(p.ch[prim], p.cctx, b, len), (int64_t)e1);
    p.seq++;
    p.acked[p.seq % NKEY]++;
    uint64_t full[NREP];
    for (int r = 0; r < NREP; r++)
        full[r] = stats(p.s[r]).catchup_full;
    uint64_t t0 = bex_test_now_ms();
    fo_kill(&p, prim);
    push_one(&p); /* acknowledged by the new primary only */
    uint64_t took = bex_test_now_ms() - t0;
    int np = wait_primary(&p, prim, 15000); /* (see wait_primary) */
    CHECK(np >= 0 && np != prim);
    fprintf(stderr, "failover: %llu ms to the first Push acknowledged; epoch %llu -> %llu\n",
            (unsigned long long)took, (unsigned long long)e1,
            (unsigned long long)p.s[np]->rp.epoch);
    CHECK(p.s[np]->rp.epoch > e1);
    CHECK(stats(p.s[np]).failovers >=
          1); /* bex_ps_failovers_total (1 unless its own lease lapsed) */
    CHECK(took < (TTL + 500 + 4000) * time_scale()); /* TTL + margin + etcd's expiry check, slack */
    for (int i = 0; i < 40; i++)
        push_one(&p);
    wait_synced(&p, np);
    /* the other survivor followed the new term by a full copy, not by a
     * log suffix (docs/architecture.md, "Takeover": the log is not kept
     * across a term) */
    int other = 3 - prim - np;
    CHECK(stats(p.s[other]).catchup_full > full[other]);
    CHECK_EQ(stats(p.s[other]).catchup_suffix, 0);
    rows_check(&p);
    fo_stop(&p);
    return 0;
}

static int t_sigstop(void)
{
    struct fo p = {0};
    int prim = fo_up(&p);
    for (int i = 0; i < 30; i++)
        push_one(&p);
    /* stopped: no keep-alive, no agent step; its lease runs out */
    bex_ps_failover_hold(p.f[prim], true);
    uint64_t until = bex__elect_until_ns(p.s[prim]->rp.el);
    int np = wait_primary(&p, prim, 15000);
    CHECK(np >= 0);
    CHECK(bex__rpc_now_ns() >= until); /* the new term began after the old lease's deadline */
    /* the old primary, still thinking itself primary, acknowledges nothing */
    CHECK_EQ(stats(p.s[prim]).role, BEX_PS_ROLE_PRIMARY);
    uint8_t b[256];
    size_t len = push_body(b, 1000, ++p.seq);
    CHECK_EQ(call_raw(p.ch[prim], p.cctx, b, len), -ESTALE);
    p.seq--; /* not acknowledged: its id is used again below */
    /* a forward of the old term is refused by a backup of the new one */
    int bk = 3 - prim - np;
    uint8_t f[256];
    bex__ps_fwd_put(f, &(struct bex__ps_fwd_hdr){.session = p.s[prim]->rp.epoch, .lsn = 1});
    size_t flen = BEX__PS_FWD_HDR_LEN + push_body(f + BEX__PS_FWD_HDR_LEN, 1000, 777);
    wait_one(&p, np, bk);
    CHECK_EQ(call_method(p.ch[bk], p.cctx, BEX_PS_M_FORWARD, f, flen), -ESTALE);
    for (int i = 0; i < 30; i++)
        push_one(&p);
    /* woken: it follows the new primary and copies from it */
    bex_ps_failover_hold(p.f[prim], false);
    for (uint64_t end = bex_test_now_ms() + 10000 * time_scale();
         stats(p.s[prim]).role != BEX_PS_ROLE_BACKUP;) {
        CHECK(bex_test_now_ms() < end);
        bex_test_sleep_ms(20);
    }
    wait_synced(&p, np);
    for (int i = 0; i < 10; i++)
        push_one(&p);
    rows_check(&p);
    fo_stop(&p);
    return 0;
}

/* Replica r back on its address: a new shard (empty), server and agent. */
static void fo_restart(struct fo *p, int r)
{
    bex_ps_shard_destroy(p->s[r]);
    bex_ps_shard_config pc = {.shard = 0,
                              .n_shards = 1,
                              .tables = TABLES,
                              .n_tables = 2,
                              .role = BEX_PS_ROLE_BACKUP,
                              .forward_timeout_ms = 1000 * time_scale()};
    CHECK_OK(bex_ps_shard_create(&pc, &p->s[r]));
    CHECK_OK(bex_rpc_server_create(p->ctx[r], NULL, &p->srv[r]));
    CHECK_OK(bex_ps_shard_register(p->s[r], p->srv[r], p->ctx[r]));
    bex_addr a = p->ep[r].addr;
    CHECK_OK(bex_rpc_server_listen(p->srv[r], &a));
    bex_ps_failover_config fc = {.etcd_url = url,
                                 .replicas = p->ep,
                                 .n_replicas = NREP,
                                 .self = (uint32_t)r,
                                 .lease_ttl_ms = TTL,
                                 .lease_margin_ms = 500};
    CHECK_OK(bex_ps_failover_start(p->s[r], p->ctx[r], &fc, &p->f[r]));
}

/* The replica set in etcd now. */
static void set_now(char *set, size_t cap)
{
    uint64_t cr, mr;
    CHECK_OK(bex__elect_get(url, "/bex/ps/ps/0/set", &cr, &mr, set, cap));
}

static int t_backup_down(void)
{
    struct fo p = {0};
    int prim = fo_up(&p);
    for (int i = 0; i < 20; i++)
        push_one(&p);
    int bk = (prim + 1) % NREP;
    char name[32], set[256];
    snprintf(name, sizeof name, "127.0.0.1:%u", ntohs(p.ep[bk].addr.in4.sin_port));
    set_now(set, sizeof set);
    CHECK(strstr(set, name));
    fo_kill(&p, bk);
    /* Pushes go on without it, once it is out of the set in etcd */
    for (int i = 0; i < 20; i++)
        push_one(&p);
    CHECK_EQ(primary_of(&p, -1), prim);
    set_now(set, sizeof set);
    CHECK(!strstr(set, name));
    rows_check(&p);
    /* back (empty): it copies from the primary and rejoins the set */
    fo_restart(&p, bk);
    for (int i = 0; i < 20; i++)
        push_one(&p);
    wait_synced(&p, prim);
    set_now(set, sizeof set);
    CHECK(strstr(set, name));
    for (int i = 0; i < 10; i++)
        push_one(&p);
    rows_check(&p);
    fo_stop(&p);
    return 0;
}

/* A backup out of the set when the primary dies is rejoined by the next
 * primary (which lists it out of the set, probes it, and lets it back). */
static int t_out_at_election(void)
{
    struct fo p = {0};
    int prim = fo_up(&p);
    int bk = (prim + 1) % NREP, other = (prim + 2) % NREP;
    fo_kill(&p, bk);
    for (int i = 0; i < 10; i++)
        push_one(&p); /* bk leaves the set */
    fo_kill(&p, prim);
    for (int i = 0; i < 10; i++)
        push_one(&p); /* other leads, alone in the set */
    CHECK_EQ(wait_primary(&p, prim, 1), other);
    fo_restart(&p, bk);
    for (int i = 0; i < 10; i++)
        push_one(&p);
    wait_one(&p, other, bk); /* copied and back in the set */
    for (int i = 0; i < 5; i++)
        push_one(&p);
    rows_check(&p);
    fo_stop(&p);
    return 0;
}

/* ---- any_order: the client first, then the replicas, then etcd ---- */

struct pusher {
    bex_ps_client *c;
    int n, failed;
    uint32_t acked[NKEY];
};

static void *pusher_main(void *arg)
{
    struct pusher *u = arg;
    float g[8];
    for (int d = 0; d < 8; d++)
        g[d] = 1.0f;
    for (int i = 0; i < u->n; i++) {
        uint64_t key = 1000 + (uint64_t)(i % NKEY);
        int rc = bex_ps_push_sync(u->c, TS->id, TS->dim, &key, 1, g);
        if (rc) {
            fprintf(stderr, "Push %d: %s\n", i, bex_strerror(rc));
            u->failed++;
        } else {
            u->acked[i % NKEY]++;
        }
    }
    return NULL;
}

/* A directory of the three replicas' addresses (etcd is not up yet). */
static bex_dir *dir_of(const struct fo *p)
{
    char j[512], err[256];
    size_t o = (size_t)snprintf(j, sizeof j, "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":[");
    for (int r = 0; r < NREP; r++)
        o += (size_t)snprintf(j + o, sizeof j - o, "%s{\"addr\":\"127.0.0.1:%u\"}", r ? "," : "",
                              ntohs(p->ep[r].addr.in4.sin_port));
    snprintf(j + o, sizeof j - o, "]}]}}}");
    bex_dir *d;
    CHECK_OK(bex_dir_create(NULL, &d));
    CHECK_OK(bex_dir_load_json(d, j, err, sizeof err));
    return d;
}

static int t_any_order(void)
{
    struct fo p = {0};
    for (int r = 0; r < NREP; r++)
        p.ep[r].addr.in4 = (struct sockaddr_in){.sin_family = AF_INET,
                                                .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                                                .sin_port = htons(free_port())};
    bex_ctx *cctx = client_ctx();
    bex_dir *d = dir_of(&p);
    bex_ps_client_config cc = {.dir = d,
                               .timeout_ms = 30000 * time_scale(),
                               .attempt_timeout_ms = 1000 * time_scale(),
                               .connect_timeout_ms = 500 * time_scale(),
                               .push_mode = BEX_PS_PUSH_PRIMARY};
    struct pusher u = {.n = 40};
    CHECK_OK(bex_ps_client_create(cctx, &cc, &u.c));
    pthread_t th;
    CHECK(pthread_create(&th, NULL, pusher_main, &u) == 0);
    bex_test_sleep_ms(300); /* the client's first Push finds nobody */
    snprintf(url, sizeof url, "http://127.0.0.1:%u", free_port()); /* etcd's, not up yet */
    fo_start(&p);                                                  /* the agents wait for etcd */
    bex_test_sleep_ms(500);
    start_etcd();
    pthread_join(th, NULL);
    CHECK_EQ(u.failed, 0);
    int prim = wait_primary(&p, -1, 1);
    CHECK(prim >= 0);
    memcpy(p.acked, u.acked, sizeof p.acked);
    wait_synced(&p, prim);
    rows_check(&p);
    bex_ps_client_destroy(u.c);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(cctx));
    fo_stop(&p);
    return 0;
}

/* ---- proc: bex-ps processes, kill -9 and SIGSTOP for real ---- */

#define PROC_TTL "2000"

static char ps_args[NREP][2][64]; /* [1]: its --listen */

static void proc_start(int r, const char *reps)
{
    const char *const args[] = {"--etcd",
                                url,
                                "--primary-backup",
                                "--replicas",
                                reps,
                                "--listen",
                                ps_args[r][1],
                                "--n-shards",
                                "1",
                                "--shard",
                                "0",
                                "--transport",
                                "tcp",
                                "--table",
                                "1:8:sgd:0.1",
                                "--lease-ttl-ms",
                                PROC_TTL,
                                "--lease-margin-ms",
                                "500",
                                "--forward-timeout-ms",
                                "1000",
                                NULL};
    ps_pid[r] = bex_ps_start(args, NULL, 0);
}

/* The replica etcd names primary now (index), or -1. */
static int proc_primary(const struct fo *p)
{
    char v[64] = "";
    uint64_t cr, mr;
    if (bex__elect_get(url, "/bex/ps/ps/0/primary", &cr, &mr, v, sizeof v) || !cr)
        return -1;
    for (int r = 0; r < NREP; r++)
        if (!strcmp(v, ps_args[r][1]))
            return r;
    (void)p;
    return -1;
}

static int proc_wait_primary(const struct fo *p, int not )
{
    for (uint64_t end = bex_test_now_ms() + 15000 * time_scale(); bex_test_now_ms() < end;
         bex_test_sleep_ms(50)) {
        int r = proc_primary(p);
        if (r >= 0 && r != not )
            return r;
    }
    return -1;
}

static void proc_pushes(bex_ps_client *c, int n, uint32_t *acked, uint64_t *seq)
{
    float g[8];
    for (int d = 0; d < 8; d++)
        g[d] = 1.0f;
    for (int i = 0; i < n; i++, (*seq)++) {
        uint64_t key = 1000 + *seq % NKEY;
        CHECK_OK(bex_ps_push_sync(c, 1, 8, &key, 1, g));
        acked[*seq % NKEY]++;
    }
}

/* Replica r's rows match init - 0.1 x acked exactly (false: not yet). */
static bool proc_rows_ok(bex_ctx *ctx, const struct fo *p, int r, const uint32_t *acked)
{
    char j[256], err[128];
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":[{\"addr\":\"%s\"}]}]}}}",
             ps_args[r][1]);
    bex_dir *d;
    CHECK_OK(bex_dir_create(NULL, &d));
    CHECK_OK(bex_dir_load_json(d, j, err, sizeof err));
    bex_ps_client_config cc = {.dir = d, .timeout_ms = 2000 * time_scale()};
    bex_ps_client *c;
    CHECK_OK(bex_ps_client_create(ctx, &cc, &c));
    bool ok = true;
    for (int k = 0; k < NKEY && ok; k++) {
        uint64_t key = 1000 + (uint64_t)k;
        float row[8];
        ok = bex_ps_fetch_sync(c, 1, 8, &key, 1, row) == 0;
        for (uint32_t col = 0; col < 8 && ok; col++) {
            float w = bex_ps_init_value(1, key, col, 0.01f);
            for (uint32_t i = 0; i < acked[k]; i++)
                w -= 0.1f * 1.0f;
            ok = !memcmp(&w, &row[col], 4);
        }
    }
    bex_ps_client_destroy(c);
    bex_dir_destroy(d);
    (void)p;
    return ok;
}

static void proc_wait_rows(bex_ctx *ctx, const struct fo *p, int r, const uint32_t *acked)
{
    uint64_t end = bex_test_now_ms() + 15000 * time_scale();
    while (!proc_rows_ok(ctx, p, r, acked)) {
        CHECK(bex_test_now_ms() < end);
        bex_test_sleep_ms(100);
    }
}

static int t_proc(void)
{
    start_etcd();
    struct fo p = {0};
    char reps[256] = "";
    for (int r = 0; r < NREP; r++) {
        snprintf(ps_args[r][1], 64, "127.0.0.1:%u", free_port());
        snprintf(reps + strlen(reps), sizeof reps - strlen(reps), "%s%s", r ? "," : "",
                 ps_args[r][1]);
    }
    for (int r = 0; r < NREP; r++)
        proc_start(r, reps);
    /* a stopped primary's connection is given up after 2 s (keepalive):
     * the Push in doubt then goes to the next replica */
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ctx_config base = {.keepalive_timeout_ms = 2000, .connect_timeout_ms = 2000};
    bex_ctx_config sc = scaled(&base, a1);
    bex_ctx *cctx;
    CHECK_OK(bex_ctx_create(&sc, &cctx));
    char j[512], err[128];
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":[{\"replicas\":[{\"addr\":\"%s\"},{\"addr\":"
             "\"%s\"},{\"addr\":\"%s\"}]}]}}}",
             ps_args[0][1], ps_args[1][1], ps_args[2][1]);
    bex_dir *d;
    CHECK_OK(bex_dir_create(NULL, &d));
    CHECK_OK(bex_dir_load_json(d, j, err, sizeof err));
    bex_ps_client_config cc = {.dir = d,
                               .timeout_ms = 30000 * time_scale(),
                               .attempt_timeout_ms = 1000 * time_scale(),
                               .connect_timeout_ms = 500 * time_scale(),
                               .push_mode = BEX_PS_PUSH_PRIMARY};
    bex_ps_client *c;
    CHECK_OK(bex_ps_client_create(cctx, &cc, &c));
    uint32_t acked[NKEY] = {0};
    uint64_t seq = 0;
    proc_pushes(c, 30, acked, &seq);
    int p1 = proc_wait_primary(&p, -1);
    CHECK(p1 >= 0);
    /* kill -9 the primary: a backup takes over, every Push acknowledged */
    CHECK(kill(ps_pid[p1], SIGKILL) == 0);
    waitpid(ps_pid[p1], NULL, 0);
    ps_pid[p1] = 0;
    proc_pushes(c, 30, acked, &seq);
    int p2 = proc_wait_primary(&p, p1);
    CHECK(p2 >= 0);
    /* the third replica back in p2's set, so that it may take over */
    int p3w = 3 - p1 - p2;
    char set[256] = "";
    for (uint64_t end = bex_test_now_ms() + 15000 * time_scale(); !strstr(set, ps_args[p3w][1]);
         bex_test_sleep_ms(50)) {
        uint64_t cr, mr;
        CHECK(bex_test_now_ms() < end);
        proc_pushes(c, 1, acked, &seq); /* rejoins happen while Pushes come */
        CHECK_OK(bex__elect_get(url, "/bex/ps/ps/0/set", &cr, &mr, set, sizeof set));
    }
    /* SIGSTOP the new primary past its lease, then SIGCONT */
    CHECK(kill(ps_pid[p2], SIGSTOP) == 0);
    proc_pushes(c, 20, acked, &seq);
    int p3 = proc_wait_primary(&p, p2);
    CHECK(p3 >= 0 && p3 != p1);
    CHECK(kill(ps_pid[p2], SIGCONT) == 0);
    proc_start(p1, reps); /* the killed one back, empty: it copies */
    proc_pushes(c, 20, acked, &seq);
    for (int r = 0; r < NREP; r++)
        proc_wait_rows(cctx, &p, r, acked);
    bex_ps_client_destroy(c);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(cctx));
    for (int r = 0; r < NREP; r++) {
        term_bex_ps(ps_pid[r]);
        ps_pid[r] = 0;
    }
    return 0;
}

/* A Forward of one row of key (id seq) naming session, to replica r. */
static int forward_to(struct fo *p, int r, uint64_t session, uint64_t key, uint64_t seq)
{
    uint8_t b[512];
    bex__ps_fwd_put(b, &(struct bex__ps_fwd_hdr){.session = session, .lsn = 1u << 20});
    size_t len = BEX__PS_FWD_HDR_LEN + push_body(b + BEX__PS_FWD_HDR_LEN, key, seq);
    return call_method(p->ch[r], p->cctx, BEX_PS_M_FORWARD, b, len);
}

/* Replica r's epoch and whether it is in step, under its lock. */
static uint64_t epoch_of(struct fo *p, int r, bool *synced)
{
    pthread_mutex_lock(&p->s[r]->mu);
    uint64_t e = p->s[r]->rp.epoch;
    if (synced)
        *synced = p->s[r]->rp.state == RP_BACKUP;
    pthread_mutex_unlock(&p->s[r]->mu);
    return e;
}

static int t_refusals(void)
{
    struct fo p = {0};
    int prim = fo_up(&p);
    for (int i = 0; i < 8; i++)
        push_one(&p);
    int bk = (prim + 1) % NREP;
    uint8_t b[256];
    /* a client that keeps Pushing to a backup: refused, counted, said 7 times */
    size_t len = push_body(b, 1000 + (p.seq + 1) % NKEY, p.seq + 1);
    uint64_t np0 = stats(p.s[bk]).not_primary; /* push_one's tries there */
    int lines0 = atomic_load(&backup_lines[bk]), want = 0;
    for (uint64_t n = np0 + 1; n <= np0 + 40; n++)
        want += !(n & (n - 1));    /* said at the 1st refusal, the 2nd, 4th, ... */
    for (int i = 0; i < 40; i++) { /* 20 a second, as a client retrying: under the site's limit */
        CHECK_EQ(call_raw(p.ch[bk], p.cctx, b, len), -EPERM);
        bex_test_sleep_ms(50);
    }
    CHECK_EQ(stats(p.s[bk]).not_primary, np0 + 40);
    CHECK_EQ(atomic_load(&backup_lines[bk]) - lines0, want);
    /* a client Push naming a term to come: refused, counted, not applied */
    uint64_t e = epoch_of(&p, prim, NULL);
    bex_ps_shard_stats st0 = stats(p.s[prim]);
    len = push_body_ep(b, 1000 + (p.seq + 1) % NKEY, p.seq + 1, true, e + 1000);
    CHECK_EQ(call_epoch(p.ch[prim], p.cctx, b, len), -ESTALE);
    bex_ps_shard_stats st1 = stats(p.s[prim]);
    CHECK_EQ(st1.not_primary, st0.not_primary + 1);
    CHECK_EQ(st1.pushes, st0.pushes);
    CHECK_EQ(st1.lsn, st0.lsn);
    CHECK_EQ(epoch_of(&p, prim, NULL), e);
    /* Forwards naming a forged future term and a past one at a backup */
    bool synced = false;
    uint64_t fr = stats(p.s[bk]).fwd_refused, applied = stats(p.s[bk]).fwd_applied;
    CHECK(forward_to(&p, bk, e + 1000, 1000 + (p.seq + 1) % NKEY, p.seq + 1) < 0);
    CHECK(forward_to(&p, bk, e - 1, 1000 + (p.seq + 1) % NKEY, p.seq + 1) < 0);
    CHECK_EQ(stats(p.s[bk]).fwd_refused, fr + 2);
    CHECK_EQ(stats(p.s[bk]).fwd_applied, applied);
    CHECK_EQ(epoch_of(&p, bk, &synced), e);
    CHECK(synced);
    /* the backup still takes the primary's forwards: rows exact everywhere */
    for (int i = 0; i < 8; i++)
        push_one(&p);
    wait_synced(&p, prim);
    CHECK_EQ(epoch_of(&p, bk, NULL), e);
    rows_check(&p);
    fo_stop(&p);
    return 0;
}

/* Whether set names every replica of p, once each. */
static bool set_whole(const char *set, const struct fo *p)
{
    int commas = 0;
    for (const char *c = set; *c; c++)
        commas += *c == ',';
    for (int r = 0; r < NREP; r++) {
        char name[32];
        snprintf(name, sizeof name, "127.0.0.1:%u", ntohs(p->ep[r].addr.in4.sin_port));
        if (!strstr(set, name))
            return false;
    }
    return commas == NREP - 1;
}

static int t_bad_set(void)
{
    struct fo p = {0};
    int prim = fo_up(&p);
    for (int i = 0; i < 10; i++)
        push_one(&p);
    uint64_t e = epoch_of(&p, prim, NULL);
    char set[256];
    set_now(set, sizeof set);
    CHECK(set_whole(set, &p));
    const char *bad[] = {",,garbage", "10.9.9.9:1"};
    for (int k = 0; k < 2; k++) {
        CHECK_OK(bex__elect_put_if(url, "/bex/ps/ps/0/set", bad[k], "/bex/ps/ps/0/primary", e));
        /* the primary writes its own set back */
        for (uint64_t end = bex_test_now_ms() + 10000 * time_scale();; bex_test_sleep_ms(20)) {
            set_now(set, sizeof set);
            if (set_whole(set, &p))
                break;
            CHECK(bex_test_now_ms() < end);
        }
        CHECK_EQ(atomic_load(&bad_set_lines[prim]), k + 1); /* said once each time */
        for (int i = 0; i < 10; i++)
            push_one(&p);
    }
    fo_kill(&p, prim);
    push_one(&p);                           /* acknowledged by the new primary */
    int np = wait_primary(&p, prim, 15000); /* (see wait_primary) */
    CHECK(np >= 0);
    for (int i = 0; i < 10; i++)
        push_one(&p);
    wait_synced(&p, np);
    rows_check(&p);
    fo_stop(&p);
    return 0;
}

/* ---- join: a replica added to the running shard in etcd mode ---- */

struct bg_push {
    struct fo *p;
    atomic_bool stop;
    int n;
};

static void *bg_push_main(void *arg)
{
    struct bg_push *u = arg;
    while (!atomic_load(&u->stop)) {
        push_one(u->p);
        u->n++;
    }
    return NULL;
}

/* Whether the set (or, key "joined", the joined key) names replica r. */
static bool key_names(const struct fo *p, const char *key, int r)
{
    char v[512], name[32], k[64];
    uint64_t cr, mr;
    snprintf(k, sizeof k, "/bex/ps/ps/0/%s", key);
    snprintf(name, sizeof name, "127.0.0.1:%u", ntohs(p->ep[r].addr.in4.sin_port));
    CHECK_OK(bex__elect_get(url, k, &cr, &mr, v, sizeof v));
    return strstr(v, name) != NULL;
}

/* A JOIN of replica r's address naming epoch, sent by the test to
 * replica to. */
static int join_raw(struct fo *p, int to, int r, uint64_t epoch)
{
    uint8_t b[BEX__PS_JOIN6_LEN];
    bex__ps_cut_put(b, &(struct bex__ps_cut_hdr){.op = BEX__PS_CUT_JOIN, .id = epoch});
    size_t n = bex__ps_join_put(b + BEX__PS_CUT_HDR_LEN, &p->ep[r]);
    return call_method(p->ch[to], p->cctx, BEX_PS_M_CUT, b, BEX__PS_CUT_HDR_LEN + n);
}

static int t_join(void)
{
    struct fo p = {0};
    int prim = fo_up(&p);
    for (int i = 0; i < 10; i++)
        push_one(&p);
    struct in_addr a0, a1;
    CHECK(pair_addrs(&a0, &a1) == 0);
    fo_one(&p, NREP, a0); /* listed by none of the three */
    uint64_t e = p.s[prim]->rp.epoch;
    size_t nb = p.s[prim]->rp.n_bk;
    /* another term's JOIN is refused and adds nothing */
    CHECK_EQ(join_raw(&p, prim, NREP, e + 1), -ESTALE);
    CHECK_EQ(join_raw(&p, prim, NREP, e - 1), -ESTALE);
    CHECK_EQ(join_raw(&p, (prim + 1) % NREP, NREP, e), -EPERM); /* a backup */
    CHECK_EQ(p.s[prim]->rp.n_bk, nb);
    CHECK(!key_names(&p, "set", NREP));
    /* started under Pushes, its list naming the four: it JOINs, copies,
     * and is put in the set */
    struct bg_push u = {.p = &p};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, bg_push_main, &u) == 0);
    bex_ps_failover_config fc = {.etcd_url = url,
                                 .replicas = p.ep,
                                 .n_replicas = MAXREP,
                                 .self = NREP,
                                 .lease_ttl_ms = TTL,
                                 .lease_margin_ms = 500};
    CHECK_OK(bex_ps_failover_start(p.s[NREP], p.ctx[NREP], &fc, &p.f[NREP]));
    wait_one(&p, prim, NREP);
    uint64_t applied = stats(p.s[NREP]).fwd_applied;
    for (uint64_t end = bex_test_now_ms() + 10000 * time_scale();
         stats(p.s[NREP]).fwd_applied == applied; bex_test_sleep_ms(20))
        CHECK(bex_test_now_ms() < end); /* forwarded to now */
    atomic_store(&u.stop, true);
    CHECK(pthread_join(th, NULL) == 0);
    fprintf(stderr, "join: %d Pushes acknowledged while the fourth replica joined\n", u.n);
    CHECK(key_names(&p, "set", NREP) && key_names(&p, "joined", NREP));
    CHECK_EQ(p.s[prim]->rp.epoch, e); /* no term change on the way */
    CHECK_EQ(join_raw(&p, prim, NREP, e), -EEXIST);
    for (int i = 0; i < 10; i++)
        push_one(&p);
    wait_synced(&p, prim);
    rows_check(&p); /* the four: exact, equal bit for bit */
    /* the primary dies: the next one (an old backup learns the fourth
     * from etcd, or the fourth itself) keeps every survivor in its set */
    fo_kill(&p, prim);
    push_one(&p);
    int np = wait_primary(&p, prim, 15000); /* (see wait_primary) */
    CHECK(np >= 0);
    for (int i = 0; i < 10; i++)
        push_one(&p);
    wait_synced(&p, np);
    CHECK(key_names(&p, "set", NREP));
    rows_check(&p);
    fo_stop(&p);
    return 0;
}

BEX_TEST_MAIN({"join", t_join}, {"bad_set", t_bad_set}, {"refusals", t_refusals},
              {"kill9", t_kill9}, {"sigstop", t_sigstop}, {"backup_down", t_backup_down},
              {"any_order", t_any_order}, {"proc", t_proc}, {"out_at_election", t_out_at_election})
