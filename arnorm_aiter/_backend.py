"""``AiterBackend``: AITER's ``CustomAllreduce.fused_ar_rms`` behind arnorm's backend protocol.

Life cycle (arnorm's protocol, ``arnorm/_protocol.py``):

* ``probe`` never imports aiter. Off ROCm (``torch.version.hip`` unset) that is itself the reason;
  on ROCm the version comes from package metadata, and the GPU arch, norm and fp8 limits from the
  problem (:mod:`arnorm_aiter._rules`).
* ``create`` imports aiter, then builds one ``CustomAllreduce(cpu_group, device, max_size=pool)``
  (aiter asserts a non-NCCL group: it exchanges IPC handles over the gloo twin of the TP group).
  Both steps are agreed over the CPU group, so every rank raises the same
  :class:`arnorm.BackendSetupError` or none does.
* A call copies the input into the registered buffer (``registered=False``) and runs the 1-stage
  or 2-stage kernel as vLLM chooses. That path is CUDA-graph safe without anything else: the buffer
  was registered with every peer when the op was built. Inside :meth:`AiterBackend.capture` (AITER's
  capture context) an op built with ``inplace=False`` skips the copy instead (``registered=True``);
  AITER registers the captured inputs with the peers when the context exits.
* In-place: the new residual is written straight into ``hidden_states`` (``res_out=hidden_states``).
  That aliasing is safe only on the copy-in path, where the kernel reads the registered copy and
  never ``hidden_states``; on the registered path peers read ``hidden_states`` while the kernel
  runs, which is why in-place ops always copy in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from arnorm.plugin import BackendSettings, BackendSetupError, Output, QuantizedActivation, format_spec
from arnorm_aiter import _rules

if TYPE_CHECKING:
    from arnorm.plugin import Comm, Problem

__all__ = ["AiterBackend"]

_COMMUNICATOR = "aiter.dist.device_communicators.custom_all_reduce"


def _load_communicator() -> type:
    """Import aiter's ``CustomAllreduce`` (JIT-builds ``module_custom_all_reduce`` on first use)."""
    import importlib

    return importlib.import_module(_COMMUNICATOR).CustomAllreduce


def _agree(comm: Comm, error: str, step: str) -> None:
    """Raise the same :class:`BackendSetupError` on every rank if ``step`` failed on any."""
    errors = comm.gather_objects(error)
    if any(errors):
        detail = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        raise BackendSetupError(f"aiter {step}: {detail}")


