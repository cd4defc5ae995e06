"""Finding vLLM's all-reduce -> norm (-> quant) seams in a post-grad FX graph, and rewriting them.

:func:`plan` reads the whole graph first: each seam is either fused (a :class:`Seam`), left to vLLM
with a reason (a norm arnorm cannot compute bit for bit: an fp32 weight, a partial variance, no
weight), or unexpected (a shape of seam this code does not know), in which case :func:`rewrite` is
never called and the graph stays as it was: never half rewritten. :func:`rewrite` then replaces
each seam by one call of ``torch.ops.arnorm.vllm_seam``. Neither builds anything nor talks to the
other ranks: nothing here is collective.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from arnorm.integrations._vllm_pass_table import (
    ALL_REDUCE,
    FUSED_ADD_RMS_NORM,
    RMS_NORM,
    TAIL_BY_OP,
    QuantTail,
)

__all__ = ["Plan", "Seam", "plan", "rewrite"]

_NORMS = (RMS_NORM, FUSED_ADD_RMS_NORM)
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class Seam:
    """One seam to fuse: vLLM's nodes, and what the replacement takes."""

    all_reduce: fx.Node
    norm: fx.Node
    x: fx.Node
    group_name: str
    weight: fx.Node  # the norm's weight (Gemma: the stored one, before ``float() + 1``)
    eps: float
    gemma: bool
    residual: fx.Node | None
    normed: list[fx.Node]  # nodes whose value is the normed output
    residual_out: list[fx.Node]  # nodes whose value is the new residual (besides a bare all-reduce)
    tail: QuantTail | None = None
    tail_node: fx.Node | None = None
    scale: fx.Node | None = None
    keep_normed: bool = True

    def inputs(self) -> list[fx.Node]:
        return [n for n in (self.x, self.residual, self.weight, self.scale) if n is not None]

    def anchor(self, order: dict[fx.Node, int]) -> fx.Node:
        """The node the replacement goes right after: the last of its inputs."""
        return max(self.inputs(), key=order.__getitem__)

    def readers(self) -> list[fx.Node]:
        """The nodes reading the seam's results (they must come after the replacement)."""
        replaced = [*self.normed, *self.residual_out]
        if self.residual is None:
            replaced.append(self.all_reduce)
        if self.tail_node is not None:
            replaced.extend(self.tail_node.users)
        skip = {self.norm, self.tail_node, *self.normed, *self.residual_out}
        if self.tail_node is not None:
            skip.update(self.tail_node.users)
        return [u for n in replaced for u in n.users if u not in skip]

    def kind(self) -> str:
        norm = "add_rms_norm" if self.residual is not None else "rms_norm"
        name = ("gemma_" if self.gemma else "") + norm
        return name + (f"+{self.tail.key}" if self.tail else "")


@dataclass
class Plan:
    seams: list[Seam] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # seams left to vLLM, with why
    unexpected: str | None = None  # set: the graph is left alone


class _Unexpected(Exception):
    pass


def _name(target: Any) -> str:
    return str(target)


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_float(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _gemma_weight(weight: fx.Node) -> fx.Node | None:
    """The stored weight when ``weight`` is ``stored.float() + 1.0`` (vLLM's GemmaRMSNorm), else None."""
    if _name(weight.target) not in ("aten.add.Tensor", "aten.add.Scalar") or len(weight.args) != 2:
        return None
    base, one = weight.args
    if one != 1 or not isinstance(base, fx.Node) or weight.kwargs.get("alpha", 1) != 1:
        return None
    if _name(base.target) in ("prims.convert_element_type.default", "aten._to_copy.default"):
        stored = base.args[0]
        return stored if isinstance(stored, fx.Node) else None
    return None


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    out = {}
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int) or user.args[1] in out:
            raise _Unexpected(f"{node.name}: read other than by one getitem per output ({user.name})")
        out[user.args[1]] = user
    return out


