"""The triton backend on 1, 2 and 4 gloo ranks (CPU, Triton interpreter in every rank).

Normal mode is checked against the contract given what the same gloo all-reduce returns; exact
mode against the reference's fp32 rank-order sum, bitwise. One spawn per world size: process
start-up costs more than the cases.
"""

from __future__ import annotations

import pytest
import torch
import triton_cases
from triton_cases import VARIANTS

from arnorm.testing import run_ranks

pytestmark = pytest.mark.slow

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
INTERPRET = {"TRITON_INTERPRET": "1"}  # the ranks use CPU tensors, also on a machine with a GPU


def _cases(dtypes, tokens=3, hidden=256, inplace=(True, False)):
    """Every format variant once, rotating dtype, norm kind and in-place flag."""
    return [
        (q, layout, dtypes[i % len(dtypes)], float(i % 2), tokens, hidden, inplace[i % len(inplace)])
        for i, (q, layout) in enumerate(VARIANTS)
    ]


def test_one_rank_group_runs_the_kernel_alone():
    """A 1-rank gloo group: AllReduceNorm(backend='triton') meets the contract with no collective."""
    plan = [
        ([(None, None, BF16, 1.0, 4, 512, True), ("fp8_static", None, F16, 0.0, 4, 512, False)], False, True)
    ]
    assert run_ranks(1, triton_cases.rank_plan, plan, env=INTERPRET) == [[]]


def test_two_ranks_every_format_and_exact_mode():
    """2 ranks: all-reduce + kernel for every format; exact mode through AllReduceNorm is bitwise."""
    plan = [
        (_cases([BF16, F16, F32]), False, False),
        ([(None, None, BF16, 1.0, 4, 512, True), ("mxfp8", "linear", F32, 0.0, 2, 256, False)], True, True),
    ]
    assert run_ranks(2, triton_cases.rank_plan, plan, env=INTERPRET) == [[], []]


def test_four_ranks_exact_mode_every_format():
    """4 ranks: exact mode (all-gather + fp32 rank-order sum in the kernel) is bitwise the reference's
    residual for every format; the all-reduce mode through AllReduceNorm meets the contract."""
    plan = [
        (_cases([F32, BF16, F16], tokens=2), True, False),
        ([("fp8_per_token", None, BF16, 1.0, 3, 256, False)], False, True),
    ]
    assert run_ranks(4, triton_cases.rank_plan, plan, env=INTERPRET) == [[], [], [], []]
