"""FlashInfer workspaces: how big, when one-shot, and one shared copy per (group, hidden size, dtype, kind).

Budgets are per-rank input bytes, the same unit as vLLM's ``FI_ALLREDUCE_FUSION_MAX_SIZE_MB``
(``vllm/compilation/passes/fusion/allreduce_rms_fusion.py``, vLLM 0.33.0, whose values are the
defaults here). A workspace serves ``tokens * hidden * elem <= budget``; larger calls fall through
to the next backend of the op (``check_tokens`` says so).

Life cycle of a shared workspace (see :class:`Entry`):

* creation is collective (FlashInfer exchanges IPC handles over the CPU group); whether an op
  reuses the cached workspace or builds a new one is decided from every rank's cache state, which
  ``create`` gathers first, so every rank takes the same branch;
* each op holds one reference; the last ``release`` synchronizes this rank's device (no kernel of
  ours may still use the mapping) and calls ``destroy()``. It enters no collective: the core closes
  a backend on the ranks where setup succeeded only, and a barrier there would hang. Freeing is
  safe without one because a peer's imported handle keeps the physical memory alive until that
  peer releases it too;
* at interpreter exit every live workspace is destroyed locally: no collective, no device
  synchronization (a peer that died would leave a kernel spinning on its Lamport flags), so exit
  never hangs.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BUDGET_MB",
    "MAX_COMM_SIZE",
    "MIB",
    "ONESHOT_MAX_MB",
    "Entry",
    "acquire",
    "budget_mb",
    "cached_state",
    "live_entries",
    "release",
    "token_capacity",
    "use_oneshot",
    "workspace_bytes",
]

MIB = 1 << 20
#: FlashInfer clamps each Lamport buffer to this (``trtllm_ar.MAX_COMM_SIZE``) and refuses one-shot above it.
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)

#: Per-rank input budget in MiB by compute capability (``10 * major + minor``), then world size.
#: vLLM's defaults; world size 16 on SM100/103 is vLLM's multi-node MNNVL figure.
BUDGET_MB: dict[int, dict[int, float]] = {
    90: {2: 64, 4: 2, 8: 0.5},
    100: {2: 64, 4: 32, 8: 1, 16: 64},
    103: {2: 64, 4: 64, 8: 4, 16: 64},
    107: {2: 64, 4: 64, 8: 2},
}
#: Largest per-rank input (MiB) run one-shot (vLLM's ``_FI_ALLREDUCE_ONE_SHOT_MAX_SIZES_MB``);
#: above it the two-shot kernel runs. No entry (world size 16): always one-shot, as vLLM does.
ONESHOT_MAX_MB: dict[int, dict[int, float]] = {
    90: {2: 32, 4: 2, 8: 0.5},
    100: {2: 32, 4: 4, 8: 1},
    103: {2: 32, 4: 4, 8: 2},
    107: {2: 32, 4: 4, 8: 2},
}
#: Row used for an architecture with no row of its own and no lower row of the same major.
DEFAULT_ARCH = 90


def _row(table: dict[int, dict[int, float]], arch: tuple[int, int]) -> tuple[int, dict[int, float]]:
    """The row for ``arch``: exact, else the nearest lower row of the same major, else SM90's."""
    cc = 10 * arch[0] + arch[1]
    if cc in table:
        return cc, table[cc]
    same_major = [k for k in table if k // 10 == arch[0] and k <= cc]
    key = max(same_major) if same_major else DEFAULT_ARCH
    return key, table[key]


def budget_mb(arch: tuple[int, int], world_size: int, override: float | None) -> tuple[float, str]:
    """The per-rank budget in MiB and where it came from (for messages)."""
    if override is not None:
        return float(override), "ARNORM_FLASHINFER_MAX_SIZE_MB"
    key, row = _row(BUDGET_MB, arch)
    if world_size in row:
        return float(row[world_size]), f"table sm{key}/tp{world_size}"
    # No figure for this world size: the smallest of the row (conservative; larger calls fall back).
    return float(min(row.values())), f"table sm{key} minimum (no tp{world_size} entry)"


def token_capacity(budget: float, hidden: int, elem: int, max_tokens: int) -> int:
    """Tokens a workspace of ``budget`` MiB per rank serves, at most ``max_tokens``; int32-safe."""
    by_budget = int(budget * MIB) // (hidden * elem)
    by_int32 = (2**31 - 1) // hidden  # the kernel holds tokens * hidden in an int
    return max(0, min(by_budget, by_int32, max_tokens))


def alloc_tokens(capacity: int, elem: int, world_size: int) -> int:
    """``max_token_num`` to create the workspace with, so that ``capacity`` tokens fit every path.

    The two-shot kernel stages ``2 * T * H * elem`` bytes in the first IPC buffer. FlashInfer 0.7.4
    sizes it ``world_size * max_token_num * H * elem``; earlier sources (0.6.18) used 2 bytes
    whatever the dtype, which for fp32 at world size 2 holds only half of ``max_token_num``. The
    doubling costs fp32 TP-2 workspaces twice the memory on 0.7.4 and keeps older ones in bounds
    (read in the sources; not run).
    """
    return capacity * 2 if elem == 4 and world_size == 2 else capacity


def workspace_bytes(kind: str, max_token_num: int, hidden: int, elem: int, world_size: int) -> int:
    """Device bytes one rank allocates for the workspace (FlashInfer's own sizing, rounded up)."""
    if kind == "mnnvl":
        # The larger of the one-shot size (up to FlashInfer's 1 MiB threshold) and the two-shot
        # size, for each of 3 Lamport buffers; the multicast mapping aliases the same memory.
        two_shot = 2 * -(-max_token_num // world_size) * world_size * hidden * elem
        return 3 * max(two_shot, MIB)
    data = world_size * max_token_num * hidden * elem
    buffer = world_size * max_token_num * hidden * 2
    flags = world_size * 256 * 4
    return buffer + flags + 3 * min(data, MAX_COMM_SIZE)


def use_oneshot(tokens: int, hidden: int, elem: int, world_size: int, arch: tuple[int, int]) -> bool:
    """The kernel variant, a pure function of the shape: every rank must launch the same one."""
    if tokens <= world_size:
        return True  # two-shot asserts tokens > world size
    if tokens * hidden * elem * world_size > MAX_COMM_SIZE:
        return False  # FlashInfer would switch to two-shot itself
    limit = _row(ONESHOT_MAX_MB, arch)[1].get(world_size)
    return limit is None or tokens * hidden * elem <= limit * MIB


# -- the shared cache ------------------------------------------------------------------------


@dataclass(eq=False)
class Entry:
    """One FlashInfer workspace and the ops holding it."""

    key: tuple[Any, ...]
    serial: int
    kind: str
    capacity: int
    workspace: Any
    device: Any = None
    refs: int = 0
    destroyed: bool = field(default=False)

    @property
    def state(self) -> tuple[int, str, int]:
        """What ``create`` gathers to decide on reuse: identical on every rank that holds it."""
        return (self.serial, self.kind, self.capacity)


logger = logging.getLogger("arnorm")
_lock = threading.RLock()
_cache: dict[tuple[Any, ...], Entry] = {}
_live: list[Entry] = []
_serials: dict[tuple[Any, ...], itertools.count] = {}
_atexit_registered = False


def cached_state(key: tuple[Any, ...]) -> tuple[int, str, int] | None:
    """This rank's reusable workspace for ``key`` (``None`` if none)."""
    with _lock:
        entry = _cache.get(key)
        return None if entry is None or entry.destroyed else entry.state


def acquire(
    key: tuple[Any, ...],
    reuse: bool,
    kind: str,
    capacity: int,
    factory: Callable[[], Any],
    device: Any = None,
) -> Entry:
    """The cached entry (``reuse``: every rank agreed it holds the same one) or a new one from ``factory``.

    ``factory`` is FlashInfer's collective creation; it runs on every rank or on none, because
    ``reuse`` was decided from the gathered cache states.
    """
    global _atexit_registered
    with _lock:
        if reuse:
            entry = _cache[key]
            entry.refs += 1
            return entry
        serial = next(_serials.setdefault(key, itertools.count(1)))
        workspace = factory()
        entry = Entry(key, serial, kind, capacity, workspace, device, refs=1)
        _cache[key] = entry
        _live.append(entry)
        if not _atexit_registered:
            atexit.register(_destroy_all_at_exit)
            _atexit_registered = True
        return entry


def release(entry: Entry) -> None:
    """Drop one reference; the last one frees the workspace on this rank (no collective)."""
    with _lock:
        entry.refs -= 1
        if entry.refs > 0 or entry.destroyed:
            return
        if _cache.get(entry.key) is entry:
            del _cache[entry.key]
        _synchronize(entry.device)
        _destroy(entry)


def live_entries() -> list[Entry]:
    """Workspaces not destroyed yet (tests and diagnostics)."""
    with _lock:
        return [e for e in _live if not e.destroyed]


def _synchronize(device: Any) -> None:
    """Wait for this rank's kernels; a context already broken by a CUDA error must not stop the free."""
    if device is None or getattr(device, "type", None) != "cuda":
        return
    import torch

    try:
        torch.cuda.synchronize(device)
    except Exception as exc:  # a sticky CUDA error: the memory goes with the context anyway
        logger.warning("arnorm: flashinfer workspace freed without a device sync: %s", exc)


def _destroy(entry: Entry) -> None:
    entry.destroyed = True
    if entry in _live:
        _live.remove(entry)
    workspace, entry.workspace = entry.workspace, None
    _drop_module_refs(workspace)
    destroy = getattr(workspace, "destroy", None)
    if destroy is not None:
        destroy()


def _drop_module_refs(workspace: Any) -> None:
    """Release what FlashInfer keeps for a TRT-LLM workspace outside the object.

    ``trtllm_create_ipc_workspace_for_all_reduce_fusion`` files the buffers' owners in the module
    dict ``_symm_workspace_refs`` under ``id(ipc_handles)``, and the workspace's ``destroy()`` only
    drops its own attributes, so without this the device memory stays mapped until the process
    ends (read in FlashInfer's ``trtllm_ar.py``; not run).
    """
    handles = getattr(workspace, "ipc_handles", None)
    module = sys.modules.get("flashinfer.comm.trtllm_ar")
    release = getattr(module, "trtllm_destroy_ipc_workspace_for_all_reduce_fusion", None)
    if handles is None or release is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        release(handles)


def _destroy_all_at_exit() -> None:
    """Local teardown at interpreter exit: never a collective, never a device sync."""
    with _lock:
        entries = [e for e in _live if not e.destroyed]
        _cache.clear()
    for entry in entries:
        try:
            _destroy(entry)
        except Exception:  # exit must not fail: the process is going away anyway
            entry.destroyed = True
