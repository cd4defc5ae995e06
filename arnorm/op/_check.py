"""The one rule for a call's arguments, with messages that name the argument, what was found and the fix.

:class:`CallRules` holds what an op fixed at construction. The op's hot path tests the same rule
as one combined expression (``arnorm.op._call``) and calls :func:`check_call` only when it fails, so
a valid call pays for none of the string building here; a property test holds the two to accepting
exactly the same inputs. The rule depends only on the arguments and the op, so every rank that
passes the same shapes raises the same error before any collective.

A call is accepted when:

- ``residual`` is ``None`` exactly when the op was built with ``add_residual=False``;
- ``hidden_states`` and ``residual`` are ``[T, H]`` tensors of the op's dtype on the op's device
  (a meta tensor is never on it), ``1 <= T <= max_tokens``, with contiguous rows: contiguous, or,
  when every backend of the op takes strided rows, column stride 1 and row stride ``>= H``;
- ``residual``, ``weight`` and ``scale`` share no byte with ``hidden_states`` (its memory range:
  the op may write it, and a residual read through another view of it gives wrong sums);
- ``weight`` is a contiguous ``[H]`` tensor of the op's dtype on its device;
- ``scale`` is an fp32 ``[1]`` tensor on the device for fp8_static / nvfp4, else ``None``;
- no tensor has the negative or conjugate bit set (``torch._neg_view``, ``z.conj().imag``): a
  backend reads the memory through its data pointer, where the lazy negation is not applied;
- with autograd recording, an in-place op is not handed a leaf ``hidden_states`` that requires grad,
  nor an op of the in-place layout (``output_layout="in_place"``) a leaf ``residual`` that does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from arnorm._errors import InvalidInputError
from arnorm._formats import FORMAT_SPECS

if TYPE_CHECKING:
    import torch

__all__ = ["CallRules", "check_call", "check_lazy_bits", "needs_scale", "span"]


def needs_scale(quant: str | None) -> bool:
    """fp8_static takes the dequant scale, nvfp4 the global encode scale; the others compute theirs."""

    return quant is not None and FORMAT_SPECS[quant].takes_scale


@dataclass(frozen=True)
class CallRules:
    """What one op accepts; see the module docstring."""

    hidden: int
    max_tokens: int
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    quant: str | None
    needs_scale: bool
    inplace: bool
    strided_rows: bool
    add_residual: bool = True
    #: The in-place layout: the new residual is written over ``residual``.
    writes_residual: bool = False


def span(t: Any, rows: int, cols: int) -> tuple[int, int]:
    """``[start, end)`` byte addresses of a ``[rows, cols]`` tensor with unit column stride."""
    start = t.data_ptr()
    row_stride = t.stride(0) if t.dim() == 2 else cols
    return start, start + ((rows - 1) * row_stride + cols) * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _rows_ok(t: Any, rules: CallRules) -> bool:
    if not rules.strided_rows:
        return bool(t.is_contiguous())
    rows, h = t.stride()
    return (h == 1 or rules.hidden == 1) and (t.shape[0] == 1 or rows >= rules.hidden)


def _layout_message(arg: str, t: Any, rules: CallRules) -> str:
    if rules.strided_rows:
        return (
            f"{arg}: strides {list(t.stride())} (needs column stride 1 and row stride >= {rules.hidden}; "
            "pass .contiguous())"
        )
    return (
        f"{arg}: non-contiguous, strides {list(t.stride())} (needs .contiguous(); this op's backends "
        "take no strided rows)"
    )


def _check_tensor(arg: str, t: object, rules: CallRules) -> torch.Tensor:
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{arg}: {type(t).__name__} (needs a torch.Tensor)")
    if t.layout != torch.strided or t.is_nested:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise InvalidInputError(f"{arg}: layout {layout} (needs a dense torch.strided tensor)")
    if t.dtype != rules.dtype:
        raise InvalidInputError(f"{arg}: dtype {t.dtype} (needs {rules.dtype}, the op's dtype)")
    if t.device != rules.device:
        raise InvalidInputError(f"{arg}: device {t.device} (needs {rules.device}, the op's device)")
    check_lazy_bits(arg, t)
    return t


def check_lazy_bits(arg: str, t: Any) -> None:
    """Raise for a tensor whose negation or conjugation is a bit, not its memory: a backend reading
    the data pointer (a Triton or CUDA kernel, a fast path) would ignore it and compute wrong values."""
    if t.is_neg():
        raise InvalidInputError(
            f"{arg}: negative bit set, a lazy negation such as torch._neg_view(t) or z.conj().imag "
            f"(needs {arg}.resolve_neg(): backends read the memory, not the bit)"
        )
    if t.is_conj():
        raise InvalidInputError(
            f"{arg}: conjugate bit set (needs {arg}.resolve_conj(): backends read the memory, not the bit)"
        )


def _check_residual(residual: object, shape: tuple[int, ...], rules: CallRules) -> torch.Tensor | None:
    if not rules.add_residual:
        if residual is not None:
            raise InvalidInputError(
                f"residual: {type(residual).__name__} (needs None: the op was built with add_residual=False)"
            )
        return None
    if residual is None:
        raise InvalidInputError(
            f"residual: None (needs a [tokens, {rules.hidden}] tensor; for a norm with no residual add, "
            "build the op with add_residual=False)"
        )
    res = _check_tensor("residual", residual, rules)
    if tuple(res.shape) != shape:
        raise InvalidInputError(
            f"residual: shape {list(res.shape)} (needs {list(shape)}, the shape of hidden_states)"
        )
    return res


def check_call(
    rules: CallRules, hidden_states: object, residual: object, weight: object, scale: object
) -> None:
    """Raise :class:`InvalidInputError` for the first thing wrong with a call's arguments."""
    import torch

    h, t_max = rules.hidden, rules.max_tokens
    hs = _check_tensor("hidden_states", hidden_states, rules)
    shape = tuple(hs.shape)
    if len(shape) != 2 or shape[1] != h:
        raise InvalidInputError(f"hidden_states: shape {list(shape)} (needs [tokens, {h}], hidden_size={h})")
    if not 1 <= shape[0] <= t_max:
        fix = "skip a call with no tokens" if shape[0] < 1 else "build the op with a larger max_tokens"
        raise InvalidInputError(f"hidden_states: {shape[0]} tokens (needs 1 to {t_max}; {fix})")
    res = _check_residual(residual, shape, rules)
    for arg, t in (("hidden_states", hs), ("residual", res)):
        if t is not None and not _rows_ok(t, rules):
            raise InvalidInputError(_layout_message(arg, t, rules))
    w = _check_tensor("weight", weight, rules)
    if tuple(w.shape) != (h,):
        raise InvalidInputError(f"weight: shape {list(w.shape)} (needs [{h}])")
    if not w.is_contiguous():
        raise InvalidInputError(f"weight: non-contiguous, strides {list(w.stride())} (needs .contiguous())")
    if rules.needs_scale:
        what = "dequant" if rules.quant and FORMAT_SPECS[rules.quant].returns_input_scale else "global encode"
        if scale is None:
            raise InvalidInputError(
                f"scale: missing (needs the fp32 [1] {what} scale for quant={rules.quant!r})"
            )
        if not isinstance(scale, torch.Tensor):
            raise InvalidInputError(
                f"scale: {type(scale).__name__} (needs a torch.Tensor of dtype float32, shape [1])"
            )
        if scale.dtype != torch.float32:
            raise InvalidInputError(f"scale: dtype {scale.dtype} (needs torch.float32)")
        if tuple(scale.shape) != (1,):
            raise InvalidInputError(f"scale: shape {list(scale.shape)} (needs [1])")
        if scale.device != rules.device:
            raise InvalidInputError(f"scale: device {scale.device} (needs {rules.device}, the op's device)")
        check_lazy_bits("scale", scale)
    elif scale is not None:
        raise InvalidInputError(
            f"scale: {type(scale).__name__} (needs None: quant={rules.quant!r} takes no input scale)"
        )
    hs_span = span(hs, shape[0], h)
    if res is not None and _overlap(hs_span, span(res, shape[0], h)):
        raise InvalidInputError("residual: overlaps hidden_states' memory (needs a separate buffer)")
    if _overlap(hs_span, span(w, 1, h)):
        raise InvalidInputError("weight: overlaps hidden_states' memory (needs a separate buffer)")
    if isinstance(scale, torch.Tensor) and _overlap(hs_span, span(scale, 1, 1)):
        raise InvalidInputError("scale: overlaps hidden_states' memory (needs a separate buffer)")
    if rules.inplace and torch.is_grad_enabled() and hs.requires_grad and hs.is_leaf:
        raise InvalidInputError(
            "hidden_states: a leaf tensor that requires grad (needs .detach() or torch.no_grad(): "
            "the op writes the new residual into it)"
        )
    written = res if rules.writes_residual else None
    if written is not None and torch.is_grad_enabled() and written.requires_grad and written.is_leaf:
        raise InvalidInputError(
            "residual: a leaf tensor that requires grad (needs .detach() or torch.no_grad(): the op, "
            "built with output_layout='in_place', writes the new residual into it)"
        )
