"""The quantization formats of arnorm, bit for bit: ``fp8_static``, ``fp8_per_token``, ``nvfp4``, ``mxfp8``,
the per-token-group fp8 formats (``fp8_per_group`` and its group-64 and UE8M0 kinds) and ``mxfp4``.

These pure-torch functions *define* step 4 of the numerics contract (``q = Q(y)``, ``y`` the
dtype-rounded normed activation): the reference backend calls them and every backend we compile
is compared with them bitwise. They are vectorized, run on any device, and the fp8 paths never
sync with the host. ``docs/numerics.md`` states each rule and how production kernels compare.

>>> import torch
>>> from arnorm import quant
>>> y = torch.tensor([[1.0, -2.0, 500.0, 0.1]])
>>> q = quant.quantize(y, "fp8_static", scale=torch.tensor([1.0]))
>>> quant.dequantize(q).tolist()  # 500 saturates to 448; 0.1 rounds to 13 * 2**-7
[[1.0, -2.0, 448.0, 0.1015625]]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from arnorm._errors import InvalidInputError
from arnorm._formats import FORMAT_SPECS, LAYOUTS, FormatSpec, format_spec
from arnorm._formats import QUANT_FORMATS as FORMATS
from arnorm._types import QuantizedActivation
from arnorm.quant._empty import empty_quantized
from arnorm.quant._fp8 import dequantize_fp8, quantize_fp8_per_token, quantize_fp8_static
from arnorm.quant._fp8_group import dequantize_fp8_group, quantize_fp8_group
from arnorm.quant._inputs import check_format, check_input, check_scale, default_layout
from arnorm.quant._layout import swizzle_128x4, unswizzle_128x4
from arnorm.quant._mxfp4 import dequantize_mxfp4, quantize_mxfp4
from arnorm.quant._mxfp8 import dequantize_mxfp8, quantize_mxfp8
from arnorm.quant._nvfp4 import dequantize_nvfp4, quantize_nvfp4

__all__ = [
    "FORMATS",
    "FORMAT_SPECS",
    "LAYOUTS",
    "FormatSpec",
    "check_format",
    "check_scale",
    "default_layout",
    "dequantize",
    "empty_quantized",
    "format_spec",
    "quantize",
    "swizzle_128x4",
    "unswizzle_128x4",
]


def quantize(
    y: torch.Tensor,
    format: str,
    *,
    scale: torch.Tensor | None = None,
    layout: str | None = None,
) -> QuantizedActivation:
    """Quantize the normed activation ``y`` (``[T, H]``, bf16 / fp16 / fp32, any device) into ``format``.

    ``scale``: fp8_static: the fp32 ``[1]`` dequant scale; nvfp4: the fp32 ``[1]`` global encode
    scale (``448 * 6 / amax``); ``None`` for fp8_per_token and mxfp8. ``layout``: the block-scale
    layout of nvfp4 (default ``swizzled_128x4``) and mxfp8 (default ``linear``); ``None`` for fp8.
    Raises :class:`arnorm.InvalidInputError` (a ``ValueError``) for a bad argument.
    """
    y = check_input(y).detach()  # quantization is not differentiable; keep autograd out of it
    resolved = check_format(format, layout, int(y.shape[1]))
    check_scale(format, scale, y.device)
    spec = FORMAT_SPECS[format]
    data, computed = _CODECS[format][0](y, scale.detach() if scale is not None else None, resolved)
    out_scale = scale if spec.returns_input_scale else computed
    assert out_scale is not None  # check_scale saw an input scale; the codec computed the others
    return QuantizedActivation(
        data,
        out_scale,
        format,
        resolved,
        scale if spec.keeps_global_scale else None,
    )


def _check_quantized(q: QuantizedActivation) -> None:
    if not isinstance(q, QuantizedActivation):
        raise InvalidInputError(f"q: {type(q).__name__} (needs an arnorm.QuantizedActivation)")
    fmt = q.format
    default_layout(fmt)  # checks the name
    spec = FORMAT_SPECS[fmt]
    if spec.block_size and q.layout is None:
        raise InvalidInputError(f"layout: None (needs {' or '.join(spec.layouts)} for {fmt})")
    data_dtype = getattr(torch, spec.data_dtype)
    data = q.data
    if not isinstance(data, torch.Tensor) or data.dtype != data_dtype or data.dim() != 2:
        found = f"dtype {data.dtype} shape {list(data.shape)}" if isinstance(data, torch.Tensor) else "?"
        raise InvalidInputError(f"data: {found} (needs a 2-D {data_dtype} tensor for {fmt})")
    rows, hidden = int(data.shape[0]), int(data.shape[1]) * spec.elements_per_byte
    check_format(fmt, q.layout, hidden)
    if spec.block_size is None and spec.scale_dtype is not None and tuple(q.scale.shape) != (rows, 1):
        raise InvalidInputError(f"scale: shape {list(q.scale.shape)} (needs [{rows}, 1] for {fmt})")
    if spec.returns_input_scale:
        check_scale(fmt, q.scale, data.device)
    if spec.keeps_global_scale:
        check_scale(fmt, q.global_scale, data.device)


def dequantize(q: QuantizedActivation) -> torch.Tensor:
    """Decode ``q`` to fp32 ``[T, H]``: ``code * scale`` with the format's scale; swizzled scales are
    unswizzled with ``T = q.data.shape[0]``. fp8 and mxfp8 decode exactly except for the one fp32
    product of fp8 codes with an fp32 scale; nvfp4 is ``e2m1 * fp32(SF) / global_scale``.
    """
    _check_quantized(q)
    return _CODECS[q.format][1](q)


# Each format's codec: (encode(y, input scale, layout) -> (codes, computed scale or None),
# decode(q) -> fp32). The keys are the format table's; a test holds them equal.
_Encode = Callable[..., "tuple[torch.Tensor, torch.Tensor | None]"]
_CODECS: dict[str, tuple[_Encode, Callable[..., torch.Tensor]]] = {
    "fp8_static": (
        lambda y, scale, layout: (quantize_fp8_static(y, scale), None),
        lambda q: dequantize_fp8(q.data, q.scale),
    ),
    "fp8_per_token": (
        lambda y, scale, layout: quantize_fp8_per_token(y),
        lambda q: dequantize_fp8(q.data, q.scale),
    ),
    "nvfp4": (
        lambda y, scale, layout: quantize_nvfp4(y, scale, layout),
        lambda q: dequantize_nvfp4(q.data, q.scale, q.global_scale, q.layout),
    ),
    "mxfp8": (
        lambda y, scale, layout: quantize_mxfp8(y, layout),
        lambda q: dequantize_mxfp8(q.data, q.scale, q.layout),
    ),
    "mxfp4": (
        lambda y, scale, layout: quantize_mxfp4(y, layout),
        lambda q: dequantize_mxfp4(q.data, q.scale, q.layout),
    ),
}
# The formats with fp32 block scales (per-token-group fp8) differ only in facts of their records:
# the group size and whether the scales are powers of two.
_CODECS.update(
    (
        name,
        (
            lambda y, scale, layout, s=spec: quantize_fp8_group(y, s.block_size, s.pow2_scales, layout),
            lambda q, s=spec: dequantize_fp8_group(q.data, q.scale, s.block_size, q.layout),
        ),
    )
    for name, spec in FORMAT_SPECS.items()
    if spec.block_size and spec.scale_dtype == "float32"
)
