"""``Dispatch``: everything a call of :class:`arnorm.AllReduceNorm` reads, in one object.

Construction builds it (:func:`build_dispatch`), the call reads it (:func:`arnorm.op._call.call`
reads ``op._dispatch`` once, then only its fields), and a state change replaces it whole: a
poisoned op (:func:`arnorm.op._faults.poison`) and a closed op get a copy whose tables raise or
serve nothing. Nothing else writes into it, except the call's own memory of the last trusted
weight and its count of checked calls. The C helper (``_accel.c``) reads ``accel_state`` by
position and the last weight by name (``last_weight``, ``last_wptr``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from arnorm._errors import ArnormWarning, InvalidInputError
from arnorm.comm._comm import CLOSED, CallToken, Comm
from arnorm.op._accel import AccelState, accelerator
from arnorm.op._caller_outputs import CopyInto, OutRules, OutTrust
from arnorm.op._check import CallRules, needs_scale
from arnorm.op._guards import Trust
from arnorm.registry._failure import plugin_failure

if TYPE_CHECKING:
    from arnorm._config import Config
    from arnorm._problem import Problem

__all__ = ["CLOSED", "Dispatch", "Dispatched", "build_dispatch", "closed_error"]


def closed_error() -> InvalidInputError:
    return InvalidInputError(CLOSED)


@dataclasses.dataclass(slots=True, eq=False, repr=False)
class Dispatch:
    """The op's call state. The default instance serves nothing (an op not built yet)."""

    #: ``T`` -> the backend serving ``T`` tokens (``None``: none), its caller-outputs form (``out=``),
    #: and its fast path (``None``: none, or not usable as it is).
    table: list[Any] = dataclasses.field(default_factory=list)
    into_table: list[Any] = dataclasses.field(default_factory=list)
    fast_table: list[Any] = dataclasses.field(default_factory=list)
    #: The backends of the chain, their names and the op's explanation, for messages naming the
    #: one that served a call.
    chain: tuple[Any, ...] = ()
    names: tuple[str, ...] = ()
    explanation: Any = None
    #: The Python test's constants: ``(hidden, row_bytes, dtype, on_cpu, device_index, max_tokens)``.
    consts: tuple[Any, ...] = (0, 0, None, True, -1, 0)
    itemsize: int = 0
    strided: bool = False
    scaled: bool = False
    inplace: bool = True
    add_residual: bool = True
    #: The call's rule, in full (:mod:`arnorm.op._check`), and what ``out=`` must be.
    rules: Any = None
    out_rules: Any = None
    out_trust: Any = None
    #: Trusted ``out=`` objects, weights and scales (``id -> data pointer``), and the last weight.
    out_spans: dict[int, Any] = dataclasses.field(default_factory=dict)
    trust: Any = None
    trusted_weights: dict[int, int] = dataclasses.field(default_factory=dict)
    trusted_scales: dict[int, int] = dataclasses.field(default_factory=dict)
    last_weight: Any = None
    last_wptr: int = -1
    #: One call at a time: a call pops it and hands it back.
    token: list[Any] = dataclasses.field(default_factory=lambda: [None])
    #: The thread owning the group (0 at TP 1: any thread may call).
    owner: int = 0
    #: The C helper's ``accept`` (``None``: the Python test only) and the state it reads.
    accept: Any = None
    accel_state: Any = None
    #: ``ARNORM_CHECK_CALLS``: each call agreed across ranks first; ``seq`` counts them.
    check_calls: bool = False
    seq: int = 0
    comm: Any = None
    #: The op's number in compiled graphs (:mod:`arnorm.op._custom_op`).
    handle: int = 0
    is_compiling: Callable[[], bool] = bool
    grad_enabled: Callable[[], bool] = bool
    #: The op's state: a closed op serves nothing; a poisoned one raises this message.
    closed: bool = True
    poisoned: str | None = None

    def replace(self, **changes: Any) -> Dispatch:
        """A copy with ``changes``: how a state change replaces the dispatch whole."""
        return dataclasses.replace(self, **changes)

    def emptied(self, **changes: Any) -> Dispatch:
        """A copy with no fast path and no C helper whose tables serve nothing (a closed op), or
        what ``changes`` says (a poisoned op's raise)."""
        n = len(self.table)
        fields: dict[str, Any] = {"table": [None] * n, "into_table": [None] * n, "fast_table": [None] * n}
        return self.replace(**{**fields, "accept": None, **changes})


