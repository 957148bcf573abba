#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# CTest fixture cleanup of test_sock_rxe.packet_loss: remove the netem
# qdiscs it puts on the veth wire, even when the case was killed (a timeout,
# its watchdog) before it could remove them, so that no later test runs
# over a lossy wire. Runs where the case runs (BEX_TEST_ADDR0/1 set, i.e.
# in scripts/rxe-vm); elsewhere there is nothing to clean.
set -u
[ -n "${BEX_TEST_ADDR0:-}" ] || exit 0
command -v tc >/dev/null 2>&1 || exit 0
rc=0
for d in veth0 veth1; do
    if tc qdisc show dev "$d" 2>/dev/null | grep -q '^qdisc netem'; then
        echo "netem_cleanup: a netem qdisc was left on $d: removing it" >&2
        tc qdisc del dev "$d" root || rc=1
    fi
done
exit $rc
