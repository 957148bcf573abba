/* SPDX-License-Identifier: Apache-2.0 */
/* loop: what an I/O thread waits on and how other threads reach it.
 *
 * One loop per I/O thread: an epoll set whose entries point at a watcher
 * (struct ep_tag, embedded in whatever the descriptor belongs to, with its
 * owner's callback), an eventfd that wakes a sleeping loop, and a
 * multi-producer command queue: any thread pushes, only the loop's thread
 * takes. The loop knows nothing of sockets, engines or transports; what a
 * watcher or a command means is its owner's business.
 *
 * Sleep protocol: the loop's thread calls bex__loop_sleep_begin, looks for
 * work once more (commands: bex__loop_has_cmds; completions), and only then
 * waits; a pusher that sees the loop asleep writes the eventfd. Both sides
 * are seq_cst, so a command is either seen before the sleep or wakes it. */
#ifndef BEX_LOOP_H
#define BEX_LOOP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/epoll.h>

#include "common/count.h"
#include "common/sys.h"

/* A watcher: what an epoll event belongs to, embedded in its owner, and
 * the owner's handler, which finds the owner from t (container_of). The
 * thread calls cb and knows nothing of what is behind it. */
struct ep_tag {
    void (*cb)(struct ep_tag *t, uint32_t events);
    /* an event here may be explained by completions still in a CQ (a
     * connection whose peer's NIC refused our write, then closed): the
     * thread takes those before it runs cb */
    bool cq_first;
};

/* A command handed from any thread to the loop's thread; embedded in the
 * owner's object. type is the owner's. */
struct bex__cmd {
    struct bex__cmd *next;
    int type;
};

struct bex__loop {
    int epfd, evfd;
    /* a timerfd in the set (edge-triggered; its entry points at the loop
     * plus one), armed by bex__loop_timer: tfd_due is the deadline it is
     * armed for (bex__now_us time) until its expiry's event is consumed
     * (bex__loop_wait), else 0. While the thread's nearest deadline is
     * tfd_due it sleeps without a timeout, so with no clock read. */
    int tfd;
    uint64_t tfd_due;
    _Atomic(struct bex__cmd *) cmds; /* lock-free stack, newest first */
    _Atomic int sleeping;
    /* system calls of the loop (bex_sock_stats.loop_*): epoll_wait calls
     * and those with a timeout, eventfd reads (the loop's thread only),
     * and eventfd writes (wake: any thread) */
    _Atomic uint64_t waits, sleeps, wake_reads, wakes;
};

/* 0 or a negative errno; bex__loop_fini undoes it. */
int bex__loop_init(struct bex__loop *l);
void bex__loop_fini(struct bex__loop *l);

/* Any thread: queue c (its type set to type) and wake the loop if asleep.
 * c must not be queued already. */
void bex__loop_push(struct bex__loop *l, struct bex__cmd *c, int type);
/* The loop's thread: every queued command, oldest first (NULL if none). */
struct bex__cmd *bex__loop_take(struct bex__loop *l);
/* Whether commands are queued (seq_cst: for the sleep protocol). Inline,
 * as the two below: the sleep calls all three once a round trip. */
static inline bool bex__loop_has_cmds(struct bex__loop *l)
{
    return atomic_load(&l->cmds) != NULL;
}

/* Watch fd for events on behalf of tag (EPOLL_CTL_ADD / MOD / DEL):
 * 0 or a negative errno. */
int bex__loop_watch(struct bex__loop *l, int fd, uint32_t events, struct ep_tag *tag);
int bex__loop_modify(struct bex__loop *l, int fd, uint32_t events, struct ep_tag *tag);
void bex__loop_unwatch(struct bex__loop *l, int fd);

/* The loop's thread, each turn: whether commands may be queued, by a
 * plain look (no locked instruction; what it misses, the sleep's
 * bex__loop_has_cmds sees). */
static inline bool bex__loop_cmds_queued(struct bex__loop *l)
{
    return atomic_load_explicit(&l->cmds, memory_order_relaxed) != NULL;
}

static inline void bex__loop_sleep_begin(struct bex__loop *l)
{
    atomic_store(&l->sleeping, 1);
}

static inline void bex__loop_sleep_end(struct bex__loop *l)
{
    atomic_store(&l->sleeping, 0);
}
/* The coarse clock as this thread last read it (bex__now_ms) since its
 * last bex__loop_wait, 0 when it has not: bex__now_ms_since_wait's
 * (loop.c). initial-exec: no __tls_get_addr call from libbex.so. */
