"""Input checks with messages that name the argument, what was found and what is needed.

The op's hot path tests a single combined condition and calls :func:`check_call` only when it
fails, so a valid call pays for none of the string building here. The checks depend only on the
arguments and the op, so every rank that passes the same shapes raises the same error before any
collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arnorm._errors import InvalidInputError

if TYPE_CHECKING:
    import torch

    from arnorm._problem import Problem

__all__ = ["check_call", "needs_scale"]


def needs_scale(quant: str | None) -> bool:
    """fp8_static takes the dequant scale, nvfp4 the global encode scale; the others compute theirs."""
    return quant in ("fp8_static", "nvfp4")


def _device(t: torch.Tensor) -> str:
    return str(t.device)


def check_call(
    problem: Problem,
    dtype: torch.dtype,
    device: torch.device,
    hidden_states: object,
    residual: object,
    weight: object,
    scale: object,
) -> None:
    """Raise :class:`InvalidInputError` for the first thing wrong with a call's arguments."""
    import torch

    h, t_max = problem.hidden_size, problem.max_tokens
    for arg, t in (("hidden_states", hidden_states), ("residual", residual), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{arg}: {type(t).__name__} (needs a torch.Tensor)")
    assert isinstance(hidden_states, torch.Tensor) and isinstance(residual, torch.Tensor)
    assert isinstance(weight, torch.Tensor)
    shape = tuple(hidden_states.shape)
    if len(shape) != 2 or shape[1] != h:
        raise InvalidInputError(f"hidden_states: shape {list(shape)} (needs [tokens, {h}], hidden_size={h})")
    if shape[0] < 1 or shape[0] > t_max:
        raise InvalidInputError(
            f"hidden_states: {shape[0]} tokens (needs 1 to {t_max}; build the op with a larger max_tokens)"
        )
    if tuple(residual.shape) != shape:
        raise InvalidInputError(
            f"residual: shape {list(residual.shape)} (needs {list(shape)}, the shape of hidden_states)"
        )
    if tuple(weight.shape) != (h,):
        raise InvalidInputError(f"weight: shape {list(weight.shape)} (needs [{h}])")
    for arg, t in (("hidden_states", hidden_states), ("residual", residual), ("weight", weight)):
        if t.dtype != dtype:
            raise InvalidInputError(f"{arg}: dtype {t.dtype} (needs {dtype}, the op's dtype)")
        if t.device != device:
            raise InvalidInputError(f"{arg}: device {_device(t)} (needs {device}, the op's device)")
        if not t.is_contiguous():
            raise InvalidInputError(
                f"{arg}: non-contiguous, strides {list(t.stride())} (needs .contiguous())"
            )
    if needs_scale(problem.quant):
        what = "dequant" if problem.quant == "fp8_static" else "global encode"
        if scale is None:
            raise InvalidInputError(
                f"scale: missing (needs the fp32 [1] {what} scale for quant={problem.quant!r})"
            )
        if not isinstance(scale, torch.Tensor):
            raise InvalidInputError(
                f"scale: {type(scale).__name__} (needs a torch.Tensor of dtype float32, shape [1])"
            )
        if scale.dtype != torch.float32:
            raise InvalidInputError(f"scale: dtype {scale.dtype} (needs torch.float32)")
        if tuple(scale.shape) != (1,):
            raise InvalidInputError(f"scale: shape {list(scale.shape)} (needs [1])")
        if scale.device != device:
            raise InvalidInputError(f"scale: device {_device(scale)} (needs {device}, the op's device)")
    elif scale is not None:
        raise InvalidInputError(f"scale: a tensor (needs None: quant={problem.quant!r} takes no input scale)")
    if hidden_states.data_ptr() == residual.data_ptr():
        raise InvalidInputError("residual: the same buffer as hidden_states (needs a separate tensor)")
