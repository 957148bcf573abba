#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bex-perf's options for the issue 8 benchmarks, natively over the TCP
# transport on loopback (no timing is asserted, only that each mode runs and
# counts what it says):
#   conns    --conns 6 over --ports 3 (two client contexts), 2 I/O threads:
#            6 engines, all TCP, every measured message answered, a rate > 0;
#            the server saw 6 sessions
#   streams  --test lat --streams 2 --frag 4096: the round trips measured,
#            a median > 0, the streams moved data (stream_mib_s > 0)
#            (--connect-timeout 60000, which the JSON reports)
#   steady   --conns 4 --steady, 400 in flight, 1000 measured: the 400
#            after the window were sent and answered too (the server saw
#            1800 messages; 1400 without --steady), and the window's SENDs
#            are 1000 within the load in flight (the counters are read in
#            a callback, while the requests of the answers its turn took
#            are posted at the turn's end, so each edge of the window moves
#            by up to a turn's answers: 1000-1184 seen; without --steady
#            its last 400 answers have no request: 722 seen)
#   idle     --test lat --idle-ms 300, busy polling: the run's empty loop
#            turns (printed at exit, the whole run) exceed the measured
#            window's (the JSON's empty_turns) by the idle time's, and
#            loop_waits is reported
#   mute     a server that accepts the connection and never answers (a
#            listening socket nobody reads): with --connect-timeout 300 the
#            client fails within seconds and says the connect timed out,
#            not that the run had no result within --timeout (both were
#            -ETIMEDOUT, and a connect's timeout read as the run's: the
#            fourteenth session's "no result within 300 s" after 7 s)
#   bad      --conns with --test lat, --streams with --test bw,
#            --steady without --conns, --connect-timeout 0 and --idle-ms
#            with --test bw are refused
#
# Usage: test_perf_options.sh path/to/bex-perf [case]
set -uo pipefail
perf=$1
want=${2:-all}
work=$(mktemp -d "${TMPDIR:-/tmp}/perf-options.XXXXXX")
spid=
trap '[ -z "$spid" ] || kill $spid 2>/dev/null; rm -rf "$work"' EXIT
failed=0
fail() { echo "FAIL: $*" >&2; failed=1; }
# a port range of our own (16 from $port; several ctest runs and parallel
# tests share the machine): below the kernel's ephemeral range, so the
# kernel gives none of them to another socket; another run of this script
# that drew the same range makes our server fail to bind, and server()
# then draws again
lo=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
[ "$lo" -gt 12000 ] 2>/dev/null || lo=32768
pick_port() { port=$((10000 + (SRANDOM % ((lo - 10016) / 16)) * 16)); }
pick_port

# jget LINE KEY: a number or string field of a flat JSON line
jget() { sed -n "s/.*\"$2\":\"\{0,1\}\([-0-9.a-z]*\)\"\{0,1\}[,}].*/\1/p" <<<"$1"; }

server() { # RUNS OPTS...
    local runs=$1 attempt
    shift
    for attempt in 1 2 3 4 5; do
        "$perf" -s --local 127.0.0.1 -p $port --transport tcp --runs "$runs" "$@" \
            >"$work/srv.out" 2>&1 &
        spid=$!
        for _ in $(seq 100); do
            grep -q listening "$work/srv.out" && return 0
            kill -0 $spid 2>/dev/null || break
            sleep 0.1
        done
        kill -0 $spid 2>/dev/null && break # alive, not listening: a real failure
        wait $spid
        spid=
        grep -qi "in use" "$work/srv.out" || break
        pick_port # the range was taken: draw another
    done
    fail "server did not listen: $(cat "$work/srv.out")"
    return 1
}
server_end() { # SESSIONS: the server exits 0 once that many sockets closed
    local rc=0
    for _ in $(seq 100); do kill -0 $spid 2>/dev/null || break; sleep 0.1; done
    kill $spid 2>/dev/null && fail "server still running after its --runs"
    wait $spid || rc=$?
    spid=
    [ $rc = 0 ] || fail "server exited with $rc: $(cat "$work/srv.out")"
    local n
    n=$(grep -c "session done" "$work/srv.out")
    [ "$n" = "$1" ] || fail "server reported $n sessions, expected $1"
}

