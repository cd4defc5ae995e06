"""arnorm: fused tensor-parallel all-reduce + residual add + RMSNorm + quantization.

One call replaces the all-reduce after a row-parallel linear layer, the residual add, the RMSNorm
(plain or Gemma) and the quantization of the result for the next layer. Backends (FlashInfer,
AITER, Triton, a pure-torch reference) are plugins; arnorm asks each whether it can serve the
problem, picks the first that can on every rank, and says why it rejected the others::

    import arnorm, torch

    op = arnorm.AllReduceNorm(tp_group, hidden_size=4096, dtype=torch.bfloat16,
                              norm=arnorm.RMSNorm(eps=1e-6, weight_offset=1.0), quant="fp8_static")
    out = op(hidden_states, residual, weight, scale=scale)
    print(op.explain())

``import arnorm`` imports neither torch nor any backend and scans no entry points.
"""

from __future__ import annotations

import contextlib

from arnorm._config import Config
from arnorm._errors import (
    ArnormError,
    ArnormWarning,
    BackendBrokenError,
    BackendNotInstalledError,
    BackendSetupError,
    ConfigError,
    InferenceOnlyError,
    InvalidInputError,
    NoEligibleBackendError,
    PeerError,
    SelectionError,
    StoreLostError,
)
from arnorm._protocol import FusedAllReduceNorm
from arnorm._types import (
    LOCAL,
    QUANT_FORMATS,
    SCALE_LAYOUTS,
    LocalGroup,
    Output,
    QuantizedActivation,
    RMSNorm,
)
from arnorm.op._oneshot import fused_allreduce_norm
from arnorm.op._op import AllReduceNorm
from arnorm.registry._capabilities import Capabilities
from arnorm.registry._discovery import BackendInfo
from arnorm.registry._explain import STATUSES, Explanation, Verdict

__version__ = "0.3.0"

__all__ = [
    "LOCAL",
    "QUANT_FORMATS",
    "SCALE_LAYOUTS",
    "STATUSES",
    "AllReduceNorm",
    "ArnormError",
    "ArnormWarning",
    "BackendBrokenError",
    "BackendInfo",
    "BackendNotInstalledError",
    "BackendSetupError",
    "Capabilities",
    "Config",
    "ConfigError",
    "Explanation",
    "FusedAllReduceNorm",
    "InferenceOnlyError",
    "InvalidInputError",
    "LocalGroup",
    "NoEligibleBackendError",
    "Output",
    "PeerError",
    "QuantizedActivation",
    "RMSNorm",
    "SelectionError",
    "StoreLostError",
    "Verdict",
    "backends",
    "fused_allreduce_norm",
]


def backends() -> list[BackendInfo]:
    """Every registered backend with its status: available, not installed (and the fix), outdated, or broken.

    Discovers plugins on the first call. Availability here means the backend's dependencies are
    importable and new enough; whether it can serve a given problem is what
    :meth:`AllReduceNorm.explain` says.
    """
    from arnorm.registry._discovery import get_registry

    return get_registry().infos()


# Tracebacks and reprs show the public path (arnorm.InvalidInputError), not the private module.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) or callable(_obj):
        with contextlib.suppress(AttributeError, TypeError):  # builtins and C types refuse it
            _obj.__module__ = __name__
del _name, _obj
