"""``torch.ops.arnorm.vllm_seam``: what arnorm's vLLM compile pass puts in place of a seam.

A functional custom op (it mutates nothing and returns new tensors) with a fake implementation,
and no handle: everything it needs travels as its arguments (vLLM's TP group by name, the norm's
epsilon and kind, the format, the token budget), so a graph rewritten in one process, or loaded
from Inductor's cache in another, calls the same thing. It must exist in every process before a
cached graph is loaded: the vLLM plugin defines it when it installs the pass (:func:`define`).

Its first real call with a configuration builds arnorm's op (collective: every TP rank makes the
same calls, vLLM's profile run first); nothing is built while tracing (the fake runs there) or
inside CUDA-graph capture. It runs vLLM's own unfused code (``vllm.all_reduce``, the IR norm, the
quantization op) for a token count above the op's budget or served only by the reference, and,
saying why once, when arnorm's op cannot be built (the same error on every rank, so every rank
falls back alike). Calls are counted in :func:`arnorm.integrations.vllm.served_calls` under
:data:`ENTRY`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from arnorm.integrations._vllm_pass_table import TAILS

__all__ = ["ENTRY", "OP", "define", "reset"]

#: The name compiled calls are counted under in ``served_calls()``.
ENTRY = "vllm_compile_pass"
OP = "arnorm::vllm_seam"

_lock = threading.RLock()
_defined: list[Any] = []


@dataclass
class _Built:
    op: Any  # arnorm's AllReduceNorm, or None when it could not be built
    refused: str | None = None


_built: dict[tuple[Any, ...], _Built] = {}


def reset() -> None:
    """Close and forget the ops built so far (local; the next calls build them again)."""
    with _lock:
        built = list(_built.values())
        _built.clear()
    for b in built:
        if b.op is not None:
            b.op.close()


def _empty() -> torch.Tensor:
    return torch.empty(0)


def _outputs_like(x: torch.Tensor, quant: str, normed: bool) -> tuple[torch.Tensor, ...]:
    t, h = x.shape[0], x.shape[1]
    y = torch.empty_like(x) if normed or not quant else x.new_empty(0)
    codes, scales = x.new_empty(0), x.new_empty(0, dtype=torch.float32)
    if quant:
        tail = TAILS[quant]
        shape, dtype = tail.codes_like(t, h)
        codes = x.new_empty(shape, dtype=getattr(torch, dtype))
        if tail.scale_like is not None:
            scales = tail.scale_view(_scale_storage(x, quant), t)
    return y, torch.empty_like(x), codes, scales


def _scale_storage(x: torch.Tensor, quant: str) -> torch.Tensor:
    """An empty tensor shaped as the storage of vLLM's scale buffer for ``x`` (before its view)."""
    scale_like = TAILS[quant].scale_like
    assert scale_like is not None
    shape, dtype = scale_like(x.shape[0], x.shape[1])
    return x.new_empty(shape, dtype=getattr(torch, dtype))


def _vllm_tp(group_name: str) -> Any:
    from vllm.distributed import parallel_state

    from arnorm.integrations._vllm_groups import vllm_tp

    ref = parallel_state._groups.get(group_name)
    coordinator = ref() if ref is not None else None
    if coordinator is None:
        raise LookupError(f"group_name: {group_name!r} (needs a live vLLM group of that name)")
    return vllm_tp(coordinator)


def _build(key: tuple[Any, ...], x: torch.Tensor) -> _Built:
    """arnorm's op for this configuration (collective), or why there is none (the same on every rank)."""
    from arnorm._config import Config
    from arnorm._errors import ArnormError
    from arnorm._types import RMSNorm
    from arnorm.op._op import AllReduceNorm

    group_name, _, _, _, eps, gemma, residual, quant, normed, max_tokens, invariant = key
    try:
        tp = _vllm_tp(group_name)
        norm = RMSNorm(eps=eps, weight_offset=1.0 if gemma else 0.0, round_before_weight=not gemma,
                       normalize_unrounded=residual)  # fmt: skip
        # inplace=False and the separate output layout, never output_layout="in_place": this is a
        # functional op (the graph holds vLLM's functional fused_add_rms_norm here, and Inductor's
        # reinplacing decides on buffers later), so it must not write over x or residual, and the
        # in-place layout would need two [T, H] copies to honour that, more traffic than it saves.
        op = AllReduceNorm(
            tp.group, hidden_size=x.shape[1], dtype=x.dtype, norm=norm,
            quant=TAILS[quant].format if quant else None,
            max_tokens=max_tokens, normed_output=normed or not quant, inplace=False,
            scale_layout=TAILS[quant].layout if quant else None, device=x.device,
            cpu_group=tp.cpu_group, config=Config(batch_invariant=True) if invariant else None,
            add_residual=residual,
        )  # fmt: skip
    except (ArnormError, LookupError) as exc:
        return _Built(None, f"{type(exc).__name__}: {exc}")
    return _Built(op)


def _backend(built: _Built, num_tokens: int) -> str | None:
    if built.op is None:
        return None
    try:
        name: str | None = built.op.backend_for(num_tokens)
    except Exception:  # above the budget, or nothing serves that count
        return None
    return None if name == "reference" else name


