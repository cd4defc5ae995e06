"""Element codecs of arnorm.quant against ml_dtypes: every rounding boundary, its neighbours, specials."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from arnorm.quant._codecs import (
    F32_MIN_TOKEN_SCALE,
    F32_RCP_6,
    F32_RCP_448,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    pow2_neg_e8m0,
    ue8m0_round_up,
)

F32 = np.float32


def _neighbours(values: np.ndarray) -> np.ndarray:
    """``values`` with their fp32 nextafter down and up, both signs, as one flat fp32 array."""
    v = np.asarray(values, dtype=F32)
    around = np.concatenate([v, np.nextafter(v, F32(-np.inf)), np.nextafter(v, F32(np.inf))])
    return np.concatenate([around, -around]).astype(F32)


def _specials() -> np.ndarray:
    tiny = np.array([0x00000001, 0x00000002, 0x003FFFFF, 0x00400000, 0x00400001, 0x007FFFFF], np.uint32)
    return np.concatenate(
        [
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38, 1e-30, -1e-30], F32),
            tiny.view(F32),
            -tiny.view(F32),
            np.array([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32).view(F32),
        ]
    )


def _fp32_sweep(step: int = 4097) -> np.ndarray:
    """Every ``step``-th fp32 bit pattern (all signs, exponents, NaNs and infinities represented)."""
    return np.arange(0, 2**32, step, dtype=np.uint64).astype(np.uint32).view(F32)


def _grid(dtype: type) -> np.ndarray:
    """All non-negative finite values of an ml_dtypes float type, ascending."""
    codes = np.arange(256 if np.dtype(dtype).itemsize == 1 and dtype is not ml_dtypes.float4_e2m1fn else 16)
    vals = codes.astype(np.uint8).view(dtype).astype(F32)
    vals = vals[np.isfinite(vals) & (vals >= 0) & ~np.signbit(vals)]
    return np.unique(vals)


def _e4m3_oracle(x: np.ndarray) -> np.ndarray:
    ref = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy()
    ref[np.isnan(x)] = 0x7F
    return ref


def _e2m1_oracle(x: np.ndarray) -> np.ndarray:
    ref = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).copy()
    ref[np.isnan(x)] = 0x0
    return ref


def _e4m3_boundaries() -> np.ndarray:
    grid = _grid(ml_dtypes.float8_e4m3fn)
    assert grid[-1] == 448 and len(grid) == 127
    mids = (grid[:-1].astype(np.float64) + grid[1:]) / 2  # exact in fp32
    return np.concatenate([grid, mids.astype(F32), np.array([464.0, 480.0, 512.0, 2.0**-10], F32)])


def _e2m1_boundaries() -> np.ndarray:
    grid = _grid(ml_dtypes.float4_e2m1fn)
    assert grid.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    mids = (grid[:-1] + grid[1:]) / 2
    return np.concatenate([grid, mids, np.array([7.0, 8.0, 1e30], F32)]).astype(F32)


def _encode(fn, x: np.ndarray) -> np.ndarray:
    return fn(torch.from_numpy(x.copy())).numpy()


def test_e4m3_encode_matches_ml_dtypes_at_every_boundary() -> None:
    """e4m3 RNE-satfinite equals ml_dtypes on every grid value, midpoint and their fp32 neighbours."""
    x = np.concatenate([_neighbours(_e4m3_boundaries()), _specials()])
    np.testing.assert_array_equal(_encode(e4m3_encode, x), _e4m3_oracle(x))


def test_e4m3_encode_matches_ml_dtypes_on_fp32_sweep() -> None:
    """e4m3 encoding equals ml_dtypes on a strided sweep of all 2**32 fp32 bit patterns."""
    x = _fp32_sweep()
    np.testing.assert_array_equal(_encode(e4m3_encode, x), _e4m3_oracle(x))


def test_e4m3_encode_equals_torch_clamp_then_cast_for_non_nan() -> None:
    """For non-NaN input the codec equals torch's ``clamp(-448, 448).to(float8_e4m3fn)``."""
    x = np.concatenate([_neighbours(_e4m3_boundaries()), _fp32_sweep(65537)])
    x = x[~np.isnan(x)]
    t = torch.from_numpy(x)
    expected = t.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(e4m3_encode(t), expected)


def test_e4m3_encode_specials() -> None:
    """Saturation, signed zero, subnormal ties and NaN canonicalisation of the e4m3 encoder."""
    x = np.array(
        [464.0, 465.0, np.inf, -np.inf, -0.0, -1e-9, 2.0**-10, 3 * 2.0**-10, 2.0**-9, np.nan, -np.nan], F32
    )
    expected = [0x7E, 0x7E, 0x7E, 0xFE, 0x80, 0x80, 0x00, 0x02, 0x01, 0x7F, 0x7F]
    assert _encode(e4m3_encode, x).tolist() == expected


