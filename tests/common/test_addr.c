/* SPDX-License-Identifier: Apache-2.0 */
/* bex_addr (include/bex/addr.h; issue 27 items 5 and 7): IPv4 and IPv6
 * addresses as text and back, and names resolved with getaddrinfo.
 *  - parse: numeric forms ("a.b.c.d:p", "[v6]:p", bare hosts with the
 *    default port) and what is refused (no host, bad port, names).
 *  - format_compare: the text of each family, equality and same-host.
 *  - resolve_hosts: names from /etc/hosts, IPv4 and IPv6: "localhost",
 *    and two names only a private mount namespace's /etc/hosts has (so
 *    the host's file is untouched); an unknown name is -ENOENT with its
 *    name in the error text. Needs CAP_SYS_ADMIN for the namespace. */
#include <arpa/inet.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>

#include "bex/addr.h"
#include "harness.h"

static int parse(void)
{
    bex_addr a;
    char t[BEX_ADDR_STRLEN];
    CHECK_OK(bex_addr_parse("10.1.2.3:7000", 0, &a));
    CHECK_EQ(a.sa.sa_family, AF_INET);
    CHECK_EQ(bex_addr_port(&a), 7000);
    CHECK(!strcmp(bex_addr_format(&a, true, t, sizeof t), "10.1.2.3:7000"));
    CHECK_OK(bex_addr_parse("[fd99::2]:5000", 0, &a));
    CHECK_EQ(a.sa.sa_family, AF_INET6);
    CHECK_EQ(bex_addr_port(&a), 5000);
    CHECK_EQ(bex_addr_len(&a), sizeof(struct sockaddr_in6));
    CHECK(!strcmp(bex_addr_format(&a, true, t, sizeof t), "[fd99::2]:5000"));
    CHECK(!strcmp(bex_addr_format(&a, false, t, sizeof t), "fd99::2"));
    CHECK_OK(bex_addr_parse("::1", 9, &a)); /* bare IPv6: no port in it */
    CHECK_EQ(a.sa.sa_family, AF_INET6);
    CHECK_EQ(bex_addr_port(&a), 9);
    CHECK_OK(bex_addr_parse("[::]", 0, &a));
    CHECK(bex_addr_is_any(&a));
    CHECK_OK(bex_addr_parse("127.0.0.1", 80, &a));
    CHECK_EQ(bex_addr_port(&a), 80);
    const char *bad[] = {"",       ":80",    "1.2.3.4:", "1.2.3.4:65536", "1.2.3.4:8x", "[::1",
                         "[::1]x", "[::1]:", "1.2.3:80", "localhost:80",  "[]:1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        if (bex_addr_parse(bad[i], 0, &a) != -EINVAL) {
            fprintf(stderr, "'%s' was taken\n", bad[i]);
            return 1;
        }
    }
    CHECK_EQ(bex_addr_parse(NULL, 0, &a), -EINVAL);
    return 0;
}

static int format_compare(void)
{
    bex_addr a = bex_addr_loopback4(1), b = bex_addr_loopback6(1), c = bex_addr_loopback6(2);
    char t[BEX_ADDR_STRLEN];
    CHECK(!strcmp(bex_addr_format(&a, true, t, sizeof t), "127.0.0.1:1"));
    CHECK(!strcmp(bex_addr_format(&b, true, t, sizeof t), "[::1]:1"));
    CHECK(!bex_addr_equal(&a, &b));
    CHECK(!bex_addr_equal(&b, &c));
    CHECK(bex_addr_same_host(&b, &c));
    bex_addr_set_port(&c, 1);
    CHECK(bex_addr_equal(&b, &c));
    bex_addr none = {0};
    CHECK(!bex_addr_valid(&none) && bex_addr_is_any(&none));
    CHECK_EQ(bex_addr_len(&none), 0);
    CHECK(!strcmp(bex_addr_format(&none, true, t, sizeof t), "?"));
    char small[6];
    bex_addr_format(&b, true, small, sizeof small); /* cut, terminated */
    CHECK_EQ(strlen(small), sizeof small - 1);
    return 0;
}

/* /etc/hosts of this process only: a private mount namespace with a file
 * bound over it. 0, or 1 when the process may not (no CAP_SYS_ADMIN). */
static int private_hosts(const char *text)
{
    if (unshare(CLONE_NEWNS) || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL))
        return 1;
    char path[] = "/tmp/bex-hosts-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    close(fd);
    CHECK(mount(path, "/etc/hosts", NULL, MS_BIND, NULL) == 0);
    unlink(path); /* the mount keeps it */
    return 0;
}

static int resolve_hosts(void)
{
    bex_addr a;
    char err[256] = "", t[BEX_ADDR_STRLEN];
    CHECK_OK(bex_addr_resolve("localhost:7000", 0, &a, err, sizeof err));
    CHECK(a.sa.sa_family == AF_INET || a.sa.sa_family == AF_INET6);
    CHECK_EQ(bex_addr_port(&a), 7000);
    CHECK_OK(bex_addr_resolve("[::1]:7", 0, &a, err, sizeof err)); /* numeric: no lookup */
    CHECK_EQ(a.sa.sa_family, AF_INET6);
    if (private_hosts("127.0.0.1 localhost\n"
                      "fd99::7 bex-v6.test\n"
                      "10.9.8.7 bex-v4.test\n")) {
        fprintf(stderr, "resolve_hosts: no private mount namespace (needs CAP_SYS_ADMIN)\n");
        return bex_test_skip("no private /etc/hosts");
    }
    CHECK_OK(bex_addr_resolve("bex-v6.test:5000", 0, &a, err, sizeof err));
    CHECK(!strcmp(bex_addr_format(&a, true, t, sizeof t), "[fd99::7]:5000"));
    CHECK_OK(bex_addr_resolve("[bex-v6.test]:6000", 0, &a, err, sizeof err));
    CHECK_EQ(bex_addr_port(&a), 6000);
    CHECK_OK(bex_addr_resolve("bex-v4.test", 4, &a, err, sizeof err));
    CHECK(!strcmp(bex_addr_format(&a, true, t, sizeof t), "10.9.8.7:4"));
    CHECK_EQ(bex_addr_resolve("bex-none.invalid:1", 0, &a, err, sizeof err), -ENOENT);
    fprintf(stderr, "%s\n", err);
    CHECK(strstr(err, "bex-none.invalid"));
    CHECK_EQ(bex_addr_resolve("bex-v4.test:99999", 0, &a, err, sizeof err), -EINVAL);
    CHECK_EQ(bex_addr_resolve("1.2.3:80", 0, &a, err, sizeof err), -EINVAL); /* not 1.2.0.3 */
    return 0;
}

BEX_TEST_MAIN({"parse", parse}, {"format_compare", format_compare},
              {"resolve_hosts", resolve_hosts})
