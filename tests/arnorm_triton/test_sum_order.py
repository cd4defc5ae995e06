"""The order of the statistic's sum (arnorm_triton/_sum_order.py): on the CPU, torch's own.

Under the interpreter the fused kernel sums a row's squares in ATen's CPU order, so its normed
output is bitwise the torch-native norm's (arnorm's reference, vLLM's ``GemmaRMSNorm``); compiled,
it sums in a tree. These tests pin the order three ways: the written-down order against torch's sum,
the kernel's order against the written-down one (both lane counts), and the kernel's normed output
against torch-native norms in fp16, where a different order shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_cases import make_backend, make_problem

from arnorm.plugin import add_rmsnorm
from arnorm_triton import _kernels
from arnorm_triton._sum_order import aten_row_sum, aten_sum, torch_sum_lanes

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU order: interpreter only")

#: Lengths that reach every branch of aten_sum for 8 and 16 lanes: shorter than a vector (with and
#: without a row of four), no group, fewer than 16 rows of groups, open and closed chunks, 16 chunks
#: and more, leftover vectors, a scalar tail.
HIDDENS = [1, 3, 4, 5, 7, 8, 13, 15, 16, 31, 32, 33, 100, 255, 256, 1000, 1024, 2056, 4100, 8192, 8216, 16416]


def _squares(n: int, seed: int) -> np.ndarray:
    """fp32 squares of fp16 values of many magnitudes: sums that depend on the order."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-8, 8, n))).astype(np.float16).astype(np.float32)
    return x * x


def test_the_lanes_of_torchs_sum_are_known_here():
    """CI's CPU runs torch's sum with 8 or 16 lanes; 0 would mean the interpreted kernel is not
    bitwise with torch-native norms on this machine (then say so in docs/numerics.md)."""
    assert torch_sum_lanes() in (8, 16)
    assert torch_sum_lanes() == _kernels._SUM_LANES


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20000), seed=st.integers(0, 2**16))
def test_the_written_order_is_torchs(n, seed):
    """aten_row_sum reproduces torch's CPU sum bit for bit (one row, and a row among others)."""
    q = _squares(n, seed)
    lanes = torch_sum_lanes()
    assert aten_row_sum(q, lanes) == torch.from_numpy(q).sum().item()
    rows = torch.from_numpy(np.stack([q, q[::-1].copy()]))
    assert aten_row_sum(q, lanes) == rows.sum(dim=-1)[0].item()


@pytest.mark.parametrize("n", range(1, 41))
def test_short_rows_are_summed_in_torchs_order(n):
    """Rows up to a few vectors long, every length: shorter than one vector, ATen takes its scalar
    path (CI found n=5 summed in the vector path's order, 2026-12-07)."""
    for seed in range(20):
        q = _squares(n, seed)
        assert aten_row_sum(q, torch_sum_lanes()) == torch.from_numpy(q).sum().item(), seed


@triton.jit
def _sum_kernel(x_ptr, out_ptr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < HIDDEN, other=0.0)
    tl.store(out_ptr, aten_sum(x, HIDDEN, BLOCK, LANES))


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("hidden", HIDDENS)
def test_the_kernels_order_is_the_written_one(hidden, lanes):
    """aten_sum (the kernel's) equals aten_row_sum (the written order) for either lane count; the
    block is padded as the fused kernel pads it (at least 64)."""
    q = _squares(hidden, hidden)
    out = torch.zeros(1)
    block = max(triton.next_power_of_2(hidden), 64)
    _sum_kernel[(1,)](torch.from_numpy(q), out, hidden, block, lanes)
    assert out.item() == aten_row_sum(q, lanes)


def test_rows_too_long_for_the_written_cascade_are_refused():
    with pytest.raises(ValueError, match=r"values: 131072 elements \(needs fewer than 131072 for 8 lanes\)"):
        aten_row_sum(np.zeros(131072, np.float32), 8)


@pytest.mark.parametrize("unrounded", [False, True], ids=["rounded", "unrounded"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["plain", "gemma"])
@pytest.mark.parametrize(("t", "hidden"), [(64, 256), (16, 1024), (3, 1000), (64, 5), (40, 12)])
def test_fp16_normed_is_torch_natives(t, hidden, offset, unrounded):
    """The fused kernel's fp16 normed output and residual, bitwise torch's: arnorm's reference and
    vLLM 0.33's ``fused_add_rms_norm`` arithmetic (fp32 ``x + res``, ``x.pow(2).mean(-1)``,
    ``rsqrt``, ``* (w + offset)``, one rounding). With the tree order about 1 value in 10^4 differs."""
    torch.manual_seed(hidden + t)
    s = torch.randn(t, hidden).mul(3).half()
    res = torch.randn(t, hidden).half()
    weight = torch.randn(hidden).mul(0.5).half()
    backend = make_backend(make_problem(hidden, torch.float16, None, None, weight_offset=offset,
                                        normalize_unrounded=unrounded, inplace=False))  # fmt: skip
    out = backend(s.clone(), res, weight, None)
    h, y = add_rmsnorm(s, res, weight, 1e-6, offset, normalize_unrounded=unrounded)
    assert torch.equal(out.residual, h)
    assert torch.equal(out.normed, y)
    if unrounded:  # vLLM's own expression, written out
        u = s.float() + res.float()
        inv_rms = torch.rsqrt(u.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        vllm = (u * inv_rms * (weight.float() + offset)).half()
        assert torch.equal(out.normed, vllm)
