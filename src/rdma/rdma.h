/* SPDX-License-Identifier: Apache-2.0 */
/* rdma: thin helpers over libibverbs for the modules above (engine, sock, io).
 *
 * What lives here: choosing the device, port and GID that match a local IPv4
 * address (RoCEv2), a per-device handle that owns the one ibv_context and one
 * protection domain of the process for that device, completion queues and
 * channels, RC queue pairs and their state transitions, thread domains, PSNs,
 * and the translation of verbs errors into bex's negative errno values.
 *
 * Errors: every int function returns 0 or a negative errno. verbs reports
 * failure as a positive errno (ibv_modify_qp, ibv_destroy_*) or as NULL with
 * errno set (ibv_create_*, ibv_alloc_*); this module converts at the call
 * site, so nothing above it sees either convention.
 *
 * Threads: the device table (bex__rdma_dev_open/close) is locked and may be
 * used from any thread. Everything else acts on objects the caller owns and
 * follows verbs' own rules (a QP, CQ or channel is used by one thread at a
 * time unless verbs says otherwise).
 *
 * The connection-setup messages (hello) are in wire/hello.h, included below. */
#ifndef BEX_RDMA_RDMA_H
#define BEX_RDMA_RDMA_H

#include <errno.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdint.h>

#include <infiniband/verbs.h>

#include "bex/addr.h"
#include "bex/common.h"
#include "common/fault.h"
#include "common/list.h"
#include "wire/hello.h"

/* ---- error translation ------------------------------------------------- */

/* A verbs return value that is 0 or a positive errno, as a bex return code.
 * Some providers return -1 with errno set instead: that is handled too. */
static inline int bex__rdma_err(int verbs_ret)
{
    if (verbs_ret == 0)
        return 0;
    if (verbs_ret == -1)
        return errno > 0 ? -errno : -EIO;
    return verbs_ret > 0 ? -verbs_ret : verbs_ret;
}

/* After a verbs call returned NULL: errno as a bex return code (never 0). */
static inline int bex__rdma_errno(void)
{
    return errno > 0 ? -errno : -EIO;
}

/* A failed work completion as a negative errno, so the engine can hand every
 * message of a failed QP back with a meaningful code:
 *   WR_FLUSH_ERR -> -ECANCELED (the QP was already in error),
 *   RETR_EXC_ERR -> -ETIMEDOUT (peer unreachable or dead),
 *   RNR_RETRY_EXC_ERR -> -ENOBUFS (peer had no receive posted),
 *   LOC_LEN_ERR / REM_INV_REQ_ERR -> -EMSGSIZE / -EINVAL,
 *   LOC_PROT_ERR / REM_ACCESS_ERR / MW_BIND_ERR -> -EFAULT / -EACCES,
 *   everything else -> -EIO. IBV_WC_SUCCESS -> 0.
 * Use ibv_wc_status_str() for the text in logs. */
int bex__rdma_wc_errno(enum ibv_wc_status status);

/* ---- posting and polling --------------------------------------------- */

/* ibv_post_send, ibv_post_recv and ibv_poll_cq, returning what they return.
 * They exist for the fault points of the test library (common/fault.h): in
 * libbex they are the verbs calls and nothing else. */
static inline int bex__rdma_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr,
                                      struct ibv_send_wr **bad)
{
    int f = BEX__FAULT(BEX__FAULT_POST_SEND);
    if (f) {
        *bad = wr; /* nothing of the chain was posted */
        return f;
    }
    return ibv_post_send(qp, wr, bad);
}

static inline int bex__rdma_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr,
                                      struct ibv_recv_wr **bad)
{
    int f = BEX__FAULT(BEX__FAULT_POST_RECV);
    if (f) {
        *bad = wr;
        return f;
    }
    return ibv_post_recv(qp, wr, bad);
}

static inline int bex__rdma_poll_cq(struct ibv_cq *cq, int num, struct ibv_wc *wc)
{
    int n = ibv_poll_cq(cq, num, wc);
    if (n > 0) {
        /* a failing CQ loses what it had: these completions are gone */
        int f = BEX__FAULT(BEX__FAULT_POLL_CQ);
        if (f)
            return f;
    }
    return n;
}

/* ---- MTU ------------------------------------------------------------- */

/* Bytes of an IB MTU enum value (IBV_MTU_256..IBV_MTU_4096), 0 if invalid. */
int bex__rdma_mtu_bytes(enum ibv_mtu mtu);

/* ---- device choice --------------------------------------------------- */

