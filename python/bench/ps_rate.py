# SPDX-License-Identifier: Apache-2.0
"""ps_rate.py: calls a second of bex.ps.Client's waiting fetch or push of
ROWS rows of DIM floats, the same loop as ps_rate.c (python/bench/run).
fetch0 and push0: on an array of bex.empty (without a copy).
    ps_rate.py CLUSTER fetch|push|fetch0|push0 ROWS DIM SECONDS
BEX_RATE_CALLS=N: exactly N calls instead of SECONDS (python/bench/counts)."""
import os
import resource
import sys
import time

import numpy as np

import bex.ps


def main(cluster, op, rows, dim, secs):
    n, dim, secs = int(rows), int(dim), float(secs)
    keys = np.arange(n, dtype=np.uint64) * np.uint64(7919)
    with bex.ps.Client(cluster, dims={1: dim}, timeout_ms=10000) as c:
        buf = c.empty((n, dim)) if op.endswith("0") else np.empty((n, dim), np.float32)
        buf[:] = 1e-6
        push = op.startswith("push")
        call = (lambda: c.push(1, keys, buf)) if push else (lambda: c.fetch(1, keys, buf))
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        calls, t0, cpu0 = 0, time.monotonic(), time.process_time()
        t = t0
        most = int(os.environ.get("BEX_RATE_CALLS", "-1"))
        while (calls < most) if most >= 0 else (t - t0 < secs):
            call()
            calls += 1
            if calls % 16 == 0:
                t = time.monotonic()
        t = time.monotonic()
        cpu = (time.process_time() - cpu0) * 1e6 / calls
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        user = (ru1.ru_utime - ru0.ru_utime) * 1e6 / calls
        sys_ = (ru1.ru_stime - ru0.ru_stime) * 1e6 / calls
        if op.endswith("0"):
            assert c.stats()["zero_copy"] == calls, (c.stats(), calls)
        print(f"calls_per_sec {calls / (t - t0):.1f} cpu_us_per_call {cpu:.2f} "
              f"user_us {user:.2f} sys_us {sys_:.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
