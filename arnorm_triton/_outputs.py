"""What a `triton` or `triton_symm` call returns besides the residual, planned once per op."""

from __future__ import annotations

from collections.abc import Callable
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
        #: The kernel reads the caller's fp32 [1] scale (fp8_static's dequant, nvfp4's global encode).
        self.takes_scale = spec is not None and spec.takes_scale
        #: The kernel writes scales of its own (per-token or block scales).
        self.computes_scales = spec is not None and spec.scale_dtype is not None
        if spec is not None:
            self.data_dtype = getattr(torch, spec.data_dtype)
            self.data_cols = hidden // spec.elements_per_byte
            scale_dtype = spec.scale_dtype_in(layout or spec.default_layout)
            if scale_dtype is not None:
                self.scale_dtype = getattr(torch, scale_dtype)
            if spec.block_size:
                self.layout = layout or spec.default_layout
                self.scale_cols = hidden // spec.block_size
                if self.layout == "swizzled_128x4":
                    self.scale_cols = round_up(self.scale_cols, 4)
            if spec.scale_dtype is not None and not spec.block_size:
                self.scale_cols = 1  # one scale per row
        self.spec = spec
        self.swizzled = self.layout == "swizzled_128x4"
        #: The per-group fp8 formats' transposed layouts: ``[C, rows]``, rows padded to 4 for TMA.
        self.transposed = self.layout in ("column_major", "column_major_tma", "packed_ue8m0")
        self.tma = self.layout in ("column_major_tma", "packed_ue8m0")
        if self.layout == "packed_ue8m0":
            self.scale_cols = -(-self.scale_cols // 4)

        # The call path: per-variant closures over locals, built once (a call pays no attribute
        # reads or branches on the plan), exposed as the attributes ``alloc`` and ``output``.
        self.alloc: Callable[[int], tuple[Any, Any, Any]] = self._make_alloc(torch.empty)
        self.output: Callable[[Any, Any, Any, Any, Any], Output] = self._make_output()

    def _make_alloc(self, empty: Callable[..., Any]) -> Callable[[int], tuple[Any, Any, Any]]:
        """``alloc(t)`` -> ``(normed, codes, scales)`` for ``t`` tokens; ``None`` where the variant has
        none. Sizes go to ``torch.empty`` as separate integers: its argument parser takes them about
        0.3 us faster than a shape tuple (measured on CPU, torch 2.13)."""
        h, dt, dev, normed = self.hidden, self.dtype, self.device, self.normed
        cols, data_dt, scols, scale_dt = self.data_cols, self.data_dtype, self.scale_cols, self.scale_dtype
        quantized, own_scales, swizzled = self.spec is not None, self.computes_scales, self.swizzled
        transposed, tma = self.transposed, self.tma

        if not quantized and normed:
            return lambda t: (empty(t, h, dtype=dt, device=dev), None, None)
        if not quantized:
            return lambda t: (None, None, None)
        if not own_scales and not normed:
            return lambda t: (None, empty(t, cols, dtype=data_dt, device=dev), None)

        def alloc(t: int) -> tuple[Any, Any, Any]:
            y = empty(t, h, dtype=dt, device=dev) if normed else None
            q = empty(t, cols, dtype=data_dt, device=dev)
            if not own_scales:
                return y, q, None
            rows = -(-t // 128) * 128 if swizzled else t  # round_up(t, 128), inline
            return y, q, empty(rows, scols, dtype=scale_dt, device=dev)

        def alloc_transposed(t: int) -> tuple[Any, Any, Any]:
            y = empty(t, h, dtype=dt, device=dev) if normed else None
            rows = -(-t // 4) * 4 if tma else t
            return (
                y,
                empty(t, cols, dtype=data_dt, device=dev),
                empty(scols, rows, dtype=scale_dt, device=dev),
            )

        return alloc_transposed if transposed else alloc

    def _make_output(self) -> Callable[[Any, Any, Any, Any, Any], Output]:
        """``output(y, h, q, sf, scale)`` -> the call's :class:`arnorm.Output`.

        Both result types are ``NamedTuple``s: when their fields are as this code expects,
        ``tuple.__new__`` builds exactly what their constructors build, without the generated
        ``__new__``'s Python frame (about 0.1 us per call, measured); otherwise the constructors."""
        spec, fmt, layout = self.spec, self.quant, self.layout
        direct = Output._fields == ("normed", "residual", "quant") and QuantizedActivation._fields == (
            "data",
            "scale",
            "format",
            "layout",
            "global_scale",
        )
        if not direct:
            return self._output_by_constructors
        new = tuple.__new__
        # One closure per scale rule of the format table, so a call branches on nothing.
        if spec is None:
            return lambda y, h, q, sf, scale: new(Output, (y, h, None))
        if spec.returns_input_scale:
            return lambda y, h, q, sf, scale: new(
                Output, (y, h, new(QuantizedActivation, (q, scale, fmt, None, None)))
            )
        if spec.keeps_global_scale:
            return lambda y, h, q, sf, scale: new(
                Output, (y, h, new(QuantizedActivation, (q, sf, fmt, layout, scale)))
            )
        return lambda y, h, q, sf, scale: new(
            Output, (y, h, new(QuantizedActivation, (q, sf, fmt, layout, None)))
        )

    def _output_by_constructors(self, y: Any, h: Any, q: Any, sf: Any, scale: Any) -> Output:
        spec = self.spec
        if spec is None:
            return Output(y, h, None)
        if spec.returns_input_scale:
            return Output(y, h, QuantizedActivation(q, scale, spec.name))
        gs = scale if spec.keeps_global_scale else None
        return Output(y, h, QuantizedActivation(q, sf, spec.name, self.layout, gs))
