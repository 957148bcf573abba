/* SPDX-License-Identifier: Apache-2.0 */
/* Messages, patterns, clocks and the roles' pipes. See adv.h. */
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "adv.h"

/* Word at a time: under TSan every memory access is instrumented, and
 * these run over every byte of every message several times. */
uint32_t adv_csum(const void *p, size_t n, uint32_t h)
{
    const uint8_t *b = p;
    uint64_t x = h ^ 0xcbf29ce484222325ull;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        x = (x ^ w) * 0x100000001b3ull;
        x ^= x >> 29;
    }
    for (; i < n; i++)
        x = (x ^ b[i]) * 0x100000001b3ull;
    return (uint32_t)(x ^ (x >> 32));
}

static uint32_t pat_next(uint32_t *x)
{
    *x = *x * 1103515245u + 12345u;
    return *x;
}

void adv_pattern(void *p, size_t n, uint32_t seed)
{
    uint8_t *b = p;
    uint32_t x = seed * 2654435761u + 0x9e3779b9u;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        uint32_t w = pat_next(&x);
        memcpy(b + i, &w, 4);
    }
    if (i < n) {
        uint32_t w = pat_next(&x);
        memcpy(b + i, &w, n - i);
    }
}

long adv_pattern_diff(const void *p, size_t n, uint32_t seed)
{
    const uint8_t *b = p;
    uint32_t x = seed * 2654435761u + 0x9e3779b9u;
    for (size_t i = 0; i < n; i += 4) {
        uint32_t w = pat_next(&x), got = 0;
        size_t k = n - i < 4 ? n - i : 4;
        memcpy(&got, b + i, k);
        if (k < 4)
            w &= (1u << (8 * k)) - 1; /* little-endian: the first k bytes */
        if (got != w) {
            for (size_t j = 0; j < k; j++)
                if (((const uint8_t *)&got)[j] != ((const uint8_t *)&w)[j])
                    return (long)(i + j);
        }
    }
    return -1;
}

unsigned adv_timer_scale(void)
{
    return 1 + adv_scale() / 3;
}

unsigned adv_setup_ms(void)
{
    return 4000 * adv_timer_scale();
}

size_t adv_msg_size(uint32_t seq)
{
    /* sanitizer builds (a time scale above 1) move a third of the bytes:
     * the 512 KiB and 1 MiB messages come every 250th, not every 100th */
    uint32_t every = adv_scale() > 1 ? 250 : 100;
    if (seq % every == every - 1)
        return 1u << 20;
    if (seq % every == every / 2 - 1)
        return 512u << 10;
    size_t s = (size_t)16 << (seq % 13); /* 16 B .. 64 KiB */
    if (seq % 3 == 1)
        s += (seq * 7919u) % 1021; /* odd lengths */
    return s;
}

static uint32_t msg_csum(const struct adv_msg_hdr *h, const uint8_t *payload, size_t n)
{
    uint32_t c = adv_csum(&h->len, 4, 2166136261u);
    c = adv_csum(&h->seq, 4, c);
    return adv_csum(payload, n, c);
}

void adv_msg_fill(void *buf, size_t len, uint32_t seq)
{
    struct adv_msg_hdr h = {.magic = ADV_MAGIC, .seq = seq, .len = (uint32_t)len};
    uint8_t *p = buf;
    adv_pattern(p + sizeof h, len - sizeof h, seq);
    h.csum = msg_csum(&h, p + sizeof h, len - sizeof h);
    memcpy(p, &h, sizeof h);
}

int adv_msg_check(const void *buf, size_t len, char *why, size_t cap)
{
    struct adv_msg_hdr h;
    if (len < sizeof h) {
        snprintf(why, cap, "short message: %zu bytes", len);
        return -1;
    }
    memcpy(&h, buf, sizeof h);
    const uint8_t *payload = (const uint8_t *)buf + sizeof h;
    if (h.magic != ADV_MAGIC) {
        snprintf(why, cap, "bad magic 0x%08x", h.magic);
        return -1;
    }
    if (h.len != len) {
        snprintf(why, cap, "seq %u: length %zu, header says %u", h.seq, len, h.len);
        return -1;
    }
    if (msg_csum(&h, payload, len - sizeof h) != h.csum) {
        long at = adv_pattern_diff(payload, len - sizeof h, h.seq);
        snprintf(why, cap, "seq %u len %zu: checksum mismatch (first bad byte %ld)", h.seq, len,
                 at < 0 ? -1 : at + (long)sizeof h);
        return -1;
    }
    if (adv_pattern_diff(payload, len - sizeof h, h.seq) >= 0) {
        snprintf(why, cap, "seq %u len %zu: pattern mismatch", h.seq, len);
        return -1;
    }
    return 0;
}

