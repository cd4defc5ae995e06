"""fp8_static and fp8_per_token: e4m3fn codes ``[T, H]`` with one fp32 scale per tensor or per row.

Both paths are a handful of elementwise kernels and one row reduction: no host sync, CUDA-graph safe.
"""

from __future__ import annotations

import torch

from arnorm.quant._codecs import E4M3_MAX, F32_MIN_TOKEN_SCALE, e4m3_decode, e4m3_encode

__all__ = ["dequantize_fp8", "quantize_fp8_per_token", "quantize_fp8_static"]


def quantize_fp8_static(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``satfinite_rn(fp32(y) * (1 / scale))`` as ``float8_e4m3fn`` ``[T, H]``.

    ``1 / scale`` is one IEEE fp32 division (correctly rounded on every device; vLLM's
    ``1.0f / scale``), then one fp32 multiply per element, then the e4m3 rounding.
    """
    inv = torch.ones_like(scale).div(scale)
    return e4m3_encode(y.float() * inv).view(torch.float8_e4m3fn)


def quantize_fp8_per_token(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``satfinite_rn(fp32(y) / scale_t)`` and the fp32 ``[T, 1]`` scales.

    ``scale_t = max(amax_t / 448, fp32(1 / (448 * 512)))`` with ``amax_t`` the exact max of ``|y|``
    over the row (NaN if the row holds one) and a true fp32 division, as is the per-element ``/``.
    """
    y32 = y.float()
    amax = y32.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor: torch on CUDA turns division by a Python scalar into a multiply by its
    # (rounded) reciprocal, which is not the correctly rounded amax / 448 the format defines.
    scale = (amax / torch.full_like(amax, E4M3_MAX)).clamp_min(F32_MIN_TOKEN_SCALE)
    return e4m3_encode(y32 / scale).view(torch.float8_e4m3fn), scale


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp32(code) * scale`` (``scale`` is ``[1]`` or ``[T, 1]``); one fp32 rounding per element."""
    return e4m3_decode(data) * scale
