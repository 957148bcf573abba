/* SPDX-License-Identifier: Apache-2.0 */
/* etcd's connection settings (etcd_tls.c) for etcd.c's requests. */
#ifndef BEX_RPC_ETCD_TLS_H
#define BEX_RPC_ETCD_TLS_H

#include <curl/curl.h>
#include <stdbool.h>

/* Apply the process's TLS settings to e, a request to etcd at url, and
 * append the authentication header to *hdrs when etcd's authentication
 * is configured (fetching a token from url first when there is none). */
void bex__etcd_http_setup(CURL *e, const char *url, struct curl_slist **hdrs);

/* etcd answered code with body: true when it refused a token this
 * process fetched (which is then forgotten: the next request fetches
 * another), so the request is worth one more try. */
bool bex__etcd_token_refused(long code, const char *body);

#endif
