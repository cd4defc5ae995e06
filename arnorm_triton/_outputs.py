"""What a `triton` or `triton_symm` call returns besides the residual, planned once per op."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from arnorm.plugin import FORMAT_SPECS, Output, QuantizedActivation, round_up

if TYPE_CHECKING:
    import torch

__all__ = ["OutputPlan"]


class OutputPlan:
    """Allocates a call's normed / codes / scales tensors and wraps them as :class:`arnorm.Output`,
    shaped and typed as :func:`arnorm.quant.quantize` returns them (``arnorm.plugin.FORMAT_SPECS``)."""

    def __init__(self, *, hidden: int, dtype: torch.dtype, quant: str | None, layout: str | None,
                 normed: bool, device: Any) -> None:  # fmt: skip
        import torch

        self.hidden = hidden
        self.dtype = dtype
        self.quant = quant
        self.normed = normed
        self.device = device
        spec = FORMAT_SPECS[quant] if quant is not None else None
        self.layout: str | None = None
        self.data_dtype: Any = None
        self.scale_dtype: Any = None
        self.data_cols = self.scale_cols = 0
        #: 0 none, 1 fp8_static (the caller's scale), 2 per-token scales [T, 1], 3 block scales,
        #: 4 block scales plus the caller's global encode scale (nvfp4).
        self.kind = 0
        if spec is not None:
            self.data_dtype = getattr(torch, spec.data_dtype)
            self.data_cols = hidden // spec.elements_per_byte
            if spec.scale_dtype is not None:
                self.scale_dtype = getattr(torch, spec.scale_dtype)
            if spec.block_size:
                self.layout = layout or spec.default_layout
                self.scale_cols = hidden // spec.block_size
                if self.layout == "swizzled_128x4":
                    self.scale_cols = round_up(self.scale_cols, 4)
            if spec.scale_dtype is None:
                self.kind = 1
            elif not spec.block_size:
                self.kind, self.scale_cols = 2, 1
            else:
                self.kind = 4 if spec.takes_scale else 3
        self.swizzled = self.layout == "swizzled_128x4"

    def alloc(self, t: int) -> tuple[Any, Any, Any]:
        """``(normed, codes, scales)`` for ``t`` tokens; ``None`` where the variant has none."""
        import torch

        dev = self.device
        y = torch.empty((t, self.hidden), dtype=self.dtype, device=dev) if self.normed else None
        if self.kind == 0:
            return y, None, None
        q = torch.empty((t, self.data_cols), dtype=self.data_dtype, device=dev)
        if self.kind == 1:
            return y, q, None
        rows = round_up(t, 128) if self.swizzled else t
        return y, q, torch.empty((rows, self.scale_cols), dtype=self.scale_dtype, device=dev)

    def output(self, y: Any, h: Any, q: Any, sf: Any, scale: Any) -> Output:
        kind = self.kind
        if kind == 0:
            return Output(y, h, None)
        if kind == 1:
            return Output(y, h, QuantizedActivation(q, scale, "fp8_static"))
        if kind == 2:
            return Output(y, h, QuantizedActivation(q, sf, "fp8_per_token"))
        gs = scale if kind == 4 else None  # nvfp4 keeps the caller's global encode scale
        return Output(y, h, QuantizedActivation(q, sf, self.quant, self.layout, gs))  # type: ignore[arg-type]
