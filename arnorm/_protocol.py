"""``FusedAllReduceNorm``: the protocol every backend class satisfies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from arnorm._comm import Comm
    from arnorm._config import Config
    from arnorm._problem import Problem
    from arnorm._types import Output

__all__ = ["FusedAllReduceNorm"]


@runtime_checkable
class FusedAllReduceNorm(Protocol):
    """A backend: a class that arnorm probes, builds once per op, then calls per step.

    Life cycle, driven by :class:`arnorm.AllReduceNorm`:

    1. ``probe(problem)`` (classmethod, per rank, no collective): everything the declared
       :class:`arnorm.Capabilities` cannot say (dependency versions, topology, device features).
       Returns rejection reasons in the grammar ``"<aspect>: <found> (needs <required>)"``; empty
       means eligible on this rank.
    2. ``create(problem, comm, config)`` (classmethod, collective over ``comm``): builds
       workspaces and compiles kernels. Called on every rank only after every rank found the
       backend eligible.
    3. ``check_tokens(num_tokens)``: the only per-call check (workspace budgets); its answer is
       cached per token count, so it must depend on nothing else.
    4. ``__call__(hidden_states, residual, weight, scale)``: one fused step; ``hidden_states`` is
       this rank's partial sum ``[T, H]``. Inputs arrive validated. Returns an
       :class:`arnorm.Output`. No host synchronization, no allocation beyond outputs.
    5. ``close()`` (collective): frees workspaces; idempotent.
    """

    name: ClassVar[str]

    @classmethod
    def probe(cls, problem: Problem) -> Sequence[str]: ...

    @classmethod
    def create(cls, problem: Problem, comm: Comm, config: Config) -> FusedAllReduceNorm: ...

    def check_tokens(self, num_tokens: int) -> Sequence[str]: ...

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> Output: ...

    def close(self) -> None: ...
