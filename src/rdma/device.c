/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if_arp.h>
#include <netpacket/packet.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rdma/internal.h"
#include "rdma/rdma.h"

int bex__rdma_gid_query_mode;

/* The hello carries the route as it is. */
_Static_assert((int)BEX__HELLO_ROUTE_ROCE_V2 == (int)BEX__RDMA_ROUTE_ROCE_V2 &&
                   (int)BEX__HELLO_ROUTE_ROCE_V1 == (int)BEX__RDMA_ROUTE_ROCE_V1 &&
                   (int)BEX__HELLO_ROUTE_IB == (int)BEX__RDMA_ROUTE_IB,
               "hello routes are the device choice's");

void bex__rdma_gid_from_ipv4(struct in_addr ip, union ibv_gid *out)
{
    memset(out, 0, sizeof *out);
    out->raw[10] = 0xff;
    out->raw[11] = 0xff;
    memcpy(&out->raw[12], &ip.s_addr, 4); /* s_addr is already network order */
}

int bex__rdma_gid_from_addr(const bex_addr *a, union ibv_gid *out)
{
    if (a->sa.sa_family == AF_INET)
        bex__rdma_gid_from_ipv4(a->in4.sin_addr, out);
    else if (a->sa.sa_family == AF_INET6)
        memcpy(out->raw, &a->in6.sin6_addr, 16); /* RoCE v2 over IPv6: the address itself */
    else
        return -EAFNOSUPPORT;
    return 0;
}

/* The kernel names GID types "IB/RoCE v1" and "RoCE v2" in sysfs; used only
 * when the extended query is missing (kernels before 5.9). -1: unknown. */
static int sysfs_gid_type(const char *dev, uint8_t port, int index)
{
    char path[256], text[32] = "";
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/%u/gid_attrs/types/%d", dev, port,
             index);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return -1;
    text[n] = '\0';
    if (strncmp(text, "RoCE v2", 7) == 0)
        return IBV_GID_TYPE_ROCE_V2;
    return strncmp(text, "IB/RoCE v1", 10) == 0 ? IBV_GID_TYPE_ROCE_V1 : -1;
}

/* A match found so far: an ACTIVE port's beats another's, then the better
 * route (RoCE v2, v1, InfiniBand: the enum's order), then the first. */
struct match {
    int found;
    int active;
    struct bex__rdma_path path;
};

static bool ib_link(uint8_t link_layer)
{
    return link_layer == IBV_LINK_LAYER_INFINIBAND || link_layer == IBV_LINK_LAYER_UNSPECIFIED;
}

/* The route by which a row serves the address (RoCE GID want, or the
 * IPoIB port GID ipoib, NULL when the address is not on IPoIB), or -1. */
static int row_route(const struct bex__rdma_gid_row *r, const union ibv_gid *want,
                     const union ibv_gid *ipoib)
{
    if (ib_link(r->link_layer))
        return ipoib && r->gid_type == IBV_GID_TYPE_IB && !memcmp(&r->gid, ipoib, 16)
                   ? BEX__RDMA_ROUTE_IB
                   : -1;
    if (r->link_layer != IBV_LINK_LAYER_ETHERNET || memcmp(&r->gid, want, 16) != 0)
        return -1;
    if (r->gid_type == IBV_GID_TYPE_ROCE_V2)
        return BEX__RDMA_ROUTE_ROCE_V2;
    return r->gid_type == IBV_GID_TYPE_ROCE_V1 ? BEX__RDMA_ROUTE_ROCE_V1 : -1;
}

/* A GID table entry: chosen when it serves the address (row_route) and
 * beats what was found before. An InfiniBand port without a unicast LID
 * (no subnet manager yet) counts as not ACTIVE. */
static void row_consider(struct match *m, const struct bex__rdma_gid_row *r,
                         const union ibv_gid *want, const union ibv_gid *ipoib)
{
    int route = row_route(r, want, ipoib);
    /* sgid_index is 8 bits in struct ibv_global_route. */
    if (route < 0 || r->index > 255)
        return;
    int active = r->active && (route != BEX__RDMA_ROUTE_IB || (r->lid >= 1 && r->lid <= 0xbfff));
    if (m->found && (m->active > active || (m->active == active && m->path.route <= route)))
        return;
    m->found = 1;
    m->active = active;
    memset(&m->path, 0, sizeof m->path);
    snprintf(m->path.dev_name, sizeof m->path.dev_name, "%s", r->dev);
    m->path.port = r->port;
    m->path.gid_index = (uint8_t)r->index;
    m->path.gid = r->gid;
    m->path.route = (uint8_t)route;
    m->path.lid = route == BEX__RDMA_ROUTE_IB ? r->lid : 0;
}

static int match_result(const struct match *m, struct bex__rdma_path *out)
{
    if (!m->found)
        return -ENODEV;
    if (!m->active)
        return -ENETDOWN;
    *out = m->path;
    return 0;
}

