/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: a restarted backup's catch-up by its primary's log suffix
 * (docs/architecture.md, "Replication"; wire: docs/protocol.md,
 * "Catch-up", op SUFFIX).
 *
 * Its snapshot (version 4) says which primary session it followed and
 * the last lsn it had applied then. When that primary's forward log
 * still holds every forward after it, the backup applies those, in lsn
 * order, instead of copying every row; else (another session, a log that
 * moved past it, a peer that is no primary) bex_ps_shard_catchup falls
 * back to the full copy, which replaces whatever the suffix applied. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "bex/ps.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "ps/shard_internal.h"
#include "rpc/internal.h"

#define ENT_HDR 12 /* u64 lsn, u32 length */

/* Entries p[0..n) check: consecutive from pos + 1, none past last, each
 * a Push body that decodes. How many, or -EBADMSG. */
static int entries_check(const uint8_t *p, size_t n, uint64_t pos, uint64_t last)
{
    int k = 0;
    for (size_t o = 0; o < n; k++) {
        struct bex__ps_hdr h;
        if (n - o < ENT_HDR || bex__ps_get64(p + o) != pos + 1 + (uint64_t)k ||
            bex__ps_get64(p + o) > last)
            return -EBADMSG;
        size_t len = bex__ps_get32(p + o + 8);
        if (len > n - o - ENT_HDR || bex__ps_decode(BEX_PS_M_PUSH, p + o + ENT_HDR, len, &h))
            return -EBADMSG;
        o += ENT_HDR + len;
    }
    return k;
}

/* Apply one entry's Push (checked) as a forward of its lsn, under s->mu. */
static int entry_apply_locked(bex_ps_shard *s, const uint8_t *body, size_t len)
{
    struct bex__ps_hdr h;
    struct table *t;
    uint64_t *keys;
    float *g;
    int rc = bex__ps_decode(BEX_PS_M_PUSH, body, len, &h);
    if (!rc)
        rc = bex__ps_push_read(s, &h, body + bex__ps_keys_off(&h), &t, &keys, &g);
    if (rc)
        return rc;
    struct pushid id = {.k = {h.id_client, {h.id_tok[0], h.id_tok[1]}}, .seq = h.id_seq};
    rc = bex__ps_push_apply_locked(s, t, h.n, keys, g, (h.flags & BEX__PS_F_ID) ? &id : NULL, NULL);
    free(keys);
    free(g);
    return rc;
}

/* One answer's entries (n bytes at p) applied after *pos; *pos moves. */
static int entries_apply(bex_ps_shard *s, uint64_t session, const uint8_t *p, size_t n,
                         uint64_t *pos, uint64_t last)
{
    int k = entries_check(p, n, *pos, last);
    if (k < 0 || (k == 0 && *pos != last))
        return -EBADMSG;
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    for (size_t o = 0; o < n && !rc;) {
        size_t len = bex__ps_get32(p + o + 8);
        rc = entry_apply_locked(s, p + o + ENT_HDR, len);
        o += ENT_HDR + len;
        if (!rc) {
            /* its rows now hold every forward of session up to here */
            s->rp.in_session = session;
            s->rp.next = ++*pos + 1;
            s->st.suffix_applied++;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* The suffix from one peer, until the backup holds the primary's lsn of
 * the last answer. */
static int suffix_from(bex_ps_shard *s, bex_ctx *ctx, const bex_rpc_endpoint *ep, uint32_t chunk,
                       uint64_t deadline, uint64_t session, uint64_t *pos)
{
    uint64_t now = bex__rpc_now_ns();
    uint32_t left = now < deadline ? (uint32_t)((deadline - now) / 1000000ull + 1) : 0;
    if (!left)
        return -ETIMEDOUT;
    bex_rpc_channel_config cc = {.endpoints = ep,
                                 .n_endpoints = 1,
                                 .name = "ps-suffix",
                                 .request_timeout_ms = left,
                                 .connect_timeout_ms = left,
                                 .max_attempts = 1};
    bex_rpc_channel *ch = NULL;
    int rc = bex_rpc_channel_create(ctx, &cc, &ch);
    for (uint64_t last = *pos + 1; !rc && *pos != last;) {
        struct bex__ps_copy_hdr q = {.op = BEX__PS_COPY_SUFFIX,
                                     .max_len = chunk,
                                     .session = session,
                                     .offset = *pos},
                                a;
        void *body;
        size_t len;
        if ((rc = bex__ps_copy_call(ch, ctx, &q, deadline, &a, &body, &len)))
            break;
        last = a.offset;
        rc = last < *pos ? -EBADMSG
                         : entries_apply(s, session, (const uint8_t *)body + BEX__PS_COPY_HDR_LEN,
                                         len - BEX__PS_COPY_HDR_LEN, pos, last);
        bex_rpc_free(body);
    }
    if (ch)
        bex_rpc_channel_destroy(ch);
    return rc;
}

int bex__ps_catchup_suffix(bex_ps_shard *s, bex_ctx *ctx, const bex_ps_catchup_config *cfg,
                           uint64_t deadline)
{
    pthread_mutex_lock(&s->mu);
    uint64_t session = s->rp.snap_session, pos = s->rp.snap_lsn, from = pos;
    bool can = s->rp.role == BEX_PS_ROLE_BACKUP && !s->rp.fenced && session;
    pthread_mutex_unlock(&s->mu);
    if (!can)
        return -ENOENT;
    uint32_t chunk = cfg->chunk_bytes ? cfg->chunk_bytes : 1u << 20;
    int rc = -ENOENT;
    for (size_t i = 0; i < cfg->n_peers && rc; i++) {
        if (pos != from)
            break; /* applied part of one peer's: that peer's or a full copy */
        rc = suffix_from(s, ctx, &cfg->peers[i], chunk, deadline, session, &pos);
    }
    if (rc == 0) {
        /* its rows hold every forward of session up to pos: an empty
         * suffix (the snapshot at the primary's lsn) sets the position
         * too, else the next forward was refused as of a session it did
         * not follow from its start */
        pthread_mutex_lock(&s->mu);
        s->rp.in_session = session;
        s->rp.next = pos + 1;
        pthread_mutex_unlock(&s->mu);
    }
    if (rc)
        bex__log(&s->log, BEX_LOG_INFO,
                 "ps shard %u: no log suffix after lsn %llu (%s): a full copy instead", s->shard,
                 (unsigned long long)from, bex_strerror(rc));
    else
        bex__log(&s->log, BEX_LOG_INFO,
                 "ps shard %u: caught up by its primary's log: lsn %llu to %llu", s->shard,
                 (unsigned long long)from, (unsigned long long)pos);
    return rc;
}
