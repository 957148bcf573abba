/* SPDX-License-Identifier: Apache-2.0 */
/* bex-ps: serve shards of a parameter server (include/bex/ps.h) at the
 * addresses a cluster file gives them (docs/configuration.md, "bex-ps").
 *
 * Every shard listed by --shard is served at its replica --replica's
 * address, each by its own RPC server on one context (the replicas served
 * must share an IP address: the context's). Or, with --etcd instead of
 * --cluster, at --listen's address, and registered in etcd under a lease
 * (revoked at shutdown; it expires when the process dies). SIGUSR1 writes a snapshot of
 * every shard; SIGTERM and SIGINT drain: out of etcd, /ready 503, no new
 * connection, the requests received answered (at most --drain-timeout-ms,
 * 10000); then the servers stop, the snapshots are written and bex-ps
 * leaves with status 0. The snapshots (--snapshot-dir) are loaded at start;
 * --snapshot-every writes them periodically too.
 * With --metrics-port, GET /metrics over HTTP (libmicrohttpd, on the
 * replica's address) answers the shards' and their RPC servers' counters
 * and the context's (transport, pools: bex_ctx_prometheus) in Prometheus
 * text format; /healthz answers 200 while the process is up; /ready 200
 * once every shard is loaded, caught up and registered (etcd), else 503
 * with the reason (starting, registering, catching up, draining).
 * When the cluster file (or etcd) lists other replicas of a shard, the shard starts
 * by catching up with one of them (bex_ps_shard_catchup: their rows and
 * the Pushes they applied, while the Pushes arriving here are held), and
 * only then says "ready"; --no-catchup serves the snapshot alone. */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <microhttpd.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dump.h"
#include "bex/dir.h"
#include "bex/ps.h"
#include "bex/rpc.h"
#include "bex/sock.h"
#include "snapcmd.h"

#define MAX_SERVED 64

__attribute__((noreturn)) static void usage(int status)
{
    fputs("usage: bex-ps --cluster FILE --shard N[,N...]|all [OPTION]...\n"
          "       bex-ps --etcd URL --listen IP[:PORT] --n-shards N --shard N[,N...]|all "
          "[OPTION]...\n"
          "       bex-ps snapshot --cluster FILE [--service NAME] [--full] [--timeout-ms MS]\n"
          "Serve shards of a parameter server (docs/configuration.md, \"bex-ps\").\n"
          "Where the shards are:\n"
          "  --cluster FILE             the cluster file that gives each shard's replicas\n"
          "  --etcd URL                 or register in etcd at this URL instead\n"
          "  --listen IP[:PORT]         with --etcd: this process's address (shard i at PORT + i)\n"
          "  --n-shards N               with --etcd: the service's shard count (1..4096)\n"
          "  --shard N[,N...]|all       the shards this process serves\n"
          "  --service NAME             the service's name (ps)\n"
          "  --replica I                which replica of each shard this is (0)\n"
          "  --etcd-prefix P            etcd key prefix (/bex/)\n"
          "  --locality L               a locality label for nearest-replica reads (none)\n"
          "  --ttl S                    etcd lease of the registration, seconds (10)\n"
          "Replication:\n"
          "  --primary-backup           replica 0 (static) or the etcd leader is the primary\n"
          "  --replicas IP:PORT,...     with --etcd: every replica of the shards, in order\n"
          "  --lease-ttl-ms MS          the primary's etcd lease (library default)\n"
          "  --lease-margin-ms MS       stop acknowledging this long before it expires\n"
          "  --forward-timeout-ms MS    a backup that does not answer leaves the set after it\n"
          "  --etcd-wait-ms MS          how long to wait for etcd at start (60000)\n"
          "  --join                     join a running shard as a new backup (with --replica)\n"
          "  --no-catchup               serve the snapshot alone, without catching up\n"
          "  --catchup-timeout-ms MS    the catch-up from another replica at most (10000)\n"
          "Tables and snapshots:\n"
          "  --table ID:DIM:sgd|adagrad[:LR]  a table (repeatable; 1:16:sgd if none)\n"
          "  --snapshot-dir DIR         load snapshots from and write them to DIR\n"
          "  --snapshot-every MS        write snapshots this often (needs --snapshot-dir)\n"
          "  --cut-dir DIR              where consistent cuts are written and read\n"
          "  --restore-cut ID           start from cut ID (needs --cut-dir)\n"
          "  --cut-pause-ms MS          a cut's longest pause of Pushes\n"
          "  --cut-full-every N         every Nth cut is full, the others incremental\n"
          "Transport and service:\n"
          "  --transport auto|rdma|tcp  the transport (auto)\n"
          "  --poll spin-sleep|busy|event  how the I/O threads wait (spin-sleep)\n"
          "  --io-threads N             I/O threads of the context (1)\n"
          "  --eager-max B              the largest message sent eagerly (library default)\n"
          "  --send-window B            bytes in flight per connection (0: none)\n"
          "  --keepalive-timeout-ms MS  a peer silent this long is dead (library default)\n"
          "  --metrics-port PORT        serve /metrics, /healthz and /ready on it (none)\n"
          "  --drain-timeout-ms MS      on SIGTERM, finish requests for at most this (10000)\n"
          "  --verbose                  log at INFO\n"
          "  --help                     this text\n"
          "  --version                  the version\n",
          status ? stderr : stdout);
    exit(status);
}

static int parse_table(const char *s, bex_ps_table_config *t)
{
    char opt[16];
    float lr = 0;
    unsigned id, dim;
    int n = sscanf(s, "%u:%u:%15[a-z]:%f", &id, &dim, opt, &lr);
    if (n < 3)
        return -1;
    *t = (bex_ps_table_config){.id = id, .dim = dim, .lr = lr};
    if (strcmp(opt, "sgd") == 0)
        t->optimizer = BEX_PS_SGD;
    else if (strcmp(opt, "adagrad") == 0)
        t->optimizer = BEX_PS_ADAGRAD;
    else
        return -1;
    return 0;
}

