/* SPDX-License-Identifier: Apache-2.0 */
/* bex_ps_snapshot_all: the coordinator of a consistent cut of the whole
 * model (docs/architecture.md, "Snapshots"): PREPARE to every shard's
 * primary, COMMIT to every one once all are prepared, ABORT to every one
 * when any phase fails. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bex/ps.h"
#include "common/cfg.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"

#define SNAP_SHARDS_MAX 4096u

struct phase {
    struct bex__rpc_wait w;
    int rc;
    uint8_t ans[BEX__PS_CUT_ANS_LEN];
    size_t ans_len;
};

/* op on every channel at once, each answer into ph[i]; the first error. */
static int run_phase(bex_ctx *ctx, bex_rpc_channel **ch, uint32_t n, uint8_t op, uint8_t flags,
                     uint64_t id, uint32_t timeout_ms, struct phase *ph)
{
    bex_rpc_call_opts o = {.timeout_ms = timeout_ms};
    for (uint32_t i = 0; i < n; i++) {
        ph[i] = (struct phase){.w = BEX__RPC_WAIT_INIT};
        uint8_t *b = bex_rpc_alloc(ctx, BEX__PS_CUT_HDR_LEN);
        ph[i].rc = b ? 0 : -ENOMEM;
        if (b) {
            bex__ps_cut_put(b, &(struct bex__ps_cut_hdr){.op = op, .flags = flags, .id = id});
            ph[i].rc = bex_rpc_call(ch[i], BEX_PS_SERVICE, BEX_PS_M_CUT, b, BEX__PS_CUT_HDR_LEN, &o,
                                    bex__rpc_wait_done, &ph[i].w, NULL);
            if (ph[i].rc)
                bex_rpc_free(b);
        }
    }
    int first = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!ph[i].rc) {
            void *body = NULL;
            size_t len = 0;
            ph[i].rc = bex__rpc_wait(&ph[i].w, &body, &len);
            if (!ph[i].rc && body && len <= sizeof ph[i].ans) {
                memcpy(ph[i].ans, body, len);
                ph[i].ans_len = len;
            }
            bex_rpc_free(body);
        }
        if (ph[i].rc && !first)
            first = ph[i].rc;
    }
    return first;
}

/* COMMIT's answers summed into out. -EBADMSG for one malformed. */
static int sum_commits(const struct phase *ph, uint32_t n, uint64_t id, bex_ps_snapshot_result *r)
{
    *r = (bex_ps_snapshot_result){.cut_id = id, .shards = n};
    for (uint32_t i = 0; i < n; i++) {
        struct bex__ps_cut_hdr h;
        const uint8_t *a = ph[i].ans;
        if (ph[i].ans_len != BEX__PS_CUT_ANS_LEN || bex__ps_cut_get(a, ph[i].ans_len, &h) ||
            h.id != id || h.op != BEX__PS_CUT_COMMIT)
            return -EBADMSG;
        uint64_t pause = bex__ps_get64(a + 16);
        if (pause > r->pause_ns_max)
            r->pause_ns_max = pause;
        r->held += bex__ps_get64(a + 24);
        r->rows += bex__ps_get64(a + 32);
        r->full += bex__ps_get32(a + 40) != 0;
    }
    return 0;
}

/* A channel to the first replica listed of each shard (its primary). */
static int open_channels(bex_ctx *ctx, const bex_ps_snapshot_config *c, const char *svc, uint32_t n,
                         uint32_t timeout_ms, bex_rpc_channel **ch)
{
    for (uint32_t i = 0; i < n; i++) {
        bex_dir_replica rep;
        if (bex_dir_replicas(c->dir, svc, i, &rep, 1) == 0)
            return -EHOSTUNREACH;
        bex_rpc_endpoint ep = {.addr = rep.addr, .transport = rep.transport};
        /* one attempt: a phase is not retried, the cut is */
        bex_rpc_channel_config cc = {.endpoints = &ep,
                                     .n_endpoints = 1,
                                     .name = "ps-cut",
                                     .request_timeout_ms = timeout_ms,
                                     .connect_timeout_ms = timeout_ms,
                                     .max_attempts = 1};
        int rc = bex_rpc_channel_create(ctx, &cc, &ch[i]);
        if (rc)
            return rc;
    }
    return 0;
}

int bex_ps_snapshot_all(bex_ctx *ctx, const bex_ps_snapshot_config *cfg,
                        bex_ps_snapshot_result *out)
{
    bex_ps_snapshot_config c;
    BEX__CFG_TAKE(cfg, c);
    if (!ctx || !cfg || !cfg->dir || (cfg->flags & ~BEX_PS_SNAPSHOT_FULL))
        return -EINVAL;
    const char *svc = cfg->service ? cfg->service : "ps";
    uint32_t n = cfg->n_shards;
    if (n == 0)
        while (n < SNAP_SHARDS_MAX && bex_dir_replicas(cfg->dir, svc, n, NULL, 0) > 0)
            n++;
    if (n == 0 || n > SNAP_SHARDS_MAX)
        return -EINVAL;
    uint32_t tmo = cfg->timeout_ms ? cfg->timeout_ms : 10000;
    uint64_t id = cfg->cut_id;
    if (!id) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        id = (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000;
    }
    bex_rpc_channel **ch = calloc(n, sizeof *ch);
    struct phase *ph = calloc(n, sizeof *ph);
    int rc = ch && ph ? open_channels(ctx, cfg, svc, n, tmo, ch) : -ENOMEM;
    uint8_t fl = (cfg->flags & BEX_PS_SNAPSHOT_FULL) ? BEX__PS_CUT_F_FULL : 0;
    /* a first round trip (ABORT of a cut no shard has: nothing done)
     * makes every connection before any shard holds its Pushes */
    if (!rc)
        rc = run_phase(ctx, ch, n, BEX__PS_CUT_ABORT, 0, id, tmo, ph);
    if (!rc)
        rc = run_phase(ctx, ch, n, BEX__PS_CUT_PREPARE, fl, id, tmo, ph);
    if (!rc)
        rc = run_phase(ctx, ch, n, BEX__PS_CUT_COMMIT, 0, id, tmo, ph);
    bex_ps_snapshot_result r;
    if (!rc)
        rc = sum_commits(ph, n, id, &r);
    else if (ch && ph && rc != -EHOSTUNREACH)
        /* the shards still holding Pushes for it let them go now */
        run_phase(ctx, ch, n, BEX__PS_CUT_ABORT, 0, id, tmo < 1000 ? tmo : 1000, ph);
    for (uint32_t i = 0; ch && i < n; i++)
        if (ch[i])
            bex_rpc_channel_destroy(ch[i]);
    free(ch);
    free(ph);
    if (!rc && out)
        *out = r;
    return rc;
}
