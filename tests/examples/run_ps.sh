#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/ps_client.c against a running bex-ps, natively over TCP on
# loopback: 2 shards in one bex-ps, the client's Push seen in its second
# Fetch (checked here from the rows it prints, not only by the client),
# the rows kept for a second client, and a stopped server or a bad
# cluster file fail with a message and status 1
# (tests/examples/CMakeLists.txt).
#   run_ps.sh PS_CLIENT BEX_PS
. "$(dirname "$0")/lib.sh"
client_bin=$1 ps_bin=$2

# bex-ps takes its addresses from the cluster file, whose ports must be
# real ones (1-65535): it cannot listen on port 0 and say which it got.
# So a helper reserves two free ports race-free: it binds them (port 0,
# SO_REUSEADDR, not listening) and holds them until bex-ps listens on
# them (bex's listener sets SO_REUSEADDR too, which lets it bind a port
# that nobody listens on), so no other process can take them meanwhile.
start holder python3 -c '
import socket, time
held = []
for _ in range(2):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    held.append(s)
print("ports", *(s.getsockname()[1] for s in held), flush=True)
time.sleep(600)'
line=$(wait_line holder '^ports [0-9]+ [0-9]+$') || exit 1
read -r _ p0 p1 <<<"$line"
cat >"$out/cluster.json" <<JSON
{"services": {"ps": {"shards": [
    {"replicas": [{"addr": "127.0.0.1:$p0", "transport": "tcp"}]},
    {"replicas": [{"addr": "127.0.0.1:$p1", "transport": "tcp"}]}]}}}
JSON

start ps "$ps_bin" --cluster "$out/cluster.json" --shard all --table 1:4:sgd:0.5
wait_line ps '^bex-ps: ready$' >/dev/null || exit 1
kill "${pids[0]}" # the holder: bex-ps listens on both ports now

run client 0 "$client_bin" "$out/cluster.json"
expect_out client "update ok: w -= 0.5 * grad on 3 rows"
# the Push the client made, checked from its rows: updated = fetched - 0.5 * g
# with g = 0.1 * (i + 1) for the i-th float of the request
python3 - "$out/client.out" <<'PY' || fail "client: rows do not show the update"
import sys
rows = {"fetched": [], "updated": []}
for line in open(sys.argv[1]):
    w = line.split()
    if w and w[0] in rows:
        assert w[1] == "key", line
        rows[w[0]] += [float(x) for x in w[3:]]
b, a = rows["fetched"], rows["updated"]
assert len(b) == len(a) == 12, (len(b), len(a))
for i, (x, y) in enumerate(zip(b, a)):
    assert abs(y - (x - 0.5 * 0.1 * (i + 1))) < 2e-4, (i, x, y)
print("rows: ok")
PY
# a second client sees the first one's update: its rows start where the
# first one's ended
run client2 0 "$client_bin" "$out/cluster.json" 127.0.0.1
diff <(grep '^updated' "$out/client.out" | sed 's/^updated/fetched/') \
    <(grep '^fetched' "$out/client2.out") >&2 || fail "client2: rows not the first client's"

# bex-ps stops on SIGTERM with status 0; a client then fails, saying why
kill -TERM "${pids[1]}"
wait "${pids[1]}"
rc=$?
[ "$rc" = 0 ] || fail "bex-ps: exit status $rc after SIGTERM, expected 0"
run stopped 1 "$client_bin" "$out/cluster.json"
expect_err stopped "ps_client: "

echo '{"services": {}' >"$out/bad.json"
run bad 1 "$client_bin" "$out/bad.json"
expect_err bad "ps_client: $out/bad.json: "
echo "ok: ps_client against bex-ps on ports $p0 and $p1"
