/* SPDX-License-Identifier: Apache-2.0 */
/* The PS shard: the peer's side of catch-up (serving a restarted
 * replica's copy). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "bex/ps.h"
#include "common/log.h"
#include "ps/ps_internal.h"
#include "rpc/internal.h"
#include "ps/shard_internal.h"

/* ---- catch-up: the peer's side ---- */

static void copy_drop(struct copy *cp)
{
    free(cp->buf);
    *cp = (struct copy){0};
}

/* COPY op SUFFIX (docs/protocol.md, "Catch-up"): the forwards after a
 * restarted backup's position from the primary's log, or why not. */
static int serve_suffix(bex_ps_shard *s, const struct bex__ps_copy_hdr *h, void **resp,
                        size_t *resp_len)
{
    if (h->max_len == 0)
        return -EINVAL;
    uint32_t max = h->max_len < COPY_CHUNK_MAX ? h->max_len : COPY_CHUNK_MAX;
    uint8_t *out;
    size_t len;
    uint64_t last;
    pthread_mutex_lock(&s->mu);
    int rc = bex__ps_shard_catching(s) ? -EAGAIN
                                       : bex__ps_rlog_suffix_locked(&s->rp, h->session, h->offset,
                                                                    max, &out, &len, &last);
    if (rc == 0)
        s->st.suffixes_served++;
    pthread_mutex_unlock(&s->mu);
    if (rc)
        return rc;
    bex__ps_copy_put(out, &(struct bex__ps_copy_hdr){
                              .op = BEX__PS_COPY_SUFFIX, .session = h->session, .offset = last});
    *resp = out;
    *resp_len = len;
    return 0;
}

/* BEX_PS_M_COPY: OPEN makes the copy (one cut, under s->mu) and names it
 * by a session; CHUNK answers bytes of it; CLOSE drops it. One copy at a
 * time: an OPEN replaces the one before (its puller gets -ESTALE). */
static int serve_copy(bex_ps_shard *s, bex_ctx *ctx, const void *body, size_t len, void **resp,
                      size_t *resp_len)
{
    struct bex__ps_copy_hdr h;
    if (bex__ps_copy_get(body, len, &h) || len != BEX__PS_COPY_HDR_LEN)
        return -EINVAL;
    if (h.op == BEX__PS_COPY_SUFFIX)
        return serve_suffix(s, &h, resp, resp_len);
    uint64_t now = bex__rpc_now_ns();
    struct bex__ps_copy_hdr a = {.op = h.op, .session = h.session, .offset = h.offset};
    size_t n = 0;
    int rc = 0;
    uint8_t *out = NULL;
    pthread_mutex_lock(&s->mu);
    if (bex__ps_shard_catching(s)) {
        rc = -EAGAIN; /* not caught up itself: no copy to give */
        goto out;
    }
    if (s->cp.buf && now - s->cp.used_ns > COPY_IDLE_NS)
        copy_drop(&s->cp);
    switch (h.op) {
    case BEX__PS_COPY_OPEN: {
        copy_drop(&s->cp);
        uint64_t sid = 0;
        randombytes_buf(&sid, sizeof sid);
        if ((rc = bex__ps_copy_make(s, &s->cp.buf, &s->cp.len)))
            break;
        s->cp.session = a.session = sid | 1;
        s->cp.used_ns = now;
        a.offset = s->cp.len;
        s->st.copies_served++;
        bex__log(&s->log, BEX_LOG_INFO, "ps shard %u: a copy of %zu bytes for a restarted replica",
                 s->shard, s->cp.len);
        break;
    }
    case BEX__PS_COPY_CHUNK:
        if (!s->cp.buf || h.session != s->cp.session) {
            rc = -ESTALE;
            break;
        }
        if (h.offset > s->cp.len || h.max_len == 0) {
            rc = -EINVAL;
            break;
        }
        n = s->cp.len - (size_t)h.offset;
        if (n > h.max_len)
            n = h.max_len;
        if (n > COPY_CHUNK_MAX)
            n = COPY_CHUNK_MAX;
        s->cp.used_ns = now;
        break;
    default: /* CLOSE */
        if (s->cp.buf && h.session == s->cp.session)
            copy_drop(&s->cp);
        break;
    }
    if (rc == 0) {
        if (!(out = bex_rpc_alloc(ctx, BEX__PS_COPY_HDR_LEN + n)))
            rc = -ENOMEM;
        else if (n)
            memcpy(out + BEX__PS_COPY_HDR_LEN, s->cp.buf + h.offset, n);
    }
out:
    pthread_mutex_unlock(&s->mu);
    if (rc)
        return rc;
    bex__ps_copy_put(out, &a);
    *resp = out;
    *resp_len = BEX__PS_COPY_HDR_LEN + n;
    return 0;
}

