/* SPDX-License-Identifier: Apache-2.0 */
/* bex_ps_client_prometheus: the PS client's counters (bex_ps_client_stats)
 * in Prometheus text exposition format: counters, and the two gauges
 * push_held and push_channels. */
#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "bex/ps.h"
#include "rpc/internal.h"

static const struct bex__prom_ctr ctrs[] = {
    {"bex_ps_client_calls_total", "Sub-requests (RPC calls) sent to the shards",
     offsetof(bex_ps_client_stats, calls)},
    {"bex_ps_client_ok_total", "Sub-requests completed with status 0",
     offsetof(bex_ps_client_stats, ok)},
    {"bex_ps_client_failed_total", "Sub-requests completed with an error",
     offsetof(bex_ps_client_stats, failed)},
    {"bex_ps_client_attempts_total", "Requests sent, retries included",
     offsetof(bex_ps_client_stats, attempts)},
    {"bex_ps_client_retries_total", "Attempts after the first",
     offsetof(bex_ps_client_stats, retries)},
    {"bex_ps_client_retry_throttled_total", "Retries refused by the retry budget",
     offsetof(bex_ps_client_stats, retry_throttled)},
    {"bex_ps_client_failovers_total", "Retries sent to another replica",
     offsetof(bex_ps_client_stats, failovers)},
    {"bex_ps_client_conn_failures_total", "Connections failed or timed out",
     offsetof(bex_ps_client_stats, conn_failures)},
    {"bex_ps_client_push_kept_total",
     "Pushes kept for a replica that failed them while another replica took them",
     offsetof(bex_ps_client_stats, push_kept)},
    {"bex_ps_client_push_resent_total", "Kept Pushes sent to their replica again and taken",
     offsetof(bex_ps_client_stats, push_resent)},
    {"bex_ps_client_push_dropped_total",
     "Kept Pushes dropped unsent (past the bound, out of the id window, refused, replica gone)",
     offsetof(bex_ps_client_stats, push_dropped)},
};

/* what the client has now (bex_ps_client_stats: push_held, push_channels) */
static const struct bex__prom_ctr gauges[] = {
    {"bex_ps_client_push_held", "Pushes kept now, not yet sent again nor dropped",
     offsetof(bex_ps_client_stats, push_held)},
    {"bex_ps_client_push_channels",
     "Push channels now: one per replica listed, and those of replicas no longer listed not "
     "retired yet",
     offsetof(bex_ps_client_stats, push_channels)},
};

static void client_label(const void *obj, const void *arg, char *labels, size_t cap)
{
    (void)obj;
    snprintf(labels, cap, "client=\"%s\"", (const char *)arg);
}

int bex_ps_client_prometheus(bex_ps_client *c, const char *name, char *buf, size_t cap)
{
    if (!c || (!buf && cap))
        return -EINVAL;
    bex_ps_client_stats s;
    bex_ps_client_stats_get(c, &s);
    char label[256];
    bex__prom_escape(name ? name : "ps", label, sizeof label);
    if (cap)
        buf[0] = 0;
    struct bex__prom o = {buf, cap, 0};
    struct bex__prom_array one = {&s, 1, sizeof s, client_label, label};
    bex__prom_counters(&o, ctrs, sizeof ctrs / sizeof ctrs[0], bex__prom_array_next, &one);
    for (size_t i = 0; i < sizeof gauges / sizeof gauges[0]; i++) {
        const struct bex__prom_ctr *g = &gauges[i];
        bex__prom_printf(&o, "# HELP %s %s.\n# TYPE %s gauge\n%s{client=\"%s\"} %llu\n", g->metric,
                         g->help, g->metric, g->metric, label,
                         (unsigned long long)*(const uint64_t *)((const char *)&s + g->off));
    }
    return o.n > (size_t)INT_MAX ? -ENOMEM : (int)o.n;
}
