"""Distances between a result and the reference, in the units the numerics contract uses, and the
descriptions a failing test prints (the worst element, its ulp count and its absolute error).

A ulp count alone misleads near zero (a value of 1e-5 is thousands of bf16 ulps from 0.03), so
every description carries the absolute error and the element as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CodeMismatch",
    "Mismatch",
    "compare",
    "compare_codes",
    "expected_normed",
    "first_difference",
    "nearest_two_rounding_normed",
    "ulp_distance",
    "ulps",
]


def _ulp_line(t: Any) -> Any:
    """Bit patterns mapped to a monotonic integer line (sign-magnitude to two's complement)."""
    import torch

    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    i = t.contiguous().view(bits).long()
    top = 1 << (8 * t.element_size() - 1)
    return torch.where(i < 0, -(i + top), i)


def ulps(a: Any, b: Any) -> Any:
    """Elementwise distance in units in the last place between two tensors of one float dtype (int64).

    Neighbours across zero are one apart, ``+0`` and ``-0`` coincide, and two NaNs are 0 apart.
    """
    import torch

    d = (_ulp_line(a) - _ulp_line(b)).abs()
    return torch.where(a.isnan() & b.isnan(), 0, d)


def ulp_distance(a: Any, b: Any) -> int:
    """Largest of :func:`ulps` (0 for empty tensors): the one ulp measure arnorm's tests use."""
    return int(ulps(a, b).max()) if a.numel() else 0


def nearest_two_rounding_normed(
    got: Any, h: Any, weight: Any, eps: float, weight_offset: float, unrounded: Any = None
) -> Any:
    """The reference ``y`` of step 3' (``round_before_weight``) nearest to ``got``, element by element.

    Step 3' rounds twice: ``m = D(fp32(h) * rsqrt(...))``, then ``y = D(m * (b + g))``. A kernel's
    ``rsqrt`` or reduction tree may land ``fp32(h) * rsqrt`` on the other side of a rounding
    boundary, so its ``m`` is a neighbour of the reference's; the weight multiply then scales that
    one-ulp step by ``|b + g|``, which is more than one ulp of ``y`` whenever ``|b + g| > 1``. The
    contract therefore allows ``m`` within one ulp and ``y`` within one ulp of ``D(m * (b + g))``:
    this returns, per element, whichever of the three candidates is closest to ``got``.
    ``unrounded``: the fp32 sum the norm reads instead of ``h`` (``RMSNorm(normalize_unrounded=True)``).
    """
    import torch

    hf = h.float() if unrounded is None else unrounded.float()
    m = (hf * torch.rsqrt(hf.square().mean(dim=-1, keepdim=True) + eps)).to(h.dtype)
    w = weight.float() + weight_offset
    best = (m.float() * w).to(h.dtype)
    best_d = ulps(got, best)
    for direction in (float("-inf"), float("inf")):
        near = torch.nextafter(m, torch.full_like(m, direction))
        cand = (near.float() * w).to(h.dtype)
        d = ulps(got, cand)
        better = d < best_d
        best = torch.where(better, cand, best)
        best_d = torch.where(better, d, best_d)
    return best


def expected_normed(got: Any, y: Any, h: Any, reduced: Any, residual: Any, weight: Any, norm: Any) -> Any:
    """What a backend's ``normed`` (``got``) is judged against: the reference ``y`` of ``norm`` (an
    :class:`arnorm.RMSNorm`), or where it rounds twice (``round_before_weight``) the nearest of the
    neighbours the contract allows (:func:`nearest_two_rounding_normed`). ``h``, ``reduced`` and
    ``residual``: the reference's new residual, reduced sum and residual before the call (or None)."""
    if not norm.round_before_weight:
        return y
    unrounded = None
    if norm.normalize_unrounded and residual is not None:
        unrounded = reduced.float() + residual.float()
    return nearest_two_rounding_normed(got, h, weight, norm.eps, norm.weight_offset, unrounded)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


@dataclass(frozen=True)
class Mismatch:
    """How a float tensor differs from the expected one: counts, the worst element, the largest error.

    ``index``/``got``/``expected`` are the element furthest off in ulps; ``max_abs`` is the largest
    absolute error over all elements (NaN when one side has a NaN the other has not).
    """

    count: int
    total: int
    max_ulps: int
    max_abs: float
    index: tuple[int, ...]
    got: float
    expected: float
    abs_index: tuple[int, ...] = ()

    def describe(self, what: str, allowed: str = "") -> str:
        """``"normed: 3 ulp off at [2, 17] (got 0.5078, expected 0.5039, |err| 0.0039); ..."``."""
        at = ", ".join(map(str, self.index))
        err = abs(self.got - self.expected)
        limit = f"; allowed {allowed}" if allowed else ""
        return (
            f"{what}: {self.max_ulps} ulp off at [{at}] (got {_fmt(self.got)}, "
            f"expected {_fmt(self.expected)}, |err| {_fmt(err)}); "
            f"{self.count} of {self.total} elements differ, max |err| {_fmt(self.max_abs)} at "
            f"[{', '.join(map(str, self.abs_index))}]{limit}"
        )


def compare(got: Any, expected: Any) -> Mismatch | None:
    """``None`` when ``got`` equals ``expected`` bit for bit (NaNs included), else the :class:`Mismatch`."""
    import torch

    if got.numel() == 0:
        return None
    ulps = (_ulp_line(got) - _ulp_line(expected)).abs().reshape(-1)
    count = int((ulps != 0).sum())
    if count == 0:
        return None
    worst = int(ulps.argmax())
    g, e = got.reshape(-1).double(), expected.reshape(-1).double()
    diff = (g - e).abs()
    nan_mismatch = bool((g.isnan() != e.isnan()).any())
    finite = torch.nan_to_num(diff, nan=0.0)
    max_abs = float("nan") if nan_mismatch else float(finite.max())
    return Mismatch(
        count=count,
        total=got.numel(),
        max_ulps=int(ulps[worst]),
        max_abs=max_abs,
        index=_index(worst, tuple(got.shape)),
        got=float(g[worst]),
        expected=float(e[worst]),
        abs_index=_index(int(finite.argmax()), tuple(got.shape)),
    )


@dataclass(frozen=True)
class CodeMismatch:
    """How quantized codes differ: the fraction, and the code furthest off (in code steps)."""

    count: int
    total: int
    max_steps: int
    index: tuple[int, ...]
    got: int
    expected: int

    @property
    def fraction(self) -> float:
        return self.count / self.total if self.total else 0.0

    def describe(self, what: str) -> str:
        """``"quant codes: 3 of 4096 differ (0.0732%); the worst is 1 step off at [0, 5] ..."``."""
        at = ", ".join(map(str, self.index))
        return (
            f"{what}: {self.count} of {self.total} differ ({100 * self.fraction:.4f}%); the worst is "
            f"{self.max_steps} step(s) off at [{at}] "
            f"(got code 0x{self.got:02x}, expected 0x{self.expected:02x})"
        )


def _code_line(codes: Any, sign_bit: int) -> Any:
    # fp8 e4m3 and e2m1 codes are sign-magnitude: magnitudes are monotonic, -0 meets +0.
    mag = codes & (sign_bit - 1)
    return mag.where((codes & sign_bit) == 0, -mag)


def compare_codes(got: Any, expected: Any, packed_fp4: bool) -> CodeMismatch | None:
    """Compare quantized codes (uint8 views); nvfp4 bytes are unpacked to their two e2m1 codes."""
    import torch

    g, e = got.contiguous().view(torch.uint8).long(), expected.contiguous().view(torch.uint8).long()
    if packed_fp4:
        # low nibble first: element 2j is byte j's low nibble
        g = torch.stack((g & 0xF, g >> 4), dim=-1).reshape(*g.shape[:-1], -1)
        e = torch.stack((e & 0xF, e >> 4), dim=-1).reshape(*e.shape[:-1], -1)
    differ = (g != e).reshape(-1)
    count = int(differ.sum())
    if count == 0:
        return None
    sign = 0x8 if packed_fp4 else 0x80
    steps = (_code_line(g, sign) - _code_line(e, sign)).abs().reshape(-1)
    worst = int(steps.argmax())
    return CodeMismatch(
        count=count,
        total=g.numel(),
        max_steps=int(steps[worst]),
        index=_index(worst, tuple(g.shape)),
        got=int(g.reshape(-1)[worst]),
        expected=int(e.reshape(-1)[worst]),
    )


def first_difference(got: Any, expected: Any) -> str:
    """``""`` when the two tensors are bitwise equal, else where they first differ, with both values."""
    import torch

    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (
            f"shape/dtype {list(got.shape)} {str(got.dtype).removeprefix('torch.')} (expected "
            f"{list(expected.shape)} {str(expected.dtype).removeprefix('torch.')})"
        )
    g = got.contiguous().view(torch.uint8).reshape(got.numel(), -1) if got.numel() else got
    e = (
        expected.contiguous().view(torch.uint8).reshape(expected.numel(), -1)
        if expected.numel()
        else expected
    )
    differ = (g != e).any(dim=-1) if got.numel() else torch.zeros(0, dtype=torch.bool)
    count = int(differ.sum())
    if count == 0:
        return ""
    flat = int(differ.nonzero()[0])
    at = ", ".join(map(str, _index(flat, tuple(got.shape))))
    as_num = got.float() if got.is_floating_point() else got.long()
    want = expected.float() if expected.is_floating_point() else expected.long()
    return (
        f"{count} of {got.numel()} elements differ, the first at [{at}] "
        f"(got {as_num.reshape(-1)[flat].item():.6g}, expected {want.reshape(-1)[flat].item():.6g})"
    )
