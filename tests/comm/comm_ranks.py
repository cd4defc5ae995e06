"""What each spawned rank of ``test_comm_rendezvous.py`` runs (module-level, importable by name).

Every function returns plain data; errors come back as ``("error", type name, message)``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import arnorm


def attempt(fn):
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def _build(group):
    return arnorm.AllReduceNorm(
        group, hidden_size=8, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4,
        backend="reference", device="cpu",
    )  # fmt: skip


def late_after_peers_timed_out(rank: int, world: int, subgroup: bool):
    """The last rank of the group (global rank 2 of [1, 2], or rank 1 of WORLD at TP 2) begins
    building only after its peer's wait timed out; what each got, and how long the late one took."""
    arnorm.backends()
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group([1, 2]) if subgroup else dist.group.WORLD
    if subgroup and rank == 0:
        return None
    late = rank == world - 1
    if not late:
        got = attempt(lambda: _build(group).close())
        store.set("late/peer_gave_up", "1")
        return got
    store.wait(["late/peer_gave_up"])
    t0 = time.monotonic()
    got = attempt(lambda: _build(group).close())
    return got, time.monotonic() - t0
