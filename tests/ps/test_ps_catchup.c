/* SPDX-License-Identifier: Apache-2.0 */
/* Catch-up of a restarted replica from its peer (issue 10): a replica
 * killed with -9 comes back from its snapshot, pulls its peer's rows and
 * the ids of the Pushes the peer applied (BEX_PS_M_COPY), and applies the
 * Pushes it held meanwhile that the peer's copy lacks, each once.
 *
 * replay: the library alone, in one process: a peer shard behind an RPC
 *   server, a catching-up shard fed Pushes directly; Pushes both have, some
 *   only the catching one has, one held twice: after catch-up both tables
 *   equal the reference, held Pushes counted as applied or left out.
 * hostile: a peer's copy that is garbage, too long, or answered at the
 *   wrong offset fails the catch-up at once; the shard serves its own.
 * behind: a snapshot keeps the ids of the Pushes applied; a peer whose copy
 *   lacks some of them (restarted from an older state) is refused.
 * peer_late: the only peer is unreachable when catch-up starts and listens
 *   500 ms later: it is tried again until the deadline and copied.
 * window: a bex_ps_client's Push the peer applies after its cut while the
 *   client's attempt at the restarted replica fails (its port refuses) is
 *   sent to that replica again once it serves: both end equal, each Push
 *   applied once.
 * resend_bound: the bounds of the Pushes kept (push_resend_max,
 *   push_resend_bytes, the replicas' id window): past them dropped, counted.
 * churn: a directory that renames a replica to a fresh address before
 *   every Push: the client's Push channels and kept Pushes stay bounded,
 *   those of replicas gone are retired (dropped ones counted); every Push
 *   applied once at the peer.
 * resend_hostile: a replica that answers the Pushes kept for it -EAGAIN
 *   forever, with a malformed answer, refuses every call, applies them and
 *   never answers, or restarts in a loop: memory and threads bounded, resends paced, one
 *   out at a time, counted; each Push applied once; destroy does not wait.
 * restart: bex-ps processes, 2 shards x 2 replicas; a thread Pushes all the
 *   time; replica 1 snapshots, is killed -9, Pushes go on, it restarts (its
 *   "ready" comes after catch-up); the two replicas' rows are equal bit for
 *   bit and equal to the reference of every Push made (none missed, none
 *   twice). Without catch-up replica 1 misses the Pushes made between its
 *   snapshot and its restart.
 * etcd: the same with bex-ps --etcd: the peers are found in etcd.
 * peer_dies / peer_hangs: the peer (a fake in the test) dies in the middle
 *   of the copy, or never answers a chunk: the restarted bex-ps still comes
 *   up in time, serving its snapshot, with the failure counted.
 * primary_hangs: a static --primary-backup primary whose backup hangs
 *   (a listener that never accepts) does not serve its snapshot as primary
 *   when its catch-up times out: it stays up, tries again (a second
 *   failure counted), /ready 503 "not ready: catching up", and stops on
 *   SIGTERM. */
#include <dirent.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "ps_prog.h"

/* The sample name{shard="shard"} of the /metrics at url (status 200). */
static double metric(const char *url, const char *name, int shard)
{
    char *text;
    CHECK_EQ(http_get(url, &text), 200);
    char series[128];
    snprintf(series, sizeof series, "%s{shard=\"%d\"}", name, shard);
    double v = sample(text, series);
    free(text);
    return v;
}

/* ---- the cluster ---- */

/* A directory of replica r alone. */
static bex_dir *dir_of_replica(uint16_t ports[NSH][2], int r)
{
    return dir_of_ports(ports[0][r], ports[1][r]);
}

/* Every key's row as replica r serves it. */
static void fetch_replica(bex_ctx *ctx, uint16_t ports[NSH][2], int r, const uint64_t *keys,
                          float *rows)
{
    bex_dir *d = dir_of_replica(ports, r);
    bex_ps_client *pc = client_of(ctx, d);
    CHECK_OK(bex_ps_fetch_sync(pc, TC.id, TC.dim, keys, NK, rows));
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
}

static pid_t start_replica(const char *cluster, const char *dir, int r, const char *const *extra,
                           char *url, size_t url_cap)
{
    const char *args[24] = {"--cluster",   cluster,       "--shard",        "all",
                            "--replica",   r ? "1" : "0", "--table",        "1:8:sgd:0.1",
                            "--transport", "tcp",         "--snapshot-dir", dir};
    size_t n = 12;
    if (url_cap) {
        args[n++] = "--metrics-port";
        args[n++] = "0";
    }
    for (size_t i = 0; extra && extra[i]; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    return bex_ps_start(args, url, url_cap);
}

static void cleanup(const char *dir, const char *cluster)
{
    for (int r = 0; r < 2; r++)
        for (int s = 0; s < NSH; s++) {
            char p[192];
            snap_path(p, sizeof p, dir, s, r);
            unlink(p);
        }
    unlink(cluster);
    CHECK(rmdir(dir) == 0); /* nothing else left behind */
}

/* ---- the library in one process (replay, hostile, behind) ---- */

/* The peer's context on ADDR0 (*a0) and the catching-up replica's on
 * ADDR1: 0, or what the case returns (no addresses; natively over TCP
 * only). */
static int lib_ctxs(struct in_addr *a0, bex_ctx **pctx, bex_ctx **rctx)
{
    struct in_addr a1;
    int rc = pair_addrs(a0, &a1);
    if (rc)
        return rc;
    if (!pair_tcp())
        return bex_test_skip("natively over TCP only");
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config c0 = scaled(&base, *a0), c1 = scaled(&base, a1);
    CHECK_OK(bex_ctx_create(&c0, pctx));
    CHECK_OK(bex_ctx_create(&c1, rctx));
    return 0;
}

/* Shard 0's keys (their indexes among all NK keys into idx), and ref the
 * reference of all NK keys; returns how many keys. */
static int shard0_keys(uint64_t *keys, int *idx, struct ref *ref)
{
    int n = 0;
    for (int i = 0; i < NK; i++)
        if (bex_ps_key_shard(key_of(i), NSH) == 0) {
            idx[n] = i;
            keys[n++] = key_of(i);
        }
    uint64_t all_keys[NK];
    int all[NK];
    keys_init(all_keys, all);
    ref_init(ref, &TC, all_keys);
    return n;
}

/* The peer's RPC server on a0: h answers COPY (user: the peer's context),
 * or with h NULL the shard's own methods; its address into *addr. */
static bex_rpc_server *peer_server(bex_ctx *pctx, struct in_addr a0, bex_ps_shard *shard,
                                   bex_rpc_handler h, bex_addr *addr)
{
    bex_rpc_server *srv;
    CHECK_OK(bex_rpc_server_create(pctx, NULL, &srv));
    if (h)
        CHECK_OK(bex_rpc_server_register(srv, BEX_PS_SERVICE, BEX_PS_M_COPY, 0, h, pctx));
    else
        CHECK_OK(bex_ps_shard_register(shard, srv, pctx));
    bex_addr la = {.in4 = {.sin_family = AF_INET, .sin_addr = a0}};
    CHECK_OK(bex_rpc_server_listen(srv, &la));
    bex_rpc_server_addr(srv, addr);
    return srv;
}

/* ---- replay ---- */

/* A Push body with id (client, seq) for keys[0..n) of table TC. */
static void *push_body(const uint64_t *keys, int n, const float *g, uint64_t client, uint64_t seq,
                       size_t *len)
{
    struct bex__ps_hdr h = {.table = TC.id,
                            .n = (uint32_t)n,
                            .dim = TC.dim,
                            .flags = BEX__PS_F_ID,
                            .id_client = client,
                            .id_seq = seq};
    *len = bex__ps_req_len(BEX_PS_M_PUSH, (uint32_t)n, TC.dim) + BEX__PS_ID_LEN;
    uint8_t *b = malloc(*len);
    CHECK(b);
    bex__ps_hdr_put(b, &h);
    uint8_t *p = b + bex__ps_keys_off(&h);
    for (int i = 0; i < n; i++, p += 8)
        bex__ps_put64(p, keys[i]);
    for (int i = 0; i < n * (int)TC.dim; i++, p += 4)
        bex__ps_putf(p, g[i]);
    return b;
}

static int serve(bex_ps_shard *s, bex_ctx *ctx, uint32_t m, const void *b, size_t len)
{
    void *resp = NULL;
    size_t rlen = 0;
    int rc = bex_ps_shard_serve(s, ctx, m, b, len, &resp, &rlen);
    bex_rpc_free(resp);
    return rc;
}

static void fetch_shard(bex_ps_shard *s, bex_ctx *ctx, const uint64_t *keys, int n, float *rows)
{
    size_t len = bex__ps_req_len(BEX_PS_M_FETCH, (uint32_t)n, TC.dim);
    uint8_t *b = malloc(len);
    CHECK(b);
    bex__ps_hdr_put(b, &(struct bex__ps_hdr){.table = TC.id, .n = (uint32_t)n, .dim = TC.dim});
    for (int i = 0; i < n; i++)
        bex__ps_put64(b + BEX__PS_HDR_LEN + 8 * i, keys[i]);
    void *resp = NULL;
    size_t rlen = 0;
    CHECK_OK(bex_ps_shard_serve(s, ctx, BEX_PS_M_FETCH, b, len, &resp, &rlen));
    CHECK_EQ(rlen, BEX__PS_HDR_LEN + (size_t)n * TC.dim * 4);
    for (int i = 0; i < n * (int)TC.dim; i++)
        rows[i] = bex__ps_getf((uint8_t *)resp + BEX__PS_HDR_LEN + 4 * i);
    bex_rpc_free(resp);
    free(b);
}

/* A shard 0 of table TC (flags: BEX_PS_SHARD_*; snapshot: NULL for none). */
static bex_ps_shard *shard0(uint32_t flags, const char *snapshot)
{
    bex_ps_shard_config pc = {.shard = 0,
                              .n_shards = NSH,
                              .tables = &TC,
                              .n_tables = 1,
                              .flags = flags,
                              .snapshot_path = snapshot};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create(&pc, &s));
    return s;
}

/* A case's Pushes 1..q_max (client's ids, gradients of seed step * q) to
 * shard 0's n keys (their indexes among all NK into idx), and ref the
 * reference of all NK keys with every one of them applied. Static storage:
 * too large for a stack. */
