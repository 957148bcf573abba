/* SPDX-License-Identifier: Apache-2.0 */
/* bemalloc on a real device: buffers allocated from a pool registered with
 * rxe0's PD are written by RDMA WRITEs from a QP on rxe1, addressed only
 * with what bex_mem_mr() returns; the source buffers come from a second pool
 * registered with rxe1's PD (their lkeys also from bex_mem_mr()). One
 * process drives both sides; the packets cross the veth wire. */
#include <stdbool.h>
#include <string.h>

#include "bex/mem.h"
#include "harness.h"
#include "rdma/rdma.h"
#include "../rdma/rdma_test.h"

struct end {
    struct bex__rdma_dev *dev;
    struct bex__rdma_path path;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    uint32_t psn;
    bex_mem_pool *pool;
};

static void end_open(struct end *e, struct in_addr ip, bool landing)
{
    CHECK_OK(bex__rdma_dev_open_ipv4(ip, &e->dev, &e->path));
    CHECK_OK(bex__rdma_cq_create(e->dev, 64, NULL, &e->cq));
    struct bex__rdma_qp_config qc = {.send_cq = e->cq, .recv_cq = e->cq};
    CHECK_OK(bex__rdma_qp_create(e->dev, &qc, &e->qp, NULL));
    CHECK_OK(bex__rdma_qp_to_init(e->qp, &e->path, NULL));
    e->psn = bex__rdma_random_psn();
    /* the written side is a landing pool, the only kind a peer may write */
    bex_mem_registrar reg;
    bex_mem_registrar_verbs(&reg, e->dev->pd,
                            landing ? IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE : 0);
    bex_mem_config mc = {.kind = landing ? BEX_MEM_POOL_LANDING : BEX_MEM_POOL_GENERAL};
    CHECK_OK(bex_mem_pool_create(&reg, &mc, &e->pool));
}

static void end_connect(struct end *e, const struct end *peer)
{
    struct bex__rdma_peer p = {.qpn = peer->qp->qp_num,
                               .psn = peer->psn,
                               .gid = peer->path.gid,
                               .active_mtu = peer->path.active_mtu,
                               .rd_atomic = 1};
    CHECK_OK(bex__rdma_qp_to_rtr(e->qp, e->dev, &e->path, &p, NULL));
    CHECK_OK(bex__rdma_qp_to_rts(e->qp, e->dev, e->psn, &p, NULL));
}

static void end_close(struct end *e)
{
    CHECK_OK(bex_mem_pool_destroy(e->pool));
    CHECK_OK(bex__rdma_qp_destroy(e->qp));
    CHECK_OK(bex__rdma_cq_destroy(e->cq));
    CHECK_OK(bex__rdma_dev_close(e->dev));
}

/* WRITE len bytes from src (side 1) to dst (side 0), wait for completion. */
static void write_and_wait(struct end *from, void *src, void *dst, size_t len)
{
    const bex_mem_region *sr = bex_mem_mr(src), *dr = bex_mem_mr(dst);
    CHECK(sr && dr);
    /* the regions cover the whole range, first byte to last */
    CHECK((uintptr_t)src >= (uintptr_t)sr->addr &&
          (uintptr_t)src + len <= (uintptr_t)sr->addr + sr->length);
    CHECK((uintptr_t)dst >= (uintptr_t)dr->addr &&
          (uintptr_t)dst + len <= (uintptr_t)dr->addr + dr->length);
    struct ibv_sge sge = {.addr = (uintptr_t)src, .length = (uint32_t)len, .lkey = sr->lkey};
    struct ibv_send_wr wr = {.wr_id = 7,
                             .sg_list = &sge,
                             .num_sge = 1,
                             .opcode = IBV_WR_RDMA_WRITE,
                             .send_flags = IBV_SEND_SIGNALED,
                             .wr.rdma = {.remote_addr = (uintptr_t)dst, .rkey = dr->rkey}};
    struct ibv_send_wr *bad;
    CHECK_EQ(ibv_post_send(from->qp, &wr, &bad), 0);
    struct ibv_wc wc;
    int n, spins = 0;
    while ((n = ibv_poll_cq(from->cq, 1, &wc)) == 0 && spins++ < 50000000)
        ;
    CHECK_EQ(n, 1);
    if (wc.status != IBV_WC_SUCCESS)
        fprintf(stderr, "WRITE of %zu bytes: %s\n", len, ibv_wc_status_str(wc.status));
    CHECK_EQ(wc.status, IBV_WC_SUCCESS);
}

static int remote_write(void)
{
    struct test_addrs a;
    int rc = test_need_rdma(&a);
    if (rc)
        return rc;
    struct end e0 = {0}, e1 = {0};
    end_open(&e0, a.a0, true);
    end_open(&e1, a.a1, false);
    end_connect(&e0, &e1);
    end_connect(&e1, &e0);

    /* small, span-sized, medium, chunk-sized and larger than a chunk (own
     * mapping and registration) */
    const size_t sizes[] = {1, 16, 1000, 4096, 65536, 1 << 20, (4 << 20) - 64, 5 << 20, 9 << 20};
    enum { N = sizeof sizes / sizeof sizes[0] };
    void *dst[N], *src[N];
    for (int i = 0; i < N; i++) {
        dst[i] = bex_mem_alloc(e0.pool, sizes[i]);
        src[i] = bex_mem_alloc(e1.pool, sizes[i]);
        CHECK(dst[i] && src[i]);
        memset(dst[i], 0, sizes[i]);
        test_fill(src[i], sizes[i], 1000 + (uint64_t)i);
    }
    for (int i = 0; i < N; i++) {
        /* rxe's per-message limit is 8 MiB: write bigger ones in two */
        size_t half = sizes[i] > (8u << 20) ? sizes[i] / 2 : sizes[i];
        write_and_wait(&e1, src[i], dst[i], half);
        if (half < sizes[i])
            write_and_wait(&e1, (char *)src[i] + half, (char *)dst[i] + half, sizes[i] - half);
        CHECK(memcmp(dst[i], src[i], sizes[i]) == 0);
    }
    /* an interior pointer finds the same region */
    char *mid = (char *)dst[5] + 12345;
    CHECK(bex_mem_mr(mid) == bex_mem_mr(dst[5]));
    test_fill(src[4], 4096, 99);
    write_and_wait(&e1, src[4], mid, 4096);
    CHECK(memcmp(mid, src[4], 4096) == 0);

    /* memory freed and allocated again is still registered */
    bex_mem_stats before, after;
    bex_mem_pool_stats(e0.pool, &before);
    for (int round = 0; round < 3; round++) {
        bex_mem_free(dst[3]);
        dst[3] = bex_mem_alloc(e0.pool, sizes[3]);
        CHECK(dst[3]);
        test_fill(src[3], sizes[3], 500 + (uint64_t)round);
        write_and_wait(&e1, src[3], dst[3], sizes[3]);
        CHECK(memcmp(dst[3], src[3], sizes[3]) == 0);
    }
    bex_mem_pool_stats(e0.pool, &after);
    CHECK_EQ(after.registrations, before.registrations); /* steady state */
    CHECK(after.registered_bytes >= sizes[N - 1]);

    for (int i = 0; i < N; i++) {
        bex_mem_free(dst[i]);
        bex_mem_free(src[i]);
    }
    end_close(&e1);
    end_close(&e0);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(remote_write))
