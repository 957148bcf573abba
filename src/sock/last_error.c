/* SPDX-License-Identifier: Apache-2.0 */
/* bex_sock_last_error: a socket's failure as text. */
#include <arpa/inet.h>
#include <stdio.h>

#include "internal.h"

int bex_sock_last_error(const bex_sock *s, char *buf, size_t cap)
{
    int err = atomic_load(&s->last_err);
    if (!buf || !cap)
        return err;
    if (!err) {
        snprintf(buf, cap, "no error");
        return 0;
    }
    char ip[BEX_ADDR_STRLEN];
    snprintf(buf, cap, "peer %s: %s%s", bex_addr_format(&s->peer, true, ip, sizeof ip),
             atomic_load(&s->last_connecting) ? "connecting: " : "", bex_strerror(err));
    return err;
}
