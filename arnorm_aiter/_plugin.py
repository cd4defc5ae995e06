"""The ``aiter`` entry point: a cheap descriptor; the backend module is imported only when probed."""

from __future__ import annotations

from arnorm.plugin import BackendSpec, Capabilities, hookimpl
from arnorm_aiter._rules import FP8_FORMAT, MIN_VERSION

__all__ = ["CAPABILITIES", "arnorm_backends"]

#: What AITER's fused kernels can serve at all; ``AiterBackend.probe`` adds the version, the GPU
#: arch and the limits that depend on the quant format.
CAPABILITIES = Capabilities(
    platforms=frozenset({"rocm"}),
    dtypes=frozenset({"bfloat16", "float16"}),
    # AITER's fused per-group fp8 and mxfp4 epilogues are not declared: with gemma_norm its fused
    # quant serves per-token fp8 only, and its mxfp4 e2m1 rounds ties up (docs/numerics.md, 3.6).
    quant=frozenset({"none", FP8_FORMAT}),
    world_sizes=frozenset({2, 4, 8}),
    hidden_multiple=8,
    max_hidden=16384,
    # The plain norm, or Gemma's weight + 1 (``gemma_norm``).
    weight_offsets=frozenset({0.0, 1.0}),
    # Not batch invariant (docs/numerics.md, section 10): the 1-stage kernel (up to 80 tokens) and the
    # 2-stage path multiply the norm in different orders.
    batch_invariant=False,
)


@hookimpl
def arnorm_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="aiter",
            priority=200,
            capabilities=CAPABILITIES,
            loader="arnorm_aiter._backend:AiterBackend",
            requires=("aiter",),
            extra="aiter",
            distribution="amd-aiter",
            # Older 1-stage kernels lack their final cross-rank barrier (ROCm/aiter#4346): an
            # installed aiter below this is reported "outdated", never probed.
            min_version=MIN_VERSION,
            install_hint="a build of ROCm/aiter at v0.1.19.post1 or later, see docs/aiter.md",
            description="ROCm AITER custom all-reduce fused with residual add + RMSNorm (+ per-token fp8)",
        )
    ]