#define PUSHES_MAX 8
struct pushes {
    uint64_t keys[NK];
    int idx[NK];
    int n, q_max;
    struct ref ref;
    float g[PUSHES_MAX][NK * DMAX];
    void *body[PUSHES_MAX];
    size_t blen[PUSHES_MAX];
};

static void pushes_make(struct pushes *p, int q_max, uint64_t client, int step)
{
    CHECK(q_max < PUSHES_MAX);
    p->q_max = q_max;
    p->n = shard0_keys(p->keys, p->idx, &p->ref);
    for (int q = 1; q <= q_max; q++) {
        grads_of(p->g[q], p->n, TC.dim, step * q);
        p->body[q] = push_body(p->keys, p->n, p->g[q], client, (uint64_t)q, &p->blen[q]);
        ref_push(&p->ref, p->idx, p->n, p->g[q]);
    }
}

static void pushes_free(struct pushes *p)
{
    for (int q = 1; q <= p->q_max; q++)
        free(p->body[q]);
}

/* Push q to shard s (the one of ctx): taken. */
static void push_to(bex_ps_shard *s, bex_ctx *ctx, const struct pushes *p, int q)
{
    CHECK_OK(serve(s, ctx, BEX_PS_M_PUSH, p->body[q], p->blen[q]));
}

/* Shard s's rows (the one of ctx) are the reference's. */
static void shard_check(const struct pushes *p, bex_ps_shard *s, bex_ctx *ctx)
{
    static float rows[NK * DMAX];
    fetch_shard(s, ctx, p->keys, p->n, rows);
    ref_check(&p->ref, p->idx, p->n, rows);
}

/* The peer's rows and the restarted replica's: equal, bit for bit, and the
 * reference's. */
static void shards_match(const struct pushes *p, bex_ps_shard *peer, bex_ctx *pctx,
                         bex_ps_shard *rs, bex_ctx *rctx)
{
    static float r0[NK * DMAX], r1[NK * DMAX];
    fetch_shard(peer, pctx, p->keys, p->n, r0);
    fetch_shard(rs, rctx, p->keys, p->n, r1);
    CHECK(memcmp(r0, r1, (size_t)p->n * TC.dim * 4) == 0);
    ref_check(&p->ref, p->idx, p->n, r1);
}

/* The catch-up counts of shard rs. */
static void catchup_counts(bex_ps_shard *rs, uint64_t rows, uint64_t replayed, uint64_t skipped,
                           uint64_t failed)
{
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(rs, &st);
    CHECK_EQ(st.catchup_rows, rows);
    CHECK_EQ(st.catchup_replayed, replayed);
    CHECK_EQ(st.catchup_skipped, skipped);
    CHECK_EQ(st.catchup_failed, failed);
}

/* The end of a library case: the peer's server and shard (either may be
 * NULL), the restarted replica's shard (may be NULL), both contexts. */
static void lib_down(bex_rpc_server *srv, bex_ps_shard *peer, bex_ps_shard *rs, bex_ctx *pctx,
                     bex_ctx *rctx)
{
    if (srv)
        CHECK_OK(bex_rpc_server_destroy(srv));
    bex_ps_shard_destroy(peer);
    bex_ps_shard_destroy(rs);
    CHECK_OK(bex_ctx_destroy(pctx));
    CHECK_OK(bex_ctx_destroy(rctx));
}

static int t_replay(void)
{
    struct in_addr a0;
    bex_ctx *pctx, *rctx;
    PAIR_NEED(lib_ctxs(&a0, &pctx, &rctx));
    bex_ps_shard *peer = shard0(0, NULL), *rs = shard0(BEX_PS_SHARD_CATCHUP, NULL);
    bex_rpc_endpoint eps[2] = {{.addr = {.in4 = {.sin_family = AF_INET,
                                                 .sin_addr = a0,
                                                 .sin_port = htons(free_port())}}}, /* nobody */
                               {.locality = NULL}};
    bex_rpc_server *srv = peer_server(pctx, a0, peer, NULL, &eps[1].addr);

    /* Push q (1..7) of client 0xc1: its rows move by its grads */
    static struct pushes P;
    pushes_make(&P, 7, 0xc1, 10);
    CHECK(P.n >= 8);
    /* the peer applied 1..5 before the cut */
    for (int q = 1; q <= 5; q++)
        push_to(peer, pctx, &P, q);
    /* the restarted one got 3..7 (7 twice: a retry after its restart)
     * while catching up: held, answered; no Fetch, no copy from it */
    for (int q = 3; q <= 7; q++)
        push_to(rs, rctx, &P, q);
    push_to(rs, rctx, &P, 7);
    {
        size_t len = bex__ps_req_len(BEX_PS_M_FETCH, 1, TC.dim);
        uint8_t b[64];
        bex__ps_hdr_put(b, &(struct bex__ps_hdr){.table = TC.id, .n = 1, .dim = TC.dim});
        bex__ps_put64(b + BEX__PS_HDR_LEN, P.keys[0]);
        CHECK_EQ(serve(rs, rctx, BEX_PS_M_FETCH, b, len), -EAGAIN);
        bex__ps_copy_put(b, &(struct bex__ps_copy_hdr){.op = BEX__PS_COPY_OPEN});
        CHECK_EQ(serve(rs, rctx, BEX_PS_M_COPY, b, BEX__PS_COPY_HDR_LEN), -EAGAIN);
    }
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(rs, &st);
    CHECK_EQ(st.held, 6);
    CHECK_EQ(st.pushes, 0);
    /* the dead peer first, then the live one; small chunks: many of them */
    bex_ps_catchup_config cu = {
        .peers = eps, .n_peers = 2, .timeout_ms = 20000 * time_scale(), .chunk_bytes = 100};
    CHECK_OK(bex_ps_shard_catchup(rs, rctx, &cu));
    CHECK_EQ(bex_ps_shard_catchup(rs, rctx, &cu), -EINVAL); /* once */
    /* replayed: 6 and 7; skipped: 3, 4, 5 (the peer's) and 7's retry */
    catchup_counts(rs, (uint64_t)P.n, 2, 4, 0);
    bex_ps_shard_stats_get(rs, &st);
    CHECK_EQ(st.pushes, 2);
    bex_ps_shard_stats ps;
    bex_ps_shard_stats_get(peer, &ps);
    CHECK_EQ(ps.copies_served, 1);
    /* the peer gets 6 and 7 now; 7 again at the restarted one: an id it
     * applied, not applied twice */
    for (int q = 6; q <= 7; q++)
        push_to(peer, pctx, &P, q);
    push_to(rs, rctx, &P, 7);
    bex_ps_shard_stats_get(rs, &st);
    CHECK_EQ(st.pushes, 2);
    CHECK_EQ(st.dup_ids, 1);
    shards_match(&P, peer, pctx, rs, rctx);
    pushes_free(&P);
    lib_down(srv, peer, rs, pctx, rctx);
    return 0;
}

/* ---- hostile: a peer whose copy is wrong ---- */

static _Atomic int hostile_mode;
enum { H_GARBAGE, H_HUGE, H_OFFSET, H_EMPTY_CHUNK, H_N };

static void hostile_copy(bex_rpc_req *req, void *body, size_t len, void *user)
{
    bex_ctx *ctx = user;
    struct bex__ps_copy_hdr h;
    CHECK_OK(bex__ps_copy_get(body, len, &h));
    bex_rpc_free(body);
    int mode = atomic_load(&hostile_mode);
    struct bex__ps_copy_hdr a = h;
    size_t n = 0;
    if (h.op == BEX__PS_COPY_OPEN) {
        a.session = 7;
        a.offset = mode == H_HUGE ? (2ull << 30) : 100; /* its length */
    } else if (h.op == BEX__PS_COPY_CHUNK) {
        n = mode == H_EMPTY_CHUNK ? 0 : 100 - (size_t)h.offset;
        if (mode == H_OFFSET)
            a.offset = h.offset + 1;
    }
    uint8_t *out = bex_rpc_alloc(ctx, BEX__PS_COPY_HDR_LEN + n);
    CHECK(out);
    memset(out, 0x5a, BEX__PS_COPY_HDR_LEN + n);
    bex__ps_copy_put(out, &a);
    bex_rpc_reply(req, 0, out, BEX__PS_COPY_HDR_LEN + n);
}

/* A peer that sends 100 bytes of garbage (-EBADMSG: its checksum), claims
 * 2 GiB (-E2BIG, past max_bytes 1 GiB: nothing allocated for it), echoes
 * another offset or sends an empty chunk (-EBADMSG): each catch-up fails
 * at once, counted, and the shard serves its own rows and the Push it
 * held. */
static int t_hostile(void)
{
    struct in_addr a0;
    bex_ctx *pctx, *rctx;
    PAIR_NEED(lib_ctxs(&a0, &pctx, &rctx));
    bex_rpc_endpoint ep = {.locality = NULL};
    bex_rpc_server *srv = peer_server(pctx, a0, NULL, hostile_copy, &ep.addr);
    static struct pushes P;
    pushes_make(&P, 1, 0xc3, 5);
    const int want[H_N] = {-EBADMSG, -E2BIG, -EBADMSG, -EBADMSG};
    for (int m = 0; m < H_N; m++) {
        atomic_store(&hostile_mode, m);
        bex_ps_shard *rs = shard0(BEX_PS_SHARD_CATCHUP, NULL);
        push_to(rs, rctx, &P, 1);
        bex_ps_catchup_config cu = {.peers = &ep, .n_peers = 1, .timeout_ms = 20000 * time_scale()};
        uint64_t t0 = pair_now_ms();
        CHECK_EQ(bex_ps_shard_catchup(rs, rctx, &cu), want[m]);
        CHECK(pair_now_ms() - t0 < 5000ull * time_scale()); /* at once, not by the deadline */
        catchup_counts(rs, 0, 1, 0, 1);
        shard_check(&P, rs, rctx);
        bex_ps_shard_destroy(rs);
    }
    pushes_free(&P);
    lib_down(srv, NULL, NULL, pctx, rctx);
    return 0;
}

/* ---- behind: the peer lacks what this replica's snapshot has ---- */

