"""The slice of ``flashinfer.comm`` this backend uses, loaded once and checked by attribute, not by version.

Everything FlashInfer-specific that varies between releases is looked up here, so the rest of the
package (and the recording fake in the tests) sees one small surface:

* ``create_allreduce_fusion_workspace(backend=, world_size=, rank=, max_token_num=, hidden_dim=,
  dtype=, comm_backend=, group=[, gpus_per_node=])`` (collective);
* ``allreduce_fusion(input=, workspace=, pattern=, ...)``;
* ``AllReduceFusionPattern`` / ``QuantizationSFLayout`` (plain classes of int constants);
* ``flashinfer.comm.mnnvl.TorchDistBackend`` (the torch.distributed ``CommBackend``);
* the JIT module getters ``trtllm_ar.get_trtllm_comm_module`` and
  ``trtllm_mnnvl_ar.get_trtllm_mnnvl_comm_module``;
* ``flashinfer.comm.mnnvl.is_multicast_supported`` and ``flashinfer.utils.is_confidential_compute``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["FlashInferAPI", "api_reasons", "load"]

#: Pattern constant per (quant, normed output). ``None`` quant always writes the normed output.
PATTERNS: dict[tuple[str | None, bool], str] = {
    (None, True): "kARResidualRMSNorm",
    (None, False): "kARResidualRMSNorm",
    ("fp8_static", True): "kARResidualRMSNormOutFP8Quant",
    ("fp8_static", False): "kARResidualRMSNormFP8Quant",
    ("fp8_per_token", True): "kARResidualRMSNormOutDynamicFP8Quant",
    ("fp8_per_token", False): "kARResidualRMSNormDynamicFP8Quant",
    ("nvfp4", True): "kARResidualRMSNormOutFP4Quant",
    ("nvfp4", False): "kARResidualRMSNormFP4Quant",
    ("mxfp8", True): "kARResidualRMSNormOutMXFP8Quant",
    ("mxfp8", False): "kARResidualRMSNormMXFP8Quant",
}
#: arnorm scale layout -> ``QuantizationSFLayout`` attribute. SWIZZLED_8x4 is never used: the fused
#: kernel has no branch for it and writes no scales.
SF_LAYOUTS: dict[str, str] = {"swizzled_128x4": "SWIZZLED_128x4", "linear": "LINEAR"}
#: Only MXFP8 needs more than the unified API of 0.7.2.
MXFP8_MIN_VERSION = "0.7.4"
API_MIN_VERSION = "0.7.2"


@dataclass(frozen=True)
class FlashInferAPI:
    """What this backend calls, bound to one imported ``flashinfer.comm``."""

    version: str
    comm: Any
    patterns: Any
    layouts: Any
    has_mxfp8: bool
    missing: tuple[str, ...]

    def pattern(self, quant: str | None, normed_output: bool) -> int:
        return int(getattr(self.patterns, PATTERNS[(quant, normed_output)]))

    def layout_code(self, layout: str | None) -> int | None:
        return None if layout is None else int(getattr(self.layouts, SF_LAYOUTS[layout]))

    def torch_dist_backend(self, group: Any) -> Any:
        """FlashInfer's ``CommBackend`` over ``group`` (so nothing falls back to WORLD or to MPI)."""
        try:
            from flashinfer.comm.mnnvl import TorchDistBackend
        except ImportError:  # older layouts kept it next to the other backends
            from flashinfer.comm.comm_backend import TorchDistBackend
        return TorchDistBackend(group=group)

    def build_module(self, kind: str) -> None:
        """Build or load the JIT module of ``kind`` now (FlashInfer would do it inside the collective)."""
        if kind == "mnnvl":
            importlib.import_module("flashinfer.comm.trtllm_mnnvl_ar").get_trtllm_mnnvl_comm_module()
        else:
            importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()

    def multicast_supported(self, device_index: int) -> bool:
        try:
            from flashinfer.comm.mnnvl import is_multicast_supported
        except ImportError:
            return False
        return bool(is_multicast_supported(device_index))

    def confidential_compute(self) -> bool:
        try:
            from flashinfer.utils import is_confidential_compute
        except ImportError:
            return False
        return bool(is_confidential_compute())


_cached: FlashInferAPI | None = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(exc).__name__}: {line[:200]}" if line else type(exc).__name__


def _lacks(fn: Any, name: str) -> bool:
    """``fn`` certainly has no parameter ``name`` (an opaque ``**kwargs`` wrapper counts as having it)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return False
    return all(p.name != name for p in params)


def load() -> tuple[FlashInferAPI | None, str | None]:
    """Import ``flashinfer.comm``; return the API or a rejection reason (never raises)."""
    global _cached
    module = sys.modules.get("flashinfer.comm")
    if _cached is not None and module is _cached.comm:
        return _cached, None
    try:
        import flashinfer
        import flashinfer.comm as fc
    except Exception as exc:  # a broken install can raise anything at import (CUDA libs, tvm-ffi)
        return (
            None,
            f"flashinfer.comm: import failed: {_first_line(exc)} (needs a working flashinfer-python install)",
        )
    version = str(getattr(flashinfer, "__version__", "unknown"))
    missing = []
    for name in ("allreduce_fusion", "create_allreduce_fusion_workspace", "AllReduceFusionPattern"):
        if not hasattr(fc, name):
            missing.append(name)
    if not missing:
        if _lacks(fc.create_allreduce_fusion_workspace, "group"):
            missing.append("create_allreduce_fusion_workspace(group=)")
        if _lacks(fc.allreduce_fusion, "weight_bias"):
            missing.append("allreduce_fusion(weight_bias=)")
    patterns = getattr(fc, "AllReduceFusionPattern", None)
    layouts = getattr(fc, "QuantizationSFLayout", None)
    if layouts is None:
        missing.append("QuantizationSFLayout")
    has_mxfp8 = patterns is not None and hasattr(patterns, "kARResidualRMSNormMXFP8Quant")
    api = FlashInferAPI(version, fc, patterns, layouts, has_mxfp8, tuple(missing))
    _cached = api
    return api, None


def api_reasons(api: FlashInferAPI, quant: str | None, normed_output: bool) -> tuple[str, ...]:
    """What the installed FlashInfer lacks for this problem."""
    if api.missing:
        what = ", ".join(api.missing)
        return (f"flashinfer: {api.version} has no {what} (needs >= {API_MIN_VERSION})",)
    if quant == "mxfp8" and not api.has_mxfp8:
        return (f"flashinfer: {api.version} has no MXFP8 fusion patterns (needs >= {MXFP8_MIN_VERSION})",)
    name = PATTERNS[(quant, normed_output)]
    if not hasattr(api.patterns, name):
        return (
            f"flashinfer: {api.version} has no AllReduceFusionPattern.{name} (needs >= {API_MIN_VERSION})",
        )
    return ()
