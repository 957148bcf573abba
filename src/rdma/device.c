/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rdma/internal.h"
#include "rdma/rdma.h"

int bex__rdma_gid_query_mode;

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
 * when the extended query is missing (kernels before 5.9). */
static int sysfs_gid_is_v2(const char *dev, uint8_t port, int index)
{
    char path[256], text[32] = "";
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/%u/gid_attrs/types/%d", dev, port,
             index);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return 0;
    text[n] = '\0';
    return strncmp(text, "RoCE v2", 7) == 0;
}

/* A match found so far: remember whether its port was ACTIVE, since a
 * matching but inactive port should lose to an active one elsewhere. */
struct match {
    int found;
    int active;
    struct bex__rdma_path path;
};

static void consider(struct match *m, const char *dev, uint8_t port, uint32_t index,
                     const union ibv_gid *gid, int active)
{
    /* sgid_index is 8 bits in struct ibv_global_route. */
    if (index > 255)
        return;
    if (m->found && (m->active || !active))
        return;
    m->found = 1;
    m->active = active;
    memset(&m->path, 0, sizeof m->path);
    snprintf(m->path.dev_name, sizeof m->path.dev_name, "%s", dev);
    m->path.port = port;
    m->path.gid_index = (uint8_t)index;
    m->path.gid = *gid;
}

/* A GID table entry: chosen when it is the RoCE v2 GID of the address
 * on an Ethernet port (RoCE v1 GIDs and InfiniBand ports never are). */
static void row_consider(struct match *m, const struct bex__rdma_gid_row *r,
                         const union ibv_gid *want)
{
    if (r->gid_type != IBV_GID_TYPE_ROCE_V2 || r->link_layer != IBV_LINK_LAYER_ETHERNET ||
        memcmp(&r->gid, want, 16) != 0)
        return;
    consider(m, r->dev, r->port, r->index, &r->gid, r->active);
}

int bex__rdma_choose(const struct bex__rdma_gid_row *rows, size_t n, const bex_addr *addr,
                     struct bex__rdma_path *out)
{
    union ibv_gid want;
    if (bex__rdma_gid_from_addr(addr, &want))
        return -EAFNOSUPPORT;
    struct match m = {0};
    for (size_t i = 0; i < n; i++)
        row_consider(&m, &rows[i], &want);
    if (!m.found)
        return -ENODEV;
    if (!m.active)
        return -ENETDOWN;
    *out = m.path;
    return 0;
}

/* One GID at a time: for kernels or providers without the table query. */
static void scan_port_slowly(struct ibv_context *ctx, const char *dev, uint8_t port,
                             const struct ibv_port_attr *pa, const union ibv_gid *want,
                             struct match *m)
{
    int active = pa->state == IBV_PORT_ACTIVE;
    for (int i = 0; i < pa->gid_tbl_len && i <= 255; i++) {
        struct ibv_gid_entry e;
        if (bex__rdma_gid_query_mode < 2 && ibv_query_gid_ex(ctx, port, (uint32_t)i, &e, 0) == 0) {
            if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && memcmp(&e.gid, want, 16) == 0)
                consider(m, dev, port, (uint32_t)i, &e.gid, active);
            continue;
        }
        union ibv_gid g;
        if (ibv_query_gid(ctx, port, i, &g) != 0)
            continue;
        if (memcmp(&g, want, 16) == 0 && sysfs_gid_is_v2(dev, port, i))
            consider(m, dev, port, (uint32_t)i, &g, active);
    }
}

static int scan_device(struct ibv_device *d, const union ibv_gid *want, struct match *m)
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
                                            .gid = e->gid};
            row_consider(m, &row, want);
        }
    } else {
        for (uint8_t p = 1; p <= da.phys_port_cnt && p != 0; p++)
            if (pa[p - 1].link_layer == IBV_LINK_LAYER_ETHERNET)
                scan_port_slowly(ctx, name, p, &pa[p - 1], want, m);
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

    struct match m = {0};
    for (int i = 0; i < num && !(m.found && m.active); i++) {
        /* A device that cannot be opened or queried is not ours to choose;
         * another may still match. */
        (void)scan_device(list[i], &want, &m);
    }
    ibv_free_device_list(list);

    if (!m.found)
        return -ENODEV;
    if (!m.active)
        return -ENETDOWN;
    *out = m.path;
    return 0;
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
