/* SPDX-License-Identifier: Apache-2.0 */
/* The per-thread loop: epoll, wake-up eventfd, command queue, clocks. */
#include <errno.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "common/sys.h"
#include "loop/loop.h"

int bex__loop_init(struct bex__loop *l)
{
    int err;
    atomic_init(&l->cmds, NULL);
    atomic_init(&l->sleeping, 0);
    atomic_init(&l->waits, 0);
    atomic_init(&l->sleeps, 0);
    atomic_init(&l->wake_reads, 0);
    atomic_init(&l->wakes, 0);
    l->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (l->epfd < 0)
        return -errno;
    l->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (l->evfd < 0) {
        err = -errno;
        goto err_epoll;
    }
    /* the eventfd's entry points at the loop itself: no owner's tag can */
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = l};
    if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->evfd, &ev)) {
        err = -errno;
        goto err_evfd;
    }
    l->tfd_due = 0;
    l->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (l->tfd < 0) {
        err = -errno;
        goto err_evfd;
    }
    /* edge-triggered, never read: each expiry is one event, and arming
     * again (timerfd_settime) clears the count; its entry points one byte
     * into the loop, which no owner's tag can either */
    ev = (struct epoll_event){.events = EPOLLIN | EPOLLET, .data.ptr = (char *)l + 1};
    if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->tfd, &ev)) {
        err = -errno;
        goto err_tfd;
    }
    return 0;
err_tfd:
    close(l->tfd);
err_evfd:
    close(l->evfd);
err_epoll:
    close(l->epfd);
    return err;
}

void bex__loop_fini(struct bex__loop *l)
{
    close(l->tfd);
    close(l->evfd);
    close(l->epfd);
}

static void wake(struct bex__loop *l)
{
    /* seq_cst on both sides: either the loop sees our command before it
     * sleeps, or we see it sleeping and write the eventfd. The first
     * waker takes the flag: the commands pushed after it, before the loop
     * is up, write nothing more (a Fetch over 8 shards pushes 8 calls in
     * a row; issue 25 item 5). */
    if (atomic_load(&l->sleeping) && atomic_exchange(&l->sleeping, 0)) {
        uint64_t one = 1;
        atomic_fetch_add_explicit(&l->wakes, 1, memory_order_relaxed);
        ssize_t r = write(l->evfd, &one, sizeof(one));
        (void)r;
    }
}

void bex__loop_push(struct bex__loop *l, struct bex__cmd *c, int type)
{
    c->type = type;
    struct bex__cmd *head = atomic_load_explicit(&l->cmds, memory_order_relaxed);
    do {
        c->next = head;
    } while (!atomic_compare_exchange_weak(&l->cmds, &head, c));
    wake(l);
}

struct bex__cmd *bex__loop_take(struct bex__loop *l)
{
    /* a plain look first: the spinning loop must not take the line that
     * other threads push to (a locked exchange) on every empty turn; the
     * sleep path checks again with seq_cst */
    if (!atomic_load_explicit(&l->cmds, memory_order_relaxed))
        return NULL;
    struct bex__cmd *list = atomic_exchange(&l->cmds, NULL);
    struct bex__cmd *fifo = NULL;
    while (list) { /* the stack is newest first */
        struct bex__cmd *n = list->next;
        list->next = fifo;
        fifo = list;
        list = n;
    }
    return fifo;
}

int bex__loop_watch(struct bex__loop *l, int fd, uint32_t events, struct ep_tag *tag)
{
    struct epoll_event ev = {.events = events, .data.ptr = tag};
    return epoll_ctl(l->epfd, EPOLL_CTL_ADD, fd, &ev) ? -errno : 0;
}

int bex__loop_modify(struct bex__loop *l, int fd, uint32_t events, struct ep_tag *tag)
{
    struct epoll_event ev = {.events = events, .data.ptr = tag};
    return epoll_ctl(l->epfd, EPOLL_CTL_MOD, fd, &ev) ? -errno : 0;
}

void bex__loop_unwatch(struct bex__loop *l, int fd)
{
    epoll_ctl(l->epfd, EPOLL_CTL_DEL, fd, NULL);
}

BEX__LOOP_TLS uint64_t bex__loop_coarse_seen;

int bex__loop_own_wakeups(struct bex__loop *l, struct epoll_event *ev, int i, int n)
{
    int k = i;
    for (; i < n; i++) {
        if (ev[i].data.ptr == (char *)l + 1) {
            l->tfd_due = 0;
            continue;
        }
        if (ev[i].data.ptr == l) {
            uint64_t v;
            bex__loop_count(&l->wake_reads);
            ssize_t r = read(l->evfd, &v, sizeof(v));
            (void)r;
            continue;
        }
        ev[k++] = ev[i];
    }
    return k;
}

void bex__loop_timer(struct bex__loop *l, uint64_t due_us)
{
    struct itimerspec its = {.it_value = {.tv_sec = (time_t)(due_us / 1000000),
                                          .tv_nsec = (long)(due_us % 1000000) * 1000}};
    l->tfd_due = 0; /* (due_us 0 disarms it) */
    if (timerfd_settime(l->tfd, TFD_TIMER_ABSTIME, &its, NULL) == 0)
        l->tfd_due = due_us;
}

/* Every user is a millisecond timeout, and the I/O loop reads this on every
 * turn: the coarse clock (one jiffy of resolution) comes from the vDSO even
 * where CLOCK_MONOTONIC cannot, e.g. on an emulated HPET in a VM, where
 * each CLOCK_MONOTONIC read is a system call of about 2 us. */
static _Atomic(uint64_t (*)(void)) coarse_fn;

void bex__loop_coarse_hook(uint64_t (*fn)(void))
{
    atomic_store_explicit(&coarse_fn, fn, memory_order_release);
}

uint64_t bex__now_ms_read(void)
{
    uint64_t (*fn)(void) = atomic_load_explicit(&coarse_fn, memory_order_relaxed);
    if (__builtin_expect(fn != NULL, 0))
        return fn();
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

uint64_t bex__now_ms(void)
{
    return bex__loop_coarse_seen = bex__now_ms_read();
}

uint64_t bex__now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}
