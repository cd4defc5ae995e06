"""AITER's kernel arithmetic in torch, and how far from arnorm's contract it may land.

``expected`` replays, operation by operation in fp32, what ROCm/aiter's kernels compute
(``csrc/include/custom_all_reduce.cuh``, v0.1.19.post1 .. v0.1.20.post1); only the order of the
sum of squares and ``rsqrtf``'s last bits differ. ``deviation`` measures a result against the
contract reference and ``violations`` holds it to :data:`TOLERANCE` (``docs/aiter.md`` explains both).

What the kernels do, for partials ``x_r`` in ``D`` (bf16 / fp16), ``h32 = fp32(s) + fp32(res)``:

* every path: ``s = D(sum_r fp32(x_r))`` in rank order and ``residual = D(h32)``: the contract's
  steps 1 and 2 exactly;
* 1-stage kernel (``none`` and ``fp8_per_token``): the statistic and the normed value use the
  **unrounded** ``h32``: ``y32 = (h32 * rsqrt(sum(h32^2) / H + eps)) * (b + fp32(g))``;
* 2-stage, no quant: the same unrounded ``h32``, multiplied as ``(h32 * w) * rsqrt(...)``;
* 2-stage and split fp8 kernels: the statistic over the rounded ``D(h32)``, like the contract;
* normed output ``D(y32)``; fp8_per_token: ``scale = amax(|y32|) / 448`` (1 for an all-zero row,
  no lower bound) and ``q = e4m3fn_rn(y32 / scale)``: the unrounded ``y32``, not ``D(y32)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from arnorm_aiter._rules import FP8_FORMAT

__all__ = ["TOLERANCE", "Deviation", "deviation", "expected", "violations"]

#: Tolerances against the contract reference (the ``reference`` backend on the same inputs).
TOLERANCE = {
    "residual_ulp": 0,  # bitwise
    "normed_ulp": 2,  # the contract allows 1; the unrounded statistic adds up to 1 more
    "quant_codes": 1,  # e4m3 codes, in rows whose contract scale is above its floor
    "scale_rel": 2.0**-6,  # per-row scale, same rows
}
_E4M3_MAX = 448.0
#: The contract's fp8_per_token scale floor, 1 / (448 * 512), as fp32.
_MIN_TOKEN_SCALE = float(torch.tensor(1.0 / (448.0 * 512.0), dtype=torch.float32))


def expected(
    partials: Sequence[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    quant: str | None,
    one_stage: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(residual, normed, fp8 codes, fp32 [T, 1] scales)`` as AITER's kernels compute them."""
    dtype = partials[0].dtype
    acc = partials[0].float()
    for p in partials[1:]:
        acc = acc + p.float()
    h32 = acc.to(dtype).float() + residual.float()
    h = h32.to(dtype)
    fp8 = quant == FP8_FORMAT
    x = h.float() if (fp8 and not one_stage) else h32
    inv = torch.rsqrt(x.square().sum(dim=-1, keepdim=True) / x.shape[-1] + eps)
    w = weight.float() + weight_offset
    y32 = x * w * inv if (not fp8 and not one_stage) else x * inv * w
    if not fp8:
        return h, y32.to(dtype), None, None
    amax = y32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / _E4M3_MAX)
    # torch's cast rounds to nearest even like the kernel; the clamp saturates as it does.
    codes = (y32 / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return h, y32.to(dtype), codes, scale


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude bit patterns mapped onto integers in value order (ulp / code distances)."""
    if t.element_size() == 1:
        i = t.view(torch.uint8).to(torch.int32)
        return torch.where(i >= 0x80, -(i & 0x7F), i)
    i = t.view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


@dataclass(frozen=True)
class Deviation:
    """How one output differs from the contract reference; fractions are over all elements / rows."""

    residual_mismatches: int
    normed_max_ulp: int | None
    normed_fraction: float | None
    quant_max_codes: int | None = None
    quant_fraction: float | None = None
    scale_max_rel: float | None = None
    floored_rows: int = 0

    def __str__(self) -> str:
        parts = [f"residual mismatches {self.residual_mismatches}"]
        if self.normed_max_ulp is not None:
            parts.append(f"normed max {self.normed_max_ulp} ulp ({self.normed_fraction:.2%} differ)")
        if self.quant_max_codes is not None:
            parts.append(
                f"fp8 max {self.quant_max_codes} codes ({self.quant_fraction:.2%} differ), "
                f"scale max rel {self.scale_max_rel:.2e}, {self.floored_rows} floored rows"
            )
        return ", ".join(parts)


def deviation(out: object, ref: object) -> Deviation:
    """Compare two :class:`arnorm.Output` (``out`` from aiter, ``ref`` from the reference backend)."""
    res = int((out.residual.view(torch.int16) != ref.residual.view(torch.int16)).sum())  # type: ignore[attr-defined]
    n_ulp = n_frac = None
    if out.normed is not None and ref.normed is not None:  # type: ignore[attr-defined]
        d = (_ordered(out.normed) - _ordered(ref.normed)).abs()  # type: ignore[attr-defined]
        n_ulp, n_frac = int(d.max()), float((d > 0).float().mean())
    if out.quant is None or ref.quant is None:  # type: ignore[attr-defined]
        return Deviation(res, n_ulp, n_frac)
    qa, qr = out.quant, ref.quant  # type: ignore[attr-defined]
    # Rows whose contract scale sits on its floor (amax < 1/512) are scaled differently by design.
    ok_rows = qr.scale.float() > _MIN_TOKEN_SCALE
    dc = (_ordered(qa.data) - _ordered(qr.data)).abs()
    dc_rows = torch.where(ok_rows, dc, torch.zeros_like(dc))
    rel = ((qa.scale.float() - qr.scale.float()).abs() / qr.scale.float()).where(ok_rows, 0.0)
    return Deviation(
        res,
        n_ulp,
        n_frac,
        int(dc_rows.max()),
        float((dc > 0).float().mean()),
        float(rel.max()),
        int((~ok_rows).sum()),
    )


def violations(dev: Deviation, tolerance: dict[str, float] | None = None) -> list[str]:
    """What in ``dev`` exceeds ``tolerance`` (default :data:`TOLERANCE`), in arnorm's reason grammar."""
    tol = TOLERANCE if tolerance is None else tolerance
    out = []
    if dev.residual_mismatches > tol["residual_ulp"]:
        out.append(f"residual: {dev.residual_mismatches} elements differ (needs bitwise equality)")
    if dev.normed_max_ulp is not None and dev.normed_max_ulp > tol["normed_ulp"]:
        out.append(f"normed: {dev.normed_max_ulp} ulp (needs <= {tol['normed_ulp']:g})")
    if dev.quant_max_codes is not None and dev.quant_max_codes > tol["quant_codes"]:
        out.append(f"fp8 codes: {dev.quant_max_codes} apart (needs <= {tol['quant_codes']:g})")
    if dev.scale_max_rel is not None and dev.scale_max_rel > tol["scale_rel"]:
        out.append(f"fp8 scale: relative {dev.scale_max_rel:.2e} (needs <= {tol['scale_rel']:.2e})")
    return out