/* Issue 23 item 3 on a replica restored by catch-up: the peer applied
 * Pushes 900 and 2000 of a client; the caught-up replica refuses 900
 * again (1100 behind: -ESTALE, counted) and answers 2000 as a duplicate;
 * nothing is applied twice. On the code before, 900 was applied again. */
static int t_stale(void)
{
    struct in_addr a0;
    bex_ctx *pctx, *rctx;
    PAIR_NEED(lib_ctxs(&a0, &pctx, &rctx));
    bex_ps_shard *peer = shard0(0, NULL), *rs = shard0(BEX_PS_SHARD_CATCHUP, NULL);
    bex_rpc_endpoint ep = {.addr = {.sa = {0}}};
    bex_rpc_server *srv = peer_server(pctx, a0, peer, NULL, &ep.addr);
    uint64_t keys[NK];
    int idx[NK];
    struct ref ref;
    CHECK(shard0_keys(keys, idx, &ref) >= 1);
    float g[64] = {0.5f};
    size_t l900, l2000;
    void *b900 = push_body(keys, 1, g, 0xc1, 900, &l900);
    void *b2000 = push_body(keys, 1, g, 0xc1, 2000, &l2000);
    CHECK_OK(serve(peer, pctx, BEX_PS_M_PUSH, b900, l900));
    CHECK_OK(serve(peer, pctx, BEX_PS_M_PUSH, b2000, l2000));
    bex_ps_catchup_config cu = {.peers = &ep, .n_peers = 1, .timeout_ms = 20000 * time_scale()};
    CHECK_OK(bex_ps_shard_catchup(rs, rctx, &cu));
    CHECK_EQ(serve(rs, rctx, BEX_PS_M_PUSH, b900, l900), -ESTALE);
    CHECK_OK(serve(rs, rctx, BEX_PS_M_PUSH, b2000, l2000));
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(rs, &st);
    CHECK(st.pushes == 0 && st.stale_ids == 1 && st.dup_ids == 1);
    free(b900);
    free(b2000);
    lib_down(srv, peer, rs, pctx, rctx);
    return 0;
}

/* Snapshots keep the ids of the Pushes applied: a shard loaded from one
 * does not apply such a Push again; and its catch-up refuses a peer whose
 * copy lacks them (a peer restarted from an older snapshot: copying it
 * would lose Pushes), falling back to the snapshot plus the held Pushes. */
static int t_behind(void)
{
    struct in_addr a0;
    bex_ctx *pctx, *rctx;
    PAIR_NEED(lib_ctxs(&a0, &pctx, &rctx));
    char tmpl[] = "/tmp/bex-ps-catchup-XXXXXX";
    CHECK(mkdtemp(tmpl));
    char snap[128];
    snprintf(snap, sizeof snap, "%s/s.snap", tmpl);
    static struct pushes P;
    pushes_make(&P, 3, 0xc2, 20);
    /* this replica's first life: Pushes 1 and 2, snapshot */
    bex_ps_shard *rs = shard0(0, NULL);
    for (int q = 1; q <= 2; q++)
        push_to(rs, rctx, &P, q);
    CHECK_OK(bex_ps_shard_snapshot(rs, snap));
    bex_ps_shard_destroy(rs);
    /* loaded: Push 2 again is not applied */
    rs = shard0(0, snap);
    push_to(rs, rctx, &P, 2);
    bex_ps_shard_stats st;
    bex_ps_shard_stats_get(rs, &st);
    CHECK_EQ(st.pushes, 0);
    CHECK_EQ(st.dup_ids, 1);
    bex_ps_shard_destroy(rs);
    /* the peer restarted empty (it had only Push 1 ... and lost it) */
    bex_ps_shard *peer = shard0(0, NULL);
    push_to(peer, pctx, &P, 1);
    bex_rpc_endpoint ep = {.locality = NULL};
    bex_rpc_server *srv = peer_server(pctx, a0, peer, NULL, &ep.addr);
    /* this replica restarts from its snapshot, catching up; Push 3 held */
    rs = shard0(BEX_PS_SHARD_CATCHUP, snap);
    push_to(rs, rctx, &P, 3);
    bex_ps_catchup_config cu = {.peers = &ep, .n_peers = 1, .timeout_ms = 20000 * time_scale()};
    CHECK_EQ(bex_ps_shard_catchup(rs, rctx, &cu), -ESTALE);
    catchup_counts(rs, 0, 1, 0, 1);
    /* its own rows: Pushes 1-3, not the peer's (1 only) */
    shard_check(&P, rs, rctx);
    pushes_free(&P);
    lib_down(srv, peer, rs, pctx, rctx);
    CHECK(unlink(snap) == 0);
    CHECK(rmdir(tmpl) == 0);
    return 0;
}

/* ---- peer_late: the only peer unreachable when catch-up starts ---- */

static struct {
    bex_ctx *ctx;
    bex_ps_shard *shard;
    bex_addr addr;
    bex_rpc_server *srv;
} late;

/* The peer's server, listening only after 500 ms (the catch-up meanwhile
 * finds nobody at its address). */
static void *late_listen(void *arg)
{
    (void)arg;
    pair_sleep_ms(500);
    CHECK_OK(bex_rpc_server_create(late.ctx, NULL, &late.srv));
    CHECK_OK(bex_ps_shard_register(late.shard, late.srv, late.ctx));
    CHECK_OK(bex_rpc_server_listen(late.srv, &late.addr));
    return NULL;
}

/* A peer that refuses at first (its server not up yet, as a peer whose
 * connection cannot be made at once on a loaded host) is tried again until
 * the deadline: the catch-up copies it, not its snapshot alone. On the
 * one-pass catch-up it failed at once (the first refusal) and the shard
 * lacked Pushes 1 and 2. */
static int t_peer_late(void)
{
    struct in_addr a0;
    bex_ctx *rctx;
    PAIR_NEED(lib_ctxs(&a0, &late.ctx, &rctx));
    late.shard = shard0(0, NULL);
    bex_ps_shard *rs = shard0(BEX_PS_SHARD_CATCHUP, NULL);
    static struct pushes P;
    pushes_make(&P, 3, 0xc4, 40);
    /* the peer applied 1 and 2; the restarted one holds 2 and 3 */
    for (int q = 1; q <= 2; q++)
        push_to(late.shard, late.ctx, &P, q);
    for (int q = 2; q <= 3; q++)
        push_to(rs, rctx, &P, q);
    late.addr =
        (bex_addr){.in4 = {.sin_family = AF_INET, .sin_addr = a0, .sin_port = htons(free_port())}};
    bex_rpc_endpoint ep = {.addr = late.addr};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, late_listen, NULL) == 0);
    bex_ps_catchup_config cu = {.peers = &ep, .n_peers = 1, .timeout_ms = 5000 * time_scale()};
    uint64_t t0 = pair_now_ms();
    int rc = bex_ps_shard_catchup(rs, rctx, &cu);
    uint64_t took = pair_now_ms() - t0;
    CHECK(pthread_join(th, NULL) == 0);
    fprintf(stderr, "catch-up: %s after %llu ms\n", bex_strerror(rc), (unsigned long long)took);
    CHECK_OK(rc);
    CHECK(took >= 400); /* it waited for the peer */
    /* replayed: 3; skipped: 2 (the peer's) */
    catchup_counts(rs, (uint64_t)P.n, 1, 1, 0);
    bex_ps_shard_stats ps;
    bex_ps_shard_stats_get(late.shard, &ps);
    CHECK_EQ(ps.copies_served, 1);
    /* the peer gets 3 too: both equal each other and the reference */
    push_to(late.shard, late.ctx, &P, 3);
    shards_match(&P, late.shard, late.ctx, rs, rctx);
    pushes_free(&P);
    lib_down(late.srv, late.shard, rs, late.ctx, rctx);
    return 0;
}

/* ---- window: a Push applied at the peer after its cut, its attempt at
 * the restarted replica failed ---- */

/* The directory of the window case: shard 0 at the peer (a0) and at the
 * restarted replica (a1); shard 1 (never pushed to) at the peer. */
static bex_dir *window_dir(const bex_addr *peer, struct in_addr a1, uint16_t p1)
{
    char ip0[INET_ADDRSTRLEN], ip1[INET_ADDRSTRLEN], j[512];
    inet_ntop(AF_INET, &peer->in4.sin_addr, ip0, sizeof ip0);
    inet_ntop(AF_INET, &a1, ip1, sizeof ip1);
    unsigned p0 = ntohs(peer->in4.sin_port);
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":["
             "{\"replicas\":[{\"addr\":\"%s:%u\"},{\"addr\":\"%s:%u\"}]},"
             "{\"replicas\":[{\"addr\":\"%s:%u\"}]}]}}}",
             ip0, p0, ip1, (unsigned)p1, ip0, p0);
    return dir_from_json(j);
}

/* A Push of P's grads q through the client: its report's status at the
 * peer (0: taken) and at the restarted replica into st[0], st[1]. */
static int window_push(bex_ps_client *pc, const struct pushes *P, int q, uint64_t seq,
                       const bex_addr *peer, int st[2])
{
    bex_ps_replica_result res[2];
    size_t nres = 0;
    int rc = seq ? bex_ps_push_seq_sync(pc, seq, TC.id, TC.dim, P->keys, (size_t)P->n, P->g[q], res,
                                        2, &nres)
                 : bex_ps_push_report_sync(pc, TC.id, TC.dim, P->keys, (size_t)P->n, P->g[q], res,
                                           2, &nres);
    CHECK_EQ(nres, 2);
    for (int i = 0; i < 2; i++)
        st[bex_addr_equal(&res[i].addr, peer) ? 0 : 1] = res[i].status;
    return rc;
}

/* The rig of the window and resend_bound cases: the peer (shard 0's
 * first replica, served on a0) and the restarted replica's shard rs, not
 * served: its port p1 on a1 reserved, nobody listening (its Pushes are
 * refused); the directory of both (window_dir); the client's context and
 * the config of a client of them (one attempt a call), to adjust and
 * create. */
struct wrig {
    bex_ctx *pctx, *rctx, *cctx;
    struct in_addr a1;
    uint16_t p1;
    bex_ps_shard *peer, *rs;
    bex_rpc_endpoint ep;        /* the peer's */
    bex_rpc_server *srv, *srv1; /* the peer's; the replica's once wrig_serve */
    bex_dir *d;
    bex_ps_client_config cc;
};

