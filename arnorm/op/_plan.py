"""What a call of :class:`arnorm.AllReduceNorm` reads (its :class:`CallPlan`) and what it changes
(its :class:`CallState`).

Construction builds both (:func:`build_plan`). The plan is frozen: the tables by token count, the
rule's constants, the backends' names. A state change replaces it whole: a poisoned op
(:func:`arnorm.op._faults.poison`) and a closed op get a new plan whose tables raise or serve
nothing. The state is the one mutable object of a call: the call token and the thread owning the
group, the call sequence of check mode, the trust caches, and which token counts had their first
result checked. Only the call module (:mod:`arnorm.op._call`) changes it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from arnorm._errors import ArnormWarning
from arnorm.op._caller_outputs import OutRules
from arnorm.op._results import CopyInto
from arnorm.registry._failure import plugin_failure

if TYPE_CHECKING:
    import torch

    from arnorm._config import Config
    from arnorm._problem import Problem
    from arnorm._types import Output
    from arnorm.comm._comm import Comm
    from arnorm.op._caller_outputs import Spans
    from arnorm.registry._explain import Explanation

__all__ = ["CallPlan", "CallRules", "CallState", "Serve", "ServeInto", "build_plan", "fast_path"]


class Serve(Protocol):
    """A dispatch-table entry: a backend's call (or what stands for it: a poisoned op's raise)."""

    def __call__(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
        scale: torch.Tensor | None, /,
    ) -> Output: ...  # fmt: skip


class ServeInto(Protocol):
    """A caller-outputs table entry: the backend's call with ``out``."""

    def __call__(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
        scale: torch.Tensor | None, out: Output, /,
    ) -> Output: ...  # fmt: skip


#: A backend's fast path: ``(T, hidden_states, residual, weight, scale, out, hp, rp, wp, sp)``.
FastPath = Callable[..., "Output | None"]


@dataclasses.dataclass(frozen=True)
class CallRules:
    """What one op accepts (the rule itself is :mod:`arnorm.op._call`'s)."""

    hidden: int
    max_tokens: int
    dtype: torch.dtype
    device: torch.device
    quant: str | None
    needs_scale: bool
    inplace: bool
    strided_rows: bool
    add_residual: bool = True
    #: The in-place layout (``output_layout="in_place"``): the new residual is written over ``residual``.
    writes_residual: bool = False


@dataclasses.dataclass(frozen=True, slots=True, eq=False, repr=False)
class CallPlan:
    """Everything a call reads and never changes. An op not built yet, or closed, has tables
    serving nothing (``closed``); a poisoned one has tables whose entries raise (``poisoned``)."""

    #: ``T`` -> the backend serving ``T`` tokens (``None``: none), its call with ``out=``, and its
    #: fast path (``None``: none, or not usable as it is).
    table: tuple[Serve | None, ...]
    into_table: tuple[ServeInto | None, ...]
    fast_table: tuple[FastPath | None, ...]
    #: The backends of the chain and their names, and the op's explanation, for messages.
    chain: tuple[object, ...]
    names: tuple[str, ...]
    explanation: Explanation | None
    #: The rule's constants (:class:`CallRules` holds them all; these are read per call).
    rules: CallRules
    out_rules: OutRules
    hidden: int
    row_bytes: int
    itemsize: int
    dtype: torch.dtype | None
    on_cpu: bool
    device_index: int
    max_tokens: int
    strided: bool
    scaled: bool
    inplace: bool
    add_residual: bool
    #: ``ARNORM_CHECK_CALLS``: each call agreed across ranks first.
    check_calls: bool
    comm: Comm | None
    #: The op's number in compiled graphs (:mod:`arnorm.op._custom_op`).
    handle: int
    is_compiling: Callable[[], bool]
    grad_enabled: Callable[[], bool]
    closed: bool
    poisoned: str | None

    def emptied(
        self, *, closed: bool = False, poisoned: str | None = None, entry: Serve | None = None
    ) -> CallPlan:
        """A new plan with no fast path whose tables hold ``entry`` where a backend was (``None``:
        a closed op, which serves nothing; a poisoned op's raise)."""
        table = tuple(None if e is None else entry for e in self.table)
        into: tuple[ServeInto | None, ...] = table  # type: ignore[assignment]  # the raise takes out= too
        fast = (None,) * len(self.table)
        return dataclasses.replace(
            self, table=table, into_table=into, fast_table=fast, closed=closed, poisoned=poisoned
        )


def unbuilt_plan() -> CallPlan:
    """The plan of an op not built yet: closed, serving nothing."""
    rules = CallRules(0, 0, None, None, None, False, True, False)  # type: ignore[arg-type]
    out_rules = OutRules(0, None, None, None, None, True, True)  # type: ignore[arg-type]
    return CallPlan(
        table=(), into_table=(), fast_table=(), chain=(), names=(), explanation=None, rules=rules,
        out_rules=out_rules, hidden=0, row_bytes=0, itemsize=0, dtype=None, on_cpu=True, device_index=-1,
        max_tokens=0, strided=False, scaled=False, inplace=True, add_residual=True, check_calls=False,
        comm=None, handle=0, is_compiling=bool, grad_enabled=bool, closed=True, poisoned=None,
    )  # fmt: skip


