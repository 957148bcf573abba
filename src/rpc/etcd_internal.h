/* SPDX-License-Identifier: Apache-2.0 */
/* etcd's JSON gateway calls (etcd.c) for the election (dir_elect.c). */
#ifndef BEX_RPC_ETCD_INTERNAL_H
#define BEX_RPC_ETCD_INTERNAL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* POST body to url + path (one call, bounded by etcd.c's OP_TIMEOUT_MS);
 * 0 and *out (the answer's JSON, the caller's), or a negative errno with
 * err set. */
int bex__etcd_call(const char *url, const char *path, json_t *body, json_t **out, char *err,
                   size_t errlen);
/* base64 of a C string / decoded (NUL-terminated); NULL on failure. */
char *bex__etcd_b64(const char *s);
char *bex__etcd_unb64(const char *s, size_t *len);
/* etcd's 64-bit numbers (strings in JSON). */
int64_t bex__etcd_num(json_t *v);

#endif
