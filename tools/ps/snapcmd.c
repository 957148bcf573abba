/* SPDX-License-Identifier: Apache-2.0 */
/* bex-ps snapshot: a consistent cut of every shard of a cluster file's
 * service (bex_ps_snapshot_all), its id printed for --restore-cut; and
 * bex-ps --join's call (docs/configuration.md, "bex-ps"). */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bex/dir.h"
#include "bex/ps.h"
#include "bex/sock.h"
#include "snapcmd.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

/* The local address that routes to the first shard's primary (a UDP
 * socket's connect sends nothing): the context's. */
static int local_for(bex_dir *dir, const char *svc, bex_addr *out, uint32_t *transport)
{
    bex_dir_replica rep;
    if (bex_dir_replicas(dir, svc, 0, &rep, 1) == 0)
        return -EHOSTUNREACH;
    *transport = rep.transport ? rep.transport : BEX_TRANSPORT_AUTO;
    int fd = socket(rep.addr.sa.sa_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    bex_addr me = {0};
    socklen_t len = sizeof me;
    int rc = fd < 0 || connect(fd, &rep.addr.sa, bex_addr_len(&rep.addr)) ||
                     getsockname(fd, &me.sa, &len)
                 ? -errno
                 : 0;
    if (fd >= 0)
        close(fd);
    if (!rc)
        *out = me;
    return rc;
}

static int snap_usage(void)
{
    fprintf(stderr, "usage: bex-ps snapshot --cluster FILE [--service NAME] [--full] "
                    "[--timeout-ms MS]\n");
    return 2;
}

struct snap_opts {
    const char *cluster, *service;
    unsigned long timeout_ms;
    int full;
};

static int snap_parse(int argc, char **argv, struct snap_opts *o)
{
    static const struct option lo[] = {{"cluster", required_argument, 0, 'c'},
                                       {"service", required_argument, 0, 's'},
                                       {"full", no_argument, 0, 'f'},
                                       {"timeout-ms", required_argument, 0, 't'},
                                       {0, 0, 0, 0}};
    *o = (struct snap_opts){.service = "ps", .timeout_ms = 10000};
    optind = 1;
    for (int c; (c = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
        char *end;
        switch (c) {
        case 'c':
            o->cluster = optarg;
            break;
        case 's':
            o->service = optarg;
            break;
        case 'f':
            o->full = 1;
            break;
        case 't':
            o->timeout_ms = strtoul(optarg, &end, 10);
            if (*end || !o->timeout_ms || o->timeout_ms > 3600000)
                return -1;
            break;
        default:
            return -1;
        }
    }
    return optind != argc || !o->cluster ? -1 : 0;
}

int bex_ps_tool_snapshot(int argc, char **argv)
{
    struct snap_opts o;
    if (snap_parse(argc, argv, &o))
        return snap_usage();
    char err[256] = "";
    bex_dir *dir = NULL;
    bex_ctx *ctx = NULL;
    int rc = bex_dir_create(NULL, &dir);
    if (!rc && (rc = bex_dir_load_file(dir, o.cluster, err, sizeof err)))
        fprintf(stderr, "bex-ps snapshot: %s\n", err[0] ? err : bex_strerror(rc));
    bex_ctx_config cc = {.transport = BEX_TRANSPORT_AUTO};
    if (!rc && (rc = local_for(dir, o.service, &cc.local_addr, &cc.transport)))
        fprintf(stderr, "bex-ps snapshot: no route to shard 0: %s\n", bex_strerror(rc));
    if (!rc && (rc = bex_ctx_create(&cc, &ctx)))
        fprintf(stderr, "bex-ps snapshot: context: %s\n", bex_strerror(rc));
    bex_ps_snapshot_result r;
    if (!rc) {
        bex_ps_snapshot_config sc = {.dir = dir,
                                     .service = o.service,
                                     .flags = o.full ? BEX_PS_SNAPSHOT_FULL : 0,
                                     .timeout_ms = (uint32_t)o.timeout_ms};
        if ((rc = bex_ps_snapshot_all(ctx, &sc, &r)))
            fprintf(stderr, "bex-ps snapshot: %s (no cut: restore an earlier one)\n",
                    bex_strerror(rc));
        else
            printf("cut %llu: %u shards (%u full), %llu rows, %llu Pushes held, pause %.3f ms\n",
                   (unsigned long long)r.cut_id, r.shards, r.full, (unsigned long long)r.rows,
                   (unsigned long long)r.held, (double)r.pause_ns_max / 1e6);
    }
    if (ctx)
        bex_ctx_destroy(ctx);
    bex_dir_destroy(dir);
    return rc ? 1 : 0;
}

int bex_ps_tool_join(bex_ps_shard *s, bex_ctx *ctx, const bex_rpc_endpoint *primary,
                     const bex_dir_replica *self, uint32_t timeout_ms)
{
    bex_ps_join_config jc = {.primary = *primary,
                             .self = {.addr = self->addr, .transport = self->transport},
                             .timeout_ms = timeout_ms};
    int rc = bex_ps_shard_join(s, ctx, &jc);
    if (rc)
        fprintf(stderr, "bex-ps: join: %s\n", bex_strerror(rc));
    return rc;
}
