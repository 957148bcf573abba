# SPDX-License-Identifier: Apache-2.0
"""bex.snapshot: bex-ps's snapshots as numpy arrays, and their dump."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import bex.ps
import bex.snapshot
from conftest import DIM, TABLE, Cluster
from test_ps import client, grads_for


def test_snapshot_holds_the_rows_the_client_saw(tmp_path):
    snapdir = tmp_path / "snap"
    snapdir.mkdir()
    c = Cluster(str(tmp_path), 2, 1, ["--snapshot-dir", str(snapdir)])
    keys = np.arange(100, 140, dtype=np.uint64)
    try:
        with client(c) as ps:
            ps.push(TABLE, keys, grads_for(len(keys)))
            want = ps.fetch(TABLE, keys)
        c.kill(0, signal.SIGTERM)  # writes the snapshots, exits 0
        assert c.procs[0].wait(20) == 0
    finally:
        c.stop()
    got = {}
    for shard in range(2):
        snap = bex.snapshot.read(snapdir / f"ps-shard{shard}-replica0.snap")
        assert (snap.shard, snap.n_shards) == (shard, 2)
        t = snap.tables[TABLE]
        assert t.dim == DIM and t.optimizer == "sgd" and t.accumulators is None
        assert t.keys.dtype == np.uint64 and t.rows.dtype == np.float32
        assert all(bex.ps.key_shard(int(k), 2) == shard for k in t.keys)
        got.update(zip(t.keys.tolist(), t.rows))
    assert sorted(got) == keys.tolist()
    np.testing.assert_array_equal(np.stack([got[k] for k in keys.tolist()]), want)
    # the dump: .npy files a trainer loads back
    out = tmp_path / "npy"
    r = subprocess.run([sys.executable, "-m", "bex.snapshot", "dump",
                        str(snapdir / "ps-shard0-replica0.snap"), str(out)],
                       capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r
    k0 = np.load(out / f"table{TABLE}_keys.npy")
    r0 = np.load(out / f"table{TABLE}_rows.npy")
    np.testing.assert_array_equal(r0, np.stack([got[k] for k in k0.tolist()]))
    # a changed byte, a cut file, something else: a clear ValueError
    data = (snapdir / "ps-shard0-replica0.snap").read_bytes()
    bad = bytearray(data)
    bad[40] ^= 1
    for b, msg in ((bytes(bad), "checksum"), (data[:-7], "checksum"), (b"hello" * 20, "magic")):
        with pytest.raises(ValueError, match=msg):
            bex.snapshot.parse(b)
