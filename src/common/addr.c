/* SPDX-License-Identifier: Apache-2.0 */
/* Network addresses (include/bex/addr.h): building, comparing, text. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>

#include "bex/addr.h"

bex_addr bex_addr_ipv4(uint32_t ip_be, uint16_t port)
{
    bex_addr a = {.in4 = {.sin_family = AF_INET, .sin_port = htons(port)}};
    a.in4.sin_addr.s_addr = ip_be;
    return a;
}

bex_addr bex_addr_loopback4(uint16_t port)
{
    return bex_addr_ipv4(htonl(INADDR_LOOPBACK), port);
}

bex_addr bex_addr_loopback6(uint16_t port)
{
    bex_addr a = {.in6 = {.sin6_family = AF_INET6, .sin6_port = htons(port)}};
    a.in6.sin6_addr = in6addr_loopback;
    return a;
}

uint16_t bex_addr_port(const bex_addr *a)
{
    if (a->sa.sa_family == AF_INET)
        return ntohs(a->in4.sin_port);
    if (a->sa.sa_family == AF_INET6)
        return ntohs(a->in6.sin6_port);
    return 0;
}

void bex_addr_set_port(bex_addr *a, uint16_t port)
{
    if (a->sa.sa_family == AF_INET)
        a->in4.sin_port = htons(port);
    else if (a->sa.sa_family == AF_INET6)
        a->in6.sin6_port = htons(port);
}

socklen_t bex_addr_len(const bex_addr *a)
{
    if (a->sa.sa_family == AF_INET)
        return sizeof a->in4;
    if (a->sa.sa_family == AF_INET6)
        return sizeof a->in6;
    return 0;
}

bool bex_addr_valid(const bex_addr *a)
{
    return a->sa.sa_family == AF_INET || a->sa.sa_family == AF_INET6;
}

bool bex_addr_is_any(const bex_addr *a)
{
    if (a->sa.sa_family == AF_INET)
        return a->in4.sin_addr.s_addr == htonl(INADDR_ANY);
    if (a->sa.sa_family == AF_INET6)
        return IN6_IS_ADDR_UNSPECIFIED(&a->in6.sin6_addr);
    return true;
}

bool bex_addr_same_host(const bex_addr *a, const bex_addr *b)
{
    if (a->sa.sa_family != b->sa.sa_family)
        return false;
    if (a->sa.sa_family == AF_INET)
        return a->in4.sin_addr.s_addr == b->in4.sin_addr.s_addr;
    if (a->sa.sa_family == AF_INET6)
        return !memcmp(&a->in6.sin6_addr, &b->in6.sin6_addr, 16) &&
               a->in6.sin6_scope_id == b->in6.sin6_scope_id;
    return a->sa.sa_family == AF_UNSPEC;
}

bool bex_addr_equal(const bex_addr *a, const bex_addr *b)
{
    return bex_addr_same_host(a, b) && bex_addr_port(a) == bex_addr_port(b);
}

char *bex_addr_format(const bex_addr *a, bool with_port, char *buf, size_t cap)
{
    char host[INET6_ADDRSTRLEN] = "?";
    if (!cap)
        return buf;
    if (a->sa.sa_family == AF_INET)
        inet_ntop(AF_INET, &a->in4.sin_addr, host, sizeof host);
    else if (a->sa.sa_family == AF_INET6)
        inet_ntop(AF_INET6, &a->in6.sin6_addr, host, sizeof host);
    else {
        snprintf(buf, cap, "?");
        return buf;
    }
    char scope[16] = "";
    if (a->sa.sa_family == AF_INET6 && a->in6.sin6_scope_id)
        snprintf(scope, sizeof scope, "%%%u", (unsigned)a->in6.sin6_scope_id);
    bool v6 = a->sa.sa_family == AF_INET6;
    if (!with_port)
        snprintf(buf, cap, "%s%s", host, scope);
    else
        snprintf(buf, cap, "%s%s%s%s:%u", v6 ? "[" : "", host, scope, v6 ? "]" : "",
                 (unsigned)bex_addr_port(a));
    return buf;
}

/* Split text into host and port text: "h", "h:p", "[h]", "[h]:p", or an
 * IPv6 address without brackets (two colons or more: no port). */
