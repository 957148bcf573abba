/* The adversarial suite (label `adversary`): a listener serving good
 * clients while an attacker abuses it. See adv.h for the processes and
 * docs/testing.md for every case and what it asserts.
 *
 * Each case passes only if, all at once:
 *   - the listener process is alive after the attack and its teardown
 *     (close every socket, bex_listener_close, bex_ctx_destroy) succeeds;
 *   - the good clients' messages all came back intact (length compared,
 *     checksummed, every byte) and on time: the early client (connected
 *     before the attack, at least 1000 messages of 16 B .. 1 MiB, running
 *     through it) and a late one (connecting while the attack is underway);
 *   - the server's RSS and its pool's in-use bytes stayed under the bounds
 *     below, and its fds and engines went back to what the good clients use;
 *   - every abusive connection the server had to refuse was closed, and its
 *     error logged once: one WARN/ERROR line naming the peer's
 *     address:port, none that names nobody;
 *   - nothing was written outside payload memory: the server's canaries
 *     (pool buffers on its I/O and main threads) and the received buffers it
 *     holds are intact, and every good message verified on arrival and again
 *     after its echo. */
#include <ctype.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "adv.h"
#include "bex/common.h"

/* Stated bounds, over the server's own use right after it started
 * listening. The good clients alone take RSS +10..18 MiB (+62 MiB under
 * TSan) and pool +4..6 MiB; the server's limits (server.c: 32 MiB of
 * rendezvous destinations per peer, 48 MiB received) keep an attacker
 * under the rest. */
#define RSS_BOUND_KB (192L << 10)
#define POOL_BOUND   ((size_t)64 << 20)
#define FDS_SLACK    8
#define GOOD_MIN     1000 /* messages of the early client */
#define LATE_MIN     200  /* messages of the late client */
#define MAX_PORTS    8192

enum log_rule {
    LOG_EACH,  /* every abusive connection the server refused: exactly one
                  line naming it, and no line naming nobody */
    LOG_FLOOD, /* many connections: none named twice; a flood may be
                  summarised (at most FLOOD_LINES lines naming nobody);
                  at least one line says why */
    LOG_ANY,   /* nothing required; none named twice, at most FLOOD_LINES
                  naming nobody */
};
#define FLOOD_LINES 3

struct adv_case {
    adv_attack_fn fn; /* NULL: no attack (baseline) */
    enum log_rule log;
    bool close_each;  /* every abusive connection must be closed by the server */
    bool killed;      /* the attacker ends by SIGKILL */
    bool secret;      /* the server has a secret: the good clients and a
                         protocol-level attacker know it */
    const char *keys; /* '|'-separated words; a refusal line must have one.
                         None for bad keys: the server's NIC refuses those,
                         and on rxe the server only sees its QP fail */
};

/* ---- failures are collected, so that a run lists all of them ---- */

static int nfail;
static void failf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void failf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAILED CHECK: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    nfail++;
}

/* ---- what the attacker said ---- */

struct ports {
    uint16_t p[MAX_PORTS];
    int n;
};

static void ports_add(struct ports *s, unsigned port)
{
    for (int i = 0; i < s->n; i++)
        if (s->p[i] == port)
            return;
    if (s->n < MAX_PORTS)
        s->p[s->n++] = (uint16_t)port;
}

static bool ports_has(const struct ports *s, unsigned port)
{
    for (int i = 0; i < s->n; i++)
        if (s->p[i] == port)
            return true;
    return false;
}

static struct ports conns, closed, accepted, killed;

/* ---- the server's report ---- */

#define MAX_LOG 4096
struct report {
    bool ok;
    long rss_base_kb, rss_peak_kb, fds_base, fds_now, engines, canaries, canary_bad, held, held_bad,
        held_large_bad, good_msgs, good_bad, echo_bad, log_lost;
    size_t pool_base, pool_peak, pool_now;
    char *log[MAX_LOG];
    int level[MAX_LOG];
    int nlog;
};

static void report_free(struct report *r)
{
    for (int i = 0; i < r->nlog; i++)
        free(r->log[i]);
    memset(r, 0, sizeof *r);
}

