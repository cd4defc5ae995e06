"""``AllReduceNorm``: the object engines keep (construction, the checked call, lifetime)."""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from arnorm._config import Config, peer_timeout
from arnorm._errors import ArnormError, ArnormWarning, InvalidInputError, PeerError
from arnorm._problem import Problem
from arnorm._types import Output, RMSNorm
from arnorm.comm._comm import CLOSED, Comm
from arnorm.comm._rendezvous import open_agreement
from arnorm.op._args import build_problem, resolve_device
from arnorm.op._call import call, no_backend
from arnorm.op._caller_outputs import empty_output
from arnorm.op._custom_op import register_handle, unregister_handle
from arnorm.op._faults import claim_group, release, track
from arnorm.op._plan import CallPlan, CallState, build_plan, new_state, unbuilt_plan
from arnorm.op._results import with_zero_residual
from arnorm.registry._capabilities import did_you_mean
from arnorm.registry._discovery import get_registry
from arnorm.registry._explain import Explanation
from arnorm.registry._failure import plugin_failure
from arnorm.registry._load import load_config, load_settings
from arnorm.registry._select import Preference, agree, agreement_facts, select

if TYPE_CHECKING:
    import torch

__all__ = ["AllReduceNorm"]

_building = threading.Lock()


def warn_unknown_names(pref: Preference, registry: Any, stacklevel: int = 5) -> None:
    """A misspelt name in ARNORM_DISABLE, or in a preference list that another name satisfies,
    would otherwise pass in silence (the CLI calls it too, before any work)."""
    known = {i.name for i in registry.infos()}
    named = pref.names if pref.names is not None and len(pref.names) > 1 else ()
    for source, names in (("ARNORM_DISABLE / Config.disable", pref.disabled), (pref.source, named)):
        for name in names:
            if name not in known:
                valid = ", ".join(sorted(known)) + did_you_mean(name, known)
                msg = f"{source}: {name!r} is not a registered backend (needs one of {valid})"
                warnings.warn(msg, ArnormWarning, stacklevel=stacklevel)


@dataclasses.dataclass(frozen=True)
class _Request:
    """The constructor's arguments as the caller gave them: nothing here is checked yet
    (``build_problem`` checks them, before any collective), so the types say what is expected."""

    tp_group: Any
    hidden_size: int
    dtype: torch.dtype
    norm: RMSNorm
    quant: str | None
    max_tokens: int
    backend: str | Sequence[str] | None
    normed_output: bool
    inplace: bool
    scale_layout: str | None
    device: torch.device | str | None
    cpu_group: Any
    config: Config | None
    add_residual: bool
    output_layout: str


