#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# bench/cost/fetch-sweep, a short run natively over TCP (2 rounds, 0.5 s
# steps at 10 % and 100 % of the capacity): its lines, its arithmetic and
# what cannot be otherwise. Per step, no request failed or was dropped,
# and completed/s is at most offered/s (both counted over the same
# window: no more can complete in it than arrived); the table's median of
# two rounds is their mean, its range theirs; the knee line and the plot's
# data (SWEEP_DATA) are there, and REPLAY of the output prints the same
# tables. The figures themselves are not checked.
# usage: test_fetch_sweep.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
fail() { echo "FAIL: $*" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$src" && BEX_BUILD_DIR=$build ROUNDS=2 DURATION=0.5 FRACTIONS="10 100" \
    SWEEP_DATA=$tmp/data bench/cost/fetch-sweep) >"$tmp/out" 2>&1 || { cat "$tmp/out"; fail "fetch-sweep exited $?"; }
cat "$tmp/out"
python3 - "$tmp/out" "$tmp/data" <<'PY'
import sys
out = open(sys.argv[1]).read().splitlines()
steps = [l.split() for l in out if l.startswith("sweep tcp ") and l.split()[3] != "capacity"]
caps = [l for l in out if l.startswith("sweep tcp ") and l.split()[3] == "capacity"]
assert len(caps) == 2 and len(steps) == 4, (caps, steps)
for s in steps:
    # sweep T ROUND F offered completed p50 p99 lag failed dropped
    assert len(s) == 11, s
    f, off, done, p50, p99 = int(s[3]), float(s[4]), float(s[5]), int(s[6]), int(s[7])
    assert s[9] == "0" and s[10] == "0", f"failed or dropped requests: {s}"
    assert 0 < done <= off, f"completed {done}/s of {off}/s offered: {s}"
    assert 0 < p50 <= p99, s
rows = {l.split("|")[1].strip(): [c.strip() for c in l.split("|")[1:-1]]
        for l in out if l.startswith("| 10 |") or l.startswith("| 100 |")}
assert set(rows) == {"10", "100"}, rows
for f, row in rows.items():
    vals = sorted(float(s[5]) for s in steps if s[3] == f)
    med = row[2].split()[0]
    rng = row[2].split()[1].strip("[]").split("-")
    assert abs(float(med) - sum(vals) / 2) < 1e-6, (f, row, vals)
    assert [float(x) for x in rng] == vals, (f, row, vals)
assert any(l.startswith("knee (tcp): ") for l in out), "no knee line"
data = [l.split() for l in open(sys.argv[2])]
assert [d[:2] for d in data] == [["tcp", "10"], ["tcp", "100"]] and all(len(d) == 12 for d in data), data
print("ok")
PY
# REPLAY: the same tables and knee again from the run's own lines
(cd "$src" && REPLAY=$tmp/out bench/cost/fetch-sweep) >"$tmp/replay" || fail "REPLAY exited $?"
diff <(sed -n '/^tcp, event mode/,$p' "$tmp/out") <(sed -n '/^tcp, event mode/,$p' "$tmp/replay") ||
    fail "REPLAY's tables differ from the run's"
grep -q '^knee (tcp): ' "$tmp/replay" || fail "REPLAY printed no knee"
echo "replay ok"
