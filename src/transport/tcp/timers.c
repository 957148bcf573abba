/* SPDX-License-Identifier: Apache-2.0 */
/* The TCP transport: timers (keepalive, stalls, the receive rate), split
 * from tcp.c along its banner. See tcp.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "transport/tcp/tcp_internal.h"

/* ---------------- timers ---------------- */

/* Has a wait that began at since (ms) lasted beyond stall_ms? */
static bool waited_out(const struct bex__tcp *t, uint64_t since, uint64_t now)
{
    return t->cfg.stall_ms && now > since && now - since > t->cfg.stall_ms;
}

/* Holding partly received messages, the connection must deliver min_rate
 * bytes a second of them over each rate_window_ms: a peer that announced
 * large messages and stopped holds the budget others wait for. The window
 * lets an honest sender paced by TCP's send window through; time we do
 * not read for want of room in the context's budget is not the peer's and
 * restarts the window (a pause by the connection's own share is: the
 * peer started more than its share). Whether it fell below. */
static bool too_slow(struct bex__tcp *t, uint64_t now)
{
    if (!t->holding || !t->cfg.min_rate || !t->cfg.rate_window_ms)
        return false;
    if (now < t->rate_ms || (t->rx_paused && !t->pause_own)) {
        t->rate_ms = now;
        t->rate_rx = t->part_rx;
        return false;
    }
    uint64_t span = now - t->rate_ms;
    if (span < t->cfg.rate_window_ms)
        return false;
    uint64_t got = t->part_rx - t->rate_rx;
    if (got * 1000 < (uint64_t)t->cfg.min_rate * span)
        return true;
    t->rate_ms = now;
    t->rate_rx = t->part_rx;
    return false;
}

/* Has a deadline of the connection passed (logged)? Stalls for room or
 * for acknowledgements, the receive rate, the keepalive. */
static bool timed_out(struct bex__tcp *t, uint64_t now)
{
    /* Paused while holding partly received messages: only reading on can
     * finish them, and only other connections' frees can let us read on.
     * A peer that started messages to take the room and stopped (or two
     * streams whose messages together exceed it) would hold the context's
     * received memory for good: the connection goes after stall_ms. */
    if (t->rx_paused && t->parts_n && waited_out(t, t->paused_ms, now)) {
        bex__log(t->sh->log, BEX_LOG_ERROR,
                 "%s: over TCP: no room to receive (recv_bytes_max) for %u ms with %u messages "
                 "partly received",
                 t->cfg.name, t->cfg.stall_ms, t->parts_n);
        return true;
    }
    if (too_slow(t, now)) {
        bex__log(t->sh->log, BEX_LOG_ERROR,
                 "%s: over TCP: %u messages partly received (%llu bytes held) progress below "
                 "recv_min_rate (%u bytes/s over %u ms)",
                 t->cfg.name, t->parts_n, (unsigned long long)t->part_bytes, t->cfg.min_rate,
                 t->cfg.rate_window_ms);
        return true;
    }
    /* As over RDMA for credits: messages written whole that the peer does
     * not acknowledge in stall_ms (it reads them, it answers keepalives)
     * would wait for good. */
    if (t->ack_head && waited_out(t, t->ack_wait_ms, now)) {
        bex__log(t->sh->log, BEX_LOG_ERROR,
                 "%s: over TCP: sent messages waited %u ms for an acknowledgement", t->cfg.name,
                 t->cfg.stall_ms);
        return true;
    }
    /* the reads above stamp last_rx with a later now than ours */
    if (t->rx_paused) {
        t->last_rx = now; /* we are the one not reading */
    } else if (now > t->last_rx && now - t->last_rx > t->cfg.keepalive_timeout_ms) {
        bex__log(t->sh->log, BEX_LOG_WARN, "%s: over TCP: keepalive timeout (%u ms)", t->cfg.name,
                 t->cfg.keepalive_timeout_ms);
        BEX__STAT_ADD(t->sh->stats, keepalive_fails, 1);
        return true;
    }
    return false;
}

/* What the I/O thread should do after a tick: a progress call when work
 * is queued or the connection is held back or dead; a tick soon (not at
 * the next keepalive round) while it is held back for room, which only
 * other connections' frees give, or holds partly received messages, whose
 * rate the tick measures. An idle connection asks for neither. */
static unsigned tick_wants(const struct bex__tcp *t)
{
    if (t->state != T_UP)
        return BEX__TICK_PROGRESS;
    unsigned want = 0;
    if (t->need_buf || t->rx_paused || t->holding || t->out_n || t->ctl_n || t->streams.ring_n)
        want |= BEX__TICK_PROGRESS | BEX__TICK_SOON;
    if (t->ack_head)
        want |= BEX__TICK_PROGRESS;
    return want;
}

/* Is a keepalive due at this tick (now, ms)? It is written only as often
 * as the peer's timeout needs (bex__keepalive_send_ms: every), so the
 * peer's thread is not woken by one every tick; and on a grid all
 * connections share (the multiples of every of the monotonic clock), so
 * that a thread's idle connections, which tick together once per
 * keepalive_ms (conn/timers.c), write theirs in the same tick and their
 * peers' threads wake once for all of them, not once per tick for the
 * connections that came up in it. The first tick of each period of the
 * grid writes one unless the connection wrote within the last eighth of
 * keepalive_ms; in between one is written when every has passed (each
 * tick a little late: an eighth of keepalive_ms early is on time), so the
 * gap between two writes is never longer than before. */
bool bex__tcp_keepalive_due(struct bex__tcp *t, uint64_t now)
{
    uint32_t every = bex__keepalive_send_ms(t->cfg.keepalive_ms, t->cfg.peer_ka_timeout_ms);
    if (now <= t->last_tx || !every)
        return false;
    uint64_t since = now - t->last_tx, slack = t->cfg.keepalive_ms / 8;
    bool grid = now / every != t->ka_period;
    t->ka_period = now / every;
    return since + slack >= every || (grid && since >= slack);
}

unsigned bex__tcp_tick(struct bex__xport *x, uint64_t now)
{
    struct bex__tcp *t = tcp_of(x);
    if (t->state != T_UP)
        return tick_wants(t);
    if (t->need_buf) { /* room again? */
        bex__tcp_rx(t);
        if (t->state == T_DEAD)
            return tick_wants(t);
    }
    if (timed_out(t, now)) {
        bex__tcp_fail(x, -ETIMEDOUT);
        return tick_wants(t);
    }
    if (bex__tcp_keepalive_due(t, now) && !t->out_n && !t->ctl_n) {
        /* a header says we are alive */
        bex__tcp_ctl_push(t, BEX__MSG_CREDIT, 0, NULL);
        t->last_tx = now;
        bex__tcp_progress(x);
    }
    return tick_wants(t);
}
