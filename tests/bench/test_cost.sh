#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# bench/cost/run's method against known answers, natively:
#   copies   bex-copycount counts exactly what copycount-probe copies
#            (1000 x 100 bytes, memcpy and memmove)
#   cg-counts the counts bench/cost/run takes from a callgrind file, on
#            cg-probe: its poll function's calls and the completions they
#            returned (20000 and 2000), and its qsort's instructions as
#            callgrind_annotate gives them (the sample sort taken out);
#            its clock calibration (400 gettimeofday calls in
#            probe_calibrate) as probe_calibrate's inclusive count, and not
#            main's (one gettimeofday call of its own);
#            callgrind-diff's total of the same --dump-instr=yes file;
#            busy mode's rule on cg-probe's two waiting loops of
#            different cost (a message's true cost within 2 %, where one
#            empty-poll cost for both loops misses it by more than 10 %)
#   retry    bench/cost/run starts a client again only when its connect was
#            refused before the server listened: a bex-perf client that
#            fails otherwise (SIZE=0: a bad option) fails the run at once,
#            its output kept (KEEP=, the .tries file: one failure)
#   syscalls the kernel TCP ping-pong costs exactly one write and one read
#            per round trip and side (the difference of two run lengths:
#            set-up and teardown cancel), and bex over TCP a stated number
#            within a margin (the CI guard of issue 25: a change that adds
#            a system call per message fails here)
#   allocs   bex over TCP makes no heap allocation per message received or
#            sent (issue 25 item 2: the read side's calloc per message)
#   fanout   (with a third argument "fanout", that alone: CTest's
#            bench.cost_fanout) a Fetch's sub-request costs its bex-ps no
#            heap allocation (bench/cost/ps-fanout over 2 shards; issue 25
#            item 5: the request's record and the keys' array, 2.0 before),
#            and its client allocates no call record nor send descriptor
#            per sub-request (3.5 before); with the client's
#            acknowledgements held (tcp_ack_delay_us) a server makes 3
#            system calls a sub-request over 4 shards; bex's own counters
#            at native speed (frames, ackframes, waits: no tool) give one
#            frame a sub-request from every bex-ps, and the client's
#            frames its requests and its frames of acknowledgements alone
#   connect  (with a third argument "connect", that alone: CTest's
#            bench.cost_connect) bench/cost/run's run_pair_once with
#            stand-in processes: a client refused after its server said
#            "listening on" is started again, each time logged, and
#            succeeds on its second try; refused every time it gives up
#            after LATE_TRIES (3) more tries; a server that never says
#            it listens still fails the run
#   futex    a synchronous PS Fetch or Push costs its client process at
#            most one wake-up of the calling thread (bench/cost/ps-futex:
#            2 futex calls, the I/O thread's wake and the caller's wait;
#            issue 25 item 3)
#   rounds   (with a third argument "rounds", that alone: CTest's
#            bench.cost_rounds) bench/cost/run's ROUNDS: from canned
#            callgrind files (FROM=, a round a subdirectory) each figure
#            is the median of the rounds with its range (an even count's
#            median the middle two's mean), the ratio to perftest the
#            median of each round's own ratio (not the ratio of the
#            medians), the stacks' order rotates a round, and the
#            time-driven work, the message path, poll_cq calls and CQ
#            events a round trip are cg-counts --paths's, bex against
#            base is each round's difference's median; ROUNDS=1 reads
#            FROM itself and prints today's lines; a run keeps each round
#            in KEEP/rR (the kernel TCP ping-pong, two rounds); busy
#            mode over RDMA on canned --dump-instr=yes files of a
#            UCX-like process: its async thread's work (a thread that
#            waits in ucs_event_set_wait) is the time-driven work, put
#            apart also where the empty polls' subtraction took some of
#            it, and the message path is the message's true cost; the
#            function names the rule takes from UCX are the installed
#            libucs's (nm -D)
# usage: test_cost.sh SOURCE_DIR BUILD_DIR [fanout|rounds|connect]
set -euo pipefail
src=$1 build=$2 part=${3:-}
fail() { echo "FAIL: $*" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ "$part" = connect ]; then
    defs=$(sed -n '/^run_pair_once() {/,/^}/p' "$src/bench/cost/run")
    grep -q '^run_pair_once() {' <<<"$defs" || fail "no run_pair_once in bench/cost/run"
    eval "$defs"
    # what run_pair_once reads of bench/cost/run's state, and its stacks'
    # commands: the stand-ins below
    out=$tmp port=1 late_tries=3 dev0= dev1=
    env_of() { echo STAND_IN=1; }
    wrap() { echo env; }
    server_cmd() { echo "bash $tmp/srv.sh"; }
    client_cmd() { echo "bash $tmp/cli.sh"; }
    # the server: says it listens (or not: LISTENS=0) and lives until the
    # client got through, or for LIFE seconds
    cat >"$tmp/srv.sh" <<'SRV'
