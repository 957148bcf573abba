#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install bex into a temporary prefix, then build an outside program
# against it with pkg-config and with CMake's find_package(bex), run both;
# then move the installed tree elsewhere and build with pkg-config again
# (bex.pc is relocatable). Nothing installs the demo's programs.
#   test_install.sh BUILD_DIR SOURCE_DIR VERSION [CFLAGS]
# CFLAGS: a sanitizer build's flags, which the outside program needs too.
set -euo pipefail
build=$1 src=$(cd "$2" && pwd) version=$3 cflags=${4:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "test_install: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log"
for p in bex-cluster bex-ranker bex-trainer; do
    [ ! -e "$tmp/prefix/bin/$p" ] || fail "the demo program $p was installed"
done

build_pc() { # prefix out
    local pc
    pc=$(dirname "$(find "$1" -name bex.pc | head -1)")
    [ -n "$pc" ] || fail "no bex.pc under $1"
    PKG_CONFIG_PATH=$pc pkg-config --exact-version="$version" bex ||
        fail "pkg-config: bex $version not found under $1"
    # shellcheck disable=SC2046,SC2086
    cc $cflags -o "$2" "$src/tests/install/hello.c" $(PKG_CONFIG_PATH=$pc pkg-config --cflags --libs bex)
    LD_LIBRARY_PATH=$(PKG_CONFIG_PATH=$pc pkg-config --variable=libdir bex) "$2"
}
out=$(build_pc "$tmp/prefix" "$tmp/hello-pc")
[ "$out" = "bex $version" ] || fail "pkg-config build printed '$out'"

mkdir -p "$tmp/cm"
cat >"$tmp/cm/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.25)
project(outside C)
find_package(bex $version REQUIRED)
add_executable(hello $src/tests/install/hello.c)
target_link_libraries(hello PRIVATE bex::bex)
CM
cmake -S "$tmp/cm" -B "$tmp/cm/b" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_C_FLAGS="$cflags" \
    >"$tmp/cm.log" 2>&1 ||
    { cat "$tmp/cm.log" >&2; fail "find_package(bex) failed"; }
cmake --build "$tmp/cm/b" >>"$tmp/cm.log" 2>&1 || { cat "$tmp/cm.log" >&2; fail "CMake build failed"; }
out=$("$tmp/cm/b/hello")
[ "$out" = "bex $version" ] || fail "CMake build printed '$out'"

# an incompatible version is refused (0.x: same major.minor only)
cat >"$tmp/cm/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.25)
project(outside C)
find_package(bex 99.0 REQUIRED)
CM
if cmake -S "$tmp/cm" -B "$tmp/cm/b2" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null 2>&1; then
    fail "find_package(bex 99.0) succeeded"
fi

mv "$tmp/prefix" "$tmp/moved"
out=$(build_pc "$tmp/moved" "$tmp/hello-moved")
[ "$out" = "bex $version" ] || fail "build from the moved tree printed '$out'"
echo "test_install: pkg-config, find_package and a moved prefix all give bex $version"
