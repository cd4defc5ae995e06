"""What arnorm's vLLM compile pass recognises: the ops of a seam, and the quantizations after a norm.

A seam is vLLM's TP all-reduce (``torch.ops.vllm.all_reduce``) whose result is the input of vLLM's
IR norm (``torch.ops.vllm_ir.rms_norm`` / ``fused_add_rms_norm``): the post-grad graph holds them
un-lowered whenever vLLM's passes run (vllm/compilation/passes/pass_manager.py). A quantization
after the norm is recognised where vLLM emits it as one of its custom ops (functionalized):
:data:`TAILS` has one entry per arnorm format, so a format arnorm adds is one more entry here.
Ops are named by string: nothing here imports vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ALL_REDUCE", "FUSED_ADD_RMS_NORM", "RMS_NORM", "TAILS", "QuantTail", "table_text"]

ALL_REDUCE = "vllm.all_reduce.default"
RMS_NORM = "vllm_ir.rms_norm.default"
FUSED_ADD_RMS_NORM = "vllm_ir.fused_add_rms_norm.default"

#: Values a per-tensor ``group_shape`` argument is written with (vLLM passes either).
_PER_TENSOR = (None, (-1, -1), [-1, -1])


def _codes_fp8(t: Any, h: Any) -> tuple[tuple[Any, ...], str]:
    return (t, h), "float8_e4m3fn"


def _codes_fp4(t: Any, h: Any) -> tuple[tuple[Any, ...], str]:
    return (t, h // 2), "uint8"


def _scale_per_token(t: Any, h: Any) -> tuple[tuple[Any, ...], str]:
    return (t, 1), "float32"


def _scale_nvfp4_swizzled(t: Any, h: Any) -> tuple[tuple[Any, ...], str]:
    # vLLM's scaled_fp4_quant buffer: e4m3 scales per 16, 128x4-swizzled, read as int32 words.
    rows = (t + 127) // 128 * 128
    cols = (h // 16 + 3) // 4 * 4
    return (rows, cols // 4), "int32"


@dataclass(frozen=True)
class QuantTail:
    """One quantization vLLM emits after a norm, as ``auto_functionalized(op, **kwargs)``.

    ``format``/``layout``: arnorm's format and block-scale layout that compute the same codes.
    ``op``: the vLLM op (``str(OpOverload)``). ``input``: its argument holding the normed values;
    ``codes``: the mutated argument receiving the codes; ``scale_in``: the argument holding the
    caller's scale (a static per-tensor scale, nvfp4's global scale), if any; ``scale_out``: the
    mutated argument receiving computed scales, if any (``codes_index``/``scale_index``: where the
    functionalized call's result holds them). ``fixed``: other arguments and the values
    they must hold (the first is what the unfused path passes). ``codes_like``/``scale_like``: the
    shape and dtype of vLLM's buffers for ``T`` tokens of hidden size ``H``.
    """

    format: str
    layout: str | None
    op: str
    input: str
    codes: str
    scale_in: str | None
    scale_out: str | None
    fixed: tuple[tuple[str, tuple[Any, ...]], ...]
    codes_like: Callable[[Any, Any], tuple[tuple[Any, ...], str]]
    scale_like: Callable[[Any, Any], tuple[tuple[Any, ...], str]] | None = None
    #: Where ``auto_functionalized``'s result holds the codes and the computed scales.
    codes_index: int = 1
    scale_index: int | None = None

    def describe(self) -> str:
        """The entry as text, for the pass's ``uuid()`` (what it rewrites)."""
        likes = (self.codes_like.__name__, self.scale_like.__name__ if self.scale_like else None)
        return repr((self.format, self.layout, self.op, self.input, self.codes, self.scale_in,
                     self.scale_out, self.fixed, likes, self.codes_index, self.scale_index))  # fmt: skip


#: arnorm format -> how vLLM emits it after a norm (vllm/_custom_ops.py, the fusion passes' matchers).
TAILS: dict[str, QuantTail] = {
    "fp8_static": QuantTail(
        "fp8_static", None, "_C.static_scaled_fp8_quant.default", "input", "result", "scale", None,
        (("group_shape", _PER_TENSOR),), _codes_fp8,
    ),
    "fp8_per_token": QuantTail(
        "fp8_per_token", None, "_C.dynamic_per_token_scaled_fp8_quant.default", "input", "result", None,
        "scale", (("scale_ub", (None,)),), _codes_fp8, _scale_per_token, scale_index=2,
    ),
    "nvfp4": QuantTail(
        "nvfp4", "swizzled_128x4", "_C.scaled_fp4_quant.out", "input", "output", "input_scale",
        "output_scale", (("is_sf_swizzled_layout", (True,)),), _codes_fp4, _scale_nvfp4_swizzled,
        scale_index=2,
    ),
}  # fmt: skip

#: vLLM op name -> its tail.
TAIL_BY_OP = {tail.op: tail for tail in TAILS.values()}


def table_text() -> str:
    """Everything the pass matches, as text (part of its ``uuid()``)."""
    ops = repr((ALL_REDUCE, RMS_NORM, FUSED_ADD_RMS_NORM))
    return ops + "".join(TAILS[name].describe() for name in sorted(TAILS))