[ "$LISTENS" = 0 ] || echo "listening on 127.0.0.1:1"
for _ in $(seq $((LIFE * 10))); do [ -e "$DIR/through" ] && exit 0; sleep 0.1; done
exit 1
SRV
    # the client: refused its first REFUSALS tries, then through
    cat >"$tmp/cli.sh" <<'CLI'
n=$(($(cat "$DIR/n") + 1))
echo $n >"$DIR/n"
[ "$n" -gt "$REFUSALS" ] || { echo "bex-perf: connect: Connection refused"; exit 1; }
touch "$DIR/through"
CLI
    export DIR=$tmp
    # pair LISTENS REFUSALS LIFE TIMEOUT: run_pair_once's status, the
    # client's tries and the retries logged, one line (TIMEOUT: seconds a
    # process may run, and the wait for the server's line)
    pair() {
        echo 0 >"$tmp/n"
        rm -f "$tmp/through"
        local rc=0
        run_timeout=$4
        LISTENS=$1 REFUSALS=$2 LIFE=$3 run_pair_once bex syscalls 10 2>"$tmp/err" || rc=1
        echo "$rc $(cat "$tmp/n") $(grep -c "refused after its server listened" "$tmp/err")"
    }
    r=$(pair 1 1 10 10)
    [ "$r" = "0 2 1" ] || fail "refused once after listening: status, tries, retries logged $r (want 0 2 1)"
    r=$(pair 1 100 20 20)
    [ "$r" = "1 4 3" ] || fail "refused always after listening: status, tries, retries logged $r (want 1 4 3)"
    # never listening: the wait for its line lasts as long as the server
    # may run (run_timeout), which then ends it: no client, a failure
    r=$(pair 0 100 4 2)
    [ "$r" = "1 0 0" ] || fail "a server that never listens: status, tries, retries logged $r (want 1 0 0)"
    echo "ok"
    exit 0
