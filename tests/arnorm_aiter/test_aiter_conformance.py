"""arnorm's conformance suite on the aiter backend (needs ROCm and AITER; skips elsewhere)."""

from __future__ import annotations

from arnorm.testing import ConformanceSuite


class TestAiterConformance(ConformanceSuite):
    """Declared dtypes and formats at TP 2 and 4, held to AITER's documented deviation (docs/aiter.md).

    The 1-stage kernel normalizes the unrounded sum (normed up to 2 ulp off) and takes the per-token
    fp8 amax over fp32 values (scales not bitwise, codes up to one step off): the per-element bounds
    are checked by arnorm_aiter._numerics; here the codes' fraction is left open.
    """

    backend = "aiter"
    world_sizes = (2, 4)
    normed_ulps = 2
    quant_mismatch = 1.0
    quant_max_code_diff = 1
    quant_scales_exact = False
