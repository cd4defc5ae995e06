"""Argument checks of arnorm.quant: names, layouts, hidden sizes, scales; each message exactly."""

from __future__ import annotations

import pytest
import torch

import arnorm.quant as quant
from arnorm._errors import InvalidInputError
from arnorm.quant import check_format, check_scale, default_layout, quantize

ALL_FORMATS = (
    "fp8_static, fp8_per_token, nvfp4, mxfp8, fp8_per_group, fp8_per_group_64, fp8_per_group_ue8m0, "
    "fp8_per_group_64_ue8m0, mxfp4"
)

CPU = torch.device("cpu")


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(InvalidInputError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_public_names() -> None:
    """The module exports exactly the fixed public API and the format/layout tuples."""
    assert quant.__all__ == [
        "FORMATS",
        "FORMAT_SPECS",
        "LAYOUTS",
        "FormatSpec",
        "check_format",
        "check_scale",
        "default_layout",
        "dequantize",
        "empty_quantized",
        "format_spec",
        "quantize",
        "swizzle_128x4",
        "unswizzle_128x4",
    ]
    assert tuple(ALL_FORMATS.split(", ")) == quant.FORMATS
    assert quant.LAYOUTS == ("linear", "swizzled_128x4", "column_major", "column_major_tma", "packed_ue8m0")


def test_default_layout() -> None:
    """nvfp4 defaults to swizzled_128x4, mxfp8 to linear, the fp8 formats to None."""
    assert [default_layout(f) for f in quant.FORMATS] == [None, None, "swizzled_128x4", *["linear"] * 6]
    assert _message(default_layout, "fp4") == "quant: 'fp4' (needs one of " + ALL_FORMATS + ")"


def test_check_format_resolves_layouts() -> None:
    """check_format returns the resolved layout: the default, the given one, or None for fp8."""
    assert check_format("fp8_static", None, 4100) is None
    assert check_format("fp8_per_token", None, 1) is None
    assert check_format("nvfp4", None, 4096) == "swizzled_128x4"
    assert check_format("nvfp4", "linear", 16) == "linear"
    assert check_format("mxfp8", None, 4096) == "linear"
    assert check_format("mxfp8", "swizzled_128x4", 32) == "swizzled_128x4"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("fp4", None, 4096), "quant: 'fp4' (needs one of " + ALL_FORMATS + ")"),
        ((None, None, 4096), "quant: None (needs one of " + ALL_FORMATS + ")"),
        (("nvfp4", None, 4100), "hidden_size: 4100 (needs a multiple of 16 for nvfp4)"),
        (("mxfp8", None, 4112), "hidden_size: 4112 (needs a multiple of 32 for mxfp8)"),
        (("fp8_static", None, 0), "hidden_size: 0 (needs a positive int)"),
        (("fp8_static", None, 64.0), "hidden_size: 64.0 (needs a positive int)"),
        (("fp8_static", None, True), "hidden_size: True (needs a positive int)"),
        (("nvfp4", "x", 4096), "layout: 'x' (needs swizzled_128x4 or linear for nvfp4)"),
        (
            ("mxfp8", "swizzled_8x4", 4096),
            "layout: 'swizzled_8x4' (needs linear or swizzled_128x4 for mxfp8)",
        ),
        (
            ("fp8_static", "linear", 4096),
            "layout: 'linear' (needs None for fp8_static, which has no block scales)",
        ),
        (
            ("fp8_per_token", "swizzled_128x4", 4096),
            "layout: 'swizzled_128x4' (needs None for fp8_per_token, which has no block scales)",
        ),
    ],
)
def test_check_format_messages(args: tuple, message: str) -> None:
    """Each bad format, layout or hidden size raises InvalidInputError with its exact message."""
    assert _message(check_format, *args) == message


def test_check_scale_accepts_what_each_format_needs() -> None:
    """fp8_static/nvfp4 accept an fp32 [1] tensor on the device; the others accept None."""
    for fmt in ("fp8_static", "nvfp4"):
        check_scale(fmt, torch.tensor([0.5]), CPU)
        check_scale(fmt, torch.tensor([-1.0]), "cpu")  # the value is not checked (no host sync)
    for fmt in ("fp8_per_token", "mxfp8"):
        check_scale(fmt, None, CPU)


