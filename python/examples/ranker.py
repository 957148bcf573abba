# SPDX-License-Identifier: Apache-2.0
"""ranker.py: a ranking service whose embeddings live in bex-ps.

An RPC server (service 8, method 1): a request is candidate ids (uint64,
little-endian); the answer is one float32 score per id, the dot product
of its embedding row (Fetched from bex-ps) with a user vector. Handlers
run on worker threads, off bex's I/O thread.
    python3 ranker.py CLUSTER_FILE [IP:PORT] [DIM]   prints "listening on IP:PORT"
    python3 ranker.py --query IP:PORT ID...           prints "ID SCORE" lines, best first
BEX_LOCAL_ADDR and BEX_TRANSPORT (the environment's; 127.0.0.1, tcp) are its
clients' and server's local_addr and transport."""
import os
import signal
import sys

import numpy as np

import bex.ps
import bex.rpc

SERVICE, RANK, TABLE = 8, 1, 1
NET = {"local_addr": os.environ.get("BEX_LOCAL_ADDR", "127.0.0.1"),
       "transport": os.environ.get("BEX_TRANSPORT", "tcp")}


def serve(cluster, addr="127.0.0.1:0", dim=16):
    dim = int(dim)
    user = np.linspace(-1, 1, dim, dtype=np.float32)
    with bex.ps.Client(cluster, dims={TABLE: dim}, timeout_ms=5000, **NET) as ps, \
            bex.rpc.Server(workers=4, **NET) as srv:
        def rank(body):
            ids = np.frombuffer(body, np.uint64)
            return (ps.fetch(TABLE, ids) @ user).astype(np.float32).tobytes()
        srv.register(SERVICE, RANK, rank)
        print("listening on", srv.start(addr), flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})


def query(addr, *ids):
    keys = np.array([int(i) for i in ids], np.uint64)
    with bex.rpc.Channel([addr], timeout_ms=5000, connect_timeout_ms=2000, **NET) as ch:
        scores = np.frombuffer(ch.call(SERVICE, RANK, keys.tobytes()), np.float32)
    for i in np.argsort(-scores):
        print(keys[i], f"{scores[i]:+.6f}")


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["--query"]:
            query(*sys.argv[2:])
        else:
            serve(*sys.argv[1:])
    except bex.Error as e:
        sys.exit(f"ranker: {e}")
