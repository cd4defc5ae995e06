"""``torch.ops.arnorm.*``: the op as torch custom ops with fake implementations.

``torch.compile`` cannot trace into backends (IPC workspaces, Triton launches, collectives), so a
compiled model reaches the op through two opaque custom ops; the op object itself travels as an
integer handle (a weak reference: a dropped op leaves no entry behind). ``all_reduce_norm_``
mutates ``hidden_states`` (in-place ops) and returns the other outputs; ``all_reduce_norm``
mutates nothing and returns the new residual first; ``all_reduce_norm_in_place`` (ops built with
``output_layout="in_place"``) mutates ``hidden_states`` (the normed output) and ``residual`` (the new
residual) and returns the quantized output's tensors. With autograd recording, a compiled in-place
call goes through the functional op and copies the residual back, because torch registers
autograd formulas on functional ops only; the formula raises :class:`arnorm.InferenceOnlyError`.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any

from arnorm._formats import FORMAT_SPECS
from arnorm._types import Output, QuantizedActivation

if TYPE_CHECKING:
    import torch

__all__ = ["call_custom_op", "register_handle", "unregister_handle"]

_ops: dict[int, weakref.ReferenceType[Any]] = {}
_ids = itertools.count(1)
_lock = threading.Lock()
_defined = False


def register_handle(op: object) -> int:
    """A process-unique integer standing for ``op`` inside compiled graphs; forgotten when ``op`` is."""
    handle = next(_ids)
    _ops[handle] = weakref.ref(op, lambda _ref, h=handle: _ops.pop(h, None))  # type: ignore[misc]
    _define_ops()
    return handle


def unregister_handle(handle: int) -> None:
    """``op.close()``: nothing to forget. A closed op keeps its handle until it is freed, so that
    compiled code still calling it gets the eager call's error ("op: closed ...") rather than a
    lookup failure; the weak reference drops the entry once the op is gone."""
    return None


def live_handles() -> int:
    """How many ops are registered (for leak tests)."""
    return len(_ops)


def _lookup(handle: int) -> Any:
    ref = _ops.get(handle)
    op = ref() if ref is not None else None
    if op is None:
        # What the eager call of a closed op raises: compiled code keeps calling the op it was
        # compiled with (closed, or freed once nothing else held it).
        from arnorm._errors import InvalidInputError

        raise InvalidInputError(
            "op: closed (needs a new arnorm.AllReduceNorm; this compiled code calls the op it was "
            "compiled with, which was closed or freed: compile the code again with the new op)"
        )
    return op


def _check_dests(op: Any, dests: Any, hidden_states: Any, residual: Any, weight: Any, scale: Any) -> None:
    """``out=``'s destinations against the call's inputs, on real tensors: what the eager call tests
    (a compiled call could only check shapes and dtypes, on fake tensors, when it was traced)."""
    if dests:
        from arnorm.op._caller_outputs import check_dests_overlap

        check_dests_overlap(op._plan.out_rules, list(dests), (hidden_states, residual, weight, scale))


def _fake_quant(op: Any, t: Any, device: torch.device) -> list[torch.Tensor]:
    """The quantized outputs' shapes and dtypes, from the format table (``t`` may be symbolic)."""
    import torch

    p = op._problem
    if p.quant is None:
        return []
    spec = FORMAT_SPECS[p.quant]
    out = [
        torch.empty(spec.data_shape(t, p.hidden_size), dtype=getattr(torch, spec.data_dtype), device=device)
    ]
    shape = spec.scale_shape(t, p.hidden_size, p.scale_layout)
    if shape is not None:
        scale_dtype = spec.scale_dtype_in(p.scale_layout)
        assert scale_dtype is not None
        out.append(torch.empty(shape, dtype=getattr(torch, scale_dtype), device=device))
    return out


def _fake_outputs(op: Any, hidden_states: torch.Tensor, with_residual: bool) -> tuple[torch.Tensor, ...]:
    import torch

    t = hidden_states.shape[0]
    normed = torch.empty_like(hidden_states) if op._problem.normed_output else _placeholder(hidden_states)
    q = [*_fake_quant(op, t, hidden_states.device), _placeholder(hidden_states), _placeholder(hidden_states)]
    head = (torch.empty_like(hidden_states),) if with_residual else ()
    return (*head, normed, q[0], q[1])


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    # The ops return a fixed tuple (torch cannot functionalize a mutating op returning Tensor[]):
    # an absent output travels as an empty tensor.
    import torch

    return torch.empty(0, dtype=torch.uint8, device=like.device)


