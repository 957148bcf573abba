/* SPDX-License-Identifier: Apache-2.0 */
/* bex-cluster: run a parameter-server cluster on one machine through a
 * phase plan, and report (issue 10 item 3; paper §8, Tables 5-7).
 *
 * Each phase starts n shards x r replicas (one bex-ps process each, at
 * addresses from a cluster file it writes), then its rankers and trainers
 * (bex-ranker, bex-trainer) for the phase's duration, over the phase's
 * transport; a fault phase sends kill -9 to one replica mid-run and
 * restarts it (from its snapshot). A phase with "replication":
 * "primary-backup" starts bex-ps --primary-backup (replica 0 each shard's
 * primary) and trainers that Push to the primaries and retry each failed
 * Push with its id (bex_ps_push_seq); its fault, on a primary, reports the
 * training Pushes failed (goal 0), how long the primary was down and the
 * Pushes' latency meanwhile. After the clients, it checks from every
 * replica how many times each trained key's Pushes were applied (the
 * trainers' gradients are constant, so a row's value counts them), stops
 * the servers (SIGTERM), and collects the JSON reports and latency samples
 * into results.json, series.dat (latency over time) and tables shaped like
 * the paper's Tables 5-7 on stdout.
 *
 * Nothing is left running: every process it starts is in one process
 * group (a keeper process leads it for the whole run) and dies with
 * bex-cluster (PR_SET_PDEATHSIG); SIGINT, SIGTERM and SIGHUP stop the group
 * (SIGTERM, then SIGKILL after 5 s) before bex-cluster exits. The pids it
 * started are listed in OUT/pids and the group in OUT/pgid.
 *
 * With --etcd the servers register in etcd and the clients' cluster file
 * is read from there; --only servers|clients splits a run between two
 * instances (two machines) that meet through etcd.
 *
 * Usage and plan format: docs/configuration.md ("bex-cluster"). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bex/dir.h"
#include "bex/ps.h"
#include "bex/sock.h"

/* The plan `make demo` runs: the same inference and training load over
 * RDMA and over TCP, then a fault phase. Sized for 2 cores inside the
 * Soft-RoCE VM (software-emulated RDMA under qemu TCG): a few hundred
 * user requests a second. Its deadlines (10 s) and keepalive timeouts
 * (10 s) are the VM's: on a loaded host the emulated processes stall for
 * seconds (P99s of 1.5-3 s at a load of 10 on 2 cores), and a tighter
 * deadline failed user requests in phases without a fault. The fault
 * phase runs primary-backup shards that fail over through etcd (bex-cluster
 * starts one, or uses --etcd's) and kills shard 0's primary: trainers retry
 * each Push with its id, so none fails (tools/demo/plan-fanout-fault.json
 * is the same plan with the former client fan-out fault: a backup killed). A ranker's
 * Fetch answers are 1-64 KB, and every 32nd is 1 MiB (16384 keys): all of
 * them that large at once made rxe fail QPs under this load. Answers and
 * Pushes up to 64 KB go by one SEND (eager_max 65600 in every process, as
 * bench/rpc/compare does), not by rendezvous: 8 MiB of receive buffers
 * per connection, a few hundred MiB for the whole demo. */
static const char DEFAULT_PLAN[] =
    "{\n"
    "  \"shards\": 2, \"replicas\": 2,\n"
    "  \"table\": {\"id\": 1, \"dim\": 16, \"lr\": 0.01},\n"
    "  \"keys\": 50000, \"zipf\": 0.99,\n"
    "  \"ps\": {\"snapshot_every_ms\": 2000, \"keepalive_timeout_ms\": 10000,\n"
    "         \"eager_max\": 65600},\n"
    "  \"ranker\": {\"outstanding\": 4, \"models\": 4, \"keys_min\": 16, \"keys_max\": 1024,\n"
    "             \"large_every\": 32, \"large_keys\": 16384,\n"
    "             \"timeout_ms\": 10000, \"keepalive_timeout_ms\": 10000,\n"
    "             \"eager_max\": 65600},\n"
    "  \"trainer\": {\"outstanding\": 1, \"compute_us\": 5000, \"mean_bytes\": 20480,\n"
    "              \"p99_bytes\": 51200, \"timeout_ms\": 10000,\n"
    "              \"keepalive_timeout_ms\": 10000, \"eager_max\": 65600,\n"
    "              \"push_retry_ms\": 30000},\n"
    "  \"phases\": [\n"
    "    {\"name\": \"rdma\", \"transport\": \"rdma\", \"duration_s\": 20, \"rankers\": 2,\n"
    "     \"trainers\": 2},\n"
    "    {\"name\": \"tcp\", \"transport\": \"tcp\", \"duration_s\": 20, \"rankers\": 2,\n"
    "     \"trainers\": 2},\n"
    "    {\"name\": \"fault\", \"transport\": \"rdma\", \"duration_s\": 24, \"rankers\": 2,\n"
    "     \"trainers\": 2, \"replication\": \"primary-backup\",\n"
    "     \"fault\": {\"shard\": 0, \"replica\": \"primary\", \"snapshot_at_s\": 4,\n"
    "     \"kill_at_s\": 8, \"restart_at_s\": 14}}\n"
    "  ]\n"
    "}\n";

#define MAX_PROCS  256
#define MAX_ADDRS  8
#define MAX_PHASES 16
#define SERIES_BIN 1.0 /* seconds per point of series.dat */
#define READY_WAIT 60  /* seconds for a bex-ps to say ready */
#define STOP_WAIT  5   /* seconds between SIGTERM and SIGKILL */
#define PROC_ARGS  64  /* a process's argv, its NULL included */
#define EXTRA_WAIT 30  /* seconds past a phase's end for its clients */

enum { R_KEEPER, R_PS, R_RANKER, R_TRAINER, R_ETCD };

struct proc {
    int used, role, idx; /* idx: ranker/trainer number, or shard * R + replica */
    pid_t pid;
    int out_fd, log_fd;
    char name[64];
    char line[512];
    size_t line_len;
    int running, ready, killed; /* killed: by the fault, expected */
    int status;
    struct rusage ru;
    unsigned long long prog_ok, prog_failed;
    int progressed; /* a client: said progress (its first operation done) */
    char *argv[PROC_ARGS];
};

static struct {
    char out[2048], bin[2048], ps_bin[PATH_MAX];
    char snap_root[1024];                   /* the servers' snapshots: a directory in TMPDIR */
    char addrs[MAX_ADDRS][BEX_ADDR_STRLEN]; /* hosts, IPv6 without brackets */
    int n_addrs;
    pid_t self, pgid;
    FILE *pids;
    struct proc procs[MAX_PROCS];
    volatile sig_atomic_t stop_sig, got_chld;
    int tty, quiet;
    int die_status; /* die's exit status (0: 1); 2 while reading the input */
    double scale;   /* durations multiplied by this */
    /* --etcd: the servers register there (bex-ps --etcd), the clients'
     * cluster file is read from there; --only: this instance's half */
    const char *etcd, *etcd_prefix;
    int servers, clients; /* which processes this instance starts */
    /* primary-backup phases without --etcd: an etcd of our own (one for
     * the run, on 127.0.0.1) that the servers fail over through */
    char own_etcd[64];
} g;

static void on_signal(int sig)
{
    if (sig == SIGCHLD)
        g.got_chld = 1;
    else if (!g.stop_sig)
        g.stop_sig = sig;
}

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void cleanup_all(void);

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%sbex-cluster: ", g.tty ? "\n" : "");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    cleanup_all();
    exit(g.die_status ? g.die_status : 1);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- processes ---- */

static void reap(void)
{
    g.got_chld = 0;
    for (;;) {
        int st;
        struct rusage ru;
        pid_t p = wait4(-1, &st, WNOHANG, &ru);
        if (p <= 0)
            return;
        for (int i = 0; i < MAX_PROCS; i++) {
            struct proc *pr = &g.procs[i];
            if (pr->used && pr->running && pr->pid == p) {
                pr->running = 0;
                pr->status = st;
                pr->ru = ru;
            }
        }
    }
}

static void handle_line(struct proc *p, const char *line)
{
    unsigned long long a, b;
    if (p->role == R_PS && strcmp(line, "bex-ps: ready") == 0)
        p->ready = 1;
    else if (sscanf(line, "progress %llu %llu", &a, &b) == 2) {
        p->progressed = 1;
        p->prog_ok = a;
        p->prog_failed = b;
        return; /* not worth a log line each */
    }
    if (p->log_fd >= 0) {
        dprintf(p->log_fd, "%s\n", line);
    }
}

/* Read what the children said, reap the dead; wait up to ms. Returns
 * nonzero when a stop signal came. */
static int pump(int ms)
{
    struct pollfd pf[MAX_PROCS];
    struct proc *who[MAX_PROCS];
    int n = 0;
    for (int i = 0; i < MAX_PROCS; i++)
        if (g.procs[i].used && g.procs[i].out_fd >= 0) {
            pf[n] = (struct pollfd){.fd = g.procs[i].out_fd, .events = POLLIN};
            who[n++] = &g.procs[i];
        }
    sigset_t none;
    sigemptyset(&none);
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    int rc = ppoll(pf, (nfds_t)n, &ts, &none);
    for (int i = 0; rc > 0 && i < n; i++) {
        if (!(pf[i].revents & (POLLIN | POLLHUP | POLLERR)))
            continue;
        struct proc *p = who[i];
        char buf[4096];
        ssize_t k = read(p->out_fd, buf, sizeof buf);
        if (k <= 0) {
            close(p->out_fd);
            p->out_fd = -1;
            continue;
        }
        for (ssize_t j = 0; j < k; j++) {
            if (buf[j] == '\n' || p->line_len == sizeof p->line - 1) {
                p->line[p->line_len] = 0;
                handle_line(p, p->line);
                p->line_len = 0;
            }
            if (buf[j] != '\n')
                p->line[p->line_len++] = buf[j];
        }
    }
    reap();
    return g.stop_sig != 0;
}

static struct proc *proc_new(int role, int idx, const char *name)
{
    for (int i = 0; i < MAX_PROCS; i++)
        if (!g.procs[i].used) {
            struct proc *p = &g.procs[i];
            *p = (struct proc){.used = 1, .role = role, .idx = idx, .out_fd = -1, .log_fd = -1};
            snprintf(p->name, sizeof p->name, "%s", name);
            return p;
        }
    die("too many processes");
}

static void child_setup(void)
{
    /* die with bex-cluster, even by SIGKILL; the parent may be gone already */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != g.self)
        _exit(1);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

/* Start p->argv in the group, its stdout to us, its stderr to log. */
static void proc_spawn(struct proc *p, const char *log)
{
    int fds[2];
    if (pipe2(fds, O_CLOEXEC))
        die("pipe: %s", strerror(errno));
    if (p->log_fd < 0 &&
        (p->log_fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) < 0)
        die("%s: %s", log, strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        child_setup();
        setpgid(0, g.pgid);
        dup2(fds[1], 1);
        dup2(p->log_fd, 2);
        execv(p->argv[0], p->argv);
        dprintf(2, "bex-cluster: exec %s: %s\n", p->argv[0], strerror(errno));
        _exit(127);
    }
    setpgid(pid, g.pgid); /* both sides: no window outside the group */
    close(fds[1]);
    p->out_fd = fds[0];
    p->pid = pid;
    p->running = 1;
    p->ready = 0;
    p->killed = 0;
    p->line_len = 0;
    p->prog_ok = p->prog_failed = 0;
    p->progressed = 0;
    fprintf(g.pids, "%d %s\n", (int)pid, p->name);
    fflush(g.pids);
}

static void proc_release(struct proc *p)
{
    if (p->out_fd >= 0)
        close(p->out_fd);
    if (p->log_fd >= 0)
        close(p->log_fd);
    for (int i = 0; p->argv[i]; i++)
        free(p->argv[i]);
    p->used = 0;
}

static int running_count(int role)
{
    int n = 0;
    for (int i = 0; i < MAX_PROCS; i++)
        if (g.procs[i].used && g.procs[i].running && (role < 0 || g.procs[i].role == role))
            n++;
    return n;
}

/* Signal every running process of a role (-1: all but the keeper). */
static void signal_role(int role, int sig)
{
    for (int i = 0; i < MAX_PROCS; i++) {
        struct proc *p = &g.procs[i];
        if (p->used && p->running && p->role != R_KEEPER && (role < 0 || p->role == role))
            kill(p->pid, sig);
    }
}

/* SIGTERM to a role, SIGKILL after STOP_WAIT; reaps them. */
static void stop_role(int role)
{
    signal_role(role, SIGTERM);
    double end = now_s() + STOP_WAIT;
    while (running_count(role) > (role < 0 ? 1 : 0) && now_s() < end)
        pump(50);
    signal_role(role, SIGKILL);
    while (running_count(role) > (role < 0 ? 1 : 0))
        pump(50);
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

static void cleanup_all(void)
{
    if (g.pgid) {
        signal(SIGINT, SIG_IGN); /* a second ^C does not cut the cleanup short */
        stop_role(-1);
        /* the group: the keeper and anything a child left behind */
        kill(-g.pgid, SIGKILL);
        while (running_count(-1) > 0)
            pump(50);
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
        g.pgid = 0;
    }
    if (g.snap_root[0]) { /* the servers are gone: nothing writes there now */
        nftw(g.snap_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        g.snap_root[0] = 0;
    }
}

static void start_keeper(void)
{
    struct proc *p = proc_new(R_KEEPER, 0, "keeper");
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        child_setup();
        setpgid(0, 0);
        for (;;)
            pause();
    }
    setpgid(pid, pid);
    g.pgid = pid;
    p->pid = pid;
    p->running = 1;
    fprintf(g.pids, "%d keeper\n", (int)pid);
    fflush(g.pids);
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/pgid", g.out);
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "%d\n", (int)pid);
        fclose(f);
    }
}

/* ---- plan ---- */

