"""arnorm.testing._compare: the distances and descriptions conformance failures are made of."""

from __future__ import annotations

import pytest
import torch

from arnorm.testing._compare import (
    compare,
    compare_codes,
    first_difference,
    nearest_two_rounding_normed,
    ulp_distance,
)


def test_equal_tensors_have_no_mismatch():
    """Bitwise-equal tensors, NaNs included, compare as equal."""
    x = torch.tensor([[1.0, float("nan")], [-0.0, 3.0]], dtype=torch.bfloat16)
    assert compare(x, x.clone()) is None and first_difference(x, x.clone()) == ""


def test_zero_signs_coincide_and_neighbours_across_zero_are_one_apart():
    """+0 and -0 are 0 ulp apart; the smallest subnormals on either side of zero are 2 apart."""
    zeros = torch.tensor([0.0, -0.0], dtype=torch.float16)
    assert ulp_distance(zeros[:1], zeros[1:]) == 0
    tiny = torch.tensor([2**-24, -(2**-24)], dtype=torch.float16)
    assert ulp_distance(tiny[:1], tiny[1:]) == 2


@pytest.mark.parametrize("index", range(8))
@pytest.mark.parametrize("steps", [1, 2, 17, 300])
def test_mismatch_names_the_worst_element_with_values_and_abs_error(index, steps):
    """The described element is the one furthest off in ulps, with its values and absolute error."""
    expected = torch.linspace(0.5, 1.5, 8).to(torch.bfloat16)
    got = expected.clone()
    got.view(torch.int16)[index] += steps  # positive values: the bit pattern counts ulps
    m = compare(got, expected)
    assert m is not None and (m.max_ulps, m.index, m.count) == (steps, (index,), 1)
    assert m.got == float(got[index]) and m.expected == float(expected[index])
    text = m.describe("normed", "1 ulp")
    assert f"normed: {steps} ulp off at [{index}]" in text and "|err| " in text and "allowed 1 ulp" in text


def test_nvfp4_codes_are_compared_per_nibble_in_code_steps():
    """Packed e2m1 bytes are unpacked (low nibble first); a sign flip of 1.0 is 4 steps (2 per side)."""
    want = torch.tensor([[0x21, 0x00]], dtype=torch.uint8)  # codes 1 (0.5), 2 (1.0), 0, 0
    got = torch.tensor([[0xA1, 0x00]], dtype=torch.uint8)  # code 2 becomes 0xA (-1.0)
    m = compare_codes(got, want, packed_fp4=True)
    assert m is not None and (m.count, m.total, m.index, m.max_steps) == (1, 4, (0, 1), 4)
    assert "got code 0x0a, expected 0x02" in m.describe("quant codes")


def test_first_difference_reports_shape_or_the_first_differing_element():
    """Scales of another shape say so; equal shapes name the first element that differs."""
    a = torch.tensor([[1.0], [2.0], [3.0]])
    b = torch.tensor([[1.0], [2.5], [4.0]])
    assert first_difference(a, b) == "2 of 3 elements differ, the first at [1, 0] (got 2, expected 2.5)"
    assert "shape/dtype [3, 1] float32 (expected [2] float32)" in first_difference(a, torch.zeros(2))


def _two_rounding(h: torch.Tensor, w: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
    return ((h.float() * inv_rms).to(h.dtype).float() * w).to(h.dtype)


def test_two_rounding_normed_allows_a_neighbouring_intermediate():
    """round_before_weight: an rsqrt slightly off flips D(x * rsqrt) to a neighbour for some elements,
    which the weight multiply turns into 2+ ulps of y (an H200 mxfp8 test failed so); judged against
    the nearest candidate such a kernel is exact, the reference is its own nearest, and a wrong
    value is still caught."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    weight = (torch.rand(512, generator=g) * 3).to(torch.bfloat16)
    hf = h.float()
    inv = torch.rsqrt(hf.square().mean(-1, keepdim=True) + 1e-6)
    w = weight.float() + 1.0
    exact = _two_rounding(h, w, inv)
    off = _two_rounding(h, w, inv * (1 + 2**-14))
    assert ulp_distance(off, exact) >= 2  # the plain 1-ulp check would fail this correct kernel
    assert ulp_distance(off, nearest_two_rounding_normed(off, h, weight, 1e-6, 1.0)) == 0
    assert torch.equal(nearest_two_rounding_normed(exact, h, weight, 1e-6, 1.0), exact)
    wrong = exact.clone()
    wrong[0, 0] = -wrong[0, 0] + 1.0
    assert ulp_distance(wrong, nearest_two_rounding_normed(wrong, h, weight, 1e-6, 1.0)) > 1