def _flatten(out: Output, hidden_states: torch.Tensor, with_residual: bool) -> tuple[torch.Tensor, ...]:
    q = out.quant
    data = q.data if q is not None else _placeholder(hidden_states)
    # fp8_static's scale is the caller's own tensor: an output may not alias an input.
    scale = (
        q.scale
        if q is not None and not FORMAT_SPECS[q.format].returns_input_scale
        else _placeholder(hidden_states)
    )
    normed = out.normed if out.normed is not None else _placeholder(hidden_states)
    head = (out.residual,) if with_residual else ()
    return (*head, normed, data, scale)


def _unflatten(op: Any, residual: torch.Tensor, normed: Any, data: Any, qscale: Any, scale: Any) -> Output:
    p = op._problem
    quant = None
    if p.quant is not None:
        spec = FORMAT_SPECS[p.quant]
        quant = QuantizedActivation(
            data,
            scale if spec.returns_input_scale else qscale,
            p.quant,
            p.scale_layout if spec.block_size else None,
            scale if spec.keeps_global_scale else None,
        )
    return Output(normed if p.normed_output else None, residual, quant)


def _define_ops() -> None:
    global _defined
    with _lock:
        if _defined:
            return
        import torch

        # Explicit schemas: annotations here are strings (future import) that infer_schema cannot evaluate.
        @torch.library.custom_op(
            "arnorm::all_reduce_norm_",
            mutates_args=("hidden_states",),
            schema="(int handle, Tensor(a!) hidden_states, Tensor? residual, Tensor weight, Tensor? scale,"
            " Tensor[]? dests=None) -> (Tensor, Tensor, Tensor)",
        )
        def all_reduce_norm_(
            handle: int,
            hidden_states: torch.Tensor,
            residual: torch.Tensor | None,
            weight: torch.Tensor,
            scale: torch.Tensor | None,
            dests: list[torch.Tensor] | None = None,
        ) -> tuple[torch.Tensor, ...]:
            op = _lookup(handle)
            _check_dests(op, dests, hidden_states, residual, weight, scale)
            return _flatten(op(hidden_states, residual, weight, scale), hidden_states, False)

        @all_reduce_norm_.register_fake
        def _(handle, hidden_states, residual, weight, scale, dests=None):  # type: ignore[no-untyped-def]
            return _fake_outputs(_lookup(handle), hidden_states, False)

        @torch.library.custom_op(
            "arnorm::all_reduce_norm",
            mutates_args=(),
            schema="(int handle, Tensor hidden_states, Tensor? residual, Tensor weight, Tensor? scale,"
            " Tensor[]? dests=None) -> (Tensor, Tensor, Tensor, Tensor)",
        )
        def all_reduce_norm(
            handle: int,
            hidden_states: torch.Tensor,
            residual: torch.Tensor | None,
            weight: torch.Tensor,
            scale: torch.Tensor | None,
            dests: list[torch.Tensor] | None = None,
        ) -> tuple[torch.Tensor, ...]:
            op = _lookup(handle)
            _check_dests(op, dests, hidden_states, residual, weight, scale)
            # The functional op never writes its inputs; an in-place op reaches it only with autograd
            # recording (see the module docstring) and works on a copy.
            hs = hidden_states.clone() if op._problem.inplace else hidden_states
            if op._problem.output_layout == "in_place" and residual is not None:
                residual = residual.clone()
            return _flatten(op(hs, residual, weight, scale), hs, True)

        @all_reduce_norm.register_fake
        def _(handle, hidden_states, residual, weight, scale, dests=None):  # type: ignore[no-untyped-def]
            return _fake_outputs(_lookup(handle), hidden_states, True)

        @torch.library.custom_op(
            "arnorm::all_reduce_norm_in_place",
            mutates_args=("hidden_states", "residual"),
            schema="(int handle, Tensor(a!) hidden_states, Tensor(b!) residual, Tensor weight, Tensor? scale,"
            " Tensor[]? dests=None) -> (Tensor, Tensor)",
        )
        def all_reduce_norm_in_place(
            handle: int,
            hidden_states: torch.Tensor,
            residual: torch.Tensor,
            weight: torch.Tensor,
            scale: torch.Tensor | None,
            dests: list[torch.Tensor] | None = None,
        ) -> tuple[torch.Tensor, ...]:
            op = _lookup(handle)
            _check_dests(op, dests, hidden_states, residual, weight, scale)
            return _flatten(op(hidden_states, residual, weight, scale), hidden_states, False)[1:]

        @all_reduce_norm_in_place.register_fake
        def _(handle, hidden_states, residual, weight, scale, dests=None):  # type: ignore[no-untyped-def]
            return _fake_outputs(_lookup(handle), hidden_states, False)[1:]

        # The backward is an op of its own: AOT autograd traces it at compile time through the
        # fake (so compiling a model whose parameters require grad works), and running it raises.
        @torch.library.custom_op("arnorm::inference_only", mutates_args=(), schema="(Tensor like) -> Tensor")
        def inference_only(like: torch.Tensor) -> torch.Tensor:
            from arnorm._errors import InferenceOnlyError
            from arnorm.op._results import INFERENCE_ONLY

            raise InferenceOnlyError(INFERENCE_ONLY)

        @inference_only.register_fake
        def _(like):  # type: ignore[no-untyped-def]
            return torch.empty_like(like)

        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            # Shapes only, no saved tensors: an in-place op copies the result back into
            # hidden_states right after this op, and a saved hidden_states would then fail
            # autograd's version check when AOT autograd traces the backward (compiling in grad mode).
            ctx.likes = [None if t is None else (t.shape, t.dtype, t.device) for t in inputs[1:4]]

        def backward(ctx: Any, *grads: Any) -> Any:
            # Every differentiable input gets the raising op as its gradient, so that whichever
            # one autograd needs (a weight that is a parameter, usually) runs it.
            marks = [
                None
                if m is None
                else torch.ops.arnorm.inference_only(torch.empty(m[0], dtype=m[1], device=m[2]))
                for m in ctx.likes
            ]
            # No gradient for the handle, scale and dests (as many as the call passed).
            return None, *marks, *([None] * (len(ctx.needs_input_grad) - 1 - len(marks)))

        all_reduce_norm.register_autograd(backward, setup_context=setup_context)
        _defined = True


