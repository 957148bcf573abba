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
path, n = sys.argv[1], int(sys.argv[2])
keys = np.arange(16, dtype=np.uint64) * np.uint64(2)  # shard 0 of 2
with bex.ps.Client(path, dims={%d: %d}, timeout_ms=%d, **%r) as c:
    g = c.empty((16, %d))
    g[:] = 1e-6
    for _ in range(n):
        c.push(%d, keys, g)
"""


def getpid_calls(path, n):
    """getpid system calls of a process making n Pushes."""
    if not shutil.which("strace"):
        pytest.fail("strace is needed (scripts/deps installs it)")
    out = os.path.join(os.path.dirname(path), f"strace.{n}")
    prog = LOOP % (TABLE, DIM, 3000 * SCALE, NET, DIM, TABLE)
    subprocess.run(["strace", "-f", "-c", "-e", "trace=getpid", "-o", out, sys.executable, "-c",
                    prog, path, str(n)], check=True, env=dict(os.environ))
    with open(out) as f:
        rows = [line.split() for line in f if line.rstrip().endswith("getpid")]
    return int(rows[0][3]) if rows else 0


@pytest.mark.native_only
def test_push_makes_no_getpid_call(cluster):
    """The fork check of every call asked the kernel for the process id:
    one system call per call that the C client does not make."""
    few, many = getpid_calls(cluster.path, 10), getpid_calls(cluster.path, 110)
    assert (many - few) / 100 < 0.05, (few, many)
