#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every program's command line: --help prints its usage to stdout and exits
# 0, --version prints "NAME VERSION" and exits 0, an unknown option is an
# error on stderr with exit status 2 (issue 27 items 1 and 8).
#   test_cli.sh VERSION PROGRAM...
set -euo pipefail
version=$1
shift
fail() { echo "test_cli: $*" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for p in "$@"; do
    name=$(basename "$p")
    rc=0
    "$p" --help >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" = 0 ] || fail "$name --help exited $rc"
    grep -qi usage "$tmp/out" || fail "$name --help printed no usage on stdout"
    out=$("$p" --version) || fail "$name --version failed"
    [ "$out" = "$name $version" ] || fail "$name --version printed '$out', want '$name $version'"
    rc=0
    "$p" --no-such-option >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" = 2 ] || fail "$name --no-such-option exited $rc, want 2"
    [ -s "$tmp/err" ] || fail "$name --no-such-option said nothing on stderr"
    echo "test_cli: $name ok"
done