/* w set up, rs made with shard0's flags rs_flags: 0, or what the case
 * returns (lib_ctxs). */
static int wrig_up(struct wrig *w, uint32_t rs_flags)
{
    struct in_addr a0;
    *w = (struct wrig){.srv1 = NULL};
    PAIR_NEED(lib_ctxs(&a0, &w->pctx, &w->rctx));
    CHECK(pair_addrs(&a0, &w->a1) == 0);
    w->peer = shard0(0, NULL);
    w->rs = shard0(rs_flags, NULL);
    w->srv = peer_server(w->pctx, a0, w->peer, NULL, &w->ep.addr);
    w->p1 = bex_test_port_at(w->a1); /* reserved, nobody listening: refused */
    w->d = window_dir(&w->ep.addr, w->a1, w->p1);
    w->cctx = client_ctx();
    w->cc = (bex_ps_client_config){.dir = w->d,
                                   .service = "ps",
                                   .n_shards = NSH,
                                   .timeout_ms = 10000 * time_scale(),
                                   .connect_timeout_ms = 5000 * time_scale(),
                                   .max_attempts = 1};
    return 0;
}

/* The restarted replica served at its port: it answers from now on. */
static void wrig_serve(struct wrig *w)
{
    CHECK_OK(bex_rpc_server_create(w->rctx, NULL, &w->srv1));
    CHECK_OK(bex_ps_shard_register(w->rs, w->srv1, w->rctx));
    bex_addr la = {.in4 = {.sin_family = AF_INET, .sin_addr = w->a1, .sin_port = htons(w->p1)}};
    CHECK_OK(bex_rpc_server_listen(w->srv1, &la));
}

/* w torn down (its clients destroyed first, by the case). */
static void wrig_down(struct wrig *w)
{
    CHECK_OK(bex_ctx_destroy(w->cctx));
    bex_dir_destroy(w->d);
    if (w->srv1)
        CHECK_OK(bex_rpc_server_destroy(w->srv1));
    lib_down(w->srv, w->peer, w->rs, w->pctx, w->rctx);
}

/* The window docs/architecture.md ("Catch-up of a restarted replica")
 * named, made deterministic: the client's Pushes to the restarted replica
 * fail (its port refuses: as its channel not reconnected yet) while the
 * peer takes them. Push 1 before the peer's cut (in the copy), Push 2
 * after it, then the replica serves and Push 3 reaches both. The
 * restarted replica must end with the peer's rows: Push 2, which only the
 * client still has, sent to it again; each Push applied once there (Push
 * 1 came with the copy: sent again, it is a duplicate). */
static int t_window(void)
{
    static struct wrig w;
    PAIR_NEED(wrig_up(&w, BEX_PS_SHARD_CATCHUP));
    bex_ps_shard *peer = w.peer, *rs = w.rs;
    bex_ctx *pctx = w.pctx, *rctx = w.rctx;
    const bex_rpc_endpoint *ep = &w.ep;
    bex_ps_client *pc;
    CHECK_OK(bex_ps_client_create(w.cctx, &w.cc, &pc));
    static struct pushes P;
    pushes_make(&P, 3, 0, 20); /* the bodies unused: the client makes its own */
    int st[2];
    /* Push 1: the peer takes it, the restarted replica's attempt fails */
    CHECK(window_push(pc, &P, 1, 0, &ep->addr, st) != 0);
    CHECK(st[0] == 0 && st[1] != 0);
    /* the peer's cut: Push 1 in it */
    bex_ps_catchup_config cu = {.peers = ep, .n_peers = 1, .timeout_ms = 20000 * time_scale()};
    CHECK_OK(bex_ps_shard_catchup(rs, rctx, &cu));
    catchup_counts(rs, (uint64_t)P.n, 0, 0, 0);
    /* Push 2, after the cut: the peer alone again */
    CHECK(window_push(pc, &P, 2, 0, &ep->addr, st) != 0);
    CHECK(st[0] == 0 && st[1] != 0);
    /* the restarted replica reachable; Push 3 reaches both (its own
     * retries, with its id, until its channel to the replica is back) */
    wrig_serve(&w);
    /* the replica gets Push 2 (sent again): wait for it, to a deadline */
    bex_ps_shard_stats rst;
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    do {
        pair_sleep_ms(10);
        bex_ps_shard_stats_get(rs, &rst);
    } while (rst.pushes < 1 && pair_now_ms() < end);
    /* Push 3: both (the caller's own retries, with its id, until its
     * channel to the replica is back) */
    uint64_t seq3 = bex_ps_push_next_seq(pc);
    end = pair_now_ms() + 10000ull * time_scale();
    while (window_push(pc, &P, 3, seq3, &ep->addr, st) != 0 && pair_now_ms() < end)
        pair_sleep_ms(20);
    CHECK(st[0] == 0 && st[1] == 0);
    bex_ps_shard_stats_get(rs, &rst);
    fprintf(stderr, "restarted replica: %llu Pushes applied, %llu duplicates\n",
            (unsigned long long)rst.pushes, (unsigned long long)rst.dup_ids);
    /* in the peer's order: bit for bit (on the code before, a row short:
     * Push 2 missing) */
    shards_match(&P, peer, pctx, rs, rctx);
    CHECK_EQ(rst.pushes, 2);  /* 2 and 3, once each; 1 came in the copy */
    CHECK_EQ(rst.dup_ids, 1); /* 1 sent again */
    bex_ps_shard_stats pst;
    bex_ps_shard_stats_get(peer, &pst);
    CHECK_EQ(pst.pushes, 3);
    bex_ps_client_stats cs;
    end = pair_now_ms() + 10000ull * time_scale();
    bex_ps_client_stats_get(pc, &cs);
    while (cs.push_held && pair_now_ms() < end) {
        pair_sleep_ms(5);
        bex_ps_client_stats_get(pc, &cs);
    }
    CHECK(cs.push_kept == 2 && cs.push_resent == 2 && cs.push_dropped == 0 && cs.push_held == 0);
    bex_ps_client_destroy(pc);
    pushes_free(&P);
    wrig_down(&w);
    return 0;
}

/* ---- resend_bound: the bounds of the Pushes kept for a replica ---- */

/* push_resend_max 2: of 4 Pushes the replica (its port refusing) failed
 * while the peer took them, the 2 oldest are dropped; the 2 kept fall
 * 1024 behind the client's newest sequence (1100 taken unsent) and are
 * dropped when the replica answers again, not sent (it would refuse them:
 * -ESTALE). push_resend_bytes below a Push's body: none kept. */
static int t_resend_bound(void)
{
    static struct wrig w;
    PAIR_NEED(wrig_up(&w, 0));
    const bex_rpc_endpoint *ep = &w.ep;
    bex_ps_client *pc, *pc2;
    w.cc.push_resend_max = 2;
    CHECK_OK(bex_ps_client_create(w.cctx, &w.cc, &pc));
    w.cc.push_resend_max = 0;
    w.cc.push_resend_bytes = 64; /* less than a Push of the case's keys */
    CHECK_OK(bex_ps_client_create(w.cctx, &w.cc, &pc2));
    static struct pushes P;
    pushes_make(&P, 5, 0, 30);
    int st[2];
    for (int q = 1; q <= 4; q++) {
        CHECK(window_push(pc, &P, q, 0, &ep->addr, st) != 0);
        CHECK(st[0] == 0 && st[1] != 0);
    }
    CHECK(window_push(pc2, &P, 1, 0, &ep->addr, st) != 0);
    CHECK(st[0] == 0 && st[1] != 0);
    bex_ps_client_stats cs;
    bex_ps_client_stats_get(pc, &cs);
    CHECK(cs.push_kept == 4 && cs.push_dropped == 2 && cs.push_held == 2);
    /* the gauges: 2 held now, a Push channel per replica (the peer and
     * the refusing one) */
    static char text[8192];
    CHECK(bex_ps_client_prometheus(pc, "t", text, sizeof text) < (int)sizeof text);
    CHECK(strstr(
        text, "# TYPE bex_ps_client_push_held gauge\nbex_ps_client_push_held{client=\"t\"} 2\n"));
    CHECK(cs.push_channels == 2);
    CHECK(strstr(text, "# TYPE bex_ps_client_push_channels gauge\n"
                       "bex_ps_client_push_channels{client=\"t\"} 2\n"));
    bex_ps_client_stats_get(pc2, &cs);
    CHECK(cs.push_kept == 0 && cs.push_dropped == 1 && cs.push_held == 0);
    for (int i = 0; i < 1100; i++)
        bex_ps_push_next_seq(pc);
    wrig_serve(&w);
    uint64_t seq5 = bex_ps_push_next_seq(pc);
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    while (window_push(pc, &P, 5, seq5, &ep->addr, st) != 0 && pair_now_ms() < end)
        pair_sleep_ms(20);
    CHECK(st[0] == 0 && st[1] == 0);
    bex_ps_client_stats_get(pc, &cs);
    while (cs.push_held && pair_now_ms() < end) {
        pair_sleep_ms(5);
        bex_ps_client_stats_get(pc, &cs);
    }
    fprintf(stderr, "client: %llu kept, %llu dropped, %llu held, %llu resent\n",
            (unsigned long long)cs.push_kept, (unsigned long long)cs.push_dropped,
            (unsigned long long)cs.push_held, (unsigned long long)cs.push_resent);
    CHECK(cs.push_kept == 4 && cs.push_dropped == 4 && cs.push_held == 0 && cs.push_resent == 0);
    bex_ps_shard_stats rst;
    bex_ps_shard_stats_get(w.rs, &rst);
    CHECK(rst.pushes == 1 && rst.stale_ids == 0); /* Push 5 alone; nothing stale sent */
    CHECK(bex_ps_client_prometheus(pc, "t", text, sizeof text) < (int)sizeof text);
    CHECK(strstr(text, "bex_ps_client_push_dropped_total{client=\"t\"} 4\n"));
    CHECK(strstr(text, "bex_ps_client_push_held{client=\"t\"} 0\n"));
    bex_ps_client_destroy(pc);
    bex_ps_client_destroy(pc2);
    pushes_free(&P);
    wrig_down(&w);
    return 0;
}