class Dispatched(Protocol):
    """What the call needs of the op: its dispatch."""

    _dispatch: Dispatch


def fast_path(name: str, impl: Any) -> Any:
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


def build_dispatch(
    problem: Problem,
    comm: Comm,
    device: Any,
    config: Config,
    explanation: Any,
    chain: list[Any],
    raw: list[Any],
    caps: list[Any],
    served_by: list[int],
    owner: int,
    handle: int,
) -> Dispatch:
    """The dispatch of a built op: ``chain`` the backends as the call sees them (``raw`` as
    selection built them), ``caps`` their capabilities, ``served_by[t]`` the chain index serving
    ``t`` tokens (``-1``: none)."""
    import torch

    table = [None if i < 0 else chain[i] for i in served_by]
    into = [
        impl if c.caller_outputs else CopyInto(impl, problem.inplace)
        for impl, c in zip(chain, caps, strict=True)
    ]
    # Fast paths are asked for once, and used only where the core calls the backend as it is
    # (no CopyInto or ZeroResidual in between): their contract includes writing into out.
    fast = [
        fast_path(name, impl) if impl is r and c.caller_outputs else None
        for name, impl, r, c in zip(explanation.chain, chain, raw, caps, strict=True)
    ]
    fast_table = [None if i < 0 else fast[i] for i in served_by]
    dtype = getattr(torch, problem.dtype)
    out_rules = OutRules(problem.hidden_size, dtype, device, problem.quant, problem.scale_layout,
                         problem.normed_output, problem.inplace,
                         problem.output_layout == "in_place")  # fmt: skip
    out_trust = OutTrust(out_rules)
    strided = all(c.strided_rows for c in caps)
    rules = CallRules(problem.hidden_size, problem.max_tokens, dtype, device, problem.quant,
                      needs_scale(problem.quant), problem.inplace, strided, problem.add_residual,
                      problem.output_layout == "in_place")  # fmt: skip
    itemsize = torch.empty((), dtype=dtype).element_size()
    trust = Trust(rules)
    # The call's token: list.pop is atomic, so two threads can never both hold it (a
    # non-blocking Lock.acquire is too, at twice the cost per call).
    token = CallToken(comm) if comm.counts_calls else [None]
    grad_enabled = torch.is_grad_enabled
    accel_state = AccelState(
        hidden=problem.hidden_size, row_bytes=problem.hidden_size * itemsize, dtype=dtype,
        on_cpu=device.type == "cpu", device_index=-1 if device.index is None else device.index,
        max_tokens=problem.max_tokens, scaled=rules.needs_scale, add_residual=problem.add_residual,
        token=token, fast_table=fast_table, weights=trust.weights, scales=trust.scales,
        out_spans=out_trust.table, grad_enabled=grad_enabled,
    )  # fmt: skip
    check_calls = bool(config.check_calls)
    accept = None
    # The C helper's copy of the test, where a backend has a fast path for it to call. It does not
    # compare threads; no built-in backend has a fast path at TP > 1.
    if (
        config.accelerate
        and not check_calls
        and comm.world_size == 1
        and any(f is not None for f in fast_table)
    ):
        accept = accelerator().accept
    return Dispatch(
        table=table, into_table=[None if i < 0 else into[i] for i in served_by], fast_table=fast_table,
        chain=tuple(chain), names=tuple(explanation.chain), explanation=explanation,
        consts=tuple(accel_state[:6]),  # a plain tuple: unpacking it is the Python call's first step
        itemsize=itemsize, strided=strided, scaled=rules.needs_scale, inplace=problem.inplace,
        add_residual=problem.add_residual, rules=rules, out_rules=out_rules, out_trust=out_trust,
        out_spans=out_trust.table, trust=trust, trusted_weights=trust.weights, trusted_scales=trust.scales,
        token=token, owner=owner, accept=accept, accel_state=accel_state, check_calls=check_calls,
        comm=comm, handle=handle, is_compiling=torch.compiler.is_compiling, grad_enabled=grad_enabled,
        closed=False,
    )  # fmt: skip
