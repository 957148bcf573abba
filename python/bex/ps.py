# SPDX-License-Identifier: Apache-2.0
"""bex.ps: the parameter-server client (include/bex/ps.h)."""
import asyncio
import math
import weakref

import numpy

from . import _bex
from ._dispatch import Dispatch

__all__ = ["Client", "KEYS_MAX", "DIM_MAX", "key_shard", "empty"]

KEYS_MAX = _bex.PS_KEYS_MAX
DIM_MAX = _bex.PS_DIM_MAX
key_shard = _bex.ps_key_shard  # the shard of a key among n (bex_ps_key_shard)


def _as_buffer(x, writable=False):
    """x itself when it has the buffer protocol (numpy, memoryview, array),
    else a numpy view of it without a copy: a torch CPU tensor through
    .numpy() (writable, shares its memory), anything else with __dlpack__
    through numpy.from_dlpack (read-only)."""
    if isinstance(x, numpy.ndarray):
        return x
    try:
        memoryview(x).release()
        return x
    except TypeError:
        pass
    if hasattr(x, "__dlpack__"):
        if hasattr(x, "detach") and hasattr(x, "numpy"):  # torch: a writable view
            if getattr(x, "device", None) is not None and x.device.type != "cpu":
                raise TypeError(f"bex needs CPU memory, not a tensor on {x.device}")
            return x.detach().numpy()
        a = numpy.from_dlpack(x)
        if writable:
            raise ValueError("out must be writable (numpy.from_dlpack gave a read-only view)")
        return a
    return x  # the extension names what is wrong


_last_client = None  # a weakref to the client opened last (bex.empty's default)