struct served {
    uint32_t shard;
    bex_ps_shard *ps;
    bex_rpc_server *srv;
    char snap[4096];
    bex_rpc_endpoint peers[16]; /* the shard's other replicas: catch-up */
    size_t n_peers;
    uint32_t role;                /* --primary-backup: BEX_PS_ROLE_* */
    bex_rpc_endpoint backups[15]; /* the primary's */
    size_t n_backups;
    bex_ps_failover *fo;      /* --etcd --primary-backup */
    bex_rpc_endpoint primary; /* --primary-backup: replica 0 (--join) */
};

/* ---- /metrics ---- */

struct metrics {
    bex_ps_shard *ps[MAX_SERVED];
    bex_rpc_server *srv[MAX_SERVED];
    const char *names[MAX_SERVED];
    char name_buf[MAX_SERVED][16];
    size_t n;
    bex_ctx *ctx;
    _Atomic(const char *) not_ready; /* why /ready answers 503; NULL: ready */
};

/* The shards' text, then their servers', then the context's: malloc'd,
 * NUL-terminated. */
static char *metrics_text(const struct metrics *m)
{
    size_t cap = 16384;
    for (int tries = 0; tries < 8; tries++) {
        char *buf = malloc(cap);
        if (!buf)
            return NULL;
        int a = bex_ps_shard_prometheus(m->ps, m->n, buf, cap);
        int b = a < 0 || (size_t)a >= cap
                    ? 0
                    : bex_rpc_server_prometheus(m->srv, m->names, m->n, buf + a, cap - (size_t)a);
        size_t ab = (size_t)a + (size_t)b;
        int c = a < 0 || b < 0 || ab >= cap ? 0 : bex_ctx_prometheus(m->ctx, buf + ab, cap - ab);
        if (a < 0 || b < 0 || c < 0) {
            free(buf);
            return NULL;
        }
        if (ab + (size_t)c < cap)
            return buf;
        free(buf); /* grew meanwhile, or the first guess was short */
        cap = 2 * (ab + (size_t)c + 1);
    }
    return NULL;
}

/* /ready's text: "ready" or "not ready: why", then with replication each
 * shard's role now ("shard3: primary", "backup", "backup, catching up"):
 * malloc'd. */
static char *ready_text(const struct metrics *m, const char *why)
{
    size_t cap = 64 + m->n * 48, n;
    char *text = malloc(cap);
    if (!text)
        return NULL;
    n = (size_t)snprintf(text, cap, why ? "not ready: %s\n" : "ready\n", why);
    for (size_t i = 0; i < m->n && n < cap; i++) {
        bex_ps_shard_stats st;
        bex_ps_shard_stats_get(m->ps[i], &st);
        if (st.role == BEX_PS_ROLE_ANY)
            continue;
        bool catching = why && !strcmp(why, "catching up");
        n += (size_t)snprintf(text + n, cap - n, "%s: %s%s\n", m->names[i],
                              st.role == BEX_PS_ROLE_PRIMARY ? "primary" : "backup",
                              catching ? ", catching up" : "");
    }
    return text;
}

static enum MHD_Result http_answer(struct MHD_Connection *c, unsigned code, char *text)
{
    if (!text)
        return MHD_NO;
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                            code == MHD_HTTP_OK ? "text/plain; version=0.0.4; charset=utf-8"
                                                : "text/plain; charset=utf-8");
    enum MHD_Result ret = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result on_http(void *cls, struct MHD_Connection *c, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **req_cls)
{
    (void)version;
    (void)upload;
    (void)req_cls;
    if (*upload_size) /* no body is read: refuse one */
        return MHD_NO;
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return http_answer(c, MHD_HTTP_METHOD_NOT_ALLOWED, strdup("only GET\n"));
    struct metrics *m = cls;
    if (strcmp(url, "/healthz") == 0)
        return http_answer(c, MHD_HTTP_OK, strdup("ok\n"));
    if (strcmp(url, "/ready") == 0) {
        const char *why = atomic_load(&m->not_ready);
        return http_answer(c, why ? MHD_HTTP_SERVICE_UNAVAILABLE : MHD_HTTP_OK, ready_text(m, why));
    }
    if (strcmp(url, "/metrics") != 0)
        return http_answer(c, MHD_HTTP_NOT_FOUND, strdup("only /metrics, /healthz, /ready\n"));
    char *text = metrics_text(cls);
    if (!text)
        return http_answer(c, MHD_HTTP_INTERNAL_SERVER_ERROR, strdup("out of memory\n"));
    return http_answer(c, MHD_HTTP_OK, text);
}

/* The replicas of reps[0..nr) other than self (by address) as the
 * shard's catch-up peers, nearest (same locality) first. */
static void add_peers(struct served *sv, const bex_dir_replica *reps, size_t nr,
                      const bex_dir_replica *self)
{
    for (int near = 1; near >= 0; near--)
        for (size_t j = 0; j < nr; j++) {
            bool same = strcmp(reps[j].locality, self->locality) == 0;
            if (bex_addr_equal(&reps[j].addr, &self->addr) || same != (bool)near ||
                sv->n_peers == sizeof sv->peers / sizeof sv->peers[0])
                continue;
            bex_rpc_endpoint *e = &sv->peers[sv->n_peers++];
            e->addr = reps[j].addr;
            e->transport = reps[j].transport;
            e->locality = NULL; /* not needed to connect */
        }
}

static void snapshot_all(struct served *sv, size_t n, const char *dir)
{
    if (!dir)
        return;
    for (size_t i = 0; i < n; i++) {
        int rc = bex_ps_shard_snapshot(sv[i].ps, sv[i].snap);
        if (rc)
            fprintf(stderr, "bex-ps: shard %u: snapshot %s: %s\n", sv[i].shard, sv[i].snap,
                    bex_strerror(rc));
    }
}

