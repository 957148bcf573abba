/* SPDX-License-Identifier: Apache-2.0 */
/* Why no RDMA device serves an address: the text of the WARN a context of
 * transport auto logs when it falls back to TCP, and of bex-info. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rdma/rdma.h"

struct why {
    char *buf;
    size_t cap, n;
};

__attribute__((format(printf, 2, 3))) static void say(struct why *w, const char *fmt, ...)
{
    if (w->n >= w->cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(w->buf + w->n, w->cap - w->n, fmt, ap);
    va_end(ap);
    if (k > 0)
        w->n += (size_t)k;
}

/* The type of the GID equal to want on port p, or -1 when none is. */
static int gid_type_of(struct ibv_context *ctx, uint8_t p, int len, const union ibv_gid *want)
{
    for (int i = 0; i < len && i <= 255; i++) {
        struct ibv_gid_entry e;
        if (ibv_query_gid_ex(ctx, p, (uint32_t)i, &e, 0) == 0) {
            if (memcmp(&e.gid, want, 16) == 0)
                return (int)e.gid_type;
            continue;
        }
        union ibv_gid g;
        if (ibv_query_gid(ctx, p, i, &g) == 0 && memcmp(&g, want, 16) == 0)
            return IBV_GID_TYPE_ROCE_V2; /* no type known: assume the usual */
    }
    return -1;
}

static void port_why(struct why *w, struct ibv_context *ctx, const char *dev, uint8_t p,
                     const union ibv_gid *want, const char *ip)
{
    struct ibv_port_attr pa;
    if (ibv_query_port(ctx, p, &pa)) {
        say(w, "; %s port %u: cannot be queried", dev, p);
        return;
    }
    if (pa.link_layer != IBV_LINK_LAYER_ETHERNET) {
        say(w, "; %s port %u: InfiniBand, LID %u, %s (%s must be an address of its IPoIB netdev)",
            dev, p, pa.lid, ibv_port_state_str(pa.state), ip);
        return;
    }
    int t = gid_type_of(ctx, p, pa.gid_tbl_len, want);
    if (t < 0)
        say(w, "; %s port %u: no GID for %s", dev, p, ip);
    else if (t != IBV_GID_TYPE_ROCE_V2 && t != IBV_GID_TYPE_ROCE_V1)
        say(w, "; %s port %u: %s only as a GID of type %d (RoCE v1 or v2 needed)", dev, p, ip, t);
    else if (pa.state != IBV_PORT_ACTIVE)
        say(w, "; %s port %u: has %s but is %s, not ACTIVE", dev, p, ip,
            ibv_port_state_str(pa.state));
    else if (pa.active_mtu == 0)
        say(w, "; %s port %u: has %s but no active MTU", dev, p, ip);
    else
        say(w, "; %s port %u: has %s (RoCE v%d, ACTIVE)", dev, p, ip,
            t == IBV_GID_TYPE_ROCE_V1 ? 1 : 2);
}

void bex__rdma_why_none(struct in_addr addr, int err, char *buf, size_t cap)
{
    bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_addr = addr}};
    bex__rdma_why_none_addr(&a, err, buf, cap);
}

void bex__rdma_why_none_addr(const bex_addr *addr, int err, char *buf, size_t cap)
{
    struct why w = {buf, cap, 0};
    if (cap)
        buf[0] = 0;
    char ip[BEX_ADDR_STRLEN];
    bex_addr_format(addr, false, ip, sizeof ip);
    say(&w, "no usable RDMA device for %s", ip);
    if (err != -ENODEV && err != -ENETDOWN) /* else what follows says it */
        say(&w, " (%s)", bex_strerror(err));
    int num = 0;
    struct ibv_device **list = ibv_get_device_list(&num);
    if (!list || num == 0) {
        say(&w, ": this host has no RDMA device (no driver loaded, or no NIC; "
                "`rdma link` lists them)");
        if (list)
            ibv_free_device_list(list);
        return;
    }
    union ibv_gid want = {0};
    (void)bex__rdma_gid_from_addr(addr, &want);
    for (int i = 0; i < num; i++) {
        const char *dev = ibv_get_device_name(list[i]);
        struct ibv_context *ctx = ibv_open_device(list[i]);
        struct ibv_device_attr da;
        if (!ctx || ibv_query_device(ctx, &da)) {
            say(&w, "; %s: cannot be opened (%s)", dev, strerror(errno));
            if (ctx)
                ibv_close_device(ctx);
            continue;
        }
        for (uint8_t p = 1; p <= da.phys_port_cnt && p != 0; p++)
            port_why(&w, ctx, dev, p, &want, ip);
        ibv_close_device(ctx);
    }
    ibv_free_device_list(list);
}