struct phase {
    const char *name, *transport;
    const char *poll; /* the plan's "poll", or the phase's own */
    double duration_s;
    int rankers, trainers;
    double warmup_s; /* samples that start earlier are left out of the stats */
    int fault, f_shard, f_replica;
    double f_snap, f_kill, f_restart;
    int pb;             /* "replication": "primary-backup" (else client fan-out) */
    double retry_ms;    /* pb: a trainer's Push sent again with its id this long */
    double send_window; /* the phase's "send_window" for every process (-1: the plan's) */
};

struct plan {
    json_t *root;
    int shards, replicas;
    unsigned table, dim, keys;
    double lr, zipf;
    const char *poll; /* every process's I/O threads' poll mode (NULL: the library's) */
    json_t *ranker, *trainer, *ps;
    struct phase ph[MAX_PHASES];
    int n_ph;
};

static double jnum(json_t *o, const char *k, double def)
{
    json_t *v = o ? json_object_get(o, k) : NULL;
    return v && json_is_number(v) ? json_number_value(v) : def;
}

/* A "poll" setting: spin-sleep, busy or event (def when absent) */
static const char *poll_mode(const char *arg, json_t *v, const char *def)
{
    if (!v)
        return def;
    const char *m = json_string_value(v);
    if (!m || (strcmp(m, "spin-sleep") && strcmp(m, "busy") && strcmp(m, "event")))
        die("plan %s: \"poll\": spin-sleep, busy or event", arg);
    return m;
}

static void plan_load(struct plan *pl, const char *arg)
{
    json_error_t err;
    if (strcmp(arg, "default") == 0)
        pl->root = json_loads(DEFAULT_PLAN, 0, &err);
    else
        pl->root = json_load_file(arg, 0, &err);
    struct stat st;
    if (!pl->root && stat(arg, &st) == 0 && S_ISDIR(st.st_mode))
        die("plan %s: %s", arg, strerror(EISDIR));
    if (!pl->root)
        die("plan %s: %s (line %d)", arg, err.text, err.line);
    json_t *r = pl->root;
    pl->shards = (int)jnum(r, "shards", 2);
    pl->replicas = (int)jnum(r, "replicas", 2);
    json_t *t = json_object_get(r, "table");
    pl->table = (unsigned)jnum(t, "id", 1);
    pl->dim = (unsigned)jnum(t, "dim", 16);
    pl->lr = jnum(t, "lr", 0.01);
    pl->keys = (unsigned)jnum(r, "keys", 100000);
    pl->zipf = jnum(r, "zipf", 0.99);
    pl->ranker = json_object_get(r, "ranker");
    pl->trainer = json_object_get(r, "trainer");
    pl->ps = json_object_get(r, "ps");
    pl->poll = poll_mode(arg, json_object_get(r, "poll"), NULL);
    json_t *phs = json_object_get(r, "phases");
    if (!json_is_array(phs) || json_array_size(phs) == 0 || json_array_size(phs) > MAX_PHASES)
        die("plan %s: \"phases\": an array of 1-%d phases", arg, MAX_PHASES);
    for (size_t i = 0; i < json_array_size(phs); i++) {
        json_t *p = json_array_get(phs, i);
        struct phase *ph = &pl->ph[pl->n_ph++];
        json_t *n = json_object_get(p, "name"), *tr = json_object_get(p, "transport");
        ph->name = json_is_string(n) ? json_string_value(n) : "phase";
        ph->transport = json_is_string(tr) ? json_string_value(tr) : "tcp";
        if (strcmp(ph->transport, "rdma") && strcmp(ph->transport, "tcp") &&
            strcmp(ph->transport, "auto"))
            die("plan %s: phases[%zu].transport: rdma, tcp or auto", arg, i);
        ph->poll = poll_mode(arg, json_object_get(p, "poll"), pl->poll);
        ph->duration_s = jnum(p, "duration_s", 10) * g.scale;
        ph->warmup_s = jnum(p, "warmup_s", jnum(r, "warmup_s", 2)) * g.scale;
        if (ph->warmup_s >= ph->duration_s)
            ph->warmup_s = 0;
        json_t *rp = json_object_get(p, "replication");
        ph->pb = rp && json_is_string(rp) && strcmp(json_string_value(rp), "primary-backup") == 0;
        if (rp && !ph->pb && (!json_is_string(rp) || strcmp(json_string_value(rp), "fan-out")))
            die("plan %s: phases[%zu].replication: fan-out or primary-backup", arg, i);
        ph->retry_ms = jnum(pl->trainer, "push_retry_ms", 30000);
        ph->rankers = (int)jnum(p, "rankers", 1);
        ph->trainers = (int)jnum(p, "trainers", 1);
        ph->send_window = jnum(p, "send_window", -1);
        if (ph->rankers < 0 || ph->trainers < 0 || ph->rankers + ph->trainers > 64 ||
            ph->duration_s <= 0)
            die("plan %s: phases[%zu]: at most 64 clients, a positive duration", arg, i);
        json_t *f = json_object_get(p, "fault");
        if (f) {
            ph->fault = 1;
            ph->f_shard = (int)jnum(f, "shard", 0);
            /* "primary" (the default under primary-backup): the replica
             * that is the shard's primary when the fault starts (etcd) */
            json_t *fr = json_object_get(f, "replica");
            int cur = fr ? json_is_string(fr) && !strcmp(json_string_value(fr), "primary") : ph->pb;
            ph->f_replica = cur ? -1 : (int)jnum(f, "replica", pl->replicas - 1);
            if (fr && !cur && !json_is_number(fr))
                die("plan %s: phases[%zu].fault.replica: a number or \"primary\"", arg, i);
            if (cur && !ph->pb)
                die("plan %s: phases[%zu].fault.replica \"primary\" needs primary-backup", arg, i);
            ph->f_snap = jnum(f, "snapshot_at_s", -1) * g.scale;
            ph->f_kill = jnum(f, "kill_at_s", ph->duration_s / 3 / g.scale) * g.scale;
            ph->f_restart = jnum(f, "restart_at_s", ph->duration_s * 2 / 3 / g.scale) * g.scale;
            if (ph->f_shard >= pl->shards || ph->f_replica >= pl->replicas)
                die("plan %s: phases[%zu].fault: no such shard or replica", arg, i);
            if (pl->replicas < 2)
                die("plan %s: phases[%zu].fault needs 2 replicas or more", arg, i);
        }
    }
}

/* ---- one phase ---- */

static char *xstrdup(const char *s)
{
    char *d = strdup(s);
    if (!d)
        die("out of memory");
    return d;
}

static void argv_set(struct proc *p, ...)
{
    va_list ap;
    va_start(ap, p);
    int n = 0;
    for (const char *s; (s = va_arg(ap, const char *)) && n < PROC_ARGS - 1;)
        p->argv[n++] = xstrdup(s);
    p->argv[n] = NULL;
    va_end(ap);
}

static void argv_add(struct proc *p, const char *k, const char *v)
{
    int n = 0;
    while (p->argv[n])
        n++;
    if (n + 2 >= PROC_ARGS - 1)
        die("too many arguments");
    p->argv[n++] = xstrdup(k);
    if (v)
        p->argv[n++] = xstrdup(v);
    p->argv[n] = NULL;
}

static void argv_num(struct proc *p, const char *k, json_t *o, const char *jk)
{
    json_t *v = o ? json_object_get(o, jk) : NULL;
    if (!v || !json_is_number(v))
        return;
    char b[64];
    snprintf(b, sizeof b, "%.17g", json_number_value(v));
    argv_add(p, k, b);
}

/* --send-window: the phase's own (Table 7's "RDMA without / with the
 * window" split in one plan), else o's "send_window". */
static void argv_window(struct proc *p, const struct phase *ph, json_t *o)
{
    char b[32];
    if (ph->send_window < 0) {
        argv_num(p, "--send-window", o, "send_window");
        return;
    }
    snprintf(b, sizeof b, "%.0f", ph->send_window);
    argv_add(p, "--send-window", b);
}

/* Free TCP ports on addr: bound to port 0 all at once, so they differ, and
 * left bound (SO_REUSEADDR, not listening; close-on-exec) for the run's
 * life: a port let go could be taken by another program's socket before
 * its server listens on it (EADDRINUSE), while bex's listener, which sets
 * SO_REUSEADDR too, may bind a port held this way. */
static void free_ports(const char *addr, int n, int *ports)
{
    for (int i = 0; i < n; i++) {
        bex_addr a;
        if (bex_addr_parse(addr, 0, &a))
            die("a free port on %s: not an IP address", addr);
        socklen_t len = sizeof a;
        int one = 1, fd = socket(a.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
            bind(fd, &a.sa, bex_addr_len(&a)) || getsockname(fd, (struct sockaddr *)&a, &len))
            die("a free port on %s: %s", addr, strerror(errno));
        ports[i] = bex_addr_port(&a); /* fd stays open: the reservation */
    }
}

struct verify {
    int done;
    long keys, acked, unsure; /* over every replica */
    struct vrep {             /* per shard and replica */
        long checked, exact, twice, twice_rows, missing, missing_rows, unexplained, fetch_failed;
        long same; /* rows equal, bit for bit, to its peer's (replica 1 for 0, else 0) */
    } rep[16][4];
};

/* A trained key and, per replica, the Pushes of it the trainers had
 * acknowledged and those that failed there (maybe applied). */
struct kc {
    uint64_t key;
    long acked[4], unsure[4];
};

/* The trainers' counts of phase ph (dir/trainer-T.counts), one entry per
 * trained key, summed over trainers; *n_out entries. */
static struct kc *read_counts(const struct plan *pl, const struct phase *ph, const char *dir,
                              size_t *n_out)
{
    const int R = pl->replicas;
    size_t cap = 0, n = 0;
    struct kc *kc = NULL;
    uint32_t *rank_at = calloc(pl->keys, sizeof *rank_at); /* index + 1 */
    if (!rank_at)
        die("out of memory");
    for (int t = 0; t < ph->trainers; t++) {
        char path[PATH_MAX + 32];
        snprintf(path, sizeof path, "%s/trainer-%d.counts", dir, t);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        unsigned rank, nr;
        unsigned long long key;
        while (fscanf(f, "%u %llu %u", &rank, &key, &nr) == 3) {
            long a[4] = {0}, u[4] = {0};
            for (unsigned r = 0; r < nr; r++) {
                unsigned x, y;
                if (fscanf(f, "%u %u", &x, &y) != 2)
                    die("%s: malformed", path);
                if (r < 4) {
                    a[r] = x;
                    u[r] = y;
                }
            }
            if (rank >= pl->keys || (int)nr != R)
                die("%s: rank %u or %u replicas: not this plan's", path, rank, nr);
            if (!rank_at[rank]) {
                if (n == cap) {
                    cap = cap ? 2 * cap : 4096;
                    if (!(kc = realloc(kc, cap * sizeof *kc)))
                        die("out of memory");
                }
                kc[n] = (struct kc){.key = key};
                rank_at[rank] = (uint32_t)++n;
            }
            struct kc *k = &kc[rank_at[rank] - 1];
            for (int r = 0; r < R; r++) {
                k->acked[r] += a[r];
                k->unsure[r] += u[r];
            }
        }
        fclose(f);
    }
    free(rank_at);
    *n_out = n;
    return kc;
}

/* The cluster file cl with only replica r of each shard (json_dumps text). */
static char *only_replica(json_t *cl, int r)
{
    json_t *c1 = json_deep_copy(cl);
    json_t *shards =
        json_object_get(json_object_get(json_object_get(c1, "services"), "ps"), "shards");
    for (size_t s = 0; s < json_array_size(shards); s++) {
        json_t *reps = json_object_get(json_array_get(shards, s), "replicas");
        json_t *one = json_incref(json_array_get(reps, (size_t)r));
        json_array_clear(reps);
        json_array_append_new(reps, one);
    }
    char *txt = json_dumps(c1, 0);
    json_decref(c1);
    return txt;
}

/* Fetch the n keys' rows from replica r of each shard alone: 0 or an error. */
static int fetch_replica(bex_ctx *ctx, json_t *cl, int r, const struct plan *pl,
                         const uint64_t *keys, size_t n, float *rows)
{
    char *txt = only_replica(cl, r);
    bex_dir *d = NULL;
    bex_ps_client *ps = NULL;
    char err[256];
    int rc = bex_dir_create(NULL, &d);
    if (!rc)
        rc = bex_dir_load_json(d, txt, err, sizeof err);
    free(txt);
    bex_ps_client_config pc = {.dir = d, .service = "ps", .timeout_ms = 10000};
    if (!rc)
        rc = bex_ps_client_create(ctx, &pc, &ps);
    for (size_t at = 0; rc == 0 && at < n; at += 4096) {
        size_t k = n - at < 4096 ? n - at : 4096;
        rc = bex_ps_fetch_sync(ps, pl->table, pl->dim, keys + at, k, rows + at * pl->dim);
    }
    bex_ps_client_destroy(ps);
    bex_dir_destroy(d);
    return rc;
}

/* Replica r's rows against the counts: a row's value after n Pushes of the
 * constant gradient is init - lr*grad applied n times; a count above the
 * acknowledged and maybe-applied is a Push applied twice, one below the
 * acknowledged a Push lost. */
static void count_pushes(const struct plan *pl, struct verify *v, int r, const struct kc *kc,
                         const uint64_t *keys, const float *rows, size_t n, double grad)
{
    const float step = (float)pl->lr * (float)grad;
    for (size_t i = 0; i < n; i++) {
        struct vrep *vr = &v->rep[bex_ps_key_shard(keys[i], (uint32_t)pl->shards)][r];
        float init = bex_ps_init_value(pl->table, keys[i], 0, 0.01f);
        float want = rows[i * pl->dim];
        long lo = kc[i].acked[r], hi = kc[i].acked[r] + kc[i].unsure[r];
        long limit = 2 * hi + 64, cnt = -1;
        volatile float x = init;
        for (long j = 0; j <= limit; j++) {
            if (x == want) {
                cnt = j;
                break;
            }
            x = x - step;
        }
        vr->checked++;
        if (cnt < 0)
            vr->unexplained++;
        else if (cnt > hi) {
            vr->twice += cnt - hi;
            vr->twice_rows++;
        } else if (cnt < lo) {
            vr->missing += lo - cnt;
            vr->missing_rows++;
        } else
            vr->exact++;
    }
}

