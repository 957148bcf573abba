/* The service directory: services, shards and replicas from a cluster file
 * or etcd, replica choice by locality and load, and quarantine.
 *
 * One mutex guards a directory. Channels call in with their own lock held
 * (lock order: channel, then directory); the directory never calls out
 * except to its logger. Nodes (addresses) are kept for the directory's
 * life, whether or not a shard lists them now, so that a channel may hold
 * a node's handle and a node's health survives a re-registration. */
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

#include "bex/sock.h"
#include "common/log.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"

/* The timestamps (ns) of a node's last max + 1 failures of one kind: more
 * than max within the window is when the oldest of them is in it. */
struct fail_ring {
    uint64_t *t;
    uint32_t cap, n, head; /* cap = max + 1 */
};

struct bex__dir_node {
    bex_dir_replica r;
    char name[32]; /* "a.b.c.d:port", for the log */
    int state;
    uint64_t until;         /* QUARANTINED: till then; PROBING: the probe's expiry */
    bool probe_out;         /* PROBING: a probe call is out */
    bool refused_logged;    /* a refused quarantine was logged (reset by a lift) */
    bool early;             /* PROBING before its period ended (see release_early) */
    bool early_logged;      /* an early probe was logged (reset by a lift) */
    bool early_fail_logged; /* an early probe's failure was logged (reset by a lift) */
    struct fail_ring conn, req;
    bex_dir_node_stats st;
    struct bex__dir_node *next;
};

struct shard {
    struct bex__dir_node **reps;
    size_t n;
};

struct service {
    char *name;
    struct shard *shards;
    uint32_t n_shards;
    struct service *next;
};

struct bex_dir {
    pthread_mutex_t mu;
    struct bex__log log;
    uint32_t conn_max, req_max, max_nodes;
    uint64_t window_ns, quarantine_ns, probe_ns;
    struct bex__dir_node *nodes;
    size_t n_nodes;
    struct service *services;
    uint64_t generation;
    uint64_t rng; /* ties among equal replicas: not security */
    void *watch;  /* the source (etcd's watch), stopped by watch_stop */
    void (*watch_stop)(void *watch);
    bool etcd;
};

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

/* ---- labels and addresses ---- */

int bex__dir_parse_addr(const char *s, struct sockaddr_in *addr)
{
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || (size_t)(colon - s) >= INET_ADDRSTRLEN)
        return -EINVAL;
    char host[INET_ADDRSTRLEN];
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    struct in_addr ia;
    if (inet_pton(AF_INET, host, &ia) != 1)
        return -EINVAL;
    const char *p = colon + 1;
    unsigned long port = 0;
    if (!*p)
        return -EINVAL;
    for (; *p; p++) {
        if (!isdigit((unsigned char)*p))
            return -EINVAL;
        port = port * 10 + (unsigned long)(*p - '0');
        if (port > 65535)
            return -EINVAL;
    }
    if (!port)
        return -EINVAL;
    *addr = (struct sockaddr_in){
        .sin_family = AF_INET, .sin_port = htons((uint16_t)port), .sin_addr = ia};
    return 0;
}

bool bex__dir_locality_ok(const char *s)
{
    size_t n = strlen(s);
    if (n > BEX_DIR_LOCALITY_MAX)
        return false;
    if (n == 0)
        return true;
    if (s[0] == '/' || s[n - 1] == '/' || strstr(s, "//"))
        return false;
    for (const char *p = s; *p; p++)
        if (!isgraph((unsigned char)*p))
            return false;
    return true;
}

unsigned bex__dir_closeness(const char *a, const char *b)
{
    if (!a || !b || !*a || !*b)
        return 0;
    unsigned same = 0;
    for (;;) {
        size_t la = strcspn(a, "/"), lb = strcspn(b, "/");
        if (la != lb || memcmp(a, b, la))
            return same;
        same++;
        if (!a[la] || !b[lb])
            return same;
        a += la + 1;
        b += lb + 1;
    }
}

static bool same_addr(const struct sockaddr_in *a, const struct sockaddr_in *b)
{
    return a->sin_addr.s_addr == b->sin_addr.s_addr && a->sin_port == b->sin_port;
}

/* ---- nodes (under d->mu) ---- */

static struct bex__dir_node *node_find(bex_dir *d, const struct sockaddr_in *addr)
{
    for (struct bex__dir_node *n = d->nodes; n; n = n->next)
        if (same_addr(&n->r.addr, addr))
            return n;
    return NULL;
}

