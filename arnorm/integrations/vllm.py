"""vLLM's fused all-reduce + (Gemma) RMSNorm entry points, served by arnorm.

A vLLM model file switches by changing an import; the signatures and return contracts are the
seeds' and vLLM 0.33's own::

    from arnorm.integrations.vllm import fused_allreduce_gemma_rms_norm

    normed, residual = fused_allreduce_gemma_rms_norm(hidden_states, residual, self.norm)

- :func:`fused_allreduce_gemma_rms_norm` and :func:`fused_allreduce_rms_norm` (vLLM's plain
  ``RMSNorm``) always return. They run the best eligible arnorm backend, or, when only the
  reference would serve the call (or the call has more tokens than the budget), the unfused path:
  the TP all-reduce then ``norm(reduced, residual)``. The fused path computes the arithmetic of the
  norm module it is handed (probed once, :mod:`arnorm.integrations._vllm_norms`), so the result does
  not depend on which path ran, up to the order in which a GPU kernel sums the statistic's squares.
- :func:`fused_allreduce_gemma_rms_norm_quant` returns vLLM's own ``QuantizedActivation``, or None
  exactly when no fused backend serves the call, so the caller runs its own unfused path.
- :func:`allreduce_gemma_rms_norm_mxfp8` returns a result wherever arnorm can compute one (fused, or
  the all-reduce then arnorm's norm + mxfp8), None only where no path takes the inputs.

The TP group is vLLM's (its device group and its CPU group) when vllm is importable, unless
:func:`configure` named one; without vllm, :func:`configure` is required. Ops are built lazily,
one per (group, hidden size, dtype, device, norm arithmetic, format, normed output), and shared by every
layer with that configuration. Building one is collective: every TP rank makes the same first
call, and it must happen before CUDA-graph capture (call :func:`warmup` first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from arnorm._errors import InvalidInputError
from arnorm._reference import add_rmsnorm
from arnorm._types import LOCAL
from arnorm.integrations import _vllm_ops
from arnorm.integrations._common import accepts_residual, norm_eps
from arnorm.integrations._vllm_checks import (
    not_gemma_reason,
    not_plain_reason,
    uncallable_reason,
    unfusable_norm_reason,
    warn_unfused,
)
from arnorm.integrations._vllm_groups import explicit_tp
from arnorm.integrations._vllm_keys import format_of_key
from arnorm.integrations._vllm_norms import VLLM_033_GEMMA, Arithmetic, arithmetic_of
from arnorm.integrations._vllm_ops import DEFAULT_MAX_TOKENS, settings
from arnorm.integrations._vllm_ops import entry as entry_for
from arnorm.integrations._vllm_ops import local_tp as _local_tp
from arnorm.integrations._vllm_ops import lock as _lock
from arnorm.integrations._vllm_ops import ops as _ops  # noqa: F401  (the ops built so far, for tests)
from arnorm.integrations._vllm_ops import tally as _tally
from arnorm.integrations._vllm_ops import tp as _tp
from arnorm.integrations._vllm_types import block_scales, scale_layout_for, to_vllm
from arnorm.integrations._vllm_weights import fused_weight
from arnorm.op._op import AllReduceNorm

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "allreduce_gemma_rms_norm_mxfp8",
    "close",
    "compile_pass_reports",
    "configure",
    "fused_allreduce_gemma_rms_norm",
    "fused_allreduce_gemma_rms_norm_quant",
    "fused_allreduce_rms_norm",
    "op_for",
    "served_calls",
    "warmup",
]


def configure(
    *,
    group: Any = None,
    cpu_group: Any = None,
    max_tokens: int | None = None,
    backend: str | Sequence[str] | None = None,
) -> None:
    """Say which TP group the entry points run on, and the ops' token budget.

    Args:
        group: the TP ``ProcessGroup`` or :data:`arnorm.LOCAL` (TP 1). ``None``: vLLM's TP group
            (its device group and CPU group), looked up at each call.
        cpu_group: a gloo group over the same ranks, when ``group`` is an NCCL group smaller than WORLD.
        max_tokens: the most tokens a call may pass to a fused backend; larger calls take the
            unfused path (or return None). Default: :data:`DEFAULT_MAX_TOKENS`.
        backend: an arnorm backend name or ordered list (strict), or None for auto.

    Closes the ops built so far (local: no collective), so the next call builds new ones.
    """
    import torch.distributed as dist

    if (
        group is not None
        and group is not LOCAL
        and not (dist.is_available() and isinstance(group, dist.ProcessGroup))
    ):
        raise InvalidInputError(
            f"group: {type(group).__name__} (needs a torch.distributed ProcessGroup, arnorm.LOCAL, "
            "or None for vLLM's TP group)"
        )
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise InvalidInputError(f"max_tokens: {max_tokens!r} (needs a positive int or None)")
    with _lock:
        close()
        settings.group, settings.cpu_group = group, cpu_group
        settings.max_tokens, settings.backend = max_tokens, backend
        settings.explicit = None if group is None else explicit_tp(group, cpu_group)
        settings.from_vllm = None


close = _vllm_ops.close


def served_calls(reset: bool = False) -> dict[str, dict[str, int]]:
    """What served the entry points' calls in this process so far: ``{entry point: {path: calls}}``,
    the path being the fused backend's name or ``"unfused"`` (vLLM's own arithmetic: the all-reduce
    and the norm module, or arnorm's reference arithmetic for the mxfp8 entry point; ``None``
    returns of the quant entry point count here too). ``reset``: start counting afresh."""
    out: dict[str, dict[str, int]] = {}
    for (entry_point, path), n in sorted(_tally.items()):
        out.setdefault(entry_point, {})[path] = n
    if reset:
        _tally.clear()
    return out


def compile_pass_reports(reset: bool = False) -> list[dict[str, Any]]:
    """What arnorm's compile pass did to each graph it rewrote in this process (the last 64),
    oldest first: ``{"fused": [seam kinds], "left": [why each seam left to vLLM was left],
    "unexpected": why the graph was left alone, or None, "remaining": seams still unfused}``.
    Empty where no pass ran here (a cache hit runs none: the cached graph is already rewritten).
    ``reset``: start afresh."""
    import sys

    module = sys.modules.get("arnorm.integrations._vllm_pass")  # loaded only where a pass exists
    return module.reports(reset) if module is not None else []


def _offset_of(norm: Any) -> float:
    return 1.0 if not_gemma_reason(norm) is None else 0.0


def op_for(
    hidden_size: int,
    dtype: torch.dtype,
    eps: float,
    *,
    key: Any = None,
    return_normed: bool = True,
    device: torch.device | str | None = None,
    norm: Any = None,
) -> AllReduceNorm | None:
    """The op calls with this configuration run on (built now if needed: collective); None for a key
    arnorm has no format for. Its ``explain()`` says which backend serves which token count.

    ``norm``: the norm module the calls hand over (its arithmetic is probed, and a plain norm means
    :func:`fused_allreduce_rms_norm`); None: vLLM 0.33's ``GemmaRMSNorm`` arithmetic, the one the
    quant entry point uses without ``norm=``. ``key="mxfp8"`` and a vLLM mxfp8 key build the op
    with the scale layout each returns (row-major, 128x4-swizzled)."""
    quant = None if key is None else format_of_key(key)
    if key is not None and quant is None:
        return None
    dev = torch.device(device) if device is not None else _default_device()
    probe = torch.empty(0, hidden_size, dtype=dtype, device=dev)
    layout = scale_layout_for(key, quant) if quant is not None else None
    rmsnorm = _arithmetic(norm, float(eps), dtype, dev).rmsnorm(float(eps))
    entry = entry_for(_tp(), probe, rmsnorm, quant, layout, return_normed or quant is None)
    if entry.op is None:
        raise InvalidInputError(str(entry.refused))
    return entry.op


def warmup(
    hidden_size: int,
    dtype: torch.dtype,
    eps: float,
    *,
    key: Any = None,
    return_normed: bool = True,
    device: torch.device | str | None = None,
    norm: Any = None,
) -> None:
    """Build, now, the op that calls with this configuration will use (collective: every TP rank).

    Call it before CUDA-graph capture for every configuration the model uses, with ``norm=`` the
    norm module the calls hand over (its arithmetic is probed now, not during capture): ``key=None``
    for :func:`fused_allreduce_gemma_rms_norm` and :func:`fused_allreduce_rms_norm`, the quant key
    for the other two (``key=kMxfp8Dynamic, return_normed=False`` for
    :func:`allreduce_gemma_rms_norm_mxfp8` without the normed output).
    """
    op_for(hidden_size, dtype, eps, key=key, return_normed=return_normed, device=device, norm=norm)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _arithmetic(norm: Any, eps: float, dtype: torch.dtype, device: torch.device) -> Arithmetic:
    if norm is None:
        return VLLM_033_GEMMA
    return arithmetic_of(norm, eps, _offset_of(norm), dtype, device, 5)


def _weight_and_eps(norm: Any, gemma: bool) -> tuple[torch.Tensor, float]:
    """The norm's weight and epsilon; a norm without them, or of the other kind, is refused."""
    weight, eps = getattr(norm, "weight", None), norm_eps(norm)
    if not isinstance(weight, torch.Tensor) or eps is None:
        raise InvalidInputError(
            f"norm: {type(norm).__name__} (needs a module with a weight and variance_epsilon or eps)"
        )
    reason = not_gemma_reason(norm) if gemma else not_plain_reason(norm)
    if reason is not None:
        raise InvalidInputError(reason)
    return weight, eps


