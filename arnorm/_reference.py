"""The numerics contract in plain torch, and the ``reference`` backend built on it.

Steps (docs/numerics.md, "The contract"), for partials ``x_r`` in dtype ``D``:

1. ``s = D(sum_r fp32(x_r))``, fp32 accumulation in rank order, one rounding;
2. ``h = D(fp32(s) + fp32(residual))``                                   -> ``Output.residual``
   (no residual, ``add_residual=False``: ``h = s``);
3. ``y = D(fp32(h) * rsqrt(mean(fp32(h)**2) + eps) * (b + fp32(g)))``     -> ``Output.normed``
   (``round_before_weight``: ``y = D(fp32(D(fp32(h) * rsqrt(...))) * (b + fp32(g)))``;
   ``normalize_unrounded``: ``fp32(s) + fp32(residual)``, not rounded, in place of ``fp32(h)``);
4. ``q = Q(y)``: the quantizer reads the ``D``-rounded ``y``              -> ``Output.quant``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from arnorm._norm import NORM_OPTIONS
from arnorm._types import Output, QuantizedActivation, RMSNorm

if TYPE_CHECKING:
    import torch

    from arnorm._config import BackendSettings
    from arnorm._problem import Problem
    from arnorm.comm._comm import Comm

__all__ = [
    "ReferenceBackend",
    "add_rmsnorm",
    "apply_norm",
    "mean_square_rows",
    "quantize_output",
    "rank_order_sum",
]


def rank_order_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Step 1: ``D(sum_r fp32(parts[r]))``, accumulated in fp32 from rank 0 up."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def mean_square_rows(hf: torch.Tensor) -> torch.Tensor:
    """``mean(hf**2)`` of each row of fp32 ``[T, H]`` as ``[T, 1]``, summed by a fixed pairwise tree
    of elementwise adds (lanes ``i`` and ``i + n/2`` of the row zero-padded to a power of two, then
    halved again), then divided by ``H``.

    Only elementwise operations: each is correctly rounded per element whatever the tensor's
    shape, so a row's result is bitwise independent of how many rows come with it. A torch
    reduction is not: its split of a row over threads (CPU, rows of 32768 elements and more at
    T = 1) or blocks (CUDA) depends on the number of rows.
    """
    import torch.nn.functional as F

    n = hf.shape[-1]
    acc = hf.square()
    width = 1 << max(0, n - 1).bit_length()
    if width != n:
        acc = F.pad(acc, (0, width - n))
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc / n


def add_rmsnorm(
    reduced: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    round_before_weight: bool = False,
    normalize_unrounded: bool = False,
    *,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2 and 3: ``(h, y)`` from the reduced sum ``s``; both in the dtype of ``reduced``.

    ``reduced`` and ``residual`` are ``[T, H]`` (any row strides), ``weight`` is ``[H]``;
    ``residual=None`` is no add (``h`` is ``reduced`` itself, not a copy).
    Each option of :class:`arnorm.RMSNorm` is a keyword of its name (:func:`apply_norm` passes them).
    ``normalize_unrounded``: the norm reads the fp32 sum before it is rounded to ``h``.
    ``batch_invariant``: the statistic by :func:`mean_square_rows` (a row's result independent of
    the other rows) instead of torch's ``mean``.
    """
    import torch

    if residual is None:
        h = hf = reduced
    else:
        hf = reduced.float() + residual.float()
        h = hf.to(reduced.dtype)
    if not normalize_unrounded or residual is None:
        hf = h
    hf = hf.float()
    mean_sq = mean_square_rows(hf) if batch_invariant else hf.square().mean(dim=-1, keepdim=True)
    inv_rms = torch.rsqrt(mean_sq + eps)
    normalized = hf * inv_rms
    if round_before_weight:
        normalized = normalized.to(reduced.dtype).float()
    y = (normalized * (weight.float() + weight_offset)).to(reduced.dtype)
    return h, y


def apply_norm(
    reduced: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    norm: RMSNorm,
    *,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rmsnorm` with ``norm``'s epsilon, weight offset and options."""
    options = {name: getattr(norm, name) for name in NORM_OPTIONS}
    return add_rmsnorm(
        reduced, residual, weight, norm.eps, norm.weight_offset, **options, batch_invariant=batch_invariant
    )


def quantize_output(
    y: torch.Tensor, quant: str | None, scale: torch.Tensor | None, layout: str | None
) -> QuantizedActivation | None:
    """Step 4 through the bit-exact quantizers of :mod:`arnorm.quant` (``None`` when ``quant`` is)."""
    if quant is None:
        return None
    from arnorm.quant import quantize

    return quantize(y, quant, scale=scale, layout=layout)


class ReferenceBackend:
    """Pure torch on any device: all-gather the partials, then steps 1-4 exactly as written.

    Slow (several kernels and a gather of every partial) and always correct: it is the oracle the
    other backends are checked against and the fallback auto mode ends on. For batch-invariant ops
    (``problem.batch_invariant``) it takes the norm's statistic by :func:`mean_square_rows`.
    """

    name: ClassVar[str] = "reference"

    def __init__(self, problem: Problem, comm: Comm) -> None:
        self._problem = problem
        self._norm = RMSNorm.with_options(problem.eps, problem.weight_offset, problem.norm_options)
        self._comm = comm

    @classmethod
    def probe(cls, problem: Problem) -> tuple[str, ...]:
        return ()

    @classmethod
    def create(cls, problem: Problem, comm: Comm, settings: BackendSettings) -> ReferenceBackend:
        return cls(problem, comm)

    def check_tokens(self, num_tokens: int) -> tuple[str, ...]:
        return ()

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> Output:
        p = self._problem
        if self._comm.world_size == 1:
            reduced = hidden_states
        else:
            reduced = rank_order_sum(self._comm.all_gather(hidden_states))
        h, y = apply_norm(reduced, residual, weight, self._norm, batch_invariant=p.batch_invariant)
        q = quantize_output(y, p.quant, scale, p.scale_layout)
        if p.output_layout == "in_place":
            assert residual is not None  # the op refuses the layout without a residual add
            residual.copy_(h)
            normed = hidden_states.copy_(y) if p.normed_output else None
            return Output(normed, residual, q)
        if p.inplace:
            h = hidden_states.copy_(h)
        elif h is hidden_states:  # no residual at TP 1: the output is a new tensor all the same
            h = h.clone()
        return Output(y if p.normed_output else None, h, q)

    def close(self) -> None:
        return None
