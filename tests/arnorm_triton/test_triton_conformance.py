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
    # The interpreter runs every declared format and layout: two gloo ranks take 4-6 minutes on 2 cores.
    timeout = 900.0
    world_sizes = (1,) if torch.cuda.is_available() else (1, 2)
    shapes = ((1, 256), (7, 512))
    # Batch invariance: on a GPU, H 4096 (rows of the measured launch table, whose warp count changes
    # at T 1, 16, 128 and 1024) at every one of those boundaries; on CPU (the interpreter, where warps
    # play no part and every launch is one program per row, whatever T) a row alone, a pair and an odd
    # batch against the rank-order gather. The largest size is the pool of rows each computed alone,
    # so it sets the cost: 7 rows, not 33, cover the same code (a pool of 33 took 4x the time).
    invariance_hidden = 4096 if torch.cuda.is_available() else 256
    invariance_sizes = (1, 2, 7, 16, 17, 128, 129, 1024, 1025) if torch.cuda.is_available() else (1, 2, 7)
