#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/deps's sets (issue 27 item 2): build is a strict subset of test
# and of bench, every set is in all, no set means all (CI's list), the
# build set has no benchmark or VM package, an unknown set exits 2.
#   test_deps.sh DEPS
set -euo pipefail
deps=$1
fail() { echo "test_deps: $*" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for s in build test vm bench dev all; do
    "$deps" --list "$s" | sort >"$tmp/$s"
    [ -s "$tmp/$s" ] || fail "set $s is empty"
done
"$deps" --list | sort >"$tmp/default"
cmp -s "$tmp/default" "$tmp/all" || fail "no set is not all"
subset() { [ -z "$(comm -23 "$tmp/$1" "$tmp/$2")" ] || fail "$1 is not within $2"; }
for s in build test vm bench dev; do subset "$s" all; done
subset build test
subset build bench
[ "$(wc -l <"$tmp/build")" -lt "$(wc -l <"$tmp/all")" ] || fail "build is everything"
for p in qemu-system-x86 ucx-utils libgrpc++-dev clang etcd-server; do
    ! grep -qx "$p" "$tmp/build" || fail "build installs $p"
done
for p in cmake libibverbs-dev libsodium-dev libmicrohttpd-dev; do
    grep -qx "$p" "$tmp/build" || fail "build lacks $p"
done
rc=0
"$deps" --list nosuchset >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "an unknown set exited $rc, want 2"
echo "test_deps: ok ($(wc -l <"$tmp/build") of $(wc -l <"$tmp/all") packages to build)"