/* Rows equal, bit for bit, to the peer replica's (1 for 0, else 0): a
 * restarted replica caught up with its peer holds the peer's rows. */
static void compare_replicas(const struct plan *pl, struct verify *v, const uint64_t *keys,
                             const float *all, size_t n)
{
    const int R = pl->replicas;
    for (int r = 0; R > 1 && r < R; r++) {
        int p = r ? 0 : 1;
        for (size_t i = 0; i < n; i++) {
            uint32_t s = bex_ps_key_shard(keys[i], (uint32_t)pl->shards);
            if (!v->rep[s][r].fetch_failed && !v->rep[s][p].fetch_failed &&
                memcmp(all + ((size_t)r * n + i) * pl->dim, all + ((size_t)p * n + i) * pl->dim,
                       pl->dim * sizeof *all) == 0)
                v->rep[s][r].same++;
        }
    }
}

/* How many Pushes each replica applied to the trained keys, against what
 * the trainers say they acknowledged per key and replica (read_counts,
 * count_pushes), and whether the replicas agree (compare_replicas). */
static void verify_phase(const struct plan *pl, const struct phase *ph, const char *dir,
                         const char *cluster_json, struct verify *v, double grad)
{
    *v = (struct verify){0};
    const int R = pl->replicas;
    size_t n = 0;
    struct kc *kc = read_counts(pl, ph, dir, &n);
    v->keys = (long)n;
    for (size_t i = 0; i < n; i++)
        for (int r = 0; r < R; r++) {
            v->acked += kc[i].acked[r];
            v->unsure += kc[i].unsure[r];
        }
    if (n == 0) {
        free(kc);
        return;
    }
    json_error_t jerr;
    json_t *cl = json_loads(cluster_json, 0, &jerr);
    uint64_t *keys = malloc(n * sizeof *keys);
    float *rows = malloc(n * pl->dim * sizeof *rows);
    float *all = malloc((size_t)R * n * pl->dim * sizeof *all); /* every replica's */
    if (!cl || !keys || !rows || !all)
        die("out of memory");
    for (size_t i = 0; i < n; i++)
        keys[i] = kc[i].key;
    bex_ctx_config cc = {.transport = strcmp(ph->transport, "tcp") == 0    ? BEX_TRANSPORT_TCP
                                      : strcmp(ph->transport, "rdma") == 0 ? BEX_TRANSPORT_RDMA
                                                                           : BEX_TRANSPORT_AUTO};
    bex_addr_parse(g.addrs[0], 0, &cc.local_addr);
    bex_ctx *ctx;
    int rc = bex_ctx_create(&cc, &ctx);
    if (rc) {
        fprintf(stderr, "bex-cluster: check: context: %s\n", bex_strerror(rc));
        goto out;
    }
    for (int r = 0; r < R; r++) {
        rc = fetch_replica(ctx, cl, r, pl, keys, n, rows);
        if (rc) {
            fprintf(stderr, "bex-cluster: check: replica %d: %s\n", r, bex_strerror(rc));
            for (int s = 0; s < pl->shards; s++)
                v->rep[s][r].fetch_failed = 1;
            continue;
        }
        memcpy(all + (size_t)r * n * pl->dim, rows, n * pl->dim * sizeof *rows);
        count_pushes(pl, v, r, kc, keys, rows, n, grad);
    }
    compare_replicas(pl, v, keys, all, n);
    v->done = 1;
    rc = bex_ctx_destroy(ctx);
    if (rc)
        fprintf(stderr, "bex-cluster: check: context teardown: %s\n", bex_strerror(rc));
out:
    json_decref(cl);
    free(keys);
    free(rows);
    free(all);
    free(kc);
}

/* Latency samples of a phase, by role and op. */
struct lat {
    uint32_t *v; /* the ok ones after the warm-up */
    size_t n, cap;
    unsigned long long total, failed; /* all of them */
    double sum;
};

static void lat_add(struct lat *l, uint32_t us, int ok, int measured)
{
    l->total++;
    if (!ok) {
        l->failed++;
        return;
    }
    if (!measured)
        return;
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 4096;
        if (!(l->v = realloc(l->v, l->cap * sizeof *l->v)))
            die("out of memory");
    }
    l->v[l->n++] = us;
    l->sum += us;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static json_t *lat_json(struct lat *l, double secs)
{
    if (l->n)
        qsort(l->v, l->n, sizeof *l->v, cmp_u32);
    json_t *o = json_object();
    json_object_set_new(o, "count", json_integer((json_int_t)l->total));
    json_object_set_new(o, "failed", json_integer((json_int_t)l->failed));
    json_object_set_new(o, "measured", json_integer((json_int_t)l->n));
    json_object_set_new(o, "per_s", json_real(secs > 0 ? (double)l->n / secs : 0));
    json_object_set_new(o, "mean_us", json_real(l->n ? l->sum / (double)l->n : 0));
    json_object_set_new(o, "p50_us", json_integer(l->n ? l->v[l->n / 2] : 0));
    json_object_set_new(o, "p99_us",
                        json_integer(l->n ? l->v[(size_t)((double)(l->n - 1) * 0.99)] : 0));
    json_object_set_new(o, "max_us", json_integer(l->n ? l->v[l->n - 1] : 0));
    return o;
}

enum { S_RFETCH, S_REQ, S_TFETCH, S_TPUSH, S_N };
static const char *const s_names[] = {"ranker_fetch", "ranker_request", "trainer_fetch",
                                      "trainer_push"};

/* One bin of series.dat per SERIES_BIN seconds: every op's latencies. */
struct bins {
    struct lat b[S_N][1024];
    int n;
};

/* The fault's window and kill (seconds in the client's clock), and the
 * end of the first training Push started after the kill and acknowledged. */
struct fwin {
    struct lat *lat;
    double lo_s, hi_s, kill_s, first_ack_s;
};

static void load_samples(const char *path, int role, double warmup_s, struct lat *all,
                         struct bins *bn, struct fwin *w)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    char op[32];
    unsigned t, us, ok;
    fscanf(f, "%*[^\n]\n");
    while (fscanf(f, "%u,%31[^,],%u,%u\n", &t, op, &us, &ok) == 4) {
        int s = -1;
        if (role == R_RANKER)
            s = strcmp(op, "fetch") == 0 ? S_RFETCH : strcmp(op, "request") == 0 ? S_REQ : -1;
        else
            s = strcmp(op, "fetch") == 0 ? S_TFETCH : strcmp(op, "push") == 0 ? S_TPUSH : -1;
        if (s < 0)
            continue;
        lat_add(&all[s], us, (int)ok, t >= warmup_s * 1000);
        if (s == S_TPUSH && t >= w->lo_s * 1000 && t <= w->hi_s * 1000)
            lat_add(w->lat, us, (int)ok, 1);
        double end_s = (t + us / 1000.0) / 1000.0;
        if (s == S_TPUSH && ok && w->kill_s >= 0 && t >= w->kill_s * 1000 &&
            (w->first_ack_s < 0 || end_s < w->first_ack_s))
            w->first_ack_s = end_s;
        int b = (int)((double)t / 1000.0 / SERIES_BIN);
        if (b >= 0 && b < 1024) {
            lat_add(&bn->b[s][b], us, (int)ok, 1);
            if (b + 1 > bn->n)
                bn->n = b + 1;
        }
    }
    fclose(f);
}

static double tv(struct timeval t)
{
    return (double)t.tv_sec + (double)t.tv_usec / 1e6;
}

static const char *status_text(int st, char *buf, size_t len)
{
    if (WIFEXITED(st))
        snprintf(buf, len, "exit %d", WEXITSTATUS(st));
    else if (WIFSIGNALED(st))
        snprintf(buf, len, "killed by signal %d", WTERMSIG(st));
    else
        snprintf(buf, len, "status %d", st);
    return buf;
}

static void progress(int pi, int n_ph, const struct phase *ph, double t, const char *state)
{
    /* on a terminal, one line redrawn; in a log, a line every 2 s or when
     * the state changes */
    static double last;
    static char last_state[128];
    double now = now_s();
    if (g.quiet || (now - last < (g.tty ? 0.2 : 2.0) && strcmp(state, last_state) == 0))
        return;
    last = now;
    snprintf(last_state, sizeof last_state, "%s", state);
    unsigned long long rq = 0, rf = 0, it = 0, itf = 0;
    for (int i = 0; i < MAX_PROCS; i++) {
        struct proc *p = &g.procs[i];
        if (!p->used)
            continue;
        if (p->role == R_RANKER) {
            rq += p->prog_ok;
            rf += p->prog_failed;
        } else if (p->role == R_TRAINER) {
            it += p->prog_ok;
            itf += p->prog_failed;
        }
    }
    int ps_up = 0, ps_n = 0;
    for (int i = 0; i < MAX_PROCS; i++)
        if (g.procs[i].used && g.procs[i].role == R_PS) {
            ps_n++;
            ps_up += g.procs[i].running && g.procs[i].ready;
        }
    fprintf(stderr,
            "%s[phase %d/%d %s, %s] %5.1f/%.0f s | bex-ps %d/%d up | user requests %llu "
            "(%llu failed) | training iterations %llu (%llu failed)%s%s%s",
            g.tty ? "\r\033[K" : "", pi + 1, n_ph, ph->name, ph->transport, t, ph->duration_s,
            ps_up, ps_n, rq, rf, it, itf, state[0] ? " | " : "", state, g.tty ? "" : "\n");
}

/* ---- etcd for primary-backup (failover): ours, and its keys ---- */

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static void b64_enc(const char *in, char *out, size_t cap)
{
    size_t n = strlen(in), o = 0;
    for (size_t i = 0; i < n && o + 5 < cap; i += 3) {
        unsigned v = (unsigned char)in[i] << 16;
        v |= i + 1 < n ? (unsigned char)in[i + 1] << 8 : 0;
        v |= i + 2 < n ? (unsigned char)in[i + 2] : 0;
        out[o++] = B64[v >> 18 & 63];
        out[o++] = B64[v >> 12 & 63];
        out[o++] = i + 1 < n ? B64[v >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? B64[v & 63] : '=';
    }
    out[o] = 0;
}

static void b64_dec(const char *in, char *out, size_t cap)
{
    unsigned v = 0, bits = 0;
    size_t o = 0;
    for (; *in && *in != '=' && o + 1 < cap; in++) {
        const char *c = strchr(B64, *in);
        if (!c || !*c)
            break;
        v = v << 6 | (unsigned)(c - B64);
        if ((bits += 6) >= 8) {
            bits -= 8;
            out[o++] = (char)(v >> bits & 255);
        }
    }
    out[o] = 0;
}

/* The value of key in the etcd at url (http://a.b.c.d:port, its v3 JSON
 * gateway), into val: 0, or -1 (no such key, etcd did not answer in 2 s). */
static int etcd_get(const char *url, const char *key, char *val, size_t cap)
{
    char host[64], k64[1400], body[1500], req[1700], resp[8192];
    int port;
    struct sockaddr_in a = {.sin_family = AF_INET};
    if (sscanf(url, "http://%63[^:/]:%d", host, &port) != 2 ||
        inet_pton(AF_INET, host, &a.sin_addr) != 1 || strlen(key) > 1000)
        return -1;
    a.sin_port = htons((uint16_t)port);
    b64_enc(key, k64, sizeof k64);
    int bl = snprintf(body, sizeof body, "{\"key\":\"%s\"}", k64);
    int rl = snprintf(req, sizeof req,
                      "POST /v3/kv/range HTTP/1.0\r\nHost: %s:%d\r\nContent-Type: "
                      "application/json\r\nContent-Length: %d\r\n\r\n%s",
                      host, port, bl, body);
    struct timeval tmo = {2, 0};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    size_t n = 0;
    ssize_t k = -1;
    if (fd >= 0 && !setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tmo, sizeof tmo) &&
        !setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tmo, sizeof tmo) &&
        !connect(fd, (struct sockaddr *)&a, sizeof a) && write(fd, req, (size_t)rl) == rl)
        while (n < sizeof resp - 1 && (k = read(fd, resp + n, sizeof resp - 1 - n)) > 0)
            n += (size_t)k;
    if (fd >= 0)
        close(fd);
    resp[n] = 0;
    const char *js = strstr(resp, "\r\n\r\n");
    json_t *o = js ? json_loads(js + 4, 0, NULL) : NULL;
    json_t *kv = json_array_get(json_object_get(o, "kvs"), 0);
    const char *v = json_string_value(json_object_get(kv, "value"));
    if (v)
        b64_dec(v, val, cap);
    json_decref(o);
    return v ? 0 : -1;
}

/* The etcd program: $BEX_ETCD, else etcd on PATH (Debian's etcd-server). */
static void etcd_program(char *out, size_t cap)
{
    const char *e = getenv("BEX_ETCD"), *name = e && *e ? e : "etcd";
    if (strchr(name, '/')) {
        snprintf(out, cap, "%s", name);
        return;
    }
    const char *path = getenv("PATH");
    for (const char *p = path && *path ? path : "/usr/bin:/bin"; p;) {
        const char *c = strchr(p, ':');
        int l = c ? (int)(c - p) : (int)strlen(p);
        snprintf(out, cap, "%.*s/%s", l, p, name);
        if (access(out, X_OK) == 0)
            return;
        p = c ? c + 1 : NULL;
    }
    die("primary-backup fails over through etcd: no %s on PATH (install etcd-server: "
        "scripts/deps; or set BEX_ETCD, or give --etcd URL)",
        name);
}

