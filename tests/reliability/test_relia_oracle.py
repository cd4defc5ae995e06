"""The fuzz's oracle checks itself: its quantizers agree bit for bit with arnorm.quant (two independent
implementations of docs/numerics.md's formats), and its steps 1-3 hold arnorm's reference on hand values."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arnorm.quant import quantize

import relia_oracle as oracle

_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.double().numpy()


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


@st.composite
def activations(draw):
    quant = draw(st.sampled_from(["fp8_static", "fp8_per_token", "nvfp4", "mxfp8"]))
    block = {"nvfp4": 16, "mxfp8": 32}.get(quant, 1)
    rows, hidden = draw(st.integers(1, 5)), block * draw(st.integers(1, 3)) * (1 if block > 1 else 8)
    dtype = draw(st.sampled_from(list(_TORCH)))
    seed, magnitude = draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from([1e-30, 1e-3, 1.0, 500.0]))
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(rows, hidden, generator=g) * magnitude).to(_TORCH[dtype])
    if draw(st.booleans()):
        y[0] = 0  # an all-zero row: the smallest scales
    layout = draw(st.sampled_from([None, "linear", "swizzled_128x4"])) if block > 1 else None
    amax = float(y.float().abs().max()) or 1.0
    factor = draw(st.sampled_from([0.25, 1.0, 8.0]))
    scale = {"fp8_static": amax / 448 * factor, "nvfp4": 448 * 6 / amax * factor}.get(quant)
    return y, quant, None if scale is None else float(np.float32(scale)), layout


@settings(max_examples=150, deadline=None)
@given(activations())
def test_the_oracle_quantizers_match_arnorm_quant_bit_for_bit(case):
    """Data bytes and scales of every format and layout are identical in both implementations."""
    y, quant, scale, layout = case
    q = quantize(y, quant, scale=None if scale is None else torch.tensor([scale]), layout=layout)
    default = {"nvfp4": "swizzled_128x4", "mxfp8": "linear"}.get(quant)
    data, scales = oracle.quantize(as_np(y), quant, scale, layout or default)
    np.testing.assert_array_equal(bytes_of(q.data), data)
    if quant == "fp8_per_token":
        np.testing.assert_array_equal(as_np(q.scale), scales)
    elif quant in ("nvfp4", "mxfp8"):
        assert tuple(q.scale.shape) == scales.shape
        np.testing.assert_array_equal(bytes_of(q.scale), scales)


def test_the_oracle_reproduces_hand_computed_values():
    """[1, 2, 3, 4] on two bf16 ranks: residual [2, 4, 6, 8]; normed is bf16(h / sqrt(30)) exactly."""
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    kw = dict(dtype="bfloat16", eps=0.0, offset=0.0, round_before_weight=False)
    exp = oracle.add_rmsnorm([x, x], np.zeros((1, 4)), np.ones(4), **kw)
    np.testing.assert_array_equal(exp.residual, [[2.0, 4.0, 6.0, 8.0]])
    # 2 / sqrt(30) = 0.36515 -> 0.365234375 (bf16 spacing 2**-9 there), and so on.
    expected = [[0.365234375, 0.73046875, 1.09375, 1.4609375]]
    np.testing.assert_array_equal(exp.lo, expected)
    np.testing.assert_array_equal(exp.hi, expected)
    # Gemma offset 1 with weight 0.5, rounding before the weight: bf16(bf16(z) * 1.5).
    kw.update(offset=1.0, round_before_weight=True)
    exp = oracle.add_rmsnorm([x, x], np.zeros((1, 4)), np.full(4, 0.5), **kw)
    np.testing.assert_array_equal(exp.lo, [[0.546875, 1.09375, 1.640625, 2.1875]])
