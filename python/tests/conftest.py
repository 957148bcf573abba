# SPDX-License-Identifier: Apache-2.0
"""bex-ps clusters for the tests, natively over TCP on loopback.

BEX_PS names the bex-ps binary (python/test.sh sets it from the build
dir); without it the tests fail, they are not skipped. Ports are reserved
race-free the way tests/examples/run_ps.sh does: held bound (SO_REUSEADDR,
not listening) until bex-ps listens on them."""
import json
import os
import signal
import socket
import subprocess
import time

import pytest

SCALE = int(os.environ.get("BEX_TEST_TIME_SCALE", "1"))
TABLE, DIM, LR = 1, 8, 0.5
# BEX_PY_TRANSPORT=rdma (python/test.sh --rxe, in the Soft-RoCE VM): the
# servers on rxe1's address, the clients on rxe0's, over RDMA
TRANSPORT = os.environ.get("BEX_PY_TRANSPORT", "tcp")
RDMA = TRANSPORT == "rdma"
SERVER_IP = os.environ.get("BEX_TEST_ADDR1", "10.99.0.2") if RDMA else "127.0.0.1"
CLIENT_IP = os.environ.get("BEX_TEST_ADDR0", "10.99.0.1") if RDMA else "127.0.0.1"
# what every client, channel and context of the tests takes
NET = {"local_addr": CLIENT_IP, "transport": TRANSPORT}
SERVER_NET = {"local_addr": SERVER_IP, "transport": TRANSPORT}
# an RPC channel's: bex's connect timeout (10 ms) is too short for the VM
CHANNEL = dict(NET, connect_timeout_ms=5000 * SCALE)


def pytest_configure(config):
    config.addinivalue_line("markers", "torch: imports torch (left out in the VM: slow there)")
    config.addinivalue_line("markers", "tcp_only: runs the examples, which use TCP on loopback")
    config.addinivalue_line("markers", "native_only: the same on either transport: not run again in "
                            "the VM (its seconds)")


def bex_ps_binary():
    path = os.environ.get("BEX_PS")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"BEX_PS must name the bex-ps binary (is {path!r}); python/test.sh sets it")
    return path


def stopped(pid):
    tasks = f"/proc/{pid}/task"
    for t in os.listdir(tasks):
        with open(f"{tasks}/{t}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] not in "tT":
                return False
    return True


class Cluster:
    """shards x replicas bex-ps processes, one per replica index, each
    serving every shard (--shard all --replica I)."""

    def __init__(self, tmp, shards, replicas, extra=()):
        self.tmp, self.shards, self.replicas, self.extra = tmp, shards, replicas, list(extra)
        held = []
        for _ in range(shards * replicas):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((SERVER_IP, 0))
            held.append(s)
        ports = [s.getsockname()[1] for s in held]
        # ports[shard * replicas + replica]
        self.addrs = [[f"{SERVER_IP}:{ports[s * replicas + r]}" for r in range(replicas)]
                      for s in range(shards)]
        doc = {"services": {"ps": {"shards": [
            {"replicas": [{"addr": a, "transport": TRANSPORT} for a in reps]}
            for reps in self.addrs]}}}
        self.path = os.path.join(tmp, "cluster.json")
        with open(self.path, "w") as f:
            json.dump(doc, f)
        self.procs = [self._start(r) for r in range(replicas)]
        for s in held:
            s.close()

    def _start(self, replica):
        log = open(os.path.join(self.tmp, f"ps{replica}.out"), "w+")
        p = subprocess.Popen(
            [bex_ps_binary(), "--cluster", self.path, "--shard", "all", "--replica",
             str(replica), "--table", f"{TABLE}:{DIM}:sgd:{LR}", "--no-catchup",
             "--transport", TRANSPORT, *self.extra],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20 * SCALE
        while time.monotonic() < deadline:
            log.seek(0)
            if "bex-ps: ready" in log.read():
                return p
            if p.poll() is not None:
                break
            time.sleep(0.05)
        log.seek(0)
        p.kill()
        pytest.fail(f"bex-ps replica {replica} not ready: {log.read()[-2000:]}")

    def kill(self, replica, sig=signal.SIGKILL):
        p = self.procs[replica]
        p.send_signal(sig)
        if sig == signal.SIGKILL:
            p.wait()
        elif sig == signal.SIGSTOP:  # stopped when every thread is
            deadline = time.monotonic() + 5 * SCALE
            while time.monotonic() < deadline and not stopped(p.pid):
                time.sleep(0.01)
            assert stopped(p.pid), f"bex-ps {p.pid} did not stop"

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()


@pytest.fixture
def cluster(tmp_path):
    """2 shards, 1 replica each."""
    c = Cluster(str(tmp_path), 2, 1)
    yield c
    c.stop()


@pytest.fixture
def cluster2(tmp_path):
    """2 shards, 2 replicas each (two bex-ps processes)."""
    c = Cluster(str(tmp_path), 2, 2)
    yield c
    c.stop()


def pools_settled(base, timeout=5.0):
    """(ok, now): the extension's contexts and the bytes in use in their
    pools back to base (none more alive, no byte more, no context destroyed
    with live buffers), waiting up to timeout seconds for what bex's I/O
    threads free after a call returned."""
    import gc
    from bex import _bex
    deadline = time.monotonic() + timeout * SCALE
    while True:
        gc.collect()
        now = _bex.pools()
        ok = (now["contexts"] <= base["contexts"] and now["leaked"] == base["leaked"]
              and all(now[k] <= base[k] for k in ("pool", "recv_pool", "landing")))
        if ok or time.monotonic() > deadline:
            return ok, now
        time.sleep(0.05)


@pytest.fixture
def pools_baseline():
    """After the test, bex's pool counters are back to their baseline
    (issue 28 item 8: nothing leaks, beyond the PS client too)."""
    import gc
    from bex import _bex
    gc.collect()
    base = _bex.pools()
    yield base
    ok, now = pools_settled(base)
    assert ok, f"bex pools not back to their baseline: {now} (before: {base})"
