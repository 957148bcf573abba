/* bex-ps: serve shards of a parameter server (include/bex/ps.h) at the
 * addresses a cluster file gives them (docs/configuration.md, "bex-ps").
 *
 * Every shard listed by --shard is served at its replica --replica's
 * address, each by its own RPC server on one context (the replicas served
 * must share an IP address: the context's). SIGUSR1 writes a snapshot of
 * every shard; SIGTERM and SIGINT stop the servers, write the snapshots and
 * leave with status 0. The snapshots (--snapshot-dir) are loaded at start. */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bex/dir.h"
#include "bex/ps.h"
#include "bex/rpc.h"
#include "bex/sock.h"

#define MAX_SERVED 64

static void usage(void)
{
    fprintf(stderr,
            "usage: bex-ps --cluster FILE --shard N[,N...]|all [--service NAME] [--replica I]\n"
            "              [--table ID:DIM:sgd|adagrad[:LR]]... [--snapshot-dir DIR]\n"
            "              [--transport auto|rdma|tcp] [--verbose]\n");
    exit(2);
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
};

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

int main(int argc, char **argv)
{
    const char *cluster = NULL, *service = "ps", *shards = NULL, *snap_dir = NULL;
    uint32_t replica = 0, transport = BEX_TRANSPORT_AUTO;
    bex_ps_table_config tables[BEX_PS_TABLES_MAX];
    size_t n_tables = 0;
    int verbose = 0;
    static const struct option lo[] = {{"cluster", required_argument, 0, 'c'},
                                       {"service", required_argument, 0, 's'},
                                       {"shard", required_argument, 0, 'n'},
                                       {"replica", required_argument, 0, 'r'},
                                       {"table", required_argument, 0, 't'},
                                       {"snapshot-dir", required_argument, 0, 'd'},
                                       {"transport", required_argument, 0, 'x'},
                                       {"verbose", no_argument, 0, 'v'},
                                       {0, 0, 0, 0}};
    for (int o; (o = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
        switch (o) {
        case 'c':
            cluster = optarg;
            break;
        case 's':
            service = optarg;
            break;
        case 'n':
            shards = optarg;
            break;
        case 'r':
            replica = (uint32_t)strtoul(optarg, NULL, 10);
            break;
        case 'd':
            snap_dir = optarg;
            break;
        case 'v':
            verbose = 1;
            break;
        case 't':
            if (n_tables == BEX_PS_TABLES_MAX || parse_table(optarg, &tables[n_tables++]))
                usage();
            break;
        case 'x':
            if (strcmp(optarg, "tcp") == 0)
                transport = BEX_TRANSPORT_TCP;
            else if (strcmp(optarg, "rdma") == 0)
                transport = BEX_TRANSPORT_RDMA;
            else if (strcmp(optarg, "auto") != 0)
                usage();
            break;
        default:
            usage();
        }
    }
    if (!cluster || !shards || optind != argc)
        usage();
    if (n_tables == 0)
        tables[n_tables++] = (bex_ps_table_config){.id = 1, .dim = 16, .optimizer = BEX_PS_SGD};

    /* the signals are taken by sigwait below: blocked before any thread */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    bex_dir *dir;
    char err[256] = "";
    int rc = bex_dir_create(NULL, &dir);
    if (!rc)
        rc = bex_dir_load_file(dir, cluster, err, sizeof err);
    if (rc) {
        if (err[0])
            fprintf(stderr, "bex-ps: %s\n", err);
        else
            fprintf(stderr, "bex-ps: %s: %s\n", cluster, bex_strerror(rc));
        return 1;
    }
    uint32_t n_shards = 0;
    while (n_shards < 4096 && bex_dir_replicas(dir, service, n_shards, NULL, 0) > 0)
        n_shards++;
    if (n_shards == 0) {
        fprintf(stderr, "bex-ps: %s: no service \"%s\"\n", cluster, service);
        return 1;
    }
    static struct served sv[MAX_SERVED];
    size_t n_sv = 0;
    for (const char *p = shards; *p;) {
        if (strncmp(p, "all", 3) == 0) {
            for (uint32_t i = 0; i < n_shards && n_sv < MAX_SERVED; i++)
                sv[n_sv++].shard = i;
            break;
        }
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (end == p || v >= n_shards || n_sv == MAX_SERVED) {
            fprintf(stderr, "bex-ps: --shard %s: the cluster has shards 0..%u\n", shards,
                    n_shards - 1);
            return 1;
        }
        sv[n_sv++].shard = (uint32_t)v;
        p = *end == ',' ? end + 1 : end;
    }
    bex_dir_replica self[MAX_SERVED];
    for (size_t i = 0; i < n_sv; i++) {
        bex_dir_replica reps[64];
        size_t nr = bex_dir_replicas(dir, service, sv[i].shard, reps, 64);
        if (replica >= nr || replica >= 64) {
            fprintf(stderr, "bex-ps: shard %u has no replica %u\n", sv[i].shard, replica);
            return 1;
        }
        self[i] = reps[replica];
        if (self[i].addr.sin_addr.s_addr != self[0].addr.sin_addr.s_addr) {
            fprintf(stderr, "bex-ps: the shards served must share an IP address\n");
            return 1;
        }
    }
    bex_dir_destroy(dir);

    bex_ctx_config cc = {.local_addr = self[0].addr.sin_addr,
                         .transport = self[0].transport ? self[0].transport : transport,
                         .log_level = verbose ? BEX_LOG_INFO : 0};
    bex_ctx *ctx;
    if ((rc = bex_ctx_create(&cc, &ctx))) {
        fprintf(stderr, "bex-ps: context: %s\n", bex_strerror(rc));
        return 1;
    }
    int status = 0;
    size_t up = 0;
    for (; up < n_sv; up++) {
        struct served *s = &sv[up];
        if (snap_dir)
            snprintf(s->snap, sizeof s->snap, "%s/%s-shard%u-replica%u.snap", snap_dir, service,
                     s->shard, replica);
        bex_ps_shard_config pc = {.shard = s->shard,
                                  .n_shards = n_shards,
                                  .tables = tables,
                                  .n_tables = n_tables,
                                  .snapshot_path = snap_dir ? s->snap : NULL};
        char a[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &self[up].addr.sin_addr, a, sizeof a);
        if ((rc = bex_ps_shard_create(&pc, &s->ps)) == 0) {
            if ((rc = bex_rpc_server_create(ctx, NULL, &s->srv)) == 0 &&
                ((rc = bex_ps_shard_register(s->ps, s->srv, ctx)) ||
                 (rc = bex_rpc_server_listen(s->srv, &self[up].addr)))) {
                bex_rpc_server_destroy(s->srv);
                s->srv = NULL;
            }
            if (rc)
                bex_ps_shard_destroy(s->ps);
        }
        if (rc) {
            fprintf(stderr, "bex-ps: shard %u at %s:%u: %s\n", s->shard, a,
                    ntohs(self[up].addr.sin_port), bex_strerror(rc));
            status = 1;
            break;
        }
        printf("bex-ps: shard %u of %u serving at %s:%u\n", s->shard, n_shards, a,
               ntohs(self[up].addr.sin_port));
    }
    if (status == 0) {
        printf("bex-ps: ready\n");
        fflush(stdout);
        for (;;) {
            int sig = 0;
            sigwait(&sigs, &sig);
            if (sig != SIGUSR1)
                break;
            snapshot_all(sv, n_sv, snap_dir);
        }
    }
    /* servers first: no Push is applied after the snapshot */
    for (size_t i = 0; i < up; i++)
        bex_rpc_server_destroy(sv[i].srv);
    if (status == 0)
        snapshot_all(sv, n_sv, snap_dir);
    for (size_t i = 0; i < up; i++)
        bex_ps_shard_destroy(sv[i].ps);
    if ((rc = bex_ctx_destroy(ctx))) {
        fprintf(stderr, "bex-ps: context teardown: %s\n", bex_strerror(rc));
        status = 1;
    }
    if (status == 0)
        printf("bex-ps: stopped\n");
    return status;
}
