# SPDX-License-Identifier: Apache-2.0
"""bex.ps.Client's asynchronous calls: concurrent.futures and asyncio."""
import asyncio
import concurrent.futures
import errno
import signal
import threading
import time

import numpy as np
import pytest

import bex
import bex.ps
from conftest import DIM, LR, SCALE, TABLE
from test_ps import client, grads_for, warm


def test_futures_overlap_and_match_the_waiting_calls(cluster):
    with client(cluster) as c:
        batches = [np.arange(i * 50, i * 50 + 20, dtype=np.uint64) for i in range(32)]
        futs = [c.fetch_async(TABLE, k) for k in batches]  # all out at once
        assert all(isinstance(f, concurrent.futures.Future) for f in futs)
        got = [f.result(10 * SCALE) for f in futs]
        for k, rows in zip(batches, got):
            np.testing.assert_array_equal(rows, c.fetch(TABLE, k))
        g = grads_for(20)
        pushes = [c.push_async(TABLE, k, g) for k in batches[:8]]
        assert [f.result(10 * SCALE) for f in pushes] == [None] * 8
        for k, before in zip(batches[:8], got):
            np.testing.assert_allclose(c.fetch(TABLE, k), before - LR * g, atol=1e-5)
        out = np.zeros((20, DIM), np.float32)
        assert c.fetch_async(TABLE, batches[9], out).result(10 * SCALE) is out
        np.testing.assert_array_equal(out, got[9])


def test_future_errors(cluster):
    key = np.array([11], np.uint64)
    with client(cluster, timeout_ms=300) as c:
        warm(c, key)
        with pytest.raises(TypeError, match="float32"):  # bad arguments: at the call
            c.fetch_async(TABLE, key, np.zeros((1, DIM), np.float64))
        with pytest.raises(ValueError, match="shape"):
            c.push_async(TABLE, key, np.zeros((2, DIM), np.float32))
        cluster.kill(0, signal.SIGSTOP)
        f = c.fetch_async(TABLE, key)
        assert not f.cancel()  # running: bex cannot take it back
        e = f.exception(10 * SCALE)
        assert isinstance(e, bex.Error) and e.errno == errno.ETIMEDOUT
        assert e.shard == bex.ps.key_shard(11, 2)
        e = c.push_async(TABLE, key, np.ones((1, DIM), np.float32)).exception(10 * SCALE)
        assert isinstance(e, bex.PushError) and e.errno == errno.ETIMEDOUT
        assert e.failed and e.failed[0][1] == cluster.addrs[e.failed[0][0]][0]
        cluster.kill(0, signal.SIGCONT)


def test_close_fails_outstanding_calls(cluster):
    key = np.array([11], np.uint64)
    c = client(cluster, timeout_ms=30000 * SCALE)
    c.fetch(TABLE, key)
    cluster.kill(0, signal.SIGSTOP)
    futs = [c.fetch_async(TABLE, key) for _ in range(4)]
    futs.append(c.push_async(TABLE, key, np.ones((1, DIM), np.float32)))
    time.sleep(0.1)
    t0 = time.monotonic()
    c.close()
    assert all(f.done() for f in futs)  # set before close returned
    assert time.monotonic() - t0 < 10 * SCALE
    for f in futs:
        assert f.exception().errno == errno.ECANCELED, f.exception()
    with pytest.raises(ValueError, match="closed"):
        c.fetch_async(TABLE, key)
    cluster.kill(0, signal.SIGCONT)


def test_asyncio_does_not_block_the_loop(cluster):
    key = np.array([11], np.uint64)

    async def main(c):
        rows = await c.afetch(TABLE, key)
        await c.apush(TABLE, key, np.ones((1, DIM), np.float32))
        np.testing.assert_allclose(await c.afetch(TABLE, key), rows - LR, atol=1e-5)
        many = await asyncio.gather(*(c.afetch(TABLE, np.array([k], np.uint64))
                                      for k in range(16)))
        assert len(many) == 16
        cluster.kill(0, signal.SIGSTOP)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)
        t = asyncio.ensure_future(ticker())
        with pytest.raises(bex.Error) as e:
            await c.afetch(TABLE, key)
        t.cancel()
        assert e.value.errno == errno.ETIMEDOUT
        assert ticks > 20, f"the event loop ran {ticks} times during a 1 s wait"
        cluster.kill(0, signal.SIGCONT)

    # below bex's keepalive timeout (2 s): the stopped server's call ends
    # by its deadline (ETIMEDOUT), not by the connection's (EIO)
    with client(cluster, timeout_ms=1000) as c:
        asyncio.run(main(c))


def test_threads_share_async_calls(cluster):
    with client(cluster) as c:
        errors = []

        def worker(i):
            try:
                keys = np.arange(i * 1000, i * 1000 + 8, dtype=np.uint64)
                for _ in range(10):
                    before = c.fetch_async(TABLE, keys).result(10 * SCALE)
                    c.push_async(TABLE, keys, np.ones((8, DIM), np.float32)).result(10 * SCALE)
                    np.testing.assert_allclose(c.fetch(TABLE, keys), before - LR, atol=1e-5)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors


def test_dispatcher_ends_when_idle_and_client_is_freed(cluster):
    import gc
    import weakref
    c = client(cluster)
    c.fetch_async(TABLE, np.array([1], np.uint64)).result(10 * SCALE)
    deadline = time.monotonic() + 5 * SCALE
    while c._dispatcher is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c._dispatcher is None
    r = weakref.ref(c)
    del c
    gc.collect()
    assert r() is None  # nothing keeps an idle client alive