/* the limits bad_value's lines name */
_Static_assert(BEX_DIR_LOCALITY_MAX == 63 && BEX_PS_TABLES_MAX == 64, "bex-ps's messages");

/* The option being parsed (its long name), for bad_value. */
static const char *cur_opt = "";

/* The current option's value is bad: one line naming the option, its
 * value and what it may be, exit status 2. */
__attribute__((noreturn)) static void bad_value(const char *want)
{
    fprintf(stderr, "bex-ps: --%s '%s': %s\n", cur_opt, optarg ? optarg : "", want);
    exit(2);
}

/* A whole decimal number in [lo, hi], or bad_value(). */
static long opt_num(const char *s, long lo, long hi)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*s == 0 || *end || errno || v < lo || v > hi) {
        char want[80];
        snprintf(want, sizeof want, "not a whole number from %ld to %ld", lo, hi);
        bad_value(want);
    }
    return v;
}

/* The command line. */
struct opts {
    const char *cluster, *service, *shards, *snap_dir, *etcd, *etcd_prefix, *listen_s, *locality;
    uint32_t replica, transport, poll_mode;
    long metrics_port, snap_every_ms, keepalive_timeout_ms, catchup_ms;
    long drain_ms;    /* SIGTERM: each server's drain at most (bex_rpc_server_drain) */
    long eager_max;   /* the context's (0: its default) */
    long send_window; /* the context's (0: none) */
    long io_threads;
    int catchup, verbose, primary_backup;
    const char *replicas_s; /* --etcd --primary-backup: every replica's --listen */
    long lease_ttl_ms, lease_margin_ms, fwd_timeout_ms, etcd_wait_ms;
    /* consistent cuts (--cut-*) and --join (a new backup joins its primary) */
    const char *cut_dir;
    unsigned long long restore_cut;
    long cut_pause_ms, cut_full_every;
    int join;
    unsigned long n_shards_opt, ttl_s;
    bex_ps_table_config tables[BEX_PS_TABLES_MAX];
    size_t n_tables;
};

/* This process: the shards it serves, their addresses, its context. */
struct node {
    struct served sv[MAX_SERVED];
    size_t n_sv, up; /* up: shards made, in order */
    bex_dir_replica self[MAX_SERVED];
    uint32_t n_shards;
    bex_ctx *ctx;
    bex_dir_registration *regs[MAX_SERVED];
    bex_rpc_endpoint reps[MAX_SERVED][BEX_PS_REPLICAS_MAX]; /* --replicas, per shard */
    size_t n_reps;
    uint32_t self_rep;
    struct metrics mt;
    struct MHD_Daemon *httpd;
};

/* A numeric option: whether c is one. */
static bool num_opt(int c, struct opts *o)
{
    switch (c) {
    case 'r':
        o->replica = (uint32_t)opt_num(optarg, 0, UINT32_MAX);
        return true;
    case 'U':
        o->catchup_ms = opt_num(optarg, 1, 3600000);
        return true;
    case 'N':
    case 'T':
        *(c == 'N' ? &o->n_shards_opt : &o->ttl_s) = (unsigned long)opt_num(optarg, 1, 4096);
        return true;
    case 'e':
        o->snap_every_ms = opt_num(optarg, 1, 86400000);
        return true;
    case 'k':
        o->keepalive_timeout_ms = opt_num(optarg, 1, 3600000);
        return true;
    case 'G':
        o->eager_max = opt_num(optarg, 0, UINT32_MAX);
        return true;
    case 'W':
        o->send_window = opt_num(optarg, 0, UINT32_MAX);
        return true;
    case 'I':
        o->io_threads = opt_num(optarg, 1, 64);
        return true;
    case 'm':
        o->metrics_port = opt_num(optarg, 0, 65535);
        return true;
    case 'D':
        o->drain_ms = opt_num(optarg, 0, 3600000);
        return true;
    case 'a':
        o->lease_ttl_ms = opt_num(optarg, 1000, 3600000);
        return true;
    case 'g':
        o->lease_margin_ms = opt_num(optarg, 1, 3600000);
        return true;
    case 'f':
        o->fwd_timeout_ms = opt_num(optarg, 1, 3600000);
        return true;
    case 'w':
        o->etcd_wait_ms = opt_num(optarg, 0, 86400000);
        return true;
    case 'X':
        o->cut_pause_ms = opt_num(optarg, 1, 60000);
        return true;
    case 'F':
        o->cut_full_every = opt_num(optarg, 1, 1000000);
        return true;
    case 'Q':
        o->restore_cut = strtoull(optarg, NULL, 10);
        if (!o->restore_cut)
            bad_value("not a cut id (a whole number above 0)");
        return true;
    default:
        return false;
    }
}

