"""arnorm's conformance suite on the triton backend (through AllReduceNorm, gloo ranks on CPU)."""

from __future__ import annotations

import torch

from arnorm.testing import ConformanceSuite


class TestTritonConformance(ConformanceSuite):
    """Every declared dtype and format at TP 1 and 2 (TP 1 only on a GPU host, where two gloo ranks
    would share one GPU); shapes kept small for the Triton interpreter. bf16/fp16 normed outputs are
    held to 1 ulp, fp32 to the suite's ``normed_ulps_fp32``.
    """

    backend = "triton"
    world_sizes = (1,) if torch.cuda.is_available() else (1, 2)
    shapes = ((1, 256), (7, 512))
