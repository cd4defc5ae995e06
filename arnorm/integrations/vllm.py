"""vLLM's fused all-reduce + Gemma RMSNorm entry points, served by arnorm.

A vLLM model file switches by changing an import; the signatures and return contracts are the
seeds' own::

    from arnorm.integrations.vllm import fused_allreduce_gemma_rms_norm

    normed, residual = fused_allreduce_gemma_rms_norm(hidden_states, residual, self.norm)

- :func:`fused_allreduce_gemma_rms_norm` always returns. It runs the best eligible arnorm backend,
  or, when only the reference would serve the call (or the call has more tokens than the
  budget), the unfused path: the TP all-reduce then ``norm(reduced, residual)``.
- :func:`fused_allreduce_gemma_rms_norm_quant` and :func:`allreduce_gemma_rms_norm_mxfp8` return
  None exactly when no fused backend serves the call, so the caller runs its own unfused path.

The TP group is vLLM's (its device group and its CPU group) when vllm is importable, unless
:func:`configure` named one; without vllm, :func:`configure` is required. Ops are built lazily,
one per (group, hidden size, dtype, device, eps, format, normed output), and shared by every
layer with that configuration. Building one is collective: every TP rank makes the same first
call, and it must happen before CUDA-graph capture (call :func:`warmup` first).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from arnorm._errors import InvalidInputError, NoEligibleBackendError
from arnorm._types import LOCAL, QuantizedActivation, RMSNorm
from arnorm.integrations._common import accepts_residual, gemma_add_norm, norm_eps
from arnorm.integrations._vllm_checks import not_gemma_reason, uncallable_reason, warn_unfused
from arnorm.integrations._vllm_groups import Tp, explicit_tp, vllm_coordinator, vllm_tp
from arnorm.integrations._vllm_keys import format_of_key
from arnorm.op._op import AllReduceNorm

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "allreduce_gemma_rms_norm_mxfp8",
    "close",
    "configure",
    "fused_allreduce_gemma_rms_norm",
    "fused_allreduce_gemma_rms_norm_quant",
    "op_for",
    "warmup",
]

#: Token budget of the ops when neither configure() nor vLLM's scheduler says otherwise.
DEFAULT_MAX_TOKENS = 8192


@dataclass
class _Settings:
    group: Any = None  # None: vLLM's
    cpu_group: Any = None
    max_tokens: int | None = None
    backend: str | Sequence[str] | None = None
    explicit: Tp | None = None
    from_vllm: Tp | None = None


@dataclass
class _Entry:
    op: AllReduceNorm | None  # None: the op refused this configuration, for ``refused``
    served: dict[int, bool] = field(default_factory=dict)
    refused: str | None = None

    def serves(self, num_tokens: int) -> bool:
        """A backend other than the reference serves ``num_tokens`` (cached per count)."""
        known = self.served.get(num_tokens)
        if known is None:
            if self.op is None:
                return False
            try:
                known = self.op.backend_for(num_tokens) != "reference"
            except (InvalidInputError, NoEligibleBackendError):  # above the budget, or nothing serves it
                known = False
            self.served[num_tokens] = known
        return known


_settings = _Settings()
_ops: dict[tuple[Any, ...], _Entry] = {}
_lock = threading.RLock()


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
        _settings.group, _settings.cpu_group = group, cpu_group
        _settings.max_tokens, _settings.backend = max_tokens, backend
        _settings.explicit = None if group is None else explicit_tp(group, cpu_group)
        _settings.from_vllm = None


def close() -> None:
    """Close every op built so far (local; the next call builds them again, collectively)."""
    with _lock:
        entries = list(_ops.values())
        _ops.clear()
    for entry in entries:
        if entry.op is not None:
            entry.op.close()


def _tp() -> Tp:
    if _settings.explicit is not None:
        return _settings.explicit
    coordinator = vllm_coordinator()
    cached = _settings.from_vllm
    if cached is not None and cached.source is coordinator:
        return cached
    with _lock:
        close()  # ops of an earlier vLLM group
        _settings.from_vllm = vllm_tp(coordinator)
    return _settings.from_vllm


def _entry(
    tp: Tp,
    hidden_states: torch.Tensor,
    eps: float,
    quant: str | None,
    layout: str | None,
    normed_output: bool,
) -> _Entry:
    key = (id(tp), hidden_states.shape[1], hidden_states.dtype, hidden_states.device, eps, quant, layout,
           normed_output)  # fmt: skip
    entry = _ops.get(key)
    if entry is not None:
        return entry
    with _lock:
        entry = _ops.get(key)
        if entry is None:
            try:
                op = AllReduceNorm(
                    tp.group,
                    hidden_size=hidden_states.shape[1],
                    dtype=hidden_states.dtype,
                    norm=RMSNorm(eps, 1.0),
                    quant=quant,
                    max_tokens=_settings.max_tokens or DEFAULT_MAX_TOKENS,
                    backend=_settings.backend,
                    normed_output=normed_output,
                    scale_layout=layout,
                    device=hidden_states.device,
                    cpu_group=tp.cpu_group,
                )
            except InvalidInputError as exc:
                # A configuration no op takes (a hidden size the format cannot split): raised on
                # every rank alike, so every rank takes the unfused path; kept, so not rebuilt.
                entry = _ops[key] = _Entry(None, refused=str(exc))
            else:
                entry = _ops[key] = _Entry(op)
    return entry


def op_for(
    hidden_size: int,
    dtype: torch.dtype,
    eps: float,
    *,
    key: Any = None,
    return_normed: bool = True,
    device: torch.device | str | None = None,
) -> AllReduceNorm | None:
    """The op calls with this configuration run on (built now if needed: collective); None for a key
    arnorm has no format for. Its ``explain()`` says which backend serves which token count."""
    quant = None if key is None else format_of_key(key)
    if key is not None and quant is None:
        return None
    dev = torch.device(device) if device is not None else _default_device()
    probe = torch.empty(0, hidden_size, dtype=dtype, device=dev)
    layout = "swizzled_128x4" if quant == "nvfp4" else None
    entry = _entry(_tp(), probe, float(eps), quant, layout, return_normed or quant is None)
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
) -> None:
    """Build, now, the op that calls with this configuration will use (collective: every TP rank).

    Call it before CUDA-graph capture for every configuration the model uses: ``key=None`` for
    :func:`fused_allreduce_gemma_rms_norm`, the quant key for the other two
    (``return_normed=False`` for :func:`allreduce_gemma_rms_norm_mxfp8` without the normed output).
    """
    op_for(hidden_size, dtype, eps, key=key, return_normed=return_normed, device=device)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _weight_and_eps(norm: Any) -> tuple[torch.Tensor, float]:
    """The norm's weight and epsilon; a norm without them, or a plain (non-Gemma) norm, is refused."""
    weight, eps = getattr(norm, "weight", None), norm_eps(norm)
    if not isinstance(weight, torch.Tensor) or eps is None:
        raise InvalidInputError(
            f"norm: {type(norm).__name__} (needs a module with a weight and variance_epsilon or eps)"
        )
    reason = not_gemma_reason(norm)
    if reason is not None:
        raise InvalidInputError(reason)
    return weight, eps


