# SPDX-License-Identifier: Apache-2.0
"""bex for Python: the parameter-server client of bex (python/README.md).

    import bex, bex.ps
    print(bex.version())                  # libbex's version
    c = bex.ps.Client("cluster.json", dims={1: 64})
    rows = c.fetch(1, keys)               # numpy float32 (len(keys), 64)
    c.push(1, keys, grads)

Errors of bex raise bex.Error (an OSError: errno, bex_error, shard,
replica); a Push some replica did not acknowledge raises bex.PushError
(its replicas and failed list every part); a client used in a forked child
raises bex.ForkError.
"""
from ._bex import Error, ForkError, PushError, strerror, version

__all__ = ["Error", "ForkError", "PushError", "strerror", "version", "ps", "rpc", "sock", "snapshot",
           "empty"]


def __getattr__(name):
    if name == "empty":  # bex.ps.empty: an array on bex's registered memory
        from .ps import empty
        return empty
    if name in ("ps", "rpc", "sock", "snapshot"):  # the submodules without an import
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'bex' has no attribute {name!r}")
