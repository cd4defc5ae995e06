"""vLLM quantization keys to arnorm formats, by structure (vLLM need not be importable)."""

from __future__ import annotations

from typing import Any

import torch

from arnorm._types import QUANT_FORMATS

__all__ = ["format_of_key"]

_PER_TENSOR = (-1, -1)
_PER_TOKEN = (1, -1)


def _group(scale: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(v) for v in scale.group_shape)
    except (AttributeError, TypeError, ValueError):
        return None


def format_of_key(key: Any) -> str | None:
    """The arnorm format a vLLM ``QuantKey`` (or an arnorm format name) describes; None when arnorm has none.

    vLLM's keys are dataclasses ``QuantKey(dtype, scale=ScaleDesc(dtype, static, group_shape),
    scale2=None, symmetric=True)``; they are read by their fields, so any vLLM version with that
    shape works and vLLM itself is never imported:

    - fp8 e4m3fn, static fp32 per-tensor scale: ``"fp8_static"`` (``kFp8StaticTensorSym``);
    - fp8 e4m3fn, dynamic fp32 per-token scale: ``"fp8_per_token"`` (``kFp8DynamicTokenSym``);
    - packed fp4 (uint8), dynamic e4m3 scales per 16, static fp32 second scale: ``"nvfp4"``
      (``kNvfp4Dynamic``);
    - fp8 e4m3fn, dynamic E8M0 scales (uint8 or float8_e8m0fnu) per 32: ``"mxfp8"`` (``kMxfp8Dynamic``).

    Everything else (e4m3fnuz, asymmetric, per-group fp8, dynamic per-tensor, ...) is None.
    """
    if isinstance(key, str):
        return key if key in QUANT_FORMATS else None
    dtype, scale = getattr(key, "dtype", None), getattr(key, "scale", None)
    if not isinstance(dtype, torch.dtype) or scale is None or getattr(key, "symmetric", True) is not True:
        return None
    group, static, scale_dtype = _group(scale), getattr(scale, "static", None), getattr(scale, "dtype", None)
    scale2 = getattr(key, "scale2", None)
    if dtype == torch.float8_e4m3fn and scale2 is None:
        if scale_dtype == torch.float32 and static is True and group == _PER_TENSOR:
            return "fp8_static"
        if scale_dtype == torch.float32 and static is False and group == _PER_TOKEN:
            return "fp8_per_token"
        e8m0 = {torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)}
        if scale_dtype in e8m0 and static is False and group == (1, 32):
            return "mxfp8"
        return None
    if (
        dtype == torch.uint8
        and scale_dtype == torch.float8_e4m3fn
        and static is False
        and group == (1, 16)
        and scale2 is not None
        and getattr(scale2, "dtype", None) == torch.float32
        and getattr(scale2, "static", None) is True
        and _group(scale2) == _PER_TENSOR
    ):
        return "nvfp4"
    return None
