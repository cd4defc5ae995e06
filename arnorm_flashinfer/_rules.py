"""What FlashInfer's TRT-LLM fused kernels accept, as rejection reasons (no heavy imports).

Each rule cites what it protects against; "read" means read in FlashInfer 0.7.x source
(``include/flashinfer/comm/trtllm_allreduce_fusion.cuh``, ``flashinfer/comm/allreduce.py``,
``flashinfer/jit/comm.py``), not run on hardware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arnorm.plugin import DTYPE_BYTES

if TYPE_CHECKING:
    from arnorm.plugin import Problem

__all__ = [
    "ARCH_MAJORS",
    "HALF_ONLY",
    "MIN_ARCH",
    "NVFP4_MIN_ARCH",
    "WORLD_SIZES",
    "launcher_reasons",
    "max_hidden",
]

#: The C++ dispatch instantiates these rank counts only ("Supported ranks: 2, 4, 8, 16").
WORLD_SIZES: tuple[int, ...] = (2, 4, 8, 16)
#: ``gen_trtllm_comm_module`` builds for these compute-capability majors only.
ARCH_MAJORS: tuple[int, ...] = (9, 10, 12)
MIN_ARCH = (9, 0)
#: The FP4 quantizer of the fused kernel is compiled out below SM100 (``#if __CUDA_ARCH__ >= 1000``):
#: on SM90 patterns 3/5 would run and write all-zero codes and no scales.
NVFP4_MIN_ARCH = (10, 0)
#: Formats whose kernels take 16-bit inputs only: the FP4 patterns are not instantiated for float
#: ("FP4Quant pattern cannot work with DType=float"); MXFP8 is (a 4-element fp32 vector per thread).
HALF_ONLY: tuple[str, ...] = ("nvfp4",)


def max_hidden(hidden: int, elem: int) -> int:
    """The largest hidden size the launcher can place with ``hidden``'s power-of-two factors.

    One token is one thread-block cluster: ``threads = hidden / (16 / elem)`` split over a cluster
    of the largest power of two <= 8 dividing it, with at most 1024 threads per block.
    """
    vec = 16 // elem
    threads = max(1, hidden // vec)
    cluster = 8
    while cluster > 1 and threads % cluster:
        cluster //= 2
    return 1024 * cluster * vec


def launcher_reasons(problem: Problem) -> tuple[str, ...]:
    """What the declared capabilities cannot say: the launcher's limit at this hidden size's alignment."""
    hidden, elem = problem.hidden_size, DTYPE_BYTES.get(problem.dtype)
    if elem is None or hidden % (16 // elem):
        return ()  # the capabilities already reject it
    limit = max_hidden(hidden, elem)
    if hidden <= limit:
        return ()
    return (
        f"hidden size: {hidden} (needs <= {limit} for {problem.dtype} at this alignment: "
        "one token per cluster of <= 8 blocks of <= 1024 threads)",
    )