static int ring_init(struct fail_ring *r, uint32_t max)
{
    r->cap = max + 1;
    r->t = calloc(r->cap, sizeof(*r->t));
    return r->t ? 0 : -ENOMEM;
}

/* Record a failure at now; true when more than cap - 1 fell in the window. */
static bool ring_add(struct fail_ring *r, uint64_t now, uint64_t window)
{
    r->t[r->head] = now;
    r->head = (r->head + 1) % r->cap;
    if (r->n < r->cap)
        r->n++;
    /* full: head is the oldest of the last cap failures */
    return r->n == r->cap && now - r->t[r->head] <= window;
}

static void node_free(struct bex__dir_node *n)
{
    free(n->conn.t);
    free(n->req.t);
    free(n);
}

/* The node at r's address, made if new; its replica data updated. */
static int node_get(bex_dir *d, const bex_dir_replica *r, struct bex__dir_node **out)
{
    struct bex__dir_node *n = node_find(d, &r->addr);
    if (!n) {
        if (d->n_nodes >= d->max_nodes)
            return -ENOSPC;
        n = calloc(1, sizeof(*n));
        if (!n || ring_init(&n->conn, d->conn_max) || ring_init(&n->req, d->req_max)) {
            if (n)
                node_free(n);
            return -ENOMEM;
        }
        char ip[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &r->addr.sin_addr, ip, sizeof ip);
        snprintf(n->name, sizeof n->name, "%s:%u", ip, ntohs(r->addr.sin_port));
        n->next = d->nodes;
        d->nodes = n;
        d->n_nodes++;
    }
    n->r = *r;
    *out = n;
    return 0;
}

/* ---- contents ---- */

static void services_free(struct service *s)
{
    while (s) {
        struct service *next = s->next;
        for (uint32_t i = 0; i < s->n_shards; i++)
            free(s->shards[i].reps);
        free(s->shards);
        free(s->name);
        free(s);
        s = next;
    }
}

static struct service *service_find(struct service *list, const char *name)
{
    for (struct service *s = list; s; s = s->next)
        if (!strcmp(s->name, name))
            return s;
    return NULL;
}

static struct shard *shard_find(bex_dir *d, const char *service, uint32_t shard)
{
    struct service *s = service_find(d->services, service);
    return s && shard < s->n_shards ? &s->shards[shard] : NULL;
}

int bex__dir_set_members(bex_dir *d, const struct bex__dir_member *m, size_t n)
{
    struct service *list = NULL;
    int err = -ENOMEM;
    pthread_mutex_lock(&d->mu);
    /* shape first: services and their shard counts */
    for (size_t i = 0; i < n; i++) {
        struct service *s = service_find(list, m[i].service);
        if (!s) {
            if (!(s = calloc(1, sizeof(*s))) || !(s->name = strdup(m[i].service))) {
                free(s);
                goto err_free;
            }
            s->next = list;
            list = s;
        }
        if (m[i].shard >= s->n_shards) {
            struct shard *ns = realloc(s->shards, (m[i].shard + 1) * sizeof(*ns));
            if (!ns)
                goto err_free;
            memset(ns + s->n_shards, 0, (m[i].shard + 1 - s->n_shards) * sizeof(*ns));
            s->shards = ns;
            s->n_shards = m[i].shard + 1;
        }
    }
    for (size_t i = 0; i < n; i++) {
        struct shard *sh = &service_find(list, m[i].service)->shards[m[i].shard];
        struct bex__dir_node *node;
        if ((err = node_get(d, &m[i].r, &node)))
            goto err_free;
        bool dup = false;
        for (size_t k = 0; k < sh->n; k++)
            dup |= sh->reps[k] == node;
        if (dup)
            continue;
        struct bex__dir_node **nr = realloc(sh->reps, (sh->n + 1) * sizeof(*nr));
        if (!nr) {
            err = -ENOMEM;
            goto err_free;
        }
        sh->reps = nr;
        sh->reps[sh->n++] = node;
    }
    services_free(d->services);
    d->services = list;
    d->generation++;
    pthread_mutex_unlock(&d->mu);
    return 0;

err_free:
    /* nodes made on the way stay (empty of shards): harmless */
    services_free(list);
    pthread_mutex_unlock(&d->mu);
    return err;
}

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
        set_err(err, errlen, "%s: not an object", where);
        return -EINVAL;
    }
    *r = (bex_dir_replica){0};
    const char *key;
    json_t *v;
    bool have_addr = false;
    json_object_foreach(o, key, v)
    {
        if (!strcmp(key, "addr")) {
            if (!json_is_string(v) || bex__dir_parse_addr(json_string_value(v), &r->addr)) {
                set_err(err, errlen, "%s.addr: not \"a.b.c.d:port\" (port 1-65535)", where);
                return -EINVAL;
            }
            have_addr = true;
        } else if (!strcmp(key, "locality")) {
            if (!json_is_string(v) || !bex__dir_locality_ok(json_string_value(v))) {
                set_err(err, errlen,
                        "%s.locality: not a label like \"dc1/pod2\" (printable, no empty "
                        "component, at most %d bytes)",
                        where, BEX_DIR_LOCALITY_MAX);
                return -EINVAL;
            }
            strcpy(r->locality, json_string_value(v));
        } else if (!strcmp(key, "transport")) {
            if (!json_is_string(v) || parse_transport(json_string_value(v), &r->transport)) {
                set_err(err, errlen, "%s.transport: not \"auto\", \"rdma\" or \"tcp\"", where);
                return -EINVAL;
            }
        } else {
            set_err(err, errlen, "%s: unknown key \"%s\"", where, key);
            return -EINVAL;
        }
    }
    if (!have_addr) {
        set_err(err, errlen, "%s: no \"addr\"", where);
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
        set_err(err, errlen, "line %d column %d: %s", je.line, je.column, je.text);
        return -EINVAL;
    }
    int rc = parse_replica(root, r, "replica", err, errlen);
    json_decref(root);
    return rc;
}