static int get_report(struct adv_proc *srv, struct report *r, unsigned scale, bool quiet)
{
    report_free(r);
    adv_cmd(srv, 'r');
    char line[1200];
    for (;;) {
        int rc = adv_readline(srv, line, sizeof line, 20000 * scale);
        if (rc)
            return rc;
        if (!strcmp(line, "end"))
            break;
        char key[64];
        long long v;
        if (!strncmp(line, "log ", 4)) {
            int lv = atoi(line + 4);
            const char *t = strchr(line + 4, ' ');
            if (r->nlog < MAX_LOG) {
                r->level[r->nlog] = lv;
                r->log[r->nlog++] = strdup(t ? t + 1 : "");
            }
            continue;
        }
        if (!strncmp(line, "note ", 5) || !strncmp(line, "guard ", 6)) {
            if (!quiet)
                fprintf(stderr, "[server] %s\n", line);
            continue;
        }
        if (sscanf(line, "%63s %lld", key, &v) != 2)
            continue;
#define K(name)                                                                                    \
    if (!strcmp(key, #name))                                                                       \
        r->name = (__typeof__(r->name))v;
        K(rss_base_kb);
        K(rss_peak_kb);
        K(fds_base);
        K(fds_now);
        K(engines);
        K(canaries);
        K(canary_bad);
        K(held);
        K(held_bad);
        K(held_large_bad);
        K(good_msgs);
        K(good_bad);
        K(echo_bad);
        K(log_lost);
        K(pool_base);
        K(pool_peak);
        K(pool_now);
#undef K
    }
    r->ok = true;
    return 0;
}

/* The port named after "<addr>:" in a line, among the attacker's; 0 if none. */
static unsigned line_port(const char *line, const char *addr)
{
    size_t al = strlen(addr);
    for (const char *p = strstr(line, addr); p; p = strstr(p + 1, addr)) {
        if (p[al] != ':' || !isdigit((unsigned char)p[al + 1]))
            continue;
        unsigned port = (unsigned)strtoul(p + al + 1, NULL, 10);
        if (ports_has(&conns, port))
            return port;
    }
    return 0;
}

static bool has_key(const char *line, const char *keys)
{
    char low[1200];
    size_t i;
    for (i = 0; line[i] && i < sizeof low - 1; i++)
        low[i] = (char)tolower((unsigned char)line[i]);
    low[i] = 0;
    char k[256];
    snprintf(k, sizeof k, "%s", keys);
    for (char *save, *w = strtok_r(k, "|", &save); w; w = strtok_r(NULL, "|", &save))
        if (strstr(low, w))
            return true;
    return false;
}

static void check_log(const struct adv_case *c, const struct report *r, const char *addr)
{
    static int per[65536];
    memset(per, 0, sizeof per);
    int unattributed = 0, attributed = 0, keyed = 0;
    for (int i = 0; i < r->nlog; i++) {
        if (r->level[i] > BEX_LOG_WARN || strstr(r->log[i], "suppressed"))
            continue;
        unsigned port = line_port(r->log[i], addr);
        bool why = c->keys && has_key(r->log[i], c->keys);
        if (!port) {
            /* a flood may be summarised; anything else must name its peer */
            if (c->fn && c->log != LOG_EACH && ++unattributed <= FLOOD_LINES) {
                keyed += why;
                continue;
            }
            failf("a log line names no abusive peer (%s:<port>): \"%s\"", addr, r->log[i]);
            continue;
        }
        attributed++;
        keyed += why;
        if (++per[port] == 2)
            failf("connection %s:%u logged more than once: \"%s\"", addr, port, r->log[i]);
    }
    if (!c->fn)
        return;
    /* a connection whose every abuse was accepted (it wrote into payload
     * memory it may write) need not be refused, nor logged */
    int refused = 0;
    for (int i = 0; i < conns.n; i++) {
        unsigned port = conns.p[i];
        if (ports_has(&accepted, port))
            continue;
        refused++;
        if (c->log == LOG_EACH && per[port] == 0)
            failf("refused connection %s:%u: no log line names it", addr, port);
    }
    if (c->log == LOG_FLOOD && refused && attributed + unattributed == 0)
        failf("nothing logged about the flood");
    if (c->log != LOG_ANY && refused && c->keys && attributed + unattributed && !keyed)
        failf("no log line says why (one of: %s)", c->keys);
}

/* ---- one case ---- */

struct atk_arg {
    adv_attack_fn fn;
    struct adv_attack_ctx ac;
};

static int attacker_main(int rd, int wr, void *arg)
{
    struct atk_arg *x = arg;
    x->ac.rd = rd;
    x->ac.wr = wr;
    return x->fn(&x->ac);
}

static int run_case(const struct adv_case *c)
{
    struct in_addr a0, a1;
    int rc = adv_addrs(&a0, &a1);
    if (rc)
        return rc;
    char addr1[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &a1, addr1, sizeof addr1);
    signal(SIGPIPE, SIG_IGN);
    unsigned sc = adv_scale();
    char line[1200];
    nfail = 0;

    const char *secret = c->secret ? ADV_SECRET : NULL;
    struct adv_server_opts so = {.secret = secret};
    struct adv_proc srv, good, late, atk;
    bool have_late = false, have_atk = false;
    CHECK(adv_spawn(&srv, "server", adv_server_main, &so) == 0);
    if (adv_expect(&srv, "port ", line, sizeof line, 30000 * sc)) {
        fprintf(stderr, "the server did not start\n");
        adv_reap(&srv, 1000);
        return 1;
    }
    uint16_t port = (uint16_t)atoi(line + 5);

    struct adv_good_opts go = {
        .secret = secret, .port = port, .min_msgs = GOOD_MIN, .wait_go = true};
    CHECK(adv_spawn(&good, "good", adv_good_main, &go) == 0);
    if (adv_expect(&good, "ready", line, sizeof line, 30000 * sc) || strncmp(line, "ready", 5)) {
        failf("the early good client did not connect before the attack");
        goto stop;
    }
    adv_cmd(&good, 'g');
    adv_sleep_ms(300);

    struct adv_good_opts lo = {
        .secret = secret, .port = port, .min_msgs = LATE_MIN, .seq0 = 1u << 20};
    if (c->fn) {
        struct atk_arg aa = {.fn = c->fn,
                             .ac = {.local = a1, .srv_addr = a0, .port = port, .secret = secret}};
        CHECK(adv_spawn(&atk, "attacker", attacker_main, &aa) == 0);
        have_atk = true;
    } else {
        CHECK(adv_spawn(&late, "late", adv_good_main, &lo) == 0);
        have_late = true;
    }
    if (have_atk) {
        for (;;) {
            int r = adv_readline(&atk, line, sizeof line, 180000 * sc);
            if (r == -ETIMEDOUT) {
                failf("the attacker did not finish");
                break;
            }
            if (r)
                break; /* its pipe closed: done, or killed */
            unsigned p;
            if (sscanf(line, "conn %u", &p) == 1)
                ports_add(&conns, p);
            else if (sscanf(line, "closed %u", &p) == 1)
                ports_add(&closed, p);
            else if (sscanf(line, "accepted %u", &p) == 1)
                ports_add(&accepted, p);
            else if (sscanf(line, "killed %u", &p) == 1)
                ports_add(&killed, p);
            else if (sscanf(line, "leak %u", &p) == 1)
                failf("the server sent its hello (QPN, GID, keepalive rkey) to "
                      "unauthenticated connection %s:%u",
                      addr1, p);
            else if (!strcmp(line, "underway")) {
                if (!have_late) {
                    CHECK(adv_spawn(&late, "late", adv_good_main, &lo) == 0);
                    have_late = true;
                }
            } else if (!strcmp(line, "done")) {
                break;
            } else {
                fprintf(stderr, "[attacker] %s\n", line);
                if (!strncmp(line, "fail", 4))
                    failf("the attacker could not do its job: %s", line);
            }
        }
        int st = adv_reap(&atk, 30000 * sc);
        if (c->killed) {
            if (!(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL))
                failf("the attacker was to die by SIGKILL (status 0x%x)", st);
        } else if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
            failf("the attacker failed (status 0x%x)", st);
        }
        if (!have_late) {
            failf("the attack never got underway");
        }
    }
    if (have_late) {
        if (adv_expect(&late, "result", line, sizeof line, 120000 * sc))
            failf("the late good client gave no result");
        else if (strncmp(line, "result ok", 9))
            failf("late good client: %s", line);
        else
            fprintf(stderr, "late good client: %s\n", line);
    }
    adv_cmd(&good, 's');
    if (adv_expect(&good, "result", line, sizeof line, 120000 * sc))
        failf("the early good client gave no result");
    else if (strncmp(line, "result ok", 9))
        failf("early good client: %s", line);
    else
        fprintf(stderr, "early good client: %s\n", line);

stop:;
    /* the server: alive, back to the good clients' engines, then report */
    struct report r = {0};
    unsigned want_engines = 1 + have_late;
    if (!adv_alive(&srv)) {
        while (adv_readline(&srv, line, sizeof line, 100) == 0)
            fprintf(stderr, "[server] %s\n", line);
        failf("the listener process died (status 0x%x)", srv.status);
    } else {
        uint64_t end = adv_now_ms() + 15000ull * sc;
        while (get_report(&srv, &r, sc, true) == 0 && (unsigned long)r.engines > want_engines &&
               adv_now_ms() < end)
            adv_sleep_ms(200);
        if (!r.ok || get_report(&srv, &r, sc, false)) {
            failf("the server did not report");
        }
    }
    if (r.ok) {
        fprintf(stderr,
                "server: rss +%ld KiB (peak), pool +%zu KiB (peak), %ld good messages, "
                "%d log lines, engines %ld, fds %ld (started with %ld)\n",
                r.rss_peak_kb - r.rss_base_kb, (r.pool_peak - r.pool_base) >> 10, r.good_msgs,
                r.nlog, r.engines, r.fds_now, r.fds_base);
        for (int i = 0; i < r.nlog; i++)
            fprintf(stderr, "  server log [%d] %s\n", r.level[i], r.log[i]);
        if (r.rss_peak_kb - r.rss_base_kb > RSS_BOUND_KB)
            failf("server RSS grew by %ld KiB, bound %ld KiB", r.rss_peak_kb - r.rss_base_kb,
                  RSS_BOUND_KB);
        if (r.pool_peak - r.pool_base > POOL_BOUND)
            failf("pool in-use grew by %zu KiB, bound %zu KiB", (r.pool_peak - r.pool_base) >> 10,
                  POOL_BOUND >> 10);
        if ((unsigned long)r.engines > want_engines)
            failf("%ld engines left after the attack, the good clients have %u", r.engines,
                  want_engines);
        if (r.fds_now > r.fds_base + FDS_SLACK)
            failf("%ld fds open after the attack, %ld before", r.fds_now, r.fds_base);
        if (r.canaries < 10)
            failf("only %ld canaries were placed", r.canaries);
        if (r.canary_bad)
            failf("%ld canaries overwritten", r.canary_bad);
        if (r.held_bad)
            failf("%ld received SEND buffers held by the application changed", r.held_bad);
        if (r.held_large_bad)
            failf("%ld delivered rendezvous buffers held by the application changed",
                  r.held_large_bad);
        if (r.good_bad || r.echo_bad)
            failf("%ld good messages arrived damaged, %ld changed while bex held their echo",
                  r.good_bad, r.echo_bad);
        if (r.good_msgs < GOOD_MIN)
            failf("the server saw %ld good messages, fewer than %d", r.good_msgs, GOOD_MIN);
        if (r.log_lost)
            failf("%ld log lines beyond the capture", r.log_lost);
        check_log(c, &r, addr1);
    }
    if (c->fn && c->close_each) {
        for (int i = 0; i < conns.n; i++) {
            unsigned p = conns.p[i];
            if (ports_has(&closed, p) || ports_has(&accepted, p) || ports_has(&killed, p))
                continue;
            failf("abusive connection %s:%u was not closed by the server", addr1, p);
        }
    }
    fprintf(stderr, "attacker: %d connections, %d closed by the server, %d abuses accepted\n",
            conns.n, closed.n, accepted.n);

    /* teardown: the clients first (their closes must not be logged as
     * errors: the report is taken), then the server's own */
    adv_cmd(&good, 'q');
    if (have_late)
        adv_cmd(&late, 'q');
    int st = adv_reap(&good, 30000 * sc);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        failf("the early good client failed its teardown (status 0x%x)", st);
    if (have_late) {
        st = adv_reap(&late, 30000 * sc);
        if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
            failf("the late good client failed its teardown (status 0x%x)", st);
    }
    if (!srv.reaped) {
        adv_cmd(&srv, 'q');
        st = adv_reap(&srv, 60000 * sc);
        while (adv_readline(&srv, line, sizeof line, 100) == 0)
            fprintf(stderr, "[server] %s\n", line);
        if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
            failf("the server failed its teardown (status 0x%x)", st);
    }
    report_free(&r);
    if (nfail)
        fprintf(stderr, "%d checks failed\n", nfail);
    return nfail ? 1 : 0;
}

/* ---- the cases ---- */

#define CASE(name, ...)                                                                            \
    static int name(void)                                                                          \
    {                                                                                              \
        static const struct adv_case c_ = {__VA_ARGS__};                                           \
        return run_case(&c_);                                                                      \
    }

CASE(baseline, .fn = NULL)
CASE(random_bytes, .fn = adv_attack_random_bytes, .log = LOG_EACH, .close_each = true,
     .keys = "hello|protocol|magic|malformed|invalid")
CASE(truncated_hello, .fn = adv_attack_truncated_hello, .log = LOG_EACH, .close_each = true,
     .keys = "timed out|timeout|deadline|setup")
CASE(absurd_hello, .fn = adv_attack_absurd_hello, .log = LOG_EACH, .close_each = true,
     .keys = "hello|protocol|invalid|refus|malformed")
CASE(idle_conns, .fn = adv_attack_idle_conns, .log = LOG_FLOOD, .close_each = false,
     .keys = "timed out|timeout|setup|limit|too many")
CASE(connect_close, .fn = adv_attack_connect_close, .log = LOG_ANY, .close_each = false)
CASE(rndv_huge, .fn = adv_attack_rndv_huge, .secret = true, .log = LOG_EACH, .close_each = true,
     .keys = "rendezvous|max_msg|too large|size|limit")
CASE(rndv_endless, .fn = adv_attack_rndv_endless, .secret = true, .log = LOG_EACH,
     .close_each = true, .keys = "rendezvous|limit|max_rndv|too many")
CASE(streams, .fn = adv_attack_streams, .secret = true, .log = LOG_EACH, .close_each = true,
     .keys = "stream|limit|too many")
CASE(no_credits, .fn = adv_attack_no_credits, .secret = true, .log = LOG_EACH, .close_each = true,
     .keys = "credit|timed out|timeout")
CASE(recv_depth_1, .fn = adv_attack_recv_depth_1, .secret = true, .log = LOG_EACH,
     .close_each = true, .keys = "depth|credit|hello")
CASE(rkey_forged, .fn = adv_attack_rkey_forged, .secret = true, .log = LOG_EACH, .close_each = true)
CASE(rkey_stale, .fn = adv_attack_rkey_stale, .secret = true, .log = LOG_EACH, .close_each = true)
CASE(rkey_range, .fn = adv_attack_rkey_range, .secret = true, .log = LOG_EACH, .close_each = true)
CASE(kill9_rndv, .fn = adv_attack_kill9_rndv, .secret = true, .log = LOG_EACH, .close_each = true,
     .killed = true, .keys = "closed|reset|eof|keepalive|timed out|timeout|lost")

CASE(unauthenticated, .fn = adv_attack_unauthenticated, .secret = true, .log = LOG_EACH,
     .close_each = true, .keys = "secret|auth|proof|mac|timed out|timeout|malformed")

BEX_TEST_MAIN(BEX_CASE(baseline), BEX_CASE(random_bytes), BEX_CASE(truncated_hello),
              BEX_CASE(absurd_hello), BEX_CASE(idle_conns), BEX_CASE(connect_close),
              BEX_CASE(rndv_huge), BEX_CASE(rndv_endless), BEX_CASE(streams), BEX_CASE(no_credits),
              BEX_CASE(recv_depth_1), BEX_CASE(rkey_forged), BEX_CASE(rkey_stale),
              BEX_CASE(rkey_range), BEX_CASE(kill9_rndv), BEX_CASE(unauthenticated))
