"""``FusedAllReduceNorm``: the protocol every backend class satisfies (checked when it is loaded)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from arnorm._config import BackendSettings
    from arnorm._problem import Problem
    from arnorm._types import Output
    from arnorm.comm._comm import Comm

__all__ = ["FusedAllReduceNorm"]


@runtime_checkable
class FusedAllReduceNorm(Protocol):
    """A backend: a class that arnorm probes, builds once per op, then calls per step.

    Life cycle, driven by :class:`arnorm.AllReduceNorm` (a class missing a method, or whose
    ``name`` differs from the registered one, is a broken plugin when it is loaded):

    1. ``probe(problem)`` (classmethod, per rank, no collective, fast: bounded by
       ``ARNORM_PROBE_TIMEOUT``): everything the declared :class:`arnorm.plugin.Capabilities`
       cannot say (dependency versions, topology, device features). Returns rejection reasons in
       the grammar ``"<aspect>: <found> (needs <required>)"``; empty means eligible on this rank.
       It runs on a helper thread with the op's device current; results are cached per process.
       The backend's module is imported first, on a helper thread bounded the same way: a module
       whose import never returns makes the backend *broken*, and is never imported again.
    2. ``create(problem, comm, settings)`` (classmethod, collective over ``comm``): builds
       workspaces and compiles kernels; ``settings`` is the backend's own
       :class:`arnorm.plugin.BackendSettings` (an empty one when the descriptor declares none).
       Called on every rank only after every rank found the backend eligible; a raise on any rank
       makes every rank reject the backend ("setup_failed").
    3. ``check_tokens(num_tokens)``: which token counts it serves (workspace budgets). Asked for
       every count from 1 to ``max_tokens`` right after ``create`` and agreed across ranks, so it
       must be cheap and depend on the count alone; never called per step.
    4. ``__call__(hidden_states, residual, weight, scale)``: one fused step; ``hidden_states`` is
       this rank's partial sum ``[T, H]``. Inputs arrive validated, without the negative or
       conjugate bit (and contiguous unless the capabilities declare ``strided_rows``).
       ``residual`` is ``None`` for an op built with
       ``add_residual=False`` when the capabilities declare ``residual_free`` (undeclared, such
       an op hands the backend ``-0.0`` rows instead). Returns an :class:`arnorm.Output`. No host
       synchronization, no allocation beyond outputs.
    5. ``close()``: frees this rank's resources. Local (no collective: the core may close a backend
       on some ranks only, after another rank failed its setup) and idempotent.

    Optional: ``input_buffer(num_tokens) -> torch.Tensor | None``, a ``[T, H]`` view of a buffer
    the caller may write the partial sum into (zero-copy input); see ``AllReduceNorm.input_buffer``.

    Optional: ``fast_path() -> Callable | None``, asked once after ``create``: a function
    ``fast(num_tokens, hidden_states, residual, weight, scale, out, hidden_ptr, residual_ptr,
    weight_ptr, scale_ptr) -> Output | None`` called instead of ``__call__`` when the core's check
    found the call valid with contiguous ``hidden_states`` and ``residual``; the pointers are the
    tensors' ``data_ptr()`` (0 for ``None``) and ``out`` is ``None`` or checked caller outputs.
    Used only for backends declaring ``caller_outputs``. Returning ``None`` declines (nothing may
    have been done): the core then calls ``__call__`` with the same arguments.
    """

    name: ClassVar[str]

    @classmethod
    def probe(cls, problem: Problem) -> Sequence[str]: ...

    @classmethod
    def create(cls, problem: Problem, comm: Comm, settings: BackendSettings) -> FusedAllReduceNorm: ...

    def check_tokens(self, num_tokens: int) -> Sequence[str]: ...

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> Output: ...

    def close(self) -> None: ...
