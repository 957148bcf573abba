/* SPDX-License-Identifier: Apache-2.0 */
/* etcd v3 as a directory source, through etcd's JSON gateway over HTTP
 * (libcurl, jansson; keys and values base64 in that API, by libsodium).
 *
 * Key layout (docs/protocol.md, "Service directory in etcd"):
 *   <prefix>services/<service>/<shard>/<a.b.c.d:port>
 * with a JSON value {"addr": ..., "locality": ..., "transport": ...}, put
 * under a lease the registering server keeps alive. A client reads the
 * prefix, then watches it from the next revision on; a broken watch is
 * read and watched again. */
#include <arpa/inet.h>
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "rpc/dir_internal.h"
#include "rpc/etcd_internal.h"
#include "rpc/etcd_tls.h"
#include "rpc/internal.h"

#define OP_TIMEOUT_MS 3000 /* one unary call to etcd */

__attribute__((format(printf, 3, 4))) static void set_err(char *err, size_t errlen, const char *fmt,
                                                          ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init_once(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

/* ---- base64 ---- */

static char *b64_enc(const void *p, size_t n)
{
    size_t cap = sodium_base64_ENCODED_LEN(n, sodium_base64_VARIANT_ORIGINAL);
    char *s = malloc(cap);
    if (s)
        sodium_bin2base64(s, cap, p, n, sodium_base64_VARIANT_ORIGINAL);
    return s;
}

/* Decoded into a NUL-terminated buffer; NULL if not base64 or no memory. */
static char *b64_dec(const char *s, size_t *len)
{
    size_t sl = strlen(s), n = 0;
    char *out = malloc(sl / 4 * 3 + 4);
    if (!out)
        return NULL;
    if (sodium_base642bin((unsigned char *)out, sl / 4 * 3 + 3, s, sl, NULL, &n, NULL,
                          sodium_base64_VARIANT_ORIGINAL)) {
        free(out);
        return NULL;
    }
    out[n] = 0;
    if (len)
        *len = n;
    return out;
}

/* The end of a prefix range: the prefix with its last byte + 1. */
static char *range_end(const char *prefix)
{
    char *e = strdup(prefix);
    if (e) {
        size_t n = strlen(e);
        e[n - 1]++;
    }
    return e;
}

/* ---- unary calls ---- */

struct buf {
    char *p;
    size_t n, cap;
};

static size_t buf_write(char *data, size_t sz, size_t nm, void *arg)
{
    struct buf *b = arg;
    size_t n = sz * nm;
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char *p = realloc(b->p, cap);
        if (!p)
            return 0;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
    b->p[b->n] = 0;
    return n;
}

static int curl_errno(CURLcode c)
{
    switch (c) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
        return -ECONNREFUSED;
    case CURLE_OPERATION_TIMEDOUT:
        return -ETIMEDOUT;
    case CURLE_OUT_OF_MEMORY:
        return -ENOMEM;
    default:
        return -EIO;
    }
}

static CURL *easy_for(const char *url, const char *path, const char *body, struct buf *b,
                      struct curl_slist **hdrs)
{
    pthread_once(&curl_once, curl_init_once);
    CURL *e = curl_easy_init();
    if (!e)
        return NULL;
    size_t ul = strlen(url) + strlen(path) + 1;
    char *full = malloc(ul);
    if (!full) {
        curl_easy_cleanup(e);
        return NULL;
    }
    snprintf(full, ul, "%s%s", url, path);
    curl_easy_setopt(e, CURLOPT_URL, full);
    free(full); /* libcurl keeps its own copy */
    curl_easy_setopt(e, CURLOPT_COPYPOSTFIELDS, body);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, buf_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, b);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)OP_TIMEOUT_MS);
    *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    bex__etcd_http_setup(e, url, hdrs); /* TLS and the auth token */
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, *hdrs);
    return e;
}

/* One POST of text to url + path: the answer's status and body into
 * *code and b. */
static CURLcode post_once(const char *url, const char *path, const char *text, struct buf *b,
                          long *code)
{
    struct curl_slist *hdrs = NULL;
    CURL *e = easy_for(url, path, text, b, &hdrs);
    if (!e) {
        curl_slist_free_all(hdrs);
        return CURLE_OUT_OF_MEMORY;
    }
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)OP_TIMEOUT_MS);
    CURLcode c = curl_easy_perform(e);
    *code = 0;
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, code);
    curl_easy_cleanup(e);
    curl_slist_free_all(hdrs);
    return c;
}

