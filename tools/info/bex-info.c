/* SPDX-License-Identifier: Apache-2.0 */
/* bex-info: what bex would use on this host for a local address (the
 * device, port, link layer, GID index and type, MTU, remote-access mode,
 * SRQ and thread-domain support, the device's limits), or why it would use
 * TCP; and, given a peer running `bex-info --listen`, a check of the path
 * end to end (connect, round trips, a bandwidth burst, the transport
 * chosen). The pre-deployment check, in one command; --json for scripts.
 * Exit status: 0 RDMA usable (and the check passed), 1 the check failed,
 * 2 a bad command line or BEX_* variable, 3 no usable RDMA device (bex
 * would use TCP). */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "info.h"
#include "sock/internal.h"

struct opts {
    bex_addr local, peer, listen;
    bool have_local, have_peer, have_listen, json;
    uint32_t transport;
    uint64_t burst_bytes;
};

/* What the context chose. */
struct report {
    char local[BEX_ADDR_STRLEN];
    bool rdma;
    char why[1024];
    const struct bex__rdma_dev *dev;
    struct bex__rdma_path path;
    struct bex__rdma_port port;
    char gid[INET6_ADDRSTRLEN];
    bool td;
    const char *remote_access;
};

__attribute__((noreturn)) static void usage(int status)
{
    fprintf(status ? stderr : stdout,
            "usage: bex-info --local IP [--json] [--peer IP:PORT [--transport auto|rdma|tcp]\n"
            "                [--burst-mib N]]\n"
            "       bex-info --listen IP:PORT     (answer other hosts' --peer checks)\n"
            "       bex-info --help | --version\n"
            "  --local IP         the address bex would be given (bex_ctx_config.local_addr)\n"
            "  --json             one JSON object instead of text\n"
            "  --peer IP:PORT     check the path to a bex-info --listen there\n"
            "  --transport T      the check's connection: auto (default), rdma or tcp\n"
            "  --burst-mib N      the check's burst, MiB (default 64; 0: none)\n"
            "  --listen IP:PORT   serve checks until SIGINT or SIGTERM\n"
            "  --help             this text\n"
            "  --version          the version\n"
            "exit status: 0 RDMA usable (and the check passed), 1 the check failed,\n"
            "2 a bad command line or BEX_* variable, 3 no usable RDMA device\n"
            "(bex would use TCP)\n");
    exit(status);
}

__attribute__((noreturn)) static void bad(const char *opt, const char *val, const char *what)
{
    fprintf(stderr, "bex-info: %s %s: %s\n", opt, val, what);
    exit(2);
}

/* HOST (port_needed 0), HOST:PORT with PORT 0 allowed (1) or not (2);
 * HOST an IPv4 address, [IPv6] (bare without a port) or a name. */
static void parse_ip_port(const char *opt, const char *s, int port_needed, bex_addr *a)
{
    char why[200];
    const char *end = s[0] == '[' ? strchr(s, ']') : NULL;
    const char *colon = strrchr(end ? end : s, ':');
    bool v6bare = !end && colon && strchr(s, ':') != colon; /* "fd00::1": no port */
    bool has_port = colon && !v6bare;
    if (bex_addr_resolve(s, 0, a, why, sizeof why))
        bad(opt, s, why);
    if ((port_needed && !has_port) || (port_needed == 2 && bex_addr_port(a) == 0) ||
        (!port_needed && has_port))
        bad(opt, s, port_needed ? "not HOST:PORT" : "not an address without a port");
}