static void one_opt(int c, struct opts *o)
{
    switch (c) {
    case 'V':
        printf("%s %s\n", "bex-ps", bex_version_string());
        exit(0);
    case 'h':
        usage(0);
    case 'c':
        o->cluster = optarg;
        break;
    case 's':
        o->service = optarg;
        break;
    case 'n':
        o->shards = optarg;
        break;
    case 'd':
        o->snap_dir = optarg;
        break;
    case 'v':
        o->verbose = 1;
        break;
    case 'C':
        o->catchup = 0;
        break;
    case 'B':
        o->primary_backup = 1;
        break;
    case 'R':
        o->replicas_s = optarg;
        break;
    case 'J':
        o->join = 1;
        break;
    case 'K':
        o->cut_dir = optarg;
        break;
    case 'E':
        o->etcd = optarg;
        break;
    case 'P':
        o->etcd_prefix = optarg;
        break;
    case 'l':
        o->listen_s = optarg;
        break;
    case 'L':
        o->locality = optarg;
        if (strlen(o->locality) > BEX_DIR_LOCALITY_MAX)
            bad_value("longer than BEX_DIR_LOCALITY_MAX (63) bytes");
        break;
    case 't':
        if (o->n_tables == BEX_PS_TABLES_MAX)
            bad_value("one table more than BEX_PS_TABLES_MAX (64)");
        if (parse_table(optarg, &o->tables[o->n_tables++]))
            bad_value("not ID:DIM:sgd|adagrad[:LR]");
        break;
    case 'p':
        if (bex_poll_mode_parse(optarg, &o->poll_mode))
            bad_value("not spin-sleep, busy or event");
        break;
    case 'x':
        if (strcmp(optarg, "tcp") == 0)
            o->transport = BEX_TRANSPORT_TCP;
        else if (strcmp(optarg, "rdma") == 0)
            o->transport = BEX_TRANSPORT_RDMA;
        else if (strcmp(optarg, "auto") != 0)
            bad_value("not auto, rdma or tcp");
        break;
    default:
        if (!num_opt(c, o))
            usage(2);
    }
}

static void parse_opts(int argc, char **argv, struct opts *o)
{
    *o = (struct opts){.service = "ps",
                       .transport = BEX_TRANSPORT_AUTO,
                       .poll_mode = BEX_POLL_SPIN_SLEEP,
                       .metrics_port = -1,
                       .catchup_ms = 10000,
                       .drain_ms = 10000,
                       .io_threads = 1,
                       .catchup = 1,
                       .locality = "",
                       .ttl_s = 10,
                       .etcd_wait_ms = 60000};
    static const struct option lo[] = {{"cluster", required_argument, 0, 'c'},
                                       {"service", required_argument, 0, 's'},
                                       {"shard", required_argument, 0, 'n'},
                                       {"replica", required_argument, 0, 'r'},
                                       {"table", required_argument, 0, 't'},
                                       {"snapshot-dir", required_argument, 0, 'd'},
                                       {"transport", required_argument, 0, 'x'},
                                       {"metrics-port", required_argument, 0, 'm'},
                                       {"snapshot-every", required_argument, 0, 'e'},
                                       {"etcd", required_argument, 0, 'E'},
                                       {"etcd-prefix", required_argument, 0, 'P'},
                                       {"listen", required_argument, 0, 'l'},
                                       {"n-shards", required_argument, 0, 'N'},
                                       {"locality", required_argument, 0, 'L'},
                                       {"ttl", required_argument, 0, 'T'},
                                       {"keepalive-timeout-ms", required_argument, 0, 'k'},
                                       {"verbose", no_argument, 0, 'v'},
                                       {"no-catchup", no_argument, 0, 'C'},
                                       {"primary-backup", no_argument, 0, 'B'},
                                       {"catchup-timeout-ms", required_argument, 0, 'U'},
                                       {"poll", required_argument, 0, 'p'},
                                       {"eager-max", required_argument, 0, 'G'},
                                       {"send-window", required_argument, 0, 'W'},
                                       {"io-threads", required_argument, 0, 'I'},
                                       {"drain-timeout-ms", required_argument, 0, 'D'},
                                       {"replicas", required_argument, 0, 'R'},
                                       {"lease-ttl-ms", required_argument, 0, 'a'},
                                       {"lease-margin-ms", required_argument, 0, 'g'},
                                       {"forward-timeout-ms", required_argument, 0, 'f'},
                                       {"etcd-wait-ms", required_argument, 0, 'w'},
                                       {"cut-dir", required_argument, 0, 'K'},
                                       {"restore-cut", required_argument, 0, 'Q'},
                                       {"cut-pause-ms", required_argument, 0, 'X'},
                                       {"cut-full-every", required_argument, 0, 'F'},
                                       {"join", no_argument, 0, 'J'},
                                       {"help", no_argument, 0, 'h'},
                                       {"version", no_argument, 0, 'V'},
                                       {0, 0, 0, 0}};
    int idx = -1;
    for (int c; (c = getopt_long(argc, argv, "", lo, &idx)) != -1; idx = -1) {
        cur_opt = idx >= 0 ? lo[idx].name : "";
        one_opt(c, o);
    }
    if (!o->shards || optind != argc || (o->snap_every_ms && !o->snap_dir) ||
        !o->cluster == !o->etcd || (o->etcd && (!o->listen_s || !o->n_shards_opt)) ||
        (o->etcd && o->primary_backup && !o->replicas_s) || (o->replicas_s && !o->etcd) ||
        (o->restore_cut && !o->cut_dir) || (o->join && (!o->primary_backup || !o->replica)))
        usage(2);
    if (o->etcd && o->primary_backup)
        o->catchup = 0; /* each backup copies from its primary (the failover agent) */
    if (o->n_tables == 0)
        o->tables[o->n_tables++] =
            (bex_ps_table_config){.id = 1, .dim = 16, .optimizer = BEX_PS_SGD};
}

/* --cluster: the file's directory in *dir, and the service's shard count. */
static int load_cluster(const struct opts *o, bex_dir **dir, uint32_t *n_shards)
{
    char err[256] = "";
    int rc = bex_dir_create(NULL, dir);
    if (!rc)
        rc = bex_dir_load_file(*dir, o->cluster, err, sizeof err);
    if (rc) {
        if (err[0])
            fprintf(stderr, "bex-ps: %s\n", err);
        else
            fprintf(stderr, "bex-ps: %s: %s\n", o->cluster, bex_strerror(rc));
        bex_dir_destroy(*dir);
        *dir = NULL;
        return 1;
    }
    while (*n_shards < 4096 && bex_dir_replicas(*dir, o->service, *n_shards, NULL, 0) > 0)
        (*n_shards)++;
    if (*n_shards == 0) {
        fprintf(stderr, "bex-ps: %s: no service \"%s\"\n", o->cluster, o->service);
        bex_dir_destroy(*dir);
        *dir = NULL;
        return 1;
    }
    return 0;
}

