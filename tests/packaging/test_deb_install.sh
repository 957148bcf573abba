#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian packages installed for real (issue 27 item 2): `dpkg --root`
# installs libbex0 and bex-ps into a throwaway root (its own dpkg database;
# the host's is never touched) holding just what the maintainer scripts
# need (sh, ldconfig, libc: dpkg chroots into it to run them). Checked:
#  - dpkg records both packages installed ("ii") and lists their files;
#  - libbex0's postinst ran: the root's ld.so cache has libbex.so.0;
#  - the packages' dependencies other than libbex0 are installed on this
#    host at the versions asked (dpkg cannot see them in the empty root:
#    --force-depends, checked here instead);
#  - the installed unit passes systemd-analyze verify (ExecStart pointed
#    into the root), and bex-ps started by its ExecStart line from the
#    installed tree answers /healthz and /ready and exits 0 on KillSignal;
#  - dpkg --purge removes both: no file of theirs left, the cache without
#    libbex (the postrm ran), the database without them.
# What it cannot show: systemd as PID 1 starting the unit (DynamicUser,
# StateDirectory, LimitMEMLOCK: test_deb.systemd shows it, in a VM), and an install resolving dependencies
# with apt. Needs root (chroot) and dpkg: exit 77 (skip) without them.
# The packages are the ones test_deb.packages left in BUILD_DIR/test-deb.
#   test_deb_install.sh BUILD_DIR VERSION
set -euo pipefail
build=$1
version=$2
major=${version%%.*}
fail() { echo "test_deb_install: $*" >&2; exit 1; }
# shellcheck source=unit_check.sh
. "$(dirname "$0")/unit_check.sh"
[ "$(id -u)" = 0 ] || { echo "SKIP: not root (dpkg --root chroots)" >&2; exit 77; }
command -v dpkg >/dev/null || { echo "SKIP: no dpkg" >&2; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the packages test_deb.packages built (its fixture) and checked
debs=$build/test-deb
lib=$(ls "$debs/libbex${major}_${version}_"*.deb) || fail "no libbex$major in $debs (test_deb.packages)"
ps=$(ls "$debs/bex-ps_${version}_"*.deb) || fail "no bex-ps in $debs (test_deb.packages)"

# The root: a dpkg database and what the maintainer scripts run.
root=$tmp/root
mkdir -p "$root"/var/lib/dpkg/{info,updates,triggers} "$root"/{bin,sbin,etc,lib64,tmp} \
    "$root/lib/x86_64-linux-gnu"
touch "$root/var/lib/dpkg/status" "$root/var/lib/dpkg/available"
cp "$(readlink -f /bin/sh)" "$root/bin/sh"
cp /sbin/ldconfig "$root/sbin/"
for l in $(ldd "$(readlink -f /bin/sh)" | grep -o '/[^ ]*'); do
    mkdir -p "$root$(dirname "$l")" && cp "$l" "$root$l"
done
pre=$(find "$root" -type f | sort)

# Dependencies, checked against the host: "name (op version)" each.
deps_on_host() {
    dpkg-deb -f "$1" Depends | tr ',' '\n' | sed 's/^ *//' | while read -r name op ver; do
        [ "$name" = "libbex$major" ] && continue
        have=$(dpkg-query -W -f='${Version}' "$name" 2>/dev/null) ||
            fail "$(basename "$1") needs $name: not installed on this host"
        [ -z "$op" ] && continue
        op=${op#(} ver=${ver%)}
        case $op in '>=') op=ge ;; '=') op=eq ;; '<=') op=le ;; '>>') op=gt ;; '<<') op=lt ;; esac
        dpkg --compare-versions "$have" "$op" "$ver" ||
            fail "$(basename "$1") needs $name $op $ver, the host has $have"
    done
}
deps_on_host "$lib"
deps_on_host "$ps"

dpkg --root="$root" --force-depends -i "$lib" "$ps" >"$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log" >&2; fail "dpkg -i failed"; }
for p in "libbex$major" bex-ps; do
    [ "$(dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${db:Status-Abbrev}' "$p")" = "ii " ] ||
        fail "$p is not installed (ii)"
done
for f in /usr/lib/libbex.so.$major /usr/bin/bex-ps /usr/lib/systemd/system/bex-ps.service; do
    dpkg --root="$root" -L "$(case $f in */libbex*) echo "libbex$major" ;; *) echo bex-ps ;; esac)" |
        grep -qx "$f" || fail "dpkg does not list $f"
    [ -e "$root$f" ] || fail "$f not installed"
done
chroot "$root" /sbin/ldconfig -p | grep -q "libbex.so.$major " || fail "postinst: no libbex in ld.so.cache"

unit=$root/usr/lib/systemd/system/bex-ps.service
unit_verify "$root" "$unit" "$tmp"
# bex-ps by the unit's ExecStart, from the installed tree
unit_run "$root" "$unit" "$tmp"

dpkg --root="$root" --purge bex-ps "libbex$major" >"$tmp/purge.log" 2>&1 ||
    { cat "$tmp/purge.log" >&2; fail "dpkg --purge failed"; }
for p in "libbex$major" bex-ps; do
    st=$(dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    [ -z "$st" ] || [ "$st" = "pn " ] || fail "$p still in the database ($st)"
done
chroot "$root" /sbin/ldconfig -p | grep -q libbex && fail "postrm: libbex still in ld.so.cache"
left=$(find "$root" -type f ! -path "$root/var/lib/dpkg/*" ! -path "$root/etc/ld.so.cache" |
    sort | comm -13 <(echo "$pre") -)
[ -z "$left" ] || fail "left after purge: $left"
echo "test_deb_install: ok (installed with dpkg --root, bex-ps served /healthz and /ready and stopped on SIG$unit_sig, purged clean)"
