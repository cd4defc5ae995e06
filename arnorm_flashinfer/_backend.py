"""``FlashInferBackend``: arnorm's backend over ``flashinfer.comm.allreduce_fusion``."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, ClassVar

from arnorm.plugin import DTYPE_BYTES, BackendSetupError, InvalidInputError, format_spec
from arnorm_flashinfer import _workspace
from arnorm_flashinfer._api import FlashInferAPI, api_reasons, load
from arnorm_flashinfer._outputs import CallPlan
from arnorm_flashinfer._preflight import _join as _join_errors
from arnorm_flashinfer._preflight import build_modules, decide, local_facts, mnnvl_blocker
from arnorm_flashinfer._rules import launcher_reasons

if TYPE_CHECKING:
    import torch

    from arnorm.plugin import Comm, Output, Problem
    from arnorm_flashinfer._plugin import FlashInferSettings

__all__ = ["FlashInferBackend"]

_UNSET: Any = object()


def _group_key(comm: Comm) -> tuple[Any, ...]:
    name = getattr(comm.group, "group_name", None)
    return (name if name else f"id:{id(comm.group)}", comm.world_size)


class FlashInferBackend:
    """One fused FlashInfer kernel per call over a TRT-LLM IPC (Lamport) workspace.

    Patterns: ``kARResidualRMSNorm`` (no quant), static FP8 (``FP8Quant`` / ``OutFP8Quant``),
    per-token FP8 (``DynamicFP8Quant`` / ``OutDynamicFP8Quant``), NVFP4 (SM100+ only) and MXFP8
    (when the installed FlashInfer defines those patterns); the ``Out`` variant when the op returns
    the normed activation. Every call passes ``use_oneshot`` explicitly (a pure function of the
    shape, the same on every rank), ``fp32_acc=True``, ``weight_bias`` = the norm's weight offset,
    the scale as the caller's fp32 ``[1]`` device tensor, and leaves ``trigger_completion_at_end``
    at its default. ``launch_with_pdl`` is off (a class attribute): FlashInfer before 0.7.4 reads the
    residual and the weight before the kernel's grid-dependency wait (0.7.4 waits first), so with
    PDL a producer that signals completion early could be read too soon.

    Numerics (read in the kernel source; docs/numerics.md's contract): the sum is accumulated in
    fp32 in rank order 0..N-1 and rounded once, then the residual is added in fp32 and rounded, and
    the statistic is taken over that rounded residual, which is arnorm's order. ``residual`` is
    bitwise equal to the reference, except that the one-shot kernel turns ``-0.0`` partials into
    ``+0.0`` (its "not yet written" sentinel). FlashInfer builds with ``-use_fast_math``
    (approximate ``rsqrtf`` and reciprocals, FMA contraction, flush-to-zero): ``normed`` is within
    1 ulp of the reference, and ``quant`` may differ from ``Q(normed)`` by one code in rare elements
    (fp8 codes, nvfp4 block scales, per-token scales by 1 ulp). The opt-in MNNVL kernels multiply
    in another order (1 ulp of ``normed`` again).

    Workspace: sized from a per-(arch, world size) budget (vLLM's table, or
    ``ARNORM_FLASHINFER_MAX_SIZE_MB``), shared by ops of the same group, hidden size and dtype,
    created collectively after every rank agreed on its facts (see ``_preflight``), freed when the
    last op holding it closes and at interpreter exit. ``ARNORM_FLASHINFER_MNNVL`` opts into the
    MNNVL workspace when every rank supports multicast (never FlashInfer's ``auto``).
    ``close()`` enters no collective (the core closes a backend on the ranks where setup succeeded
    only, after a failure elsewhere); it synchronizes this rank's device before freeing. Calls on
    one workspace must be issued in the same order on every rank and from one stream; CUDA graphs
    may capture calls (the workspace exists before capture, outputs come from the graph's pool),
    but a graph must not be replayed after ``close()``.
    """

    name: ClassVar[str] = "flashinfer"
    #: Programmatic Dependent Launch; see the class docstring for why it is off.
    launch_with_pdl: ClassVar[bool] = False

    def __init__(
        self, problem: Problem, comm: Comm, api: FlashInferAPI, entry: _workspace.Entry, plan: Any
    ) -> None:
        import torch

        self._problem = problem
        self._comm = comm
        self._entry: _workspace.Entry | None = entry
        self._workspace = entry.workspace
        self._fused = api.comm.allreduce_fusion
        self._kind = entry.kind
        self._capacity = min(plan.tokens, entry.capacity)
        self._budget = plan.budget
        self._budget_source = plan.budget_source
        self._dtype = getattr(torch, problem.dtype)
        self._elem = DTYPE_BYTES[problem.dtype]
        self._pattern = api.pattern(problem.quant, problem.normed_output)
        spec = format_spec(problem.quant) if problem.quant is not None else None
        self._layout_code = api.layout_code(
            problem.scale_layout if spec is not None and spec.block_size else None
        )
        self._outputs = CallPlan(problem)
        self._static_scale = spec is not None and spec.takes_scale
        self._eps = float(problem.eps)
        self._offset = float(problem.weight_offset)
        self._oneshot: dict[int, bool | None] = {}

    @property
    def kind(self) -> str:
        """``"trtllm"`` or ``"mnnvl"``: the FlashInfer workspace this op runs on."""
        return self._kind

    @property
    def capacity(self) -> int:
        """The most tokens one call may pass."""
        return self._capacity

    # -- selection --------------------------------------------------------------------------

    @classmethod
    def probe(cls, problem: Problem) -> tuple[str, ...]:
        """Per rank, no collective: the launcher's hidden-size limit, then the installed FlashInfer.

        Everything else (platform, world sizes, dtypes per format, architectures) is declared in
        the capabilities and checked by the core before this runs.
        """
        reasons = list(launcher_reasons(problem))
        if importlib.util.find_spec("flashinfer") is None:
            return (*reasons, "flashinfer: not installed (needs pip install 'arnorm[flashinfer]')")
        api, why = load()
        if api is None:
            return (*reasons, str(why))
        return (*reasons, *api_reasons(api, problem.quant, problem.normed_output))

    @classmethod
    def create(cls, problem: Problem, comm: Comm, settings: FlashInferSettings) -> FlashInferBackend:
        """Collective: gather every rank's facts, agree, then create (or reuse) the workspace.

        Every rank reaches the gather whatever failed locally, and every rank derives the same
        plan from the gathered facts, so a failure raises the same ``BackendSetupError`` on every
        rank before any of FlashInfer's collectives starts.
        """
        api, why = load()
        reasons = list(launcher_reasons(problem))
        if api is None:
            reasons.append(str(why))
        else:
            reasons.extend(api_reasons(api, problem.quant, problem.normed_output))
        if comm.world_size != problem.world_size:
            reasons.append(f"world size: {comm.world_size} ranks in the group (needs {problem.world_size})")
        base_key = (*_group_key(comm), problem.hidden_size, problem.dtype)
        cached = {}
        for kind in ("trtllm", "mnnvl"):
            state = _workspace.cached_state((*base_key, kind))
            if state is not None:
                cached[kind] = state
        # Two rounds: the cheap facts (topology, memory) first, so that a rejected topology (two
        # ranks on one GPU, no peer access) never pays the minutes of the JIT build; then the build.
        facts = local_facts(problem, comm, settings, api, tuple(reasons), cached)
        gathered = comm.gather_objects(facts)
        want_mnnvl = settings.mnnvl and mnnvl_blocker(problem, api) is None
        plan = decide(gathered, problem, want_mnnvl, shared_gpu=settings.shared_gpu)
        if plan.error is not None:
            raise BackendSetupError(plan.error)
        assert api is not None
        built = comm.gather_objects(build_modules(api, plan.kind, comm.device))
        if any(built):
            raise BackendSetupError(_join_errors(built))
        key = (*base_key, plan.kind)

        def factory() -> Any:
            return _create_workspace(api, plan, problem, comm)

        entry = _workspace.acquire(key, plan.reuse, plan.kind, plan.tokens, factory, comm.device)
        return cls(problem, comm, api, entry, plan)

    # -- per call ---------------------------------------------------------------------------

    def _oneshot_for(self, num_tokens: int) -> bool | None:
        p = self._problem
        flag: bool | None = None  # MNNVL: its own AUTO rule, deterministic and how its workspace was sized
        if self._kind != "mnnvl":
            flag = _workspace.use_oneshot(
                num_tokens, p.hidden_size, self._elem, p.world_size, p.arch or (9, 0)
            )
        self._oneshot[num_tokens] = flag
        return flag

    def check_tokens(self, num_tokens: int) -> tuple[str, ...]:
        """Tokens within the workspace: our budget, then FlashInfer's ``is_buffer_size_sufficient``."""
        if num_tokens < 1:
            return (f"tokens: {num_tokens} (needs >= 1)",)
        if num_tokens > self._capacity:
            return (
                f"tokens: {num_tokens} (needs <= {self._capacity}: the workspace holds {self._budget:g} MiB "
                f"per rank ({self._budget_source}); raise ARNORM_FLASHINFER_MAX_SIZE_MB)",
            )
        if self._workspace is None:
            return ("workspace: closed (needs a new op)",)
        p = self._problem
        try:
            ok = self._workspace.is_buffer_size_sufficient(
                p.world_size, num_tokens, p.hidden_size, self._dtype
            )
        except Exception as exc:  # FlashInfer's check must not break dispatch
            return (
                f"tokens: {num_tokens} (needs flashinfer's is_buffer_size_sufficient to pass; "
                f"it raised {type(exc).__name__}: {exc})",
            )
        if not ok:
            return (
                f"tokens: {num_tokens} (needs a workspace holding {num_tokens} x {p.hidden_size}: "
                "flashinfer's is_buffer_size_sufficient said no)",
            )
        self._oneshot_for(num_tokens)
        return ()

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> Output:
        if weight.dtype is not hidden_states.dtype:
            msg = (
                f"weight: dtype {weight.dtype} "
                f"(needs {hidden_states.dtype}: flashinfer reads rms_gamma as the input type)"
            )
            raise InvalidInputError(msg)
        if self._workspace is None:
            raise InvalidInputError("flashinfer: closed (needs a new op)")
        num_tokens = hidden_states.shape[0]
        oneshot = self._oneshot.get(num_tokens, _UNSET)
        if oneshot is _UNSET:
            oneshot = self._oneshot_for(num_tokens)
        kw, out = self._outputs.allocate(hidden_states, scale, residual)
        self._fused(
            input=hidden_states,
            workspace=self._workspace,
            pattern=self._pattern,
            launch_with_pdl=self.launch_with_pdl,
            residual_in=residual,
            rms_gamma=weight,
            rms_eps=self._eps,
            scale_factor=scale if self._static_scale else None,
            layout_code=self._layout_code,
            use_oneshot=oneshot,
            fp32_acc=True,
            weight_bias=self._offset,
            **kw,
        )
        return out

    def close(self) -> None:
        """Release this op's hold on the workspace; the last holder frees it. Idempotent, no collective."""
        entry, self._entry = self._entry, None
        self._workspace = None
        if entry is not None:
            _workspace.release(entry)

    def __repr__(self) -> str:
        state = "closed" if self._entry is None else f"{self._kind}, {self._capacity} tokens"
        return f"FlashInferBackend({self._problem.short()}, {state})"


def _create_workspace(api: FlashInferAPI, plan: Any, problem: Problem, comm: Comm) -> Any:
    """FlashInfer's collective creation with the TP group and a CommBackend on its CPU twin, never WORLD."""
    import torch

    kwargs: dict[str, Any] = {
        "backend": plan.kind,
        "world_size": comm.world_size,
        "rank": comm.rank,
        "max_token_num": _workspace.alloc_tokens(plan.tokens, DTYPE_BYTES[problem.dtype], comm.world_size),
        "hidden_dim": problem.hidden_size,
        "dtype": getattr(torch, problem.dtype),
        "comm_backend": api.torch_dist_backend(comm.cpu_group),
        "group": comm.group,
    }
    if plan.kind == "mnnvl":
        kwargs["gpus_per_node"] = plan.gpus_per_node
    if getattr(comm.device, "type", None) == "cuda":
        with torch.cuda.device(comm.device):
            return api.comm.create_allreduce_fusion_workspace(**kwargs)
    return api.comm.create_allreduce_fusion_workspace(**kwargs)