def _warn(reason: str) -> None:
    from arnorm.integrations._common import warn_once

    warn_once(f"arnorm's vLLM compile pass: seams run vLLM's unfused code: {reason}", 4, key=reason)


def _unfused(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             scale: torch.Tensor | None, group_name: str, eps: float, gemma: bool, quant: str,
             normed: bool) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """vLLM's own code for the seam, op by op, as the graph held it before the pass."""
    reduced = torch.ops.vllm.all_reduce(x, group_name)
    w = weight.float() + 1.0 if gemma else weight
    if residual is None:
        y, res = torch.ops.vllm_ir.rms_norm(reduced, w, eps), reduced
    else:
        y, res = torch.ops.vllm_ir.fused_add_rms_norm(reduced, residual, w, eps)
    _, _, codes, scales = _outputs_like(x, quant, normed)
    if quant:
        tail = TAILS[quant]
        namespace, name, overload = tail.op.split(".")
        kwargs: dict[str, Any] = {tail.input: y, tail.codes: codes}
        if tail.scale_in is not None:
            kwargs[tail.scale_in] = scale
        if tail.scale_out is not None:
            kwargs[tail.scale_out] = scales
        kwargs.update((arg, values[0]) for arg, values in tail.fixed)
        getattr(getattr(getattr(torch.ops, namespace), name), overload)(**kwargs)
    if quant and not normed:
        y = x.new_empty(0)
    return y, res.clone() if res is reduced and residual is None else res, codes, scales


def _as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """arnorm's codes or scales as vLLM's buffer holds them (same bytes, vLLM's dtype and shape)."""
    if t.dtype == like.dtype and t.shape == like.shape:
        return t
    return t.contiguous().view(torch.uint8).view(like.dtype).reshape(like.shape)


def _call(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor | None,
          group_name: str, eps: float, gemma: bool, quant: str, normed: bool, max_tokens: int,
          batch_invariant: bool) -> tuple[torch.Tensor, ...]:  # fmt: skip
    from arnorm.integrations._vllm_ops import tally

    key = (group_name, x.shape[1], x.dtype, x.device, eps, gemma, residual is not None, quant, normed,
           max_tokens, batch_invariant)  # fmt: skip
    built = _built.get(key)
    if built is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # Building is collective and cannot be captured; every rank captures the same sizes.
            _warn("op: first needed inside CUDA-graph capture (needs vLLM's profile run first)")
            tally[ENTRY, "unfused"] += 1
            return _unfused(x, residual, weight, scale, group_name, eps, gemma, quant, normed)
        with _lock:
            built = _built.get(key)
            if built is None:
                built = _built[key] = _build(key, x)
        if built.refused is not None:
            _warn(built.refused)
        elif _backend(built, 1) is None:
            needs = "a fused backend" + (" declaring batch invariance" if batch_invariant else "")
            _warn(f"op: only arnorm's reference serves this configuration (needs {needs})")
    backend = _backend(built, x.shape[0])
    if backend is None:
        tally[ENTRY, "unfused"] += 1
        return _unfused(x, residual, weight, scale, group_name, eps, gemma, quant, normed)
    tally[ENTRY, backend] += 1
    takes_scale = bool(quant) and TAILS[quant].scale_in is not None
    if takes_scale and scale is not None and scale.dim() != 1:
        scale = scale.reshape(1)
    out = built.op(x, residual, weight, scale if takes_scale else None)
    y, codes, scales = out.normed, x.new_empty(0), x.new_empty(0, dtype=torch.float32)
    if quant:
        _, _, codes_like, _ = _outputs_like(x, quant, normed)
        codes = _as(out.quant.data, codes_like)
        if TAILS[quant].scale_like is not None:
            scales = TAILS[quant].scale_view(_as(out.quant.scale, _scale_storage(x, quant)), x.shape[0])
    if y is None:
        y = x.new_empty(0)
    return y, out.residual, codes, scales


def define() -> Any:
    """Define ``torch.ops.arnorm.vllm_seam`` in this process (once); returns its default overload."""
    with _lock:
        if _defined:
            return _defined[0]

        @torch.library.custom_op(OP, mutates_args=())
        def vllm_seam(
            x: torch.Tensor,
            residual: torch.Tensor | None,
            weight: torch.Tensor,
            scale: torch.Tensor | None,
            group_name: str,
            eps: float,
            gemma: bool,
            quant: str,
            normed: bool,
            max_tokens: int,
            batch_invariant: bool,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            return _call(x, residual, weight, scale, group_name, eps, gemma, quant, normed, max_tokens,
                         batch_invariant)  # type: ignore[return-value]  # fmt: skip

        @vllm_seam.register_fake
        def _fake(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  scale: torch.Tensor | None, group_name: str, eps: float, gemma: bool, quant: str,
                  normed: bool, max_tokens: int, batch_invariant: bool,
                  ) -> tuple[torch.Tensor, ...]:  # fmt: skip
            return _outputs_like(x, quant, normed)

        _defined.append(torch.ops.arnorm.vllm_seam.default)
        return _defined[0]
