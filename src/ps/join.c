/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: a backup added to a running shard (issue 29 item 5;
 * docs/architecture.md, "Replication", "Adding a backup").
 *
 * The new backup asks its primary to JOIN (BEX_PS_M_CUT, op JOIN): the
 * primary holds new Pushes as for a cut (snapcut.c), so its rows, ids and
 * lsn stay still; the backup copies them (catch-up, the copy carrying the
 * primary's session and lsn) and says JOINED; the primary adds it to its
 * backups, in step at that lsn, and releases the Pushes, which it then
 * forwards to every backup, the new one included. */
#include <errno.h>
#include <pthread.h>
#include <sodium.h>
#include <string.h>
#include <arpa/inet.h>

#include "bex/ps.h"
#include "common/cfg.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "ps/shard_internal.h"
#include "rpc/internal.h"

/* The JOIN body after its header (docs/protocol.md, "Cut"): 8 bytes for
 * an IPv4 address, 24 for an IPv6 one (len, checked by the caller). */
void bex__ps_join_endpoint(const uint8_t *p, size_t len, bex_rpc_endpoint *ep)
{
    if (len == BEX__PS_JOIN6_LEN - BEX__PS_CUT_HDR_LEN) {
        *ep = (bex_rpc_endpoint){.addr = {.in6 = {.sin6_family = AF_INET6}}};
        memcpy(&ep->addr.in6.sin6_addr, p, 16);
        memcpy(&ep->addr.in6.sin6_port, p + 16, 2);
        ep->transport = (uint32_t)p[18] | (uint32_t)p[19] << 8;
        ep->addr.in6.sin6_scope_id = bex__ps_get32(p + 20);
        return;
    }
    *ep = (bex_rpc_endpoint){.addr = {.in4 = {.sin_family = AF_INET}}};
    memcpy(&ep->addr.in4.sin_addr.s_addr, p, 4);
    memcpy(&ep->addr.in4.sin_port, p + 4, 2);
    ep->transport = (uint32_t)p[6] | (uint32_t)p[7] << 8;
}

/* The inverse, after the header: the bytes written (0: not IPv4/IPv6). */
size_t bex__ps_join_put(uint8_t *p, const bex_rpc_endpoint *ep)
{
    const bex_addr *a = &ep->addr;
    uint8_t *t = p + (a->sa.sa_family == AF_INET6 ? 18 : 6);
    if (a->sa.sa_family == AF_INET6) {
        memcpy(p, &a->in6.sin6_addr, 16);
        memcpy(p + 16, &a->in6.sin6_port, 2);
        bex__ps_put32(p + 20, a->in6.sin6_scope_id);
    } else if (a->sa.sa_family == AF_INET) {
        memcpy(p, &a->in4.sin_addr.s_addr, 4);
        memcpy(p + 4, &a->in4.sin_port, 2);
    } else {
        return 0;
    }
    t[0] = (uint8_t)ep->transport;
    t[1] = (uint8_t)(ep->transport >> 8);
    return a->sa.sa_family == AF_INET6 ? BEX__PS_JOIN6_LEN - BEX__PS_CUT_HDR_LEN
                                       : BEX__PS_JOIN_LEN - BEX__PS_CUT_HDR_LEN;
}

int bex__ps_join_check_locked(const bex_ps_shard *s, const bex_rpc_endpoint *ep)
{
    const struct repl *rp = &s->rp;
    if (rp->role != BEX_PS_ROLE_PRIMARY || !rp->ctx)
        return -EPERM;
    if (rp->n_bk >= BEX_PS_BACKUPS_MAX)
        return -ENOSPC;
    if (!bex_addr_port(&ep->addr) || ep->transport > BEX_TRANSPORT_TCP)
        return -EINVAL;
    for (size_t i = 0; i < rp->n_bk; i++)
        if (bex_addr_equal(&rp->bk[i].addr, &ep->addr))
            return -EEXIST; /* a backup restarted rejoins by the probe */
    return 0;
}

/* No Push is between the door and its forwards (the hold): n_bk may grow;
 * the room for it was made at init, so forwards in flight keep their
 * backup's place. */
int bex__ps_join_add_locked(bex_ps_shard *s, const bex_rpc_endpoint *ep)
{
    struct repl *rp = &s->rp;
    int rc = bex__ps_join_check_locked(s, ep);
    if (rc)
        return rc;
    uint32_t b = (uint32_t)rp->n_bk;
    rp->bk[b] = (struct backup){.addr = ep->addr, .transport = ep->transport};
    rp->n_bk++;
    if ((rc = bex__ps_repl_register(s, rp->ctx))) {
        rp->n_bk--;
        return rc;
    }
    bex__ps_lag_acked(s, b, rp->lsn); /* it copied every Push up to here */
    char a[BEX_ADDR_STRLEN];
    bex_addr_format(&ep->addr, true, a, sizeof a);
    bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: backup %u (%s) joined at lsn %llu", s->shard, b,
             a, (unsigned long long)rp->lsn);
    return 0;
}