def empty(shape, dtype=numpy.float32, *, client=None):
    """A numpy array of shape and dtype (uninitialized) on bex's registered
    memory (bex_ps_rows_alloc) of client's context (default: the client
    opened last, still open). fetch(out=a) lands rows in it straight from
    the wire and push(keys, a) sends from it, without a copy, when the
    keys come grouped by shard (each shard's keys one run; the first
    shard's part of a Push; else, and for an array of another client, they
    take the copying way). The array keeps its memory (and its
    client's context) alive; torch.from_numpy(a) shares it. Counted against
    the context's user_mem_max (bex.Error ENOBUFS past it)."""
    if client is None:
        client = _last_client() if _last_client is not None else None
        if client is None or client.closed:
            raise ValueError("bex.empty needs a bex.ps.Client: open one first or pass client=")
    shape = (int(shape),) if isinstance(shape, (int, numpy.integer)) else tuple(map(int, shape))
    if not shape or shape[0] < 1 or any(d < 1 for d in shape):
        raise ValueError(f"bex.empty: shape must be non-empty with dimensions >= 1, not {shape}")
    dtype = numpy.dtype(dtype)
    per_row = math.prod(shape[1:]) * dtype.itemsize
    mem = _bex.Memory(client, shape[0], max(1, -(-per_row // 4)))
    return numpy.frombuffer(mem, dtype, count=math.prod(shape)).reshape(shape)


class Client(_bex.PsClient, Dispatch):
    """A client of bex-ps shards.

    Client(cluster, dims=None, *, local_addr="127.0.0.1", transport="tcp",
           service="ps", locality=None, timeout_ms=0, n_shards=0,
           connect_timeout_ms=0, attempt_timeout_ms=0, max_attempts=0,
           io_threads=0)

    cluster: a cluster file (JSON, docs/configuration.md) or an etcd URL
    (http://host:port). dims: {table: dim}, the width of each table's rows
    (or pass dim= to each call). timeout_ms: a request's deadline (1000);
    the other fields are bex_ps_client_config's and bex_ctx_config's, zero
    meaning their default.

    Keys are uint64 (int64 without negative values is taken as is, for torch);
    rows and gradients are float32 of shape (len(keys), dim), C-contiguous.
    Anything with the buffer protocol works, and torch CPU tensors (their
    memory, no copy). A wrong type is a TypeError, a wrong shape or layout a
    ValueError; bex's errors raise bex.Error.

    fetch_async and push_async return a concurrent.futures.Future at once
    (already running: bex cannot take a request back); afetch and apush are
    their asyncio coroutines. Completions come from bex's I/O thread
    through a queue and an eventfd to a dispatcher thread of the client's,
    which sets the Futures (their callbacks run there: keep them short).

    Threads: a client may be shared by any number of Python threads; each
    call waits with the GIL released. close() (or leaving a with block)
    waits for the waiting calls in progress; outstanding asynchronous ones
    fail with ECANCELED. Processes: a client belongs to the
    process that made it; a forked child gets bex.ForkError from it and
    opens its own.
    """

    def __init__(self, cluster, dims=None, **kw):
        global _last_client
        super().__init__(str(cluster), **kw)
        _last_client = weakref.ref(self)
        self.dims = dict(dims or {})
        self._dispatch_init("bex-ps-dispatch")

    def empty(self, shape, dtype=numpy.float32):
        """bex.empty(shape, dtype, client=self): an array on this client's
        registered memory, for fetch and push without a copy."""
        return empty(shape, dtype, client=self)

    def _dim(self, table, dim, rows=None):
        if dim is None:
            dim = self.dims.get(table)
        if dim is None and rows is not None:
            shape = getattr(rows, "shape", None)
            if shape is not None and len(shape) == 2:
                dim = int(shape[1])
        if dim is None:
            raise ValueError(f"dim of table {table} unknown: pass dims={{{table}: DIM}} "
                             "to Client() or dim= to the call")
        return dim

    def _fetch_args(self, table, keys, out, dim):
        dim = self._dim(table, dim, out)
        keys = _as_buffer(keys)
        if out is None:
            n = keys.shape[0] if hasattr(keys, "shape") else len(memoryview(keys))
            out = numpy.empty((n, dim), numpy.float32)
            return dim, keys, out, out
        return dim, keys, out, _as_buffer(out, writable=True)

    def fetch(self, table, keys, out=None, *, dim=None):
        """The rows of keys of table, as float32 (len(keys), dim): into out
        when given (returned), else into a new numpy array."""
        dim, keys, out, target = self._fetch_args(table, keys, out, dim)
        self.fetch_into(table, dim, keys, target)
        return out

    def fetch_async(self, table, keys, out=None, *, dim=None):
        """fetch() started: a Future of the rows. keys and out must not
        change until it is done."""
        dim, keys, out, target = self._fetch_args(table, keys, out, dim)
        return self._start(self.fetch_async_into, table, dim, keys, target, out)

    def push_async(self, table, keys, grads, *, dim=None):
        """push() started: a Future of None, or of bex.PushError."""
        dim = self._dim(table, dim, grads)
        return self._start(super().push_async, table, dim, _as_buffer(keys),
                           _as_buffer(grads), None)

    async def afetch(self, table, keys, out=None, *, dim=None):
        """fetch() for asyncio: awaits without blocking the event loop."""
        return await asyncio.wrap_future(self.fetch_async(table, keys, out, dim=dim))

    async def apush(self, table, keys, grads, *, dim=None):
        """push() for asyncio."""
        return await asyncio.wrap_future(self.push_async(table, keys, grads, dim=dim))

    def push(self, table, keys, grads, *, dim=None):
        """Push grads (float32 (len(keys), dim)) for keys to every replica
        of their shards, once each. Raises bex.PushError naming the
        replicas that did not acknowledge."""
        dim = self._dim(table, dim, grads)
        super().push(table, dim, _as_buffer(keys), _as_buffer(grads))

    def close(self):
        """Wait for the waiting calls in progress, fail the asynchronous
        ones (ECANCELED, their Futures set before this returns), free."""
        super().close()
        self._dispatch_join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
