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

__all__ = ["ALL_REDUCE", "FUSED_ADD_RMS_NORM", "RMS_NORM", "TAILS", "TAIL_BY_OP", "QuantTail", "table_text"]

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


def _scale_groups(group: int, layout: str) -> Callable[[Any, Any], tuple[tuple[Any, ...], str]]:
    """arnorm's storage of per-token-group fp8 scales in ``layout`` (``FormatSpec.scale_shape``)."""

    def like(t: Any, h: Any) -> tuple[tuple[Any, ...], str]:
        cols = h // group
        if layout == "column_major":
            return (cols, t), "float32"
        if layout == "column_major_tma":
            # vLLM's get_tma_aligned_size(T, 4), written as it writes it (``-(T // -4) * 4``) so that
            # a symbolic T gives the very expression its buffer's stride holds.
            return (cols, -(t // -4) * 4), "float32"
        return (t, cols), "float32"

    like.__name__ = f"_scale_groups_{group}_{layout}"
    return like


def _view_rows_first(storage: Any, t: Any) -> Any:
    """vLLM's ``[T, C]`` view of column-major scale storage ``[C, T or more]`` (its rows may be padded)."""
    return storage[:, :t].t()


def _view_same(storage: Any, t: Any) -> Any:
    return storage


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
    #: The table's key when a format has several tails (one per scale layout vLLM allocates).
    name: str = ""
    #: vLLM's view of the scale storage ``scale_like`` describes, for ``T`` tokens: its column-major
    #: buffers are ``[T, C]`` views with strides ``(1, rows)`` over ``[C, rows]`` storage.
    scale_view: Callable[[Any, Any], Any] = _view_same

    @property
    def key(self) -> str:
        """This tail's key in :data:`TAILS` (the ``quant`` argument of the op the pass inserts)."""
        return self.name or self.format

    def describe(self) -> str:
        """The entry as text, for the pass's ``uuid()`` (what it rewrites)."""
        likes = (self.codes_like.__name__, self.scale_like.__name__ if self.scale_like else None)
        extra = (self.name, self.scale_view.__name__) if self.name else ()
        return repr((self.format, self.layout, self.op, self.input, self.codes, self.scale_in, self.scale_out,
                     self.fixed, likes, self.codes_index, self.scale_index, *extra))  # fmt: skip


def _group_tail(fmt: str, group: int, ue8m0: bool, layout: str) -> QuantTail:
    """vLLM's ``per_token_group_quant_fp8`` as its graphs hold it (``_C.per_token_group_fp8_quant``):
    the layout of the scales is the buffer vLLM allocates (row-major, a transposed ``[C, T]``, or
    ``[C, round_up(T, 4)]`` for TMA), which its two flags name (the kernel reads the strides)."""
    transposed, tma = layout != "linear", layout == "column_major_tma"
    return QuantTail(
        fmt,
        layout,
        "_C.per_token_group_fp8_quant.default",
        "input",
        "output_q",
        None,
        "output_s",
        (
            ("group_size", (group,)),
            ("eps", (1e-10,)),
            ("fp8_min", (-448.0,)),
            ("fp8_max", (448.0,)),
            ("scale_ue8m0", (ue8m0,)),
            ("dummy_is_scale_transposed", (transposed,)),
            # A row-major buffer is row-major whatever the TMA flag says (vLLM pads only column-major).
            ("dummy_is_tma_aligned", (tma,) if transposed else (False, True)),
        ),
        _codes_fp8,
        _scale_groups(group, layout),
        scale_index=2,
        name=fmt if layout == "linear" else f"{fmt}@{layout}",
        scale_view=_view_same if layout == "linear" else _view_rows_first,
    )


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
#: The per-token-group fp8 formats, one tail per scale layout vLLM allocates. Not here: vLLM's
#: ``per_token_group_fp8_quant_packed`` (DeepGEMM's packed UE8M0 scales; a CUDA-only kernel whose
#: arithmetic no CPU lane checks against arnorm's) and MXFP4 (vLLM 0.33's CUDA linear layers quantize
#: activations with FlashInfer's ``mxfp4_quantize`` as ``vllm.flashinfer_mxfp4_quantize``, whose
#: scale rounding is FlashInfer's, not the ``mxfp4_quantize`` arithmetic arnorm's ``mxfp4`` is): the
#: seam before either is fused, the quantization left to vLLM.
TAILS.update(
    (tail.key, tail)
    for fmt, group, ue8m0 in (("fp8_per_group", 128, False), ("fp8_per_group_64", 64, False),
                              ("fp8_per_group_ue8m0", 128, True), ("fp8_per_group_64_ue8m0", 64, True))
    for layout in ("linear", "column_major", "column_major_tma")
    for tail in (_group_tail(fmt, group, ue8m0, layout),)
)  # fmt: skip

#: vLLM op name -> its tails, in the table's order (the first whose fixed arguments match is taken).
TAIL_BY_OP: dict[str, tuple[QuantTail, ...]] = {}
for _tail in TAILS.values():
    TAIL_BY_OP[_tail.op] = (*TAIL_BY_OP.get(_tail.op, ()), _tail)
del _tail


def table_text() -> str:
    """Everything the pass matches, as text (part of its ``uuid()``)."""
    ops = repr((ALL_REDUCE, RMS_NORM, FUSED_ADD_RMS_NORM))
    return ops + "".join(TAILS[name].describe() for name in sorted(TAILS))
