"""The reference math against an independent float64 computation of the contract."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from arnorm import plugin
from arnorm._reference import add_rmsnorm, rank_order_sum
from arnorm.testing import ulp_distance as ulp_diff

DTYPES = [getattr(torch, d) for d in plugin.DTYPES]


def float64_contract(parts, residual, weight, eps, offset):
    """Steps 1-3 in float64, rounding to D exactly where the contract rounds."""
    d = parts[0].dtype
    s = sum(p.double() for p in parts).to(d)
    h = (s.double() + residual.double()).to(d)
    hd = h.double()
    y = (hd / torch.sqrt((hd * hd).mean(-1, keepdim=True) + eps) * (weight.double() + offset)).to(d)
    return s, h, y


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 4),
    tokens=st.integers(1, 6),
    hidden=st.sampled_from([8, 64, 256, 1000]),
    dtype=st.sampled_from(DTYPES),
    offset=st.sampled_from([0.0, 1.0]),
    eps=st.sampled_from([1e-6, 1e-5]),
    magnitude=st.sampled_from([1e-3, 1.0, 100.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_float64_contract(world, tokens, hidden, dtype, offset, eps, magnitude, seed):
    """Residual is bitwise the float64 contract where the fp32 sum is exact; normed within 1 ulp of D."""
    g = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(tokens, hidden, generator=g) * magnitude).to(dtype) for _ in range(world)]
    residual = (torch.randn(tokens, hidden, generator=g) * magnitude).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.2).to(dtype)
    s64, h64, _ = float64_contract(parts, residual, weight, eps, offset)
    s = rank_order_sum(parts)
    h, y = add_rmsnorm(s, residual, weight, eps, offset)
    if dtype is not torch.float32:
        # bf16/fp16 partials sum exactly in fp32 for up to 4 ranks at these magnitudes.
        assert torch.equal(s, s64) and torch.equal(h, h64)
    else:
        acc = parts[0].numpy().astype(np.float32)
        for p in parts[1:]:
            acc = (acc + p.numpy()).astype(np.float32)
        assert np.array_equal(s.numpy(), acc)  # fp32 partials: the rank-order fp32 sum, bit for bit
    h_ref, y_ref = float64_contract([s], residual, weight, eps, offset)[1:]
    assert torch.equal(h, h_ref)
    # In fp32 the computation has D's own precision (rsqrt, mean, two products each round), so
    # the exact value is a few fp32 ulps away; bf16/fp16 outputs absorb that into one ulp.
    assert ulp_diff(y, y_ref) <= (1 if dtype is not torch.float32 else 4)


def test_rank_order_sum_rounds_once():
    """Three bf16 partials are summed in fp32 then rounded once, not rounded per step."""
    a = torch.tensor([1.0], dtype=torch.bfloat16)
    tiny = torch.tensor([2.0**-8], dtype=torch.bfloat16)  # half an ulp of 1.0 in bf16: a tie, to even
    assert rank_order_sum([a, tiny, tiny]).item() == 1.0078125  # 1 + 2**-7: both halves survive in fp32
    assert ((a + tiny) + tiny).item() == 1.0  # per-step bf16 rounding loses both


def test_ulp_helper_counts_neighbours():
    """The ulp helper sees adjacent representable values as 1 apart, across zero too."""
    x = torch.tensor([1.0, -0.0], dtype=torch.bfloat16)
    up = torch.tensor([1.0078125, 0.0], dtype=torch.bfloat16)
    assert ulp_diff(x, up) == 1 and ulp_diff(x, x) == 0
    assert ulp_diff(torch.tensor([-1e-40]), torch.tensor([1e-40])) > 1


def _vllm_033_fused_add_rms_norm(x, residual, weight, eps, offset):
    """vLLM 0.33's ``ir.ops.fused_add_rms_norm`` (GemmaRMSNorm passes ``weight.float() + 1``), as the
    release's docs describe it: fp32 add, residual rounded, the statistic over the fp32 sum."""
    s32 = x.float() + residual.float()
    w = weight.float() + offset
    y = s32 * torch.rsqrt(s32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y.to(w.dtype) * w).to(x.dtype), s32.to(x.dtype)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 8),
    hidden=st.sampled_from([64, 256, 1000]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_normalize_unrounded_is_vllm_033_arithmetic(tokens, hidden, dtype, seed):
    """normalize_unrounded=True: residual the rounded sum, normed read from the fp32 sum; bitwise
    equal to vLLM 0.33's eager Gemma norm, and (on most draws) not to the rounded-sum arithmetic."""
    g = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(2))
    w = (torch.randn(hidden, generator=g) * 0.1).to(dtype)
    h, y = add_rmsnorm(x, res, w, 1e-6, 1.0, normalize_unrounded=True)
    y_vllm, h_vllm = _vllm_033_fused_add_rms_norm(x, res, w, 1e-6, 1.0)
    assert torch.equal(h, h_vllm) and torch.equal(y, y_vllm)
    h_rounded, _ = add_rmsnorm(x, res, w, 1e-6, 1.0)
    assert torch.equal(h, h_rounded)


def test_normalize_unrounded_without_residual_is_the_default():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(128, generator=g).to(torch.bfloat16)
    assert torch.equal(
        add_rmsnorm(x, None, w, 1e-6, 0.0, True, True)[1], add_rmsnorm(x, None, w, 1e-6, 0.0, True)[1]
    )


def test_rmsnorm_normalize_unrounded_is_validated():
    import pytest

    import arnorm

    with pytest.raises(arnorm.InvalidInputError, match=r"normalize_unrounded: 1 \(needs True or False\)"):
        arnorm.RMSNorm(1e-6, 1.0, False, 1)  # type: ignore[arg-type]
    assert arnorm.RMSNorm(1e-6, 1.0, normalize_unrounded=True).normalize_unrounded
