"""The public plugin API: everything a backend author needs, and nothing else.

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
"""

from arnorm._capabilities import Capabilities, check_capabilities
from arnorm._comm import Comm
from arnorm._config import Config
from arnorm._problem import DTYPES, Problem
from arnorm._protocol import FusedAllReduceNorm
from arnorm._reference import add_rmsnorm, quantize_output, rank_order_sum
from arnorm._spec import BackendSpec, hookimpl
from arnorm._types import QUANT_FORMATS, SCALE_LAYOUTS, Output, QuantizedActivation

__all__ = [
    "DTYPES",
    "QUANT_FORMATS",
    "SCALE_LAYOUTS",
    "BackendSpec",
    "Capabilities",
    "Comm",
    "Config",
    "FusedAllReduceNorm",
    "Output",
    "Problem",
    "QuantizedActivation",
    "add_rmsnorm",
    "check_capabilities",
    "hookimpl",
    "quantize_output",
    "rank_order_sum",
]
