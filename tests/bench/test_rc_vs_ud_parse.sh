#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/rc-vs-ud reads the right figure out of perftest's result lines
# (ib_send_bw's BW average, ib_send_lat's t_typical), takes none from a run
# that printed 0.00 or no result line, and rotates its tests from round to
# round. Runs the script's own functions on lines in perftest's format.
#
# Usage: test_rc_vs_ud_parse.sh [path/to/rc-vs-ud]
set -uo pipefail
script=${1:-$(dirname "$0")/../../bench/rc-vs-ud}
defs=$(sed -n '/^bw_of() /p; /^lat_of() /p; /^order() {/,/^}/p' "$script")
for fn in bw_of lat_of order; do
    grep -q "^$fn() " <<<"$defs" || { echo "FAIL: $fn() not found in $script" >&2; exit 1; }
done
eval "$defs"

failed=0
check() { # WHAT GOT WANT
    if [ "$2" != "$3" ]; then
        echo "FAIL: $1: got '$2', expected '$3'" >&2
        failed=1
    fi
}

bw=' #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 4096       1000             17.02              16.83                0.004309
---------------------------------------------------------------------------------------'
check "send_bw" "$(bw_of 4096 <<<"$bw")" "16.83"
check "send_bw, other size" "$(bw_of 1024 <<<"$bw")" ""
bw0=' 1024       1000             0.00               0.00                 0.000000'
check "send_bw 0.00" "$(bw_of 1024 <<<"$bw0")" ""
lat=' #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]
 1024       1000          60.12          1210.55      75.21              80.04          20.11           300.02                 900.13'
check "send_lat" "$(lat_of 1024 <<<"$lat")" "75.21"
check "send_lat error" "$(lat_of 1024 <<<" Couldn't connect to 10.99.0.1:18515")" ""
tests="rc-bw-big rc-bw ud-bw rc-lat ud-lat"
check "order 1" "$(order 1 | tr '\n' ' ')" "rc-bw-big rc-bw ud-bw rc-lat ud-lat "
check "order 3" "$(order 3 | tr '\n' ' ')" "ud-bw rc-lat ud-lat rc-bw-big rc-bw "
[ $failed = 0 ] && echo "rc-vs-ud parse: ok"
exit $failed
