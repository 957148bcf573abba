#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A program's --help has a line of its own for every long option the
# program takes: each {"name", ..._argument, ...} of its getopt_long tables
# in its SOURCE files starts a line of the help ("  --name"). The help is checked
# against the code, so an option added without its line fails.
#   test_help_lines.sh PROGRAM SOURCE...
set -euo pipefail
prog=$1
shift
fail() { echo "test_help_lines: $*" >&2; exit 1; }
help=$("$prog" --help) || fail "$prog --help failed"
names=$(grep -ohE '\{"[a-z0-9-]+", (required|no|optional)_argument' "$@" | cut -d'"' -f2 | sort -u)
[ -n "$names" ] || fail "no options found in $*"
n=0
for o in $names; do
    grep -qE -- "^ +--$o( |$)" <<<"$help" || fail "$(basename "$prog") --help has no line for --$o"
    n=$((n + 1))
done
echo "test_help_lines: $(basename "$prog"): $n options, a line each"