/* --shard all or a list of shards. */
static int shard_list(const struct opts *o, struct node *nd)
{
    for (const char *p = o->shards; *p;) {
        if (strncmp(p, "all", 3) == 0) {
            for (uint32_t i = 0; i < nd->n_shards && nd->n_sv < MAX_SERVED; i++)
                nd->sv[nd->n_sv++].shard = i;
            break;
        }
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (end == p || v >= nd->n_shards || nd->n_sv == MAX_SERVED) {
            fprintf(stderr, "bex-ps: --shard %s: the cluster has shards 0..%u\n", o->shards,
                    nd->n_shards - 1);
            return 1;
        }
        nd->sv[nd->n_sv++].shard = (uint32_t)v;
        p = *end == ',' ? end + 1 : end;
    }
    return 0;
}

/* --listen HOST[:PORT] (etcd): shard i of the list at PORT + i (0: any).
 * HOST: an IPv4 address, [IPv6] or a name (resolved here). */
static int listen_addrs(const struct opts *o, struct node *nd)
{
    bex_addr a;
    char why[200];
    const char *ls = o->listen_s;
    if (bex_addr_resolve(ls, 0, &a, why, sizeof why) || bex_addr_port(&a) + nd->n_sv > 65536) {
        fprintf(stderr, "bex-ps: --listen %s: not HOST[:PORT] (%s)\n", ls,
                bex_addr_port(&a) ? "port + shards past 65535" : why);
        return 1;
    }
    unsigned port = bex_addr_port(&a);
    for (size_t i = 0; i < nd->n_sv; i++) {
        nd->self[i] = (bex_dir_replica){
            .addr = a, .transport = o->transport == BEX_TRANSPORT_AUTO ? 0 : o->transport};
        bex_addr_set_port(&nd->self[i].addr, (uint16_t)(port ? port + i : 0));
        snprintf(nd->self[i].locality, sizeof nd->self[i].locality, "%s", o->locality);
    }
    return 0;
}

/* --primary-backup: replica 0 is the shard's primary (the first listed,
 * where clients with BEX_PS_PUSH_PRIMARY send their Pushes), the others
 * its backups. */
static void pb_roles(struct served *sv, const bex_dir_replica *reps, size_t nr, uint32_t self)
{
    sv->role = self == 0 ? BEX_PS_ROLE_PRIMARY : BEX_PS_ROLE_BACKUP;
    sv->primary = (bex_rpc_endpoint){.addr = reps[0].addr, .transport = reps[0].transport};
    for (size_t j = 1; self == 0 && j < nr && sv->n_backups < 15; j++)
        sv->backups[sv->n_backups++] =
            (bex_rpc_endpoint){.addr = reps[j].addr, .transport = reps[j].transport};
}

/* --cluster: each shard's address (our replica's) and its peers. */
static int cluster_addrs(const struct opts *o, bex_dir *dir, struct node *nd)
{
    for (size_t i = 0; i < nd->n_sv; i++) {
        bex_dir_replica reps[64];
        size_t nr = bex_dir_replicas(dir, o->service, nd->sv[i].shard, reps, 64);
        if (o->replica >= nr || o->replica >= 64) {
            fprintf(stderr, "bex-ps: shard %u has no replica %u\n", nd->sv[i].shard, o->replica);
            return 1;
        }
        nd->self[i] = reps[o->replica];
        if (!bex_addr_same_host(&nd->self[i].addr, &nd->self[0].addr)) {
            fprintf(stderr, "bex-ps: the shards served must share an IP address\n");
            return 1;
        }
        if (o->catchup)
            add_peers(&nd->sv[i], reps, nr < 64 ? nr : 64, &nd->self[i]);
        if (o->primary_backup)
            pb_roles(&nd->sv[i], reps, nr < 64 ? nr : 64, o->replica);
    }
    return 0;
}

/* With etcd: the peers are the replicas registered there now (a stale
 * registration of this process's previous life, at its address, left
 * out; one at another port fails and the next is tried). */
static void etcd_peers(const struct opts *o, struct node *nd)
{
    char err[256] = "";
    bex_dir *dir = NULL;
    int rc = bex_dir_create(NULL, &dir);
    if (!rc && (rc = bex_dir_watch_etcd(dir, o->etcd, o->etcd_prefix, err, sizeof err)))
        fprintf(stderr, "bex-ps: etcd: %s: no catch-up\n", err[0] ? err : bex_strerror(rc));
    for (size_t i = 0; !rc && i < nd->n_sv; i++) {
        bex_dir_replica reps[64];
        size_t nr = bex_dir_replicas(dir, o->service, nd->sv[i].shard, reps, 64);
        add_peers(&nd->sv[i], reps, nr < 64 ? nr : 64, &nd->self[i]);
    }
    bex_dir_destroy(dir);
}

/* --etcd --primary-backup: --replicas (each one's --listen) into each
 * shard's replica list (shard i of the list at PORT + i), this one's
 * index, and every shard a backup until the failover agent decides. */
