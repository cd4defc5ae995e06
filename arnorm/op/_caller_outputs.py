"""Caller-provided outputs (``op(..., out=...)``): the rule, its messages, and trust by identity.

An engine that keeps its activation buffers passes them as ``out``, an :class:`arnorm.Output` for
exactly the call's ``T`` tokens, as :meth:`arnorm.AllReduceNorm.empty_output` allocates it or as
an earlier call returned it. The call writes into:

- ``out.normed``: ``[T, H]`` in the op's dtype, contiguous (``None`` when the op has no normed output);
- ``out.residual``: ``[T, H]``, contiguous, when the op is not in place (an in-place op writes the
  residual into ``hidden_states``, and ignores this field);
- ``out.quant.data`` and, for the formats that compute their scales (fp8_per_token, nvfp4, mxfp8),
  ``out.quant.scale``: shaped, typed and laid out as :func:`arnorm.quant.empty_quantized` makes them
  (fp8_static's scale and nvfp4's global scale are the call's ``scale``; those fields are ignored).

Every destination is a distinct, contiguous tensor on the op's device that shares no byte with
another destination or with ``hidden_states``, ``residual``, ``weight`` or ``scale``. An ``out``
that passed the full check is trusted afterwards by identity, with its destinations' data pointers
and shapes compared on each call (a ``t.data = ...`` swap or a ``resize_`` is checked again); the
overlap with the call's inputs is tested on every call, from the spans remembered at the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from arnorm._errors import InvalidInputError
from arnorm._formats import FORMAT_SPECS
from arnorm._types import Output, QuantizedActivation

if TYPE_CHECKING:
    import torch

__all__ = [
    "OutRules",
    "Spans",
    "check_dests_overlap",
    "check_out",
    "check_out_tensors",
    "checked_out",
    "dest_shapes",
    "empty_output",
    "span",
]


@dataclass(frozen=True)
class OutRules:
    """What one op writes: fixed at construction."""

    hidden: int
    dtype: torch.dtype
    device: torch.device
    quant: str | None
    layout: str | None
    normed: bool
    inplace: bool
    #: The in-place layout: the normed output goes over ``hidden_states`` (no ``out.normed``) and
    #: the new residual over ``residual``.
    normed_over_input: bool = False


class Spans(NamedTuple):
    """A checked ``out`` for ``rows`` tokens: each destination with the data pointer it had, its
    ``[start, end)`` byte range (tested against the call's inputs on every call, each on its own:
    an envelope of them would meet unrelated inputs that a caching allocator placed in between) and
    its shape (an in-place ``resize_`` that shrinks a buffer keeps its data pointer)."""

    rows: int
    dests: tuple[tuple[Any, int, int, Any], ...]


def span(t: Any, rows: int, cols: int) -> tuple[int, int]:
    """``[start, end)`` byte addresses of a ``[rows, cols]`` tensor with unit column stride."""
    start = t.data_ptr()
    row_stride = t.stride(0) if t.dim() == 2 else cols
    return start, start + ((rows - 1) * row_stride + cols) * t.element_size()


def dest_shapes(rules: OutRules, t: int) -> list[tuple[str, str, tuple[int, ...], Any]]:
    """``(argument, field, shape, dtype)`` of every destination for ``t`` tokens."""
    import torch

    dests: list[tuple[str, str, tuple[int, ...], Any]] = []
    if rules.normed and not rules.normed_over_input:
        dests.append(("out.normed", "normed", (t, rules.hidden), rules.dtype))
    if not rules.inplace:
        dests.append(("out.residual", "residual", (t, rules.hidden), rules.dtype))
    if rules.quant is not None:
        spec = FORMAT_SPECS[rules.quant]
        dests.append(
            ("out.quant.data", "data", spec.data_shape(t, rules.hidden), getattr(torch, spec.data_dtype))
        )
        shape = spec.scale_shape(t, rules.hidden, rules.layout)
        if shape is not None:
            scale_dtype = spec.scale_dtype_in(rules.layout)
            assert scale_dtype is not None
            dests.append(("out.quant.scale", "scale", shape, getattr(torch, scale_dtype)))
    return dests


def _field(out: Output, field: str) -> Any:
    if field in ("normed", "residual"):
        return getattr(out, field)
    return getattr(out.quant, field)


def check_out_tensors(rules: OutRules, out: object, t: int) -> list[tuple[str, Any]]:
    """Check ``out``'s structure and each destination's type, dtype, shape, device, layout and
    autograd state for ``t`` tokens (no data pointers: a compiled call checks this much on fake
    tensors); raise :class:`InvalidInputError` for the first thing wrong, else return
    ``(argument, tensor)`` per destination."""
    import torch

    if not isinstance(out, Output):
        raise InvalidInputError(
            f"out: {type(out).__name__} (needs an arnorm.Output, e.g. op.empty_output({t}))"
        )
    if rules.quant is None and out.quant is not None:
        raise InvalidInputError("out.quant: QuantizedActivation (needs None: the op does not quantize)")
    if rules.quant is not None:
        q = out.quant
        if not isinstance(q, QuantizedActivation):
            raise InvalidInputError(
                f"out.quant: {type(q).__name__} "
                f"(needs an arnorm.QuantizedActivation of format {rules.quant!r})"
            )
        if q.format != rules.quant:
            raise InvalidInputError(
                f"out.quant.format: {q.format!r} (needs {rules.quant!r}, the op's format)"
            )
        if rules.layout is not None and q.layout != rules.layout:
            raise InvalidInputError(
                f"out.quant.layout: {q.layout!r} (needs {rules.layout!r}, the op's layout)"
            )
    if not rules.normed and out.normed is not None:
        raise InvalidInputError("out.normed: Tensor (needs None: the op was built with normed_output=False)")
    if rules.normed_over_input and (out.normed is not None or out.residual is not None):
        arg = "out.normed" if out.normed is not None else "out.residual"
        raise InvalidInputError(
            f"{arg}: Tensor (needs None: the op was built with output_layout='in_place', which writes "
            "the normed output over hidden_states and the new residual over residual)"
        )
    dests = []
    for arg, field, shape, dtype in dest_shapes(rules, t):
        d = _field(out, field)
        if not isinstance(d, torch.Tensor):
            raise InvalidInputError(
                f"{arg}: {type(d).__name__} (needs a torch.Tensor of shape {list(shape)})"
            )
        if d.layout != torch.strided or d.is_nested:
            raise InvalidInputError(f"{arg}: layout {d.layout} (needs a dense torch.strided tensor)")
        if d.dtype != dtype:
            raise InvalidInputError(f"{arg}: dtype {d.dtype} (needs {dtype})")
        if tuple(d.shape) != shape:
            raise InvalidInputError(f"{arg}: shape {list(d.shape)} (needs {list(shape)} for {t} tokens)")
        if d.device != rules.device:
            raise InvalidInputError(f"{arg}: device {d.device} (needs {rules.device}, the op's device)")
        if not d.is_contiguous():
            raise InvalidInputError(
                f"{arg}: non-contiguous, strides {list(d.stride())} (needs .contiguous())"
            )
        if d.requires_grad:
            raise InvalidInputError(
                f"{arg}: requires grad (needs a buffer without autograd history: .detach())"
            )
        dests.append((arg, d))
    return dests


def check_out(rules: OutRules, out: object, t: int) -> Spans:
    """Check ``out`` for ``t`` tokens on its own (not against the call's inputs): its tensors
    (:func:`check_out_tensors`), no negative bit, 16-byte alignment, and no two destinations
    sharing a byte; raise
    :class:`InvalidInputError` for the first thing wrong, else return its :class:`Spans`."""
    dests = check_out_tensors(rules, out, t)
    ranges: list[tuple[int, int]] = []
    for arg, d in dests:
        # Written through its pointer, the bit would negate what the caller reads back. (Not in
        # check_out_tensors: a compiled call copies into out with torch ops, which honour it.)
        if d.is_neg() or d.is_conj():
            raise InvalidInputError(
                f"{arg}: negative bit set, a lazy negation such as torch._neg_view(t) (needs a plain "
                "buffer: backends write the memory, not the bit)"
            )
        start = d.data_ptr()
        if start % 16:
            raise InvalidInputError(
                f"{arg}: data pointer {start:#x} (needs 16-byte alignment, as torch.empty gives; "
                "slice buffers at row boundaries of an aligned allocation)"
            )
        end = start + d.numel() * d.element_size()
        for j, (a, b) in enumerate(ranges):
            if start < b and a < end:
                raise InvalidInputError(f"{arg}: overlaps {dests[j][0]} (needs a separate buffer)")
        ranges.append((start, end))
    return Spans(t, tuple((d, a, b, d.shape) for (_, d), (a, b) in zip(dests, ranges, strict=True)))


def check_out_inputs(spans: Spans, rules: OutRules, inputs: tuple[tuple[str, Any], ...]) -> None:
    """Raise when a destination shares a byte with one of the call's ``(name, tensor)`` inputs."""
    names = [d[0] for d in dest_shapes(rules, spans.rows)]
    for name, t in inputs:
        if t is None:
            continue
        rows, cols = (t.shape[0], t.shape[1]) if t.dim() == 2 else (1, t.numel())
        a, b = span(t, rows, cols)
        for arg, (_, s, e, _) in zip(names, spans.dests, strict=True):
            if s < b and a < e:
                raise InvalidInputError(f"{arg}: overlaps {name} (needs a separate buffer)")


def check_dests_overlap(rules: OutRules, dests: list[Any], inputs: tuple[Any, ...]) -> None:
    """Raise when two of ``dests`` (``out``'s destinations in :func:`dest_shapes`' order, already
    checked on their own) share a byte, or one shares a byte with an input of ``inputs``
    (``hidden_states, residual, weight, scale``): the byte tests of :func:`check_out` and
    :func:`checked_out`, for a compiled call whose ``out`` was checked on fake tensors."""
    t = inputs[0].shape[0]
    names = [d[0] for d in dest_shapes(rules, t)]
    spans: list[tuple[Any, int, int, Any]] = []
    for j, d in enumerate(dests):
        start = d.data_ptr()
        end = start + d.numel() * d.element_size()
        for i, (_, a, b, _) in enumerate(spans):
            if start < b and a < end:
                raise InvalidInputError(f"{names[j]}: overlaps {names[i]} (needs a separate buffer)")
        spans.append((d, start, end, d.shape))
    labels = ("hidden_states", "residual", "weight", "scale")
    check_out_inputs(Spans(t, tuple(spans)), rules, tuple(zip(labels, inputs, strict=True)))


def checked_out(rules: OutRules, out: object, t: int, tensors: tuple[Any, ...]) -> Spans:
    """Raise :class:`InvalidInputError` unless ``out`` fits ``t`` tokens and shares no byte with the
    call's inputs ``tensors`` (``hidden_states, residual, weight, scale``, each ``None`` where
    absent); else its :class:`Spans`, which the call trusts by identity afterwards."""
    s = check_out(rules, out, t)
    names = ("hidden_states", "residual", "weight", "scale")
    check_out_inputs(s, rules, tuple(zip(names, tensors, strict=True)))
    return s


def empty_output(rules: OutRules, t: int, scale: Any = None) -> Output:
    """Uninitialized destinations for ``t`` tokens (``residual`` is ``None`` for an in-place op)."""
    import torch

    from arnorm.quant import empty_quantized

    own_normed = rules.normed and not rules.normed_over_input
    normed = torch.empty(t, rules.hidden, dtype=rules.dtype, device=rules.device) if own_normed else None
    residual = None if rules.inplace else torch.empty(t, rules.hidden, dtype=rules.dtype, device=rules.device)
    quant = None
    if rules.quant is not None:
        spec = FORMAT_SPECS[rules.quant]
        if spec.takes_scale and scale is None:
            # The scale the output records (fp8_static's, nvfp4's global one) is the call's; out=
            # ignores the field, so any fp32 [1] fits.
            scale = torch.ones(1, dtype=torch.float32, device=rules.device)
        quant = empty_quantized(
            rules.quant, t, rules.hidden, device=rules.device, layout=rules.layout,
            scale=scale if spec.takes_scale else None,
        )  # fmt: skip
    return Output(normed, residual, quant)  # type: ignore[arg-type]