/* Whether something listens at 127.0.0.1:port. */
static int tcp_listens(int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr = {htonl(INADDR_LOOPBACK)}};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

/* Our etcd (once for the run, on 127.0.0.1, its data in TMPDIR),
 * listening when this returns 0; -1: interrupted. */
static int start_own_etcd(void)
{
    if (g.own_etcd[0])
        return 0;
    char bin[PATH_MAX], data[1100], curl[64], purl[64], init[96], log[2100];
    int ports[2];
    etcd_program(bin, sizeof bin);
    free_ports("127.0.0.1", 2, ports);
    snprintf(curl, sizeof curl, "http://127.0.0.1:%d", ports[0]);
    snprintf(purl, sizeof purl, "http://127.0.0.1:%d", ports[1]);
    snprintf(init, sizeof init, "demo=%s", purl);
    snprintf(data, sizeof data, "%s/etcd", g.snap_root);
    snprintf(log, sizeof log, "%s/etcd.log", g.out);
    struct proc *p = proc_new(R_ETCD, 0, "etcd");
    argv_set(p, bin, "--name", "demo", "--data-dir", data, "--listen-client-urls", curl,
             "--advertise-client-urls", curl, "--listen-peer-urls", purl,
             "--initial-advertise-peer-urls", purl, "--initial-cluster", init, "--log-level",
             "warn", NULL);
    proc_spawn(p, log);
    for (double t0 = now_s(); !tcp_listens(ports[0]);) {
        if (!p->running)
            die("etcd (%s) exited (see %s)", bin, log);
        if (now_s() - t0 > READY_WAIT * g.scale)
            die("etcd not listening after %d s (see %s)", READY_WAIT, log);
        if (pump(100))
            return -1;
    }
    snprintf(g.own_etcd, sizeof g.own_etcd, "%s", curl);
    return 0;
}

/* The etcd a primary-backup phase fails over through (NULL: none). */
static const char *pb_etcd(const struct phase *ph)
{
    return !ph->pb ? NULL : g.etcd ? g.etcd : g.own_etcd;
}

/* ---- etcd (--etcd) ---- */

/* The key prefix of phase pi's servers, and of the instances' signals. */
static void etcd_prefix(char *buf, size_t cap, int pi)
{
    if (pi >= 0)
        snprintf(buf, cap, "%sphase%d/", g.etcd_prefix, pi + 1);
    else
        snprintf(buf, cap, "%sctl/", g.etcd_prefix);
}

/* A directory following prefix in etcd (dies when etcd does not answer). */
static bex_dir *etcd_dir(const char *prefix)
{
    bex_dir *d;
    char err[256] = "";
    int rc = bex_dir_create(NULL, &d);
    if (rc == 0 && (rc = bex_dir_watch_etcd(d, g.etcd, prefix, err, sizeof err)))
        bex_dir_destroy(d);
    if (rc)
        die("etcd %s: %s", g.etcd, err[0] ? err : bex_strerror(rc));
    return d;
}

/* The cluster file's text from what phase pi's servers registered in etcd
 * (the other instance's, or ours): waits until every shard has R replicas,
 * each named by its locality dc1/podR, for at most wait_s. NULL when a
 * stop signal came. */
static char *etcd_cluster(int pi, int S, int R, double wait_s)
{
    char prefix[512];
    etcd_prefix(prefix, sizeof prefix, pi);
    bex_dir *d = etcd_dir(prefix);
    double end = now_s() + wait_s;
    json_t *shards = NULL;
    while (!shards) {
        shards = json_array();
        for (int s = 0; shards && s < S; s++) {
            bex_dir_replica reps[16];
            size_t n = bex_dir_replicas(d, "ps", (uint32_t)s, reps, 16);
            json_t *by_r[4] = {0};
            for (size_t i = 0; i < n && i < 16; i++) {
                int r;
                char ap[BEX_ADDR_STRLEN];
                if (sscanf(reps[i].locality, "dc1/pod%d", &r) != 1 || r < 0 || r >= R || by_r[r])
                    continue;
                bex_addr_format(&reps[i].addr, true, ap, sizeof ap);
                by_r[r] = json_pack("{s:s,s:s,s:s}", "addr", ap, "locality", reps[i].locality,
                                    "transport",
                                    reps[i].transport == BEX_TRANSPORT_RDMA  ? "rdma"
                                    : reps[i].transport == BEX_TRANSPORT_TCP ? "tcp"
                                                                             : "auto");
            }
            json_t *rl = json_array();
            for (int r = 0; r < R; r++)
                if (by_r[r])
                    json_array_append_new(rl, by_r[r]);
            if ((int)json_array_size(rl) < R) {
                json_decref(rl);
                json_decref(shards);
                shards = NULL;
                break;
            }
            json_array_append_new(shards, json_pack("{s:o}", "replicas", rl));
        }
        if (shards)
            break;
        if (now_s() > end)
            die("phase %d: not every replica registered in etcd (%s, under %s) after %.0f s",
                pi + 1, g.etcd, prefix, wait_s);
        if (pump(200)) {
            bex_dir_destroy(d);
            return NULL;
        }
    }
    bex_dir_destroy(d);
    json_t *cl = json_pack("{s:i,s:{s:{s:o}}}", "version", 1, "services", "ps", "shards", shards);
    char *txt = json_dumps(cl, JSON_INDENT(2));
    json_decref(cl);
    return txt;
}

/* Merge one ranker's fetch_bytes into acc (NULL: a copy of it): counts
 * and the histogram added, min and max kept, means weighted. */
static json_t *fetch_bytes_merge(json_t *acc, json_t *b)
{
    if (!acc) {
        acc = json_deep_copy(b);
        json_object_del(acc, "large_mean_us");
        json_object_set_new(acc, "large_lat_sum_us",
                            json_real(jnum(b, "large_mean_us", 0) *
                                      (jnum(b, "large", 0) - jnum(b, "large_failed", 0))));
        return acc;
    }
    double n0 = jnum(acc, "count", 0), n1 = jnum(b, "count", 0);
    if (n1 > 0 && (n0 == 0 || jnum(b, "min", 0) < jnum(acc, "min", 0)))
        json_object_set_new(acc, "min", json_integer((json_int_t)jnum(b, "min", 0)));
    if (jnum(b, "max", 0) > jnum(acc, "max", 0))
        json_object_set_new(acc, "max", json_integer((json_int_t)jnum(b, "max", 0)));
    if (n0 + n1 > 0)
        json_object_set_new(
            acc, "mean",
            json_real((jnum(acc, "mean", 0) * n0 + jnum(b, "mean", 0) * n1) / (n0 + n1)));
    json_object_set_new(acc, "count", json_integer((json_int_t)(n0 + n1)));
    json_object_set_new(acc, "large_lat_sum_us",
                        json_real(jnum(acc, "large_lat_sum_us", 0) +
                                  jnum(b, "large_mean_us", 0) *
                                      (jnum(b, "large", 0) - jnum(b, "large_failed", 0))));
    static const char *const sums[] = {"mib_or_more", "large", "large_failed"};
    for (size_t k = 0; k < 3; k++)
        json_object_set_new(
            acc, sums[k], json_integer((json_int_t)(jnum(acc, sums[k], 0) + jnum(b, sums[k], 0))));
    json_t *ha = json_object_get(acc, "hist"), *hb = json_object_get(b, "hist");
    for (size_t i = 0; i < json_array_size(ha) && i < json_array_size(hb); i++) {
        json_t *x = json_array_get(ha, i), *y = json_array_get(hb, i);
        json_array_set_new(x, 1,
                           json_integer(json_integer_value(json_array_get(x, 1)) +
                                        json_integer_value(json_array_get(y, 1))));
    }
    return acc;
}

/* One phase's run: what its steps share. */
struct prun {
    const struct plan *pl;
    const struct phase *ph;
    int pi, S, R;
    char dir[3072], snapdir[PATH_MAX + 16], cluster[PATH_MAX + 32];
    char ps_addr[16][4][BEX_ADDR_STRLEN]; /* "a.b.c.d:port", "[v6]:port" */
    char *cl_txt;                         /* the cluster file */
    struct proc *ps[16][4];
    struct proc *cl_p[64];
    int n_cl;
    double grad;
    bex_dir *ctl; /* --etcd: the clients' registrations */
    bex_dir_registration *ctl_reg;
    double start_s;        /* the phase's clock's start (CLOCK_MONOTONIC) */
    double win_lo, win_hi; /* the fault's window (s of the phase), -1: none */
    struct lat win;        /* the trainers' Pushes started in it */
    double kill_s;         /* the fault's kill -9 (s of the phase), -1: none */
    double first_ack_s;    /* the first Push started after it acknowledged, -1: none */
};

/* The fault's course. */
struct frun {
    int rep; /* the replica the fault hits (-1: not chosen yet) */
    int snapped, killed, restarted, restart_ready;
    double t0; /* its clock's start (s of the phase): the clients work; -1: not yet */
    double kill_t, restart_t, ready_t;
    char state[128];
    json_t *events;
};

static void phase_dirs(struct prun *r)
{
    snprintf(r->dir, sizeof r->dir, "%s/phase%d-%s", g.out, r->pi + 1, r->ph->name);
    if (mkdir(r->dir, 0755) && errno != EEXIST)
        die("%s: %s", r->dir, strerror(errno));
    /* snapshots in TMPDIR, not beside the results: written every second
     * and fsynced, they cost little on a local disk or tmpfs, and a lot on
     * the VM's 9p share where the results go */
    snprintf(r->snapdir, sizeof r->snapdir, "%s/phase%d", g.snap_root, r->pi + 1);
    if (mkdir(r->snapdir, 0755) && errno != EEXIST)
        die("%s: %s", r->snapdir, strerror(errno));
}

/* The cluster file: replica r of every shard on address r. */
static void write_cluster(struct prun *r)
{
    json_t *shards = json_array();
    for (int k = 0; k < r->R; k++) {
        const char *a = g.addrs[k % g.n_addrs];
        int ports[64];
        free_ports(a, r->S, ports);
        for (int s = 0; s < r->S; s++) {
            if (k == 0)
                json_array_append_new(shards, json_pack("{s:[]}", "replicas"));
            char *ap = r->ps_addr[s][k], loc[32];
            bex_addr pa;
            if (bex_addr_parse(a, (uint16_t)ports[s], &pa))
                die("%s: not an IP address", a);
            bex_addr_format(&pa, true, ap, sizeof r->ps_addr[s][k]);
            snprintf(loc, sizeof loc, "dc1/pod%d", k);
            json_array_append_new(json_object_get(json_array_get(shards, (size_t)s), "replicas"),
                                  json_pack("{s:s,s:s,s:s}", "addr", ap, "locality", loc,
                                            "transport", r->ph->transport));
        }
    }
    json_t *cl = json_pack("{s:i,s:{s:{s:o}}}", "version", 1, "services", "ps", "shards", shards);
    r->cl_txt = json_dumps(cl, JSON_INDENT(2));
    json_decref(cl);
    snprintf(r->cluster, sizeof r->cluster, "%s/cluster.json", r->dir);
    FILE *cf = g.servers ? fopen(r->cluster, "w") : NULL;
    if (g.servers && (!cf || fputs(r->cl_txt, cf) < 0 || fclose(cf)))
        die("%s: %s", r->cluster, strerror(errno));
}

/* primary-backup: failover through etcd, every replica of shard s listed
 * (bex-ps --replicas), the lease as the plan's "ps" says. */
static void pb_args(const struct prun *r, struct proc *p, int s)
{
    char reps[4 * 64 + 4] = "";
    for (int k = 0; k < r->R; k++)
        snprintf(reps + strlen(reps), sizeof reps - strlen(reps), "%s%s", k ? "," : "",
                 r->ps_addr[s][k]);
    argv_add(p, "--primary-backup", NULL);
    argv_add(p, "--replicas", reps);
    argv_num(p, "--lease-ttl-ms", r->pl->ps, "lease_ttl_ms");
    argv_num(p, "--lease-margin-ms", r->pl->ps, "lease_margin_ms");
    argv_num(p, "--forward-timeout-ms", r->pl->ps, "forward_timeout_ms");
}

/* bex-ps for shard s, replica k: with --etcd, registered there under the
 * phase's prefix. */
static void spawn_server(struct prun *r, int s, int k)
{
    const struct plan *pl = r->pl;
    const struct phase *ph = r->ph;
    char name[64], loc[32], tab[64], b1[32], b2[32], prefix[512], nsh[16], path[PATH_MAX + 64];
    snprintf(tab, sizeof tab, "%u:%u:sgd:%.9g", pl->table, pl->dim, pl->lr);
    etcd_prefix(prefix, sizeof prefix, r->pi);
    snprintf(nsh, sizeof nsh, "%d", r->S);
    snprintf(name, sizeof name, "ps-shard%d-replica%d", s, k);
    struct proc *p = r->ps[s][k] = proc_new(R_PS, s * r->R + k, name);
    snprintf(b1, sizeof b1, "%d", s);
    snprintf(b2, sizeof b2, "%d", k);
    snprintf(loc, sizeof loc, "dc1/pod%d", k);
    const char *url = g.etcd ? g.etcd : pb_etcd(ph);
    if (url) /* at the same port when restarted: the clients' file stays true */
        argv_set(p, g.ps_bin, "--etcd", url, "--etcd-prefix", prefix, "--listen", r->ps_addr[s][k],
                 "--n-shards", nsh, "--locality", loc, "--shard", b1, "--replica", b2, "--table",
                 tab, "--snapshot-dir", r->snapdir, "--transport", ph->transport, NULL);
    else
        argv_set(p, g.ps_bin, "--cluster", r->cluster, "--shard", b1, "--replica", b2, "--table",
                 tab, "--snapshot-dir", r->snapdir, "--transport", ph->transport, NULL);
    if (ph->pb)
        pb_args(r, p, s);
    argv_num(p, "--snapshot-every", pl->ps, "snapshot_every_ms");
    argv_num(p, "--keepalive-timeout-ms", pl->ps, "keepalive_timeout_ms");
    argv_num(p, "--eager-max", pl->ps, "eager_max");
    argv_window(p, ph, pl->ps);
    argv_num(p, "--io-threads", pl->ps, "io_threads");
    if (ph->poll)
        argv_add(p, "--poll", ph->poll);
    snprintf(path, sizeof path, "%s/%s.log", r->dir, name);
    proc_spawn(p, path);
}