/* How the RTR transition addresses the peer, from the local port's link
 * layer and the type of the chosen GID (bex__rdma_route_of); the hello
 * carries it (BEX__HELLO_ROUTE_*, the same values) and both sides of a
 * connection must have the same. RoCE v1 and InfiniBand are unit-tested
 * against fake devices (tests/rdma/test_rdma_route.c, test_rdma_choose.c)
 * but unverified on hardware (docs/architecture.md, "Fabrics"). */
enum bex__rdma_route {
    BEX__RDMA_ROUTE_ROCE_V2 = 0, /* Ethernet, RoCE v2 GID: GRH (UDP/IP) */
    BEX__RDMA_ROUTE_ROCE_V1 = 1, /* Ethernet, RoCE v1 GID: GRH (Ethertype) */
    BEX__RDMA_ROUTE_IB = 2,      /* InfiniBand: the peer's LID, and a GRH
                                    when its GID is not link-local */
};
/* The route of a port whose link layer is link_layer (IBV_LINK_LAYER_*;
 * UNSPECIFIED, as old providers report IB ports, counts as InfiniBand) for
 * a GID of type gid_type (IBV_GID_TYPE_*): Ethernet with a RoCE v1 GID is
 * ROCE_V1, Ethernet otherwise ROCE_V2. */
enum bex__rdma_route bex__rdma_route_of(uint8_t link_layer, uint32_t gid_type);

/* Where one side of a connection sits: the device, port and GID index that
 * serve a local address (bex__rdma_choose): on RoCE the GID is the address's
 * (::ffff:a.b.c.d, or the IPv6 address), on InfiniBand the port GID of the
 * IPoIB netdev with the address. */
struct bex__rdma_path {
    char dev_name[IBV_SYSFS_NAME_MAX];
    uint8_t port;            /* 1-based port number */
    uint8_t gid_index;       /* sgid_index for the global route header */
    union ibv_gid gid;       /* the GID itself (goes into the hello) */
    enum ibv_mtu active_mtu; /* port's active MTU (filled by open_ipv4) */
    uint8_t route;           /* enum bex__rdma_route (0: RoCE v2) */
    uint16_t lid;            /* the port's LID (InfiniBand; 0 on RoCE) */
};

/* Find the device, port and GID index for local IPv4 address ip (network
 * order, as in struct sockaddr_in), as bex__rdma_choose chooses among the
 * GID tables of every device (the IPoIB GID from getifaddrs).
 * Returns 0 and fills *out (all fields but active_mtu), -ENODEV when no
 * device has that address, -ENETDOWN when the only match is on a port that is
 * not ACTIVE, or another negative errno when the device list cannot be read.
 * Any thread. Opens and closes devices itself: costs a few system calls per
 * device, meant for connection setup, not the data path. */
int bex__rdma_find_ipv4(struct in_addr ip, struct bex__rdma_path *out);
/* The same for an IPv4 or IPv6 address (RoCE v2 over IPv6: the GID equal
 * to the address); -EAFNOSUPPORT for another family. */
int bex__rdma_find_addr(const bex_addr *addr, struct bex__rdma_path *out);

/* One GID table entry with its port's attributes, as the device choice
 * sees it (bex__rdma_find_addr builds them from ibv_query_gid_table). */
struct bex__rdma_gid_row {
    const char *dev;
    uint8_t port;
    uint32_t index;     /* GID index (above 255 never chosen: sgid_index is 8 bits) */
    uint32_t gid_type;  /* IBV_GID_TYPE_IB, _ROCE_V1, _ROCE_V2 */
    uint8_t link_layer; /* IBV_LINK_LAYER_ETHERNET, _INFINIBAND */
    bool active;        /* the port is ACTIVE */
    uint16_t lid;       /* the port's LID (InfiniBand) */
    union ibv_gid gid;
};
/* The choice among rows for addr, by route: on an Ethernet port the RoCE
 * v2 GID equal to addr's GID (bex__rdma_gid_from_addr), else its RoCE v1
 * GID; on an InfiniBand port the IB GID equal to ipoib, the port GID of
 * the IPoIB netdev that carries addr (bex__rdma_ipoib_gid; NULL when addr
 * is on no IPoIB netdev), LID routing with the port's LID. An ACTIVE port's
 * entry (on InfiniBand: with a unicast LID, i.e. a subnet manager has run)
 * beats another's, then RoCE v2 beats v1 beats InfiniBand, then the first.
 * 0 (out: all but active_mtu; route and lid set), -ENODEV, -ENETDOWN (only
 * on inactive ports), -EAFNOSUPPORT. Pure: tests give it fake tables. */
