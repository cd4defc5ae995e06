"""The symmetric workspace of ``triton_symm``: its layout (pure arithmetic), and building it.

Every rank holds one buffer of the same size, laid out identically (byte offsets)::

    [0, flags_bytes)           flags: uint32 [KINDS, slots, world]; peers write slot (kind, b, src)
    [in_off, in_off + T*H*e)   inputs: this rank's partial sum, [capacity, H] in the dtype
    [sum_off, ... )            sums: two-shot only, the rows this rank reduced, [capacity, H]
    [push_off, total)          push: [2, world, push_cap, H]; peer src stores into slot (e % 2, src),
                               every element is the sentinel (all bits set) until written

Flag ``(kind, b, src)`` in rank r's buffer is written by rank ``src``'s program ``b`` and read by
rank r's program ``b`` only (docs/triton-symm.md, "Protocol"). ``slots`` is the number of
programs the kernels may launch (rows map to programs as ``t % slots`` in every call).

:class:`SymmWorkspace` holds what the kernel needs on the device: the table of every rank's buffer
address, this rank's per-program call counters and its timeout word. :func:`allocate_buffer`,
:func:`rendezvous` and :func:`build` make one over torch symmetric memory; :func:`emulated` makes
``world`` of them in one process over plain tensors (the CPU tests: the kernel cannot tell the
difference, the synchronization is compiled out).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGN",
    "KINDS",
    "SENTINEL_BYTE",
    "Layout",
    "SymmWorkspace",
    "allocate_buffer",
    "build",
    "emulated",
    "fill_sentinel",
    "local_offset",
    "plan_layout",
    "rendezvous",
]

#: Region alignment in bytes (16-byte vector accesses need 16; 256 keeps rows on cache-line starts).
ALIGN = 256
#: Flag kinds: partials published, two-shot sums published, this rank done reading its peers.
KINDS = 3
#: Every byte of a push slot not written yet: all bits set, the kernels' sentinel (a NaN in every
#: dtype; arnorm_triton.symm._kernels._sentinel).
SENTINEL_BYTE = 0xFF


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte layout of one rank's buffer for an op (identical on every rank)."""

    world: int
    slots: int
    hidden: int
    itemsize: int
    #: Tokens the regions hold: calls with more tokens are not served.
    capacity: int
    #: Whether the two-shot sums region exists (the crossover is below the capacity).
    two_shot: bool
    flags_bytes: int
    in_off: int
    sum_off: int
    total_bytes: int
    #: Byte offset and rows per slot of the push region (push one-shot serves T <= push_cap).
    push_off: int = 0
    push_cap: int = 0

    @property
    def push_bytes(self) -> int:
        return self.total_bytes - self.push_off if self.push_cap else 0

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.itemsize


def flag_bytes(world: int, slots: int) -> int:
    return _round_up(KINDS * slots * world * 4, ALIGN)