static void parse(int argc, char **argv, struct opts *o)
{
    static const struct option lo[] = {{"local", required_argument, 0, 'l'},
                                       {"peer", required_argument, 0, 'p'},
                                       {"listen", required_argument, 0, 'L'},
                                       {"transport", required_argument, 0, 't'},
                                       {"burst-mib", required_argument, 0, 'b'},
                                       {"json", no_argument, 0, 'j'},
                                       {"help", no_argument, 0, 'h'},
                                       {"version", no_argument, 0, 'V'},
                                       {0, 0, 0, 0}};
    *o = (struct opts){.transport = BEX_TRANSPORT_AUTO, .burst_bytes = 64u << 20};
    char *end;
    for (int c; (c = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
        switch (c) {
        case 'l':
            parse_ip_port("--local", optarg, 0, &o->local);
            o->have_local = true;
            break;
        case 'p':
            parse_ip_port("--peer", optarg, 2, &o->peer);
            o->have_peer = true;
            break;
        case 'L':
            parse_ip_port("--listen", optarg, 1, &o->listen);
            o->have_listen = true;
            break;
        case 't':
            if (strcmp(optarg, "auto") && strcmp(optarg, "rdma") && strcmp(optarg, "tcp"))
                bad("--transport", optarg, "not auto, rdma or tcp");
            o->transport = !strcmp(optarg, "rdma")  ? BEX_TRANSPORT_RDMA
                           : !strcmp(optarg, "tcp") ? BEX_TRANSPORT_TCP
                                                    : BEX_TRANSPORT_AUTO;
            break;
        case 'b':
            errno = 0;
            o->burst_bytes = strtoull(optarg, &end, 10) << 20;
            if (!*optarg || *end || errno || o->burst_bytes > (16ull << 30))
                bad("--burst-mib", optarg, "not a number of MiB from 0 to 16384");
            break;
        case 'j':
            o->json = true;
            break;
        case 'h':
            usage(0);
        case 'V':
            printf("bex-info %s\n", bex_version_string());
            exit(0);
        default:
            usage(2);
        }
    }
    if (optind != argc || o->have_local == o->have_listen || (o->have_listen && o->have_peer))
        usage(2);
    char why[256];
    if (bex_env_check(why, sizeof why)) {
        fprintf(stderr, "bex-info: %s\n", why);
        exit(2);
    }
}

static const char *link_layer_name(uint8_t ll)
{
    return ll == IBV_LINK_LAYER_ETHERNET     ? "Ethernet"
           : ll == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand"
                                             : "unspecified";
}

/* The GID's type as the route names it: what the peer must speak too. */
static const char *route_name(uint8_t route)
{
    return route == BEX__RDMA_ROUTE_IB        ? "IB"
           : route == BEX__RDMA_ROUTE_ROCE_V1 ? "RoCE v1"
                                              : "RoCE v2";
}

static const char *port_state_name(enum ibv_port_state st)
{
    switch (st) {
    case IBV_PORT_DOWN:
        return "DOWN";
    case IBV_PORT_INIT:
        return "INIT";
    case IBV_PORT_ARMED:
        return "ARMED";
    case IBV_PORT_ACTIVE:
        return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER:
        return "ACTIVE_DEFER";
    default:
        return "NOP";
    }
}

static void fill_report(bex_ctx *ctx, const struct opts *o, struct report *r)
{
    memset(r, 0, sizeof *r);
    bex_addr_format(&o->local, false, r->local, sizeof r->local);
    r->dev = ctx->dev;
    r->rdma = ctx->dev != NULL;
    if (!r->rdma) {
        int err = bex__rdma_find_addr(&o->local, &r->path);
        bex__rdma_why_none_addr(&o->local, err ? err : -ENETDOWN, r->why, sizeof r->why);
        return;
    }
    r->path = ctx->sh.path;
    bex__rdma_port_query(ctx->dev, r->path.port, &r->port);
    inet_ntop(AF_INET6, r->path.gid.raw, r->gid, sizeof r->gid);
    struct bex__rdma_td *td;
    if (bex__rdma_td_alloc(ctx->dev, &td) == 0) {
        r->td = true;
        bex__rdma_td_free(td);
    }
    r->remote_access =
        bex_ctx_remote_access(ctx) == BEX_REMOTE_ACCESS_WINDOW ? "window" : "landing";
}

/* A JSON string: quotes, backslashes and control characters escaped. */
static void json_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            printf("\\%c", *s);
        else if ((unsigned char)*s < 0x20)
            printf("\\u%04x", *s);
        else
            putchar(*s);
    }
    putchar('"');
}

#define LIMITS(X)                                                                                  \
    X(max_qp)                                                                                      \
    X(max_qp_wr)                                                                                   \
    X(max_sge)                                                                                     \
    X(max_cq) X(max_cqe) X(max_mr) X(max_pd) X(max_srq) X(max_srq_wr) X(max_mw) X(max_qp_rd_atom)