/* POST body (JSON) to url + path; *out gets the answer's JSON. A token
 * etcd refused (expired) is fetched again, once. */
static int call(const char *url, const char *path, json_t *body, json_t **out, char *err,
                size_t errlen)
{
    char *text = json_dumps(body, JSON_COMPACT);
    if (!text)
        return -ENOMEM;
    struct buf b = {0};
    long code;
    CURLcode c = post_once(url, path, text, &b, &code);
    if (c == CURLE_OK && code != 200 && bex__etcd_token_refused(code, b.p)) {
        free(b.p);
        b = (struct buf){0};
        c = post_once(url, path, text, &b, &code);
    }
    free(text);
    int rc = 0;
    if (c != CURLE_OK) {
        set_err(err, errlen, "etcd %s%s: %s", url, path, curl_easy_strerror(c));
        rc = curl_errno(c);
    } else if (code != 200) {
        set_err(err, errlen, "etcd %s%s: HTTP %ld: %.200s", url, path, code, b.p ? b.p : "");
        rc = -EPROTO;
    } else {
        json_error_t je;
        *out = json_loadb(b.p ? b.p : "", b.n, 0, &je);
        if (!*out) {
            set_err(err, errlen, "etcd %s%s: not JSON: %s", url, path, je.text);
            rc = -EPROTO;
        }
    }
    free(b.p);
    return rc;
}

/* etcd's 64-bit numbers come as strings in JSON. */
static int64_t num(json_t *v)
{
    if (json_is_string(v))
        return strtoll(json_string_value(v), NULL, 10);
    if (json_is_integer(v))
        return json_integer_value(v);
    return 0;
}

/* ---- the watch ---- */

/* Lines logged once until things are well again (bex__log_first): the
 * watch's loss, a registration's lease lost. */
enum { LOGGED_DOWN = 1, LOGGED_LOST = 2 };

struct entry {
    char *key;
    struct bex__dir_member m;
};

struct bex__etcd_watch {
    bex_dir *d;
    char *url, *prefix, *prefix64, *end64;
    struct entry *ents;
    size_t n, cap;
    int64_t rev; /* watch from rev + 1 */
    pthread_t thr;
    pthread_mutex_t mu; /* stop, multi */
    pthread_cond_t cv;
    bool stop;
    CURLM *multi;
    struct buf line; /* the stream's partial line */
    bool stream_bad;
    uint32_t logged; /* LOGGED_DOWN: the watch's loss was logged (bex__log_first) */
};

/* A key of ours to (service, shard, address); false for any other key. */
static bool parse_key(const struct bex__etcd_watch *w, const char *key, struct bex__dir_member *m)
{
    size_t pl = strlen(w->prefix);
    if (strncmp(key, w->prefix, pl) || strncmp(key + pl, "services/", 9))
        return false;
    const char *s = key + pl + 9, *a = strchr(s, '/');
    if (!a || a == s || (size_t)(a - s) > BEX_DIR_NAME_MAX)
        return false;
    memset(m, 0, sizeof(*m));
    memcpy(m->service, s, (size_t)(a - s));
    char *end;
    unsigned long sh = strtoul(a + 1, &end, 10);
    if (end == a + 1 || *end != '/' || sh > UINT32_MAX)
        return false;
    m->shard = (uint32_t)sh;
    return bex__dir_parse_addr(end + 1, &m->r.addr, NULL, 0) == 0;
}

static void ent_del(struct bex__etcd_watch *w, const char *key)
{
    for (size_t i = 0; i < w->n; i++)
        if (!strcmp(w->ents[i].key, key)) {
            free(w->ents[i].key);
            w->ents[i] = w->ents[--w->n];
            return;
        }
}

