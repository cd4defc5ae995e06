"""An op's constructor arguments checked and turned into a :class:`Problem` (before any collective)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from arnorm._errors import InvalidInputError
from arnorm._formats import DTYPES
from arnorm._problem import OUTPUT_LAYOUTS, Problem
from arnorm._types import RMSNorm

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_HIDDEN_SIZE", "MAX_TOKENS", "build_problem", "platform_of", "resolve_device"]

#: The largest ``max_tokens``: construction asks each backend about every token count up to it and
#: keeps a dispatch entry per count, so its time and memory grow with it (2**31 would need tens of
#: GB before failing; a million counts take about a second).
MAX_TOKENS = 1 << 20
#: The largest ``hidden_size``: 64 times the widest model's (16,384 to 28,672), one fp32 row already
#: 4 MiB. Larger is a mistake that would otherwise surface as an out-of-memory error at the first
#: call, on some ranks only; and row offsets ``max_tokens * hidden_size`` stay within 2**40.
MAX_HIDDEN_SIZE = 1 << 20


def platform_of(device: torch.device) -> tuple[str, tuple[int, int] | None, str | None]:
    """``(platform, CUDA compute capability, ROCm gfx name)`` of ``device``."""
    import torch

    if device.type != "cuda":
        return device.type, None, None
    if torch.version.hip:
        gfx = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        return "rocm", None, gfx
    return "cuda", tuple(torch.cuda.get_device_capability(device)), None  # type: ignore[return-value]


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInputError(f"{name}: {value!r} (needs a positive int)")
    return value


def resolve_device(device: object) -> torch.device:
    """The op's device: given, else the current CUDA device, else CPU; ``cuda`` gets its index."""
    import torch

    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        raise InvalidInputError(
            f"device: {device!r} (needs a torch.device, e.g. 'cuda:0' or 'cpu')"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError(
                f"device: {dev} (needs a visible CUDA device; torch.cuda.is_available() is False)"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise InvalidInputError(f"device: {dev} (needs cpu or cuda)")
    return dev


def build_problem(
    world_size: int,
    *,
    hidden_size: object,
    dtype: object,
    norm: object,
    quant: object,
    scale_layout: object,
    max_tokens: object,
    normed_output: object,
    inplace: object,
    device: torch.device,
    add_residual: object = True,
    output_layout: object = "separate",
) -> Problem:
    """Check an op's arguments and describe them as a :class:`Problem` (raises InvalidInputError)."""
    import torch

    hidden = _positive_int("hidden_size", hidden_size)
    if hidden > MAX_HIDDEN_SIZE:
        raise InvalidInputError(
            f"hidden_size: {hidden} (needs an int from 1 to {MAX_HIDDEN_SIZE}: no model's rows are "
            "that wide, and buffers of such rows would fail to allocate at the first call)"
        )
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None
    if name not in DTYPES:
        raise InvalidInputError(f"dtype: {dtype!r} (needs torch.bfloat16, torch.float16 or torch.float32)")
    if not isinstance(norm, RMSNorm):
        raise InvalidInputError(
            f"norm: {type(norm).__name__} (needs arnorm.RMSNorm(eps=..., weight_offset=...))"
        )
    tokens = _positive_int("max_tokens", max_tokens)
    if tokens > MAX_TOKENS:
        raise InvalidInputError(
            f"max_tokens: {tokens} (needs an int from 1 to {MAX_TOKENS}: construction asks each backend "
            "about every token count up to it; split larger batches into calls of at most that many)"
        )
    for arg, value in (
        ("normed_output", normed_output),
        ("inplace", inplace),
        ("add_residual", add_residual),
    ):
        if not isinstance(value, bool):
            raise InvalidInputError(f"{arg}: {value!r} (needs True or False)")
    layout = None
    if quant is not None:
        from arnorm.quant import check_format

        layout = check_format(quant, scale_layout, hidden)  # type: ignore[arg-type]
    elif scale_layout is not None:
        raise InvalidInputError(f"scale_layout: {scale_layout!r} (needs None when quant is None)")
    if not normed_output and quant is None:
        raise InvalidInputError(
            "normed_output: False with quant=None (needs normed_output=True or a quant format)"
        )
    _check_output_layout(output_layout, inplace, add_residual)
    platform, arch, gfx = platform_of(device)
    return Problem(
        world_size=world_size,
        hidden_size=hidden,
        dtype=name,
        eps=float(norm.eps),
        weight_offset=float(norm.weight_offset),
        quant=quant,  # type: ignore[arg-type]
        scale_layout=layout,
        max_tokens=tokens,
        normed_output=bool(normed_output),
        inplace=bool(inplace),
        device_type=device.type,
        platform=platform,
        arch=arch,
        gfx_arch=gfx,
        # Options void for this problem (NormOption.is_void) are dropped by Problem itself.
        norm_options=norm.options,
        add_residual=bool(add_residual),
        output_layout=output_layout,  # type: ignore[arg-type]
    )


def _check_output_layout(output_layout: object, inplace: object, add_residual: object) -> None:
    if output_layout not in OUTPUT_LAYOUTS:
        choices = " or ".join(repr(v) for v in OUTPUT_LAYOUTS)
        raise InvalidInputError(f"output_layout: {output_layout!r} (needs {choices})")
    if output_layout != "in_place":
        return
    # The layout writes over both inputs: the normed output over hidden_states, the new residual
    # over residual. With nothing to write over, or an op asked to leave its inputs alone, it has
    # no meaning.
    if not inplace:
        raise InvalidInputError(
            "output_layout: 'in_place' with inplace=False (needs inplace=True: the layout writes the "
            "normed output over hidden_states and the new residual over residual; or output_layout="
            "'separate' to leave the inputs unwritten)"
        )
    if not add_residual:
        raise InvalidInputError(
            "output_layout: 'in_place' with add_residual=False (needs add_residual=True: the layout "
            "writes the new residual over residual, or output_layout='separate')"
        )
