"""``TritonBackend``: torch.distributed all-reduce (or all-gather) + one fused Triton kernel.

Per call, for this rank's partial ``hidden_states`` ``[T, H]``:

- TP 1: the kernel alone (``hidden_states`` is already the sum).
- TP > 1, default: ``torch.distributed.all_reduce`` (NCCL on CUDA, RCCL on ROCm, gloo on CPU) in
  place, then the kernel. The collective sums in the dtype, in the library's order (NCCL: ring or
  tree), so ``s`` may differ from the reference's fp32 rank-order sum by rounding; the contract
  then holds given that ``s`` (DESIGN.md, "Numerics contract").
- TP > 1, ``Config.triton_exact``: all-gather the partials into a rank-major ``[W * T, H]`` view
  of a buffer built at setup, and the kernel sums them in fp32 from rank 0 up with one rounding: bitwise the
  reference's ``s`` at any TP size. Cost: every rank receives ``(W - 1) * T * H`` elements
  instead of the ring all-reduce's ``2 * (W - 1) / W * T * H`` (the same at W = 2, W / 2 times
  more beyond), and the kernel reads ``W`` partials instead of one, so at W >= 4 and large T
  (bandwidth-bound prefill) it is slower; at decode sizes both are latency-bound and close. The
  buffer holds ``W * max_tokens * H`` elements per rank.

A call allocates only its outputs and never synchronizes with the host; the kernel variant and its
launch parameters are fixed at :meth:`TritonBackend.create`, so the call is CUDA-graph capturable
(the NCCL collectives are too).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any, ClassVar

from arnorm.plugin import Output, QuantizedActivation

if TYPE_CHECKING:
    import torch

    from arnorm.plugin import Comm, Config, Problem

__all__ = ["TritonBackend"]

_log = logging.getLogger("arnorm.triton")

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
    normed activation when ``problem.normed_output``, and the quantized activation exactly as
    :func:`arnorm.quant.quantize` lays it out (fp8 codes ``float8_e4m3fn [T, H]``; nvfp4 ``uint8
    [T, H/2]`` with ``float8_e4m3fn`` block scales; mxfp8 ``uint8`` E8M0 scales; swizzled scales
    ``[round_up(T, 128), round_up(K, 4)]`` with zero padding).
    """

    name: ClassVar[str] = "triton"

    def __init__(self, problem: Problem, comm: Comm, config: Config) -> None:
        import torch

        from arnorm_triton._kernels import INTERPRETED, FusedLauncher

        self._problem = problem
        self._comm = comm
        self._device = comm.device
        self._dtype = getattr(torch, problem.dtype)
        self._world = comm.world_size
        self._exact = bool(config.triton_exact) and self._world > 1
        self._inplace = problem.inplace
        self._normed = problem.normed_output
        self._quant = problem.quant
        self._layout = problem.scale_layout
        self._hidden = h = problem.hidden_size
        self._max_tokens = problem.max_tokens
        soft = INTERPRETED
        # e4m3 in integer arithmetic where the hardware conversion is missing or differs:
        # before SM 8.9 (no cvt to e4m3) and on ROCm (whose float8e4nv support varies by arch).
        soft_fp8 = soft or problem.platform != "cuda" or (problem.arch or (0, 0)) < (8, 9)
        self._launcher = FusedLauncher(
            hidden=h,
            quant=problem.quant,
            layout=problem.scale_layout,
            write_normed=problem.normed_output,
            num_partials=self._world if self._exact else 1,
            eps=problem.eps,
            weight_offset=problem.weight_offset,
            soft=soft,
            soft_fp8=soft_fp8,
        )
        self._gather: torch.Tensor | None = None
        if self._exact:
            # One flat buffer: any T's [W * T, H] view of its head is contiguous, as the gather needs.
            numel = self._world * problem.max_tokens * h
            self._gather = torch.empty(numel, dtype=self._dtype, device=self._device)
        self._u8 = torch.uint8
        self._f32 = torch.float32
        self._fp8 = torch.float8_e4m3fn
        self._block = {"nvfp4": 16, "mxfp8": 32}.get(problem.quant or "", 0)
        self._swizzled = self._launcher.swizzled
        self.fast_launch = False

    # -- selection --------------------------------------------------------------------------

    @classmethod
    def probe(cls, problem: Problem) -> tuple[str, ...]:
        """What the declared capabilities cannot say: Triton present and new enough, a usable
        target (a GPU, or the interpreter for CPU tensors), the single-pass width limit."""
        from arnorm_triton._plugin import MAX_HIDDEN

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
        h = problem.hidden_size
        if h > MAX_HIDDEN:
            reasons.append(f"hidden size: {h} (needs <= {MAX_HIDDEN})")
        if problem.quant == "nvfp4" and h % 16:
            reasons.append(f"hidden size: {h} (needs a multiple of 16 for nvfp4)")
        if problem.quant == "mxfp8" and h % 32:
            reasons.append(f"hidden size: {h} (needs a multiple of 32 for mxfp8)")
        return tuple(reasons)

    @classmethod
    def create(cls, problem: Problem, comm: Comm, config: Config) -> TritonBackend:
        """Bind the kernel variant, allocate the exact-mode gather buffer, compile and warm up.

        Collective only in that every rank calls it; no collective runs here (the warm-up launch
        is local), so a rank cannot hang on another's compile.
        """
        self = cls(problem, comm, config)
        if self._device.type != "cpu":
            self.fast_launch = self._warm_up()
        return self

    def _warm_up(self) -> bool:
        """Compile the variant on dummy rows (the first launch's JIT cost stays out of the step)
        and switch to the direct C launcher when it reproduces ``kernel[grid]`` bit for bit."""
        import torch

        t, h = 3, self._hidden
        g = torch.Generator(device=self._device).manual_seed(0)
        x = torch.randn((self._launcher.constexprs["NUM_PARTIALS"], t, h), generator=g, device=self._device)
        x = x.to(self._dtype)
        res = torch.randn((t, h), generator=g, device=self._device).to(self._dtype)
        w = torch.randn((h,), generator=g, device=self._device).to(self._dtype)
        scale = torch.tensor([0.5], dtype=self._f32, device=self._device)
        h_out = torch.empty((t, h), dtype=self._dtype, device=self._device)
        y, q, sf, _ = self._alloc(t, h_out)
        ptrs = self._ptrs(x, res, w, scale, h_out, y, q, sf)
        outputs = tuple(o for o in (h_out, y, q, sf) if o is not None)
        return self._launcher.enable_fast_path(ptrs, outputs, t)

    def check_tokens(self, num_tokens: int) -> tuple[str, ...]:
        if self._exact and num_tokens > self._max_tokens:
            return (f"tokens: {num_tokens} (needs <= {self._max_tokens}, the exact-mode gather buffer)",)
        return ()

    # -- the call ---------------------------------------------------------------------------

    def _alloc(
        self, t: int, h_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """This call's outputs besides the residual: normed, codes (bytes), scales (bytes or fp32),
        and the scale tensor as returned (fp8 views of the byte buffers where the format says so)."""
        import torch

        dev, hidden = self._device, self._hidden
        y = torch.empty((t, hidden), dtype=self._dtype, device=dev) if self._normed else None
        quant = self._quant
        if quant is None:
            return y, None, None, None
        if quant == "nvfp4":
            q = torch.empty((t, hidden // 2), dtype=self._u8, device=dev)
        else:
            q = torch.empty((t, hidden), dtype=self._u8, device=dev)
        if quant == "fp8_static":
            return y, q, None, None
        if quant == "fp8_per_token":
            sf = torch.empty((t, 1), dtype=self._f32, device=dev)
            return y, q, sf, sf
        k = hidden // self._block
        shape = ((t + 127) // 128 * 128, (k + 3) // 4 * 4) if self._swizzled else (t, k)
        sf = torch.empty(shape, dtype=self._u8, device=dev)
        return y, q, sf, sf.view(self._fp8) if quant == "nvfp4" else sf

    @staticmethod
    def _ptrs(
        x: torch.Tensor,
        res: torch.Tensor,
        w: torch.Tensor,
        scale: torch.Tensor | None,
        h_out: torch.Tensor,
        y: torch.Tensor | None,
        q: torch.Tensor | None,
        sf: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        """The kernel's pointer arguments; absent ones get ``h_out`` (never dereferenced)."""
        return (
            x,
            res,
            w,
            h_out if scale is None else scale,
            h_out,
            h_out if y is None else y,
            h_out if q is None else q,
            h_out if sf is None else sf,
        )

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> Output:
        t = hidden_states.shape[0]
        if self._world == 1:
            x = hidden_states
            h_out = hidden_states if self._inplace else hidden_states.new_empty(hidden_states.shape)
        elif self._exact:
            assert self._gather is not None
            # [W * T, H], rank-major: gloo's all_gather_single wants the concatenation, not a stacked
            # [W, T, H] (NCCL takes both); the kernel reads rank r's rows at r * T * H either way.
            x = self._gather[: self._world * t * self._hidden].view(self._world * t, self._hidden)
            self._comm.all_gather_into(x, hidden_states)
            h_out = hidden_states if self._inplace else hidden_states.new_empty(hidden_states.shape)
        elif self._inplace:
            x = h_out = self._comm.all_reduce_(hidden_states)
        else:
            # Reduce into the residual output so the caller's partial stays untouched: the
            # kernel then reads s and writes h in the same buffer, element by element.
            x = h_out = hidden_states.new_empty(hidden_states.shape).copy_(hidden_states)
            self._comm.all_reduce_(h_out)
        y, q, sf, sf_out = self._alloc(t, h_out)
        self._launcher.launch(*self._ptrs(x, residual, weight, scale, h_out, y, q, sf), n_rows=t)
        return Output(y, h_out, self._quantized(q, sf_out, scale))

    def _quantized(
        self, q: torch.Tensor | None, sf: torch.Tensor | None, scale: torch.Tensor | None
    ) -> QuantizedActivation | None:
        quant = self._quant
        if quant is None or q is None:
            return None
        if quant == "fp8_static":
            assert scale is not None
            return QuantizedActivation(q.view(self._fp8), scale, quant)
        assert sf is not None
        if quant == "fp8_per_token":
            return QuantizedActivation(q.view(self._fp8), sf, quant)
        if quant == "nvfp4":
            return QuantizedActivation(q, sf, quant, self._layout, scale)
        return QuantizedActivation(q.view(self._fp8), sf, quant, self._layout)

    def close(self) -> None:
        """Drop the gather buffer (idempotent; nothing else is held)."""
        self._gather = None

    # -- introspection used by tests and the benchmark ----------------------------------------

    @property
    def launcher(self) -> Any:
        """The bound :class:`arnorm_triton._kernels.FusedLauncher`."""
        return self._launcher

    @property
    def exact(self) -> bool:
        """Whether partials are all-gathered and summed in rank order in the kernel."""
        return self._exact
