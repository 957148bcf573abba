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

int bex__dir_parse_addr(const char *s, bex_addr *addr, char *err, size_t errlen)
{
    char why[160];
    int rc = bex_addr_resolve(s, 0, addr, why, sizeof why);
    if (rc == 0 && bex_addr_port(addr) == 0) {
        snprintf(why, sizeof why, "no port (1-65535) in '%s'", s);
        rc = -EINVAL;
    }
    if (rc && err && errlen)
        snprintf(err, errlen, "%s", why);
    return rc;
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

bool bex__dir_same_addr(const bex_addr *a, const bex_addr *b)
{
    return bex_addr_equal(a, b);
}