static int pb_etcd_plan(const struct opts *o, struct node *nd)
{
    bool self_seen = false;
    for (const char *p = o->replicas_s; p && *p;) {
        const char *e = strchr(p, ',');
        char one[256];
        snprintf(one, sizeof one, "%.*s", (int)(e ? e - p : (long)strlen(p)), p);
        bex_addr a;
        char err[128] = "";
        if (nd->n_reps == BEX_PS_REPLICAS_MAX || bex_addr_resolve(one, 0, &a, err, sizeof err) ||
            !bex_addr_port(&a) || bex_addr_port(&a) + nd->n_sv > 65536) {
            fprintf(stderr, "bex-ps: --replicas %s: not HOST:PORT,... (at most %u)%s%s\n",
                    o->replicas_s, BEX_PS_REPLICAS_MAX, err[0] ? ": " : "", err);
            return 1;
        }
        if (bex_addr_equal(&a, &nd->self[0].addr)) {
            nd->self_rep = (uint32_t)nd->n_reps;
            self_seen = true;
        }
        for (size_t i = 0; i < nd->n_sv; i++) {
            nd->reps[i][nd->n_reps] = (bex_rpc_endpoint){.addr = a, .transport = o->transport};
            bex_addr_set_port(&nd->reps[i][nd->n_reps].addr, (uint16_t)(bex_addr_port(&a) + i));
        }
        nd->n_reps++;
        p = e ? e + 1 : NULL;
    }
    if (!self_seen) {
        fprintf(stderr, "bex-ps: --replicas %s: --listen %s is not among them\n", o->replicas_s,
                o->listen_s);
        return 1;
    }
    for (size_t i = 0; i < nd->n_sv; i++)
        nd->sv[i].role = BEX_PS_ROLE_BACKUP;
    return 0;
}

/* The shards served, their addresses and peers, from --cluster or etcd. */
static int plan(const struct opts *o, struct node *nd)
{
    bex_dir *dir = NULL;
    nd->n_shards = (uint32_t)o->n_shards_opt;
    if (o->cluster && load_cluster(o, &dir, &nd->n_shards))
        return 1;
    int bad = shard_list(o, nd) || (o->etcd && listen_addrs(o, nd)) ||
              (dir && cluster_addrs(o, dir, nd)) || (o->replicas_s && pb_etcd_plan(o, nd));
    bex_dir_destroy(dir);
    if (bad)
        return 1;
    if (o->etcd && o->catchup)
        etcd_peers(o, nd);
    return 0;
}

/* A replica listed (or run) RDMA needs a device and prefers RDMA, but its
 * context is AUTO: it takes TCP connections too, those of clients whose
 * recovery ladder fell back to TCP (docs/architecture.md, "Recovery
 * ladder", step 3: while it was dead, say). RDMA only, it refused them
 * until their next RDMA retry (rdma_retry_ms, 30 s by default) and missed
 * their Pushes meanwhile. A client that asks RDMA still gets RDMA. */
static int make_ctx(const struct opts *o, struct node *nd)
{
    uint32_t want = nd->self[0].transport ? nd->self[0].transport : o->transport;
    bex_ctx_config cc = {.local_addr = nd->self[0].addr,
                         .transport =
                             want == BEX_TRANSPORT_TCP ? BEX_TRANSPORT_TCP : BEX_TRANSPORT_AUTO,
                         .keepalive_timeout_ms = (uint32_t)o->keepalive_timeout_ms,
                         .eager_max = (uint32_t)o->eager_max,
                         .send_window = (uint32_t)o->send_window,
                         .io_threads = (uint32_t)o->io_threads,
                         .poll_mode = o->poll_mode,
                         .log_level = o->verbose ? BEX_LOG_INFO : 0};
    int rc = bex_ctx_create(&cc, &nd->ctx);
    if (rc) {
        fprintf(stderr, "bex-ps: context: %s\n", bex_strerror(rc));
        return 1;
    }
    if (want == BEX_TRANSPORT_RDMA && !bex_ctx_pd(nd->ctx)) {
        char a[BEX_ADDR_STRLEN];
        bex_addr_format(&nd->self[0].addr, false, a, sizeof a);
        fprintf(stderr, "bex-ps: RDMA wanted, but no RDMA device carries %s\n", a);
        bex_ctx_destroy(nd->ctx);
        return 1;
    }
    return 0;
}

/* Shard up's PS shard and RPC server, listening. */
static int start_shard(const struct opts *o, struct node *nd)
{
    struct served *s = &nd->sv[nd->up];
    bex_dir_replica *self = &nd->self[nd->up];
    if (o->snap_dir)
        snprintf(s->snap, sizeof s->snap, "%s/%s-shard%u-replica%u.snap", o->snap_dir, o->service,
                 s->shard, o->replica);
    bex_ps_shard_config pc = {.shard = s->shard,
                              .n_shards = nd->n_shards,
                              .tables = o->tables,
                              .n_tables = o->n_tables,
                              .snapshot_path = o->snap_dir ? s->snap : NULL,
                              .flags = s->n_peers ? BEX_PS_SHARD_CATCHUP : 0,
                              .role = s->role,
                              .backups = s->backups,
                              .n_backups = s->n_backups,
                              .forward_timeout_ms = (uint32_t)o->fwd_timeout_ms,
                              .cut_dir = o->cut_dir,
                              .restore_cut = o->restore_cut,
                              .cut_pause_ms = (uint32_t)o->cut_pause_ms,
                              .cut_full_every = (uint32_t)o->cut_full_every};
    char a[BEX_ADDR_STRLEN];
    bex_addr_format(&self->addr, false, a, sizeof a);
    int rc;
    if ((rc = bex_ps_shard_create(&pc, &s->ps)) == 0) {
        if ((rc = bex_rpc_server_create(nd->ctx, NULL, &s->srv)) == 0 &&
            ((rc = bex_ps_shard_register(s->ps, s->srv, nd->ctx)) ||
             (rc = bex_rpc_server_listen(s->srv, &self->addr)))) {
            bex_rpc_server_destroy(s->srv);
            s->srv = NULL;
        }
        if (rc)
            bex_ps_shard_destroy(s->ps);
    }
    if (rc) {
        fprintf(stderr, "bex-ps: shard %u at %s:%u: %s\n", s->shard, a, bex_addr_port(&self->addr),
                bex_strerror(rc));
        return 1;
    }
    bex_rpc_server_addr(s->srv, &self->addr); /* the port, when it was 0 */
    printf("bex-ps: shard %u of %u serving at %s:%u\n", s->shard, nd->n_shards, a,
           bex_addr_port(&self->addr));
    return 0;
}

