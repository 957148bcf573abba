# SPDX-License-Identifier: Apache-2.0
"""bex.rpc: RPC channels and servers (include/bex/rpc.h), bodies as bytes.

    srv = bex.rpc.Server()
    srv.register(7, 1, lambda body: body.upper())
    addr = srv.start()                        # "127.0.0.1:PORT"
    ch = bex.rpc.Channel([addr])
    ch.call(7, 1, b"hello bex")               # b"HELLO BEX"
"""
import asyncio
import threading
import traceback

from . import _bex
from ._bex import Error
from ._dispatch import Dispatch

__all__ = ["Channel", "Server", "Error"]


class Channel(_bex.RpcChannel, Dispatch):
    """A channel to a service's endpoints ("ip:port" strings).

    Channel(endpoints, *, local_addr="127.0.0.1", transport="tcp",
            timeout_ms=0, max_attempts=0, connect_timeout_ms=0,
            attempt_timeout_ms=0)  (bex_rpc_channel_config; 0: default)

    call(service, method, body=b"", timeout_ms=0) waits (GIL released) and
    returns the answer's bytes; call_async returns a concurrent.futures
    Future, acall is its asyncio coroutine. A failed call raises bex.Error
    (errno, bex_error, service, method, and body: the server's error body
    or None). The body is copied into bex's memory. Any Python thread may
    call; close() fails outstanding calls with ECANCELED."""

    def __init__(self, endpoints, **kw):
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        super().__init__(list(endpoints), **kw)
        self._dispatch_init("bex-rpc-dispatch")

    def call(self, service, method, body=b"", timeout_ms=0):
        return super().call(service, method, body, timeout_ms)

    def call_async(self, service, method, body=b"", timeout_ms=0):
        return self._start(self._start_call, service, method, body, timeout_ms)

    def _start_call(self, service, method, body, timeout_ms, fut):
        self._call_async(service, method, body, fut, timeout_ms)

    async def acall(self, service, method, body=b"", timeout_ms=0):
        return await asyncio.wrap_future(self.call_async(service, method, body, timeout_ms))

    def close(self):
        super().close()
        self._dispatch_join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Server(_bex.RpcServer):
    """An RPC server whose handlers are Python functions.

    Server(*, local_addr="127.0.0.1", transport="tcp", queue_max=1024,
           workers=1)

    register(service, method, fn, write=False): fn(body: bytes) returns the
    answer (bytes-like or None); raising bex.Error (or OSError) answers its
    errno, any other exception EREMOTEIO (and prints the traceback).
    start(addr="127.0.0.1:0") listens and returns the address bound.

    Handlers run on the server's worker threads, never on bex's I/O
    thread: bex queues each request (at most queue_max waiting; one more is
    answered EAGAIN at once, which the caller may retry), so a slow handler
    cannot stall bex. close() stops: new requests are refused, queued ones
    answered ECANCELED, the workers' answers awaited."""

    def __init__(self, *, workers=1, **kw):
        super().__init__(**kw)
        self._handlers = {}
        self._workers = []
        self._n_workers = int(workers)
        if self._n_workers < 1:
            raise ValueError("workers must be >= 1")

    def register(self, service, method, fn, write=False):
        super().register(service, method, bool(write))
        self._handlers[(service, method)] = fn

    def start(self, addr="127.0.0.1:0"):
        bound = self.listen(addr)
        for i in range(self._n_workers):
            t = threading.Thread(target=self._work, daemon=True, name=f"bex-rpc-worker-{i}")
            t.start()
            self._workers.append(t)
        self.addr = bound
        return bound

    def _work(self):
        while True:
            nxt = self._next()
            if nxt is None:
                return
            req, service, method, body = nxt
            try:
                out = self._handlers[(service, method)](body)
                req.reply(0, b"" if out is None else out)
            except OSError as e:
                req.reply(e.errno or 5, b"")
            except Exception:  # noqa: BLE001 - the caller gets EREMOTEIO
                traceback.print_exc()
                req.reply(121, b"")  # EREMOTEIO
            finally:
                del req  # unanswered (reply itself failed): ECANCELED

    def close(self):
        super().close()
        me = threading.current_thread()
        for t in self._workers:
            if t is not me:
                t.join()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
