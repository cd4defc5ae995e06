"""The forwards ``fuse()`` installs: row-parallel partial sums, fused steps, and the decoder layers.

Data flow of a pre-norm layer ``i`` (Llama, Mistral, Qwen2/3, Gemma), with ``AR`` the TP
all-reduce and ``next_norm`` layer ``i+1``'s input norm or the final norm::

    x_norm = carry.take(x) or input_layernorm(x)          # layer 0: the model's own norm
    h, y   = op(self_attn(x_norm), x, post_attention_layernorm)   # AR + add + norm, one call
    h2, y2 = op(mlp(y), h, next_norm)                     # AR + add + the next layer's input norm
    carry.put(h2, y2); return h2

A sandwich layer (Gemma2/3) has a norm between each AR and its add; that norm has no residual of
its own, so it runs as a TP op built with ``add_residual=False`` (no residual is read), and the
add + next norm as a local op::

    _, a   = tp_op(self_attn(x_norm), None, post_attention_layernorm)
    h, y   = local_op(a, x, pre_feedforward_layernorm)
    _, b   = tp_op(mlp(y), None, post_feedforward_layernorm)
    h2, y2 = local_op(b, h, next_norm)

The carry hands layer ``i``'s normed output to whoever consumes ``h2`` next, only if that
consumer receives the very tensor ``h2`` (identity check) and its norm module is, at the time of
the call, the one that normed it, unhooked; anyone else runs their own norm, so a layer called out
of order (decoder layers truncated or reordered after fuse()) is still correct.

Each site checks at each call that its norm module is still the one fuse() saw, in the same place,
with the same epsilon, and (where the site's normed output is used directly) without forward
hooks; otherwise that call runs the model's own path through the module now in place (hooks
included). A few attribute reads per site: the model's numerics whatever was changed after fuse().

A call with more tokens than the op's budget (or that no backend serves) takes the unfused path
of its site: the TP all-reduce, the add and the model's own norm module, the exact operations of
the unfused model. Except for a batch-invariant
op (``Config(batch_invariant=True)``): there a call above the budget runs through the same op in
chunks of at most ``max_tokens`` rows, so every row gets the fused path's bits whatever the size of
the forward it came in (its op serves every count up to the budget, and a row's outputs do not
depend on its neighbours).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from arnorm._errors import InvalidInputError, NoEligibleBackendError
from arnorm.integrations._common import guard_backward, norm_eps, warn_once

__all__ = [
    "Carry",
    "Reducing",
    "Step",
    "final_norm_forward",
    "layer_forward",
    "needs_reduced",
    "row_parallel_forward",
]


class Carry:
    """Layer i's normed output for the consumer of its residual (see the module docstring)."""

    __slots__ = ("norm", "normed", "residual")

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None
        self.normed: torch.Tensor | None = None
        self.norm: Any = None

    def put(self, residual: torch.Tensor, normed: torch.Tensor | None, norm: Any) -> None:
        """``normed``: ``residual`` normed by the module ``norm`` (None: nothing to hand over)."""
        self.residual, self.normed, self.norm = residual, normed, norm

    def take(self, x: torch.Tensor, norm: Any) -> torch.Tensor | None:
        """The normed output for ``x``, if ``norm`` (the consumer's norm module now) made it."""
        normed = self.normed if x is self.residual and norm is self.norm and not hooked(norm) else None
        self.residual = self.normed = self.norm = None  # held no longer than one hand-over
        return normed


def hooked(module: Any, pre: bool = True) -> bool:
    """Whether calling ``module`` would run forward hooks (its own or global ones; pre-hooks too
    unless ``pre`` is False)."""
    from torch.nn.modules import module as nn_module

    if getattr(module, "_forward_hooks", None) or nn_module._global_forward_hooks:
        return True
    return pre and bool(getattr(module, "_forward_pre_hooks", None) or nn_module._global_forward_pre_hooks)


