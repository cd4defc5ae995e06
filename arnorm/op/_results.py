"""What goes to a backend and what comes back: the adapters that stand between the call and a backend
(:class:`ZeroResidual`, :class:`CopyInto`), the checks of what a backend returns, and the
inference-only guard on the outputs.

A backend's result is checked on its first call per token count (presence, type, shape, dtype and
device of every output: :func:`check_result`), then trusted; the call (:mod:`arnorm.op._call`)
records which counts were checked. With ``out=``, a backend declaring ``caller_outputs`` must hand
back ``out``'s own tensors, compared by identity on every call (:func:`returned_out`); any other
backend's result is checked in full on every call before it is copied into ``out``, so ``out`` is
never written from a wrong result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from arnorm._errors import BackendBrokenError, InferenceOnlyError
from arnorm._formats import FORMAT_SPECS
from arnorm._types import Output, QuantizedActivation
from arnorm.op._caller_outputs import OutRules, dest_shapes

if TYPE_CHECKING:
    import torch

    from arnorm.registry._explain import Explanation

__all__ = [
    "INFERENCE_ONLY",
    "CopyInto",
    "ZeroResidual",
    "broken_result",
    "check_result",
    "copy_into",
    "guard",
    "returned_out",
    "with_zero_residual",
]

INFERENCE_ONLY = (
    "backward: reached an arnorm op (needs torch.no_grad() or torch.inference_mode(): arnorm computes "
    "no gradients; it is for inference only)"
)


# -- adapters between the call and a backend ---------------------------------------------------------


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


class CopyInto:
    """A backend without ``Capabilities.caller_outputs`` serving ``out=``: it allocates its outputs
    as usual; they are checked as a first call's are, on every call, then copied into the caller's
    buffers (correct; one extra pass over them)."""

    def __init__(self, impl: Any, name: str, rules: OutRules, explanation: Explanation | None = None) -> None:
        self.impl = impl
        self.name = name
        self.rules = rules
        self.explanation = explanation

    def __call__(self, hidden_states: Any, residual: Any, weight: Any, scale: Any, out: Output) -> Output:
        got = self.impl(hidden_states, residual, weight, scale)
        t = hidden_states.shape[0]
        problem = check_result(self.rules, got, t)
        if problem:
            raise broken_result(self.name, t, problem, self.explanation)
        return copy_into(got, out, self.rules.inplace)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.impl, name)

    def __repr__(self) -> str:
        return f"CopyInto({self.impl!r})"


def copy_into(got: Output, out: Output, inplace: bool) -> Output:
    """``got``'s values in ``out``'s tensors, returned as the call's :class:`Output`."""
    # An out without normed / residual (the in-place layout, or an in-place op's residual): the
    # backend's own tensor, which is the input it wrote over.
    normed = got.normed if out.normed is None else out.normed.copy_(got.normed)  # type: ignore[arg-type]
    residual = got.residual if inplace or out.residual is None else out.residual.copy_(got.residual)
    quant = got.quant
    if quant is not None:
        dq = out.quant
        assert dq is not None
        data = dq.data.copy_(quant.data)
        computed = FORMAT_SPECS[quant.format].scale_dtype is not None
        qs = dq.scale.copy_(quant.scale) if computed else quant.scale
        quant = QuantizedActivation(data, qs, quant.format, quant.layout, quant.global_scale)
    return Output(normed, residual, quant)


# -- what a backend returns ------------------------------------------------------------------------


def broken_result(name: str, t: int, problem: str, explanation: Explanation | None) -> BackendBrokenError:
    return BackendBrokenError(
        f"backend {name!r}: its call for {t} tokens returned {problem}; fix or report the plugin, or "
        "disable it (ARNORM_DISABLE)",
        explanation,
    )


def _tensor(what: str, got: Any, shape: tuple[int, ...], dtype: Any, device: Any) -> str:
    import torch

    if not isinstance(got, torch.Tensor):
        return f"{what}: {type(got).__name__} (needs a torch.Tensor of shape {list(shape)})"
    if tuple(got.shape) != shape:
        return f"{what}: shape {list(got.shape)} (needs {list(shape)})"
    if got.dtype != dtype:
        return f"{what}: dtype {got.dtype} (needs {dtype})"
    if got.device != device:
        return f"{what}: device {got.device} (needs {device}, the op's device)"
    return ""