def plan_layout(
    *,
    world: int,
    slots: int,
    hidden: int,
    itemsize: int,
    max_tokens: int,
    max_bytes: int,
    oneshot_max: int,
    push_max: int = 0,
) -> Layout:
    """The largest capacity (at most ``max_tokens``) whose buffer fits ``max_bytes``; capacity 0
    when not even one token fits. The sums region is planned only when some served token count is
    above ``oneshot_max`` (the two-shot kernel runs only there). The push region is planned first:
    ``min(push_max, oneshot_max, max_tokens)`` rows per slot, fewer when the budget would then not
    hold one row of the inputs region, and never more than the capacity left beside it."""
    flags = flag_bytes(world, slots)
    row = hidden * itemsize
    push_cap = max(0, min(push_max, oneshot_max, max_tokens))
    room = max_bytes - flags - _round_up(row, ALIGN)
    push_cap = max(0, min(push_cap, room // (2 * world * row))) if room > 0 else 0
    while push_cap > 0 and _round_up(2 * world * push_cap * row, ALIGN) > room:
        push_cap -= 1

    def regions(budget: int) -> tuple[int, bool]:
        """The largest capacity, and whether two-shot runs, with ``budget`` bytes for flags and regions."""
        # One region up to the crossover, two beyond it: find the largest capacity that fits.
        cap = min(max_tokens, oneshot_max, max(0, (budget - flags) // row))
        two = False
        if max_tokens > oneshot_max:
            fit2 = max(0, (budget - flags) // (2 * row))
            while total(fit2 + 1, True) <= budget:  # rounding slack
                fit2 += 1
            while fit2 > 0 and total(fit2, True) > budget:
                fit2 -= 1
            if min(max_tokens, fit2) > oneshot_max:
                cap, two = min(max_tokens, fit2), True
        while cap > 0 and total(cap, two) > budget:
            cap -= 1
        return cap, two

    def total(cap: int, two: bool) -> int:
        region = _round_up(cap * row, ALIGN)
        return flags + region * (2 if two else 1)

    def push_size(rows: int) -> int:
        return _round_up(2 * world * rows * row, ALIGN)

    cap, two = regions(max_bytes - push_size(push_cap))
    if push_cap > cap:  # push slots never take the rows of tokens the op could not serve anyway
        push_cap = cap
        cap, two = regions(max_bytes - push_size(push_cap))
    region = _round_up(cap * row, ALIGN)
    in_off = flags
    sum_off = in_off + region if two else in_off
    size = total(cap, two) if cap > 0 else flags
    end = size + push_size(push_cap)
    return Layout(world, slots, hidden, itemsize, cap, two, flags, in_off, sum_off, end, size, push_cap)


def min_bytes(*, world: int, slots: int, hidden: int, itemsize: int) -> int:
    """The smallest budget that serves one token (one-shot)."""
    return flag_bytes(world, slots) + _round_up(hidden * itemsize, ALIGN)


@dataclasses.dataclass
class SymmWorkspace:
    """One rank's view of the op's symmetric workspace.

    - ``dtype``: the op's dtype (the inputs and sums regions hold it).
    - ``buffer``: this rank's uint8 buffer (``layout.total_bytes``).
    - ``peers``: int64 ``[world]`` on the device: every rank's buffer address as this process maps it.
    - ``epochs``: int32 ``[2, slots]`` (local memory): per program, this rank's call counter, then
      the epoch of its last flag-protocol call (the one whose ``DONE`` a copy-in waits for).
    - ``error``: int32 ``[1]``, bits of the flag kinds whose wait gave up (local memory).
    - ``handle``: torch's symmetric-memory handle (``None`` when emulated); kept alive with the buffer.
    - ``addresses``: ``peers`` on the host (the kernels take them as scalar arguments too).
    """

    layout: Layout
    rank: int
    dtype: Any
    buffer: Any
    peers: Any
    epochs: Any
    error: Any
    handle: Any = None
    #: ``peers`` on the host: every rank's buffer address, in rank order.
    addresses: tuple[int, ...] = ()

    def inputs(self, num_tokens: int) -> torch.Tensor:
        """``[T, H]`` view of this rank's inputs region (what ``input_buffer`` hands out)."""
        lay = self.layout
        raw = self.buffer[lay.in_off : lay.in_off + num_tokens * lay.row_bytes]
        return raw.view(self.dtype).view(num_tokens, lay.hidden)

    @property
    def base(self) -> int:
        """This rank's buffer address (``peers[rank]``), passed to the kernels as an integer."""
        return int(self.buffer.data_ptr())

    def input_ptr(self) -> int:
        return int(self.buffer.data_ptr()) + self.layout.in_off

    def release(self) -> None:
        """Drop every reference this object holds (the buffer is unmapped once torch lets go)."""
        self.buffer = self.peers = self.epochs = self.error = self.handle = None


def _new_local(
    layout: Layout, rank: int, buffer: Any, addresses: list[int], dtype: Any, handle: Any
) -> SymmWorkspace:
    import torch

    dev = buffer.device
    return SymmWorkspace(
        layout=layout,
        rank=rank,
        dtype=dtype,
        buffer=buffer,
        peers=torch.tensor(addresses, dtype=torch.int64, device=dev),
        epochs=torch.zeros(2 * layout.slots, dtype=torch.int32, device=dev),
        error=torch.zeros(1, dtype=torch.int32, device=dev),
        handle=handle,
        addresses=tuple(int(a) for a in addresses),
    )


def emulated(layout: Layout, dtype: torch.dtype, device: Any = "cpu") -> list[SymmWorkspace]:
    """``layout.world`` workspaces in this process, each rank's table pointing at all of them
    (the CPU tests run every rank's kernel here, one after the other, stage by stage)."""
    import torch

    bufs = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(layout.world)]
    for b in bufs:
        fill_sentinel(b, layout)
    addresses = [int(b.data_ptr()) for b in bufs]
    return [_new_local(layout, r, b, addresses, dtype, None) for r, b in enumerate(bufs)]


def allocate_buffer(layout: Layout, device: torch.device) -> torch.Tensor:
    """This rank's buffer from ``symm_mem.empty`` (local): its flags zeroed, its push region the
    sentinel (the caller synchronizes before any peer may push into it)."""
    import torch
    from torch.distributed import _symmetric_memory as symm_mem

    buffer = symm_mem.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    buffer[: layout.flags_bytes].zero_()
    fill_sentinel(buffer, layout)
    return buffer


def fill_sentinel(buffer: torch.Tensor, layout: Layout) -> None:
    """Every byte of ``buffer``'s push slots :data:`SENTINEL_BYTE` (a fresh buffer, before any peer
    may push into it)."""
    buffer[layout.push_off :].fill_(SENTINEL_BYTE)


def rendezvous(buffer: torch.Tensor, group: Any) -> Any:
    """``symm_mem.rendezvous`` on the TP ``group`` (never WORLD: every rank of the TP group calls it,
    and only those). Older torch needs the group registered first (``enable_symm_mem_for_group``,
    deprecated since it became automatic): done only when the plain call fails and the group is
    not registered yet."""
    from torch.distributed import _symmetric_memory as symm_mem

    try:
        return symm_mem.rendezvous(buffer, group)
    except (RuntimeError, TypeError):
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        registered = getattr(symm_mem, "is_symm_mem_enabled_for_group", lambda name: True)
        if enable is None or registered(group.group_name):
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group.group_name)
    try:
        return symm_mem.rendezvous(buffer, group)
    except TypeError:  # a torch whose rendezvous takes the group name only
        return symm_mem.rendezvous(buffer, group.group_name)


def local_offset(buffer: torch.Tensor, handle: Any, rank: int) -> int:
    """Where ``buffer`` starts within this rank's symmetric allocation. ``handle.buffer_ptrs`` are
    the allocations' starts; torch's memory pool may place a tensor inside one, at an offset that
    need not be the same on every rank, so every rank's offset is gathered (see :func:`build`)."""
    offset = int(buffer.data_ptr()) - int(handle.buffer_ptrs[rank])
    if offset < 0:
        raise RuntimeError(f"rendezvous: buffer_ptrs[{rank}] lies after this rank's tensor (offset {offset})")
    return offset


def build(
    layout: Layout, rank: int, buffer: Any, handle: Any, offsets: list[int], dtype: Any
) -> SymmWorkspace:
    """This rank's view: peer ``r``'s buffer is at ``buffer_ptrs[r] + offsets[r]`` in this process."""
    starts = [int(a) for a in handle.buffer_ptrs]
    if len(starts) != layout.world or len(offsets) != layout.world:
        raise RuntimeError(f"rendezvous: {len(starts)} buffers (needs {layout.world}, one per TP rank)")
    addresses = [a + o for a, o in zip(starts, offsets, strict=True)]
    if addresses[rank] != int(buffer.data_ptr()):
        raise RuntimeError("rendezvous: this rank's table entry is not its own tensor")
    return _new_local(layout, rank, buffer, addresses, dtype, handle)


def overlapping_devices_allowed() -> bool:
    """Whether torch lets several ranks' symmetric buffers live on one GPU (tests only)."""
    return os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "0") not in ("", "0")
