/* SPDX-License-Identifier: Apache-2.0 */
/* The service directory: the cluster file (parsing and loading it). */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>

#include "bex/sock.h"
#include "common/log.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"
#include "rpc/dir_impl.h"

/* ---- the cluster file ---- */

static int parse_transport(const char *s, uint32_t *out)
{
    if (!strcmp(s, "auto"))
        *out = BEX_TRANSPORT_AUTO;
    else if (!strcmp(s, "rdma"))
        *out = BEX_TRANSPORT_RDMA;
    else if (!strcmp(s, "tcp"))
        *out = BEX_TRANSPORT_TCP;
    else
        return -EINVAL;
    return 0;
}

/* One replica object; where names it for errors. */
static int parse_replica(json_t *o, bex_dir_replica *r, const char *where, char *err, size_t errlen)
{
    if (!json_is_object(o)) {
        bex__dir_set_err(err, errlen, "%s: not an object", where);
        return -EINVAL;
    }
    *r = (bex_dir_replica){0};
    const char *key;
    json_t *v;
    bool have_addr = false;
    json_object_foreach(o, key, v)
    {
        if (!strcmp(key, "addr")) {
            char why[160] = "not a string";
            int rc = json_is_string(v)
                         ? bex__dir_parse_addr(json_string_value(v), &r->addr, why, sizeof why)
                         : -EINVAL;
            if (rc) {
                bex__dir_set_err(err, errlen,
                                 "%s.addr: %s (want \"host:port\": a.b.c.d, [v6] or a name; "
                                 "port 1-65535)",
                                 where, why);
                return rc == -EAGAIN ? -EAGAIN : -EINVAL;
            }
            have_addr = true;
        } else if (!strcmp(key, "locality")) {
            if (!json_is_string(v) || !bex__dir_locality_ok(json_string_value(v))) {
                bex__dir_set_err(err, errlen,
                                 "%s.locality: not a label like \"dc1/pod2\" (printable, no empty "
                                 "component, at most %d bytes)",
                                 where, BEX_DIR_LOCALITY_MAX);
                return -EINVAL;
            }
            strcpy(r->locality, json_string_value(v));
        } else if (!strcmp(key, "transport")) {
            if (!json_is_string(v) || parse_transport(json_string_value(v), &r->transport)) {
                bex__dir_set_err(err, errlen, "%s.transport: not \"auto\", \"rdma\" or \"tcp\"",
                                 where);
                return -EINVAL;
            }
        } else {
            bex__dir_set_err(err, errlen, "%s: unknown key \"%s\"", where, key);
            return -EINVAL;
        }
    }
    if (!have_addr) {
        bex__dir_set_err(err, errlen, "%s: no \"addr\"", where);
        return -EINVAL;
    }
    return 0;
}

int bex__dir_parse_replica_json(const char *text, size_t len, bex_dir_replica *r, char *err,
                                size_t errlen)
{
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        bex__dir_set_err(err, errlen, "line %d column %d: %s", je.line, je.column, je.text);
        return -EINVAL;
    }
    int rc = parse_replica(root, r, "replica", err, errlen);
    json_decref(root);
    return rc;
}

/* The top level: {"services": {...}, "version": 1}, version optional. */
static int check_top(json_t *root, char *err, size_t errlen)
{
    json_t *svcs = json_object_get(root, "services");
    if (!json_is_object(root) || !json_is_object(svcs)) {
        bex__dir_set_err(err, errlen, "top level: an object with a \"services\" object expected");
        return -EINVAL;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        if (strcmp(key, "services") && strcmp(key, "version")) {
            bex__dir_set_err(err, errlen, "top level: unknown key \"%s\"", key);
            return -EINVAL;
        }
        if (!strcmp(key, "version") && (!json_is_integer(v) || json_integer_value(v) != 1)) {
            bex__dir_set_err(err, errlen, "version: only 1 is known");
            return -EINVAL;
        }
    }
    return 0;
}

/* The members read so far (m grows by doubling). */
struct members {
    struct bex__dir_member *m;
    size_t cap, n;
};

