"""Helpers of the per-call path: the inference-only guard, the checked-call mode, trust of weights.

The hot path itself is ``AllReduceNorm.__call__`` (:mod:`arnorm.op._call`): one combined test of
:class:`arnorm.op._check.CallRules`, a list index that picks the backend for the token count, and
the backend call. A weight or scale that passed the full check is trusted afterwards by identity
and data pointer (a ``w.data = ...`` swap changes the pointer and is checked again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from arnorm._errors import InferenceOnlyError, InvalidInputError
from arnorm._types import Output
from arnorm.op._check import CallRules, check_call

if TYPE_CHECKING:
    import torch

__all__ = [
    "INFERENCE_ONLY",
    "Trust",
    "ZeroResidual",
    "agree_call",
    "guard",
    "no_backend",
    "with_zero_residual",
]

INFERENCE_ONLY = (
    "backward: reached an arnorm op (needs torch.no_grad() or torch.inference_mode(): arnorm computes "
    "no gradients; it is for inference only)"
)
#: Trusted weights/scales per op before the trust table starts over (an op shared by every layer
#: sees one weight per layer; a caller passing fresh tensors every call must not grow it forever).
TRUST_LIMIT = 1024


class Trust:
    """Weights and scales that passed the full check: ``id -> data pointer``, one table each, bounded.

    The tensors themselves are kept alive in ``held``, so an ``id`` is never reused by another
    tensor while it is trusted; a ``w.data = ...`` swap changes the data pointer, which the hot
    path compares, and sends the tensor through the full check again. Weights and scales have
    separate tables: a trusted scale passed as a weight is checked as a weight.
    """

    __slots__ = ("held", "rules", "scales", "weights")

    def __init__(self, rules: CallRules) -> None:
        self.rules = rules
        self.weights: dict[int, int] = {}
        self.scales: dict[int, int] = {}
        self.held: list[Any] = []

    def _keep(self, table: dict[int, int], t: Any, ptr: int) -> bool:
        if len(self.held) >= TRUST_LIMIT:
            self.weights.clear()
            self.scales.clear()
            self.held.clear()
        table[id(t)] = ptr
        self.held.append(t)
        return True

    def weight(self, w: Any, ptr: int) -> bool:
        """Check ``w`` fully and trust it when it passes (``ptr`` is its data pointer)."""
        r = self.rules
        ok = w.dtype is r.dtype and w.shape == (r.hidden,) and w.device == r.device and w.is_contiguous()
        return ok and not w.is_neg() and self._keep(self.weights, w, ptr)

    def scale(self, s: Any, ptr: int) -> bool:
        """Check the fp32 ``[1]`` scale fully and trust it when it passes."""
        import torch

        r = self.rules
        ok = r.needs_scale and s.dtype is torch.float32 and s.shape == (1,) and s.device == r.device
        return ok and not s.is_neg() and self._keep(self.scales, s, ptr)


def guard(
    out: Output, hidden_states: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
) -> Output:
    """Attach a grad_fn that raises :class:`InferenceOnlyError` to every floating output."""
    return _guard_fn()(out, hidden_states, residual, weight)


_GUARD: list[Callable[..., Output]] = []


def _guard_fn() -> Callable[..., Output]:
    if _GUARD:
        return _GUARD[0]
    import torch

    class InferenceOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, anchor_h: Any, anchor_r: Any, anchor_w: Any, *outs: Any) -> Any:
            ctx.mark_non_differentiable(
                *[o for o in outs if not o.dtype.is_floating_point or o.element_size() == 1]
            )
            return tuple(o.view_as(o) for o in outs)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            raise InferenceOnlyError(INFERENCE_ONLY)

    def apply(out: Output, hs: Any, res: Any, w: Any) -> Output:
        tensors = [out.residual] + ([out.normed] if out.normed is not None else [])
        wrapped = list(InferenceOnly.apply(hs, res, w, *tensors))
        residual = wrapped.pop(0)
        normed = wrapped.pop(0) if out.normed is not None else None
        return Output(normed, residual, out.quant)

    _GUARD.append(apply)
    return apply


def no_backend(num_tokens: int) -> Exception:
    from arnorm._errors import NoEligibleBackendError

    return NoEligibleBackendError(
        f"tokens: {num_tokens} (needs a token count some backend of this op serves; "
        f"see op.explain({num_tokens}))"
    )


def agree_call(
    comm: Any,
    rules: CallRules,
    seq: int,
    hidden_states: Any,
    residual: Any,
    weight: Any,
    scale: Any,
    check_out: Callable[..., None] | None = None,
) -> None:
    """``ARNORM_CHECK_CALLS``: gather every rank's fingerprint of call number ``seq`` (shapes, dtypes,
    devices, whether a scale came, and the local verdict on the arguments, ``out=`` included through
    ``check_out``) before the collective, and raise the same error on every rank when they differ
    or any rank rejects its arguments."""

    def fingerprint(t: Any) -> Any:
        try:
            return f"{list(t.shape)} {t.dtype} {t.device.type}"
        except Exception:  # not a tensor, or one without sizes (nested)
            return type(t).__name__

    try:
        check_call(rules, hidden_states, residual, weight, scale)
        if check_out is not None:
            check_out(hidden_states, residual, weight, scale)
        error = ""
    except Exception as exc:  # whatever it is, every rank must learn of it before the collective
        error = str(exc) if isinstance(exc, InvalidInputError) else f"{type(exc).__name__}: {exc}"
    mine = (seq, fingerprint(hidden_states), fingerprint(residual), fingerprint(weight), scale is None, error)
    seen = comm.gather_objects(mine)
    if all(s == seen[0] for s in seen):
        if not error:
            return
        # The same call, rejected the same way on every rank (or the only rank): that is the error.
        raise InvalidInputError(error)
    detail = "; ".join(
        f"{comm.who(r)}: call {s[0]}, hidden_states {s[1]}, residual {s[2]}, weight {s[3]}, "
        f"scale {'none' if s[4] else 'given'}" + (f", rejected: {s[5]}" if s[5] else "")
        for r, s in enumerate(seen)
    )
    raise InvalidInputError(
        f"calls: differ across ranks or were rejected ({detail}) (needs the same call on every rank)"
    )


class ZeroResidual:
    """A backend without ``Capabilities.residual_free`` serving an ``add_residual=False`` op.

    Each call hands it the first ``T`` rows of a ``-0.0`` buffer as the residual: in IEEE
    arithmetic ``x + -0.0 == x`` for every ``x`` (``-0.0`` and NaN included), so the result is
    bitwise the residual-free contract, at the cost of reading ``T * H`` more elements. Everything
    else (``check_tokens``, ``close``, ``input_buffer``) is the backend's own.
    """

    def __init__(self, impl: Any, zeros: torch.Tensor) -> None:
        self.impl = impl
        self._zeros = zeros

    def __call__(self, hidden_states: Any, residual: Any, weight: Any, scale: Any, out: Any = None) -> Output:
        zeros = self._zeros[: hidden_states.shape[0]]
        if out is None:
            return self.impl(hidden_states, zeros, weight, scale)
        return self.impl(hidden_states, zeros, weight, scale, out)

    def close(self) -> None:
        self._zeros = self._zeros[:0]
        self.impl.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.impl, name)

    def __repr__(self) -> str:
        return f"ZeroResidual({self.impl!r})"


def with_zero_residual(
    chain: list[Any], native: list[bool], table: list[int], problem: Any, device: Any
) -> list[Any]:
    """``chain`` with every backend that cannot serve ``residual=None`` itself wrapped in
    :class:`ZeroResidual`; one ``-0.0`` buffer, as many rows as the largest ``T`` they serve."""
    if all(native):
        return chain
    rows = max((t for t, i in enumerate(table) if i >= 0 and not native[i]), default=0)
    if rows == 0:  # the backends that would need it serve no token count
        return chain
    import torch

    zeros = torch.full((rows, problem.hidden_size), -0.0, dtype=getattr(torch, problem.dtype), device=device)
    return [impl if ok else ZeroResidual(impl, zeros) for impl, ok in zip(chain, native, strict=True)]