/* The servers (this instance's half, unless --only clients), ready; then,
 * with --etcd, the clients' cluster file from the registrations (the
 * other instance's servers may still be starting, or finishing the
 * previous phase). -1: interrupted. */
static int start_servers(struct prun *r)
{
    if (g.servers && r->ph->pb && !g.etcd && start_own_etcd())
        return -1;
    for (int s = 0; g.servers && s < r->S; s++)
        for (int k = 0; k < r->R; k++)
            spawn_server(r, s, k);
    double t0 = now_s();
    for (; g.servers;) {
        int ready = 0;
        for (int s = 0; s < r->S; s++)
            for (int k = 0; k < r->R; k++) {
                struct proc *p = r->ps[s][k];
                if (!p->running)
                    die("%s did not start (see %s/%s.log)", p->name, r->dir, p->name);
                ready += p->ready;
            }
        if (ready == r->S * r->R)
            break;
        if (now_s() - t0 > READY_WAIT * g.scale)
            die("bex-ps not ready after %d s (see %s)", READY_WAIT, r->dir);
        if (pump(100))
            return -1;
        progress(r->pi, r->pl->n_ph, r->ph, 0, "starting bex-ps");
    }
    if (g.clients && g.etcd) {
        free(r->cl_txt);
        r->cl_txt = etcd_cluster(r->pi, r->S, r->R, (g.servers ? 1 : 4) * READY_WAIT * g.scale);
        if (!r->cl_txt)
            return -1;
        FILE *cf = fopen(r->cluster, "w");
        if (!cf || fputs(r->cl_txt, cf) < 0 || fclose(cf))
            die("%s: %s", r->cluster, strerror(errno));
    }
    return 0;
}

/* Client i of the phase: ranker i, or trainer i - rankers. */
static void spawn_client(struct prun *r, int i)
{
    const struct plan *pl = r->pl;
    const struct phase *ph = r->ph;
    int rk = i < ph->rankers, k = rk ? i : i - ph->rankers;
    char name[64], loc[32], json[PATH_MAX + 64], smp[PATH_MAX + 64], path[PATH_MAX + 64];
    char dur[32], keys[32], zipf[32], dim[32], table[32], seed[32], bin[PATH_MAX + 16];
    snprintf(dur, sizeof dur, "%.3f", ph->duration_s);
    snprintf(keys, sizeof keys, "%u", pl->keys);
    snprintf(zipf, sizeof zipf, "%g", pl->zipf);
    snprintf(dim, sizeof dim, "%u", pl->dim);
    snprintf(table, sizeof table, "%u", pl->table);
    snprintf(name, sizeof name, "%s-%d", rk ? "ranker" : "trainer", k);
    snprintf(loc, sizeof loc, "dc1/pod%d", k % r->R);
    snprintf(json, sizeof json, "%s/%s.json", r->dir, name);
    snprintf(smp, sizeof smp, "%s/%s.samples.csv", r->dir, name);
    snprintf(seed, sizeof seed, "%d", 1000 * (r->pi + 1) + i);
    struct proc *p = r->cl_p[i] = proc_new(rk ? R_RANKER : R_TRAINER, k, name);
    snprintf(bin, sizeof bin, "%s/bex-%s", g.bin, rk ? "ranker" : "trainer");
    argv_set(p, bin, "--cluster", r->cluster, "--transport", ph->transport, "--addr",
             g.addrs[k % g.n_addrs], "--locality", loc, "--duration", dur, "--keys", keys, "--zipf",
             zipf, "--dim", dim, "--table", table, "--seed", seed, "--json", json, "--samples", smp,
             "--progress", NULL);
    json_t *o = rk ? pl->ranker : pl->trainer;
    argv_num(p, "--outstanding", o, "outstanding");
    argv_num(p, "--timeout-ms", o, "timeout_ms");
    argv_num(p, "--attempt-timeout-ms", o, "attempt_timeout_ms");
    argv_num(p, "--connect-timeout-ms", o, "connect_timeout_ms");
    argv_num(p, "--keepalive-timeout-ms", o, "keepalive_timeout_ms");
    argv_num(p, "--eager-max", o, "eager_max");
    argv_window(p, ph, o);
    if (ph->poll)
        argv_add(p, "--poll", ph->poll);
    if (rk) {
        argv_num(p, "--models", o, "models");
        argv_num(p, "--keys-min", o, "keys_min");
        argv_num(p, "--keys-max", o, "keys_max");
        argv_num(p, "--large-every", o, "large_every");
        argv_num(p, "--large-keys", o, "large_keys");
        argv_num(p, "--rate", o, "rate");
    } else {
        argv_num(p, "--compute-us", o, "compute_us");
        argv_num(p, "--mean-bytes", o, "mean_bytes");
        argv_num(p, "--p99-bytes", o, "p99_bytes");
        char gs[32], cnt[PATH_MAX + 64];
        snprintf(gs, sizeof gs, "%.17g", r->grad);
        argv_add(p, "--grad", gs);
        snprintf(cnt, sizeof cnt, "%s/%s.counts", r->dir, name);
        argv_add(p, "--counts", cnt);
        if (ph->pb) {
            char rms[32];
            snprintf(rms, sizeof rms, "%.0f", ph->retry_ms * g.scale);
            argv_add(p, "--push-primary", NULL);
            argv_add(p, "--push-retry-ms", rms);
        }
    }
    snprintf(path, sizeof path, "%s/%s.log", r->dir, name);
    proc_spawn(p, path);
}

/* --only clients: the other instance learns that they run (and when they
 * are done: the registration goes) from a registration in etcd, service
 * "clients", shard = the phase's index; --only servers: it waits for
 * that. -1: interrupted. */
static int sync_instances(struct prun *r)
{
    char ctl_prefix[512];
    etcd_prefix(ctl_prefix, sizeof ctl_prefix, -1);
    if (g.etcd && !g.servers) {
        bex_dir_replica me = {0};
        if (bex_addr_parse(g.addrs[0], (uint16_t)(r->pi + 1), &me.addr))
            die("%s: not an IP address", g.addrs[0]);
        char err[256] = "";
        int rc = bex_dir_register_etcd(g.etcd, ctl_prefix, "clients", (uint32_t)r->pi, &me, 10, err,
                                       sizeof err, &r->ctl_reg);
        if (rc)
            die("etcd %s: %s", g.etcd, err[0] ? err : bex_strerror(rc));
    }
    if (g.etcd && !g.clients) {
        r->ctl = etcd_dir(ctl_prefix);
        double end = now_s() + 4 * READY_WAIT * g.scale;
        while (bex_dir_replicas(r->ctl, "clients", (uint32_t)r->pi, NULL, 0) == 0) {
            if (now_s() > end)
                die("phase %d: the clients' bex-cluster did not start its clients within %.0f s "
                    "(etcd %s, %s)",
                    r->pi + 1, 4 * READY_WAIT * g.scale, g.etcd, ctl_prefix);
            if (pump(100))
                return -1;
            progress(r->pi, r->pl->n_ph, r->ph, 0, "waiting for the clients' bex-cluster");
        }
    }
    return 0;
}

static void fault_event(struct frun *f, double t, const char *event, const struct proc *v)
{
    json_array_append_new(f->events,
                          json_pack("{s:f,s:s,s:s}", "t_s", t, "event", event, "process", v->name));
}

/* The replica the fault hits: the plan's, or (replica "primary") the
 * shard's primary now, as etcd names it; -1: none named yet. */
static int fault_victim(const struct prun *r)
{
    const struct phase *ph = r->ph;
    if (ph->f_replica >= 0)
        return ph->f_replica;
    char key[700], val[128];
    etcd_prefix(key, sizeof key, r->pi);
    snprintf(key + strlen(key), sizeof key - strlen(key), "ps/ps/%d/primary", ph->f_shard);
    if (etcd_get(pb_etcd(ph), key, val, sizeof val))
        return -1;
    for (int k = 0; k < r->R; k++)
        if (!strcmp(val, r->ps_addr[ph->f_shard][k]))
            return k;
    return -1;
}

/* The fault's events due at t: snapshot, kill -9, restart, ready again. */
/* The fault's events due at tf (seconds since the clients work), taken
 * at t (of the phase): snapshot, kill -9, restart, ready again. */
static void fault_step(struct prun *r, struct frun *f, double t, double tf)
{
    const struct phase *ph = r->ph;
    if (f->rep < 0 && (!f->snapped || !f->killed) &&
        ((ph->f_snap >= 0 && tf >= ph->f_snap) || tf >= ph->f_kill))
        f->rep = fault_victim(r);
    if (f->rep < 0)
        return;
    struct proc *v = r->ps[ph->f_shard][f->rep];
    if (!f->snapped && ph->f_snap >= 0 && tf >= ph->f_snap) {
        f->snapped = 1;
        kill(v->pid, SIGUSR1);
        fault_event(f, t, "snapshot (SIGUSR1)", v);
    }
    if (!f->killed && tf >= ph->f_kill) {
        f->killed = 1;
        f->kill_t = t;
        v->killed = 1;
        kill(v->pid, SIGKILL);
        snprintf(f->state, sizeof f->state, "%s killed (kill -9) at %.1f s", v->name, t);
        fault_event(f, t, "kill -9", v);
    }
    if (f->killed && !f->restarted && tf >= ph->f_restart && !v->running) {
        f->restarted = 1;
        f->restart_t = t;
        if (v->out_fd >= 0) {
            close(v->out_fd);
            v->out_fd = -1;
        }
        char path[PATH_MAX + 64];
        snprintf(path, sizeof path, "%s/%s.log", r->dir, v->name);
        proc_spawn(v, path);
        snprintf(f->state, sizeof f->state, "%s restarted at %.1f s", v->name, t);
        fault_event(f, t, "restart", v);
    }
    if (f->restarted && !f->restart_ready && v->ready) {
        f->restart_ready = 1;
        f->ready_t = t;
        snprintf(f->state, sizeof f->state, "%s back (restarted at %.1f s, ready at %.1f s)",
                 v->name, f->restart_t, t);
        fault_event(f, t, "ready again", v);
    }
}

/* Whether every trainer (every client, without trainers) did its first
 * operation, or ended. */
static int clients_work(const struct prun *r)
{
    for (int i = 0; i < r->n_cl; i++) {
        const struct proc *p = r->cl_p[i];
        if ((r->ph->trainers == 0 || p->role == R_TRAINER) && p->running && !p->progressed)
            return 0;
    }
    return 1;
}

/* Whether the fault still has its restart to make, or its restarted
 * replica to see ready, at t: the clients may end first (under load they
 * start late, and the fault's clock starts when they work), and the check
 * after the phase reads every replica, the restarted one caught up. Not
 * past READY_WAIT (scaled) after the restart: the check then says so. */
static int fault_pending(const struct prun *r, const struct frun *f, double t)
{
    if (!r->ph->fault || !g.servers || f->t0 < 0 || !f->killed || f->restart_ready)
        return 0;
    return !f->restarted || t - f->restart_t <= READY_WAIT * g.scale;
}

/* The run: the fault's events, the progress line, until the clients end
 * and the fault is over. Returns how long it took, or -1: interrupted. */
static double watch_phase(struct prun *r, struct frun *f)
{
    const struct phase *ph = r->ph;
    double start = now_s();
    r->start_s = start;
    for (;;) {
        double t = now_s() - start;
        /* the fault's clock starts when the clients work: in the VM they
         * take tens of seconds to start, and a fault timed from their
         * spawning was over before a trainer Pushed */
        if (ph->fault && g.servers && f->t0 < 0 && (!g.clients || clients_work(r)))
            f->t0 = t;
        if (ph->fault && g.servers && f->t0 >= 0)
            fault_step(r, f, t, t - f->t0);
        int clients = 0;
        for (int i = 0; i < r->n_cl; i++)
            clients += r->cl_p[i]->running;
        if (r->ctl ? bex_dir_replicas(r->ctl, "clients", (uint32_t)r->pi, NULL, 0) == 0
                   : clients == 0 && !fault_pending(r, f, t))
            break;
        if (r->ctl && t > ph->duration_s + 4 * (EXTRA_WAIT + READY_WAIT) * g.scale)
            die("phase %d: the clients' bex-cluster did not finish", r->pi + 1);
        /* primary-backup: a trainer's last Push may be retried that long */
        double extra = (EXTRA_WAIT + (ph->pb ? ph->retry_ms / 1000 : 0)) * g.scale;
        if (t > ph->duration_s + extra) {
            fprintf(stderr, "\nbex-cluster: clients still running %.0f s past the phase: stopped\n",
                    extra);
            for (int i = 0; i < r->n_cl; i++)
                if (r->cl_p[i]->running)
                    kill(r->cl_p[i]->pid, SIGKILL);
        }
        for (int s = 0; g.servers && s < r->S; s++)
            for (int k = 0; k < r->R; k++) {
                struct proc *p = r->ps[s][k];
                if (!p->running && !p->killed) {
                    char st[64];
                    die("%s stopped during the phase (%s; see %s/%s.log)", p->name,
                        status_text(p->status, st, sizeof st), r->dir, p->name);
                }
            }
        if (pump(200))
            return -1;
        progress(r->pi, r->pl->n_ph, ph, t < ph->duration_s ? t : ph->duration_s, f->state);
    }
    return now_s() - start;
}

/* What the clients' reports add up to. */
struct totals {
    double cu, cs, ops, su, ss;
    long long retries, failovers, throttled, partial;
    int bad_clients;
    json_t *fb; /* the rankers' Fetch answer sizes, merged (bex-ranker's fetch_bytes) */
};

