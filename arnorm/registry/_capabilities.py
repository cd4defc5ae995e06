"""``Capabilities``: what a backend declares it can serve, and the static check against a ``Problem``."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from arnorm import _formats
from arnorm._norm import NORM_OPTIONS, NormOptionName
from arnorm._problem import OutputLayout, Problem

__all__ = [
    "BATCH_INVARIANCE_REASON",
    "Capabilities",
    "admitted_hidden",
    "check_capabilities",
    "did_you_mean",
    "hidden_multiple",
    "join_or",
]

#: Why a backend is rejected for an op built with ``Config(batch_invariant=True)``.
BATCH_INVARIANCE_REASON = (
    "batch invariance: not declared (needs batch_invariant=True in Capabilities, asked by "
    "ARNORM_BATCH_INVARIANT)"
)

Platform = Literal["cpu", "cuda", "rocm"]
Dtype = _formats.DtypeName
#: ``"none"`` (no quantized output) or a format of :mod:`arnorm._formats`.
QuantChoice = _formats.QuantChoice
Layout = _formats.LayoutName


class Capabilities(BaseModel):
    """What a backend declares, checked against a :class:`Problem` before anything is imported.

    A backend's probe keeps only what cannot be declared here (versions, topology, devices).

    - ``platforms``, ``dtypes``, ``quant``, ``scale_layouts``: the values served.
    - ``quant_dtypes``: narrower dtypes for single formats (``{"nvfp4": {"bfloat16", "float16"}}``).
    - ``world_sizes`` (``None``: any) and ``min_world_size``.
    - ``min_arch`` and ``arch_majors`` (CUDA compute capability; ``None``: any); ``quant_min_arch``
      raises the floor for single formats.
    - ``hidden_multiple`` for every format, ``quant_hidden_multiple`` per format (the format's own
      multiple, ``FormatSpec.hidden_multiple``, always applies on top: :func:`hidden_multiple`);
      ``min_hidden``, ``max_hidden``.
    - ``weight_offsets`` (``None``: any); ``norm_options``: the options of :class:`arnorm.RMSNorm`
      the backend serves (``{"round_before_weight", "normalize_unrounded"}``; the table of options
      is ``arnorm.plugin.NORM_OPTIONS``). An option's name as a keyword of its own
      (``round_before_weight=True``) is refused with an error naming ``norm_options``.
    - ``strided_rows``: whether ``hidden_states`` / ``residual`` may be ``[T, H]`` views with
      unit column stride and a row stride above ``H`` (taken without a copy).
    - ``residual_free``: whether the backend serves ops built with ``add_residual=False``
      (``residual=None`` reaches it) itself. It never excludes a backend: for one that does not,
      arnorm passes rows of a ``-0.0`` buffer as the residual (``x + -0.0 == x`` bit for bit), at
      the cost of reading them.
    - ``caller_outputs``: whether the backend's call takes a fifth argument ``out`` (an
      :class:`arnorm.Output` of caller-owned buffers, checked by arnorm) and writes into it, its
      result holding those tensors (checked on every ``out=`` call: otherwise the call raises
      ``BackendBrokenError`` naming the backend). It never excludes a backend: for one that does
      not, arnorm copies its outputs into ``out``.
    - ``batch_invariant``: whether the backend serves ops built with ``Config(batch_invariant=True)``
      (``Problem.batch_invariant``) so that a row's outputs (residual, normed, codes and scales) are
      a function of that row's inputs alone: bitwise independent of the token count, of the other
      rows and of which of its kernels or protocols serves the count. A backend whose default path
      is not invariant may still declare it if it switches, for such problems, to a path that is
      (``triton`` runs its exact mode). Only declaring backends are selected for such an op, and the
      conformance suite checks the property (docs/numerics.md, section 10).
    - ``output_layouts``: where the backend can write the outputs (``Problem.output_layout``):
      ``"separate"`` (the normed output in a tensor of its own), ``"in_place"`` (the normed output
      over ``hidden_states``, the new residual over ``residual``, as vLLM's ``fused_add_rms_norm``
      writes them). A backend that does not declare ``"in_place"`` is not chosen for such an op.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    platforms: frozenset[Platform]
    dtypes: frozenset[Dtype] = frozenset(_formats.DTYPES)
    quant: frozenset[QuantChoice] = frozenset({_formats.NO_QUANT})
    quant_dtypes: dict[QuantChoice, frozenset[Dtype]] = Field(default_factory=dict)
    scale_layouts: frozenset[Layout] = frozenset(_formats.LAYOUTS)
    world_sizes: frozenset[int] | None = None
    min_world_size: int = 1
    min_arch: tuple[int, int] | None = None
    arch_majors: frozenset[int] | None = None
    quant_min_arch: dict[QuantChoice, tuple[int, int]] = Field(default_factory=dict)
    hidden_multiple: int = Field(default=1, ge=1)
    quant_hidden_multiple: dict[QuantChoice, int] = Field(default_factory=dict)
    min_hidden: int = 1
    max_hidden: int | None = None
    weight_offsets: frozenset[float] | None = None
    norm_options: frozenset[NormOptionName] = frozenset()
    strided_rows: bool = False
    residual_free: bool = False
    caller_outputs: bool = False
    batch_invariant: bool = False
    output_layouts: frozenset[OutputLayout] = frozenset({"separate"})

    @model_validator(mode="before")
    @classmethod
    def _options_only_in_norm_options(cls, data: object) -> object:
        """A norm option passed as a keyword of its own would otherwise fail as an unknown field;
        the error names where the option goes instead."""
        if isinstance(data, dict):
            for name in NORM_OPTIONS:
                if name in data:
                    raise ValueError(
                        f"{name}: {data[name]!r} (needs norm_options={{{name!r}}}: the norm's options are "
                        "named in norm_options)"
                    )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Capabilities:
        """Fields that contradict each other would make a backend that can never be chosen, or
        that declares what it does not serve: refused where the plugin declares them."""
        problems = []
        for field in ("platforms", "dtypes", "quant", "scale_layouts", "output_layouts"):
            if not getattr(self, field):
                problems.append(f"{field}: empty (needs at least one value: the backend could never serve)")
        if self.world_sizes is not None:
            if any(w < 1 for w in self.world_sizes):
                problems.append(f"world_sizes: {sorted(self.world_sizes)} (needs sizes >= 1)")
            elif not any(w >= self.min_world_size for w in self.world_sizes):
                problems.append(
                    f"world_sizes: {sorted(self.world_sizes)} all below min_world_size "
                    f"{self.min_world_size} (needs one size >= min_world_size: the backend could never serve)"
                )
        for field in ("quant_dtypes", "quant_min_arch", "quant_hidden_multiple"):
            stray = sorted(set(getattr(self, field)) - set(self.quant))
            if stray:
                problems.append(f"{field}: {', '.join(stray)} (needs formats in quant, {sorted(self.quant)})")
        for fmt, dtypes in self.quant_dtypes.items():
            if not dtypes <= self.dtypes:
                want = sorted(self.dtypes)
                problems.append(f"quant_dtypes[{fmt!r}]: {sorted(dtypes)} (needs a subset of dtypes, {want})")
        if self.max_hidden is not None and self.max_hidden < self.min_hidden:
            problems.append(f"max_hidden: {self.max_hidden} (needs >= min_hidden {self.min_hidden})")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def __hash__(self) -> int:
        return hash(tuple((k, _hashable(v)) for k, v in self))


