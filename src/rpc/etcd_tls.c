/* SPDX-License-Identifier: Apache-2.0 */
/* etcd's connection: TLS (CA, client certificate) and authentication
 * tokens, for every etcd request of the process (include/bex/dir.h,
 * bex_etcd_configure). etcd.c's requests call bex__etcd_http_setup on
 * each handle; a token etcd refuses is forgotten and fetched again. */
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bex/dir.h"
#include "common/cfg.h"
#include "rpc/etcd_tls.h"

#define AUTH_TIMEOUT_MS 3000

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    bool set; /* configured (or the environment read) */
    char *ca, *cert, *key, *user, *password, *token;
    char *auth_url, *auth_token; /* the token user/password got, and from where */
} st;

static void settings_free(void)
{
    char **f[] = {&st.ca,       &st.cert,  &st.key,      &st.user,
                  &st.password, &st.token, &st.auth_url, &st.auth_token};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) {
        free(*f[i]);
        *f[i] = NULL;
    }
}

/* strdup of s (NULL stays NULL); false when out of memory */
static bool dup_into(char **dst, const char *s)
{
    *dst = s && *s ? strdup(s) : NULL;
    return !s || !*s || *dst;
}

static int settings_take(const bex_etcd_config *c)
{
    settings_free();
    st.set = true;
    if (!c)
        return 0;
    if (!dup_into(&st.ca, c->ca_file) || !dup_into(&st.cert, c->cert_file) ||
        !dup_into(&st.key, c->key_file) || !dup_into(&st.user, c->user) ||
        !dup_into(&st.password, c->password) || !dup_into(&st.token, c->token)) {
        settings_free();
        return -ENOMEM;
    }
    return 0;
}

static int config_check(const bex_etcd_config *c)
{
    bool cert = c->cert_file && *c->cert_file, key = c->key_file && *c->key_file;
    bool user = c->user && *c->user, pw = c->password && *c->password;
    if (cert != key || user != pw || (user && c->token && *c->token))
        return -EINVAL;
    return 0;
}

int bex_etcd_configure(const bex_etcd_config *cfg)
{
    bex_etcd_config local;
    BEX__CFG_TAKE(cfg, local);
    if (cfg && config_check(cfg))
        return -EINVAL;
    pthread_mutex_lock(&mu);
    int rc = settings_take(cfg);
    pthread_mutex_unlock(&mu);
    return rc;
}

/* The environment's settings, at the first request when nothing was
 * configured. Under mu. */
static void settings_from_env(void)
{
    if (st.set)
        return;
    char name[256] = "";
    const char *u = getenv("BEX_ETCD_USER"), *colon = u ? strchr(u, ':') : NULL;
    if (colon && (size_t)(colon - u) < sizeof name)
        memcpy(name, u, (size_t)(colon - u));
    bex_etcd_config c = {.size = sizeof c,
                         .ca_file = getenv("BEX_ETCD_CACERT"),
                         .cert_file = getenv("BEX_ETCD_CERT"),
                         .key_file = getenv("BEX_ETCD_KEY"),
                         .user = name[0] ? name : NULL,
                         .password = name[0] ? colon + 1 : NULL,
                         .token = getenv("BEX_ETCD_TOKEN")};
    if (config_check(&c) || (u && !name[0])) {
        fprintf(stderr, "bex: BEX_ETCD_* settings ignored: a certificate needs its key, "
                        "BEX_ETCD_USER is name:password, and not with BEX_ETCD_TOKEN\n");
        st.set = true;
        return;
    }
    (void)settings_take(&c);
}

/* The TLS options on e. Under mu. */
static void tls_options(CURL *e)
{
    if (st.ca)
        curl_easy_setopt(e, CURLOPT_CAINFO, st.ca);
    if (st.cert) {
        curl_easy_setopt(e, CURLOPT_SSLCERT, st.cert);
        curl_easy_setopt(e, CURLOPT_SSLKEY, st.key);
    }
}

static size_t auth_write(char *data, size_t sz, size_t nm, void *arg)
{
    json_t **out = arg;
    size_t n = sz * nm;
    if (!*out && n < 65536) { /* etcd's answer comes in one piece: it is small */
        json_error_t je;
        *out = json_loadb(data, n, 0, &je);
    }
    return n;
}

/* A token for user/password from etcd at url (NULL on failure). Under mu:
 * requests wait for one authentication. */
static char *authenticate(const char *url)
{
    CURL *e = curl_easy_init();
    json_t *req = json_pack("{ssss}", "name", st.user, "password", st.password), *resp = NULL;
    char *body = req ? json_dumps(req, JSON_COMPACT) : NULL, full[1024], *tok = NULL;
    json_decref(req);
    if (e && body &&
        snprintf(full, sizeof full, "%s/v3/auth/authenticate", url) < (int)sizeof full) {
        struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
        curl_easy_setopt(e, CURLOPT_URL, full);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
        curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)AUTH_TIMEOUT_MS);
        curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, auth_write);
        curl_easy_setopt(e, CURLOPT_WRITEDATA, &resp);
        tls_options(e);
        long code = 0;
        if (curl_easy_perform(e) == CURLE_OK &&
            curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code) == CURLE_OK && code == 200) {
            const char *t = json_string_value(json_object_get(resp, "token"));
            tok = t ? strdup(t) : NULL;
        }
        curl_slist_free_all(h);
    }
    json_decref(resp);
    free(body);
    if (e)
        curl_easy_cleanup(e);
    return tok;
}

/* The token for url (configured, cached, or fetched now), into buf. Under
 * mu. */
static bool token_for(const char *url, char *buf, size_t cap)
{
    if (st.token)
        return snprintf(buf, cap, "Authorization: %s", st.token) < (int)cap;
    if (!st.user)
        return false;
    if (!st.auth_token || !st.auth_url || strcmp(st.auth_url, url)) {
        free(st.auth_token);
        free(st.auth_url);
        st.auth_token = authenticate(url);
        st.auth_url = st.auth_token ? strdup(url) : NULL;
    }
    return st.auth_token && snprintf(buf, cap, "Authorization: %s", st.auth_token) < (int)cap;
}

void bex__etcd_http_setup(CURL *e, const char *url, struct curl_slist **hdrs)
{
    char auth[1200];
    pthread_mutex_lock(&mu);
    settings_from_env();
    tls_options(e);
    bool have = token_for(url, auth, sizeof auth);
    pthread_mutex_unlock(&mu);
    if (have) {
        struct curl_slist *h = curl_slist_append(*hdrs, auth);
        if (h)
            *hdrs = h;
    }
}

bool bex__etcd_token_refused(long code, const char *body)
{
    if (code != 401 && !(body && strstr(body, "invalid auth token")))
        return false;
    pthread_mutex_lock(&mu);
    bool fetched = st.auth_token != NULL; /* a configured token is not ours to renew */
    free(st.auth_token);
    st.auth_token = NULL;
    pthread_mutex_unlock(&mu);
    return fetched;
}