uint64_t adv_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

void adv_sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) && errno == EINTR)
        ;
}

unsigned adv_scale(void)
{
    const char *s = getenv("BEX_TEST_TIME_SCALE");
    int v = s ? atoi(s) : 1;
    return v >= 1 ? (unsigned)v : 1;
}

long adv_raise_nofile(long want)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r))
        return -1;
    if ((long)r.rlim_cur >= want)
        return (long)r.rlim_cur;
    struct rlimit n = {(rlim_t)want, r.rlim_max > (rlim_t)want ? r.rlim_max : (rlim_t)want};
    if (setrlimit(RLIMIT_NOFILE, &n)) {
        /* not allowed to raise the hard limit: take what it gives */
        n.rlim_cur = r.rlim_max < (rlim_t)want ? r.rlim_max : (rlim_t)want;
        n.rlim_max = r.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &n))
            return (long)r.rlim_cur;
    }
    return (long)n.rlim_cur;
}

long adv_rss_kb(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f)
        return -1;
    long size, res;
    int n = fscanf(f, "%ld %ld", &size, &res);
    fclose(f);
    return n == 2 ? res * (sysconf(_SC_PAGESIZE) / 1024) : -1;
}

int adv_fd_count(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (de->d_name[0] != '.')
            n++;
    closedir(d);
    return n - 1; /* the directory's own fd */
}

/* Connections to a local TCP port the listener has not seen yet, by
 * /proc/net/tcp and tcp6 (the attacker shares the server's network
 * namespace): the server's half-open ones (SYN_RECV, 03: a handshake whose
 * final ACK was dropped while the accept queue was full) and, on the
 * connecting side, sockets closed but not yet acknowledged (FIN_WAIT1, 04;
 * CLOSING, 0B; LAST_ACK, 09): with SYN cookies the server keeps no state
 * for a handshake, and the closed socket's retransmitted FIN completes it
 * and reaches the accept queue seconds after the attacker has gone. */
static int half_open(unsigned port)
{
    static const char *const files[] = {"/proc/net/tcp", "/proc/net/tcp6"};
    int n = 0;
    for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
        FILE *fp = fopen(files[f], "r");
        if (!fp)
            continue;
        char line[512], local[128], remote[128];
        unsigned st;
        while (fgets(line, sizeof line, fp)) {
            char *lc, *rc;
            if (sscanf(line, " %*u: %127s %127s %x", local, remote, &st) != 3 ||
                !(lc = strrchr(local, ':')) || !(rc = strrchr(remote, ':')))
                continue;
            unsigned lport = (unsigned)strtoul(lc + 1, NULL, 16);
            unsigned rport = (unsigned)strtoul(rc + 1, NULL, 16);
            if ((lport == port && st == 0x03) ||
                (rport == port && (st == 0x04 || st == 0x0b || st == 0x09)))
                n++;
        }
        fclose(fp);
    }
    return n;
}

int adv_listen_backlog(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        int fd = atoi(de->d_name), on = 0;
        socklen_t ol = sizeof on;
        struct tcp_info ti;
        socklen_t tl = sizeof ti;
        if (de->d_name[0] == '.' || fd == dirfd(d) ||
            getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &ol) || !on ||
            getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tl))
            continue;
        n += (int)ti.tcpi_unacked; /* of a listening socket: its accept queue */
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
            n += half_open(ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                          : ((struct sockaddr_in *)&ss)->sin_port));
    }
    closedir(d);
    return n;
}

int adv_addrs(struct in_addr *a0, struct in_addr *a1)
{
    const char *s0 = getenv("BEX_TEST_ADDR0"), *s1 = getenv("BEX_TEST_ADDR1");
    if (!s0 || !s1 || !*s0 || !*s1)
        return bex_test_skip("BEX_TEST_ADDR0/1 not set (run under scripts/rxe-vm)");
    if (inet_pton(AF_INET, s0, a0) != 1 || inet_pton(AF_INET, s1, a1) != 1) {
        fprintf(stderr, "FAIL: BEX_TEST_ADDR0=%s / BEX_TEST_ADDR1=%s are not IPv4\n", s0, s1);
        exit(1);
    }
    return 0;
}

/* ---- roles ---- */