/* Count and log a request refused for the shard's role. A client that
 * has not found the primary yet retries 20 times a second (under the call
 * site's limit), so the line is said at the 1st, 2nd, 4th, 8th, ...
 * refusal of the shard only, with the count; bex_ps_shard_stats has them
 * all (not_primary). */
static int role_refused(bex_ps_shard *s, int rc, const char *why)
{
    pthread_mutex_lock(&s->mu);
    uint64_t n = ++s->st.not_primary;
    pthread_mutex_unlock(&s->mu);
    if (n & (n - 1))
        return rc;
    bex__log(&s->log, BEX_LOG_WARN, "ps shard %u: %s refused: %s (%llu refused so far)", s->shard,
             why,
             rc != -EPERM ? "needs the registered handler"
             : s->rp.role == BEX_PS_ROLE_BACKUP
                 ? "this replica is a backup (Pushes go to the primary)"
                 : "this replica is not a backup (Forwards go to backups)",
             (unsigned long long)n);
    return rc;
}

/* A Push or Forward for the replication role (req NULL: no handler to
 * answer later). BEX__PS_LATER, SERVE_HERE (a Push served as any
 * replica's), 0 (a Forward applied) or an error. */
#define SERVE_HERE 2
static int repl_serve(bex_ps_shard *s, uint32_t method, const struct bex__ps_hdr *h,
                      const void *body, size_t len, bex_rpc_req *req)
{
    if (method == BEX_PS_M_FORWARD && !req)
        return role_refused(s, -EOPNOTSUPP, "a Forward");
    if (method == BEX_PS_M_FORWARD && s->rp.role != BEX_PS_ROLE_BACKUP)
        return role_refused(s, -EPERM, "a Forward"); /* its sender is no primary of ours */
    if (method == BEX_PS_M_FORWARD)
        return bex__ps_backup_forward(s, body, len, req);
    if (s->rp.role == BEX_PS_ROLE_BACKUP)
        return role_refused(s, -EPERM, "a client's Push");
    if (s->rp.role != BEX_PS_ROLE_PRIMARY)
        return SERVE_HERE;
    return req ? bex__ps_primary_push(s, h, body, len, req)
               : role_refused(s, -EOPNOTSUPP, "a primary's Push");
}

/* A Fetch's or Push's body refused as malformed (-EINVAL) or too large
 * (-E2BIG): counted, and said. Out of line: no request served pays for its
 * frame. */
static __attribute__((noinline, cold)) void refused_body(bex_ps_shard *s, uint32_t method,
                                                         size_t len, int rc)
{
    pthread_mutex_lock(&s->mu);
    s->st.malformed++;
    pthread_mutex_unlock(&s->mu);
    /* rate-limited by the logger: a peer can send many */
    bex__log(&s->log, BEX_LOG_WARN, "ps shard %u: %s body of %zu bytes refused: %s", s->shard,
             method == BEX_PS_M_FETCH ? "Fetch" : "Push", len, bex_strerror(rc));
}

/* bex_ps_shard_serve for the RPC request req (NULL: none); BEX__PS_LATER
 * when req is answered later. A Fetch or Push served here sets *t_end to
 * the time its latency sample ended (0 stays: none read). */
static int shard_serve(bex_ps_shard *s, bex_ctx *ctx, uint32_t method, const void *body, size_t len,
                       bex_rpc_req *req, void **resp, size_t *resp_len, uint64_t *t_end)
{
    if (method == BEX_PS_M_COPY)
        return serve_copy(s, ctx, body, len, resp, resp_len);
    if (method == BEX_PS_M_CUT)
        return bex__ps_cut_serve(s, ctx, body, len, req, resp, resp_len);
    if (method == BEX_PS_M_FORWARD)
        return repl_serve(s, method, NULL, body, len, req);
    if (method != BEX_PS_M_FETCH && method != BEX_PS_M_PUSH)
        return -ENOSYS;
    struct bex__ps_hdr h;
    /* an RPC's time counts from its dispatch: no clock read of our own */
    uint64_t t0 = req ? bex__rpc_req_start_ns(req) : bex__rpc_now_ns();
    int rc = bex__ps_decode(method, body, len, &h);
    if (rc == 0 && method == BEX_PS_M_PUSH)
        rc = repl_serve(s, method, &h, body, len, req);
    if (rc == 0 || rc == SERVE_HERE) {
        const uint8_t *p = (const uint8_t *)body + bex__ps_keys_off(&h);
        rc = method == BEX_PS_M_FETCH
                 ? bex__ps_serve_fetch(s, ctx, &h, p, t0, t_end, resp, resp_len)
                 : bex__ps_serve_push(s, ctx, &h, p, req, resp, resp_len);
    }
    if (rc == 0 && method == BEX_PS_M_PUSH) {
        /* the table exists: the request was served (a Fetch counted its
         * time under the rows' lock) */
        *t_end = bex__rpc_now_ns();
        pthread_mutex_lock(&s->mu);
        bex__rpc_hist_add(&bex__ps_find_table(s, h.table)->lat[1], *t_end - t0);
        pthread_mutex_unlock(&s->mu);
    }
    if (rc == -EINVAL || rc == -E2BIG)
        refused_body(s, method, len, rc);
    return rc;
}

