"""The ``flashinfer`` backend's entry point: a cheap descriptor (imports neither torch nor FlashInfer)."""

from __future__ import annotations

import math

from pydantic import Field, field_validator

from arnorm.plugin import BackendSettings, BackendSpec, Capabilities, hookimpl
from arnorm_flashinfer._rules import ARCH_MAJORS, MIN_ARCH, NVFP4_MIN_ARCH, WORLD_SIZES

__all__ = ["CAPABILITIES", "FlashInferSettings", "arnorm_backends"]

#: Declared statically; the probe adds only what cannot be declared (the launcher's hidden-size
#: limit at the hidden size's alignment, and the installed FlashInfer's patterns).
CAPABILITIES = Capabilities(
    platforms=frozenset({"cuda"}),
    # Every dtype, and the two block-scale layouts its fused kernel writes (_api.SF_LAYOUTS): the
    # per-token-group fp8 formats' layouts are not among them, nor is SWIZZLED_8x4 an arnorm layout.
    # Patterns 8/9 (per-token-group fp8, UE8M0 packed) floor a group's scale after the division
    # (docs/numerics.md, 3.5): not arnorm's fp8_per_group_ue8m0 on tiny groups, so not declared.
    quant=frozenset({"none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"}),
    scale_layouts=frozenset({"linear", "swizzled_128x4"}),
    # The FP4 patterns are not instantiated for float inputs.
    quant_dtypes={"nvfp4": frozenset({"bfloat16", "float16"})},  # _rules.HALF_ONLY
    world_sizes=frozenset(WORLD_SIZES),
    min_arch=MIN_ARCH,
    arch_majors=frozenset(ARCH_MAJORS),
    quant_min_arch={"nvfp4": NVFP4_MIN_ARCH},
    # One 16-byte vector per thread; nvfp4 / mxfp8 blocks (16 / 32) are required by the core too.
    hidden_multiple=8,
    max_hidden=65536,
    # Not batch invariant (docs/numerics.md, section 10): the launcher splits a row over blocks and
    # a cluster by the token count (adjust_for_sm_count), which reorders the sum of squares, and
    # only the one-shot kernel turns -0.0 inputs into +0.0.
    batch_invariant=False,
    # residual_out may be residual_in and norm_out be input (_outputs.CallPlan): the kernel reads an
    # element before the same thread writes it, and vLLM's own fusion passes exactly that aliasing.
    output_layouts=frozenset({"separate", "in_place"}),
)


class FlashInferSettings(BackendSettings):
    """``ARNORM_FLASHINFER_*``: the workspace FlashInfer's fused kernels run on."""

    mnnvl: bool = Field(
        default=False,
        description="Allow the MNNVL (multicast) workspace when every rank supports multicast.",
    )
    max_size_mb: float | None = Field(
        default=None,
        gt=0,
        description="Per-rank input budget in MiB (calls above it fall back); unset: the per-GPU table.",
    )
    shared_gpu: bool = Field(
        default=False,
        description="Testing on one GPU: let ranks share a GPU (FlashInfer's IPC then maps one "
        "device's memory into itself; correct, never fast).",
    )

    @field_validator("max_size_mb")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError(f"max_size_mb: {value} (needs a finite number of MiB)")
        return value


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
            min_version="0.7.2",  # the extra's floor: older releases lack the fused patterns used
            settings=FlashInferSettings,
            description=f"flashinfer.comm fused all-reduce + RMSNorm (+quant), TRT-LLM IPC; {majors}",
        )
    ]