int bex__rdma_choose(const struct bex__rdma_gid_row *rows, size_t n, const bex_addr *addr,
                     const union ibv_gid *ipoib, struct bex__rdma_path *out);

/* The port GID of the IPoIB netdev in ifs (a getifaddrs list) that has
 * addr: the last 16 bytes of its 20-byte hardware address. 0, or -ENODEV
 * when no netdev has addr or the one that has it is not IPoIB. Pure: tests
 * give it fake lists. */
struct ifaddrs;
int bex__rdma_ipoib_gid(const struct ifaddrs *ifs, const bex_addr *addr, union ibv_gid *out);

/* Why no device serves ip, for a log line: "no usable RDMA device for
 * IP (err's text)" and what each port of each device has instead (no GID
 * for it, RoCE v1 only, InfiniBand, not ACTIVE), or that the host has no
 * device; NUL-terminated, cut to cap. Opens every device: not for a hot
 * path. */
void bex__rdma_why_none(struct in_addr ip, int err, char *buf, size_t cap);
void bex__rdma_why_none_addr(const bex_addr *addr, int err, char *buf, size_t cap);

/* The IPv4-mapped GID ::ffff:a.b.c.d of ip. */
void bex__rdma_gid_from_ipv4(struct in_addr ip, union ibv_gid *out);
/* The RoCE v2 GID of an address: IPv4-mapped, or the IPv6 address itself.
 * 0, or -EAFNOSUPPORT. */
int bex__rdma_gid_from_addr(const bex_addr *a, union ibv_gid *out);

/* ---- device handle --------------------------------------------------- */

struct bex__rdma_port {
    enum ibv_port_state state;
    enum ibv_mtu active_mtu;
    enum ibv_mtu max_mtu;
    uint16_t lid;       /* 0 on RoCE */
    uint8_t link_layer; /* IBV_LINK_LAYER_ETHERNET for RoCE */
    int gid_tbl_len;
};

/* One opened device, shared by every user in the process: the PD is the one
 * bemalloc registers its chunks with (bex_mem_registrar_verbs(.., dev->pd,
 * 0)), and every QP of this device is created on it (or on a parent domain
 * over it), so any chunk can serve any connection of the device.
 * Fields are read-only for users. */
struct bex__rdma_dev {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_device_attr attr; /* limits: max_qp_wr, max_sge, max_cqe, ... */
    char name[IBV_SYSFS_NAME_MAX];
    uint8_t nports;
    struct bex__rdma_port *ports; /* ports[0..nports-1] = ports 1..nports,
                                     as queried at first open, immutable */
    /* private */
    int refs;
    struct bex__list link; /* the open devices */
};

/* Open the device named name (e.g. "rxe0"): the first open in the process
 * opens the ibv_context, allocates the PD and queries device and ports; later
 * opens return the same handle with one more reference. Each successful open
 * is paired with one bex__rdma_dev_close(). Returns 0, -ENODEV (no such
 * device), or the error of ibv_open_device / ibv_alloc_pd / ibv_query_*.
 * Any thread. */
int bex__rdma_dev_open(const char *name, struct bex__rdma_dev **out);

/* find_ipv4 + dev_open + active MTU of the chosen port: the one call
 * connection setup makes with the local address of its TCP socket. On
 * success the caller owns one reference to *dev and *path is complete. */
int bex__rdma_dev_open_ipv4(struct in_addr ip, struct bex__rdma_dev **dev,
                            struct bex__rdma_path *path);
int bex__rdma_dev_open_addr(const bex_addr *addr, struct bex__rdma_dev **dev,
                            struct bex__rdma_path *path);

/* Drop a reference. The last one deallocates the PD and closes the context;
 * every MR, QP, CQ, SRQ and TD made on the device must be gone by then.
 * Returns 0, or -EBUSY when the PD still has objects: the handle then stays
 * open and the caller still holds its reference. NULL is ignored. */
int bex__rdma_dev_close(struct bex__rdma_dev *dev);

/* Query one port (1-based) afresh into *out; the active MTU and state
 * change with the netdev (dev->ports is not updated: it is read unlocked).
 * Returns 0, -EINVAL for a bad port, or the verbs error. */
int bex__rdma_port_query(struct bex__rdma_dev *dev, uint8_t port, struct bex__rdma_port *out);

/* ---- async events ---------------------------------------------------- */

/* Make the device's async event fd (dev->ctx->async_fd) non-blocking, for
 * epoll. Any thread; more calls change nothing. 0 or a negative errno. */
