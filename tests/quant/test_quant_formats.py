"""Each format of arnorm.quant against an independent NumPy + ml_dtypes oracle, and its edge cases."""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from arnorm._types import QuantizedActivation
from arnorm.quant import dequantize, quantize, swizzle_128x4

F32 = np.float32


# ---------------------------------------------------------------------------------------------
# Oracle: NumPy fp32 arithmetic (each op correctly rounded) and ml_dtypes casts.


def _e4m3(x: np.ndarray) -> np.ndarray:
    ref = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy()
    ref[np.isnan(x)] = 0x7F
    return ref


def _e4m3_value(codes: np.ndarray) -> np.ndarray:
    return codes.view(ml_dtypes.float8_e4m3fn).astype(F32)


def _e2m1(x: np.ndarray) -> np.ndarray:
    ref = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).copy()
    ref[np.isnan(x)] = 0
    return ref


def oracle_fp8_static(y: np.ndarray, scale: float) -> np.ndarray:
    inv = F32(1) / F32(scale)
    return _e4m3(y * inv)


def oracle_fp8_per_token(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    amax = np.max(np.abs(y), axis=1, keepdims=True)
    scale = np.maximum(amax / F32(448), F32(1) / F32(448 * 512))
    return _e4m3(y / scale), scale


def oracle_nvfp4(y: np.ndarray, gs: float) -> tuple[np.ndarray, np.ndarray]:
    t, h = y.shape
    blocks = y.reshape(t, h // 16, 16)
    with np.errstate(invalid="ignore", divide="ignore"):
        amax = np.max(np.abs(blocks), axis=-1)
        sf = _e4m3(F32(gs) * (amax * (F32(1) / F32(6))))
        sf_value = _e4m3_value(sf)
        mult = np.where(sf_value == 0, F32(0), F32(gs) / sf_value).astype(F32)
        codes = _e2m1(blocks * mult[..., None]).reshape(t, h)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), sf


def _ue8m0_ceil(p: float) -> int:
    if math.isnan(p):
        return 255
    if p <= 2.0**-127:
        return 0
    if math.isinf(p):
        return 254
    mant, exp = math.frexp(p)
    return min((exp - 1 if mant == 0.5 else exp) + 127, 254)


def oracle_mxfp8(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t, h = y.shape
    blocks = y.reshape(t, h // 32, 32)
    amax = np.max(np.abs(blocks), axis=-1)
    p = amax * (F32(1) / F32(448))
    e = np.vectorize(_ue8m0_ceil, otypes=[np.int64])(p.astype(np.float64))
    mult = np.where(e == 255, np.nan, np.ldexp(1.0, 127 - np.minimum(e, 254))).astype(F32)
    return _e4m3(blocks * mult[..., None]).reshape(t, h), e.astype(np.uint8)


def _swizzle_loop(linear: np.ndarray) -> np.ndarray:
    """docs/numerics.md's offset formula, one element at a time."""
    rows, cols = linear.shape
    rows_p, cols_p = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = np.zeros(rows_p * cols_p, np.uint8)
    for m in range(rows):
        for k in range(cols):
            off = (
                (m // 128) * (cols_p // 4) * 512
                + (k // 4) * 512
                + (m % 32) * 16
                + ((m % 128) // 32) * 4
                + k % 4
            )
            out[off] = linear[m, k]
    return out.reshape(rows_p, cols_p)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _sample(rows: int, hidden: int, seed: int) -> np.ndarray:
    """Values over many binades, with exact zeros, negative zeros and exact e4m3/e2m1 ties."""
    rng = np.random.default_rng(seed)
    y = (rng.standard_normal((rows, hidden)) * np.exp2(rng.integers(-12, 6, (rows, 1)))).astype(F32)
    y[rng.random((rows, hidden)) < 0.05] = 0.0
    y[rng.random((rows, hidden)) < 0.02] = -0.0
    y[rng.random((rows, hidden)) < 0.05] = 2.5
    return y


# ---------------------------------------------------------------------------------------------
# The formats against the oracle.


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.0, 2.0**-10])
def test_fp8_static_matches_oracle(scale: float) -> None:
    """fp8_static codes equal satfinite_rn(y * fp32(1/scale)) and the scale is passed through."""
    y = _sample(9, 96, 1)
    s = torch.tensor([scale], dtype=torch.float32)
    q = quantize(torch.from_numpy(y), "fp8_static", scale=s)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (9, 96)
    assert q.scale is s and q.layout is None and q.global_scale is None
    np.testing.assert_array_equal(_bytes(q.data), oracle_fp8_static(y, scale))
    np.testing.assert_array_equal(dequantize(q).numpy(), _e4m3_value(_bytes(q.data)) * F32(scale))


def test_fp8_per_token_matches_oracle() -> None:
    """fp8_per_token scales equal max(amax/448, fp32(1/229376)) and codes y / scale_t."""
    y = _sample(11, 80, 2)
    y[3] = 0.0  # the floor scale
    y[4, :] = 1e-8  # amax / 448 below the floor
    q = quantize(torch.from_numpy(y), "fp8_per_token")
    codes, scale = oracle_fp8_per_token(y)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (11, 1)
    np.testing.assert_array_equal(q.scale.numpy(), scale)
    assert q.scale[3].item() == q.scale[4].item() == float(F32(1) / F32(229376))
    np.testing.assert_array_equal(_bytes(q.data), codes)
    np.testing.assert_array_equal(dequantize(q).numpy(), _e4m3_value(codes) * scale)


@pytest.mark.parametrize("factor", [1.0, 0.37, 5.0, 1e-3])
def test_nvfp4_matches_oracle(factor: float) -> None:
    """nvfp4 packed codes and e4m3 block scales equal the oracle, in both layouts."""
    y = _sample(5, 160, 3)
    gs = float(F32(448 * 6 / np.abs(y).max() * factor))
    codes, sf = oracle_nvfp4(y, gs)
    s = torch.tensor([gs], dtype=torch.float32)
    lin = quantize(torch.from_numpy(y), "nvfp4", scale=s, layout="linear")
    swz = quantize(torch.from_numpy(y), "nvfp4", scale=s)
    assert lin.data.dtype == torch.uint8 and lin.data.shape == (5, 80)
    assert lin.scale.dtype == torch.float8_e4m3fn and lin.scale.shape == (5, 10)
    assert swz.layout == "swizzled_128x4" and swz.scale.shape == (128, 12) and swz.global_scale is s
    np.testing.assert_array_equal(lin.data.numpy(), codes)
    np.testing.assert_array_equal(_bytes(lin.scale), sf)
    np.testing.assert_array_equal(swz.data.numpy(), codes)
    np.testing.assert_array_equal(_bytes(swz.scale), _swizzle_loop(sf))
    assert torch.equal(dequantize(lin), dequantize(swz))


def test_mxfp8_matches_oracle() -> None:
    """mxfp8 codes and E8M0 exponents equal the oracle (ceil of amax*fp32(1/448)), in both layouts."""
    y = _sample(7, 224, 4)
    y[0, :32] = 0.0  # all-zero block
    y[1, :32] = 448.0  # p rounds to exactly 1
    y[2, 32:64] = np.float32(2.0**-120)  # tiny block: p < 2**-127
    codes, e = oracle_mxfp8(y)
    lin = quantize(torch.from_numpy(y), "mxfp8")
    swz = quantize(torch.from_numpy(y), "mxfp8", layout="swizzled_128x4")
    assert lin.layout == "linear" and lin.scale.dtype == torch.uint8 and lin.scale.shape == (7, 7)
    assert lin.data.dtype == torch.float8_e4m3fn and swz.scale.shape == (128, 8)
    np.testing.assert_array_equal(_bytes(lin.data), codes)
    np.testing.assert_array_equal(lin.scale.numpy(), e)
    np.testing.assert_array_equal(swz.scale.numpy(), _swizzle_loop(e))
    assert e[0, 0] == 0 and e[1, 0] == 127 and e[2, 1] == 0
    expected = _e4m3_value(codes).reshape(7, 7, 32) * np.ldexp(F32(1), e.astype(np.int64) - 127)[..., None]
    np.testing.assert_array_equal(dequantize(lin).numpy(), expected.reshape(7, 224))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["fp8_static", "fp8_per_token", "nvfp4", "mxfp8"])
def test_half_inputs_quantize_like_their_fp32_values(fmt: str, dtype: torch.dtype) -> None:
    """A bf16/fp16 input gives the same bytes as its exact fp32 values; non-contiguous input works."""
    y = torch.from_numpy(_sample(4, 64, 5)).to(dtype)
    scale = torch.tensor([0.02 if fmt == "fp8_static" else 300.0]) if fmt in ("fp8_static", "nvfp4") else None
    a = quantize(y, fmt, scale=scale)
    b = quantize(y.float(), fmt, scale=scale)
    c = quantize(y.t().contiguous().t(), fmt, scale=scale)
    for other in (b, c):
        assert torch.equal(_as_u8(a.data), _as_u8(other.data))
        assert torch.equal(_as_u8(a.scale), _as_u8(other.scale))


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def test_zero_rows() -> None:
    """T = 0 quantizes to empty tensors and dequantizes back to [0, H]."""
    y = torch.zeros(0, 64)
    for fmt, scale in [("fp8_static", 1.0), ("fp8_per_token", None), ("nvfp4", 1.0), ("mxfp8", None)]:
        s = None if scale is None else torch.tensor([scale])
        for layout in ["linear", "swizzled_128x4"] if fmt in ("nvfp4", "mxfp8") else [None]:
            q = quantize(y, fmt, scale=s, layout=layout)
            assert dequantize(q).shape == (0, 64)


# ---------------------------------------------------------------------------------------------
# Zeros, saturation, tiny and huge values.


def test_all_zero_blocks_keep_signed_zeros() -> None:
    """All-zero blocks: nvfp4 SF 0 and mxfp8 e 0; codes keep the sign of each zero."""
    y = torch.zeros(1, 32)
    y[0, 1::2] = -0.0
    nv = quantize(y, "nvfp4", scale=torch.tensor([2688.0]), layout="linear")
    assert _bytes(nv.scale).tolist() == [[0, 0]] and nv.data.unique().tolist() == [0x80]
    mx = quantize(y, "mxfp8")
    assert mx.scale.tolist() == [[0]] and _bytes(mx.data)[0, :4].tolist() == [0x00, 0x80, 0x00, 0x80]
    for q in (nv, mx):
        out = dequantize(q)
        assert torch.equal(out, y) and torch.equal(torch.signbit(out), torch.signbit(y))


def test_nvfp4_block_scale_saturates_at_448() -> None:
    """An SF above 448 saturates to 448 (0x7E) and the block's largest codes saturate at 6."""
    y = torch.tensor([[10.0, -10.0, 1.0] + [0.0] * 13])
    q = quantize(y, "nvfp4", scale=torch.tensor([2688.0 / 5.0]), layout="linear")  # S*amax/6 = 896
    assert _bytes(q.scale).tolist() == [[0x7E]]
    lo, hi = q.data[0, 0].item() & 0xF, q.data[0, 0].item() >> 4
    assert (lo, hi) == (0x7, 0xF)  # +6, -6
    assert dequantize(q)[0, 0].item() == pytest.approx(6 * 448 / (2688 / 5))


def test_nvfp4_one_huge_value_flushes_the_rest_of_its_block() -> None:
    """One huge value sets its block's SF; small neighbours round to signed zero; other blocks are kept."""
    y = torch.full((1, 32), 0.01)
    y[0, 0] = 1000.0
    y[0, 1] = -0.01
    q = quantize(y, "nvfp4", scale=torch.tensor([2688.0 / 1000.0]), layout="linear")
    out = dequantize(q)
    assert out[0, 0].item() == pytest.approx(1000.0, rel=1e-6)
    assert out[0, 1].item() == 0.0 and math.copysign(1.0, out[0, 1].item()) == -1.0
    assert out[0, 2:16].abs().max().item() == 0.0
    assert out[0, 16:].abs().min().item() > 0


def test_nvfp4_tiny_block_gets_zero_scale() -> None:
    """A block whose S*amax/6 rounds to 0 in e4m3 (<= 2**-10) gets SF 0 and all-zero codes."""
    y = torch.full((1, 16), 1e-6)
    q = quantize(y, "nvfp4", scale=torch.tensor([1.0]), layout="linear")
    assert _bytes(q.scale).tolist() == [[0]] and q.data.unique().tolist() == [0]
    assert torch.equal(dequantize(q), torch.zeros(1, 16))


def test_mxfp8_tiny_block_keeps_precision_at_e0() -> None:
    """p <= 2**-127 gives e = 0 and the multiplier 2**127 (not flushed), so tiny values survive exactly."""
    y = torch.zeros(1, 32)
    y[0, 0] = 2.0**-130
    y[0, 1] = -(2.0**-133) * 1.5
    q = quantize(y, "mxfp8")
    assert q.scale.tolist() == [[0]]
    assert torch.equal(dequantize(q), y)


def test_mxfp8_subnormal_p_just_above_two_pow_minus_127() -> None:
    """p in (2**-127, 2**-126) gives e = 1 (2**-126), the next E8M0 value up."""
    y = torch.zeros(1, 32)
    y[0, 0] = 2.0**-118  # p = 2**-118 * fp32(1/448) ~ 1.14 * 2**-127
    q = quantize(y, "mxfp8")
    assert q.scale.tolist() == [[1]]
    assert dequantize(q)[0, 0].item() == 2.0**-118


def test_mxfp8_one_huge_value_and_saturated_exponent() -> None:
    """A huge value sets e; an infinite value saturates e at 254 and encodes as 448 there."""
    y = torch.full((1, 64), 1.0)
    y[0, 0] = 3.0e38
    y[0, 32] = float("inf")
    y[0, 33] = -float("inf")
    q = quantize(y, "mxfp8")
    e0 = math.ceil(math.log2(float(F32(3.0e38) * (F32(1) / F32(448))))) + 127
    assert q.scale.tolist() == [[e0, 254]]
    codes = _bytes(q.data)[0]
    assert codes[32] == 0x7E and codes[33] == 0xFE and codes[34] == 0
    assert dequantize(q)[0, 32].item() == math.inf  # 448 * 2**127 overflows fp32


# ---------------------------------------------------------------------------------------------
# NaN and infinity.


def test_fp8_static_nan_and_inf() -> None:
    """fp8_static: NaN of either sign encodes as 0x7F alone; +-inf saturate to +-448."""
    y = torch.tensor([[float("nan"), -float("nan"), float("inf"), -float("inf"), 1.0, -0.0]])
    q = quantize(y, "fp8_static", scale=torch.tensor([1.0]))
    assert _bytes(q.data)[0].tolist() == [0x7F, 0x7F, 0x7E, 0xFE, 0x38, 0x80]


def test_fp8_per_token_nan_row_and_inf_row() -> None:
    """fp8_per_token: a NaN poisons only its row (scale NaN, all codes 0x7F); inf gives scale inf."""
    y = torch.ones(3, 8)
    y[0, 2] = float("nan")
    y[1, 5] = float("inf")
    q = quantize(y, "fp8_per_token")
    codes = _bytes(q.data)
    assert math.isnan(q.scale[0, 0].item()) and (codes[0] == 0x7F).all()
    assert q.scale[1, 0].item() == math.inf
    assert codes[1, 5] == 0x7F and (codes[1, np.arange(8) != 5] == 0).all()  # inf/inf is NaN
    assert q.scale[2, 0].item() == float(F32(1) / F32(448)) and (codes[2] == 0x7E).all()


def test_nvfp4_nan_poisons_only_its_block() -> None:
    """nvfp4: a NaN makes its block's SF 0x7F and codes 0; the block decodes to NaN, others do not."""
    y = torch.ones(2, 32)
    y[1, 20] = float("nan")
    q = quantize(y, "nvfp4", scale=torch.tensor([2688.0]), layout="linear")
    sf = _bytes(q.scale)
    assert sf[1, 1] == 0x7F and sf[1, 0] != 0x7F and (sf[0] != 0x7F).all()
    assert (q.data[1, 8:] == 0).all()
    out = dequantize(q)
    assert torch.isnan(out[1, 16:]).all() and not torch.isnan(out[1, :16]).any()
    assert not torch.isnan(out[0]).any()


def test_nvfp4_inf_saturates() -> None:
    """nvfp4: an infinite value saturates its block's SF to 448 and its code to +-6."""
    y = torch.ones(1, 16)
    y[0, 3] = -float("inf")
    q = quantize(y, "nvfp4", scale=torch.tensor([1.0]), layout="linear")
    assert _bytes(q.scale).tolist() == [[0x7E]]
    assert q.data[0, 1].item() >> 4 == 0xF


def test_mxfp8_nan_poisons_only_its_block() -> None:
    """mxfp8: a NaN makes its block's exponent 255 (E8M0 NaN) and all its codes 0x7F."""
    y = torch.ones(1, 64)
    y[0, 40] = -float("nan")
    q = quantize(y, "mxfp8")
    assert q.scale.tolist() == [[119, 255]]  # 1 * fp32(1/448) rounds up to 2**-8
    codes = _bytes(q.data)[0]
    assert (codes[32:] == 0x7F).all() and (codes[:32] == 0x78).all()  # 1 * 2**8
    out = dequantize(q)
    assert torch.isnan(out[0, 32:]).all() and torch.equal(out[0, :32], torch.ones(32))


def test_dequantize_rejects_malformed_input() -> None:
    """dequantize checks the format name, the data dtype and the per-token scale shape."""
    data = torch.zeros(2, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^quant: 'int4' \(needs one of"):
        dequantize(QuantizedActivation(data, torch.ones(1), "int4"))
    with pytest.raises(ValueError, match=r"^data: dtype torch.uint8 shape \[2, 32\] \(needs a 2-D"):
        dequantize(QuantizedActivation(data.view(torch.uint8), torch.ones(1), "fp8_static"))
    with pytest.raises(ValueError, match=r"^scale: shape \[1\] \(needs \[2, 1\] for fp8_per_token\)$"):
        dequantize(QuantizedActivation(data, torch.ones(1), "fp8_per_token"))
    with pytest.raises(ValueError, match=r"^layout: None \(needs linear or swizzled_128x4 for mxfp8\)$"):
        dequantize(QuantizedActivation(data, torch.zeros(2, 1, dtype=torch.uint8), "mxfp8"))
    with pytest.raises(ValueError, match=r"^scale: shape \[2, 2\] \(needs \[2, 1\] for linear\)$"):
        dequantize(QuantizedActivation(data, torch.zeros(2, 2, dtype=torch.uint8), "mxfp8", "linear"))


def test_swizzled_scales_equal_swizzle_of_linear() -> None:
    """The swizzled scales of a quantization are swizzle_128x4 of its linear scales."""
    y = torch.from_numpy(_sample(130, 320, 6))
    for fmt, scale in [("nvfp4", torch.tensor([100.0])), ("mxfp8", None)]:
        lin = quantize(y, fmt, scale=scale, layout="linear")
        swz = quantize(y, fmt, scale=scale, layout="swizzled_128x4")
        assert torch.equal(_as_u8(swz.scale), _as_u8(swizzle_128x4(lin.scale)))


# ---------------------------------------------------------------------------------------------
# Devices.

_CASES = [
    ("fp8_static", True, None),
    ("fp8_per_token", False, None),
    ("nvfp4", True, "linear"),
    ("nvfp4", True, "swizzled_128x4"),
    ("mxfp8", False, "linear"),
    ("mxfp8", False, "swizzled_128x4"),
]


@pytest.mark.parametrize(("fmt", "scaled", "layout"), _CASES)
def test_runs_on_meta_device(fmt: str, scaled: bool, layout: str | None) -> None:
    """Every format runs on the meta device: no host sync, no value-dependent shapes, right output shapes."""
    y = torch.empty(130, 64, dtype=torch.bfloat16, device="meta")
    scale = torch.empty(1, device="meta") if scaled else None
    q = quantize(y, fmt, scale=scale, layout=layout)
    assert q.data.device.type == "meta" and q.scale.device.type == "meta"
    assert q.data.shape == ((130, 32) if fmt == "nvfp4" else (130, 64))
    assert dequantize(q).shape == (130, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("fmt", "scaled", "layout"), _CASES)
def test_cuda_matches_cpu_bitwise_without_host_sync(fmt: str, scaled: bool, layout: str | None) -> None:
    """On CUDA every format gives the CPU bytes, and quantize never synchronizes with the host."""
    y = _sample(300, 512, 7)
    y[5, 40] = np.nan
    y[6, 70] = -np.inf
    scale = torch.tensor([0.0123 if fmt == "fp8_static" else 97.0]) if scaled else None
    cpu = quantize(torch.from_numpy(y), fmt, scale=scale, layout=layout)
    y_gpu = torch.from_numpy(y).cuda()
    scale_gpu = None if scale is None else scale.cuda()
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sync debug mode is a prototype feature"
            torch.cuda.set_sync_debug_mode("error")
        gpu = quantize(y_gpu, fmt, scale=scale_gpu, layout=layout)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(_as_u8(gpu.data).cpu(), _as_u8(cpu.data))
    # Scales: the same bits, except NaN payloads (a NaN row's fp32 scale; its codes are all 0x7F).
    g, c = gpu.scale.cpu(), cpu.scale
    assert torch.equal(_as_u8(g)[~g.isnan()], _as_u8(c)[~c.isnan()]) and torch.equal(g.isnan(), c.isnan())
    np.testing.assert_array_equal(dequantize(gpu).cpu().numpy(), dequantize(cpu).numpy())


def test_inputs_that_require_grad_give_detached_outputs() -> None:
    """Tensors that require grad quantize without building an autograd graph; the scale is passed through."""
    y = torch.randn(4, 64, requires_grad=True)
    s = torch.tensor([0.1], requires_grad=True)
    for fmt, scale in [("fp8_static", s), ("fp8_per_token", None), ("nvfp4", s), ("mxfp8", None)]:
        q = quantize(y, fmt, scale=scale)
        assert not q.data.requires_grad
        assert not (q.scale.requires_grad and q.scale is not s)
