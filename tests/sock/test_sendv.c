/* SPDX-License-Identifier: Apache-2.0 */
/* The gather send (bex_sock_sendv): one message from several buffers, no
 * copy. One process, a server context on BEX_TEST_ADDR0 and a client on
 * BEX_TEST_ADDR1; over RDMA in the VM (label rxe: an eager SEND with one
 * SGE a buffer, a large message's WRITEs cut at the buffers' ends), over
 * TCP on loopback natively (tcp: one sendmsg of the buffers).
 *
 * - gather: messages of 1 to BEX_SOCK_IOV_MAX buffers (from bex_sock_alloc,
 *   bex_sock_alloc_exposable and slices inside one allocation), small and
 *   large (past the fragment size and the peer's eager bound), arrive each
 *   as one message whose bytes are the buffers' in order; every one is
 *   reported once, with iov[0] and the total length.
 * - errors: too many buffers (-E2BIG), none, a NULL array, an empty buffer,
 *   bex memory that no context registered, another context's buffer
 *   (-EINVAL), a total past 2 GiB (-EMSGSIZE): refused at once, nothing
 *   arrives; a good send after them arrives alone.
 * - foreign: memory bex never allocated (malloc's, stack, static, a page
 *   mapped alone) given to bex_sock_send, _send_req, _sendv and _expose:
 *   -EINVAL and bex_last_error naming the buffer, no crash, nothing sent. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "sock/echo.h"

static struct in_addr addr0, addr1;

struct srv {
    struct local_srv base;
    _Atomic long recvd, bad;
};

/* each message's bytes are fill_pattern's with its length as seed */
static void srv_recv(bex_sock *s, void *buf, size_t len, void *user)
{
    (void)s;
    struct srv *v = user;
    if (check_pattern(buf, len, (uint32_t)len)) {
        fprintf(stderr, "a message of %zu bytes is not what was sent\n", len);
        atomic_fetch_add(&v->bad, 1);
    }
    bex_mem_free(buf);
    waiter_add(&v->base.w, &v->recvd, 1);
}

struct cli {
    struct local_cli base;
    _Atomic long done, failed;
};

/* what one message was sent from */
struct sent {
    void *first;
    size_t total;
    void *bufs[BEX_SOCK_IOV_MAX];
    unsigned n;
};

static void cli_done(bex_sock *s, void *buf, size_t len, void *msg_user, int status, void *user)
{
    (void)s;
    struct cli *c = user;
    struct sent *m = msg_user;
    if (status || buf != m->first || len != m->total) {
        fprintf(stderr, "done: status %d, buf %p (sent %p), len %zu (sent %zu)\n", status, buf,
                m->first, len, m->total);
        atomic_fetch_add(&c->failed, 1);
    }
    for (unsigned i = 0; i < m->n; i++)
        bex_mem_free(m->bufs[i]);
    free(m);
    waiter_add(c->base.w, &c->done, 1);
}

struct rig {
    struct srv v;
    struct cli c;
    bex_ctx *sctx, *cctx;
    bex_listener *l;
    bex_addr at;
    bex_sock *s;
};

static int rig_up(struct rig *r)
{
    int rc = pair_addrs(&addr0, &addr1);
    if (rc)
        return rc;
    r->v = (struct srv){.base.w = WAITER_INIT};
    r->sctx = local_ctx(NULL, addr0);
    r->cctx = local_ctx(NULL, addr1);
    r->l = local_listen(r->sctx, addr0, &r->v.base, srv_recv, &r->at);
    r->c = (struct cli){.base.w = &r->v.base.w};
    bex_sock_ops ops = {
        .on_connect = local_cli_connect, .on_send_done = cli_done, .on_close = local_cli_closed};
    CHECK_OK(bex_sock_connect(r->cctx, &r->at, &ops, &r->c, &r->s));
    CHECK_OK(wait_count(&r->v.base.w, &r->c.base.connected, 1, 5000));
    return 0;
}

static void rig_down(struct rig *r)
{
    bex_sock_close(r->s);
    CHECK_OK(wait_count(&r->v.base.w, &r->c.base.closed, 1, 5000));
    CHECK_OK(wait_count(&r->v.base.w, &r->v.base.closed, atomic_load(&r->v.base.accepted), 5000));
    CHECK_OK(bex_listener_close(r->l));
    CHECK_OK(bex_ctx_destroy(r->cctx));
    CHECK_OK(bex_ctx_destroy(r->sctx));
}

