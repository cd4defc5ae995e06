"""Rank side of the leak test: build, call and drop ops in loops; count what a process holds."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

import arnorm
from arnorm.op._custom_op import live_handles

H = 32


def holdings() -> dict[str, int]:
    """What must stay flat: custom-op handles, live threads, open file descriptors, cached ops."""
    from arnorm.op import _oneshot
    from arnorm.registry import _probe

    gc.collect()
    return {
        "handles": live_handles(),
        "threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "cached ops": len(_oneshot._cache),
        "probe cache": len(_probe._cache),
    }


def _cycle(group: Any, i: int, backend: str | None) -> None:
    """One op built, called, then closed (even i) or dropped without close (odd i)."""
    quant = (None, "fp8_per_token", "mxfp8")[i % 3]
    op = arnorm.AllReduceNorm(
        group, hidden_size=H, dtype=torch.bfloat16, norm=arnorm.RMSNorm(1e-6, 1.0), quant=quant,
        max_tokens=4, backend=backend, device="cpu",
    )  # fmt: skip
    x, r, w = torch.randn(3, H, dtype=torch.bfloat16), torch.randn(3, H, dtype=torch.bfloat16), torch.ones(H)
    op(x, r, w.bfloat16())
    if i % 2 == 0:
        op.close()
    del op


def _fused(group: Any, i: int) -> None:
    """fused_allreduce_norm over more signatures than its cache holds (distinct eps): evictions close."""
    x, r, w = torch.randn(2, H), torch.randn(2, H), torch.ones(H)
    arnorm.fused_allreduce_norm(x, r, w, group=group, eps=1e-6 * (1 + i % 24))


def measure(loop: Callable[[int], None], warm: int, n: int) -> tuple[dict[str, int], dict[str, int]]:
    """Holdings after ``warm`` cycles (imports, probes and caches settle) and after ``n`` more."""
    for i in range(warm):
        loop(i)
    before = holdings()
    for i in range(warm, warm + n):
        loop(i)
    return before, holdings()


def leak_loops(rank: int, world: int, backend: str, n: int) -> dict[str, tuple[dict, dict]]:
    """Every loop's (before, after) holdings on this rank: LOCAL ops, ops on WORLD, the fused cache."""
    import torch.distributed as dist

    return {
        f"local {backend}": measure(lambda i: _cycle(arnorm.LOCAL, i, backend), 6, n),
        f"world {backend}": measure(lambda i: _cycle(dist.group.WORLD, i, backend), 6, n),
        "fused world": measure(lambda i: _fused(dist.group.WORLD, i), 24, 48),
    }