def fused_allreduce_gemma_rms_norm(
    hidden_states: torch.Tensor, residual: torch.Tensor, norm: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``hidden_states`` over TP, add ``residual``, Gemma-RMSNorm: ``(normed, residual)``.

    ``norm`` is any module with a ``weight`` (the raw Gemma weight: ``1 + weight`` multiplies)
    and ``variance_epsilon`` or ``eps``. On the fused path the new residual is written into
    ``hidden_states``' buffer and returned (on the unfused path that buffer may hold the reduced
    sum afterwards); ``residual`` is not modified. When no backend but the
    reference serves the call, or it has more tokens than the budget, this runs the unfused path:
    the all-reduce, then ``norm(reduced, residual)`` (vLLM's norms), or the same arithmetic in
    torch for a norm that takes one argument (bitwise arnorm's contract).
    """
    weight, eps = _weight_and_eps(norm)
    tp = _tp()
    reason = uncallable_reason(hidden_states, residual, weight)
    if reason is None:
        entry = _entry(tp, hidden_states, eps, None, None, True)
        op = entry.op
        if op is not None and entry.serves(hidden_states.shape[0]):
            out = op(hidden_states, residual, weight)
            return out.normed, out.residual  # type: ignore[return-value]
        reason = entry.refused
    if reason is not None:
        warn_unfused("fused_allreduce_gemma_rms_norm", reason)
    reduced = tp.all_reduce(hidden_states)
    if accepts_residual(norm):
        normed, new_residual = norm(reduced, residual)
        # vLLM's fp16 Gemma norm hands back an fp32 residual; the fused path and the next call's
        # arguments keep the caller's dtype, so the stream does not change dtype (and stop fusing).
        if isinstance(residual, torch.Tensor) and new_residual.dtype != residual.dtype:
            new_residual = new_residual.to(residual.dtype)
        return normed, new_residual
    return gemma_add_norm(reduced, residual, weight, eps)


def fused_allreduce_gemma_rms_norm_quant(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    key: Any,
) -> tuple[QuantizedActivation, torch.Tensor, torch.Tensor] | None:
    """All-reduce + residual add + Gemma RMSNorm + quantization: ``(quantized, normed, residual)``, or None.

    ``key``: a vLLM ``QuantKey`` (static per-tensor fp8, dynamic per-token fp8, nvfp4, mxfp8) or an
    arnorm format name. ``scale``: the fp32 dequant scale for static fp8, the global encode scale
    (``448 * 6 / amax``) for nvfp4, ignored for the dynamic formats. ``quantized`` is an
    :class:`arnorm.QuantizedActivation` (``data, scale, ...``; nvfp4 block scales 128x4-swizzled,
    mxfp8 E8M0 scales row-major). Returns None, touching nothing, exactly when no fused backend
    serves the call: only the reference would, the call has more tokens than the budget, or arnorm
    has no format for ``key``; the caller then runs its own unfused path.
    """
    quant = format_of_key(key)
    if quant is None or not isinstance(weight, torch.Tensor):
        return None
    out = _quantized_call(
        hidden_states,
        residual,
        weight,
        float(eps),
        scale,
        quant,
        True,
        "fused_allreduce_gemma_rms_norm_quant",
    )
    if out is None:
        return None
    return out.quant, out.normed, out.residual


def allreduce_gemma_rms_norm_mxfp8(
    hidden_states: torch.Tensor, residual: torch.Tensor, norm: Any, return_normed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """All-reduce + add + Gemma RMSNorm + MXFP8: ``(x_q, x_scale, normed | None, residual)``, or None.

    ``x_q`` is float8_e4m3fn ``[T, H]``, ``x_scale`` the E8M0 exponents (uint8 ``[T, H/32]``,
    row-major). ``normed`` is returned only with ``return_normed=True``. None exactly when no fused
    backend serves the call (see :func:`fused_allreduce_gemma_rms_norm_quant`).
    """
    weight, eps = _weight_and_eps(norm)
    out = _quantized_call(
        hidden_states,
        residual,
        weight,
        eps,
        None,
        "mxfp8",
        bool(return_normed),
        "allreduce_gemma_rms_norm_mxfp8",
    )
    if out is None:
        return None
    q = out.quant
    return q.data, q.scale, out.normed, out.residual


def _quantized_call(
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    quant: str,
    normed_output: bool,
    entry_point: str,
) -> Any:
    reason = uncallable_reason(hidden_states, residual, weight)
    if reason is not None:
        warn_unfused(entry_point, reason, 4)
        return None
    layout = "swizzled_128x4" if quant == "nvfp4" else None
    entry = _entry(_tp(), hidden_states, eps, quant, layout, normed_output)
    op = entry.op
    if op is None:
        warn_unfused(entry_point, str(entry.refused), 4)
        return None
    if not entry.serves(hidden_states.shape[0]):
        return None
    if quant in ("fp8_static", "nvfp4"):
        if isinstance(scale, torch.Tensor) and scale.dim() == 0:
            scale = scale.reshape(1)  # vLLM keeps some per-tensor scales 0-d
    else:
        scale = None
    return op(hidden_states, residual, weight, scale)