int bex__rdma_choose(const struct bex__rdma_gid_row *rows, size_t n, const bex_addr *addr,
                     const union ibv_gid *ipoib, struct bex__rdma_path *out)
{
    union ibv_gid want;
    if (bex__rdma_gid_from_addr(addr, &want))
        return -EAFNOSUPPORT;
    struct match m = {0};
    for (size_t i = 0; i < n; i++)
        row_consider(&m, &rows[i], &want, ipoib);
    return match_result(&m, out);
}

/* One GID at a time: for kernels or providers without the table query. */
static void scan_port_slowly(struct ibv_context *ctx, const char *dev, uint8_t port,
                             const struct ibv_port_attr *pa, const union ibv_gid *want,
                             const union ibv_gid *ipoib, struct match *m)
{
    struct bex__rdma_gid_row row = {.dev = dev,
                                    .port = port,
                                    .link_layer = pa->link_layer,
                                    .active = pa->state == IBV_PORT_ACTIVE,
                                    .lid = pa->lid};
    for (int i = 0; i < pa->gid_tbl_len && i <= 255; i++) {
        struct ibv_gid_entry e;
        row.index = (uint32_t)i;
        if (bex__rdma_gid_query_mode < 2 && ibv_query_gid_ex(ctx, port, (uint32_t)i, &e, 0) == 0) {
            row.gid_type = e.gid_type;
            row.gid = e.gid;
            row_consider(m, &row, want, ipoib);
            continue;
        }
        if (ibv_query_gid(ctx, port, i, &row.gid) != 0)
            continue;
        int type = ib_link(pa->link_layer) ? IBV_GID_TYPE_IB : sysfs_gid_type(dev, port, i);
        if (type < 0)
            continue;
        row.gid_type = (uint32_t)type;
        row_consider(m, &row, want, ipoib);
    }
}

static int scan_device(struct ibv_device *d, const union ibv_gid *want, const union ibv_gid *ipoib,
                       struct match *m)
{
    const char *name = ibv_get_device_name(d);
    struct ibv_context *ctx = ibv_open_device(d);
    if (!ctx)
        return bex__rdma_errno();

    int rc;
    struct ibv_device_attr da;
    rc = bex__rdma_err(ibv_query_device(ctx, &da));
    if (rc < 0)
        goto out_close;

    struct ibv_port_attr pa[256];
    size_t total = 0;
    for (uint8_t p = 1; p <= da.phys_port_cnt && p != 0; p++) {
        rc = bex__rdma_err(ibv_query_port(ctx, p, &pa[p - 1]));
        if (rc < 0)
            goto out_close;
        if (pa[p - 1].gid_tbl_len > 0)
            total += (size_t)pa[p - 1].gid_tbl_len;
    }

    /* The table query returns only valid entries, with their types, in one
     * system call; fall back when the kernel predates it. */
    struct ibv_gid_entry *tab = total ? calloc(total, sizeof *tab) : NULL;
    ssize_t n = tab && bex__rdma_gid_query_mode == 0 ? ibv_query_gid_table(ctx, tab, total, 0) : -1;
    if (n >= 0) {
        for (ssize_t i = 0; i < n; i++) {
            const struct ibv_gid_entry *e = &tab[i];
            if (e->port_num < 1 || e->port_num > da.phys_port_cnt)
                continue;
            const struct ibv_port_attr *a = &pa[e->port_num - 1];
            struct bex__rdma_gid_row row = {.dev = name,
                                            .port = (uint8_t)e->port_num,
                                            .index = e->gid_index,
                                            .gid_type = e->gid_type,
                                            .link_layer = a->link_layer,
                                            .active = a->state == IBV_PORT_ACTIVE,
                                            .lid = a->lid,
                                            .gid = e->gid};
            row_consider(m, &row, want, ipoib);
        }
    } else {
        for (uint8_t p = 1; p <= da.phys_port_cnt && p != 0; p++)
            scan_port_slowly(ctx, name, p, &pa[p - 1], want, ipoib, m);
    }
    free(tab);
    rc = 0;
out_close:
    ibv_close_device(ctx);
    return rc;
}

int bex__rdma_find_ipv4(struct in_addr ip, struct bex__rdma_path *out)
{
    bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_addr = ip}};
    return bex__rdma_find_addr(&a, out);
}