/* ---- churn: a directory that renames a replica again and again ---- */

/* The directory of the churn case into w->d: shard 0 at the peer and, p1
 * not 0, at a1:p1; shard 1 at a1:q1, or at the peer when q1 is 0. */
static void churn_dir(struct wrig *w, uint16_t p1, uint16_t q1)
{
    char ip0[INET_ADDRSTRLEN], ip1[INET_ADDRSTRLEN], r0[64], r1[64], j[512];
    inet_ntop(AF_INET, &w->ep.addr.in4.sin_addr, ip0, sizeof ip0);
    inet_ntop(AF_INET, &w->a1, ip1, sizeof ip1);
    unsigned p0 = ntohs(w->ep.addr.in4.sin_port);
    snprintf(r0, sizeof r0, ",{\"addr\":\"%s:%u\"}", ip1, (unsigned)p1);
    snprintf(r1, sizeof r1, "{\"addr\":\"%s:%u\"}", q1 ? ip1 : ip0, q1 ? (unsigned)q1 : p0);
    snprintf(j, sizeof j,
             "{\"services\":{\"ps\":{\"shards\":["
             "{\"replicas\":[{\"addr\":\"%s:%u\"}%s]},{\"replicas\":[%s]}]}}}",
             ip0, p0, p1 ? r0 : "", r1);
    char err[256] = "";
    int rc = bex_dir_load_json(w->d, j, err, sizeof err);
    if (rc)
        fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
}

/* The client's stats once pred holds of them, or at a deadline. */
static void churn_wait(bex_ps_client *pc, bex_ps_client_stats *cs,
                       bool (*pred)(const bex_ps_client_stats *))
{
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    bex_ps_client_stats_get(pc, cs);
    while (!pred(cs) && pair_now_ms() < end) {
        pair_sleep_ms(5);
        bex_ps_client_stats_get(pc, cs);
    }
    fprintf(stderr, "client: %llu channels, %llu kept, %llu held, %llu dropped, %llu resent\n",
            (unsigned long long)cs->push_channels, (unsigned long long)cs->push_kept,
            (unsigned long long)cs->push_held, (unsigned long long)cs->push_dropped,
            (unsigned long long)cs->push_resent);
}

#define CHURN 40
static bool churn_none_held(const bex_ps_client_stats *cs)
{
    return cs->push_held == 0;
}
static bool churn_two(const bex_ps_client_stats *cs)
{
    return cs->push_channels == 2;
}

/* Shard 0's second replica renamed to a fresh address before each of
 * CHURN Pushes (a port reserved on a1, nobody listening: a replica
 * restarted on a new port each time, or a hostile directory): its part
 * fails there while the peer takes it, so it is kept for that address.
 * The client keeps the channels and kept Pushes of at most 8 replicas gone
 * from the directory, the rest dropped, counted: 10 channels (the peer's,
 * the listed one's, 8 gone), once the retired are destroyed and no resend
 * to a gone one was out at the last look (Pushes more, to the same
 * directory, until then). Then shard 0 on the
 * peer alone and shard 1 renamed 10 times (its channels never used: retired
 * as they go); once the kept Pushes fall out of the id window (dropped),
 * their channels go too: 2 left. The peer applied every Push once. (On the
 * code before: 41 channels and 40 Pushes held after the first part, 51
 * channels at the end.) */
static int t_churn(void)
{
    static struct wrig w;
    PAIR_NEED(wrig_up(&w, 0));
    bex_ps_client *pc;
    CHECK_OK(bex_ps_client_create(w.cctx, &w.cc, &pc));
    static struct pushes P;
    pushes_make(&P, 1, 0, 40);
    int st[2], pushes = 0;
    for (int i = 0; i < CHURN; i++, pushes++) {
        churn_dir(&w, bex_test_port_at(w.a1), 0);
        if (i)
            ref_push(&P.ref, P.idx, P.n, P.g[1]);
        CHECK(window_push(pc, &P, 1, 0, &w.ep.addr, st) != 0);
        CHECK(st[0] == 0 && st[1] != 0);
    }
    bex_ps_client_stats cs;
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    int more = 0; /* Pushes to the last directory, each a look */
    for (bex_ps_client_stats_get(pc, &cs); cs.push_channels > 10 && pair_now_ms() < end;
         bex_ps_client_stats_get(pc, &cs), more++, pushes++) {
        ref_push(&P.ref, P.idx, P.n, P.g[1]);
        CHECK(window_push(pc, &P, 1, 0, &w.ep.addr, st) != 0);
        CHECK(st[0] == 0 && st[1] != 0);
        pair_sleep_ms(5);
    }
    fprintf(stderr, "client: %llu channels, %llu kept, %llu held, %llu dropped (%d Pushes more)\n",
            (unsigned long long)cs.push_channels, (unsigned long long)cs.push_kept,
            (unsigned long long)cs.push_held, (unsigned long long)cs.push_dropped, more);
    CHECK_EQ(cs.push_channels, 10);
    /* 1 + more kept for the listed one, 1 for each of the 8 gone */
    CHECK(cs.push_kept == (uint64_t)(CHURN + more) && cs.push_resent == 0);
    CHECK_EQ(cs.push_held, (uint64_t)(9 + more));
    CHECK_EQ(cs.push_dropped, (uint64_t)(CHURN - 9));
    for (int i = 0; i < 10; i++, pushes++) {
        churn_dir(&w, 0, bex_test_port_at(w.a1));
        ref_push(&P.ref, P.idx, P.n, P.g[1]);
        CHECK_OK(bex_ps_push_sync(pc, TC.id, TC.dim, P.keys, (size_t)P.n, P.g[1]));
    }
    for (int i = 0; i < 1100; i++)
        bex_ps_push_next_seq(pc);
    churn_wait(pc, &cs, churn_none_held);
    CHECK(cs.push_held == 0 && cs.push_dropped == (uint64_t)(CHURN + more));
    ref_push(&P.ref, P.idx, P.n, P.g[1]); /* one more: the client looks again */
    CHECK_OK(bex_ps_push_sync(pc, TC.id, TC.dim, P.keys, (size_t)P.n, P.g[1]));
    pushes++;
    churn_wait(pc, &cs, churn_two);
    CHECK_EQ(cs.push_channels, 2); /* the peer's and shard 1's listed one */
    bex_ps_shard_stats pst;
    bex_ps_shard_stats_get(w.peer, &pst);
    CHECK_EQ(pst.pushes, (uint64_t)pushes);
    shard_check(&P, w.peer, w.pctx);
    bex_ps_client_destroy(pc);
    pushes_free(&P);
    wrig_down(&w);
    return 0;
}

/* ---- resend_hostile: a replica that answers its kept Pushes badly ---- */

/* What the hostile replica does with a Push (the client's or a resend). */
enum {
    HZ_EAGAIN, /* -EAGAIN, forever */
    HZ_SHORT,  /* status 0 and a 5-byte body: no Push answer */
    HZ_APPLY,  /* applies it to the shard behind it and never answers */
    HZ_HANG,   /* never answers */
    HZ_HONEST, /* applies it and answers as a shard does */
};

#define HZ_HELD_MAX 64
static struct {
    _Atomic int mode;
    bex_ps_shard *shard; /* the rows behind the hostile replica */
    bex_ctx *ctx;
    bex_rpc_server *srv;
    bex_addr addr;
    pthread_mutex_t mu;
    bex_rpc_req *held[HZ_HELD_MAX]; /* requests never answered (until the server goes) */
    size_t n_held;
    _Atomic uint64_t calls;
} hz = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void hz_push(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    int mode = atomic_load(&hz.mode);
    if (mode == HZ_APPLY || mode == HZ_HONEST) {
        void *resp = NULL;
        size_t rlen = 0;
        int rc = bex_ps_shard_serve(hz.shard, hz.ctx, BEX_PS_M_PUSH, body, len, &resp, &rlen);
        if (mode == HZ_HONEST) {
            bex_rpc_free(body);
            bex_rpc_reply(req, rc, resp, rlen);
            atomic_fetch_add(&hz.calls, 1);
            return;
        }
        bex_rpc_free(resp);
    }
    if (mode == HZ_APPLY || mode == HZ_HANG) {
        bex_rpc_free(body);
        pthread_mutex_lock(&hz.mu);
        CHECK(hz.n_held < HZ_HELD_MAX);
        hz.held[hz.n_held++] = req;
        pthread_mutex_unlock(&hz.mu);
    } else if (mode == HZ_SHORT) {
        bex_rpc_reply(req, 0, body, len < 5 ? len : 5); /* the request's first bytes */
    } else {
        bex_rpc_free(body);
        bex_rpc_reply(req, -EAGAIN, NULL, 0);
    }
    atomic_fetch_add(&hz.calls, 1);
}

/* The hostile replica listening at addr (its port fixed across restarts);
 * without the Push method (svc false) it accepts connections and refuses
 * every call (-ENOSYS, the RPC server's own answer). */
static void hz_up_svc(bool svc)
{
    CHECK_OK(bex_rpc_server_create(hz.ctx, NULL, &hz.srv));
    if (svc)
        CHECK_OK(bex_rpc_server_register(hz.srv, BEX_PS_SERVICE, BEX_PS_M_PUSH,
                                         bex__ps_method_flags(BEX_PS_M_PUSH), hz_push, NULL));
    CHECK_OK(bex_rpc_server_listen(hz.srv, &hz.addr));
}

static void hz_up(void)
{
    hz_up_svc(true);
}

/* The hostile replica gone (its connections closed), then the requests it
 * held answered (dropped: nobody is there). */
static void hz_down(void)
{
    CHECK_OK(bex_rpc_server_destroy(hz.srv));
    pthread_mutex_lock(&hz.mu);
    for (size_t i = 0; i < hz.n_held; i++)
        bex_rpc_reply(hz.held[i], -ECANCELED, NULL, 0);
    hz.n_held = 0;
    pthread_mutex_unlock(&hz.mu);
}

/* The hostile replica restarted (svc: with the Push method): gone, and
 * up again once pc's Push channel saw its connection fail, so that the
 * next Push opens a new one to the new server rather than meet the old
 * one closing (it would fail at once, in doubt, never reaching it). */