class Step:
    """One site: (all-reduce) + (residual add) + norm, fused through ``op`` when it serves the call.

    ``op``: an ``AllReduceNorm`` or None (no fusion: the unfused path always). ``all_reduce``:
    the unfused path's reduction (None when the input is already complete). A site whose norm has
    no residual is called with ``residual=None`` and has an op built with ``add_residual=False``.
    ``owner``/``attr``: where the norm module lives (checked at each call); ``direct``: the site's
    normed output is used as it is (else it goes through the carry, whose consumer checks it).
    After a call, ``used`` is the module that made its normed output (None: no normed output).
    """

    __slots__ = ("all_reduce", "attr", "direct", "dtype", "eps", "hidden", "norm", "norm_forward", "op",
                 "owner", "served", "used")  # fmt: skip

    def __init__(
        self,
        op: Any,
        norm: Any,
        norm_forward: Callable[[torch.Tensor], torch.Tensor],
        all_reduce: Callable[[torch.Tensor], Any] | None,
        owner: Any = None,
        attr: str = "",
        direct: bool = True,
    ) -> None:
        self.op, self.norm, self.norm_forward = op, norm, norm_forward
        self.all_reduce = all_reduce
        self.owner, self.attr, self.direct = owner, attr, direct
        self.eps = norm_eps(norm)
        self.used: Any = None
        self.served: dict[int, bool] = {}
        self.dtype = None if op is None else getattr(torch, op.problem.dtype)
        self.hidden = None if op is None else op.problem.hidden_size

    def backend_for(self, num_tokens: int) -> str:
        """The backend serving ``num_tokens`` here, or ``"unfused"``."""
        if self._chunks(num_tokens):
            return str(self.op.backend_for(self.op.problem.max_tokens))
        if not self._serves(num_tokens):
            return "unfused"
        return str(self.op.backend_for(num_tokens))

    def _chunks(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` runs through the op in chunks: above the budget of a batch-invariant op."""
        op = self.op
        return op is not None and op.problem.batch_invariant and num_tokens > op.problem.max_tokens

    def _serves(self, num_tokens: int) -> bool:
        known = self.served.get(num_tokens)
        if known is None:
            known = False
            if self.op is not None and 0 < num_tokens <= self.op.problem.max_tokens:
                try:
                    self.op.backend_for(num_tokens)
                    known = True
                except (InvalidInputError, NoEligibleBackendError):
                    known = False
            self.served[num_tokens] = known
        return known

    def __call__(
        self, partial: torch.Tensor, residual: torch.Tensor | None, is_sum: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(new residual, normed)``; without a residual the first is the reduced sum. ``is_sum``:
        ``partial`` is already the sum (the layer runs unfused): the model's own path, no all-reduce."""
        norm: Any = self.norm if self.owner is None else getattr(self.owner, self.attr, None)
        if is_sum or norm is not self.norm or norm_eps(norm) != self.eps or (self.direct and hooked(norm)):
            return self._own_path(partial, residual, norm, is_sum)
        self.used = norm
        shape = partial.shape
        h = shape[-1]
        t = partial.numel() // h if h else 0
        fits = (
            self.op is not None
            and h == self.hidden
            and partial.dtype == self.dtype
            and (residual is None or (residual.dtype == self.dtype and residual.shape == shape))
        )
        if fits and self._serves(t):
            x = partial.reshape(t, h)
            res = None if residual is None else residual.reshape(t, h)
            out = self.op(x, res, self.norm.weight)
            return out.residual.view(shape), out.normed.view(shape)
        if fits and self._chunks(t):
            return self._chunked(partial.reshape(t, h), None if residual is None else residual.reshape(t, h),
                                 shape)  # fmt: skip
        if self.op is not None and self._serves(t):
            self._warn_unfused(partial, residual)
        reduced = partial if self.all_reduce is None else self.all_reduce(partial)
        new_residual = reduced if residual is None else residual + reduced
        return new_residual, self.norm_forward(new_residual)

    def _own_path(
        self, partial: torch.Tensor, residual: torch.Tensor | None, norm: Any, is_sum: bool = False
    ) -> tuple[torch.Tensor, Any]:
        """The model's own path through the module in place now (changed since fuse(), or hooked):
        the all-reduce (unless ``is_sum``), the add, and the module called as the model calls it
        (hooks included). A site whose normed output goes through the carry hands none over: its
        consumer norms."""
        reduced = partial if self.all_reduce is None or is_sum else self.all_reduce(partial)
        new_residual = reduced if residual is None else residual + reduced
        if not self.direct:
            self.used = None
            return new_residual, None
        self.used = norm
        return new_residual, norm(new_residual)

    def _chunked(
        self, x: torch.Tensor, res: torch.Tensor | None, shape: torch.Size
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The op over rows ``[i, i + max_tokens)`` in turn: the fused path's arithmetic for every row
        (every rank makes the same calls: the chunks are a function of the token count alone)."""
        m = self.op.problem.max_tokens
        residuals, normed = [], []
        for i in range(0, x.shape[0], m):
            out = self.op(x[i : i + m], None if res is None else res[i : i + m], self.norm.weight)
            residuals.append(out.residual)
            normed.append(out.normed)
        return torch.cat(residuals).view(shape), torch.cat(normed).view(shape)

    def _warn_unfused(self, partial: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Say once per distinct reason why a call its op serves by size ran unfused (the handle's
        ``backends()`` answers by token count alone)."""
        if partial.dtype != self.dtype:
            reason = (f"partial sum: dtype {partial.dtype} (needs {self.dtype}, the dtype of the fused "
                      "model; autocast changes the linear layers' output dtype)")  # fmt: skip
        elif residual is not None and residual.dtype != self.dtype:
            reason = f"residual: dtype {residual.dtype} (needs {self.dtype}, the dtype of the fused model)"
        else:
            shape = tuple(partial.shape)
            reason = f"partial sum: shape {shape} (needs [..., {self.hidden}], as the residual)"
        warn_once(f"arnorm.integrations.transformers: a site ran unfused: {reason}", 3)


class Reducing:
    """Per decoder layer at TP: whether this call's row-parallel linears reduce their own output (the
    layer runs unfused because something would otherwise see a partial sum: see
    :func:`needs_reduced`), with the all-reduce they use then."""

    __slots__ = ("all_reduce", "on")

    def __init__(self, all_reduce: Callable[[torch.Tensor], Any]) -> None:
        self.all_reduce, self.on = all_reduce, False


def row_parallel_forward(linear: torch.nn.Linear, reducing: Reducing) -> Callable[..., torch.Tensor]:
    """``linear``'s forward returning this rank's partial sum: the rowwise style without its
    all-reduce; with it while ``reducing.on`` (the layer runs unfused)."""
    from torch.distributed.tensor import DTensor, Shard

    def forward(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            x = x.redistribute(placements=[Shard(-1)]).to_local()
        weight = linear.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        out = F.linear(x, local)
        return reducing.all_reduce(out) if reducing.on else out

    return forward


def needs_reduced(layer: Any, linears: dict[str, Any]) -> bool:
    """Whether a call of ``layer`` must see reduced row-parallel outputs, as the unfused TP model
    does: a forward hook on a row-parallel linear or on a module holding it (``self_attn``,
    ``mlp``) would otherwise see this rank's partial sum, and a linear replaced since fuse() runs
    its own forward (the model's rowwise style reduces there)."""
    for path, linear in linears.items():
        module = layer
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None or hooked(module, pre=False):
                return True
        if module is not linear:
            return True
    return False


def _all_reduce(group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch.distributed as dist

    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)  # what transformers' rowwise style does at inference
        return x

    return reduce


def _kwargs(sig: inspect.Signature, layer: Any, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Positional arguments of a decoder layer call, as the keywords its attention receives."""
    bound = sig.bind(layer, x, *args, **kwargs)
    out: dict[str, Any] = {}
    names = list(sig.parameters)
    for name, value in bound.arguments.items():
        if name in names[:2]:
            continue
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def layer_forward(
    layer: Any,
    kind: str,
    carry: Carry,
    steps: dict[str, Step],
    reducing: Reducing | None = None,
    linears: dict[str, Any] | None = None,
) -> Callable[..., torch.Tensor]:
    """The fused forward of one decoder layer (``kind``: ``pre_norm`` or ``sandwich``). At TP,
    ``reducing`` is shared with the layer's row-parallel ``linears`` (by path): a call that
    :func:`needs_reduced` runs them with their all-reduce and its sites on the model's own path."""
    sig = inspect.signature(type(layer).forward)
    anchors = (layer.input_layernorm.weight,)
    sandwich = kind == "sandwich"
    attn_step, mlp_step = steps["attention"], steps["mlp"]
    pre_ff, mlp_residual = steps.get("pre_feedforward"), steps.get("mlp_residual")

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            kwargs = _kwargs(sig, layer, hidden_states, args, kwargs)
        with torch.no_grad():
            input_norm = layer.input_layernorm  # the module in place now
            normed = carry.take(hidden_states, input_norm)
            if normed is None:
                normed = input_norm(hidden_states)
            summed = reducing is not None and needs_reduced(layer, linears or {})
            if reducing is not None:
                reducing.on = summed
            try:
                attn = layer.self_attn(hidden_states=normed, **kwargs)[0]
                if sandwich:
                    _, a = attn_step(attn, None, summed)
                    h, y = pre_ff(a, hidden_states)  # type: ignore[misc]
                    _, b = mlp_step(layer.mlp(y), None, summed)
                    h2, y2 = mlp_residual(b, h)  # type: ignore[misc]
                else:
                    h, y = attn_step(attn, hidden_states, summed)
                    h2, y2 = mlp_step(layer.mlp(y), h, summed)
            finally:
                if reducing is not None:
                    reducing.on = False
        out = guard_backward(h2, (hidden_states, *anchors))
        last = mlp_residual if sandwich else mlp_step
        carry.put(out, y2, last.used)  # type: ignore[union-attr]
        return out

    return forward


def final_norm_forward(norm: Any, original: Callable[[torch.Tensor], torch.Tensor], carry: Carry) -> Any:
    """The final norm: the last layer's fused output when handed its residual, else the model's own norm."""
    anchors = (norm.weight,)

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = carry.take(x, norm)
        if y is None:
            return original(x)
        return guard_backward(y, (x, *anchors))

    return forward


def reducer(group: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The unfused path's all-reduce over ``group`` (None: a single process, nothing to reduce)."""
    return None if group is None else _all_reduce(group)
