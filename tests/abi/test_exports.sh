#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# libbex.so exports exactly what include/bex/ declares, each symbol with the
# version node of src/libbex.map, and its SONAME is libbex.so.MAJOR.
#   test_exports.sh LIBBEX_SO INCLUDE_DIR MAJOR
set -euo pipefail
so=$1 inc=$2 major=$3
fail() { echo "test_exports: $*" >&2; exit 1; }

soname=$(objdump -p "$so" | awk '$1 == "SONAME" {print $2}')
[ "$soname" = "libbex.so.$major" ] || fail "SONAME is '$soname', want libbex.so.$major"

# defined dynamic symbols: name and version node
exports=$(objdump -T "$so" | awk '$2 ~ /g/ && $4 != "*UND*" {print $(NF-1), $NF}')
[ -n "$exports" ] || fail "no exported symbols"
bad=$(echo "$exports" | awk '$1 != "BEX_0.1" && $1 != "(BEX_0.1)" {print}')
[ -z "$bad" ] || fail "symbols without the BEX_0.1 node: $bad"
names=$(echo "$exports" | awk '{print $2}' | grep -v '^BEX_0' | sort -u)

# every export is declared in a public header, and every function a public
# header declares is exported
for n in $names; do
    grep -rqw -- "$n" "$inc" || fail "$n is exported but no header in $inc declares it"
done
declared=$(grep -rhoE '\bbex_[a-z0-9_]+\(' "$inc" | tr -d '(' | sort -u)
for n in $declared; do
    # a function-like name in a comment or a callback field is not a function
    grep -rqE "^[a-z].*[ *]$n\(" "$inc" || continue
    grep -qx -- "$n" <<<"$names" || fail "$n is declared in $inc but not exported"
done
echo "test_exports: $(echo "$names" | wc -l) symbols, all BEX_0.1, SONAME $soname"
