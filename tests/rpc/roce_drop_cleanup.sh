#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# CTest fixture cleanup of test_ladder.rdma_unusable: remove the ingress
# qdiscs (and with them the filters dropping RoCE v2) it puts on the veth
# wire, even when the case was killed before it could, so that no later
# test runs over a wire without RDMA. Runs where the case runs
# (BEX_TEST_ADDR0/1 set, i.e. in scripts/rxe-vm); elsewhere nothing to do.
set -u
[ -n "${BEX_TEST_ADDR0:-}" ] || exit 0
command -v tc >/dev/null 2>&1 || exit 0
rc=0
for d in veth0 veth1; do
    if tc qdisc show dev "$d" 2>/dev/null | grep -q '^qdisc ingress'; then
        echo "roce_drop_cleanup: an ingress qdisc was left on $d: removing it" >&2
        tc qdisc del dev "$d" ingress || rc=1
    fi
done
exit $rc