case_conns() {
    server 6 --ports 3 --io-threads 2 || return
    local out rc=0
    out=$(timeout 60 "$perf" -c 127.0.0.1 --local 127.0.0.1 -p $port --transport tcp --test bw \
        --size 512 --conns 6 --ports 3 --io-threads 2 --outstanding 20 --iters 3000 \
        --connect-timeout 60000 --json) ||
        rc=$?
    [ $rc = 0 ] || fail "conns: client exited with $rc"
    echo "$out"
    [ "$(jget "$out" conns)" = 6 ] || fail "conns: conns $(jget "$out" conns)"
    [ "$(jget "$out" contexts)" = 2 ] || fail "conns: contexts $(jget "$out" contexts)"
    [ "$(jget "$out" engines)" = 6 ] || fail "conns: engines $(jget "$out" engines), expected 6"
    [ "$(jget "$out" tcp_conns)" = 6 ] || fail "conns: tcp_conns $(jget "$out" tcp_conns)"
    [ "$(jget "$out" io_threads)" = 2 ] || fail "conns: io_threads $(jget "$out" io_threads)"
    [ "$(jget "$out" iters)" = 3000 ] || fail "conns: iters $(jget "$out" iters)"
    [ "$(jget "$out" connect_timeout_ms)" = 60000 ] ||
        fail "conns: connect_timeout_ms $(jget "$out" connect_timeout_ms)"
    awk -v v="$(jget "$out" msg_s)" 'BEGIN{exit !(v > 0)}' || fail "conns: msg_s not > 0"
    server_end 6
    # every message was answered: the server counted 3000 + warmup (20)
    # 512-byte messages in all, at least; none of another size
    local total
    total=$(sed -n 's/.*session done: \([0-9]*\) messages, \([0-9]*\) bytes/\1 \2/p' \
        "$work/srv.out" | awk '{m += $1; b += $2} END {print m, b}')
    set -- $total
    [ "${1:-0}" -ge 3020 ] || fail "conns: the server saw ${1:-0} messages, expected >= 3020"
    [ "${2:-0}" = $((${1:-0} * 512)) ] || fail "conns: ${2:-0} bytes for ${1:-0} messages"
}

case_streams() {
    server 3 || return
    local out rc=0
    out=$(timeout 60 "$perf" -c 127.0.0.1 --local 127.0.0.1 -p $port --transport tcp --test lat \
        --streams 2 --stream-size 256K --outstanding 2 --frag 4096 --iters 300 --json) || rc=$?
    [ $rc = 0 ] || fail "streams: client exited with $rc"
    echo "$out"
    [ "$(jget "$out" streams)" = 2 ] || fail "streams: streams $(jget "$out" streams)"
    [ "$(jget "$out" iters)" = 300 ] || fail "streams: iters $(jget "$out" iters)"
    [ "$(jget "$out" frag)" = 4096 ] || fail "streams: frag $(jget "$out" frag)"
    [ "$(jget "$out" tcp_conns)" = 1 ] || fail "streams: tcp_conns $(jget "$out" tcp_conns) (one engine)"
    awk -v v="$(jget "$out" median_us)" 'BEGIN{exit !(v > 0)}' || fail "streams: median not > 0"
    awk -v v="$(jget "$out" stream_mib_s)" 'BEGIN{exit !(v > 0)}' ||
        fail "streams: stream_mib_s $(jget "$out" stream_mib_s) not > 0"
    server_end 3
}

case_steady() {
    server 4 --ports 2 --io-threads 2 || return
    local out rc=0
    out=$(timeout 60 "$perf" -c 127.0.0.1 --local 127.0.0.1 -p $port --transport tcp --test bw \
        --size 512 --conns 4 --ports 2 --io-threads 2 --outstanding 400 --iters 1000 --steady \
        --json) || rc=$?
    [ $rc = 0 ] || fail "steady: client exited with $rc"
    echo "$out"
    [ "$(jget "$out" steady)" = true ] || fail "steady: not reported"
    [ "$(jget "$out" iters)" = 1000 ] || fail "steady: iters $(jget "$out" iters)"
    local sends
    sends=$(jget "$out" sends_posted)
    [ "${sends:-0}" -ge 600 ] && [ "${sends:-0}" -le 1400 ] ||
        fail "steady: $sends SENDs in the measured window, expected 1000 +- 400"
    server_end 4
    # warm-up (400), measured (1000) and the drain after (400): 1800
    local total
    total=$(sed -n 's/.*session done: \([0-9]*\) messages.*/\1/p' "$work/srv.out" |
        awk '{m += $1} END {print m}')
    [ "${total:-0}" = 1800 ] || fail "steady: the server saw ${total:-0} messages, expected 1800"
}

