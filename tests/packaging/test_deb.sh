#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian packages (cmake/packaging.cmake; issue 27 item 2): CPack's DEB
# generator builds libbex0, libbex-dev and bex-ps from this build; dpkg-deb
# -I and -c show each package's name, version, dependencies and files (the
# library alone in libbex0; headers, libbex.so, libbex.a, bex.pc and the
# CMake package in -dev; bex-ps, bex-info and the systemd unit in bex-ps,
# which depend on libbex0 of the same version); the unit starts
# /usr/bin/bex-ps and stops it with SIGTERM (its drain); the programs
# unpacked with the library run (--version); bex-ps started from the
# unpacked packages by the unit's own ExecStart line answers /healthz and
# /ready and stops with status 0 on the unit's KillSignal.
#   test_deb.sh BUILD_DIR VERSION
set -euo pipefail
build=$1
version=$2
fail() { echo "test_deb: $*" >&2; exit 1; }
# shellcheck source=unit_check.sh
. "$(dirname "$0")/unit_check.sh"
command -v dpkg-deb >/dev/null || fail "dpkg-deb not found (scripts/deps test)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The packages stay in BUILD_DIR/test-deb for test_deb.install (a CTest
# fixture: building them again took it a minute on a loaded host).
rm -rf "$build/test-deb"
(cd "$build" && cpack --config CPackConfig.cmake -G DEB -B "$build/test-deb") >"$tmp/cpack.log" 2>&1 ||
    { cat "$tmp/cpack.log" >&2; fail "cpack failed"; }
ln -s "$build/test-deb" "$tmp/out"
major=${version%%.*}

# deb NAME: the package file of NAME, checked for name and version
deb() {
    local f
    f=$(ls "$tmp/out/$1_${version}_"*.deb 2>/dev/null | head -1)
    [ -n "$f" ] || { ls "$tmp/out" >&2; fail "no package $1 $version"; }
    dpkg-deb -I "$f" >"$tmp/$1.info" || fail "dpkg-deb -I $f"
    dpkg-deb -c "$f" | awk '{print $6}' | sed 's|^\./|/|' >"$tmp/$1.files" || fail "dpkg-deb -c $f"
    [ "$(dpkg-deb -f "$f" Package)" = "$1" ] || fail "$f: Package is not $1"
    [ "$(dpkg-deb -f "$f" Version)" = "$version" ] || fail "$f: Version is not $version"
    echo "$f"
}
has() { grep -qx "$2" "$tmp/$1.files" || { cat "$tmp/$1.files" >&2; fail "$1 lacks $2"; }; }
hasnt() { ! grep -q "$2" "$tmp/$1.files" || fail "$1 has $2"; }
depends() {
    dpkg-deb -f "$1" Depends | grep -q "$2" || fail "$(basename "$1") does not depend on $2"
}

lib=$(deb "libbex$major")
dev=$(deb libbex-dev)
ps=$(deb bex-ps)
has "libbex$major" "/usr/lib/libbex.so.$major"
has "libbex$major" "/usr/lib/libbex.so.$version"
hasnt "libbex$major" "include"
hasnt "libbex$major" "bin/"
depends "$lib" "libibverbs1"
for f in /usr/include/bex/sock.h /usr/include/bex/version.h /usr/lib/libbex.so /usr/lib/libbex.a \
         /usr/lib/pkgconfig/bex.pc /usr/lib/cmake/bex/bexConfig.cmake; do
    has libbex-dev "$f"
done
depends "$dev" "libbex$major (= $version)"
for f in /usr/bin/bex-ps /usr/bin/bex-info /usr/lib/systemd/system/bex-ps.service \
         /usr/share/doc/bex-ps/bex-ps.default; do
    has bex-ps "$f"
done
hasnt bex-ps "libbex.so"
depends "$ps" "libbex$major (= $version)"
depends "$ps" "libmicrohttpd"

root=$tmp/root
dpkg-deb -x "$lib" "$root"
dpkg-deb -x "$ps" "$root"
unit=$root/usr/lib/systemd/system/bex-ps.service
grep -qx 'ExecStart=/usr/bin/bex-ps $BEX_PS_OPTS' "$unit" || fail "the unit does not start bex-ps"
grep -qx 'KillSignal=SIGTERM' "$unit" || fail "the unit does not stop it with SIGTERM"
grep -q '^TimeoutStopSec=' "$unit" || fail "the unit gives the drain no time"
grep -qx 'WantedBy=multi-user.target' "$unit" || fail "the unit has no [Install] target"
unit_verify "$root" "$unit" "$tmp"
for p in bex-ps bex-info; do
    out=$(LD_LIBRARY_PATH=$root/usr/lib "$root/usr/bin/$p" --version) || fail "$p --version failed"
    [ "$out" = "$p $version" ] || fail "$p --version printed '$out'"
done

# bex-ps from the unpacked packages, as the unit starts and stops it
unit_run "$root" "$unit" "$tmp"
echo "test_deb: ok ($(cat "$tmp"/*.files | wc -l) paths in 3 packages; bex-ps from the unit's ExecStart served /healthz and stopped on SIG$unit_sig)"
