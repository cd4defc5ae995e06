"""Measured launch table rows (see :mod:`arnorm_triton._launch_table`); generated, do not edit.

Measured on NVIDIA H200, 2026-12-04, torch 2.11.0+cu130, triton 3.6.0.
Regenerate on the GPU with ``python benchmarks/bench_norm_quant.py --write-table`` (run
by ``benchmarks/gpu_kernel_round.sh``), then commit this file.
"""

#: (cuda major, BLOCK, QUANT code, WRITE_NORMED, itemsize) -> ((t_max, num_warps), ...)
MEASURED: dict[tuple[int, int, int, bool, int], tuple[tuple[int, int], ...]] = {
    (9, 4096, 1, False, 2): ((1, 16), (1073741824, 8)),
    (9, 4096, 4, False, 2): ((1073741824, 4),),
    (9, 4096, 4, True, 2): ((1024, 4), (1073741824, 8)),
    (9, 8192, 2, False, 2): ((128, 16), (1073741824, 8)),
    (9, 8192, 3, False, 2): ((1, 4), (128, 16), (1073741824, 8)),
    (9, 8192, 4, False, 2): ((16, 8), (128, 4), (1073741824, 8)),
    (9, 8192, 4, True, 2): ((16, 8), (128, 16), (1073741824, 8)),
}
