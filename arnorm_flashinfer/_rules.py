"""What FlashInfer's TRT-LLM fused kernels accept, as rejection reasons (no imports beyond the stdlib).

Each rule cites what it protects against; "read" means read in FlashInfer 0.7.x source
(``include/flashinfer/comm/trtllm_allreduce_fusion.cuh``, ``flashinfer/comm/allreduce.py``,
``flashinfer/jit/comm.py``), not run on hardware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arnorm._problem import Problem

__all__ = [
    "ARCH_MAJORS",
    "BLOCK_ALIGN",
    "DTYPE_BYTES",
    "MIN_ARCH",
    "NVFP4_MIN_ARCH",
    "QUANTS",
    "WORLD_SIZES",
    "max_hidden",
    "static_reasons",
]

#: The C++ dispatch instantiates these rank counts only ("Supported ranks: 2, 4, 8, 16").
WORLD_SIZES: tuple[int, ...] = (2, 4, 8, 16)
#: ``gen_trtllm_comm_module`` builds for these compute-capability majors only.
ARCH_MAJORS: tuple[int, ...] = (9, 10, 12)
MIN_ARCH = (9, 0)
#: The FP4 quantizer of the fused kernel is compiled out below SM100 (``#if __CUDA_ARCH__ >= 1000``):
#: on SM90 patterns 3/5 would run and write all-zero codes and no scales.
NVFP4_MIN_ARCH = (10, 0)
QUANTS: tuple[str, ...] = ("none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8")
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
#: Hidden-size multiple per format: one 16-byte vector per thread (8 elements at 16 bits), and
#: whole scale blocks per thread pair (nvfp4: 16 elements) or per block (mxfp8: 32).
BLOCK_ALIGN: dict[str, int] = {"none": 8, "fp8_static": 8, "fp8_per_token": 8, "nvfp4": 16, "mxfp8": 32}
#: Formats whose kernels take 16-bit inputs only: the FP4 patterns are not instantiated for float
#: ("FP4Quant pattern cannot work with DType=float"); MXFP8 is (a 4-element fp32 vector per thread).
HALF_ONLY: tuple[str, ...] = ("nvfp4",)
LAYOUTS: tuple[str, ...] = ("linear", "swizzled_128x4")


def _list(items: tuple[object, ...]) -> str:
    names = [str(i) for i in items]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


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


def static_reasons(problem: Problem) -> tuple[str, ...]:
    """Everything about ``problem`` alone that rules this backend out, with the kernel's reason."""
    reasons: list[str] = []
    quant = problem.quant_name
    if problem.platform != "cuda":
        reasons.append(f"platform: {problem.platform} (needs cuda)")
    if problem.world_size not in WORLD_SIZES:
        reasons.append(f"world size: {problem.world_size} (needs {_list(WORLD_SIZES)})")
    if problem.dtype not in DTYPE_BYTES:
        reasons.append(f"dtype: {problem.dtype} (needs bfloat16, float16 or float32)")
    elif quant in HALF_ONLY and problem.dtype == "float32":
        reasons.append(f"dtype: float32 (needs bfloat16 or float16 for {quant})")
    if quant not in QUANTS:
        reasons.append(f"quant: {quant} (needs {_list(QUANTS)})")
    if problem.scale_layout is not None and problem.scale_layout not in LAYOUTS:
        reasons.append(
            f"scale layout: {problem.scale_layout} (needs linear or swizzled_128x4; "
            "the fused kernel writes no scales for SWIZZLED_8x4)"
        )
    if problem.platform == "cuda":
        arch = problem.arch
        if arch is None:
            reasons.append("compute capability: unknown (needs >= 9.0)")
        elif arch < MIN_ARCH:
            reasons.append(f"compute capability: {arch[0]}.{arch[1]} (needs >= 9.0)")
        elif arch[0] not in ARCH_MAJORS:
            majors = _list(tuple(f"{m}.x" for m in ARCH_MAJORS))
            reasons.append(
                f"compute capability: {arch[0]}.{arch[1]} "
                f"(needs {majors}, the archs FlashInfer builds trtllm_comm for)"
            )
        if quant == "nvfp4" and arch is not None and arch < NVFP4_MIN_ARCH:
            reasons.append(
                f"compute capability: {arch[0]}.{arch[1]} (needs >= 10.0 for nvfp4: FlashInfer compiles the "
                "fused FP4 quantizer out below SM100, where the kernel would write zeros)"
            )
    hidden = problem.hidden_size
    align = BLOCK_ALIGN.get(quant, 8)
    if hidden % align:
        what = "" if align == 8 else f" for {quant}"
        reasons.append(f"hidden size: {hidden} (needs a multiple of {align}{what})")
    elif problem.dtype in DTYPE_BYTES:
        limit = max_hidden(hidden, DTYPE_BYTES[problem.dtype])
        if hidden > limit:
            reasons.append(
                f"hidden size: {hidden} (needs <= {limit} for {problem.dtype} at this alignment: "
                "one token per cluster of <= 8 blocks of <= 1024 threads)"
            )
    return tuple(reasons)
