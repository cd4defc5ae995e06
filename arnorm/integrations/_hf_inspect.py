"""Recognising a Hugging Face decoder ``fuse()`` can rewire, before anything is changed.

Every check appends a reason in the grammar ``"<aspect>: <found> (needs <required>)"``; a model
with any reason is refused whole. What is recognised:

- the decoder stack: the one module with ``layers`` (a ModuleList) and a final ``norm``;
- each layer's class: pre-norm (Llama, Mistral, Qwen2, Qwen3, Gemma) or sandwich (Gemma2,
  Gemma3, whose extra norms follow the attention and the MLP before the residual add);
- each norm's class, hence its weight offset and rounding order, then checked bit for bit
  against arnorm's formula on a few rows, so a transformers release that changes a norm is
  refused rather than silently served with the wrong rounding;
- the row-parallel linears (``self_attn.o_proj``, ``mlp.down_proj``): plain ``nn.Linear``
  without bias, sharded on the input dimension by transformers' tensor parallelism (weights are
  DTensors placed ``Shard(1)``) over one process group, or unsharded for ``arnorm.LOCAL``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from arnorm._reference import add_rmsnorm
from arnorm._types import RMSNorm
from arnorm.integrations._common import norm_eps

__all__ = ["LayerPlan", "ModelPlan", "inspect_model"]

#: Decoder layer classes whose forward is attention -> add -> norm -> MLP -> add.
PRE_NORM = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
            "GemmaDecoderLayer")  # fmt: skip
#: Decoder layer classes with a norm after the attention and after the MLP, before each add.
SANDWICH = ("Gemma2DecoderLayer", "Gemma3DecoderLayer")
#: Norm class -> (weight_offset, round_before_weight): Llama's family rounds x * rsqrt to the
#: dtype before the weight multiply; Gemma's adds 1 to the weight and rounds once.
NORMS = {
    "LlamaRMSNorm": (0.0, True),
    "MistralRMSNorm": (0.0, True),
    "Qwen2RMSNorm": (0.0, True),
    "Qwen3RMSNorm": (0.0, True),
    "GemmaRMSNorm": (1.0, False),
    "Gemma2RMSNorm": (1.0, False),
    "Gemma3RMSNorm": (1.0, False),
}
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
_LOAD_TP = (
    "a model loaded with transformers' tensor parallelism, from_pretrained(..., "
    "distributed_config=DistributedConfig(tp_plan='auto'))"
)


@dataclass
class LayerPlan:
    """One decoder layer: its kind and its norms (attribute name -> (module, arnorm.RMSNorm))."""

    index: int
    prefix: str
    module: Any
    kind: str  # "pre_norm" or "sandwich"
    norms: dict[str, tuple[Any, RMSNorm]] = field(default_factory=dict)
    row_parallel: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelPlan:
    """What fuse() will rewire; ``reasons`` non-empty means it must refuse."""

    reasons: list[str] = field(default_factory=list)
    stack_prefix: str = ""
    stack: Any = None
    layers: list[LayerPlan] = field(default_factory=list)
    final_norm: tuple[Any, RMSNorm] | None = None
    hidden_size: int = 0
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    tp_group: Any = None  # the process group the row-parallel weights are sharded over, or None
    tp_ranks: tuple[int, ...] = ()


def _find_stack(model: Any, plan: ModelPlan) -> None:
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)
        and isinstance(getattr(m, "norm", None), torch.nn.Module)
    ]
    if len(found) != 1:
        names = ", ".join(n or "<model>" for n, _ in found) or "none"
        plan.reasons.append(
            f"model: {len(found)} decoder stacks ({names}) (needs exactly one module with .layers and .norm)"
        )
        return
    plan.stack_prefix, plan.stack = found[0]


def _name(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def _check_norm(module: Any, where: str, plan: ModelPlan) -> tuple[Any, RMSNorm] | None:
    """The arnorm norm a model's norm module computes, checked on a few rows; None (with a reason) if not."""
    cls = type(module).__name__
    if cls not in NORMS:
        plan.reasons.append(f"{where}: {cls} (needs one of {', '.join(NORMS)})")
        return None
    weight, eps = getattr(module, "weight", None), norm_eps(module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None or eps <= 0:
        plan.reasons.append(f"{where}: no 1-D weight and positive eps (needs a 1-D weight and a positive "
                            "variance_epsilon or eps)")  # fmt: skip
        return None
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        plan.reasons.append(f"{where}.weight: {type(weight).__name__} (needs a replicated, plain tensor)")
        return None
    if plan.dtype is None:
        plan.dtype, plan.device, plan.hidden_size = weight.dtype, weight.device, weight.shape[0]
    elif (weight.dtype, weight.device, weight.shape[0]) != (plan.dtype, plan.device, plan.hidden_size):
        plan.reasons.append(
            f"{where}.weight: {weight.dtype} [{weight.shape[0]}] on {weight.device} (needs "
            f"{plan.dtype} [{plan.hidden_size}] on {plan.device}, as the other norms)"
        )
        return None
    offset, round_first = NORMS[cls]
    norm = RMSNorm(eps, offset, round_first)
    try:
        same = _same_as_arnorm(module, weight, norm)
    except Exception as exc:  # a module that fails on a few rows: refuse on every rank, do not hang them
        plan.reasons.append(f"{where}: {cls} raised {type(exc).__name__} on test rows (needs a working norm)")
        return None
    if not same:
        plan.reasons.append(
            f"{where}: {cls} output differs from arnorm.RMSNorm(eps={eps:g}, weight_offset={offset:g}, "
            f"round_before_weight={round_first}) (needs a norm arnorm reproduces bit for bit)"
        )
        return None
    return module, norm


def _same_as_arnorm(module: Any, weight: torch.Tensor, norm: RMSNorm) -> bool:
    """The module's own output on a few seeded rows equals arnorm's formula bit for bit. Its forward
    alone: a user's forward hooks never see these rows (a hooked norm's site runs the model's own
    path, hooks included, at every call: :mod:`arnorm.integrations._hf_layers`)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, weight.shape[0], generator=g) * 3).to(weight.dtype).to(weight.device)
    with torch.no_grad():
        theirs = module.forward(x)
        _, ours = add_rmsnorm(x, None, weight, norm.eps, norm.weight_offset, norm.round_before_weight)
    return isinstance(theirs, torch.Tensor) and theirs.dtype == ours.dtype and torch.equal(theirs, ours)


def _check_row_parallel(linear: Any, where: str, plan: ModelPlan, local: bool) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    if type(linear) is not torch.nn.Linear:
        plan.reasons.append(f"{where}: {type(linear).__name__} (needs torch.nn.Linear)")
        return False
    if linear.bias is not None:
        plan.reasons.append(f"{where}: a bias (needs bias=False: a row-parallel bias is added after the sum)")
        return False
    weight = linear.weight
    if not isinstance(weight, DTensor):
        if not local:
            plan.reasons.append(f"{where}: not sharded (needs {_LOAD_TP}, or tp_group=arnorm.LOCAL)")
            return False
        return True
    if linear._forward_hooks or linear._forward_pre_hooks:
        plan.reasons.append(
            f"{where}: a forward hook (needs none at TP: fuse() makes its output this rank's partial sum, "
            "which the hook would see in place of the reduced output; remove it, or hook the norm after it)"
        )
        return False
    if local:
        size = weight.device_mesh.size()
        plan.reasons.append(
            f"tp_group: arnorm.LOCAL for {where} sharded over {size} ranks (needs the model's TP group)"
        )
        return False
    placements = tuple(weight.placements)
    if len(placements) != 1 or not (isinstance(placements[0], Shard) and placements[0].dim in (1, -1)):
        plan.reasons.append(f"{where}.weight: placements {placements} (needs (Shard(dim=1),), rowwise)")
        return False
    mesh = weight.device_mesh
    group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    if plan.tp_group is None:
        plan.tp_group, plan.tp_ranks = group, ranks
    elif ranks != plan.tp_ranks:
        plan.reasons.append(f"{where}: sharded over ranks {list(ranks)} (needs {list(plan.tp_ranks)})")
        return False
    return True


def _layer(index: int, prefix: str, layer: Any, plan: ModelPlan, local: bool) -> None:
    cls = type(layer).__name__
    norms: tuple[str, ...]
    if cls in PRE_NORM:
        kind, norms = "pre_norm", ("input_layernorm", "post_attention_layernorm")
    elif cls in SANDWICH:
        kind = "sandwich"
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")  # fmt: skip
    else:
        plan.reasons.append(f"{prefix}: {cls} (needs one of {', '.join(PRE_NORM + SANDWICH)})")
        return
    lp = LayerPlan(index, prefix, layer, kind)
    for attr in norms:
        module = getattr(layer, attr, None)
        if not isinstance(module, torch.nn.Module):
            plan.reasons.append(f"{_name(prefix, attr)}: missing (needs the {cls} layout)")
            continue
        checked = _check_norm(module, _name(prefix, attr), plan)
        if checked is not None:
            lp.norms[attr] = checked
    for path in ROW_PARALLEL:
        owner, _, attr = path.partition(".")
        linear = getattr(getattr(layer, owner, None), attr, None)
        if linear is None:
            plan.reasons.append(f"{_name(prefix, path)}: missing (needs the {cls} layout)")
        elif _check_row_parallel(linear, _name(prefix, path), plan, local):
            lp.row_parallel[path] = linear
    plan.layers.append(lp)


def inspect_model(model: Any, local: bool) -> ModelPlan:
    """Everything fuse() needs to know about ``model``; ``local``: the caller passed arnorm.LOCAL."""
    plan = ModelPlan()
    if not isinstance(model, torch.nn.Module):
        plan.reasons.append(f"model: {type(model).__name__} (needs a Hugging Face torch.nn.Module)")
        return plan
    if getattr(model, "_arnorm_fused", False):
        plan.reasons.append("model: already fused by arnorm (needs handle.close() first)")
        return plan
    if model.training:
        plan.reasons.append("model: in training mode (needs model.eval(): the fused path is inference only)")
    _find_stack(model, plan)
    if plan.stack is None:
        return plan
    stack = plan.stack
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    layers = list(stack.layers)
    if isinstance(count, int) and count != len(layers):
        plan.reasons.append(
            f"config.num_hidden_layers: {count} (needs {len(layers)}, the layers of {plan.stack_prefix})"
        )
    if not layers:
        plan.reasons.append(f"{_name(plan.stack_prefix, 'layers')}: empty (needs decoder layers)")
    for i, layer in enumerate(layers):
        _layer(i, _name(plan.stack_prefix, f"layers.{i}"), layer, plan, local)
    plan.final_norm = _check_norm(stack.norm, _name(plan.stack_prefix, "norm"), plan)
    kinds = {lp.kind for lp in plan.layers}
    if len(kinds) > 1:
        plan.reasons.append(f"model: mixed layer kinds {sorted(kinds)} (needs one kind)")
    return plan
