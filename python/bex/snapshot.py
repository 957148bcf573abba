# SPDX-License-Identifier: Apache-2.0
"""bex-ps snapshots as numpy arrays (docs/protocol.md, "Snapshot file").

    snap = bex.snapshot.read("snap/ps-shard0-replica0.snap")
    t = snap.tables[1]            # t.keys: uint64 (n,), t.rows: float32 (n, dim),
                                  # t.accumulators: Adagrad's (n, dim) or None

    python3 -m bex.snapshot dump FILE DIR   # DIR/table<ID>_keys.npy, _rows.npy
                                            # (and _accumulators.npy for Adagrad)

The checksum (BLAKE2b-256 of everything before it) is verified first; a
file that does not parse whole raises ValueError naming what is wrong and
at which byte. The ids of the Pushes applied (after the tables) are not
decoded: a trainer inspects or exports its embeddings."""
import hashlib
import os
import struct
import sys
from dataclasses import dataclass

import numpy as np

MAGIC = b"BEXPSNAP"
VERSIONS = (1, 2, 3, 4)  # 4: the replication position after the ids (not read)
OPTIMIZERS = {1: "sgd", 2: "adagrad"}


@dataclass
class Table:
    id: int
    dim: int
    optimizer: str
    keys: np.ndarray
    rows: np.ndarray
    accumulators: object  # np.ndarray for Adagrad, else None


@dataclass
class Snapshot:
    version: int
    shard: int
    n_shards: int
    tables: dict


def _u32s(data, off, n, what):
    if off + 4 * n > len(data):
        raise ValueError(f"snapshot: {what} at byte {off} past the end ({len(data)} bytes)")
    return struct.unpack_from(f"<{n}I", data, off), off + 4 * n


def _table(data, off):
    (tid, dim, opt, n), off = _u32s(data, off, 4, "table header")
    if opt not in OPTIMIZERS or not 1 <= dim <= 4096:
        raise ValueError(f"snapshot: table {tid} at byte {off - 16}: dim {dim}, optimizer {opt}")
    cols = dim * (2 if opt == 2 else 1)
    rec = np.dtype([("key", "<u8"), ("v", "<f4", (cols,))])
    if off + n * rec.itemsize > len(data):
        raise ValueError(f"snapshot: table {tid}: {n} rows at byte {off} past the end")
    recs = np.frombuffer(data, rec, n, off)
    keys = recs["key"].copy()
    v = recs["v"].reshape(n, cols)
    rows = np.ascontiguousarray(v[:, :dim])
    acc = np.ascontiguousarray(v[:, dim:]) if opt == 2 else None
    if len(np.unique(keys)) != n:
        raise ValueError(f"snapshot: table {tid}: a key appears twice")
    return Table(tid, dim, OPTIMIZERS[opt], keys, rows, acc), off + n * rec.itemsize


def parse(data):
    """A Snapshot from a file's bytes."""
    if len(data) < 8 + 16 + 32 or data[:8] != MAGIC:
        raise ValueError("snapshot: not a bex-ps snapshot (no BEXPSNAP magic)")
    body, digest = data[:-32], data[-32:]
    if hashlib.blake2b(body, digest_size=32).digest() != digest:
        raise ValueError("snapshot: checksum mismatch (corrupt or truncated file)")
    (version, shard, n_shards, n_tables), off = _u32s(body, 8, 4, "header")
    if version not in VERSIONS:
        raise ValueError(f"snapshot: version {version}, this reader knows {VERSIONS}")
    tables = {}
    for _ in range(n_tables):
        t, off = _table(body, off)
        if t.id in tables:
            raise ValueError(f"snapshot: table {t.id} twice")
        tables[t.id] = t
    return Snapshot(version, shard, n_shards, tables)


def read(path):
    with open(path, "rb") as f:
        return parse(f.read())


def dump(path, outdir):
    """Write each table's keys, rows (and accumulators) as .npy into outdir;
    returns the files written."""
    snap = read(path)
    os.makedirs(outdir, exist_ok=True)
    out = []
    for t in snap.tables.values():
        for name, arr in (("keys", t.keys), ("rows", t.rows), ("accumulators", t.accumulators)):
            if arr is not None:
                p = os.path.join(outdir, f"table{t.id}_{name}.npy")
                np.save(p, arr)
                out.append(p)
    return out


def main(argv):
    if len(argv) != 3 or argv[0] != "dump":
        sys.exit("usage: python3 -m bex.snapshot dump FILE DIR")
    try:
        for p in dump(argv[1], argv[2]):
            print(p)
    except (OSError, ValueError) as e:
        sys.exit(f"bex.snapshot: {argv[1]}: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
