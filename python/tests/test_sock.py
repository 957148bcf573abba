# SPDX-License-Identifier: Apache-2.0
"""bex.sock: sockets' send and recv of bytes over TCP, and echo.py."""
import errno
import os
import subprocess
import sys
import threading
import time

import pytest

import bex
import bex.sock
from conftest import NET, SCALE, SERVER_IP, SERVER_NET

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")

# every test: bex's pools back to their baseline after it (conftest.py)
pytestmark = pytest.mark.usefixtures("pools_baseline")


def contexts():
    """A server context (on SERVER_IP) and a client one (on CLIENT_IP)."""
    return bex.sock.Context(**SERVER_NET), bex.sock.Context(**NET)


def test_messages_both_ways():
    sctx, ctx = contexts()
    with sctx, ctx:
        with sctx.listen(f"{SERVER_IP}:0") as lst:
            s = ctx.connect(lst.addr)
            peer = lst.accept(10 * SCALE)
            big = os.urandom(3 << 20)  # rendezvous-sized
            for m in (b"hello", b"", bytearray(b"ba"), memoryview(b"mv"), big):
                s.send(m)
            assert [peer.recv(10 * SCALE) for _ in range(5)] == [b"hello", b"", b"ba", b"mv", big]
            peer.send(b"back")
            assert s.recv(10 * SCALE) == b"back"
            with pytest.raises(bex.Error) as e:  # nothing more: a timeout
                s.recv(0.2)
            assert e.value.errno == errno.ETIMEDOUT
            with pytest.raises(TypeError):
                s.send("text")
            s.close()
            # the peer learns it: the error after the messages already in
            with pytest.raises(bex.Error) as e:
                peer.recv(10 * SCALE)
            assert e.value.errno != errno.ETIMEDOUT
            peer.close()
            with pytest.raises(ValueError, match="closed"):
                s.send(b"x")


def test_recv_releases_the_gil_and_threads():
    sctx, ctx = contexts()
    with sctx, ctx, sctx.listen(f"{SERVER_IP}:0") as lst:
        s = ctx.connect(lst.addr)
        peer = lst.accept(10 * SCALE)
        got = []
        t = threading.Thread(target=lambda: got.extend(peer.recv(10 * SCALE) for _ in range(100)))
        t.start()
        for i in range(100):
            s.send(b"%d" % i)
        t.join(20 * SCALE)
        assert got == [b"%d" % i for i in range(100)]
        s.close()
        peer.close()


def test_context_refuses_to_close_with_open_sockets_and_bad_input():
    sctx, ctx = contexts()
    lst = sctx.listen(f"{SERVER_IP}:0")
    s = ctx.connect(lst.addr)
    with pytest.raises(ValueError, match="first"):
        ctx.close()
    with pytest.raises(ValueError, match="first"):
        sctx.close()
    s.close()
    lst.close()
    ctx.close()
    sctx.close()
    with pytest.raises(ValueError, match="closed"):
        ctx.connect("127.0.0.1:1")
    sctx, ctx = contexts()
    with sctx, ctx:
        with pytest.raises(ValueError, match="ip:port"):
            ctx.connect("nowhere")
        # nobody listens: refused (port of a listener just closed)
        lst = sctx.listen(f"{SERVER_IP}:0")
        addr = lst.addr
        lst.close()
        with pytest.raises(bex.Error) as e:
            ctx.connect(addr, 5 * SCALE)
        assert e.value.errno in (errno.ECONNREFUSED, errno.ETIMEDOUT)


@pytest.mark.tcp_only
def test_example_echo():
    srv = subprocess.Popen([sys.executable, os.path.join(EXAMPLES, "echo.py"), "server",
                            "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        assert line.startswith("listening on "), line
        addr = line.split()[-1]
        run = [sys.executable, os.path.join(EXAMPLES, "echo.py"), "client", addr]
        r = subprocess.run(run + ["hello bex"], capture_output=True, text=True,
                           timeout=60 * SCALE)
        assert r.returncode == 0 and r.stdout == "echo: hello bex\n", r
        srv.kill()
        srv.wait()
        time.sleep(0.1)
        r = subprocess.run(run + ["again"], capture_output=True, text=True, timeout=60 * SCALE)
        assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith("echo: "), r
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
