# SPDX-License-Identifier: Apache-2.0
"""What a waiting Push costs the Python process beyond the C client's
(issue 28 item 1): system calls per call counted by strace over two loops
of different lengths, the difference per call (start-up cancels)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import DIM, NET, SCALE, TABLE

LOOP = """
import sys
import numpy as np
import bex.ps
path, n, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
keys = np.array([k for k in range(4 * rows) if bex.ps.key_shard(k, 2) == 0][:rows],
                np.uint64)  # shard 0 of 2: one part, from the array
with bex.ps.Client(path, dims={%d: %d}, timeout_ms=%d, **%r) as c:
    g = c.empty((rows, %d))
    g[:] = 1e-6
    for _ in range(n):
        c.push(%d, keys, g)
"""


def strace_loop(path, n, opts, out, rows=16):
    """strace (opts, into out) of a process making n Pushes of rows rows."""
    if not shutil.which("strace"):
        pytest.fail("strace is needed (scripts/deps installs it)")
    prog = LOOP % (TABLE, DIM, 30000 * SCALE, NET, DIM, TABLE)  # no deadline tested
    subprocess.run(["strace", "-f", *opts, "-o", out, sys.executable, "-c", prog, path, str(n),
                    str(rows)], check=True, env=dict(os.environ))


def getpid_calls(path, n):
    """getpid system calls of a process making n Pushes."""
    out = os.path.join(os.path.dirname(path), f"strace.{n}")
    strace_loop(path, n, ["-c", "-e", "trace=getpid"], out)
    with open(out) as f:
        rows = [line.split() for line in f if line.rstrip().endswith("getpid")]
    return int(rows[0][3]) if rows else 0


@pytest.mark.native_only
def test_push_makes_no_getpid_call(cluster):
    """The fork check of every call asked the kernel for the process id:
    one system call per call that the C client does not make."""
    few, many = getpid_calls(cluster.path, 10), getpid_calls(cluster.path, 110)
    assert (many - few) / 100 < 0.05, (few, many)


def cond_wait(call):
    """Whether a futex call of strace's is a condition-variable wait with
    no timeout (pthread_cond_wait: FUTEX_WAIT_BITSET_PRIVATE, NULL): not a
    pthread_join (a shared futex on the thread's id, as many as the
    threads not yet gone at exit: 3 to 5 at load 12-15), nor a timed wait
    (the interpreter's GIL hand-off, pthread_cond_timedwait)."""
    return "FUTEX_WAIT_BITSET_PRIVATE" in call and call.split(",")[3].strip() == "NULL"


def main_cond_waits(path, n):
    """Condition-variable waits (cond_wait) of the calling thread (the
    process's first: its id is the pid) of a process making n Pushes."""
    out = os.path.join(os.path.dirname(path), f"futex.{n}")
    strace_loop(path, n, ["-e", "trace=futex"], out, rows=1024)
    with open(out) as f:
        lines = [line.split(None, 1) for line in f]
    main = lines[0][0]  # the first line is the first thread's
    return sum(1 for tid, call in lines if tid == main and cond_wait(call))


@pytest.mark.native_only
def test_push_wakes_its_caller_once(cluster):
    """A waiting Push from an array returned to its caller when its answer
    came, and the caller then slept again on the array's condition until
    the transport let the array go: two wake-ups per call where one does
    (the call now completes once the array is back)."""
    few, many = main_cond_waits(cluster.path, 5), main_cond_waits(cluster.path, 55)
    assert many - few <= 2, (few, many)  # none per call (2: a start-up's spread)
