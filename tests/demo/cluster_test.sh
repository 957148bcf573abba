#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bex-cluster end to end, natively over TCP (tests/demo/CMakeLists.txt).
#
#   cluster_test.sh run BEX_CLUSTER PLAN [vm]   the plan runs to its end: every
#       phase has user requests and training iterations, none failed, no
#       client error, no Push applied twice (checked from results.json);
#       bex-cluster exits 0 and leaves no process behind; with "vm", on the
#       Soft-RoCE VM's addresses (BEX_TEST_ADDR0,BEX_TEST_ADDR1), with "v6" on
#       ::1, else 127.0.0.1
#   cluster_test.sh etcd BEX_CLUSTER PLAN       two instances on one local etcd:
#       --only servers (127.0.0.1) and --only clients (127.0.0.2, the servers
#       found through etcd); both exit 0, each started its half only, none
#       left a process, the clients' results pass the run checks
#   cluster_test.sh interrupt BEX_CLUSTER PLAN  SIGINT mid-phase: bex-cluster
#       exits 130 within 15 s and every process it started is gone
#   cluster_test.sh killed BEX_CLUSTER PLAN     SIGKILL to bex-cluster mid-phase
#       (no handler runs): its children die with it (PR_SET_PDEATHSIG)
#
# "Gone": no pid of OUT/pids alive and no process left in the group OUT/pgid.
set -u
mode=$1 cluster=$2 plan=$3 where=${4:-}
addrs=127.0.0.1
if [ "$where" = vm ]; then
    if [ -z "${BEX_TEST_ADDR0:-}" ] || [ -z "${BEX_TEST_ADDR1:-}" ]; then
        echo "SKIP: BEX_TEST_ADDR0/1 not set (run under scripts/rxe-vm)" >&2
        [ -n "${BEX_REQUIRE_RDMA:-}" ] && [ "$BEX_REQUIRE_RDMA" != 0 ] && exit 1
        exit 77
    fi
    addrs=$BEX_TEST_ADDR0,$BEX_TEST_ADDR1
fi
# "v6": the IPv6 loopback (every address bex-cluster prints and hands on is IPv6)
if [ "$where" = v6 ]; then
    python3 -c 'import socket; socket.socket(socket.AF_INET6).bind(("::1", 0))' 2>/dev/null || {
        echo "SKIP: no IPv6 loopback" >&2
        exit 77
    }
    addrs=::1
fi
scale=${BEX_TEST_TIME_SCALE:-1}
out=$(mktemp -d "${TMPDIR:-/tmp}/bex-cluster-test.XXXXXX")
trap 'rm -rf "$out"' EXIT
# bex-cluster --time-scale stretches the plan's deadlines (processes ready,
# the drain after a phase, Push retries) and its phases' durations alike.
# The deadlines take the whole sanitizer scale; the durations (the work:
# phase, warm-up, the fault's snapshot, kill and restart, which count from
# when the clients work) at most x3 (work_scale_max), ASan's scale, under
# which the demo's checks pass: TSan's x10 made each run a minute of
# load the checks do not need (docs/testing.md, "CI in the fifth session").
work_scale_max=3
run_plan=$plan
if [ "$scale" -gt "$work_scale_max" ]; then
    run_plan=$out/plan.json
    python3 - "$plan" "$run_plan" "$work_scale_max/$scale" <<'PY' || exit 1
import json, sys
src, dst, frac = sys.argv[1], sys.argv[2], sys.argv[3]
num, den = (float(x) for x in frac.split("/"))
f = num / den
plan = json.load(open(src))
for obj in [plan] + plan["phases"] + [p["fault"] for p in plan["phases"] if "fault" in p]:
    for k in ("duration_s", "warmup_s", "snapshot_at_s", "kill_at_s", "restart_at_s"):
        if k in obj:
            obj[k] *= f
