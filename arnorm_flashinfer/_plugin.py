"""The ``flashinfer`` backend's entry point: a cheap descriptor (imports neither torch nor FlashInfer)."""

from __future__ import annotations

from arnorm.plugin import BackendSpec, Capabilities, hookimpl
from arnorm_flashinfer._rules import ARCH_MAJORS, MIN_ARCH, NVFP4_MIN_ARCH, WORLD_SIZES

__all__ = ["CAPABILITIES", "arnorm_backends"]

#: Declared statically; the probe adds what cannot be declared (fp32 with nvfp4, per-format
#: hidden alignment, the launcher's hidden-size limit, the arch majors FlashInfer builds for, the
#: installed FlashInfer's patterns).
CAPABILITIES = Capabilities(
    platforms=frozenset({"cuda"}),
    dtypes=frozenset({"bfloat16", "float16", "float32"}),
    quant=frozenset({"none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"}),
    scale_layouts=frozenset({"linear", "swizzled_128x4"}),
    world_sizes=frozenset(WORLD_SIZES),
    min_arch=MIN_ARCH,
    quant_min_arch={"nvfp4": NVFP4_MIN_ARCH},
    hidden_multiple=8,
    max_hidden=65536,
)


@hookimpl
def arnorm_backends() -> list[BackendSpec]:
    majors = "/".join(f"sm{m}x" for m in ARCH_MAJORS)
    return [
        BackendSpec(
            name="flashinfer",
            priority=300,
            capabilities=CAPABILITIES,
            loader="arnorm_flashinfer._backend:FlashInferBackend",
            requires=("flashinfer",),
            extra="flashinfer",
            distribution="flashinfer-python",
            description=f"flashinfer.comm fused all-reduce + RMSNorm (+quant), TRT-LLM IPC; {majors}",
        )
    ]
