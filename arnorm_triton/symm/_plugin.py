"""Registers the ``triton_symm`` backend (its own ``arnorm.backends`` entry point); imports nothing heavy.

``triton_symm`` fuses the all-reduce itself into one Triton kernel over torch symmetric memory:
every rank publishes its partial sum into its own symmetric buffer, and the kernel reads all the
partials from the peers' buffers, sums them in fp32 in rank order (bitwise the reference's step
1 on every rank), then adds the residual, normalizes and quantizes with the same epilogue as
``triton`` (docs/triton-symm.md).
"""

from __future__ import annotations

from pydantic import Field

from arnorm.plugin import BackendSettings, BackendSpec, Capabilities, hookimpl
from arnorm_triton._plugin import CAPABILITIES as TRITON_CAPABILITIES

__all__ = [
    "CAPABILITIES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_ONESHOT_MAX_TOKENS",
    "DEFAULT_PUSH_MAX_TOKENS",
    "DEFAULT_SPIN_LIMIT",
    "MAX_WORLD_SIZE",
    "ONESHOT_MAX_BYTES",
    "TritonSymmSettings",
    "arnorm_backends",
    "auto_oneshot_tokens",
]

#: Ranks of one node that peer memory can join; the kernel unrolls its rank loop up to this.
MAX_WORLD_SIZE = 8
#: Symmetric workspace per rank: 64 MiB holds 2048 tokens of the one-shot and two-shot regions at
#: H = 8192 in bf16 (16 KiB a row, twice), far beyond the decode sizes where a fused all-reduce
#: beats NCCL; larger calls fall through to ``triton``.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: One-shot up to at most this many tokens, two-shot above (docs/triton-symm.md, "Crossovers");
#: fewer at 3 or more ranks (:func:`auto_oneshot_tokens`).
DEFAULT_ONESHOT_MAX_TOKENS = 128
#: One-shot calls up to at most this many tokens push (docs/triton-symm.md, "Push"); the same
#: world-size bound applies. At H = 8192 in bf16 and 2 ranks the push region is 2 x 2 x 128 rows of
#: 16 KiB, 8 MiB of the budget.
DEFAULT_PUSH_MAX_TOKENS = 128
#: One rank's partial, in bytes, up to which one-shot (and push) serves a call, by world size:
#: one-shot moves (W - 1) x the partial per rank, two-shot 2 (W - 1) / W x, so its range shrinks as
#: W grows. These are vLLM's limits for FlashInfer's one-shot on SM 9.0 (2: 32 MiB, 4: 2 MiB,
#: 8: 512 KiB; research/flashinfer.md, 7.2); a world between two keys takes the larger one's.
ONESHOT_MAX_BYTES = ((2, 32 << 20), (4, 2 << 20), (8, 512 << 10))


