"""``TritonBackend``: torch.distributed all-reduce (or all-gather) + one fused Triton kernel.

Per call, for this rank's partial ``hidden_states`` ``[T, H]``:

- TP 1: the kernel alone (``hidden_states`` is already the sum).
- TP > 1, default: ``torch.distributed.all_reduce`` (NCCL on CUDA, RCCL on ROCm, gloo on CPU) in
  place, then the kernel. The collective sums in the dtype, in the library's order (NCCL: ring or
  tree), so ``s`` may differ from the reference's fp32 rank-order sum by rounding; the contract
  then holds given that ``s`` (docs/numerics.md, section 1).
- TP > 1, ``ARNORM_TRITON_EXACT=1``: all-gather the partials into a rank-major ``[W * T, H]`` view
  of a buffer built at setup, and the kernel sums them in fp32 from rank 0 up with one rounding:
  bitwise the reference's ``s`` at any TP size. Cost: every rank receives ``(W - 1) * T * H``
  elements instead of the ring all-reduce's ``2 * (W - 1) / W * T * H`` (the same at W = 2,
  W / 2 times more beyond), and the kernel reads ``W`` partials instead of one, so at W >= 4 and
  large T (bandwidth-bound prefill) it is slower; at decode sizes both are latency-bound and
  close. The buffer holds ``W * max_tokens * H`` elements per rank.

Rows may be strided (``[T, H]`` views with unit column stride): the kernel takes row strides. A
call allocates only its outputs and never synchronizes with the host; the kernel variants and
their launchers are bound at :meth:`TritonBackend.create`, so the call is CUDA-graph capturable
(the NCCL collectives are too).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any, ClassVar

from arnorm.plugin import BackendSetupError, Output, RMSNorm

if TYPE_CHECKING:
    import torch

    from arnorm.plugin import BackendSettings, Comm, Problem

__all__ = ["TritonBackend"]

#: The oldest Triton the ``triton`` extra allows; the kernel is compile-checked with 3.6 and 3.8.
MIN_TRITON = (3, 2)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonBackend:
    """The ``triton`` backend: any TP size, CUDA / ROCm (and CPU through the Triton interpreter).

    Outputs per call: the new residual (``hidden_states`` itself when ``problem.inplace``), the
    normed activation when ``problem.normed_output``, and the quantized activation laid out as
    :data:`arnorm.plugin.FORMAT_SPECS` says (as :func:`arnorm.quant.quantize` returns it).
    """

    name: ClassVar[str] = "triton"

    def __init__(self, problem: Problem, comm: Comm, exact: bool, pdl: bool) -> None:
        """``exact``: the exact mode (``ARNORM_TRITON_EXACT``, or any batch-invariant op): the
        rank-order gather at TP > 1, and one warp count for every token count."""
        import torch

        from arnorm_triton._kernels import INTERPRETED, row_shape
        from arnorm_triton._launch import FusedLauncher
        from arnorm_triton._launch_table import default_num_warps
        from arnorm_triton._outputs import OutputPlan

        self._problem = problem
        self._comm = comm
        self._device = comm.device
        self._dtype = getattr(torch, problem.dtype)
        self._world = comm.world_size
        self._exact = exact and self._world > 1
        self._inplace = problem.inplace
        self._normed = problem.normed_output
        #: The normed output over hidden_states, the new residual over residual (no y to allocate).
        self._in_place = problem.output_layout == "in_place"
        self._quant = problem.quant
        self._hidden = h = problem.hidden_size
        self._max_tokens = problem.max_tokens
        soft = INTERPRETED
        # e4m3 in integer arithmetic where the hardware conversion is missing or differs:
        # before SM 8.9 (no cvt to e4m3) and on ROCm (whose float8e4nv support varies by arch).
        soft_fp8 = soft or problem.platform != "cuda" or (problem.arch or (0, 0)) < (8, 9)
        # The output plan, from the format table, resolved once (shared with triton_symm). The
        # kernel writes the layout the plan resolved (a Problem may leave it None: the format's
        # default). Bound methods as attributes: the call path pays no more lookups than inline code.
        plan = OutputPlan(
            hidden=h,
            dtype=self._dtype,
            quant=problem.quant,
            layout=problem.scale_layout,
            normed=problem.normed_output and not self._in_place,
            device=self._device,
        )
        # The launch table's warp count changes with T, and with it the order of the sum of
        # squares: exact mode pins it to a function of the row's shape alone (the count triton_symm
        # always uses), so a row's result does not depend on the token count.
        itemsize = torch.empty((), dtype=self._dtype).element_size()
        pinned = default_num_warps(row_shape(h, problem.quant, itemsize)[0]) if exact else None
        self._launcher = FusedLauncher(
            hidden=h,
            itemsize=itemsize,
            quant=problem.quant,
            layout=plan.layout,
            write_normed=problem.normed_output,
            num_partials=self._world if self._exact else 1,
            norm=RMSNorm.with_options(problem.eps, problem.weight_offset, problem.norm_options),
            add_residual=problem.add_residual,
            soft=soft,
            soft_fp8=soft_fp8,
            pdl=pdl,
            arch=problem.arch if problem.platform == "cuda" else None,
            num_warps=pinned,
        )
        self._gather: torch.Tensor | None = None
        if self._exact:
            # One flat buffer: any T's [W * T, H] view of its head is contiguous, as the gather needs.
            numel = self._world * problem.max_tokens * h
            self._gather = torch.empty(numel, dtype=self._dtype, device=self._device)
        self._alloc = plan.alloc
        self._output = plan.output
        #: Whether the scales are the kernel's to write (not the caller's input scale).
        self._own_scales = plan.computes_scales
        self._launch = self._launcher.launch
        self.fast_launch = False

    # -- selection --------------------------------------------------------------------------

    @classmethod
    def probe(cls, problem: Problem) -> tuple[str, ...]:
        """What the declared capabilities cannot say: Triton present and new enough, and a usable
        target (a GPU, or the interpreter for CPU tensors)."""
        if importlib.util.find_spec("triton") is None:
            return ("triton: not importable (needs pip install 'arnorm[triton]')",)
        try:
            import triton
        except Exception as exc:  # a broken install must not break selection
            return (f"triton: import failed with {type(exc).__name__}: {exc} (needs a working triton)",)
        reasons: list[str] = []
        version = getattr(triton, "__version__", "0")
        if _version_tuple(version) < MIN_TRITON:
            reasons.append(f"triton: {version} (needs >= {MIN_TRITON[0]}.{MIN_TRITON[1]})")
        if problem.platform == "cpu" and not _interpret_requested():
            reasons.append("platform: cpu (needs cuda or rocm, or TRITON_INTERPRET=1)")
        elif problem.platform == "cpu":
            from arnorm_triton._kernels import INTERPRETED

            if not INTERPRETED:
                reasons.append(
                    "triton interpreter: off when arnorm_triton._kernels was imported "
                    "(needs TRITON_INTERPRET=1 before the first import)"
                )
        return tuple(reasons)

    @classmethod
    def create(cls, problem: Problem, comm: Comm, settings: BackendSettings) -> TritonBackend:
        """Bind the kernel variants, allocate the exact-mode gather buffer, compile and warm up.

        Collective only in that every rank calls it; no collective runs here (the warm-up launches
        are local), so a rank cannot hang on another's compile. ``settings`` is a
        :class:`arnorm_triton._plugin.TritonSettings`.
        """
        exact = bool(getattr(settings, "exact", False))
        if problem.batch_invariant and not exact:
            if "exact" in getattr(settings, "model_fields_set", ()):
                msg = (
                    "batch invariance: exact=False (ARNORM_TRITON_EXACT or Config.settings) (needs "
                    "exact=True or unset: the library all-reduce sums in an order that changes with "
                    "its algorithm and the size, and the launch table's warp count changes with T)"
                )
                raise BackendSetupError(msg)
            exact = True
        from arnorm_triton._direct import pdl_available

        pdl = bool(getattr(settings, "pdl", True)) and pdl_available(problem)
        self = cls(problem, comm, exact, pdl)
        if self._device.type != "cpu":
            self.fast_launch = self._warm_up()
            if not self.fast_launch and pdl:
                # A Triton without launch_pdl support, or a driver that refuses it: launch plainly.
                self = cls(problem, comm, exact, False)
                self.fast_launch = self._warm_up()
        return self

    def _warm_up(self) -> bool:
        """Compile every launch configuration this op uses on dummy rows (the JIT cost stays out of
        the step) and bind the direct launcher where it reproduces ``kernel[grid]`` bit for bit."""
        import torch

        t, h = 3, self._hidden
        g = torch.Generator(device=self._device).manual_seed(0)
        parts = self._launcher.constexprs["NUM_PARTIALS"]
        x = torch.randn((parts, t, h), generator=g, device=self._device).to(self._dtype)
        res = torch.randn((t, h), generator=g, device=self._device).to(self._dtype)
        w = torch.randn((h,), generator=g, device=self._device).to(self._dtype)
        scale = torch.tensor([0.5], dtype=torch.float32, device=self._device)
        h_out = torch.empty((t, h), dtype=self._dtype, device=self._device)
        y, q, sf = self._alloc(t)
        if self._in_place and self._normed:  # the call writes y over the rows it read
            y = torch.empty((t, h), dtype=self._dtype, device=self._device)
        tensors = (x, res, w, scale, h_out, y, q, sf)
        outputs = [o for o in (h_out, y, q, sf) if o is not None]
        configs = self._launcher.configs(self._max_tokens)
        try:
            return self._launcher.bind(tensors, outputs, t, (h, h, h), configs)
        except Exception:
            return False

    def check_tokens(self, num_tokens: int) -> tuple[str, ...]:
        if self._exact and num_tokens > self._max_tokens:
            return (f"tokens: {num_tokens} (needs <= {self._max_tokens}, the exact-mode gather buffer)",)
        return ()

    # -- the call ---------------------------------------------------------------------------

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
        out: Output | None = None,
    ) -> Output:
        if self._in_place:
            assert residual is not None  # the op refuses the layout without a residual add
            return self._call_in_place(hidden_states, residual, weight, scale, out)
        t = hidden_states.shape[0]
        hidden = self._hidden
        # Row strides; a single row's stride is never used (and may be anything): pass H.
        xs = hs = hidden_states.stride(0) if t > 1 else hidden
        if residual is None:  # add_residual=False: the kernel never reads it; any aligned pointer
            residual, rs = weight, hidden
        else:
            rs = residual.stride(0) if t > 1 else hidden
        if self._world == 1:
            x = hidden_states
            if self._inplace:
                h_out = hidden_states
            else:
                h_out = self._fresh(hidden_states, out, t)
                hs = hidden
        elif self._exact:
            assert self._gather is not None
            # [W * T, H], rank-major: gloo's all_gather_single wants the concatenation, not a stacked
            # [W, T, H] (NCCL takes both); the kernel reads rank r's rows at r * T * H either way.
            x = self._gather[: self._world * t * hidden].view(self._world * t, hidden)
            self._comm.all_gather_into(x, hidden_states)
            xs = hidden
            if self._inplace:
                h_out = hidden_states
            else:
                h_out = self._fresh(hidden_states, out, t)
                hs = hidden
        elif self._inplace and (t == 1 or xs == hidden):
            x = h_out = self._comm.all_reduce_(hidden_states)
        else:
            # Reduce a contiguous copy (collectives take contiguous tensors, and the caller's
            # partial stays untouched when not in place); the kernel reads s from it and writes
            # h to hidden_states (in place) or into the copy itself, element by element.
            x = self._comm.all_reduce_(self._fresh(hidden_states, out, t).copy_(hidden_states))
            h_out = hidden_states if self._inplace else x
            xs = hidden
            hs = hs if self._inplace else hidden
        if out is None:
            y, q, sf = self._alloc(t)
        else:
            y, oq = out.normed, out.quant
            q, sf = (None, None) if oq is None else (oq.data, oq.scale if self._own_scales else None)
        self._launch(x, residual, weight, scale, h_out, y, q, sf, t, xs, rs, hs)
        return self._output(y, h_out, q, sf, scale)

    def _call_in_place(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
        out: Output | None,
    ) -> Output:
        """The in-place layout: the kernel reads a row of the sum and of the residual whole before
        its first store, so it writes the new residual over that residual row and the normed
        output over the row of ``hidden_states`` (which holds the reduced sum by then)."""
        t = hidden_states.shape[0]
        hidden = self._hidden
        xs = hidden_states.stride(0) if t > 1 else hidden
        rs = residual.stride(0) if t > 1 else hidden
        packed = xs == hidden  # the kernel writes y at row stride H
        if self._world == 1:
            x = hidden_states
        elif self._exact:
            assert self._gather is not None
            x = self._gather[: self._world * t * hidden].view(self._world * t, hidden)
            self._comm.all_gather_into(x, hidden_states)
            xs = hidden
        elif packed:
            x = self._comm.all_reduce_(hidden_states)
        else:
            x = self._comm.all_reduce_(hidden_states.new_empty(t, hidden).copy_(hidden_states))
            xs = hidden
        y = None
        if self._normed:
            y = hidden_states if packed else hidden_states.new_empty(t, hidden)
        if out is None:
            _, q, sf = self._alloc(t)
        else:
            oq = out.quant
            q, sf = (None, None) if oq is None else (oq.data, oq.scale if self._own_scales else None)
        self._launch(x, residual, weight, scale, residual, y, q, sf, t, xs, rs, rs)
        if y is not None and y is not hidden_states:
            y = hidden_states.copy_(y)
        return self._output(y, residual, q, sf, scale)

    def fast_path(self) -> Any:
        """The call from the core's pointers at TP 1 (``None`` at TP > 1, where the all-reduce
        needs the tensors): the arguments arrive checked and contiguous, so this reads only its
        outputs' pointers; the kernel goes through the direct launch when it holds, else
        :meth:`FusedLauncher.launch` (the interpreter, a profiler's hook)."""
        if self._world != 1:
            return None
        alloc, output, own_scales = self._alloc, self._output, self._own_scales
        inplace, h = self._inplace, self._hidden
        go, launch = self._launcher.rows_launcher(), self._launcher.launch
        if self._in_place:
            return self._fast_in_place(go, launch)

        def fast(t: int, x: Any, res: Any, w: Any, scale: Any, out: Output | None, xp: int, rp: int, wp: int,
                 sp: int) -> Output:  # fmt: skip
            if out is None:
                y, q, sf = alloc(t)
                h_out = x if inplace else x.new_empty(t, h)
            else:
                y, r_out, oq = out  # Output is (normed, residual, quant): unpacking beats three reads
                q, sf = (None, None) if oq is None else (oq.data, oq.scale if own_scales else None)
                h_out = x if inplace else r_out
            hp = xp if inplace else h_out.data_ptr()
            if res is None:  # add_residual=False: the kernel never reads it; any aligned pointer
                res, rp = w, wp
            yp = hp if y is None else y.data_ptr()
            qp = hp if q is None else q.data_ptr()
            sfp = hp if sf is None else sf.data_ptr()
            if not go(t, xp, rp, wp, sp or hp, hp, yp, qp, sfp):
                launch(x, res, w, scale, h_out, y, q, sf, t, h, h, h)
            return output(y, h_out, q, sf, scale)

        return fast

    def _fast_in_place(self, go: Any, launch: Any) -> Any:
        """:meth:`fast_path` for the in-place layout: contiguous rows (the core's promise to a
        fast path), the new residual over ``res``, the normed output over ``x``."""
        alloc, output, own_scales = self._alloc, self._output, self._own_scales
        normed, h = self._normed, self._hidden

        def fast(t: int, x: Any, res: Any, w: Any, scale: Any, out: Output | None, xp: int, rp: int, wp: int,
                 sp: int) -> Output:  # fmt: skip
            if out is None:
                _, q, sf = alloc(t)
            else:
                oq = out[2]
                q, sf = (None, None) if oq is None else (oq.data, oq.scale if own_scales else None)
            y = x if normed else None
            qp = rp if q is None else q.data_ptr()
            sfp = rp if sf is None else sf.data_ptr()
            if not go(t, xp, rp, wp, sp or rp, rp, xp if normed else rp, qp, sfp):
                launch(x, res, w, scale, res, y, q, sf, t, h, h, h)
            return output(y, res, q, sf, scale)

        return fast

    def _fresh(self, hidden_states: torch.Tensor, out: Output | None, t: int) -> torch.Tensor:
        """Where a not-in-place residual goes: ``out.residual`` (checked by arnorm), else a new tensor."""
        if out is not None and not self._inplace:
            return out.residual
        return hidden_states.new_empty(t, self._hidden)

    def close(self) -> None:
        """Drop the gather buffer (idempotent; nothing else is held)."""
        self._gather = None

    # -- introspection used by tests and the benchmark ----------------------------------------

    @property
    def launcher(self) -> Any:
        """The bound :class:`arnorm_triton._launch.FusedLauncher`."""
        return self._launcher

    @property
    def exact(self) -> bool:
        """Whether partials are all-gathered and summed in rank order in the kernel."""
        return self._exact
