"""``fuse()``: one arnorm call for every all-reduce + residual add + norm of a Hugging Face decoder.

::

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from arnorm.integrations.transformers import fuse

    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.bfloat16)
    handle = fuse(model, torch.distributed.group.WORLD, max_tokens=8192)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32)
    handle.close()  # the model is as it was

Supported: Llama, Mistral, Qwen2, Qwen3 (pre-norm layers) and Gemma, Gemma2, Gemma3 (Gemma2/3's
sandwich norms included), loaded with transformers' own tensor parallelism, or unsharded with
``arnorm.LOCAL`` (residual add + norm fused, no all-reduce). Anything else is refused before any
change, every reason listed. Inference only: a backward pass through the fused model raises
:class:`arnorm.InferenceOnlyError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from arnorm._config import DEFAULT_PEER_TIMEOUT, Config
from arnorm._errors import InvalidInputError, SelectionError
from arnorm._types import LOCAL, RMSNorm
from arnorm.comm._comm import Comm
from arnorm.integrations._hf_inspect import LayerPlan, ModelPlan, inspect_model
from arnorm.integrations._hf_layers import (
    Carry,
    Reducing,
    Step,
    final_norm_forward,
    layer_forward,
    reducer,
    row_parallel_forward,
)
from arnorm.op._op import AllReduceNorm

__all__ = ["FusedModel", "fuse"]


class FusedModel:
    """What :func:`fuse` returns: the rewired model, its ops, and :meth:`close` to undo it all.

    One op serves every site with the same norm (and, for Gemma2/3, one more for the local add +
    norm after each sandwich norm); ``backends(T)`` says which backend serves which site.
    """

    def __init__(self, model: Any, plan: ModelPlan, max_tokens: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self._plan = plan
        self._ops: list[AllReduceNorm] = []
        self._sites: list[tuple[int, str, str, Step]] = []  # (layer, role, name, step)
        self._patched: list[tuple[Any, bool, Any]] = []
        self._closed = False

    @property
    def ops(self) -> tuple[AllReduceNorm, ...]:
        """The distinct ops the sites share."""
        return tuple(self._ops)

    @property
    def closed(self) -> bool:
        return self._closed

    def backends(self, num_tokens: int) -> dict[str, str]:
        """``site -> backend`` for a forward of ``num_tokens`` tokens (``"unfused"`` where none serves it).

        Sites are named by what they reduce: ``<layer>.self_attn.o_proj`` and ``<layer>.mlp.down_proj``
        (each with the norm that follows it); Gemma2/3 add ``<layer>.pre_feedforward_layernorm`` and
        ``<layer>.mlp_residual``, the local residual add + norm after each sandwich norm.
        """
        return {name: step.backend_for(num_tokens) for _, _, name, step in self._sites}

    def layer_backends(self, num_tokens: int) -> list[dict[str, str]]:
        """Per layer, ``role -> backend`` (roles ``attention``, ``mlp``; Gemma2/3 also ``pre_feedforward``
        and ``mlp_residual``)."""
        rows: list[dict[str, str]] = [{} for _ in self._plan.layers]
        for layer, role, _, step in self._sites:
            rows[layer][role] = step.backend_for(num_tokens)
        return rows

    def explain(self, num_tokens: int | None = None) -> str:
        """Each op's explanation, headed by the sites it serves (above ``max_tokens``: every site unfused)."""
        if num_tokens is not None and num_tokens > self.max_tokens:
            if self._ops and all(op.problem.batch_invariant for op in self._ops):
                how = f"every site runs its op in chunks of {self.max_tokens} (batch invariant)"
            else:
                how = "every site runs unfused"
            head = f"{num_tokens} tokens: above max_tokens={self.max_tokens}, {how}"
            return f"{head}\n\n{self.explain()}"
        parts = []
        for op in self._ops:
            names = [name for _, _, name, step in self._sites if step.op is op]
            more = ", ..." if len(names) > 3 else ""
            head = f"{op!r} serves {len(names)} site(s): {', '.join(names[:3])}{more}"
            parts.append(f"{head}\n{op.explain(num_tokens)}")
        return "\n\n".join(parts)

    def close(self) -> None:
        """Restore the model's own forwards and free the ops. Idempotent and local (no collective)."""
        if self._closed:
            return
        self._closed = True
        for module, had, forward in reversed(self._patched):
            if had:
                module.forward = forward
            else:
                del module.forward
        self._patched.clear()
        self.model.__dict__.pop("_arnorm_fused", None)
        for op in self._ops:
            op.close()

    def __enter__(self) -> FusedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._sites)} sites, {len(self._ops)} op(s)"
        return f"FusedModel({type(self.model).__name__}, {state})"

    # -- building -------------------------------------------------------------------------------

    def _patch(self, module: Any, forward: Any) -> None:
        self._patched.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
        module.forward = _Installed(forward)


