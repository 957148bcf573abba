#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python tier (docs/testing.md): build the bex package from python/
# against a build dir's libbex and install it there (pip, offline: no build
# isolation, no index), then run its pytest suite natively over TCP against
# bex-ps servers the tests start. A package that does not build fails the
# tier; so does a test that skips.
#
#   python/test.sh [BUILD_DIR]     (default: $BEX_BUILD_DIR, else build)
#   python/test.sh --rxe [BUILD_DIR]
#       inside the Soft-RoCE VM (scripts/rxe-vm): the package installed by a
#       run of the first form, the tests over RDMA (servers on rxe1's
#       address, clients on rxe0's), less those that import torch (slow in
#       the emulated VM), those that run the examples (TCP on loopback) and
#       those marked native_only (the same on either transport)
#
# Environment: BEX_PYTHON (default /usr/bin/python3: Debian's, with
# python3-numpy, python3-pytest and python3-torch from scripts/deps).
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rxe=0
if [ "${1:-}" = --rxe ]; then
    rxe=1
    shift
fi
build=$(cd "${1:-${BEX_BUILD_DIR:-$top/build}}" && pwd)
py=${BEX_PYTHON:-/usr/bin/python3}
site=$build/python-site
mkdir -p "$build/test-times"

tier=python select=()
if [ "$rxe" = 1 ]; then
    [ -f "$site/bex/__init__.py" ] || {
        echo "python/test.sh --rxe: no package in $site (run python/test.sh first)" >&2
        exit 1
    }
    tier=python-rxe select=(-m "not torch and not tcp_only and not native_only")
    export BEX_PY_TRANSPORT=rdma
else
    rm -rf "$site"
    BEX_BUILD_DIR=$build "$py" -m pip install --quiet --no-build-isolation --no-index --no-deps \
        --target "$site" "$top/python"
fi
# from the build dir, so that python/bex (the sources) is not what imports
cd "$build"
PYTHONPATH=$site BEX_PS=$build/tools/ps/bex-ps "$py" -m pytest -p no:cacheprovider -q -rs \
    --junitxml "$build/test-times/$tier.xml" "${select[@]}" "$top/python/tests" "${@:2}" |
    tee "$build/$tier-tests.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || exit "$rc"
if grep -qE '[0-9]+ skipped' "$build/$tier-tests.log"; then
    echo "python/test.sh: a test was skipped; every test must run" >&2
    exit 1
fi
