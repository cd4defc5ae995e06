"""vLLM quantization keys to arnorm formats, by structure (vLLM need not be importable).

The structure a key must have for each format is derived from the format table
(:data:`arnorm.plugin.FORMAT_SPECS`): the codes' dtype, the scale's dtype, whether the scale is an
input (static) and its group shape, and whether a static fp32 second scale rides along. A format
added to the table is recognised here with no change.
"""

from __future__ import annotations

from typing import Any

import torch

from arnorm._formats import FORMAT_SPECS, FormatSpec

__all__ = ["format_of_key"]

_PER_TENSOR = (-1, -1)
_PER_TOKEN = (1, -1)

#: ``(codes dtype, scale dtype, scale static, scale group shape, static fp32 second scale)``.
_Shape = tuple[str, str, bool, tuple[int, int], bool]


def _key_shape(spec: FormatSpec) -> _Shape:
    """The fields of the vLLM ``QuantKey`` that describes ``spec``'s output: an input scale is a
    static fp32 per-tensor scale (fp8_static's); computed scales are dynamic, per block or per token;
    a kept global scale is vLLM's static fp32 per-tensor ``scale2`` (nvfp4's)."""
    if spec.returns_input_scale:
        return (spec.data_dtype, "float32", True, _PER_TENSOR, False)
    group = (1, spec.block_size) if spec.block_size else _PER_TOKEN
    assert spec.scale_dtype is not None  # a format that does not return the input scale computes one
    return (spec.data_dtype, spec.scale_dtype, False, group, spec.keeps_global_scale)


#: A key's structure to its format. Formats of one structure (the UE8M0 per-group kinds share their
#: fp32 twins': a key says fp32 group scales, not how they are rounded): the table's first is the key's.
_BY_SHAPE: dict[_Shape, str] = {}
for _name, _spec in FORMAT_SPECS.items():
    _BY_SHAPE.setdefault(_key_shape(_spec), _name)


def _group(scale: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(v) for v in scale.group_shape)
    except (AttributeError, TypeError, ValueError):
        return None


def _dtype_name(dtype: Any) -> str | None:
    """torch's name of ``dtype``; vLLM's E8M0 scales (``float8_e8m0fnu``) are arnorm's ``uint8``
    exponents, byte for byte."""
    if not isinstance(dtype, torch.dtype):
        return None
    if dtype == getattr(torch, "float8_e8m0fnu", None):
        return "uint8"
    return str(dtype).removeprefix("torch.")


def _static_per_tensor_fp32(scale2: Any) -> bool:
    return (
        _dtype_name(getattr(scale2, "dtype", None)) == "float32"
        and getattr(scale2, "static", None) is True
        and _group(scale2) == _PER_TENSOR
    )


def format_of_key(key: Any) -> str | None:
    """The arnorm format a vLLM ``QuantKey`` (or an arnorm format name) describes; None when arnorm has none.

    vLLM's keys are dataclasses ``QuantKey(dtype, scale=ScaleDesc(dtype, static, group_shape),
    scale2=None, symmetric=True)``; they are read by their fields, so any vLLM version with that
    shape works and vLLM itself is never imported. With today's table:

    - fp8 e4m3fn, static fp32 per-tensor scale: ``"fp8_static"`` (``kFp8StaticTensorSym``);
    - fp8 e4m3fn, dynamic fp32 per-token scale: ``"fp8_per_token"`` (``kFp8DynamicTokenSym``);
    - packed fp4 (uint8), dynamic e4m3 scales per 16, static fp32 second scale: ``"nvfp4"``
      (``kNvfp4Dynamic``);
    - fp8 e4m3fn, dynamic E8M0 scales (uint8 or float8_e8m0fnu) per 32: ``"mxfp8"`` (``kMxfp8Dynamic``).

    Everything else (e4m3fnuz, asymmetric, per-group fp8, dynamic per-tensor, ...) is None.
    """
    if isinstance(key, str):
        return key if key in FORMAT_SPECS else None
    scale = getattr(key, "scale", None)
    if scale is None or getattr(key, "symmetric", True) is not True:
        return None
    data, scale_dtype = _dtype_name(getattr(key, "dtype", None)), _dtype_name(getattr(scale, "dtype", None))
    static, group = getattr(scale, "static", None), _group(scale)
    if (
        data is None
        or scale_dtype is None
        or not isinstance(static, bool)
        or group is None
        or len(group) != 2
    ):
        return None
    scale2 = getattr(key, "scale2", None)
    if scale2 is not None and not _static_per_tensor_fp32(scale2):
        return None
    return _BY_SHAPE.get((data, scale_dtype, static, (group[0], group[1]), scale2 is not None))
