# SPDX-License-Identifier: Apache-2.0
# What test_deb.sh (the unpacked packages) and test_deb_install.sh (the
# installed ones) both check of bex-ps's systemd unit, sourced by each:
#   unit_verify ROOT UNIT TMP  the unit passes systemd-analyze verify (when
#                              there is one), its ExecStart pointed into ROOT
#                              (verify wants the binary to exist)
#   unit_run ROOT UNIT TMP     bex-ps started as the unit would (its ExecStart
#                              line from ROOT, BEX_PS_OPTS as an
#                              /etc/default/bex-ps would give them: a
#                              one-shard cluster on loopback) answers /healthz
#                              and /ready with 200, and the unit's KillSignal
#                              ends it with status 0 after 'bex-ps: stopped';
#                              sets unit_sig to that signal's name
# Both call the sourcing script's fail.

unit_verify() {
    local root=$1 unit=$2 tmp=$3
    command -v systemd-analyze >/dev/null || return 0
    mkdir -p "$tmp/unit"
    sed "s|^ExecStart=/usr/bin/|ExecStart=$root/usr/bin/|" "$unit" >"$tmp/unit/bex-ps.service"
    systemd-analyze verify --man=no "$tmp/unit/bex-ps.service" 2>"$tmp/verify" ||
        { cat "$tmp/verify" >&2; fail "systemd-analyze verify"; }
}

unit_free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# unit_http_200 PATH: /PATH on the metrics port answers 200 within 10 s
unit_http_200() {
    local code=000
    for _ in $(seq 100); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$unit_mport/$1" || true)
        [ "$code" = 200 ] && return 0
        kill -0 "$unit_pid" 2>/dev/null || break
        sleep 0.1
    done
    cat "$unit_tmp/ps.out" >&2
    kill "$unit_pid" 2>/dev/null
    fail "/$1 answered $code"
}

unit_run() {
    local root=$1 unit=$2 port exec_start cmd opts rc=0
    unit_tmp=$3
    port=$(unit_free_port)
    unit_mport=$(unit_free_port)
    printf '{"services":{"ps":{"shards":[{"replicas":[{"addr":"127.0.0.1:%s","transport":"tcp"}]}]}}}\n' \
        "$port" >"$unit_tmp/cluster.json"
    opts="--cluster $unit_tmp/cluster.json --shard all --table 1:4:sgd:0.1 --transport tcp"
    opts+=" --metrics-port $unit_mport --no-catchup"
    exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
    cmd=${exec_start//\$BEX_PS_OPTS/$opts}
    cmd=${cmd/\/usr\/bin\//$root/usr/bin/}
    LD_LIBRARY_PATH=$root/usr/lib $cmd >"$unit_tmp/ps.out" 2>&1 &
    unit_pid=$!
    unit_http_200 healthz
    unit_http_200 ready
    unit_sig=$(sed -n 's/^KillSignal=SIG//p' "$unit")
    kill -s "$unit_sig" "$unit_pid"
    wait "$unit_pid" || rc=$?
    [ "$rc" = 0 ] || { cat "$unit_tmp/ps.out" >&2; fail "bex-ps exited $rc after SIG$unit_sig"; }
    grep -q '^bex-ps: stopped' "$unit_tmp/ps.out" ||
        { cat "$unit_tmp/ps.out" >&2; fail "bex-ps did not say stopped"; }
}
