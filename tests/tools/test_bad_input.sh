#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Bad input to the programs (issue 27, "Bad input"): a missing or
# unreadable cluster/plan file (a directory: said so), an address without
# a port in it, an environment variable with a bad value, a bad value of
# an option (bex-ps, bex-ranker, bex-trainer). Each is one line on stderr naming
# the input, exit status 2, nothing started (nothing on stdout, no
# listener: the programs stop before their context). No network is used:
# every case fails before a socket is opened.
#   test_bad_input.sh BEX_PS BEX_RANKER BEX_TRAINER BEX_CLUSTER BEX_INFO
set -euo pipefail
ps=$1 ranker=$2 trainer=$3 cluster=$4 info=$5
fail() { echo "test_bad_input: $*" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# a cluster file whose replica has no port
printf '%s\n' '{"services":{"ps":{"shards":[{"replicas":[{"addr":"127.0.0.1","transport":"tcp"}]}]}}}' \
    >"$tmp/noport.json"
# a valid one (the environment cases: the file is not what is wrong)
printf '%s\n' '{"services":{"ps":{"shards":[{"replicas":[{"addr":"127.0.0.1:1","transport":"tcp"}]}]}}}' \
    >"$tmp/ok.json"
mkdir "$tmp/dir.json"
# expect NAMED -- COMMAND...: exit 2, one line on stderr containing NAMED,
# nothing on stdout
expect() {
    local named=$1 rc=0
    shift 2
    timeout 30 "$@" </dev/null >"$tmp/out" 2>"$tmp/err" || rc=$?
    local what="$*"
    [ "$rc" = 2 ] || { cat "$tmp/err" >&2; fail "$what: exit $rc, want 2"; }
    [ "$(wc -l <"$tmp/err")" = 1 ] || { cat "$tmp/err" >&2; fail "$what: not one line on stderr"; }
    grep -qF -- "$named" "$tmp/err" || fail "$what: '$(cat "$tmp/err")' does not name $named"
    [ ! -s "$tmp/out" ] || fail "$what: printed on stdout: $(head -n 2 "$tmp/out")"
    echo "test_bad_input: ok: $what: $(cat "$tmp/err")"
}
for p in "$ps --shard all" "$ranker --duration 1" "$trainer --duration 1"; do
    # shellcheck disable=SC2086
    set -- $p
    expect /nonexistent/c.json -- "$@" --cluster /nonexistent/c.json
    expect "$tmp/dir.json: Is a directory" -- "$@" --cluster "$tmp/dir.json"
    expect "'127.0.0.1'" -- "$@" --cluster "$tmp/noport.json"
    expect "--transport 'ib': not auto, rdma or tcp" -- "$@" --cluster "$tmp/ok.json" --transport ib
    for e in BEX_LOG_LEVEL=loud BEX_TRANSPORT=ib BEX_IO_THREADS=0; do
        expect "${e%%=*}" -- env "$e" "$@" --cluster "$tmp/ok.json"
    done
done
# a bad option value: the option, its value and what it may be
expect "--transport 'ib': not auto, rdma or tcp" -- "$ps" --shard all --cluster "$tmp/ok.json" --transport ib
expect "--io-threads '0': not a whole number from 1 to 64" -- "$ps" --shard all --cluster "$tmp/ok.json" --io-threads 0
expect "--poll 'fast'" -- "$ps" --shard all --cluster "$tmp/ok.json" --poll fast
expect "--table '1:x:sgd'" -- "$ps" --shard all --cluster "$tmp/ok.json" --table 1:x:sgd
for p in "$ranker" "$trainer"; do
    expect "--outstanding '0': not a number from 1 to 4096" -- "$p" --cluster "$tmp/ok.json" --outstanding 0
    expect "--poll 'fast': not spin-sleep, busy or event" -- "$p" --cluster "$tmp/ok.json" --poll fast
done
expect /nonexistent/p.json -- "$cluster" --plan /nonexistent/p.json --out "$tmp/out1"
expect "$tmp/dir.json: Is a directory" -- "$cluster" --plan "$tmp/dir.json" --out "$tmp/out1"
expect phases -- "$cluster" --plan "$tmp/ok.json" --out "$tmp/out1"
expect BEX_IO_THREADS -- env BEX_IO_THREADS=x "$cluster" --out "$tmp/out1"
expect "--time-scale '0': not a number above 0" -- "$cluster" --time-scale 0 --out "$tmp/out1"
expect "--only 'both': not servers or clients" -- "$cluster" --only both --out "$tmp/out1"
[ ! -e "$tmp/out1" ] || fail "bex-cluster made its output directory on bad input"
for e in BEX_TRANSPORT=ib BEX_IO_THREADS=0; do
    expect "${e%%=*}" -- env "$e" "$info" --local 127.0.0.1
done
echo "test_bad_input: ok"