/* In etcd once every shard serves: clients find them from here on. etcd
 * may not be up yet (any start order): tried again for --etcd-wait-ms. */
static int register_all(const struct opts *o, struct node *nd)
{
    char err[256] = "";
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (size_t i = 0; i < nd->n_sv; i++) {
        int rc;
        bool said = false;
        while ((rc = bex_dir_register_etcd(o->etcd, o->etcd_prefix, o->service, nd->sv[i].shard,
                                           &nd->self[i], (uint32_t)o->ttl_s, err, sizeof err,
                                           &nd->regs[i]))) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            long ms = (now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000;
            if (rc == -EINVAL || ms >= o->etcd_wait_ms)
                break;
            if (!said)
                printf("bex-ps: waiting for etcd at %s (%s), %ld ms at most\n", o->etcd,
                       err[0] ? err : bex_strerror(rc), o->etcd_wait_ms);
            said = true;
            fflush(stdout);
            struct timespec ts = {0, 200000000};
            nanosleep(&ts, NULL);
        }
        if (rc) {
            fprintf(stderr, "bex-ps: shard %u: etcd registration: %s\n", nd->sv[i].shard,
                    err[0] ? err : bex_strerror(rc));
            return 1;
        }
        printf("bex-ps: shard %u registered in etcd\n", nd->sv[i].shard);
    }
    return 0;
}

/* --etcd --primary-backup: each shard's failover agent (it elects, leads
 * or follows from here on). */
static int failover_all(const struct opts *o, struct node *nd)
{
    for (size_t i = 0; o->replicas_s && i < nd->n_sv; i++) {
        bex_ps_failover_config fc = {.etcd_url = o->etcd,
                                     .prefix = o->etcd_prefix,
                                     .service = o->service,
                                     .shard = nd->sv[i].shard,
                                     .replicas = nd->reps[i],
                                     .n_replicas = nd->n_reps,
                                     .self = nd->self_rep,
                                     .lease_ttl_ms = (uint32_t)o->lease_ttl_ms,
                                     .lease_margin_ms = (uint32_t)o->lease_margin_ms,
                                     .resync_timeout_ms = (uint32_t)o->catchup_ms};
        int rc = bex_ps_failover_start(nd->sv[i].ps, nd->ctx, &fc, &nd->sv[i].fo);
        if (rc) {
            fprintf(stderr, "bex-ps: shard %u: failover: %s\n", nd->sv[i].shard, bex_strerror(rc));
            return 1;
        }
        printf("bex-ps: shard %u: primary-backup through etcd, replica %u of %zu\n",
               nd->sv[i].shard, nd->self_rep, nd->n_reps);
    }
    return 0;
}

/* A primary's catch-up failed: it does not serve its snapshot (its
 * backups may hold newer rows) and tries again, not ready meanwhile,
 * until SIGTERM or SIGINT (1: stop). */
static int primary_catchup_wait(const struct node *nd, size_t i, int rc, const sigset_t *sigs)
{
    fprintf(stderr,
            "bex-ps: shard %u: the primary's catch-up failed (%s): not serving its snapshot as "
            "primary; trying again\n",
            nd->sv[i].shard, bex_strerror(rc));
    struct timespec pause = {0, 500000000};
    int sig = sigtimedwait(sigs, NULL, &pause);
    return sig == SIGTERM || sig == SIGINT;
}

/* Catch up with a peer replica, each shard in turn (they hold Pushes and
 * refuse Fetches until then; after the etcd registration, so that clients
 * send them the Pushes the peer applies after its copy): a failure is
 * logged, and the shard serves its snapshot and the Pushes it held; a
 * primary's is tried again until it succeeds. */
static int catchup_all(const struct opts *o, struct node *nd, const sigset_t *sigs)
{
    for (size_t i = 0; i < nd->n_sv; i++) {
        if (!nd->sv[i].n_peers)
            continue;
        bex_ps_catchup_config cu = {.peers = nd->sv[i].peers,
                                    .n_peers = nd->sv[i].n_peers,
                                    .timeout_ms = (uint32_t)o->catchup_ms};
        int rc = o->join ? bex_ps_tool_join(nd->sv[i].ps, nd->ctx, &nd->sv[i].primary, &nd->self[i],
                                            (uint32_t)o->catchup_ms)
                         : bex_ps_shard_catchup(nd->sv[i].ps, nd->ctx, &cu);
        while (rc && !o->join && !o->etcd && nd->sv[i].role == BEX_PS_ROLE_PRIMARY &&
               o->primary_backup) {
            if (primary_catchup_wait(nd, i, rc, sigs))
                return 1;
            rc = bex_ps_shard_catchup(nd->sv[i].ps, nd->ctx, &cu);
        }
        if (rc && o->join) /* not in the replica set: it would serve stale rows */
            return 1;
        if (rc)
            fprintf(stderr, "bex-ps: shard %u: catch-up failed (%s): serving its snapshot\n",
                    nd->sv[i].shard, bex_strerror(rc));
        else
            printf("bex-ps: shard %u caught up\n", nd->sv[i].shard);
    }
    return 0;
}

