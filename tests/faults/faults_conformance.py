"""Backends that break the contract in ways only the conformance suite can see (issue 41, item 4),
served to test_faults_conformance.py's suite run through a generated entry point naming this module."""

from __future__ import annotations

from arnorm_conformance_fixtures import PLANTED_CAPS
from arnorm_conformance_fixtures.planted import Planted, SizeGated

from arnorm.plugin import BackendSpec, hookimpl


class WritesResidual(Planted):
    """Right values, but adds its residual into the caller's ``residual`` (it does not own it)."""

    name = "fc_writes_residual"

    def __call__(self, hidden_states, residual, weight, scale):
        out = super().__call__(hidden_states, residual, weight, scale)
        if residual is not None:
            residual.add_(1)
        return out


class WritesWeight(Planted):
    """Right values, but scales the caller's ``weight`` in place afterwards."""

    name = "fc_writes_weight"

    def __call__(self, hidden_states, residual, weight, scale):
        out = super().__call__(hidden_states, residual, weight, scale)
        weight.mul_(2)
        return out


class SkipsOnRankOne(Planted):
    """Skips its all-reduce on rank 1 (a size-gated shortcut gone wrong): rank 1 reduces nothing."""

    name = "fc_skips_on_one"

    def compute(self, hidden_states, residual, weight):
        if self.comm.rank != 1:
            return super().compute(hidden_states, residual, weight)
        from arnorm.plugin import add_rmsnorm

        p = self.problem
        options = dict.fromkeys(p.norm_options, True)
        return add_rmsnorm(hidden_states, residual, weight, p.eps, p.weight_offset, **options)


class NotInvariant(SizeGated):
    """Declares batch_invariant; above 64 tokens its statistic comes from another kernel."""

    name = "fc_not_invariant"


def _spec(name: str, cls: str, **caps: object) -> BackendSpec:
    return BackendSpec(
        name=name, priority=-100, capabilities=PLANTED_CAPS.model_copy(update=caps),
        loader=f"faults_conformance:{cls}",
    )  # fmt: skip


@hookimpl
def arnorm_backends():
    return [
        _spec("fc_writes_residual", "WritesResidual"),
        _spec("fc_writes_weight", "WritesWeight"),
        _spec("fc_skips_on_one", "SkipsOnRankOne"),
        _spec("fc_not_invariant", "NotInvariant", batch_invariant=True),
    ]
