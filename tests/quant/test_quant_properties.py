"""Hypothesis properties of arnorm.quant: error within half a step at the block's scale, re-quantization."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from arnorm.quant import dequantize, quantize

F32 = np.float32
SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def activations(draw: st.DrawFn, block: int = 32) -> np.ndarray:
    """fp32 [T, H] with H a multiple of ``block``: mixed magnitudes, zeros, an overall binade shift."""
    rows = draw(st.integers(1, 3))
    hidden = block * draw(st.integers(1, 3))
    mags = st.floats(-1e3, 1e3, width=32, allow_subnormal=False) | st.sampled_from([0.0, -0.0, 2.5, -448.0])
    y = draw(arrays(F32, (rows, hidden), elements=mags))
    shift = draw(st.integers(-20, 20))
    return (y * F32(2.0**shift)).astype(F32)


def _e4m3_half_step(v: np.ndarray) -> np.ndarray:
    """Half the spacing of the e4m3 grid around |v| (|v| <= 448): 2**-10 below 2**-6."""
    a = np.abs(v.astype(np.float64))
    exp = np.floor(np.log2(np.maximum(a, 2.0**-6)))
    return np.ldexp(1.0, (exp - 4).astype(np.int64))


def _e2m1_half_step(v: np.ndarray) -> np.ndarray:
    a = np.abs(v.astype(np.float64))
    return np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, 1.0))


def _check_scaled_error(code_values: np.ndarray, v: np.ndarray, half_step: np.ndarray, top: float) -> None:
    """|code - v| <= half a step, plus the excess over the largest code where v saturates."""
    v64 = v.astype(np.float64)
    err = np.abs(code_values.astype(np.float64) - v64)
    bound = half_step + np.maximum(np.abs(v64) - top, 0.0)
    assert (err <= bound).all(), (err - bound).max()


def _codes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.float8_e4m3fn).float().numpy()


@SETTINGS
@given(y=activations(block=1), scale=st.floats(2.0**-13, 128.0, width=32))
def test_fp8_static_error_within_half_step(y: np.ndarray, scale: float) -> None:
    """fp8_static: each code is within half an e4m3 step of y/scale (plus saturation above 448)."""
    s = torch.tensor([scale], dtype=torch.float32)
    q = quantize(torch.from_numpy(y), "fp8_static", scale=s)
    v = y * (F32(1) / F32(scale))
    _check_scaled_error(_codes(q.data), v, _e4m3_half_step(np.minimum(np.abs(v), 448)), 448.0)
    np.testing.assert_array_equal(dequantize(q).numpy(), _codes(q.data) * F32(scale))


@SETTINGS
@given(y=activations(block=1), scale=st.floats(2.0**-13, 128.0, width=32))
def test_fp8_static_requantizing_the_dequantized_tensor_is_stable(y: np.ndarray, scale: float) -> None:
    """fp8_static: quantize(dequantize(q), same scale) gives the same bytes."""
    s = torch.tensor([scale], dtype=torch.float32)
    q = quantize(torch.from_numpy(y), "fp8_static", scale=s)
    again = quantize(dequantize(q), "fp8_static", scale=s)
    assert torch.equal(again.data.view(torch.uint8), q.data.view(torch.uint8))


@SETTINGS
@given(y=activations(block=1))
def test_fp8_per_token_error_within_half_step(y: np.ndarray) -> None:
    """fp8_per_token: codes within half a step of y/scale_t; no saturation; row amax maps to ~448."""
    q = quantize(torch.from_numpy(y), "fp8_per_token")
    scale = q.scale.numpy()
    v = y / scale
    assert (np.abs(v) <= 448 * (1 + 2**-20)).all()
    _check_scaled_error(_codes(q.data), v, _e4m3_half_step(np.minimum(np.abs(v), 448)), 448.0)
    np.testing.assert_array_equal(dequantize(q).numpy(), _codes(q.data) * scale)


@SETTINGS
@given(y=activations(block=16), factor=st.sampled_from([0.25, 1.0, 1.0, 3.0]), swizzled=st.booleans())
def test_nvfp4_error_within_half_step(y: np.ndarray, factor: float, swizzled: bool) -> None:
    """nvfp4: e2m1 codes within half a step of y*S/SF (plus saturation); SF = 0 only for tiny blocks."""
    amax = float(np.abs(y).max())
    # A global scale must be a finite fp32: blocks of subnormal-sized values would need more.
    assume(amax == 0 or 448 * 6 / amax * factor < float(np.finfo(np.float32).max))
    gs = F32(448 * 6 / amax * factor) if amax > 0 else F32(1.0)
    layout = "swizzled_128x4" if swizzled else "linear"
    q = quantize(torch.from_numpy(y), "nvfp4", scale=torch.tensor([gs]), layout=layout)
    lin = quantize(torch.from_numpy(y), "nvfp4", scale=torch.tensor([gs]), layout="linear")
    rows, hidden = y.shape
    sf = lin.scale.float().numpy()  # [T, H/16]
    blocks = y.reshape(rows, hidden // 16, 16)
    mult = np.where(sf == 0, F32(0), gs / np.where(sf == 0, F32(1), sf)).astype(F32)
    v = blocks * mult[..., None]
    nib = q.data.numpy()
    codes = np.stack([nib & 0xF, nib >> 4], axis=-1).reshape(rows, hidden // 16, 16)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], F32)
    _check_scaled_error(grid[codes], v, _e2m1_half_step(np.minimum(np.abs(v), 6)), 6.0)
    zero_sf = sf == 0
    assert (np.abs(blocks).max(-1)[zero_sf] * gs / 6 <= 2.0**-10 * (1 + 2**-20)).all()
    expected = (grid[codes] * sf[..., None] / gs).astype(F32).reshape(rows, hidden)
    np.testing.assert_array_equal(dequantize(q).numpy(), expected)


@SETTINGS
@given(y=activations(block=32), swizzled=st.booleans())
def test_mxfp8_error_within_half_step(y: np.ndarray, swizzled: bool) -> None:
    """mxfp8: codes within half an e4m3 step of y*2**(127-e); the power-of-two scale never saturates."""
    layout = "swizzled_128x4" if swizzled else "linear"
    q = quantize(torch.from_numpy(y), "mxfp8", layout=layout)
    lin = quantize(torch.from_numpy(y), "mxfp8", layout="linear")
    rows, hidden = y.shape
    e = lin.scale.numpy().astype(np.int64)
    v = y.reshape(rows, hidden // 32, 32).astype(np.float64) * np.ldexp(1.0, 127 - e)[..., None]
    assert (np.abs(v) <= 448 * (1 + 2**-20)).all()
    codes = _codes(q.data).reshape(rows, hidden // 32, 32)
    _check_scaled_error(codes, v, _e4m3_half_step(np.minimum(np.abs(v), 448)), 448.0)
    deq = dequantize(q).numpy().reshape(rows, hidden // 32, 32)
    np.testing.assert_array_equal(deq, codes * np.ldexp(1.0, e - 127)[..., None])
    # the scale is the smallest power of two that avoids saturation (up to the fp32 rounding of p)
    amax = np.abs(y).reshape(rows, hidden // 32, 32).max(-1).astype(np.float64)
    tight = (amax > 0) & (e > 0)
    assert (amax[tight] * np.ldexp(1.0, 128 - e[tight]) > 448 * (1 - 2**-20)).all()
