"""Functions the ranks of the arnorm.testing tests run (importable by name, as run_ranks needs), and
the backends with one planted bug each that the conformance suite must fail (see the end)."""

from __future__ import annotations

import os
import signal

if os.environ.get("TESTING_RANK_FNS_BREAK_IMPORT") == "1":
    raise ImportError("testing_rank_fns: broken on purpose on this rank")

from arnorm.plugin import BackendSpec, Capabilities, Output, add_rmsnorm, hookimpl, quantize_output


def rank_and_world(rank: int, world: int, extra: object = None) -> tuple[int, int, object]:
    """Return what the rank was given."""
    return rank, world, extra


def fail_on_rank_one(rank: int, world: int) -> str:
    """Rank 1 raises at once; rank 0 waits in a collective that can never complete."""
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one gives up")
    dist.barrier()
    return "unreachable"


def exit_on_rank_one(rank: int, world: int) -> str:
    """Rank 1 leaves without a word (os._exit); rank 0 waits in a collective."""
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.barrier()
    return "unreachable"


def segfault_on_rank_one(rank: int, world: int) -> str:
    """Rank 1 is killed by SIGSEGV; rank 0 waits in a collective."""
    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return "unreachable"


def unpicklable_result(rank: int, world: int) -> object:
    """A return value that cannot travel back to the parent."""
    return lambda: None


def sleep_on_rank_one(rank: int, world: int) -> int:
    """Rank 1 hangs (a stuck kernel, a deadlock); rank 0 returns at once."""
    import time

    if rank == 1:
        time.sleep(3600)
    return rank


# -- backends with one planted bug each ------------------------------------------------------------
# test_conformance_suite.py serves them through a generated entry point (``arnorm.backends``
# group, naming this module) and shows that the conformance suite fails each of them.

#: Capabilities of the planted backends: bf16, no quant, any world size, unless a backend widens them.
PLANTED_CAPS = Capabilities(platforms=frozenset({"cpu", "cuda"}), dtypes=frozenset({"bfloat16"}))


class Planted:
    """Correct (the reference steps after an fp32 all-reduce) until a subclass plants its bug."""

    name = "pl_correct"

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

    def __call__(self, hidden_states, residual, weight, scale):
        p = self.problem
        h, y = self.compute(hidden_states, residual, weight)
        q = quantize_output(self.quant_input(h, y), p.quant, scale, p.scale_layout)
        if p.inplace:
            h = hidden_states.copy_(h)
        return Output(y if p.normed_output else None, h, q)

    def compute(self, hidden_states, residual, weight):
        p = self.problem
        reduced = self.comm.all_reduce_(hidden_states.float()).to(hidden_states.dtype)
        return add_rmsnorm(reduced, residual, weight, p.eps, p.weight_offset, p.round_before_weight)

    def quant_input(self, h, y):
        return y

    def close(self):
        return None


class WritesInput(Planted):
    """Writes the new residual into hidden_states even when the op was built with inplace=False."""

    name = "pl_writes_input"

    def __call__(self, hidden_states, residual, weight, scale):
        out = super().__call__(hidden_states, residual, weight, scale)
        return out._replace(residual=hidden_states.copy_(out.residual))


class ContiguousRows(Planted):
    """Declares strided_rows but reads row i at i * H, as if the rows were contiguous."""

    name = "pl_contiguous_rows"

    def compute(self, hidden_states, residual, weight):
        def packed(t):
            return t if t is None else t.as_strided(t.shape, (t.shape[1], 1))

        return super().compute(packed(hidden_states), packed(residual), weight)


class WritesPacked(Planted):
    """Declares strided_rows, reads the rows right, but writes the new residual as packed rows."""

    name = "pl_writes_packed"

    def __call__(self, hidden_states, residual, weight, scale):
        out = super().__call__(hidden_states, residual, weight, scale)
        if not self.problem.inplace:
            return out
        t, h = hidden_states.shape
        return out._replace(residual=hidden_states.as_strided((t, h), (h, 1)).copy_(out.residual))


class QuantizesResidual(Planted):
    """Without a normed output, quantizes the new residual instead of the normed activation."""

    name = "pl_quantizes_residual"

    def quant_input(self, h, y):
        return y if self.problem.normed_output else h


class ReturnsTuple(Planted):
    """Returns a plain (normed, residual, quant) tuple instead of an arnorm.plugin.Output."""

    name = "pl_returns_tuple"

    def __call__(self, hidden_states, residual, weight, scale):
        return tuple(super().__call__(hidden_states, residual, weight, scale))


class ReturnsNone(Planted):
    """Writes its results into hidden_states and returns None."""

    name = "pl_returns_none"

    def __call__(self, hidden_states, residual, weight, scale):
        super().__call__(hidden_states, residual, weight, scale)


class IgnoresOut(Planted):
    """Declares caller_outputs, takes out= and returns new tensors, leaving the caller's unwritten."""

    name = "pl_ignores_out"

    def __call__(self, hidden_states, residual, weight, scale, out=None):
        return super().__call__(hidden_states, residual, weight, scale)


class Invariant(Planted):
    """Correct, and declares batch_invariant: its statistic is the reference's invariant one."""

    name = "pl_invariant"

    def compute(self, hidden_states, residual, weight):
        p = self.problem
        reduced = self.comm.all_reduce_(hidden_states.float()).to(hidden_states.dtype)
        return add_rmsnorm(reduced, residual, weight, p.eps, p.weight_offset, p.round_before_weight,
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


class OnlyFourRanks(Planted):
    """Correct, and declares world size 4 only."""

    name = "pl_only_four_ranks"


def _planted(name: str, cls: str, **caps: object) -> BackendSpec:
    # Priority below the reference's: auto mode never picks these in the process that discovers them.
    return BackendSpec(
        name=name,
        priority=-100,
        capabilities=PLANTED_CAPS.model_copy(update=caps),
        loader=f"testing_rank_fns:{cls}",
    )


INVARIANT_QUANT = frozenset({"none", "fp8_per_token"})


@hookimpl
def arnorm_backends():
    return [
        _planted("pl_correct", "Planted", quant=frozenset({"none", "fp8_per_token"}), strided_rows=True),
        _planted("pl_writes_input", "WritesInput"),
        _planted("pl_contiguous_rows", "ContiguousRows", strided_rows=True),
        _planted("pl_writes_packed", "WritesPacked", strided_rows=True),
        _planted("pl_quantizes_residual", "QuantizesResidual", quant=frozenset({"none", "fp8_per_token"})),
        _planted("pl_returns_tuple", "ReturnsTuple"),
        _planted("pl_returns_none", "ReturnsNone"),
        _planted("pl_only_four_ranks", "OnlyFourRanks", world_sizes=frozenset({4})),
        _planted("pl_ignores_out", "IgnoresOut", caller_outputs=True),
        _planted("pl_invariant", "Invariant", quant=INVARIANT_QUANT, batch_invariant=True),
        _planted("pl_size_gated", "SizeGated", batch_invariant=True),
    ]