def test_e4m3_decode_all_codes() -> None:
    """Decoding each of the 256 e4m3 codes equals ml_dtypes (0x7F and 0xFF are NaN)."""
    codes = np.arange(256, dtype=np.uint8)
    ours = e4m3_decode(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(ours, codes.view(ml_dtypes.float8_e4m3fn).astype(F32))
    np.testing.assert_array_equal(np.signbit(ours), codes >= 0x80)


def test_e4m3_round_trip_all_finite_codes() -> None:
    """Encoding each decoded finite code gives the code back (both zeros included)."""
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)
    decoded = e4m3_decode(torch.from_numpy(codes))
    assert e4m3_encode(decoded).tolist() == codes.tolist()


def test_e2m1_encode_matches_ml_dtypes_at_every_boundary() -> None:
    """e2m1 RNE-satfinite equals ml_dtypes on every grid value, midpoint and their fp32 neighbours."""
    x = np.concatenate([_neighbours(_e2m1_boundaries()), _specials()])
    np.testing.assert_array_equal(_encode(e2m1_encode, x), _e2m1_oracle(x))


def test_e2m1_encode_matches_ml_dtypes_on_fp32_sweep() -> None:
    """e2m1 encoding equals ml_dtypes on a strided sweep of all 2**32 fp32 bit patterns."""
    x = _fp32_sweep()
    np.testing.assert_array_equal(_encode(e2m1_encode, x), _e2m1_oracle(x))


def test_e2m1_encode_ties_and_specials() -> None:
    """Ties go to the even code, above 5 saturates to 6, signed zero kept, NaN gives code 0."""
    x = np.array(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, np.inf, -np.inf, -0.0, -0.1, np.nan, -np.nan], F32
    )
    expected = [0, 2, 2, 4, 4, 6, 6, 7, 7, 15, 8, 8, 0, 0]
    assert _encode(e2m1_encode, x).tolist() == expected


def test_e2m1_decode_all_codes() -> None:
    """Decoding each of the 16 e2m1 codes equals ml_dtypes, code 8 being -0.0."""
    codes = np.arange(16, dtype=np.uint8)
    ours = e2m1_decode(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(ours, codes.view(ml_dtypes.float4_e2m1fn).astype(F32))
    np.testing.assert_array_equal(np.signbit(ours), codes >= 8)


def _ue8m0_oracle(p: np.ndarray) -> np.ndarray:
    """Smallest E8M0 value >= p, by frexp (independent of the bit logic); NaN -> 255."""
    out = np.empty(p.shape, np.int64)
    for i, v in enumerate(p.astype(np.float64)):
        if np.isnan(v):
            out[i] = 255
            continue
        if v <= 0:
            out[i] = 0
            continue
        if np.isinf(v):
            out[i] = 254
            continue
        mant, exp = np.frexp(v)  # v = mant * 2**exp, mant in [0.5, 1)
        k = exp - 1 if mant == 0.5 else exp  # smallest k with 2**k >= v
        out[i] = min(max(k, -127), 127) + 127
    return out


def test_ue8m0_round_up_matches_frexp_oracle() -> None:
    """E8M0 round-up equals the frexp oracle on powers of two, their neighbours, subnormals, a sweep."""
    pow2 = np.ldexp(F32(1), np.arange(-149, 128)).astype(F32)
    p = np.concatenate([_neighbours(pow2), _specials(), _fp32_sweep(65537)])
    p = np.abs(p[~np.isnan(p)])
    p = np.concatenate([p, np.array([np.nan], F32)])
    ours = ue8m0_round_up(torch.from_numpy(p.copy())).numpy()
    np.testing.assert_array_equal(ours, _ue8m0_oracle(p))


def test_ue8m0_round_up_subnormal_and_saturation() -> None:
    """p <= 2**-127 (zero included) gives 0, just above gives 1, inf saturates at 254, NaN gives 255."""
    bits = np.array([0, 1, 0x003FFFFF, 0x00400000, 0x00400001, 0x007FFFFF, 0x00800000, 0x00800001], np.uint32)
    p = np.concatenate([bits.view(F32), np.array([2.0**127, 3.0e38, np.inf, np.nan], F32)])
    ours = ue8m0_round_up(torch.from_numpy(p)).tolist()
    assert ours == [0, 0, 0, 0, 1, 1, 1, 2, 254, 254, 254, 255]


def test_e8m0_decode_and_multiplier_all_codes() -> None:
    """E8M0 decode equals ml_dtypes for all 256 codes; the encode multiplier is exactly 2**(127-e)."""
    codes = np.arange(256, dtype=np.uint8)
    ours = e8m0_decode(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(ours, codes.view(ml_dtypes.float8_e8m0fnu).astype(F32))
    mult = pow2_neg_e8m0(torch.from_numpy(codes)).numpy()
    assert np.isnan(mult[255])
    np.testing.assert_array_equal(mult[:255].astype(np.float64), np.ldexp(1.0, 127 - np.arange(255)))


@pytest.mark.parametrize(
    ("constant", "num", "den"),
    [(F32_RCP_6, 1, 6), (F32_RCP_448, 1, 448), (F32_MIN_TOKEN_SCALE, 1, 448 * 512)],
)
def test_fp32_constants_are_correctly_rounded(constant: float, num: int, den: int) -> None:
    """The fp32 constants equal the IEEE fp32 quotient they stand for."""
    assert constant == float(F32(num) / F32(den))
