/* SPDX-License-Identifier: Apache-2.0 */
/* bex: network addresses, IPv4 or IPv6.
 *
 * Every address the API takes or gives (contexts, connect, listen, RPC,
 * directory, PS) is a bex_addr: a union of the socket address structs, so
 * a program fills the one of its family (.in4 or .in6) and passes .sa to
 * the system's socket calls. AF_UNSPEC (a zeroed bex_addr) is "none". */
#ifndef BEX_ADDR_H
#define BEX_ADDR_H

#include <netinet/in.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#ifdef __cplusplus
extern "C" {
#endif

#pragma GCC visibility push(default)

typedef union bex_addr {
    struct sockaddr sa;      /* sa.sa_family: AF_INET, AF_INET6 or AF_UNSPEC */
    struct sockaddr_in in4;  /* AF_INET */
    struct sockaddr_in6 in6; /* AF_INET6 */
} bex_addr;

/* The longest text bex_addr_format writes: "[" IPv6 "%" scope "]:" port. */
#define BEX_ADDR_STRLEN (INET6_ADDRSTRLEN + 32)

/* An IPv4 address (network order, as in struct in_addr) and port (host
 * order). */
bex_addr bex_addr_ipv4(uint32_t ip_be, uint16_t port);
/* The IPv4 loopback 127.0.0.1 at port. */
bex_addr bex_addr_loopback4(uint16_t port);
/* The IPv6 loopback ::1 at port. */
bex_addr bex_addr_loopback6(uint16_t port);

/* The port in host order (0 for AF_UNSPEC). */
uint16_t bex_addr_port(const bex_addr *a);
/* Set the port (host order); nothing for AF_UNSPEC. */
void bex_addr_set_port(bex_addr *a, uint16_t port);
/* The length of the family's sockaddr (for bind, connect), 0 for others. */
socklen_t bex_addr_len(const bex_addr *a);
/* Whether a is AF_INET or AF_INET6. */
bool bex_addr_valid(const bex_addr *a);
/* Whether a is the wildcard address (0.0.0.0 or ::) or AF_UNSPEC. */
bool bex_addr_is_any(const bex_addr *a);
/* Same family, host and port (the IPv6 scope included). */
bool bex_addr_equal(const bex_addr *a, const bex_addr *b);
/* Same family and host; ports are not compared. */
bool bex_addr_same_host(const bex_addr *a, const bex_addr *b);

/* "a.b.c.d:port" or "[v6]:port" (with_port false: the host alone, IPv6
 * without brackets) into buf (BEX_ADDR_STRLEN is enough; shorter text is
 * cut). Returns buf; "?" for a family it does not know. */
char *bex_addr_format(const bex_addr *a, bool with_port, char *buf, size_t cap);

/* Parse numeric text: "a.b.c.d", "a.b.c.d:port", "v6", "[v6]" or
 * "[v6]:port". With no port in the text the port is default_port.
 * Returns 0 or -EINVAL. Resolves no names (see bex_addr_resolve). */
int bex_addr_parse(const char *text, uint16_t default_port, bex_addr *out);

/* Like bex_addr_parse, but a host that is not numeric is a name looked up
 * with getaddrinfo (/etc/hosts, DNS), IPv4 or IPv6, the first answer
 * taken: "name", "name:port", "[name]:port". Blocks while it looks up.
 * Returns 0, -EINVAL (malformed), -ENOENT (the name is unknown) or
 * -EAGAIN (the resolver failed for now); err (may be NULL) says which. */
int bex_addr_resolve(const char *text, uint16_t default_port, bex_addr *out, char *err,
                     size_t errlen);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif
