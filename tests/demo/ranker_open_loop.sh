#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# bex-ranker --rate's open loop at overload, natively over TCP on
# loopback: Poisson arrivals at 100 000/s for 0.2 s with one request in
# flight (some thousands a second), so nearly all of them wait.
# Every arrival of the window is issued, late ones too, or fails unissued
# past the end plus the deadline (arrivals_dropped): none is left out
# (before, the loop stopped at the end and the backlog went uncounted:
# arrivals were what one slot carried in the window: 3038 of ~20 000).
# The window's own count
# (in_window, window_per_s) and the latency from arrival are reported.
# usage: ranker_open_loop.sh BEX_PS BEX_RANKER
set -euo pipefail
ps=$1 ranker=$2
fail() { echo "FAIL: $*" >&2; exit 1; }
tmp=$(mktemp -d)
spid=
trap '[ -z "$spid" ] || { kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; }; rm -rf "$tmp"' EXIT
scale=${BEX_TEST_TIME_SCALE:-1}
lo=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
# a port below the ephemeral range, drawn again when bex-ps finds it taken
for try in 1 2 3 4 5; do
    port=$((10000 + SRANDOM % (lo - 10000)))
    printf '{"version": 1, "services": {"ps": {"shards": [{"replicas": [{"addr": "127.0.0.1:%d", "transport": "tcp"}]}]}}}\n' \
        "$port" >"$tmp/cl.json"
    "$ps" --cluster "$tmp/cl.json" --shard 0 --transport tcp --poll event --no-catchup \
        --table 1:16:sgd >"$tmp/ps.log" 2>&1 &
    spid=$!
    deadline=$((SECONDS + 30 * scale))
    while ! grep -qsx 'bex-ps: ready' "$tmp/ps.log" && kill -0 "$spid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
        sleep 0.05
    done
    grep -qsx 'bex-ps: ready' "$tmp/ps.log" && break
    kill "$spid" 2>/dev/null || true
    wait "$spid" 2>/dev/null || true
    spid=
    echo "bex-ps on port $port did not start (try $try):"
    tail -n 3 "$tmp/ps.log"
done
[ -n "$spid" ] || fail "bex-ps did not start"
"$ranker" --cluster "$tmp/cl.json" --transport tcp --poll event --duration 0.2 --outstanding 1 \
    --rate 100000 --timeout-ms 1000 --models 1 --keys-min 64 --keys-max 64 --dim 16 \
    >"$tmp/rk.json" 2>"$tmp/rk.err" || { cat "$tmp/rk.err"; fail "bex-ranker exited $?"; }
python3 - "$tmp/rk.json" <<'PY'
import json, sys
o = json.load(open(sys.argv[1]))
r, f = o["ops"]["request"], o["ops"]["fetch"]
print("arrivals", o["arrivals"], "waited", o["arrivals_waited"], "dropped", o.get("arrivals_dropped"),
      "requests", r["count"], "failed", r["failed"], "in window", r.get("in_window"),
      "request P50", r["p50_us"], "fetch P50", f["p50_us"], "issue lag", o.get("issue_lag_us"))
# a Poisson count of mean 20 000 (deviation 141): every arrival of the
# window, whatever one slot carried
assert 19000 <= o["arrivals"] <= 21000, f"{o['arrivals']} arrivals in 0.2 s at 100 000/s"
assert r["count"] == o["arrivals"], f"{r['count']} requests of {o['arrivals']} arrivals"
assert o["arrivals_waited"] > 0, "no arrival waited for the one slot"
# a request fails when its Fetch did, or unissued past the end plus the deadline
assert r["failed"] == f["failed"] + o["arrivals_dropped"], (r["failed"], f["failed"], o["arrivals_dropped"])
assert f["count"] + o["arrivals_dropped"] == o["arrivals"], (f["count"], o["arrivals_dropped"])
# the window's count: what completed within the 0.2 s (none, if a loaded
# host stalled it throughout), at most all that did
assert 0 <= r["in_window"] <= r["ok"], (r["in_window"], r["ok"])
assert abs(r["window_per_s"] - r["in_window"] / 0.2) < 1, r["window_per_s"]
# latency from arrival: the waits for the slot count
assert r["p50_us"] >= f["p50_us"], (r["p50_us"], f["p50_us"])
PY
echo ok
