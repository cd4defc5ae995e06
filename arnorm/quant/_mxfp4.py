"""mxfp4: e2m1 codes, two per byte (even element in the low nibble), an E8M0 scale per 32 elements.

Per block of 32 (vLLM's ``mxfp4_quantize``, the OCP rule with the maximum rounded first):

1. ``amax = max |y|`` over the block's values that are not NaN (exact in fp32; NaN if all are);
2. ``r``: ``amax`` rounded to a power of two at its mantissa's second bit
   (``(bits(amax) + 0x200000) & 0x7F800000``: mantissas from 1.75 up go to the next power);
3. the unbiased exponent ``u = clamp(floor(log2 r) - 2, -127, 127)`` (``r = 0`` gives -127,
   ``r = inf`` gives 127; a NaN ``amax`` rounds to ``inf``), the scale byte is ``u + 127``;
4. ``q = e2m1_rn_sat(fp32(y) * 2**-u)``: the multiplier is exact; values from 6 up (inf included)
   give 6, ties go to the even code; a NaN element gives 6 (``0x7``), as vLLM's bit rule reads a
   NaN's all-ones exponent. vLLM keeps the NaN's sign bit there; a NaN's sign is not specified by
   any step before (torch and Triton give different ones), so arnorm gives ``0x7`` whatever it is.

Decoding is ``e2m1(q) * 2**u`` (exact).
"""

from __future__ import annotations

import torch

from arnorm.quant._codecs import e2m1_decode, e2m1_encode, e8m0_decode
from arnorm.quant._layout import from_layout, to_layout
from arnorm.quant._nvfp4 import unpack_e2m1

__all__ = ["BLOCK", "NAN_CODE", "dequantize_mxfp4", "mxfp4_exponents", "nan_free_amax", "quantize_mxfp4"]

BLOCK = 32


#: The code of a NaN element.
NAN_CODE = 0x7


def mxfp4_exponents(amax: torch.Tensor) -> torch.Tensor:
    """The unbiased scale exponent ``u`` (``int32``, -127..127) of each fp32 block maximum."""
    # A NaN whose payload carries past the exponent leaves 0 here, as in vLLM's uint32 arithmetic.
    exp = (((amax.view(torch.int32).to(torch.int64) + 0x200000) & 0x7F800000) >> 23).to(torch.int32)
    return torch.where(exp == 0xFF, 127, (exp - 129).clamp(-127, 127))


def nan_free_amax(blocks: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the last axis, NaN left out; NaN where every value is NaN."""
    a = blocks.abs()
    nan = torch.isnan(a)
    amax = torch.where(nan, 0.0, a).amax(dim=-1)
    return torch.where(nan.all(dim=-1), float("nan"), amax)


def quantize_mxfp4(y: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes ``uint8 [T, H/2]`` and biased E8M0 exponents (``uint8``) in ``layout``."""
    rows, hidden = y.shape
    blocks = y.float().reshape(rows, hidden // BLOCK, BLOCK)
    u = mxfp4_exponents(nan_free_amax(blocks))
    multiplier = ((127 - u) << 23).view(torch.float32)  # 2**-u, a normal number for u <= 126
    multiplier = torch.where(u == 127, 2.0**-127, multiplier)
    scaled = blocks * multiplier.unsqueeze(-1)
    codes = torch.where(torch.isnan(scaled), NAN_CODE, e2m1_encode(scaled)).reshape(rows, hidden)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, to_layout((u + 127).to(torch.uint8), layout)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, layout: str | None) -> torch.Tensor:
    """``e2m1(q) * 2**u`` as fp32 ``[T, H]``."""
    rows, hidden = packed.shape[0], packed.shape[1] * 2
    values = e2m1_decode(unpack_e2m1(packed)).reshape(rows, hidden // BLOCK, BLOCK)
    scale = e8m0_decode(from_layout(scales, layout, rows, hidden // BLOCK))
    return (values * scale.unsqueeze(-1)).reshape(rows, hidden)
