"""arnorm: fused tensor-parallel all-reduce + residual add + RMSNorm + quantization.

One call replaces the all-reduce after a row-parallel linear layer, the residual add, the RMSNorm
(plain or Gemma) and the quantization of the result for the next layer. Backends (FlashInfer,
AITER, Triton, a pure-torch reference) are plugins; arnorm asks each whether it can serve the
problem, picks the first that can on every rank, and says why it rejected the others::

    import arnorm, torch

    op = arnorm.AllReduceNorm(group=tp_group, hidden_size=4096, dtype=torch.bfloat16,
                              norm=arnorm.RMSNorm(eps=1e-6, weight_offset=1.0), quant="fp8_static")
    out = op(hidden_states, residual, weight, scale=scale)
    print(op.explain())

``import arnorm`` imports neither torch nor any backend and scans no entry points.
"""

from __future__ import annotations

from arnorm._capabilities import Capabilities
from arnorm._config import Config
from arnorm._discovery import ArnormWarning, BackendInfo
from arnorm._errors import (
    ArnormError,
    BackendBrokenError,
    BackendNotInstalledError,
    BackendSetupError,
    ConfigError,
    InvalidInputError,
    NoEligibleBackendError,
)
from arnorm._explain import Explanation, Verdict
from arnorm._op import AllReduceNorm, fused_allreduce_norm
from arnorm._protocol import FusedAllReduceNorm
from arnorm._types import QUANT_FORMATS, SCALE_LAYOUTS, Output, QuantizedActivation, RMSNorm

__version__ = "0.1.0"

__all__ = [
    "QUANT_FORMATS",
    "SCALE_LAYOUTS",
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
    "InvalidInputError",
    "NoEligibleBackendError",
    "Output",
    "QuantizedActivation",
    "RMSNorm",
    "Verdict",
    "backends",
    "fused_allreduce_norm",
]


def backends() -> list[BackendInfo]:
    """Every registered backend with its status: available, not installed (and the fix), or broken.

    Discovers plugins on the first call. Availability here means the backend's dependencies are
    importable; whether it can serve a given problem is what :meth:`AllReduceNorm.explain` says.
    """
    from arnorm._discovery import get_registry

    return get_registry().infos()
