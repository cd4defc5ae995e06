"""Argument checks shared by the quantizers; every message reads ``"<argument>: <found> (needs <required>)"``.

Nothing here reads a tensor's values (no host sync): only names, dtypes, shapes and devices.
"""

from __future__ import annotations

import torch

from arnorm._errors import InvalidInputError
from arnorm._formats import DTYPES, FORMAT_SPECS, QUANT_FORMATS, round_up

__all__ = [
    "check_format",
    "check_input",
    "check_scale",
    "default_layout",
    "round_up",
]

#: The dtypes of the normed input ``y``: arnorm's activation dtypes.
_INPUT_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, d) for d in DTYPES)
_NEEDS_DTYPE = ", ".join(f"torch.{d}" for d in DTYPES[:-1]) + f" or torch.{DTYPES[-1]}"


def _fail(argument: str, found: str, needs: str) -> InvalidInputError:
    return InvalidInputError(f"{argument}: {found} (needs {needs})")


def _check_format_name(format: object) -> str:
    if not isinstance(format, str) or format not in FORMAT_SPECS:
        raise _fail("quant", repr(format), "one of " + ", ".join(QUANT_FORMATS))
    return format


def default_layout(format: str) -> str | None:
    """The scale layout used when none is given: nvfp4 ``swizzled_128x4``, mxfp8 ``linear``, fp8 ``None``."""
    return FORMAT_SPECS[_check_format_name(format)].default_layout


def check_format(format: str, layout: str | None, hidden_size: int) -> str | None:
    """Check a format name, its scale layout and the hidden size; return the resolved layout.

    fp8_static and fp8_per_token have no block scales, so their layout must be ``None`` (and ``None``
    is returned). A block format takes one of its table record's layouts (``FormatSpec.layouts``);
    ``None`` picks :func:`default_layout`.
    """
    fmt = _check_format_name(format)
    spec = FORMAT_SPECS[fmt]
    if spec.block_size:
        if layout is None:
            resolved = spec.default_layout
        elif isinstance(layout, str) and layout in spec.layouts:
            resolved = layout
        else:
            raise _fail("layout", repr(layout), f"{' or '.join(spec.layouts)} for {fmt}")
    elif layout is not None:
        raise _fail("layout", repr(layout), f"None for {fmt}, which has no block scales")
    else:
        resolved = None
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise _fail("hidden_size", repr(hidden_size), "a positive int")
    if hidden_size % spec.hidden_multiple:
        raise _fail("hidden_size", str(hidden_size), f"a multiple of {spec.hidden_multiple} for {fmt}")
    return resolved


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_scale(format: str, scale: torch.Tensor | None, device: torch.device | str) -> None:
    """Check the ``scale`` argument of a format: dtype, shape and device, never its value.

    fp8_static and nvfp4 need an fp32 tensor of shape ``[1]`` on ``device``; that it is finite and
    positive is the caller's contract (checking it would sync with the device). fp8_per_token and
    mxfp8 compute their own scales and need ``scale=None``.
    """
    fmt = _check_format_name(format)
    device = torch.device(device)
    if not FORMAT_SPECS[fmt].takes_scale:
        if scale is not None:
            raise _fail("scale", type(scale).__name__, f"None for {fmt}, which computes its own scales")
        return
    needs = f"an fp32 tensor of shape [1] for {fmt}"
    if scale is None:
        raise _fail("scale", "missing", needs)
    if not isinstance(scale, torch.Tensor):
        raise _fail("scale", type(scale).__name__, needs)
    if scale.dtype != torch.float32:
        raise _fail("scale", f"dtype {scale.dtype}", "torch.float32")
    if tuple(scale.shape) != (1,):
        raise _fail("scale", f"shape {list(scale.shape)}", "[1]")
    if not _same_device(scale.device, device):
        raise _fail("scale", f"device {scale.device}", f"{device}, the input's device")


def check_input(y: object) -> torch.Tensor:
    """Check the normed input: a 2-D ``[T, H]`` tensor in bf16, fp16 or fp32."""
    if not isinstance(y, torch.Tensor):
        raise _fail("y", type(y).__name__, "a torch.Tensor")
    if y.dtype not in _INPUT_DTYPES:
        raise _fail("y", f"dtype {y.dtype}", _NEEDS_DTYPE)
    if y.dim() != 2:
        raise _fail("y", f"shape {list(y.shape)}", "2-D [T, H]")
    return y
