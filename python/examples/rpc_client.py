# SPDX-License-Identifier: Apache-2.0
"""rpc_client.py: examples/rpc_client.c in Python: call "upper" once.
    python3 rpc_client.py IP:PORT TEXT   prints TEXT in upper case; exit 1
with the reason on stderr when the call fails."""
import sys

import bex.rpc

try:
    with bex.rpc.Channel([sys.argv[1]], timeout_ms=2000) as ch:
        print(ch.call(7, 1, sys.argv[2].encode()).decode())
except (bex.Error, ValueError) as e:
    sys.exit(f"rpc_client: {e}")
