"""Launching the ``triton_symm`` kernels for one rank: constexprs bound once per op, the grid and
warps a pure function of the op and the token count (so every rank launches the same grid: a
rank-dependent grid would leave a program waiting for a peer program that never runs).

Eager calls go straight to the compiled kernel's launcher once :meth:`SymmLauncher.bind` has
checked, bit for bit, that it writes what ``kernel[grid]`` writes (the same mechanism and guards
as ``triton``'s :class:`arnorm_triton._launch.FusedLauncher`: 16-byte aligned pointers and row
strides of the bound divisibility, no launch hook; anything else takes ``kernel[grid]``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from arnorm_triton import _kernels as K
from arnorm_triton._direct import HOOK_CHAIN, RUNTIME, bound_launchers
from arnorm_triton._launch import norm_constexprs
from arnorm_triton._launch_table import default_num_warps
from arnorm_triton.symm import _kernels as S

if TYPE_CHECKING:
    import torch

    from arnorm.plugin import RMSNorm
    from arnorm_triton.symm._workspace import SymmWorkspace

__all__ = ["SymmLauncher"]

#: ``spin_limit`` passed for "wait forever" (the kernel's poll counter is int32).
UNBOUNDED_SPINS = 2**31 - 1
#: Launches :meth:`SymmLauncher.bind` makes after the ordinary one, on every rank whatever it
#: finds (a rank-dependent number of launches would leave the peers' flags out of step).
BIND_TRIALS = 2

_log = logging.getLogger("arnorm.triton")


class SymmLauncher:
    """Launches of :func:`arnorm_triton.symm._kernels.symm_allreduce_norm_kernel` for one rank.

    ``launch(x, res, w, scale, h, y, q, sf, n_rows, x_stride, res_stride, h_stride, *, push,
    two_shot, copy_in, end_wait, stage=0)``: tensors in the kernel's order (``scale``, ``y``, ``q``,
    ``sf`` may be ``None`` where the variant neither reads nor writes them). ``sync=False`` builds
    the emulation variant (no flag operations or polls; the caller runs the stages in order over
    all ranks). ``pdl``: programmatic dependent launch (CUDA SM 9.0+; never with ``sync=False``).
    ``norm``: the op's :class:`arnorm.plugin.RMSNorm` (options as ``triton``'s constexprs).
    """

    def __init__(
        self,
        workspace: SymmWorkspace,
        *,
        quant: str | None,
        layout: str | None,
        write_normed: bool,
        norm: RMSNorm,
        soft: bool,
        soft_fp8: bool,
        sync: bool = True,
        spin_limit: int = 0,
        pdl: bool = False,
    ) -> None:
        lay = workspace.layout
        block, group, vec = K.row_shape(lay.hidden, quant, lay.itemsize)
        self.workspace = workspace
        self.slots = lay.slots
        self.eps = float(norm.eps)
        self.weight_offset = float(norm.weight_offset)
        self.spin_limit = spin_limit if spin_limit > 0 else UNBOUNDED_SPINS
        self.swizzled = K.is_swizzled(quant, layout)
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
            "SCALE_LAYOUT": K.SCALE_LAYOUT_CODES[layout],
            "WRITE_NORMED": write_normed,
            "SOFT": soft,
            "SOFT_FP8": soft_fp8,
            "WORLD": lay.world,
            "SLOTS": lay.slots,
            "SYNC": sync,
            "USE_PDL": pdl and sync,
            **norm_constexprs(norm),
        }
        names = S.symm_allreduce_norm_kernel.arg_names
        #: Every constexpr in signature order, ``STAGE=0`` included (the direct launch's tail).
        self._consts = tuple({**self.constexprs, "STAGE": 0}[n] for n in names[names.index("HIDDEN") :])
        self._div16 = lay.hidden % 16 == 0
        # Every rank's address as a scalar argument (0 past the world size): see S.PEER_ARGS.
        self._peer_args = (*workspace.addresses, *(0,) * (S.PEER_ARGS - len(workspace.addresses)))
        self._bound: Any = None  # Bound once bind() succeeded
        self._fixed: tuple[int, ...] = ()
        self._scalars: tuple[Any, ...] = ()
        self._get_stream: Any = None
        self._device_index = 0

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
        push: bool = False,
        two_shot: bool,
        copy_in: bool,
        end_wait: bool,
        stage: int = 0,
        warmup: bool = False,
    ) -> Any:
        """One launch over ``n_rows`` rows; ``warmup=True`` compiles the variant without running it."""
        bound = self._bound
        if bound is not None and stage == 0 and not warmup:
            xp, rp, wp, hp = x.data_ptr(), res.data_ptr(), w.data_ptr(), h.data_ptr()
            # y, q, sf are the backend's own allocations (always aligned); scale is not specialized.
            # As FusedLauncher.launch: the bound variant saw 16-byte aligned pointers and strides
            # divisible by 16 when H is (else strides that are not 1).
            if self._div16:
                fits = not (xp | rp | wp | hp | x_stride | res_stride | h_stride) & 15
            else:
                fits = not (xp | rp | wp | hp) & 15 and x_stride != 1 and res_stride != 1 and h_stride != 1
            hook = RUNTIME.launch_enter_hook
            if fits and (hook is None or (type(hook) is HOOK_CHAIN and not hook.calls)):
                bound.run(
                    self.grid(n_rows), 1, 1, self._get_stream(self._device_index), bound.function,
                    *bound.mid, xp, rp, wp, hp if scale is None else scale.data_ptr(), hp,
                    hp if y is None else y.data_ptr(), hp if q is None else q.data_ptr(),
                    hp if sf is None else sf.data_ptr(), *self._fixed, n_rows, x_stride, res_stride, h_stride,
                    *self._scalars, int(push), int(two_shot), int(copy_in), int(end_wait), *self._consts,
                )  # fmt: skip
                return None
        return self._ordinary(x, res, w, scale, h, y, q, sf, n_rows, x_stride, res_stride, h_stride,
                              push=push, two_shot=two_shot, copy_in=copy_in, end_wait=end_wait, stage=stage,
                              warmup=warmup)  # fmt: skip

    def _ordinary(self, x: Any, res: Any, w: Any, scale: Any, h: Any, y: Any, q: Any, sf: Any, n_rows: int,
                  x_stride: int, res_stride: int, h_stride: int, *, push: bool = False, two_shot: bool,
                  copy_in: bool, end_wait: bool, stage: int = 0, warmup: bool = False) -> Any:  # fmt: skip
        """``kernel[grid](...)``: Triton's own launch path (returns the compiled kernel)."""
        import torch

        ws = self.workspace
        lay = ws.layout
        ptrs = [h if t is None else t for t in (x, res, w, scale, h, y, q, sf)]
        # Codes and block scales are stored as bytes: fp8 outputs go in as uint8 views.
        for i in (6, 7):
            if ptrs[i].element_size() == 1 and ptrs[i].dtype is not torch.uint8:
                ptrs[i] = ptrs[i].view(torch.uint8)
        launch = _launcher(S.symm_allreduce_norm_kernel, self.grid(n_rows), warmup)
        extra = {"launch_pdl": True} if self.constexprs["USE_PDL"] else {}
        return launch(
            *ptrs, ws.peers, ws.epochs, ws.error, ws.base, *self._peer_args, n_rows, x_stride, res_stride,
            h_stride, self.eps, self.weight_offset, ws.rank, lay.in_off, lay.sum_off, lay.push_off,
            lay.push_cap, self.spin_limit, int(push), int(two_shot), int(copy_in), int(end_wait),
            STAGE=stage, num_warps=self.num_warps, **extra, **self.constexprs,
        )  # fmt: skip

    # -- the direct launch -------------------------------------------------------------------

    def bind(self, tensors: tuple[Any, ...], n_rows: int, strides: tuple[int, int, int], *,
             two_shot: bool, push: bool = False) -> bool:  # fmt: skip
        """Collective over the op's ranks (every rank calls it at the same point, with the same
        ``n_rows`` and kind, push or flags): one ordinary copy-in launch, then exactly
        :data:`BIND_TRIALS` more on every rank, each through a candidate direct launcher when there
        is one (an ordinary launch otherwise), keeping the first candidate whose outputs are bit for
        bit the ordinary launch's. ``tensors`` = x, res, w, scale, h, y, q, sf (x and h distinct;
        every rank's x the same partial for every launch, which the kernel copies in, so the sums
        repeat). Synchronizes (setup only). Returns whether launches now go direct."""
        import torch

        self._bound = None
        if K.INTERPRETED:
            return False
        x, res, w, scale, h, y, q, sf = tensors
        outputs = [t for t in (h, y, q, sf) if t is not None]
        kwargs = {"push": push, "two_shot": two_shot, "copy_in": True, "end_wait": False}
        compiled = self._ordinary(x, res, w, scale, h, y, q, sf, n_rows, *strides, **kwargs)
        torch.cuda.synchronize(x.device)
        first = [o.clone() for o in outputs]
        candidates: list[Any] = []
        try:
            self._get_stream = _stream_getter()
            dev = x.device
            self._device_index = (
                dev.index if dev.index is not None or dev.type != "cuda" else torch.cuda.current_device()
            )
            self._device_index = self._device_index or 0
            ws = self.workspace
            self._fixed = (
                int(ws.peers.data_ptr()),
                int(ws.epochs.data_ptr()),
                int(ws.error.data_ptr()),
                ws.base,
                *self._peer_args,
            )
            lay = ws.layout
            self._scalars = (self.eps, self.weight_offset, ws.rank, lay.in_off, lay.sum_off, lay.push_off,
                             lay.push_cap, self.spin_limit)  # fmt: skip
            candidates = bound_launchers(compiled)
        except Exception as exc:  # Triton API drift: ordinary launches only, never a failed setup
            _log.warning("triton_symm: direct launch unavailable (%s: %s)", type(exc).__name__, exc)
        chosen = None
        for i in range(BIND_TRIALS):
            for o in outputs:
                o.zero_()
            cand = candidates[i] if i < len(candidates) and chosen is None else None
            launched = direct = False
            if cand is not None:
                self._bound = cand
                try:
                    # None: it went direct; else launch() itself fell back to kernel[grid].
                    direct = self.launch(x, res, w, scale, h, y, q, sf, n_rows, *strides, **kwargs) is None
                    launched = True
                except Exception as exc:
                    _log.warning("triton_symm: direct launch failed (%s: %s)", type(exc).__name__, exc)
                self._bound = None
            if not launched:  # the same number of launches on every rank, whatever happened here
                self._ordinary(x, res, w, scale, h, y, q, sf, n_rows, *strides, **kwargs)
            if not direct:
                continue
            torch.cuda.synchronize(x.device)
            if all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(first, outputs, strict=True)
            ):
                chosen = cand
        torch.cuda.synchronize(x.device)
        if chosen is None and candidates:
            _log.warning("triton_symm: direct launch disagrees with kernel[grid]; using kernel[grid]")
        self._bound = chosen
        return chosen is not None

    def unbind(self) -> None:
        """Every launch through ``kernel[grid]`` from now on (benchmarks, tests)."""
        self._bound = None

    @property
    def fast(self) -> bool:
        """Whether launches go straight to the compiled kernel's launcher."""
        return self._bound is not None

    def wait_done(self, warmup: bool = False) -> Any:
        """Enqueue :func:`~arnorm_triton.symm._kernels.symm_wait_done_kernel` (zero-copy start)."""
        ws = self.workspace
        launch = _launcher(S.symm_wait_done_kernel, self.slots, warmup)
        return launch(
            ws.epochs, ws.error, ws.base, ws.rank, self.spin_limit, SLOTS=self.slots,
            WORLD=ws.layout.world, num_warps=1,
        )  # fmt: skip


def _stream_getter() -> Any:
    """Triton's ``get_current_stream(device_index)`` (what its own launch path calls)."""
    from triton.runtime import driver

    return driver.active.get_current_stream


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