def _seam(ar: fx.Node, norm: fx.Node, order: dict[fx.Node, int]) -> Seam | str:
    """The seam ``ar -> norm``, or why it is left to vLLM; raises _Unexpected for an unknown shape."""
    residual_norm = _name(norm.target) == FUSED_ADD_RMS_NORM
    x, group = _arg(ar, 0, "tensor"), _arg(ar, 1, "group_name")
    if not isinstance(x, fx.Node) or not isinstance(group, str):
        raise _Unexpected(f"{ar.name}: arguments {ar.args} (needs a tensor and a group name)")
    w_at, eps_at = (2, 3) if residual_norm else (1, 2)
    weight, eps = _arg(norm, w_at, "weight"), _arg(norm, eps_at, "epsilon")
    if not _is_float(eps):
        raise _Unexpected(f"{norm.name}: epsilon {eps!r} (needs a number)")
    if _arg(norm, eps_at + 1, "variance_size") is not None:
        return f"{norm.name}: variance over part of the row (arnorm's norm reads the whole row)"
    if not isinstance(weight, fx.Node):
        return f"{norm.name}: no weight"
    xv, wv = _val(x), _val(weight)
    if xv is None or wv is None:
        raise _Unexpected(f"{norm.name}: no tensor metadata on its inputs")
    if xv.dim() != 2 or xv.dtype not in _DTYPES:
        return f"{norm.name}: input {tuple(xv.shape)} {xv.dtype} (needs [tokens, hidden] bfloat16 or float16)"
    stored = _gemma_weight(weight)
    raw = stored if stored is not None else weight
    if _val(raw) is None or _val(raw).dtype != xv.dtype:
        found = _val(raw).dtype if _val(raw) is not None else "unknown"
        return f"{norm.name}: weight dtype {found} (needs {xv.dtype}, the activations' dtype)"
    residual = _arg(norm, 1, "x_residual") if residual_norm else None
    if residual_norm and not (isinstance(residual, fx.Node) and _val(residual) is not None
                              and _val(residual).dtype == xv.dtype):  # fmt: skip
        return f"{norm.name}: residual not of the activations' dtype"
    others = [u for u in ar.users if u is not norm]
    if residual_norm and others:
        return f"{ar.name}: the reduced sum is also read without the residual ({others[0].name})"
    if residual_norm:
        items = _getitems(norm)
        if set(items) - {0, 1}:
            raise _Unexpected(f"{norm.name}: output {sorted(items)} read (needs 0 and 1)")
        normed = [items[0]] if 0 in items else []
        residual_out = [items[1]] if 1 in items else []
    else:
        normed, residual_out = [norm], []  # the all-reduce's other readers read the new residual
    seam = Seam(ar, norm, x, group, raw, float(eps), stored is not None, residual, normed, residual_out)
    _take_tail(seam, order)
    early = [u for u in seam.readers() if order[u] <= order[seam.anchor(order)]]
    if early:
        return f"{ar.name}: its result is read ({early[0].name}) before the seam's last input is ready"
    return seam


def _take_tail(seam: Seam, order: dict[fx.Node, int]) -> None:
    """Fuse the quantization that reads the normed output, where vLLM emits one arnorm knows."""
    if len(seam.normed) != 1:
        return
    out = seam.normed[0]
    tails = []
    for user in out.users:
        if _name(user.target) != "auto_functionalized" or not user.args:
            continue
        known = TAIL_BY_OP.get(_name(user.args[0]), ())
        if any(user.kwargs.get(tail.input) is out for tail in known):
            tails.append((user, known))
    if len(tails) != 1:
        return
    node, known = tails[0]
    matching = [tail for tail in known if _matches(node, tail)]
    if not matching:
        return
    tail = matching[0]
    scale = node.kwargs.get(tail.scale_in) if tail.scale_in else None
    if tail.scale_in and not isinstance(scale, fx.Node):
        return
    assert scale is None or isinstance(scale, fx.Node)
    items = _getitems(node)
    if set(items) - {tail.codes_index, tail.scale_index}:
        raise _Unexpected(f"{node.name}: output {sorted(items)} read")
    seam.tail, seam.tail_node, seam.scale = tail, node, scale
    seam.keep_normed = len(out.users) > 1