def fused_allreduce_gemma_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, norm: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``hidden_states`` over TP, add ``residual``, Gemma-RMSNorm: ``(normed, residual)``.

    ``norm`` is any module with a ``weight`` (the raw Gemma weight: ``1 + weight`` multiplies)
    and ``variance_epsilon`` or ``eps``. The fused path computes the module's own arithmetic (vLLM
    0.33's ``GemmaRMSNorm`` normalizes the unrounded fp32 sum; probed once per class). The fused
    path writes over its inputs: at TP 1 as vLLM's own ``fused_add_rms_norm`` does (the normed
    output over ``hidden_states``, the new residual over ``residual``, both returned); at TP > 1
    the new residual over ``hidden_states`` (returned), ``residual`` left as it was. On the unfused
    path ``hidden_states`` may hold the reduced sum afterwards. Pass neither buffer expecting it
    unchanged, as with vLLM's norms. When no
    backend but the reference serves the call, or it has more tokens than the budget, this runs the
    unfused path: the all-reduce, then ``norm(reduced, residual)`` (vLLM's norms), or the same
    arithmetic in torch for a norm that takes one argument.
    """
    weight, eps = _weight_and_eps(norm, gemma=True)
    return _norm_call("fused_allreduce_gemma_rms_norm", hidden_states, residual, norm, weight, eps, 1.0)


def fused_allreduce_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, norm: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.33's ``vllm.models.common.ops.fused_allreduce_rms_norm``, for its plain ``RMSNorm``.

    All-reduce ``hidden_states`` (this rank's partial, from a row-parallel linear with
    ``reduce_results=False``) over TP, add ``residual``, RMSNorm (``weight`` multiplies): returns
    ``(normed, new_residual)``, equivalent to ``norm(all_reduce(hidden_states), residual)``, with
    the module's own arithmetic. A Gemma norm is refused (use
    :func:`fused_allreduce_gemma_rms_norm`); the other contracts are those of
    :func:`fused_allreduce_gemma_rms_norm`.
    """
    weight, eps = _weight_and_eps(norm, gemma=False)
    return _norm_call("fused_allreduce_rms_norm", hidden_states, residual, norm, weight, eps, 0.0)


def _norm_call(
    entry_point: str,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    norm: Any,
    weight: torch.Tensor,
    eps: float,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    tp = _tp()
    op_weight, reason = fused_weight(weight, hidden_states)
    reason = reason or uncallable_reason(hidden_states, residual, op_weight) or unfusable_norm_reason(norm)
    if reason is None:
        arith = arithmetic_of(norm, eps, offset, hidden_states.dtype, hidden_states.device)
        # vLLM's layout (two tensors touched, not three) where every backend that would serve the
        # call writes it: at TP 1, triton. At TP > 1 triton_symm (and aiter) write the separate
        # layout only: asking for the other would trade them for NCCL and a kernel wherever
        # flashinfer (which writes both) is absent or above its budget.
        layout = "in_place" if tp.world_size == 1 else "separate"
        entry = entry_for(tp, hidden_states, arith.rmsnorm(eps), None, None, True, layout)
        op = entry.op
        backend = entry.backend(hidden_states.shape[0]) if op is not None else None
        if op is not None and backend is not None:
            out = op(hidden_states, residual, op_weight)
            _tally[entry_point, backend] += 1
            return out.normed, out.residual  # type: ignore[return-value]
        reason = entry.refused
    if reason is not None:
        warn_unfused(entry_point, reason, 4)
    _tally[entry_point, "unfused"] += 1
    reduced = tp.all_reduce(hidden_states)
    if accepts_residual(norm):
        normed, new_residual = norm(reduced, residual)
        # A norm that hands back another residual dtype (vLLM <= 0.2x's fp16 GemmaRMSNorm returned
        # the fp32 sum) would change the stream's dtype, and every later call would run unfused.
        if isinstance(residual, torch.Tensor) and new_residual.dtype != residual.dtype:
            new_residual = new_residual.to(residual.dtype)
        return normed, new_residual
    arith = arithmetic_of(norm, eps, offset, hidden_states.dtype, hidden_states.device)
    h, y = add_rmsnorm(reduced, residual, weight, eps, offset, arith.round_before_weight,
                       arith.normalize_unrounded)  # fmt: skip
    return y, h


def fused_allreduce_gemma_rms_norm_quant(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    key: Any,
    *,
    norm: Any = None,
) -> tuple[Any, torch.Tensor, torch.Tensor] | None:
    """All-reduce + residual add + Gemma RMSNorm + quantization: ``(quantized, normed, residual)``, or None.

    ``key``: a vLLM ``QuantKey`` (``kFp8StaticTensorSym``, ``kFp8DynamicTokenSym``, ``kNvfp4Dynamic``,
    ``kMxfp8Dynamic``) or an arnorm format name. ``scale``: the fp32 dequant scale for static fp8,
    the global encode scale (``448 * 6 / amax``) for nvfp4, ignored for the dynamic formats.
    ``quantized`` is vLLM's own ``QuantizedActivation(data, scale, orig_dtype, orig_shape,
    quant_key)`` (a stand-in with those fields when vllm is not importable): ``quant_key`` the
    caller's key (vLLM's key for a format name), ``orig_dtype``/``orig_shape`` those of
    ``hidden_states``, ``scale`` the caller's static scale for fp8_static, fp32 ``[T, 1]`` for
    fp8_per_token, the 128x4-swizzled e4m3 block scales for nvfp4, the E8M0 scales for mxfp8
    (128x4-swizzled and flat for a vLLM key, row-major ``[T, H/32]`` for ``"mxfp8"``).
    ``norm``: the norm module whose arithmetic to follow; None: vLLM 0.33's ``GemmaRMSNorm``'s.
    Returns None, touching nothing, exactly when no fused backend serves the call: only the
    reference would, the call has more tokens than the budget, or arnorm has no format for
    ``key``; the caller then runs its own unfused path.
    """
    quant = format_of_key(key)
    if quant is None or not isinstance(weight, torch.Tensor):
        return None
    out = _quantized_call(hidden_states, residual, weight, float(eps), scale, quant,
                          scale_layout_for(key, quant), True, norm,
                          "fused_allreduce_gemma_rms_norm_quant")  # fmt: skip
    if out is None:
        return None
    return to_vllm(out.quant, key, quant, hidden_states, scale), out.normed, out.residual


def allreduce_gemma_rms_norm_mxfp8(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    norm: Any,
    return_normed: bool = False,
    *,
    scale_layout: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """All-reduce + add + Gemma RMSNorm + MXFP8: ``(x_q, x_scale, normed | None, residual)``, or None.

    ``x_q`` is float8_e4m3fn ``[T, H]``; ``x_scale`` the uint8 E8M0 exponents in the layout the
    consumer reads: ``"linear"`` (default: the seed's documented return, what its AMD caller reads):
    row-major ``[T, H/32]``; or, on request, ``"swizzled_128x4"`` (vLLM's FlashInfer mxfp8 linears,
    ``kMxfp8Dynamic``): flat ``[ceil(T/128)*128 * ceil(H/128)*4]`` as vLLM's ``mxfp8_e4m3_quantize``
    returns it. ``normed`` only with ``return_normed=True``. Computed
    wherever arnorm can: fused when a backend serves the call, otherwise the TP all-reduce then
    arnorm's norm + mxfp8 (a single-process op, or the reference arithmetic), TP 1 included. None
    only where no path takes the inputs (see :func:`fused_allreduce_gemma_rms_norm_quant`'s
    warning); then nothing was touched.
    """
    if scale_layout not in ("linear", "swizzled_128x4"):
        raise InvalidInputError(f"scale_layout: {scale_layout!r} (needs 'linear' or 'swizzled_128x4')")
    weight, eps = _weight_and_eps(norm, gemma=True)
    out = _quantized_call(hidden_states, residual, weight, eps, None, "mxfp8", scale_layout,
                          bool(return_normed), norm, "allreduce_gemma_rms_norm_mxfp8",
                          compute_unfused=True)  # fmt: skip
    if out is None:
        return None
    q = out.quant
    return q.data, block_scales(q, "mxfp8"), out.normed, out.residual


def _quantized_call(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    quant: str,
    layout: str | None,
    normed_output: bool,
    norm: Any,
    entry_point: str,
    compute_unfused: bool = False,
) -> Any:
    op_weight, reason = fused_weight(weight, hidden_states)
    reason = reason or uncallable_reason(hidden_states, residual, op_weight)
    if reason is None and norm is not None:
        reason = unfusable_norm_reason(norm)
    if reason is not None:
        warn_unfused(entry_point, reason, 5)
        _tally[entry_point, "unfused"] += 1
        return None
    weight = op_weight
    rmsnorm = _arithmetic(norm, eps, hidden_states.dtype, hidden_states.device).rmsnorm(eps)
    tp = _tp()
    entry = entry_for(tp, hidden_states, rmsnorm, quant, layout, normed_output)
    op = entry.op
    if op is None:
        warn_unfused(entry_point, str(entry.refused), 5)
        _tally[entry_point, "unfused"] += 1
        return None
    if quant in ("fp8_static", "nvfp4"):
        if isinstance(scale, torch.Tensor) and scale.dim() == 0:
            scale = scale.reshape(1)  # vLLM keeps some per-tensor scales 0-d
    else:
        scale = None
    backend = entry.backend(hidden_states.shape[0])
    if backend is not None:
        _tally[entry_point, backend] += 1
        return op(hidden_states, residual, weight, scale)
    _tally[entry_point, "unfused"] += 1
    if not compute_unfused:
        return None
    # The all-reduce, then arnorm's norm + quant on this rank: a single-process op where a backend
    # serves it (triton on a GPU), else the reference arithmetic (above any op's budget, on a CPU).
    reduced = tp.all_reduce(hidden_states)
    if tp.world_size > 1:
        local = entry_for(_local_tp(), reduced, rmsnorm, quant, layout, normed_output)
        if local.op is not None and local.serves(reduced.shape[0]):
            return local.op(reduced, residual, weight, scale)
    from arnorm._reference import quantize_output
    from arnorm._types import Output

    h, y = add_rmsnorm(reduced, residual, weight, eps, rmsnorm.weight_offset, rmsnorm.round_before_weight,
                       rmsnorm.normalize_unrounded)  # fmt: skip
    q = quantize_output(y, quant, scale, layout)
    return Output(y if normed_output else None, h, q)
