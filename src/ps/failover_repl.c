/* SPDX-License-Identifier: Apache-2.0 */
/* Primary-backup replication in etcd mode: the shard's checks of epochs
 * and of the primary's lease (docs/architecture.md, "Replication", etcd
 * mode), and a backup's re-sync from a new primary. Under the shard's
 * lock unless said. */
#include <errno.h>

#include "bex/ps.h"
#include "common/log.h"
#include "ps/shard_internal.h"
#include "rpc/elect.h"

bool bex__ps_lease_held(const struct repl *rp)
{
    return rp->el && bex__rpc_now_ns() < bex__elect_until_ns(rp->el);
}

int bex__ps_fenced_admit(bex_ps_shard *s, const struct bex__ps_hdr *h)
{
    struct repl *rp = &s->rp;
    if (rp->role != BEX_PS_ROLE_PRIMARY)
        return -EPERM;
    /* epoch 0: a client that does not know the term yet */
    if (!bex__ps_lease_held(rp) ||
        ((h->flags & BEX__PS_F_EPOCH) && h->epoch && h->epoch != rp->epoch)) {
        s->st.not_primary++;
        return -ESTALE; /* not surely primary now, or the client saw another term */
    }
    return 0;
}

int bex__ps_fenced_forward(bex_ps_shard *s, uint64_t epoch)
{
    struct repl *rp = &s->rp;
    if (epoch < rp->epoch)
        return -ESTALE; /* a deposed primary's */
    if (epoch > rp->epoch) {
        /* a term this backup has not seen in etcd: maybe a new primary's
         * (its agent reads etcd now, follows it and copies from it, and
         * the primary's channel sends this again), maybe forged by any
         * peer: taking it from the Forward would make the backup refuse
         * its real primary's forwards and every copy from it for good */
        if (rp->kick)
            rp->kick(rp->kick_arg);
        return -EAGAIN;
    }
    return rp->state == RP_BACKUP ? 0 : -EAGAIN; /* UNSYNCED: not copied yet */
}

/* Not under the lock. */
int bex__ps_resync(bex_ps_shard *s, bex_ctx *ctx, const bex_rpc_endpoint *primary,
                   uint32_t timeout_ms)
{
    pthread_mutex_lock(&s->mu);
    uint64_t epoch = s->rp.epoch;
    bool go = s->state == SH_SERVING && s->rp.role == BEX_PS_ROLE_BACKUP;
    if (go)
        bex__ps_shard_move(s, SH_RESYNC_WAIT);
    pthread_mutex_unlock(&s->mu);
    if (!go)
        return -EBUSY;
    bex_ps_catchup_config cc = BEX_PS_CATCHUP_CONFIG_INIT;
    cc.peers = primary;
    cc.n_peers = 1;
    cc.timeout_ms = timeout_ms;
    int rc = bex_ps_shard_catchup(s, ctx, &cc);
    pthread_mutex_lock(&s->mu);
    if (s->state == SH_RESYNC_WAIT || s->state == SH_RESYNC) /* not over: a plain catch-up */
        bex__ps_shard_move(s, s->state == SH_RESYNC ? SH_CATCHUP : SH_WAIT);
    bool ok = rc == 0 && s->rp.in_session == epoch && s->rp.epoch == epoch;
    if (ok)
        if (s->rp.state == RP_UNSYNCED)
            bex__ps_repl_move(s, RP_BACKUP);
    pthread_mutex_unlock(&s->mu);
    return rc ? rc : ok ? 0 : -ESTALE;
}
