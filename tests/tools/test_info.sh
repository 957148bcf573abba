#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bex-info (issue 27 item 5).
#   test_info.sh BEX_INFO native: on 127.0.0.1 (no RDMA device has it,
#     natively nor in the VM): exit 3, "transport: tcp" and the reason, the
#     same in --json (parsed by python3); bad command lines exit 2 naming
#     the input; a path check against `bex-info --listen` passes over TCP
#     (exit 0, 20 round trips, the burst's bytes), and one to a closed port
#     fails at connect (exit 1).
#   test_info.sh BEX_INFO rxe: on BEX_TEST_ADDR0 (rxe0, in the VM; skips
#     with 77 without it): exit 0, --json's device rxe*, Ethernet, RoCE v2,
#     an MTU, landing, limits; the check from BEX_TEST_ADDR1 over RDMA.
set -euo pipefail
bin=$1
mode=$2
fail() { echo "test_info: $*" >&2; exit 1; }
tmp=$(mktemp -d)
listener=
cleanup() {
    [ -n "$listener" ] && kill "$listener" 2>/dev/null && wait "$listener" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT

# run NAME WANT_STATUS ARGS...: stdout/stderr into $tmp/NAME.{out,err}
run() {
    local name=$1 want=$2 rc=0
    shift 2
    local t0=$SECONDS
    "$bin" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" || rc=$?
    cat "$tmp/$name.out" "$tmp/$name.err" >&2
    echo "test_info: $name: $((SECONDS - t0)) s" >&2
    [ "$rc" = "$want" ] || fail "$name: bex-info $* exited $rc, want $want"
}

# json NAME PYTHON-EXPRESSION: the expression over d (the parsed output of
# run NAME, kept as $tmp/NAME.json) must be true; json_verify checks every
# one noted so in one python3 (each start of it takes seconds in the VM)
json() {
    cp "$tmp/$1.out" "$tmp/$1.json"
    printf '%s\t%s\n' "$1" "$2" >>"$tmp/checks"
}
json_verify() {
    echo "test_info: checking the JSON of: $(cut -f1 "$tmp/checks" | tr '\n' ' ')" >&2
    python3 - "$tmp" <<'PY' || fail "a --json output does not satisfy its check (above)"
import json, os, sys
tmp = sys.argv[1]
bad = 0
for line in open(os.path.join(tmp, "checks")):
    name, expr = line.rstrip("\n").split("\t", 1)
    d = json.load(open(os.path.join(tmp, name + ".json")))
    if not eval(expr, {"d": d, "os": os}):
        print(f"test_info: {name}: --json does not satisfy: {expr}", file=sys.stderr)
        bad = 1
sys.exit(bad)
PY
}

# listen IP: a bex-info --listen on IP:0; its port into $port
listen() {
    "$bin" --listen "$1:0" >"$tmp/listen.out" 2>"$tmp/listen.err" &
    listener=$!
    for _ in $(seq 100); do
        port=$(sed -n 's/^bex-info: listening on .*:\([0-9]*\)$/\1/p' "$tmp/listen.out")
        [ -n "$port" ] && return 0
        sleep 0.1
    done
    cat "$tmp/listen.err" >&2
    fail "bex-info --listen $1:0 printed no port"
}

if [ "$mode" = native ]; then
    run text 3 --local 127.0.0.1
    grep -q '^transport: *tcp$' "$tmp/text.out" || fail "no 'transport: tcp' line"
    grep -q '^reason: *no usable RDMA device for 127.0.0.1' "$tmp/text.out" || fail "no reason"
    run js 3 --local 127.0.0.1 --json
    json js 'd["transport"] == "tcp" and d["local"] == "127.0.0.1" and "127.0.0.1" in d["reason"]'
    for bad in "--local 1.2.3" "--local 127.0.0.1 --transport foo" \
               "--local 127.0.0.1 --burst-mib x" "--local 127.0.0.1 --peer 127.0.0.1" \
               "--json" "--local 127.0.0.1 extra"; do
        # shellcheck disable=SC2086
        run bad 2 $bad
        [ -s "$tmp/bad.err" ] || fail "bex-info $bad: nothing on stderr"
    done
    run bad 2 --local 1.2.3
    grep -q -- '--local 1.2.3' "$tmp/bad.err" || fail "the error does not name --local 1.2.3"
    listen 127.0.0.1
    run check 0 --local 127.0.0.2 --peer "127.0.0.1:$port" --json --burst-mib 4
    json check 'd["check"]["ok"] and d["check"]["transport"] == "tcp" and d["check"]["round_trips"] == 20 and d["check"]["burst_bytes"] == 4 << 20 and d["check"]["burst_mib_s"] > 0'
    kill "$listener"
    wait "$listener" || fail "bex-info --listen exited $? on SIGTERM, want 0"
    listener=
    run closed 1 --local 127.0.0.2 --peer "127.0.0.1:$port" --json
    json closed 'not d["check"]["ok"] and d["check"]["failed_step"] == "connect" and "refused" in d["check"]["error"]'
    json_verify
    echo "test_info: native ok"
    exit 0
fi

[ -n "${BEX_TEST_ADDR0:-}" ] && [ -n "${BEX_TEST_ADDR1:-}" ] || {
    echo "test_info: BEX_TEST_ADDR0/1 not set (run under scripts/rxe-vm)" >&2
    [ -n "${BEX_REQUIRE_RDMA:-}" ] && exit 1
    exit 77
}
run dev 0 --local "$BEX_TEST_ADDR0" --json
json dev 'd["transport"] == "rdma" and d["device"].startswith("rxe") and d["link_layer"] == "Ethernet" and d["gid_type"] == "RoCE v2" and d["lid"] == 0 and d["mtu"] in (256, 512, 1024, 2048, 4096) and d["port_state"] == "ACTIVE" and d["remote_access"] in ("landing", "window") and isinstance(d["srq"], bool) and isinstance(d["thread_domain"], bool) and d["limits"]["max_qp"] > 0 and d["limits"]["max_qp_wr"] > 0'
# (the GID: ::ffff: and the address)
json dev 'd["gid"] == "::ffff:" + os.environ["BEX_TEST_ADDR0"]'
run text 0 --local "$BEX_TEST_ADDR0"
grep -q '^transport: *rdma$' "$tmp/text.out" || fail "no 'transport: rdma' line"
listen "$BEX_TEST_ADDR0"
run check 0 --local "$BEX_TEST_ADDR1" --peer "$BEX_TEST_ADDR0:$port" --json --burst-mib 8
json check 'd["transport"] == "rdma" and d["check"]["ok"] and d["check"]["transport"] == "rdma" and d["check"]["round_trips"] == 20 and d["check"]["burst_bytes"] == 8 << 20'
json_verify
echo "test_info: rxe ok"
