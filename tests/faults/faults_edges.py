"""What each spawned rank of ``test_faults_edges.py`` runs (module-level, importable by name):
limits told up front, a store that goes away, subgroups, and the store's key count over many ops.

Every function returns plain data; errors come back as ``("error", type name, message)``.
"""

from __future__ import annotations

import time

import faults_fixtures as ff


def attempt(fn):
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def build_twice(rank: int, world: int):
    """Build an op (closing it) twice, timing each attempt."""
    ff.aligned()
    got = []
    for _ in range(2):
        t0 = time.monotonic()
        got.append((attempt(lambda: ff.build().close()), time.monotonic() - t0))
    return got
