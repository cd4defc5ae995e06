"""Backends with one planted bug each, beside the fixtures of :mod:`.backends`: the conformance
suite must fail each of them (tests/testing/test_conformance_suite.py). They share the one minimal
correct backend, :class:`~arnorm_conformance_fixtures.backends.Good`."""

from __future__ import annotations

from arnorm.plugin import add_rmsnorm
from arnorm_conformance_fixtures.backends import Good


class Planted(Good):
    """Correct (the reference steps after an fp32 all-reduce) until a subclass plants its bug."""

    name = "pl_correct"


class InPlace(Good):
    """Correct, the in-place output layout included: the new residual over residual, the normed
    output over hidden_states."""

    name = "pl_in_place"

    def __call__(self, hidden_states, residual, weight, scale):
        out = super().__call__(hidden_states, residual, weight, scale)
        if self.problem.output_layout != "in_place":
            return out
        new_residual = residual.copy_(out.residual)  # first: an in-place op's is hidden_states
        normed = hidden_states.copy_(out.normed) if out.normed is not None else None
        return out._replace(normed=normed, residual=new_residual)


class SeparateInPlace(Good):
    """Declares the in-place output layout but writes separate outputs whatever the op asks."""

    name = "pl_separate_in_place"


class WritesInput(Good):
    """Writes the new residual into hidden_states even when the op was built with inplace=False."""

    name = "pl_writes_input"

    def __call__(self, hidden_states, residual, weight, scale):
        out = super().__call__(hidden_states, residual, weight, scale)
        return out._replace(residual=hidden_states.copy_(out.residual))


class ContiguousRows(Good):
    """Declares strided_rows but reads row i at i * H, as if the rows were contiguous."""

    name = "pl_contiguous_rows"

    def compute(self, hidden_states, residual, weight):
        def packed(t):
            return t if t is None else t.as_strided(t.shape, (t.shape[1], 1))

        return super().compute(packed(hidden_states), packed(residual), weight)


class WritesPacked(Good):
    """Declares strided_rows, reads the rows right, but writes the new residual as packed rows."""

    name = "pl_writes_packed"

    def __call__(self, hidden_states, residual, weight, scale):
        out = super().__call__(hidden_states, residual, weight, scale)
        if not self.problem.inplace:
            return out
        t, h = hidden_states.shape
        return out._replace(residual=hidden_states.as_strided((t, h), (h, 1)).copy_(out.residual))


class QuantizesResidual(Good):
    """Without a normed output, quantizes the new residual instead of the normed activation."""

    name = "pl_quantizes_residual"

    def quant_input(self, h, y):
        return y if self.problem.normed_output else h


class ReturnsTuple(Good):
    """Returns a plain (normed, residual, quant) tuple instead of an arnorm.plugin.Output."""

    name = "pl_returns_tuple"

    def __call__(self, hidden_states, residual, weight, scale):
        return tuple(super().__call__(hidden_states, residual, weight, scale))


class ReturnsNone(Good):
    """Writes its results into hidden_states and returns None."""

    name = "pl_returns_none"

    def __call__(self, hidden_states, residual, weight, scale):
        super().__call__(hidden_states, residual, weight, scale)


class IgnoresOut(Good):
    """Declares caller_outputs, takes out= and returns new tensors, leaving the caller's unwritten."""

    name = "pl_ignores_out"

    def __call__(self, hidden_states, residual, weight, scale, out=None):
        return super().__call__(hidden_states, residual, weight, scale)


class Invariant(Good):
    """Correct, and declares batch_invariant: its statistic is the reference's invariant one."""

    name = "pl_invariant"

    def compute(self, hidden_states, residual, weight):
        p = self.problem
        reduced = self.comm.all_reduce_(hidden_states.float()).to(hidden_states.dtype)
        options = dict.fromkeys(p.norm_options, True)
        return add_rmsnorm(reduced, residual, weight, p.eps, p.weight_offset, **options,
                           batch_invariant=p.batch_invariant)  # fmt: skip


class SizeGated(Invariant):
    """Declares batch_invariant, but above 64 tokens runs a "second kernel" that takes the norm's
    statistic over the unrounded fp32 sum (as a size-gated two-stage kernel does), not over the
    rounded residual: within the contract's 1 ulp, and not batch invariant."""

    name = "pl_size_gated"

    def compute(self, hidden_states, residual, weight):
        h, y = super().compute(hidden_states, residual, weight)
        if hidden_states.shape[0] <= 64 or residual is None:
            return h, y
        import torch

        p = self.problem
        reduced = self.comm.all_reduce_(hidden_states.float())
        h32 = reduced + residual.float()
        inv = torch.rsqrt(h32.square().mean(dim=-1, keepdim=True) + p.eps)
        return h, (h.float() * inv * (weight.float() + p.weight_offset)).to(h.dtype)


class OnlyFourRanks(Good):
    """Correct, and declares world size 4 only."""

    name = "pl_only_four_ranks"