def call_custom_op(
    op: Any,
    handle: int,
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    scale: Any,
    dests: list[torch.Tensor] | None = None,
) -> Output:
    """The compiled-graph path of ``AllReduceNorm.__call__``; ``dests``: ``out=``'s destinations,
    tested against the inputs when the graph runs (:func:`_check_dests`)."""
    import torch

    grad = torch.is_grad_enabled() and (
        hidden_states.requires_grad
        or (residual is not None and residual.requires_grad)
        or weight.requires_grad
    )
    if op._problem.output_layout == "in_place" and residual is not None:
        if grad:
            h, normed, data, qscale = torch.ops.arnorm.all_reduce_norm(
                handle, hidden_states, residual, weight, scale, dests
            )
            residual.copy_(h)
            if op._problem.normed_output:
                hidden_states.copy_(normed)
        else:
            data, qscale = torch.ops.arnorm.all_reduce_norm_in_place(
                handle, hidden_states, residual, weight, scale, dests
            )
        return _unflatten(op, residual, hidden_states, data, qscale, scale)
    if op._problem.inplace and grad:
        h, normed, data, qscale = torch.ops.arnorm.all_reduce_norm(
            handle, hidden_states, residual, weight, scale, dests
        )
        hidden_states.copy_(h)
        return _unflatten(op, hidden_states, normed, data, qscale, scale)
    if op._problem.inplace:
        normed, data, qscale = torch.ops.arnorm.all_reduce_norm_(
            handle, hidden_states, residual, weight, scale, dests
        )
        return _unflatten(op, hidden_states, normed, data, qscale, scale)
    h, normed, data, qscale = torch.ops.arnorm.all_reduce_norm(
        handle, hidden_states, residual, weight, scale, dests
    )
    return _unflatten(op, h, normed, data, qscale, scale)