#: Why a fused model cannot be copied or saved as it is (the end of the "needs" of both errors).
_NOT_COPYABLE = (
    ": a fused model's layers run through forwards that hold the original model's modules and "
    "arnorm's ops, so a copy would run the original's layers, and a saved one could not be loaded)"
)


class _Installed:
    """A forward fuse() installs: calls through; refuses ``copy.deepcopy`` and pickling
    (``torch.save(model)``) with an error naming them, instead of a copy that silently runs the
    original model's layers, or a pickle ``AttributeError``."""

    __slots__ = ("__signature__", "__wrapped__", "fn")

    def __init__(self, fn: Any) -> None:
        import inspect

        self.fn = self.__wrapped__ = fn
        self.__signature__ = inspect.signature(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: Any) -> Any:
        raise InvalidInputError(
            "copy.deepcopy: a model fused by arnorm.integrations.transformers.fuse() (needs "
            "handle.close() first, then fuse() again" + _NOT_COPYABLE
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InvalidInputError(
            "torch.save / pickle: a model fused by arnorm.integrations.transformers.fuse() (needs "
            "handle.close() first, then fuse() again" + _NOT_COPYABLE
        )


def _refuse(reasons: Sequence[str]) -> InvalidInputError:
    listed = "\n".join(f"  - {r}" for r in reasons)
    exc = InvalidInputError(
        f"fuse: the model was left unchanged; {len(reasons)} reason(s) (needs each resolved):\n{listed}"
    )
    exc.reasons = tuple(reasons)  # type: ignore[attr-defined]
    return exc


def _agreed(comm: Comm | None, reasons: list[str], config: Config | None) -> list[str]:
    """Every rank's reasons, so all ranks refuse together (one refusing alone would hang the others).

    Through the store, each wait bounded by ``peer_timeout``: a rank calling fuse() alone gets
    :class:`arnorm.PeerError` then, not the process group's timeout, and a peer that calls it
    later learns that this rank gave up (and when). Ranks are named as the user knows them."""
    if comm is None:
        return reasons
    from arnorm.comm._rendezvous import Channel, default_store, ranks_text

    store = default_store()
    if store is None:
        seen = comm.gather_objects(reasons)
        ranks = None
    else:
        from arnorm._errors import PeerError

        try:
            timeout = (config if isinstance(config, Config) else Config()).peer_timeout
        except Exception:  # a malformed ARNORM_* value: the ops' agreement reports it on every rank
            timeout = DEFAULT_PEER_TIMEOUT
        ranks = comm.ranks
        channel = Channel(store, ranks, comm.rank, timeout, namespace="arnorm-fuse")
        channel.phase = "calling"
        try:
            seen = channel.gather(reasons)
            channel.done()
        except PeerError as exc:
            channel.abandon(f"peers: {channel.who([comm.rank])} gave up on fuse() ({exc})")
            raise PeerError(
                f"fuse: {exc} (needs every rank of tp_group to call fuse() with the same model and "
                "arguments; the model was left unchanged)"
            ) from None
    merged: list[str] = []
    for rank, mine in enumerate(seen):
        for r in mine:
            text = r if all(r in other for other in seen) else f"{ranks_text([rank], ranks)}: {r}"
            if text not in merged:
                merged.append(text)
    return merged


def fuse(
    model: Any,
    tp_group: Any,
    *,
    max_tokens: int,
    quant: str | None = None,
    backend: str | Sequence[str] | None = None,
    cpu_group: Any = None,
    config: Config | None = None,
) -> FusedModel:
    """Rewire a tensor-parallel Hugging Face decoder: each all-reduce + residual add + norm becomes one call.

    Collective: every rank of ``tp_group`` calls it with the same arguments.

    Args:
        model: a Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2 or Gemma3 causal LM (or its base
            model), in eval mode, loaded with transformers' tensor parallelism (row-parallel
            weights sharded ``Shard(1)``), or unsharded when ``tp_group`` is :data:`arnorm.LOCAL`.
        tp_group: the ranks the model is sharded over (e.g. ``torch.distributed.group.WORLD``), or
            :data:`arnorm.LOCAL` for a single process.
        max_tokens: the most tokens (batch x sequence) one forward passes to the ops; a forward
            with more runs the model's unfused path for every site instead of raising.
        quant: must be None: the model's linear layers read the normed activation in its dtype.
        backend: an arnorm backend name or ordered list (strict), or None for auto. Gemma2/3's
            local add + norm sites of a TP model fall back to auto when it cannot serve one process.
        cpu_group: a gloo group over the TP ranks, when ``tp_group`` is an NCCL group smaller than WORLD.
        config: :class:`arnorm.Config` for every op (default: the ``ARNORM_*`` environment). With
            ``batch_invariant=True`` a forward above ``max_tokens`` runs each site's op in chunks of
            ``max_tokens`` rows instead of the unfused path, so a row's outputs at every site are the
            same bits whatever the size of the forward (docs/numerics.md, section 10).

    Returns:
        A :class:`FusedModel`; its ``close()`` restores the model.

    Raises:
        InvalidInputError: the model (or an argument) is not supported; ``.reasons`` lists why,
            each as ``"<aspect>: <found> (needs <required>)"``. Nothing was changed.
        SelectionError: no backend can serve the model's norms (from :class:`arnorm.AllReduceNorm`).
    """
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidInputError(f"max_tokens: {max_tokens!r} (needs a positive int)")
    local = tp_group is LOCAL
    plan = inspect_model(model, local)
    reasons = list(plan.reasons)
    if quant is not None:
        reasons.append(
            f"quant: {quant!r} (needs None: the model's linear layers read the normed activation "
            "in the model's dtype)"
        )
    comm = None
    if not local:
        import torch.distributed as dist

        comm = Comm.resolve(tp_group, plan.device or torch.device("cpu"), cpu_group)
        ranks = tuple(dist.get_process_group_ranks(tp_group)) if comm.group is not None else ()
        if plan.tp_group is not None and ranks != plan.tp_ranks:
            needs = f"needs {list(plan.tp_ranks)}, the ranks the model is sharded over"
            reasons.append(f"tp_group: ranks {list(ranks)} ({needs})")
        if comm.group is None:
            comm = None
    reasons = _agreed(comm, reasons, config)
    if reasons:
        raise _refuse(reasons)
    handle = FusedModel(model, plan, max_tokens)
    try:
        _build(handle, plan, tp_group, local, max_tokens, backend, cpu_group, config)
    except BaseException:
        handle.close()
        raise
    model._arnorm_fused = True
    return handle


def _build(
    handle: FusedModel,
    plan: ModelPlan,
    tp_group: Any,
    local: bool,
    max_tokens: int,
    backend: Any,
    cpu_group: Any,
    config: Config | None = None,
) -> None:
    """Build the ops (collective, in layer order on every rank), then install the forwards."""
    ops: dict[tuple[bool, RMSNorm, bool], AllReduceNorm] = {}
    hidden, dtype, device = plan.hidden_size, plan.dtype, plan.device
    ar = None if local else reducer(plan.tp_group)

    def op(reduces: bool, norm: RMSNorm, add_residual: bool = True) -> AllReduceNorm:
        key = (reduces and not local, norm, add_residual)
        if key not in ops:

            def build(choice: Any) -> AllReduceNorm:
                return AllReduceNorm(
                    tp_group if key[0] else LOCAL,
                    hidden_size=hidden,
                    dtype=dtype,  # type: ignore[arg-type]
                    norm=norm,
                    max_tokens=max_tokens,
                    backend=choice,
                    device=device,
                    cpu_group=cpu_group if key[0] else None,
                    add_residual=add_residual,
                    config=config,
                )

            if key[0] or local or backend is None:
                ops[key] = build(backend)
            else:
                # A Gemma2/3 local add + norm of a TP model: the named backend when it serves one
                # process (it may be an all-reduce kernel that needs 2+ ranks), else auto. Local ops
                # involve no other rank, and every rank has the same backends, so all choose alike.
                try:
                    ops[key] = build(backend)
                except SelectionError:
                    ops[key] = build(None)
            handle._ops.append(ops[key])
        return ops[key]

    final_module, final_norm = plan.final_norm  # type: ignore[misc]
    final_original = final_module.forward
    layers = plan.layers

    def following(i: int) -> tuple[Any, RMSNorm, Any, Any, str]:
        """The norm after layer ``i``'s MLP: its module, arnorm norm, forward, and where it lives."""
        if i + 1 < len(layers):
            module, norm = layers[i + 1].norms["input_layernorm"]
            return module, norm, module.forward, layers[i + 1].module, "input_layernorm"
        return final_module, final_norm, final_original, plan.stack, "norm"

    carry = Carry()
    for lp in layers:
        steps = _layer_steps(lp, following(lp.index), op, ar, local)
        for role, name in _site_names(lp).items():
            handle._sites.append((lp.index, role, name, steps[role]))
        reducing = None if local or ar is None else Reducing(ar)
        if reducing is not None:
            for linear in lp.row_parallel.values():
                handle._patch(linear, row_parallel_forward(linear, reducing))
        handle._patch(lp.module, layer_forward(lp.module, lp.kind, carry, steps, reducing, lp.row_parallel))
    handle._patch(final_module, final_norm_forward(final_module, final_original, carry))


def _site_names(lp: LayerPlan) -> dict[str, str]:
    names = {"attention": f"{lp.prefix}.self_attn.o_proj", "mlp": f"{lp.prefix}.mlp.down_proj"}
    if lp.kind == "sandwich":
        names["pre_feedforward"] = f"{lp.prefix}.pre_feedforward_layernorm"
        names["mlp_residual"] = f"{lp.prefix}.mlp_residual"
    return names


def _layer_steps(
    lp: LayerPlan, nxt: tuple[Any, RMSNorm, Any, Any, str], op: Any, ar: Any, local: bool
) -> dict[str, Step]:
    next_module, next_norm, next_forward, next_owner, next_attr = nxt
    layer = lp.module
    if lp.kind == "pre_norm":
        post, post_norm = lp.norms["post_attention_layernorm"]
        return {
            "attention": Step(op(True, post_norm), post, post.forward, ar, layer, "post_attention_layernorm"),
            "mlp": Step(
                op(True, next_norm), next_module, next_forward, ar, next_owner, next_attr, direct=False
            ),
        }
    steps = {}
    for role, attr in (("attention", "post_attention_layernorm"), ("mlp", "post_feedforward_layernorm")):
        module, norm = lp.norms[attr]
        if local:  # no all-reduce and no residual: the model's own norm is all there is to run
            steps[role] = Step(None, module, module.forward, None, layer, attr)
        else:
            # A norm right after the all-reduce, with no residual: the op reads none.
            steps[role] = Step(op(True, norm, add_residual=False), module, module.forward, ar, layer, attr)
    pre, pre_norm = lp.norms["pre_feedforward_layernorm"]
    steps["pre_feedforward"] = Step(
        op(False, pre_norm), pre, pre.forward, None, layer, "pre_feedforward_layernorm"
    )
    steps["mlp_residual"] = Step(op(False, next_norm), next_module, next_forward, None, next_owner, next_attr,
                                 direct=False)  # fmt: skip
    return steps
