#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/vs-perftest reads the right figure out of each other stack's output
# (ucx_perftest's "Final:" line, rstream's result line) and rotates the
# stacks from round to round. Runs the script's own functions on outputs in
# the tools' formats (lines as ucx_perftest 1.13 and rstream of rdma-core 44
# print them).
#
# Usage: test_vs_perftest_parse.sh [path/to/vs-perftest]
set -uo pipefail
script=${1:-$(dirname "$0")/../../bench/vs-perftest}
defs=$(sed -n '/^ucx_lat_of() /p; /^ucx_bw_of() /p; /^rstream_lat_of() /p;
               /^rstream_bw_of() {/,/^}/p; /^round_order() {/,/^}/p' "$script")
for fn in ucx_lat_of ucx_bw_of rstream_lat_of rstream_bw_of round_order; do
    grep -q "^$fn() " <<<"$defs" || { echo "FAIL: $fn() not found in $script" >&2; exit 1; }
done
eval "$defs"

failed=0
# check WHAT GOT WANT
check() {
    if [ "$2" != "$3" ]; then
        echo "FAIL: $1: got '$2', expected '$3'" >&2
        failed=1
    fi
}

ucx_lat='+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|              |              |       latency (usec)         |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
[thread 0]               477     68.500  1454.943  3233.512        0.02       0.01         687         309
Final:                  2048     24.512    25.101    25.730        1.22       1.19       39840       38862'
check "ucx lat" "$(ucx_lat_of <<<"$ucx_lat")" "24.512"
ucx_bw='[thread 0]                40     37.000 30000.000 30000.000       33.33      33.33          33          33
Final:                   100  29987.000 30011.120 30102.400       33.32      33.22          33          33'
check "ucx bw" "$(ucx_bw_of <<<"$ucx_bw")" "33.22"
ucx_fail='[1796042148.503616] [bex-vm:162  :0]        perftest.c:405  UCX  ERROR client failed. connect() failed: Connection refused'
check "ucx without a Final line" "$(ucx_lat_of <<<"$ucx_fail")" ""

rs_head='name      bytes   xfers   iters   total       time     Gb/sec    usec/xfer'
check "rstream lat" "$(rstream_lat_of <<<"$rs_head
custom    32      1       1k      62k         0.05s      0.01      25.50")" "25.50"
# 100 messages of 1 MiB each way, 33550 us per message: 1 MiB / 33.55 ms
check "rstream bw" "$(rstream_bw_of 1048576 <<<"$rs_head
custom    1m      100     1       200m        6.71s      0.25   33550.00")" "29.81"
check "rstream without a result line" "$(rstream_lat_of <<<"$rs_head")" ""
check "rstream bw without a result line" "$(rstream_bw_of 1048576 <<<"rconnect: Connection refused")" ""

STACKS="bex perftest ucx rsockets"
check "round 1" "$(round_order 1 | tr '\n' ' ')" "bex perftest ucx rsockets "
check "round 2" "$(round_order 2 | tr '\n' ' ')" "perftest ucx rsockets bex "
check "round 5" "$(round_order 5 | tr '\n' ' ')" "bex perftest ucx rsockets "
STACKS="bex perftest"
check "two stacks, round 2" "$(round_order 2 | tr '\n' ' ')" "perftest bex "

[ $failed = 0 ] && echo "PASS: vs-perftest reads UCX's and rstream's figures and rotates the stacks"
exit $failed
