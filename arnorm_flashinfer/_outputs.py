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
else a new ``[T, H]`` buffer: one allocation per call, no copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from arnorm._types import Output, QuantizedActivation

if TYPE_CHECKING:
    import torch

    from arnorm._problem import Problem

__all__ = ["OutputPlan"]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class OutputPlan:
    """Everything per call that depends only on the problem, resolved once at ``create``."""

    __slots__ = ("_fp8", "_u8", "block", "hidden", "inplace", "layout", "norm_out", "quant", "return_normed")

    def __init__(self, problem: Problem) -> None:
        import torch

        self.quant = problem.quant
        self.layout = problem.scale_layout if problem.quant in ("nvfp4", "mxfp8") else None
        self.hidden = problem.hidden_size
        self.inplace = problem.inplace
        self.return_normed = problem.normed_output
        # kARResidualRMSNorm always writes the norm: without quant it needs a norm_out buffer.
        self.norm_out = problem.normed_output or problem.quant is None
        self.block = {"nvfp4": 16, "mxfp8": 32}.get(problem.quant or "", 0)
        self._fp8 = torch.float8_e4m3fn
        self._u8 = torch.uint8

    def _scales(self, rows: int, device: torch.device) -> torch.Tensor:
        import torch

        cols = self.hidden // self.block
        if self.layout == "swizzled_128x4":
            return torch.zeros((_round_up(rows, 128), _round_up(cols, 4)), dtype=self._u8, device=device)
        return torch.empty((rows, cols), dtype=self._u8, device=device)

    def allocate(self, x: torch.Tensor, scale: torch.Tensor | None) -> tuple[dict[str, Any], Output]:
        """FlashInfer's output keyword arguments for input ``x``, and the ``Output`` they fill."""
        import torch

        rows, device = x.shape[0], x.device
        res = x if self.inplace else torch.empty_like(x)
        norm = torch.empty_like(x) if self.norm_out else None
        # ``output`` (the plain all-reduce result) is written by pattern 0 only; passing the
        # residual buffer spares FlashInfer an allocation, and were it ever written, the same
        # thread stores the residual over it afterwards.
        kw: dict[str, Any] = {"output": res, "residual_out": res, "norm_out": norm}
        qa = None
        quant = self.quant
        if quant == "fp8_static":
            data = torch.empty((rows, self.hidden), dtype=self._fp8, device=device)
            kw["quant_out"] = data
            assert scale is not None
            qa = QuantizedActivation(data, scale, quant)
        elif quant == "fp8_per_token":
            data = torch.empty((rows, self.hidden), dtype=self._fp8, device=device)
            token_scale = torch.empty((rows, 1), dtype=torch.float32, device=device)
            kw["quant_out"], kw["scale_out"] = data, token_scale
            qa = QuantizedActivation(data, token_scale, quant)
        elif quant == "nvfp4":
            data = torch.empty((rows, self.hidden // 2), dtype=self._u8, device=device)
            sf = self._scales(rows, device).view(self._fp8)
            kw["quant_out"], kw["scale_out"] = data, sf.view(-1)
            qa = QuantizedActivation(data, sf, quant, self.layout, scale)
        elif quant == "mxfp8":
            data = torch.empty((rows, self.hidden), dtype=self._fp8, device=device)
            sf = self._scales(rows, device)
            kw["quant_out"], kw["scale_out"] = data, sf.view(-1)
            qa = QuantizedActivation(data, sf, quant, self.layout)
        return kw, Output(norm if self.return_normed else None, res, qa)
