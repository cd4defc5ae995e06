"""Fixture backends: one correct (:class:`Good`, the one minimal test backend the conformance
fixtures build on), the others wrong in exactly one way each (more in :mod:`.planted`)."""

from __future__ import annotations

from arnorm.plugin import Output, add_rmsnorm, quantize_output


class Good:
    """All-reduce in fp32, round to the dtype, then the reference steps: passes the suite."""

    name = "cf_good"

    def __init__(self, problem, comm):
        self.problem, self.comm = problem, comm

    @classmethod
    def probe(cls, problem):
        return ()

    @classmethod
    def create(cls, problem, comm, settings):
        return cls(problem, comm)

    def check_tokens(self, num_tokens):
        return ()

    def compute(self, hidden_states, residual, weight):
        p = self.problem
        reduced = self.comm.all_reduce_(hidden_states.float()).to(hidden_states.dtype)
        options = dict.fromkeys(p.norm_options, True)
        return add_rmsnorm(reduced, residual, weight, p.eps, p.weight_offset, **options)

    def __call__(self, hidden_states, residual, weight, scale):
        p = self.problem
        h, y = self.compute(hidden_states, residual, weight)
        q = quantize_output(self.quant_input(h, y), p.quant, scale, p.scale_layout)
        if p.inplace:
            h = hidden_states.copy_(h)
        return Output(y if p.normed_output else None, h, q)

    def quant_input(self, h, y):
        return y

    def close(self):
        return None


class Unrounded(Good):
    """Skips the contract's first rounding: adds the fp32 sum to the residual (wrong from 2 ranks)."""

    name = "cf_unrounded"

    def compute(self, hidden_states, residual, weight):
        p = self.problem
        summed = self.comm.all_reduce_(hidden_states.float())
        h = (summed + residual.float()).to(hidden_states.dtype)
        zeros = residual.new_zeros(residual.shape)
        _, y = add_rmsnorm(h, zeros, weight, p.eps, p.weight_offset, **dict.fromkeys(p.norm_options, True))
        return h, y


class Scaled(Good):
    """Its normed output is 3% too large."""

    name = "cf_scaled"

    def compute(self, hidden_states, residual, weight):
        h, y = super().compute(hidden_states, residual, weight)
        return h, (y.float() * 1.03125).to(y.dtype)


class QuantOff(Good):
    """Quantizes a value 6% larger than the normed output it returns."""

    name = "cf_quant_off"

    def quant_input(self, h, y):
        return (y.float() * 1.0625).to(y.dtype)


class ProbeRaises(Good):
    """Its probe raises instead of returning reasons."""

    name = "cf_probe_raises"

    @classmethod
    def probe(cls, problem):
        raise RuntimeError("probe crashed while reading the topology")


class CreateFails(Good):
    """Passes every check, then fails to build its workspace."""

    name = "cf_create_fails"

    @classmethod
    def create(cls, problem, comm, settings):
        raise RuntimeError("workspace allocation failed")


class Incompatible(Good):
    """Its probe rules out every machine: merely ineligible here."""

    name = "cf_incompatible"

    @classmethod
    def probe(cls, problem):
        return ("topology: this machine (needs one that does not exist)",)
