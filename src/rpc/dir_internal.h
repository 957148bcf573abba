/* SPDX-License-Identifier: Apache-2.0 */
/* What the directory (src/rpc/dir.c) offers the RPC channel and its etcd
 * source (src/rpc/etcd.c): nodes by handle, picks with the channel's own
 * exclusions, outcomes with an explicit clock (unit tests drive time). */
#ifndef BEX_RPC_DIR_INTERNAL_H
#define BEX_RPC_DIR_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "bex/dir.h"

/* A node: one address. Lives as long as its directory, so a channel may
 * keep the handle. */
struct bex__dir_node;

/* The channel's exclusions: true to use n only when nothing else is
 * usable. Called under the directory's lock: read only. */
typedef bool (*bex__dir_avoid_fn)(void *arg, const struct bex__dir_node *n);

/* bex_dir_pick with a handle, an avoid callback (may be NULL) and a clock
 * (ns, monotonic). Returns 0 or -ENOENT. */
int bex__dir_pick_node(bex_dir *d, const char *service, uint32_t shard, const char *locality,
                       bex__dir_avoid_fn avoid, void *arg, uint64_t now_ns,
                       struct bex__dir_node **out);
/* bex_dir_report with a handle and a clock. */
void bex__dir_report_node(bex_dir *d, struct bex__dir_node *n, int outcome, bool done,
                          uint64_t now_ns);
void bex__dir_node_info(bex_dir *d, const struct bex__dir_node *n, bex_dir_replica *out);
/* Whether (service, shard) lists n now. */
bool bex__dir_in_shard(bex_dir *d, const char *service, uint32_t shard,
                       const struct bex__dir_node *n);
/* The node at addr, NULL if never seen (tests). */
struct bex__dir_node *bex__dir_node_find(bex_dir *d, const bex_addr *addr);

/* One registration seen in a source: (service, shard) served by r. */
struct bex__dir_member {
    char service[BEX_DIR_NAME_MAX + 1];
    uint32_t shard;
    bex_dir_replica r;
};

/* Replace the contents with members[0..n). Returns 0, -ENOMEM, -ENOSPC
 * (contents unchanged then). */
int bex__dir_set_members(bex_dir *d, const struct bex__dir_member *m, size_t n);
struct bex__log *bex__dir_log(bex_dir *d);

/* Parse "host:port" into addr: host an IPv4 address, an IPv6 one in
 * brackets ("[::1]:5000") or a name, resolved here (getaddrinfo: /etc/hosts,
 * DNS; the first IPv4 or IPv6 answer). Blocks while it resolves. Returns 0,
 * -EINVAL (malformed, port 0), -ENOENT (unknown name) or -EAGAIN (the
 * resolver failed for now); err (may be NULL) says which. */
int bex__dir_parse_addr(const char *s, bex_addr *addr, char *err, size_t errlen);
/* A locality label's checks: printable, no spaces, <= BEX_DIR_LOCALITY_MAX,
 * no empty component. */
bool bex__dir_locality_ok(const char *s);
/* Same-prefix components of two labels: 0 (none) .. all of them. */
unsigned bex__dir_closeness(const char *a, const char *b);

/* A source that feeds the directory (etcd.c's watch): the directory knows
 * it only through these, so etcd.c sits above dir.c. Claim: 0, or -EBUSY
 * when a source has the directory already. Set: the claim is through (src
 * not NULL: the directory stops it with stop(src) when destroyed) or
 * failed (src NULL: the claim is released). */
int bex__dir_source_claim(bex_dir *d);
void bex__dir_source_set(bex_dir *d, void *src, void (*stop)(void *src));
/* Parse one registration's value (JSON) into m's replica. Returns 0 or
 * -EINVAL with err set. */
int bex__dir_parse_replica_json(const char *text, size_t len, bex_dir_replica *r, char *err,
                                size_t errlen);
#endif
