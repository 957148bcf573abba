# SPDX-License-Identifier: Apache-2.0
# Shared by tests/examples/run_*.sh (sourced): a temporary directory, the
# servers started killed on exit, and checks that say what they expected.
set -u
scale=${BEX_TEST_TIME_SCALE:-1}
out=$(mktemp -d "${TMPDIR:-/tmp}/bex-examples.XXXXXX")
pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do
        kill "$p" 2>/dev/null && wait "$p" 2>/dev/null
    done
    rm -rf "$out"
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*" >&2
    local f
    for f in "$out"/*.out "$out"/*.err; do
        [ -s "$f" ] && { echo "--- ${f##*/}" >&2; tail -20 "$f" >&2; }
    done
    exit 1
}

# start NAME CMD...: CMD in the background, stdout in $out/NAME.out, stderr
# in $out/NAME.err; its pid is killed on exit.
start() {
    local name=$1
    shift
    "$@" >"$out/$name.out" 2>"$out/$name.err" &
    pids+=($!)
}

# wait_line NAME REGEX: wait (20 s, scaled) for a line of $out/NAME.out
# matching REGEX and print it; fail when the process died first.
wait_line() {
    local i pid=${pids[-1]}
    for ((i = 0; i < 200 * scale; i++)); do
        if grep -m1 -E "$2" "$out/$1.out" 2>/dev/null; then
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || fail "$1 exited before printing /$2/"
        sleep 0.1
    done
    fail "$1 did not print /$2/ within $((20 * scale)) s"
}

# run NAME WANT_STATUS CMD...: run CMD (60 s, scaled), stdout/stderr into
# $out/NAME.out/.err, and check its exit status.
run() {
    local name=$1 want=$2 rc
    shift 2
    timeout $((60 * scale)) "$@" >"$out/$name.out" 2>"$out/$name.err"
    rc=$?
    [ "$rc" = "$want" ] || fail "$name: exit status $rc, expected $want"
}

# expect_out NAME TEXT / expect_err NAME TEXT: the exact line TEXT in
# $out/NAME.out, or TEXT somewhere in $out/NAME.err.
expect_out() {
    grep -qxF -- "$2" "$out/$1.out" || fail "$1: no line \"$2\" in its output"
}
expect_err() {
    grep -qF -- "$2" "$out/$1.err" || fail "$1: no \"$2\" in its error output"
}