static void hz_restart(bex_ps_client *pc, bool svc)
{
    bex_ps_client_stats a, b;
    bex_ps_client_stats_get(pc, &a);
    hz_down();
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    do {
        pair_sleep_ms(1);
        bex_ps_client_stats_get(pc, &b);
    } while (b.conn_failures == a.conn_failures && pair_now_ms() < end);
    CHECK(b.conn_failures > a.conn_failures);
    hz_up_svc(svc);
}

/* Wait (to a deadline) until the hostile replica took n calls in all. */
static void hz_wait_calls(uint64_t n)
{
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    while (atomic_load(&hz.calls) < n && pair_now_ms() < end)
        pair_sleep_ms(2);
    if (atomic_load(&hz.calls) < n)
        fprintf(stderr, "the hostile replica took %llu calls, not %llu\n",
                (unsigned long long)atomic_load(&hz.calls), (unsigned long long)n);
    CHECK(atomic_load(&hz.calls) >= n);
}

/* Wait (to a deadline) until pc holds no kept Push; its counters into *cs. */
static void hz_wait_settled(bex_ps_client *pc, bex_ps_client_stats *cs)
{
    uint64_t end = pair_now_ms() + 20000ull * time_scale();
    bex_ps_client_stats_get(pc, cs);
    while (cs->push_held && pair_now_ms() < end) {
        pair_sleep_ms(5);
        bex_ps_client_stats_get(pc, cs);
    }
    CHECK_EQ(cs->push_held, 0);
}