static int load_root(bex_dir *d, json_t *root, char *err, size_t errlen)
{
    json_t *svcs = json_object_get(root, "services");
    if (!json_is_object(root) || !json_is_object(svcs)) {
        set_err(err, errlen, "top level: an object with a \"services\" object expected");
        return -EINVAL;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        if (strcmp(key, "services") && strcmp(key, "version")) {
            set_err(err, errlen, "top level: unknown key \"%s\"", key);
            return -EINVAL;
        }
        if (!strcmp(key, "version") && (!json_is_integer(v) || json_integer_value(v) != 1)) {
            set_err(err, errlen, "version: only 1 is known");
            return -EINVAL;
        }
    }
    size_t cap = 16, n = 0;
    struct bex__dir_member *m = malloc(cap * sizeof(*m));
    if (!m)
        return -ENOMEM;
    int rc = 0;
    json_t *svc;
    json_object_foreach(svcs, key, svc)
    {
        if (!*key || strlen(key) > BEX_DIR_NAME_MAX || strchr(key, '/')) {
            set_err(err, errlen, "services.\"%s\": a name of 1-%d bytes without '/' expected", key,
                    BEX_DIR_NAME_MAX);
            rc = -EINVAL;
            goto out;
        }
        json_t *shards = json_object_get(svc, "shards");
        if (!json_is_object(svc) || !json_is_array(shards) || json_array_size(shards) == 0 ||
            json_object_size(svc) != 1) {
            set_err(err, errlen,
                    "services.%s: an object with only a non-empty \"shards\" array expected", key);
            rc = -EINVAL;
            goto out;
        }
        size_t si;
        json_t *sh;
        json_array_foreach(shards, si, sh)
        {
            json_t *reps = json_object_get(sh, "replicas");
            if (!json_is_object(sh) || !json_is_array(reps) || json_array_size(reps) == 0 ||
                json_object_size(sh) != 1) {
                set_err(err, errlen,
                        "services.%s.shards[%zu]: an object with only a non-empty \"replicas\" "
                        "array expected",
                        key, si);
                rc = -EINVAL;
                goto out;
            }
            size_t ri;
            json_t *rep;
            json_array_foreach(reps, ri, rep)
            {
                if (n == cap) {
                    struct bex__dir_member *nm = realloc(m, 2 * cap * sizeof(*m));
                    if (!nm) {
                        rc = -ENOMEM;
                        goto out;
                    }
                    m = nm;
                    cap *= 2;
                }
                char where[160];
                snprintf(where, sizeof where, "services.%s.shards[%zu].replicas[%zu]", key, si, ri);
                m[n] = (struct bex__dir_member){.shard = (uint32_t)si};
                strcpy(m[n].service, key);
                if ((rc = parse_replica(rep, &m[n].r, where, err, errlen)))
                    goto out;
                for (size_t k = 0; k < n; k++)
                    if (!strcmp(m[k].service, key) && m[k].shard == si &&
                        same_addr(&m[k].r.addr, &m[n].r.addr)) {
                        set_err(err, errlen, "%s.addr: listed twice in the shard", where);
                        rc = -EINVAL;
                        goto out;
                    }
                n++;
            }
        }
    }
    rc = bex__dir_set_members(d, m, n);
    if (rc == -ENOSPC)
        set_err(err, errlen, "more addresses than max_nodes");
out:
    free(m);
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
        set_err(err, errlen, "the directory follows etcd");
        return -EBUSY;
    }
    json_error_t je;
    json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        set_err(err, errlen, "line %d column %d: %s", je.line, je.column, je.text);
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
    if (!f) {
        int e = -errno;
        set_err(err, errlen, "%s: %s", path, strerror(-e));
        return e;
    }
    json_error_t je;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
    fclose(f);
    if (!root) {
        set_err(err, errlen, "%s: line %d column %d: %s", path, je.line, je.column, je.text);
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
        set_err(err, errlen, "%s: %s", path, inner);
    json_decref(root);
    return rc;
}

