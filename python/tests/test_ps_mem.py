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
        s = c.stats()
        assert s["zero_copy"] == z0 + 2
        # one replica a shard: no Push is kept for another
        assert (s["push_kept"], s["push_resent"], s["push_dropped"], s["push_held"]) == (0, 0, 0, 0)
        np.testing.assert_allclose(c.fetch(TABLE, keys, out=a), want - LR * 0.25, atol=1e-6)
        # keys on both shards, not grouped by shard: the copying way
        mixed = np.array([keys_on(0, 4)[0], keys_on(1, 4)[0], keys_on(0, 4)[1]], np.uint64)
        m = c.empty((3, DIM))
        c.fetch(TABLE, mixed, out=m)
        np.testing.assert_array_equal(m, c.fetch(TABLE, mixed))
        assert c.stats()["zero_copy"] == z0 + 3  # one more: a's fetch, not m's
        del a, g, m


def test_multi_shard_on_bex_memory(cluster, pools_baseline):
    """Keys on both shards grouped by shard: each shard's part lands in /
    is sent from its slice of the array (issue 28 item 1)."""
    with client(cluster) as c:
        both = np.concatenate([keys_on(0, 40), keys_on(1, 40)])
        want = c.fetch(TABLE, both)  # the copying way
        b = c.empty((80, DIM))
        z0 = c.stats()["zero_copy"]
        assert c.fetch(TABLE, both, out=b) is b
        np.testing.assert_array_equal(b, want)
        assert c.stats()["zero_copy"] == z0 + 1
        b[:] = 0.5
        c.push(TABLE, both, b)
        assert c.stats()["zero_copy"] == z0 + 2
        np.testing.assert_allclose(c.fetch(TABLE, both, out=b), want - LR * 0.5, atol=1e-6)
        # shard 1's keys first: any order of shards
        swap = np.concatenate([both[40:], both[:40]])
        c.fetch(TABLE, swap, out=b)
        np.testing.assert_allclose(b[:40], want[40:] - LR * 0.5, atol=1e-6)
        np.testing.assert_allclose(b[40:], want[:40] - LR * 0.5, atol=1e-6)
        assert c.stats()["zero_copy"] == z0 + 4
        del b


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
