"""Backends that break a promise at the op boundary, for tests/faults/test_faults_plugins.py.

They declare ``Capabilities(caller_outputs=True)`` (the core hands them the caller's ``out=``) and
then ignore ``out``: one in ``__call__``, one in its fast path. Their results are right; only the
caller's buffers are left unwritten.
"""

from __future__ import annotations

from typing import ClassVar

from arnorm.plugin import BackendSpec, Capabilities

import fake_backends

WRITES_OUT = Capabilities(platforms=frozenset({"cpu", "cuda"}), caller_outputs=True)


class IgnoresOut(fake_backends.AllReduceBackend):
    """Takes ``out`` and returns new tensors instead."""

    name: ClassVar[str] = "ignores_out"

    def __call__(self, hidden_states, residual, weight, scale, out=None):
        return super().__call__(hidden_states, residual, weight, scale)


class FastIgnoresOut(IgnoresOut):
    """Its ``__call__`` honours ``out``; its fast path does not."""

    name: ClassVar[str] = "fast_ignores_out"

    def __call__(self, hidden_states, residual, weight, scale, out=None):
        got = fake_backends.AllReduceBackend.__call__(self, hidden_states, residual, weight, scale)
        if out is None:
            return got
        from arnorm.op._results import copy_into

        return copy_into(got, out, self.problem.inplace)

    def fast_path(self):
        def fast(t, x, res, w, scale, out, xp, rp, wp, sp):
            return fake_backends.AllReduceBackend.__call__(self, x, res, w, scale)

        return fast


def spec(cls: type) -> BackendSpec:
    return BackendSpec(
        name=cls.name, priority=70, capabilities=WRITES_OUT, loader=f"{__name__}:{cls.__name__}"
    )


def build_with_import_hanging_on_rank_one(rank: int, world: int) -> tuple:
    """Rank side: auto mode with a backend whose module import never returns on rank 1."""
    import torch

    import arnorm

    fake_backends.install(
        BackendSpec(
            name="hangs_on_one",
            priority=70,
            capabilities=fake_backends.CPU_ANY,
            loader="faults_hangs_on_rank_one:Backend",
        )
    )
    group = torch.distributed.group.WORLD
    args = dict(hidden_size=8, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), device="cpu")
    with arnorm.AllReduceNorm(group, config=arnorm.Config(probe_timeout=2), **args) as op:
        v = op.explain().verdict("hangs_on_one")
        x = torch.full((2, 8), float(rank + 1))
        got = op(x, torch.zeros(2, 8), torch.ones(8))
        return op.backend, v.status, v.reasons, got.residual[0, 0].item()
