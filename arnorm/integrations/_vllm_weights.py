"""A norm's weight as the fused path reads it: in the activations' dtype, and only where that is exact.

A vLLM norm module may hold an fp32 weight while the activations are fp16 or bf16 (a checkpoint's
norms kept in fp32); vLLM's own arithmetic then reads the fp32 values (``weight.float() + 1`` for
Gemma, ``x * weight`` in fp32 for the plain norm). An op takes a weight of its own dtype, so the
fused path may take the weight narrowed to the activations' dtype only when narrowing changes no
value: then ``fp32(narrow(w)) == w`` and the result is bit for bit the one the fp32 weight gives.
Otherwise the call runs vLLM's own unfused path, and says why once. The narrowed copy is kept per
weight tensor and rebuilt when the weight is written to (its version counter moves).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["fused_weight"]

_NARROW = (torch.float16, torch.bfloat16)
_cache: dict[tuple[int, torch.dtype], tuple[Any, int, torch.Tensor | None, str | None]] = {}


def _narrowed(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, str | None]:
    w = weight.detach()
    narrow = w.to(dtype)
    if torch.equal(narrow.float(), w):
        return narrow, None
    differ = int((narrow.float() != w).sum())
    name = str(dtype).removeprefix("torch.")
    return None, (
        f"weight: dtype float32 with {differ} of {w.numel()} values {name} does not hold exactly (needs "
        f"a {name} weight, or float32 values {name} represents: the fused path reads the weight in the "
        "activations' dtype)"
    )


def fused_weight(weight: Any, hidden_states: Any) -> tuple[Any, str | None]:
    """``(weight the op takes, None)`` or ``(weight, why the call must run unfused)``.

    The weight itself when its dtype is the activations' (or when the call is malformed: the
    caller's check names that); an exact narrowed copy of an fp32 weight for fp16/bf16 activations;
    otherwise the reason no fused path computes what the module computes."""
    if not (isinstance(weight, torch.Tensor) and isinstance(hidden_states, torch.Tensor)):
        return weight, None
    dtype = hidden_states.dtype
    if weight.dtype == dtype or weight.dtype != torch.float32 or dtype not in _NARROW:
        return weight, None
    key = (id(weight), dtype)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == weight._version:
        return (weight, hit[3]) if hit[2] is None else (hit[2], None)
    narrow, why = _narrowed(weight, dtype)
    _cache[key] = (weakref.ref(weight), weight._version, narrow, why)
    return (weight, why) if narrow is None else (narrow, None)
