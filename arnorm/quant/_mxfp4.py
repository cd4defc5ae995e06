"""mxfp4: e2m1 codes, two per byte (even element in the low nibble), an E8M0 scale per 32 elements.

Per block of 32 (vLLM's ``mxfp4_quantize``, the OCP rule with the maximum rounded first):

1. ``amax = max |y|`` (exact in fp32; NaN if the block holds one);
2. ``r``: ``amax`` rounded to a power of two at its mantissa's second bit
   (``(bits(amax) + 0x200000) & 0xFF800000``: mantissas from 1.75 up go to the next power);
3. the unbiased exponent ``u = clamp(floor(log2 r) - 2, -127, 127)`` (``r = 0`` gives -127,
   ``r = inf`` gives 127; a NaN ``amax`` rounds to ``inf``), the scale byte is ``u + 127``;
4. ``q = e2m1_rn_sat(fp32(y) * 2**-u)``: the multiplier is exact; values from 6 up (inf included)
   give 6, ties go to the even code. A NaN element gives the code the bit rule reads off its
   pattern (3, i.e. 1.5, for the default NaN), kept with its sign, as vLLM's kernel writes it.

Decoding is ``e2m1(q) * 2**u`` (exact).
"""

from __future__ import annotations

import torch

from arnorm.quant._codecs import e2m1_decode, e2m1_encode, e8m0_decode
from arnorm.quant._layout import from_layout, to_layout
from arnorm.quant._nvfp4 import unpack_e2m1

__all__ = ["BLOCK", "dequantize_mxfp4", "mxfp4_exponents", "quantize_mxfp4"]

BLOCK = 32


def mxfp4_exponents(amax: torch.Tensor) -> torch.Tensor:
    """The unbiased scale exponent ``u`` (``int32``, -127..127) of each fp32 block maximum."""
    rounded = ((amax.view(torch.int32).to(torch.int64) + 0x200000) & 0xFF800000) & 0xFFFFFFFF
    exp = (rounded >> 23) & 0xFF
    negative = rounded >= 0x80000000  # a NaN's payload carried into the sign: -0, log2 = -inf
    u = torch.where(exp == 0xFF, 127, (exp - 129).clamp(-127, 127))
    return torch.where(negative | (exp == 0), -127, u).to(torch.int32)


def _nan_codes(x: torch.Tensor) -> torch.Tensor:
    """The code vLLM's bit rule gives a NaN element (its normal-range path applied to the pattern)."""
    a = x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    odd = (a >> 22) & 1
    return (((a + ((1 - 127) << 23) + (1 << 21) - 1 + odd) & 0xFFFFFFFF) >> 22) & 0xFF


def quantize_mxfp4(y: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes ``uint8 [T, H/2]`` and biased E8M0 exponents (``uint8``) in ``layout``."""
    rows, hidden = y.shape
    blocks = y.float().reshape(rows, hidden // BLOCK, BLOCK)
    u = mxfp4_exponents(blocks.abs().amax(dim=-1))
    multiplier = ((127 - u) << 23).view(torch.float32)  # 2**-u, a normal number for |u| <= 126
    multiplier = torch.where(u == 127, 2.0**-127, multiplier)
    scaled = blocks * multiplier.unsqueeze(-1)
    codes = e2m1_encode(scaled).to(torch.int64)
    sign = (scaled.view(torch.int32) < 0).to(torch.int64) << 3
    codes = torch.where(torch.isnan(scaled), _nan_codes(scaled) | sign, codes).reshape(rows, hidden)
    packed = ((codes[:, 0::2] | (codes[:, 1::2] << 4)) & 0xFF).to(torch.uint8)
    return packed, to_layout((u + 127).to(torch.uint8), layout)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, layout: str | None) -> torch.Tensor:
    """``e2m1(q) * 2**u`` as fp32 ``[T, H]``."""
    rows, hidden = packed.shape[0], packed.shape[1] * 2
    values = e2m1_decode(unpack_e2m1(packed)).reshape(rows, hidden // BLOCK, BLOCK)
    scale = e8m0_decode(from_layout(scales, layout, rows, hidden // BLOCK))
    return (values * scale.unsqueeze(-1)).reshape(rows, hidden)