/* The clients' reports (in the returned array), their samples into all
 * and bn, their sums into tt. */
static json_t *collect_clients(struct prun *r, struct totals *tt, struct lat *all, struct bins *bn)
{
    json_t *clients = json_array();
    char path[PATH_MAX + 64];
    for (int i = 0; i < r->n_cl; i++) {
        struct proc *p = r->cl_p[i];
        char st[64];
        if (!WIFEXITED(p->status) || WEXITSTATUS(p->status) != 0) {
            fprintf(stderr, "bex-cluster: %s: %s (see %s/%s.log)\n", p->name,
                    status_text(p->status, st, sizeof st), r->dir, p->name);
            tt->bad_clients++;
        }
        snprintf(path, sizeof path, "%s/%s.json", r->dir, p->name);
        json_error_t je;
        json_t *cj = json_load_file(path, 0, &je);
        if (cj) {
            json_t *cpu = json_object_get(cj, "cpu");
            tt->cu += jnum(cpu, "user_s", 0);
            tt->cs += jnum(cpu, "sys_s", 0);
            tt->ops += jnum(cpu, "ops", 0);
            tt->retries += (long long)jnum(cj, "retries", 0);
            tt->failovers += (long long)jnum(cj, "failovers", 0);
            tt->throttled += (long long)jnum(cj, "retry_throttled", 0);
            tt->partial += (long long)jnum(cj, "push_partial", 0);
            json_t *b = json_object_get(cj, "fetch_bytes");
            if (b)
                tt->fb = fetch_bytes_merge(tt->fb, b);
            json_object_set_new(cj, "name", json_string(p->name));
            json_array_append_new(clients, cj);
        } else if (WIFEXITED(p->status) && WEXITSTATUS(p->status) == 0) {
            fprintf(stderr, "bex-cluster: %s: %s\n", path, je.text);
            tt->bad_clients++;
        }
        snprintf(path, sizeof path, "%s/%s.samples.csv", r->dir, p->name);
        /* the window in the client's clock (its samples' times count from
         * its own start, t0_mono_s in its report: seconds after ours) */
        double off = cj ? jnum(cj, "t0_mono_s", r->start_s) - r->start_s : 0;
        struct fwin w = {&r->win, r->win_lo - off, r->win_hi - off,
                         r->kill_s >= 0 ? r->kill_s - off : -1, -1};
        load_samples(path, p->role, r->ph->warmup_s, all, bn, &w);
        if (w.first_ack_s >= 0 && (r->first_ack_s < 0 || w.first_ack_s + off < r->first_ack_s))
            r->first_ack_s = w.first_ack_s + off;
    }
    for (int s = 0; g.servers && s < r->S; s++)
        for (int k = 0; k < r->R; k++) {
            /* a killed replica's first life is not in its rusage: only the
             * restarted one's */
            tt->su += tv(r->ps[s][k]->ru.ru_utime);
            tt->ss += tv(r->ps[s][k]->ru.ru_stime);
        }
    return clients;
}

static json_t *cpu_json(const struct totals *tt)
{
    double ops = tt->ops;
    json_t *cpu = json_object();
    json_object_set_new(cpu, "ops", json_real(ops));
    json_object_set_new(cpu, "client_user_us_per_op", json_real(ops ? tt->cu * 1e6 / ops : 0));
    json_object_set_new(cpu, "client_sys_us_per_op", json_real(ops ? tt->cs * 1e6 / ops : 0));
    json_object_set_new(cpu, "server_user_us_per_op", json_real(ops ? tt->su * 1e6 / ops : 0));
    json_object_set_new(cpu, "server_sys_us_per_op", json_real(ops ? tt->ss * 1e6 / ops : 0));
    return cpu;
}

/* The fault's record (events taken), or NULL for a phase without one. */
static json_t *fault_json(const struct phase *ph, struct frun *f)
{
    if (ph->fault && g.servers)
        return json_pack("{s:i,s:i,s:f,s:f,s:f,s:o}", "shard", ph->f_shard, "replica", f->rep,
                         "killed_at_s", f->kill_t, "restarted_at_s", f->restart_t,
                         "ready_again_at_s", f->ready_t, "events", f->events);
    json_decref(f->events);
    if (ph->fault) /* the servers' instance did it: the plan's times */
        return json_pack("{s:i,s:i,s:f,s:f,s:b}", "shard", ph->f_shard, "replica", ph->f_replica,
                         "kill_at_s", ph->f_kill, "restart_at_s", ph->f_restart,
                         "by_servers_instance", 1);
    return NULL;
}

/* The trainers' Pushes during the fault (r->win), into the fault's
 * record: how many, how many failed in the end (retried by id or not),
 * their P99, how long the replica was down and the outage the trainers
 * saw (the longest a Push took). */
static void fault_window_json(json_t *fj, struct prun *r)
{
    json_t *w = lat_json(&r->win, r->win_hi - r->win_lo);
    json_object_set_new(w, "from_s", json_real(r->win_lo));
    json_object_set_new(w, "to_s", json_real(r->win_hi));
    json_object_set_new(fj, "push_during", w);
    double down = jnum(fj, "ready_again_at_s", -1) - jnum(fj, "killed_at_s", 0);
    json_object_set_new(fj, "down_s", json_real(down));
    json_object_set_new(fj, "outage_s",
                        json_real(r->win.n ? (double)r->win.v[r->win.n - 1] / 1e6 : 0));
    /* failover: from the kill to the first training Push the shard's new
     * primary acknowledged (each trainer Push spans every shard: one
     * started after the kill needs it); -1: none */
    if (r->ph->pb)
        json_object_set_new(fj, "failover_s",
                            json_real(r->first_ack_s >= 0 ? r->first_ack_s - r->kill_s : -1));
    free(r->win.v);
    r->win = (struct lat){0};
}

/* The check of applied Pushes, into res. */
static void push_check_json(json_t *res, const struct verify *vf, const struct phase *ph, int S,
                            int R, int killed)
{
    json_t *v = json_object();
    json_object_set_new(v, "keys", json_integer(vf->keys));
    json_object_set_new(v, "acknowledged", json_integer(vf->acked));
    json_object_set_new(v, "failed_at_replica", json_integer(vf->unsure));
    json_t *reps = json_array();
    long twice = 0, missing = 0;
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++) {
            const struct vrep *q = &vf->rep[s][r];
            json_t *o = json_object();
            json_object_set_new(o, "shard", json_integer(s));
            json_object_set_new(o, "replica", json_integer(r));
            json_object_set_new(o, "killed",
                                json_boolean(ph->fault && s == ph->f_shard && r == killed));
            json_object_set_new(o, "rows_checked", json_integer(q->checked));
            json_object_set_new(o, "rows_exact", json_integer(q->exact));
            json_object_set_new(o, "pushes_applied_twice", json_integer(q->twice));
            json_object_set_new(o, "rows_applied_twice", json_integer(q->twice_rows));
            json_object_set_new(o, "pushes_missing", json_integer(q->missing));
            json_object_set_new(o, "rows_missing", json_integer(q->missing_rows));
            json_object_set_new(o, "rows_unexplained", json_integer(q->unexplained));
            json_object_set_new(o, "rows_equal_to_peer", json_integer(q->same));
            json_object_set_new(o, "fetch_failed", json_boolean(q->fetch_failed));
            json_array_append_new(reps, o);
            twice += q->twice;
            missing += q->missing;
        }
    json_object_set_new(v, "replicas", reps);
    json_object_set_new(res, "push_check", v);
    json_object_set_new(res, "pushes_applied_twice", json_integer(twice));
    json_object_set_new(res, "pushes_missing", json_integer(missing));
}

/* series.dat: phase t_s mean/p99 (ms) per op, failed user requests. */
static void write_series(int pi, const struct phase *ph, struct bins *bn)
{
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/series.dat", g.out);
    FILE *sf = fopen(path, "a");
    if (!sf)
        return;
    for (int b = 0; b < bn->n; b++) {
        fprintf(sf, "%d %s %.1f", pi + 1, ph->name, (b + 0.5) * SERIES_BIN);
        for (int s = 0; s < S_N; s++) {
            struct lat *l = &bn->b[s][b];
            if (l->n)
                qsort(l->v, l->n, sizeof *l->v, cmp_u32);
            if (l->n)
                fprintf(sf, " %.3f %.3f", l->sum / (double)l->n / 1000,
                        l->v[(size_t)((double)(l->n - 1) * 0.99)] / 1000.0);
            else
                fprintf(sf, " NaN NaN");
        }
        fprintf(sf, " %llu\n", bn->b[S_REQ][b].failed);
    }
    fprintf(sf, "\n\n");
    fclose(sf);
}

/* The phase's results: the clients' reports, the latencies, the fault
 * and the check of applied Pushes. */
static json_t *phase_results(struct prun *r, struct frun *f, const struct verify *vf,
                             double elapsed)
{
    const struct phase *ph = r->ph;
    json_t *res = json_object();
    json_object_set_new(res, "name", json_string(ph->name));
    json_object_set_new(res, "transport", json_string(ph->transport));
    json_object_set_new(res, "poll", json_string(ph->poll ? ph->poll : "spin-sleep"));
    json_object_set_new(res, "duration_s", json_real(ph->duration_s));
    json_object_set_new(res, "elapsed_s", json_real(elapsed));
    json_object_set_new(res, "warmup_s", json_real(ph->warmup_s));
    json_object_set_new(res, "rankers", json_integer(ph->rankers));
    json_object_set_new(res, "trainers", json_integer(ph->trainers));
    json_object_set_new(res, "shards", json_integer(r->S));
    json_object_set_new(res, "replicas", json_integer(r->R));
    struct totals tt = {0};
    struct lat all[S_N] = {0};
    struct bins *bn = calloc(1, sizeof *bn);
    if (!bn)
        die("out of memory");
    /* the fault's window: from just before the kill to 1 s after it
     * serves again */
    r->win_lo = f->kill_t >= 0 ? f->kill_t - 0.5 : -1;
    r->win_hi = f->kill_t < 0 ? -1 : f->ready_t >= 0 ? f->ready_t + 1 : ph->duration_s;
    r->kill_s = f->kill_t;
    r->first_ack_s = -1;
    json_t *clients = collect_clients(r, &tt, all, bn);
    json_object_set_new(res, "client_errors", json_integer(tt.bad_clients));
    json_t *lat = json_object();
    for (int s = 0; s < S_N; s++)
        json_object_set_new(lat, s_names[s], lat_json(&all[s], ph->duration_s - ph->warmup_s));
    json_object_set_new(res, "latency", lat);
    json_object_set_new(res, "failed_user_requests", json_integer((json_int_t)all[S_REQ].failed));
    json_object_set_new(res, "retries", json_integer(tt.retries));
    json_object_set_new(res, "failovers", json_integer(tt.failovers));
    json_object_set_new(res, "retry_throttled", json_integer(tt.throttled));
    json_object_set_new(res, "push_partial", json_integer(tt.partial));
    if (tt.fb) {
        double ok = jnum(tt.fb, "large", 0) - jnum(tt.fb, "large_failed", 0);
        json_object_set_new(tt.fb, "large_mean_us",
                            json_real(ok > 0 ? jnum(tt.fb, "large_lat_sum_us", 0) / ok : 0));
        json_object_del(tt.fb, "large_lat_sum_us");
        json_object_set_new(res, "ranker_fetch_bytes", tt.fb);
    }
    json_object_set_new(res, "cpu", cpu_json(&tt));
    json_t *fj = fault_json(ph, f);
    if (fj && r->win_lo >= 0)
        fault_window_json(fj, r);
    if (fj)
        json_object_set_new(res, "fault", fj);
    json_object_set_new(res, "replication",
                        json_string(ph->pb ? "primary-backup" : "client fan-out"));
    if (vf->done)
        push_check_json(res, vf, ph, r->S, r->R, f->rep);
    json_object_set_new(res, "clients", clients);
    write_series(r->pi, ph, bn);
    for (int s = 0; s < S_N; s++) {
        free(all[s].v);
        for (int b = 0; b < bn->n; b++)
            free(bn->b[s][b].v);
    }
    free(bn);
    return res;
}

/* A process beside the phase (scripts/demo-python: the Python examples,
 * whose start takes minutes in the emulated VM) keeps the phase's servers
 * up while DIR/hold exists, at most HOLD_MAX seconds; after the phase's
 * clients and its check, so that its figures are not changed. */
#define HOLD_MAX 480
static void hold_servers(const char *dir)
{
    char p[3100];
    snprintf(p, sizeof p, "%s/hold", dir);
    for (int i = 0; i < HOLD_MAX * 10 && access(p, F_OK) == 0; i++) {
        if (i == 0 && !g.quiet)
            fprintf(stderr, "bex-cluster: servers kept while %s exists\n", p);
        usleep(100000);
    }
}