/* ---- quarantine (under d->mu) ---- */

/* Lines to log once d->mu is released: the log hook may call back into
 * the directory. A report logs a few at most (a refused quarantine and the
 * early probes it releases); defer says whether the line was kept, so that
 * a "logged once" flag is set only for a line that was. */
struct pending {
    int n;
    struct {
        int level;
        char text[256];
    } l[4];
};

__attribute__((format(printf, 3, 4))) static bool defer(struct pending *p, int level,
                                                        const char *fmt, ...)
{
    if (p->n == (int)(sizeof p->l / sizeof p->l[0]))
        return false;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->l[p->n].text, sizeof p->l[p->n].text, fmt, ap);
    va_end(ap);
    p->l[p->n++].level = level;
    return true;
}

static void flush(bex_dir *d, const struct pending *p)
{
    for (int i = 0; i < p->n; i++)
        bex__log(&d->log, p->l[i].level, "%s", p->l[i].text);
}

static bool in_shard(const struct shard *sh, const struct bex__dir_node *n)
{
    for (size_t i = 0; i < sh->n; i++)
        if (sh->reps[i] == n)
            return true;
    return false;
}

/* Whether every shard n serves keeps a replica outside quarantine without n. */
static bool may_quarantine(bex_dir *d, const struct bex__dir_node *n)
{
    for (struct service *s = d->services; s; s = s->next)
        for (uint32_t k = 0; k < s->n_shards; k++) {
            const struct shard *sh = &s->shards[k];
            if (!in_shard(sh, n))
                continue;
            bool other = false;
            for (size_t i = 0; i < sh->n && !other; i++)
                other = sh->reps[i] != n && sh->reps[i]->state == BEX_DIR_HEALTHY;
            if (!other)
                return false;
        }
    return true;
}

static const char *kind_name(int outcome)
{
    return outcome == BEX_DIR_CONN_FAIL ? "connection" : "request";
}

/* n, a healthy node, failed (outcome) and is the last replica outside
 * quarantine of some shard it serves: the quarantined replicas of those
 * shards are probed now rather than after their period, so that "never all
 * replicas of a shard at once" holds when that last one fails too, not
 * only when a quarantine starts (else every call of the shard would go to
 * the failing node until a period ended). A probe answered lifts the
 * quarantine as usual; a failed one starts another period, and the next
 * failure of n releases another probe: one call at a time per node, only
 * while n keeps failing. Counted each time, logged once until a lift. */
