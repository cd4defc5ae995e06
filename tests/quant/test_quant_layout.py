"""The 128x4 scale swizzle: byte offsets against docs/numerics.md's formula, padding, exact round trips."""

from __future__ import annotations

import pytest
import torch

from arnorm.quant import dequantize, quantize, swizzle_128x4, unswizzle_128x4

ROWS = [1, 7, 127, 128, 129, 1000]
COLS = [1, 2, 3, 4, 5, 8, 13]


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _offset(m: int, k: int, cols: int) -> int:
    """docs/numerics.md: (m//128)*ceil(C/4)*512 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4."""
    return (
        (m // 128) * ((cols + 3) // 4) * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    )


def _random_bytes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (7, 3), (32, 4), (129, 6), (200, 9), (256, 5)])
def test_swizzle_offsets_match_design_formula(rows: int, cols: int) -> None:
    """Each scale (m, k) lands at docs/numerics.md's byte offset; every other byte is zero padding."""
    lin = _random_bytes(rows, cols)
    swz = swizzle_128x4(lin)
    assert swz.shape == (_round_up(rows, 128), _round_up(cols, 4)) and swz.is_contiguous()
    flat = swz.reshape(-1).tolist()
    expected = [0] * len(flat)
    values = lin.tolist()
    for m in range(rows):
        for k in range(cols):
            expected[_offset(m, k, cols)] = values[m][k]
    assert flat == expected


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
def test_swizzle_round_trip(rows: int, cols: int) -> None:
    """unswizzle_128x4(swizzle_128x4(s), T, C) == s for any T and C, and padding is zero."""
    lin = _random_bytes(rows, cols, seed=rows * 31 + cols)
    swz = swizzle_128x4(lin)
    assert torch.equal(unswizzle_128x4(swz, rows, cols), lin)
    assert int((swz != 0).sum()) == rows * cols  # values are 1..255, so exactly the real scales are non-zero
    assert torch.equal(unswizzle_128x4(swz.reshape(-1), rows, cols), lin)  # a flat buffer works too


@pytest.mark.parametrize(
    "dtype",
    [torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.bool],
)
def test_swizzle_keeps_any_one_byte_dtype(dtype: torch.dtype) -> None:
    """Any 1-byte dtype is swizzled by its bytes and comes back bit-identical in the same dtype."""
    raw = _random_bytes(130, 5) % 2 if dtype == torch.bool else _random_bytes(130, 5)
    lin = raw.view(dtype)
    swz = swizzle_128x4(lin)
    assert swz.dtype == dtype
    assert torch.equal(swz.view(torch.uint8), swizzle_128x4(raw))
    assert torch.equal(unswizzle_128x4(swz, 130, 5).view(torch.uint8), raw)


def test_swizzle_of_a_non_contiguous_input() -> None:
    """A transposed (non-contiguous) scale matrix is swizzled by its logical [T, C] indices."""
    lin = _random_bytes(6, 33)
    assert torch.equal(swizzle_128x4(lin.t()), swizzle_128x4(lin.t().contiguous()))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 96, 160, 256])
def test_block_formats_round_trip_through_both_layouts(rows: int, hidden: int) -> None:
    """nvfp4 (H/16 = 4, 6, 10, 16) and mxfp8 (H/32 = 2, 3, 5, 8) decode identically from both layouts."""
    g = torch.Generator().manual_seed(rows + hidden)
    y = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    for fmt, scale in [("nvfp4", torch.tensor([500.0])), ("mxfp8", None)]:
        lin = quantize(y, fmt, scale=scale, layout="linear")
        swz = quantize(y, fmt, scale=scale, layout="swizzled_128x4")
        cols = hidden // (16 if fmt == "nvfp4" else 32)
        assert swz.scale.shape == (_round_up(rows, 128), _round_up(cols, 4))
        assert torch.equal(
            unswizzle_128x4(swz.scale, rows, cols).view(torch.uint8), lin.scale.view(torch.uint8)
        )
        assert torch.equal(dequantize(lin), dequantize(swz))


def test_swizzle_errors() -> None:
    """Wrong dtype size, rank, element count or dimensions raise ValueError with the argument named."""
    with pytest.raises(ValueError, match=r"^scales: dtype torch.float32 \(needs a 1-byte dtype\)$"):
        swizzle_128x4(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"^scales: shape \[4\] \(needs 2-D \[T, C\]\)$"):
        swizzle_128x4(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(
        ValueError, match=r"^swizzled: 512 elements \(needs 128 \* 8 = 1024 for 3 x 5 scales\)$"
    ):
        unswizzle_128x4(torch.zeros(128, 4, dtype=torch.uint8), 3, 5)
    with pytest.raises(ValueError, match=r"^rows: -1 \(needs a non-negative int\)$"):
        unswizzle_128x4(torch.zeros(128, 4, dtype=torch.uint8), -1, 4)
