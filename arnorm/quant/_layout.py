"""Block-scale layouts: ``linear`` (row-major ``[T, C]``) and ``swizzled_128x4``.

The 128x4 swizzle is the one cuBLASLt / CUTLASS block-scaled GEMMs read and that vLLM, FlashInfer
and TRT-LLM write (``get_sf_out_offset_128x4``). The scale matrix is padded with zeros to
``[round_up(T, 128), round_up(C, 4)]`` and cut into 128x4 tiles of 512 bytes, tiles ordered
row-tile major; inside a tile, row ``m`` and column ``k`` sit at
``(m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4``. In full, the byte offset of ``(m, k)`` is::

    (m // 128) * (Cp // 4) * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4

with ``Cp // 4 = ceil(C / 4)`` (``ceil(H / 64)`` for nvfp4, ``ceil(H / 128)`` for mxfp8). As a
view: ``[Tp/128, 4, 32, Cp/4, 4] -> permute(0, 3, 2, 1, 4)``; that permutation is its own inverse.
"""

from __future__ import annotations

import torch

from arnorm._errors import InvalidInputError
from arnorm.quant._inputs import round_up

__all__ = ["from_layout", "swizzle_128x4", "to_layout", "unswizzle_128x4"]

_PERM = (0, 3, 2, 1, 4)


def _as_bytes(t: torch.Tensor, argument: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{argument}: {type(t).__name__} (needs a torch.Tensor)")
    if t.element_size() != 1:
        raise InvalidInputError(f"{argument}: dtype {t.dtype} (needs a 1-byte dtype)")
    return t if t.dtype == torch.uint8 else t.contiguous().view(torch.uint8)


def _check_dim(value: object, argument: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"{argument}: {value!r} (needs a non-negative int)")
    return value


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Row-major scales ``[T, C]`` -> ``[round_up(T, 128), round_up(C, 4)]`` in 128x4 swizzled byte order.

    Any 1-byte dtype; the result keeps it and is contiguous; padding bytes are zero.
    """
    raw = _as_bytes(scales, "scales")
    if raw.dim() != 2:
        raise InvalidInputError(f"scales: shape {list(raw.shape)} (needs 2-D [T, C])")
    rows, cols = raw.shape
    rows_p, cols_p = round_up(rows, 128), round_up(cols, 4)
    padded = torch.zeros((rows_p, cols_p), dtype=torch.uint8, device=raw.device)
    padded[:rows, :cols] = raw
    tiles = padded.view(rows_p // 128, 4, 32, cols_p // 4, 4).permute(_PERM)
    return tiles.contiguous().view(rows_p, cols_p).view(scales.dtype)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`: swizzled scales -> row-major ``[rows, cols]``, same dtype.

    ``swizzled`` may have any shape with ``round_up(rows, 128) * round_up(cols, 4)`` elements, read in
    (logical, row-major) order.
    """
    raw = _as_bytes(swizzled, "swizzled")
    rows, cols = _check_dim(rows, "rows"), _check_dim(cols, "cols")
    rows_p, cols_p = round_up(rows, 128), round_up(cols, 4)
    if raw.numel() != rows_p * cols_p:
        raise InvalidInputError(
            f"swizzled: {raw.numel()} elements (needs {rows_p} * {cols_p} = {rows_p * cols_p} "
            f"for {rows} x {cols} scales)"
        )
    tiles = raw.reshape(rows_p // 128, cols_p // 4, 32, 4, 4).permute(_PERM)
    linear = tiles.reshape(rows_p, cols_p)[:rows, :cols].contiguous()
    return linear.view(swizzled.dtype)


def to_layout(scales: torch.Tensor, layout: str) -> torch.Tensor:
    """Row-major block scales -> ``layout`` (``"linear"`` returns them as they are)."""
    return swizzle_128x4(scales) if layout == "swizzled_128x4" else scales


def from_layout(scales: torch.Tensor, layout: str | None, rows: int, cols: int) -> torch.Tensor:
    """Block scales in ``layout`` -> row-major ``[rows, cols]`` (checks the shape of linear scales)."""
    if layout == "swizzled_128x4":
        return unswizzle_128x4(scales, rows, cols)
    if layout != "linear":
        raise InvalidInputError(f"layout: {layout!r} (needs linear or swizzled_128x4)")
    if tuple(scales.shape) != (rows, cols):
        raise InvalidInputError(f"scale: shape {list(scales.shape)} (needs [{rows}, {cols}] for linear)")
    return scales
