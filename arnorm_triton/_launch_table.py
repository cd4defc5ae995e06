"""Warps per row program, per (GPU family, row shape, format, outputs, token count): a fixed table.

The rows are measured on real hardware: ``python benchmarks/tune_launch_table.py --write-table``
writes ``arnorm_triton/_launch_measured.py`` for the GPU it runs on (docs/performance.md, "The
launch table"). Every TP rank reads the same table for the same call, so every rank launches
the same grid with the same warp count (the warp count changes the order of the sum of squares,
so ranks must agree on it; they do, by construction). Token buckets are powers of two: a row
``(t_max, warps)`` serves ``T <= t_max`` above the previous row's ``t_max``.
"""

from __future__ import annotations

from arnorm.plugin import FORMAT_SPECS
from arnorm_triton._launch_measured import MEASURED

__all__ = ["TABLE", "TWO_PASS_FROM", "TableKey", "default_num_warps", "launch_config", "two_pass_scales"]

#: ``(cuda major, BLOCK, QUANT code, WRITE_NORMED, itemsize)``; the QUANT code is the format's
#: ``FormatSpec.code`` in arnorm's format table (0 none, 1 fp8_static, 2 fp8_per_token, 3 nvfp4,
#: 4 mxfp8), fixed for good (``tests/test_formats.py`` pins them): a format added to the table
#: never moves a tuned row onto another format.
TableKey = tuple[int, int, int, bool, int]

#: ``key -> ((t_max, num_warps), ...)`` ascending in ``t_max``; T beyond the last row, and keys not
#: listed, use :func:`default_num_warps`.
TABLE: dict[TableKey, tuple[tuple[int, int], ...]] = dict(MEASURED)


def default_num_warps(block: int) -> int:
    """Warps per row program: 8 to 16 elements per thread (4 warps up to 1024 lanes, 8 up to 4096,
    16 at 8192, 32 at 16384). ptxas (SM 9.0) then needs 40-58 registers per thread for every
    format, with no spills, which keeps 32 or more warps resident per SM for the loads in flight.
    """
    if block >= 16384:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def launch_config(
    arch: tuple[int, int] | None, block: int, quant: int, normed: bool, itemsize: int, n_rows: int
) -> int:
    """Warps for one launch: the table's row for ``n_rows`` on this GPU family, else the default."""
    rows = TABLE.get((arch[0], block, quant, normed, itemsize)) if arch is not None else None
    if rows:
        for t_max, warps in rows:
            if n_rows <= t_max:
                return warps
    return default_num_warps(block)


#: ``key -> T``: from ``T`` rows up, swizzled block scales are stored in two passes (the fused
#: kernel writes them linearly, a second kernel swizzles whole tiles; the same bytes). A row's
#: scales are 4 bytes of every 512-byte tile of the 128x4 layout, so one pass writes them as
#: partial sectors (128 per row at H 8192), which costs 7-9% of nvfp4's bandwidth at T 8192
#: (kernel-variants run 17); the second pass costs a launch, so small T keeps one pass.
#: Measured on the H200 (kernel-variants run 18, 2026-12-04): nvfp4 at H 4096 / 8192, with and
#: without the normed output, is as fast or faster in two passes from T 4096 (0.2-3.6%), 2-5%
#: faster at T 8192, and 0.6-1.1 us slower at T 1024. mxfp8 (one scale per 32 elements, half of
#: nvfp4's scale bytes) gains nothing: not listed. Re-checked on the flat row layout (run 24's
#: `cur` columns): the same rule holds.
TWO_PASS_FROM: dict[TableKey, int] = {
    (9, block, FORMAT_SPECS["nvfp4"].code, normed, 2): 4096
    for block in (4096, 8192)
    for normed in (False, True)
}


def two_pass_scales(
    arch: tuple[int, int] | None, block: int, quant: int, normed: bool, itemsize: int, n_rows: int
) -> bool:
    """Whether a launch of ``n_rows`` rows stores its swizzled block scales in two passes."""
    t_min = TWO_PASS_FROM.get((arch[0], block, quant, normed, itemsize)) if arch is not None else None
    return t_min is not None and n_rows >= t_min
