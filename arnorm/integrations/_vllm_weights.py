"""A norm's weight as the fused path reads it: in the activations' dtype, and only where that is exact.

A vLLM norm module may hold an fp32 weight while the activations are fp16 or bf16 (a checkpoint's
norms kept in fp32); vLLM's own arithmetic then reads the fp32 values (``weight.float() + 1`` for
Gemma, ``x * weight`` in fp32 for the plain norm). An op takes a weight of its own dtype, so the
fused path may take the weight narrowed to the activations' dtype only when narrowing changes no
value: then ``fp32(narrow(w)) == w`` and the result is bit for bit the one the fp32 weight gives.
Otherwise the call runs vLLM's own unfused path, and says why once.

vLLM's weight loader writes a norm's weight through ``param.data.copy_``, which moves no version
counter, so a narrowed copy kept from an earlier call could go stale without a sign. So the kept
buffer is refreshed from the weight at every call: one ``H``-element cast, no host sync (checking the
values at every call would cost a device sync per layer and could not be captured into a CUDA
graph; a refresh is captured as a read of the weight's storage, so replays follow reloads too).
Whether narrowing is exact is checked again whenever the weight's version, storage or shape
changes. The one case a call cannot see: values the activations' dtype does not hold, written
without a version bump into a weight whose values it held before; those are read rounded.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["fused_weight"]

_NARROW = (torch.float16, torch.bfloat16)
_cache: dict[tuple[int, torch.dtype], tuple[Any, int, int, torch.Tensor | None, str | None]] = {}


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
    caller's check names that); an exact narrowed copy of an fp32 weight for fp16/bf16 activations,
    current with the weight's values (see the module docstring); otherwise the reason no fused path
    computes what the module computes."""
    if not (isinstance(weight, torch.Tensor) and isinstance(hidden_states, torch.Tensor)):
        return weight, None
    dtype = hidden_states.dtype
    if weight.dtype == dtype or weight.dtype != torch.float32 or dtype not in _NARROW:
        return weight, None
    key = (id(weight), dtype)
    hit = _cache.get(key)
    if (
        hit is not None
        and hit[0]() is weight
        and hit[1] == weight._version
        and hit[2] == weight.data_ptr()
        and (hit[3] is None or hit[3].shape == weight.shape)
    ):
        if hit[3] is None:
            return weight, hit[4]
        hit[3].copy_(weight.detach())
        return hit[3], None
    narrow, why = _narrowed(weight, dtype)
    _cache[key] = (weakref.ref(weight), weight._version, weight.data_ptr(), narrow, why)
    return (weight, why) if narrow is None else (narrow, None)
