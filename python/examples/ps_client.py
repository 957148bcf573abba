# SPDX-License-Identifier: Apache-2.0
"""ps_client.py: examples/ps_client.c in Python: Fetch rows of table 1
(dim 4, SGD, lr 0.5) from bex-ps, Push gradients, Fetch again, check.
    python3 ps_client.py CLUSTER_FILE      prints the rows, then "update ok"."""
import sys

import numpy as np

import bex.ps

keys = np.array([42, 1000, 77777], np.uint64)
try:
    with bex.ps.Client(sys.argv[1], dims={1: 4}, timeout_ms=5000) as ps:
        before = ps.fetch(1, keys)
        grads = (0.1 * np.arange(1, 13, dtype=np.float32)).reshape(3, 4)
        ps.push(1, keys, grads)  # applied once on every replica
        after = ps.fetch(1, keys)
except bex.Error as e:
    sys.exit(f"ps_client: {e}")
for what, rows in (("fetched", before), ("updated", after)):
    for k, r in zip(keys, rows):
        print(what, "key", k, " ".join(f"{x:+.4f}" for x in r))
if not np.allclose(after, before - 0.5 * grads, atol=1e-4):
    sys.exit("ps_client: the rows do not show w -= 0.5 * grad (is bex-ps's table 1:4:sgd:0.5?)")
print("update ok: w -= 0.5 * grad on 3 rows")
