"""Registers the ``triton`` backend (the ``arnorm.backends`` entry point); imports nothing heavy."""

from __future__ import annotations

from pydantic import Field

from arnorm.plugin import BackendSettings, BackendSpec, Capabilities, hookimpl

__all__ = ["CAPABILITIES", "MAX_HIDDEN", "TritonSettings", "arnorm_backends"]

#: Widest row the single-pass kernel keeps in registers (one row per program of 32 warps at most,
#: BLOCK = next_pow2(H)); wider rows would need a second pass over global memory.
MAX_HIDDEN = 16384

#: Everything that can be decided without importing Triton. ``TritonBackend.probe`` adds only
#: what cannot be declared: Triton importable and new enough, and the interpreter for CPU tensors.
CAPABILITIES = Capabilities(
    platforms=frozenset({"cpu", "cuda", "rocm"}),
    # Every dtype and scale layout (the defaults). The formats the kernels' quantizer branches on
    # (``QUANT``, by the format table's codes); each format's hidden multiple (whole quantization
    # blocks: the kernel reduces each block as one unit) comes from the table.
    quant=frozenset(
        {
            "none",
            "fp8_static",
            "fp8_per_token",
            "nvfp4",
            "mxfp8",
            "fp8_per_group",
            "fp8_per_group_64",
            "fp8_per_group_ue8m0",
            "fp8_per_group_64_ue8m0",
            "mxfp4",
        }
    ),
    min_arch=(8, 0),
    max_hidden=MAX_HIDDEN,
    # The epilogue's constexpr per option (_launch.norm_constexprs), triton_symm's too.
    norm_options=frozenset({"round_before_weight", "normalize_unrounded"}),
    strided_rows=True,
    residual_free=True,
    caller_outputs=True,
    # Served through the exact mode, whatever ARNORM_TRITON_EXACT says unless it says 0: the
    # default path's NCCL all-reduce sums in an order that depends on its algorithm and the size,
    # and its launch table changes the warp count (so the sum of squares' order) with T.
    batch_invariant=True,
    # The kernel loads a row whole before its first store, so the normed output may go over the
    # row it read and the new residual over the residual row (vLLM's and FlashInfer's layout).
    output_layouts=frozenset({"separate", "in_place"}),
)


class TritonSettings(BackendSettings):
    """``ARNORM_TRITON_*``: how the ``triton`` backend reduces at TP > 1 and launches its kernel."""

    exact: bool = Field(
        default=False,
        description="At TP > 1, all-gather the partials and sum them in fp32 in rank order inside "
        "the kernel (bitwise the reference at any TP size) instead of a library all-reduce; costs a "
        "TP * max_tokens * H gather buffer per rank and more traffic at TP >= 4. At any TP size, every "
        "token count launches with one warp count (a function of H), so a row's outputs do not depend "
        "on T: the batch-invariant mode. On for batch-invariant ops (ARNORM_BATCH_INVARIANT) unless "
        "set to 0, which then fails the backend's setup.",
    )
    pdl: bool = Field(
        default=True,
        description="Launch with programmatic dependent launch where the GPU (SM 9.0+) and Triton "
        "support it: the kernel's launch overlaps the previous kernel's tail (it still waits for "
        "that kernel's results before its first load).",
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
            min_version="3.2",  # the extra's floor (and MIN_TRITON in _backend)
            settings=TritonSettings,
            description="torch.distributed all-reduce (or exact all-gather) + one fused Triton kernel",
        )
    ]
