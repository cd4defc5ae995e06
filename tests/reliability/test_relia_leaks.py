"""Nothing grows per op: ops built, called and dropped (closed or not) in loops leave the custom-op
handle registry, the thread count, the open file descriptors and arnorm's caches where they were.

The loops run in spawned gloo ranks (fresh processes: no thread or descriptor of another test is
counted): single-process ops (arnorm.LOCAL), ops on a 2-rank WORLD, and fused_allreduce_norm over
more signatures than its cache holds (the cache stays at CACHE_SIZE, evicted ops are closed).
"""

from __future__ import annotations

import pytest

from arnorm.op._oneshot import CACHE_SIZE
from arnorm.testing import run_ranks

import relia_leaks
from relia_harness import triton_unavailable

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("backend", "n"), [("reference", 40), ("triton", 16)])
def test_ops_built_and_dropped_in_a_loop_leave_nothing_behind(backend, n):
    """After a warm-up, n more ops per loop (half never closed) change no count, on either rank."""
    env = None
    if backend == "triton":
        why = triton_unavailable()
        if why:
            pytest.skip(f"triton backend not eligible on this checkout: {why}")
        env = {"TRITON_INTERPRET": "1"}
    results = run_ranks(2, relia_leaks.leak_loops, backend, n, env=env, timeout=120)
    for rank, loops in enumerate(results):
        for loop, (before, after) in loops.items():
            grew = {k: (before[k], after[k]) for k in before if after[k] > before[k]}
            assert not grew, f"rank {rank}, {loop}: grew {grew}"
            assert after["handles"] == before["handles"], (rank, loop, before, after)
            assert after["cached ops"] <= CACHE_SIZE, (rank, loop, after)
