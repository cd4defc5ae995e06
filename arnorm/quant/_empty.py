"""Empty output tensors of a quantized format, shaped and typed by the format table."""

from __future__ import annotations

import torch

from arnorm._formats import format_spec
from arnorm._types import QuantizedActivation
from arnorm.quant._inputs import check_format, check_scale

__all__ = ["empty_quantized"]

#: The layouts whose scale tensor holds padding beside the scales.
_PADDED_LAYOUTS = ("swizzled_128x4", "column_major_tma", "packed_ue8m0")


def empty_quantized(
    format: str,
    num_tokens: int,
    hidden_size: int,
    *,
    device: torch.device | str,
    layout: str | None = None,
    scale: torch.Tensor | None = None,
    zero_padding: bool = False,
) -> QuantizedActivation:
    """Uninitialized outputs of ``format`` for ``[num_tokens, hidden_size]``, as a backend fills them.

    ``data``: codes (``float8_e4m3fn [T, H]``, nvfp4 ``uint8 [T, H/2]``). ``scale``: fp8_static
    returns the caller's dequant scale ``scale`` itself; fp8_per_token ``float32 [T, 1]``; nvfp4
    ``float8_e4m3fn`` and mxfp8 ``uint8`` block scales, ``[T, H/block]`` (``linear``) or
    ``[round_up(T, 128), round_up(H/block, 4)]`` (``swizzled_128x4``), the per-group fp8 formats'
    layouts as ``arnorm/_formats.py`` gives them; a layout with padding is zero-filled when
    ``zero_padding``, for kernels that leave the padding unwritten. nvfp4 keeps ``scale`` as
    ``global_scale``. ``layout=None`` picks the format's default.
    """
    spec = format_spec(format)
    resolved = check_format(format, layout, hidden_size)
    check_scale(format, scale, device)
    data = torch.empty(
        spec.data_shape(num_tokens, hidden_size), dtype=getattr(torch, spec.data_dtype), device=device
    )
    shape = spec.scale_shape(num_tokens, hidden_size, resolved)
    if shape is None:
        assert scale is not None
        return QuantizedActivation(data, scale, format)
    make = torch.zeros if zero_padding and resolved in _PADDED_LAYOUTS else torch.empty
    scale_dtype = spec.scale_dtype_in(resolved)
    assert scale_dtype is not None
    scales = make(shape, dtype=getattr(torch, scale_dtype), device=device)
    return QuantizedActivation(data, scales, format, resolved, scale if spec.keeps_global_scale else None)
