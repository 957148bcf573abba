/* SPDX-License-Identifier: Apache-2.0 */
/* Config structs carry their size (issue 27 item 3; include/bex/common.h):
 * a program built against older headers passes a smaller struct and it
 * works, the fields it lacks taking their defaults. Each older struct is
 * declared here as a prefix of today's (what an older header had) and
 * placed at the very end of a page followed by an inaccessible one: a
 * library reading past the caller's size faults.
 *  - ctx_older: a bex_ctx_config of {size, local_addr} makes a context
 *    that listens (transport auto, the defaults).
 *  - mem_older: a bex_mem_config of {size} makes a pool that allocates.
 *  - ps_older: a shard config of its first 4 members, tables of 5 (their
 *    stride the older size): the shard is made with both tables (a wrong
 *    stride reads the second table's id and dim from the wrong bytes).
 *  - dir_older: a bex_dir_config of {size, conn_fail_max}.
 *  - newer: a larger struct is taken when the bytes past today's are
 *    zero, refused (-EINVAL) when one is set; a size below sizeof(size_t)
 *    is refused; size 0 is today's layout.
 *  - failover_sized: bex_ps_failover_config the same (a newer struct with
 *    a field set refused, zero taken; an older one without its last
 *    field taken), on a backup shard whose etcd nobody serves. */
#include <arpa/inet.h>
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "harness.h"
#include "bex/dir.h"
#include "bex/mem.h"
#include "bex/ps.h"
#include "bex/rpc.h"
#include "bex/sock.h"

/* len bytes at the end of a readable page, an inaccessible page after. */
static void *at_page_end(size_t len)
{
    long pg = sysconf(_SC_PAGESIZE);
    unsigned char *p =
        mmap(NULL, 2 * (size_t)pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    CHECK(mprotect(p + pg, (size_t)pg, PROT_NONE) == 0);
    return p + pg - len;
}

struct old_ctx_config {
    size_t size;
    bex_addr local_addr;
};

static int ctx_older(void)
{
    struct old_ctx_config *o = at_page_end(sizeof *o);
    o->size = sizeof *o;
    bex_addr_parse("127.0.0.1", 0, &o->local_addr);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create((const bex_ctx_config *)o, &ctx));
    bex_addr at = o->local_addr;
    bex_listener_ops lops = {0};
    bex_listener *l;
    CHECK_OK(bex_listen(ctx, &at, &lops, NULL, &l));
    CHECK_OK(bex_listener_close(l));
    CHECK_OK(bex_ctx_destroy(ctx));
    return 0;
}

static int mem_older(void)
{
    size_t *o = at_page_end(sizeof *o);
    *o = sizeof *o;
    bex_mem_registrar reg;
    bex_mem_registrar_noop(&reg);
    bex_mem_pool *pool;
    CHECK_OK(bex_mem_pool_create(&reg, (const bex_mem_config *)o, &pool));
    void *b = bex_mem_alloc(pool, 1000);
    CHECK(b);
    bex_mem_free(b);
    CHECK_OK(bex_mem_pool_destroy(pool));
    return 0;
}

struct old_table {
    size_t size;
    uint32_t id, dim, optimizer;
    float lr;
};

struct old_shard {
    size_t size;
    uint32_t shard, n_shards;
    const struct old_table *tables;
    size_t n_tables;
};

static int ps_older(void)
{
    struct old_table *t = at_page_end(2 * sizeof *t);
    t[0] = (struct old_table){sizeof *t, 7, 4, BEX_PS_SGD, 0.5f};
    t[1] = (struct old_table){sizeof *t, 9, 8, BEX_PS_ADAGRAD, 0.25f};
    struct old_shard *o = at_page_end(sizeof *o);
    *o = (struct old_shard){sizeof *o, 0, 1, t, 2};
    bex_ps_shard *s;
    CHECK_OK(bex_ps_shard_create((const bex_ps_shard_config *)o, &s));
    bex_ps_shard_destroy(s);
    /* the second table is read where the older stride puts it: its id,
     * made the first's, is refused as a duplicate */
    t[1].id = 7;
    CHECK_EQ(bex_ps_shard_create((const bex_ps_shard_config *)o, &s), -EINVAL);
    return 0;
}

struct old_dir_config {
    size_t size;
    uint32_t conn_fail_max;
};

static int dir_older(void)
{
    struct old_dir_config *o = at_page_end(sizeof *o);
    *o = (struct old_dir_config){sizeof *o, 5};
    bex_dir *d;
    CHECK_OK(bex_dir_create((const bex_dir_config *)o, &d));
    bex_dir_destroy(d);
    o->conn_fail_max = 1000000; /* still checked: above 100000 */
    CHECK_EQ(bex_dir_create((const bex_dir_config *)o, &d), -EINVAL);
    return 0;
}

