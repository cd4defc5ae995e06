"""``Problem``: everything a backend needs to decide whether it can serve an op, as one hashable value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from arnorm._norm import NORM_OPTIONS, NormOptionName

__all__ = ["OUTPUT_LAYOUTS", "OutputLayout", "Problem"]

#: Where an op's outputs go. ``"separate"``: the normed output in a tensor of its own (new, or
#: ``out=``'s), the new residual over ``hidden_states`` (``inplace=True``) or in a new tensor.
#: ``"in_place"``: the normed output over ``hidden_states`` and the new residual over ``residual``,
#: as vLLM's ``fused_add_rms_norm`` and FlashInfer's ``fused_add_rmsnorm`` write them: a call
#: touches two ``[T, H]`` tensors instead of three.
OutputLayout = Literal["separate", "in_place"]
OUTPUT_LAYOUTS: tuple[OutputLayout, ...] = get_args(OutputLayout)


@dataclass(frozen=True, slots=True)
class Problem:
    """The static description of one ``AllReduceNorm``: identical on every rank.

    ``platform`` is ``"cuda"``, ``"rocm"`` or ``"cpu"``; ``arch`` the CUDA compute capability
    ``(major, minor)`` or, on ROCm, ``(0, 0)`` with the gfx name in ``gfx_arch``.
    ``quant`` is ``None`` or one of :data:`arnorm.QUANT_FORMATS` and ``scale_layout`` is set for
    nvfp4 and mxfp8 only. ``eps`` and ``weight_offset`` are :class:`arnorm.RMSNorm`'s, and
    ``norm_options`` the names of its options that are on (``RMSNorm.options``), less those void for
    this problem (``NormOption.is_void``: ``normalize_unrounded`` with no residual add or in fp32),
    which the problem records off: one problem, one selection
    (``RMSNorm.with_options(p.eps, p.weight_offset, p.norm_options)`` is the norm itself).
    ``add_residual=False``: an all-reduce + norm with no residual add (calls pass ``residual=None``;
    the new residual is the reduced sum itself).
    ``output_layout``: where the outputs go (:data:`OUTPUT_LAYOUTS`); ``"in_place"`` comes with
    ``inplace=True`` and ``add_residual=True``.
    ``batch_invariant``: ``Config(batch_invariant=True)``: a row's outputs must not depend on the
    token count or the path serving it (only backends declaring ``Capabilities.batch_invariant``
    serve it, and they run their invariant path).
    """

    world_size: int
    hidden_size: int
    dtype: str
    eps: float
    weight_offset: float
    quant: str | None
    scale_layout: str | None
    max_tokens: int
    normed_output: bool
    inplace: bool
    device_type: str
    platform: str
    arch: tuple[int, int] | None = None
    gfx_arch: str | None = None
    norm_options: frozenset[NormOptionName] = frozenset()
    add_residual: bool = True
    batch_invariant: bool = False
    output_layout: OutputLayout = "separate"

    def __post_init__(self) -> None:
        if self.output_layout not in OUTPUT_LAYOUTS:
            choices = ", ".join(OUTPUT_LAYOUTS)
            raise ValueError(f"output_layout: {self.output_layout!r} (needs one of {choices})")
        unknown = sorted(set(self.norm_options) - set(NORM_OPTIONS))
        if unknown:
            raise ValueError(f"norm_options: {unknown} (needs names of {', '.join(NORM_OPTIONS)})")
        on = frozenset(
            n for n in self.norm_options if not NORM_OPTIONS[n].is_void(self.add_residual, self.dtype)
        )
        object.__setattr__(self, "norm_options", on)

    @property
    def quant_name(self) -> str:
        """The quant format, ``"none"`` for no quantized output."""
        return self.quant or "none"

    def short(self) -> str:
        """A one-line summary for logs: ``tp=2 hidden=4096 bfloat16 quant=fp8_static gemma cpu``."""
        norm = {0.0: "plain", 1.0: "gemma"}.get(self.weight_offset, f"offset={self.weight_offset:g}")
        norm += "".join(f"/{o.label}" for n, o in NORM_OPTIONS.items() if n in self.norm_options)
        layout = f"/{self.scale_layout}" if self.scale_layout else ""
        residual = "" if self.add_residual else " no-residual"
        invariant = " batch-invariant" if self.batch_invariant else ""
        in_place = " in-place" if self.output_layout == "in_place" else ""
        return (
            f"tp={self.world_size} hidden={self.hidden_size} {self.dtype} "
            f"quant={self.quant_name}{layout} {norm}{residual}{in_place}{invariant} {self.platform}"
        )
