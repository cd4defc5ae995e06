"""Output buffers for one fused call, and how FlashInfer's buffers map onto :class:`arnorm.Output`.

=============  ====================================  ===============================  ======================
quant          FlashInfer writes                     arnorm's ``QuantizedActivation``  scale layout
=============  ====================================  ===============================  ======================
fp8_static     ``quant_out`` e4m3 ``[T, H]``         data; scale = the input scale    -
fp8_per_token  + ``scale_out`` fp32 ``[T, 1]``       data; scale = that tensor        -
nvfp4          ``quant_out`` uint8 ``[T, H/2]``,     data; e4m3 scales;               linear ``[T, H/16]``
               ``scale_out`` 1-D e4m3 bytes          global_scale = the input scale   or 128x4 ``[Tp, Cp]``
mxfp8          ``quant_out`` e4m3 ``[T, H]``,        data; uint8 E8M0 exponents       linear ``[T, H/32]``
               ``scale_out`` 1-D uint8                                                or 128x4 ``[Tp, Cp]``
=============  ====================================  ===============================  ======================

``Tp = round_up(T, 128)``, ``Cp = round_up(C, 4)`` with ``C`` scale columns. The scale tensor is
allocated in arnorm's 2-D shape and FlashInfer receives ``.view(-1)`` of it: its 1-D byte order is
row-major over that shape in both layouts, so the 2-D tensor *is* the result (no copy). The
swizzled buffer is zero-filled first because the kernel leaves the padding unwritten and arnorm's
layout defines it as zero.

``residual_out`` is ``hidden_states`` when the op is in place (the kernel reads each element of
its input before it writes the same element from the same thread, in one-shot and two-shot alike),
else a new ``[T, H]`` buffer: one allocation per call, no copy. In the in-place output layout
(``Problem.output_layout == "in_place"``) ``residual_out`` is ``residual_in`` and ``norm_out`` is
``input``, the aliasing vLLM's own FlashInfer fusion passes in production, by the same per-thread
argument: no ``[T, H]`` buffer is allocated at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from arnorm.plugin import Output, QuantizedActivation, format_spec

if TYPE_CHECKING:
    import torch

    from arnorm.plugin import Problem

__all__ = ["CallPlan"]


class CallPlan:
    """Everything per call that depends only on the problem, resolved once at ``create``.

    Shapes and dtypes come from arnorm's format table (:data:`arnorm.plugin.FORMAT_SPECS`).
    """

    __slots__ = (
        "_data_dtype",
        "_scale_dtype",
        "hidden",
        "in_place",
        "inplace",
        "layout",
        "norm_out",
        "quant",
        "return_normed",
        "spec",
    )

    def __init__(self, problem: Problem) -> None:
        import torch

        self.quant = problem.quant
        self.spec = format_spec(problem.quant) if problem.quant is not None else None
        self.layout = None
        if self.spec is not None and self.spec.block_size:
            self.layout = problem.scale_layout or self.spec.default_layout
        self.hidden = problem.hidden_size
        self.inplace = problem.inplace
        self.in_place = problem.output_layout == "in_place"
        self.return_normed = problem.normed_output
        # kARResidualRMSNorm always writes the norm: without quant it needs a norm_out buffer.
        self.norm_out = problem.normed_output or problem.quant is None
        self._data_dtype = getattr(torch, self.spec.data_dtype) if self.spec else None
        scale_dtype = self.spec.scale_dtype if self.spec else None
        self._scale_dtype = getattr(torch, scale_dtype) if scale_dtype else None

    def allocate(
        self, x: torch.Tensor, scale: torch.Tensor | None, residual: torch.Tensor | None = None
    ) -> tuple[dict[str, Any], Output]:
        """FlashInfer's output keyword arguments for input ``x`` (and ``residual``, written over in
        the in-place layout), and the ``Output`` they fill."""
        import torch

        rows, device = x.shape[0], x.device
        if self.in_place:
            assert residual is not None  # the op refuses the layout without a residual add
            res, norm = residual, (x if self.norm_out else None)
        else:
            res = x if self.inplace else torch.empty_like(x)
            norm = torch.empty_like(x) if self.norm_out else None
        # ``output`` (the plain all-reduce result) is written by pattern 0 only; passing the
        # residual buffer spares FlashInfer an allocation, and were it ever written, the same
        # thread stores the residual over it afterwards.
        kw: dict[str, Any] = {"output": res, "residual_out": res, "norm_out": norm}
        qa = None
        spec = self.spec
        if spec is not None:
            data = torch.empty(spec.data_shape(rows, self.hidden), dtype=self._data_dtype, device=device)
            kw["quant_out"] = data
            shape = spec.scale_shape(rows, self.hidden, self.layout)
            if shape is None:  # fp8_static: the caller's scale is the dequantization scale
                assert scale is not None
                qa = QuantizedActivation(data, scale, spec.name)
            else:
                # The kernel leaves the swizzled padding unwritten; arnorm's layout defines it as 0.
                make = torch.zeros if self.layout == "swizzled_128x4" else torch.empty
                scales = make(shape, dtype=self._scale_dtype, device=device)
                # FlashInfer takes block scales as 1-D bytes in the same row-major order.
                kw["scale_out"] = scales.view(-1) if spec.block_size else scales
                global_scale = scale if spec.keeps_global_scale else None
                qa = QuantizedActivation(data, scales, spec.name, self.layout, global_scale)
        return kw, Output(norm if self.return_normed else None, res, qa)
