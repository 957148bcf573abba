# SPDX-License-Identifier: Apache-2.0
"""bex.sock: bex sockets (include/bex/sock.h): messages of bytes.

    with bex.sock.Context() as ctx:
        lst = ctx.listen("127.0.0.1:0")            # lst.addr: "127.0.0.1:PORT"
        s = ctx.connect(lst.addr)
        s.send(b"hello")                            # one message
        peer = lst.accept()
        assert peer.recv() == b"hello"

A socket carries messages, not a byte stream: each send() is one recv()
at the peer. send copies the bytes once into bex's registered memory
(bex sends from there without a copy); recv returns each message as
bytes. Calls wait with the GIL released; bex's I/O thread never takes it.
A failed socket raises bex.Error from recv (the messages that arrived
before come first) and send. Close sockets and listeners before their
context (with blocks do); in a forked child they raise bex.ForkError.
"""
from . import _bex

__all__ = ["Context", "Listener"]


class Listener:
    """Sockets peers open: accept(timeout=None) takes the next (bex.Error
    ETIMEDOUT when the timeout passes); at most accept_max wait to be
    accepted, a peer's socket past them is closed."""

    def __init__(self, impl, addr):
        self._impl, self.addr = impl, addr

    def accept(self, timeout=None):
        return self._impl.accept(-1 if timeout is None else float(timeout))

    def close(self):
        self._impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Context(_bex.SockContext):
    """A bex context (its I/O thread, memory, connections):
    Context(local_addr="127.0.0.1", transport="tcp")."""

    def connect(self, addr, timeout=10.0):
        """A socket to a listener at "ip:port", connected (bex.Error when
        refused or not up within timeout seconds)."""
        return super().connect(addr, float(timeout))

    def listen(self, addr="127.0.0.1:0", accept_max=128):
        impl, bound = self._listen(addr, accept_max)
        return Listener(impl, bound)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