_LEADING_NUMBER = re.compile(r"^-?\d+(\.\d+)?")


def _hashable(value: object) -> object:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


def _sort_key(item: str) -> tuple[int, float, str]:
    # Numbers, and texts that start with one ("9.x"), sort by that number ("2, 4, 8 or 16";
    # "9.x, 10.x or 12.x"); everything else after them by text.
    match = _LEADING_NUMBER.match(item)
    if match is None:
        return (1, 0.0, item)
    return (0, float(match.group()), item)


def join_or(items: Iterable[object]) -> str:
    """``["b", "a", "c"]`` -> ``"a, b or c"``; numbers in numeric order; stable for messages."""
    names = sorted((str(i) for i in items), key=_sort_key)
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " or " + names[-1]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'triton'?"`` when ``name`` is close to some of ``known`` (a misspelt
    backend name), else ``""``: appended inside a reason's ``(needs ...)``."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    if not close:
        return ""
    return f"; did you mean {' or '.join(map(repr, close))}?"


def _arch(a: tuple[int, int]) -> str:
    return f"{a[0]}.{a[1]}"


def _arch_reasons(caps: Capabilities, problem: Problem) -> list[str]:
    if problem.platform != "cuda" or problem.arch is None:
        return []
    reasons = []
    arch, quant = problem.arch, problem.quant_name
    for floor, scope in ((caps.min_arch, ""), (caps.quant_min_arch.get(quant), f" for {quant}")):  # type: ignore[call-overload]
        if floor is not None and arch < floor:
            reasons.append(f"compute capability: {_arch(arch)} (needs >= {_arch(floor)}{scope})")
    if caps.arch_majors is not None and arch[0] not in caps.arch_majors:
        majors = join_or(f"{m}.x" for m in caps.arch_majors)
        reasons.append(f"compute capability: {_arch(arch)} (needs {majors})")
    return reasons