/* Send one message of the pieces' lengths (n of them), piece i from its
 * own allocation of kind i % 3: bex_sock_alloc, bex_sock_alloc_exposable,
 * or 100 bytes into a larger bex_sock_alloc. */
static void send_gathered(struct rig *r, const size_t *lens, unsigned n)
{
    size_t total = 0;
    for (unsigned i = 0; i < n; i++)
        total += lens[i];
    uint8_t *whole = malloc(total);
    CHECK(whole);
    fill_pattern(whole, total, (uint32_t)total);
    struct sent *m = calloc(1, sizeof *m);
    CHECK(m);
    struct iovec iov[BEX_SOCK_IOV_MAX];
    size_t off = 0;
    for (unsigned i = 0; i < n; i++) {
        uint8_t *b = i % 3 == 0   ? bex_sock_alloc(r->cctx, lens[i])
                     : i % 3 == 1 ? bex_sock_alloc_exposable(r->cctx, lens[i])
                                  : bex_sock_alloc(r->cctx, lens[i] + 200);
        CHECK(b);
        m->bufs[i] = b;
        uint8_t *p = i % 3 == 2 ? b + 100 : b;
        memcpy(p, whole + off, lens[i]);
        off += lens[i];
        iov[i] = (struct iovec){p, lens[i]};
    }
    m->n = n;
    m->first = iov[0].iov_base;
    m->total = total;
    free(whole);
    CHECK_OK(bex_sock_sendv(r->s, iov, n, m));
}

/* After refused sends: a good message of two pieces (a and b bytes) is the
 * first to arrive, intact, and nothing failed; then the rig goes down. */
static void first_after_refused(struct rig *r, size_t a, size_t b)
{
    size_t l[2] = {a, b};
    send_gathered(r, l, 2);
    CHECK_OK(wait_count(&r->v.base.w, &r->c.done, 1, 5000));
    CHECK_OK(wait_count(&r->v.base.w, &r->v.recvd, 1, 5000));
    CHECK_EQ(atomic_load(&r->v.recvd), 1);
    CHECK_EQ(atomic_load(&r->v.bad), 0);
    CHECK_EQ(atomic_load(&r->c.failed), 0);
    rig_down(r);
}

static int gather(void)
{
    struct rig r;
    int rc = rig_up(&r);
    if (rc)
        return rc;
    /* totals all different (the server checks by length) */
    static const size_t small[][4] = {{40}, {100, 3}, {7, 300, 50}, {1, 2, 3, 4}, {64, 64, 64, 64}};
    static const size_t large[][4] = {{70000, 5, 200000}, {300000, 1}, {9, 150001, 8, 65536}};
    long sent = 0;
    for (int k = 0; k < 3; k++) {
        for (size_t i = 0; i < sizeof small / sizeof small[0]; i++, sent++) {
            unsigned n = 0;
            while (n < 4 && small[i][n])
                n++;
            size_t l[4];
            for (unsigned j = 0; j < n; j++)
                l[j] = small[i][j] + (size_t)k * 1000;
            send_gathered(&r, l, n);
        }
    }
    for (size_t i = 0; i < sizeof large / sizeof large[0]; i++, sent++) {
        unsigned n = 0;
        while (n < 4 && large[i][n])
            n++;
        send_gathered(&r, large[i], n);
    }
    CHECK_OK(wait_count(&r.v.base.w, &r.v.recvd, sent, 20000));
    CHECK_OK(wait_count(&r.v.base.w, &r.c.done, sent, 10000));
    CHECK_EQ(atomic_load(&r.v.bad), 0);
    CHECK_EQ(atomic_load(&r.c.failed), 0);
    rig_down(&r);
    return 0;
}

