#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian packages under systemd as PID 1 (issue 27 item 2): run inside
# `scripts/rxe-vm --init systemd` (an overlay root: dpkg writes nothing to
# the host). dpkg -i installs libbex0 and bex-ps (the ones test_deb.packages
# left in BUILD_DIR/test-deb); `systemctl start bex-ps` with a one-shard
# cluster on loopback in /etc/default/bex-ps; checked:
#  - /healthz and /ready answer 200, and the example ps_client Fetches,
#    Pushes and Fetches the update back ("update ok");
#  - `systemctl stop bex-ps` returns within the unit's TimeoutStopSec, the
#    unit's main process exited 0 (Result=success), the journal has
#    "bex-ps: drained" and "bex-ps: stopped", and a snapshot was written to
#    the unit's StateDirectory.
# Outside a VM it runs itself in one (scripts/rxe-vm --init systemd; skips
# with 77 without qemu); in a VM whose PID 1 is not systemd (the rxe
# tier's) it skips (77): a VM does not nest, and it never runs dpkg -i on
# a host.
#   test_deb_systemd.sh BUILD_DIR VERSION
set -euo pipefail
if [ -z "${BEX_IN_VM:-}" ]; then
    command -v qemu-system-x86_64 >/dev/null ||
        { echo "SKIP: no qemu-system-x86_64 (scripts/deps)" >&2; exit 77; }
    self=$(readlink -f "$0")
    exec "${self%/tests/packaging/*}/scripts/rxe-vm" --init systemd --timeout 600 -- "$self" "$@"
fi
build=$1
version=$2
major=${version%%.*}
fail() {
    echo "test_deb_systemd: $*" >&2
    journalctl -u bex-ps --no-pager >&2 || true
    exit 1
}
[ "$(cat /proc/1/comm)" = systemd ] ||
    { echo "SKIP: PID 1 is not systemd (run under scripts/rxe-vm --init systemd)" >&2; exit 77; }
debs=$build/test-deb
lib=$(ls "$debs/libbex${major}_${version}_"*.deb) || fail "no libbex$major in $debs (test_deb.packages)"
ps=$(ls "$debs/bex-ps_${version}_"*.deb) || fail "no bex-ps in $debs (test_deb.packages)"
dpkg -i "$lib" "$ps" >/tmp/dpkg.log 2>&1 || { cat /tmp/dpkg.log >&2; fail "dpkg -i failed"; }

# the VM is this test's alone: fixed loopback ports cannot collide
mkdir -p /etc/bex
printf '{"services":{"ps":{"shards":[{"replicas":[{"addr":"127.0.0.1:7000","transport":"tcp"}]}]}}}\n' \
    >/etc/bex/cluster.json
opts="--cluster /etc/bex/cluster.json --shard all --table 1:4:sgd:0.5 --transport tcp"
opts+=" --snapshot-dir /var/lib/bex-ps --metrics-port 9464 --drain-timeout-ms 5000 --no-catchup"
echo "BEX_PS_OPTS=\"$opts\"" >/etc/default/bex-ps
systemctl daemon-reload
systemctl start bex-ps || fail "systemctl start bex-ps"

http_200() { # PATH: answers 200 within 60 s
    local code=000
    for _ in $(seq 600); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:9464/$1" || true)
        [ "$code" = 200 ] && return 0
        systemctl -q is-active bex-ps || break
        sleep 0.1
    done
    fail "/$1 answered $code"
}
http_200 healthz
http_200 ready
"$build/examples/ps_client" /etc/bex/cluster.json >/tmp/client.out 2>&1 ||
    { cat /tmp/client.out >&2; fail "ps_client failed"; }
grep -q "update ok" /tmp/client.out || { cat /tmp/client.out >&2; fail "ps_client: no 'update ok'"; }

limit_s=$(sed -n 's/^TimeoutStopSec=//p' /usr/lib/systemd/system/bex-ps.service)
t0=$(date +%s%N)
systemctl stop bex-ps || fail "systemctl stop bex-ps"
took_ms=$((($(date +%s%N) - t0) / 1000000))
echo "test_deb_systemd: systemctl stop took $took_ms ms (TimeoutStopSec=$limit_s)" >&2
[[ "$limit_s" =~ ^[0-9]+$ ]] && [ "$took_ms" -lt $((limit_s * 1000)) ] ||
    fail "stop took $took_ms ms, TimeoutStopSec=$limit_s"
[ "$(systemctl show -p Result --value bex-ps)" = success ] || fail "Result is not success"
[ "$(systemctl show -p ExecMainStatus --value bex-ps)" = 0 ] || fail "bex-ps did not exit 0"
journalctl -u bex-ps --no-pager >/tmp/journal.txt
grep -q 'bex-ps: drained' /tmp/journal.txt || fail "the journal has no 'bex-ps: drained'"
grep -q 'bex-ps: stopped' /tmp/journal.txt || fail "the journal has no 'bex-ps: stopped'"
snaps=$(find /var/lib/private/bex-ps /var/lib/bex-ps/ -type f -size +0 2>/dev/null | head -n 5)
[ -n "$snaps" ] || fail "no snapshot in the StateDirectory (/var/lib/bex-ps)"
echo "test_deb_systemd: ok (started by systemd, served, stopped drained in $took_ms ms; snapshot: $snaps)"