json.dump(plan, open(dst, "w"), indent=1)
PY
fi
# bex-cluster keeps the servers' snapshots in a directory of TMPDIR: gone at its end
mkdir "$out/tmp"
export TMPDIR=$out/tmp
tmp_left() { [ -z "$(ls -A "$out/tmp")" ] || { ls "$out/tmp" >&2; return 1; }; }
fail() {
    echo "FAIL: $*" >&2
    [ -f "$out/log" ] && tail -20 "$out/log" >&2
    # the processes' refusals and ladder steps, counted (a replica that
    # refused its clients, a client stuck on a step)
    cat "$out"/run/phase*/*.log 2>/dev/null | grep -E "refused|step [0-9]|Fetch failed" |
        sed 's/:[0-9]*\b//g' | sort | uniq -c | sort -rn | head -20 >&2
    exit 1
}

# Processes started by the run (OUT/pids) still alive, or still in its group.
left_behind() {
    local pgid pid rest n=0 stat line
    pgid=$(cat "$out/pgid" 2>/dev/null) || return 0
    for stat in /proc/[0-9]*/stat; do
        # field 5 is the process group; comm (field 2) may hold spaces and
        # ") ": cut after the last ") " (builtins only: a fork per process
        # took tens of seconds in the emulated VM)
        read -r line 2>/dev/null <"$stat" || continue
        rest=${line##*) }
        set -- $rest
        if [ "${3:-}" = "$pgid" ]; then
            pid=${stat#/proc/}; pid=${pid%/stat}
            echo "left in group $pgid: $pid $(tr '\0' ' ' </proc/$pid/cmdline 2>/dev/null)" >&2
            n=$((n + 1))
        fi
    done
    while read -r pid name; do
        if kill -0 "$pid" 2>/dev/null && [ "$(cut -d' ' -f1 /proc/$pid/stat 2>/dev/null)" = "$pid" ] &&
            grep -q "bex\|$name" /proc/$pid/cmdline 2>/dev/null; then
            echo "left running: $pid ($name)" >&2
            n=$((n + 1))
        fi
    done <"$out/pids"
    return $n
}

wait_gone() { # up to $1 seconds
    local i
    for ((i = 0; i < $1 * 10; i++)); do
        left_behind 2>/dev/null && return 0
        sleep 0.1
    done
    left_behind
}

# The results of a run that went to its end (results.json), checked.
check_results() {
    python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
ph = r["phases"]
plan = r["plan"]["phases"]
assert len(ph) == len(plan), f"{len(ph)} phases of {len(plan)}"
for p in ph:
    lat = p["latency"]
    n = p["name"]
    assert lat["ranker_request"]["count"] > 0, f"{n}: no user request"
    assert lat["ranker_fetch"]["count"] >= lat["ranker_request"]["count"], n
    assert lat["trainer_push"]["count"] > 0, f"{n}: no Push"
    assert p["failed_user_requests"] == 0, f"{n}: {p['failed_user_requests']} user requests failed"
    fault = p.get("fault")
    if fault and p.get("replication") == "primary-backup":
        # a primary killed: each Push retried with its id until acknowledged
        assert lat["trainer_push"]["failed"] == 0, \
            f"{n}: {lat['trainer_push']['failed']} training Pushes failed (goal 0)"
        assert fault["push_during"]["count"] > 0, f"{n}: no Push during the fault"
        assert fault["outage_s"] > 0 and fault["down_s"] > 0, f"{n}: no outage measured"
        # a backup took over (etcd): a Push started after the kill was
        # acknowledged, and one out at the kill waited about that long (the
        # window is placed with each trainer's t0_mono_s)
        assert fault["failover_s"] > 0, f"{n}: no Push acknowledged after the kill"
        assert fault["outage_s"] >= 0.5 * fault["failover_s"], \
            f"{n}: longest Push {fault['outage_s']} s, failover {fault['failover_s']} s"
    elif fault:
        # a Push to the dead replica's shard fails there; none may fail everywhere
        assert lat["trainer_push"]["failed"] == p["push_partial"], \
            f"{n}: {lat['trainer_push']['failed'] - p['push_partial']} Pushes no replica acknowledged"
    else:
        assert lat["trainer_push"]["failed"] == 0, f"{n}: Pushes failed"
    assert p["client_errors"] == 0, f"{n}: client errors"
    assert lat["ranker_fetch"]["p99_us"] > 0 and lat["ranker_fetch"]["mean_us"] > 0, n
    pc = p["push_check"]
    assert pc["acknowledged"] > 0 and pc["keys"] > 0, f"{n}: nothing checked"
    reps = pc["replicas"]
    assert len(reps) == r["plan"]["shards"] * r["plan"]["replicas"], n
    for rep in reps:
        w = f"{n}: shard {rep['shard']} replica {rep['replica']}"
        assert not rep["fetch_failed"], f"{w}: not read"
        assert rep["rows_checked"] > 0, f"{w}: no row"
        assert rep["rows_unexplained"] == 0, f"{w}: rows the trainers' counts do not explain"
        assert rep["pushes_applied_twice"] == 0, f"{w}: Pushes applied twice"
        # replicated: every replica has every Push it acknowledged, the
        # killed one too (it caught up with its peer after its restart)
        assert rep["pushes_missing"] == 0, f"{w}: {rep['pushes_missing']} acknowledged Pushes missing"
        assert rep["rows_exact"] == rep["rows_checked"], w
        if rep["killed"]:
            assert rep["rows_equal_to_peer"] == rep["rows_checked"], \
                f"{w}: {rep['rows_checked'] - rep['rows_equal_to_peer']} rows differ from its peer's"
    for ri in range(r["plan"]["replicas"]):
        assert sum(x["rows_checked"] for x in reps if x["replica"] == ri) == pc["keys"], n
    assert p["pushes_applied_twice"] == 0, f"{n}: Pushes applied twice"
    for c in p["clients"]:
        assert c["cpu"]["ops"] > 0, f"{n}: {c['name']} reported no op"
    if "fault" in p:
        f = p["fault"]
        if not f.get("by_servers_instance"):  # --only clients: the other one's
            assert 0 < f["killed_at_s"] < f["restarted_at_s"] <= f["ready_again_at_s"], f
        assert p["retries"] > 0, f"{n}: a replica was killed under load but nothing was retried"
# MB-sized Fetches (the ranker's large_every): every phase's rankers issued
# them, every one answered, and the sizes reported add up
rk = r["plan"].get("ranker", {})
if rk.get("large_every"):
    every, lk, dim = rk["large_every"], rk.get("large_keys", 16384), r["plan"]["table"]["dim"]
    for p in ph:
        n = p["name"]
        b = p["ranker_fetch_bytes"]
        fetches = p["latency"]["ranker_fetch"]["count"]
        assert b["count"] == fetches, f"{n}: {b['count']} sizes for {fetches} Fetches"
        assert sum(c for _, c in b["hist"]) == fetches, f"{n}: histogram {b['hist']}"
        # every large_every-th Fetch of each ranker
        assert fetches // every - p["rankers"] <= b["large"] <= fetches // every, \
            f"{n}: {b['large']} large Fetches of {fetches}"
        assert b["large"] >= 3 and b["large_failed"] == 0, f"{n}: {b}"
        assert b["max"] == lk * dim * 4, f"{n}: largest answer {b['max']} bytes"
        if lk * dim * 4 >= 1 << 20:
            assert b["mib_or_more"] >= b["large"], f"{n}: {b}"
        big = sum(c for le, c in b["hist"] if le == 0 or le >= lk * dim * 4)
        assert big >= b["large"], f"{n}: histogram {b['hist']}"
        assert b["large_mean_us"] > 0, n
# Paced rankers (the plan's ranker.rate: Poisson arrivals, open loop) and
# the I/O threads' poll mode (the plan's "poll", a phase's own): what every
# client ran with, from its own report
rate = rk.get("rate", 0)
for p in ph:
    n = p["name"]
    want = next(q for q in plan if q["name"] == n).get("poll", r["plan"].get("poll", "spin-sleep"))
    assert p["poll"] == want, f"{n}: poll {p['poll']}, the plan says {want}"
    for c in p["clients"]:
        assert c["poll"] == want, f"{n}: {c['name']} polled {c['poll']}, the plan says {want}"
        if c["role"] != "ranker":
            continue
        assert c["rate"] == rate, f"{n}: {c['name']} ran at rate {c['rate']}, the plan says {rate}"
        reqs = c["ops"]["request"]["count"]
        if not rate:
            assert c["arrivals"] == 0, f"{n}: {c['name']}: arrivals in a closed loop"
            continue
        # each arrival is one user request; a Poisson count of mean
        # rate x duration (well within half to 1.5 times that, unless
        # arrivals had to wait for a slot: then fewer came in time)
        expect = rate * p["duration_s"]
        assert c["arrivals"] == reqs, f"{n}: {c['name']}: {c['arrivals']} arrivals, {reqs} requests"
        assert reqs <= 1.5 * expect + 10, f"{n}: {c['name']}: {reqs} requests at rate {rate}"
        assert reqs >= 0.5 * expect or c["arrivals_waited"] > 0, \
            f"{n}: {c['name']}: {reqs} requests at rate {rate} in {p['duration_s']} s, none waited"
print("results.json: ok:", ", ".join(
    f"{p['name']}: {p['latency']['ranker_request']['count']} user requests, "
    f"{p['latency']['trainer_push']['count']} Pushes, {p['retries']} retries" for p in ph))
PY
}

case "$mode" in
run)
    # the plan's times stretched with the sanitizers' (the fault must find
    # the clients under load)
    "$cluster" --plan "$run_plan" --out "$out/run" --addrs "$addrs" --time-scale "$scale" \
        >"$out/log" 2>&1
    rc=$?
    cp "$out/run/pgid" "$out/run/pids" "$out/" 2>/dev/null
    [ $rc = 0 ] || fail "bex-cluster exited $rc"
    left_behind || fail "processes left behind"
    tmp_left || fail "snapshot directory left in TMPDIR"
    check_results "$out/run/results.json" || fail "results.json"
    if [ "$where" = v6 ]; then
        # the servers were written down, and so reached, as [::1]:port
        grep -q '"addr": "\[::1\]:[0-9]*"' "$out"/run/phase1-*/cluster.json ||
            fail "cluster.json has no [::1]:port address"
    fi
    ;;
etcd)
    # two bex-cluster instances sharing one local etcd: one starts the
    # servers (--only servers, on 127.0.0.1), the other the clients (--only
    # clients, on 127.0.0.2), which find the servers through etcd
    etcd_bin=${BEX_ETCD:-etcd}
    command -v "$etcd_bin" >/dev/null || fail "no $etcd_bin (install etcd-server: scripts/deps)"
    # etcd's two ports stay bound (SO_REUSEADDR, not listening) by a holder
    # until etcd listens on them: a port chosen and let go can be taken by
    # a parallel test meanwhile (tests/port.h)
    coproc HOLD { python3 -c '
import socket, sys
s = [socket.socket() for _ in range(2)]
for x in s:
    x.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s], flush=True)
