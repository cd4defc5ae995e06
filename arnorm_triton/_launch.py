"""Launching the fused kernel: constexprs bound once per op, a launch configuration per token
count, and a direct launch that skips Triton's per-call Python binding.

Host cost per eager call is what an engine running without CUDA graphs pays every layer. Triton's
``kernel[grid](...)`` re-binds and re-specializes every argument in Python (tens of microseconds);
the compiled kernel's own launcher then calls ``data_ptr()`` and ``cuPointerGetAttribute`` on
every tensor argument. :class:`FusedLauncher` instead, after :meth:`FusedLauncher.bind`, calls
the compiled kernel's launcher (``CompiledKernel.run``, the call ``JITFunction.run`` ends with,
identical in Triton 3.6 and 3.8) with plain integer pointers, which Triton's launcher takes as
they are. A launch goes this way only while the specialization it was compiled for still holds
(16-byte aligned pointers and row strides of the same divisibility, as Triton specializes them)
and no launch hook (a profiler) is installed; anything else takes the ordinary ``kernel[grid]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from arnorm_triton import _kernels as K
from arnorm_triton import _swizzle as S
from arnorm_triton._direct import HOOK_CHAIN, RUNTIME, Bound, bound_launchers
from arnorm_triton._launch_table import launch_config, two_pass_scales
from arnorm_triton._plugin import CAPABILITIES, MAX_HIDDEN

if TYPE_CHECKING:
    import torch

    from arnorm.plugin import RMSNorm

__all__ = ["FusedLauncher", "LaunchConfig", "norm_constexprs"]

_log = logging.getLogger("arnorm.triton")


def norm_constexprs(norm: RMSNorm) -> dict[str, bool]:
    """The kernels' constexpr of each norm option the backend declares (``CAPABILITIES.norm_options``):
    the option's name in capitals (``ROUND_BEFORE_WEIGHT``), True where ``norm`` turns it on. Shared
    with ``triton_symm``, whose kernels take the same epilogue."""
    unserved = norm.options - CAPABILITIES.norm_options
    if unserved:
        raise ValueError(f"norm options: {sorted(unserved)} (needs {sorted(CAPABILITIES.norm_options)})")
    return {name.upper(): name in norm.options for name in sorted(CAPABILITIES.norm_options)}


class LaunchConfig(NamedTuple):
    """How one launch is shaped; chosen per (H, T) by :mod:`arnorm_triton._launch_table`.

    ``two_pass``: swizzled block scales written linearly by the fused kernel into a scratch
    buffer of the call, then swizzled by :func:`~arnorm_triton._swizzle.swizzle_block_scales_kernel`
    (the same bytes; whole-sector stores at large T)."""

    num_warps: int
    two_pass: bool = False


class FusedLauncher:
    """Launches of :func:`arnorm_triton._kernels.fused_add_rmsnorm_quant_kernel` for one op.

    ``itemsize``: bytes per element of the op's dtype; ``norm``: the op's :class:`arnorm.plugin.RMSNorm`
    (its epsilon and offset are arguments, its options constexprs: :func:`norm_constexprs`).
    ``launch(x, res, w, scale, h, y, q, sf, n_rows, x_stride, res_stride, h_stride)``: tensors in
    the kernel's order; ``scale``, ``y``, ``q``, ``sf`` may be ``None`` when the variant does not
    read or write them. The launch configuration is a function of ``n_rows`` alone (a fixed table),
    so every TP rank launches the same grid for the same call.
    """

    def __init__(
        self,
        *,
        hidden: int,
        itemsize: int,
        quant: str | None,
        layout: str | None,
        write_normed: bool,
        num_partials: int,
        norm: RMSNorm,
        add_residual: bool = True,
        soft: bool,
        soft_fp8: bool,
        pdl: bool = False,
        arch: tuple[int, int] | None = None,
        num_warps: int | None = None,
        two_pass: bool | None = None,
    ) -> None:
        if hidden > MAX_HIDDEN:
            msg = f"hidden size: {hidden} (needs <= {MAX_HIDDEN})"
            raise ValueError(msg)
        block, group, vec = K.row_shape(hidden, quant, itemsize)
        self.hidden = hidden
        self.itemsize = itemsize
        self.quant = quant
        self.arch = arch
        self.swizzled = K.is_swizzled(quant, layout)
        self.fixed_warps = num_warps
        #: Two-pass scale stores forced on or off (labs, tests); None: the table's rule.
        self.fixed_two_pass = two_pass
        self.eps = float(norm.eps)
        self.weight_offset = float(norm.weight_offset)
        self.constexprs: dict[str, Any] = {
            "HIDDEN": hidden,
            "BLOCK": block,
            "GROUP": group,
            "VEC": vec,
            "NUM_PARTIALS": num_partials,
            "QUANT": K.QUANT_CODES[quant],
            "SWIZZLED": self.swizzled,
            "SCALE_LAYOUT": K.SCALE_LAYOUT_CODES[layout],
            "WRITE_NORMED": write_normed,
            "SOFT": soft,
            "SOFT_FP8": soft_fp8,
            "USE_PDL": pdl,
            "HAS_RESIDUAL": add_residual,
            **norm_constexprs(norm),
        }
        names = K.fused_add_rmsnorm_quant_kernel.arg_names
        self._const_names = names[names.index("HIDDEN") :]
        consts = tuple(self.constexprs[n] for n in self._const_names)
        #: Every argument after the strides, in signature order, for the direct launch.
        self._tail = (self.eps, self.weight_offset, *consts)
        # Triton specializes integer arguments divisible by 16: strides must keep that property.
        self._div16 = hidden % 16 == 0
        self._bound: dict[LaunchConfig, Bound] = {}
        self._by_rows: dict[int, tuple[Any, ...]] = {}
        self._get_stream: Callable[[int], int] | None = None
        self._device_index = 0

    # -- configuration ----------------------------------------------------------------------

    def config(self, n_rows: int) -> LaunchConfig:
        """The launch configuration for ``n_rows`` rows (a pure function of the op and ``n_rows``)."""
        c = self.constexprs
        key = (self.arch, c["BLOCK"], c["QUANT"], c["WRITE_NORMED"], self.itemsize, n_rows)
        warps = launch_config(*key) if self.fixed_warps is None else self.fixed_warps
        two = two_pass_scales(*key) if self.fixed_two_pass is None else self.fixed_two_pass
        return LaunchConfig(warps, self.swizzled and two)

    def configs(self, max_rows: int) -> list[LaunchConfig]:
        """Every distinct configuration used for 1 to ``max_rows`` rows."""
        seen: dict[LaunchConfig, None] = {}
        for t in _probe_counts(max_rows):
            seen.setdefault(self.config(t))
        return list(seen)

    def grid_rows(self, n_rows: int, cfg: LaunchConfig | None = None) -> int:
        """Programs to launch: T, plus one per 32 padding rows when the fused kernel writes swizzled
        scales itself (not in a two-pass launch, whose second kernel writes the padding)."""
        two_pass = (cfg or self.config(n_rows)).two_pass
        return n_rows + K.padding_programs(n_rows) if self.swizzled and not two_pass else n_rows

    @property
    def pdl(self) -> bool:
        return bool(self.constexprs["USE_PDL"])

    # -- launching --------------------------------------------------------------------------

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
    ) -> Any:
        """One launch over ``n_rows`` rows (returns the compiled kernel when launched ordinarily: for a
        two-pass configuration, the fused and the swizzle kernels' pair)."""
        # y, q, sf are this backend's own allocations or caller buffers arnorm checked for 16-byte
        # alignment; scale is not specialized (any pointer).
        hp = h.data_ptr()
        if self.launch_pointers(
            n_rows, x.data_ptr(), res.data_ptr(), w.data_ptr(), hp if scale is None else scale.data_ptr(), hp,
            hp if y is None else y.data_ptr(), hp if q is None else q.data_ptr(),
            hp if sf is None else sf.data_ptr(), x_stride, res_stride, h_stride,
        ):  # fmt: skip
            return None
        cfg = self.config(n_rows)
        return self._ordinary(cfg, (x, res, w, scale, h, y, q, sf), n_rows, x_stride, res_stride, h_stride)

    def launch_pointers(self, n_rows: int, xp: int, rp: int, wp: int, sp: int, hp: int, yp: int, qp: int,
                        sfp: int, x_stride: int, res_stride: int, h_stride: int) -> bool:  # fmt: skip
        """The direct launch from data pointers (any valid pointer where the variant reads or writes
        nothing); ``False`` when it cannot be taken (no bound launcher, a specialization that does
        not hold, a launch hook installed): then nothing was launched, and :meth:`launch` must be used.
        """
        entry = self._by_rows.get(n_rows) or self._entry(n_rows)
        run = entry[0]
        if run is None:
            return False
        # Pointers 16-byte aligned, and strides as bound: Triton specializes integers divisible
        # by 16 and integers equal to 1, and the bound variants saw strides of H. So when H is
        # a multiple of 16 every stride must be one too (one test with the pointers), else
        # none may be 1.
        if self._div16:
            if (xp | rp | wp | hp | yp | qp | sfp | x_stride | res_stride | h_stride) & 15:
                return False
        elif (xp | rp | wp | hp | yp | qp | sfp) & 15 or x_stride == 1 or res_stride == 1 or h_stride == 1:
            return False
        hook = RUNTIME.launch_enter_hook  # a profiler's hook: the ordinary launch
        if hook is not None and not (type(hook) is HOOK_CHAIN and not hook.calls):
            return False
        run(
            entry[1], 1, 1, entry[4](entry[5]), entry[2], *entry[3],
            xp, rp, wp, sp, hp, yp, qp, sfp, n_rows, x_stride, res_stride, h_stride, *self._tail,
        )  # fmt: skip
        return True

    def rows_launcher(self) -> Callable[[int, int, int, int, int, int, int, int, int], bool]:
        """:meth:`launch_pointers` for contiguous rows (every stride H) whose outputs ``yp``, ``qp``,
        ``sfp`` are known 16-byte aligned (the backend's own allocations, or ``out=`` buffers arnorm
        checked): ``go(n_rows, xp, rp, wp, sp, hp, yp, qp, sfp) -> bool``. The eager fast path's
        launch: one frame, and the constant parts of the test made once here."""
        by_rows, entry_of, tail, h = self._by_rows, self._entry, self._tail, self.hidden
        if not self._div16 and h == 1:  # a stride of 1 would break the bound specialization

            def never(*pointers: int) -> bool:
                return False

            return never

        def go(n_rows: int, xp: int, rp: int, wp: int, sp: int, hp: int, yp: int, qp: int, sfp: int) -> bool:
            e = by_rows.get(n_rows) or entry_of(n_rows)
            if e[0] is None or (xp | rp | wp | hp) & 15:
                return False
            hook = RUNTIME.launch_enter_hook
            if hook is not None and not (type(hook) is HOOK_CHAIN and not hook.calls):
                return False
            e[0](e[1], 1, 1, e[4](e[5]), e[2], *e[3], xp, rp, wp, sp, hp, yp, qp, sfp, n_rows, h, h, h, *tail)
            return True

        return go

    def _entry(self, n_rows: int) -> tuple[Any, ...]:
        """``(run, grid, function, mid, get_stream, device_index)`` for ``n_rows``: the bound
        launcher (``run`` None when there is none) flattened with the grid and the stream's source;
        cached per token count once launchers are bound."""
        cfg = self.config(n_rows)
        bound = self._bound.get(cfg)
        grid = self.grid_rows(n_rows, cfg)
        if bound is None:
            entry: tuple[Any, ...] = (None, grid, None, (), None, 0)
        else:
            entry = (bound.run, grid, bound.function, bound.mid, self._get_stream, self._device_index)
        if self._bound:
            self._by_rows[n_rows] = entry
        return entry

    def _ordinary(self, cfg: LaunchConfig, tensors: Sequence[Any], n_rows: int, *strides: int) -> Any:
        import torch

        h = tensors[4]
        ptrs = [h if t is None else t for t in tensors]
        # The kernel stores codes and block scales as bytes: fp8 outputs go in as uint8 views.
        for i in (6, 7):
            if ptrs[i].element_size() == 1 and ptrs[i].dtype is not torch.uint8:
                ptrs[i] = ptrs[i].view(torch.uint8)
        extra = {"launch_pdl": True} if self.pdl else {}
        if cfg.two_pass:
            return self._two_pass(cfg, ptrs, n_rows, strides, extra)
        return K.fused_add_rmsnorm_quant_kernel[(self.grid_rows(n_rows, cfg),)](
            *ptrs, n_rows, *strides, self.eps, self.weight_offset, num_warps=cfg.num_warps,
            **extra, **self.constexprs,
        )  # fmt: skip

    def _two_pass(self, cfg: LaunchConfig, ptrs: list[Any], n_rows: int, strides: Sequence[int],
                  extra: dict[str, Any]) -> Any:  # fmt: skip
        """The fused kernel writing linear scales into a scratch buffer of this call (allocated per
        call: no state shared between calls, whatever their streams), then the swizzle kernel."""
        import torch

        c = self.constexprs
        k = self.hidden // c["GROUP"]
        sf = ptrs[7]
        scratch = torch.empty(n_rows * k, dtype=torch.uint8, device=sf.device)
        compiled = K.fused_add_rmsnorm_quant_kernel[(n_rows,)](
            *ptrs[:7], scratch, n_rows, *strides, self.eps, self.weight_offset, num_warps=cfg.num_warps,
            **extra, **(c | {"SWIZZLED": False}),
        )  # fmt: skip
        kp, kc, chunks = S.swizzle_shape(k)
        swizzle = S.swizzle_block_scales_kernel[((n_rows + 127) // 128, chunks)](
            scratch, sf, n_rows, K=k, KP=kp, KC=kc, USE_PDL=c["USE_PDL"], num_warps=S.SWIZZLE_WARPS, **extra
        )
        return compiled, swizzle

    def _two_pass_bound(self, fused: Bound, swizzle: Bound, device: Any) -> Bound:
        """A :class:`Bound` whose ``run`` takes the fused kernel's direct-launch arguments and makes
        both launches: the fused kernel into a scratch buffer of the call (``sf``'s pointer swapped
        for it), then the swizzle kernel into ``sf``. The scratch is freed on return: the caching
        allocator hands it out again only in stream order, after both kernels read it."""
        import torch

        k = self.hidden // self.constexprs["GROUP"]
        (kp, kc, chunks), pdl = S.swizzle_shape(k), self.constexprs["USE_PDL"]
        # Among the fused run's arguments after `function`: sf's pointer, and the SWIZZLED
        # constexpr (after 8 pointers, n_rows, 3 strides, eps and weight_offset), which the
        # bound variant was compiled False for (the launcher passes constexprs along as given).
        at = len(fused.mid) + 7
        swz = at + 7 + self._const_names.index("SWIZZLED")
        f_run, s_run, s_fn, s_mid = fused.run, swizzle.run, swizzle.function, swizzle.mid
        empty, u8 = torch.empty, torch.uint8

        def run(gx: int, gy: int, gz: int, stream: int, function: Any, *rest: Any) -> None:
            n_rows = rest[at + 1]
            scratch = empty(n_rows * k, dtype=u8, device=device)
            sp, sfp = scratch.data_ptr(), rest[at]
            f_run(gx, gy, gz, stream, function, *rest[:at], sp, *rest[at + 1 : swz], False, *rest[swz + 1 :])
            s_run((n_rows + 127) // 128, chunks, 1, stream, s_fn, *s_mid, sp, sfp, n_rows, k, kp, kc, pdl)

        return Bound(run, fused.function, fused.mid)

    def _direct(
        self, bound: Bound, cfg: LaunchConfig, ptrs: tuple[int, ...], n_rows: int, *strides: int
    ) -> None:
        assert self._get_stream is not None
        args = (*ptrs, n_rows, *strides, *self._tail)
        stream = self._get_stream(self._device_index)
        bound.run(self.grid_rows(n_rows, cfg), 1, 1, stream, bound.function, *bound.mid, *args)

    # -- setup ------------------------------------------------------------------------------

    def bind(self, tensors: Sequence[Any], outputs: Sequence[Any], n_rows: int, strides: tuple[int, int, int],
             configs: Sequence[LaunchConfig]) -> bool:  # fmt: skip
        """Compile each configuration through ``kernel[grid]``, bind its launcher, and keep it only
        if a direct launch writes ``outputs`` bit for bit as the ordinary launch did. Synchronizes
        (setup only). ``tensors`` = x, res, w, scale, h, y, q, sf must not alias (x and h distinct)
        and be 16-byte aligned, as every tensor torch allocates is.
        """
        self._bound.clear()
        self._by_rows.clear()
        if K.INTERPRETED:
            return False
        try:
            import torch
            from triton.runtime import driver

            dev = tensors[0].device
            self._device_index = dev.index if dev.index is not None else torch.cuda.current_device()
            self._get_stream = driver.active.get_current_stream
            ptrs = tuple((tensors[4] if t is None else t).data_ptr() for t in tensors)
            for cfg in configs:
                compiled = self._ordinary(cfg, tensors, n_rows, *strides)
                if cfg.two_pass:
                    candidates = [
                        self._two_pass_bound(f, s, dev)
                        for f in bound_launchers(compiled[0])
                        for s in bound_launchers(compiled[1])
                    ]
                else:
                    candidates = bound_launchers(compiled)
                first = [o.clone() for o in outputs]
                for bound in candidates:
                    for o in outputs:
                        o.zero_()
                    self._direct(bound, cfg, ptrs, n_rows, *strides)
                    torch.cuda.synchronize(dev)
                    pairs = zip(first, outputs, strict=True)
                    if all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs):
                        self._bound[cfg] = bound
                        break
                else:
                    _log.warning("triton: direct launch disagrees with kernel[grid]; using kernel[grid]")
                    self._bound.clear()
                    self._by_rows.clear()
                    return False
            return True
        except Exception as exc:  # any Triton API drift: fall back, never fail setup over speed
            _log.warning(
                "triton: direct launch unavailable (%s: %s); using kernel[grid]", type(exc).__name__, exc
            )
        self._bound.clear()
        self._by_rows.clear()
        return False

    def unbind(self) -> None:
        """Drop the direct launchers: every launch goes through ``kernel[grid]`` (benchmarks, tests)."""
        self._bound.clear()
        self._by_rows.clear()

    @property
    def fast(self) -> bool:
        """Whether launches go straight to the compiled kernel's launcher."""
        return bool(self._bound)


def _probe_counts(max_rows: int) -> list[int]:
    """Token counts that reach every bucket of the launch table: powers of two and their neighbours."""
    counts = {1, max_rows}
    p = 1
    while p <= max_rows:
        counts.update(c for c in (p - 1, p, p + 1) if 1 <= c <= max_rows)
        p *= 2
    return sorted(counts)