static json_t *run_phase(const struct plan *pl, int pi)
{
    static struct prun r;
    r = (struct prun){.pl = pl, .ph = &pl->ph[pi], .pi = pi, .S = pl->shards, .R = pl->replicas};
    const struct phase *ph = r.ph;
    struct frun f = {.rep = ph->f_replica,
                     .t0 = -1,
                     .kill_t = -1,
                     .restart_t = -1,
                     .ready_t = -1,
                     .events = json_array()};
    phase_dirs(&r);
    write_cluster(&r);
    if (start_servers(&r)) {
        json_decref(f.events);
        free(r.cl_txt);
        return NULL;
    }
    r.grad = jnum(pl->trainer, "grad", 0x1p-10);
    r.n_cl = g.clients ? ph->rankers + ph->trainers : 0;
    for (int i = 0; i < r.n_cl; i++)
        spawn_client(&r, i);
    double elapsed = -1;
    if (sync_instances(&r) == 0)
        elapsed = watch_phase(&r, &f);
    if (elapsed < 0) {
        json_decref(f.events);
        free(r.cl_txt);
        bex_dir_destroy(r.ctl);
        bex_dir_deregister(r.ctl_reg);
        return NULL;
    }
    if (!g.quiet)
        fprintf(stderr, "%s", g.tty ? "\n" : "");
    /* the check of applied Pushes, while the servers still run */
    struct verify vf = {0};
    if (ph->trainers > 0 && g.clients) {
        if (!g.quiet)
            fprintf(stderr, "bex-cluster: phase %s: checking the trained rows on every replica\n",
                    ph->name);
        verify_phase(pl, ph, r.dir, r.cl_txt, &vf, r.grad);
    }
    hold_servers(r.dir);
    free(r.cl_txt);
    /* the other instance's servers may stop now */
    int rc = bex_dir_deregister(r.ctl_reg);
    if (rc)
        fprintf(stderr, "bex-cluster: etcd: deregistration: %s (the lease expires)\n",
                bex_strerror(rc));
    bex_dir_destroy(r.ctl);
    stop_role(R_PS);
    json_t *res = phase_results(&r, &f, &vf, elapsed);
    for (int i = 0; i < MAX_PROCS; i++)
        if (g.procs[i].used && g.procs[i].role != R_KEEPER && !g.procs[i].running)
            proc_release(&g.procs[i]);
    return res;
}

/* ---- the tables ---- */

static double jpath(json_t *o, const char *a, const char *b, const char *c)
{
    json_t *v = json_object_get(o, a);
    if (b)
        v = json_object_get(v, b);
    if (c)
        v = json_object_get(v, c);
    return v && json_is_number(v) ? json_number_value(v) : NAN;
}

static void row(const char *what, double rdma, double tcp, const char *unit, int red)
{
    printf("  %-34s %12.3f %12.3f  %s", what, rdma, tcp, unit);
    if (red && tcp > 0)
        printf("   %+6.1f %%", (tcp - rdma) / tcp * 100);
    printf("\n");
}

/* What the figures depend on, stated with them: the rankers' load, the
 * poll modes. */
static void print_load(json_t *plan, json_t *rd, json_t *tc)
{
    json_t *rk = json_object_get(plan, "ranker");
    double rate = jpath(rk, "rate", NULL, NULL), outst = jpath(rk, "outstanding", NULL, NULL);
    if (isnan(outst))
        outst = 8; /* bex-ranker's */
    if (rate > 0)
        printf("Load: each ranker's user requests arrive at %g a second (Poisson, open loop; at "
               "most %.0f in\nflight); a user request's latency counts from its arrival.\n",
               rate, outst);
    else
        printf("Load: each ranker keeps %.0f user requests in flight (closed loop: latency is "
               "that work\nover the throughput the machine sustains).\n",
               outst);
    if (rd && tc)
        printf("I/O threads of every process: poll mode %s over RDMA, %s over TCP.\n",
               json_string_value(json_object_get(rd, "poll")),
               json_string_value(json_object_get(tc, "poll")));
}

/* Table 5 (CPU per PS operation), RDMA against TCP. */
static void print_table5(json_t *rd, json_t *tc)
{
    printf("Table 5 (shape): CPU time per PS operation (Fetch or Push), microseconds\n");
    printf("  %-34s %12s %12s        %s\n", "", "RDMA", "TCP", "reduction");
    row("rankers+trainers, user", jpath(rd, "cpu", "client_user_us_per_op", NULL),
        jpath(tc, "cpu", "client_user_us_per_op", NULL), "us", 1);
    row("rankers+trainers, system", jpath(rd, "cpu", "client_sys_us_per_op", NULL),
        jpath(tc, "cpu", "client_sys_us_per_op", NULL), "us", 1);
    row("bex-ps servers, user", jpath(rd, "cpu", "server_user_us_per_op", NULL),
        jpath(tc, "cpu", "server_user_us_per_op", NULL), "us", 1);
    row("bex-ps servers, system", jpath(rd, "cpu", "server_sys_us_per_op", NULL),
        jpath(tc, "cpu", "server_sys_us_per_op", NULL), "us", 1);
}

/* Table 6 (Fetch latency of the rankers), RDMA against TCP. */
static void print_table6(json_t *rd, json_t *tc)
{
    printf("\nTable 6 (shape): PS Fetch latency, inference (rankers)\n");
    printf("  %-34s %12s %12s        %s\n", "", "RDMA", "TCP", "reduction");
    row("Fetch mean", jpath(rd, "latency", "ranker_fetch", "mean_us") / 1000,
        jpath(tc, "latency", "ranker_fetch", "mean_us") / 1000, "ms", 1);
    row("Fetch P99", jpath(rd, "latency", "ranker_fetch", "p99_us") / 1000,
        jpath(tc, "latency", "ranker_fetch", "p99_us") / 1000, "ms", 1);
    row("user request mean (k Fetches)", jpath(rd, "latency", "ranker_request", "mean_us") / 1000,
        jpath(tc, "latency", "ranker_request", "mean_us") / 1000, "ms", 1);
    row("user request P99", jpath(rd, "latency", "ranker_request", "p99_us") / 1000,
        jpath(tc, "latency", "ranker_request", "p99_us") / 1000, "ms", 1);
    row("Fetch throughput", jpath(rd, "latency", "ranker_fetch", "per_s"),
        jpath(tc, "latency", "ranker_fetch", "per_s"), "/s", 0);
    row("user requests failed", jpath(rd, "failed_user_requests", NULL, NULL),
        jpath(tc, "failed_user_requests", NULL, NULL), "", 0);
    row("Fetch answer mean size", jpath(rd, "ranker_fetch_bytes", "mean", NULL) / 1024,
        jpath(tc, "ranker_fetch_bytes", "mean", NULL) / 1024, "KiB", 0);
    row("Fetch answer largest", jpath(rd, "ranker_fetch_bytes", "max", NULL) / 1024,
        jpath(tc, "ranker_fetch_bytes", "max", NULL) / 1024, "KiB", 0);
    row("Fetches of 1 MiB or more", jpath(rd, "ranker_fetch_bytes", "mib_or_more", NULL),
        jpath(tc, "ranker_fetch_bytes", "mib_or_more", NULL), "", 0);
    if (jpath(rd, "ranker_fetch_bytes", "large", NULL) > 0)
        row("large Fetch mean (large_every)",
            jpath(rd, "ranker_fetch_bytes", "large_mean_us", NULL) / 1000,
            jpath(tc, "ranker_fetch_bytes", "large_mean_us", NULL) / 1000, "ms", 1);
}

/* Table 7 (training), RDMA against TCP. */
static void print_table7(json_t *rd, json_t *tc)
{
    printf("\nTable 7 (shape): training (trainers)\n");
    printf("  %-34s %12s %12s        %s\n", "", "RDMA", "TCP", "reduction");
    row("Fetch mean", jpath(rd, "latency", "trainer_fetch", "mean_us") / 1000,
        jpath(tc, "latency", "trainer_fetch", "mean_us") / 1000, "ms", 1);
    row("Fetch P99", jpath(rd, "latency", "trainer_fetch", "p99_us") / 1000,
        jpath(tc, "latency", "trainer_fetch", "p99_us") / 1000, "ms", 1);
    row("Push mean", jpath(rd, "latency", "trainer_push", "mean_us") / 1000,
        jpath(tc, "latency", "trainer_push", "mean_us") / 1000, "ms", 1);
    row("Push P99", jpath(rd, "latency", "trainer_push", "p99_us") / 1000,
        jpath(tc, "latency", "trainer_push", "p99_us") / 1000, "ms", 1);
    row("Push throughput", jpath(rd, "latency", "trainer_push", "per_s"),
        jpath(tc, "latency", "trainer_push", "per_s"), "/s", 0);
    row("retries (all clients)", jpath(rd, "retries", NULL, NULL), jpath(tc, "retries", NULL, NULL),
        "", 0);
}

/* The training Pushes of a fault phase during its fault. */
static void print_fault_pushes(json_t *p, json_t *f)
{
    printf("  %-34s %.0f of %.0f (goal 0), %.0f of %.0f during the fault\n",
           "training Pushes failed", jpath(p, "latency", "trainer_push", "failed"),
           jpath(p, "latency", "trainer_push", "count"), jpath(f, "push_during", "failed", NULL),
           jpath(f, "push_during", "count", NULL));
    double fo = jpath(f, "failover_s", NULL, NULL);
    if (json_object_get(f, "failover_s") && fo >= 0)
        printf("  %-34s %.2f s (kill -9 to the first training Push the new\n"
               "  %-34s primary acknowledged)\n",
               "failover", fo, "");
    else if (json_object_get(f, "failover_s"))
        printf("  %-34s not measured: no training Push started after the kill was\n"
               "  %-34s acknowledged\n",
               "failover", "");
    printf("  %-34s %.1f s (kill -9 to serving again); the longest\n"
           "  %-34s training Push took %.1f s\n",
           "killed replica down", jpath(f, "down_s", NULL, NULL), "",
           jpath(f, "outage_s", NULL, NULL));
    printf("  %-34s P99 %.1f ms, mean %.1f ms, %.0f Pushes (from %.1f s to %.1f s)\n",
           "training Push during the fault", jpath(f, "push_during", "p99_us", NULL) / 1000,
           jpath(f, "push_during", "mean_us", NULL) / 1000, jpath(f, "push_during", "count", NULL),
           jpath(f, "push_during", "from_s", NULL), jpath(f, "push_during", "to_s", NULL));
}

/* A phase outside the tables (a fault phase, say), on its own. */
static void print_phase(json_t *p)
{
    json_t *f = json_object_get(p, "fault");
    const char *rp = json_string_value(json_object_get(p, "replication"));
    int pb = rp && strcmp(rp, "primary-backup") == 0;
    printf("\nPhase \"%s\" (%s, %s)%s\n", json_string_value(json_object_get(p, "name")),
           json_string_value(json_object_get(p, "transport")), rp ? rp : "client fan-out",
           !f   ? ""
           : pb ? ": a shard's primary killed with kill -9 mid-run; a backup takes\n"
                  "  over through etcd (lease expiry), the killed one restarts and rejoins as a\n"
                  "  backup; trainers retry each Push with its id until acknowledged"
                : ": one replica killed with kill -9 mid-run, then restarted");
    if (f && json_object_get(f, "by_servers_instance"))
        printf("  %-34s shard %d replica %d: killed at %.1f s and restarted at %.1f s (planned) "
               "by the servers' bex-cluster\n",
               "fault", (int)jpath(f, "shard", NULL, NULL), (int)jpath(f, "replica", NULL, NULL),
               jpath(f, "kill_at_s", NULL, NULL), jpath(f, "restart_at_s", NULL, NULL));
    else if (f && jpath(f, "killed_at_s", NULL, NULL) < 0)
        printf("  %-34s did not run: no trainer did an operation in the phase\n", "fault");
    else if (f)
        printf("  %-34s shard %d replica %d: killed at %.1f s, restarted at %.1f s, "
               "serving again at %.1f s\n",
               "fault", (int)jpath(f, "shard", NULL, NULL), (int)jpath(f, "replica", NULL, NULL),
               jpath(f, "killed_at_s", NULL, NULL), jpath(f, "restarted_at_s", NULL, NULL),
               jpath(f, "ready_again_at_s", NULL, NULL));
    printf("  %-34s %.0f of %.0f\n", "user requests failed",
           jpath(p, "latency", "ranker_request", "failed"),
           jpath(p, "latency", "ranker_request", "count"));
    printf("  %-34s mean %.3f ms, P99 %.3f ms\n", "ranker Fetch",
           jpath(p, "latency", "ranker_fetch", "mean_us") / 1000,
           jpath(p, "latency", "ranker_fetch", "p99_us") / 1000);
    if (json_object_get(p, "ranker_fetch_bytes"))
        printf("  %-34s %.1f to %.1f KiB, mean %.1f KiB; %.0f of %.0f of 1 MiB or more\n",
               "ranker Fetch answer sizes", jpath(p, "ranker_fetch_bytes", "min", NULL) / 1024,
               jpath(p, "ranker_fetch_bytes", "max", NULL) / 1024,
               jpath(p, "ranker_fetch_bytes", "mean", NULL) / 1024,
               jpath(p, "ranker_fetch_bytes", "mib_or_more", NULL),
               jpath(p, "ranker_fetch_bytes", "count", NULL));
    printf("  %-34s mean %.3f ms, P99 %.3f ms; %.0f of %.0f not acknowledged by every\n"
           "  %-34s replica (%.0f of them by some)\n",
           "trainer Push", jpath(p, "latency", "trainer_push", "mean_us") / 1000,
           jpath(p, "latency", "trainer_push", "p99_us") / 1000,
           jpath(p, "latency", "trainer_push", "failed"),
           jpath(p, "latency", "trainer_push", "count"), "", jpath(p, "push_partial", NULL, NULL));
    printf("  %-34s %.0f (failovers %.0f, refused by the budget %.0f)\n", "retries",
           jpath(p, "retries", NULL, NULL), jpath(p, "failovers", NULL, NULL),
           jpath(p, "retry_throttled", NULL, NULL));
    if (f && json_object_get(f, "push_during"))
        print_fault_pushes(p, f);
}

