"""Which arithmetic a norm module handed to the vLLM entry points computes, so the fused path follows it.

vLLM's norms changed arithmetic between releases (docs/numerics.md, "Conventions across the
ecosystem"): 0.33's ``GemmaRMSNorm`` and its CPU ``RMSNorm`` add in fp32, return the rounded sum as
the residual and normalize the *unrounded* sum (``RMSNorm(normalize_unrounded=True)``); older
releases, and kernels such as FlashInfer's, normalize the rounded sum. A drop-in that fuses must
compute what the module it replaces computes, so the arithmetic is read off the module itself:

- a module whose forward takes ``(x, residual)`` (vLLM's norms) is *probed* once per (class, dtype,
  weight dtype, device type): a copy of it, given a crafted weight, runs on crafted rows, and each of
  arnorm's four arithmetics (rounded or unrounded sum, rounding before the weight or not) is
  compared with it. The one that matches is used; one that matches up to the order in which the
  statistic's squares are summed (a GPU kernel's reduction tree: at most 1 ulp on under 1% of the
  values) is used too. When none does, or the copy does not respond to its crafted weight (a
  forward wrapped by a closure that holds the original module), or its residual is not the rounded
  sum, no arnorm arithmetic is the module's: ``None``, and the drop-ins run vLLM's own path for
  that module (one :class:`arnorm.ArnormWarning` names it and what differs);
- a module that takes ``x`` alone (Hugging Face style) gets the rounded sum (the caller adds in
  the dtype first) and the rounding order of its family, by class name;
- when probing cannot run (inside CUDA-graph capture) vLLM 0.33's own classes are known per
  platform (:func:`known_arithmetic`); anything else is not guessed: vLLM's own path.

Every rank probes the same rows on the same kind of device, so every rank reaches the same
arithmetic (the op built from it is agreed across ranks, as always).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

import torch

from arnorm._reference import add_rmsnorm
from arnorm._types import RMSNorm
from arnorm.integrations._common import accepts_residual, warn_once
from arnorm.integrations._hf_inspect import NORMS

__all__ = ["VLLM_033_GEMMA", "Arithmetic", "arithmetic_of", "known_arithmetic", "probe_arithmetic"]

#: Rows of a probe, and the share of normed values that may differ by one ulp (a reduction order).
PROBE_ROWS = 16
ORDER_SHARE = 0.01
_SEED = 35


@dataclass(frozen=True)
class Arithmetic:
    """How a norm turns ``(reduced, residual)`` into ``(normed, residual)``: an :class:`arnorm.RMSNorm`
    without its epsilon."""

    weight_offset: float
    round_before_weight: bool
    normalize_unrounded: bool

    def rmsnorm(self, eps: float) -> RMSNorm:
        return RMSNorm(eps, self.weight_offset, self.round_before_weight, self.normalize_unrounded)

    def describe(self) -> str:
        sums = "unrounded fp32 sum" if self.normalize_unrounded else "sum rounded to the dtype"
        order = "rounds before the weight" if self.round_before_weight else "rounds once after the weight"
        return f"normalizes the {sums}, {order}"


#: vLLM 0.33's ``GemmaRMSNorm`` (``ir.ops.fused_add_rms_norm`` with ``weight.float() + 1``): the
#: arithmetic of calls that hand no norm module (the quant entry point, ``warmup`` without ``norm``).
VLLM_033_GEMMA = Arithmetic(1.0, False, True)

_CANDIDATES = tuple(Arithmetic(0.0, rbw, unr) for unr in (True, False) for rbw in (False, True))
_cache: dict[tuple[Any, ...], Arithmetic | None] = {}
_lock = threading.Lock()


def _one_argument(norm: Any, offset: float) -> Arithmetic:
    """A norm that takes ``x`` alone: the caller rounds the sum; its family decides the rounding order."""
    for cls in type(norm).__mro__:
        known = NORMS.get(cls.__name__)
        if known is not None and known[0] == offset:
            return Arithmetic(offset, known[1], False)
    # Llama's family rounds before the weight, Gemma's once after it.
    return Arithmetic(offset, offset == 0.0, False)


def known_arithmetic(
    norm: Any, offset: float, dtype: torch.dtype, device: torch.device
) -> tuple[Arithmetic | None, str]:
    """Without a probe: ``(what vLLM 0.33's own norm class computes on this platform, how it was
    decided)``, or ``(None, why not)`` where arnorm will not guess (another class, another vLLM,
    another platform: the caller then runs vLLM's own path).

    vLLM 0.33 dispatches ``ir.ops.fused_add_rms_norm``: on CPU its native torch arithmetic (fp32
    add, the unrounded sum normalized, ``x.to(weight.dtype) * weight``); on CUDA its C kernel
    (``csrc/layernorm_kernels.cu``) where the weight has the activations' dtype, which rounds the
    sum to the dtype first and rounds ``x * rsqrt`` before the weight, else the native arithmetic.
    ``GemmaRMSNorm`` passes ``weight.float() + 1``: an fp32 weight, native except for fp32 activations.
    """
    cls = type(norm)
    name = cls.__name__
    if name not in ("RMSNorm", "GemmaRMSNorm") or not cls.__module__.startswith("vllm."):
        return None, f"{name} is not vLLM's own RMSNorm or GemmaRMSNorm"
    try:
        import vllm

        version = tuple(int(p) for p in vllm.__version__.split(".")[:2])
    except (ImportError, AttributeError, ValueError):
        version = (0, 0)
    if version != (0, 33):
        return None, "arnorm knows vLLM 0.33's norms only"
    gemma = name == "GemmaRMSNorm"
    if gemma != (offset == 1.0) or getattr(norm, "variance_size_override", None) is not None:
        return None, f"{name} is not called as vLLM calls it"
    weight = getattr(norm, "weight", None)
    weight_dtype = torch.float32 if gemma else getattr(weight, "dtype", None)
    native = Arithmetic(offset, weight_dtype is not None and weight_dtype != torch.float32, True)
    if device.type == "cpu":
        return native, "vLLM 0.33's native arithmetic on CPU"
    if device.type == "cuda" and torch.version.hip is None:
        if weight_dtype == dtype and getattr(norm, "has_weight", True) is not False:
            return Arithmetic(offset, True, False), "vLLM 0.33's C kernel on CUDA"
        return native, "vLLM 0.33's native arithmetic on CUDA (weight dtype not the activations')"
    return None, f"arnorm does not know which kernel vLLM 0.33 runs on {device.type}"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from arnorm.testing._compare import ulps

    return ulps(a, b)


def probe_arithmetic(
    norm: Any, eps: float, offset: float, dtype: torch.dtype, device: torch.device
) -> tuple[Arithmetic | None, str | None]:
    """``(arithmetic, None)``, or ``(None, what differs)``: run a copy of ``norm`` on crafted rows
    and pick the arnorm arithmetic it computes (see the module docstring). Local: no collective."""
    weight = norm.weight
    hidden = int(weight.shape[-1])
    g = torch.Generator().manual_seed(_SEED)
    # Sums of two magnitudes: the fp32 sum and its rounding differ in most elements' low bits.
    x = (torch.randn(PROBE_ROWS, hidden, generator=g) * 3.0).to(dtype).to(device)
    residual = torch.randn(PROBE_ROWS, hidden, generator=g).to(dtype).to(device)
    probe = copy.deepcopy(norm)
    if not isinstance(getattr(probe, "weight", None), torch.Tensor) or (
        probe.weight.data_ptr() == weight.data_ptr() and weight.numel() > 0
    ):
        # Writing the crafted weight would write the model's own.
        return None, "its copy shares the module's weight"
    w = weight.detach()
    crafted = getattr(norm, "has_weight", True) is not False
    if crafted:
        base = 1.0 - offset
        w = (torch.randn(hidden, generator=g) * 0.5 + base).to(weight.dtype).to(weight.device)

    def run(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            if crafted:
                probe.weight.data.copy_(values)
            out = probe(x.clone(), residual.clone())
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"it returned {type(out).__name__}, not (normed, residual)")
        return out

    normed, new_residual = run(w)
    if crafted and hidden > 1:
        # A copy that ignores its weight (a forward wrapped by a closure holding the original
        # module, as monitoring tools do) would be judged on the original's arithmetic.
        other, _ = run(torch.roll(w, 1))
        if torch.equal(other, normed):
            return None, "its copy does not respond to the weight it is given (a wrapped forward?)"
    rounded_sum = (x.float() + residual.float()).to(dtype)
    if new_residual.dtype != dtype:
        return None, f"its residual comes back {new_residual.dtype}, not {dtype}"
    if not torch.equal(new_residual.view(torch.uint8), rounded_sum.view(torch.uint8)):
        return None, "its residual is not the fp32 sum rounded to the dtype"
    best, best_bad, best_max = None, None, None
    for cand in _CANDIDATES:
        cand = Arithmetic(offset, cand.round_before_weight, cand.normalize_unrounded)
        # The weight in the module's own dtype: an fp32 weight rounded to fp16 here would judge the
        # module against arithmetic it does not do (false mismatches, up to 30 ulp).
        _, y = add_rmsnorm(x, residual, w, eps, offset, cand.round_before_weight,
                           cand.normalize_unrounded)  # fmt: skip
        d = _ulps(normed.to(dtype), y)
        bad, worst = int((d > 0).sum()), int(d.max())
        if best_bad is None or bad < best_bad:
            best, best_bad, best_max = cand, bad, worst
    assert best is not None and best_bad is not None and best_max is not None
    total = normed.numel()
    if best_bad > ORDER_SHARE * total or best_max > 1:
        return None, (
            f"{best_bad} of {total} normed values differ from the nearest arnorm arithmetic "
            f"({best.describe()}), up to {best_max} ulp"
        )
    return best, None


def arithmetic_of(
    norm: Any, eps: float, offset: float, dtype: torch.dtype, device: torch.device, stacklevel: int = 4
) -> Arithmetic | None:
    """The arithmetic the fused path uses for ``norm`` (probed once per class, dtype, weight dtype and
    device type), or None: no arnorm arithmetic is the module's, and the caller runs vLLM's own path
    for it (said once). ``stacklevel``: of the warning, from this function (4: the caller of an
    entry point that calls it through one helper)."""
    if not accepts_residual(norm):
        return _one_argument(norm, offset)
    # The weight's dtype too: vLLM's plain RMSNorm rounds before the weight with an fp16 weight and
    # once with an fp32 one (x.to(weight.dtype) * weight), so a probe holds for one weight dtype only.
    weight = getattr(norm, "weight", None)
    weight_dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
    key = (type(norm), dtype, weight_dtype, device.type, offset, getattr(norm, "has_weight", True))
    if key in _cache:
        return _cache[key]
    name = type(norm).__name__
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # No probe inside a capture (it would be recorded): vLLM's own classes are known, once.
        arith, how = known_arithmetic(norm, offset, dtype, device)
        if arith is None:
            warn_once(
                f"arnorm.integrations.vllm: {name} ({dtype}) was first seen inside CUDA-graph capture, "
                f"where it cannot be probed, and {how}: it runs vLLM's own path; call "
                "arnorm.integrations.vllm.warmup(..., norm=<the module>) before capture",
                stacklevel,
            )
        return arith
    with _lock:
        if key in _cache:
            return _cache[key]
        try:
            found, differs = probe_arithmetic(norm, eps, offset, dtype, device)
        except Exception as exc:  # a module that cannot be copied or run on crafted rows
            found, differs = None, f"it could not be probed ({type(exc).__name__}: {exc})"
        _cache[key] = found
    if differs is not None:
        warn_once(
            f"arnorm.integrations.vllm: {name} ({dtype}) runs vLLM's own path, not fused: no arnorm "
            f"arithmetic is its own, bit for bit: {differs}",
            stacklevel,
        )
    return found
