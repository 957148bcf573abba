/* SPDX-License-Identifier: Apache-2.0 */
/* Leases and elections in etcd (elect.h): one lease per bex__elect, kept
 * alive by its thread; a campaign is one transaction (create the key only
 * if absent, under the lease), so at most one holder at a time and each
 * term's epoch (the key's create_revision) above every earlier one. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "rpc/elect.h"
#include "rpc/etcd_internal.h"
#include "rpc/internal.h"

struct bex__elect {
    char *url;
    int64_t lease;
    uint64_t margin_ns, ttl_s;
    _Atomic uint64_t until_ns;
    pthread_t thr;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop, hold;
};

/* The deadline after an answer of ttl seconds to a request sent at t0. */
static uint64_t deadline_of(const bex__elect *e, uint64_t t0, int64_t ttl)
{
    uint64_t d = t0 + (uint64_t)ttl * 1000000000ull;
    return ttl > 0 && d > t0 + e->margin_ns ? d - e->margin_ns : 0;
}

static int grant(bex__elect *e, char *err, size_t errlen)
{
    json_t *req = json_pack("{s:I}", "TTL", (json_int_t)e->ttl_s), *resp = NULL;
    if (!req)
        return -ENOMEM;
    uint64_t t0 = bex__rpc_now_ns();
    int rc = bex__etcd_call(e->url, "/v3/lease/grant", req, &resp, err, errlen);
    json_decref(req);
    if (rc)
        return rc;
    e->lease = bex__etcd_num(json_object_get(resp, "ID"));
    int64_t ttl = bex__etcd_num(json_object_get(resp, "TTL"));
    json_decref(resp);
    if (!e->lease || ttl <= 0)
        return -EPROTO;
    atomic_store(&e->until_ns, deadline_of(e, t0, ttl));
    return 0;
}

/* One keep-alive; the deadline moves on only with an answer. */
static void keepalive_once(bex__elect *e)
{
    char ids[32], err[256] = "";
    snprintf(ids, sizeof ids, "%lld", (long long)e->lease);
    json_t *req = json_pack("{s:s}", "ID", ids), *resp = NULL;
    uint64_t t0 = bex__rpc_now_ns();
    int rc =
        req ? bex__etcd_call(e->url, "/v3/lease/keepalive", req, &resp, err, sizeof err) : -ENOMEM;
    json_decref(req);
    if (rc == 0) {
        int64_t ttl = bex__etcd_num(json_object_get(json_object_get(resp, "result"), "TTL"));
        uint64_t d = deadline_of(e, t0, ttl);
        if (ttl <= 0)
            atomic_store(&e->until_ns, 0); /* expired: lost for good */
        else if (atomic_load(&e->until_ns) && d > atomic_load(&e->until_ns))
            atomic_store(&e->until_ns, d);
    }
    json_decref(resp);
}

static void *keepalive_main(void *arg)
{
    bex__elect *e = arg;
    pthread_mutex_lock(&e->mu);
    while (!e->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + e->ttl_s * 1000000000ull / 3;
        ts.tv_sec += (time_t)(ns / 1000000000ull);
        ts.tv_nsec = (long)(ns % 1000000000ull);
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
        if (e->stop)
            break;
        if (e->hold)
            continue;
        pthread_mutex_unlock(&e->mu);
        keepalive_once(e);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

int bex__elect_create(const char *url, uint32_t ttl_ms, uint32_t margin_ms, bex__elect **out,
                      char *err, size_t errlen)
{
    if (!url || !out || !ttl_ms)
        return -EINVAL;
    bex__elect *e = calloc(1, sizeof *e);
    if (!e || !(e->url = strdup(url))) {
        free(e);
        return -ENOMEM;
    }
    e->ttl_s = (ttl_ms + 999) / 1000;
    e->margin_ns = (uint64_t)margin_ms * 1000000ull;
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc = grant(e, err, errlen);
    if (!rc)
        rc = -pthread_create(&e->thr, NULL, keepalive_main, e);
    if (rc) {
        pthread_cond_destroy(&e->cv);
        pthread_mutex_destroy(&e->mu);
        free(e->url);
        free(e);
        return rc;
    }
    *out = e;
    return 0;
}

void bex__elect_destroy(bex__elect *e, bool revoke)
{
    if (!e)
        return;
    pthread_mutex_lock(&e->mu);
    e->stop = true;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thr, NULL);
    if (revoke) {
        char ids[32];
        snprintf(ids, sizeof ids, "%lld", (long long)e->lease);
        json_t *req = json_pack("{s:s}", "ID", ids), *resp = NULL;
        if (req)
            bex__etcd_call(e->url, "/v3/lease/revoke", req, &resp, NULL, 0);
        json_decref(req);
        json_decref(resp);
    }
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e->url);
    free(e);
}

uint64_t bex__elect_until_ns(const bex__elect *e)
{
    return atomic_load(&e->until_ns);
}

void bex__elect_hold(bex__elect *e, bool hold)
{
    pthread_mutex_lock(&e->mu);
    e->hold = hold;
    pthread_mutex_unlock(&e->mu);
}