/* One call of method CUT to the primary, body b (len bytes, ours until
 * sent): its status. */
static int call1(bex_rpc_channel *ch, bex_ctx *ctx, const uint8_t *body, size_t len,
                 uint32_t timeout_ms)
{
    uint8_t *b = bex_rpc_alloc(ctx, len);
    if (!b)
        return -ENOMEM;
    memcpy(b, body, len);
    struct bex__rpc_wait w = BEX__RPC_WAIT_INIT;
    bex_rpc_call_opts o = {.timeout_ms = timeout_ms ? timeout_ms : 1};
    int rc =
        bex_rpc_call(ch, BEX_PS_SERVICE, BEX_PS_M_CUT, b, len, &o, bex__rpc_wait_done, &w, NULL);
    if (rc) {
        bex_rpc_free(b);
        return rc;
    }
    void *resp = NULL;
    size_t rlen = 0;
    rc = bex__rpc_wait(&w, &resp, &rlen);
    bex_rpc_free(resp);
    return rc;
}

static uint32_t left_ms(uint64_t deadline)
{
    uint64_t now = bex__rpc_now_ns();
    return now >= deadline ? 0 : (uint32_t)((deadline - now) / 1000000ull + 1);
}

/* JOIN, the copy, JOINED (or ABORT): the join's steps on channel ch. */
static int join_steps(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_join_config *cfg,
                      bex_rpc_channel *ch, uint64_t deadline)
{
    uint64_t id = 0;
    randombytes_buf(&id, sizeof id);
    id |= 1;
    uint8_t b[BEX__PS_JOIN6_LEN];
    bex__ps_cut_put(b, &(struct bex__ps_cut_hdr){.op = BEX__PS_CUT_JOIN, .id = id});
    size_t n = bex__ps_join_put(b + BEX__PS_CUT_HDR_LEN, &cfg->self);
    int rc = n ? call1(ch, ctx, b, BEX__PS_CUT_HDR_LEN + n, left_ms(deadline)) : -EINVAL;
    if (rc) {
        bex__log(&s->log, BEX_LOG_ERROR,
                 "ps shard %u: JOIN at the primary failed (nothing copied): %s", s->shard,
                 bex_strerror(rc));
        return rc;
    }
    bex_ps_catchup_config cc = {.peers = &cfg->primary,
                                .n_peers = 1,
                                .timeout_ms = left_ms(deadline),
                                .chunk_bytes = cfg->chunk_bytes,
                                .max_bytes = cfg->max_bytes};
    rc = bex_ps_shard_catchup(s, ctx, &cc);
    bex__ps_cut_put(
        b, &(struct bex__ps_cut_hdr){.op = rc ? BEX__PS_CUT_ABORT : BEX__PS_CUT_JOINED, .id = id});
    int rc2 = call1(ch, ctx, b, BEX__PS_CUT_HDR_LEN, left_ms(deadline));
    if (!rc && rc2)
        bex__log(&s->log, BEX_LOG_ERROR,
                 "ps shard %u: copied the primary, but it did not add this backup: %s (its "
                 "join_pause_ms ran out?)",
                 s->shard, bex_strerror(rc2));
    return rc ? rc : rc2;
}

