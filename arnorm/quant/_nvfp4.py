"""nvfp4: e2m1 codes, two per byte (even element in the low nibble), an e4m3 scale per 16 elements.

Per block of 16 with ``S`` the fp32 global encode scale (``448 * 6 / amax`` by convention):

1. ``amax16 = max |y|`` (exact in fp32; NaN if the block holds one);
2. ``SF = e4m3_rn_sat(S * (amax16 * fp32(1/6)))``: two fp32 products, rounded in that order;
3. ``q = e2m1_rn_sat(fp32(y) * (S / fp32(SF)))``: one IEEE fp32 division per block and one
   product per element; the multiplier is 0 where ``SF == 0``, so such blocks hold signed zeros.

Decoding is ``e2m1(q) * fp32(SF) / S`` (the product is exact, the division rounds once).
"""

from __future__ import annotations

import torch

from arnorm.quant._codecs import F32_RCP_6, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode
from arnorm.quant._layout import from_layout, to_layout

__all__ = ["BLOCK", "dequantize_nvfp4", "quantize_nvfp4"]

BLOCK = 16


def quantize_nvfp4(
    y: torch.Tensor, global_scale: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes ``uint8 [T, H/2]`` and e4m3 block scales (``float8_e4m3fn``) in ``layout``."""
    rows, hidden = y.shape
    blocks = y.float().reshape(rows, hidden // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    sf_code = e4m3_encode(global_scale * (amax * F32_RCP_6))
    sf = e4m3_decode(sf_code)
    multiplier = torch.where(sf == 0, 0.0, global_scale / sf)
    codes = e2m1_encode(blocks * multiplier.unsqueeze(-1)).reshape(rows, hidden)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, to_layout(sf_code.view(torch.float8_e4m3fn), layout)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [T, H/2]`` -> codes ``uint8 [T, H]`` (low nibble first)."""
    rows, half = packed.shape
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, 2 * half)


def dequantize_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, layout: str | None
) -> torch.Tensor:
    """``e2m1(q) * fp32(SF) / S`` as fp32 ``[T, H]``."""
    rows, hidden = packed.shape[0], packed.shape[1] * 2
    values = e2m1_decode(unpack_e2m1(packed)).reshape(rows, hidden // BLOCK, BLOCK)
    sf = e4m3_decode(from_layout(scales, layout, rows, hidden // BLOCK))
    return (values * sf.unsqueeze(-1) / global_scale).reshape(rows, hidden)
