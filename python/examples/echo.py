# SPDX-License-Identifier: Apache-2.0
"""echo.py: examples/echo.c in Python. A server sends every message back;
a client sends one and prints the answer.
    python3 echo.py server IP:PORT          (port 0: bex picks; prints it)
    python3 echo.py client IP:PORT MESSAGE  prints "echo: MESSAGE"; exit 1
with the reason on stderr when there is no answer."""
import sys
import threading

import bex.sock


def echo_back(s):
    with s:  # closed when the peer goes
        try:
            while True:
                s.send(s.recv())
        except bex.Error:
            pass


if len(sys.argv) == 3 and sys.argv[1] == "server":
    ctx = bex.sock.Context(sys.argv[2].rsplit(":", 1)[0])
    lst = ctx.listen(sys.argv[2])
    print("listening on", lst.addr, flush=True)
    while True:  # serve until killed
        threading.Thread(target=echo_back, args=(lst.accept(),), daemon=True).start()
elif len(sys.argv) == 4 and sys.argv[1] == "client":
    try:
        with bex.sock.Context() as ctx, ctx.connect(sys.argv[2]) as s:
            s.send(sys.argv[3].encode())
            print("echo:", s.recv(10).decode())
    except bex.Error as e:
        sys.exit(f"echo: {sys.argv[2]}: {e}")
else:
    sys.exit("usage: echo.py server IP:PORT | echo.py client IP:PORT MESSAGE")