#define BEX__LOOP_TLS _Thread_local __attribute__((tls_model("initial-exec")))
extern BEX__LOOP_TLS uint64_t bex__loop_coarse_seen;

/* A counter of the loop's own thread (single writer): no locked add. */
static inline void bex__loop_count(_Atomic uint64_t *c)
{
    bex__count_add(c, 1);
}

/* Whether an event's entry is the loop's own: its eventfd's (l) or its
 * timer's (l + 1). */
static inline bool bex__loop_own_event(const struct bex__loop *l, const struct epoll_event *e)
{
    return (uintptr_t)e->data.ptr - (uintptr_t)l <= 1;
}

/* bex__loop_wait's events from ev[i], the first of the loop's own, on:
 * each eventfd wake-up consumed (read), the timer's expiry too (tfd_due
 * cleared), the others copied down; how many events are left. Out of
 * line (loop.c): most waits return an owner's events alone, and the wait
 * then saves no registers for this loop (issue 25). */
int bex__loop_own_wakeups(struct bex__loop *l, struct epoll_event *ev, int i, int n);

/* bex__loop_wait's wait alone: epoll_wait's events (0 for none or an
 * error), the loop's own among them; bex__loop_wait_own takes those out.
 * A caller that knows its one event at a glance (the I/O thread's
 * completion channel) skips that scan (issue 25 item 2). */
static inline int bex__loop_wait_raw(struct bex__loop *l, struct epoll_event *ev, int max,
                                     int timeout_ms)
{
    bex__loop_coarse_seen = 0; /* what was read before a wait is old after it */
    bex__loop_count(&l->waits);
    if (timeout_ms != 0)
        bex__loop_count(&l->sleeps);
    int n = bex__sys_epoll_wait(l->epfd, ev, max, timeout_ms);
    return n > 0 ? n : 0;
}

/* The loop's own wake-ups and its timer's expiry among n events of
 * bex__loop_wait_raw consumed (see bex__loop_wait): how many are left. */
static inline int bex__loop_wait_own(struct bex__loop *l, struct epoll_event *ev, int n)
{
    for (int i = 0; i < n; i++)
        if (bex__loop_own_event(l, &ev[i]))
            return bex__loop_own_wakeups(l, ev, i, n);
    return n;
}

/* epoll_wait for up to max events (timeout_ms as epoll's): the number of
 * events left for the caller. The loop's own wake-ups and its timer's
 * expiry (which clears tfd_due) are consumed here and not returned.
 * Inline: the I/O thread's sleep calls it once a round trip (issue 25
 * item 2: its call and frame, some 10 instructions). */
static inline int bex__loop_wait(struct bex__loop *l, struct epoll_event *ev, int max,
                                 int timeout_ms)
{
    return bex__loop_wait_own(l, ev, bex__loop_wait_raw(l, ev, max, timeout_ms));
}
/* Arm the loop's timer for due_us (bex__now_us time; absolute): an event
 * at that time that ends a wait (bex__loop_wait returns, perhaps 0), and
 * tfd_due = due_us until then. A failure leaves tfd_due 0 (the caller
 * then keeps to timeouts). One system call. */
void bex__loop_timer(struct bex__loop *l, uint64_t due_us);

/* Monotonic clocks. bex__now_ms is coarse (a jiffy) and cheap everywhere:
 * every user is a millisecond timeout read on every loop turn. */
uint64_t bex__now_ms(void);
uint64_t bex__now_us(void);
/* The coarse clock read, not kept (bex__now_ms keeps it). */
uint64_t bex__now_ms_read(void);
/* The I/O loop's turn gate: the value this thread's last bex__now_ms read
 * if it read one since its last bex__loop_wait and no call of this took
 * it, else bex__now_ms's without keeping it. Older than a read by what
 * ran since (at most the turn's callbacks); a sleep never ages it.
 * Inline: a spinning loop asks on every turn (issue 25 item 2). */
static inline uint64_t bex__now_ms_since_wait(void)
{
    uint64_t v = bex__loop_coarse_seen;
    bex__loop_coarse_seen = 0;
    return v ? v : bex__now_ms_read();
}
/* Tests: bex__now_ms reads fn from now on (NULL: CLOCK_MONOTONIC_COARSE
 * again), e.g. a coarse clock lagging the precise one by more than a
 * jiffy, as a VM's emulated ticks make it. fn must be monotonic and never
 * ahead of bex__now_us. */
void bex__loop_coarse_hook(uint64_t (*fn)(void));

#endif
