"""Helpers both integrations share: reading a norm module, the unfused Gemma path, the backward guard."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from arnorm._errors import InferenceOnlyError

__all__ = [
    "INFERENCE_ONLY",
    "accepts_residual",
    "gemma_add_norm",
    "guard_backward",
    "norm_eps",
    "warn_once",
]

INFERENCE_ONLY = (
    "backward: reached a model rewired by arnorm (needs torch.no_grad() or torch.inference_mode(): "
    "the fused path computes no gradients; it is for inference only)"
)


#: Keys :func:`warn_once` has said (once per process).
_WARNED: set[str] = set()


def warn_once(message: str, stacklevel: int, key: str | None = None) -> None:
    """An :class:`arnorm.ArnormWarning` the first time ``key`` (default: the message) comes up in
    this process: an integration that runs a call unfused says why once, not on every layer of
    every step."""
    key = message if key is None else key
    if key not in _WARNED:
        _WARNED.add(key)
        import warnings

        from arnorm._errors import ArnormWarning

        warnings.warn(message, ArnormWarning, stacklevel + 1)


def norm_eps(norm: Any) -> float | None:
    """A norm module's epsilon: ``variance_epsilon`` (Llama, vLLM) or ``eps`` (Gemma); None if neither."""
    for attr in ("variance_epsilon", "eps"):
        value = getattr(norm, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


_ACCEPTS_RESIDUAL: dict[type, bool] = {}


def accepts_residual(norm: Any) -> bool:
    """Whether ``norm(x, residual)`` is the module's own add + norm (vLLM's norms); judged once per class.

    vLLM's norms are custom ops whose ``forward`` takes ``*args``: their ``forward_native`` names
    the parameter. Hugging Face norms take ``x`` alone.
    """
    cls = type(norm)
    known = _ACCEPTS_RESIDUAL.get(cls)
    if known is None:
        known = False
        for name in ("forward_native", "forward"):
            fn = getattr(cls, name, None)
            if fn is None:
                continue
            try:
                known = "residual" in inspect.signature(fn).parameters
            except (TypeError, ValueError):
                known = False
            break
        _ACCEPTS_RESIDUAL[cls] = known
    return known


def gemma_add_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, x + residual)`` as vLLM's ``GemmaRMSNorm(x, residual)`` computes it in eager torch.

    The add rounds to the dtype; the statistic is taken over the rounded sum; ``(1 + w)`` and the
    product are fp32 with one rounding at the end: arnorm's contract with ``weight_offset=1.0``.
    """
    h = x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype), h


class _InferenceOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise InferenceOnlyError(INFERENCE_ONLY)


def guard_backward(out: torch.Tensor, anchors: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """``out`` with a grad_fn that raises :class:`arnorm.InferenceOnlyError`, when autograd is recording.

    ``anchors`` are tensors the output depends on (inputs, parameters): the first that requires
    grad ties ``out`` into the graph, so a backward pass through it raises instead of computing
    gradients the fused path never defined.
    """
    if not torch.is_grad_enabled():
        return out
    for anchor in anchors:
        if anchor is not None and anchor.requires_grad:
            return _InferenceOnly.apply(anchor, out.detach())
    return out
