/* SPDX-License-Identifier: Apache-2.0 */
/* The adversarial suite: shared pieces of the orchestrator and its roles.
 *
 * One test program, one case per CTest test. The orchestrator (the parent
 * process) never opens a verbs device; it forks every role from a clean
 * process, so verbs state is never shared across fork():
 *   server    bex listener on BEX_TEST_ADDR0: echo, instrumentation
 *             (RSS and pool peaks, canaries, captured log), see server.c;
 *   good      well-behaved bex clients on BEX_TEST_ADDR1 (goodcli.c);
 *   attacker  the abuse of the case (attacks.c), speaking raw TCP or, over
 *             its own RC QP, the engine protocol (peer.c).
 * Roles talk to the parent in text lines on a pipe ("key value ..."), and
 * take one-character commands from it. docs/testing.md describes the cases
 * and what each one asserts. */
#ifndef BEX_TESTS_ADV_H
#define BEX_TESTS_ADV_H

#include <arpa/inet.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "harness.h"

/* ---- the good clients' messages -------------------------------------- */

/* Every message of a good client starts with this 16-byte header; the
 * payload after it is pattern(seed = seq). 16 B messages are the header
 * alone. The server verifies it on arrival and again when its echo is done
 * (so a write into a buffer bex holds is seen); the client compares the
 * echo's length with the length it sent and checks every byte. */
#define ADV_MAGIC 0x41445631u /* "ADV1" */
struct adv_msg_hdr {
    uint32_t magic;
    uint32_t seq;
    uint32_t len;  /* the whole message, header included */
    uint32_t csum; /* adv_csum over len, seq and the payload */
};

/* Sizes 16 B .. 1 MiB: 16 B .. 64 KiB in turn (a third of them odd
 * lengths), every 100th 512 KiB and every 100th 1 MiB: about 24 MB per 1000
 * messages, so that the suite stays short under TCG. Sanitizer builds
 * (BEX_TEST_TIME_SCALE > 1) send the large ones every 250th: about 9 MB. */
size_t adv_msg_size(uint32_t seq);
void adv_msg_fill(void *buf, size_t len, uint32_t seq);
/* 0 if buf (len bytes) is an intact message; else -1, with why[] filled. */
int adv_msg_check(const void *buf, size_t len, char *why, size_t cap);
uint32_t adv_csum(const void *p, size_t n, uint32_t h);

/* deterministic bytes (canaries) */
void adv_pattern(void *p, size_t n, uint32_t seed);
/* offset of the first byte differing from adv_pattern(seed), or -1 */
long adv_pattern_diff(const void *p, size_t n, uint32_t seed);

/* ---- time, limits ---------------------------------------------------- */

/* The server's and the good clients' transport timers. Emulated (TCG) VMs
 * on a loaded host stall for hundreds of milliseconds: with the default ACK
 * timeout (2^14 * 4.096 us = 67 ms) rxe retransmits data that was never
 * lost, and the default keepalive timeout (2 s) ends healthy connections.
 * Neither protects against an attacker here (keepalive writes and TCP ends
 * do), so both are raised: ACK timeout 2^18 * 4.096 us = 1.07 s, keepalive
 * timeout 5 s x adv_timer_scale(). */
#define ADV_QP_TIMEOUT   18
#define ADV_KEEPALIVE_MS 5000
/* The server's log rate window (bex_ctx_config.log_window_ms): short, so
 * that the cases of a group wait 100 ms past it between them, not a second
 * (test_adversary.c) */
#define ADV_LOG_WINDOW_MS 200

/* The library's timers in the suite (setup deadline, keepalive, rendezvous
 * and credit timeouts) are stretched by 1 + scale / 3: 1 plain, 2 ASan, 4
 * TSan. What they must outlast is the loaded TCG VM's stalls, which the
 * sanitizers lengthen less than their CPU cost (scale); and the attacks
 * that end by one of them (truncated hellos, a silent OPEN, a hello
 * naming a QP nobody has, credits never returned) take that long. */
unsigned adv_timer_scale(void);
/* The server's setup deadline (connect_timeout_ms): a silent or truncated
 * setup is refused after it. 4 s x adv_timer_scale(): a legitimate setup
 * takes well under a second, but the first one of a process registers its
 * pools' memory. */
unsigned adv_setup_ms(void);

uint64_t adv_now_ms(void);
void adv_sleep_ms(unsigned ms);
/* BEX_TEST_TIME_SCALE (1, 3 for ASan, 10 for TSan) */
unsigned adv_scale(void);
/* Raise RLIMIT_NOFILE to want (or the hard limit). Returns the soft limit. */
long adv_raise_nofile(long want);
/* Resident set of this process, KiB. */
long adv_rss_kb(void);
/* Open file descriptors of this process. */
int adv_fd_count(void);
/* Connections waiting for this process's listening sockets: in their
 * accept queues (TCP_INFO's tcpi_unacked of a listener) or still to come
 * (half-open, or closed by their client and not yet acknowledged: see
 * util.c), or -1. */
