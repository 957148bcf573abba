#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The chaos test (issue 29 item 6; docs/testing.md, "The chaos test").

A primary-backup cluster of bex-ps processes (--shards x --replicas, each
its own process; with --hosts netns each replica index its own network
namespace, a host of its own on a bridge), --trainers bex_chaos_node
trainers Pushing for --seconds with explicit Push ids (each Push retried
with its id until acknowledged), while a scheduler seeded by --seed kills -9
and restarts, or SIGSTOPs and SIGCONTs, primaries and backups at random (at
most one fault per shard at a time, --faults per shard at most); a
"snapkill" has a replica write its snapshot (SIGUSR1), lets the Pushes go
on for a while, then kills it -9 and restarts it from that snapshot, so a
backup catches up by its primary's log suffix when the log still covers
it (static mode), by a full copy otherwise; the run reports how many of
each it saw. Then every
process is brought back and bex_chaos_node check reads every row from each
replica: replicas equal bit for bit (SGD and Adagrad), each SGD row exactly
0 less the acknowledged gradients (none lost, none applied twice).

--directory static: the cluster file, replica 0 the fixed primary (no
failover: a killed primary is restarted and the Pushes wait for it).
--directory etcd: a local etcd (BEX_ETCD or etcd in PATH) on the trainers'
address, bex-ps --etcd --primary-backup --ttl LEASE_S registered there,
the trainers and the check reading the directory from it (the shard's
primary: the first replica it lists); backups are stopped past the forward
deadline too, and primaries past their lease (failover). Skipped (77)
while bex-ps refuses --etcd with --primary-backup (before failover).

Rerun one seed: tests/ps/chaos/chaos.py --ps build/tools/ps/bex-ps
  --node build/tests/ps/bex_chaos_node --seed N (the other options as the
  failed run printed them). Exit status 0 pass, 1 a finding, 77 skipped.