int adv_spawn(struct adv_proc *p, const char *name, adv_role_fn fn, void *arg)
{
    int up[2], down[2];
    if (pipe(up) || pipe(down))
        return -errno;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return -errno;
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        /* a role dies with the orchestrator: nothing may outlive a case */
        signal(SIGPIPE, SIG_IGN);
        int rc = fn(down[0], up[1], arg);
        fflush(NULL);
        _exit(rc);
    }
    close(up[1]);
    close(down[0]);
    memset(p, 0, sizeof *p);
    p->name = name;
    p->pid = pid;
    p->rd = up[0];
    p->wr = down[1];
    return 0;
}

int adv_readline(struct adv_proc *p, char *line, size_t cap, unsigned timeout_ms)
{
    uint64_t end = adv_now_ms() + timeout_ms;
    for (;;) {
        char *nl = memchr(p->buf, '\n', p->n);
        if (nl) {
            size_t len = (size_t)(nl - p->buf);
            size_t c = len < cap - 1 ? len : cap - 1;
            memcpy(line, p->buf, c);
            line[c] = 0;
            memmove(p->buf, nl + 1, p->n - len - 1);
            p->n -= len + 1;
            return 0;
        }
        if (p->rd < 0)
            return -EPIPE;
        uint64_t now = adv_now_ms();
        if (now >= end)
            return -ETIMEDOUT;
        struct pollfd pf = {.fd = p->rd, .events = POLLIN};
        int r = poll(&pf, 1, (int)(end - now));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            continue;
        if (p->n == sizeof p->buf) /* a line longer than the buffer: cut it */
            p->buf[p->n - 1] = '\n';
        ssize_t n = read(p->rd, p->buf + p->n, sizeof p->buf - p->n);
        if (n <= 0) {
            close(p->rd);
            p->rd = -1;
            if (p->n && p->buf[p->n - 1] != '\n' && p->n < sizeof p->buf)
                p->buf[p->n++] = '\n';
            continue;
        }
        p->n += (size_t)n;
    }
}

int adv_expect(struct adv_proc *p, const char *prefix, char *line, size_t cap, unsigned timeout_ms)
{
    uint64_t end = adv_now_ms() + timeout_ms;
    size_t pl = strlen(prefix);
    for (;;) {
        uint64_t now = adv_now_ms();
        int rc = adv_readline(p, line, cap, now < end ? (unsigned)(end - now) : 0);
        if (rc)
            return rc;
        if (strncmp(line, prefix, pl) == 0)
            return 0;
        fprintf(stderr, "[%s] %s\n", p->name, line);
    }
}

void adv_cmd(struct adv_proc *p, char c)
{
    if (p->wr >= 0 && write(p->wr, &c, 1) != 1) {
        /* the role is gone; reaping tells why */
    }
}

bool adv_alive(struct adv_proc *p)
{
    if (p->reaped)
        return false;
    int st;
    pid_t w = waitpid(p->pid, &st, WNOHANG);
    if (w == p->pid) {
        p->status = st;
        p->reaped = true;
        return false;
    }
    return true;
}

int adv_reap(struct adv_proc *p, unsigned timeout_ms)
{
    uint64_t end = adv_now_ms() + timeout_ms;
    while (!p->reaped) {
        if (!adv_alive(p))
            break;
        if (adv_now_ms() >= end) {
            fprintf(stderr, "%s (pid %d) did not finish in %u ms: killed\n", p->name, (int)p->pid,
                    timeout_ms);
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &p->status, 0);
            p->reaped = true;
            p->status = -1;
            break;
        }
        adv_sleep_ms(10);
    }
    if (p->wr >= 0)
        close(p->wr);
    p->wr = -1;
    return p->status;
}

void adv_say(int wr, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof line - 2)
        n = (int)sizeof line - 2;
    for (int i = 0; i < n; i++)
        if (line[i] == '\n')
            line[i] = ' ';
    line[n++] = '\n';
    const char *p = line;
    while (n > 0) {
        ssize_t w = write(wr, p, (size_t)n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        p += w;
        n -= (int)w;
    }
}

char adv_get_cmd(int rd, int timeout_ms)
{
    struct pollfd pf = {.fd = rd, .events = POLLIN};
    int r;
    while ((r = poll(&pf, 1, timeout_ms)) < 0 && errno == EINTR)
        ;
    if (r <= 0)
        return 0;
    char c;
    if (read(rd, &c, 1) != 1)
        return 'q'; /* the parent is gone: leave */
    return c;
}
