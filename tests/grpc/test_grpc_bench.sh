#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bex_grpc_bench.tcp_json: run bex-grpc-bench's matrix for a few calls on
# loopback and check its --json output: one object per cell (64 B, 4 KiB,
# 64 KiB x 1, 64 outstanding), each with exactly the keys bex-rpc-bench
# prints, the calls asked for, a positive rate and P50 <= P99, no error.
# Usage: test_grpc_bench.sh GRPC_BENCH RPC_BENCH
set -euo pipefail
grpc=$1 rpc=$2
out=$(mktemp)
ref=$(mktemp)
trap 'rm -f "$out" "$ref"' EXIT
iters=200
"$grpc" --matrix --iters $iters --warmup 20 --json >"$out"
# one cell of bex-rpc-bench for its keys
"$rpc" --matrix --transport tcp --iters 20 --warmup 0 --json >"$ref"
python3 - "$out" "$ref" $iters <<'PY'
import json, sys
out, ref, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
keys = set(json.loads(open(ref).readline()))
lines = [l for l in open(out).read().splitlines() if l.strip()]
cells = []
for l in lines:
    o = json.loads(l)
    assert isinstance(o, dict), l
    assert set(o) == keys, f"keys {sorted(o)} differ from bex-rpc-bench's {sorted(keys)}"
    assert o["bench"] == "grpc" and o["transport"] == "tcp", l
    assert o["iters"] == iters, l
    assert o["calls_per_s"] > 0, l
    assert 0 < o["p50_us"] <= o["p99_us"], l
    assert o["mean_us"] > 0 and o["errors"] == 0, l
    cells.append((o["size"], o["outstanding"]))
want = [(s, k) for s in (64, 4096, 65536) for k in (1, 64)]
assert cells == want, f"cells {cells}, expected {want}"
print(f"bex-grpc-bench: {len(cells)} cells, {iters} calls each, JSON as bex-rpc-bench's")
PY
