"""The ``triton`` backend's per-group fp8 formats and mxfp4 against ``reference``: every scale layout,
token counts around the TMA padding, and NaN / inf / zero groups (a NaN or infinite norm weight puts
them in one column of y). Under the interpreter the outputs are bit for bit the reference's; on a GPU
the same tests run compiled and hold the kernel to the contract (normed within ulps, codes and
scales bit for bit ``arnorm.quant`` of its own normed output)."""

from __future__ import annotations

import pytest
import torch
from triton_cases import assert_quant_equal

import arnorm
from arnorm import quant
from arnorm.testing import ulp_distance

# numpy, inside the interpreter, on the NaN / inf columns.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

GROUP_FORMATS = [n for n, s in quant.FORMAT_SPECS.items() if s.block_size and s.scale_dtype == "float32"]
VARIANTS = [(f, layout) for f in [*GROUP_FORMATS, "mxfp4"] for layout in quant.FORMAT_SPECS[f].layouts]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _op(backend, fmt, layout, hidden, dtype, offset=0.0):
    return arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=hidden,
        dtype=dtype,
        norm=arnorm.RMSNorm(1e-6, weight_offset=offset),
        quant=fmt,
        scale_layout=layout,
        backend=backend,
        max_tokens=16,
        device=_device(),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.uint8)


def _inputs(t, hidden, dtype, special):
    g = torch.Generator().manual_seed(t * 7 + hidden)
    x = (torch.randn(t, hidden, generator=g) * 2).to(dtype)
    r = torch.randn(t, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    x[0, :128] = 0
    r[0, :128] = 0  # a zero group (and zero blocks) in row 0
    if special:
        w[3] = float("nan")  # NaN in column 3 of every row
        w[70] = float("inf")  # +-inf in column 70
    dev = _device()
    return x.to(dev), r.to(dev), w.to(dev)


def _same(fmt, layout, t, hidden, dtype, special=False, offset=0.0):
    outs = []
    for backend in ("reference", "triton"):
        op = _op(backend, fmt, layout, hidden, dtype, offset)
        x, r, w = _inputs(t, hidden, dtype, special)
        outs.append(op(x, r, w))
        op.close()
    a, b = outs
    assert torch.equal(_bits(a.residual), _bits(b.residual))
    _held_to_the_contract(a, b, fmt, layout, ulps=8 if dtype == torch.float32 else 1)


def _held_to_the_contract(a, b, fmt, layout, ulps):
    """``b`` (triton) against ``a`` (reference), as docs/numerics.md words the contract: the normed
    output within ``ulps`` (reduction trees and ``rsqrt`` differ between kernels: compiled on a GPU,
    fp32 lands a few ulps away), codes and scales bit for bit ``arnorm.quant`` of triton's own normed
    output; and where the normed outputs are bitwise equal (the interpreter), codes and scales bit for
    bit the reference's."""
    off = ulp_distance(a.normed, b.normed)  # two NaNs are 0 apart
    assert off <= ulps, (fmt, layout, off)
    assert_quant_equal(b.quant, quant.quantize(b.normed, fmt, layout=layout))
    if torch.equal(_bits(a.normed), _bits(b.normed)):
        assert_quant_equal(b.quant, a.quant)


@pytest.mark.parametrize(("fmt", "layout"), VARIANTS, ids=[f"{f}-{lay}" for f, lay in VARIANTS])
@pytest.mark.parametrize("t", [1, 5])
def test_triton_is_the_reference_bit_for_bit(fmt, layout, t):
    _same(fmt, layout, t, 384, torch.bfloat16, special=t == 5)


@pytest.mark.parametrize("fmt", ["fp8_per_group", "fp8_per_group_64_ue8m0", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_and_gemma(fmt, dtype):
    layout = quant.FORMAT_SPECS[fmt].layouts[-1]
    _same(fmt, layout, 3, 256, dtype, special=True, offset=1.0)


def test_the_backends_declare_the_formats():
    from arnorm_triton._plugin import CAPABILITIES

    assert {*GROUP_FORMATS, "mxfp4"} <= CAPABILITIES.quant


@pytest.mark.parametrize("fmt", [*GROUP_FORMATS, "mxfp4"])
def test_scales_at_the_top_of_fp32_match_the_reference(fmt):
    """fp32 activations whose normed values reach the top of fp32 (and overflow to inf): UE8M0's
    round-up at 2^120, E8M0's clamp at byte 254, as the reference has them."""
    layout = quant.FORMAT_SPECS[fmt].layouts[-1]
    outs = []
    for backend in ("reference", "triton"):
        op = _op(backend, fmt, layout, 256, torch.float32)
        x, r, w = _inputs(2, 256, torch.float32, special=False)
        w[5], w[200] = 1e38, -3e38
        outs.append(op(x, r, w))
        op.close()
    a, b = outs
    _held_to_the_contract(a, b, fmt, layout, ulps=8)
