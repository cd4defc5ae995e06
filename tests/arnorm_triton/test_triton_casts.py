"""The conversion helpers of arnorm_triton._casts against torch and arnorm.quant's codecs, bit for bit.

The integer-bit branch (``SOFT=True``) runs everywhere, the interpreter included; the hardware
branch (``SOFT=False``) only on a GPU: the interpreter's own fp32 -> bf16 / e4m3 casts are wrong.
"""

from __future__ import annotations

import struct

import pytest
import torch
import triton
import triton.language as tl

from arnorm.quant._codecs import e2m1_encode, e4m3_encode, pow2_neg_e8m0, ue8m0_round_up
from arnorm_triton._casts import (
    e2m1_code,
    e4m3_bits,
    e4m3_decode,
    to_dtype_rne,
    to_fp32,
    ue8m0_to_inv_scale,
)
from arnorm_triton._casts import (
    ue8m0_round_up as k_ue8m0_round_up,
)

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
BLOCK = 1 << 14


@triton.jit
def _encode_kernel(x_ptr, bf16_ptr, f16_ptr, e4m3_ptr, e4m3_cvt_ptr, e2m1_ptr, e8m0_ptr, n,
                   SOFT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(bf16_ptr + offs, to_dtype_rne(x, tl.bfloat16, SOFT), mask=m)
    tl.store(f16_ptr + offs, to_dtype_rne(x, tl.float16, SOFT), mask=m)
    tl.store(e4m3_ptr + offs, e4m3_bits(x, SOFT), mask=m)
    tl.store(e4m3_cvt_ptr + offs, e4m3_bits(x, SOFT, False), mask=m)  # the conversion saturates alone
    tl.store(e2m1_ptr + offs, e2m1_code(x), mask=m)
    tl.store(e8m0_ptr + offs, k_ue8m0_round_up(tl.abs(x)).to(tl.uint8), mask=m)


@triton.jit
def _decode_kernel(bf16_ptr, up_ptr, code_ptr, e4m3_val_ptr, inv_ptr, SOFT: tl.constexpr):
    i = tl.arange(0, 65536)
    tl.store(up_ptr + i, to_fp32(tl.load(bf16_ptr + i), SOFT))
    c = tl.arange(0, 256)
    tl.store(e4m3_val_ptr + c, e4m3_decode(tl.load(code_ptr + c) & 0x7F))
    tl.store(inv_ptr + c, ue8m0_to_inv_scale(c.to(tl.uint32)))


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor([struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0] for b in bits])


def _sweep() -> torch.Tensor:
    """A strided sweep over all 2**32 fp32 patterns, plus every e4m3 / bf16 / e2m1 tie and specials."""
    stride = 16411  # odd and about 2**32 / 2**18: the sweep covers every exponent and sign
    bits = (torch.arange(1 << 18, dtype=torch.int64) * stride) & 0xFFFFFFFF
    sweep = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    e4m3 = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:127]
    ties = (e4m3[:-1] + e4m3[1:]) / 2  # exact in fp32
    e2m1 = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30])
    bf16_ties = (torch.arange(0, 1 << 15, 7, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    pow2 = torch.tensor([2.0**k for k in range(-149, 128)], dtype=torch.float32)
    special = _f32([0, 1 << 31, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,
                    0x00400000, 0x00400001, 0x7F7FFFFF, 0x43E00000, 0x43E80000, 0x43F00000])  # fmt: skip
    core = torch.cat([ties, e2m1, pow2, pow2 * 1.5, (pow2 * 1.0000001).float()])
    return torch.cat([sweep, bf16_ties, special, core, -core])


def _nan_aware_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())).all())


def _check_encoders(soft: bool) -> None:
    x = _sweep().to(DEVICE)
    n = x.numel()
    bf16 = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    f16 = torch.empty(n, dtype=torch.float16, device=DEVICE)
    e4m3, e4m3_cvt, e2m1, e8m0 = (torch.empty(n, dtype=torch.uint8, device=DEVICE) for _ in range(4))
    grid = (triton.cdiv(n, BLOCK),)
    _encode_kernel[grid](x, bf16, f16, e4m3, e4m3_cvt, e2m1, e8m0, n, SOFT=soft, BLOCK=BLOCK)
    x = x.cpu()
    assert _nan_aware_equal(bf16.cpu(), x.to(torch.bfloat16)), "fp32 -> bf16"
    assert _nan_aware_equal(f16.cpu(), x.to(torch.float16)), "fp32 -> fp16"
    assert torch.equal(e4m3.cpu(), e4m3_encode(x)), "fp32 -> e4m3"
    assert torch.equal(e4m3_cvt.cpu(), e4m3_encode(x)), "fp32 -> e4m3 without the clamp (CLAMP=False)"
    assert torch.equal(e2m1.cpu(), e2m1_encode(x)), "fp32 -> e2m1"
    assert torch.equal(e8m0.cpu(), ue8m0_round_up(x.abs()).to(torch.uint8)), "ue8m0 round-up"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inside the interpreter, on NaN / inf
def test_soft_encoders_are_exact():
    """SOFT=True: fp32 -> bf16 / fp16 / e4m3 / e2m1 / E8M0 equal torch and arnorm.quant on the sweep."""
    _check_encoders(soft=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("soft", [True, False], ids=["soft", "hardware"])
def test_decoders_are_exact(soft):
    """bf16 -> fp32 for all 65536 patterns, e4m3 decode of all codes, 2**(127-e) for all E8M0."""
    if not soft and DEVICE.type != "cuda":
        pytest.skip("the hardware bf16 upcast is exercised on a GPU (the interpreter mis-decodes subnormals)")
    bf16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    up = torch.empty(65536, device=DEVICE)
    vals, inv = torch.empty(256, device=DEVICE), torch.empty(256, device=DEVICE)
    _decode_kernel[(1,)](bf16.to(DEVICE), up, codes.to(DEVICE), vals, inv, SOFT=soft)
    assert torch.equal(up.cpu().view(torch.int32), bf16.float().view(torch.int32))
    expect = (codes & 0x7F).view(torch.float8_e4m3fn).float()
    assert torch.equal(vals.cpu().nan_to_num(-1.0), expect.nan_to_num(-1.0))
    assert torch.equal(inv.cpu().nan_to_num(-1.0), pow2_neg_e8m0(codes.to(torch.int32)).nan_to_num(-1.0))


@pytest.mark.gpu
def test_hardware_encoders_are_exact():
    """SOFT=False on a GPU: the hardware cvt instructions give the same bits as the integer path,
    and e4m3 without the explicit clamp too (cvt.rn.satfinite saturates by itself)."""
    _check_encoders(soft=False)
