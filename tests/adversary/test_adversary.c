/* SPDX-License-Identifier: Apache-2.0 */
/* The adversarial suite (label `adversary`): a listener serving good
 * clients while an attacker abuses it. See adv.h for the processes and
 * docs/testing.md for every case and what it asserts.
 *
 * The registered tests are groups (run_group): one server and one early
 * good client (at least 1000 messages, through every case of the group)
 * serve the group's cases in turn; each case brings its attacker and a late
 * good client and is checked on what it added (log lines, counters) once
 * the server is back to the early client alone. Each case can also run
 * alone (`test_adversary <case>`).
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
#include "bex/sock.h"

/* Stated bounds, over the server's own use right after it started
 * listening. The good clients alone take RSS +10..18 MiB (+62 MiB under
 * TSan) and pool +4..6 MiB; the server's limits (server.c: 32 MiB of
 * rendezvous destinations per peer, 48 MiB received) keep an attacker
 * under the rest. */
#define RSS_BOUND_KB (192L << 10)
#define POOL_BOUND   ((size_t)64 << 20)
#define FDS_SLACK    8
/* Messages of the early good client (through a whole group) and of each
 * late one; sanitizer builds (BEX_TEST_TIME_SCALE > 1) send fewer. */
#define GOOD_MIN     1000
#define GOOD_MIN_SAN 300
#define LATE_MIN     100
#define LATE_MIN_SAN 40
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
    const char *name;
    adv_attack_fn fn; /* NULL: no attack (baseline) */
    enum log_rule log;
    bool close_each;     /* every abusive connection must be closed by the server */
    bool killed;         /* the attacker ends by SIGKILL */
    bool secret;         /* the server has a secret: the good clients and a
                            protocol-level attacker know it */
    const char *keys;    /* '|'-separated words; a refusal line must have one.
                            None for bad keys: the server's NIC refuses those,
                            and on rxe the server only sees its QP fail */
    bool landing_writes; /* writes beyond a granted buffer but inside its
                            landing chunk: rxe does not check a window's
                            range, so in either mode they may land in
                            delivered rendezvous buffers the server holds
                            (payload memory, docs/security.md); the good
                            clients pause meanwhile */
    bool stale_landing;  /* a write into the delivered rendezvous buffer is
                            allowed in landing mode (payload memory the key
                            covers), refused in window mode */
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
/* connections the attacker opened from each port (ports are reused), and
 * server log lines naming each port, over the whole group */
static uint16_t nconn[65536];
static int per[65536];

/* ---- the server's report ---- */

#define MAX_LOG 4096
struct report {
    bool ok;
    long rss_base_kb, rss_peak_kb, fds_base, fds_now, backlog, engines, canaries, canary_bad, held,
        held_bad, held_large_bad, good_msgs, good_bad, echo_bad, log_lost, mode, srq_credits;
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

/* back to the early good client alone: one engine, no fds beyond the
 * slack, nothing queued or half-open on the listening port */
static bool server_settled(const struct report *r)
{
    return r->engines <= 1 && r->fds_now <= r->fds_base + FDS_SLACK && r->backlog == 0;
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
        K(backlog);
        K(engines);
        K(canaries);
        K(canary_bad);
        K(held);
        K(held_bad);
        K(held_large_bad);
        K(good_msgs);
        K(good_bad);
        K(echo_bad);
        K(srq_credits);
        K(log_lost);
        K(mode);
        K(pool_base);
        K(pool_peak);
        K(pool_now);
#undef K
    }
    r->ok = true;
    return 0;
}

/* The port named after "<addr>:" in a line, among the attacker's (this
 * case's, or an earlier one's of the group: nconn); 0 if none. */