/* ---- transactions ---- */

static json_t *cmp(const char *k64, const char *target, const char *field, uint64_t v)
{
    char n[32];
    snprintf(n, sizeof n, "%llu", (unsigned long long)v);
    return json_pack("{s:s, s:s, s:s, s:s}", "key", k64, "target", target, "result", "EQUAL", field,
                     n);
}

/* The first kv of a range answer (json of the range response), or NULL. */
static json_t *first_kv(json_t *range)
{
    return json_array_get(json_object_get(range, "kvs"), 0);
}

/* kv's create/mod revisions and value into the outputs (absent: zeros). */
static void kv_read(json_t *kv, uint64_t *create_rev, uint64_t *mod_rev, char *val, size_t cap)
{
    *create_rev = kv ? (uint64_t)bex__etcd_num(json_object_get(kv, "create_revision")) : 0;
    if (mod_rev)
        *mod_rev = kv ? (uint64_t)bex__etcd_num(json_object_get(kv, "mod_revision")) : 0;
    if (!val || !cap)
        return;
    val[0] = 0;
    const char *v64 = kv ? json_string_value(json_object_get(kv, "value")) : NULL;
    char *v = v64 ? bex__etcd_unb64(v64, NULL) : NULL;
    if (v)
        snprintf(val, cap, "%s", v);
    free(v);
}

/* Run txn at url; 1 succeeded, 0 not (*resp kept for the caller), <0. */
static int txn(const char *url, json_t *t, json_t **resp)
{
    int rc = t ? bex__etcd_call(url, "/v3/kv/txn", t, resp, NULL, 0) : -ENOMEM;
    json_decref(t);
    if (rc)
        return rc;
    return json_is_true(json_object_get(*resp, "succeeded")) ? 1 : 0;
}

int bex__elect_campaign(bex__elect *e, const char *key, const char *val, const char *guard,
                        uint64_t guard_rev, uint64_t *epoch, char *holder, size_t cap)
{
    char *k64 = bex__etcd_b64(key), *v64 = bex__etcd_b64(val),
         *g64 = guard ? bex__etcd_b64(guard) : NULL;
    char ids[32];
    snprintf(ids, sizeof ids, "%lld", (long long)e->lease);
    json_t *c = json_array(), *t = NULL, *resp = NULL;
    int rc = -ENOMEM;
    if (k64 && v64 && c && (!guard || g64)) {
        json_array_append_new(c, cmp(k64, "CREATE", "create_revision", 0));
        if (guard)
            json_array_append_new(c, cmp(g64, "MOD", "mod_revision", guard_rev));
        t = json_pack("{s:O, s:[{s:{s:s, s:s, s:s}}], s:[{s:{s:s}}]}", "compare", c, "success",
                      "request_put", "key", k64, "value", v64, "lease", ids, "failure",
                      "request_range", "key", k64);
        rc = txn(e->url, t, &resp);
    }
    if (rc == 1) {
        *epoch =
            (uint64_t)bex__etcd_num(json_object_get(json_object_get(resp, "header"), "revision"));
        if (holder && cap)
            snprintf(holder, cap, "%s", val);
    } else if (rc == 0) {
        json_t *r = json_object_get(json_array_get(json_object_get(resp, "responses"), 0),
                                    "response_range");
        kv_read(first_kv(r), epoch, NULL, holder, cap);
    }
    json_decref(resp);
    json_decref(c);
    free(k64);
    free(v64);
    free(g64);
    return rc;
}

int bex__elect_get(const char *url, const char *key, uint64_t *create_rev, uint64_t *mod_rev,
                   char *val, size_t cap)
{
    char *k64 = bex__etcd_b64(key);
    json_t *req = k64 ? json_pack("{s:s}", "key", k64) : NULL, *resp = NULL;
    int rc = req ? bex__etcd_call(url, "/v3/kv/range", req, &resp, NULL, 0) : -ENOMEM;
    if (rc == 0)
        kv_read(first_kv(resp), create_rev, mod_rev, val, cap);
    json_decref(req);
    json_decref(resp);
    free(k64);
    return rc;
}

int bex__elect_put_if(const char *url, const char *key, const char *val, const char *guard,
                      uint64_t epoch)
{
    char *k64 = bex__etcd_b64(key), *v64 = bex__etcd_b64(val), *g64 = bex__etcd_b64(guard);
    json_t *resp = NULL;
    int rc = -ENOMEM;
    if (k64 && v64 && g64 && epoch) {
        json_t *t = json_pack("{s:[o], s:[{s:{s:s, s:s}}]}", "compare",
                              cmp(g64, "CREATE", "create_revision", epoch), "success",
                              "request_put", "key", k64, "value", v64);
        rc = txn(url, t, &resp);
        rc = rc == 1 ? 0 : rc == 0 ? -ESTALE : rc;
    }
    json_decref(resp);
    free(k64);
    free(v64);
    free(g64);
    return rc;
}
