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
#     an MTU, landing, limits; the check from BEX_TEST_ADDR1 over RDMA. The
#     GID index printed (--json and text, on both sides) is the kernel's
#     one (sysfs) that holds ::ffff:ADDR with the type RoCE v2 on the
#     device and port printed: the GID bex's context uses is that one.
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
    # made here, not by the background job's redirection: the first sed
    # below may run before that job has opened it (a loaded host's native
    # tier failed so: "sed: can't read .../listen.out")
    : >"$tmp/listen.out"
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

# jfield NAME KEY: a number or string field of run NAME's --json (flat
# keys only: device, port, gid_index)
jfield() {
    sed -n "s/.*\"$2\":\"\{0,1\}\([^\",}]*\).*/\1/p" "$tmp/$1.out" | head -n 1
}

# sysfs_gid ADDR DEV PORT: the index of DEV's PORT whose GID is ::ffff:ADDR
# and whose type is RoCE v2, from the kernel's table; fails unless exactly
# one entry is
sysfs_gid() {
    local o1 o2 o3 o4 want dir f i found=
    IFS=. read -r o1 o2 o3 o4 <<<"$1"
    want=$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' "$o1" "$o2" "$o3" "$o4")
    dir=/sys/class/infiniband/$2/ports/$3
    [ -d "$dir/gids" ] || fail "no $dir/gids"
    # (read, not cat: rxe's table has 1024 entries, and a process start
    # costs a fraction of a second in the VM)
    local g t
    for f in "$dir"/gids/*; do
        i=${f##*/}
        read -r g <"$f" && [ "$g" = "$want" ] || continue
        { read -r t <"$dir/gid_attrs/types/$i"; } 2>/dev/null && [ "$t" = "RoCE v2" ] || continue
        [ -z "$found" ] || fail "$2 port $3: GIDs $found and $i both hold $want (RoCE v2)"
        found=$i
    done
    [ -n "$found" ] || fail "$2 port $3: no RoCE v2 GID $want in $dir/gids"
    echo "$found"
}

# gid_is_kernels NAME ADDR: run NAME's --json GID index is the kernel's
gid_is_kernels() {
    local dev port idx want
    dev=$(jfield "$1" device)
    port=$(jfield "$1" port)
    idx=$(jfield "$1" gid_index)
    want=$(sysfs_gid "$2" "$dev" "$port")
    echo "test_info: $1: $dev port $port GID index $idx, the kernel's for $2: $want" >&2
    [ "$idx" = "$want" ] || fail "$1: GID index $idx printed, $dev port $port holds $2 (RoCE v2) at $want"
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
gid_is_kernels dev "$BEX_TEST_ADDR0"
gidx=$(jfield dev gid_index)
run text 0 --local "$BEX_TEST_ADDR0"
grep -q '^transport: *rdma$' "$tmp/text.out" || fail "no 'transport: rdma' line"
grep -q "^GID: *index $gidx, ::ffff:$BEX_TEST_ADDR0, RoCE v2\$" "$tmp/text.out" ||
    fail "no 'GID: index $gidx, ::ffff:$BEX_TEST_ADDR0, RoCE v2' line"
listen "$BEX_TEST_ADDR0"
run check 0 --local "$BEX_TEST_ADDR1" --peer "$BEX_TEST_ADDR0:$port" --json --burst-mib 8
gid_is_kernels check "$BEX_TEST_ADDR1"
json check 'd["transport"] == "rdma" and d["check"]["ok"] and d["check"]["transport"] == "rdma" and d["check"]["round_trips"] == 20 and d["check"]["burst_bytes"] == 8 << 20'
json_verify
echo "test_info: rxe ok"
