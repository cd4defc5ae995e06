"""Every rank of a ``triton_symm`` call in one process, over plain tensors (CPU tests, no GPU needed).

The ranks' workspaces are ordinary tensors whose addresses fill each rank's peer table, so the
kernel reads "peer" memory exactly as it would over symmetric memory. The flag operations are
compiled out (``SYNC=False``) and the kernel runs stage by stage, each stage on every rank before
the next stage anywhere: the order the flags enforce on a GPU. Everything else (the row-to-program
map, the copy-in, the rank-order sum, the two-shot ownership, the epilogue) is the real kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from arnorm.plugin import Output, RMSNorm
from arnorm_triton._outputs import OutputPlan
from arnorm_triton.symm._launch import SymmLauncher
from arnorm_triton.symm._workspace import SENTINEL_BYTE, Layout, SymmWorkspace, emulated, plan_layout

if TYPE_CHECKING:
    import torch

__all__ = ["emulate_call", "initial_contents", "shared_workspace"]

_PLAIN = RMSNorm()


def emulate_call(
    partials: Sequence[torch.Tensor],
    residual: torch.Tensor | Sequence[torch.Tensor],
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    *,
    norm: RMSNorm = _PLAIN,
    quant: str | None = None,
    layout: str | None = None,
    normed: bool = True,
    inplace: bool = True,
    two_shot: bool = False,
    push: bool = False,
    zero_copy: bool = False,
    slots: int = 4,
    soft_fp8: bool | None = None,
    workspaces: list[Any] | None = None,
) -> tuple[list[Output], list[Any]]:
    """Run one call on ``len(partials)`` emulated ranks; ``(outputs per rank, workspaces)``.

    ``residual``: one tensor for every rank or one per rank; ``norm``: the op's norm (default: plain,
    eps 1e-6). ``workspaces`` from an earlier call
    are reused (their contents stay, as on a GPU). ``push``: the push one-shot (the workspaces
    must have a push region of at least ``T`` rows). Integer-bit casts in the interpreter; on a GPU,
    ``soft_fp8`` picks the e4m3 conversion (default: the hardware's).
    """
    import torch

    from arnorm_triton._kernels import INTERPRETED

    world = len(partials)
    t, h = partials[0].shape
    dtype = partials[0].dtype
    residuals: list[torch.Tensor] = (
        list(residual) if isinstance(residual, (list, tuple)) else [residual] * world  # type: ignore[list-item]
    )
    if workspaces is None:
        lay = plan_layout(world=world, slots=slots, hidden=h, itemsize=dtype.itemsize, max_tokens=t,
                          max_bytes=1 << 40, oneshot_max=0 if two_shot else t, push_max=t)  # fmt: skip
        workspaces = emulated(lay, dtype, partials[0].device)
    plan = OutputPlan(
        hidden=h, dtype=dtype, quant=quant, layout=layout, normed=normed, device=partials[0].device
    )
    launchers = [
        SymmLauncher(
            ws,
            quant=quant,
            layout=layout,
            write_normed=normed,
            norm=norm,
            soft=INTERPRETED,
            soft_fp8=INTERPRETED if soft_fp8 is None else soft_fp8 or INTERPRETED,
            sync=False,
        )
        for ws in workspaces
    ]
    calls = []
    for r, ws in enumerate(workspaces):
        if zero_copy:
            x = ws.inputs(t)
            x.copy_(partials[r])
            h_out = torch.empty((t, h), dtype=dtype, device=x.device)
        else:
            x = partials[r].clone()
            h_out = x if inplace else torch.empty((t, h), dtype=dtype, device=x.device)
        y, q, sf = plan.alloc(t)
        calls.append((x, h_out, y, q, sf))
    for stage in (1, 2, 3):
        for r, launcher in enumerate(launchers):
            x, h_out, y, q, sf = calls[r]
            launcher.launch(x, residuals[r], weight, scale, h_out, y, q, sf, t, x.stride(0) if t > 1 else h,
                            residuals[r].stride(0) if t > 1 else h, h_out.stride(0) if t > 1 else h,
                            push=push, two_shot=two_shot, copy_in=not zero_copy, end_wait=zero_copy,
                            stage=stage)  # fmt: skip
    outs = [plan.output(y, h_out, q, sf, scale) for _, h_out, y, q, sf in calls]
    return outs, workspaces


def shared_workspace(layout: Layout, dtype: torch.dtype, directory: str, rank: int) -> SymmWorkspace:
    """Rank ``rank``'s workspace over files that every rank maps (``directory/rank<r>.buf``): ranks
    in separate processes share memory the way GPUs share symmetric memory, so the kernel can run
    with its flags (``SYNC=True``) under the Triton interpreter. The files must exist, holding
    :func:`initial_contents`, before any rank maps them."""
    import os

    import torch

    from arnorm_triton.symm._workspace import _new_local

    buffers = [
        torch.from_file(
            os.path.join(directory, f"rank{r}.buf"), shared=True, size=layout.total_bytes, dtype=torch.uint8
        )
        for r in range(layout.world)
    ]
    ws = _new_local(layout, rank, buffers[rank], [int(b.data_ptr()) for b in buffers], dtype, None)
    ws.handle = buffers  # keeps every mapping alive as long as the workspace
    return ws


def initial_contents(layout: Layout) -> bytes:
    """A fresh buffer's bytes: flags and regions zero, the push region the sentinel (all bits set)."""
    return bytes(layout.push_off) + bytes([SENTINEL_BYTE]) * (layout.total_bytes - layout.push_off)
