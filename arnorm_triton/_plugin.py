"""Registers the ``triton`` backend (the ``arnorm.backends`` entry point); imports nothing heavy."""

from __future__ import annotations

from arnorm.plugin import BackendSpec, Capabilities, hookimpl

__all__ = ["CAPABILITIES", "MAX_HIDDEN", "arnorm_backends"]

#: Widest row the single-pass kernel keeps in registers (one row per program of 32 warps at most,
#: BLOCK = next_pow2(H)); wider rows would need a second pass over global memory.
MAX_HIDDEN = 16384

#: What the static check can decide without importing Triton; ``TritonBackend.probe`` adds the rest
#: (Triton importable and >= 3.2, the interpreter for CPU tensors, nvfp4 / mxfp8 alignment).
CAPABILITIES = Capabilities(
    platforms=frozenset({"cpu", "cuda", "rocm"}),
    quant=frozenset({"none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"}),
    min_arch=(8, 0),
    max_hidden=MAX_HIDDEN,
)


@hookimpl
def arnorm_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="triton",
            priority=100,
            capabilities=CAPABILITIES,
            loader="arnorm_triton._backend:TritonBackend",
            requires=("triton",),
            extra="triton",
            distribution="triton",
            description="torch.distributed all-reduce (or exact all-gather) + one fused Triton kernel",
        )
    ]