/* The threads of this process. */
static int threads_now(void)
{
    DIR *d = opendir("/proc/self/task");
    CHECK(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* One Push through pc: taken by the peer, the hostile replica's status
 * into *st1. */
static void hz_push_one(bex_ps_client *pc, const struct pushes *P, int i, const bex_addr *peer,
                        int *st1)
{
    int st[2];
    CHECK(window_push(pc, P, 1 + i % P->q_max, 0, peer, st) != 0);
    CHECK_OK(st[0]);
    *st1 = st[1];
}

/* Shard 0 at an honest peer and at a hostile replica; a bex_ps_client
 * keeps at most 8 Pushes for a replica (push_resend_max). The hostile one
 * answers every Push -EAGAIN: 20 kept, 8 held, the 12 oldest dropped; it
 * gets the resends one at a time, paced (50 ms doubling to 1 s: a few in
 * a second, not a loop), and the client's threads do not grow. It answers
 * them with 5 bytes instead of a Push's answer: each dropped (-EBADMSG,
 * as a Push's own part is), not counted sent (on the code before: counted
 * sent, taken for applied). It accepts connections and refuses every
 * call (no Push method): the kept ones dropped (-ENOSYS). It applies Pushes and never answers, and
 * restarts twice: one resend out at a time, each Push applied once
 * behind it (the rest duplicates), every held Push sent once it answers.
 * The peer applies each of the client's Pushes once; the client's
 * destroy with a resend hanging returns before that resend's 10 s
 * deadline. */
static int t_resend_hostile(void)
{
    struct in_addr a0, a1;
    bex_ctx *pctx;
    PAIR_NEED(lib_ctxs(&a0, &pctx, &hz.ctx));
    CHECK(pair_addrs(&a0, &a1) == 0);
    bex_ps_shard *peer = shard0(0, NULL);
    hz.shard = shard0(0, NULL);
    bex_rpc_endpoint ep = {.locality = NULL};
    bex_rpc_server *srv = peer_server(pctx, a0, peer, NULL, &ep.addr);
    uint16_t p1 = bex_test_port_at(a1);
    hz.addr = (bex_addr){.in4 = {.sin_family = AF_INET, .sin_addr = a1, .sin_port = htons(p1)}};
    atomic_store(&hz.mode, HZ_EAGAIN);
    hz_up();
    bex_dir *d = window_dir(&ep.addr, a1, p1);
    bex_ctx *cctx = client_ctx();
    bex_ps_client_config cc = {.dir = d,
                               .service = "ps",
                               .n_shards = NSH,
                               /* the peer's part in time at load 20; the
                                  hostile one's, when it hangs, then */
                               .timeout_ms = 1000 * time_scale(),
                               .connect_timeout_ms = 5000 * time_scale(),
                               .max_attempts = 1,
                               .push_resend_max = 8};
    bex_ps_client *pc;
    CHECK_OK(bex_ps_client_create(cctx, &cc, &pc));
    static struct pushes P;
    pushes_make(&P, 7, 0, 40);
    int st1, made = 0;
    bex_ps_client_stats cs;

    /* -EAGAIN forever */
    hz_push_one(pc, &P, made++, &ep.addr, &st1); /* the channels and the keeping thread made */
    CHECK_EQ(st1, -EAGAIN);
    int threads = threads_now();
    while (made < 20) {
        hz_push_one(pc, &P, made++, &ep.addr, &st1);
        CHECK_EQ(st1, -EAGAIN);
    }
    bex_ps_client_stats_get(pc, &cs);
    CHECK(cs.push_kept == 20 && cs.push_held == 8 && cs.push_dropped == 12);
    uint64_t t0 = pair_now_ms(), c0 = atomic_load(&hz.calls);
    hz_wait_calls(c0 + 2); /* sent again, refused again */
    pair_sleep_ms(600);    /* a window to count them in */
    uint64_t resends = atomic_load(&hz.calls) - c0, took = pair_now_ms() - t0;
    fprintf(stderr, "-EAGAIN forever: %llu resends in %llu ms\n", (unsigned long long)resends,
            (unsigned long long)took);
    /* 50, 100, 200, 400, 800 ms, then every 1 s: at most log2(took / 50)
     * + took / 1000 + 2 */
    CHECK(resends <= 6 + took / 1000);
    CHECK_EQ(threads_now(), threads);
    bex_ps_client_stats_get(pc, &cs);
    CHECK(cs.push_held == 8 && cs.push_resent == 0 && cs.push_dropped == 12);

    /* a malformed answer: not a Push's */
    atomic_store(&hz.mode, HZ_SHORT);
    hz_wait_settled(pc, &cs);
    fprintf(stderr, "short answers: kept %llu, sent again %llu, dropped %llu\n",
            (unsigned long long)cs.push_kept, (unsigned long long)cs.push_resent,
            (unsigned long long)cs.push_dropped);
    CHECK(cs.push_resent == 0 && cs.push_dropped == 20);
    hz_push_one(pc, &P, made++, &ep.addr, &st1); /* its own part's answer: the same */
    CHECK_EQ(st1, -EBADMSG);
    bex_ps_client_stats_get(pc, &cs);
    CHECK(cs.push_kept == 20 && cs.push_held == 0);

    /* 2 kept (-EAGAIN), then it accepts connections and refuses every
     * call: dropped (-ENOSYS), as a Push's own part is not kept */
    atomic_store(&hz.mode, HZ_EAGAIN);
    for (int i = 0; i < 2; i++) {
        hz_push_one(pc, &P, made++, &ep.addr, &st1);
        CHECK_EQ(st1, -EAGAIN);
    }
    hz_restart(pc, false);
    hz_wait_settled(pc, &cs);
    CHECK(cs.push_kept == 22 && cs.push_resent == 0 && cs.push_dropped == 22);
    hz_push_one(pc, &P, made++, &ep.addr, &st1);
    CHECK_EQ(st1, -ENOSYS);
    bex_ps_client_stats_get(pc, &cs);
    CHECK(cs.push_kept == 22 && cs.push_held == 0);
    hz_restart(pc, true);

    /* applied behind it, never answered; restarted twice */
    atomic_store(&hz.mode, HZ_APPLY);
    c0 = atomic_load(&hz.calls);
    for (int i = 0; i < 2; i++) {
        hz_push_one(pc, &P, made++, &ep.addr, &st1);
        CHECK(st1 == -ETIMEDOUT || st1 == -EIO);
    }
    hz_wait_calls(c0 + 3); /* both, and the oldest sent again: applied, hanging */
    for (int r = 0; r < 2; r++) {
        c0 = atomic_load(&hz.calls);
        hz_restart(pc, true);
        hz_wait_calls(c0 + 1); /* sent again to the new one */
    }
    pthread_mutex_lock(&hz.mu);
    CHECK_EQ(hz.n_held, 1); /* one resend out at a time */
    pthread_mutex_unlock(&hz.mu);
    CHECK_EQ(threads_now(), threads);
    atomic_store(&hz.mode, HZ_HONEST);
    hz_restart(pc, true);
    hz_wait_settled(pc, &cs);
    bex_ps_shard_stats hst, pst;
    bex_ps_shard_stats_get(hz.shard, &hst);
    bex_ps_shard_stats_get(peer, &pst);
    fprintf(stderr,
            "restarts: kept %llu, sent again %llu, dropped %llu; behind the hostile replica "
            "%llu applied, %llu duplicates; the peer %llu applied, %llu duplicates\n",
            (unsigned long long)cs.push_kept, (unsigned long long)cs.push_resent,
            (unsigned long long)cs.push_dropped, (unsigned long long)hst.pushes,
            (unsigned long long)hst.dup_ids, (unsigned long long)pst.pushes,
            (unsigned long long)pst.dup_ids);
    CHECK(cs.push_kept == 24 && cs.push_resent == 2 && cs.push_dropped == 22);
    CHECK_EQ(hst.pushes, 2);    /* each once */
    CHECK(hst.dup_ids >= 3);    /* the original, then at least the resends before each restart */
    CHECK_EQ(pst.pushes, made); /* every one of the client's, once */
    CHECK_EQ(pst.dup_ids, 0);

    /* a resend hanging at the client's destroy */
    atomic_store(&hz.mode, HZ_HANG);
    c0 = atomic_load(&hz.calls);
    hz_push_one(pc, &P, made++, &ep.addr, &st1);
    CHECK(st1 == -ETIMEDOUT || st1 == -EIO);
    hz_wait_calls(c0 + 2); /* it, and sent again */
    t0 = pair_now_ms();
    bex_ps_client_destroy(pc);
    took = pair_now_ms() - t0;
    fprintf(stderr, "destroy with a resend hanging: %llu ms\n", (unsigned long long)took);
    CHECK(took < 9000); /* not the resend's 10 s deadline */
    CHECK_OK(bex_ctx_destroy(cctx));
    bex_dir_destroy(d);
    hz_down();
    pushes_free(&P);
    lib_down(srv, peer, hz.shard, pctx, hz.ctx);
    return 0;
}

/* ---- restart: bex-ps processes, kill -9 while Pushes go on ---- */

static struct {
    bex_ps_client *pc;
    uint16_t (*ports)[2];
    uint64_t keys[NK];
    int all[NK];
    struct ref ref; /* every Push made */
    pthread_t th;
    _Atomic int done, stop;
    _Atomic int r1_failed; /* Pushes replica 1 did not take (it was down) */
} pu;

static void *pusher(void *arg)
{
    (void)arg;
    static float g[NK * DMAX];
    for (int i = 0; !atomic_load(&pu.stop); i++) {
        grads_of(g, NK, TC.dim, 100 + i);
        bex_ps_replica_result res[2 * NSH];
        size_t nres = 0;
        int rc = bex_ps_push_report_sync(pu.pc, TC.id, TC.dim, pu.keys, NK, g, res, 2 * NSH, &nres);
        CHECK_EQ(nres, 2 * NSH);
        /* replica 0 (never down) applied every Push: it is in the
         * reference; replica 1 must end up with it too */
        bool r1_failed = false;
        for (size_t k = 0; k < nres; k++) {
            bool is_r1 = ntohs(res[k].addr.in4.sin_port) == pu.ports[res[k].shard][1];
            if (!is_r1)
                CHECK_OK(res[k].status);
            else if (res[k].status)
                r1_failed = true;
        }
        (void)rc;
        ref_push(&pu.ref, pu.all, NK, g);
        atomic_fetch_add(&pu.r1_failed, r1_failed);
        atomic_fetch_add(&pu.done, 1);
    }
    return NULL;
}

static void wait_pushes(int n)
{
    uint64_t end = pair_now_ms() + 60000ull * time_scale();
    while (atomic_load(&pu.done) < n && pair_now_ms() < end)
        pair_sleep_ms(2);
    CHECK(atomic_load(&pu.done) >= n);
}

/* The pusher thread started with client pc (replicas at ports); n Pushes
 * made. */
static void pusher_start(bex_ps_client *pc, uint16_t ports[NSH][2], int n)
{
    pu.pc = pc;
    pu.ports = ports;
    keys_init(pu.keys, pu.all);
    ref_init(&pu.ref, &TC, pu.keys);
    CHECK(pthread_create(&pu.th, NULL, pusher, NULL) == 0);
    wait_pushes(n);
}

/* n Pushes more, then the pusher stopped. */
static void pusher_stop(int n)
{
    int at = atomic_load(&pu.done);
    wait_pushes(at + n);
    atomic_store(&pu.stop, 1);
    CHECK(pthread_join(pu.th, NULL) == 0);
}

/* Replica 1 (pid) snapshots (SIGUSR1, its files in dir), n Pushes it will
 * lose with its memory, kill -9; down, n Pushes go to replica 0 alone. */
static void snapshot_kill_r1(pid_t pid, const char *dir, int n)
{
    CHECK(kill(pid, SIGUSR1) == 0);
    for (int s = 0; s < NSH; s++) {
        char p[192];
        snap_path(p, sizeof p, dir, s, 1);
        wait_file(p);
    }
    int at = atomic_load(&pu.done);
    wait_pushes(at + n);
    kill9(pid);
    at = atomic_load(&pu.done);
    wait_pushes(at + n);
    CHECK(atomic_load(&pu.r1_failed) > 0);
}

/* Both replicas: the reference's rows, and the same bit for bit unless the
 * client sent a Push to replica 1 again (a Push its peer applied after the
 * cut while the client's attempt at it failed: replica 1 applies it after
 * later ones, so the rows agree up to float rounding, as between replicas
 * with concurrent Pushers). No kept Push dropped. */
static void replicas_match(bex_ctx *ctx, uint16_t ports[NSH][2])
{
    bex_ps_client_stats cs;
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    bex_ps_client_stats_get(pu.pc, &cs);
    while (cs.push_held && pair_now_ms() < end) { /* the kept ones sent */
        pair_sleep_ms(5);
        bex_ps_client_stats_get(pu.pc, &cs);
    }
    CHECK_EQ(cs.push_held, 0);
    fprintf(stderr, "client: %llu Pushes kept for a replica, %llu sent again, %llu dropped\n",
            (unsigned long long)cs.push_kept, (unsigned long long)cs.push_resent,
            (unsigned long long)cs.push_dropped);
    CHECK_EQ(cs.push_dropped, 0);
    static float rows[2][NK * DMAX];
    for (int r = 0; r < 2; r++) {
        fetch_replica(ctx, ports, r, pu.keys, rows[r]);
        ref_check(&pu.ref, pu.all, NK, rows[r]);
    }
    if (cs.push_resent == 0)
        CHECK(memcmp(rows[0], rows[1], sizeof rows[0]) == 0);
}

static int t_restart(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-catchup-XXXXXX";
    char cluster[128];
    static uint16_t ports[NSH][2];
    tmp_cluster(tmpl, cluster, sizeof cluster, 2, ports);
    pid_t pid[2];
    /* replica 0 first, alone: no peer to catch up with (it would wait its
     * whole deadline for replica 1, each shard) */
    const char *no[] = {"--no-catchup", NULL};
    for (int r = 0; r < 2; r++)
        pid[r] = start_replica(cluster, tmpl, r, r ? NULL : no, NULL, 0);
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_file(cluster);
    pusher_start(client_short(ctx, d, 0), ports, 20);
    snapshot_kill_r1(pid[1], tmpl, 20);
    char url[128];
    pid[1] = start_replica(cluster, tmpl, 1, NULL, url, sizeof url);
    CHECK(url[0]);
    pusher_stop(20);
    fprintf(stderr, "%d Pushes, %d not taken by replica 1\n", atomic_load(&pu.done),
            atomic_load(&pu.r1_failed));
    replicas_match(ctx, ports);
    /* the copy brought every row of each shard */
    int per[NSH] = {0};
    for (int i = 0; i < NK; i++)
        per[bex_ps_key_shard(pu.keys[i], NSH)]++;
    for (int s = 0; s < NSH; s++) {
        CHECK_EQ(metric(url, "bex_ps_catchup_rows_copied_total", s), per[s]);
        CHECK_EQ(metric(url, "bex_ps_catchup_failures_total", s), 0);
    }
    bex_ps_client_destroy(pu.pc);
    bex_dir_destroy(d);
    CHECK_OK(bex_ctx_destroy(ctx));
    for (int r = 0; r < 2; r++)
        term_bex_ps(pid[r]);
    cleanup(tmpl, cluster);
    return 0;
}

/* ---- etcd ---- */

/* With --etcd the peers come from etcd: two bex-ps (every shard each,
 * fixed ports, replica 0 and 1) registered; Pushes; replica 1 snapshots,
 * more Pushes, kill -9 (its registration stays until its lease ends: the
 * Pushes fail there), more Pushes; restarted at the same ports it leaves
 * its own stale registration out and catches up with replica 0: both
 * replicas' rows are equal and the reference. */
static int t_etcd(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char url[96];
    etcd_start(url, sizeof url);
    char tmpl[] = "/tmp/bex-ps-catchup-XXXXXX";
    CHECK(mkdtemp(tmpl));
    static uint16_t ports[NSH][2];
    for (int r = 0; r < 2; r++) {
        /* shard i at PORT + i: both reserved (PORT + 1 free at the choice
         * was taken by another test's connection once, EADDRINUSE) */
        uint16_t p = bex_test_port_run(NSH);
        ports[0][r] = p;
        ports[1][r] = (uint16_t)(p + 1);
    }
    char listen[2][32];
    pid_t pid[2];
    for (int r = 0; r < 2; r++)
        snprintf(listen[r], sizeof listen[r], "127.0.0.1:%u", ports[0][r]);
    for (int r = 0; r < 2; r++) {
        const char *args[] = {"--etcd",         url,           "--listen",
                              listen[r],        "--n-shards",  "2",
                              "--shard",        "all",         "--replica",
                              r ? "1" : "0",    "--locality",  r ? "dc1/pod2" : "dc1/pod1",
                              "--ttl",          "30",          "--table",
                              "1:8:sgd:0.1",    "--transport", "tcp",
                              "--snapshot-dir", tmpl,          NULL};
        pid[r] = bex_ps_start(args, NULL, 0);
    }
    bex_dir *d;
    char err[256] = "";
    CHECK_OK(bex_dir_create(NULL, &d));
    CHECK_OK(bex_dir_watch_etcd(d, url, NULL, err, sizeof err));
    for (uint32_t s = 0; s < NSH; s++)
        wait_replicas(d, s, 2);
    bex_ctx *ctx = client_ctx();
    pusher_start(client_short(ctx, d, NSH), ports, 10);
    snapshot_kill_r1(pid[1], tmpl, 10);
    const char *args[] = {
        "--etcd",  url,           "--listen",    listen[1],    "--n-shards",     "2",     "--shard",
        "all",     "--replica",   "1",           "--locality", "dc1/pod2",       "--ttl", "30",
        "--table", "1:8:sgd:0.1", "--transport", "tcp",        "--snapshot-dir", tmpl,    NULL};
    pid[1] = bex_ps_start(args, NULL, 0);
    pusher_stop(10);
    replicas_match(ctx, ports);
    bex_ps_client_destroy(pu.pc);
    CHECK_OK(bex_ctx_destroy(ctx));
    bex_dir_destroy(d);
    for (int r = 0; r < 2; r++)
        term_bex_ps(pid[r]);
    etcd_cleanup();
    char cluster[128];
    snprintf(cluster, sizeof cluster, "%s/none", tmpl);
    cleanup(tmpl, cluster);
    return 0;
}

/* ---- peer_dies / peer_hangs: a fake peer in the test ---- */

static struct {
    bex_ctx *ctx;
    bex_rpc_server *srv;
    int hang; /* 1: never answer a chunk; 0: die at the second one */
    _Atomic int opens, chunks, die;
    bex_rpc_req *held[64];
    _Atomic int n_held;
} fk;

static void fake_copy(bex_rpc_req *req, void *body, size_t len, void *user)
{
    (void)user;
    struct bex__ps_copy_hdr h;
    CHECK_OK(bex__ps_copy_get(body, len, &h));
    bex_rpc_free(body);
    if (h.op == BEX__PS_COPY_OPEN) {
        atomic_fetch_add(&fk.opens, 1);
        uint8_t *out = bex_rpc_alloc(fk.ctx, BEX__PS_COPY_HDR_LEN);
        CHECK(out);
        bex__ps_copy_put(out,
                         &(struct bex__ps_copy_hdr){.op = h.op, .session = 42, .offset = 4u << 20});
        bex_rpc_reply(req, 0, out, BEX__PS_COPY_HDR_LEN);
        return;
    }
    int c = atomic_fetch_add(&fk.chunks, 1);
    if (h.op == BEX__PS_COPY_CHUNK && (fk.hang || c >= 1)) {
        /* held: hanging, or dying with it (the test destroys the server) */
        int i = atomic_fetch_add(&fk.n_held, 1);
        CHECK(i < 64);
        fk.held[i] = req;
        if (!fk.hang)
            atomic_store(&fk.die, 1);
        return;
    }
    size_t n = h.max_len < 65536 ? h.max_len : 65536;
    uint8_t *out = bex_rpc_alloc(fk.ctx, BEX__PS_COPY_HDR_LEN + n);
    CHECK(out);
    memset(out, 0, BEX__PS_COPY_HDR_LEN + n);
    bex__ps_copy_put(out, &h);
    bex_rpc_reply(req, 0, out, BEX__PS_COPY_HDR_LEN + n);
}

static void fake_start(uint16_t port)
{
    struct in_addr a = {htonl(INADDR_LOOPBACK)};
    bex_ctx_config base = {.keepalive_timeout_ms = 10000, .connect_timeout_ms = 10000};
    bex_ctx_config c = scaled(&base, a);
    CHECK_OK(bex_ctx_create(&c, &fk.ctx));
    CHECK_OK(bex_rpc_server_create(fk.ctx, NULL, &fk.srv));
    CHECK_OK(bex_rpc_server_register(fk.srv, BEX_PS_SERVICE, BEX_PS_M_COPY, 0, fake_copy, NULL));
    bex_addr la = {.in4 = {.sin_family = AF_INET, .sin_addr = a, .sin_port = htons(port)}};
    CHECK_OK(bex_rpc_server_listen(fk.srv, &la));
}

/* The fake dies when told to (a thread: bex_ps_start blocks meanwhile). */
static void *fake_killer(void *arg)
{
    (void)arg;
    uint64_t end = pair_now_ms() + 60000ull * time_scale();
    while (!atomic_load(&fk.die) && pair_now_ms() < end)
        pair_sleep_ms(2);
    CHECK(atomic_load(&fk.die));
    CHECK_OK(bex_rpc_server_destroy(fk.srv));
    fk.srv = NULL;
    return NULL;
}

static int peer_fails(int hang)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-catchup-XXXXXX";
    char cluster[128];
    static uint16_t ports[NSH][2];
    tmp_cluster(tmpl, cluster, sizeof cluster, 2, ports);
    /* replica 1 alone (no catch-up: nobody to catch up with), some Pushes,
     * its snapshot at SIGTERM */
    const char *no[] = {"--no-catchup", NULL};
    pid_t pid = start_replica(cluster, tmpl, 1, no, NULL, 0);
    bex_ctx *ctx = client_ctx();
    bex_dir *d = dir_of_replica(ports, 1);
    bex_ps_client *pc = client_of(ctx, d);
    static uint64_t keys[NK];
    static int all[NK];
    keys_init(keys, all);
    static struct ref ref;
    ref_init(&ref, &TC, keys);
    for (int i = 0; i < 3; i++)
        push_ref(pc, &ref, keys, all, NK, 30 + i);
    bex_ps_client_destroy(pc);
    bex_dir_destroy(d);
    term_bex_ps(pid);
    /* shard 0's peer: the fake; shard 1's: nobody */
    fk.hang = hang;
    fake_start(ports[0][0]);
    pthread_t th;
    if (!hang)
        CHECK(pthread_create(&th, NULL, fake_killer, NULL) == 0);
    char url[128];
    char ms[16];
    snprintf(ms, sizeof ms, "%u", 1500 * time_scale());
    const char *extra[] = {"--catchup-timeout-ms", ms, NULL};
    uint64_t t0 = pair_now_ms();
    pid = start_replica(cluster, tmpl, 1, extra, url, sizeof url);
    uint64_t took = pair_now_ms() - t0;
    fprintf(stderr, "restarted replica ready after %llu ms\n", (unsigned long long)took);
    if (!hang)
        CHECK(pthread_join(th, NULL) == 0);
    /* in the middle of the copy: opened, a chunk asked for and not had */
    CHECK_EQ(atomic_load(&fk.opens), 1);
    CHECK(atomic_load(&fk.chunks) >= (hang ? 1 : 2));
    if (hang)
        CHECK(took >= 1500ull * time_scale()); /* the deadline, not sooner */
    CHECK(took < 15000ull * time_scale());
    /* it serves its snapshot: the reference */
    static float rows[NK * DMAX];
    fetch_replica(ctx, ports, 1, keys, rows);
    ref_check(&ref, all, NK, rows);
    for (int s = 0; s < NSH; s++) {
        CHECK_EQ(metric(url, "bex_ps_catchup_failures_total", s), 1);
        CHECK_EQ(metric(url, "bex_ps_catchup_rows_copied_total", s), 0);
    }
    CHECK_OK(bex_ctx_destroy(ctx));
    term_bex_ps(pid);
    for (int i = 0; i < atomic_load(&fk.n_held); i++)
        bex_rpc_reply(fk.held[i], -ECANCELED, NULL, 0);
    if (fk.srv)
        CHECK_OK(bex_rpc_server_destroy(fk.srv));
    CHECK_OK(bex_ctx_destroy(fk.ctx));
    cleanup(tmpl, cluster);
    return 0;
}

static int t_peer_dies(void)
{
    return peer_fails(0);
}

static int t_peer_hangs(void)
{
    return peer_fails(1);
}

/* ---- primary_hangs ---- */

/* A TCP listener on port that never accepts: a peer that hangs. */
static int hung_listener(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    int one = 1;
    CHECK(setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
    bex_addr a = {.in4 = {.sin_family = AF_INET,
                          .sin_port = htons(port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)}};
    CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
    CHECK(listen(fd, 16) == 0);
    return fd;
}

/* bex-ps with argv, its stdout into *out; its metrics base URL into base. */
static pid_t spawn_metrics(const char *const *argv, FILE **out, char *base, size_t cap)
{
    pid_t pid = bex_ps_spawn_piped(argv, out);
    static const char at[] = "bex-ps: metrics at ";
    char line[256];
    base[0] = 0;
    while (!base[0] && fgets(line, sizeof line, *out))
        if (strncmp(line, at, sizeof at - 1) == 0)
            snprintf(base, cap, "%.*s",
                     (int)(strcspn(line + sizeof at - 1, "\n") - strlen("/metrics")),
                     line + sizeof at - 1);
    CHECK(base[0]);
    return pid;
}

static int t_primary_hangs(void)
{
    if (!pair_tcp())
        return bex_test_skip("the program cases run over TCP only");
    char tmpl[] = "/tmp/bex-ps-catchup-XXXXXX";
    char cluster[128];
    uint16_t ports[NSH][2];
    tmp_cluster(tmpl, cluster, sizeof cluster, 2, ports);
    int hung[NSH];
    for (int s = 0; s < NSH; s++)
        hung[s] = hung_listener(ports[s][1]);
    const char *argv[] = {"bex-ps",
                          "--cluster",
                          cluster,
                          "--shard",
                          "all",
                          "--replica",
                          "0",
                          "--table",
                          "1:8:sgd",
                          "--transport",
                          "tcp",
                          "--metrics-port",
                          "0",
                          "--primary-backup",
                          "--catchup-timeout-ms",
                          "300",
                          NULL};
    FILE *f;
    char base[128], path[160], *text;
    pid_t pid = spawn_metrics(argv, &f, base, sizeof base);
    /* a second catch-up of shard 0 failed: it tried again instead of
     * serving (before: one failure, then its empty rows served, ready) */
    char murl[160];
    snprintf(murl, sizeof murl, "%s/metrics", base);
    uint64_t until = pair_now_ms() + 30000ull * time_scale();
    while (metric(murl, "bex_ps_catchup_failures_total", 0) < 2 && pair_now_ms() < until)
        pair_sleep_ms(50);
    CHECK(metric(murl, "bex_ps_catchup_failures_total", 0) >= 2);
    CHECK_EQ(waitpid(pid, NULL, WNOHANG), 0);
    snprintf(path, sizeof path, "%s/ready", base);
    CHECK_EQ(http_get(path, &text), 503); /* was 200: its empty rows served */
    fprintf(stderr, "/ready: %s", text);
    static const char want[] = "not ready: catching up\n";
    CHECK(strncmp(text, want, sizeof want - 1) == 0);
    CHECK(strstr(text, "shard0: primary, catching up\n"));
    free(text);
    CHECK(kill(pid, SIGTERM) == 0);
    int status = 0;
    uint64_t end = pair_now_ms() + 10000ull * time_scale();
    pid_t w;
    while ((w = waitpid(pid, &status, WNOHANG)) == 0 && pair_now_ms() < end)
        pair_sleep_ms(10);
    if (w == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    CHECK(w == pid && WIFEXITED(status)); /* stopped by SIGTERM, within a bound */
    fclose(f);
    for (int s = 0; s < NSH; s++)
        close(hung[s]);
    unlink(cluster);
    CHECK(rmdir(tmpl) == 0);
    return 0;
}

BEX_TEST_MAIN({"replay", t_replay}, {"behind", t_behind}, {"stale", t_stale},
              {"hostile", t_hostile}, {"peer_late", t_peer_late}, {"window", t_window},
              {"resend_bound", t_resend_bound}, {"churn", t_churn},
              {"resend_hostile", t_resend_hostile}, {"restart", t_restart}, {"etcd", t_etcd},
              {"peer_dies", t_peer_dies}, {"peer_hangs", t_peer_hangs},
              {"primary_hangs", t_primary_hangs})
