"""The one table of per-format facts: code, block size, input scale, output dtypes and shapes, layouts.

Everything that allocates, checks or describes a quantized output reads it: the quantizers and
their checks (:mod:`arnorm.quant`), the custom op's fake implementation, the backends' output
plans. It imports nothing heavy (dtypes are torch attribute names), so plugin descriptors and
``Capabilities`` may use it at discovery time.

======================  ====  ==========  ===========  ==========================  =======================
format                  code  block size  input scale  data ``[T, H]``             scale returned
======================  ====  ==========  ===========  ==========================  =======================
``fp8_static``          1     -           dequant      float8_e4m3fn ``[T, H]``    the input fp32 ``[1]``
``fp8_per_token``       2     -           -            float8_e4m3fn ``[T, H]``    float32 ``[T, 1]``
``nvfp4``               3     16          global enc.  uint8 ``[T, H/2]`` (2 e2m1)  float8_e4m3fn blocks
``mxfp8``               4     32          -            float8_e4m3fn ``[T, H]``    uint8 E8M0 blocks
``fp8_per_group``       5     128         -            float8_e4m3fn ``[T, H]``    float32 per group
``fp8_per_group_64``    6     64          -            float8_e4m3fn ``[T, H]``    float32 per group
``fp8_per_group_ue8m0`` 7     128         -            float8_e4m3fn ``[T, H]``    float32 powers of two
``fp8_per_group_64_ue8m0`` 8  64          -            float8_e4m3fn ``[T, H]``    float32 powers of two
``mxfp4``               9     32          -            uint8 ``[T, H/2]`` (2 e2m1) uint8 E8M0 blocks
======================  ====  ==========  ===========  ==========================  =======================

Block scales (``C = H / block`` per token) are ``[T, C]`` in the ``linear`` layout and
``[round_up(T, 128), round_up(C, 4)]`` in ``swizzled_128x4`` (padding zero). The per-group fp8
formats keep their scales as the consumers of block-FP8 activations read them, each stored as a
contiguous tensor: ``linear`` (row-major ``[T, C]``), ``column_major`` (``[C, T]``: its transpose
is vLLM's column-major ``[T, C]`` view), ``column_major_tma`` (``[C, round_up(T, 4)]``: the rows
padded to 16 bytes as TMA loads them, vLLM's ``tma_aligned_scales``) and, for power-of-two scales,
``packed_ue8m0`` (int32 ``[ceil(C / 4), round_up(T, 4)]``: the biased exponent bytes of groups
``4k .. 4k+3`` of a token in one int32, lowest group in the lowest byte, DeepGEMM's layout and
FlashInfer's ``PerTokenGroupFP8PackedQuant``). Padding is zero.

A format's ``code`` is its identity for compiled code and tuned tables (the Triton kernels' ``QUANT``
constexpr, the keys of ``arnorm_triton``'s launch tables): append-only. A new format takes the next
unused code; a code is never reused or renumbered, whatever the order of the table
(``tests/test_formats.py`` pins them). 0 means no quantized output.

Adding a format: its name in :data:`QuantName`, its record in ``_SPECS``, its codec in
:mod:`arnorm.quant` (docs/architecture.md, "Adding a format").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

__all__ = [
    "DTYPES",
    "DTYPE_BYTES",
    "FORMAT_SPECS",
    "LAYOUTS",
    "NO_QUANT",
    "QUANT_FORMATS",
    "TMA_ROWS",
    "DtypeName",
    "FormatSpec",
    "LayoutName",
    "QuantChoice",
    "QuantName",
    "format_spec",
    "round_up",
]

#: The quantized formats, in the order the docs list them: the one place their names are typed.
QuantName = Literal[
    "fp8_static",
    "fp8_per_token",
    "nvfp4",
    "mxfp8",
    "fp8_per_group",
    "fp8_per_group_64",
    "fp8_per_group_ue8m0",
    "fp8_per_group_64_ue8m0",
    "mxfp4",
]
#: What a backend declares it serves (``Capabilities.quant``): a format, or ``"none"`` for no
#: quantized output (``Problem.quant_name``).
QuantChoice = Literal["none", QuantName]
#: The name of "no quantized output" among the :data:`QuantChoice` values.
NO_QUANT: Literal["none"] = "none"
#: Layouts of block scales: the first two serve every block format unless its record names its own.
LayoutName = Literal["linear", "swizzled_128x4", "column_major", "column_major_tma", "packed_ue8m0"]
#: The activation dtypes arnorm serves, by torch name: the one place they are typed (the op's
#: ``dtype``, ``Capabilities.dtypes``, the quantizers' input, the CLI's choices).
DtypeName = Literal["bfloat16", "float16", "float32"]

#: The layouts every block format serves unless its record names its own.
_BLOCK_LAYOUTS = ("linear", "swizzled_128x4")
#: Token rows of the TMA-aligned scale layouts are padded to a multiple of this: 16 bytes of
#: 4-byte scales (vLLM's ``get_tma_aligned_size(T, 4)``).
TMA_ROWS = 4
QUANT_FORMATS: tuple[QuantName, ...] = get_args(QuantName)
LAYOUTS: tuple[LayoutName, ...] = get_args(LayoutName)
DTYPES: tuple[DtypeName, ...] = get_args(DtypeName)
#: Bytes per element of each activation dtype.
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"bfloat16": 2, "float16": 2, "float32": 4})
assert tuple(DTYPE_BYTES) == DTYPES, "DTYPE_BYTES and DtypeName must list the same dtypes"


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n``."""
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class FormatSpec:
    """What one quantized format produces, independent of any backend.

    ``data_dtype`` / ``scale_dtype`` are torch dtype names (``getattr(torch, name)``);
    ``scale_dtype`` is ``None`` when the output's scale is the caller's input scale (fp8_static).
    ``elements_per_byte`` is 2 for nvfp4's packed e2m1 pairs (low nibble first), else 1.
    ``takes_scale``: the call needs an fp32 ``[1]`` input scale. It is either the dequant scale the
    output hands back as its own (``returns_input_scale``: fp8_static) or a global encode scale kept
    beside computed block scales (``keeps_global_scale``: nvfp4).
    ``code``: the format's fixed number for compiled code and tuned tables (append-only, >= 1).
    """

    name: str
    code: int
    block_size: int | None
    takes_scale: bool
    data_dtype: str
    elements_per_byte: int
    scale_dtype: str | None
    default_layout: str | None
    #: An input scale that suits activations of magnitude ~1-8, for demos, benches and test cases.
    sample_scale: float | None = None
    #: The block-scale layouts of this format, default first; empty: ``linear`` and ``swizzled_128x4``.
    scale_layouts: tuple[str, ...] = ()
    #: Each computed fp32 scale is rounded up to a power of two (UE8M0 scales kept as fp32).
    pow2_scales: bool = False

    @property
    def returns_input_scale(self) -> bool:
        """The output's scale is the caller's input scale (no scale is computed)."""
        return self.takes_scale and self.scale_dtype is None

    @property
    def keeps_global_scale(self) -> bool:
        """The output keeps the caller's input scale as ``global_scale`` beside computed scales."""
        return self.takes_scale and self.scale_dtype is not None

    @property
    def layouts(self) -> tuple[str, ...]:
        """The block-scale layouts this format may use, its default first (none for the fp8 formats)."""
        if not self.block_size:
            return ()
        if self.scale_layouts:
            return self.scale_layouts
        first = self.default_layout or LAYOUTS[0]
        return (first, *(x for x in _BLOCK_LAYOUTS if x != first))

    @property
    def hidden_multiple(self) -> int:
        """The hidden size must be a multiple of this: a whole number of blocks, and of bytes for a
        packed format (``elements_per_byte`` codes share a byte); 1 for the unpacked fp8 formats."""
        return math.lcm(self.block_size or 1, self.elements_per_byte)

    def data_shape(self, num_tokens: int, hidden_size: int) -> tuple[int, int]:
        """Shape of the codes tensor."""
        return (num_tokens, hidden_size // self.elements_per_byte)

    def scale_shape(self, num_tokens: int, hidden_size: int, layout: str | None) -> tuple[int, ...] | None:
        """Shape of the scale tensor the format computes, ``None`` for fp8_static (input scale)."""
        if self.block_size is None:
            return None if self.takes_scale else (num_tokens, 1)
        cols = hidden_size // self.block_size
        if layout == "swizzled_128x4":
            return (round_up(num_tokens, 128), round_up(cols, 4))
        if layout == "column_major":
            return (cols, num_tokens)
        if layout == "column_major_tma":
            return (cols, round_up(num_tokens, TMA_ROWS))
        if layout == "packed_ue8m0":
            return (-(-cols // 4), round_up(num_tokens, TMA_ROWS))
        return (num_tokens, cols)

    def scale_dtype_in(self, layout: str | None) -> str | None:
        """The scale tensor's dtype in ``layout``: ``int32`` for four exponent bytes packed in one."""
        return "int32" if layout == "packed_ue8m0" else self.scale_dtype


_GROUP_LAYOUTS = ("linear", "column_major", "column_major_tma")
_POW2_GROUP_LAYOUTS = (*_GROUP_LAYOUTS, "packed_ue8m0")

# fmt: off
_SPECS = (
    #          name            code block takes  data             /byte scale            default layout
    FormatSpec("fp8_static",    1,  None, True,  "float8_e4m3fn", 1,   None,            None,
               sample_scale=0.02),
    FormatSpec("fp8_per_token", 2,  None, False, "float8_e4m3fn", 1,   "float32",       None),
    FormatSpec("nvfp4",         3,  16,   True,  "uint8",         2,   "float8_e4m3fn", "swizzled_128x4",
               sample_scale=448 * 6 / 8.0),
    FormatSpec("mxfp8",         4,  32,   False, "float8_e4m3fn", 1,   "uint8",         "linear"),
    FormatSpec("fp8_per_group", 5,  128,  False, "float8_e4m3fn", 1,   "float32",       "linear",
               scale_layouts=_GROUP_LAYOUTS),
    FormatSpec("fp8_per_group_64", 6, 64, False, "float8_e4m3fn", 1,   "float32",       "linear",
               scale_layouts=_GROUP_LAYOUTS),
    FormatSpec("fp8_per_group_ue8m0", 7, 128, False, "float8_e4m3fn", 1, "float32",     "linear",
               scale_layouts=_POW2_GROUP_LAYOUTS, pow2_scales=True),
    FormatSpec("fp8_per_group_64_ue8m0", 8, 64, False, "float8_e4m3fn", 1, "float32",   "linear",
               scale_layouts=_POW2_GROUP_LAYOUTS, pow2_scales=True),
    FormatSpec("mxfp4",         9,  32,   False, "uint8",         2,   "uint8",         "linear"),
)
# fmt: on

#: Every quantized format by name, in the order the docs list them.
FORMAT_SPECS: Mapping[str, FormatSpec] = MappingProxyType({s.name: s for s in _SPECS})
assert tuple(FORMAT_SPECS) == QUANT_FORMATS, "the format table and QuantName must list the same formats"


def _check_codes(specs: Iterable[FormatSpec]) -> None:
    codes = [s.code for s in specs]
    assert len(set(codes)) == len(codes) and min(codes) >= 1, f"codes: {codes} (needs each once, >= 1)"


_check_codes(_SPECS)


def format_spec(name: str) -> FormatSpec:
    """The :class:`FormatSpec` of ``name``; raises :class:`arnorm.InvalidInputError` for an unknown one."""
    spec = FORMAT_SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        from arnorm._errors import InvalidInputError

        raise InvalidInputError(f"quant: {name!r} (needs one of {', '.join(FORMAT_SPECS)})")
    return spec
