#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# examples/rpc_server.c and rpc_client.c, natively over TCP on loopback:
# the server on a port it picks (port 0, read from its output), the
# client's call answered in capitals, an unreachable server and a bad
# argument fail with a message and status 1 (a bad argument: 2), and the server stops on
# SIGTERM with status 0 (tests/examples/CMakeLists.txt).
#   run_rpc.sh RPC_SERVER RPC_CLIENT
. "$(dirname "$0")/lib.sh"
server_bin=$1 client_bin=$2

start server "$server_bin" 127.0.0.1:0
line=$(wait_line server '^listening on 127\.0\.0\.1:[0-9]+$') || exit 1
port=${line##*:}

run client 0 "$client_bin" "127.0.0.1:$port" "hello bex"
expect_out client "HELLO BEX"
run client2 0 "$client_bin" "127.0.0.1:$port" "Mixed 123 case" 127.0.0.1
expect_out client2 "MIXED 123 CASE"

# SIGTERM: the server stops cleanly, status 0
kill -TERM "${pids[0]}"
wait "${pids[0]}"
rc=$?
[ "$rc" = 0 ] || fail "server: exit status $rc after SIGTERM, expected 0"

run closed 1 "$client_bin" "127.0.0.1:$port" "anyone?"
expect_err closed "rpc_client: 127.0.0.1:$port: "
[ ! -s "$out/closed.out" ] || fail "closed: printed an answer"

run usage 2 "$client_bin" "127.0.0.1:0" "x"
expect_err usage "usage: rpc_client"
echo "ok: rpc on port $port"