/* Pushes applied per shard and replica, every phase that checked them. */
static void print_push_checks(json_t *phases)
{
    json_t *p;
    size_t i;
    printf("\nPushes applied, per shard and replica (each trained row read from each replica and "
           "its value\nchecked against the Pushes the trainers saw that replica acknowledge)\n");
    json_array_foreach(phases, i, p)
    {
        json_t *pc = json_object_get(p, "push_check");
        if (!pc)
            continue;
        printf("  phase \"%s\": %.0f keys; parts acknowledged %.0f, failed %.0f; Pushes applied "
               "twice %.0f\n",
               json_string_value(json_object_get(p, "name")), jpath(pc, "keys", NULL, NULL),
               jpath(pc, "acknowledged", NULL, NULL), jpath(pc, "failed_at_replica", NULL, NULL),
               jpath(p, "pushes_applied_twice", NULL, NULL));
        json_t *r;
        size_t j;
        json_array_foreach(json_object_get(pc, "replicas"), j, r)
        {
            printf("    shard %.0f replica %.0f: rows exact %.0f of %.0f, applied twice %.0f, "
                   "acknowledged but missing %.0f (rows %.0f), unexplained %.0f, equal to "
                   "its peer's %.0f%s%s\n",
                   jpath(r, "shard", NULL, NULL), jpath(r, "replica", NULL, NULL),
                   jpath(r, "rows_exact", NULL, NULL), jpath(r, "rows_checked", NULL, NULL),
                   jpath(r, "pushes_applied_twice", NULL, NULL),
                   jpath(r, "pushes_missing", NULL, NULL), jpath(r, "rows_missing", NULL, NULL),
                   jpath(r, "rows_unexplained", NULL, NULL),
                   jpath(r, "rows_equal_to_peer", NULL, NULL),
                   json_is_true(json_object_get(r, "killed"))
                       ? " (the killed one: restarted from its snapshot, then caught up with its "
                         "peer)"
                       : "",
                   json_is_true(json_object_get(r, "fetch_failed")) ? " (its Fetch failed)" : "");
        }
    }
}

static void print_tables(json_t *phases, json_t *plan, int soft_roce)
{
    json_t *rd = NULL, *tc = NULL, *p;
    size_t i;
    json_array_foreach(phases, i, p)
    {
        if (json_object_get(p, "fault"))
            continue;
        const char *t = json_string_value(json_object_get(p, "transport"));
        if (!rd && t && strcmp(t, "rdma") == 0)
            rd = p;
        if (!tc && t && strcmp(t, "tcp") == 0)
            tc = p;
    }
    printf("\n");
    print_load(plan, rd, tc);
    if (rd && tc) {
        print_table5(rd, tc);
        print_table6(rd, tc);
        print_table7(rd, tc);
    }
    json_array_foreach(phases, i, p)
    {
        if (rd && tc && (p == rd || p == tc))
            continue;
        print_phase(p);
    }
    print_push_checks(phases);
    if (soft_roce)
        printf("\nNOTE: RDMA here is Soft-RoCE (rdma_rxe) inside a qemu VM without KVM: the RDMA\n"
               "timings are software-emulated, not a hardware result; compare the shapes, not the\n"
               "numbers, with the paper's.\n");
}

__attribute__((noreturn)) static void usage(int status)
{
    fputs("usage: bex-cluster [OPTION]...\n"
          "Run a parameter-server cluster on this machine through a phase plan and\n"
          "print the paper's tables (docs/configuration.md, \"bex-cluster\").\n"
          "  --plan FILE|default        the phase plan (JSON; default: the built-in one)\n"
          "  --print-plan               print the built-in plan and exit\n"
          "  --out DIR                  results, logs and plots go there (bex-cluster-out)\n"
          "  --addrs A[,B...]           the hosts' addresses (BEX_TEST_ADDR0,1, else 127.0.0.1)\n"
          "  --bin-dir DIR              where bex-ps, bex-ranker, bex-trainer are (beside it)\n"
          "  --time-scale X             multiply the plan's times by X (1; up to 1000)\n"
          "  --quiet                    no progress lines\n"
          "  --etcd URL                 servers register in etcd, clients read it there\n"
          "  --etcd-prefix P            its key prefix, ending in '/' (/bex-cluster/)\n"
          "  --only servers|clients     run one half (with --etcd: two machines)\n"
          "  --help                     this text\n"
          "  --version                  the version\n",
          status ? stderr : stdout);
    exit(status);
}

/* The current option's value is bad: one line naming it, exit status 2. */
__attribute__((noreturn)) static void bad_value(const char *opt, const char *want)
{
    fprintf(stderr, "bex-cluster: --%s '%s': %s\n", opt, optarg ? optarg : "", want);
    exit(2);
}

/* The command line into g, *plan_arg and *addrs; usage() on a bad one. */
static void parse_args(int argc, char **argv, const char **plan_arg, const char **addrs)
{
    const char *only = NULL;
    static const struct option lo[] = {{"plan", required_argument, 0, 'p'},
                                       {"out", required_argument, 0, 'o'},
                                       {"addrs", required_argument, 0, 'a'},
                                       {"bin-dir", required_argument, 0, 'b'},
                                       {"time-scale", required_argument, 0, 's'},
                                       {"quiet", no_argument, 0, 'q'},
                                       {"print-plan", no_argument, 0, 'P'},
                                       {"etcd", required_argument, 0, 'E'},
                                       {"etcd-prefix", required_argument, 0, 'X'},
                                       {"only", required_argument, 0, 'O'},
                                       {"help", no_argument, 0, 'h'},
                                       {"version", no_argument, 0, 'V'},
                                       {0, 0, 0, 0}};
    for (int o; (o = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
        switch (o) {
        case 'V':
            printf("%s %s\n", "bex-cluster", bex_version_string());
            exit(0);
        case 'h':
            usage(0);
        case 'p':
            *plan_arg = optarg;
            break;
        case 'o':
            snprintf(g.out, sizeof g.out, "%s", optarg);
            break;
        case 'a':
            *addrs = optarg;
            break;
        case 'b':
            snprintf(g.bin, sizeof g.bin, "%s", optarg);
            break;
        case 's':
            g.scale = atof(optarg);
            if (!(g.scale > 0 && g.scale <= 1000))
                bad_value("time-scale", "not a number above 0, at most 1000");
            break;
        case 'q':
            g.quiet = 1;
            break;
        case 'P':
            fputs(DEFAULT_PLAN, stdout);
            exit(0);
        case 'E':
            g.etcd = optarg;
            break;
        case 'X':
            g.etcd_prefix = optarg;
            break;
        case 'O':
            only = optarg;
            if (strcmp(only, "servers") == 0)
                g.clients = 0;
            else if (strcmp(only, "clients") == 0)
                g.servers = 0;
            else
                bad_value("only", "not servers or clients");
            break;
        default:
            usage(2);
        }
    }
    /* the halves meet through etcd; a prefix ends with '/' (bex-ps adds
     * "services/...") */
    if (optind != argc || (only && !g.etcd) || !g.etcd_prefix[0] ||
        g.etcd_prefix[strlen(g.etcd_prefix) - 1] != '/' || strlen(g.etcd_prefix) > 256)
        usage(2);
}

/* Where the programs are: beside us, bex-ps in ../ps of a build tree. */
static void find_programs(void)
{
    if (!g.bin[0]) {
        char self[2048];
        ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
        if (k <= 0)
            die("/proc/self/exe: %s", strerror(errno));
        self[k] = 0;
        *strrchr(self, '/') = 0;
        snprintf(g.bin, sizeof g.bin, "%s", self);
    }
    snprintf(g.ps_bin, sizeof g.ps_bin, "%s/bex-ps", g.bin);
    if (access(g.ps_bin, X_OK))
        snprintf(g.ps_bin, sizeof g.ps_bin, "%s/../ps/bex-ps", g.bin);
    if (access(g.ps_bin, X_OK))
        die("no bex-ps beside %s or in %s/../ps", g.bin, g.bin);
}

/* The hosts' addresses: --addrs, else the VM's (BEX_TEST_ADDR0/1), else
 * loopback. */
static void parse_addrs(const char *addrs)
{
    char abuf[256];
    const char *e0 = getenv("BEX_TEST_ADDR0"), *e1 = getenv("BEX_TEST_ADDR1");
    if (!addrs && e0 && e1) {
        snprintf(abuf, sizeof abuf, "%s,%s", e0, e1);
        addrs = abuf;
    }
    if (!addrs)
        addrs = "127.0.0.1";
    {
        char tmp[256];
        snprintf(tmp, sizeof tmp, "%s", addrs);
        for (char *sv, *t = strtok_r(tmp, ",", &sv); t; t = strtok_r(NULL, ",", &sv)) {
            /* IPv4 or IPv6, "[v6]" too; kept as the bare host, the form
             * the clients' --addr and bex_addr_parse take */
            bex_addr ia;
            if (g.n_addrs == MAX_ADDRS || bex_addr_parse(t, 0, &ia) || bex_addr_port(&ia))
                die("--addrs: %s: not an IPv4 or IPv6 address without a port (at most %d)", t,
                    MAX_ADDRS);
            bex_addr_format(&ia, false, g.addrs[g.n_addrs++], BEX_ADDR_STRLEN);
        }
    }
}

/* RDMA phases need a device on the address: said now, not mid-run. Returns
 * whether the device is Soft-RoCE (the tables say so). */
static int check_rdma(const struct plan *pl)
{
    for (int i = 0; i < pl->n_ph; i++)
        if (strcmp(pl->ph[i].transport, "rdma") == 0) {
            bex_ctx_config cc = {.transport = BEX_TRANSPORT_RDMA, .log_level = BEX_LOG_ERROR};
            bex_addr_parse(g.addrs[0], 0, &cc.local_addr);
            bex_ctx *ctx;
            int rc = bex_ctx_create(&cc, &ctx);
            if (rc)
                die("phase %s runs over RDMA, but no RDMA device carries %s (%s); `make demo` "
                    "runs the plan inside the Soft-RoCE VM on a host without one",
                    pl->ph[i].name, g.addrs[0], bex_strerror(rc));
            bex_ctx_destroy(ctx);
            break;
        }
    if (access("/sys/class/infiniband/rxe0", F_OK) == 0 || getenv("BEX_IN_VM"))
        return 1;

    return 0;
}

/* The output directory, the snapshots' directory, the pids and series files. */
static void prepare_out(void)
{
    if (mkdir(g.out, 0755) && errno != EEXIST)
        die("%s: %s", g.out, strerror(errno));
    const char *tmp = getenv("TMPDIR");
    snprintf(g.snap_root, sizeof g.snap_root, "%s/bex-cluster-snap.XXXXXX",
             tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(g.snap_root)) {
        g.snap_root[0] = 0;
        die("a directory for the snapshots in %s: %s", tmp && tmp[0] ? tmp : "/tmp",
            strerror(errno));
    }
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/pids", g.out);
    if (!(g.pids = fopen(path, "w")))
        die("%s: %s", path, strerror(errno));
    snprintf(path, sizeof path, "%s/series.dat", g.out);
    FILE *sf = fopen(path, "w");
    if (sf) {
        fprintf(sf, "# phase name t_s  then mean_ms p99_ms of: ranker Fetch, ranker user "
                    "request, trainer Fetch, trainer Push; then failed user requests\n");
        fclose(sf);
    }
}

/* Signals that stop the run, delivered only inside ppoll (pump). */
static void install_signals(void)
{
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigset_t block;
    sigemptyset(&block);
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};
    for (size_t k = 0; k < sizeof sigs / sizeof sigs[0]; k++) {
        sigaction(sigs[k], &sa, NULL);
        sigaddset(&block, sigs[k]);
    }
    /* delivered only inside ppoll (pump), so none is missed between checks */
    sigprocmask(SIG_BLOCK, &block, NULL);
    signal(SIGPIPE, SIG_IGN);
    start_keeper();
}

/* results.json and the tables. */
static void write_results(const struct plan *pl, json_t *phases, int soft_roce, double t_start)
{
    char path[PATH_MAX + 32];
    json_t *res = json_object();
    json_object_set(res, "plan", pl->root);
    json_object_set_new(res, "soft_roce", json_boolean(soft_roce));
    json_object_set_new(res, "elapsed_s", json_real(now_s() - t_start));
    json_object_set(res, "phases", phases);
    snprintf(path, sizeof path, "%s/results.json", g.out);
    if (json_dump_file(res, path, JSON_INDENT(2)))
        die("%s: cannot write", path);
    if (g.clients)
        print_tables(phases, pl->root, soft_roce);
    else
        printf("\nbex-cluster --only servers: %d phase%s served; the clients' bex-cluster has the "
               "tables\n",
               (int)json_array_size(phases), json_array_size(phases) == 1 ? "" : "s");
    printf("\nraw results: %s/results.json; latency over time: %s/series.dat\n", g.out, g.out);
    json_decref(res);
}

int main(int argc, char **argv)
{
    const char *plan_arg = "default", *addrs = NULL;
    g.scale = 1;
    g.self = getpid();
    g.servers = g.clients = 1;
    g.etcd_prefix = "/bex-cluster/";
    snprintf(g.out, sizeof g.out, "bex-cluster-out");
    parse_args(argc, argv, &plan_arg, &addrs);
    g.tty = isatty(2);
    /* bad input (a BEX_* variable, which every program run inherits, the
     * addresses, the plan): one line naming it, exit 2, nothing started */
    find_programs();
    g.die_status = 2;
    char why[256];
    if (bex_env_check(why, sizeof why))
        die("%s", why);
    parse_addrs(addrs);
    struct plan pl = {0};
    plan_load(&pl, plan_arg);
    g.die_status = 0;
    int soft_roce = check_rdma(&pl);
    prepare_out();
    install_signals();

    double t_start = now_s();
    json_t *phases = json_array();
    for (int i = 0; i < pl.n_ph; i++) {
        json_t *r = run_phase(&pl, i);
        if (!r)
            break;
        json_array_append_new(phases, r);
    }
    int sig = g.stop_sig;
    if (sig && !g.quiet)
        fprintf(stderr, "\nbex-cluster: %s: stopping everything\n", strsignal(sig));
    cleanup_all();
    if (sig) {
        json_decref(phases);
        json_decref(pl.root);
        fclose(g.pids);
        return 128 + sig;
    }
    write_results(&pl, phases, soft_roce, t_start);
    int failed = 0;
    size_t i;
    json_t *p;
    json_array_foreach(phases, i, p) failed += (int)jpath(p, "client_errors", NULL, NULL);
    json_decref(phases);
    json_decref(pl.root);
    fclose(g.pids);
    return failed ? 1 : 0;
}
