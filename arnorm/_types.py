"""Value types of the public API: the norm (its options' table is :mod:`arnorm._norm`), the outputs and
the quantized activation.

All of them are immutable; none imports torch (tensors are only annotated).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NamedTuple

from arnorm import _formats
from arnorm._norm import NORM_OPTIONS, NormOptionName

if TYPE_CHECKING:
    import torch

__all__ = [
    "LOCAL",
    "QUANT_FORMATS",
    "SCALE_LAYOUTS",
    "LocalGroup",
    "Output",
    "QuantizedActivation",
    "RMSNorm",
]

#: Quantized output formats, in the order the docs list them (``None`` means no quantized output).
QUANT_FORMATS = _formats.QUANT_FORMATS
#: Layouts of block scales (nvfp4, mxfp8): the format table's.
SCALE_LAYOUTS = _formats.LAYOUTS


class LocalGroup:
    """The type of :data:`LOCAL`: a single-process op, with no all-reduce and no process group."""

    _instance: LocalGroup | None = None

    def __new__(cls) -> LocalGroup:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "arnorm.LOCAL"

    def __reduce__(self) -> str:
        return "LOCAL"


#: Pass as the TP group for a single-process op: ``AllReduceNorm(arnorm.LOCAL, hidden_size=...)``.
LOCAL = LocalGroup()


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class RMSNorm:
    """RMSNorm parameters. With ``h`` the new residual in dtype ``D`` and ``r = rsqrt(mean(h**2) + eps)``::

        round_before_weight=False:  y = D( h * r * (weight_offset + weight) )          # one rounding
        round_before_weight=True:   y = D( D(h * r) * (weight_offset + weight) )       # two roundings

    ``weight_offset=0.0`` is the plain (Llama) norm, ``1.0`` the Gemma / Qwen3.5 norm that stores
    ``weight - 1``. ``round_before_weight=True`` is the order of Hugging Face's ``LlamaRMSNorm``
    and vLLM's ``rms_norm`` kernels (``weight * (x * rsqrt).to(dtype)``); Gemma's norms and
    FlashInfer's fused kernel round once. Everything in between is fp32.

    ``normalize_unrounded=True`` normalizes ``fp32(s) + fp32(residual)`` as computed, before it is
    rounded to ``D`` (the statistic and the scaled value both read it); the residual returned is
    still the rounded ``h``, and the reduced sum ``s`` is rounded as always. It is the arithmetic
    of vLLM >= 0.2x's ``fused_add_rms_norm`` (``GemmaRMSNorm`` in 0.33) and AITER's fused kernel;
    ``False`` (the default) normalizes the rounded ``h``, as FlashInfer's fused kernel and
    Hugging Face's norms do. With ``add_residual=False`` there is no add and the two agree.

    The bool fields are the norm's options (``arnorm.plugin.NORM_OPTIONS``); :attr:`options` names
    those on.
    """

    eps: float = 1e-6
    weight_offset: float = 0.0
    round_before_weight: bool = False
    normalize_unrounded: bool = False

    def __post_init__(self) -> None:
        from arnorm._errors import InvalidInputError

        if not (_is_real(self.eps) and 0 < self.eps < float("inf")):
            msg = f"eps: {self.eps!r} (needs a positive finite float)"
            raise InvalidInputError(msg)
        if not (_is_real(self.weight_offset) and abs(self.weight_offset) < float("inf")):
            msg = f"weight_offset: {self.weight_offset!r} (needs a finite float, 0.0 plain or 1.0 Gemma)"
            raise InvalidInputError(msg)
        for name in NORM_OPTIONS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidInputError(f"{name}: {value!r} (needs True or False)")

    @property
    def kind(self) -> str:
        """``"plain"`` for offset 0, ``"gemma"`` for offset 1, else ``"offset=<b>"``."""
        if self.weight_offset == 0.0:
            return "plain"
        if self.weight_offset == 1.0:
            return "gemma"
        return f"offset={self.weight_offset:g}"

    @property
    def options(self) -> frozenset[NormOptionName]:
        """The names of the options not at their default."""
        return frozenset(n for n, o in NORM_OPTIONS.items() if getattr(self, n) != o.default)

    @classmethod
    def with_options(cls, eps: float, weight_offset: float, options: Iterable[str]) -> RMSNorm:
        """The norm of ``eps``, ``weight_offset`` and the options named in ``options`` (``Problem``'s
        ``eps``, ``weight_offset`` and ``norm_options``), the others at their default."""
        on = frozenset(options)
        return cls(eps, weight_offset, **{n: (n in on) != o.default for n, o in NORM_OPTIONS.items()})


_FIELDS = {f.name: f.default for f in fields(RMSNorm) if f.type in ("bool", bool)}
assert {n: o.default for n, o in NORM_OPTIONS.items()} == _FIELDS, "RMSNorm's bool fields are the options"


class QuantizedActivation(NamedTuple):
    """A quantized activation and what is needed to read it back.

    ``data``: codes (``float8_e4m3fn`` ``[T, H]`` for the fp8 formats and mxfp8, ``uint8``
    ``[T, H/2]`` for nvfp4, two e2m1 codes per byte, low nibble first).
    ``scale``: fp8_static: the fp32 ``[1]`` dequant scale that was passed in; fp8_per_token: fp32
    ``[T, 1]``; nvfp4: e4m3 block scales (``float8_e4m3fn``); mxfp8: E8M0 exponents (``uint8``); the
    block scales in ``layout``.
    ``global_scale``: nvfp4 only, the fp32 ``[1]`` encode scale that was passed in.

    ``arnorm.quant.dequantize(q)`` decodes it to fp32 (the value type imports no codec).
    """

    data: torch.Tensor
    scale: torch.Tensor
    format: str
    layout: str | None = None
    global_scale: torch.Tensor | None = None


class Output(NamedTuple):
    """What an ``AllReduceNorm`` call returns.

    ``normed``: ``[T, H]`` in the op's dtype, or ``None`` when the op was built with
    ``normed_output=False``. ``residual``: ``[T, H]`` = ``all_reduce(hidden_states) + residual``
    (it *is* ``hidden_states`` when the op is in place). ``quant``: the quantized ``normed`` or
    ``None``.
    """

    normed: torch.Tensor | None
    residual: torch.Tensor
    quant: QuantizedActivation | None = None
