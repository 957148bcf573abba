/* SPDX-License-Identifier: Apache-2.0 */
/* The service directory: labels and addresses (parsing and checking). */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "bex/sock.h"
#include "common/log.h"
#include "rpc/dir_internal.h"
#include "rpc/internal.h"
#include "rpc/dir_impl.h"

/* ---- labels and addresses ---- */

int bex__dir_parse_addr(const char *s, struct sockaddr_in *addr)
{
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || (size_t)(colon - s) >= INET_ADDRSTRLEN)
        return -EINVAL;
    char host[INET_ADDRSTRLEN];
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    struct in_addr ia;
    if (inet_pton(AF_INET, host, &ia) != 1)
        return -EINVAL;
    const char *p = colon + 1;
    unsigned long port = 0;
    if (!*p)
        return -EINVAL;
    for (; *p; p++) {
        if (!isdigit((unsigned char)*p))
            return -EINVAL;
        port = port * 10 + (unsigned long)(*p - '0');
        if (port > 65535)
            return -EINVAL;
    }
    if (!port)
        return -EINVAL;
    *addr = (struct sockaddr_in){
        .sin_family = AF_INET, .sin_port = htons((uint16_t)port), .sin_addr = ia};
    return 0;
}

bool bex__dir_locality_ok(const char *s)
{
    size_t n = strlen(s);
    if (n > BEX_DIR_LOCALITY_MAX)
        return false;
    if (n == 0)
        return true;
    if (s[0] == '/' || s[n - 1] == '/' || strstr(s, "//"))
        return false;
    for (const char *p = s; *p; p++)
        if (!isgraph((unsigned char)*p))
            return false;
    return true;
}

unsigned bex__dir_closeness(const char *a, const char *b)
{
    if (!a || !b || !*a || !*b)
        return 0;
    unsigned same = 0;
    for (;;) {
        size_t la = strcspn(a, "/"), lb = strcspn(b, "/");
        if (la != lb || memcmp(a, b, la))
            return same;
        same++;
        if (!a[la] || !b[lb])
            return same;
        a += la + 1;
        b += lb + 1;
    }
}

bool bex__dir_same_addr(const struct sockaddr_in *a, const struct sockaddr_in *b)
{
    return a->sin_addr.s_addr == b->sin_addr.s_addr && a->sin_port == b->sin_port;
}
