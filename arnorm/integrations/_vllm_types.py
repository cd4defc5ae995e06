"""vLLM's own objects for what the quant entry points return: its ``QuantizedActivation`` and keys.

vLLM's linear kernels take a pre-quantized input only as
``vllm.model_executor.layers.fusion.quant_activation.QuantizedActivation(data, scale, orig_dtype,
orig_shape, quant_key)`` (``as_quantized_activation`` turns anything else into None, and then the
kernel asserts it got a tensor). vllm is imported here lazily, on the first quantized call; without
it, :class:`QuantizedActivationStandIn` carries the same fields, so CPU tests stay meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["QuantizedActivationStandIn", "scale_layout_for", "to_vllm", "vllm_key"]


@dataclass
class QuantizedActivationStandIn:
    """The fields of vLLM's ``QuantizedActivation``, for processes where vllm is not importable."""

    data: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype
    orig_shape: torch.Size
    quant_key: Any


#: vLLM 0.33's key names (``vllm.model_executor.layers.quantization.utils.quant_utils``) per format:
#: vLLM's own spelling, not a fact of the format. A format vLLM does not name keeps the caller's key,
#: so adding a format to arnorm's table needs no line here.
KEY_NAMES = {
    "fp8_static": "kFp8StaticTensorSym",
    "fp8_per_token": "kFp8DynamicTokenSym",
    "nvfp4": "kNvfp4Dynamic",
    "mxfp8": "kMxfp8Dynamic",
}
_VLLM: list[Any] = []  # [(QuantizedActivation class, quant_utils module)] or [None]


def _vllm() -> Any:
    if not _VLLM:
        try:
            from vllm.model_executor.layers.fusion.quant_activation import QuantizedActivation
            from vllm.model_executor.layers.quantization.utils import quant_utils
        except ImportError:
            _VLLM.append(None)
        else:
            _VLLM.append((QuantizedActivation, quant_utils))
    return _VLLM[0]


def vllm_key(key: Any, fmt: str) -> Any:
    """The ``quant_key`` to return: the caller's own key object, or, for an arnorm format name, vLLM's
    key for that format when vllm is importable (so ``as_quantized_activation`` accepts it)."""
    if not isinstance(key, str):
        return key
    found = _vllm()
    return getattr(found[1], KEY_NAMES.get(fmt, ""), key) if found is not None else key


def scale_layout_for(key: Any, fmt: str) -> str | None:
    """The block-scale layout the consumer of ``key`` reads. nvfp4: 128x4-swizzled (vLLM's only
    convention). mxfp8: 128x4-swizzled for a vLLM key (its FlashInfer mxfp8 linears take F8_128x4
    scales; the key does not say, the kernels' convention does), row-major for arnorm's name
    ``"mxfp8"``. None for the formats without block scales."""
    if fmt == "nvfp4":
        return "swizzled_128x4"
    if fmt == "mxfp8":
        return "linear" if isinstance(key, str) else "swizzled_128x4"
    return None


def block_scales(q: Any, fmt: str) -> torch.Tensor:
    """The scale tensor in vLLM's shape: swizzled mxfp8 scales flat ``[rows_128 * cols_4]`` uint8 as
    vLLM's ``mxfp8_e4m3_quantize(..., is_sf_swizzled_layout=True)`` returns them; everything else as
    arnorm returns it (nvfp4: float8_e4m3fn ``[rows_128, cols_4]``, vLLM's ``scaled_fp4_quant``)."""
    if fmt == "mxfp8" and q.layout == "swizzled_128x4":
        return q.scale.reshape(-1)
    return q.scale


def to_vllm(q: Any, key: Any, fmt: str, hidden_states: torch.Tensor, scale: Any) -> Any:
    """vLLM's ``QuantizedActivation`` (or the stand-in) for arnorm's quantized output ``q``.

    ``scale``: fp8_static: the caller's static scale, as passed (vLLM's kernel reads it as given);
    the others: the scales arnorm computed (see :func:`block_scales`)."""
    out_scale = scale if fmt == "fp8_static" and isinstance(scale, torch.Tensor) else block_scales(q, fmt)
    found = _vllm()
    cls = found[0] if found is not None else QuantizedActivationStandIn
    return cls(
        data=q.data,
        scale=out_scale,
        orig_dtype=hidden_states.dtype,
        orig_shape=hidden_states.shape,
        quant_key=vllm_key(key, fmt),
    )