int bex_ps_shard_join(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_join_config *cfg)
{
    bex_ps_join_config c;
    BEX__CFG_TAKE(cfg, c);
    if (!s || !ctx || !cfg || s->rp.role != BEX_PS_ROLE_BACKUP || !bex__ps_shard_catching(s))
        return -EINVAL;
    uint32_t tmo = cfg->timeout_ms ? cfg->timeout_ms : 10000;
    uint64_t deadline = bex__rpc_now_ns() + (uint64_t)tmo * 1000000ull;
    bex_rpc_channel_config cc = {.endpoints = &cfg->primary,
                                 .n_endpoints = 1,
                                 .name = "ps-join",
                                 .request_timeout_ms = tmo,
                                 .connect_timeout_ms = tmo,
                                 .max_attempts = 1};
    bex_rpc_channel *ch;
    int rc = bex_rpc_channel_create(ctx, &cc, &ch);
    if (rc)
        return rc;
    rc = join_steps(s, ctx, cfg, ch, deadline);
    bex_rpc_channel_destroy(ch);
    if (!rc)
        bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: joined its primary's replica set", s->shard);
    return rc;
}

/* ---- etcd mode: a replica added to a running shard ----
 *
 * The new replica's agent (failover.c) sends JOIN, its id the term it
 * read from etcd, to that term's primary. The primary adds it to its
 * backups out of the replica set (no hold, no JOINED: nothing is
 * forwarded to it yet) and kicks its agent, which writes its name to the
 * shard's joined key and then treats it as any backup out of the set:
 * probed, it copies (again) from the primary with the Pushes paused, and
 * is put in the set under the term's guard. */
int bex__ps_join_fenced(bex_ps_shard *s, uint64_t epoch, const bex_rpc_endpoint *ep, bool *fenced)
{
    struct repl *rp = &s->rp;
    pthread_mutex_lock(&s->mu);
    *fenced = rp->fenced;
    int rc = 0;
    if (!rp->fenced)
        ; /* static mode: the hold, the copy, JOINED (snapcut.c) */
    else if (rp->role != BEX_PS_ROLE_PRIMARY)
        rc = -EPERM;
    else if (epoch != rp->epoch || !bex__ps_lease_held(rp))
        rc = -ESTALE; /* another term's JOIN, or not surely primary now */
    else
        rc = bex__ps_join_check_locked(s, ep);
    if (rp->fenced && !rc) {
        rp->bk[rp->n_bk] = (struct backup){
            .addr = ep->addr, .transport = ep->transport, .state = BK_OUT, .probe_ns = 0};
        rp->n_bk++;
        if ((rc = bex__ps_repl_register(s, rp->ctx)))
            rp->n_bk--;
    }
    void (*kick)(void *) = rp->kick;
    void *arg = rp->kick_arg;
    pthread_mutex_unlock(&s->mu);
    if (!*fenced)
        return 0;
    char a[BEX_ADDR_STRLEN];
    bex_addr_format(&ep->addr, true, a, sizeof a);
    bex__log(&s->log, rc && rc != -EEXIST ? BEX_LOG_WARN : BEX_LOG_INFO,
             "ps shard %u: JOIN of %s (epoch %llu): %s", s->shard, a, (unsigned long long)epoch,
             rc ? bex_strerror(rc) : "a backup out of the replica set until it is in step");
    if (!rc && kick)
        kick(arg);
    return rc;
}

int bex__ps_join_fenced_call(bex_ps_shard *s, bex_ctx *ctx, const bex_rpc_endpoint *primary,
                             const bex_rpc_endpoint *self, uint64_t epoch, uint32_t timeout_ms)
{
    uint8_t b[BEX__PS_JOIN6_LEN];
    bex__ps_cut_put(b, &(struct bex__ps_cut_hdr){.op = BEX__PS_CUT_JOIN, .id = epoch});
    size_t n = bex__ps_join_put(b + BEX__PS_CUT_HDR_LEN, self);
    if (!n || !epoch)
        return -EINVAL;
    bex_rpc_channel_config cc = {.endpoints = primary,
                                 .n_endpoints = 1,
                                 .name = "ps-join",
                                 .request_timeout_ms = timeout_ms,
                                 .connect_timeout_ms = timeout_ms,
                                 .max_attempts = 1};
    bex_rpc_channel *ch;
    int rc = bex_rpc_channel_create(ctx, &cc, &ch);
    if (rc)
        return rc;
    uint64_t deadline = bex__rpc_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    rc = call1(ch, ctx, b, BEX__PS_CUT_HDR_LEN + n, left_ms(deadline));
    bex_rpc_channel_destroy(ch);
    (void)s;
    return rc;
}
