"""An independent oracle of the numerics contract (docs/numerics.md), in numpy float64; nothing from arnorm.

Rounding onto bf16, fp16, e4m3fn and e2m1 goes through ``ml_dtypes`` / numpy casts (round to
nearest even), saturation is a clip before the cast. Every fp32 operation the contract names is
emulated exactly: a +, *, / of two fp32 values computed in float64 and rounded once to fp32 is the
correctly rounded fp32 result (float64 carries more than 2 * 24 + 2 bits).

- Steps 1-2 (rank-order fp32 sum rounded to the dtype, residual add rounded) are exact: a backend
  must match them bit for bit.
- Step 3 is computed in float64 and turned into an interval: a backend computing it in fp32 lands
  within a relative ``DELTA`` of the exact value before its final rounding(s), so its result lies
  between the roundings of ``v * (1 - DELTA)`` and ``v * (1 + DELTA)`` (rounding is monotone). For
  bf16 / fp16 that is the one or two neighbours of the exact value, i.e. within 1 ulp.
- Step 4 (the quantizers) is exact given the normed activation, per docs/numerics.md's formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

#: Relative error budget of an fp32 implementation of step 3 (a few roundings, an H <= 256 mean and
#: an rsqrt are below 2**-20).
DELTA = 2.0**-18

_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
E4M3_MAX, E2M1_MAX = 448.0, 6.0


def f32(x) -> np.ndarray:
    """Round float64 values to fp32 (kept as float64 holding fp32 values)."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def to_dtype(x, dtype: str) -> np.ndarray:
    """Round fp32-valued float64 data onto ``dtype`` (via fp32, monotone), kept as float64."""
    return f32(x).astype(np.float32).astype(_DTYPES[dtype]).astype(np.float64)


@dataclass(frozen=True)
class Expected:
    """Steps 1-3: the exact residual and the interval [lo, hi] the normed values must lie in."""

    residual: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def add_rmsnorm(
    partials: list[np.ndarray],
    residual: np.ndarray,
    weight: np.ndarray,
    *,
    dtype: str,
    eps: float,
    offset: float,
    round_before_weight: bool,
) -> Expected:
    """The contract for float64 arrays holding ``dtype`` values (partials in rank order)."""
    acc = f32(partials[0])
    for p in partials[1:]:
        acc = f32(acc + p)  # fp32 accumulation in rank order
    s = to_dtype(acc, dtype)
    h = to_dtype(f32(s + residual), dtype)
    inv_rms = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + f32(eps))
    wsum = f32(f32(offset) + weight)  # (b + fp32(g)) is one fp32 addition
    down, up = 1.0 - DELTA, 1.0 + DELTA
    if round_before_weight:
        z = h * inv_rms
        ends = [to_dtype(f32(to_dtype(z * k, dtype) * wsum), dtype) for k in (down, up)]
    else:
        v = h * inv_rms * wsum
        ends = [to_dtype(v * k, dtype) for k in (down, up)]
    return Expected(h, np.minimum(*ends), np.maximum(*ends))


# -- step 4: the formats, bit for bit ---------------------------------------------------------------


def e4m3(x) -> np.ndarray:
    """fp32 values -> e4m3fn codes (uint8): RNE, saturating to +-448, signed zero kept."""
    clipped = np.clip(np.asarray(x, np.float64), -E4M3_MAX, E4M3_MAX).astype(np.float32)
    return clipped.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_value(codes: np.ndarray) -> np.ndarray:
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def e2m1(x) -> np.ndarray:
    """fp32 values -> e2m1 codes 0..15 (uint8, sign in bit 3): RNE, saturating to +-6."""
    clipped = np.clip(np.asarray(x, np.float64), -E2M1_MAX, E2M1_MAX).astype(np.float32)
    return clipped.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F


def ue8m0_round_up(p: np.ndarray) -> np.ndarray:
    """The smallest biased E8M0 exponent e (0..254) with 2**(e - 127) >= p, for fp32 p >= 0."""
    mantissa, exponent = np.frexp(p)  # p = mantissa * 2**exponent, mantissa in [0.5, 1)
    ceil_log2 = np.where(mantissa == 0.5, exponent - 1, exponent)
    return np.where(p == 0, 0, np.clip(ceil_log2 + 127, 0, 254)).astype(np.int64)


def swizzle_128x4(scales: np.ndarray) -> np.ndarray:
    """Row-major ``[T, C]`` bytes -> ``[round_up(T, 128), round_up(C, 4)]`` in 128x4 order.

    The order is docs/numerics.md's, section 4."""
    rows, cols = scales.shape
    rows_p, cols_p = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = np.zeros(rows_p * cols_p, dtype=np.uint8)
    m, k = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    offset = (m // 128) * (cols_p // 4) * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    out[offset.ravel()] = scales.ravel()
    return out.reshape(rows_p, cols_p)


def _layout(scales: np.ndarray, layout: str) -> np.ndarray:
    return swizzle_128x4(scales) if layout == "swizzled_128x4" else scales


def quantize(
    y: np.ndarray, quant: str, scale: float | None, layout: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(data bytes, scale)`` of the normed values ``y`` (float64 holding dtype values).

    data: uint8 codes ``[T, H]`` (nvfp4: ``[T, H/2]``, low nibble first). scale: fp8_static: the
    input scale ``[1]``; fp8_per_token: fp32 ``[T, 1]`` values; nvfp4: e4m3 block-scale bytes;
    mxfp8: E8M0 exponent bytes (block scales in ``layout``).
    """
    rows, hidden = y.shape
    if quant == "fp8_static":
        inv = f32(1.0 / scale)
        return e4m3(f32(y * inv)), np.array([scale])
    if quant == "fp8_per_token":
        amax = np.abs(y).max(axis=-1, keepdims=True)
        token = np.maximum(f32(amax / E4M3_MAX), f32(1.0 / (E4M3_MAX * 512)))
        return e4m3(f32(y / token)), token
    if quant == "nvfp4":
        blocks = y.reshape(rows, hidden // 16, 16)
        amax = np.abs(blocks).max(axis=-1)
        sf = e4m3(f32(scale * f32(amax * f32(1.0 / 6.0))))
        sf_value = e4m3_value(sf)
        with np.errstate(divide="ignore"):
            multiplier = np.where(sf_value == 0, 0.0, f32(scale / sf_value))
        codes = e2m1(f32(blocks * multiplier[..., None])).reshape(rows, hidden)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        return packed, _layout(sf, layout)
    if quant == "mxfp8":
        blocks = y.reshape(rows, hidden // 32, 32)
        amax = np.abs(blocks).max(axis=-1)
        e = ue8m0_round_up(f32(amax * f32(1.0 / E4M3_MAX)))
        codes = e4m3(f32(blocks * np.exp2(127.0 - e)[..., None])).reshape(rows, hidden)
        return codes, _layout(e.astype(np.uint8), layout)
    raise ValueError(quant)
