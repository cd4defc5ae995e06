"""What the vLLM entry points check before a call: the norm is a Gemma norm, the tensors are ones an
op takes as they are; and the one-time warning that says why a call ran unfused."""

from __future__ import annotations

from typing import Any

import torch

from arnorm.integrations._common import warn_once
from arnorm.integrations._hf_inspect import NORMS

__all__ = [
    "DTYPES",
    "not_gemma_reason",
    "not_plain_reason",
    "uncallable_reason",
    "unfusable_norm_reason",
    "warn_unfused",
]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Norm classes known to multiply by ``weight``, not ``1 + weight``: vLLM's plain norms and the
#: Hugging Face families whose norm arnorm reproduces with ``weight_offset=0``.
PLAIN_NORMS = frozenset({"RMSNorm", "RMSNormGated", *(n for n, (offset, _) in NORMS.items() if offset == 0)})
_NOT_GEMMA: dict[type, str | None] = {}


def not_gemma_reason(norm: Any) -> str | None:
    """Why ``norm`` is not a Gemma norm, or None; judged once per class, by its class names.

    A class named like Gemma anywhere in its MRO passes; a known plain norm class (see
    :data:`PLAIN_NORMS`) anywhere in it is refused, since the fused path would multiply by
    ``1 + weight`` where the module multiplies by ``weight``; any other class passes, as the
    docs promise (a module with a weight and an epsilon).
    """
    cls = type(norm)
    if cls not in _NOT_GEMMA:
        names = [c.__name__ for c in cls.__mro__]
        plain = [n for n in names if n in PLAIN_NORMS]
        reason = None
        if plain and not any("gemma" in n.lower() for n in names):
            reason = (
                f"norm: {cls.__name__}, a plain RMSNorm that multiplies by weight (needs a Gemma norm: "
                "these entry points multiply by 1 + weight; for a plain norm build "
                "arnorm.AllReduceNorm(..., norm=arnorm.RMSNorm(eps)))"
            )
        _NOT_GEMMA[cls] = reason
    return _NOT_GEMMA[cls]


def not_plain_reason(norm: Any) -> str | None:
    """Why ``norm`` is not a plain norm (``weight`` multiplies), or None: a class named like Gemma
    anywhere in its MRO multiplies by ``1 + weight``."""
    cls = type(norm)
    if any("gemma" in c.__name__.lower() for c in cls.__mro__):
        return (
            f"norm: {cls.__name__}, a Gemma norm that multiplies by 1 + weight (needs a plain RMSNorm: "
            "fused_allreduce_rms_norm multiplies by weight; use fused_allreduce_gemma_rms_norm)"
        )
    return None


def unfusable_norm_reason(norm: Any) -> str | None:
    """Why no arnorm op computes what ``norm`` computes, or None: vLLM's ``RMSNorm(var_hidden_size=...)``
    takes the statistic over the first ``var_hidden_size`` values only."""
    override = getattr(norm, "variance_size_override", None)
    if override is not None:
        return (
            f"norm: {type(norm).__name__} with the statistic over the first {override} values "
            "(needs the statistic over the whole hidden size: no var_hidden_size)"
        )
    return None


def uncallable_reason(hidden_states: Any, residual: Any, weight: Any) -> str | None:
    """Why an op cannot take these arguments as they are (2-D, contiguous, one dtype arnorm serves,
    matching shapes, one device), in arnorm's grammar; None when it can."""
    for name, t in (("hidden_states", hidden_states), ("residual", residual), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            return f"{name}: {type(t).__name__} (needs a torch.Tensor)"
    shape, dtype = tuple(hidden_states.shape), hidden_states.dtype
    if hidden_states.dim() != 2:
        return f"hidden_states: shape {shape} (needs 2-D [T, H])"
    if shape[0] == 0:
        return "hidden_states: 0 tokens (needs at least 1)"
    if dtype not in DTYPES:
        return f"hidden_states: dtype {dtype} (needs bfloat16, float16 or float32)"
    for name, t in (("residual", residual), ("weight", weight)):
        want = shape if name == "residual" else shape[1:]
        if tuple(t.shape) != want:
            return f"{name}: shape {tuple(t.shape)} (needs {want}, as hidden_states {shape})"
        if t.dtype != dtype:
            return f"{name}: dtype {t.dtype} (needs {dtype}, the dtype of hidden_states)"
        if t.device != hidden_states.device:
            return f"{name}: device {t.device} (needs {hidden_states.device}, the device of hidden_states)"
    for name, t in (("hidden_states", hidden_states), ("residual", residual)):
        if not t.is_contiguous():
            return f"{name}: strides {t.stride()} (needs contiguous)"
    return None


def warn_unfused(entry: str, reason: str, stacklevel: int = 3) -> None:
    """Say once per distinct reason that ``entry`` ran unfused, and why (0-token calls are silent:
    there is nothing to fuse). ``stacklevel``: the caller of the entry point."""
    if not reason.startswith("hidden_states: 0 tokens"):
        warn_once(f"arnorm.integrations.vllm.{entry}: ran unfused: {reason}", stacklevel, key=reason)