fi
if [ "$part" = rounds ]; then
    # the time-driven rule's names are functions of bex-perf as
    # bench/cost/run measures it, a plain build (a rename or an inlining
    # would move their work to the message path unseen); a sanitizer's
    # build inlines otherwise and is never measured
    names=$(python3 "$src/bench/cost/cg-counts" --names)
    [ "$(wc -l <<<"$names")" -ge 12 ] || fail "cg-counts --names gave too few: $names"
    if grep -qx 'BEX_SANITIZE:STRING=' "$build/CMakeCache.txt"; then
        syms=$(nm "$build/bench/perf/bex-perf" | awk '$2 ~ /^[Tt]$/ {print $3}')
        for n in $names; do
            grep -qx -- "$n" <<<"$syms" ||
                fail "cg-counts' time-driven rule names $n, no function of $build/bench/perf/bex-perf"
        done
    fi
    # cgfile FILE TOTAL TIMED POLLS EVENTS: a callgrind file of a process
    # whose instructions are TOTAL, TIMED of them in sleep_timeout (one of
    # cg-counts' time-driven functions), that polls the provider POLLS
    # times and reads EVENTS completion events
    cgfile() {
        cat >"$1" <<CG
version: 1
creator: test_cost.sh
positions: line
events: Ir
ob=(1) /canned/bex-perf
fn=(1) bex__io_main
0 10
cfn=(2) sleep_timeout
calls=7 0
0 $3
cob=(3) /canned/librxe-rdmav34.so
cfn=(3) 0x0000000000002ca0
calls=$4 0
0 $4
cob=(4) /canned/libibverbs.so.1
cfn=(4) ibv_get_cq_event
calls=$5 0
0 $5
fn=(2)
0 $3
ob=(3)
fn=(3)
0 $4
ob=(4)
fn=(4)
0 $5
totals: $2
CG
    }
    # canned STACK ROUND V T P E: that round's N1 (200) and N2 (1200) runs,
    # both sides alike, V instructions a round trip, T of them
    # time-driven, P polls and E events
    canned() {
        local d=$tmp/from/r$2 side
        mkdir -p "$d"
        for side in srv cli; do
            cgfile "$d/$1.instructions.200.$side" 1000000 10000 400 200
            cgfile "$d/$1.instructions.1200.$side" $((1000000 + 1000 * $3)) $((10000 + 1000 * $4)) \
                $((400 + 1000 * $5 / 100)) $((200 + 1000 * $6 / 100))
        done
    }
    # (P and E in hundredths)
    canned bex 1 1800 50 200 100
    canned bex 2 1700 -10 250 50
    canned bex 3 1900 100 150 75
    canned perftest 1 1500 0 200 200
    canned perftest 2 1400 0 200 200
    canned perftest 3 1450 0 200 200
    # base: bex's before, 50 dearer in rounds 1 and 3, the same in 2
    canned base 1 1850 50 200 100
    canned base 2 1700 -10 250 50
    canned base 3 1950 100 150 75
    rounds() { # ROUNDS [DIR [STACKS]]: bench/cost/run's report from the canned files
        (cd "$src" && FROM=${2:-$tmp/from} ROUNDS=$1 TRANSPORT=rdma STACKS=${3:-base bex perftest} BASE_BUILD=/none \
            TOOLS=instructions N1=200 N2=1200 bench/cost/run)
    }
    out=$(rounds 3)
    echo "$out"
    line() { grep -F -- "$1" <<<"$out" >/dev/null || fail "ROUNDS=$2: no line '$1'"; }
    # each round's stacks in turn, the list rotated a round
    order=$(awk '$1 == "round" && $6 == "srv" {printf "%s%s%s", sep, $2, $4; sep = " "}' <<<"$out")
    [ "$order" = "1:base 1:bex 1:perftest 2:bex 2:perftest 2:base 3:perftest 3:base 3:bex" ] ||
        fail "ROUNDS=3 ran the stacks in the order '$order'"
    line "cost bex instructions srv 1800.0 (range 1700.0..1900.0 over 3 rounds" 3
    line "time-driven 50.0 [-10.0, 100.0], message path 1750.0 [1710.0, 1800.0], poll_cq 2.00 [1.50, 2.50], CQ events 0.75 [0.50, 1.00])" 3
    line "cost perftest instructions cli 1450.0 (range 1400.0..1500.0 over 3 rounds" 3
    line "| bex | 1800.0 [1700.0, 1900.0] / 1800.0 [1700.0, 1900.0] |" 3
    line "| bex | 50.0 [-10.0, 100.0] / 50.0 [-10.0, 100.0] | 1750.0 [1710.0, 1800.0] / 1750.0 [1710.0, 1800.0] |" 3
    # each round's own ratio (1.20, 1.21, 1.31), not 1800 / 1450 = 1.24
    line "bex against perftest (instructions, the sort and calibration excluded; each round's against its own, the median of 3 rounds [range]): 1.21x [1.20x, 1.31x] / 1.21x [1.20x, 1.31x]" 3
    line "bex's message path against perftest's (the time-driven work out of both too): 1.22x [1.17x, 1.24x]" 3
    line "bex against perftest by round: round 1 1.20x / 1.20x, round 2 1.21x / 1.21x, round 3 1.31x / 1.31x" 3
    # bex less base, round by round
    line "bex against base (total, instructions a round trip, each round's difference, the median of 3 rounds [range]): -50.0 [-50.0, 0.0] / -50.0 [-50.0, 0.0]" 3
    line "bex against base (message path, instructions a round trip, each round's difference, the median of 3 rounds [range]): -50.0 [-50.0, 0.0] / -50.0 [-50.0, 0.0]" 3
    # an even count: the middle two's mean
    out=$(rounds 2 "$tmp/from" "bex perftest")
    line "cost bex instructions srv 1750.0 (range 1700.0..1800.0 over 2 rounds" 2
    line "poll_cq 2.25 [2.00, 2.50]" 2
    # ROUNDS=1: FROM itself, today's lines (and the run's path in the
    # cost line's detail)
    out=$(rounds 1 "$tmp/from/r2" "bex perftest")
    line "cost bex instructions srv 1700.0 (raw 1700.0, sort 0.0 excluded, calibration 0.0 excluded, time-driven -10.0, message path 1710.0, poll_cq 2.50, CQ events 0.50)" 1
    line "| bex | 1700.0 / 1700.0 | 0.0 / 0.0 | 0.0 / 0.0 | 1700.0 / 1700.0 |" 1
    line "bex against perftest (instructions, the sort and calibration excluded): 1.21x / 1.21x" 1
    ! grep -q "^round [0-9]\|over [0-9]* rounds\|message path against\|against base" <<<"$out" || fail "ROUNDS=1 printed a round's figures"
    # busy mode, every stack's time-driven work apart: canned
    # --dump-instr=yes files of a UCX-like process (busycg below) whose
    # message costs 74 a round trip (a body of 50, two polls with a
    # completion at 12 each), an empty poll 9 (its loop 4, the poll 5),
    # and whose async thread (start_thread -> a libucs function that
    # waits in ucs_event_set_wait) ran 90000 instructions in the N1 run,
    # 40000 in the N2 run and 99000 in the spinning run: 0.5 an empty
    # poll more there, so the empty polls' common part takes 0.5 of it an
    # empty poll too. The total keeps the thread's -50 a round trip (and
    # less the 0.5 x 10 empty polls the subtraction took); the rule puts
    # it apart, and the message path is the truth, 74
    busycg() { # FILE ROUND_TRIPS EMPTY_POLLS THREAD_SELF THREAD_WAIT (no thread: 0 0)
        python3 - "$@" <<'PY'
import sys
f, n, e, ts, tw = sys.argv[1], *map(int, sys.argv[2:])
c, done = 2 * n + e, 2 * n  # the poll's calls and completions
body = [f'0x{0x1000 + i:x} 0 {n}' for i in range(50)]
loop = [f'0x{0x3000 + i:x} 0 {c}' for i in range(4)]
poll = [f'0x{0x2ca0 + i:x} 0 {c}' for i in range(5)] + [f'0x{0x2cb0 + i:x} 0 {done}' for i in range(3)]
total = 50 * n + 4 * c + 5 * c + 3 * done + (10 + ts + tw if ts + tw else 0)
out = ['version: 1', 'creator: test_cost.sh', 'positions: instr line', 'events: Ir',
       'ob=(1) /canned/ucx_perftest', 'fn=(1) main', *body,
       'ob=(2) /canned/libuct_ib.so.0.0.0', 'fn=(2) 0x0000000000032490', *loop,
       'cob=(3) /canned/librxe-rdmav34.so', 'cfn=(3) 0x0000000000002ca0',
       f'calls={c} 0x2ca0 0', f'0x3003 0 {5 * c + 3 * done}',
       'ob=(3)', 'fn=(3)', *poll]
if ts + tw:
    out += ['ob=(4) /canned/libc.so.6', 'fn=(4) start_thread', '0x9000 0 10',
            'cob=(5) /canned/libucs.so.0.0.0', 'cfn=(5) 0x0000000000018bf0',
            f'calls=1 0x18bf0 0', f'0x9000 0 {ts + tw}',
            'ob=(5)', 'fn=(5)', f'0x18bf0 0 {ts}',
            'cfn=(6) ucs_event_set_wait', 'calls=100 0x318e0 0', f'0x18bf0 0 {tw}',
            'fn=(6)', f'0x318e0 0 {tw}']
out.append(f'totals: {total}')
open(f, 'w').write('\n'.join(out) + '\n')
PY
    }
    mkdir -p "$tmp/busy"
    for side in srv cli; do
        busycg "$tmp/busy/ucx.instructions.200.$side" 200 2000 60000 30000
        busycg "$tmp/busy/ucx.instructions.1200.$side" 1200 12000 25000 15000
        busycg "$tmp/busy/ucx.instructions.200s.$side" 200 20000 69000 30000
        busycg "$tmp/busy/perftest.instructions.200.$side" 200 2000 0 0
        busycg "$tmp/busy/perftest.instructions.1200.$side" 1200 12000 0 0
        busycg "$tmp/busy/perftest.instructions.200s.$side" 200 20000 0 0
    done
    # calls callgrind counted where it did not collect (UCX_CALLGRIND
    # toggling UCX's set-up wait off: neither the call instruction nor
    # the callee's instructions counted) are no polls: a site's calls
    # are its calling instruction's executions
    sed 's/^calls=2400 0x2ca0 0$/calls=2417 0x2ca0 0/' "$tmp/busy/ucx.instructions.200.srv" >"$tmp/phantom"
    read -r _ _ p d _ < <(python3 "$src/bench/cost/cg-counts" "$tmp/phantom")
    [ "$p $d" = "2400 400" ] || fail "17 uncollected calls: $p polls, $d completions (want 2400, 400)"
    out=$(cd "$src" && FROM=$tmp/busy TRANSPORT=rdma MODE=busy STACKS="perftest ucx" TOOLS=instructions \
        N1=200 N2=1200 bench/cost/run)
    echo "$out"
    line "cost ucx instructions srv 19.0 (" busy
    line "raw 114.0, sort 0.0 excluded, calibration 0.0 excluded, time-driven -55.0 (a run 90000 40000 99000, 0.5 an empty poll in the empty polls' cost), message path 74.0" busy
    line "cost perftest instructions cli 74.0 (" busy
    line "time-driven 0.0 (a run 0 0 0, 0.0 an empty poll in the empty polls' cost), message path 74.0" busy
    line "perftest against ucx (instructions, the sort and calibration excluded): 3.89x / 3.89x; message paths: 1.00x / 1.00x" busy
    # ROUNDS > 1: busy mode's table of the run's path, and the message
    # paths' ratio (two rounds of the same files)
    mkdir -p "$tmp/busy2"
    cp -r "$tmp/busy" "$tmp/busy2/r1"
    cp -r "$tmp/busy" "$tmp/busy2/r2"
    out=$(cd "$src" && FROM=$tmp/busy2 ROUNDS=2 TRANSPORT=rdma MODE=busy STACKS="perftest ucx" TOOLS=instructions \
        N1=200 N2=1200 bench/cost/run)
    line "| ucx | -55.0 [-55.0, -55.0] / -55.0 [-55.0, -55.0] | 74.0 [74.0, 74.0] / 74.0 [74.0, 74.0] |" busy
    line "perftest's message path against ucx's (the time-driven work out of both too): 1.00x [1.00x, 1.00x] / 1.00x [1.00x, 1.00x]" busy
    # a libucs that renames its wait fails here, not in a verdict
    if [ -e /usr/lib/x86_64-linux-gnu/libucs.so.0 ]; then
        syms=$(nm -D --defined-only /usr/lib/x86_64-linux-gnu/libucs.so.0 | awk '{print $3}')
        for n in $(python3 "$src/bench/cost/cg-counts" --names ucx); do
            grep -qx -- "$n" <<<"$syms" ||
                fail "cg-counts' time-driven rule names $n, no function of the installed libucs"
        done
    fi
    # UCX_CALLGRIND's options reach UCX's processes under callgrind and
    # no other stack's, and by default none: the arguments a fake
    # valgrind was given (a server's stays a second, for its client to
    # find it; a fake tc for the spinning run's netem)
    mkdir -p "$tmp/fake"
    # shellcheck disable=SC2016
    printf '#!/bin/bash\nfor a; do case $a in --callgrind-out-file=*) echo "$*" >"${a#*=}.args"
        case $a in *.srv) sleep 1 ;; esac ;; esac; done\n' >"$tmp/fake/valgrind"
    printf '#!/bin/sh\nexit 0\n' >"$tmp/fake/tc"
    chmod +x "$tmp/fake/valgrind" "$tmp/fake/tc"
    for how in default set; do
        (cd "$src" && if [ $how = set ]; then export UCX_CALLGRIND="--toggle-collect=ucp_worker_flush --collect-atstart=yes"; fi &&
            PATH=$tmp/fake:$PATH TRANSPORT=rdma MODE=busy STACKS="ucx perftest" TOOLS=instructions \
                N1=1 N2=2 REPORT=no KEEP=$tmp/tog.$how bench/cost/run) >/dev/null
        for f in ucx.instructions.{1,2,1s}.{srv,cli} perftest.instructions.{1,2,1s}.{srv,cli}; do
            [ -s "$tmp/tog.$how/$f.args" ] || fail "no valgrind run for $f"
            case $how.$f in
            set.ucx.*) grep -q -- "--toggle-collect=ucp_worker_flush --collect-atstart=yes" "$tmp/tog.$how/$f.args" ||
                fail "UCX_CALLGRIND did not reach $f: $(cat "$tmp/tog.$how/$f.args")" ;;
            *) ! grep -q -- "--toggle-collect" "$tmp/tog.$how/$f.args" ||
                fail "$how: $f given UCX's options: $(cat "$tmp/tog.$how/$f.args")" ;;
            esac
        done
    done
    # a run keeps each round apart, KEEP/rR
    lo=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
    out=$(cd "$src" && BEX_BUILD_DIR=$build STACKS=kernel TOOLS=syscalls N1=100 N2=300 ROUNDS=2 \
        PORT=$((10000 + SRANDOM % (lo - 10100))) KEEP=$tmp/keep bench/cost/run)
    echo "$out"
    line "cost kernel syscalls srv 2.0 (range 2.0..2.0 over 2 rounds; round 1 (the median): " 2
    for r in 1 2; do
        [ -s "$tmp/keep/r$r/kernel.syscalls.300.srv" ] || fail "ROUNDS=2: round $r not kept in KEEP/r$r"
    done
    echo "ok"
    exit 0