static void release_early(bex_dir *d, const struct bex__dir_node *n, int outcome, uint64_t now,
                          struct pending *pl)
{
    for (struct service *s = d->services; s; s = s->next)
        for (uint32_t k = 0; k < s->n_shards; k++) {
            const struct shard *sh = &s->shards[k];
            if (!in_shard(sh, n))
                continue;
            bool other = false;
            for (size_t i = 0; i < sh->n && !other; i++)
                other = sh->reps[i] != n && sh->reps[i]->state == BEX_DIR_HEALTHY;
            if (other)
                continue;
            for (size_t i = 0; i < sh->n; i++) {
                struct bex__dir_node *q = sh->reps[i];
                if (q == n || q->state != BEX_DIR_QUARANTINED || now >= q->until)
                    continue;
                q->state = BEX_DIR_PROBING;
                q->probe_out = false;
                q->early = true;
                q->st.early_probes++;
                if (!q->early_logged)
                    q->early_logged =
                        defer(pl, BEX_LOG_WARN,
                              "dir: node %s probed before its quarantine ends: %s, the last "
                              "replica of %s shard %u outside quarantine, failed (%s)",
                              q->name, n->name, s->name, k, kind_name(outcome));
            }
        }
}

/* n passed a threshold (or failed its probe): quarantine it unless it is
 * the last healthy replica of a shard. */
static void quarantine(bex_dir *d, struct bex__dir_node *n, int outcome, uint64_t now,
                       struct pending *pl)
{
    bool probe = n->state == BEX_DIR_PROBING;
    bool early = n->early;
    n->early = false;
    if (!may_quarantine(d, n)) {
        n->st.quarantine_refused++;
        n->state = BEX_DIR_HEALTHY;
        n->probe_out = false;
        if (!n->refused_logged)
            defer(pl, BEX_LOG_WARN,
                  "dir: node %s not quarantined despite %s failures: it is the last replica "
                  "of a shard outside quarantine",
                  n->name, kind_name(outcome));
        n->refused_logged = true;
        /* it cannot go, and the other replicas of its shard are
         * quarantined: they are probed now (a node failing this much is
         * what release_early is for) */
        release_early(d, n, outcome, now, pl);
        return;
    }
    n->state = BEX_DIR_QUARANTINED;
    n->until = now + d->quarantine_ns;
    n->probe_out = false;
    n->st.quarantines++;
    /* a new count after the period: the failures that led here are done */
    n->conn.n = n->req.n = 0;
    if (probe) {
        n->st.probe_failures++;
        /* early probes come as often as the last healthy replica fails:
         * their failures are logged once (counted each time) */
        if (!early || !n->early_fail_logged)
            defer(pl, BEX_LOG_WARN,
                  "dir: node %s failed its %sprobe (%s): quarantined again "
                  "for %llu ms%s",
                  n->name, early ? "early " : "", kind_name(outcome),
                  (unsigned long long)(d->quarantine_ns / 1000000),
                  early ? " (later early probes' failures are not logged)" : "");
        if (early)
            n->early_fail_logged = true;
    } else {
        defer(pl, BEX_LOG_WARN,
              "dir: node %s quarantined for %llu ms: more than %u %s failures within %llu ms",
              n->name, (unsigned long long)(d->quarantine_ns / 1000000),
              outcome == BEX_DIR_CONN_FAIL ? d->conn_max : d->req_max, kind_name(outcome),
              (unsigned long long)(d->window_ns / 1000000));
    }
}

/* A quarantine whose period is over becomes ready for a probe; a probe
 * never reported expires. */
static void node_tick(struct bex__dir_node *n, uint64_t now)
{
    if (n->state == BEX_DIR_QUARANTINED && now >= n->until) {
        n->state = BEX_DIR_PROBING;
        n->probe_out = false;
        n->early = false;
    } else if (n->state == BEX_DIR_PROBING && n->probe_out && now >= n->until) {
        n->probe_out = false;
    }
}

void bex__dir_report_node(bex_dir *d, struct bex__dir_node *n, int outcome, bool done, uint64_t now)
{
    struct pending pl = {0};
    pthread_mutex_lock(&d->mu);
    if (done && n->st.outstanding)
        n->st.outstanding--;
    node_tick(n, now);
    switch (outcome) {
    case BEX_DIR_OK:
        n->st.ok++;
        if (n->state == BEX_DIR_PROBING) {
            n->state = BEX_DIR_HEALTHY;
            n->probe_out = false;
            n->refused_logged = false;
            n->early = n->early_logged = n->early_fail_logged = false;
            n->st.lifts++;
            defer(&pl, BEX_LOG_WARN, "dir: node %s answered its probe: quarantine lifted", n->name);
        }
        break;
    case BEX_DIR_CONN_FAIL:
    case BEX_DIR_REQ_FAIL: {
        bool conn = outcome == BEX_DIR_CONN_FAIL;
        if (conn)
            n->st.conn_failures++;
        else
            n->st.req_failures++;
        bool over = ring_add(conn ? &n->conn : &n->req, now, d->window_ns);
        if (n->state == BEX_DIR_PROBING && n->probe_out)
            quarantine(d, n, outcome, now, &pl);
        else if (n->state == BEX_DIR_HEALTHY && over)
            quarantine(d, n, outcome, now, &pl);
        else if (n->state == BEX_DIR_HEALTHY && conn)
            /* one connection failure is enough: the node is unreachable
             * now, and a shard whose other replicas are quarantined has
             * nowhere else to go (a request failure may be the call's
             * own: that waits for the threshold, in quarantine()) */
            release_early(d, n, outcome, now, &pl);
        break;
    }
    default:
        break;
    }
    pthread_mutex_unlock(&d->mu);
    flush(d, &pl);
}