def _matches(node: fx.Node, tail: QuantTail) -> bool:
    """``node`` is ``tail``: its fixed arguments hold, and its scale buffer is the tail's layout."""
    if any(node.kwargs.get(arg) not in values for arg, values in tail.fixed):
        return False
    if tail.scale_out is None or tail.scale_like is None or not tail.name:
        return True
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    buffer, x = _val(node.kwargs.get(tail.scale_out)), _val(node.kwargs.get(tail.input))
    if buffer is None or x is None or x.dim() != 2 or buffer.dim() != 2:
        return False
    shape, dtype = tail.scale_like(x.shape[0], x.shape[1])
    with getattr(buffer, "fake_mode", None) or contextlib.nullcontext():
        want = tail.scale_view(torch.empty_strided(shape, (shape[1], 1), dtype=buffer.dtype), x.shape[0])
    same = [*zip(buffer.shape, want.shape, strict=True), *zip(buffer.stride(), want.stride(), strict=True)]
    return str(buffer.dtype) == f"torch.{dtype}" and all(statically_known_true(a == b) for a, b in same)


def plan(graph: fx.Graph) -> Plan:
    """Every seam of ``graph``: fused, left to vLLM with why, or the reason the graph is left alone."""
    result = Plan()
    order = {node: i for i, node in enumerate(graph.nodes)}
    try:
        for ar in graph.nodes:
            if _name(ar.target) != ALL_REDUCE:
                continue
            # A norm reading the all-reduce as its residual reads the new residual: not a seam.
            norms = [u for u in ar.users if _name(u.target) in _NORMS and u.args and u.args[0] is ar]
            if not norms:
                continue
            if len(norms) > 1:
                raise _Unexpected(f"{ar.name}: normalized by {len(norms)} norms")
            found = _seam(ar, norms[0], order)
            if isinstance(found, str):
                result.left.append(found)
            else:
                result.seams.append(found)
    except _Unexpected as exc:
        return Plan(unexpected=str(exc))
    return result


def _fake_outputs(seam: Seam, quant: str, normed: bool) -> tuple[Any, ...]:
    from arnorm.integrations._vllm_pass_op import _outputs_like

    xv = _val(seam.x)
    mode = getattr(xv, "fake_mode", None)
    if mode is None:
        return _outputs_like(xv, quant, normed)
    with mode:
        return _outputs_like(xv, quant, normed)


def rewrite(graph: fx.Graph, the_plan: Plan, op: Any, max_tokens: int, batch_invariant: bool) -> int:
    """Replace each planned seam by one call of ``op`` (``torch.ops.arnorm.vllm_seam``); the count."""
    moved: dict[fx.Node, fx.Node] = {}  # a replaced node -> what replaced it (a later seam may read it)
    for seam in the_plan.seams:
        seam.x = moved.get(seam.x, seam.x)
        seam.residual = moved.get(seam.residual, seam.residual) if seam.residual is not None else None
        seam.weight = moved.get(seam.weight, seam.weight)
        seam.scale = moved.get(seam.scale, seam.scale) if seam.scale is not None else None
        order = {node: i for i, node in enumerate(graph.nodes)}
        anchor = seam.anchor(order)
        quant = seam.tail.key if seam.tail else ""
        normed = seam.keep_normed or not quant
        args = (seam.x, seam.residual, seam.weight, seam.scale, seam.group_name, seam.eps, seam.gemma, quant,
                normed, max_tokens, batch_invariant)  # fmt: skip
        vals = _fake_outputs(seam, quant, normed)
        with graph.inserting_after(anchor):
            call = graph.call_function(op, args)
            call.meta["val"] = vals
        outs: list[fx.Node] = []
        for i in range(4):
            with graph.inserting_after(outs[-1] if outs else call):
                item = graph.call_function(operator.getitem, (call, i))
            item.meta["val"] = vals[i]
            outs.append(item)
        if seam.tail_node is not None and seam.tail is not None:
            items = _getitems(seam.tail_node)
            for index, new in ((seam.tail.codes_index, outs[2]), (seam.tail.scale_index, outs[3])):
                if index in items:
                    items[index].replace_all_uses_with(new)
                    graph.erase_node(items[index])
            graph.erase_node(seam.tail_node)
        for old in seam.normed:
            old.replace_all_uses_with(outs[0])
            moved[old] = outs[0]
        for old in seam.residual_out:
            old.replace_all_uses_with(outs[1])
            moved[old] = outs[1]
        if seam.residual is None:
            seam.all_reduce.replace_all_uses_with(outs[1])
            moved[seam.all_reduce] = outs[1]
        for old in [*seam.normed, *seam.residual_out]:
            if old is not seam.norm and not old.users:
                graph.erase_node(old)
        for old in (seam.norm, seam.all_reduce):
            if not old.users:
                graph.erase_node(old)
    return len(the_plan.seams)