sys.stdin.read()'; }
    hold_pid=$HOLD_PID
    read -r cport pport <&"${HOLD[0]}"
    url=http://127.0.0.1:$cport
    "$etcd_bin" --name t --data-dir "$out/etcd" --listen-client-urls "$url" \
        --advertise-client-urls "$url" --listen-peer-urls "http://127.0.0.1:$pport" \
        --initial-advertise-peer-urls "http://127.0.0.1:$pport" \
        --initial-cluster "t=http://127.0.0.1:$pport" --log-level warn >"$out/etcd.log" 2>&1 &
    etcd_pid=$!
    trap 'kill $etcd_pid $hold_pid 2>/dev/null; wait $etcd_pid 2>/dev/null; rm -rf "$out"' EXIT
    python3 - "$url" <<'PY' || fail "etcd did not come up: $(tail -3 "$out/etcd.log")"
import sys, time, urllib.request
for _ in range(300):
    try:
        if urllib.request.urlopen(sys.argv[1] + "/health", timeout=1).status == 200:
            sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit(1)
PY
    kill $hold_pid 2>/dev/null # etcd listens: the ports are its own now
    "$cluster" --plan "$run_plan" --out "$out/srv" --addrs 127.0.0.1 --time-scale "$scale" \
        --etcd "$url" --only servers >"$out/srv.log" 2>&1 &
    spid=$!
    "$cluster" --plan "$run_plan" --out "$out/run" --addrs 127.0.0.2 --time-scale "$scale" \
        --etcd "$url" --only clients >"$out/log" 2>&1
    crc=$?
    wait $spid
    src=$?
    [ $crc = 0 ] || fail "the clients' bex-cluster exited $crc"
    [ $src = 0 ] || { tail -20 "$out/srv.log" >&2; fail "the servers' bex-cluster exited $src"; }
    for half in srv run; do
        cp "$out/$half/pgid" "$out/$half/pids" "$out/" 2>/dev/null
        left_behind || fail "$half: processes left behind"
    done
    tmp_left || fail "snapshot directory left in TMPDIR"
    # each started its half; the clients' results pass the run checks
    grep -q ' ps-shard' "$out/srv/pids" || fail "the servers' instance started no bex-ps"
    grep -q ' ranker-\| trainer-' "$out/srv/pids" && fail "the servers' instance started clients"
    grep -q ' ps-shard' "$out/run/pids" && fail "the clients' instance started bex-ps"
    grep -q ' ranker-0$' "$out/run/pids" || fail "the clients' instance started no ranker"
    check_results "$out/run/results.json" || fail "results.json"
    python3 - "$out/srv/results.json" "$out"/run/phase*/cluster.json <<'PY' || fail "etcd halves"
