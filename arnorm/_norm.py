"""The one table of the norm's options.

An option is a ``bool`` field of :class:`arnorm.RMSNorm` that picks one of two arithmetics (docs/numerics.md
defines each bit for bit). Everything else reads this table: the problem keeps the names of the
options an op turns on (``Problem.norm_options``), a backend declares the names it serves
(``Capabilities.norm_options``) and the static check derives its reasons from the records, the
reference arithmetic takes each option as a keyword of its name, the Triton launchers derive a
kernel constexpr from each name, the CLI a flag, and the conformance and invariance cases turn each
declared option on in turn.

==========================  =======  ===============  ================================================
option                      default  void when        what a backend that does not serve it computes
==========================  =======  ===============  ================================================
``round_before_weight``     False    -                one rounding, after the weight
``normalize_unrounded``     False    no add, or fp32  the norm of the sum rounded to the dtype
==========================  =======  ===============  ================================================

Adding an option: its name in :data:`NormOptionName`, its record in ``_OPTIONS``, its field in
:class:`arnorm.RMSNorm` (``_types.py``; docs/architecture.md, "Adding a norm option").

It imports nothing (``Problem`` reads it, and the errors module sits above the problem).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

__all__ = ["NORM_OPTIONS", "NormOption", "NormOptionName"]

#: The norm options, in the order the docs list them: the names of ``RMSNorm``'s bool fields.
NormOptionName = Literal["round_before_weight", "normalize_unrounded"]


@dataclass(frozen=True)
class NormOption:
    """One option of the norm, as the registry, the CLI and the test cases read it.

    ``aspect`` and ``otherwise``: the rejection reason of a backend that does not serve the option,
    ``"<aspect>: <name>=True (needs False: <otherwise>)"``. ``label``: the option in one-line
    summaries (``Problem.short()``, a case's id). ``summary``: what the option does, for a flag's
    help. ``needs_rounded_sum``: the option means something only where the new residual is a
    rounded sum (a residual is added, in a dtype narrower than fp32); elsewhere an op records it off,
    so that both spellings are one problem and one selection.
    """

    name: NormOptionName
    aspect: str
    otherwise: str
    label: str
    summary: str
    default: bool = False
    needs_rounded_sum: bool = False

    @property
    def reason(self) -> str:
        """Why a backend that does not declare the option is rejected for an op that turns it on."""
        return f"{self.aspect}: {self.name}={not self.default} (needs {self.default}: {self.otherwise})"

    def is_void(self, add_residual: bool, dtype: str) -> bool:
        """Whether the option changes nothing for an op of ``dtype`` with or without a residual add."""
        return self.needs_rounded_sum and (not add_residual or dtype == "float32")


_OPTIONS = (
    NormOption(
        "round_before_weight",
        aspect="rounding order",
        otherwise="one rounding after the weight",
        label="round-before-weight",
        summary="round the normalized value to the dtype before the weight multiply (Hugging Face "
        "Llama order)",
    ),
    NormOption(
        "normalize_unrounded",
        aspect="norm input",
        otherwise="this backend normalizes the residual rounded to the dtype",
        label="unrounded",
        summary="normalize the fp32 sum of the reduced value and the residual before it is rounded to "
        "the dtype (vLLM 0.33's order)",
        # With no add the sum is the reduced value itself; in fp32 rounding to the dtype is exact.
        needs_rounded_sum=True,
    ),
)

#: Every norm option by name, in the order the docs list them.
NORM_OPTIONS: Mapping[NormOptionName, NormOption] = MappingProxyType({o.name: o for o in _OPTIONS})
assert tuple(NORM_OPTIONS) == get_args(NormOptionName), "the option table and NormOptionName must agree"
