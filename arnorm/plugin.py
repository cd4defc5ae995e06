"""The public plugin API: everything a backend needs, and nothing else.

A backend is a class satisfying :class:`FusedAllReduceNorm`, described by a :class:`BackendSpec`
that a pluggy hook returns; the hook's module is the target of an ``arnorm.backends`` entry point::

    # my_backend/_plugin.py  (cheap: imports nothing heavy)
    from arnorm.plugin import BackendSpec, Capabilities, hookimpl

    @hookimpl
    def arnorm_backends():
        return [BackendSpec(name="mine", priority=50, loader="my_backend._impl:MyBackend",
                            capabilities=Capabilities(platforms={"cuda"}))]

    # pyproject.toml
    [project.entry-points."arnorm.backends"]
    mine = "my_backend._plugin"

Backends import this module (and :mod:`arnorm.quant`) only, never ``arnorm._*``. Importing it
imports no torch: ``quantize``, ``dequantize`` and ``empty_quantized`` load :mod:`arnorm.quant`
(and torch) on first use.
"""

# No ``from __future__ import annotations`` and no ``from typing import ...``: every name bound
# here is the plugin API (``__all__``), and those would bind ``annotations``, ``Any``, ...
import typing as _typing

from arnorm._config import BackendSettings
from arnorm._errors import (
    ArnormError,
    BackendSetupError,
    ConfigError,
    InferenceOnlyError,
    InvalidInputError,
)
from arnorm._formats import DTYPE_BYTES, DTYPES, FORMAT_SPECS, FormatSpec, format_spec, round_up
from arnorm._norm import NORM_OPTIONS, NormOption
from arnorm._problem import Problem
from arnorm._protocol import FusedAllReduceNorm
from arnorm._reference import add_rmsnorm, quantize_output, rank_order_sum
from arnorm._types import LOCAL, QUANT_FORMATS, SCALE_LAYOUTS, Output, QuantizedActivation, RMSNorm
from arnorm.comm._comm import Comm
from arnorm.registry._capabilities import Capabilities, check_capabilities, join_or
from arnorm.registry._spec import BackendSpec, hookimpl

if _typing.TYPE_CHECKING:  # loaded on first use by __getattr__ below
    from arnorm.quant import dequantize, empty_quantized, quantize

__all__ = [
    "DTYPES",
    "DTYPE_BYTES",
    "FORMAT_SPECS",
    "LOCAL",
    "NORM_OPTIONS",
    "QUANT_FORMATS",
    "SCALE_LAYOUTS",
    "ArnormError",
    "BackendSettings",
    "BackendSetupError",
    "BackendSpec",
    "Capabilities",
    "Comm",
    "ConfigError",
    "FormatSpec",
    "FusedAllReduceNorm",
    "InferenceOnlyError",
    "InvalidInputError",
    "NormOption",
    "Output",
    "Problem",
    "QuantizedActivation",
    "RMSNorm",
    "add_rmsnorm",
    "check_capabilities",
    "dequantize",
    "empty_quantized",
    "format_spec",
    "hookimpl",
    "join_or",
    "quantize",
    "quantize_output",
    "rank_order_sum",
    "round_up",
]

_FROM_QUANT = frozenset({"quantize", "dequantize", "empty_quantized"})


def __getattr__(name: str) -> _typing.Any:
    # The quantizers need torch: load them when a backend first asks, not at discovery.
    if name in _FROM_QUANT:
        import arnorm.quant

        return getattr(arnorm.quant, name)
    raise AttributeError(f"module 'arnorm.plugin' has no attribute {name!r}")