static int addr_split(const char *text, char *host, size_t hcap, const char **port)
{
    const char *h = text, *end;
    *port = NULL;
    if (*text == '[') {
        h = text + 1;
        end = strchr(h, ']');
        if (!end || (end[1] && end[1] != ':'))
            return -EINVAL;
        if (end[1] == ':')
            *port = end + 2;
    } else {
        const char *c = strchr(text, ':');
        if (c && !strchr(c + 1, ':')) {
            end = c;
            *port = c + 1;
        } else
            end = text + strlen(text);
    }
    size_t n = (size_t)(end - h);
    if (!n || n >= hcap)
        return -EINVAL;
    memcpy(host, h, n);
    host[n] = 0;
    return 0;
}

static int addr_port(const char *p, uint16_t dflt, uint16_t *out)
{
    if (!p) {
        *out = dflt;
        return 0;
    }
    unsigned long v = 0;
    if (!*p)
        return -EINVAL;
    for (; *p; p++) {
        if (!isdigit((unsigned char)*p))
            return -EINVAL;
        v = v * 10 + (unsigned long)(*p - '0');
        if (v > 65535)
            return -EINVAL;
    }
    *out = (uint16_t)v;
    return 0;
}

/* A numeric host: 1 (parsed into out), 0 (not numeric). */
static int addr_numeric(const char *host, uint16_t port, bex_addr *out)
{
    bex_addr a = {0};
    if (inet_pton(AF_INET, host, &a.in4.sin_addr) == 1)
        a.sa.sa_family = AF_INET;
    else if (inet_pton(AF_INET6, host, &a.in6.sin6_addr) == 1)
        a.sa.sa_family = AF_INET6;
    else
        return 0;
    bex_addr_set_port(&a, port);
    *out = a;
    return 1;
}

int bex_addr_parse(const char *text, uint16_t default_port, bex_addr *out)
{
    char host[256];
    const char *ptext;
    uint16_t port;
    if (!text || !out || addr_split(text, host, sizeof host, &ptext) ||
        addr_port(ptext, default_port, &port))
        return -EINVAL;
    return addr_numeric(host, port, out) ? 0 : -EINVAL;
}

/* "<what> '<host>'<why>" into err (may be NULL); returns rc. */
static int addr_err(char *err, size_t errlen, int rc, const char *what, const char *host,
                    const char *why)
{
    if (err && errlen)
        snprintf(err, errlen, "%s '%s'%s", what, host, why);
    return rc;
}

int bex_addr_resolve(const char *text, uint16_t default_port, bex_addr *out, char *err,
                     size_t errlen)
{
    char host[256];
    const char *ptext;
    uint16_t port;
    if (!text || !out || addr_split(text, host, sizeof host, &ptext) ||
        addr_port(ptext, default_port, &port))
        return addr_err(err, errlen, -EINVAL, "bad address", text ? text : "(null)", "");
    if (addr_numeric(host, port, out))
        return 0;
    if (strspn(host, "0123456789.") == strlen(host)) /* getaddrinfo takes "1.2.3" as 1.2.0.3 */
        return addr_err(err, errlen, -EINVAL, "bad address", text, ": not a.b.c.d");
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int g = getaddrinfo(host, NULL, &hints, &res);
    char why[128];
    snprintf(why, sizeof why, ": %s", g ? gai_strerror(g) : "");
    if (g == EAI_NONAME || g == EAI_NODATA || g == EAI_FAMILY)
        return addr_err(err, errlen, -ENOENT, "unknown host", host, why);
    if (g)
        return addr_err(err, errlen, -EAGAIN, "cannot resolve", host, why);
    int rc = -ENOENT;
    for (struct addrinfo *ai = res; ai && rc; ai = ai->ai_next) {
        if ((ai->ai_family == AF_INET && ai->ai_addrlen >= sizeof out->in4) ||
            (ai->ai_family == AF_INET6 && ai->ai_addrlen >= sizeof out->in6)) {
            *out = (bex_addr){0};
            memcpy(out, ai->ai_addr, ai->ai_family == AF_INET ? sizeof out->in4 : sizeof out->in6);
            bex_addr_set_port(out, port);
            rc = 0;
        }
    }
    freeaddrinfo(res);
    return rc ? addr_err(err, errlen, rc, "unknown host", host, ": no IPv4 or IPv6 address") : 0;
}