int bex__rdma_find_addr(const bex_addr *addr, struct bex__rdma_path *out)
{
    union ibv_gid want;
    if (bex__rdma_gid_from_addr(addr, &want))
        return -EAFNOSUPPORT;

    int num = 0;
    struct ibv_device **list = ibv_get_device_list(&num);
    if (!list) /* ENOSYS: no RDMA support in the kernel at all */
        return errno == ENOSYS ? -ENODEV : bex__rdma_errno();

    /* On InfiniBand the address is an IPoIB netdev's: its hardware
     * address names the port GID. */
    union ibv_gid ipoib;
    struct ifaddrs *ifs = NULL;
    bool on_ipoib = getifaddrs(&ifs) == 0 && bex__rdma_ipoib_gid(ifs, addr, &ipoib) == 0;
    if (ifs)
        freeifaddrs(ifs);

    struct match m = {0};
    for (int i = 0; i < num; i++) {
        /* A device that cannot be opened or queried is not ours to choose;
         * another may still match. */
        (void)scan_device(list[i], &want, on_ipoib ? &ipoib : NULL, &m);
    }
    ibv_free_device_list(list);
    return match_result(&m, out);
}

/* Where an IPoIB netdev's 20-byte hardware address keeps the port GID:
 * after 4 bytes of flags and QPN (RFC 4391). */
#define IPOIB_HWADDR_LEN 20
#define IPOIB_GID_OFF    4

static bool ifa_has_addr(const struct ifaddrs *ifa, const bex_addr *addr)
{
    const struct sockaddr *sa = ifa->ifa_addr;
    if (!sa || sa->sa_family != addr->sa.sa_family)
        return false;
    if (sa->sa_family == AF_INET)
        return ((const struct sockaddr_in *)(const void *)sa)->sin_addr.s_addr ==
               addr->in4.sin_addr.s_addr;
    if (sa->sa_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr,
                       &addr->in6.sin6_addr, 16);
    return false;
}

static int ipoib_link_gid(const struct ifaddrs *ifs, const char *name, union ibv_gid *out)
{
    for (const struct ifaddrs *ifa = ifs; ifa; ifa = ifa->ifa_next) {
        const struct sockaddr *sa = ifa->ifa_addr;
        if (!sa || sa->sa_family != AF_PACKET || !ifa->ifa_name || strcmp(ifa->ifa_name, name))
            continue;
        const struct sockaddr_ll *ll = (const struct sockaddr_ll *)(const void *)sa;
        if (ll->sll_hatype != ARPHRD_INFINIBAND || ll->sll_halen != IPOIB_HWADDR_LEN)
            return -ENODEV;
        /* glibc's link entries hold the whole address past sll_addr[8] */
        const uint8_t *hw = (const uint8_t *)sa + offsetof(struct sockaddr_ll, sll_addr);
        memcpy(out->raw, hw + IPOIB_GID_OFF, 16);
        return 0;
    }
    return -ENODEV;
}

int bex__rdma_ipoib_gid(const struct ifaddrs *ifs, const bex_addr *addr, union ibv_gid *out)
{
    for (const struct ifaddrs *ifa = ifs; ifa; ifa = ifa->ifa_next)
        if (ifa->ifa_name && ifa_has_addr(ifa, addr))
            return ipoib_link_gid(ifs, ifa->ifa_name, out);
    return -ENODEV;
}

/* ---- the process-wide device table ----------------------------------- */

/* A short list: a host has a handful of devices and the table is touched at
 * connection setup only, so a mutex and a linear scan are plenty. */
static pthread_mutex_t devs_lock = PTHREAD_MUTEX_INITIALIZER;
static struct bex__list devs = {&devs, &devs};

static int query_port(struct bex__rdma_dev *dev, uint8_t port, struct bex__rdma_port *out)
{
    struct ibv_port_attr pa;
    int rc = bex__rdma_err(ibv_query_port(dev->ctx, port, &pa));
    if (rc < 0)
        return rc;
    out->state = pa.state;
    out->active_mtu = pa.active_mtu;
    out->max_mtu = pa.max_mtu;
    out->lid = pa.lid;
    out->link_layer = pa.link_layer;
    out->gid_tbl_len = pa.gid_tbl_len;
    return 0;
}

static int dev_create(struct ibv_device *d, struct bex__rdma_dev **out)
{
    int rc;
    struct bex__rdma_dev *dev = calloc(1, sizeof *dev);
    if (!dev)
        return -ENOMEM;
    snprintf(dev->name, sizeof dev->name, "%s", ibv_get_device_name(d));

    dev->ctx = ibv_open_device(d);
    if (!dev->ctx) {
        rc = bex__rdma_errno();
        goto err_free;
    }
    rc = bex__rdma_err(ibv_query_device(dev->ctx, &dev->attr));
    if (rc < 0)
        goto err_close;
    dev->nports = dev->attr.phys_port_cnt;
    dev->ports = calloc(dev->nports ? dev->nports : 1, sizeof *dev->ports);
    if (!dev->ports) {
        rc = -ENOMEM;
        goto err_close;
    }
    for (uint8_t p = 1; p <= dev->nports && p != 0; p++) {
        rc = query_port(dev, p, &dev->ports[p - 1]);
        if (rc < 0)
            goto err_free_ports;
    }
    dev->pd = ibv_alloc_pd(dev->ctx);
    if (!dev->pd) {
        rc = bex__rdma_errno();
        goto err_free_ports;
    }
    dev->refs = 1;
    *out = dev;
    return 0;

err_free_ports:
    free(dev->ports);
err_close:
    ibv_close_device(dev->ctx);
err_free:
    free(dev);
    return rc;
}

