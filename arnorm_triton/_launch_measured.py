"""Measured launch table rows (see :mod:`arnorm_triton._launch_table`); generated, do not edit.

Measured on NVIDIA H200, 2026-12-04, torch 2.11.0+cu130, triton 3.6.0.
Regenerate on the GPU with ``python benchmarks/tune_launch_table.py --write-table``
(docs/performance.md, "The launch table"), then commit this file.
"""

#: (cuda major, BLOCK, QUANT code, WRITE_NORMED, itemsize) -> ((t_max, num_warps), ...); the QUANT
#: code is the format's FormatSpec.code (fixed for good, arnorm/_formats.py).
MEASURED: dict[tuple[int, int, int, bool, int], tuple[tuple[int, int], ...]] = {
    (9, 4096, 0, True, 2): ((128, 4), (1024, 16), (1073741824, 8)),
    (9, 4096, 1, False, 2): ((1, 16), (128, 8), (1024, 4), (1073741824, 8)),
    (9, 4096, 1, True, 2): ((1, 16), (16, 8), (128, 4), (1073741824, 8)),
    (9, 4096, 2, False, 2): ((128, 16), (1073741824, 8)),
    (9, 4096, 2, True, 2): ((128, 16), (1073741824, 8)),
    (9, 4096, 3, False, 2): ((1, 8), (16, 4), (1073741824, 8)),
    (9, 4096, 4, True, 2): ((1, 4), (1073741824, 8)),
    (9, 8192, 0, True, 2): ((16, 8), (128, 16), (1024, 8), (1073741824, 16)),
    (9, 8192, 1, False, 2): ((1, 8), (1073741824, 16)),
    (9, 8192, 2, False, 2): ((128, 16), (1073741824, 8)),
    (9, 8192, 3, False, 2): ((128, 16), (1073741824, 8)),
    (9, 8192, 4, False, 2): ((16, 8), (128, 16), (1024, 4), (1073741824, 8)),
    (9, 8192, 4, True, 2): ((1, 8), (1073741824, 16)),
}
