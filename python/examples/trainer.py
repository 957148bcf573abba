# SPDX-License-Identifier: Apache-2.0
"""trainer.py: a small PyTorch model whose embedding rows live in bex-ps.

Each step Fetches the rows of a batch's ids (the next batch's Fetch is
already out while this one computes), runs the model, and Pushes the
embedding rows' gradients back; the dense layer stays local (torch SGD).
The task: tell even ids from odd ones by their learned embeddings.
    python3 trainer.py CLUSTER_FILE [STEPS] [DIM] [KEY_BASE]
bex-ps must serve table 1 with rows of DIM floats (16), e.g.
    bex-ps --cluster CLUSTER_FILE --shard all --table 1:16:sgd:0.5
Its ids are KEY_BASE + 0..199 (0). BEX_LOCAL_ADDR and BEX_TRANSPORT (the
environment's; 127.0.0.1, tcp) are its client's local_addr and transport.
Prints the loss every 20 steps and "trained: loss A -> B"."""
import os
import sys

import numpy as np
import torch

import bex.ps

TABLE, BATCH, IDS = 1, 64, 200


NET = {"local_addr": os.environ.get("BEX_LOCAL_ADDR", "127.0.0.1"),
       "transport": os.environ.get("BEX_TRANSPORT", "tcp")}


def batches(rng, steps, base):
    for _ in range(steps):
        ids = rng.choice(IDS, BATCH, replace=False).astype(np.uint64)
        yield ids + np.uint64(base), torch.tensor((ids % 2).astype(np.float32))


def main(cluster, steps=200, dim=16, key_base=0):
    steps, dim = int(steps), int(dim)
    torch.manual_seed(0)
    dense = torch.nn.Linear(dim, 1)
    opt = torch.optim.SGD(dense.parameters(), lr=0.5)
    data = list(batches(np.random.default_rng(0), steps, int(key_base)))
    losses = []
    with bex.ps.Client(cluster, dims={TABLE: dim}, timeout_ms=5000, **NET) as ps:
        nxt = ps.fetch_async(TABLE, data[0][0])
        for i, (keys, labels) in enumerate(data):
            rows = nxt.result()
            if i + 1 < steps:  # overlap: the next batch's rows come meanwhile
                nxt = ps.fetch_async(TABLE, data[i + 1][0])
            emb = torch.from_numpy(rows).requires_grad_()  # the rows' memory, no copy
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                dense(emb).squeeze(1), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ps.push(TABLE, keys, emb.grad)  # the server applies SGD to the rows
            losses.append(loss.item())
            if i % 20 == 0:
                print(f"step {i} loss {loss.item():.4f}", flush=True)
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"trained: loss {first:.4f} -> {last:.4f}")
    return 0 if last < first else 1


if __name__ == "__main__":
    try:
        sys.exit(main(*sys.argv[1:]))
    except bex.Error as e:
        sys.exit(f"trainer: {e}")
