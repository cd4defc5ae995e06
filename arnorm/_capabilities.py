"""``Capabilities``: what a backend declares it can serve, and the static check against a ``Problem``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from arnorm._problem import Problem

__all__ = ["Capabilities", "check_capabilities", "join_or"]

Platform = Literal["cpu", "cuda", "rocm"]
Dtype = Literal["bfloat16", "float16", "float32"]
QuantName = Literal["none", "fp8_static", "fp8_per_token", "nvfp4", "mxfp8"]
Layout = Literal["linear", "swizzled_128x4"]


class Capabilities(BaseModel):
    """What a backend declares, checked against a :class:`Problem` before anything is imported.

    Sets are the values served; ``world_sizes=None`` means any world size. ``min_arch`` applies to
    CUDA only. ``quant_min_arch`` raises the floor for single formats (nvfp4 needs SM100 in
    FlashInfer's kernels).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    platforms: frozenset[Platform]
    dtypes: frozenset[Dtype] = frozenset({"bfloat16", "float16", "float32"})
    quant: frozenset[QuantName] = frozenset({"none"})
    scale_layouts: frozenset[Layout] = frozenset({"linear", "swizzled_128x4"})
    world_sizes: frozenset[int] | None = None
    min_world_size: int = 1
    min_arch: tuple[int, int] | None = None
    quant_min_arch: dict[str, tuple[int, int]] = Field(default_factory=dict)
    hidden_multiple: int = 1
    min_hidden: int = 1
    max_hidden: int | None = None
    weight_offsets: frozenset[float] | None = None

    def __hash__(self) -> int:
        return hash(tuple((k, _hashable(v)) for k, v in self))


def _hashable(value: object) -> object:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def join_or(items: object) -> str:
    """``["a", "b", "c"]`` -> ``"a, b or c"``; sorted, for stable messages."""
    names = sorted(str(i) for i in items)  # type: ignore[attr-defined]
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " or " + names[-1]


def _arch(a: tuple[int, int]) -> str:
    return f"{a[0]}.{a[1]}"


def check_capabilities(caps: Capabilities, problem: Problem) -> tuple[str, ...]:
    """Every way ``problem`` falls outside ``caps``, as ``"<aspect>: <found> (needs <required>)"``."""
    reasons: list[str] = []
    if problem.platform not in caps.platforms:
        reasons.append(f"platform: {problem.platform} (needs {join_or(caps.platforms)})")
    if problem.dtype not in caps.dtypes:
        reasons.append(f"dtype: {problem.dtype} (needs {join_or(caps.dtypes)})")
    if problem.quant_name not in caps.quant:
        reasons.append(f"quant: {problem.quant_name} (needs {join_or(caps.quant)})")
    if problem.scale_layout is not None and problem.scale_layout not in caps.scale_layouts:
        reasons.append(f"scale layout: {problem.scale_layout} (needs {join_or(caps.scale_layouts)})")
    ws = problem.world_size
    if caps.world_sizes is not None and ws not in caps.world_sizes:
        reasons.append(f"world size: {ws} (needs {join_or(caps.world_sizes)})")
    elif ws < caps.min_world_size:
        reasons.append(f"world size: {ws} (needs >= {caps.min_world_size})")
    if problem.platform == "cuda" and problem.arch is not None:
        floors = [
            (caps.min_arch, ""),
            (caps.quant_min_arch.get(problem.quant_name), f" for {problem.quant_name}"),
        ]
        for floor, scope in floors:
            if floor is not None and problem.arch < floor:
                reasons.append(f"compute capability: {_arch(problem.arch)} (needs >= {_arch(floor)}{scope})")
    h = problem.hidden_size
    if h % caps.hidden_multiple:
        reasons.append(f"hidden size: {h} (needs a multiple of {caps.hidden_multiple})")
    if h < caps.min_hidden:
        reasons.append(f"hidden size: {h} (needs >= {caps.min_hidden})")
    if caps.max_hidden is not None and h > caps.max_hidden:
        reasons.append(f"hidden size: {h} (needs <= {caps.max_hidden})")
    if caps.weight_offsets is not None and problem.weight_offset not in caps.weight_offsets:
        offsets = join_or(f"{o:g}" for o in caps.weight_offsets)
        reasons.append(f"weight offset: {problem.weight_offset:g} (needs {offsets})")
    return tuple(reasons)
