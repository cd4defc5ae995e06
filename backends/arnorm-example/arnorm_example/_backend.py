"""The backend: all-reduce in fp32 (exact in rank order for two ranks), then arnorm's reference
add + RMSNorm, compiled once with torch.compile on GPUs."""

from __future__ import annotations

import torch

from arnorm.plugin import Comm, Output, Problem, add_rmsnorm, quantize_output
from arnorm_example._plugin import ExampleSettings


class ExampleBackend:
    """The ``arnorm.FusedAllReduceNorm`` protocol, checked when arnorm loads the class; one
    instance per op and rank, built by ``create``."""

    # The registered name (the descriptor's): arnorm refuses a class that claims another.
    name = "example"

    def __init__(self, problem: Problem, comm: Comm, settings: ExampleSettings) -> None:
        self.problem, self.comm = problem, comm
        # The reference's own arithmetic: compiled, it still rounds where the contract rounds.
        use_compile = settings.compile and problem.platform != "cpu"
        self._norm = torch.compile(add_rmsnorm, dynamic=True) if use_compile else add_rmsnorm
        # add_rmsnorm takes each option of RMSNorm as a keyword of its name; norm_options names the
        # options this op turns on, among those the descriptor declares. Built once, not per call.
        self._options = dict.fromkeys(problem.norm_options, True)

    @classmethod
    def probe(cls, problem: Problem) -> tuple[str, ...]:
        # Per rank, fast, no collective: what Capabilities cannot declare (a library version, the
        # topology). Nothing here: the declared capabilities say it all.
        return ()

    @classmethod
    def create(cls, problem: Problem, comm: Comm, settings: ExampleSettings) -> ExampleBackend:
        # On every rank once all found the backend eligible: workspaces and compilation go here.
        return cls(problem, comm, settings)

    def check_tokens(self, num_tokens: int) -> tuple[str, ...]:
        # No workspace to outgrow: every token count up to the op's max_tokens is served.
        return ()

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> Output:
        p = self.problem
        # The contract's first rounding: the reduced sum is rounded to the dtype before the residual
        # is added. The sum runs in place, so on a copy: for fp32 input .float() would be
        # hidden_states itself, which an op built with inplace=False must leave as it was.
        reduced = self.comm.all_reduce_(hidden_states.to(torch.float32, copy=True)).to(hidden_states.dtype)
        h, y = self._norm(reduced, residual, weight, p.eps, p.weight_offset, **self._options)
        q = quantize_output(y, p.quant, scale, p.scale_layout)
        if p.inplace:
            h = hidden_states.copy_(h)
        return Output(y if p.normed_output else None, h, q)

    def close(self) -> None:
        # Local and idempotent: this backend holds nothing to free.
        return None