def auto_oneshot_tokens(world: int, row_bytes: int) -> int:
    """The default of ``oneshot_max_tokens`` and ``push_max_tokens`` for ``world`` ranks and rows of
    ``row_bytes``: :data:`DEFAULT_ONESHOT_MAX_TOKENS`, or fewer when :data:`ONESHOT_MAX_BYTES` of a
    rank's partial hold fewer rows (H 8192 in bf16: 128 tokens at 2 and 4 ranks, 32 at 8)."""
    limit = next((b for w, b in ONESHOT_MAX_BYTES if world <= w), ONESHOT_MAX_BYTES[-1][1])
    return min(DEFAULT_ONESHOT_MAX_TOKENS, limit // max(1, row_bytes))


#: Polls of a peer's flag before a wait gives up and records a timeout (about 10 s to minutes,
#: depending on the GPU's atomic latency): long enough for a late rank, short of a silent hang.
DEFAULT_SPIN_LIMIT = 1 << 27

#: The ``triton`` backend's declaration, narrowed: GPUs only (symmetric memory has no CPU
#: implementation), 2 to 8 ranks of one node, and a residual always read (the symmetric kernels
#: do not specialize on ``add_residual``; such ops hand them rows of a ``-0.0`` buffer).
CAPABILITIES = Capabilities(
    **{
        **TRITON_CAPABILITIES.model_dump(),
        "platforms": frozenset({"cuda", "rocm"}),
        "world_sizes": frozenset(range(2, MAX_WORLD_SIZE + 1)),
        "min_world_size": 2,
        "residual_free": False,
        # Caller-provided outputs reach it through arnorm's copy (its call allocates its own).
        "caller_outputs": False,
        # Push, one-shot and two-shot all sum the ranks in fp32 from rank 0 up and round once
        # (_symm_kernels._rank_order_sum, _push_pass), the epilogue is triton's, and the warp count
        # is a function of H alone (_symm_launch.SymmLauncher): a row's outputs never depend on T.
        "batch_invariant": True,
        # Its kernels write the normed output at row stride H into a buffer of their own; writing
        # it over hidden_states (the in-place layout) is not wired through their protocols.
        "output_layouts": frozenset({"separate"}),
        # The two TMA-padded scale layouts are declined: on an H100 (2026-12-07) two ranks sharing
        # the GPU got wrong scales in the flag one-shot kernel (T = 1 with push off, T = 4 with the
        # defaults) while push, two-shot and emulated ranks were right, cause not found. A call
        # asking for them is served by `triton` (NCCL, then the fused kernel), exact on the same GPU.
        "scale_layouts": TRITON_CAPABILITIES.scale_layouts - {"column_major_tma", "packed_ue8m0"},
    }
)


class TritonSymmSettings(BackendSettings):
    """``ARNORM_TRITON_SYMM_*``: the symmetric workspace budget, the push and one-shot/two-shot
    crossovers, how long a kernel waits for a peer, and programmatic dependent launch."""

    max_bytes: int = Field(
        default=DEFAULT_MAX_BYTES,
        gt=0,
        description="Bytes of symmetric memory per rank for this op's workspace (the push slots, the "
        "partials, the two-shot sums and the flags). It bounds the token count the backend serves; a call "
        "with more tokens falls through to the next backend (triton).",
    )
    oneshot_max_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Token counts up to this run the one-shot kernel (every rank reads every partial); "
        "above it the two-shot kernel (each rank reduces a share of the rows, then reads the others' "
        "sums). 0: always two-shot; at least max_tokens: always one-shot. Unset: 128, or the tokens of "
        "2 MiB (3-4 ranks) or 512 KiB (5-8 ranks) of one rank's partial when fewer (H 8192 bf16 at 8 "
        "ranks: 32).",
    )
    push_max_tokens: int | None = Field(
        default=None,
        ge=0,
        description="One-shot calls up to this many tokens push: each rank stores its partial into "
        "every peer's buffer and the data itself says it has arrived (no flags, no fences). Costs "
        "2 x world x this x hidden x itemsize bytes of the budget. 0: the flag protocol for every call. "
        "Unset: as oneshot_max_tokens' default.",
    )
    pdl: bool = Field(
        default=True,
        description="Programmatic dependent launch on CUDA SM 9.0+ (the kernel's launch overlaps the "
        "previous kernel's tail); off: plain launches.",
    )
    spin_limit: int = Field(
        default=DEFAULT_SPIN_LIMIT,
        ge=0,
        le=2**31 - 1,
        description="Polls of a peer's flag before a waiting kernel gives up, records a timeout "
        "(TritonSymmBackend.check() raises on it) and goes on with wrong values instead of hanging; "
        "0: wait forever.",
    )


@hookimpl
def arnorm_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="triton_symm",
            priority=150,
            capabilities=CAPABILITIES,
            loader="arnorm_triton.symm._backend:TritonSymmBackend",
            requires=("triton",),
            extra="triton",
            distribution="triton",
            settings=TritonSymmSettings,
            description="one Triton kernel: all-reduce over torch symmetric memory (rank-order fp32 sum) "
            "+ residual add + RMSNorm + quant",
        )
    ]