/* ---- choice ---- */

static uint64_t rnd(bex_dir *d)
{
    /* xorshift64* */
    uint64_t x = d->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    d->rng = x;
    return x * 0x2545F4914F6CDD1Dull;
}

enum { TIER_PROBE, TIER_HEALTHY, TIER_AVOIDED, TIER_LAST, TIER_NONE };

int bex__dir_pick_node(bex_dir *d, const char *service, uint32_t shard, const char *locality,
                       bex__dir_avoid_fn avoid, void *arg, uint64_t now, struct bex__dir_node **out)
{
    struct pending pl = {0};
    pthread_mutex_lock(&d->mu);
    struct shard *sh = service ? shard_find(d, service, shard) : NULL;
    if (!sh || sh->n == 0) {
        pthread_mutex_unlock(&d->mu);
        return -ENOENT;
    }
    /* best: lowest tier, then nearest, then least outstanding, then one
     * of the equals at random (reservoir sampling: each with 1/k) */
    struct bex__dir_node *best = NULL;
    int best_tier = TIER_NONE;
    unsigned best_close = 0;
    uint64_t ties = 0;
    for (size_t i = 0; i < sh->n; i++) {
        struct bex__dir_node *n = sh->reps[i];
        node_tick(n, now);
        bool av = avoid && avoid(arg, n);
        int tier;
        if (n->state == BEX_DIR_PROBING && !n->probe_out)
            tier = av ? TIER_LAST : TIER_PROBE; /* the probe goes first */
        else if (n->state == BEX_DIR_HEALTHY)
            tier = av ? TIER_AVOIDED : TIER_HEALTHY;
        else
            tier = TIER_LAST; /* quarantined, or its probe out: only when nothing else */
        unsigned close = bex__dir_closeness(locality, n->r.locality);
        bool better = !best || tier < best_tier;
        if (!better && tier == best_tier) {
            if (tier == TIER_LAST)
                better = n->until < best->until;
            else if (close != best_close)
                better = close > best_close;
            else if (n->st.outstanding != best->st.outstanding)
                better = n->st.outstanding < best->st.outstanding;
            else
                better = rnd(d) % ++ties == 0;
        }
        if (better && (!best || tier != best_tier || close != best_close ||
                       n->st.outstanding != best->st.outstanding))
            ties = 1; /* a new best: the equals count restarts */
        if (better) {
            best = n;
            best_tier = tier;
            best_close = close;
        }
    }
    if (best->state == BEX_DIR_PROBING && !best->probe_out) {
        best->probe_out = true;
        best->until = now + d->probe_ns;
        best->st.probes++;
        if (!best->early) /* an early one was logged when released */
            defer(&pl, BEX_LOG_INFO, "dir: probing quarantined node %s", best->name);
    }
    best->st.picks++;
    best->st.outstanding++;
    *out = best;
    pthread_mutex_unlock(&d->mu);
    flush(d, &pl);
    return 0;
}

void bex__dir_node_info(bex_dir *d, const struct bex__dir_node *n, bex_dir_replica *out)
{
    pthread_mutex_lock(&d->mu); /* a load may update the replica's data */
    *out = n->r;
    pthread_mutex_unlock(&d->mu);
}

bool bex__dir_in_shard(bex_dir *d, const char *service, uint32_t shard,
                       const struct bex__dir_node *n)
{
    pthread_mutex_lock(&d->mu);
    struct shard *sh = shard_find(d, service, shard);
    bool in = sh && in_shard(sh, n);
    pthread_mutex_unlock(&d->mu);
    return in;
}

