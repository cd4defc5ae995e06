"""Launching the ``triton_symm`` kernels for one rank: constexprs bound once per op, the grid and
warps a pure function of the op and the token count (so every rank launches the same grid: a
rank-dependent grid would leave a program waiting for a peer program that never runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from arnorm_triton import _kernels as K
from arnorm_triton import _symm_kernels as S
from arnorm_triton._launch_table import default_num_warps

if TYPE_CHECKING:
    import torch

    from arnorm_triton._symm_workspace import SymmWorkspace

__all__ = ["SymmLauncher"]

#: ``spin_limit`` passed for "wait forever" (the kernel's poll counter is int32).
UNBOUNDED_SPINS = 2**31 - 1


class SymmLauncher:
    """Launches of :func:`arnorm_triton._symm_kernels.symm_allreduce_norm_kernel` for one rank.

    ``launch(x, res, w, scale, h, y, q, sf, n_rows, x_stride, res_stride, h_stride, *, two_shot,
    copy_in, end_wait, stage=0)``: tensors in the kernel's order (``scale``, ``y``, ``q``, ``sf``
    may be ``None`` where the variant neither reads nor writes them). ``sync=False`` builds the
    emulation variant (no flag operations; the caller runs the stages in order over all ranks).
    """

    def __init__(
        self,
        workspace: SymmWorkspace,
        *,
        quant: str | None,
        layout: str | None,
        write_normed: bool,
        eps: float,
        weight_offset: float,
        round_before_weight: bool,
        soft: bool,
        soft_fp8: bool,
        sync: bool = True,
        spin_limit: int = 0,
    ) -> None:
        lay = workspace.layout
        block, group, vec = K.row_shape(lay.hidden, quant, lay.itemsize)
        self.workspace = workspace
        self.slots = lay.slots
        self.eps = float(eps)
        self.weight_offset = float(weight_offset)
        self.spin_limit = spin_limit if spin_limit > 0 else UNBOUNDED_SPINS
        self.swizzled = layout == "swizzled_128x4" and quant in ("nvfp4", "mxfp8")
        # The warp count changes the order of the sum of squares: a function of BLOCK alone keeps
        # every rank, and every token count, on the same order.
        self.num_warps = default_num_warps(block)
        self.constexprs: dict[str, Any] = {
            "HIDDEN": lay.hidden,
            "BLOCK": block,
            "GROUP": group,
            "VEC": vec,
            "QUANT": K.QUANT_CODES[quant],
            "SWIZZLED": self.swizzled,
            "WRITE_NORMED": write_normed,
            "ROUND_BEFORE_WEIGHT": round_before_weight,
            "SOFT": soft,
            "SOFT_FP8": soft_fp8,
            "WORLD": lay.world,
            "SLOTS": lay.slots,
            "SYNC": sync,
        }

    def grid(self, n_rows: int) -> int:
        """Programs: one per row up to ``slots`` (program ``b`` serves rows ``b + k * slots``), plus
        the swizzled padding programs (32 padding rows each, outside the flag protocol)."""
        main = min(n_rows, self.slots)
        return main + K.padding_programs(n_rows) if self.swizzled else main

    def launch(
        self,
        x: torch.Tensor,
        res: torch.Tensor,
        w: torch.Tensor,
        scale: torch.Tensor | None,
        h: torch.Tensor,
        y: torch.Tensor | None,
        q: torch.Tensor | None,
        sf: torch.Tensor | None,
        n_rows: int,
        x_stride: int,
        res_stride: int,
        h_stride: int,
        *,
        two_shot: bool,
        copy_in: bool,
        end_wait: bool,
        stage: int = 0,
        warmup: bool = False,
    ) -> Any:
        """One launch over ``n_rows`` rows; ``warmup=True`` compiles the variant without running it."""
        import torch

        ws = self.workspace
        lay = ws.layout
        ptrs = [h if t is None else t for t in (x, res, w, scale, h, y, q, sf)]
        # Codes and block scales are stored as bytes: fp8 outputs go in as uint8 views.
        for i in (6, 7):
            if ptrs[i].element_size() == 1 and ptrs[i].dtype is not torch.uint8:
                ptrs[i] = ptrs[i].view(torch.uint8)
        launch = _launcher(S.symm_allreduce_norm_kernel, self.grid(n_rows), warmup)
        return launch(
            *ptrs, ws.peers, ws.epochs, ws.error, ws.base, n_rows, x_stride, res_stride, h_stride, self.eps,
            self.weight_offset, ws.rank, lay.in_off, lay.sum_off, self.spin_limit, int(two_shot),
            int(copy_in), int(end_wait), STAGE=stage, num_warps=self.num_warps, **self.constexprs,
        )  # fmt: skip

    def wait_done(self, warmup: bool = False) -> Any:
        """Enqueue :func:`~arnorm_triton._symm_kernels.symm_wait_done_kernel` (zero-copy start)."""
        ws = self.workspace
        launch = _launcher(S.symm_wait_done_kernel, self.slots, warmup)
        return launch(
            ws.epochs, ws.error, ws.base, ws.rank, self.spin_limit, SLOTS=self.slots,
            WORLD=ws.layout.world, num_warps=1,
        )  # fmt: skip


def _launcher(kernel: Any, grid: int, warmup: bool) -> Any:
    """``kernel[grid]``, or with ``warmup`` a call that compiles without running (nothing in the
    interpreter, and nothing where this Triton's ``warmup`` takes other arguments: the first real
    launch compiles then; a kernel that does not compile still raises)."""
    if not warmup:
        return kernel[(grid,)]
    if not hasattr(kernel, "warmup"):
        return _nothing

    def compile_only(*args: Any, **kwargs: Any) -> Any:
        try:
            return kernel.warmup(*args, grid=(grid,), **kwargs)
        except TypeError:
            return None

    return compile_only


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None
