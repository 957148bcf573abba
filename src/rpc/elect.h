/* SPDX-License-Identifier: Apache-2.0 */
/* Leases and elections in etcd (dir_elect.c), for the parameter server's
 * primary-backup shards (docs/architecture.md, "Replication", etcd mode).
 *
 * A bex__elect is one etcd lease kept alive by a thread of its own. Its
 * deadline is when the lease may expire at the earliest as far as this
 * process can know: the time the last grant or keep-alive was SENT plus
 * the TTL etcd answered, less a margin; a holder of a key under the lease
 * acts as its holder only before that deadline. */
#ifndef BEX_RPC_ELECT_H
#define BEX_RPC_ELECT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct bex__elect bex__elect;

/* A lease of ttl_ms (whole seconds, rounded up; etcd may grant more) at
 * url, kept alive every third of its TTL; margin_ms taken off every
 * deadline. 0 and *out, or a negative errno with err set. */
int bex__elect_create(const char *url, uint32_t ttl_ms, uint32_t margin_ms, bex__elect **out,
                      char *err, size_t errlen);
/* Stop the keep-alives; revoke: the lease too (its keys go at once),
 * else it expires (as if the process died). */
void bex__elect_destroy(bex__elect *e, bool revoke);
/* The monotonic time (bex__rpc_now_ns) until which the lease is surely
 * held; 0 once it is known lost (etcd answered TTL 0). Any thread. */
uint64_t bex__elect_until_ns(const bex__elect *e);
/* Tests: hold (true) or resume the keep-alives, as a stopped process. */
void bex__elect_hold(bex__elect *e, bool hold);

/* Create key = val under the lease, only if key is absent and guard's
 * mod_revision is guard_rev (0: guard absent; guard NULL: no guard).
 * Returns 1 (won: *epoch the key's create_revision), 0 (key held or the
 * guard moved: *epoch the holder's create_revision or 0, its value in
 * holder), or a negative errno. */
int bex__elect_campaign(bex__elect *e, const char *key, const char *val, const char *guard,
                        uint64_t guard_rev, uint64_t *epoch, char *holder, size_t cap);
/* Read key: 0 and its create and mod revisions (0, 0: absent) and value
 * (truncated to cap - 1), or a negative errno. */
int bex__elect_get(const char *url, const char *key, uint64_t *create_rev, uint64_t *mod_rev,
                   char *val, size_t cap);
/* Put key = val (no lease) only if guard's create_revision is epoch (the
 * holder's term still runs). 0, -ESTALE (guard moved), or a negative
 * errno. */
int bex__elect_put_if(const char *url, const char *key, const char *val, const char *guard,
                      uint64_t epoch);

#endif