"""
import argparse
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

LOG = []


def say(msg):
    line = "chaos: %s" % msg
    print(line, flush=True)
    LOG.append(line)


def sh(*cmd, check=True):
    r = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and r.returncode:
        raise RuntimeError("%s: %s" % (" ".join(cmd), r.stdout.strip()))
    return r.returncode


class Hosts:
    """Where replica r runs: its address and the command prefix (netns)."""

    def __init__(self, kind):
        self.kind, self.ns, self.br = kind, [], None
        tag = "bxc%d" % (os.getpid() % 100000)
        self.tag = tag
        if kind == "netns":
            why = self.netns_setup(tag)
            if why:
                say("network namespaces unavailable (%s): loopback addresses instead" % why)
                self.cleanup()
                self.kind = kind = "loopback"
        if kind == "loopback":
            self.client = "127.0.0.1"
        elif kind == "vm":
            self.client = os.environ["BEX_TEST_ADDR1"]

    def netns_setup(self, tag):
        if os.geteuid() != 0 or not shutil.which("ip"):
            return "not root, or no ip(8)"
        self.br = tag + "br"
        # Two runs side by side (chaos.tcp and chaos.tcp.etcd under ctest
        # -j) must not take the same /24: one at a time (a lock) takes the
        # first 10.213.N/24 no interface has, from one its pid chooses.
        with open("/run/bex-chaos-net.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = subprocess.run(["ip", "-4", "-o", "addr"], stdout=subprocess.PIPE,
                                  text=True).stdout
            for i in range(250):
                net = "10.213.%d" % ((os.getpid() + i) % 250 + 1)
                if " %s." % net not in used:
                    break
            else:
                return "every 10.213.N/24 in use"
            self.net = net
            try:
                sh("ip", "link", "add", self.br, "type", "bridge")
                sh("ip", "addr", "add", net + ".1/24", "dev", self.br)
                sh("ip", "link", "set", self.br, "up")
                self.client = net + ".1"
            except RuntimeError as e:
                return str(e)
        return None

    def add_host(self, r):
        """Namespace of replica r (netns): made on first use."""
        if self.kind != "netns" or r < len(self.ns):
            return
        ns, veth = "%sh%d" % (self.tag, r), "%sv%d" % (self.tag, r)
        sh("ip", "netns", "add", ns)
        self.ns.append(ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", self.br)
        sh("ip", "link", "set", veth, "up")
        for c in (["link", "set", "lo", "up"], ["addr", "add", self.addr(r) + "/24", "dev", "eth0"],
                  ["link", "set", "eth0", "up"]):
            sh("ip", "-n", ns, *c)

    def addr(self, r):
        if self.kind == "netns":
            return "%s.%d" % (self.net, 10 + r)
        if self.kind == "vm":
            return os.environ["BEX_TEST_ADDR0" if r == 0 else "BEX_TEST_ADDR1"]
        return "127.0.0.%d" % (10 + r)

    def prefix(self, r):
        return ["ip", "netns", "exec", self.ns[r]] if self.kind == "netns" else []

    def port(self, s, r):
        if self.kind == "netns":
            return 7100 + s  # each host its own ports
        with socket.socket() as so:
            so.bind((self.addr(r), 0))
            return so.getsockname()[1]

    def cleanup(self):
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)
        self.ns = []
        if self.br:
            sh("ip", "link", "del", self.br, check=False)
            self.br = None


class Etcd:
    """A local etcd for --directory etcd, on addr."""

    def __init__(self, addr, workdir):
        self.bin = os.environ.get("BEX_ETCD", "etcd")
        if not shutil.which(self.bin):
            raise Skip("no etcd (BEX_ETCD or etcd in PATH; scripts/deps has etcd-server)")
        ports = []
        for _ in range(2):
            with socket.socket() as so:
                so.bind((addr, 0))
                ports.append(so.getsockname()[1])
        self.url, peer = "http://%s:%d" % (addr, ports[0]), "http://%s:%d" % (addr, ports[1])
        self.log = open(os.path.join(workdir, "etcd.log"), "w")
        self.p = subprocess.Popen(
            [self.bin, "--name", "c", "--data-dir", os.path.join(workdir, "etcd"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", "c=" + peer, "--log-level", "warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        end = time.monotonic() + 30
        while time.monotonic() < end and self.p.poll() is None:
            try:
                if opener.open(self.url + "/health", timeout=1).status == 200:
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("etcd did not start (%s)" % self.log.name)

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            self.p.wait()


class Skip(Exception):
    pass


class Server:
    """bex-ps for shard s, replica r: its lives (a log file each)."""

    def __init__(self, ch, s, r):
        self.ch, self.s, self.r, self.life, self.p = ch, s, r, 0, None
        self.stopped = False

    def start(self, catchup):
        a = self.ch.args
        self.life += 1
        self.log = os.path.join(self.ch.dir, "ps-s%d-r%d.%d.log" % (self.s, self.r, self.life))
        reps = ",".join(self.ch.addr_of[self.s, r] for r in range(a.replicas))
        where = ["--cluster", self.ch.cluster] if not self.ch.etcd else [
            "--etcd", self.ch.etcd.url, "--etcd-prefix", self.ch.prefix, "--listen",
            self.ch.addr_of[self.s, self.r], "--n-shards", str(a.shards), "--ttl",
            str(a.lease_s), "--replicas", reps, "--lease-ttl-ms", str(a.lease_s * 1000),
            "--forward-timeout-ms", "1000"]
        cmd = self.ch.hosts.prefix(self.r) + [a.ps] + where + [
            "--shard", str(self.s), "--replica", str(self.r),
            "--table", "1:4:sgd:1", "--table", "2:4:adagrad:0.1", "--transport", a.transport,
            "--primary-backup", "--keepalive-timeout-ms", "3000", "--catchup-timeout-ms", "10000",
            "--snapshot-dir", self.ch.snap_dir]
        if not catchup:
            cmd.append("--no-catchup")
        with open(self.log, "w") as f:
            self.p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        self.stopped = False

    def ready(self):
        with open(self.log) as f:
            return "bex-ps: ready" in f.read()

    def wait_ready(self, secs):
        # sanitizer builds run slower: tests/CMakeLists.txt's time scale
        # (1 plain, 3 ASan, 10 TSan), as every C test's deadlines
        secs *= max(1, int(os.environ.get("BEX_TEST_TIME_SCALE", "1")))
        end = time.monotonic() + secs
        while time.monotonic() < end:
            if self.p.poll() is not None:
                with open(self.log) as f:
                    if self.ch.etcd and self.p.returncode == 2 and "usage" in f.read():
                        raise Skip("bex-ps refuses --etcd with --primary-backup (no failover yet)")
                raise RuntimeError("%s exited %s (%s)" % (self.name(), self.p.returncode, self.log))
            if self.ready():
                return
            time.sleep(0.05)
        with open(self.log) as f:  # the log may be in a VM's /tmp: its tail here
            sys.stdout.write("".join(f.readlines()[-20:]))
        raise RuntimeError("%s not ready in %d s (%s)" % (self.name(), secs, self.log))

    def name(self):
        return "shard %d %s (replica %d)" % (self.s, "primary" if self.r == 0 else "backup", self.r)

    def signal(self, sig):
        if self.p and self.p.poll() is None:
            self.p.send_signal(sig)

    def kill9(self):
        self.signal(signal.SIGKILL)
        self.p.wait()


class Chaos:
    def __init__(self, args):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="bex-chaos-")
        self.hosts = Hosts(args.hosts)
        self.servers, self.trainers = {}, []
        self.etcd, self.prefix, self.addr_of = None, "/bex-chaos/", {}
        self.snap_dir = os.path.join(self.dir, "snap")  # snapkill's snapshots
        os.mkdir(self.snap_dir)

    def write_cluster(self):
        a, shards = self.args, []
        for s in range(a.shards):
            reps = []
            for r in range(a.replicas):
                self.hosts.add_host(r)
                self.addr_of[s, r] = "%s:%d" % (self.hosts.addr(r), self.hosts.port(s, r))
                reps.append('{"addr":"%s","transport":"%s"}' % (self.addr_of[s, r], a.transport))
            shards.append('{"replicas":[%s]}' % ",".join(reps))
        self.cluster = os.path.join(self.dir, "cluster.json")
        with open(self.cluster, "w") as f:
            f.write('{"version":1,"services":{"ps":{"shards":[%s]}}}\n' % ",".join(shards))

    def node(self, mode, *extra):
        a = self.args
        where = ["--etcd", self.etcd.url, "--prefix", self.prefix] if self.etcd else [
            "--cluster", self.cluster]
        return [a.node, mode] + where + ["--addr", self.hosts.client,
                "--transport", a.transport, "--replicas", str(a.replicas)] + list(extra)

    def start_all(self):
        for s in range(self.args.shards):
            for r in reversed(range(self.args.replicas)):
                sv = self.servers[s, r] = Server(self, s, r)
                sv.start(catchup=False)
        for sv in self.servers.values():
            sv.wait_ready(30)

    def plan(self, s):
        """Shard s's next fault: (kind, replica, seconds), from its own
        generator (the sequence depends on the seed alone)."""
        g = self.rng[s]
        kind = g.choice(["kill", "snapkill", "stop", "stop", "longstop", "snapkill"])
        r = g.randrange(self.args.replicas)
        if kind == "longstop" and not self.args.long_backup_stops and not self.etcd:
            r = 0  # static mode: a backup stopped past forward_timeout_ms may never rejoin
        # a snapkill's time drawn as a kill's
        secs = {"kill": g.uniform(0.2, 1.5), "stop": g.uniform(0.3, 2.5),
                "longstop": g.uniform(5.5, 7.0)}["kill" if kind == "snapkill" else kind]
        return kind, r, secs

    def fault_step(self, s, st, t):
        """Shard s's scheduler: idle -> fault -> recovering -> idle."""
        if st["phase"] == "idle" and t >= st["at"] and st["n"] < self.args.faults:
            kind, r, secs = self.plan(s)
            sv = st["sv"] = self.servers[s, r]
            if t + secs > self.args.seconds - 1:
                st["n"] = self.args.faults  # no time left for it: done
                return
            st.update(phase="fault", kind=kind, until=t + secs, n=st["n"] + 1)
            if kind == "kill":
                sv.kill9()
            elif kind == "snapkill":
                sv.signal(signal.SIGUSR1)  # its snapshot; killed at "until"
            else:
                sv.signal(signal.SIGSTOP)
                sv.stopped = True
            what = {"kill": "kill -9", "snapkill": "snapshot of"}.get(kind, "SIGSTOP")
            say("%5.1f s: %s %s for %.1f s" % (t, what, sv.name(), secs))
        elif st["phase"] == "fault" and t >= st["until"]:
            if st["kind"] == "snapkill":
                st["sv"].kill9()  # restarted from the snapshot just written
            self.recover(st["sv"])
            st["phase"] = "recovering"
            say("%5.1f s: %s %s" % (t, {"kill": "restart", "snapkill": "kill -9, restart from its "
                                         "snapshot"}.get(st["kind"], "SIGCONT"),
                                     st["sv"].name()))
        elif st["phase"] == "recovering" and st["sv"].ready():
            st.update(phase="idle", at=t + self.rng[s].uniform(0.3, 1.5))
        elif st["phase"] == "recovering" and st["sv"].p.poll() is not None:
            raise RuntimeError("%s: its restart exited %d (%s)" % (
                st["sv"].name(), st["sv"].p.returncode, st["sv"].log))

    def recover(self, sv):
        if sv.stopped:
            sv.signal(signal.SIGCONT)
            sv.stopped = False
        elif sv.p.poll() is not None:
            sv.start(catchup=True)

    def run(self):
        a = self.args
        self.write_cluster()
        if a.directory == "etcd":
            self.etcd = Etcd(self.hosts.client, self.dir)
        say("seed %d; %d shards x %d replicas (%s, %s), %d trainers for %.0f s, at most %d "
            "faults a shard; directory %s" % (a.seed, a.shards, a.replicas, self.hosts.kind,
                                               a.transport, a.trainers, a.seconds, a.faults,
                                               a.directory))
        say("rerun: %s" % " ".join(rerun_argv(a)))
        self.start_all()
        r = subprocess.run(self.node("zero"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=120)
        if r.returncode:
            raise RuntimeError("zero: %s" % r.stdout)
        tr, sums = self.trainers, []
        for i in range(a.trainers):
            sums.append(os.path.join(self.dir, "sums%d" % i))
            log = open(os.path.join(self.dir, "trainer%d.log" % i), "w")
            tr.append(subprocess.Popen(self.node(
                "push", "--id", str(i), "--seed", str(a.seed), "--seconds", str(a.seconds),
                "--sums", sums[-1], "--ack-bound-ms", str(a.ack_bound_ms)),
                stdout=log, stderr=subprocess.STDOUT))
        self.rng = [random.Random(a.seed * 100 + s) for s in range(a.shards)]
        st = [{"phase": "idle", "at": self.rng[s].uniform(0.5, 2.0), "n": 0}
              for s in range(a.shards)]
        t0 = time.monotonic()
        end = t0 + a.seconds + a.ack_bound_ms / 1000 + 30
        while any(p.poll() is None for p in tr) and time.monotonic() < end:
            for s in range(a.shards):
                self.fault_step(s, st[s], time.monotonic() - t0)
            time.sleep(0.05)
        for sv in self.servers.values():
            self.recover(sv)
        return self.finish(tr, sums)

    def finish(self, tr, sums):
        bad = 0
        for i, p in enumerate(tr):
            if p.poll() is None:
                p.kill()
                say("trainer %d: still running after its bound (a hang)" % i)
                bad = 1
            p.wait()
            with open(os.path.join(self.dir, "trainer%d.log" % i)) as f:
                text = f.read()
            last = text.strip().splitlines()[-1] if text.strip() else "(no output)"
            say("trainer %d: exit %d: %s" % (i, p.returncode, last))
            if p.returncode:
                bad = 1
                sys.stdout.write(text[-2000:])
        for sv in self.servers.values():
            sv.wait_ready(30)
        if bad:
            say("check skipped: a trainer failed (its last Push is in doubt)")
            return 1
        r = subprocess.run(self.node("check", *sum([["--sums", x] for x in sums], [])),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=120)
        sys.stdout.write(r.stdout)
        self.catchups()
        return 1 if bad or r.returncode else 0

    def catchups(self):
        """How the restarted replicas caught up, from their logs."""
        suffix = full = 0
        for name in os.listdir(self.dir):
            if name.startswith("ps-") and name.endswith(".log"):
                with open(os.path.join(self.dir, name)) as f:
                    text = f.read()
                suffix += text.count("caught up by its primary's log")
                full += text.count("a full copy instead")
        say("catch-ups by log suffix: %d; suffix refused, full copy instead: %d" % (suffix, full))

    def cleanup(self, keep):
        for p in self.trainers:
            if p.poll() is None:
                p.kill()
                p.wait()
        for sv in self.servers.values():
            sv.signal(signal.SIGCONT)
            sv.signal(signal.SIGKILL)
            if sv.p:
                sv.p.wait()
        if self.etcd:
            self.etcd.stop()
        self.hosts.cleanup()
        if keep:
            say("logs kept in %s" % self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def rerun_argv(a):
    return [sys.argv[0], "--ps", a.ps, "--node", a.node, "--seed", str(a.seed), "--seconds",
            str(a.seconds), "--trainers", str(a.trainers), "--faults", str(a.faults), "--hosts",
            a.hosts, "--transport", a.transport, "--directory", a.directory, "--lease-s",
            str(a.lease_s)] + (
                ["--long-backup-stops"] if a.long_backup_stops else [])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ps", required=True, help="the bex-ps binary")
    ap.add_argument("--node", required=True, help="the bex_chaos_node binary")
    ap.add_argument("--seed", type=int, help="the scheduler's and trainers' (default: random)")
    ap.add_argument("--seconds", type=float, default=20, help="how long the trainers Push")
    ap.add_argument("--trainers", type=int, default=3)
    ap.add_argument("--shards", type=int, default=2, choices=[2])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--faults", type=int, default=6, help="faults per shard, at most")
    ap.add_argument("--ack-bound-ms", type=int, default=60000,
                    help="a Push not acknowledged this long fails the run")
    ap.add_argument("--hosts", choices=["netns", "loopback", "vm"], default="netns")
    ap.add_argument("--transport", choices=["tcp", "rdma"], default="tcp")
    ap.add_argument("--directory", choices=["static", "etcd"], default="static")
    ap.add_argument("--lease-s", type=int, default=2,
                    help="--directory etcd: bex-ps's lease TTL (--ttl), seconds")
    ap.add_argument("--keep", action="store_true", help="keep the logs even when it passes")
    ap.add_argument("--long-backup-stops", action="store_true",
                    help="stop backups too for longer than the forward deadline (5 s): in static "
                         "mode such a backup may miss a forward and never rejoin (docs/testing.md)")
    a = ap.parse_args()
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 1 << 31)
    if a.hosts == "vm" and not os.environ.get("BEX_IN_VM"):
        print("chaos: --hosts vm runs inside the Soft-RoCE VM (scripts/rxe-vm): skipped")
        return 77
    ch = Chaos(a)
    rc = 1
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(1))
    try:
        rc = ch.run()
    except Skip as e:
        say("skipped: %s" % e)
        rc = 77
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        say("error: %s" % e)
    finally:
        ch.cleanup(keep=rc not in (0, 77) or a.keep)
    if rc != 77:
        say("%s (seed %d)" % ("PASSED" if rc == 0 else "FAILED", a.seed))
    return rc


if __name__ == "__main__":
    sys.exit(main())