struct bex__dir_node *bex__dir_node_find(bex_dir *d, const struct sockaddr_in *addr)
{
    pthread_mutex_lock(&d->mu);
    struct bex__dir_node *n = node_find(d, addr);
    pthread_mutex_unlock(&d->mu);
    return n;
}

struct bex__log *bex__dir_log(bex_dir *d)
{
    return &d->log;
}

/* ---- API ---- */

int bex_dir_create(const bex_dir_config *cfg, bex_dir **out)
{
    static const bex_dir_config none;
    if (!out)
        return -EINVAL;
    if (!cfg)
        cfg = &none;
    if (cfg->conn_fail_max > 100000 || cfg->req_fail_max > 100000)
        return -EINVAL;
    bex_dir *d = calloc(1, sizeof(*d));
    if (!d)
        return -ENOMEM;
    d->conn_max = cfg->conn_fail_max ? cfg->conn_fail_max : 30;
    d->req_max = cfg->req_fail_max ? cfg->req_fail_max : 50;
    d->window_ns = (cfg->fail_window_ms ? cfg->fail_window_ms : 300000) * 1000000ull;
    d->quarantine_ns = (cfg->quarantine_ms ? cfg->quarantine_ms : 60000) * 1000000ull;
    d->probe_ns = (cfg->probe_timeout_ms ? cfg->probe_timeout_ms : 10000) * 1000000ull;
    d->max_nodes = cfg->max_nodes ? cfg->max_nodes : 65536;
    while (!d->rng)
        if (getrandom(&d->rng, sizeof d->rng, 0) != sizeof d->rng)
            d->rng = bex__rpc_now_ns() ^ (uint64_t)(uintptr_t)d;
    pthread_mutex_init(&d->mu, NULL);
    bex__log_init(&d->log, cfg->log_fn, cfg->log_arg, cfg->log_level);
    *out = d;
    return 0;
}