static int errors(void)
{
    struct rig r;
    int rc = rig_up(&r);
    if (rc)
        return rc;
    /* bex memory that no context registered (a pool without registrar):
     * over RDMA no key of this context's reaches it */
    bex_mem_registrar none;
    bex_mem_registrar_noop(&none);
    bex_mem_pool *unreg_pool;
    CHECK_OK(bex_mem_pool_create(&none, NULL, &unreg_pool));
    uint8_t *a = bex_sock_alloc(r.cctx, 64), *theirs = bex_sock_alloc(r.sctx, 64);
    uint8_t *plain = bex_mem_alloc(unreg_pool, 64);
    CHECK(a && theirs && plain);
    struct iovec five[BEX_SOCK_IOV_MAX + 1];
    for (int i = 0; i < BEX_SOCK_IOV_MAX + 1; i++)
        five[i] = (struct iovec){a + 8 * i, 8};
    CHECK_EQ(bex_sock_sendv(r.s, five, BEX_SOCK_IOV_MAX + 1, NULL), -E2BIG);
    CHECK_EQ(bex_sock_sendv(r.s, five, 0, NULL), -EINVAL);
    CHECK_EQ(bex_sock_sendv(r.s, NULL, 2, NULL), -EINVAL);
    CHECK_EQ(bex_sock_sendv(NULL, five, 2, NULL), -EINVAL);
    struct iovec empty[2] = {{a, 8}, {a + 8, 0}};
    CHECK_EQ(bex_sock_sendv(r.s, empty, 2, NULL), -EINVAL);
    struct iovec unreg[2] = {{a, 8}, {plain, 8}}; /* registered by no context */
    CHECK_EQ(bex_sock_sendv(r.s, unreg, 2, NULL), -EINVAL);
    struct iovec other[2] = {{theirs, 8}, {a, 8}}; /* the server context's */
    CHECK_EQ(bex_sock_sendv(r.s, other, 2, NULL), -EINVAL);
    struct iovec past[1] = {{a, (size_t)1 << 40}};
    CHECK_EQ(bex_sock_sendv(r.s, past, 1, NULL), -EMSGSIZE);
    bex_mem_free(plain);
    CHECK_OK(bex_mem_pool_destroy(unreg_pool));
    bex_mem_free(theirs);
    bex_mem_free(a);
    /* nothing went: the next good message is the first to arrive */
    first_after_refused(&r, 10, 20);
    return 0;
}

/* A page mapped where no 4 MiB region around it is: bemalloc finds an
 * allocation's header by masking to 4 MiB, so a check that trusted the
 * pointer would read the unmapped start of the region and crash. */
static void *lone_page(void **map, size_t *len)
{
    size_t four = (size_t)4 << 20;
    *len = 3 * four;
    char *m = mmap(NULL, *len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED);
    char *al = (char *)(((uintptr_t)m + four - 1) & ~(uintptr_t)(four - 1));
    char *page = al + four / 2;
    CHECK(mprotect(page, 4096, PROT_READ | PROT_WRITE) == 0);
    memset(page, 0x5a, 4096);
    *map = m;
    return page;
}

/* each refusal is -EINVAL with bex_last_error naming the buffer */
static void refused(int rc, const void *buf)
{
    char at[32];
    snprintf(at, sizeof at, "%p", buf);
    CHECK_EQ(rc, -EINVAL);
    if (!strstr(bex_last_error(), at) || !strstr(bex_last_error(), "not memory bex allocated")) {
        fprintf(stderr, "last error \"%s\" does not name %s\n", bex_last_error(), at);
        CHECK(0);
    }
}

/* Memory bex never allocated (malloc's, the stack, a static array, a page
 * mapped alone), passed to every send and to expose: -EINVAL and a text
 * naming it, no crash; nothing arrives; a good send after them does. */
static int foreign(void)
{
    struct rig r;
    int rc = rig_up(&r);
    if (rc)
        return rc;
    static uint8_t stat_buf[64];
    uint8_t stack_buf[64] = {1};
    void *map;
    size_t map_len;
    uint8_t *heap_buf = malloc(64), *lone = lone_page(&map, &map_len);
    CHECK(heap_buf);
    uint8_t *a = bex_sock_alloc(r.cctx, 64);
    CHECK(a);
    void *bufs[] = {lone, heap_buf, stack_buf, stat_buf};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        refused(bex_sock_send(r.s, bufs[i], 64, NULL), bufs[i]);
        bex_send_req req;
        refused(bex_sock_send_req(r.s, &req, bufs[i], 64, NULL), bufs[i]);
        struct iovec iov[2] = {{a, 8}, {bufs[i], 64}};
        refused(bex_sock_sendv(r.s, iov, 2, NULL), bufs[i]);
        bex_remote_buf rb;
        refused(bex_sock_expose(r.s, bufs[i], 64, NULL, &rb), bufs[i]);
    }
    CHECK(munmap(map, map_len) == 0);
    free(heap_buf);
    bex_mem_free(a);
    first_after_refused(&r, 11, 22);
    return 0;
}

BEX_TEST_MAIN({"gather", gather}, {"errors", errors}, {"foreign", foreign})
