"""The per-token-group fp8 formats: e4m3fn codes ``[T, H]`` and one fp32 scale per token per group.

Per group of ``g`` consecutive elements of a row (``g`` = 128 or 64, the format's block size):

1. ``amax = max |y|`` over the group's values that are not NaN (exact in fp32; 0 if all are NaN);
2. ``s = fp32(max(amax, fp32(1e-10)) * fp32(1/448))``: one fp32 product, so an all-zero group gets
   the floor ``fp32(1e-10) * fp32(1/448)`` and never a zero or NaN scale; an infinite amax gives
   ``s = inf``;
3. UE8M0 formats (``pow2_scales``): ``s`` rounded *up* to a power of two, exactly (a power of two
   stays; ``inf`` stays);
4. ``q = satfinite_rn(fp32(y) / s)``: one IEEE fp32 division per element, saturating to +-448; a
   NaN quotient (a NaN element, or an infinite one over ``s = inf``) gives -448 (``0xFE``).

These are the steps of vLLM's ``per_token_group_quant_fp8(x, g, eps=1e-10, use_ue8m0=)``: its
maximum and its clamp (``fmaxf``/``fminf`` in CUDA, ``nanmax``/``fmax``/``fmin`` in Triton's
interpreter) drop NaN, which is where step 1's rule and step 4's -448 come from.
Decoding is ``fp32(q) * s`` (one fp32 rounding per element).

The scales' layouts (``arnorm/_formats.py`` describes them) are storage only: the values are
the same in each. ``packed_ue8m0`` keeps each scale's biased exponent byte (``inf`` and NaN give
255, which decodes to NaN).
"""

from __future__ import annotations

import torch

from arnorm.quant._codecs import F32_RCP_448, e4m3_decode, e4m3_encode, e8m0_decode, f32_from_bits

__all__ = ["EPS", "NAN_CODE", "dequantize_fp8_group", "pow2_round_up", "quantize_fp8_group", "group_scales"]

#: fp32(1e-10): the floor of a group's amax (vLLM's ``eps``), 0x2EDBE6FF.
EPS = f32_from_bits(0x2EDBE6FF)
#: The code of a NaN quotient: -448, where vLLM's NaN-dropping clamp puts it.
NAN_CODE = 0xFE

_EXP_MASK = 0x7F800000
_MAN_MASK = 0x007FFFFF


def pow2_round_up(s: torch.Tensor) -> torch.Tensor:
    """fp32 ``s >= 0`` -> the smallest power of two ``>= s`` (exact; powers of two, ``inf``, NaN and
    zero unchanged; a value above 2**127 gives ``inf``)."""
    bits = s.view(torch.int32)
    finite_non_pow2 = ((bits & _MAN_MASK) != 0) & ((bits & _EXP_MASK) != _EXP_MASK)
    # Adding the mantissa mask carries into the exponent unless the mantissa is zero; masking the
    # mantissa off then leaves 2**(e + 1). A subnormal gives 2**-126, the smallest normal above it.
    up = (bits + _MAN_MASK) & _EXP_MASK
    return torch.where(finite_non_pow2, up, bits).view(torch.float32)


def group_scales(y32: torch.Tensor, group: int, pow2: bool) -> torch.Tensor:
    """The fp32 scales ``[T, H / group]`` of fp32 ``y32`` (steps 1-3)."""
    rows, hidden = y32.shape
    a = y32.reshape(rows, hidden // group, group).abs()
    amax = torch.where(torch.isnan(a), 0.0, a).amax(dim=-1)
    scale = amax.clamp_min(EPS) * F32_RCP_448
    return pow2_round_up(scale) if pow2 else scale


def _exponent_bytes(scales: torch.Tensor) -> torch.Tensor:
    return ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def to_group_layout(scales: torch.Tensor, layout: str) -> torch.Tensor:
    """Row-major fp32 scales ``[T, C]`` -> their storage in ``layout`` (contiguous, padding zero)."""
    rows, cols = scales.shape
    if layout == "linear":
        return scales
    if layout == "column_major":
        # A fresh tensor, not .contiguous(): at T = 1 the transpose counts as contiguous and keeps a
        # last stride of C, which byte views of it refuse.
        return scales.new_empty((cols, rows)).copy_(scales.t())
    padded_rows = -(-rows // 4) * 4
    if layout == "column_major_tma":
        out = scales.new_zeros((cols, padded_rows))
        out[:, :rows] = scales.t()
        return out
    assert layout == "packed_ue8m0", layout
    packed_cols = -(-cols // 4)
    raw = torch.zeros((packed_cols * 4, padded_rows), dtype=torch.uint8, device=scales.device)
    raw[:cols, :rows] = _exponent_bytes(scales).t()
    # Byte j of the int32 (k, m) is group 4k + j's exponent: little-endian, lowest byte first.
    return raw.view(packed_cols, 4, padded_rows).permute(0, 2, 1).contiguous().view(torch.int32).squeeze(-1)


def from_group_layout(stored: torch.Tensor, layout: str | None, rows: int, cols: int) -> torch.Tensor:
    """Scales stored in ``layout`` -> row-major fp32 ``[rows, cols]`` (packed exponents decoded)."""
    if layout == "linear":
        return stored
    if layout in ("column_major", "column_major_tma"):
        return stored[:, :rows].t()
    assert layout == "packed_ue8m0", layout
    raw = stored.contiguous().view(torch.uint8).view(stored.shape[0], stored.shape[1], 4)
    exponents = raw.permute(0, 2, 1).reshape(stored.shape[0] * 4, stored.shape[1])[:cols, :rows].t()
    return e8m0_decode(exponents)


def quantize_fp8_group(
    y: torch.Tensor, group: int, pow2: bool, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``float8_e4m3fn [T, H]`` and the scales in ``layout``."""
    rows, hidden = y.shape
    y32 = y.float()
    scales = group_scales(y32, group, pow2)
    blocks = y32.reshape(rows, hidden // group, group)
    quotient = (blocks / scales.unsqueeze(-1)).reshape(rows, hidden)
    codes = torch.where(torch.isnan(quotient), NAN_CODE, e4m3_encode(quotient))
    return codes.view(torch.float8_e4m3fn), to_group_layout(scales, layout)


def dequantize_fp8_group(
    data: torch.Tensor, stored: torch.Tensor, group: int, layout: str | None
) -> torch.Tensor:
    """``fp32(q) * s`` as fp32 ``[T, H]``."""
    rows, hidden = data.shape
    scales = from_group_layout(stored, layout, rows, hidden // group)
    values = e4m3_decode(data).reshape(rows, hidden // group, group)
    return (values * scales.unsqueeze(-1)).reshape(rows, hidden)
