"""triton_symm's all-reduce epilogue with the per-group fp8 formats and mxfp4, on emulated ranks (the
Triton interpreter on CPU): every scale layout at 2 ranks, the three protocols at 4; codes and scales
bitwise ``quantize`` of the kernel's own normed output, every rank identical, sums the reference's."""

from __future__ import annotations

import pytest
import torch
from test_symm_kernel import DEVICE, KINDS, H, _check_all_ranks, _inputs
from triton_cases import make_problem

from arnorm import quant as Q
from arnorm.plugin import RMSNorm
from arnorm_triton.symm._emulation import emulate_call

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

GROUP_FORMATS = [n for n, s in Q.FORMAT_SPECS.items() if s.block_size and s.scale_dtype == "float32"]
VARIANTS = [(f, layout) for f in [*GROUP_FORMATS, "mxfp4"] for layout in Q.FORMAT_SPECS[f].layouts]


def _run(quant, layout, world, kind, t=9):
    parts, res, w = _inputs(world, t, offset=1.0, seed=world)
    problem = make_problem(
        H, torch.bfloat16, quant, layout, weight_offset=1.0, world_size=world, device=DEVICE
    )
    outs, _ = emulate_call(parts, res, w, None, norm=RMSNorm(weight_offset=1.0), quant=quant, layout=layout,
                           slots=4, **KINDS[kind])  # fmt: skip
    _check_all_ranks(outs, parts, res, w, problem, None)


@pytest.mark.parametrize(("quant", "layout"), VARIANTS, ids=[f"{f}-{lay}" for f, lay in VARIANTS])
def test_every_group_layout_at_two_ranks(quant, layout):
    _run(quant, layout, 2, "one_shot")


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    ("quant", "layout"),
    [
        ("fp8_per_group_ue8m0", "packed_ue8m0"),
        ("fp8_per_group_64", "column_major_tma"),
        ("mxfp4", "swizzled_128x4"),
    ],
)
def test_four_ranks_every_protocol(quant, layout, kind):
    _run(quant, layout, 4, kind, t=6)