static int start_metrics(const struct opts *o, struct node *nd)
{
    struct metrics *mt = &nd->mt;
    for (size_t i = 0; i < nd->n_sv; i++) {
        mt->ps[i] = nd->sv[i].ps;
        mt->srv[i] = nd->sv[i].srv;
        snprintf(mt->name_buf[i], sizeof mt->name_buf[i], "shard%u", nd->sv[i].shard);
        mt->names[i] = mt->name_buf[i];
    }
    mt->n = nd->n_sv;
    mt->ctx = nd->ctx;
    bex_addr ma = nd->self[0].addr;
    bex_addr_set_port(&ma, (uint16_t)o->metrics_port);
    /* its thread starts with the signals blocked, as every thread here */
    nd->httpd = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG |
                                     (ma.sa.sa_family == AF_INET6 ? MHD_USE_IPv6 : 0),
                                 (uint16_t)o->metrics_port, NULL, NULL, on_http, mt,
                                 MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ma,
                                 MHD_OPTION_CONNECTION_TIMEOUT, 10u, MHD_OPTION_END);
    const union MHD_DaemonInfo *di =
        nd->httpd ? MHD_get_daemon_info(nd->httpd, MHD_DAEMON_INFO_BIND_PORT) : NULL;
    char a[BEX_ADDR_STRLEN];
    if (!di) {
        fprintf(stderr, "bex-ps: metrics on %s: cannot listen\n",
                bex_addr_format(&ma, true, a, sizeof a));
        return 1;
    }
    bex_addr_set_port(&ma, di->port);
    printf("bex-ps: metrics at http://%s/metrics\n", bex_addr_format(&ma, true, a, sizeof a));
    fflush(stdout); /* before the catch-up: /ready tells it */
    return 0;
}

/* Until SIGTERM or SIGINT; SIGUSR1 (and with --snapshot-every each
 * period, so that a replica killed without SIGTERM comes back with its
 * rows of that moment) takes a snapshot. */
static void serve(const struct opts *o, struct node *nd, const sigset_t *sigs)
{
    atomic_store(&nd->mt.not_ready, NULL);
    printf("bex-ps: ready\n");
    fflush(stdout);
    long every = o->snap_every_ms;
    struct timespec period = {every / 1000, (every % 1000) * 1000000};
    for (;;) {
        int sig = every ? sigtimedwait(sigs, NULL, &period) : 0;
        if (!every)
            sigwait(sigs, &sig);
        if (sig < 0 && errno == EAGAIN)
            sig = SIGUSR1; /* the period passed */
        else if (sig < 0)
            continue; /* EINTR */
        if (sig != SIGUSR1)
            break;
        snapshot_all(nd->sv, nd->n_sv, o->snap_dir);
    }
}

/* SIGTERM's graceful part: no new connection, the requests received
 * answered (bex_rpc_server_drain), each server within --drain-timeout-ms. */
static void drain_all(const struct opts *o, struct node *nd)
{
    printf("bex-ps: draining\n");
    fflush(stdout);
    for (size_t i = 0; i < nd->up; i++) {
        int rc = bex_rpc_server_drain(nd->sv[i].srv, (uint32_t)o->drain_ms);
        if (rc)
            fprintf(stderr, "bex-ps: shard %u: drain: %s (requests still unanswered are dropped)\n",
                    nd->sv[i].shard, bex_strerror(rc));
    }
    printf("bex-ps: drained\n");
}

static int stop_all(const struct opts *o, struct node *nd, int status)
{
    int rc;
    atomic_store(&nd->mt.not_ready, "draining");
    /* out of etcd first: clients stop picking us before we stop answering */
    for (size_t i = 0; i < nd->n_sv; i++)
        if (nd->regs[i] && (rc = bex_dir_deregister(nd->regs[i])))
            fprintf(stderr, "bex-ps: shard %u: etcd deregistration: %s (the lease expires)\n",
                    nd->sv[i].shard, bex_strerror(rc));
    for (size_t i = 0; i < nd->n_sv; i++)
        bex_ps_failover_stop(nd->sv[i].fo, true); /* the term ends now: another takes over */
    if (status == 0)
        drain_all(o, nd);
    if (nd->httpd)
        MHD_stop_daemon(nd->httpd); /* it reads the shards and servers */
    /* servers first: no Push is applied after the snapshot */
    for (size_t i = 0; i < nd->up; i++)
        bex_rpc_server_destroy(nd->sv[i].srv);
    if (status == 0)
        snapshot_all(nd->sv, nd->n_sv, o->snap_dir);
    for (size_t i = 0; i < nd->up; i++)
        bex_ps_shard_destroy(nd->sv[i].ps);
    if ((rc = bex_ctx_destroy(nd->ctx))) {
        fprintf(stderr, "bex-ps: context teardown: %s\n", bex_strerror(rc));
        status = 1;
    }
    if (status == 0)
        printf("bex-ps: stopped\n");
    return status;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "snapshot") == 0)
        return bex_ps_tool_snapshot(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "dump")) /* bex-ps dump SNAPSHOT DIR (dump.c) */
        return bex_ps_dump_main(argc - 1, argv + 1);
    static struct opts o;
    parse_opts(argc, argv, &o);
    /* the signals are taken by sigwait below: blocked before any thread */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    /* bad input (a BEX_* variable, the cluster file, the shards, the
     * addresses): one line naming it, exit 2, nothing started */
    char why[256];
    if (bex_env_check(why, sizeof why)) {
        fprintf(stderr, "bex-ps: %s\n", why);
        return 2;
    }
    static struct node nd;
    if (plan(&o, &nd))
        return 2;
    if (make_ctx(&o, &nd))
        return 1;
    int status = 0;
    for (; nd.up < nd.n_sv; nd.up++)
        if (start_shard(&o, &nd)) {
            status = 1;
            break;
        }
    /* /healthz and /ready answer from here on (/ready: 503 until serve) */
    atomic_store(&nd.mt.not_ready, o.etcd ? "registering" : "catching up");
    if (status == 0 && o.metrics_port >= 0)
        status = start_metrics(&o, &nd);
    if (status == 0 && o.etcd)
        status = register_all(&o, &nd);
    if (status == 0)
        status = failover_all(&o, &nd);
    atomic_store(&nd.mt.not_ready, "catching up");
    if (status == 0)
        status = catchup_all(&o, &nd, &sigs);
    if (status == 0)
        serve(&o, &nd, &sigs);
    return stop_all(&o, &nd, status);
}