static int ent_put(struct bex__etcd_watch *w, const char *key, const char *val, size_t vlen)
{
    struct bex__dir_member m;
    char err[200];
    if (!parse_key(w, key, &m)) {
        size_t pl = strlen(w->prefix);
        if (strncmp(key, w->prefix, pl) || strncmp(key + pl, "services/", 9))
            return 0; /* not a directory key (the failover's <prefix>ps/...): not ours */
        bex__log(bex__dir_log(w->d), BEX_LOG_WARN,
                 "dir: etcd key %s: not %sservices/<service>/"
                 "<shard>/<a.b.c.d:port>: ignored",
                 key, w->prefix);
        return 0;
    }
    bex_addr ka = m.r.addr;
    if (bex__dir_parse_replica_json(val, vlen, &m.r, err, sizeof err) ||
        !bex_addr_equal(&m.r.addr, &ka)) {
        bex__log(bex__dir_log(w->d), BEX_LOG_WARN, "dir: etcd key %s: bad value (%s): ignored", key,
                 err[0] ? err : "its addr is not the key's");
        ent_del(w, key);
        return 0;
    }
    for (size_t i = 0; i < w->n; i++)
        if (!strcmp(w->ents[i].key, key)) {
            w->ents[i].m = m;
            return 0;
        }
    if (w->n == w->cap) {
        size_t cap = w->cap ? 2 * w->cap : 16;
        struct entry *e = realloc(w->ents, cap * sizeof(*e));
        if (!e)
            return -ENOMEM;
        w->ents = e;
        w->cap = cap;
    }
    if (!(w->ents[w->n].key = strdup(key)))
        return -ENOMEM;
    w->ents[w->n++].m = m;
    return 0;
}

/* A kv object of etcd's: key and value decoded. */
static int kv_apply(struct bex__etcd_watch *w, json_t *kv, bool del)
{
    const char *k64 = json_string_value(json_object_get(kv, "key"));
    if (!k64)
        return 0;
    char *key = b64_dec(k64, NULL);
    if (!key)
        return 0;
    int rc = 0;
    if (del) {
        ent_del(w, key);
    } else {
        const char *v64 = json_string_value(json_object_get(kv, "value"));
        size_t vlen = 0;
        char *val = b64_dec(v64 ? v64 : "", &vlen);
        rc = val ? ent_put(w, key, val, vlen) : 0;
        free(val);
    }
    free(key);
    return rc;
}

static int publish(struct bex__etcd_watch *w)
{
    struct bex__dir_member *m = malloc((w->n ? w->n : 1) * sizeof(*m));
    if (!m)
        return -ENOMEM;
    for (size_t i = 0; i < w->n; i++)
        m[i] = w->ents[i].m;
    int rc = bex__dir_set_members(w->d, m, w->n);
    free(m);
    return rc;
}

/* Read everything under the prefix: the entries and the revision. */
static int read_all(struct bex__etcd_watch *w, char *err, size_t errlen)
{
    json_t *req = json_pack("{s:s, s:s}", "key", w->prefix64, "range_end", w->end64);
    json_t *resp = NULL;
    if (!req)
        return -ENOMEM;
    int rc = call(w->url, "/v3/kv/range", req, &resp, err, errlen);
    json_decref(req);
    if (rc)
        return rc;
    for (size_t i = 0; i < w->n; i++)
        free(w->ents[i].key);
    w->n = 0;
    size_t i;
    json_t *kv;
    json_array_foreach(json_object_get(resp, "kvs"), i, kv)
    {
        if ((rc = kv_apply(w, kv, false)))
            break;
    }
    w->rev = num(json_object_get(json_object_get(resp, "header"), "revision"));
    json_decref(resp);
    if (!rc)
        rc = publish(w);
    if (rc == -ENOSPC)
        set_err(err, errlen, "more addresses in etcd than the directory's max_nodes");
    return rc;
}

