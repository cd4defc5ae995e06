"""Which arithmetic a norm module handed to the vLLM entry points computes, so the fused path follows it.

vLLM's norms changed arithmetic between releases (docs/numerics.md, "Conventions across the
ecosystem"): 0.33's ``GemmaRMSNorm`` and its CPU ``RMSNorm`` add in fp32, return the rounded sum as
the residual and normalize the *unrounded* sum (``RMSNorm(normalize_unrounded=True)``); older
releases, and kernels such as FlashInfer's, normalize the rounded sum. A drop-in that fuses must
compute what the module it replaces computes, so the arithmetic is read off the module itself:

- a module whose forward takes ``(x, residual)`` (vLLM's norms) is *probed* once per (class, dtype,
  device type): a copy of it, given a crafted weight, runs on crafted rows, and each of arnorm's four
  arithmetics (rounded or unrounded sum, rounding before the weight or not) is compared with it.
  The one that matches is used; one that matches up to the order in which the statistic's squares
  are summed (a GPU kernel's reduction tree: at most 1 ulp on under 1% of the values) is used too.
  When none does, an :class:`arnorm.ArnormWarning` says so once and names what differs; the
  nearest is used;
- a module that takes ``x`` alone (Hugging Face style) gets the rounded sum (the caller adds in
  the dtype first) and the rounding order of its family, by class name;
- when probing cannot run (inside CUDA-graph capture) the module's known class decides.

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

__all__ = ["VLLM_033_GEMMA", "Arithmetic", "arithmetic_of", "probe_arithmetic"]

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
_cache: dict[tuple[Any, ...], Arithmetic] = {}
_lock = threading.Lock()


def _one_argument(norm: Any, offset: float) -> Arithmetic:
    """A norm that takes ``x`` alone: the caller rounds the sum; its family decides the rounding order."""
    for cls in type(norm).__mro__:
        known = NORMS.get(cls.__name__)
        if known is not None and known[0] == offset:
            return Arithmetic(offset, known[1], False)
    # Llama's family rounds before the weight, Gemma's once after it.
    return Arithmetic(offset, offset == 0.0, False)


def _known(norm: Any, offset: float) -> Arithmetic:
    """Without a probe: vLLM >= 0.33's eager norms normalize the unrounded sum; others the rounded."""
    try:
        import vllm

        version = tuple(int(p) for p in vllm.__version__.split(".")[:2])
    except (ImportError, AttributeError, ValueError):
        version = (0, 0)
    names = {c.__name__ for c in type(norm).__mro__}
    unrounded = version >= (0, 33) and bool(names & {"GemmaRMSNorm", "RMSNorm"})
    return Arithmetic(offset, offset == 0.0 and "GemmaRMSNorm" not in names, unrounded)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from arnorm.testing._compare import ulps

    return ulps(a, b)


def probe_arithmetic(
    norm: Any, eps: float, offset: float, dtype: torch.dtype, device: torch.device
) -> tuple[Arithmetic, str | None]:
    """``(arithmetic, what differs or None)``: run a copy of ``norm`` on crafted rows and pick the
    arnorm arithmetic it computes (see the module docstring). Local: no collective."""
    weight = norm.weight
    hidden = int(weight.shape[-1])
    g = torch.Generator().manual_seed(_SEED)
    # Sums of two magnitudes: the fp32 sum and its rounding differ in most elements' low bits.
    x = (torch.randn(PROBE_ROWS, hidden, generator=g) * 3.0).to(dtype).to(device)
    residual = torch.randn(PROBE_ROWS, hidden, generator=g).to(dtype).to(device)
    probe = copy.deepcopy(norm)
    w = weight.detach()
    if getattr(norm, "has_weight", True) is not False:
        base = 1.0 - offset
        w = (torch.randn(hidden, generator=g) * 0.5 + base).to(weight.dtype).to(weight.device)
        with torch.no_grad():
            probe.weight.data.copy_(w)
    with torch.no_grad():
        normed, new_residual = probe(x.clone(), residual.clone())
    rounded_sum = (x.float() + residual.float()).to(dtype)
    notes = []
    if new_residual.dtype != dtype:
        notes.append(f"its residual comes back {new_residual.dtype}, not {dtype}")
    elif not torch.equal(new_residual.view(torch.uint8), rounded_sum.view(torch.uint8)):
        notes.append("its residual is not the fp32 sum rounded to the dtype")
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
        notes.append(
            f"{best_bad} of {total} normed values differ from the nearest arnorm arithmetic "
            f"({best.describe()}), up to {best_max} ulp"
        )
    return best, ("; ".join(notes) or None)


def arithmetic_of(
    norm: Any, eps: float, offset: float, dtype: torch.dtype, device: torch.device, stacklevel: int = 4
) -> Arithmetic:
    """The arithmetic the fused path uses for ``norm`` (probed once per class, dtype and device type).
    ``stacklevel``: of the warning, from this function (4: the caller of an entry point that calls
    it through one helper)."""
    if not accepts_residual(norm):
        return _one_argument(norm, offset)
    # The weight's dtype too: vLLM's plain RMSNorm rounds before the weight with an fp16 weight and
    # once with an fp32 one (x.to(weight.dtype) * weight), so a probe holds for one weight dtype only.
    weight = getattr(norm, "weight", None)
    weight_dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
    key = (type(norm), dtype, weight_dtype, device.type, offset, getattr(norm, "has_weight", True))
    known = _cache.get(key)
    if known is not None:
        return known
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # No probe inside a capture (it would be recorded): the class decides, once, and says so.
        arith = _known(norm, offset)
        warn_once(
            f"arnorm.integrations.vllm: {type(norm).__name__} was first seen inside CUDA-graph capture, "
            f"so its arithmetic was not probed (taken by class: it {arith.describe()}); call "
            "arnorm.integrations.vllm.warmup(..., norm=<the module>) before capture",
            stacklevel,
        )
        return arith
    with _lock:
        known = _cache.get(key)
        if known is not None:
            return known
        try:
            arith, differs = probe_arithmetic(norm, eps, offset, dtype, device)
        except Exception as exc:  # a module that cannot be copied or run on crafted rows
            arith, differs = _known(norm, offset), f"it could not be probed ({type(exc).__name__}: {exc})"
        _cache[key] = arith
    if differs is not None:
        warn_once(
            f"arnorm.integrations.vllm: the fused path cannot match {type(norm).__name__} ({dtype}) bit for "
            f"bit: {differs}; it follows the nearest arithmetic, which {arith.describe()}",
            stacklevel,
        )
    return arith