int bex__rdma_async_nonblock(struct bex__rdma_dev *dev);
/* The next async event into *ev: 1 (acknowledge it with
 * ibv_ack_async_event), 0 when none is pending (after
 * bex__rdma_async_nonblock), or a negative errno. */
int bex__rdma_async_next(struct bex__rdma_dev *dev, struct ibv_async_event *ev);

/* ---- completion queues ----------------------------------------------- */

/* A completion channel whose fd is non-blocking, for poll()/epoll of an idle
 * I/O thread. Returns 0 or the verbs error. */
int bex__rdma_channel_create(struct bex__rdma_dev *dev, struct ibv_comp_channel **out);
/* Returns 0, or -EBUSY while CQs still use the channel. NULL is ignored. */
int bex__rdma_channel_destroy(struct ibv_comp_channel *ch);

/* A CQ of at least cqe entries (0 means 256), capped by the device's
 * max_cqe; ch may be NULL (polling only). Returns 0, -EINVAL when cqe
 * exceeds the device limit, or the verbs error. */
int bex__rdma_cq_create(struct bex__rdma_dev *dev, int cqe, struct ibv_comp_channel *ch,
                        struct ibv_cq **out);
/* Returns 0, or -EBUSY while QPs still use the CQ. NULL is ignored. */
int bex__rdma_cq_destroy(struct ibv_cq *cq);
/* Grow (or shrink) cq to at least cqe entries (ibv_resize_cq): 0, -EINVAL
 * beyond the device's max_cqe, or what verbs reports. Completions already
 * in the CQ stay. */
int bex__rdma_cq_resize(struct ibv_cq *cq, int cqe);

/* ---- thread domains -------------------------------------------------- */

/* A thread domain and a parent domain over dev->pd using it. Creating a
 * QP on td->pd tells the provider that one thread drives the QP, so it can
 * skip locks and use a dedicated doorbell. MRs of dev->pd work with QPs on
 * td->pd. */
struct bex__rdma_td {
    struct ibv_td *td;
    struct ibv_pd *pd; /* the parent domain: pass as bex__rdma_qp_config.pd */
};

/* Returns 0, or -EOPNOTSUPP when the provider lacks thread or parent domains
 * (rxe, and any provider without them): the caller then creates its QPs on
 * dev->pd and nothing else changes. Other errors as verbs reports them. */
int bex__rdma_td_alloc(struct bex__rdma_dev *dev, struct bex__rdma_td **out);
/* Returns 0, or -EBUSY while QPs still use the parent domain. NULL ignored. */
int bex__rdma_td_free(struct bex__rdma_td *td);

/* ---- RC queue pairs -------------------------------------------------- */

/* Creation parameters; zero in a field means its default. */
struct bex__rdma_qp_config {
    struct ibv_cq *send_cq; /* required */
    struct ibv_cq *recv_cq; /* required */
    struct ibv_srq *srq;    /* NULL: the QP has its own receive queue */
    struct ibv_pd *pd;      /* NULL: dev->pd; or bex__rdma_td.pd */
    uint32_t sq_depth;      /* send WRs (default 32) */
    uint32_t rq_depth;      /* receive WRs (default 32; ignored with srq) */
    uint32_t max_send_sge;  /* default 1 */
    uint32_t max_recv_sge;  /* default 1 */
    uint32_t max_inline;    /* inline bytes; 0 = no inline data */
};

/* Create an RC QP in RESET with selective signaling (sq_sig_all = 0: only
 * WRs flagged IBV_SEND_SIGNALED complete). cap_out (may be NULL) receives the
 * capacities the provider actually granted, which may exceed the request.
 * Returns 0, -EINVAL (missing CQ, or a depth/SGE count above the device's
 * limits), or the verbs error. */
int bex__rdma_qp_create(struct bex__rdma_dev *dev, const struct bex__rdma_qp_config *cfg,
                        struct ibv_qp **out, struct ibv_qp_cap *cap_out);
/* Returns 0 or the verbs error. NULL is ignored. */
int bex__rdma_qp_destroy(struct ibv_qp *qp);

/* Timers and limits of the state transitions; zero in a field means its
 * default. In the fields whose default is not 0 (timeout .. hop_limit),
 * BEX__RDMA_ZERO asks for a real 0, e.g. rnr_retry = 0 to see RNR errors at
 * once in tests. traffic_class, sl and flow_label are used as given (the
 * context resolves its defaults: bex_ctx_config). */