def _device_guard(device: torch.device) -> Any:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class AiterBackend:
    """ROCm AITER: one fused kernel (1-stage) or two (2-stage) over IPC buffers, TP 2 / 4 / 8."""

    name: ClassVar[str] = "aiter"

    def __init__(self, problem: Problem, comm: Comm, communicator: Any, pool: int) -> None:
        self._problem = problem
        self._comm = comm
        self._car = communicator
        self._pool = pool
        self._hidden = problem.hidden_size
        self._item = _rules.itemsize(problem.dtype)
        self._world = problem.world_size
        self._eps = problem.eps
        self._gemma = problem.weight_offset == 1.0
        self._fp8 = problem.quant == _rules.FP8_FORMAT
        self._normed = problem.normed_output
        self._inplace = problem.inplace
        # AITER turns registration off under expandable segments (IPC cannot export those pointers).
        self._can_register = not problem.inplace and bool(
            getattr(communicator, "enable_register_for_capturing", True)
        )
        self._capturing = False
        self._one_stage: dict[int, bool] = {}
        spec = format_spec(_rules.FP8_FORMAT)
        self._codes_dtype = getattr(torch, spec.data_dtype)
        self._scale_dtype = getattr(torch, spec.scale_dtype or "float32")

    # -- eligibility --------------------------------------------------------------------------

    @classmethod
    def probe(cls, problem: Problem) -> tuple[str, ...]:
        if not getattr(torch.version, "hip", None):
            # Not an import attempt: aiter is only ever imported on ROCm, in create().
            return (f"platform: torch {torch.__version__} without ROCm (needs a ROCm build of torch)",)
        return tuple(_rules.problem_reasons(problem, _rules.installed_version()))

    @classmethod
    def create(cls, problem: Problem, comm: Comm, settings: BackendSettings) -> AiterBackend:
        if comm.cpu_group is None or comm.world_size != problem.world_size:
            ws = comm.world_size
            msg = f"aiter setup: world size {ws} (needs {problem.world_size} ranks with a CPU group)"
            raise BackendSetupError(msg)
        error, communicator_cls = "", None
        try:
            communicator_cls = _load_communicator()
        except (Exception, SystemExit) as exc:  # aiter raises SystemExit when its JIT build fails
            error = f"import {_COMMUNICATOR}: {type(exc).__name__}: {exc}"
        _agree(comm, error, "import")
        assert communicator_cls is not None
        pool = _rules.pool_bytes(problem)
        error, car = "", None
        try:
            with _device_guard(comm.device):
                car = communicator_cls(comm.cpu_group, comm.device, max_size=pool)
            if car.disabled:
                error = "CustomAllreduce disabled itself (needs every rank on one node and its HIP library)"
        except Exception as exc:
            error = f"CustomAllreduce: {type(exc).__name__}: {exc}"
        try:
            _agree(comm, error, "setup")
        except BackendSetupError:
            if car is not None:
                car.close()
            raise
        return cls(problem, comm, car, pool)

    def check_tokens(self, num_tokens: int) -> tuple[str, ...]:
        return tuple(_rules.token_reasons(self._problem, num_tokens, self._pool))

    # -- the call -----------------------------------------------------------------------------

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> Output:
        tokens = hidden_states.shape[0]
        one_stage = self._one_stage.get(tokens)
        if one_stage is None:
            one_stage = self._one_stage[tokens] = _rules.use_one_stage(
                tokens, self._hidden, self._item, self._world
            )
        registered = self._capturing and self._can_register and torch.cuda.is_current_stream_capturing()
        res_out = hidden_states if self._inplace else torch.empty_like(hidden_states)
        if not self._fp8:
            normed = torch.empty_like(hidden_states)
            self._car.fused_ar_rms(
                hidden_states,
                residual,
                res_out=res_out,
                out=normed,
                w=weight,
                eps=self._eps,
                registered=registered,
                use_1stage=one_stage,
                gemma_norm=self._gemma,
            )
            return Output(normed, res_out, None)
        # Shapes as arnorm's format table has them: codes [T, H], per-token scales [T, 1].
        data = torch.empty(hidden_states.shape, dtype=self._codes_dtype, device=hidden_states.device)
        token_scale = torch.empty((tokens, 1), dtype=self._scale_dtype, device=hidden_states.device)
        result = self._car.fused_ar_rms(
            hidden_states,
            residual,
            res_out=res_out,
            out=data,
            scale_out=token_scale,
            w=weight,
            eps=self._eps,
            registered=registered,
            use_1stage=one_stage,
            post_per_token_quant=True,
            gemma_norm=self._gemma,
            emit_bf16=self._normed,
        )
        mirror = result[3] if self._normed else None  # the dtype copy of the normed values (emit_bf16)
        return Output(mirror, res_out, QuantizedActivation(data, token_scale, _rules.FP8_FORMAT))

    # -- graphs and lifetime ------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self) -> Iterator[AiterBackend]:
        """Capture CUDA graphs through AITER's capture context (collective: every rank enters it).

        Optional: without it captured calls copy their input into the registered buffer, which is
        graph safe. Inside it, an op built with ``inplace=False`` passes its input to the kernel
        directly and AITER exchanges the captured input addresses with the peers on exit.
        """
        if self._car is None:
            raise BackendSetupError("aiter capture: closed (needs an open op)")
        with self._car.capture():
            self._capturing = True
            try:
                yield self
            finally:
                self._capturing = False

    def close(self) -> None:
        """Release AITER's communicator and its IPC buffers; idempotent.

        Each fused kernel ends with a cross-rank barrier, so once this rank's stream is drained no
        peer touches its buffers any more: no further collective is needed.
        """
        car, self._car = self._car, None
        if car is None:
            return
        if self._comm.device.type == "cuda":
            with _device_guard(self._comm.device):
                torch.cuda.synchronize()
        car.close()