case_idle() {
    server 1 --poll-mode busy || return
    local out rc=0
    out=$(timeout 60 "$perf" -c 127.0.0.1 --local 127.0.0.1 -p $port --transport tcp --test lat \
        --poll-mode busy --iters 200 --idle-ms 300 --json 2>"$work/cli.err") || rc=$?
    [ $rc = 0 ] || fail "idle: client exited with $rc: $(cat "$work/cli.err")"
    echo "$out"
    local win all
    win=$(jget "$out" empty_turns)
    all=$(sed -n 's/^bex-perf: \([0-9]*\) empty loop turns, [0-9]* loop waits$/\1/p' "$work/cli.err")
    echo "empty turns: $win in the window, ${all:-none} in the run"
    [ -n "$(jget "$out" loop_waits)" ] || fail "idle: no loop_waits"
    [ -n "$win" ] && [ -n "$all" ] && [ "$all" -gt $((win + 100)) ] ||
        fail "idle: ${all:-no} empty turns in the run, ${win:-none} in the window: no idle spin"
    server_end 1
    grep -q "^bex-perf server: [0-9]* empty loop turns" "$work/srv.out" ||
        fail "idle: the server did not print its empty turns"
}

case_mute() {
    local lpid= attempt out
    for attempt in 1 2 3 4 5; do
        python3 -c 'import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(4)
print("listening", flush=True)
time.sleep(120)' $port >"$work/mute.out" 2>&1 &
        lpid=$!
        for _ in $(seq 100); do
            grep -q listening "$work/mute.out" && break
            kill -0 $lpid 2>/dev/null || break
            sleep 0.1
        done
        grep -q listening "$work/mute.out" && break
        wait $lpid 2>/dev/null
        lpid=
        pick_port
    done
    [ -n "$lpid" ] || { fail "mute: no listener"; return; }
    local start=$SECONDS
    out=$(timeout 60 "$perf" -c 127.0.0.1 --local 127.0.0.1 -p $port --transport tcp --test lat \
        --connect-timeout 300 --timeout 30 2>&1)
    local rc=$? took=$((SECONDS - start))
    kill $lpid 2>/dev/null
    wait $lpid 2>/dev/null
    echo "mute: rc $rc after ${took} s: $(grep -v 'loop turns' <<<"$out" | tr '\n' ' ')"
    [ $rc != 0 ] && [ $rc != 124 ] || fail "mute: the client's rc $rc against a server that never answers"
    grep -q "connect: Connection timed out" <<<"$out" || fail "mute: no connect timeout said"
    ! grep -q "no result within" <<<"$out" || fail "mute: a connect's timeout reported as the run's"
}

case_bad() {
    "$perf" -c 127.0.0.1 --local 127.0.0.1 --test lat --conns 2 >/dev/null 2>&1
    [ $? = 2 ] || fail "bad: --conns with --test lat accepted"
    "$perf" -c 127.0.0.1 --local 127.0.0.1 --test bw --streams 2 >/dev/null 2>&1
    [ $? = 2 ] || fail "bad: --streams with --test bw accepted"
    "$perf" -c 127.0.0.1 --local 127.0.0.1 --test bw --steady >/dev/null 2>&1
    [ $? = 2 ] || fail "bad: --steady without --conns accepted"
    "$perf" -c 127.0.0.1 --local 127.0.0.1 --connect-timeout 0 >/dev/null 2>&1
    [ $? = 2 ] || fail "bad: --connect-timeout 0 accepted"
    "$perf" -c 127.0.0.1 --local 127.0.0.1 --test bw --idle-ms 10 >/dev/null 2>&1
    [ $? = 2 ] || fail "bad: --idle-ms with --test bw accepted"
}

for c in conns streams steady idle mute bad; do
    [ "$want" = all ] || [ "$want" = $c ] || continue
    case_$c
done
exit $failed
