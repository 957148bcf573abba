# SPDX-License-Identifier: Apache-2.0
"""rpc_server.py: examples/rpc_server.c in Python: service 7, method 1
("upper") answers its request's text in upper case.
    python3 rpc_server.py [IP:PORT]      (default 127.0.0.1:0: bex picks)
prints "listening on IP:PORT", serves until SIGINT or SIGTERM."""
import signal
import sys

import bex.rpc

with bex.rpc.Server() as srv:
    srv.register(7, 1, lambda body: body.upper())  # runs on a worker thread
    print("listening on", srv.start(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:0"),
          flush=True)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