static void print_json(const struct report *r, const struct check_result *c)
{
    printf("{\"version\":\"%s\",\"local\":\"%s\",\"transport\":\"%s\"", bex_version_string(),
           r->local, r->rdma ? "rdma" : "tcp");
    if (!r->rdma) {
        printf(",\"reason\":");
        json_str(r->why);
    } else {
        const struct ibv_device_attr *a = &r->dev->attr;
        printf(",\"device\":\"%s\",\"port\":%u,\"link_layer\":\"%s\",\"port_state\":\"%s\","
               "\"gid_index\":%u,\"gid\":\"%s\",\"gid_type\":\"%s\",\"lid\":%u,\"mtu\":%d,"
               "\"max_mtu\":%d,\"remote_access\":\"%s\",\"srq\":%s,\"thread_domain\":%s,"
               "\"fw_ver\":",
               r->dev->name, r->path.port, link_layer_name(r->port.link_layer),
               port_state_name(r->port.state), r->path.gid_index, r->gid, route_name(r->path.route),
               r->path.lid, bex__rdma_mtu_bytes(r->port.active_mtu),
               bex__rdma_mtu_bytes(r->port.max_mtu), r->remote_access,
               a->max_srq > 0 ? "true" : "false", r->td ? "true" : "false");
        json_str(a->fw_ver);
        printf(",\"limits\":{");
        const char *sep = "";
#define J(f) printf("%s\"%s\":%lld", sep, #f, (long long)a->f), sep = ",";
        LIMITS(J)
#undef J
        printf(",\"max_mr_size\":%llu}", (unsigned long long)a->max_mr_size);
    }
    if (c) {
        printf(",\"check\":{\"ok\":%s,\"transport\":\"%s\",\"round_trips\":%u,"
               "\"rtt_min_us\":%.1f,\"rtt_median_us\":%.1f,\"burst_bytes\":%llu,"
               "\"burst_mib_s\":%.1f",
               c->err ? "false" : "true",
               c->transport == BEX_TRANSPORT_RDMA  ? "rdma"
               : c->transport == BEX_TRANSPORT_TCP ? "tcp"
                                                   : "none",
               c->rtts, c->rtt_us[0], c->rtt_us[1], (unsigned long long)c->burst_bytes,
               c->burst_mib_s);
        if (c->err) {
            printf(",\"failed_step\":\"%s\",\"error\":", c->step);
            json_str(c->text);
        }
        printf("}");
    }
    printf("}\n");
}

static void print_text(const struct report *r, const struct check_result *c)
{
    printf("local address:  %s\n", r->local);
    if (!r->rdma) {
        printf("transport:      tcp\nreason:         %s\n", r->why);
    } else {
        const struct ibv_device_attr *a = &r->dev->attr;
        printf("transport:      rdma\ndevice:         %s (firmware %s)\n", r->dev->name,
               a->fw_ver[0] ? a->fw_ver : "-");
        printf("port:           %u (%s, %s)\n", r->path.port, link_layer_name(r->port.link_layer),
               port_state_name(r->port.state));
        printf("GID:            index %u, %s, %s\n", r->path.gid_index, r->gid,
               route_name(r->path.route));
        if (r->path.route == BEX__RDMA_ROUTE_IB)
            printf("LID:            %u\n", r->path.lid);
        printf("MTU:            %d (port max %d)\n", bex__rdma_mtu_bytes(r->port.active_mtu),
               bex__rdma_mtu_bytes(r->port.max_mtu));
        printf("remote access:  %s\nSRQ:            %s\nthread domain:  %s\nlimits:        ",
               r->remote_access, a->max_srq > 0 ? "yes" : "no", r->td ? "yes" : "no");
#define T(f) printf(" %s %lld", #f, (long long)a->f);
        LIMITS(T)
#undef T
        printf(" max_mr_size %llu\n", (unsigned long long)a->max_mr_size);
    }
    if (!c)
        return;
    if (c->err) {
        printf("check:          FAILED at %s: %s\n", c->step, c->text);
        return;
    }
    printf("check:          ok over %s: round trip min %.1f us, median %.1f us (%u); "
           "burst %.1f MiB/s (%llu bytes)\n",
           c->transport == BEX_TRANSPORT_RDMA ? "rdma" : "tcp", c->rtt_us[0], c->rtt_us[1], c->rtts,
           c->burst_mib_s, (unsigned long long)c->burst_bytes);
}

int main(int argc, char **argv)
{
    struct opts o;
    parse(argc, argv, &o);
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* ERROR only: the fallback's WARN is this program's report */
    bex_ctx_config cc = {.local_addr = o.have_listen ? o.listen : o.local,
                         .transport = BEX_TRANSPORT_AUTO,
                         .log_level = BEX_LOG_ERROR};
    bex_ctx *ctx;
    int rc = bex_ctx_create(&cc, &ctx);
    if (rc) {
        fprintf(stderr, "bex-info: context: %s\n", bex_strerror(rc));
        return 1;
    }
    int status;
    if (o.have_listen) {
        status = info_serve(ctx, &o.listen);
    } else {
        static struct report r;
        struct check_result c;
        fill_report(ctx, &o, &r);
        if (o.have_peer)
            info_check(ctx, &o.peer, o.transport, o.burst_bytes, &c);
        (o.json ? print_json : print_text)(&r, o.have_peer ? &c : NULL);
        status = o.have_peer ? (c.err ? 1 : 0) : (r.rdma ? 0 : 3);
    }
    fflush(stdout);
    if ((rc = bex_ctx_destroy(ctx)))
        fprintf(stderr, "bex-info: context teardown: %s\n", bex_strerror(rc));
    return status;
}