/* The replicas of shard si of service key (sh) appended to ms. */
static int load_replicas(const char *key, size_t si, json_t *sh, struct members *ms, char *err,
                         size_t errlen)
{
    json_t *reps = json_object_get(sh, "replicas");
    if (!json_is_object(sh) || !json_is_array(reps) || json_array_size(reps) == 0 ||
        json_object_size(sh) != 1) {
        bex__dir_set_err(err, errlen,
                         "services.%s.shards[%zu]: an object with only a non-empty \"replicas\" "
                         "array expected",
                         key, si);
        return -EINVAL;
    }
    size_t ri;
    json_t *rep;
    json_array_foreach(reps, ri, rep)
    {
        if (ms->n == ms->cap) {
            struct bex__dir_member *nm = realloc(ms->m, 2 * ms->cap * sizeof(*nm));
            if (!nm)
                return -ENOMEM;
            ms->m = nm;
            ms->cap *= 2;
        }
        struct bex__dir_member *m = ms->m;
        size_t n = ms->n;
        char where[160];
        snprintf(where, sizeof where, "services.%s.shards[%zu].replicas[%zu]", key, si, ri);
        m[n] = (struct bex__dir_member){.shard = (uint32_t)si};
        strcpy(m[n].service, key);
        int rc = parse_replica(rep, &m[n].r, where, err, errlen);
        if (rc)
            return rc;
        for (size_t k = 0; k < n; k++)
            if (!strcmp(m[k].service, key) && m[k].shard == si &&
                bex__dir_same_addr(&m[k].r.addr, &m[n].r.addr)) {
                bex__dir_set_err(err, errlen, "%s.addr: listed twice in the shard", where);
                return -EINVAL;
            }
        ms->n++;
    }
    return 0;
}

static int load_root(bex_dir *d, json_t *root, char *err, size_t errlen)
{
    int rc = check_top(root, err, errlen);
    if (rc)
        return rc;
    json_t *svcs = json_object_get(root, "services");
    struct members ms = {malloc(16 * sizeof(*ms.m)), 16, 0};
    if (!ms.m)
        return -ENOMEM;
    const char *key;
    json_t *svc;
    json_object_foreach(svcs, key, svc)
    {
        if (!*key || strlen(key) > BEX_DIR_NAME_MAX || strchr(key, '/')) {
            bex__dir_set_err(err, errlen,
                             "services.\"%s\": a name of 1-%d bytes without '/' expected", key,
                             BEX_DIR_NAME_MAX);
            rc = -EINVAL;
            goto out;
        }
        json_t *shards = json_object_get(svc, "shards");
        if (!json_is_object(svc) || !json_is_array(shards) || json_array_size(shards) == 0 ||
            json_object_size(svc) != 1) {
            bex__dir_set_err(
                err, errlen,
                "services.%s: an object with only a non-empty \"shards\" array expected", key);
            rc = -EINVAL;
            goto out;
        }
        size_t si;
        json_t *sh;
        json_array_foreach(shards, si, sh)
        {
            if ((rc = load_replicas(key, si, sh, &ms, err, errlen)))
                goto out;
        }
    }
    rc = bex__dir_set_members(d, ms.m, ms.n);
    if (rc == -ENOSPC)
        bex__dir_set_err(err, errlen, "more addresses than max_nodes");
out:
    free(ms.m);
    return rc;
}

int bex_dir_load_json(bex_dir *d, const char *json, char *err, size_t errlen)
{
    if (!d || !json)
        return -EINVAL;
    pthread_mutex_lock(&d->mu);
    bool etcd = d->etcd;
    pthread_mutex_unlock(&d->mu);
    if (etcd) {
        bex__dir_set_err(err, errlen, "the directory follows etcd");
        return -EBUSY;
    }
    json_error_t je;
    json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        bex__dir_set_err(err, errlen, "line %d column %d: %s", je.line, je.column, je.text);
        return -EINVAL;
    }
    int rc = load_root(d, root, err, errlen);
    json_decref(root);
    return rc;
}

int bex_dir_load_file(bex_dir *d, const char *path, char *err, size_t errlen)
{
    if (!d || !path)
        return -EINVAL;
    FILE *f = fopen(path, "rb");
    struct stat st;
    if (f && fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
        fclose(f); /* glibc opens a directory; reading it fails */
        f = NULL;
        errno = EISDIR;
    }
    if (!f) {
        int e = -errno;
        bex__dir_set_err(err, errlen, "%s: %s", path, strerror(-e));
        return e;
    }
    json_error_t je;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
    fclose(f);
    if (!root) {
        bex__dir_set_err(err, errlen, "%s: line %d column %d: %s", path, je.line, je.column,
                         je.text);
        return -EINVAL;
    }
    char inner[256] = "";
    pthread_mutex_lock(&d->mu);
    bool etcd = d->etcd;
    pthread_mutex_unlock(&d->mu);
    int rc = etcd ? -EBUSY : load_root(d, root, inner, sizeof inner);
    if (etcd)
        snprintf(inner, sizeof inner, "the directory follows etcd");
    if (rc)
        bex__dir_set_err(err, errlen, "%s: %s", path, inner);
    json_decref(root);
    return rc;
}