def check_result(rules: OutRules, result: Any, t: int) -> str:
    """What is wrong with ``result`` as an op's output for ``t`` tokens (``""``: nothing)."""
    if not isinstance(result, Output):
        if result is None or isinstance(result, tuple):
            what = "None" if result is None else f"a {type(result).__name__} of {len(result)} items"
        else:
            what = f"a {type(result).__name__}"
        return f"{what} (needs an arnorm.plugin.Output(normed, residual, quant))"
    h, dtype, device = rules.hidden, rules.dtype, rules.device
    wrong = _tensor("Output.residual", result.residual, (t, h), dtype, device)
    if wrong:
        return wrong
    if not rules.normed and result.normed is not None:
        return "Output.normed: a tensor (needs None: the op was built with normed_output=False)"
    q = result.quant
    if rules.quant is None and q is not None:
        return "Output.quant: a QuantizedActivation (needs None: the op does not quantize)"
    if rules.quant is not None and not isinstance(q, QuantizedActivation):
        return f"Output.quant: {type(q).__name__} (needs an arnorm.QuantizedActivation of {rules.quant!r})"
    if rules.normed and rules.normed_over_input:  # the in-place layout: hidden_states, written over
        wrong = _tensor("Output.normed", result.normed, (t, h), dtype, device)
        if wrong:
            return wrong
    fields = {"normed": ("Output.normed", result.normed)}
    if q is not None:
        fields["data"] = ("Output.quant.data", q.data)
        fields["scale"] = ("Output.quant.scale", q.scale)
    for _, field, shape, want in dest_shapes(rules, t):
        if field in fields:
            what, got = fields[field]
            wrong = _tensor(what, got, shape, want, device)
            if wrong:
                return wrong
    return ""


def _same_memory(got: Any, want: Any) -> bool:
    """``got`` is ``want`` or a view of exactly its memory (a backend may return ``out.normed.view(...)``)."""
    if got is want:
        return True
    try:
        return bool(
            got.data_ptr() == want.data_ptr() and got.shape == want.shape and got.stride() == want.stride()
            and got.dtype == want.dtype and got.device == want.device
        )  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        return False


def unwritten_destination(result: Any, out: Output, rules: OutRules) -> str:
    """The first destination of ``out`` that ``result`` does not hand back (``""``: it holds them
    all). A backend declaring ``caller_outputs`` must return the caller's tensors; one that returns
    new ones has left the caller's buffers unwritten."""
    if not isinstance(result, Output):
        return "out"
    if not rules.normed_over_input and not _same_memory(result.normed, out.normed):
        return "out.normed"
    if not rules.inplace and not _same_memory(result.residual, out.residual):
        return "out.residual"
    if rules.quant is not None and out.quant is not None:
        got = result.quant
        if not isinstance(got, QuantizedActivation) or not _same_memory(got.data, out.quant.data):
            return "out.quant.data"
        if FORMAT_SPECS[rules.quant].scale_dtype is not None and not _same_memory(got.scale, out.quant.scale):
            return "out.quant.scale"
    return ""


def returned_out(result: Any, out: Output, rules: OutRules, name: str, explanation: Any) -> Output:
    """``result``, when it hands back the caller's ``out`` tensors (identity: a few ``is`` tests);
    else raise naming the backend ``name``: one declaring ``caller_outputs`` that ignored ``out`` has
    left the caller's buffers unwritten, and the values an engine reads next would be stale."""
    if (
        type(result) is Output
        and (result.normed is out.normed or rules.normed_over_input)
        and (rules.inplace or result.residual is out.residual)
    ):
        q = out.quant
        if q is None or (
            result.quant is not None and result.quant.data is q.data and result.quant.scale is q.scale
        ):
            return result
    where = unwritten_destination(result, out, rules)
    if not where:
        return result
    msg = (
        f"backend {name!r}: {where}: not the caller's tensor, its buffer left unwritten (needs a backend "
        "that writes into out= and returns its tensors, as Capabilities(caller_outputs=True) promises; "
        "fix or report the plugin, or call without out=)"
    )
    raise BackendBrokenError(msg, explanation)


# -- the inference-only guard ----------------------------------------------------------------------


def guard(out: Output, hidden_states: Any, residual: Any, weight: Any) -> Output:
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
