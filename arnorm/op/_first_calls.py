"""A backend's results, checked on its first call per token count, then trusted (like ``out=``).

A plugin's call result used to reach the caller unchecked: a wrong shape, a float32 ``normed`` from a
bfloat16 op, ``None``. At construction each entry of the op's dispatch tables (the backend's call,
and its fast path) is wrapped in a :class:`FirstCall`; its first call for a token count checks what
the backend returned (presence, type, shape, dtype and device of every output) and puts the backend
itself back in that slot, so valid calls after the first pay nothing. A result that fails raises
:class:`arnorm.BackendBrokenError` naming the backend; at TP > 1 the op is poisoned as after any
failed call (the backend's collectives ran, but what else it did is unknown). Results with ``out=``
are checked by identity with ``out``'s tensors on every call instead (``returned_out``).
"""

from __future__ import annotations

import weakref
from typing import Any

from arnorm._errors import BackendBrokenError
from arnorm._types import Output, QuantizedActivation

__all__ = ["FirstCall", "arm", "served_by"]


class FirstCall:
    """A dispatch-table entry: call the backend, check its result for this token count, then hand the
    op's slot back to the backend (``fast``: the entry is in the fast-path table, whose functions
    return ``None`` when they decline; then nothing is checked). The op is held weakly: a table
    holding an entry that held the op would keep a dropped op, and its groups, for the collector."""

    __slots__ = ("backend", "fast", "name", "op")

    def __init__(self, backend: Any, name: str, op: Any, fast: bool) -> None:
        self.backend, self.name, self.op, self.fast = backend, name, weakref.ref(op), fast

    def __call__(self, *args: Any) -> Any:
        result = self.backend(*args)
        if self.fast:
            t, hidden_states = args[0], args[1]
            if result is None or args[5] is not None:  # declined, or out= (checked by identity)
                return result
        else:
            hidden_states = args[0]
            t = hidden_states.shape[0]
        op = self.op()
        if op is None:
            return result
        problem = check_result(op, result, t)
        if problem:
            raise BackendBrokenError(
                f"backend {self.name!r}: its call for {t} tokens returned {problem}; fix or report the "
                "plugin, or disable it (ARNORM_DISABLE)",
                op._dispatch.explanation,
            )
        d = op._dispatch  # poisoned or closed meanwhile: a new dispatch, whose tables hold no wrapper
        table = d.fast_table if self.fast else d.table
        if table[t] is self:
            table[t] = self.backend
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def __repr__(self) -> str:
        return f"FirstCall({self.backend!r})"


def served_by(entry: Any) -> Any:
    """The backend behind a dispatch-table entry."""
    return entry.backend if type(entry) is FirstCall else entry


def arm(op: Any, d: Any) -> None:
    """Wrap every entry of the call and fast-path tables of ``op``'s dispatch ``d`` (in place: the C
    helper holds the fast-path list) in a :class:`FirstCall`, one per backend and table."""
    for table, fast in ((d.fast_table, True), (d.table, False)):  # named by the call table
        wrappers: dict[int, FirstCall] = {}
        for t, entry in enumerate(table):
            if entry is None:
                continue
            w = wrappers.get(id(entry))
            if w is None:
                w = wrappers[id(entry)] = FirstCall(entry, _served_name(d, t), op, fast)
            table[t] = w


def _served_name(d: Any, t: int) -> str:
    """The name of the backend serving ``t`` tokens (a fast path is its backend's)."""
    impl = served_by(d.table[t])
    for name, c in zip(d.names, d.chain, strict=True):
        if c is impl:
            return str(name)
    return str(d.names[0])


def _tensor(what: str, got: Any, shape: tuple[int, ...], dtype: Any, device: Any) -> str:
    import torch

    if not isinstance(got, torch.Tensor):
        return f"{what}: {type(got).__name__} (needs a torch.Tensor of shape {list(shape)})"
    if tuple(got.shape) != shape:
        return f"{what}: shape {list(got.shape)} (needs {list(shape)})"
    if got.dtype != dtype:
        return f"{what}: dtype {got.dtype} (needs {dtype})"
    if got.device != device:
        return f"{what}: device {got.device} (needs {device}, the op's device)"
    return ""


def check_result(op: Any, result: Any, t: int) -> str:
    """What is wrong with ``result`` as ``op``'s output for ``t`` tokens (``""``: nothing)."""
    from arnorm.op._caller_outputs import OutRules, _dest_shapes

    if not isinstance(result, Output):
        if result is None or isinstance(result, tuple):
            what = "None" if result is None else f"a {type(result).__name__} of {len(result)} items"
        else:
            what = f"a {type(result).__name__}"
        return f"{what} (needs an arnorm.plugin.Output(normed, residual, quant))"
    rules: OutRules = op._dispatch.out_rules
    h, dtype, device = rules.hidden, rules.dtype, rules.device
    wrong = _tensor("Output.residual", result.residual, (t, h), dtype, device)
    if wrong:
        return wrong
    if not rules.normed and result.normed is not None:
        return "Output.normed: a tensor (needs None: the op was built with normed_output=False)"
    q = result.quant
    if rules.quant is None and q is not None:
        return "Output.quant: a QuantizedActivation (needs None: the op does not quantize)"
    if rules.quant is not None and not isinstance(q, QuantizedActivation):
        return f"Output.quant: {type(q).__name__} (needs an arnorm.QuantizedActivation of {rules.quant!r})"
    fields = {"normed": ("Output.normed", result.normed)}
    if q is not None:
        fields["data"] = ("Output.quant.data", q.data)
        fields["scale"] = ("Output.quant.scale", q.scale)
    for _, field, shape, want in _dest_shapes(rules, t):
        if field in fields:
            what, got = fields[field]
            wrong = _tensor(what, got, shape, want, device)
            if wrong:
                return wrong
    return ""