@pytest.mark.parametrize(
    ("fmt", "scale", "message"),
    [
        ("fp8_static", None, "scale: missing (needs an fp32 tensor of shape [1] for fp8_static)"),
        ("nvfp4", None, "scale: missing (needs an fp32 tensor of shape [1] for nvfp4)"),
        ("fp8_static", 0.5, "scale: float (needs an fp32 tensor of shape [1] for fp8_static)"),
        (
            "fp8_static",
            torch.tensor([1.0], dtype=torch.bfloat16),
            "scale: dtype torch.bfloat16 (needs torch.float32)",
        ),
        (
            "nvfp4",
            torch.tensor([1.0], dtype=torch.float64),
            "scale: dtype torch.float64 (needs torch.float32)",
        ),
        ("fp8_static", torch.tensor(1.0), "scale: shape [] (needs [1])"),
        ("nvfp4", torch.ones(2), "scale: shape [2] (needs [1])"),
        ("nvfp4", torch.ones(1, 1), "scale: shape [1, 1] (needs [1])"),
        ("fp8_static", torch.ones(1, device="meta"), "scale: device meta (needs cpu, the input's device)"),
        (
            "fp8_per_token",
            torch.ones(1),
            "scale: Tensor (needs None for fp8_per_token, which computes its own scales)",
        ),
        ("mxfp8", 1.0, "scale: float (needs None for mxfp8, which computes its own scales)"),
        ("int8", None, "quant: 'int8' (needs one of " + ALL_FORMATS + ")"),
    ],
)
def test_check_scale_messages(fmt: str, scale: object, message: str) -> None:
    """Each bad scale raises InvalidInputError naming the argument, what was found and what is needed."""
    assert _message(check_scale, fmt, scale, CPU) == message


@pytest.mark.parametrize(
    ("y", "kwargs", "message"),
    [
        ([[1.0]], {}, "y: list (needs a torch.Tensor)"),
        (
            torch.ones(2, 64, dtype=torch.int32),
            {},
            "y: dtype torch.int32 (needs torch.bfloat16, torch.float16 or torch.float32)",
        ),
        (
            torch.ones(2, 64, dtype=torch.float64),
            {},
            "y: dtype torch.float64 (needs torch.bfloat16, torch.float16 or torch.float32)",
        ),
        (torch.ones(64), {}, "y: shape [64] (needs 2-D [T, H])"),
        (torch.ones(2, 2, 64), {}, "y: shape [2, 2, 64] (needs 2-D [T, H])"),
        (torch.ones(2, 48), {"layout": "linear"}, "hidden_size: 48 (needs a multiple of 32 for mxfp8)"),
        (
            torch.ones(2, 64),
            {"layout": "tiled"},
            "layout: 'tiled' (needs linear or swizzled_128x4 for mxfp8)",
        ),
        (
            torch.ones(2, 64),
            {"scale": torch.ones(1)},
            "scale: Tensor (needs None for mxfp8, which computes its own scales)",
        ),
    ],
)
def test_quantize_validates_before_computing(y: object, kwargs: dict, message: str) -> None:
    """quantize checks y, then format/layout/hidden size, then the scale, with the same messages."""
    assert _message(quantize, y, "mxfp8", **kwargs) == message


def test_quantize_format_and_scale_messages() -> None:
    """quantize reports an unknown format and a missing scale like check_format and check_scale."""
    y = torch.ones(2, 64)
    assert _message(quantize, y, "fp4") == "quant: 'fp4' (needs one of " + ALL_FORMATS + ")"
    assert _message(quantize, y, "nvfp4") == "scale: missing (needs an fp32 tensor of shape [1] for nvfp4)"
    assert _message(quantize, y, "fp8_static", layout="linear") == (
        "layout: 'linear' (needs None for fp8_static, which has no block scales)"
    )