int bex__rdma_dev_open(const char *name, struct bex__rdma_dev **out)
{
    int rc = -ENODEV;
    pthread_mutex_lock(&devs_lock);
    struct bex__list *pos;
    bex__list_foreach(pos, &devs)
    {
        struct bex__rdma_dev *d = bex__list_entry(pos, struct bex__rdma_dev, link);
        if (strcmp(d->name, name) == 0) {
            d->refs++;
            *out = d;
            rc = 0;
            goto out_unlock;
        }
    }

    int num = 0;
    struct ibv_device **list = ibv_get_device_list(&num);
    if (!list) {
        rc = errno == ENOSYS ? -ENODEV : bex__rdma_errno();
        goto out_unlock;
    }
    for (int i = 0; i < num; i++) {
        if (strcmp(ibv_get_device_name(list[i]), name) != 0)
            continue;
        struct bex__rdma_dev *dev;
        rc = dev_create(list[i], &dev);
        if (rc == 0) {
            bex__list_push_head(&devs, &dev->link);
            *out = dev;
        }
        break;
    }
    ibv_free_device_list(list);
out_unlock:
    pthread_mutex_unlock(&devs_lock);
    return rc;
}

int bex__rdma_dev_open_ipv4(struct in_addr ip, struct bex__rdma_dev **dev,
                            struct bex__rdma_path *path)
{
    bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_addr = ip}};
    return bex__rdma_dev_open_addr(&a, dev, path);
}

int bex__rdma_dev_open_addr(const bex_addr *addr, struct bex__rdma_dev **dev,
                            struct bex__rdma_path *path)
{
    struct bex__rdma_path p;
    int rc = bex__rdma_find_addr(addr, &p);
    if (rc < 0)
        return rc;
    struct bex__rdma_dev *d;
    rc = bex__rdma_dev_open(p.dev_name, &d);
    if (rc < 0)
        return rc;
    /* Fresh, not the copy from the first open: the MTU follows the netdev. */
    struct bex__rdma_port port;
    rc = bex__rdma_port_query(d, p.port, &port);
    if (rc < 0)
        goto err_close;
    p.active_mtu = port.active_mtu;
    if (p.route == BEX__RDMA_ROUTE_IB)
        p.lid = port.lid; /* the subnet manager may have moved it */
    *dev = d;
    *path = p;
    return 0;

err_close:
    bex__rdma_dev_close(d);
    return rc;
}

int bex__rdma_dev_close(struct bex__rdma_dev *dev)
{
    if (!dev)
        return 0;
    pthread_mutex_lock(&devs_lock);
    if (--dev->refs > 0) {
        pthread_mutex_unlock(&devs_lock);
        return 0;
    }
    int rc = bex__rdma_err(ibv_dealloc_pd(dev->pd));
    if (rc < 0) {
        /* Objects still hang off the PD: keep everything usable so the
         * caller can destroy them and close again. */
        dev->refs++;
        pthread_mutex_unlock(&devs_lock);
        return rc;
    }
    bex__list_remove(&dev->link);
    pthread_mutex_unlock(&devs_lock);

    ibv_close_device(dev->ctx);
    free(dev->ports);
    free(dev);
    return 0;
}

int bex__rdma_port_query(struct bex__rdma_dev *dev, uint8_t port, struct bex__rdma_port *out)
{
    if (port < 1 || port > dev->nports)
        return -EINVAL;
    /* dev->ports stays as first queried: other threads read it unlocked. */
    return query_port(dev, port, out);
}

int bex__rdma_async_nonblock(struct bex__rdma_dev *dev)
{
    int fd = dev->ctx->async_fd, fl = fcntl(fd, F_GETFL);
    if (fl < 0 || (!(fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0))
        return -errno;
    return 0;
}

int bex__rdma_async_next(struct bex__rdma_dev *dev, struct ibv_async_event *ev)
{
    if (ibv_get_async_event(dev->ctx, ev) == 0)
        return 1;
    return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
}

void bex__rdma_peer_of_hello(const struct bex__hello *h, struct bex__rdma_peer *out)
{
    *out = (struct bex__rdma_peer){.qpn = h->qpn,
                                   .psn = h->psn,
                                   .active_mtu = (enum ibv_mtu)h->mtu,
                                   .rd_atomic = h->rd_atomic,
                                   .lid = h->lid};
    memcpy(out->gid.raw, h->gid, 16);
}