@dataclasses.dataclass(slots=True, eq=False, repr=False)
class CallState:
    """What calls change; only :mod:`arnorm.op._call` changes it."""

    #: One call at a time: a call pops it and hands it back (``list.pop`` is atomic).
    token: list[None]
    #: The thread owning the group (0 at TP 1: any thread may call).
    owner: int
    #: Check mode's count of agreed calls.
    seq: int = 0
    #: Trusted weights and scales: ``id -> data pointer``; the tensors are held so that an id is
    #: never reused while trusted. The last trusted weight is compared by identity first.
    weights: dict[int, int] = dataclasses.field(default_factory=dict)
    scales: dict[int, int] = dataclasses.field(default_factory=dict)
    held: list[object] = dataclasses.field(default_factory=list)
    last_weight: object = None
    last_wptr: int = -1
    #: Trusted ``out=`` objects: ``id -> Spans``, and the objects held.
    out_spans: dict[int, Spans] = dataclasses.field(default_factory=dict)
    out_held: list[object] = dataclasses.field(default_factory=list)
    #: ``T`` -> whether the backend's first result for ``T`` tokens was checked (call, fast path).
    checked: list[bool] = dataclasses.field(default_factory=list)
    fast_checked: list[bool] = dataclasses.field(default_factory=list)


def fast_path(name: str, impl: object) -> FastPath | None:
    """The backend's optional ``fast_path()`` function, or ``None`` (absent, declined, or broken)."""
    get = getattr(impl, "fast_path", None)
    if get is None:
        return None
    try:
        fn = get()
    except Exception as exc:  # plugin code: a broken fast path costs speed, never the op
        warnings.warn(
            f"arnorm: {name}.fast_path() raised {plugin_failure(exc)}; its calls go through __call__",
            ArnormWarning,
            4,
        )
        return None
    if fn is not None and not callable(fn):
        msg = f"arnorm: {name}.fast_path() returned {type(fn).__name__} (needs a function or None)"
        warnings.warn(msg, ArnormWarning, 4)
        return None
    return fn


def build_plan(
    problem: Problem,
    comm: Comm,
    device: torch.device,
    config: Config,
    explanation: Explanation,
    chain: list[Serve],
    raw: list[object],
    caps: list[object],
    served_by: list[int],
    handle: int,
) -> CallPlan:
    """The plan of a built op: ``chain`` the backends as the call sees them (``raw`` as selection
    built them), ``caps`` their capabilities, ``served_by[t]`` the chain index serving ``t`` tokens
    (``-1``: none)."""
    import torch

    from arnorm._formats import FORMAT_SPECS

    names = tuple(explanation.chain)
    # Fast paths are asked for once, and used only where the core calls the backend as it is
    # (no CopyInto or ZeroResidual in between): their contract includes writing into out.
    fast = [
        fast_path(name, impl) if impl is r and c.caller_outputs else None  # type: ignore[attr-defined]
        for name, impl, r, c in zip(names, chain, raw, caps, strict=True)
    ]
    dtype = getattr(torch, problem.dtype)
    out_rules = OutRules(problem.hidden_size, dtype, device, problem.quant, problem.scale_layout,
                         problem.normed_output, problem.inplace,
                         problem.output_layout == "in_place")  # fmt: skip
    into: list[ServeInto] = [
        impl if c.caller_outputs else CopyInto(impl, name, out_rules, explanation)  # type: ignore[attr-defined,misc]
        for impl, name, c in zip(chain, names, caps, strict=True)
    ]
    itemsize = torch.empty((), dtype=dtype).element_size()
    strided = all(c.strided_rows for c in caps)  # type: ignore[attr-defined]
    scaled = problem.quant is not None and FORMAT_SPECS[problem.quant].takes_scale
    rules = CallRules(problem.hidden_size, problem.max_tokens, dtype, device, problem.quant, scaled,
                      problem.inplace, strided, problem.add_residual,
                      problem.output_layout == "in_place")  # fmt: skip
    return CallPlan(
        table=tuple(None if i < 0 else chain[i] for i in served_by),
        into_table=tuple(None if i < 0 else into[i] for i in served_by),
        fast_table=tuple(None if i < 0 else fast[i] for i in served_by),
        chain=tuple(chain), names=names, explanation=explanation, rules=rules, out_rules=out_rules,
        hidden=problem.hidden_size, row_bytes=problem.hidden_size * itemsize, itemsize=itemsize,
        dtype=dtype, on_cpu=device.type == "cpu", device_index=-1 if device.index is None else device.index,
        max_tokens=problem.max_tokens, strided=strided, scaled=scaled, inplace=problem.inplace,
        add_residual=problem.add_residual, check_calls=bool(config.check_calls), comm=comm, handle=handle,
        is_compiling=torch.compiler.is_compiling, grad_enabled=torch.is_grad_enabled, closed=False,
        poisoned=None,
    )  # fmt: skip


def new_state(comm: Comm, owner: int, tokens: int) -> CallState:
    """The state of a new op over ``tokens + 1`` table slots; ``owner`` the thread owning its group."""
    from arnorm.comm._comm import CallToken

    # Ops whose data collectives carry headers take a token that marks the call as not yet at its
    # collective (a failed call then knows its number); the rest keep a plain list.
    token: list[None] = CallToken(comm) if comm.counts_calls else [None]
    return CallState(token=token, owner=owner, checked=[False] * tokens, fast_checked=[False] * tokens)