class AllReduceNorm:
    """Fused all-reduce + residual add + RMSNorm (+ quantization) over a tensor-parallel group.

    For this rank's partial sum ``x_r`` ``[T, H]``, with ``D`` the op's dtype::

        residual_out = D(D(sum_r fp32(x_r)) + residual)                         # -> Output.residual
        normed       = D(residual_out * rsqrt(mean(residual_out**2) + eps) * (weight_offset + weight))
        quant        = Q(normed)                                                # -> Output.quant

    (with ``RMSNorm(round_before_weight=True)``, ``normed`` rounds ``residual_out * rsqrt(...)`` to
    ``D`` before the weight multiply; with ``add_residual=False`` there is no residual and
    ``residual_out = D(sum_r fp32(x_r))``). Construction is collective and does everything slow
    (discovery, probing, cross-rank agreement, workspace creation) so that a call does no host
    sync, no discovery and no allocation beyond its outputs. Every rank of ``tp_group`` builds the
    op with the same arguments, from one thread, in the same order. One op serves every layer
    with the same configuration: weights and scales are call arguments.

    Args:
        tp_group: the TP ``ProcessGroup`` (``torch.distributed.group.WORLD`` for every rank), or
            :data:`arnorm.LOCAL` for a single process (no all-reduce).
        hidden_size: ``H``.
        dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
        norm: :class:`arnorm.RMSNorm` (``weight_offset=1.0`` for Gemma).
        quant: ``None`` or ``"fp8_static"``, ``"fp8_per_token"``, ``"nvfp4"``, ``"mxfp8"``.
        max_tokens: the largest ``T`` a call may pass; sizes workspaces. At most 2**20
            (:data:`arnorm.op._args.MAX_TOKENS`): construction asks every backend about each count.
        backend: ``None`` for auto, or a name / ordered list of names (strict: no fallback).
        normed_output: also return the normed activation in ``dtype``.
        inplace: write the new residual into ``hidden_states``' buffer.
        output_layout: ``"separate"`` (default): the normed output in a tensor of its own, the new
            residual as ``inplace`` says. ``"in_place"``: the normed output over ``hidden_states``
            and the new residual over ``residual`` (vLLM's ``fused_add_rms_norm`` and FlashInfer's
            ``fused_add_rmsnorm`` layout: two ``[T, H]`` tensors touched instead of three; with
            ``normed_output=False``, ``hidden_states`` may hold anything afterwards, e.g. the reduced
            sum). The result's ``normed`` is
            ``hidden_states`` and its ``residual`` is ``residual``; ``out=`` holds the quantized
            output only. Needs ``inplace=True`` and ``add_residual=True``.
        add_residual: ``False`` for an all-reduce + norm with no residual add (Gemma2/3's norm
            right after the attention / MLP output): calls pass ``residual=None``, and no
            residual is read.
        scale_layout: nvfp4 / mxfp8 block-scale layout (defaults: ``swizzled_128x4`` / ``linear``).
        device: where the tensors live (default: the current CUDA device, else CPU).
        cpu_group: a gloo group over the same ranks, for agreement. Needed when ``tp_group`` is a
            device (NCCL) group smaller than WORLD: pass the engine's TP CPU group.
        config: :class:`arnorm.Config`; default reads the ``ARNORM_*`` environment.

    Raises:
        InvalidInputError, ConfigError: bad arguments or settings on some rank, or ranks that
            disagree on them (raised on every rank).
        NoEligibleBackendError: no backend can serve the problem on every rank.
        PeerError: a peer did not arrive within ``Config.peer_timeout``, abandoned construction
            (an exception or KeyboardInterrupt there), or the op is used after a fork.
        BackendNotInstalledError, BackendBrokenError, BackendSetupError: a named backend cannot serve.
    """

    def __init__(
        self,
        tp_group: Any,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        norm: RMSNorm,
        quant: str | None = None,
        max_tokens: int = 8192,
        backend: str | Sequence[str] | None = None,
        normed_output: bool = True,
        inplace: bool = True,
        scale_layout: str | None = None,
        device: torch.device | str | None = None,
        cpu_group: Any = None,
        config: Config | None = None,
        add_residual: bool = True,
        output_layout: str = "separate",
    ) -> None:
        # Serves nothing until construction succeeds, so close() stays safe.
        self._plan: CallPlan = unbuilt_plan()
        self._state: CallState = CallState(token=[None], owner=0)
        self._chain: list[Any] = []
        self._group_name = ""
        self._release_keys: weakref.finalize[Any, Any] | None = None
        if not _building.acquire(blocking=False):
            msg = (
                "AllReduceNorm: built from two threads at once "
                "(needs ops built from one thread, in the same order on every rank)"
            )
            raise InvalidInputError(msg)
        try:
            request = _Request(tp_group, hidden_size, dtype, norm, quant, max_tokens, backend, normed_output,
                               inplace, scale_layout, device, cpu_group, config, add_residual,
                               output_layout)  # fmt: skip
            self._build(request)
        except BaseException as exc:
            self._abandon(exc)
            raise
        finally:
            _building.release()

    def _build(self, request: _Request) -> None:
        import torch

        r = request
        tp_group, hidden_size, dtype, norm, quant = r.tp_group, r.hidden_size, r.dtype, r.norm, r.quant
        max_tokens, backend, normed_output, inplace = r.max_tokens, r.backend, r.normed_output, r.inplace
        scale_layout, device, cpu_group = r.scale_layout, r.device, r.cpu_group
        # Checked below; a bad value raises on every rank (agree) before select() reads it.
        config: Any = r.config
        add_residual = r.add_residual

        # Everything that may fail on one rank only travels in the first gather, so every rank
        # raises the same error instead of leaving the others waiting. The groups themselves must
        # be right before anything can be gathered: a bad group raises here, on that rank.
        error: ArnormError | None = None
        facts: dict[str, Any] = {}
        try:
            dev = resolve_device(device)
        except ArnormError as exc:
            error, dev = exc, torch.device("cpu")
        comm = Comm.resolve(tp_group, dev, cpu_group)
        self._comm = comm
        owner = 0  # any thread may call an op at TP 1
        if comm.world_size > 1:
            # Before anything is sent: a call or construction from the wrong thread raises on this
            # rank alone, and every rank running the same program raises it alike.
            self._group_name = str(getattr(comm.group, "group_name", id(comm.group)))
            owner = claim_group(self._group_name, self)
            open_agreement(comm, peer_timeout(config))
        registry = get_registry()
        try:
            if error is not None:
                raise error
            problem = build_problem(
                comm.world_size, hidden_size=hidden_size, dtype=dtype, norm=norm, quant=quant,
                scale_layout=scale_layout, max_tokens=max_tokens, normed_output=normed_output,
                inplace=inplace, device=dev, add_residual=add_residual, output_layout=r.output_layout,
            )  # fmt: skip
            if config is None:
                config = load_config()
            elif not isinstance(config, Config):
                raise InvalidInputError(f"config: {type(config).__name__} (needs arnorm.Config(...))")
            problem = config.configured(problem)
            pref = Preference.resolve(backend, config)
            settings = load_settings(registry, config)
            warn_unknown_names(pref, registry)
            facts = agreement_facts(problem, pref, config, settings)
            if comm.world_size > 1:
                # Ranks passing different group objects over the same ranks (WORLD on one, a
                # new_group on another) would never meet in a data collective.
                facts["tp_group"] = self._group_name
                facts["cpu_group"] = str(getattr(comm.cpu_group, "group_name", ""))
        except ArnormError as exc:
            error = exc
        agree(comm, facts, error)
        if config is not None and isinstance(config, Config):
            comm.open_data(config.peer_timeout)
        plan = select(problem, comm, config, pref, registry, settings)
        self._problem, self._comm, self._device = problem, comm, dev
        caps = [registry.get(n).spec.capabilities for n in plan.explanation.chain]  # type: ignore[union-attr]
        chain, explanation = plan.chain, plan.explanation
        if not problem.add_residual:
            chain = with_zero_residual(chain, [c.residual_free for c in caps], plan.table, problem, dev)
            wrapped = [n for n, a, b in zip(explanation.chain, plan.chain, chain, strict=True) if a is not b]
            if wrapped:  # not a rejection, but a cost the user should be able to see
                note = (
                    f"no residual: {', '.join(wrapped)} read rows of a -0.0 buffer as the residual "
                    "(needs Capabilities(residual_free=True) to read none)"
                )
                explanation = dataclasses.replace(
                    explanation, note="\n".join(filter(None, (explanation.note, note)))
                )
        self._explanation, self._chain = explanation, chain
        handle = register_handle(self)
        call_plan = build_plan(
            problem, comm, dev, config, explanation, chain, plan.chain, caps, plan.table, handle
        )
        self._state = new_state(comm, owner, len(call_plan.table))
        track(self)
        if comm.channel is not None:
            comm.channel.phase = "calling"
            # Closed or dropped, the op's store keys go once every rank is done with them.
            self._release_keys = weakref.finalize(self, comm.channel.release)
            self._release_keys.atexit = False  # at exit the store may be gone: nothing to tidy
        self._plan = call_plan

    def _abandon(self, exc: BaseException) -> None:
        """Construction failed on this rank: release the group and tell peers still waiting."""
        if self._group_name:
            release(self._group_name, self)
        comm = getattr(self, "_comm", None)
        channel = getattr(comm, "channel", None)
        if channel is not None:
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            channel.abandon(
                f"peers: {channel.who([channel.rank])} abandoned building {channel.describe()}: {what}"
            )
        if comm is not None:
            comm.close()  # the exception's traceback holds this half-built op: hold no group

    # -- calls (arnorm.op._call) -------------------------------------------------------------

    __call__ = call

    def empty_output(self, num_tokens: int, scale: torch.Tensor | None = None) -> Output:
        """Uninitialized buffers for ``num_tokens`` tokens, to pass as ``out=`` (engines keeping buffers).

        ``normed`` ``[T, H]`` when the op has a normed output; ``residual`` ``[T, H]`` when the op
        is not in place, else ``None``; ``quant`` as :func:`arnorm.quant.empty_quantized` makes it
        (``scale``: the fp32 ``[1]`` scale it records for fp8_static / nvfp4; out= ignores it).
        """
        t = self._check_tokens_arg(num_tokens)
        assert self._plan.out_rules is not None
        return empty_output(self._plan.out_rules, t, scale)

    @property
    def _closed(self) -> bool:
        return self._plan.closed

    def _check_tokens_arg(self, num_tokens: object) -> int:
        plan = self._plan
        if plan.closed:
            raise InvalidInputError(CLOSED)
        if plan.poisoned is not None:
            raise PeerError(plan.poisoned)
        limit = self._problem.max_tokens
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 0 < num_tokens <= limit:
            raise InvalidInputError(f"num_tokens: {num_tokens!r} (needs an int from 1 to {limit})")
        return num_tokens

    # -- introspection ----------------------------------------------------------------------

    @property
    def problem(self) -> Problem:
        """The static description this op was built for."""
        return self._problem

    @property
    def backend(self) -> str:
        """The selected backend (the first of the chain)."""
        return self._explanation.chain[0]

    def backend_for(self, num_tokens: int) -> str:
        """The backend a call with ``num_tokens`` tokens runs on."""
        impl = self._plan.table[self._check_tokens_arg(num_tokens)]
        if impl is None:
            raise no_backend(num_tokens)
        return self._explanation.chain[self._chain.index(impl)]

    def input_buffer(self, num_tokens: int) -> torch.Tensor | None:
        """A ``[T, H]`` view of this rank's registered buffer that the row-parallel GEMM may write into.

        A call whose ``hidden_states`` is this view skips the copy into the backend's workspace
        (zero-copy). ``None`` when the backend serving ``num_tokens`` has no such buffer. The
        buffer belongs to the op: its contents change with every call.
        """
        impl = self._plan.table[self._check_tokens_arg(num_tokens)]
        get = getattr(impl, "input_buffer", None)
        if get is None:
            return None
        return get(num_tokens)

    def explain(self, num_tokens: int | None = None) -> Explanation:
        """Every backend's verdict; with ``num_tokens``, also which one serves it and why not the others."""
        if self._closed:
            return dataclasses.replace(self._explanation, closed=True)
        if num_tokens is None:
            return self._explanation
        t = self._check_tokens_arg(num_tokens)
        served = self._plan.table[t]
        skipped = []
        for name, impl in zip(self._explanation.chain, self._chain, strict=True):
            if impl is served:
                break
            # Counts are served only where every rank serves them: this rank may have said yes.
            reasons = tuple(impl.check_tokens(t)) or (
                f"tokens: {t} (served on this rank, not on every rank)",
            )
            skipped.append((name, reasons))
        backend = None if served is None else self._explanation.chain[self._chain.index(served)]
        return dataclasses.replace(
            self._explanation, num_tokens=t, token_backend=backend, token_reasons=tuple(skipped)
        )

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Free the backends' workspaces, then let go of the process groups. Idempotent; calls
        afterwards raise.

        Local: it enters no collective, so ranks may close in any order (a backend that must
        synchronize its peers does so in its own call path).
        """
        plan = self._plan
        if plan.closed:
            return
        self._plan = plan.emptied(closed=True)
        if self._group_name:
            release(self._group_name, self)
        unregister_handle(plan.handle)
        chain, self._chain = self._chain, []
        for impl in chain:
            try:
                impl.close()
            except BaseException as exc:  # plugin code: report, never leave the other backends open
                warnings.warn(
                    f"arnorm: {type(impl).__name__}.close() raised {plugin_failure(exc)}", ArnormWarning, 2
                )
        if self._release_keys is not None:
            self._release_keys()
        self._comm.close()  # after the backends: a plugin's close() may still read its Comm

    # -- no copies ---------------------------------------------------------------------------

    def _not_copyable(self, *args: object) -> Any:
        # A copy would share the call plan and state, the group claim and the communicator, so closing
        # it would break the original; a pickle would need a live process group on the other side.
        raise TypeError(
            "op: an AllReduceNorm cannot be copied or pickled (needs a new arnorm.AllReduceNorm, built "
            "collectively on every rank; deepcopy or pickle the model before attaching the op)"
        )

    __copy__ = __deepcopy__ = __reduce_ex__ = __reduce__ = __getstate__ = _not_copyable

    def __enter__(self) -> AllReduceNorm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if not hasattr(self, "_problem"):
            return "AllReduceNorm(<not built>)"
        state = "closed" if self._closed else "+".join(self._explanation.chain)
        return f"AllReduceNorm({self._problem.short()}, backend={state})"