#define BEX__RDMA_ZERO 0xff
struct bex__rdma_conn_config {
    uint8_t timeout;            /* local ACK timeout 4.096us * 2^t (default 14,
                                   about 67 ms) */
    uint8_t retry_cnt;          /* transport retries, 0..7 (default 7) */
    uint8_t rnr_retry;          /* RNR retries, 0..7, 7 = forever (default 7) */
    uint8_t min_rnr_timer;      /* RNR NAK delay code, 0..31 (default 12,
                                   0.64 ms) */
    uint8_t max_rd_atomic;      /* outstanding READ/atomic as initiator
                                   (default 16, capped by the device) */
    uint8_t max_dest_rd_atomic; /* as responder (default 16, capped) */
    uint8_t hop_limit;          /* IP TTL (default 64) */
    uint8_t traffic_class;      /* IP DSCP/ECN byte (default 0) */
    uint8_t sl;                 /* service level / priority (default 0) */
    uint32_t access;            /* remote access flags for INIT (default
                                   REMOTE_WRITE | LOCAL_WRITE; never READ) */
    uint32_t flow_label;        /* GRH flow label, 20 bits (default 0: the
                                   provider's choice) */
};

/* What the peer told us in its hello, as the RTR transition needs it. */
struct bex__rdma_peer {
    uint32_t qpn; /* 24-bit */
    uint32_t psn; /* 24-bit: the first PSN the peer will send */
    union ibv_gid gid;
    enum ibv_mtu active_mtu;
    uint8_t rd_atomic; /* READs the peer accepts as responder:
                          caps our max_rd_atomic */
    uint16_t lid;      /* the peer port's LID: InfiniBand routes only,
                          unicast 1..0xbfff there */
};

/* The RTR part of a decoded hello (bex__hello_decode judged its ranges):
 * QPN, PSN, GID, MTU, rd_atomic and the LID of an InfiniBand sender. */
void bex__rdma_peer_of_hello(const struct bex__hello *h, struct bex__rdma_peer *out);

/* The effective max_dest_rd_atomic this side will set for cfg (default or
 * configured, capped by the device): the value to offer in the hello. */
uint8_t bex__rdma_dest_rd_atomic(const struct bex__rdma_dev *dev,
                                 const struct bex__rdma_conn_config *cfg);

/* RESET -> INIT on path->port, with cfg->access (cfg may be NULL). */
int bex__rdma_qp_to_init(struct ibv_qp *qp, const struct bex__rdma_path *path,
                         const struct bex__rdma_conn_config *cfg);

/* INIT -> RTR: path MTU = min(path->active_mtu, peer->active_mtu), remote
 * QPN and PSN, max_dest_rd_atomic, min_rnr_timer, and the address by
 * path->route: RoCE v2 and v1 a global route (dgid = peer->gid, sgid_index
 * = path->gid_index, hop_limit, traffic_class, flow_label; sl), no DLID;
 * InfiniBand DLID = peer->lid (sl), no GRH when peer->gid is link-local
 * (fe80::/64, the subnet's own) or zero, else the same global route too.
 * Receives may be posted from INIT on; after RTR the QP accepts the peer's
 * packets. Returns 0, -EINVAL for an invalid MTU, QPN, PSN or (InfiniBand)
 * a LID that is not unicast, or the verbs error. */
int bex__rdma_qp_to_rtr(struct ibv_qp *qp, struct bex__rdma_dev *dev,
                        const struct bex__rdma_path *path, const struct bex__rdma_peer *peer,
                        const struct bex__rdma_conn_config *cfg);

/* RTR -> RTS: own first PSN (the one sent in our hello), timeout, retry_cnt,
 * rnr_retry, max_rd_atomic = min(configured, device, peer->rd_atomic). */
int bex__rdma_qp_to_rts(struct ibv_qp *qp, struct bex__rdma_dev *dev, uint32_t psn,
                        const struct bex__rdma_peer *peer, const struct bex__rdma_conn_config *cfg);

/* Any state -> ERR: outstanding and later WRs complete with
 * IBV_WC_WR_FLUSH_ERR, so the owner can reclaim every buffer. A QP still in
 * RESET (Linux refuses RESET -> ERR) holds no WRs: it is left alone and 0 is
 * returned. */
int bex__rdma_qp_to_err(struct ibv_qp *qp);

/* ---- randomness ------------------------------------------------------ */

/* A random 24-bit PSN (getrandom; never blocks, falls back to a clock-seeded
 * mix during early boot). Any thread. */
uint32_t bex__rdma_random_psn(void);
/* A random non-zero 64-bit value (connection ids). Any thread. */
uint64_t bex__rdma_random_u64(void);

#endif
