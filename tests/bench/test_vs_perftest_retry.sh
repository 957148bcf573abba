#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/vs-perftest retries a run only as docs/benchmarks.md says: a run
# that succeeded but printed no figure, 0 or inf is tried once more; a run
# that failed (crash, error exit) is never retried. Runs vs-perftest's own
# positive() and twice() against stand-in runs that count their attempts.
#
# Usage: test_vs_perftest_retry.sh [path/to/vs-perftest]
set -uo pipefail
script=${1:-$(dirname "$0")/../../bench/vs-perftest}
defs=$(sed -n '/^positive() /p; /^twice() {/,/^}/p' "$script")
grep -q '^twice() {' <<<"$defs" && grep -q '^positive() ' <<<"$defs" || {
    echo "FAIL: positive()/twice() not found in $script" >&2
    exit 1
}
eval "$defs"

work=$(mktemp -d "${TMPDIR:-/tmp}/retry-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
failed=0
# run OUTPUTS...: attempt i prints OUTPUTS[i] ("CRASH": dies of SIGSEGV,
# "ERR": exits 3 after printing 5.0)
run() {
    local n
    n=$(($(cat "$work/n") + 1))
    echo $n >"$work/n"
    local o=${!n}
    case "$o" in
    CRASH) kill -SEGV $BASHPID ;;
    ERR) echo 5.0; return 3 ;;
    *) echo "$o" ;;
    esac
}
# expect WANT_RC WANT_ATTEMPTS WANT_OUT OUTPUTS...
expect() {
    local want_rc=$1 want_n=$2 want_out=$3
    shift 3
    echo 0 >"$work/n"
    local out rc=0
    out=$(twice run "$@" 2>/dev/null) || rc=$?
    local n
    n=$(cat "$work/n")
    [ "$rc" -ne 0 ] && rc=1
    if [ "$rc" != "$want_rc" ] || [ "$n" != "$want_n" ] || [ "$out" != "$want_out" ]; then
        echo "FAIL: runs [$*]: status $rc after $n attempt(s), output '$out';" \
            "expected $want_rc after $want_n, '$want_out'" >&2
        failed=1
    fi
}
expect 0 1 "12.5 3 4" "12.5 3 4"  # a figure: no retry
expect 0 2 "7.25" "0.00" "7.25"   # zero, then a figure
expect 0 2 "7.25" "inf" "7.25"    # inf, then a figure
expect 0 2 "7.25" "" "7.25"       # missing, then a figure
expect 1 2 "" "0.00" "0.00"       # retried once only
expect 1 1 "" CRASH "7.25"        # a crash is a failure: never retried
expect 1 1 "" ERR "7.25"          # so is an error exit, even with a figure
expect 1 2 "" "" ERR              # a failure on the retry is final too
[ $failed = 0 ] && echo "PASS: vs-perftest retries only a missing, zero or inf figure"
exit $failed
