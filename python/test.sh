#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python tier (docs/testing.md): build the bex package from python/
# against a build dir's libbex and install it there (pip, offline: no build
# isolation, no index), then run its pytest suite natively over TCP against
# bex-ps servers the tests start. A package that does not build fails the
# tier; so does a test that skips.
#
#   python/test.sh [BUILD_DIR]     (default: $BEX_BUILD_DIR, else build)
#
# Environment: BEX_PYTHON (default /usr/bin/python3: Debian's, with
# python3-numpy, python3-pytest and python3-torch from scripts/deps).
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "${1:-${BEX_BUILD_DIR:-$top/build}}" && pwd)
py=${BEX_PYTHON:-/usr/bin/python3}
site=$build/python-site
mkdir -p "$build/test-times"

rm -rf "$site"
BEX_BUILD_DIR=$build "$py" -m pip install --quiet --no-build-isolation --no-index --no-deps \
    --target "$site" "$top/python"
# from the build dir, so that python/bex (the sources) is not what imports
cd "$build"
PYTHONPATH=$site BEX_PS=$build/tools/ps/bex-ps "$py" -m pytest -p no:cacheprovider -q -rs \
    --junitxml "$build/test-times/python.xml" "$top/python/tests" "${@:2}" | tee "$build/python-tests.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || exit "$rc"
if grep -qE '[0-9]+ skipped' "$build/python-tests.log"; then
    echo "python/test.sh: a test was skipped; every test must run" >&2
    exit 1
fi