def hidden_multiple(caps: Capabilities, quant: str) -> int:
    """What the hidden size of a ``quant`` problem (``"none"`` or a format) must be a multiple of to
    be admitted: the backend's declared multiple for the format (or for every format), and the
    format's own (:attr:`arnorm.plugin.FormatSpec.hidden_multiple`). The one statement of the rule:
    the static check, the conformance suite and the invariance cases read it."""
    declared = caps.quant_hidden_multiple.get(quant, caps.hidden_multiple)  # type: ignore[call-overload]
    spec = _formats.FORMAT_SPECS.get(quant)
    return math.lcm(declared, spec.hidden_multiple if spec is not None else 1)


def admitted_hidden(caps: Capabilities, quant: str, hidden: int) -> int | None:
    """The smallest hidden size ``>= hidden`` the backend admits for ``quant``
    (:func:`hidden_multiple`, ``min_hidden``); ``None`` when that is above ``max_hidden``."""
    h = max(hidden, caps.min_hidden)
    h += -h % hidden_multiple(caps, quant)
    return None if caps.max_hidden is not None and h > caps.max_hidden else h


def _hidden_reasons(caps: Capabilities, problem: Problem) -> list[str]:
    h, quant = problem.hidden_size, problem.quant_name
    reasons = []
    multiple = hidden_multiple(caps, quant)
    if h % multiple:
        scope = (
            f" for {quant}" if quant in caps.quant_hidden_multiple or multiple != caps.hidden_multiple else ""
        )
        reasons.append(f"hidden size: {h} (needs a multiple of {multiple}{scope})")
    if h < caps.min_hidden:
        reasons.append(f"hidden size: {h} (needs >= {caps.min_hidden})")
    if caps.max_hidden is not None and h > caps.max_hidden:
        reasons.append(f"hidden size: {h} (needs <= {caps.max_hidden})")
    return reasons


def check_capabilities(caps: Capabilities, problem: Problem) -> tuple[str, ...]:
    """Every way ``problem`` falls outside ``caps``, as ``"<aspect>: <found> (needs <required>)"``."""
    reasons: list[str] = []
    quant = problem.quant_name
    if problem.platform not in caps.platforms:
        reasons.append(f"platform: {problem.platform} (needs {join_or(caps.platforms)})")
    if problem.dtype not in caps.dtypes:
        reasons.append(f"dtype: {problem.dtype} (needs {join_or(caps.dtypes)})")
    elif quant in caps.quant_dtypes and problem.dtype not in caps.quant_dtypes[quant]:
        allowed = join_or(caps.quant_dtypes[quant])
        reasons.append(f"dtype: {problem.dtype} (needs {allowed} for {quant})")
    if quant not in caps.quant:
        reasons.append(f"quant: {quant} (needs {join_or(caps.quant)})")
    if problem.scale_layout is not None and problem.scale_layout not in caps.scale_layouts:
        reasons.append(f"scale layout: {problem.scale_layout} (needs {join_or(caps.scale_layouts)})")
    ws = problem.world_size
    if caps.world_sizes is not None and ws not in caps.world_sizes:
        reasons.append(f"world size: {ws} (needs {join_or(caps.world_sizes)})")
    elif ws < caps.min_world_size:
        reasons.append(f"world size: {ws} (needs >= {caps.min_world_size})")
    reasons += _arch_reasons(caps, problem)
    reasons += _hidden_reasons(caps, problem)
    if caps.weight_offsets is not None and problem.weight_offset not in caps.weight_offsets:
        offsets = join_or(f"{o:g}" for o in caps.weight_offsets)
        reasons.append(f"weight offset: {problem.weight_offset:g} (needs {offsets})")
    # The problem holds no void option (Problem drops them), so a name there is one the op needs.
    reasons += [o.reason for n, o in NORM_OPTIONS.items() if n in problem.norm_options - caps.norm_options]
    if problem.output_layout not in caps.output_layouts:
        reasons.append(f"output layout: {problem.output_layout} (needs {join_or(caps.output_layouts)})")
    if problem.batch_invariant and not caps.batch_invariant:
        reasons.append(BATCH_INVARIANCE_REASON)
    return tuple(reasons)
