/* SPDX-License-Identifier: Apache-2.0 */
/* bex-info's parts: the report (bex-info.c) and the path check (check.c). */
#ifndef BEX_INFO_H
#define BEX_INFO_H

#include <netinet/in.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "bex/sock.h"

/* What the path check found. */
struct check_result {
    int err;            /* 0: every step worked; else the failing step's error */
    const char *step;   /* the step that failed (connect, round trip, burst) */
    int transport;      /* BEX_TRANSPORT_RDMA or _TCP: what the connection chose */
    double rtt_us[2];   /* round trip: min and median */
    uint32_t rtts;      /* round trips made */
    double burst_mib_s; /* bandwidth of the burst */
    uint64_t burst_bytes;
    char text[256]; /* the error as bex_sock_last_error gives it */
};

/* Connect ctx to peer (transport: BEX_TRANSPORT_* for this connection),
 * make round trips, send a burst of burst_bytes, fill r. */
void info_check(bex_ctx *ctx, const bex_addr *peer, uint32_t transport, uint64_t burst_bytes,
                struct check_result *r);
/* Serve the checks of other hosts on ctx at addr until SIGINT/SIGTERM;
 * returns a process exit status. */
int info_serve(bex_ctx *ctx, const bex_addr *addr);

#endif
