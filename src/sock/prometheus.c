/* SPDX-License-Identifier: Apache-2.0 */
/* bex_ctx_prometheus: the transport's counters and the context's pools in
 * Prometheus text exposition format. */
#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>

#include "bex/sock.h"
#include "bex/mem.h"
#include "common/prom.h"

/* One sample of bex_sock_stats per family. gauge: a level (engines now),
 * else a counter since the context was made. */
static const struct {
    const char *metric, *help;
    size_t off;
    int gauge;
} ctrs[] = {
#define C(m, h, f)                                                                                 \
    {                                                                                              \
        m, h, offsetof(bex_sock_stats, f), 0                                                       \
    }
#define G(m, h, f)                                                                                 \
    {                                                                                              \
        m, h, offsetof(bex_sock_stats, f), 1                                                       \
    }
    G("bex_transport_engines", "Transports made now: RDMA engines and TCP connections", engines),
    G("bex_transport_tcp_connections", "Of the transports, those over TCP", tcp_conns),
    C("bex_transport_messages_sent_total", "Messages sent", msgs_sent),
    C("bex_transport_messages_received_total", "Messages received", msgs_recv),
    C("bex_transport_sent_bytes_total", "Payload bytes sent", bytes_sent),
    C("bex_transport_received_bytes_total", "Payload bytes received", bytes_recv),
    C("bex_transport_credit_stalls_total", "Times a send waited for the peer's credit",
      credit_stalls),
    C("bex_transport_window_stalls_total", "Times a send waited for the send window",
      window_stalls),
    C("bex_transport_recv_paused_total", "Times the receive limits paced the peers", recv_paused),
    C("bex_transport_rnr_errors_total", "RDMA connections failed: RNR retries exhausted",
      rnr_errors),
    C("bex_transport_retry_errors_total", "RDMA connections failed: transport retries exhausted",
      retry_errors),
    C("bex_transport_keepalive_failures_total", "Connections failed for the peer's silence",
      keepalive_fails),
    C("bex_transport_tcp_fallbacks_total", "Connections of transport auto that went over TCP",
      tcp_fallbacks),
    G("bex_transport_window_bytes", "Adaptive send windows of the engines, summed", window_bytes),
    G("bex_transport_window_base_delay_us",
      "Smallest base delay (post to completion) an engine measured", window_base_us),
    G("bex_transport_window_delay_us", "Largest of the I/O threads' last delay samples",
      window_delay_us),
    C("bex_transport_window_cuts_total", "Multiplicative decreases of an adaptive send window",
      window_cuts),
    C("bex_transport_dest_bound_hits_total", "Times a send waited for its destination's bound",
      dest_bound_hits),
    G("bex_transport_dest_max_inflight_bytes", "Highest bytes in flight to one destination seen",
      dest_max_inflight),
    /* what a message costs in work requests and system calls: over TCP a
     * SEND is a frame, a doorbell a sendmsg call, and a credit message a
     * frame of acknowledgements alone (which the peer wakes for and reads) */
    C("bex_transport_sends_total", "SEND work requests posted (TCP: frames other than DIRECT)",
      sends_posted),
    C("bex_transport_doorbells_total", "ibv_post_send calls (TCP: sendmsg calls)", post_send_calls),
    C("bex_transport_credit_messages_total",
      "Credit updates sent alone (TCP: frames of acknowledgements alone)", credit_msgs),
    C("bex_loop_waits_total", "epoll_wait calls of the I/O threads", loop_waits),
    C("bex_loop_sleeps_total", "Of the I/O threads' epoll_wait calls, those that slept",
      loop_sleeps),
#undef C
#undef G
};

static void pool(struct bex__prom *o, const char *metric, const char *help,
                 bex_mem_pool *const *pools, const char *const *names, size_t n, size_t field)
{
    bex__prom_printf(o, "# HELP %s %s.\n# TYPE %s gauge\n", metric, help, metric);
    for (size_t i = 0; i < n; i++) {
        bex_mem_stats ms;
        bex_mem_pool_stats(pools[i], &ms);
        bex__prom_printf(o, "%s{pool=\"%s\"} %zu\n", metric, names[i],
                         *(size_t *)((char *)&ms + field));
    }
}

int bex_ctx_prometheus(bex_ctx *ctx, char *buf, size_t cap)
{
    if (!ctx || (!buf && cap))
        return -EINVAL;
    bex_sock_stats s;
    bex_ctx_stats(ctx, &s);
    struct bex__prom o = {buf, cap, 0};
    if (cap)
        buf[0] = 0;
    for (size_t i = 0; i < sizeof ctrs / sizeof ctrs[0]; i++) {
        const char *type = ctrs[i].gauge ? "gauge" : "counter";
        bex__prom_printf(&o, "# HELP %s %s.\n# TYPE %s %s\n%s %llu\n", ctrs[i].metric, ctrs[i].help,
                         ctrs[i].metric, type, ctrs[i].metric,
                         (unsigned long long)*(const uint64_t *)((const char *)&s + ctrs[i].off));
    }
    bex_mem_pool *pools[] = {bex_ctx_pool(ctx), bex_ctx_recv_pool(ctx), bex_ctx_landing_pool(ctx)};
    static const char *const names[] = {"main", "recv", "landing"};
    pool(&o, "bex_pool_registered_bytes", "Bytes of the context's pools registered", pools, names,
         3, offsetof(bex_mem_stats, registered_bytes));
    pool(&o, "bex_pool_in_use_bytes", "Bytes of the context's pools handed out and not freed",
         pools, names, 3, offsetof(bex_mem_stats, in_use_bytes));
    return o.n > (size_t)INT_MAX ? -ENOMEM : (int)o.n;
}