struct new_ctx_config {
    bex_ctx_config now;
    uint64_t later[2]; /* fields of a newer library */
};

static int newer(void)
{
    struct new_ctx_config n = {.now = BEX_CTX_CONFIG_INIT};
    n.now.size = sizeof n;
    n.now.transport = BEX_TRANSPORT_TCP;
    bex_addr_parse("127.0.0.1", 0, &n.now.local_addr);
    bex_ctx *ctx;
    CHECK_OK(bex_ctx_create(&n.now, &ctx));
    CHECK_OK(bex_ctx_destroy(ctx));
    n.later[1] = 1;
    CHECK_EQ(bex_ctx_create(&n.now, &ctx), -EINVAL);
    n.later[1] = 0;
    n.now.size = 4;
    CHECK_EQ(bex_ctx_create(&n.now, &ctx), -EINVAL);
    n.now.size = 0; /* today's layout */
    CHECK_OK(bex_ctx_create(&n.now, &ctx));
    CHECK_OK(bex_ctx_destroy(ctx));
    bex_mem_config mc = BEX_MEM_CONFIG_INIT;
    CHECK_EQ(mc.size, sizeof mc);
    CHECK_EQ(mc.kind, 0);
    return 0;
}

/* bex_ps_failover_config carries its size too: a backup shard (one
 * table, registered on a server of a TCP context) started in etcd mode
 * against an etcd nobody serves (its agent waits; stopped at once). */
struct failover_rig {
    bex_ctx *ctx;
    bex_rpc_server *srv;
    bex_ps_shard *s;
    bex_rpc_endpoint ep;
};

static int rig_up(struct failover_rig *r)
{
    bex_ctx_config cc = BEX_CTX_CONFIG_INIT;
    cc.transport = BEX_TRANSPORT_TCP;
    CHECK_OK(bex_addr_parse("127.0.0.1", 0, &cc.local_addr));
    CHECK_OK(bex_ctx_create(&cc, &r->ctx));
    static const bex_ps_table_config t[] = {
        {.size = sizeof t[0], .id = 1, .dim = 4, .optimizer = BEX_PS_SGD, .lr = 0.5f}};
    bex_ps_shard_config pc = BEX_PS_SHARD_CONFIG_INIT;
    pc.n_shards = 1;
    pc.tables = t;
    pc.n_tables = 1;
    pc.role = BEX_PS_ROLE_BACKUP;
    CHECK_OK(bex_ps_shard_create(&pc, &r->s));
    CHECK_OK(bex_rpc_server_create(r->ctx, NULL, &r->srv));
    CHECK_OK(bex_ps_shard_register(r->s, r->srv, r->ctx));
    CHECK_OK(bex_addr_parse("127.0.0.1:1", 0, &r->ep.addr));
    return 0;
}

static void rig_down(struct failover_rig *r)
{
    bex_rpc_server_destroy(r->srv);
    bex_ps_shard_destroy(r->s);
    bex_ctx_destroy(r->ctx);
}

struct new_failover_config {
    bex_ps_failover_config now;
    uint64_t later[2];
};

static int failover_sized(void)
{
    struct failover_rig r = {0};
    CHECK_OK(rig_up(&r));
    struct new_failover_config n = {.now = BEX_PS_FAILOVER_CONFIG_INIT};
    n.now.size = sizeof n;
    n.now.etcd_url = "http://127.0.0.1:1";
    n.now.replicas = &r.ep;
    n.now.n_replicas = 1;
    n.later[1] = 1; /* a field this library does not know: refused */
    bex_ps_failover *f;
    CHECK_EQ(bex_ps_failover_start(r.s, r.ctx, &n.now, &f), -EINVAL);
    n.later[1] = 0; /* zero: taken */
    CHECK_OK(bex_ps_failover_start(r.s, r.ctx, &n.now, &f));
    bex_ps_failover_stop(f, false);
    /* an older, smaller struct (without resync_timeout_ms): taken */
    n.now.size = offsetof(bex_ps_failover_config, resync_timeout_ms);
    CHECK_OK(bex_ps_failover_start(r.s, r.ctx, &n.now, &f));
    bex_ps_failover_stop(f, false);
    rig_down(&r);
    return 0;
}

BEX_TEST_MAIN(BEX_CASE(ctx_older), BEX_CASE(mem_older), BEX_CASE(ps_older), BEX_CASE(dir_older),
              BEX_CASE(newer), BEX_CASE(failover_sized))