/* One line of the watch stream: {"result": {"events": [...], ...}}. */
static void stream_line(struct bex__etcd_watch *w, const char *text, size_t n)
{
    json_error_t je;
    json_t *o = json_loadb(text, n, 0, &je);
    json_t *res = json_object_get(o, "result");
    if (!res || json_is_true(json_object_get(res, "canceled"))) {
        if (!w->stream_bad)
            bex__log(bex__dir_log(w->d), BEX_LOG_WARN, "dir: etcd watch: %s: %.200s",
                     res ? "cancelled" : "unexpected answer", text);
        w->stream_bad = true;
        json_decref(o);
        return;
    }
    size_t i;
    json_t *ev;
    bool changed = false;
    json_array_foreach(json_object_get(res, "events"), i, ev)
    {
        const char *type = json_string_value(json_object_get(ev, "type"));
        kv_apply(w, json_object_get(ev, "kv"), type && !strcmp(type, "DELETE"));
        changed = true;
    }
    int64_t rev = num(json_object_get(json_object_get(res, "header"), "revision"));
    if (rev > w->rev)
        w->rev = rev;
    json_decref(o);
    if (changed)
        publish(w);
}

static size_t stream_write(char *data, size_t sz, size_t nm, void *arg)
{
    struct bex__etcd_watch *w = arg;
    size_t n = sz * nm;
    if (!buf_write(data, 1, n, &w->line))
        return 0;
    char *nl;
    size_t off = 0;
    while ((nl = memchr(w->line.p + off, '\n', w->line.n - off))) {
        stream_line(w, w->line.p + off, (size_t)(nl - (w->line.p + off)));
        off = (size_t)(nl - w->line.p) + 1;
    }
    memmove(w->line.p, w->line.p + off, w->line.n - off);
    w->line.n -= off;
    return w->stream_bad ? 0 : n;
}

/* Watch from w->rev + 1 until the stream breaks or stop. */
static void watch_stream(struct bex__etcd_watch *w)
{
    json_t *req = json_pack("{s:{s:s, s:s, s:I}}", "create_request", "key", w->prefix64,
                            "range_end", w->end64, "start_revision", (json_int_t)(w->rev + 1));
    char *text = req ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    if (!text)
        return;
    struct buf unused = {0};
    struct curl_slist *hdrs = NULL;
    CURL *e = easy_for(w->url, "/v3/watch", text, &unused, &hdrs);
    free(text);
    if (!e) {
        curl_slist_free_all(hdrs);
        return;
    }
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, stream_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, w);
    w->line.n = 0;
    w->stream_bad = false;
    pthread_mutex_lock(&w->mu);
    bool stop = w->stop;
    if (!stop)
        curl_multi_add_handle(w->multi, e);
    pthread_mutex_unlock(&w->mu);
    int running = !stop;
    CURLcode res = CURLE_OK;
    while (running) {
        if (curl_multi_perform(w->multi, &running) != CURLM_OK)
            break;
        if (running)
            curl_multi_poll(w->multi, NULL, 0, 1000, NULL);
        pthread_mutex_lock(&w->mu);
        stop = w->stop;
        pthread_mutex_unlock(&w->mu);
        if (stop)
            break;
        if ((w->logged & LOGGED_DOWN) && running) {
            bex__log(bex__dir_log(w->d), BEX_LOG_WARN, "dir: etcd watch on %s re-established",
                     w->url);
            w->logged = 0;
        }
    }
    int q;
    CURLMsg *msg;
    while ((msg = curl_multi_info_read(w->multi, &q)))
        if (msg->msg == CURLMSG_DONE)
            res = msg->data.result;
    curl_multi_remove_handle(w->multi, e);
    curl_easy_cleanup(e);
    curl_slist_free_all(hdrs);
    if (!stop && bex__log_first(&w->logged, LOGGED_DOWN))
        bex__log(bex__dir_log(w->d), BEX_LOG_WARN,
                 "dir: etcd watch on %s broke (%s): reading again every second", w->url,
                 res != CURLE_OK ? curl_easy_strerror(res) : "stream ended");
}

static void *watch_main(void *arg)
{
    struct bex__etcd_watch *w = arg;
    bool first = true;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        if (!first && !w->stop) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&w->cv, &w->mu, &ts);
        }
        bool stop = w->stop;
        pthread_mutex_unlock(&w->mu);
        if (stop)
            break;
        char err[256];
        /* the first time, the start read just now; later, read again */
        if (!first && read_all(w, err, sizeof err)) {
            if (bex__log_first(&w->logged, LOGGED_DOWN))
                bex__log(bex__dir_log(w->d), BEX_LOG_WARN, "dir: %s", err);
            continue;
        }
        first = false;
        watch_stream(w);
    }
    return NULL;
}

