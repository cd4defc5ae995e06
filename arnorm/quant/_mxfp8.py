"""mxfp8: e4m3fn codes ``[T, H]`` and one E8M0 (power-of-two) scale per 32 elements.

Per block of 32:

1. ``amax32 = max |y|`` (exact in fp32; NaN if the block holds one);
2. ``e = ue8m0_round_up(amax32 * fp32(1/448))``: the smallest E8M0 value ``2**(e-127) >= p`` of the
   fp32 product ``p``; ``p <= 2**-127`` (an all-zero block included) gives ``e = 0``; saturated at
   254 (reached only by an infinite amax); a NaN block gets the E8M0 NaN code 255;
3. ``q = satfinite_rn(fp32(y) * 2**(127 - e))``: the multiplier is exact (it is 2**127 for
   ``e = 0``, not flushed to zero) and NaN for ``e = 255``, so a NaN block is all NaN codes.

Decoding is ``fp32(q) * 2**(e - 127)`` (exact).
"""

from __future__ import annotations

import torch

from arnorm.quant._codecs import (
    F32_RCP_448,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    pow2_neg_e8m0,
    ue8m0_round_up,
)
from arnorm.quant._layout import from_layout, to_layout

__all__ = ["BLOCK", "dequantize_mxfp8", "quantize_mxfp8"]

BLOCK = 32


def quantize_mxfp8(y: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``float8_e4m3fn [T, H]`` and biased E8M0 exponents (``uint8``) in ``layout``."""
    rows, hidden = y.shape
    blocks = y.float().reshape(rows, hidden // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    e = ue8m0_round_up(amax * F32_RCP_448)
    codes = e4m3_encode(blocks * pow2_neg_e8m0(e).unsqueeze(-1)).reshape(rows, hidden)
    return codes.view(torch.float8_e4m3fn), to_layout(e.to(torch.uint8), layout)


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, layout: str | None) -> torch.Tensor:
    """``fp32(q) * 2**(e - 127)`` as fp32 ``[T, H]``."""
    rows, hidden = data.shape
    scale = e8m0_decode(from_layout(scales, layout, rows, hidden // BLOCK))
    values = e4m3_decode(data).reshape(rows, hidden // BLOCK, BLOCK)
    return (values * scale.unsqueeze(-1)).reshape(rows, hidden)
