"""``AllReduceNorm``: the object engines keep (construction, the checked call, lifetime)."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from arnorm._args import build_problem, resolve_device
from arnorm._call import Trust, agree_call, guard, no_backend, with_zero_residual
from arnorm._comm import Comm
from arnorm._config import Config, load_config
from arnorm._custom_op import call_custom_op, register_handle, unregister_handle
from arnorm._discovery import ArnormWarning, get_registry, plugin_failure
from arnorm._errors import ArnormError, InvalidInputError
from arnorm._explain import Explanation
from arnorm._out import (
    CopyInto,
    OutRules,
    OutTrust,
    check_out_inputs,
    check_out_tensors,
    copy_into,
    empty_output,
)
from arnorm._problem import Problem
from arnorm._select import Preference, agree, agreement_facts, load_settings, select
from arnorm._types import Output, RMSNorm
from arnorm._validate import CallRules, check_call, needs_scale

if TYPE_CHECKING:
    import torch

__all__ = ["AllReduceNorm"]

_building = threading.Lock()


def _warn_unknown_names(pref: Preference, registry: Any) -> None:
    """A misspelt name in ARNORM_DISABLE, or in a preference list that another name satisfies,
    would otherwise pass in silence."""
    known = {i.name for i in registry.infos()}
    named = pref.names if pref.names is not None and len(pref.names) > 1 else ()
    for source, names in (("ARNORM_DISABLE / Config.disable", pref.disabled), (pref.source, named)):
        for name in names:
            if name not in known:
                valid = ", ".join(sorted(known))
                msg = f"{source}: {name!r} is not a registered backend (needs one of {valid})"
                warnings.warn(msg, ArnormWarning, stacklevel=5)


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
        max_tokens: the largest ``T`` a call may pass; sizes workspaces.
        backend: ``None`` for auto, or a name / ordered list of names (strict: no fallback).
        normed_output: also return the normed activation in ``dtype``.
        inplace: write the new residual into ``hidden_states``' buffer.
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
    ) -> None:
        self._closed = True  # until construction succeeds, so close() stays safe
        self._chain: list[Any] = []
        self._table: list[Any] = []
        self._into_table: list[Any] = []
        if not _building.acquire(blocking=False):
            msg = (
                "AllReduceNorm: built from two threads at once "
                "(needs ops built from one thread, in the same order on every rank)"
            )
            raise InvalidInputError(msg)
        try:
            self._build(tp_group, hidden_size, dtype, norm, quant, max_tokens, backend, normed_output,
                        inplace, scale_layout, device, cpu_group, config, add_residual)  # fmt: skip
        finally:
            _building.release()

    def _build(self, tp_group: Any, hidden_size: Any, dtype: Any, norm: Any, quant: Any, max_tokens: Any,
               backend: Any, normed_output: Any, inplace: Any, scale_layout: Any, device: Any, cpu_group: Any,
               config: Any, add_residual: Any) -> None:  # fmt: skip
        import torch

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
        registry = get_registry()
        try:
            if error is not None:
                raise error
            problem = build_problem(
                comm.world_size, hidden_size=hidden_size, dtype=dtype, norm=norm, quant=quant,
                scale_layout=scale_layout, max_tokens=max_tokens, normed_output=normed_output,
                inplace=inplace, device=dev, add_residual=add_residual,
            )  # fmt: skip
            if config is None:
                config = load_config()
            elif not isinstance(config, Config):
                raise InvalidInputError(f"config: {type(config).__name__} (needs arnorm.Config(...))")
            pref = Preference.resolve(backend, config)
            settings = load_settings(registry, config)
            _warn_unknown_names(pref, registry)
            facts = agreement_facts(problem, pref, config, settings)
        except ArnormError as exc:
            error = exc
        agree(comm, facts, error)
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
        self._table = [None if i < 0 else chain[i] for i in plan.table]
        into = [
            impl if c.caller_outputs else CopyInto(impl, problem.inplace)
            for impl, c in zip(chain, caps, strict=True)
        ]
        self._into_table = [None if i < 0 else into[i] for i in plan.table]
        self._out_rules = OutRules(problem.hidden_size, getattr(torch, problem.dtype), dev, problem.quant,
                                   problem.scale_layout, problem.normed_output, problem.inplace)  # fmt: skip
        self._out_trust = OutTrust(self._out_rules)
        strided = all(c.strided_rows for c in caps)
        self._rules = CallRules(problem.hidden_size, problem.max_tokens, getattr(torch, problem.dtype),
                                dev, problem.quant, needs_scale(problem.quant), problem.inplace,
                                strided, problem.add_residual)  # fmt: skip
        # Hot-path constants: attribute reads on self are most of the cost of a valid call.
        self._max_tokens = problem.max_tokens
        self._hidden = problem.hidden_size
        self._dtype = self._rules.dtype
        self._itemsize = torch.empty((), dtype=self._dtype).element_size()
        self._row_bytes = problem.hidden_size * self._itemsize
        self._strided = strided
        self._on_cpu = dev.type == "cpu"
        self._index = -1 if dev.index is None else dev.index
        self._scaled = self._rules.needs_scale
        self._inplace = problem.inplace
        self._add_residual = problem.add_residual
        self._trust = Trust(self._rules)
        self._trusted_weights = self._trust.weights
        self._trusted_scales = self._trust.scales
        self._last_weight: Any = None
        self._last_wptr = -1
        # Acquired without blocking: atomic, so two threads can never both run a call.
        self._in_call = threading.Lock()
        self._check_calls = bool(config.check_calls)
        self._seq = 0
        self._is_compiling = torch.compiler.is_compiling
        self._grad_enabled = torch.is_grad_enabled
        self._handle = register_handle(self)
        self._closed = False

    # -- calls ------------------------------------------------------------------------------

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        *,
        out: Output | None = None,
    ) -> Output:
        """Run one fused step; see the class docstring for the formula.

        Args:
            hidden_states: ``[T, H]`` this rank's partial sum (becomes the new residual when the
                op is in place). Rows may be strided when every backend of the op says so.
            residual: ``[T, H]``, not modified; must not share memory with ``hidden_states``.
                ``None`` exactly when the op was built with ``add_residual=False``.
            weight: ``[H]`` norm weight in the op's dtype (raw Gemma weight; the offset is added).
            scale: fp32 ``[1]`` on the op's device: the dequant scale (fp8_static) or the global
                encode scale (nvfp4); ``None`` for the other formats.
            out: caller-owned buffers for exactly ``T`` tokens, written instead of allocating
                (:meth:`empty_output` makes one; an earlier call's result may be passed back). The
                result holds ``out``'s tensors. Each is contiguous, 16-byte aligned and shares no
                byte with another or with the inputs (README, "Caller-provided outputs").

        One call at a time per op: a second, concurrent call from another thread raises.
        """
        if self._is_compiling():
            if out is not None:  # fake tensors have no data pointers: everything else is checked
                check_out_tensors(self._out_rules, out, hidden_states.shape[0])
            result = call_custom_op(self, self._handle, hidden_states, residual, weight, scale)
            return result if out is None else copy_into(result, out, self._inplace)
        if self._check_calls:
            self._seq += 1
            agree_call(
                self._comm,
                self._rules,
                self._seq,
                hidden_states,
                residual,
                weight,
                scale,
                self._out_check(out),
            )
        if residual is None:
            return self._call_without_residual(hidden_states, weight, scale, out)
        if not self._in_call.acquire(False):
            raise InvalidInputError("op: called from two threads at once (needs one call at a time per op)")
        try:
            # One combined test of arnorm._validate's rule (that module says it in words, and
            # check_call builds the message when this fails); a property test holds them equal.
            try:
                shape = hidden_states.shape
                t = shape[0]
                h = self._hidden
                hp, rp, wp = hidden_states.data_ptr(), residual.data_ptr(), weight.data_ptr()
                if hidden_states.is_contiguous() and residual.is_contiguous():
                    hn = rn = t * self._row_bytes
                    ok = abs(hp - rp) >= hn
                elif self._strided:
                    hst, rst = hidden_states.stride(), residual.stride()
                    hn = ((t - 1) * hst[0] + h) * self._itemsize
                    rn = ((t - 1) * rst[0] + h) * self._itemsize
                    ok = (h == 1 or hst[1] == rst[1] == 1) and (t == 1 or (hst[0] >= h and rst[0] >= h))
                    ok = ok and (hp >= rp + rn or rp >= hp + hn)
                else:
                    ok = False
                dt = self._dtype
                if self._on_cpu:  # is_cpu and get_device() both exclude meta tensors, and are cheap
                    ok = ok and hidden_states.is_cpu and residual.is_cpu
                else:
                    ok = (
                        ok
                        and hidden_states.get_device() == self._index
                        and residual.get_device() == self._index
                    )
                ok = (
                    ok
                    and self._add_residual
                    and hidden_states.dtype is dt
                    and residual.dtype is dt
                    and len(shape) == 2
                    and shape[1] == h
                    and 0 < t <= self._max_tokens
                    and residual.shape == shape
                    and (
                        (weight is self._last_weight and wp == self._last_wptr)
                        or self._trusted_weights.get(id(weight)) == wp
                        or self._trust_weight(weight, wp)
                    )
                    and (wp >= hp + hn or hp >= wp + self._row_bytes)
                )
                if scale is not None:
                    sp = scale.data_ptr()
                    ok = (
                        ok
                        and (self._trusted_scales.get(id(scale)) == sp or self._trust.scale(scale, sp))
                        and (sp >= hp + hn or hp >= sp + 4)
                    )
                elif self._scaled:
                    ok = False
                grad = (
                    ok
                    and self._grad_enabled()
                    and (hidden_states.requires_grad or residual.requires_grad or weight.requires_grad)
                )
                if grad and self._inplace and hidden_states.requires_grad and hidden_states.is_leaf:
                    ok = False
            except (AttributeError, TypeError, IndexError, RuntimeError):
                ok = grad = False
            if not ok:
                check_call(self._rules, hidden_states, residual, weight, scale)
                grad = self._grad_enabled() and (
                    hidden_states.requires_grad or residual.requires_grad or weight.requires_grad
                )
                t = hidden_states.shape[0]
            impl = self._table[t]
            if impl is None:
                raise self._closed_error() if self._closed else no_backend(t)
            if out is None:
                result = impl(hidden_states, residual, weight, scale)
            else:
                # The inputs' byte ranges the fast test computed, or None where it failed.
                spans = (hp, hp + hn, rp, rp + rn, wp, sp if scale is not None else 0) if ok else None
                result = self._into(out, t, spans, hidden_states, residual, weight, scale)
            return guard(result, hidden_states, residual, weight) if grad else result
        finally:
            self._in_call.release()

    def _call_without_residual(self, hidden_states: Any, weight: Any, scale: Any, out: Any) -> Output:
        # The rule of __call__'s fast test with no residual to place or compare (the same
        # property test covers both); the weight and scale parts are the same expressions.
        if not self._in_call.acquire(False):
            raise InvalidInputError("op: called from two threads at once (needs one call at a time per op)")
        try:
            try:
                shape = hidden_states.shape
                t = shape[0]
                h = self._hidden
                hp, wp = hidden_states.data_ptr(), weight.data_ptr()
                if hidden_states.is_contiguous():
                    hn = t * self._row_bytes
                    ok = not self._add_residual
                elif self._strided:
                    hst = hidden_states.stride()
                    hn = ((t - 1) * hst[0] + h) * self._itemsize
                    ok = not self._add_residual and (h == 1 or hst[1] == 1) and (t == 1 or hst[0] >= h)
                else:
                    ok = False
                if self._on_cpu:
                    ok = ok and hidden_states.is_cpu
                else:
                    ok = ok and hidden_states.get_device() == self._index
                ok = (
                    ok
                    and hidden_states.dtype is self._dtype
                    and len(shape) == 2
                    and shape[1] == h
                    and 0 < t <= self._max_tokens
                    and (
                        (weight is self._last_weight and wp == self._last_wptr)
                        or self._trusted_weights.get(id(weight)) == wp
                        or self._trust_weight(weight, wp)
                    )
                    and (wp >= hp + hn or hp >= wp + self._row_bytes)
                )
                if scale is not None:
                    sp = scale.data_ptr()
                    ok = (
                        ok
                        and (self._trusted_scales.get(id(scale)) == sp or self._trust.scale(scale, sp))
                        and (sp >= hp + hn or hp >= sp + 4)
                    )
                elif self._scaled:
                    ok = False
                grad = ok and self._grad_enabled() and (hidden_states.requires_grad or weight.requires_grad)
                if grad and self._inplace and hidden_states.requires_grad and hidden_states.is_leaf:
                    ok = False
            except (AttributeError, TypeError, IndexError, RuntimeError):
                ok = grad = False
            if not ok:
                check_call(self._rules, hidden_states, None, weight, scale)
                grad = self._grad_enabled() and (hidden_states.requires_grad or weight.requires_grad)
                t = hidden_states.shape[0]
            impl = self._table[t]
            if impl is None:
                raise self._closed_error() if self._closed else no_backend(t)
            if out is None:
                result = impl(hidden_states, None, weight, scale)
            else:
                # No residual: its range is hidden_states' own, which is tested anyway.
                spans = (hp, hp + hn, hp, hp + hn, wp, sp if scale is not None else 0) if ok else None
                result = self._into(out, t, spans, hidden_states, None, weight, scale)
            return guard(result, hidden_states, None, weight) if grad else result
        finally:
            self._in_call.release()

    def _into(self, out: Output, t: int, inputs: tuple[int, ...] | None, hidden_states: Any, residual: Any,
              weight: Any, scale: Any) -> Output:  # fmt: skip
        """The call with ``out=``: ``inputs`` are ``(h_start, h_end, r_start, r_end, w_start,
        s_start)`` from the fast test (``None`` when it failed: the exact test then runs)."""
        spans = self._out_trust.spans(out, t)
        bad = inputs is None
        if inputs is not None:
            hp, he, rp, re_, wp, sp = inputs
            we, se = wp + self._row_bytes, sp + 4 if scale is not None else 0
            for a, b in spans[2]:
                if (a < he and hp < b) or (a < re_ and rp < b) or (a < we and wp < b) or (a < se and sp < b):
                    bad = True
        if bad:  # the fast test failed or a destination meets an input: the exact test and its message
            check_out_inputs(spans, self._out_rules, self._inputs(hidden_states, residual, weight, scale))
        return self._into_table[t](hidden_states, residual, weight, scale, out)

    @staticmethod
    def _inputs(hidden_states: Any, residual: Any, weight: Any, scale: Any) -> tuple[tuple[str, Any], ...]:
        return (
            ("hidden_states", hidden_states),
            ("residual", residual),
            ("weight", weight),
            ("scale", scale),
        )

    def _out_check(self, out: Any) -> Any:
        """For ``ARNORM_CHECK_CALLS``: a function raising what ``out`` would raise, or ``None``."""
        if out is None:
            return None
        rules = self._out_rules

        def check(hidden_states: Any, residual: Any, weight: Any, scale: Any) -> None:
            spans = self._out_trust.spans(out, hidden_states.shape[0])
            check_out_inputs(spans, rules, self._inputs(hidden_states, residual, weight, scale))

        return check

    def empty_output(self, num_tokens: int, scale: torch.Tensor | None = None) -> Output:
        """Uninitialized buffers for ``num_tokens`` tokens, to pass as ``out=`` (engines keeping buffers).

        ``normed`` ``[T, H]`` when the op has a normed output; ``residual`` ``[T, H]`` when the op
        is not in place, else ``None``; ``quant`` as :func:`arnorm.quant.empty_quantized` makes it
        (``scale``: the fp32 ``[1]`` scale it records for fp8_static / nvfp4; out= ignores it).
        """
        return empty_output(self._out_rules, self._check_tokens_arg(num_tokens), scale)

    def _trust_weight(self, weight: Any, ptr: int) -> bool:
        # The weight of the last call is checked by identity alone next time (one op per layer);
        # an op shared by the layers finds the others in the trust table.
        if self._trust.weight(weight, ptr):
            self._last_weight, self._last_wptr = weight, ptr
            return True
        return False

    def _closed_error(self) -> Exception:
        return InvalidInputError("op: closed (needs a new arnorm.AllReduceNorm)")

    def _check_tokens_arg(self, num_tokens: object) -> int:
        if self._closed:
            raise self._closed_error()
        if (
            not isinstance(num_tokens, int)
            or isinstance(num_tokens, bool)
            or not 0 < num_tokens <= self._max_tokens
        ):
            raise InvalidInputError(f"num_tokens: {num_tokens!r} (needs an int from 1 to {self._max_tokens})")
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
        impl = self._table[self._check_tokens_arg(num_tokens)]
        if impl is None:
            raise no_backend(num_tokens)
        return self._explanation.chain[self._chain.index(impl)]

    def input_buffer(self, num_tokens: int) -> torch.Tensor | None:
        """A ``[T, H]`` view of this rank's registered buffer that the row-parallel GEMM may write into.

        A call whose ``hidden_states`` is this view skips the copy into the backend's workspace
        (zero-copy). ``None`` when the backend serving ``num_tokens`` has no such buffer. The
        buffer belongs to the op: its contents change with every call.
        """
        impl = self._table[self._check_tokens_arg(num_tokens)]
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
        served = self._table[t]
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
        """Free the backends' workspaces. Idempotent; calls afterwards raise.

        Local: it enters no collective, so ranks may close in any order (a backend that must
        synchronize its peers does so in its own call path).
        """
        if self._closed:
            return
        self._closed = True
        self._table[:] = [None] * len(self._table)
        self._into_table[:] = [None] * len(self._into_table)
        unregister_handle(self._handle)
        chain, self._chain = self._chain, []
        for impl in chain:
            try:
                impl.close()
            except BaseException as exc:  # plugin code: report, never leave the other backends open
                warnings.warn(
                    f"arnorm: {type(impl).__name__}.close() raised {plugin_failure(exc)}", ArnormWarning, 2
                )

    def __enter__(self) -> AllReduceNorm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if not hasattr(self, "_problem"):
            return "AllReduceNorm(<not built>)"
        state = "closed" if self._closed else "+".join(self._explanation.chain)
        return f"AllReduceNorm({self._problem.short()}, backend={state})"
