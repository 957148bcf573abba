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
    # bex-ps dump (C) writes the same files
    assert_c_dump_matches(snapdir / "ps-shard0-replica0.snap", tmp_path / "cdump", out)
    # a changed byte, a cut file, something else: a clear ValueError
    data = (snapdir / "ps-shard0-replica0.snap").read_bytes()
    bad = bytearray(data)
    bad[40] ^= 1
    for b, msg in ((bytes(bad), "checksum"), (data[:-7], "checksum"), (b"hello" * 20, "magic")):
        with pytest.raises(ValueError, match=msg):
            bex.snapshot.parse(b)


def bex_ps_dump(snap, out):
    return subprocess.run([os.environ["BEX_PS"], "dump", str(snap), str(out)], capture_output=True,
                          text=True)


def assert_c_dump_matches(snap, out, want_dir):
    """bex-ps dump SNAPSHOT DIR (tools/ps/dump.c, issue 28 item 6) writes the
    .npy files bex.snapshot's dump writes, array for array."""
    r = bex_ps_dump(snap, out)
    assert r.returncode == 0, r
    names = sorted(os.listdir(want_dir))
    assert sorted(os.listdir(out)) == names and names
    for name in names:
        got, want = np.load(out / name), np.load(want_dir / name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)


def synthetic_snapshot(tables):
    """A version-1 snapshot file's bytes: tables [(id, dim, optimizer, keys,
    values (n, dim or 2 dim))], its BLAKE2b-256 checksum at the end."""
    import hashlib
    import struct
    b = b"BEXPSNAP" + struct.pack("<4I", 1, 0, 1, len(tables))
    for tid, dim, opt, keys, vals in tables:
        b += struct.pack("<4I", tid, dim, opt, len(keys))
        for k, v in zip(keys, vals):
            b += struct.pack("<Q", k) + np.asarray(v, "<f4").tobytes()
    return b + hashlib.blake2b(b, digest_size=32).digest()


def test_c_dump_of_adagrad_and_empty_tables_and_bad_files(tmp_path):
    rng = np.random.default_rng(7)
    vals = rng.standard_normal((5, 6)).astype(np.float32)
    data = synthetic_snapshot([(3, 3, 2, [9, 1, 2**63 + 5, 4, 7], vals), (8, 4, 1, [], []),
                               (12, 2, 1, [77], [[1.5, -2.5]])])
    snap = tmp_path / "s.snap"
    snap.write_bytes(data)
    py = tmp_path / "py"
    r = subprocess.run([sys.executable, "-m", "bex.snapshot", "dump", str(snap), str(py)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r
    assert_c_dump_matches(snap, tmp_path / "c", py)
    acc = np.load(tmp_path / "c" / "table3_accumulators.npy")
    np.testing.assert_array_equal(acc, vals[:, 3:])
    assert np.load(tmp_path / "c" / "table8_rows.npy").shape == (0, 4)
    # a changed byte, a cut file, not a snapshot: refused, nothing written
    bad = bytearray(data)
    bad[40] ^= 1
    for i, (b, msg) in enumerate(((bytes(bad), "checksum"), (data[:-7], "checksum"),
                                  (b"hello" * 20, "magic"))):
        p = tmp_path / f"bad{i}.snap"
        p.write_bytes(b)
        r = bex_ps_dump(p, tmp_path / f"out{i}")
        assert r.returncode != 0 and msg in r.stderr, r
        assert not (tmp_path / f"out{i}").exists()
    # a table running past the end (checksum right): refused, nothing written
    cut = synthetic_snapshot([(3, 3, 2, [9], vals[:1])])
    cut = cut[:-32 - 8]
    import hashlib
    cut += hashlib.blake2b(cut, digest_size=32).digest()
    (tmp_path / "cut.snap").write_bytes(cut)
    r = bex_ps_dump(tmp_path / "cut.snap", tmp_path / "outcut")
    assert r.returncode != 0 and "past the end" in r.stderr, r
    assert not (tmp_path / "outcut").exists()
    assert bex_ps_dump(snap, "").returncode != 0