fi

BEX_COPYCOUNT_OUT=$tmp/cc LD_PRELOAD=$build/bench/cost/bex-copycount.so \
    "$build/bench/cost/bex-copycount-probe" 1000 100
read -r _ calls bytes <"$tmp/cc"
echo "copycount-probe: $calls calls, $bytes bytes"
[ "$calls" = 1000 ] || fail "copycount saw $calls calls, not 1000"
[ "$bytes" = 100000 ] || fail "copycount saw $bytes bytes, not 100000"

valgrind --tool=callgrind -q --dump-instr=yes --callgrind-out-file="$tmp/cg" \
    "$build/bench/cost/bex-cg-probe" 20000
read -r total sort polls done calib < <(python3 "$src/bench/cost/cg-counts" "$tmp/cg" bex-cg-probe)
echo "cg-probe: total $total, sort $sort, polls $polls, completions $done, calibration $calib"
[ "$polls" = 20000 ] || fail "cg-counts found $polls polls, not 20000"
[ "$done" = 2000 ] || fail "cg-counts found $done completions, not 2000"
want=$(callgrind_annotate "$tmp/cg" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
[ "$total" = "$want" ] || fail "cg-counts' total $total, callgrind_annotate's $want"
# callgrind-diff reads the same file (an instruction column before the
# line's with --dump-instr=yes): against an empty profile, its total
: >"$tmp/empty"
got=$(python3 "$src/bench/cost/callgrind-diff" 1 "$tmp/empty" "$tmp/cg" | awk '$2 == "total" {print $1}')
[ "$got" = "$want.0" ] || fail "callgrind-diff's total '$got', callgrind_annotate's $want"
want=$(callgrind_annotate --inclusive=yes "$tmp/cg" | awk '/:qsort \[/ {gsub(",", "", $1); print $1}')
[ -n "$want" ] && [ "$sort" = "$want" ] || fail "cg-counts' sort $sort, qsort's inclusive count $want"
want=$(callgrind_annotate --inclusive=yes "$tmp/cg" | awk '/:probe_calibrate \[/ {gsub(",", "", $1); print $1}')
[ -n "$want" ] && [ "${calib:-}" = "$want" ] ||
    fail "cg-counts' calibration '${calib:-}', probe_calibrate's inclusive count $want"

# busy mode's empty polls, each loop's at its own cost: cg-probe waits for
# a receive in loop B and for its send's completion in loop A (B's
# iteration the dearer), as ib_send_lat does; the N1 and N2 runs wait 30
# empty polls a message in B, the spinning run 40 in A and 10 in B (as a
# netem delay moved ib_send_lat's wait into its send loop). The truth: the
# same messages without an empty poll. cg-counts --busy (bench/cost/run's
# rule) must give it within 2 %; the one-e rule (one empty poll's cost,
# from the spinning run, for every loop) must miss it by more than 10 %
# (it did: docs/benchmarks.md, sixteenth session)
# (not in the fan-out part: bench.cost checks it once)
[ "$part" = fanout ] || {
cgp() { # FILE MESSAGES WAIT_A WAIT_B
    valgrind --tool=callgrind -q --dump-instr=yes --callgrind-out-file="$tmp/$1" \
        "$build/bench/cost/bex-cg-probe" "$2" "$3" "$4" || fail "cg-probe $2 $3 $4 failed"
}
cgp t1 200 0 0
cgp t2 1200 0 0
cgp b1 200 0 30
cgp b2 1200 0 30
cgp b3 200 40 10
cgc() { python3 "$src/bench/cost/cg-counts" "$@" bex-cg-probe; }
truth=$(awk -v a="$(cgc "$tmp/t1" | cut -d' ' -f1)" -v b="$(cgc "$tmp/t2" | cut -d' ' -f1)" \
    'BEGIN {printf "%.1f", (b - a) / 1000}')
busy=$(cgc --busy "$tmp/b1" "$tmp/b2" "$tmp/b3" 200 1200)
got=${busy%% *}
read -r i1 _ c1 d1 _ < <(cgc "$tmp/b1")
read -r i2 _ c2 d2 _ < <(cgc "$tmp/b2")
read -r _ _ c3 d3 _ < <(cgc "$tmp/b3")
e=$(python3 "$src/bench/cost/cg-counts" --per-empty "$tmp/b1" "$tmp/b3" $(((c3 - d3) - (c1 - d1))))
one=$(awk -v i1="$i1" -v i2="$i2" -v p1=$((c1 - d1)) -v p2=$((c2 - d2)) -v e="$e" \
    'BEGIN {printf "%.1f", ((i2 - e * p2) - (i1 - e * p1)) / 1000}')
echo "cg-probe, two loops: a message $truth, per loop's cost $got ($busy), one e ($e) $one"
awk -v t="$truth" -v g="$got" 'BEGIN {d = g - t; exit !(t > 0 && d * d <= (0.02 * t) ^ 2)}' ||
    fail "cg-counts --busy gives $got a message, the probe's true cost is $truth"
awk -v t="$truth" -v g="$one" 'BEGIN {d = g - t; exit !(d * d > (0.1 * t) ^ 2)}' ||
    fail "the one-e rule gives $one a message, within 10 % of $truth: the probe does not tell the rules apart"
}

# a port range of our own below the ephemeral ones (64 from $port): the
# cost runs take $port.. (one port per run, 12 runs), ps-futex $port+40, the
# retry check $port+44,
# the fan-out part $port+48.. (bench.cost and bench.cost_fanout start side
# by side and may draw the same block). SRANDOM, not RANDOM: bash seeds
# RANDOM from the time and the PID, and two scripts ctest starts in the
# same microsecond drew the same port (CI of stop 32).
lo=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
port=$((10000 + (SRANDOM % ((lo - 10064) / 64)) * 64))
if [ "$part" = fanout ]; then
    fan=$(cd "$src" && BEX_BUILD_DIR=$build PORT=$((port + 48)) SHARDS=2 TOOLS=allocs N1=50 N2=250 \
        bench/cost/ps-fanout)
    echo "$fan"
    # 0.0 since issue 25 item 5 (2.0 before: the request's record in
    # bex_rpc_server and the Fetch's keys, each malloc'd per sub-request)
    v=$(awk '$1 == "fanout" && $2 == 2 && $3 == "allocs" && $4 == "srv" {print $8}' <<<"$fan")
    awk -v v="$v" 'BEGIN {exit !(v != "" && v <= 0.2)}' ||
        fail "PS fan-out: $v heap allocations per sub-request in bex-ps (guard: at most 0.2)"
    # the client: 3.5 a sub-request over 2 shards before issue 25 item 5's
    # second part (a struct call and a send descriptor malloc'd per RPC
    # call, 1.5 per Fetch besides); the guard allows what a Fetch itself
    # allocates, not one more per sub-request
    v=$(awk '$1 == "fanout" && $2 == 2 && $3 == "allocs" && $4 == "cli" {print $8}' <<<"$fan")
    awk -v v="$v" 'BEGIN {exit !(v != "" && v <= 1.6)}' ||
        fail "PS fan-out: $v heap allocations per sub-request in the client (guard: at most 1.6)"
    # a client holding its acknowledgements for its next request
    # (tcp_ack_delay_us 1 s): the servers read no frame of them, 3 system
    # calls a sub-request (readv, sendmsg, epoll_wait) over 4 shards; 4.4
    # with the default 200 us hold on a loaded host, where a connection's
    # next request comes after it (ports $port+52..59)
    fan=$(cd "$src" && BEX_BUILD_DIR=$build PORT=$((port + 52)) SHARDS=4 TOOLS=syscalls N1=50 N2=250 \
        CLI_ACK_DELAY_US=1000000 bench/cost/ps-fanout)
    echo "$fan"
    v=$(awk '$1 == "fanout" && $2 == 4 && $3 == "syscalls" && $4 == "srv" {print $8}' <<<"$fan")
    awk -v v="$v" 'BEGIN {exit !(v != "" && v <= 3.5)}' ||
        fail "PS fan-out: $v system calls per sub-request in bex-ps with the client's acknowledgements held (guard: at most 3.5)"
    # bex's own counters at native speed (no tool; ports $port+56..63,
    # the /metrics among them): every bex-ps sends one frame a
    # sub-request, its answer, and wakes for one; the client as many, its
    # requests, and its acknowledgement-only frames (timing's doing) are
    # counted, at most one a sub-request
    fan=$(cd "$src" && BEX_BUILD_DIR=$build PORT=$((port + 56)) SHARDS=2 TOOLS="frames ackframes waits" \
        N1=50 N2=250 bench/cost/ps-fanout)
    echo "$fan"
    c() { awk -v t="$1" -v d="$2" '$1 == "fanout" && $2 == 2 && $3 == t && $4 == d {print $8}' <<<"$fan"; }
    awk -v v="$(c frames srv)" 'BEGIN {exit !(v != "" && v >= 0.95 && v <= 1.05)}' ||
        fail "PS fan-out: bex-ps sent $(c frames srv) frames a sub-request (want 1)"
    awk -v v="$(c ackframes cli)" -v f="$(c frames cli)" 'BEGIN {exit !(v != "" && v >= -0.05 && v <= 1.05 && f >= 0.95 + v)}' ||
        fail "PS fan-out: the client sent $(c frames cli) frames a sub-request, $(c ackframes cli) of acknowledgements alone"
    awk -v v="$(c waits srv)" 'BEGIN {exit !(v != "" && v >= 0.5)}' ||
        fail "PS fan-out: bex-ps waited $(c waits srv) times a sub-request in epoll_wait (want about 1)"
    echo "ok"
    exit 0
fi
# a client that fails for another reason than a refused connect is not
# started again (before: up to 120 times, half a second apart, any failure)
start=$SECONDS
if (cd "$src" && BEX_BUILD_DIR=$build STACKS=bex TOOLS=syscalls SIZE=0 N1=10 N2=20 PORT=$((port + 44)) \
    RUN_TIMEOUT=60 KEEP=$tmp/retry bench/cost/run) >"$tmp/retry.out" 2>&1; then
    fail "bench/cost/run passed with a client that cannot run (SIZE=0)"
fi
tries=$(grep -c "client failed" "$tmp/retry/bex.syscalls.10.tries" 2>/dev/null || true)
echo "retry: a failing client ran ${tries:-0} time(s), $((SECONDS - start)) s"
[ "${tries:-0}" = 1 ] || fail "bench/cost/run ran a failing client ${tries:-0} times, not once"

out=$(cd "$src" && BEX_BUILD_DIR=$build STACKS="kernel bex" TOOLS="syscalls copies allocs" \
    N1=300 N2=1300 PORT=$port bench/cost/run)
echo "$out"
val() { awk -v s="$1" -v t="$2" -v d="$3" '$1 == "cost" && $2 == s && $3 == t && $4 == d {print $5}' <<<"$out"; }
for side in srv cli; do
    [ "$(val kernel syscalls $side)" = 2.0 ] || fail "kernel TCP $side: $(val kernel syscalls $side) system calls per round trip, not 2.0"
    [ "$(val kernel copies $side)" = 0.0 ] || fail "kernel TCP $side: copies $(val kernel copies $side), not 0"
    # bex over TCP, event mode, 32 B: 3.0 per side since issue 25 item 2
    # (one readv, one sendmsg, one epoll_wait; 5.0 before, with 3 readv);
    # the guard allows +0.5
    v=$(val bex syscalls $side)
    awk -v v="$v" 'BEGIN {exit !(v >= 2 && v <= 3.5)}' || fail "bex TCP $side: $v system calls per round trip (guard: 2..3.5)"
    # no heap allocation per message (1.0 per side before issue 25 item 2)
    v=$(val bex allocs $side)
    awk -v v="$v" 'BEGIN {exit !(v <= 0.2)}' || fail "bex TCP $side: $v heap allocations per round trip (guard: at most 0.2)"
done

ps=$(cd "$src" && BEX_BUILD_DIR=$build PORT=$((port + 40)) bench/cost/ps-futex)
echo "$ps"
for op in fetch push fetch_into; do
    # 2.0-2.2 since issue 25 item 3 (8.7-13.6 before: a mutex and condition
    # variable per call, and the channel's timer thread woken twice);
    # fetch_into 2.0 since issue 28 item 2 (its own mutex and condition
    # variable before). push_from is printed, not guarded: its array comes
    # back under the channel's lock, the waiter woken there meets that lock
    # (3.4 on a quiet host, 5.6-6.4 beside a build)
    v=$(awk -v o=$op '$1 == "cost" && $2 == "ps" && $3 == o {print $5}' <<<"$ps")
    awk -v v="$v" 'BEGIN {exit !(v != "" && v <= 3.0)}' || fail "PS $op: $v futex calls per operation (guard: at most 3.0)"
done
echo "ok"