void bex_dir_destroy(bex_dir *d)
{
    if (!d)
        return;
    if (d->watch)
        d->watch_stop(d->watch);
    services_free(d->services);
    while (d->nodes) {
        struct bex__dir_node *n = d->nodes->next;
        node_free(d->nodes);
        d->nodes = n;
    }
    bex__log_fini(&d->log);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

int bex__dir_source_claim(bex_dir *d)
{
    pthread_mutex_lock(&d->mu);
    bool busy = d->etcd;
    d->etcd = true;
    pthread_mutex_unlock(&d->mu);
    return busy ? -EBUSY : 0;
}

void bex__dir_source_set(bex_dir *d, void *src, void (*stop)(void *src))
{
    pthread_mutex_lock(&d->mu);
    if (!src)
        d->etcd = false;
    d->watch = src;
    d->watch_stop = stop;
    pthread_mutex_unlock(&d->mu);
}

uint64_t bex_dir_generation(bex_dir *d)
{
    pthread_mutex_lock(&d->mu);
    uint64_t g = d->generation;
    pthread_mutex_unlock(&d->mu);
    return g;
}

size_t bex_dir_replicas(bex_dir *d, const char *service, uint32_t shard, bex_dir_replica *out,
                        size_t cap)
{
    if (!d || !service)
        return 0;
    pthread_mutex_lock(&d->mu);
    struct shard *sh = shard_find(d, service, shard);
    size_t n = sh ? sh->n : 0;
    for (size_t i = 0; i < n && i < cap; i++)
        out[i] = sh->reps[i]->r;
    pthread_mutex_unlock(&d->mu);
    return n;
}

struct avoid_addr {
    const struct sockaddr_in *a;
};

static bool avoid_by_addr(void *arg, const struct bex__dir_node *n)
{
    const struct avoid_addr *aa = arg;
    return aa->a && same_addr(aa->a, &n->r.addr);
}

int bex_dir_pick(bex_dir *d, const char *service, uint32_t shard, const char *locality,
                 const struct sockaddr_in *avoid, bex_dir_replica *out)
{
    if (!d || !service || !out)
        return -EINVAL;
    struct avoid_addr aa = {avoid};
    struct bex__dir_node *n;
    int rc =
        bex__dir_pick_node(d, service, shard, locality, avoid_by_addr, &aa, bex__rpc_now_ns(), &n);
    if (!rc) {
        pthread_mutex_lock(&d->mu);
        *out = n->r;
        pthread_mutex_unlock(&d->mu);
    }
    return rc;
}

void bex_dir_report(bex_dir *d, const struct sockaddr_in *addr, int outcome, int done)
{
    if (!d || !addr)
        return;
    pthread_mutex_lock(&d->mu);
    struct bex__dir_node *n = node_find(d, addr);
    pthread_mutex_unlock(&d->mu);
    if (n) /* nodes are never freed before d */
        bex__dir_report_node(d, n, outcome, done != 0, bex__rpc_now_ns());
}

int bex_dir_prometheus(bex_dir *d, char *buf, size_t cap)
{
    if (!d || (!buf && cap))
        return -EINVAL;
    if (cap)
        buf[0] = 0;
    struct bex__prom o = {buf, cap, 0};
    static const struct {
        const char *metric, *help;
        size_t off;
    } ctrs[] = {
        {"bex_dir_node_picks_total", "Times the node was chosen",
         offsetof(bex_dir_node_stats, picks)},
        {"bex_dir_node_ok_total", "Answers from the node", offsetof(bex_dir_node_stats, ok)},
        {"bex_dir_node_conn_failures_total", "Connection failures to the node",
         offsetof(bex_dir_node_stats, conn_failures)},
        {"bex_dir_node_req_failures_total", "Request failures to the node",
         offsetof(bex_dir_node_stats, req_failures)},
        {"bex_dir_node_quarantines_total", "Times the node was quarantined",
         offsetof(bex_dir_node_stats, quarantines)},
        {"bex_dir_node_quarantine_refused_total",
         "Quarantines refused: the node was a shard's last healthy replica",
         offsetof(bex_dir_node_stats, quarantine_refused)},
        {"bex_dir_node_probes_total", "Probe calls given to the node",
         offsetof(bex_dir_node_stats, probes)},
        {"bex_dir_node_probe_failures_total", "Probes that failed",
         offsetof(bex_dir_node_stats, probe_failures)},
        {"bex_dir_node_lifts_total", "Quarantines lifted by a good probe",
         offsetof(bex_dir_node_stats, lifts)},
        {"bex_dir_node_early_probes_total",
         "Quarantines cut short for a probe: a shard's last healthy replica failed",
         offsetof(bex_dir_node_stats, early_probes)},
    };
    pthread_mutex_lock(&d->mu);
    for (size_t i = 0; i < sizeof ctrs / sizeof ctrs[0]; i++) {
        bex__prom_printf(&o, "# HELP %s %s.\n# TYPE %s counter\n", ctrs[i].metric, ctrs[i].help,
                         ctrs[i].metric);
        for (const struct bex__dir_node *n = d->nodes; n; n = n->next) {
            uint64_t v;
            memcpy(&v, (const char *)&n->st + ctrs[i].off, sizeof v);
            bex__prom_printf(&o, "%s{node=\"%s\"} %llu\n", ctrs[i].metric, n->name,
                             (unsigned long long)v);
        }
    }
    bex__prom_printf(&o, "# HELP bex_dir_node_state 0 healthy, 1 quarantined, 2 probing.\n"
                         "# TYPE bex_dir_node_state gauge\n");
    for (const struct bex__dir_node *n = d->nodes; n; n = n->next)
        bex__prom_printf(&o, "bex_dir_node_state{node=\"%s\"} %d\n", n->name, n->state);
    bex__prom_printf(&o, "# HELP bex_dir_node_outstanding Calls picked and not reported done.\n"
                         "# TYPE bex_dir_node_outstanding gauge\n");
    for (const struct bex__dir_node *n = d->nodes; n; n = n->next)
        bex__prom_printf(&o, "bex_dir_node_outstanding{node=\"%s\"} %u\n", n->name,
                         n->st.outstanding);
    pthread_mutex_unlock(&d->mu);
    return o.n > INT32_MAX ? INT32_MAX : (int)o.n;
}

int bex_dir_node_stats_get(bex_dir *d, const struct sockaddr_in *addr, bex_dir_node_stats *out)
{
    if (!d || !addr || !out)
        return -EINVAL;
    pthread_mutex_lock(&d->mu);
    struct bex__dir_node *n = node_find(d, addr);
    if (n) {
        /* no tick here: a state changes when a pick or report sees time pass */
        *out = n->st;
        out->state = n->state;
    }
    pthread_mutex_unlock(&d->mu);
    return n ? 0 : -ENOENT;
}
