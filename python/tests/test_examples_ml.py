# SPDX-License-Identifier: Apache-2.0
"""The trainer and ranker examples against a bex-ps cluster (TCP)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import bex.ps
from conftest import SCALE, Cluster
import conftest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


@pytest.fixture
def cluster16(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "DIM", 16)
    c = Cluster(str(tmp_path), 2, 1)
    yield c
    c.stop()


@pytest.mark.torch
@pytest.mark.tcp_only
def test_trainer_learns(cluster16):
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "trainer.py"), cluster16.path,
                        "200"], capture_output=True, text=True, timeout=300 * SCALE,
                       env=dict(os.environ))
    assert r.returncode == 0, r
    last = r.stdout.splitlines()[-1].split()
    assert last[:2] == ["trained:", "loss"] and float(last[4]) < float(last[2]) - 0.05, r.stdout


@pytest.mark.tcp_only
def test_ranker_scores_with_the_servers_rows(cluster16):
    srv = subprocess.Popen([sys.executable, os.path.join(EXAMPLES, "ranker.py"),
                            cluster16.path], stdout=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        assert line.startswith("listening on "), line
        ids = [5, 17, 99, 1234]
        r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "ranker.py"), "--query",
                            line.split()[-1], *map(str, ids)], capture_output=True, text=True,
                           timeout=60 * SCALE, env=dict(os.environ))
        assert r.returncode == 0, r
        got = {int(a): float(b) for a, b in (x.split() for x in r.stdout.splitlines())}
        with bex.ps.Client(cluster16.path, dims={1: 16}) as ps:
            rows = ps.fetch(1, np.array(ids, np.uint64))
        want = rows @ np.linspace(-1, 1, 16, dtype=np.float32)
        assert sorted(got) == ids
        np.testing.assert_allclose([got[i] for i in ids], want, rtol=1e-5, atol=1e-6)
        scores = [float(x.split()[1]) for x in r.stdout.splitlines()]
        assert scores == sorted(scores, reverse=True)
    finally:
        srv.terminate()
        srv.wait(20)