static unsigned line_port(const char *line, const char *addr)
{
    size_t al = strlen(addr);
    for (const char *p = strstr(line, addr); p; p = strstr(p + 1, addr)) {
        if (p[al] != ':' || !isdigit((unsigned char)p[al + 1]))
            continue;
        unsigned port = (unsigned)strtoul(p + al + 1, NULL, 10);
        if (port < 65536 && nconn[port])
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

/* The server's log lines from index `from` on (what this case caused). */
static void check_log(const struct adv_case *c, const struct report *r, const char *addr, int from)
{
    int unattributed = 0, attributed = 0, keyed = 0;
    for (int i = from; i < r->nlog; i++) {
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
        /* a port the attacker used for n connections may be named n times */
        if (++per[port] == nconn[port] + 1)
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

/* ---- a group of cases against one server ---- */

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

/* What a group shares: one server, one early good client running through
 * every case of the group. */
struct group {
    struct adv_proc srv, good;
    uint16_t port;
    unsigned sc;
    char addr1[INET_ADDRSTRLEN];
    const char *secret;
    int mode;      /* the server's BEX_REMOTE_ACCESS_* */
    int log_seen;  /* server log lines checked by earlier cases */
    long bad_seen; /* canary_bad + held_bad + held_large_bad seen so far */
    long canary_bad, held_bad, held_large_bad, good_bad, echo_bad;
    uint32_t late_seq; /* each late client its own sequence numbers */
};

static int late_min(unsigned sc)
{
    return sc > 1 ? LATE_MIN_SAN : LATE_MIN;
}

/* One case: the attack (or, for baseline, none) while a late good client
 * comes; then the server must be back to the early client alone, with
 * every check of the file's header comment. */
static void run_one(struct group *g, const struct adv_case *c)
{
    char line[1200];
    unsigned sc = g->sc;
    struct adv_proc late, atk;
    bool have_late = false;
    conns.n = closed.n = accepted.n = killed.n = 0;
    struct adv_good_opts lo = {.secret = g->secret,
                               .port = g->port,
                               .min_msgs = (uint32_t)late_min(sc),
                               .seq0 = g->late_seq};
    g->late_seq += 1u << 20;
    if (c->fn) {
        struct atk_arg aa = {
            .fn = c->fn,
            .ac = {.local = {0}, .srv_addr = {0}, .port = g->port, .secret = g->secret}};
        struct in_addr a0, a1;
        adv_addrs(&a0, &a1);
        aa.ac.local = a1;
        aa.ac.srv_addr = a0;
        if (adv_spawn(&atk, "attacker", attacker_main, &aa)) {
            failf("cannot start the attacker");
            return;
        }
        for (;;) {
            int r = adv_readline(&atk, line, sizeof line, 180000 * sc);
            if (r == -ETIMEDOUT) {
                failf("the attacker did not finish");
                break;
            }
            if (r)
                break; /* its pipe closed: done, or killed */
            unsigned p;
            if (sscanf(line, "conn %u", &p) == 1) {
                ports_add(&conns, p);
                nconn[p]++;
            } else if (sscanf(line, "closed %u", &p) == 1)
                ports_add(&closed, p);
            else if (sscanf(line, "accepted %u", &p) == 1)
                ports_add(&accepted, p);
            else if (sscanf(line, "killed %u", &p) == 1)
                ports_add(&killed, p);
            else if (sscanf(line, "leak %u", &p) == 1)
                failf("the server sent its hello (QPN, GID, keepalive rkey) to "
                      "unauthenticated connection %s:%u",
                      g->addr1, p);
            else if (!strcmp(line, "pause") || !strcmp(line, "resume")) {
                /* the attacker is about to write where payloads in flight
                 * may be (memory its key reaches, docs/security.md): the
                 * good clients hold their traffic meanwhile */
                bool pause = line[0] == 'p';
                struct adv_proc *cl[2] = {&g->good, have_late ? &late : NULL};
                for (int k = 0; k < 2; k++) {
                    if (!cl[k])
                        continue;
                    adv_cmd(cl[k], pause ? 'p' : 'g');
                    if (pause && adv_expect(cl[k], "paused", line, sizeof line, 30000 * sc))
                        failf("a good client did not pause");
                }
                if (pause)
                    adv_cmd(&atk, 'c');
            } else if (!strcmp(line, "underway")) {
                if (!have_late) {
                    if (adv_spawn(&late, "late", adv_good_main, &lo) == 0)
                        have_late = true;
                    else
                        failf("cannot start the late good client");
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
        if (!have_late)
            failf("the attack never got underway");
    } else if (adv_spawn(&late, "late", adv_good_main, &lo) == 0) {
        have_late = true;
    } else {
        failf("cannot start the late good client");
    }
    if (have_late) {
        if (adv_expect(&late, "result", line, sizeof line, 120000 * sc))
            failf("the late good client gave no result");
        else if (strncmp(line, "result ok", 9))
            failf("late good client: %s", line);
        else
            fprintf(stderr, "late good client: %s\n", line);
        /* it leaves before the server's report: then the server must be back
         * to the early client alone */
        adv_cmd(&late, 'q');
        int st = adv_reap(&late, 30000 * sc);
        if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
            failf("the late good client failed its teardown (status 0x%x)", st);
    }

    /* the server: alive, back to the early client's engine, then report */
    struct report r = {0};
    if (!adv_alive(&g->srv)) {
        while (adv_readline(&g->srv, line, sizeof line, 100) == 0)
            fprintf(stderr, "[server] %s\n", line);
        failf("the listener process died (status 0x%x)", g->srv.status);
        return;
    }
    uint64_t end = adv_now_ms() + 15000ull * sc;
    /* the server learns of the attacker's closes when its I/O thread gets
     * to them, and accepts what the attacker left in its accept queue (each
     * such connection an fd until its reset is read): the count settles only
     * once that queue is empty. The report checked below is a second one:
     * a socket still closing or a handshake completed late can show in it
     * after a settled first (a CI run saw backlog 0, then 1); then the wait
     * goes on, and only what outlasts the deadline fails. */
    int rc;
    for (;;) {
        rc = get_report(&g->srv, &r, sc, true);
        if (rc == 0 && !server_settled(&r) && adv_now_ms() < end) {
            fprintf(stderr, "waiting for the server to settle: engines %ld, fds %ld, backlog %ld\n",
                    r.engines, r.fds_now, r.backlog);
            adv_sleep_ms(200);
            continue;
        }
        if (rc == 0)
            rc = get_report(&g->srv, &r, sc, false);
        if (rc == 0 && !server_settled(&r) && adv_now_ms() < end)
            continue;
        break;
    }
    if (rc || !r.ok) {
        failf("the server did not report");
        report_free(&r);
        return;
    }
    fprintf(stderr,
            "server: rss +%ld KiB (peak), pool +%zu KiB (peak), %ld good messages, "
            "%d new log lines, engines %ld, fds %ld (started with %ld), backlog %ld\n",
            r.rss_peak_kb - r.rss_base_kb, (r.pool_peak - r.pool_base) >> 10, r.good_msgs,
            r.nlog - g->log_seen, r.engines, r.fds_now, r.fds_base, r.backlog);
    for (int i = g->log_seen; i < r.nlog; i++)
        fprintf(stderr, "  server log [%d] %s\n", r.level[i], r.log[i]);
    if (r.rss_peak_kb - r.rss_base_kb > RSS_BOUND_KB)
        failf("server RSS grew by %ld KiB, bound %ld KiB", r.rss_peak_kb - r.rss_base_kb,
              RSS_BOUND_KB);
    if (r.pool_peak - r.pool_base > POOL_BOUND)
        failf("pool in-use grew by %zu KiB, bound %zu KiB", (r.pool_peak - r.pool_base) >> 10,
              POOL_BOUND >> 10);
    if (r.engines > 1)
        failf("%ld engines left after the attack, the early good client has 1", r.engines);
    if (r.fds_now > r.fds_base + FDS_SLACK || r.backlog != 0)
        failf("%ld fds open after the attack, %ld before, %ld connections waiting for accept "
              "(queued or half-open)",
              r.fds_now, r.fds_base, r.backlog);
    if (r.canaries < 10)
        failf("only %ld canaries were placed", r.canaries);
    /* counts are of the server's whole run: what this case added is new */
    if (r.canary_bad > g->canary_bad)
        failf("%ld canaries overwritten", r.canary_bad - g->canary_bad);
    if (r.held_bad > g->held_bad)
        failf("%ld received SEND buffers held by the application changed",
              r.held_bad - g->held_bad);
    if (r.held_large_bad > g->held_large_bad) {
        if (c->stale_landing && g->mode == BEX_REMOTE_ACCESS_LANDING)
            fprintf(stderr, "landing mode: the stale write landed in the delivered buffer "
                            "(payload memory, allowed in this mode)\n");
        else if (c->landing_writes)
            fprintf(stderr, "a write beyond a granted buffer landed in a delivered rendezvous "
                            "buffer the server holds (landing payload memory: on rxe a key "
                            "reaches its whole landing chunk, docs/security.md)\n");
        else
            failf("%ld delivered rendezvous buffers held by the application changed",
                  r.held_large_bad - g->held_large_bad);
    }
    g->canary_bad = r.canary_bad;
    g->held_bad = r.held_bad;
    g->held_large_bad = r.held_large_bad;
    if (r.good_bad > g->good_bad || r.echo_bad > g->echo_bad)
        failf("%ld good messages arrived damaged, %ld changed while bex held their echo",
              r.good_bad - g->good_bad, r.echo_bad - g->echo_bad);
    g->good_bad = r.good_bad;
    g->echo_bad = r.echo_bad;
    if (r.log_lost)
        failf("%ld log lines beyond the capture", r.log_lost);
    check_log(c, &r, g->addr1, g->log_seen);
    g->log_seen = r.nlog;
    if (c->fn && c->close_each) {
        for (int i = 0; i < conns.n; i++) {
            unsigned p = conns.p[i];
            if (ports_has(&closed, p) || ports_has(&accepted, p) || ports_has(&killed, p))
                continue;
            failf("abusive connection %s:%u was not closed by the server", g->addr1, p);
        }
    }
    fprintf(stderr, "attacker: %d connections, %d closed by the server, %d abuses accepted\n",
            conns.n, closed.n, accepted.n);
    report_free(&r);
}

struct group_def {
    const char *name;
    bool secret;            /* the server has a secret */
    uint32_t remote_access; /* the server's mode (0: the device's default) */
    const struct adv_case *cases[16];
};

/* The next group's server in SRQ mode with this queue depth (0: off). */
static uint32_t group_srq_depth;

static int run_group(const struct group_def *gd)
{
    static struct group g;
    memset(&g, 0, sizeof g);
    struct in_addr a0, a1;
    int rc = adv_addrs(&a0, &a1);
    if (rc)
        return rc;
    inet_ntop(AF_INET, &a1, g.addr1, sizeof g.addr1);
    signal(SIGPIPE, SIG_IGN);
    g.sc = adv_scale();
    g.late_seq = 1u << 24;
    memset(per, 0, sizeof per);
    memset(nconn, 0, sizeof nconn);
    nfail = 0;
    char line[1200];
    g.secret = gd->secret ? ADV_SECRET : NULL;
    struct adv_server_opts so = {
        .secret = g.secret, .remote_access = gd->remote_access, .srq_depth = group_srq_depth};
    CHECK(adv_spawn(&g.srv, "server", adv_server_main, &so) == 0);
    if (adv_expect(&g.srv, "port ", line, sizeof line, 30000 * g.sc)) {
        fprintf(stderr, "the server did not start\n");
        adv_reap(&g.srv, 1000);
        return 1;
    }
    g.port = (uint16_t)atoi(line + 5);
    struct report r = {0};
    if (get_report(&g.srv, &r, g.sc, true)) {
        fprintf(stderr, "the server did not report\n");
        adv_reap(&g.srv, 1000);
        return 1;
    }
    g.mode = r.mode;
    fprintf(stderr, "server mode: %s\n", g.mode == BEX_REMOTE_ACCESS_WINDOW ? "window" : "landing");
    if (gd->remote_access && g.mode != (int)gd->remote_access)
        failf("the server runs in mode %d, not %u", g.mode, gd->remote_access);

    uint32_t good_min = g.sc > 1 ? GOOD_MIN_SAN : GOOD_MIN;
    struct adv_good_opts go = {
        .secret = g.secret, .port = g.port, .min_msgs = good_min, .wait_go = true};
    CHECK(adv_spawn(&g.good, "good", adv_good_main, &go) == 0);
    int failed_cases = 0, ncases = 0;
    char failed_names[512] = "";
    if (adv_expect(&g.good, "ready", line, sizeof line, 30000 * g.sc) ||
        strncmp(line, "ready", 5)) {
        failf("the early good client did not connect before the attack");
        goto stop;
    }
    /* in SRQ mode the early client's engine holds a share of the queue */
    if (group_srq_depth && (get_report(&g.srv, &r, g.sc, true) || r.srq_credits == 0))
        failf("the server is not in SRQ mode (no share granted)");
    adv_cmd(&g.good, 'g');
    adv_sleep_ms(300);
    for (int i = 0; i < 16 && gd->cases[i]; i++) {
        const struct adv_case *c = gd->cases[i];
        /* The library's log is rate-limited per window (src/common/log.c):
         * on an idle VM the cases run back to back, and a burst of one case
         * (connect_close's refusals) could use up the next case's window,
         * dropping the one line that case requires. A site's window opens
         * at its first line and lasts the server's log_window_ms
         * (ADV_LOG_WINDOW_MS), and every line of a case is logged before
         * its report: that long after the report every window has closed
         * (100 ms more for the clocks' granularity; it was 1100 ms with the
         * default 1000 ms window, 19 transitions a tier). */
        if (i > 0)
            adv_sleep_ms(ADV_LOG_WINDOW_MS + 100);
        uint64_t t0 = adv_now_ms();
        int before = nfail;
        fprintf(stderr, "== %s: case %s\n", gd->name, c->name);
        if (c->secret != gd->secret)
            failf("case %s wants a server %s a secret", c->name, c->secret ? "with" : "without");
        else
            run_one(&g, c);
        ncases++;
        bool ok = nfail == before;
        fprintf(stderr, "== %s: case %s %s in %.1f s\n", gd->name, c->name,
                ok ? "passed" : "FAILED", (adv_now_ms() - t0) / 1000.0);
        if (!ok) {
            failed_cases++;
            size_t l = strlen(failed_names);
            snprintf(failed_names + l, sizeof failed_names - l, " %s", c->name);
        }
        if (!adv_alive(&g.srv))
            break;
    }
    adv_cmd(&g.good, 's');
    if (adv_expect(&g.good, "result", line, sizeof line, 120000 * g.sc))
        failf("the early good client gave no result");
    else if (strncmp(line, "result ok", 9))
        failf("early good client: %s", line);
    else
        fprintf(stderr, "early good client: %s\n", line);
    if (adv_alive(&g.srv) && get_report(&g.srv, &r, g.sc, true) == 0 &&
        r.good_msgs < (long)good_min)
        failf("the server saw %ld good messages, fewer than %u", r.good_msgs, good_min);

stop:
    report_free(&r);
    /* teardown: the client first (its close must not be logged as an
     * error: the last report is taken), then the server's own */
    adv_cmd(&g.good, 'q');
    int st = adv_reap(&g.good, 30000 * g.sc);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        failf("the early good client failed its teardown (status 0x%x)", st);
    if (!g.srv.reaped) {
        adv_cmd(&g.srv, 'q');
        st = adv_reap(&g.srv, 60000 * g.sc);
        while (adv_readline(&g.srv, line, sizeof line, 100) == 0)
            fprintf(stderr, "[server] %s\n", line);
        if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
            failf("the server failed its teardown (status 0x%x)", st);
    } else {
        failf("the listener process died (status 0x%x)", g.srv.status);
    }
    fprintf(stderr, "== %s: %d of %d cases failed%s%s\n", gd->name, failed_cases, ncases,
            failed_cases ? ":" : "", failed_names);
    if (nfail)
        fprintf(stderr, "%d checks failed\n", nfail);
    return nfail ? 1 : 0;
}

/* ---- the cases ---- */

#define CASE(id, ...) static const struct adv_case id = {.name = #id, __VA_ARGS__};

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
CASE(overack, .fn = adv_attack_overack, .secret = true, .log = LOG_EACH, .close_each = true,
     .keys = "credits back|granted")
/* SRQ mode only (the srq group): without a queue of its own the flood only
 * takes the attacker's own receives (RNR) */
CASE(srq_overcredit, .fn = adv_attack_srq_overcredit, .secret = true, .log = LOG_EACH,
     .close_each = true, .keys = "beyond|shared receive queue")
CASE(recv_depth_1, .fn = adv_attack_recv_depth_1, .secret = true, .log = LOG_EACH,
     .close_each = true, .keys = "depth|credit|hello")
CASE(rkey_forged, .fn = adv_attack_rkey_forged, .secret = true, .log = LOG_EACH, .close_each = true)
/* landing mode: the finished transfer's key still covers its landing chunk,
 * so the stale write lands in the delivered buffer (payload memory: the
 * issue allows it in this mode) and the connection goes on; window mode
 * (the window group) must refuse it: the window was invalidated at
 * delivery, no byte of the delivered buffer may change */
CASE(rkey_stale, .fn = adv_attack_rkey_stale, .secret = true, .log = LOG_EACH, .close_each = true,
     .stale_landing = true)
CASE(rkey_range, .fn = adv_attack_rkey_range, .secret = true, .log = LOG_EACH, .close_each = true,
     .landing_writes = true)
CASE(kill9_rndv, .fn = adv_attack_kill9_rndv, .secret = true, .log = LOG_EACH, .close_each = true,
     .killed = true, .keys = "closed|reset|eof|keepalive|timed out|timeout|lost")
CASE(unauthenticated, .fn = adv_attack_unauthenticated, .secret = true, .log = LOG_EACH,
     .close_each = true, .keys = "secret|auth|proof|mac|timed out|timeout|malformed")
CASE(fallback_after_frames, .fn = adv_attack_fallback_after_frames, .secret = true, .log = LOG_EACH,
     .close_each = true, .keys = "fallback")

/* The registered tests: every case, grouped so that one server and one early
 * good client (its 1000 messages) serve several attacks in turn. */
static const struct group_def g_setup = {
    "setup",
    false,
    0,
    {&baseline, &random_bytes, &truncated_hello, &absurd_hello, &connect_close, &idle_conns}};
static const struct group_def g_protocol = {
    "protocol",
    true,
    0,
    {&unauthenticated, &recv_depth_1, &rndv_huge, &rndv_endless, &streams, &no_credits, &overack,
     &rkey_forged, &rkey_stale, &rkey_range, &kill9_rndv, &fallback_after_frames}};
static const struct group_def g_window = {
    "window", true, BEX_REMOTE_ACCESS_WINDOW, {&rkey_stale, &rkey_range, &kill9_rndv}};
/* SRQ mode: one shared receive queue (one I/O thread) for the good clients
 * and the attacker, 16 shares of the default rq_depth (64) */
static const struct group_def g_srq = {"srq", true, 0, {&srq_overcredit}};

static int setup(void)
{
    return run_group(&g_setup);
}
static int protocol(void)
{
    return run_group(&g_protocol);
}
static int window(void)
{
    return run_group(&g_window);
}
static int srq(void)
{
    group_srq_depth = 1024;
    return run_group(&g_srq);
}

/* Each case alone (not registered; to reproduce one): a group of one, with
 * a secret when the case wants one, in the device's default mode. */
#define ALONE(id)                                                                                  \
    static int id##_alone(void)                                                                    \
    {                                                                                              \
        struct group_def d = {#id, id.secret, 0, {&id}};                                           \
        return run_group(&d);                                                                      \
    }
ALONE(baseline)
ALONE(random_bytes)
ALONE(truncated_hello)
ALONE(absurd_hello)
ALONE(idle_conns)
ALONE(connect_close)
ALONE(rndv_huge)
ALONE(rndv_endless)
ALONE(streams)
ALONE(no_credits)
ALONE(overack)
ALONE(recv_depth_1)
ALONE(rkey_forged)
ALONE(rkey_stale)
ALONE(rkey_range)
ALONE(kill9_rndv)
ALONE(unauthenticated)
ALONE(fallback_after_frames)
/* Window mode with good clients only (to tell a window-mode defect from an
 * attack's effect). */
static int window_baseline(void)
{
    struct group_def d = {
        "window_baseline", false, BEX_REMOTE_ACCESS_WINDOW, {&baseline, &baseline, &baseline}};
    return run_group(&d);
}
static int rkey_stale_window(void)
{
    struct group_def d = {"rkey_stale_window", true, BEX_REMOTE_ACCESS_WINDOW, {&rkey_stale}};
    return run_group(&d);
}

#define ALONE_CASE(id)                                                                             \
    {                                                                                              \
#id, id##_alone                                                                            \
    }
BEX_TEST_MAIN(BEX_CASE(setup), BEX_CASE(protocol), BEX_CASE(window), BEX_CASE(srq),
              ALONE_CASE(baseline), ALONE_CASE(random_bytes), ALONE_CASE(truncated_hello),
              ALONE_CASE(absurd_hello), ALONE_CASE(idle_conns), ALONE_CASE(connect_close),
              ALONE_CASE(rndv_huge), ALONE_CASE(rndv_endless), ALONE_CASE(streams),
              ALONE_CASE(no_credits), ALONE_CASE(overack), ALONE_CASE(recv_depth_1),
              ALONE_CASE(rkey_forged), ALONE_CASE(rkey_stale), ALONE_CASE(rkey_range),
              ALONE_CASE(kill9_rndv), ALONE_CASE(unauthenticated),
              ALONE_CASE(fallback_after_frames), BEX_CASE(rkey_stale_window),
              BEX_CASE(window_baseline))
