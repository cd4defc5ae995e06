"""Measured launch table rows (see :mod:`arnorm_triton._launch_table`); generated, do not edit.

Regenerate on the GPU with ``python benchmarks/bench_norm_quant.py --tune`` (run by
``benchmarks/gpu_kernel_round.sh``), then commit this file. Empty: every launch uses the default.
"""

MEASURED: dict[tuple[int, int, int, bool, int], tuple[tuple[int, int], ...]] = {}