int adv_listen_backlog(void);
int adv_addrs(struct in_addr *a0, struct in_addr *a1);

/* ---- roles and their pipes ------------------------------------------- */

struct adv_proc {
    const char *name;
    pid_t pid;
    int rd, wr; /* parent side: lines from the child, commands to it */
    char buf[1 << 16];
    size_t n;
    int status; /* after reaping */
    bool reaped;
};

/* A role's entry: rd gives commands, wr takes lines. Returns the exit code. */
typedef int (*adv_role_fn)(int rd, int wr, void *arg);

int adv_spawn(struct adv_proc *p, const char *name, adv_role_fn fn, void *arg);
/* Next line from the child within timeout_ms: 0, -ETIMEDOUT, or -EPIPE
 * (the child closed its end). */
int adv_readline(struct adv_proc *p, char *line, size_t cap, unsigned timeout_ms);
/* Read lines until one starts with prefix (others go to stderr). */
int adv_expect(struct adv_proc *p, const char *prefix, char *line, size_t cap, unsigned timeout_ms);
void adv_cmd(struct adv_proc *p, char c);
bool adv_alive(struct adv_proc *p);
/* Reap within timeout_ms, else SIGKILL. Returns the wait status. */
int adv_reap(struct adv_proc *p, unsigned timeout_ms);

/* In a role: one line to the parent (printf format, newline added). */
void adv_say(int wr, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* In a role: a command, waiting up to timeout_ms (-1 forever); 0 when none. */
char adv_get_cmd(int rd, int timeout_ms);

/* ---- roles ------------------------------------------------------------ */

struct adv_server_opts {
    const char *secret;     /* cluster secret, or NULL */
    uint32_t remote_access; /* BEX_REMOTE_ACCESS_* (0: the device's default) */
    uint32_t srq_depth;     /* SRQ mode with this shared queue depth (0: off) */
};
int adv_server_main(int rd, int wr, void *arg);

/* The cluster secret of the cases that set one (server, good clients and
 * the authenticated attacker know it; the unauthenticated one does not). */
#define ADV_SECRET "adversary-suite-cluster-secret-0123456789"

struct adv_good_opts {
    const char *secret; /* or NULL */
    uint16_t port;
    uint32_t min_msgs; /* at least this many echoes, all checked */
    bool wait_go;      /* wait for 'g' before sending; stop at 's' */
    uint32_t seq0;     /* first sequence number (distinct per client) */
};
int adv_good_main(int rd, int wr, void *arg);

/* What an attack reports: lines "conn <local port>" for each abusive
 * connection it opened (so the parent can attribute the server's log
 * lines), "closed <port> <ms>" when the server closed it, "underway" once
 * the attack is in full swing, "note ..." for the record, "done" at the end,
 * "fail ..." if the attacker itself could not do its job. */
struct adv_attack_ctx {
    int rd, wr;
    struct in_addr local, srv_addr;
    uint16_t port;      /* the listener's */
    const char *secret; /* the protocol-level attacker authenticates with it */
};
typedef int (*adv_attack_fn)(struct adv_attack_ctx *a);

int adv_attack_random_bytes(struct adv_attack_ctx *a);
int adv_attack_truncated_hello(struct adv_attack_ctx *a);
int adv_attack_absurd_hello(struct adv_attack_ctx *a);
int adv_attack_idle_conns(struct adv_attack_ctx *a);
int adv_attack_connect_close(struct adv_attack_ctx *a);
int adv_attack_rndv_huge(struct adv_attack_ctx *a);
int adv_attack_rndv_endless(struct adv_attack_ctx *a);
int adv_attack_streams(struct adv_attack_ctx *a);
int adv_attack_no_credits(struct adv_attack_ctx *a);
int adv_attack_overack(struct adv_attack_ctx *a);
int adv_attack_srq_overcredit(struct adv_attack_ctx *a);
int adv_attack_recv_depth_1(struct adv_attack_ctx *a);
int adv_attack_rkey_forged(struct adv_attack_ctx *a);
int adv_attack_rkey_stale(struct adv_attack_ctx *a);
int adv_attack_rkey_range(struct adv_attack_ctx *a);
int adv_attack_kill9_rndv(struct adv_attack_ctx *a);
int adv_attack_unauthenticated(struct adv_attack_ctx *a);
int adv_attack_fallback_after_frames(struct adv_attack_ctx *a);

#endif
