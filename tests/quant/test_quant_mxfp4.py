"""mxfp4 (``arnorm/quant/_mxfp4.py``): hand-checked scales and codes, properties, both layouts.
vLLM's ``mxfp4_quantize`` judges the same codes in ``tests/vllm_lane/test_lane_group_formats.py``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arnorm import quant
from arnorm.quant._codecs import e2m1_encode
from arnorm.quant._mxfp4 import mxfp4_exponents


def block(values: list[float]) -> torch.Tensor:
    y = torch.zeros(1, 32)
    y[0, : len(values)] = torch.tensor(values)
    return y


def codes(q) -> list[int]:
    d = q.data[0]
    return torch.stack((d & 0xF, d >> 4), dim=-1).reshape(-1).tolist()


def test_the_table_record():
    spec = quant.FORMAT_SPECS["mxfp4"]
    assert (spec.block_size, spec.data_dtype, spec.elements_per_byte, spec.scale_dtype) == (
        32,
        "uint8",
        2,
        "uint8",
    )
    assert spec.layouts == ("linear", "swizzled_128x4") and spec.hidden_multiple == 32


def test_the_block_maximum_is_rounded_before_its_exponent():
    # amax 6 = 1.5 * 4: the mantissa stays under 1.75, r = 4, u = 2 - 2 = 0: codes are the values.
    q = quant.quantize(block([6.0, -1.5, 0.5, 0.25, 0.75]), "mxfp4")
    assert q.scale.tolist() == [[127]]
    assert codes(q)[:5] == [0x7, 0xB, 0x1, 0x0, 0x2]  # 6, -1.5, 0.5, 0.25 -> 0 (tie to even), 0.75 -> 1
    # amax 7 = 1.75 * 4 rounds to r = 8: u = 1, the block is halved: 7 -> 3.5 -> 4 (tie to even).
    q = quant.quantize(block([7.0, 1.0]), "mxfp4")
    assert q.scale.tolist() == [[128]] and codes(q)[:2] == [0x6, 0x1]
    # amax 6.99 (mantissa 1.7475) stays at r = 4: u = 0, 6.99 saturates to 6.
    q = quant.quantize(block([6.99]), "mxfp4")
    assert q.scale.tolist() == [[127]] and codes(q)[0] == 0x7


def test_zero_inf_and_nan_blocks():
    y = torch.cat(
        [block([]), block([float("inf"), 1.0]), block([float("nan"), 2.0]), block([float("nan")] * 32)]
    )
    q = quant.quantize(y, "mxfp4")
    assert q.scale[:, 0].tolist() == [0, 254, 126, 254]
    c = torch.stack((q.data & 0xF, q.data >> 4), dim=-1).reshape(4, 32)
    assert c[0].eq(0).all()
    assert c[1, :2].tolist() == [0x7, 0x0]  # inf saturates, 1 * 2**-127 rounds to 0
    assert c[2, :2].tolist() == [0x7, 0x6]  # NaN left out of the maximum (2: u = -1); its own code is 6
    assert c[3].eq(0x7).all()  # every value NaN: the maximum is NaN, r = inf, u = 127
    all_nan = quant.quantize(-torch.ones(1, 32) * float("nan"), "mxfp4")
    assert torch.isnan(quant.dequantize(all_nan)).sum() == 0


@settings(max_examples=80, deadline=None)
@given(st.floats(min_value=0, max_value=2.0**127, width=32, allow_subnormal=True))
def test_exponent_of_a_block_maximum(amax):
    u = mxfp4_exponents(torch.tensor([amax], dtype=torch.float32)).item()
    if amax == 0:
        assert u == -127
        return
    bits = torch.tensor([amax], dtype=torch.float32).view(torch.int32).item()
    r = ((bits + 0x200000) & 0x7F800000) >> 23
    assert u == (-127 if r == 0 else max(-127, min(127, r - 129)))
    # Below 1.75 * 2**k the maximum keeps 2**k, and 6 * 2**(k - 2) = 1.5 * 2**k: at most 6/7 saturates.
    assert 6 * 2.0**u >= amax * 6 / 7 or u == 127


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_codes_are_the_e2m1_rounding_of_the_scaled_block(seed):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(3, 64, generator=g) * 10 ** torch.randint(-4, 4, (3, 1), generator=g)).bfloat16()
    q = quant.quantize(y, "mxfp4")
    scale = 2.0 ** (q.scale.to(torch.int32) - 127).float()
    expect = e2m1_encode((y.float().reshape(3, 2, 32) / scale.unsqueeze(-1)).reshape(3, 64))
    got = torch.stack((q.data & 0xF, q.data >> 4), dim=-1).reshape(3, 64)
    assert torch.equal(got, expect)
    for layout in ("swizzled_128x4",):
        s = quant.quantize(y, "mxfp4", layout=layout)
        assert torch.equal(s.data, q.data) and torch.equal(quant.unswizzle_128x4(s.scale, 3, 2), q.scale)
        assert torch.equal(quant.dequantize(s), quant.dequantize(q))


def test_the_e8m0_scale_clamps_at_its_top_never_overflowing():
    """A block maximum at fp32 max rounds (step 2) to inf, which clamps to u = 127 (byte 254): never
    byte 255 (E8M0's NaN). Its element is 2.0 at that scale (code 4); the rest of the block scales to
    zero or a subnormal and rounds to 0."""
    top = torch.finfo(torch.float32).max
    q = quant.quantize(block([top, -top, 1.0]), "mxfp4")
    assert q.scale.tolist() == [[254]]
    assert codes(q)[:3] == [0x4, 0xC, 0x0]
    big = quant.quantize(block([2.0**127]), "mxfp4")  # exactly a power of two: u = 125, byte 252
    assert big.scale.tolist() == [[252]] and codes(big)[0] == 0x6