import json, sys
srv = json.load(open(sys.argv[1]))
# the clients' cluster files, made from etcd, name the servers' address
for path in sys.argv[2:]:
    c = json.load(open(path))
    for sh in c["services"]["ps"]["shards"]:
        assert [x["locality"] for x in sh["replicas"]] == ["dc1/pod0", "dc1/pod1"], path
        for x in sh["replicas"]:
            assert x["addr"].startswith("127.0.0.1:"), (path, x)
# the servers' half ran every phase and did the fault
assert len(srv["phases"]) == len(srv["plan"]["phases"])
for p in srv["phases"]:
    assert p["clients"] == [], p["name"]
    if "fault" in srv["plan"]["phases"][srv["phases"].index(p)]:
        f = p["fault"]
        assert 0 < f["killed_at_s"] < f["restarted_at_s"] <= f["ready_again_at_s"], f
print("etcd: the clients found the servers there; both halves ran every phase")
PY
    ;;
interrupt | killed)
    "$cluster" --plan "$plan" --out "$out/run" --addrs 127.0.0.1 --time-scale $((20 * scale)) \
        >"$out/log" 2>&1 &
    pid=$!
    # until the first phase's clients run
    for ((i = 0; i < 300 * scale; i++)); do
        grep -q ' trainer-0$' "$out/run/pids" 2>/dev/null && break
        kill -0 $pid 2>/dev/null || fail "bex-cluster ended early"
        sleep 0.1
    done
    grep -q ' trainer-0$' "$out/run/pids" || fail "no trainer started"
    sleep 1
    cp "$out/run/pgid" "$out/run/pids" "$out/"
    n=$(wc -l <"$out/pids")
    [ "$n" -ge 7 ] || fail "only $n processes started"
    left_behind 2>/dev/null && fail "nothing running before the signal"
    if [ "$mode" = interrupt ]; then
        kill -INT $pid
        for ((i = 0; i < 150; i++)); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
        kill -0 $pid 2>/dev/null && { kill -9 $pid; fail "bex-cluster still running 15 s after SIGINT"; }
        wait $pid
        rc=$?
        [ $rc = 130 ] || fail "bex-cluster exited $rc after SIGINT, not 130"
        left_behind || fail "processes left behind after SIGINT"
        tmp_left || fail "snapshot directory left in TMPDIR after SIGINT"
    else
        kill -KILL $pid
        wait $pid
        wait_gone 5 || fail "processes left behind after SIGKILL"
    fi
    echo "$mode: $n processes started, none left"
    ;;
*)
    echo "usage: $0 run|etcd|interrupt|killed BEX_CLUSTER PLAN" >&2
    exit 2
    ;;
esac
