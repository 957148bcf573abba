# SPDX-License-Identifier: Apache-2.0
"""bex.empty: arrays on bex's registered memory, and fetch/push on them
without a copy (issue 28 item 3); the leak check's own test (item 8)."""
import numpy as np
import pytest

import bex
import bex.ps
import bex.sock
from bex import _bex
from conftest import DIM, LR, NET, SCALE, TABLE, pools_settled


def client(c, **kw):
    kw.setdefault("timeout_ms", 3000 * SCALE)
    return bex.ps.Client(c.path, dims={TABLE: DIM}, **NET, **kw)


def keys_on(shard, n, n_shards=2):
    keys = [k for k in range(1, 10 * n) if bex.ps.key_shard(k, n_shards) == shard][:n]
    return np.array(keys, np.uint64)


def test_fetch_and_push_on_bex_memory(cluster, pools_baseline):
    with client(cluster) as c:
        keys = keys_on(1, 16)
        want = c.fetch(TABLE, keys)  # the copying way
        a = bex.empty((16, DIM), np.float32)
        assert a.shape == (16, DIM) and a.dtype == np.float32 and a.flags.writeable
        z0 = c.stats()["zero_copy"]
        assert c.fetch(TABLE, keys, out=a) is a
        np.testing.assert_array_equal(a, want)
        g = c.empty((16, DIM))
        g[:] = 0.25
        c.push(TABLE, keys, g)
        assert c.stats()["zero_copy"] == z0 + 2
        np.testing.assert_allclose(c.fetch(TABLE, keys, out=a), want - LR * 0.25, atol=1e-6)
        # keys on both shards: the copying way, the same rows
        both = np.concatenate([keys_on(0, 4), keys_on(1, 4)])
        b = c.empty((8, DIM))
        c.fetch(TABLE, both, out=b)
        np.testing.assert_array_equal(b, c.fetch(TABLE, both))
        assert c.stats()["zero_copy"] == z0 + 3  # one more: a's fetch, not b's
        del a, g, b


@pytest.mark.native_only
def test_bad_input_on_bex_memory(cluster, pools_baseline):
    with client(cluster) as c:
        keys = keys_on(0, 4)
        a = c.empty((4, DIM))
        with pytest.raises(ValueError, match="shape"):  # a key count mismatch
            c.push(TABLE, keys[:3], a)
        with pytest.raises(ValueError, match="shape"):
            c.fetch(TABLE, np.concatenate([keys, keys]), out=a)
        with pytest.raises(TypeError, match="float32"):
            c.fetch(TABLE, keys, out=c.empty((4, DIM), np.float64))
        with pytest.raises(ValueError, match="shape"):
            c.empty((0, DIM))
        with pytest.raises(ValueError, match="rows"):
            c.empty((bex.ps.KEYS_MAX + 1, DIM))
        # a view that does not start at the array's start: the copying way
        c.fetch(TABLE, keys[:2], out=a[2:])
        np.testing.assert_array_equal(a[2:], c.fetch(TABLE, keys[:2]))
        with client(cluster) as other:  # another client's array: copied, right
            np.testing.assert_array_equal(other.fetch(TABLE, keys, out=a), c.fetch(TABLE, keys))
        del a
    with pytest.raises(ValueError, match="bex.ps.Client"):
        bex.empty((4, DIM))  # no open client


@pytest.mark.native_only
def test_array_outlives_its_client(cluster, pools_baseline):
    c = client(cluster)
    keys = keys_on(0, 4)
    a = c.empty((4, DIM))
    c.fetch(TABLE, keys, out=a)
    want = a.copy()
    c.close()
    assert _bex.pools()["contexts"] == pools_baseline["contexts"] + 1  # kept for a
    a[0, 0] += 1  # still memory
    np.testing.assert_array_equal(a[1:], want[1:])
    del a, c


@pytest.mark.torch
def test_torch_shares_bex_memory(cluster, pools_baseline):
    import torch
    with client(cluster) as c:
        keys = keys_on(1, 4)
        a = c.empty((4, DIM))
        t = torch.from_numpy(a)
        c.fetch(TABLE, keys, out=a)
        assert torch.equal(t, torch.from_numpy(c.fetch(TABLE, keys)))
        t.mul_(0)  # the same memory
        assert not a.any()
        del t, a


@pytest.mark.native_only
def test_leak_check_sees_a_context_left_open():
    base = _bex.pools()
    ctx = bex.sock.Context(**NET)
    ok, now = pools_settled(base, timeout=0.2)
    assert not ok and now["contexts"] == base["contexts"] + 1
    ctx.close()
    ok, now = pools_settled(base)
    assert ok, now
