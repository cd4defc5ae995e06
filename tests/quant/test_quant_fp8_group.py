"""The per-token-group fp8 formats (``arnorm/quant/_fp8_group.py``): hand-checked values, properties,
every scale layout, and the errors that name the argument. vLLM's own quantizer judges the same
codes in ``tests/vllm_lane/test_lane_group_formats.py``."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arnorm
from arnorm import quant
from arnorm.quant._codecs import F32_RCP_448, e4m3_encode
from arnorm.quant._fp8_group import EPS, from_group_layout, pow2_round_up

GROUP_FORMATS = [n for n, s in quant.FORMAT_SPECS.items() if s.block_size and s.scale_dtype == "float32"]
POW2 = [n for n in GROUP_FORMATS if quant.FORMAT_SPECS[n].pow2_scales]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.uint8)


def test_the_table_holds_group_128_and_64_with_fp32_or_pow2_scales():
    facts = {n: (quant.FORMAT_SPECS[n].block_size, quant.FORMAT_SPECS[n].pow2_scales) for n in GROUP_FORMATS}
    assert facts == {
        "fp8_per_group": (128, False),
        "fp8_per_group_64": (64, False),
        "fp8_per_group_ue8m0": (128, True),
        "fp8_per_group_64_ue8m0": (64, True),
    }
    for n in GROUP_FORMATS:
        layouts = ("linear", "column_major", "column_major_tma")
        assert quant.FORMAT_SPECS[n].layouts == (*layouts, "packed_ue8m0") if n in POW2 else layouts


def test_a_group_of_max_448_has_scale_one_and_its_own_codes():
    y = torch.linspace(-448, 448, 128).reshape(1, 128)
    q = quant.quantize(y, "fp8_per_group")
    assert q.scale.tolist() == [[1.0]]
    assert torch.equal(q.data.view(torch.uint8), e4m3_encode(y))


def test_hand_checked_scale_and_codes():
    # amax 3 -> s = fp32(3 * fp32(1/448)); 3 / s and 1.5 / s round to 448 and 224.
    y = torch.zeros(1, 64)
    y[0, 0], y[0, 1] = 3.0, 1.5
    q = quant.quantize(y, "fp8_per_group_64")
    assert q.scale.item() == (torch.tensor(3.0) * F32_RCP_448).item()
    assert q.data.float()[0, :2].tolist() == [448.0, 224.0]
    # UE8M0: 3 / 448 = 0.0066964... rounds up to 2**-7 = 0.0078125; 3 / 2**-7 = 384, 1.5 -> 192.
    q = quant.quantize(y, "fp8_per_group_64_ue8m0")
    assert q.scale.item() == 2.0**-7
    assert q.data.float()[0, :2].tolist() == [384.0, 192.0]


@pytest.mark.parametrize("fmt", GROUP_FORMATS)
def test_a_zero_group_gets_the_floor_and_zero_codes(fmt):
    spec = quant.FORMAT_SPECS[fmt]
    y = torch.zeros(2, 2 * spec.block_size, dtype=torch.bfloat16)
    y[1, spec.block_size :] = -0.0
    q = quant.quantize(y, fmt)
    floor = torch.tensor(EPS) * F32_RCP_448
    expect = pow2_round_up(floor) if spec.pow2_scales else floor
    assert torch.equal(bits(q.scale), bits(expect.expand(2, 2)))
    assert not torch.isnan(q.scale).any()
    assert (
        q.data.view(torch.uint8)[0].eq(0).all()
        and q.data.view(torch.uint8)[1, spec.block_size :].eq(0x80).all()
    )
    if not spec.pow2_scales:
        assert math.isclose(q.scale[0, 0].item(), 1e-10 / 448, rel_tol=1e-6)


@pytest.mark.parametrize("fmt", GROUP_FORMATS)
def test_inf_and_nan_inputs(fmt):
    g = quant.FORMAT_SPECS[fmt].block_size
    y = torch.ones(3, g)
    y[0, 0] = float("inf")
    y[1, 1] = float("nan")
    y[2, 2] = -1e30  # saturation: the scale follows the amax, nothing above 448
    y = torch.cat([y, torch.full((1, g), float("nan"))])
    q = quant.quantize(y, fmt)
    codes = q.data.view(torch.uint8)
    # inf: the scale is inf, finite values divide to zero, inf / inf is a NaN quotient: -448.
    assert q.scale[0].item() == math.inf and codes[0, 0] == 0xFE and codes[0, 1:].eq(0).all()
    # NaN: left out of the maximum (the others' scale); its own code is -448.
    assert q.scale[1].item() == quant.quantize(torch.ones(1, g), fmt).scale.item()
    assert codes[1, 1] == 0xFE and codes[1, 0] == codes[1, 2] != 0xFE
    # Every value NaN: the zero group's floor, every code -448.
    assert q.scale[3].item() == quant.quantize(torch.zeros(1, g), fmt).scale.item()
    assert codes[3].eq(0xFE).all()
    top = q.data.float()[2].abs().max().item()
    assert top == 448.0 if not quant.FORMAT_SPECS[fmt].pow2_scales else 256 < top <= 448


@pytest.mark.parametrize("fmt", GROUP_FORMATS)
@pytest.mark.parametrize("t", [1, 3, 4, 5])
def test_every_layout_holds_the_same_scales(fmt, t):
    spec = quant.FORMAT_SPECS[fmt]
    h = 3 * spec.block_size  # three groups: the packed layout pads one int32 with a zero byte
    y = torch.randn(t, h, generator=torch.Generator().manual_seed(t)) * 4
    linear = quant.quantize(y, fmt)
    for layout in spec.layouts:
        q = quant.quantize(y, fmt, layout=layout)
        assert torch.equal(q.data.view(torch.uint8), linear.data.view(torch.uint8))
        assert tuple(q.scale.shape) == spec.scale_shape(t, h, layout) and q.scale.is_contiguous()
        assert q.scale.dtype == getattr(torch, spec.scale_dtype_in(layout))
        assert torch.equal(bits(from_group_layout(q.scale, layout, t, 3)), bits(linear.scale))
        assert torch.equal(quant.dequantize(q), quant.dequantize(linear))
        if layout == "column_major":
            assert torch.equal(q.scale.t(), linear.scale)
        if layout == "column_major_tma":
            assert q.scale.shape[1] == -(-t // 4) * 4 and q.scale[:, t:].eq(0).all()
        if layout == "packed_ue8m0":
            raw = q.scale.view(torch.uint8).view(1, -1, 4)
            exps = (linear.scale.view(torch.int32) >> 23) & 0xFF
            assert raw[0, :t, :3].tolist() == exps.tolist()
            assert raw[0, :, 3].eq(0).all() and raw[0, t:].eq(0).all()


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=0, max_value=2.0**127, allow_subnormal=True, width=32))
def test_pow2_round_up_is_the_smallest_power_of_two_not_below(x):
    s = torch.tensor([x], dtype=torch.float32)
    p = pow2_round_up(s).item()
    if x == 0:
        assert p == 0
        return
    assert p >= x
    m, _ = math.frexp(p)
    assert m == 0.5 or math.isinf(p)  # a power of two
    assert p / 2 < x or p == 2.0**-126  # the smallest such: half of it is below x


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(GROUP_FORMATS))
def test_codes_never_exceed_448_and_decode_within_half_a_step(seed, fmt):
    spec = quant.FORMAT_SPECS[fmt]
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(2, 2 * spec.block_size, generator=g) * torch.rand(1, generator=g) * 1000).bfloat16()
    q = quant.quantize(y, fmt)
    scales = q.scale.repeat_interleave(spec.block_size, dim=1)
    assert (y.float() / scales).abs().max() <= 448 * (1 + 2**-20)
    err = (quant.dequantize(q) - y.float()).abs()
    # Half an e4m3 step: 2**-4 relative (3 mantissa bits), 2**-10 of the scale among subnormals.
    assert (err <= y.float().abs() * 2**-4 + scales * 2**-10).all()
    if spec.pow2_scales:
        m = torch.frexp(q.scale).mantissa
        assert m.eq(0.5).all()


def test_a_hidden_size_the_group_does_not_divide_is_refused_naming_it():
    with pytest.raises(
        arnorm.InvalidInputError, match=r"^hidden_size: 192 \(needs a multiple of 128 for fp8"
    ):
        quant.quantize(torch.ones(1, 192), "fp8_per_group")
    with pytest.raises(arnorm.InvalidInputError, match=r"hidden_size: 96 \(needs a multiple of 64 for fp8"):
        arnorm.AllReduceNorm(
            arnorm.LOCAL,
            hidden_size=96,
            dtype=torch.bfloat16,
            norm=arnorm.RMSNorm(1e-6),
            quant="fp8_per_group_64",
        )


def test_a_layout_of_another_format_is_refused_naming_it():
    with pytest.raises(
        arnorm.InvalidInputError, match=r"^layout: 'packed_ue8m0' \(needs linear or column_major"
    ):
        quant.quantize(torch.ones(1, 128), "fp8_per_group", layout="packed_ue8m0")
    with pytest.raises(arnorm.InvalidInputError, match=r"^layout: 'column_major' \(needs linear or swizzled"):
        quant.quantize(torch.ones(1, 32), "mxfp8", layout="column_major")


def _op(fmt, layout):
    return arnorm.AllReduceNorm(
        arnorm.LOCAL,
        hidden_size=256,
        dtype=torch.bfloat16,
        norm=arnorm.RMSNorm(1e-6),
        quant=fmt,
        scale_layout=layout,
        backend="reference",
        max_tokens=8,
    )


def _inputs(t):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(t, 256, generator=g).bfloat16(), torch.randn(t, 256, generator=g).bfloat16(),
            torch.randn(256, generator=g).bfloat16())  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "layout"), [("fp8_per_group", "column_major_tma"), ("fp8_per_group_ue8m0", "packed_ue8m0")]
)
def test_out_scale_buffers_with_vllm_strides_are_refused_naming_the_argument(fmt, layout):
    op = _op(fmt, layout)
    x, r, w = _inputs(5)
    out = op.empty_output(5)
    assert tuple(out.quant.scale.shape) == (2 if fmt == "fp8_per_group" else 1, 8)
    got = op(x.clone(), r.clone(), w, out=out)
    assert got.quant.scale.data_ptr() == out.quant.scale.data_ptr()
    # vLLM's own tensor for the same bytes: [T, C] with strides (1, round_up(T, 4)).
    strided = out.quant.scale.t()[:5]
    bad = out._replace(quant=out.quant._replace(scale=strided))
    with pytest.raises(
        arnorm.InvalidInputError, match=r"^out\.quant\.scale: shape \[5, \d\] \(needs \[\d, 8\] for 5"
    ):
        op(x.clone(), r.clone(), w, out=bad)
    # Right shape, wrong strides: every other column of a wider buffer.
    wrong = torch.zeros(out.quant.scale.shape[0], 16, dtype=out.quant.scale.dtype)[:, ::2]
    bad = out._replace(quant=out.quant._replace(scale=wrong))
    with pytest.raises(arnorm.InvalidInputError, match=r"^out\.quant\.scale: non-contiguous, strides"):
        op(x.clone(), r.clone(), w, out=bad)
    op.close()


@pytest.mark.parametrize("fmt", [*GROUP_FORMATS, "mxfp4"])
def test_the_op_returns_the_codec_bit_for_bit(fmt):
    for layout in quant.FORMAT_SPECS[fmt].layouts:
        op = _op(fmt, layout)
        x, r, w = _inputs(3)
        out = op(x.clone(), r.clone(), w)
        expect = quant.quantize(out.normed, fmt, layout=layout)
        assert torch.equal(bits(out.quant.data), bits(expect.data))
        assert torch.equal(bits(out.quant.scale), bits(expect.scale))
        empty = op.empty_output(3)
        assert (
            empty.quant.scale.shape == out.quant.scale.shape
            and empty.quant.scale.dtype == out.quant.scale.dtype
        )
        op.close()


def test_explain_says_why_each_backend_serves_the_formats_or_not():
    """A backend that does not declare a format is told so in the one grammar; triton serves it."""
    for fmt in ("fp8_per_group", "mxfp4"):
        op = arnorm.AllReduceNorm(
            arnorm.LOCAL,
            hidden_size=256,
            dtype=torch.bfloat16,
            norm=arnorm.RMSNorm(1e-6),
            quant=fmt,
            max_tokens=4,
        )
        text = str(op.explain())
        op.close()
        if "example" in {b.name for b in arnorm.backends()}:  # the example plugin declares fp8 only
            assert f"quant: {fmt} (needs fp8_per_token, fp8_static or none)" in text
        assert re.search(r"^triton\s+100\s+selected", text, re.M)


@pytest.mark.parametrize("fmt", POW2)
def test_ue8m0_scales_stay_finite_up_to_fp32_max_and_inf_is_byte_255(fmt):
    """UE8M0 overflow: the largest finite group maximum (fp32 max) rounds its scale up to 2^120, a
    finite power of two (an exponent byte of 247); only an infinite maximum gives scale inf, byte
    255 in the packed layout (which decodes to NaN, as E8M0's 0xFF does). Never a scale of 0 or NaN."""
    g = quant.FORMAT_SPECS[fmt].block_size
    top = torch.finfo(torch.float32).max
    y = torch.ones(3, 4 * g)
    y[0, 1] = top
    y[1, 2] = -top
    y[2, 3] = float("inf")
    q = quant.quantize(y, fmt)
    assert q.scale[0, 0].item() == q.scale[1, 0].item() == 2.0**120
    assert q.scale[2, 0].item() == math.inf
    assert q.scale[:, 1:].eq(quant.quantize(torch.ones(1, g), fmt).scale.item()).all()
    # fp32 max / 2^120 is just under 256, which e4m3 rounds to: the round-up leaves headroom.
    assert q.data.float()[0, 1].item() == 256.0 and q.data.float()[1, 2].item() == -256.0
    packed = quant.quantize(y, fmt, layout="packed_ue8m0").scale.view(torch.uint8).view(-1, 4)
    assert packed[:3, 0].tolist() == [247, 247, 255]
    decoded = quant.dequantize(quant.quantize(y, fmt, layout="packed_ue8m0"))
    # 256 * 2^120 is 2^128: the decode's one fp32 product overflows to +-inf there, never NaN.
    assert decoded[0, 1].item() == math.inf and decoded[1, 2].item() == -math.inf
    assert not torch.isnan(decoded[:2]).any() and torch.isnan(decoded[2, :g]).all()
