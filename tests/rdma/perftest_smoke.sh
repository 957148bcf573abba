#!/bin/sh
# Smoke test of the RDMA stack with perftest: ib_write_bw from rxe1 (client)
# to rxe0 (server), as set up by scripts/rxe-vm. Checks that the client
# reports a non-zero bandwidth.
#
# Exit: 0 pass, 1 fail, 77 skip (no rxe0/rxe1 here; a failure instead when
# BEX_REQUIRE_RDMA is set to anything but 0).
set -u

SIZE=65536
ITERS=2000

skip() {
    if [ -n "${BEX_REQUIRE_RDMA:-}" ] && [ "$BEX_REQUIRE_RDMA" != 0 ]; then
        echo "FAIL: $1, and BEX_REQUIRE_RDMA is set" >&2
        exit 1
    fi
    echo "SKIP: $1" >&2
    exit 77
}
fail() {
    echo "FAIL: $1" >&2
    exit 1
}

for d in rxe0 rxe1; do
    [ -e "/sys/class/infiniband/$d" ] || skip "no RDMA device $d (run the test under scripts/rxe-vm)"
done
command -v ib_write_bw >/dev/null 2>&1 || skip "ib_write_bw not found (install perftest)"

work=$(mktemp -d "${TMPDIR:-/tmp}/perftest_smoke.XXXXXX") || fail "mktemp"
server=""
cleanup() {
    [ -n "$server" ] && kill "$server" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

ib_write_bw -d rxe0 -F -s "$SIZE" -n "$ITERS" >"$work/server.log" 2>&1 &
server=$!

ok=0
for attempt in 1 2 3 4 5 6 7 8 9 10; do
    sleep 1
    kill -0 "$server" 2>/dev/null || break
    if ib_write_bw -d rxe1 -F -s "$SIZE" -n "$ITERS" 127.0.0.1 >"$work/client.log" 2>&1; then
        ok=1
        break
    fi
    echo "client attempt $attempt failed:" >&2
    tail -n 3 "$work/client.log" >&2
done

# The server ends by itself once the client has finished.
for i in $(seq 30); do
    kill -0 "$server" 2>/dev/null || break
    sleep 1
done
if kill -0 "$server" 2>/dev/null; then
    kill "$server" 2>/dev/null
    echo "server did not exit; killed" >&2
    ok=0
fi
wait "$server"
server_rc=$?
server=""

echo "--- client"
cat "$work/client.log"
echo "--- server"
cat "$work/server.log"

[ "$ok" = 1 ] || fail "ib_write_bw client did not complete"
[ "$server_rc" = 0 ] || fail "ib_write_bw server exited with $server_rc"
# The result line: #bytes #iterations BW-peak BW-average MsgRate
bw=$(awk -v s="$SIZE" -v n="$ITERS" '$1 == s && $2 == n && NF >= 4 { print $4 }' "$work/client.log" | tail -n 1)
[ -n "$bw" ] || fail "no bandwidth line in the client output"
awk -v bw="$bw" 'BEGIN { exit !(bw + 0 > 0) }' || fail "bandwidth is $bw MB/s"
echo "PASS: ib_write_bw rxe1 -> rxe0: $bw MB/s average"