int bex_ps_shard_serve(bex_ps_shard *s, bex_ctx *ctx, uint32_t method, const void *body, size_t len,
                       void **resp, size_t *resp_len)
{
    uint64_t t_end = 0;
    return shard_serve(s, ctx, method, body, len, NULL, resp, resp_len, &t_end);
}

void bex__ps_handle(struct reg *r, bex_rpc_req *req, void *body, size_t len)
{
    void *resp = NULL;
    size_t rlen = 0;
    uint64_t t_end = 0;
    int rc = shard_serve(r->s, r->ctx, r->method, body, len, req, &resp, &rlen, &t_end);
    bex_rpc_free(body);
    /* the RPC's latency sample ends where the PS's did: one clock read */
    if (rc != BEX__PS_LATER)
        bex__rpc_reply_at(req, rc, resp, rlen, t_end);
}

/* A Fetch's handler: shard_serve's Fetch path, straight. A Fetch is the
 * request a spread Fetch makes once per shard, and is never held for a cut
 * nor replicated: the method dispatch, the Push's branches and two frames
 * of arguments were some 80 instructions a sub-request (issue 25 item 5). */
static void fetch_handler(bex_rpc_req *req, void *body, size_t len, void *user)
{
    struct reg *r = user;
    bex_ps_shard *s = r->s;
    struct bex__ps_hdr h;
    void *resp = NULL;
    size_t rlen = 0;
    uint64_t t_end = 0;
    int rc = bex__ps_decode(BEX_PS_M_FETCH, body, len, &h);
    if (rc == 0)
        /* an RPC's time counts from its dispatch: no clock read of our own */
        rc = bex__ps_serve_fetch(s, r->ctx, &h, (const uint8_t *)body + bex__ps_keys_off(&h),
                                 bex__rpc_req_start_ns(req), &t_end, &resp, &rlen);
    if (rc == -EINVAL || rc == -E2BIG)
        refused_body(s, BEX_PS_M_FETCH, len, rc);
    bex_rpc_free(body);
    /* the RPC's latency sample ends where the PS's did: one clock read */
    bex__rpc_reply_at(req, rc, resp, rlen, t_end);
}

static void handler(bex_rpc_req *req, void *body, size_t len, void *user)
{
    struct reg *r = user;
    bool push = r->method == BEX_PS_M_PUSH;
    if (push && bex__ps_cut_hold(r->s, r, req, body, len))
        return; /* held for a cut: served when it releases the Pushes */
    bex__ps_handle(r, req, body, len);
    if (push)
        bex__ps_cut_done(r->s);
}

int bex_ps_shard_register(bex_ps_shard *s, bex_rpc_server *srv, bex_ctx *ctx)
{
    if (!s || !srv || !ctx)
        return -EINVAL;
    struct reg *regs = s->regs;
    regs[0] = (struct reg){s, ctx, BEX_PS_M_FETCH};
    regs[1] = (struct reg){s, ctx, BEX_PS_M_PUSH};
    regs[2] = (struct reg){s, ctx, BEX_PS_M_COPY};
    regs[3] = (struct reg){s, ctx, BEX_PS_M_FORWARD};
    regs[4] = (struct reg){s, ctx, BEX_PS_M_CUT};
    int rc = bex__ps_repl_register(s, ctx);
    if (rc)
        return rc;
    for (int i = 0; i < 5; i++) {
        rc = bex_rpc_server_register(srv, BEX_PS_SERVICE, regs[i].method,
                                     bex__ps_method_flags(regs[i].method),
                                     i == 0 ? fetch_handler : handler, &regs[i]);
        if (rc)
            return rc;
    }
    return 0;
}
