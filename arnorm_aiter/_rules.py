"""What AITER's fused all-reduce + RMSNorm can serve, as pure functions (no torch, no aiter).

Every limit below was read in ROCm/aiter's source; the kernels are identical from tag
``v0.1.19.post1`` to ``v0.1.20.post1`` (commit ``e4048607``):

* ``csrc/include/custom_all_reduce.cuh``: ``dispatchFusedAllReduceRMSNorm`` (1-stage kernel when
  asked and ``hidden / 8 <= 1024``; otherwise reduce-scatter + ``local_device_load_rmsnorm``, which
  needs ``hidden / 8 >= 64`` and drops the tail when ``tokens * hidden / 8`` is not a multiple of
  the world size), ``dispatchFusedAllReduceRMSNormQuant`` (silently writes nothing unless
  ``hidden / 8 <= 1024``; its 2-stage and split kernels size one block to ``hidden / 8`` threads and
  reduce over whole 32-lane groups, so they need ``hidden`` a multiple of 256);
* ``aiter/dist/device_communicators/custom_all_reduce.py``: ``CustomAllreduce.fused_ar_rms`` and
  the IPC pools it copies inputs into.

The 1-stage / 2-stage choice is vLLM's (``vllm/_aiter_ops.py``,
``_rocm_aiter_fused_allreduce_rmsnorm_impl``): at most 80 tokens, ``hidden / 8 <= 1024``, and a
per-rank input under 256 KiB at TP 4 or 128 KiB at TP 8 (no byte cap at TP 2).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

from arnorm.plugin import DTYPE_BYTES

if TYPE_CHECKING:
    from arnorm.plugin import Problem

__all__ = [
    "ARCHS",
    "DISTRIBUTIONS",
    "E4M3FN_ARCHS",
    "EMIT_BF16_VERSION",
    "FP8_FORMAT",
    "GEMMA_VERSION",
    "MIN_VERSION",
    "ONE_STAGE_MAX_TOKENS",
    "POOL_MAX_BYTES",
    "installed_version",
    "itemsize",
    "parse_version",
    "pool_bytes",
    "problem_reasons",
    "token_reasons",
    "use_one_stage",
]

#: The one quantized format AITER's fused kernels write (fp8 codes, an fp32 scale per token).
FP8_FORMAT: Final = "fp8_per_token"

#: Distribution names aiter is installed under (PyPI / ``setup.py``: ``amd-aiter``).
DISTRIBUTIONS = ("amd-aiter", "aiter")
#: The oldest aiter whose 1-stage fused kernel ends with a cross-rank barrier (ROCm/aiter#4346,
#: first tagged in v0.1.19.post1). Without it a fast rank refills the shared input buffer while a
#: peer still reads the previous call: silent corruption, and arnorm copies every input there.
MIN_VERSION = "0.1.19.post1"
#: ``gemma_norm`` (the ``+ 1`` Gemma weight offset in-kernel): ROCm/aiter#3792, v0.1.17.
GEMMA_VERSION = "0.1.17"
#: ``emit_bf16`` (the normed activation next to the per-token fp8 codes): ROCm/aiter#4110, v0.1.18.
EMIT_BF16_VERSION = "0.1.18"

#: GPUs served: MI300X / MI325X (gfx942) and MI350X / MI355X (gfx950). gfx1250 has no fused kernel.
ARCHS = ("gfx942", "gfx950")
#: Where AITER's fp8 is OCP e4m3fn (max 448), arnorm's format; gfx942's is e4m3fnuz (max 240).
E4M3FN_ARCHS = ("gfx950",)

PACK_BYTES = 16
ONE_STAGE_MAX_TOKENS = 80
ONE_STAGE_MAX_PACKS = 1024
#: Per-rank input bytes the 1-stage kernel may take (exclusive), by world size (vLLM's caps).
ONE_STAGE_MAX_BYTES = {4: 256 * 1024, 8: 128 * 1024}
TWO_STAGE_MIN_PACKS = 64
FP8_TWO_STAGE_HIDDEN_MULTIPLE = 256
#: The registered input buffer: every call copies its input there (AITER's default cap, 64 MiB).
POOL_MAX_BYTES = 64 * 1024 * 1024
#: Pool granule; also keeps AITER's uncached meta buffer (``meta_size() + 2 * pool``) at or above
#: 2 MiB, below which ``hipIpcGetMemHandle`` fails on sizes that are not a page multiple.
POOL_GRANULE = 1024 * 1024

_VERSION = re.compile(
    r"^\s*v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre>a|b|rc|alpha|beta|c)[-_.]?(?P<pre_n>\d*))?"
    r"(?:[-_.]?(?:post|rev|r)[-_.]?(?P<post>\d*))?"
    r"(?:[-_.]?dev[-_.]?(?P<dev>\d*))?"
    r"(?:\+[a-z0-9.]*)?\s*$",
    re.IGNORECASE,
)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2}
_INF = float("inf")


def parse_version(text: str) -> tuple | None:
    """A sort key for a PEP 440 version (``None`` if unparsable); the local part is ignored.

    ``X.devN < X.aN < X.rcN < X < X.postN.devM < X.postN`` as PEP 440 orders them.
    """
    m = _VERSION.match(text)
    if m is None:
        return None
    release = [int(p) for p in m["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre, post, dev = m["pre"], m["post"], m["dev"]
    if pre is not None:
        pre_key: tuple = (0, _PRE_RANK[pre.lower()], int(m["pre_n"] or 0))
    elif post is None and dev is not None:
        pre_key = (-1,)
    else:
        pre_key = (1,)
    post_key = (-1,) if post is None else (int(post or 0),)
    dev_key = (_INF,) if dev is None else (int(dev or 0),)
    return (tuple(release), pre_key, post_key, dev_key)


def at_least(version: str, floor: str) -> bool:
    """``version >= floor``; an unparsable version never qualifies."""
    key = parse_version(version)
    return key is not None and key >= parse_version(floor)  # type: ignore[operator]


def installed_version() -> str | None:
    """The installed aiter's version from package metadata; aiter itself is never imported."""
    import importlib.metadata

    for dist in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def itemsize(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def pool_bytes(problem: Problem) -> int:
    """Bytes of the registered input buffer: ``max_tokens`` rows, capped, in whole granules."""
    need = min(problem.max_tokens * problem.hidden_size * itemsize(problem.dtype), POOL_MAX_BYTES)
    return max(POOL_GRANULE, -(-need // POOL_GRANULE) * POOL_GRANULE)


def problem_reasons(problem: Problem, version: str | None) -> list[str]:
    """Everything the declared capabilities cannot say: aiter's version, the GPU, the norm, fp8 limits."""
    reasons: list[str] = []
    gemma = problem.weight_offset == 1.0
    fp8 = problem.quant == FP8_FORMAT
    if version is None:
        names = " or ".join(DISTRIBUTIONS)
        reasons.append(f"aiter version: unknown, no metadata for {names} (needs amd-aiter >= {MIN_VERSION})")
    else:
        if not at_least(version, MIN_VERSION):
            reasons.append(
                f"aiter version: {version} (needs >= {MIN_VERSION}: older 1-stage kernels lack their final "
                "cross-rank barrier, ROCm/aiter#4346)"
            )
        if gemma and not at_least(version, GEMMA_VERSION):
            reasons.append(
                f"aiter version: {version} (needs >= {GEMMA_VERSION} for a Gemma norm: gemma_norm)"
            )
        if fp8 and problem.normed_output and not at_least(version, EMIT_BF16_VERSION):
            reasons.append(
                f"aiter version: {version} (needs >= {EMIT_BF16_VERSION} for fp8_per_token with "
                "normed_output: emit_bf16)"
            )
    arch = (problem.gfx_arch or "").split(":")[0] or None
    if arch not in ARCHS:
        reasons.append(f"gpu arch: {arch or 'unknown'} (needs {' or '.join(ARCHS)})")
    elif fp8 and arch not in E4M3FN_ARCHS:
        reasons.append(
            f"quant: fp8_per_token on {arch} (needs {' or '.join(E4M3FN_ARCHS)}: {arch} writes e4m3fnuz, "
            "max 240, not arnorm's e4m3fn)"
        )
    size = DTYPE_BYTES.get(problem.dtype, 0)
    if fp8 and size and problem.hidden_size * size > ONE_STAGE_MAX_PACKS * PACK_BYTES:
        limit = ONE_STAGE_MAX_PACKS * PACK_BYTES // size
        reasons.append(f"hidden size: {problem.hidden_size} (needs <= {limit} for fp8_per_token)")
    return reasons


def use_one_stage(tokens: int, hidden: int, item: int, world_size: int) -> bool:
    """vLLM's rule: the 1-stage kernel for few tokens, small rows and (at TP 4 / 8) few bytes."""
    if tokens > ONE_STAGE_MAX_TOKENS:
        return False
    pack = PACK_BYTES // item
    if hidden % pack or hidden // pack > ONE_STAGE_MAX_PACKS:
        return False
    cap = ONE_STAGE_MAX_BYTES.get(world_size)
    return cap is None or tokens * hidden * item < cap


def token_reasons(problem: Problem, tokens: int, pool: int) -> list[str]:
    """Why ``tokens`` cannot run: the buffer budget, or a 2-stage kernel limit for this shape."""
    if tokens < 1:
        return [f"tokens: {tokens} (needs >= 1)"]
    h, ws = problem.hidden_size, problem.world_size
    item = itemsize(problem.dtype)
    limit = pool // (h * item)
    if tokens > limit:
        return [
            f"tokens: {tokens} (needs <= {limit}: AITER's registered input buffer holds {pool >> 20} MiB)"
        ]
    if use_one_stage(tokens, h, item, ws):
        return []
    packs = h * item // PACK_BYTES
    cap = ONE_STAGE_MAX_BYTES.get(ws)
    one = f"<= {ONE_STAGE_MAX_TOKENS} tokens" + (f" and < {cap >> 10} KiB per rank" if cap else "")
    one += " for the 1-stage kernel"
    if problem.quant == FP8_FORMAT:
        if h % FP8_TWO_STAGE_HIDDEN_MULTIPLE:
            return [
                f"tokens: {tokens} at hidden size {h} (needs {one}; the 2-stage fp8 kernels need a "
                f"hidden size that is a multiple of {FP8_TWO_STAGE_HIDDEN_MULTIPLE})"
            ]
        return []
    if packs < TWO_STAGE_MIN_PACKS:
        need = TWO_STAGE_MIN_PACKS * PACK_BYTES // item
        return [
            f"tokens: {tokens} at hidden size {h} (needs {one}; the 2-stage kernel needs a hidden size "
            f">= {need})"
        ]
    if tokens * packs % ws:
        return [
            f"tokens: {tokens} at hidden size {h} (needs {one}, or tokens x hidden / {PACK_BYTES // item} "
            f"divisible by the world size {ws} for the 2-stage kernel)"
        ]
    return []