static void watch_free(struct bex__etcd_watch *w)
{
    for (size_t i = 0; i < w->n; i++)
        free(w->ents[i].key);
    free(w->ents);
    free(w->line.p);
    free(w->url);
    free(w->prefix);
    free(w->prefix64);
    free(w->end64);
    if (w->multi)
        curl_multi_cleanup(w->multi);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

static int watch_start(bex_dir *d, const char *url, const char *prefix, char *err, size_t errlen,
                       struct bex__etcd_watch **out)
{
    if (!*prefix) {
        set_err(err, errlen, "empty etcd prefix");
        return -EINVAL;
    }
    pthread_once(&curl_once, curl_init_once);
    struct bex__etcd_watch *w = calloc(1, sizeof(*w));
    if (!w)
        return -ENOMEM;
    w->d = d;
    pthread_mutex_init(&w->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    char *end = range_end(prefix);
    w->url = strdup(url);
    w->prefix = strdup(prefix);
    w->prefix64 = b64_enc(prefix, strlen(prefix));
    w->end64 = end ? b64_enc(end, strlen(end)) : NULL;
    free(end);
    w->multi = curl_multi_init();
    int rc = -ENOMEM;
    if (!w->url || !w->prefix || !w->prefix64 || !w->end64 || !w->multi)
        goto err_free;
    if ((rc = read_all(w, err, errlen)))
        goto err_free;
    if ((rc = -pthread_create(&w->thr, NULL, watch_main, w)))
        goto err_free;
    *out = w;
    return 0;

err_free:
    watch_free(w);
    return rc;
}

static void watch_stop(void *arg)
{
    struct bex__etcd_watch *w = arg;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    curl_multi_wakeup(w->multi);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thr, NULL);
    watch_free(w);
}

int bex_dir_watch_etcd(bex_dir *d, const char *url, const char *prefix, char *err, size_t errlen)
{
    if (!d || !url)
        return -EINVAL;
    if (bex__dir_source_claim(d)) {
        set_err(err, errlen, "the directory follows etcd already");
        return -EBUSY;
    }
    struct bex__etcd_watch *w;
    int rc = watch_start(d, url, prefix ? prefix : "/bex/", err, errlen, &w);
    bex__dir_source_set(d, rc ? NULL : w, watch_stop);
    return rc;
}

/* ---- registration ---- */

struct bex_dir_registration {
    char *url, *key64, *val64;
    uint32_t ttl_s;
    int64_t lease;
    pthread_t thr;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    uint32_t logged; /* LOGGED_LOST: the lease's loss was logged (bex__log_first) */
};

static int lease_grant_put(struct bex_dir_registration *r, char *err, size_t errlen)
{
    json_t *req = json_pack("{s:I}", "TTL", (json_int_t)r->ttl_s), *resp = NULL;
    if (!req)
        return -ENOMEM;
    int rc = call(r->url, "/v3/lease/grant", req, &resp, err, errlen);
    json_decref(req);
    if (rc)
        return rc;
    int64_t id = num(json_object_get(resp, "ID"));
    json_decref(resp);
    if (!id) {
        set_err(err, errlen, "etcd %s: lease grant without an ID", r->url);
        return -EPROTO;
    }
    char ids[32];
    snprintf(ids, sizeof ids, "%lld", (long long)id);
    req = json_pack("{s:s, s:s, s:s}", "key", r->key64, "value", r->val64, "lease", ids);
    if (!req)
        return -ENOMEM;
    rc = call(r->url, "/v3/kv/put", req, &resp, err, errlen);
    json_decref(req);
    if (rc)
        return rc;
    json_decref(resp);
    pthread_mutex_lock(&r->mu);
    r->lease = id;
    pthread_mutex_unlock(&r->mu);
    return 0;
}

/* Keep the lease alive every third of its TTL; a lease found gone (etcd
 * answers TTL 0: it expired while we could not reach it) is granted and
 * the key put again. */
static void *keepalive_main(void *arg)
{
    struct bex_dir_registration *r = arg;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ms = r->ttl_s * 1000ull / 3;
        ts.tv_sec += (time_t)(ms / 1000);
        ts.tv_nsec += (long)(ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
        if (r->stop)
            break;
        char ids[32];
        snprintf(ids, sizeof ids, "%lld", (long long)r->lease);
        pthread_mutex_unlock(&r->mu);
        char err[256] = "";
        json_t *req = json_pack("{s:s}", "ID", ids), *resp = NULL;
        int rc = req ? call(r->url, "/v3/lease/keepalive", req, &resp, err, sizeof err) : -ENOMEM;
        json_decref(req);
        if (!rc && num(json_object_get(json_object_get(resp, "result"), "TTL")) <= 0)
            rc = lease_grant_put(r, err, sizeof err);
        json_decref(resp);
        if (!rc)
            r->logged = 0; /* a later loss is logged again */
        else if (bex__log_first(&r->logged, LOGGED_LOST))
            bex__log(NULL, BEX_LOG_WARN, "dir: registration keepalive: %s (%s)", bex_strerror(rc),
                     err);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static void reg_free(struct bex_dir_registration *r)
{
    free(r->url);
    free(r->key64);
    free(r->val64);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

int bex_dir_register_etcd(const char *url, const char *prefix, const char *service, uint32_t shard,
                          const bex_dir_replica *self, uint32_t ttl_s, char *err, size_t errlen,
                          bex_dir_registration **out)
{
    if (!url || !service || !self || !out || !*service || strchr(service, '/') ||
        strlen(service) > BEX_DIR_NAME_MAX || !bex_addr_valid(&self->addr) ||
        !bex_addr_port(&self->addr) || !bex__dir_locality_ok(self->locality) ||
        self->transport > BEX_TRANSPORT_TCP || (prefix && !*prefix)) {
        set_err(err, errlen, "bad argument");
        return -EINVAL;
    }
    pthread_once(&curl_once, curl_init_once);
    struct bex_dir_registration *r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->ttl_s = ttl_s ? ttl_s : 10;
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    char addr[BEX_ADDR_STRLEN], key[256];
    bex_addr_format(&self->addr, true, addr, sizeof addr);
    snprintf(key, sizeof key, "%sservices/%s/%u/%s", prefix ? prefix : "/bex/", service, shard,
             addr);
    static const char *const tnames[] = {"auto", "rdma", "tcp"};
    json_t *v = json_pack("{s:s, s:s, s:s}", "addr", addr, "locality", self->locality, "transport",
                          tnames[self->transport]);
    char *vtext = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    r->url = strdup(url);
    r->key64 = b64_enc(key, strlen(key));
    r->val64 = vtext ? b64_enc(vtext, strlen(vtext)) : NULL;
    free(vtext);
    int rc = -ENOMEM;
    if (!r->url || !r->key64 || !r->val64)
        goto err_free;
    if ((rc = lease_grant_put(r, err, errlen)))
        goto err_free;
    if ((rc = -pthread_create(&r->thr, NULL, keepalive_main, r)))
        goto err_free;
    *out = r;
    return 0;

err_free:
    reg_free(r);
    return rc;
}

static void reg_stop(struct bex_dir_registration *r)
{
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thr, NULL);
}

int bex_dir_deregister(bex_dir_registration *r)
{
    if (!r)
        return 0;
    reg_stop(r);
    char ids[32];
    snprintf(ids, sizeof ids, "%lld", (long long)r->lease);
    json_t *req = json_pack("{s:s}", "ID", ids), *resp = NULL;
    int rc = req ? call(r->url, "/v3/lease/revoke", req, &resp, NULL, 0) : -ENOMEM;
    json_decref(req);
    json_decref(resp);
    reg_free(r);
    return rc;
}

void bex_dir_registration_abandon(bex_dir_registration *r)
{
    if (!r)
        return;
    reg_stop(r);
    reg_free(r);
}

/* ---- for the election (dir_elect.c) ---- */

int bex__etcd_call(const char *url, const char *path, json_t *body, json_t **out, char *err,
                   size_t errlen)
{
    return call(url, path, body, out, err, errlen);
}

char *bex__etcd_b64(const char *s)
{
    return b64_enc(s, strlen(s));
}

char *bex__etcd_unb64(const char *s, size_t *len)
{
    return b64_dec(s, len);
}

int64_t bex__etcd_num(json_t *v)
{
    return num(v);
}
