#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/echo.c, natively over TCP on loopback: the server on a port it
# picks (port 0, read from its output), a client's message comes back, a
# client of a closed port fails with a message and status 1, a bad
# argument with its usage and status 2 (tests/examples/CMakeLists.txt).
#   run_echo.sh ECHO
. "$(dirname "$0")/lib.sh"
echo_bin=$1

start server "$echo_bin" server 127.0.0.1:0
line=$(wait_line server '^listening on 127\.0\.0\.1:[0-9]+$') || exit 1
port=${line##*:}
[ "$port" -gt 0 ] || fail "server printed port $port"

run client 0 "$echo_bin" client "127.0.0.1:$port" "hello bex"
expect_out client "echo: hello bex"
# a second client on the same server, the local address given
run client2 0 "$echo_bin" client "127.0.0.1:$port" "again" 127.0.0.1
expect_out client2 "echo: again"

# the server gone: refused, said so, status 1
kill "${pids[0]}" && wait "${pids[0]}" 2>/dev/null
run closed 1 "$echo_bin" client "127.0.0.1:$port" "anyone?"
expect_err closed "echo: 127.0.0.1:$port: "
[ ! -s "$out/closed.out" ] || fail "closed: printed an answer"

run usage 2 "$echo_bin" client "127.0.0.1" "no port"
expect_err usage "usage: echo"
echo "ok: echo on port $port"
